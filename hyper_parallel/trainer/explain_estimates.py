"""The arithmetic of ``hyper-train --explain`` (:mod:`.explain`): bytes per rank and work spread.

Everything here is local and runs on a meta-device model in one process (no process group):

* :func:`saved_bytes_per_token` — what autograd saves in one forward of the model's decoder (the
  LM head excluded) at the local sequence length, measured with ``saved_tensors_hooks`` on the
  meta device; the attention core is replaced by a stand-in that saves what a fused attention
  kernel saves (q, k, v, out, log-sum-exp), never an ``[S, S]`` matrix;
* :func:`comm_bytes` — bytes each rank sends per step for one CP method, from the exchanges
  docs/wrappers.md describes (Colossal / Head-Tail: K/V AllGather, its backward regather and
  dK/dV ReduceScatter, Head-Tail's Q/O and dO/dQ All-to-All; Ulysses: Q/K/V/O
  All-to-All both ways) and FSDP2's AllGather (forward and backward) and ReduceScatter;
* :func:`work_spread` — visible (query, key) pairs per CP rank of a batch under the method's
  layout (contiguous chunks, or Head-Tail's head r + tail 2C-1-r), documents kept apart.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..distributed.context_parallel.catalogue import METHODS, gathers_kv, gathers_kv_only, splits_heads_over_cp

PROBE_ATTENTION = "hp_explain_probe"


class _SavedAttention(torch.autograd.Function):
    """Shape-only attention: output ``[B, S, Hq, Dv]`` (``Dv``: the value head dim, which MLA sets
    apart from the query's), saving q, k, v, out and the LSE."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])
        lse = q.new_empty(q.shape[:3])
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - the probe never runs backward
        q, k, v, _, _ = ctx.saved_tensors
        return g.transpose(1, 2), torch.zeros_like(k), torch.zeros_like(v)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    return _SavedAttention.apply(query, key, value), None


def _probe_mask(*args, allow_is_causal_skip: bool = True, **kwargs):
    import transformers.masking_utils as mu

    return None if allow_is_causal_skip else mu.sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


@contextlib.contextmanager
def _probe_mode(model: nn.Module):
    """The model's attention -> the stand-in; transformers' packed-sequence detection (a
    data-dependent ``.item()``) off: the probe feeds no position ids; MoE experts through
    transformers' grouped-mm fallback (torch's meta ``grouped_mm`` takes bf16 only); no mask for
    the probe unless the model forces one for a module that reads it itself (DeepSeek sparse
    attention's indexer: ``allow_is_causal_skip=False``), then SDPA's."""
    import transformers.integrations.moe as moe
    import transformers.masking_utils as mu
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_ATTENTION, _probe_attention)
    mu.AttentionMaskInterface.register(PROBE_ATTENTION, _probe_mask)
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    before = [c._attn_implementation for c in configs]
    find, grouped = mu.find_packed_sequence_indices, moe._can_use_grouped_mm
    mu.find_packed_sequence_indices = lambda position_ids: None
    moe._can_use_grouped_mm = lambda *a, **k: False
    try:
        for c in configs:
            c._attn_implementation = PROBE_ATTENTION
        yield
    finally:
        mu.find_packed_sequence_indices, moe._can_use_grouped_mm = find, grouped
        for c, b in zip(configs, before):
            c._attn_implementation = b


