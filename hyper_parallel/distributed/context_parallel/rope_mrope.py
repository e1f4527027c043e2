"""Multimodal 3-D RoPE positions (mrope: Qwen2/2.5/3-VL, Qwen3.5) carried exactly through CP.

Batch side (called by ``shard_batch_for_cp``): ``position_ids`` may be 3-D, transformers' two
layouts for these models (``Qwen3_5TextModel.forward``):

* ``[3, B|1, S]`` — the temporal/height/width ids that ``get_rope_index`` builds. transformers then
  passes *no* 1-D position ids to the mask: causality is by sequence order and no document is
  derived from positions. CP does the same: the 1-D positions of the batch (meta ``position_ids``,
  what the engine and the documents see) are the ones CP derives without ``position_ids``
  (``arange``, or restarting per ``seq_lens`` slot), and restarts of the 3-D rows (a vision span
  holds one temporal id) never cut documents.
* ``[4, B|1, S]`` — row 0 the 1-D text positions, rows 1: the 3-D ids. Row 0 is what transformers
  gives the mask (packed documents from its restarts), so CP treats row 0 exactly as 2-D
  ``position_ids`` (documents, RoPE-free semantics) and rows 1: as the 3-D ids.

The 3 rope rows are padded to the policy multiple (CP pad tokens continue each row; the rotary
path replaces them by the row's last real id), kept global in ``meta.mrope_position_ids``
(``[3, B|1, S_pad]``, global order) and sliced with ``meta.q_index`` (every policy: contiguous,
Head-Tail, balanced permutation) into the local ``position_ids`` (``[3|4, B|1, S_local]``, the
layout the user gave).

Rotary side (:func:`mrope_cp_call`, from ``rope._cp_call``): the module runs once on the global
``[3, B|1, S_pad]`` ids (its length ``1 + max`` over every row, as at CP=1) after checking that the
positions the model passed are this rank's slice; this rank's tokens are returned. O(S) extra
memory, no collective. Text-only 3-D positions built from 1-D ids (every row equal) keep using the
1-D meta positions (the rotary module's text-rows path).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["split_mrope_positions", "attach_mrope", "mrope_cp_call", "probe_mrope_positions", "mrope_section",
           "MROPE_ROWS"]

MROPE_ROWS = 3          # temporal, height, width


def split_mrope_positions(batch: dict, error: type) -> tuple[dict, Optional[tuple[int, torch.Tensor]]]:
    """``(batch, None)`` when ``position_ids`` is absent or 2-D; else ``(copy, (K, rope rows [3, B|1, S]))``
    where the copy's ``position_ids`` is row 0 (K=4) or removed (K=3). ``error``: raised (the batch
    error class) for a 3-D tensor that is not one of transformers' two layouts."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 3:
        return batch, None
    ref = next((batch[k] for k in ("input_ids", "inputs_embeds", "labels") if batch.get(k) is not None), None)
    K = pos.shape[0]
    if K not in (MROPE_ROWS, MROPE_ROWS + 1) or ref is None or pos.shape[1] not in (1, ref.shape[0]) \
            or pos.shape[2] != ref.shape[1]:
        raise error(
            f"3-D position_ids of shape {tuple(pos.shape)}: CP carries transformers' multimodal (mrope) layouts "
            f"[3, B|1, S] (temporal/height/width ids) or [4, B|1, S] (text positions, then the 3 rows), with "
            f"[B, S] = {None if ref is None else tuple(ref.shape[:2])} from the batch; pass one of them or 2-D "
            "position_ids [B|1, S]")
    if pos.is_floating_point():
        raise error("3-D position_ids must be an integer tensor")
    out = {k: v for k, v in batch.items() if k != "position_ids"}
    if K == MROPE_ROWS + 1:
        out["position_ids"] = pos[0]
    return out, (K, pos[K - MROPE_ROWS:])


