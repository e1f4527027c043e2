"""DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-MoE-DSA) under CP: ``dsa_all_gather``.

The lightning indexer scores every query against every causal key and keeps the ``index_topk``
best; the MLA attention then sees only those keys. Under CP (contiguous layout) each rank:

1. runs the module's own lines on its local tokens: MLA q, compressed kv, RoPE (on the global
   positions the applier gives the rotary module), ``expand_kv`` -> K ``[B, H, L, Dqk]``, V
   ``[B, H, L, Dv]``; the indexer's q ``[B, L, Hi, Di]``, weights ``[B, L, Hi]`` and key ``[B, L, Di]``
   (no gradient: the indexer is ``@torch.no_grad`` in transformers);
2. ONE AllGather of ``[K | V | indexer key]`` along the sequence (backward: ReduceScatter of the
   K/V gradients to their owners) -- the one data collective, the same as Colossal's K/V gather;
3. scores its local queries against the global indexer keys block by block (:func:`index_scores`,
   ``[B, L, Hi, block]`` at a time over the global key blocks, blocks past the last local query
   skipped) keeping a running top-k: memory O(L * k), never O(S^2); visibility = causal on global
   indices, same document, not padding (the batch meta); **ties go to the lower global key index**
   (stable sorts). The same rule and the same score blocks are bound to the module's indexer
   (:func:`indexer_forward_ordered`), so its CP=1 forward selects the same keys — transformers'
   ``topk`` keeps an unspecified one of tied keys, and ties are common (a key whose every indexer
   head's ReLU is 0 scores exactly 0);
4. attends each query to its selected visible keys only (gather of the selected K/V rows, query
   blocks under activation checkpointing so at most one block's ``[B, H, Lq, k, D]`` is alive).

GLM-MoE-DSA ``shared`` layers reuse the previous layer's selection, returned as GLOBAL key indices
(the third output), exactly as at CP=1. Exact w.r.t. CP=1 (with the tie rule of 3) up to the
attention's fp32 rounding. The forward carries ``__hp_ignores_model_mask__``: under CP the base model builds no
``[B, 1, L, L]`` mask (:mod:`~hyper_parallel.distributed.context_parallel.interception.model_mask`).
Training only (no cache). docs/wrappers.md, "DeepSeek sparse attention".
"""
from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...distributed.context_parallel.collectives import all_gather_seq
from ...distributed.context_parallel.interception.model_mask import IGNORES_MODEL_MASK
from ...distributed.context_parallel.meta import refuse_blocks
from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers.rows import CPMixerError, bound_call, current_fqn, require_class
from ...distributed.context_parallel.registry import inner_wrapper
from ...ops.index_scores import index_scores as engine_index_scores
from ...distributed.context_parallel.semantics import register_uncarried

__all__ = ["DSA_CLASSES", "attend_selected", "dsa_all_gather_cp_wrapper", "index_scores", "indexer_forward_ordered",
           "select_topk"]

#: DSA attention classes -> the rotary function (in the class's transformers module) of its indexer
DSA_CLASSES = {"DeepseekV32Attention": "apply_rotary_pos_emb",
               "GlmMoeDsaAttention": "apply_rotary_pos_emb_interleave"}
KEY_BLOCK = 1024          # indexer keys scored at a time
ATTN_BUDGET = 1 << 24     # elements of one query block's gathered K/V rows


def visible(q_idx: torch.Tensor, k_idx: torch.Tensor, doc_q, doc_k) -> torch.Tensor:
    """``[B|1, Lq, ...]`` bool: key ``k_idx`` (global index, ``[Lk]`` or ``[B, Lq, Lk]``) visible to
    query ``q_idx [Lq]``: causal, same document, not padding (``doc_* None``: one valid document)."""
    if k_idx.dim() == 1:
        ok = (k_idx[None, :] <= q_idx[:, None])[None]                       # [1, Lq, Lk]
        if doc_q is not None:
            dk = doc_k[:, k_idx]                                             # [B, Lk]
            ok = ok & (dk[:, None, :] == doc_q[:, :, None]) & (dk[:, None, :] >= 0)
        return ok
    ok = k_idx <= q_idx[None, :, None]                                       # [B, Lq, k]
    if doc_q is not None:
        dk = torch.gather(doc_k, 1, k_idx.reshape(k_idx.shape[0], -1)).view_as(k_idx)
        ok = ok & (dk == doc_q[:, :, None]) & (dk >= 0)
    return ok


