"""Raw media -> model inputs for the Qwen2-VL layout (Qwen2-VL, Qwen2.5-VL, Qwen3-VL images), the
:class:`~hyper_parallel.distributed.context_parallel.vision.MediaInputs` the trainer's media source reads
(docs/vlm.md, "The trainer").

* Images: transformers' own Qwen2-VL image processor (its PIL backend, no torchvision), built from the
  model config's ``patch_size`` / ``spatial_merge_size`` / ``temporal_patch_size``, each image resized to
  a multiple of ``patch_size * spatial_merge_size`` with at most ``max_pixels`` pixels.
* Videos (a list of frames; Qwen2-VL and Qwen2.5-VL, whose video is one run of placeholders): every frame
  through the same processor with one temporal patch, then the frames grouped ``temporal_patch_size`` at
  a time (the last frame repeated to fill a group) in the video processor's layout: rows
  ``(t, h / m, w / m, m, m)``, each ``(C, temporal, patch, patch)``. Qwen3-VL / Qwen3.5 videos (timestamp
  text between the frames) are refused by field.
* The normalisation is the Qwen2-VL processor's defaults (transformers' own; a checkpoint's
  ``preprocessor_config.json`` is not read yet).
* A medium of ``n`` tokens is ``vision_start, n x image/video token, vision_end`` in the text; positions
  are the model's own ``get_rope_index`` on the sample alone.
"""
from __future__ import annotations

import torch

from ...distributed.context_parallel.vision import MediaInputs


def _processor(cfg, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vc = cfg.vision_config
    factor = vc.patch_size * vc.spatial_merge_size
    return Qwen2VLImageProcessorPil(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                    temporal_patch_size=vc.temporal_patch_size, min_pixels=factor * factor,
                                    max_pixels=max(int(max_pixels), factor * factor))


def _video(proc, cfg, frames: list) -> tuple:
    """One video's ``([rows, C * T * P * P], [t, h, w])`` from its frames (module doc)."""
    sizes = {f.size for f in frames}
    if len(sizes) != 1:
        raise ValueError(f"the frames of a video have different sizes {sorted(sizes)}: give them one size")
    vc = cfg.vision_config
    tp, p = vc.temporal_patch_size, vc.patch_size
    out = proc(images=list(frames), temporal_patch_size=1, return_tensors="pt")
    grid = out["image_grid_thw"][0]
    n = int(grid[1] * grid[2])
    per_frame = out["pixel_values"].view(len(frames), n, -1, p * p)          # [F, rows, C, P*P]
    pad = (-len(frames)) % tp
    if pad:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, -1, -1, -1)])
    t = per_frame.shape[0] // tp
    grouped = per_frame.view(t, tp, n, per_frame.shape[2], p * p).permute(0, 2, 3, 1, 4)   # [t, rows, C, tp, P*P]
    return grouped.reshape(t * n, -1), torch.tensor([t, int(grid[1]), int(grid[2])])


def _preprocess(cfg, kind: str, items: list, max_pixels: int) -> tuple:
    proc = _processor(cfg, max_pixels)
    if kind == "video" and cfg.model_type not in VIDEO_LAYOUT:
        from ...distributed.errors import CPConfigError

        raise CPConfigError("data.files", f"{cfg.model_type} lays a video out frame by frame with timestamp text "
                            "between the frames, which this source does not write yet",
                            fix=f"give images only (videos: {sorted(VIDEO_LAYOUT)}), or use the library API "
                                "(media_embeddings_for_cp) with the model's own processor")
    if kind == "image":
        out = proc(images=list(items), return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()
    pieces = [_video(proc, cfg, frames) for frames in items]
    return torch.cat([v for v, _ in pieces]).float(), torch.stack([g for _, g in pieces]).long()


#: the model types whose video is one contiguous run of placeholders (Qwen3-VL and Qwen3.5 put timestamps
#: between the frames)
VIDEO_LAYOUT = ("qwen2_vl", "qwen2_5_vl")


def _placeholders(cfg, kind: str, tokens: int) -> list:
    pad = cfg.image_token_id if kind == "image" else cfg.video_token_id
    return [cfg.vision_start_token_id] + [pad] * int(tokens) + [cfg.vision_end_token_id]


def _positions(model, input_ids: torch.Tensor, grids: dict) -> torch.Tensor:
    cfg = model.config
    if not grids:     # a text-only sample: the text positions on all three axes
        return torch.arange(input_ids.shape[1])[None, None].expand(3, 1, -1).clone()
    mtt = (input_ids == cfg.image_token_id).int() + 2 * (input_ids == cfg.video_token_id).int()
    pos, _ = model.model.get_rope_index(input_ids, mtt, image_grid_thw=grids.get("image"),
                                        video_grid_thw=grids.get("video"))
    return pos


QWEN_VL_INPUTS = MediaInputs(preprocess=_preprocess, placeholders=_placeholders, positions=_positions)
