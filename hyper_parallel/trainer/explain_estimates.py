"""The arithmetic of ``hyper-train --explain`` (:mod:`.explain`): bytes per rank and work spread.

Everything here is local and runs on a meta-device model in one process (no process group):

* :func:`saved_bytes_per_token` — what autograd saves in one forward of the model's decoder (the
  LM head excluded) at the local sequence length, measured with ``saved_tensors_hooks`` on the
  meta device; the attention core is replaced by a stand-in that saves what a fused attention
  kernel saves (q, k, v, out, log-sum-exp), never an ``[S, S]`` matrix;
* :func:`fsdp_bytes` — bytes each rank sends per step through FSDP2's AllGather (forward and
  backward) and ReduceScatter.

The CP methods' own costs are their rows' cost models (``catalogue.cost_model``, one per method
folder and in ``mixers/cost.py``); the work spread per layout is the batch layer's
(``balance/layout_spread.py``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

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
    from ..distributed.context_parallel.cost_model import saved_bytes

    decoder = getattr(model, "model", model)
    params = frozenset(p.untyped_storage()._cdata for p in model.parameters())
    ids = torch.zeros(1, int(tokens), dtype=torch.long, device="meta")
    was = model.training
    model.train()
    try:
        with _probe_mode(model):
            held = saved_bytes(lambda: decoder(input_ids=ids, use_cache=False), exclude=params)
    finally:
        model.train(was)
    return held / tokens


def fsdp_bytes(param_bytes: float, n: int, reshard_after_forward: bool = True) -> dict:
    """Bytes one rank sends per step through FSDP2 over ``n`` ranks (parameters of ``param_bytes``)."""
    if n <= 1:
        return {}
    share = param_bytes * (n - 1) / n   # a ring AllGather / ReduceScatter sends (n-1)/n of the full size
    out = {"fwd parameter AllGather": share, "bwd gradient ReduceScatter": share}
    if reshard_after_forward:
        out["bwd parameter AllGather"] = share
    return out
