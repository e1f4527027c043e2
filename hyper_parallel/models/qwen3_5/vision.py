"""Qwen3.5's media path for :mod:`hyper_parallel.distributed.context_parallel.vision`: the Qwen2-VL
layout (:func:`..qwen2_vl.vision.qwen_vl_tower`: ``model.visual``, merged patches, ``image_token_id`` /
``video_token_id``; no deepstack features, unlike Qwen3-VL). A video's frames are laid out one by one
with timestamp text between them, so its placeholders are not contiguous; the exchange places tokens by
their ordinal among the kind's placeholders (``masked_scatter``'s order), which that does not change,
and the whole video is still encoded by one rank. Registered for ``qwen3_5_moe`` too (the same
``Qwen3_5MoeModel`` media code, ``models/qwen3_5_moe``)."""
from __future__ import annotations

from ...distributed.context_parallel.vision import register_vision_tower
from ..qwen2_vl.vision import qwen_vl_tower

register_vision_tower("qwen3_5", qwen_vl_tower(inputs=False))   # the media source: not yet (its packed hybrid rows)