def index_scores(iq, weights, kb, scale: float) -> torch.Tensor:
    """The lightning indexer's score of every query against one block of keys, in float32:
    ``sum_h w[h] * relu(scale * q[h].k)`` for ``iq [B, L, Hi, Di]``, ``weights [B, L, Hi]``,
    ``kb [B, n, Di]`` -> ``[B, L, n]``. On CPU the engine's ``index_scores`` (csrc/indexer): one fixed
    float32 reduction order per (query, key) pair, so a pair's score is the same bits at every CP size,
    in CP and in the module's own CP=1 forward (:func:`indexer_forward_ordered`), on every CPU. Elsewhere
    transformers' arithmetic (two batched matmuls) on the same global key blocks."""
    if iq.device.type == "cpu":
        return engine_index_scores(iq, weights, kb, scale)
    kb = kb.float().transpose(-1, -2).unsqueeze(1)                           # [B, 1, Di, n]
    sc = F.relu(torch.matmul(iq.float(), kb) * scale)                        # [B, L, Hi, n]
    return torch.matmul(weights.float().unsqueeze(-2), sc).squeeze(-2)       # [B, L, n]


@torch.no_grad()
def indexer_forward_ordered(self, hidden_states, q_resid, position_embeddings, attention_mask,
                            position_ids=None, cache=None, *, rope=None):
    """transformers' indexer forward (DeepSeek V3.2 / GLM-MoE-DSA, 5.24) with its one unspecified
    choice fixed: the ``index_topk`` keys of a query are the highest scores with **ties to the lower
    key index** (a stable descending sort instead of ``torch.topk``, whose choice among equal scores is
    unspecified; equal scores are common: a key whose every indexer head's ReLU is 0 scores exactly 0),
    scores from :func:`index_scores` over the global key blocks. Bound to the indexer by
    :func:`dsa_all_gather_cp_wrapper` (``rope`` = the module's indexer RoPE), so the module's CP=1
    forward — the preflight proof's reference — selects what CP selects."""
    del position_ids
    cos, sin = position_embeddings
    iq, ik, iw = _indexer_inputs(self, rope, hidden_states, q_resid, cos, sin)
    if cache is not None:                       # as transformers does (CP itself runs without a cache)
        ik = cache.update_indexer(ik, self.layer_idx)
    S = ik.shape[1]
    sc = torch.cat([index_scores(iq, iw, ik[:, s0:s0 + KEY_BLOCK], self.softmax_scale)
                    for s0 in range(0, S, KEY_BLOCK)], dim=-1)
    if attention_mask.dtype == torch.bool:
        sc = sc.masked_fill(~attention_mask, float("-inf"))
    else:
        sc = sc + attention_mask
    k = min(self.index_topk, S)
    return torch.sort(sc, dim=-1, descending=True, stable=True).indices[..., :k].to(torch.int32)


