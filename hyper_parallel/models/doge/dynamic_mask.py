"""Doge's dynamic mask attention (``DogeAttention``) under CP: ``doge_dynamic_mask``.

Doge adds to every score ``scale * q.k`` a per-key, per-KV-head bias ``dt = exp(A * softplus(dt_proj(v)))``
computed from the key's value states, and keeps per query only the ``keep_window_size`` keys with
the largest bias. Both live only in the mask it passes to the attention call (which the generic CP
wrappers do not use), so this method re-runs the module's lines (transformers 5.24):

1. q, k, v, RoPE (global positions from the applier) and ``dt [B, Hk, L]`` on the local tokens;
2. the bias folded into one more key channel: ``q' = [q, 1/scale]``, ``k' = [k, dt]`` so that
   ``scale * q'.k' = scale * q.k + dt`` (one fp32 rounding; the gradient reaches ``A`` / ``dt_proj``
   through ``k'``);
3. ONE AllGather of ``[k' | v]`` along the sequence (Colossal; backward ReduceScatter) and the
   engine's causal attention on global positions with the batch's documents and padding, and
   ``config.sliding_window`` when set (the model then builds a sliding-window mask); no mask is built;
4. ``o_proj``.

The top-``keep_window_size`` selection keeps every visible key while no query sees more than
``keep_window_size`` keys (no document, or sliding window, longer): step 3 as written. Otherwise
each query keeps, per KV head, the ``keep_window_size`` visible global keys with the largest ``dt``,
**ties to the lower global key index** (:func:`key_ranks`, one stable sort of the gathered ``dt``;
:func:`keep_window_selector` per query block), and attends over those keys only
(:func:`~hyper_parallel.ops.selected.selected_attention`). The same rule is bound to the module's
own dense mask (:func:`prepare_dynamic_mask_ordered`), so its CP=1 forward — the preflight proof's
reference — selects the same keys; transformers' ``torch.topk`` keeps an unspecified one of tied
keys, and ties are common (repeated tokens at the first layer, ``A = 0`` at initialization).
The forward carries
``__hp_ignores_model_mask__``: under CP the base model builds no ``[B, 1, L, L]`` mask
(:mod:`~hyper_parallel.distributed.context_parallel.interception.model_mask`). Training only (no cache).
docs/wrappers.md, "Doge".
"""
from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel.collectives import all_gather_seq
from ...distributed.context_parallel.interception.model_mask import IGNORES_MODEL_MASK
from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.meta import current_cp_batch_meta, refuse_blocks
from ...distributed.context_parallel.mixers.rows import bound_call, current_fqn, require_class
from ...distributed.context_parallel.registry import inner_wrapper
from ...distributed.context_parallel.semantics import register_uncarried
from ...distributed.context_parallel.strategies import engine_attention
from ...ops.selected import selected_attention

__all__ = ["DOGE_CLASSES", "doge_dynamic_mask_cp_wrapper", "keep_window_selector", "key_ranks", "longest_document",
           "prepare_dynamic_mask_ordered"]

DOGE_CLASSES = ("DogeAttention",)


def longest_document(meta) -> int:
    """Length of the longest document of the CP batch (the unpadded row when there are none)."""
    if meta.key_doc is None:
        return int(meta.seq_len if meta.seq_len is not None else meta.global_seq_len)
    kd = meta.key_doc
    idx = torch.arange(kd.shape[1], device=kd.device).expand_as(kd)
    new_run = torch.ones_like(kd, dtype=torch.bool)
    new_run[:, 1:] = kd[:, 1:] != kd[:, :-1]
    start = torch.where(new_run, idx, torch.zeros_like(idx)).cummax(dim=1).values
    length = torch.where(kd >= 0, idx - start + 1, torch.zeros_like(idx))
    return int(length.max()) if length.numel() else 0


SELECT_BUDGET = 1 << 24    # elements of one query block's [B, Hk, Lb, keys] rank tensor


def key_ranks(bias: torch.Tensor) -> torch.Tensor:
    """``bias [B, Hk, S]`` -> int64 ``[B, Hk, S]``: each key's place in the order *larger bias first,
    among equal biases the lower global key index first* (a stable descending sort). Distinct per
    (row, head), so every selection made from them is unique: the tie rule."""
    order = torch.sort(bias, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(bias.shape[-1], device=bias.device).expand_as(order))
    return ranks


