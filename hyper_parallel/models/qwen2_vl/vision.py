"""The Qwen2-VL media path for :mod:`hyper_parallel.distributed.context_parallel.vision` (Qwen2.5-VL's is
the same, :func:`qwen_vl_tower`): the tower at ``model.visual``; an image or video of grid ``(t, h, w)``
patches is ``t h w`` rows of ``pixel_values`` and encodes to ``t h w / spatial_merge_size^2`` tokens
(``image_token_id`` / ``video_token_id`` placeholders); the model's own ``get_image_features`` /
``get_video_features`` encode a list of them."""
from __future__ import annotations

import torch

from ...distributed.context_parallel.vision import MediaKind, VisionTower, register_vision_tower
from .inputs import QWEN_VL_INPUTS


def _images(model, pixel_values, grid_thw) -> list:
    return [torch.cat(model.model.get_image_features(pixel_values, grid_thw, return_dict=True).pooler_output)]


def _videos(model, pixel_values, grid_thw) -> list:
    return [torch.cat(model.model.get_video_features(pixel_values, grid_thw, return_dict=True).pooler_output)]


def _wrap(tensors: list):
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=[tensors[0]])


def _widths(cfg) -> list:
    return [cfg.text_config.hidden_size]


def qwen_vl_tower(inputs: bool = True) -> VisionTower:
    """The media path of the Qwen2-VL layout (``model.visual``, ``get_image_features`` /
    ``get_video_features``, merged patches; raw media through :mod:`.inputs` unless ``inputs`` is false:
    then the trainer's media source refuses the family)."""
    return VisionTower(prefix="model.visual",
                       kinds={"image": MediaKind(lambda cfg: cfg.image_token_id, _images, _widths, _wrap),
                              "video": MediaKind(lambda cfg: cfg.video_token_id, _videos, _widths, _wrap)},
                       tokens=lambda cfg, grid: grid.prod(-1) // cfg.vision_config.spatial_merge_size ** 2,
                       rows=lambda grid: grid.prod(-1), inputs=QWEN_VL_INPUTS if inputs else None)


register_vision_tower("qwen2_vl", qwen_vl_tower())
