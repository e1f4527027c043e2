"""The Gemma 3 media path for :mod:`hyper_parallel.distributed.context_parallel.vision`.

The tower is ``model.vision_tower`` (SigLIP) followed by ``model.multi_modal_projector`` (average pool
to ``mm_tokens_per_image`` tokens, RMS norm, projection); one image is one ``pixel_values`` row
``[3, image_size, image_size]`` and encodes to exactly ``config.mm_tokens_per_image`` tokens
(``image_token_id`` placeholders). The model's own ``get_image_features`` encodes a list of them.
There is no grid: :func:`image_media` builds the ``(pixel_values, grid)`` pair the generic path takes,
with one placeholder row per image.

The language model attends bidirectionally inside each image when transformers is given
``token_type_ids`` (its ``create_masks_for_vision_model``: full layers causal OR same image, sliding
layers window AND (causal OR same image)). Under CP that visibility travels as block ids of the global
rows: :func:`image_block_ids` -> ``shard_batch_for_cp(..., block_ids=...)`` -> ``CPBatchMeta.key_block``
-> the engine's ``q_block`` / ``k_block`` (docs/attention_engine.md).
"""
from __future__ import annotations

import torch

from ...distributed.context_parallel.vision import MediaKind, VisionTower, register_vision_tower


def image_block_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """Block id per token of the GLOBAL rows ``input_ids [B, S]``: the index of its image's run of
    placeholders in its row, ``-1`` for text (transformers' ``get_block_sequence_ids_for_mask`` on the
    model's ``token_type_ids``, which are 1 exactly on the image placeholders)."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask((input_ids == config.image_token_id).long())


def image_media(pixel_values: torch.Tensor) -> tuple:
    """``(pixel_values [N, 3, H, W], grid [N, 1])``: the ``media["image"]`` entry of
    ``media_embeddings_for_cp`` for N images (the grid only counts them: one row each)."""
    return pixel_values, torch.ones(pixel_values.shape[0], 1, dtype=torch.long)


def _images(model, pixel_values, grid) -> list:
    feats = model.model.get_image_features(pixel_values, return_dict=True).pooler_output      # [n, T, H]
    return [feats.flatten(0, 1)]


def _wrap(tensors: list):
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=tensors[0][None])                    # [1, n_local, H]


TOWER = VisionTower(prefix="model.vision_tower",
                    kinds={"image": MediaKind(lambda cfg: cfg.image_token_id, _images,
                                              lambda cfg: [cfg.text_config.hidden_size], _wrap)},
                    tokens=lambda cfg, grid: [int(cfg.mm_tokens_per_image)] * len(grid),
                    rows=lambda grid: [1] * len(grid), block_input="token_type_ids")

register_vision_tower("gemma3", TOWER)