def _visible(q_idx, k_idx, doc_q, doc_k, window):
    """``[B|1, Lq, Lk]`` bool: key ``k_idx [Lk]`` (global) visible to query ``q_idx [Lq]``: causal,
    inside ``window`` when set, same document and not padding (``doc_* None``: one valid document)."""
    ok = (k_idx[None, :] <= q_idx[:, None])
    if window:
        ok = ok & (k_idx[None, :] > q_idx[:, None] - window)
    ok = ok[None]
    if doc_q is not None:
        dk = doc_k[:, k_idx]
        ok = ok & (dk[:, None, :] == doc_q[:, :, None]) & (dk[:, None, :] >= 0)
    return ok


def keep_window_selector(ranks: torch.Tensor, keep: int, q_idx, doc_q, doc_k, window=None):
    """Doge's dynamic mask as a selection: a function ``select(l0, l1)`` -> ``(sel, ok)`` for the
    local queries ``l0:l1`` (global indices ``q_idx``) — per KV head, the ``keep`` visible keys of
    smallest :func:`key_ranks` rank (largest bias, ties to the lower key index), every visible key
    when a query sees at most ``keep``; ``sel [B, Hk, Lb, width]`` global key indices in rank order,
    ``ok`` which of them are real (visible) picks. ``width = min(keep, S)``. Memory per call: one
    ``[B, Hk, Lb, keys]`` rank tensor over the keys the block's queries can see, never ``[L, S]``."""
    B, Hk, S = ranks.shape
    width = min(keep, S)

    def select(l0: int, l1: int):
        qi = q_idx[l0:l1]
        hi = int(qi.max()) + 1
        lo = max(0, int(qi.min()) - window + 1) if window else 0
        kidx = torch.arange(lo, hi, device=ranks.device)
        vis = _visible(qi, kidx, None if doc_q is None else doc_q[:, l0:l1], doc_k, window)
        r = ranks[:, :, None, lo:hi].masked_fill(~vis[:, None], S)               # [B, Hk, Lb, n]
        n = min(width, hi - lo)
        val, pos = torch.topk(r, n, dim=-1, largest=False, sorted=True)
        sel, ok = pos + lo, val < S
        if n < width:
            pad = (0, width - n)
            sel, ok = F.pad(sel, pad, value=lo), F.pad(ok, pad, value=False)
        return sel, ok

    return select, width


def prepare_dynamic_mask_ordered(self, hidden_states, dt_states, keep_window_size: int = 2048, attention_mask=None):
    """transformers' ``DogeAttention.prepare_dynamic_mask`` (5.24) with its one unspecified choice
    fixed: the ``keep_window_size`` kept keys of a query are the largest ``dt`` among its visible keys
    with ties going to the **lower key index** (a stable descending sort instead of ``torch.topk``,
    whose choice among equal values is unspecified — and equal values are common: a token repeated
    in a document has the same value states, hence the same ``dt``, at the first layer; ``A = 0``, the
    initialization, makes every ``dt`` 1). Bound to the module by :func:`doge_dynamic_mask_cp_wrapper`,
    so its CP=1 forward (the preflight proof's reference) computes the selection CP computes."""
    from torch.nn.attention.flex_attention import BlockMask

    min_dtype = torch.finfo(hidden_states.dtype).min
    dtype = hidden_states.dtype
    attn_mask = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, torch.full((), 0.0, device=attention_mask.device,
                                                                    dtype=dtype), min_dtype)
        attn_mask = attn_mask.masked_fill(attention_mask[:, :, :, : attn_mask.shape[-1]] != 0, min_dtype)
    if attn_mask.shape[-1] > keep_window_size:
        order = torch.sort(attn_mask, dim=-1, descending=True, stable=True).indices[..., :keep_window_size]
        active = torch.zeros_like(attn_mask, dtype=torch.bool).scatter(-1, order, True)
        attn_mask = attn_mask.masked_fill(~active, min_dtype)
    return attn_mask


def validate_doge(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "doge_dynamic_mask_cp_wrapper"
    require_class(what, target_module, tp_size, DOGE_CLASSES, "re-runs the forward of DogeAttention")
    p = float(getattr(target_module, "attention_dropout", 0.0) or 0.0)
    if p > 0:
        raise ValueError(f"{what}: DogeAttention has attention_dropout={p}; the CP attention computes no "
                         "dropout — set attention_dropout: 0.0")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_doge, at_cp1=True)