@torch.no_grad()
def select_topk(iq, weights, ik, scale: float, topk: int, q_idx, doc_q, doc_k, block: int = KEY_BLOCK,
                vis=None):
    """Global top-k keys per local query: ``iq [B, L, Hi, Di]``, ``weights [B, L, Hi]``, ``ik [B, S, Di]``
    (global keys) -> (``[B, L, min(topk, S)]`` int64 global key indices, ``[B, L]`` bool: the k-th and
    the (k+1)-th best visible keys score equally, a tie at the k-th place). The transformers indexer's
    score ``sum_h w[h] * relu(scale * q[h].k)`` with invisible keys at ``-inf``, a running top-(k+1)
    over key blocks (stable sort: among equal scores the earlier key wins). ``vis(s0, s1)`` ->
    ``[B|1, L, s1 - s0]`` bool replaces the visibility from positions and documents when given (the
    one-rank forward: from the module's mask). Local, no collective."""
    B, L = iq.shape[:2]
    S = ik.shape[1]
    k = min(topk, S)
    last = int(q_idx.max()) + 1                     # no key after the last local query is visible
    best_v = iq.new_empty(B, L, 0, dtype=torch.float32)
    best_i = torch.empty(B, L, 0, dtype=torch.int64, device=iq.device)
    for s0 in range(0, min(last, S), block):
        s1 = min(s0 + block, S)
        sc = index_scores(iq, weights, ik[:, s0:s1], scale)                   # [B, L, n]
        idx = torch.arange(s0, s1, device=iq.device)
        sc = sc.masked_fill(~(visible(q_idx, idx, doc_q, doc_k) if vis is None else vis(s0, s1)), float("-inf"))
        v = torch.cat([best_v, sc], dim=-1)
        i = torch.cat([best_i, idx.expand(B, L, -1)], dim=-1)
        order = torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k + 1]
        best_v, best_i = v.gather(-1, order), i.gather(-1, order)
    tied = torch.zeros(B, L, dtype=torch.bool, device=iq.device)
    if best_v.shape[-1] > k:
        kth = best_v[..., k - 1]
        tied = torch.isfinite(kth) & (kth == best_v[..., k])
    best_i = best_i[..., :k]
    if best_i.shape[-1] < k:                        # fewer candidate keys than k: pad (invisible)
        pad = torch.full((B, L, k - best_i.shape[-1]), S - 1, dtype=torch.int64, device=iq.device)
        best_i = torch.cat([best_i, pad], dim=-1)
    return best_i, tied


