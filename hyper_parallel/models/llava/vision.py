"""LLaVA's image path for :mod:`hyper_parallel.distributed.context_parallel.vision`.

The tower is ``model.vision_tower`` (CLIP-style, learned absolute position embeddings for one image
size) followed by ``model.multi_modal_projector``; transformers' ``get_image_features`` takes the hidden
states of ``config.vision_feature_layer`` (one layer, or several concatenated along the features) and,
with ``vision_feature_select_strategy == "default"``, drops the CLS token. An image is one
``pixel_values`` row ``[3, H, W]`` and must be ``vision_config.image_size`` square (one size per model:
the position embeddings are not interpolated); it encodes to ``(image_size / patch_size)^2`` tokens
(``+ 1``, the CLS token, with ``"full"``), placeholders ``image_token_id``. ``media["image"] =
(pixel_values [N, 3, H, W], grid [N, 2])``, ``grid`` the images' ``(H, W)``; both are checked against that
size on every rank before any exchange. Images only (the class has no video).
"""
from __future__ import annotations

import torch

from ...distributed.context_parallel.vision import MediaKind, VisionTower, register_vision_tower


def _encode(model, pixel_values, grid) -> list:
    return [torch.cat(list(model.model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output))]


def _wrap(tensors: list):
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=[tensors[0]])


def tokens_per_image(cfg) -> int:
    """Tokens one image encodes to: the patch grid, plus the CLS token unless the strategy drops it."""
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    strategy = cfg.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"llava: vision_feature_select_strategy {strategy!r} is not carried under CP "
                         "(carried: 'default', 'full')")
    return side * side + (strategy == "full")


def _check(cfg, pixel_values: torch.Tensor, grid: torch.Tensor) -> None:
    size = cfg.vision_config.image_size
    sizes = {tuple(g) for g in torch.as_tensor(grid).reshape(-1, 2).tolist()} | {tuple(pixel_values.shape[-2:])}
    if sizes != {(size, size)}:
        raise ValueError(f"llava: images of (H, W) {sorted(sizes)} given (grid and pixel_values), but the tower "
                         f"model.vision_tower takes {size} x {size} images only (its position embeddings are for "
                         f"one size, not interpolated): resize the images to {size} x {size}")
    tokens_per_image(cfg)


TOWER = VisionTower(prefix="model.vision_tower",
                    kinds={"image": MediaKind(lambda cfg: cfg.image_token_id, _encode,
                                              lambda cfg: [cfg.text_config.hidden_size], _wrap, _check)},
                    tokens=lambda cfg, grid: torch.full((len(grid),), tokens_per_image(cfg), dtype=torch.long),
                    rows=lambda grid: torch.ones(len(grid), dtype=torch.long))
register_vision_tower("llava", TOWER)
