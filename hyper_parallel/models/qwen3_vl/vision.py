"""Qwen3-VL's media path for :mod:`hyper_parallel.distributed.context_parallel.vision`: Qwen2-VL's layout
(``model.visual``, merged patches, ``image_token_id`` / ``video_token_id``) plus the deepstack
features: the tower's ``get_*_features`` also return one ``[tokens, H]`` feature per
``deepstack_visual_indexes`` entry, which the language model adds to the hidden states of the media
tokens in its first layers (``visual_pos_masks``). Each is exchanged with its token, so every rank
holds its shard's. Images and videos: a video's frames are laid out one by one with timestamp text
between them (``<t1> <vision_start> frame 1 <vision_end> <t2> ...``), so its placeholders are not
contiguous; the exchange places each token by its ordinal among the kind's placeholders (the order
``masked_scatter`` fills them, frame-major as the tower emits them), which that does not change, and
the whole video is still encoded by one rank (its frames attend within the video as at CP=1)."""
from __future__ import annotations

import torch

from ...distributed.context_parallel.vision import MediaKind, VisionTower, register_vision_tower
from ..qwen2_vl.inputs import QWEN_VL_INPUTS


def _encoder(which: str):
    def encode(model, pixel_values, grid_thw) -> list:
        out = getattr(model.model, which)(pixel_values, grid_thw, return_dict=True)
        return [torch.cat(out.pooler_output)] + [torch.cat(level) for level in out.deepstack_features]
    return encode


def _wrap(tensors: list):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    return BaseModelOutputWithDeepstackFeatures(pooler_output=[tensors[0]], deepstack_features=[[t] for t in tensors[1:]])


def _widths(cfg) -> list:
    return [cfg.text_config.hidden_size] * (1 + len(cfg.vision_config.deepstack_visual_indexes))


TOWER = VisionTower(prefix="model.visual",
                    kinds={"image": MediaKind(lambda cfg: cfg.image_token_id, _encoder("get_image_features"), _widths, _wrap),
                           "video": MediaKind(lambda cfg: cfg.video_token_id, _encoder("get_video_features"), _widths, _wrap)},
                    tokens=lambda cfg, grid: grid.prod(-1) // cfg.vision_config.spatial_merge_size ** 2,
                    rows=lambda grid: grid.prod(-1), inputs=QWEN_VL_INPUTS)
register_vision_tower("qwen3_vl", TOWER)
