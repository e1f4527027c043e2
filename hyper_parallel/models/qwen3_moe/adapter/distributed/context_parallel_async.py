"""Async CP wrappers for Qwen3-MoE attention (design 3.1.1 / 4.4): real overlap, both ways.

Public ``_target_`` paths:
  hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async.qwen3_moe_async_colossal_cp_wrapper
  ...qwen3_moe_async_ulysses_cp_wrapper
  ...qwen3_moe_async_hybrid_cp_wrapper  (named parameter ``ulysses_degree``)

The replacement forward keeps HF's math (q/k/v/o projections, per-head RMSNorm, RoPE) and
reorders it so each collective is launched at its last safe handoff and waited only at the
attention consumer::

    k = rope(k_norm(k_proj(h)))   -> launch K   (Colossal: AllGather on cp; Ulysses: seq->head A2A;
    v = v_proj(h)                 -> launch V    Hybrid: A2A on the ulysses group, then AllGather on
    q = rope(q_norm(q_proj(h)))   (overlaps K/V) the colossal group, chained on the platform thread)
    [Ulysses/Hybrid: launch Q (seq->head A2A)]
    wait K, V (, Q) -> engine attention with global positions -> [head->seq A2A] -> o_proj

K's collective overlaps the V projection and the Q branch, V's the Q branch. Q
(Ulysses/Hybrid) is the last tensor produced before the consumer, so its seq->head A2A is
launched and waited back to back (``cq.wait(cq.launch(q))``): it overlaps only the K/V
collectives still in flight, not compute.
The output head->seq A2A is synchronous (its result feeds ``o_proj`` at once).

Backward mirrors it: the consumer's K/V (and Q) gradients launch the inverse collectives
(reduce-scatter / inverse A2A) asynchronously; they complete while autograd runs the Q
branch (RoPE/norm backward and the q_proj grad GEMM); the wait happens in the handoff's
backward, right before the K/V projection backward.

Checks before any collective: at preflight the ``validate`` hooks reject a module that is not
a Qwen3-MoE attention (no fallback) and a head split that does not fit the method, with the
TP-local heads (``heads // tp_size``) when the planner re-validates under TP. At run time,
before K's launch, the same local checks as the sync strategies
(:meth:`~hyper_parallel.distributed.context_parallel.strategies.base.ContextParallelStrategy.check_shapes`)
compare the local sequence length with ``meta.local_seq_len``, ``meta.cp_size``/``cp_rank``
with the group, ``meta.key_doc``'s shape and the local heads.
"""
from __future__ import annotations

import torch

from .....distributed.context_parallel.async_collectives import AsyncCollective, trace_event
from .....distributed.context_parallel.collectives import ulysses_head_to_seq
from .....distributed.context_parallel.meta import current_cp_batch_meta
from .....distributed.context_parallel.registry import inner_wrapper
from .....distributed.context_parallel.strategies import AllGatherStrategy, HybridStrategy, UlyssesStrategy
from .....distributed.context_parallel.strategies.base import engine_attention
from .....distributed.context_parallel.wrappers import check_heads
from .....platform import all_gather, all_to_all, launch_chain, reduce_scatter

ADAPTER = "qwen3_moe"


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin):
    """HF's apply_rotary_pos_emb for one tensor [B, H, S, D] (cos/sin [B, S, D])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class _Mark(torch.autograd.Function):
    """Identity that records a trace event in forward and in backward (overlap evidence)."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        trace_event("compute", name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        trace_event("bwd_compute", ctx.name)
        return g, None