def _attend_block(q, kg, vg, sel, ok, scale):
    B, H, Lb, Dq = q.shape
    kk = sel.shape[-1]
    gi = sel[:, None].expand(B, H, Lb, kk).reshape(B, H, Lb * kk, 1)
    ks = kg.gather(2, gi.expand(-1, -1, -1, Dq)).view(B, H, Lb, kk, Dq)
    vs = vg.gather(2, gi.expand(-1, -1, -1, vg.shape[-1])).view(B, H, Lb, kk, vg.shape[-1])
    s = torch.einsum("bhld,bhlkd->bhlk", q, ks) * scale
    s = s.masked_fill(~ok[:, None], torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.einsum("bhlk,bhlkd->bhld", p, vs)
    return o * ok.any(-1)[:, None, :, None].to(o.dtype)          # a query that sees no key outputs 0


def attend_selected(q, kg, vg, sel, ok, scale: float, budget: int = ATTN_BUDGET):
    """Softmax attention of ``q [B, H, L, Dq]`` over its selected keys only: ``sel [B, L, k]`` global
    indices into ``kg [B, H, S, Dq]`` / ``vg [B, H, S, Dv]``, ``ok [B, L, k]`` which of them count.
    -> ``[B, H, L, Dv]``. Query blocks sized to ``budget`` elements of gathered rows, each under
    activation checkpointing (backward recomputes the block's gather). Local, no collective."""
    B, H, L, Dq = q.shape
    per_q = max(1, B * H * sel.shape[-1] * (Dq + vg.shape[-1]))
    lb = max(1, min(L, budget // per_q))
    outs = []
    for l0 in range(0, L, lb):
        args = (q[:, :, l0:l0 + lb], kg, vg, sel[:, l0:l0 + lb], ok[:, l0:l0 + lb], scale)
        outs.append(checkpoint(_attend_block, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _attend_block(*args))
    return torch.cat(outs, dim=2)


def validate_dsa(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "dsa_all_gather_cp_wrapper"
    require_class(what, target_module, tp_size, tuple(DSA_CLASSES),
                  f"re-runs the forward of {', '.join(DSA_CLASSES)} (MLA + lightning indexer)")
    p = float(getattr(target_module, "attention_dropout", 0.0) or 0.0)
    if p > 0:
        raise ValueError(f"{what}: {type(target_module).__name__} has attention_dropout={p}; the CP sparse "
                         "attention computes no dropout — set attention_dropout: 0.0")


def _indexer_inputs(ix: nn.Module, rope, hs, q_resid, cos, sin):
    """The transformers indexer's lines before its scores: ``q [B, L, Hi, Di]``, ``k [B, L, Di]``,
    ``weights [B, L, Hi]`` (already scaled by ``Hi ** -0.5``)."""
    B, L, _ = hs.shape
    q = ix.wq_b(q_resid).view(B, L, ix.n_heads, ix.head_dim)
    r = ix.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [r, ix.head_dim - r], dim=-1)
    k = ix.k_norm(ix.wk(hs)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [r, ix.head_dim - r], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    w = ix.weights_proj(hs.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    return q, k, w


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_dsa, at_cp1=True)
def dsa_all_gather_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """DSA under CP on a :data:`DSA_CLASSES` attention (module docstring): local MLA + indexer
    projections, one AllGather of ``[K | V | indexer key]``, global top-k per local query, attention
    over the selected keys, ties to the lower key index (also bound to the module's own indexer).
    Forward: 1 AllGather; backward: 1 ReduceScatter (K/V gradients)."""
    del mesh, tp_mesh, ep_mesh
    what = "dsa_all_gather_cp_wrapper"
    m = target_module
    original = m.forward
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    rope_main = hf.apply_rotary_pos_emb_interleave
    rope_ix = getattr(hf, DSA_CLASSES[type(m).__name__])
    sig = inspect.signature(type(m).forward)
    if getattr(m, "indexer", None) is not None:     # the stated tie rule at CP=1 too (the proof's reference)
        m.indexer.forward = functools.partial(types.MethodType(indexer_forward_ordered, m.indexer), rope=rope_ix)

    def compute(a, hs, gather, q_idx, vis_block, vis_sel):
        """The method on ``hs [B, L, hidden]``: ``gather`` makes the global ``[B, S, ...]`` rows from
        the local ones, ``vis_block(s0, s1)`` / ``vis_sel(sel)`` give which keys each local query sees."""
        B, L, _ = hs.shape
        cos, sin = a["position_embeddings"]
        # -- the module's lines on the local tokens (transformers 5.24)
        q_resid = m.q_a_layernorm(m.q_a_proj(hs))
        q = m.q_b_proj(q_resid).view(B, L, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_pass, k_rot = torch.split(m.kv_a_proj_with_mqa(hs), [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_pass = m.kv_a_layernorm(kv_pass).view(B, 1, L, m.kv_lora_rank)
        q_rot, k_rot = rope_main(q_rot, k_rot.view(B, 1, L, m.qk_rope_head_dim), cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)                           # [B, H, L, Dqk]
        key, value = m.expand_kv(k_pass, k_rot)                              # [B, H, L, Dqk | Dv]
        H, Dq, Dv = key.shape[1], key.shape[-1], value.shape[-1]
        ix = getattr(m, "indexer", None)
        parts = [key.transpose(1, 2).reshape(B, L, H * Dq), value.transpose(1, 2).reshape(B, L, H * Dv)]
        if ix is not None:
            with torch.no_grad():
                iq, ik, iw = _indexer_inputs(ix, rope_ix, hs, q_resid, cos, sin)
            parts.append(ik.to(key.dtype))
        # -- the one collective: K, V and the indexer key of every rank
        g = gather(torch.cat(parts, dim=-1).contiguous())
        S = g.shape[1]
        kg = g[..., :H * Dq].view(B, S, H, Dq).transpose(1, 2)
        vg = g[..., H * Dq:H * (Dq + Dv)].view(B, S, H, Dv).transpose(1, 2)
        if ix is not None:
            sel, _ = select_topk(iq, iw, g[..., H * (Dq + Dv):].detach(), ix.softmax_scale, ix.index_topk,
                                 q_idx, None, None, vis=vis_block)
        else:
            sel = a.get("prev_topk_indices")
            if sel is None or tuple(sel.shape[:2]) != (B, L):
                raise CPMixerError(f"{what} on '{fqn}': a shared-indexer layer needs the previous layer's top-k "
                                   f"indices [B, L_local, k] (got {None if sel is None else tuple(sel.shape)}): "
                                   "declare dsa_all_gather on every DSA attention of the model")
            sel = sel.long()
        out = attend_selected(query, kg, vg, sel, vis_sel(sel).expand(B, -1, -1), m.scaling)   # [B, H, L, Dv]
        out = m.o_proj(out.transpose(1, 2).reshape(B, L, -1).contiguous())
        if "prev_topk_indices" in sig.parameters:                             # GLM-MoE-DSA: pass the selection on
            return out, None, sel.to(torch.int32)
        return out, None

    def one_rank(*args, **kwargs):
        """The same computation on one rank (no CP forward in progress: the preflight proof's
        reference, or a module called outside CP): visibility from the module's own
        ``attention_mask`` (``[B, 1, S, S]``, bool or additive; None = causal), no collective."""
        a = dict(sig.bind(m, *args, **kwargs).arguments)
        hs = a["hidden_states"]
        if a.get("cache") is not None or a.get("past_key_values") is not None:
            return original(*args, **kwargs)
        S = hs.shape[1]
        mask = a.get("attention_mask")
        if mask is None:
            vis_all = torch.ones(S, S, dtype=torch.bool, device=hs.device).tril()[None]
        else:
            mask = mask[:, 0, :, :S]
            vis_all = mask if mask.dtype == torch.bool else mask == 0
        return compute(a, hs, lambda t: t, torch.arange(S, device=hs.device),
                       lambda s0, s1: vis_all[..., s0:s1], lambda sel: vis_all.expand(sel.shape[0], -1, -1).gather(-1, sel))

    def forward(*args, **kwargs):
        if cp_mesh is None:                       # installed at cp_size 1: the one-rank computation
            return one_rank(*args, **kwargs)
        entry = bound_call(what, fqn, sig, m, cp_mesh, args, kwargs)
        if entry is None:
            return one_rank(*args, **kwargs)
        meta, a, hs = entry
        refuse_blocks(meta, f"{fqn} ({what})")
        q_idx = meta.q_index.to(hs.device)
        doc_k = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        doc_q = None if doc_k is None else doc_k[:, q_idx]
        return compute(a, hs, lambda t: all_gather_seq(t, cp_mesh, dim=1, tag="cp.dsa_kv"), q_idx,
                       lambda s0, s1: visible(q_idx, torch.arange(s0, s1, device=hs.device), doc_q, doc_k),
                       lambda sel: visible(q_idx, sel, doc_q, doc_k.expand(sel.shape[0], -1) if doc_k is not None
                                           else None))

    forward.__wrapped__ = original
    forward.__hp_one_rank__ = one_rank     # the same computation at one rank: the preflight proof's reference
    forward.__hp_mixer__ = what
    setattr(forward, IGNORES_MODEL_MASK, True)      # causal, documents, padding: from the batch meta only
    return forward


def _uncarried_dsa(module: nn.Module):
    """What CP's attention would miss on a DeepSeek sparse attention (for the refusal of another method)."""
    if not (hasattr(module, "indexer") and hasattr(module, "expand_kv")):
        return None
    cfg = getattr(module, "config", None)
    return (f"DeepSeek sparse attention (a lightning indexer selecting index_topk={getattr(cfg, 'index_topk', '?')} "
            "keys per query: the selection lives only in the mask / `indices` the module builds from its local "
            "keys) — declare inner_wrapper: dsa_all_gather on it")


register_uncarried(_uncarried_dsa)

# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="dsa_all_gather", cost="mixers.cost:NOT_MODELLED",
        title="DeepSeek sparse attention, indexer top-k over the gathered keys (DeepSeek V3.2, "
        "GLM-MoE-DSA)", kind="mixer", batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local queries; K, V and the indexer key gathered)",
        offers=(catalogue.Offer("hf", "dsa_all_gather_cp_wrapper", "dsa_all_gather", module=__name__),)))
register_catalogue_names(__name__, globals())