def saved_bytes_per_token(model: nn.Module, tokens: int) -> float:
    """Bytes autograd saves per token in one forward of ``model``'s decoder (``model.model`` when the
    model has one: the LM head and loss are counted separately) over ``tokens`` tokens, on meta.
    Parameters (and views of them) are not counted; a storage saved twice counts once; only what the
    graph still holds when the forward returns counts (a branch the model computed and dropped, and
    its saves with it, does not)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    decoder = getattr(model, "model", model)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: list = []

    def pack(t):
        # by storage, alive or not at the end: never by id() of a Python wrapper (``t._base`` may be a
        # fresh one whose id a later one reuses) nor by an address a freed storage hands on
        s = t.untyped_storage()
        if s._cdata not in params:
            saved.append((StorageWeakRef(s), s._cdata, s.nbytes()))
        return t

    ids = torch.zeros(1, int(tokens), dtype=torch.long, device="meta")
    was = model.training
    model.train()
    try:
        with _probe_mode(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = decoder(input_ids=ids, use_cache=False)
        held = {key: n for ref, key, n in saved if not ref.expired()}
        del out
    finally:
        model.train(was)
    return sum(held.values()) / tokens


def comm_bytes(method: str, *, S: int, cp: int, hq: int, hk: int, d: int, elem: int, keep_gathered: bool = False
               ) -> dict:
    """Bytes one rank sends for one attention layer and one micro-batch of global length ``S``
    (forward, backward), per exchange. Unknown methods (hybrid, mixers, custom) -> {}."""
    if cp <= 1:
        return {}
    share = (cp - 1) / cp
    kv_local = S / cp * hk * d * elem
    q_local = S / cp * hq * d * elem
    row = METHODS.get(method)
    if row is not None and gathers_kv(row):   # balanced: Colossal on the permuted row
        out = {"fwd K/V AllGather": 2 * kv_local * (cp - 1), "bwd dK/dV ReduceScatter": 2 * kv_local * (cp - 1)}
        if not gathers_kv_only(row):   # Head-Tail also dispatches the queries
            out.update({"fwd Q/O All-to-All": 2 * q_local * share, "bwd dO/dQ All-to-All": 2 * q_local * share})
        if not keep_gathered:   # both keep only the local K/V for backward and gather again
            out["bwd K/V regather"] = 2 * kv_local * (cp - 1)
        return out
    if row is not None and splits_heads_over_cp(row):   # Ulysses
        per = (2 * hq + 2 * hk) * d * elem * S / cp * share
        return {"fwd Q/K/V/O All-to-All": per, "bwd dO/dQ/dK/dV All-to-All": per}
    return {}


def fsdp_bytes(param_bytes: float, n: int, reshard_after_forward: bool = True) -> dict:
    """Bytes one rank sends per step through FSDP2 over ``n`` ranks (parameters of ``param_bytes``)."""
    if n <= 1:
        return {}
    share = param_bytes * (n - 1) / n   # a ring AllGather / ReduceScatter sends (n-1)/n of the full size
    out = {"fwd parameter AllGather": share, "bwd gradient ReduceScatter": share}
    if reshard_after_forward:
        out["bwd parameter AllGather"] = share
    return out


def layout_chunks(layout: str, S: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The query positions ``[start, end)`` rank ``rank`` computes attention for."""
    if layout == "head_tail":
        w = S // (2 * cp)
        return [(rank * w, (rank + 1) * w), ((2 * cp - 1 - rank) * w, (2 * cp - rank) * w)]
    w = S // cp
    return [(rank * w, (rank + 1) * w)]


def work_spread(batch: dict, layout: str, cp: int, heads_split: bool = False) -> list[int]:
    """Visible (query, key) pairs per CP rank for ``batch`` (``position_ids`` restart at every
    document: a query at position p sees p + 1 keys; padding queries see none). ``heads_split``
    (Ulysses): every rank computes every query for its share of the heads."""
    ids = batch["input_ids"]
    B, S = ids.shape
    pos = batch.get("position_ids")
    pos = torch.arange(S).expand(B, S) if pos is None else pos
    valid = batch.get("attention_mask")
    visible = (pos + 1) * (valid if valid is not None else 1)
    per_token = visible.sum(0)
    if layout == "balanced":    # the balanced split's own permutation of this batch (blocks of 64)
        return _balanced_spread(pos, valid, per_token, cp)
    pad = (-S) % (2 * cp)
    per_token = torch.cat([per_token, per_token.new_zeros(pad)])
    if heads_split:
        total = int(per_token.sum())
        return [total // cp] * cp
    return [int(sum(int(per_token[a:b].sum()) for a, b in layout_chunks(layout, S + pad, cp, r))) for r in range(cp)]


def _balanced_spread(pos: torch.Tensor, valid, per_token: torch.Tensor, cp: int) -> list[int]:
    """Visible pairs per rank under :func:`~..distributed.context_parallel.balance.split.balanced_permutation`
    of the batch's documents (a document starts where ``pos`` is 0; padding = -1)."""
    from ..distributed.context_parallel.balance.split import DEFAULT_BLOCK, balanced_permutation

    B, S = pos.shape
    doc = (pos == 0).long().cumsum(1) - 1
    if valid is not None:
        doc = torch.where(valid.bool(), doc, torch.full_like(doc, -1))
    pad = (-S) % (DEFAULT_BLOCK * cp)
    doc = torch.cat([doc, doc.new_full((B, pad), -1)], 1)
    per_token = torch.cat([per_token, per_token.new_zeros(pad)])
    perm = balanced_permutation(doc, B, S + pad, cp)
    return [int(x) for x in per_token[perm].reshape(cp, -1).sum(1)]
