"""Qwen3.5-MoE (transformers ``qwen3_5_moe``, ``Qwen3_5MoeForConditionalGeneration``): the same media
path as Qwen3.5 (:mod:`..qwen3_5.vision`); importing the package registers it."""
from ...distributed.context_parallel.vision import register_vision_tower
from ..qwen2_vl.vision import qwen_vl_tower

register_vision_tower("qwen3_5_moe", qwen_vl_tower(inputs=False))   # the media source: not yet (its packed hybrid rows)
