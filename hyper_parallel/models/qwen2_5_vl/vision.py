"""Qwen2.5-VL's image path for :mod:`hyper_parallel.distributed.context_parallel.vision`: Qwen2-VL's
layout (:func:`..qwen2_vl.vision.qwen_vl_tower`; its tower's windowed attention stays inside each image)."""
from __future__ import annotations

from ...distributed.context_parallel.vision import register_vision_tower
from ..qwen2_vl.vision import qwen_vl_tower

register_vision_tower("qwen2_5_vl", qwen_vl_tower())