def doge_dynamic_mask_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Doge's attention with its dynamic mask under CP (module docstring): the per-key bias as an
    extra key channel, one AllGather of ``[k' | v]``, the engine on global positions and documents.
    Forward: 1 AllGather; backward: 1 ReduceScatter. Documents longer than ``keep_window_size``:
    the dynamic top-k over the global keys with the lower-index tie rule (module docstring)."""
    del mesh, tp_mesh, ep_mesh
    what = "doge_dynamic_mask_cp_wrapper"
    m = target_module
    original = m.forward
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    sig = inspect.signature(type(m).forward)
    # the stated tie rule at CP=1 too (the module's own forward: the proof's reference, cp 1 calls)
    m.prepare_dynamic_mask = types.MethodType(prepare_dynamic_mask_ordered, m)

    def forward(*args, **kwargs):
        if cp_mesh is None:      # installed at cp_size 1: with a batch meta (a CP group of one) the same
            if current_cp_batch_meta(required=False) is None:    # computation as under CP, else the
                return original(*args, **kwargs)                 # module's forward, tie rule bound
            meta, a, hs = bound_call(what, fqn, sig, m, None, args, kwargs, one_rank=True)
            return compute(meta, a, hs, lambda t: t)
        entry = bound_call(what, fqn, sig, m, cp_mesh, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, a, hs = entry
        return compute(meta, a, hs, lambda t: all_gather_seq(t, cp_mesh, dim=2, tag="cp.doge_kv"))

    def compute(meta, a, hs, gather):
        """The method on this rank's ``hs [B, L, hidden]``; ``gather`` makes the global ``[k' | v]``."""
        window = getattr(m.config, "sliding_window", None)     # the model's mask is then a sliding window
        longest = longest_document(meta)
        selects = min(longest, window or longest) > m.keep_window_size    # some query sees more keys than kept
        if selects:     # before the gather: every rank holds the same meta, so all refuse together
            refuse_blocks(meta, "Doge dynamic-mask attention (its top-k key selection)")
        B, L, _ = hs.shape
        shape = (B, L, -1, m.head_dim)
        q = m.q_norm(m.q_proj(hs).view(shape)).transpose(1, 2)
        k = m.k_norm(m.k_proj(hs).view(shape)).transpose(1, 2)
        v = m.v_proj(hs).view(shape).transpose(1, 2)
        cos, sin = a["position_embeddings"]
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        dt = m.dt_proj(v.transpose(1, 2).reshape(B, L, -1))
        dt = torch.exp(m.A * F.softplus(dt)).transpose(-1, -2)                    # [B, Hk, L]
        q1 = torch.cat([q, q.new_full((*q.shape[:-1], 1), 1.0 / m.scaling)], dim=-1)
        k1 = torch.cat([k, dt.unsqueeze(-1).to(k.dtype)], dim=-1)                 # [B, Hk, L, D + 1]
        D1 = k1.shape[-1]
        g = gather(torch.cat([k1, v], dim=-1).contiguous())
        if selects:     # the dynamic top-keep_window_size over the global keys, per query block
            q_idx = meta.q_index.to(hs.device)
            doc_k = None if meta.key_doc is None else meta.key_doc.to(hs.device)
            doc_q = None if doc_k is None else doc_k[:, q_idx]
            select, width = keep_window_selector(key_ranks(g[..., D1 - 1].detach()), m.keep_window_size, q_idx,
                                                 doc_q, doc_k, window)
            out = selected_attention(q1, g[..., :D1], g[..., D1:], select, width, m.scaling)
        else:           # every visible key is kept: the engine on global positions and documents
            out = engine_attention(q1, g[..., :D1], g[..., D1:], q_pos=meta.q_index, k_pos=meta.k_index,
                                   meta=meta, scale=m.scaling, window=window)     # [B, Hq, L, D]
        out = m.o_proj(out.transpose(1, 2).reshape(B, L, -1).contiguous())
        return out, None

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    setattr(forward, IGNORES_MODEL_MASK, True)      # causal, documents, padding: from the batch meta only
    return forward


def _uncarried_doge(module: nn.Module):
    """What CP's attention would miss on a Doge attention (for the refusal of another method)."""
    if not callable(getattr(module, "prepare_dynamic_mask", None)):
        return None
    return (f"Doge's dynamic mask (a per-key additive bias from dt_proj/A over the values and a top-"
            f"keep_window_size={getattr(module, 'keep_window_size', '?')} key selection, both only in the "
            "mask it passes to the attention call, which CP does not use) — declare inner_wrapper: "
            "doge_dynamic_mask on it")


register_uncarried(_uncarried_doge)

# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="doge_dynamic_mask", cost="mixers.cost:NOT_MODELLED",
        title="Doge dynamic-mask attention, the per-key bias as a key channel over the "
        "gathered keys (Doge)", kind="mixer", batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local queries; K, V gathered); the top-keep_window_size over the global "
        "keys, ties to the lower key index",
        offers=(catalogue.Offer("hf", "doge_dynamic_mask_cp_wrapper", "doge_dynamic_mask", module=__name__),)))
register_catalogue_names(__name__, globals())