def _validate_adapter(module, *, cp_size, tp_size=1, ulysses_degree=None, method="colossal", who=ADAPTER):
    """Preflight (resolver: ``tp_size=1``; planner under TP: the real ``tp_size``); raise ValueError.

    The target must be a ``Qwen3MoeAttention``; its heads (``num_attention_heads`` /
    ``num_key_value_heads`` divided by ``tp_size``, or ``__hp_local_heads__`` after TP) must fit
    the method exactly as for the sync wrappers: Colossal any GQA ratio; Ulysses both divisible
    by ``cp_size`` with ``Hk >= cp_size``; Hybrid ``1 < ulysses_degree < cp_size``,
    ``cp_size % ulysses_degree == 0`` and both divisible by ``ulysses_degree``. No collective.
    """
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention
    except ImportError as exc:  # pragma: no cover - transformers without Qwen3-MoE
        raise ValueError(f"transformers has no Qwen3-MoE model: {exc}") from exc
    if not isinstance(module, Qwen3MoeAttention):
        raise ValueError(
            f"async CP wrapper is a Qwen3-MoE model adapter but the target is {type(module).__name__}: "
            "async needs a model adapter with explicit handoffs; use the sync wrapper "
            "(e.g. sdpa_hf_cp_wrapper) or write an @inner_wrapper adapter for this model"
        )
    check_heads(method, module, cp_size, tp_size, ulysses_degree, who)


# ----------------------------------------------------------------------------- comm plans
def _colossal(group):
    kv = (lambda x: all_gather(x, group, dim=2, async_op=True, tag="async_kv_gather"),
          lambda g: reduce_scatter(g, group, dim=2, async_op=True, tag="async_kv_reduce_scatter"))
    return kv, None


def _ulysses(group):
    fwd = (lambda x: all_to_all(x, group, scatter_dim=1, gather_dim=2, async_op=True, tag="async_seq_to_head"),
           lambda g: all_to_all(g, group, scatter_dim=2, gather_dim=1, async_op=True, tag="async_head_to_seq"))
    return fwd, fwd


def _hybrid(colossal_group, ulysses_group):
    # Every collective of a Hybrid layer runs on the platform chain thread, in program order,
    # so the per-group order is identical on all ranks.
    kv = (lambda x: launch_chain(x, [lambda y: all_to_all(y, ulysses_group, 1, 2, tag="async_seq_to_head"),
                                     lambda y: all_gather(y, colossal_group, dim=2, tag="async_kv_gather")],
                                 op="hybrid_kv_chain"),
          lambda g: launch_chain(g, [lambda y: reduce_scatter(y, colossal_group, dim=2, tag="async_kv_reduce_scatter"),
                                     lambda y: all_to_all(y, ulysses_group, 2, 1, tag="async_head_to_seq")],
                                 op="hybrid_kv_chain_bwd"))
    q = (lambda x: launch_chain(x, [lambda y: all_to_all(y, ulysses_group, 1, 2, tag="async_seq_to_head")],
                                op="hybrid_q_a2a"),
         lambda g: launch_chain(g, [lambda y: all_to_all(y, ulysses_group, 2, 1, tag="async_head_to_seq")],
                                op="hybrid_q_a2a_bwd"))
    return kv, q


# ----------------------------------------------------------------------------- forward
def _query_positions(method, meta, ulysses_degree) -> torch.Tensor:
    """Global indices of the queries the engine sees after communication."""
    if method == "colossal":
        return meta.q_index
    if method == "ulysses":
        return meta.k_index
    span = meta.local_seq_len * ulysses_degree  # hybrid: chunk colossal_idx of the cp/u split
    start = (meta.cp_rank // ulysses_degree) * span
    return torch.arange(start, start + span, dtype=torch.int64)


def _make_forward(module, method, kv_plan, q_plan, out_group, ulysses_degree, checker):
    """The replacement forward. ``checker`` is the sync strategy of the same method on the same
    group(s); only its local :meth:`check_shapes` is used (it never communicates)."""
    groups = module.num_key_value_groups

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ValueError(f"{ADAPTER} async CP: KV cache / use_cache is not supported in training; call the model with use_cache=False")
        meta = current_cp_batch_meta()
        if position_embeddings is None:
            raise ValueError(f"{ADAPTER} async CP: position_embeddings (cos, sin) are required")
        bsz, seqlen, _ = hidden_states.shape
        shape = (bsz, seqlen, -1, module.head_dim)
        cos, sin = position_embeddings

        # K handoff: projection + norm + RoPE done -> launch
        k = _rope(module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2), cos, sin)
        # local checks before the first collective (v has k's shape; q has k's heads x groups)
        q_shape = (k.shape[0], k.shape[1] * groups, k.shape[2], k.shape[3])
        checker.check_shapes(q_shape, tuple(k.shape), tuple(k.shape), meta, cp_size=checker.cp_size,
                             cp_rank=checker.cp_rank)
        ck = AsyncCollective("k", *kv_plan)
        k_tok = ck.launch(k)
        # V handoff (its projection overlaps K's collective)
        v = module.v_proj(hidden_states).view(shape).transpose(1, 2)
        cv = AsyncCollective("v", *kv_plan)
        v_tok = cv.launch(v)
        # Q branch overlaps both K and V collectives
        q = _Mark.apply(module.q_proj(hidden_states), "q_proj")
        q = _rope(module.q_norm(q.view(shape)).transpose(1, 2), cos, sin)
        if q_plan is not None:
            # Q is the last tensor before the consumer: launched and waited back to back (it
            # overlaps only the K/V collectives still in flight)
            cq = AsyncCollective("q", *q_plan)
            q = cq.wait(cq.launch(q))
        k_full = ck.wait(k_tok)
        v_full = cv.wait(v_tok)

        out = engine_attention(q, k_full, v_full, q_pos=_query_positions(method, meta, ulysses_degree),
                               k_pos=meta.k_index, meta=meta, scale=module.scaling)
        if out_group is not None:
            # sync: its result feeds o_proj at once, so there is nothing to overlap. All chain
            # work of this layer has been waited, so issuing it from this thread keeps the
            # per-group collective order identical on every rank.
            out = ulysses_head_to_seq(out, out_group, tag="async_out_head_to_seq")
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1).contiguous()
        return module.o_proj(out), None

    return forward