def attach_mrope(out, mrope: tuple[int, torch.Tensor], n_pad: int) -> None:
    """Pad the rope rows (CP pad tokens continue each row), store them global in
    ``out.meta.mrope_position_ids`` and put this rank's ``position_ids`` (the user's layout) in ``out``."""
    K, rows = mrope
    if n_pad:
        cont = rows[..., -1:] + 1 + torch.arange(n_pad, dtype=rows.dtype, device=rows.device)
        rows = torch.cat([rows, cont], dim=-1)
    meta = out.meta
    meta.mrope_position_ids = rows
    local = rows.index_select(2, meta.q_index.to(rows.device))
    if K == MROPE_ROWS + 1:           # text row 0: the 1-D local positions (already sliced by the batch)
        text = out["position_ids"].expand(local.shape[1], -1) if local.shape[1] != out["position_ids"].shape[0] \
            else out["position_ids"]
        local = torch.cat([text[None].to(local.dtype), local], dim=0)
    out["position_ids"] = local


def _global_rows(meta, error: type) -> torch.Tensor:
    g = meta.mrope_position_ids
    if g.dim() != 3 or g.shape[-1] != meta.global_seq_len:
        raise error(f"meta.mrope_position_ids has shape {tuple(g.shape)}, expected [3, B|1, {meta.global_seq_len}]")
    n_real = meta.seq_len if getattr(meta, "seq_len", None) is not None else meta.global_seq_len
    if n_real < meta.global_seq_len:           # CP's pad-to-multiple tokens: the row's last real id
        g = torch.cat([g[..., :n_real], g[..., n_real - 1:n_real].expand(*g.shape[:2], meta.global_seq_len - n_real)],
                      dim=-1)
    return g


def mrope_cp_call(original: Callable, bound, meta, fqn: str, local: torch.Tensor, error: type,
                  slice_outputs: Callable):
    """The rotary module ``original`` once on the meta's global 3-D ids; this rank's slice of its
    output (``slice_outputs(out, sel, total, rows, fqn)``). ``local``: the ``[3, B|1, n]`` ids the
    model passed, which must equal this rank's slice of the global ones."""
    g = _global_rows(meta, error).to(local.device)
    sel = meta.q_index.to(g.device)
    want = meta.mrope_position_ids.to(g.device).index_select(2, sel)
    if local.dim() != 3 or local.shape[0] != g.shape[0] or local.shape[-1] != want.shape[-1] or \
            local.shape[1] not in (1, want.shape[1]) or \
            not torch.equal(local.expand_as(want), want.to(local.dtype)):
        raise error(
            f"rotary module '{fqn}' got position_ids of shape {tuple(local.shape)} that are not this rank's slice "
            f"(cp rank {meta.cp_rank}) of the batch's global 3-D (mrope) positions {tuple(g.shape)}: pass "
            "position_ids=local['position_ids'] from shard_batch_for_cp (the model must hand the rotary "
            "embedding the 3 temporal/height/width rows it was given)")
    if g.shape[1] > 1 and (g.stride(1) == 0 or torch.equal(g, g[:, :1].expand_as(g))):
        g = g[:, :1]                              # one distinct row: computed once
    bound.arguments["position_ids"] = g
    out = original(*bound.args, **bound.kwargs)
    return slice_outputs(out, sel, meta.global_seq_len, local.shape[1], fqn)


def probe_mrope_positions(L: int, width: int = 4) -> torch.Tensor:
    """Multimodal ids ``[3, 1, L]`` as ``get_rope_index`` lays them out: text ``0..a-1``, an image
    grid of ``L // 2`` tokens (temporal ``a``, height ``a + i // width``, width ``a + i % width``), then
    text again from ``1 + max`` of the grid. Used by the rotary preflight."""
    a, n = L // 4, L // 2
    i = torch.arange(n, dtype=torch.int64)
    grid = torch.stack([torch.full_like(i, a), a + i // width, a + i % width])
    start = int(grid.max()) + 1
    text = lambda lo, k: torch.arange(lo, lo + k, dtype=torch.int64).expand(MROPE_ROWS, k)  # noqa: E731
    return torch.cat([text(0, a), grid, text(start, L - a - n)], dim=1)[:, None]


def mrope_section(module, model_config):
    """The multimodal (3-D) RoPE section of a rotary module or its config, else None."""
    sec = getattr(module, "mrope_section", None)
    if sec:
        return sec
    for cfg in (getattr(module, "config", None), model_config, getattr(model_config, "text_config", None)):
        for attr in ("rope_parameters", "rope_scaling"):
            rp = getattr(cfg, attr, None) if cfg is not None else None
            if isinstance(rp, dict) and rp.get("mrope_section"):
                return rp["mrope_section"]
    return None