def _cp_group(cp_mesh):
    if cp_mesh is None:
        raise ValueError("async CP wrappers need an active cp mesh (accelerator.cp_size > 1)")
    return cp_mesh.get_group()


def _validate_colossal(module, *, cp_size, tp_size=1):
    """Preflight of the async Colossal wrapper (heads per TP rank when ``tp_size > 1``)."""
    _validate_adapter(module, cp_size=cp_size, tp_size=tp_size, method="colossal",
                      who="qwen3_moe_async_colossal_cp_wrapper")


def _validate_ulysses(module, *, cp_size, tp_size=1):
    """Preflight of the async Ulysses wrapper: TP-local heads must split over ``cp_size``."""
    _validate_adapter(module, cp_size=cp_size, tp_size=tp_size, method="ulysses",
                      who="qwen3_moe_async_ulysses_cp_wrapper")


def _validate_hybrid(module, *, cp_size, ulysses_degree, tp_size=1):
    """Preflight of the async Hybrid wrapper: TP-local heads must split over ``ulysses_degree``."""
    _validate_adapter(module, cp_size=cp_size, tp_size=tp_size, ulysses_degree=ulysses_degree,
                      method="hybrid", who="qwen3_moe_async_hybrid_cp_wrapper")


@inner_wrapper(method="colossal", style="model", is_async=True, model_adapter=ADAPTER,
               validate=_validate_colossal)
def qwen3_moe_async_colossal_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Colossal: K/V AllGather launched at their handoffs, reduce-scatter in backward."""
    group = _cp_group(cp_mesh)
    kv, q = _colossal(group)
    return _make_forward(target_module, "colossal", kv, q, None, None, AllGatherStrategy(group))


@inner_wrapper(method="ulysses", style="model", is_async=True, model_adapter=ADAPTER,
               validate=_validate_ulysses)
def qwen3_moe_async_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Pure Ulysses: Q/K/V seq->head A2A launched at their handoffs; inverse in backward."""
    group = _cp_group(cp_mesh)
    kv, q = _ulysses(group)
    return _make_forward(target_module, "ulysses", kv, q, group, None, UlyssesStrategy(group))


@inner_wrapper(method="hybrid", style="model", is_async=True, model_adapter=ADAPTER,
               validate=_validate_hybrid)
def qwen3_moe_async_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Async Hybrid: ulysses-group A2A chained into colossal-group K/V AllGather on the platform
    chain thread (full dependency chain, forward and backward; not half-async)."""
    colossal_group, ulysses_group = mesh.hybrid_groups(ulysses_degree)
    kv, q = _hybrid(colossal_group, ulysses_group)
    return _make_forward(target_module, "hybrid", kv, q, ulysses_group, ulysses_degree,
                         HybridStrategy(colossal_group, ulysses_group))
