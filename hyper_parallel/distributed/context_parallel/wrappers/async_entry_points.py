"""Generic async CP Targets for any attention implementing the handoff protocol (design 3.1.1 / 4.4).

Public paths: ``hyper_parallel.distributed.context_parallel.wrappers.<name>``:

=====================================  =====================================================
``async_colossal_cp_wrapper``          K/V AllGather launched at the K/V handoffs; ReduceScatter in backward
``async_ulysses_cp_wrapper``           Q/K/V seq->head A2A launched at their handoffs; inverse A2A in backward;
                                       output head->seq A2A sync (it feeds ``o_proj`` at once)
``async_hybrid_cp_wrapper``            (``ulysses_degree``) K/V: ulysses A2A chained into colossal AllGather
                                       on the comm thread; Q: ulysses A2A; backward mirrors both stages
``async_load_balance_cp_wrapper``      Head-Tail load balance, see its docstring for the launch/wait order
=====================================  =====================================================

Each works on an attention whose ``get_async_cp_handoffs()`` returns its four handoff modules
(:mod:`.async_handoff`); an attention without it is refused by name at preflight. The model
adapters (``hyper_parallel.models.<model_type>.adapter.distributed.context_parallel_async``) give
the HF attentions of Llama, Qwen2, Qwen3, Mistral and Qwen3-MoE the protocol and register their
own named Targets; ``model_adapter`` below lists those architectures (the planner requires an
async wrapper to name the models it is written for). A new model: implement the protocol and
register a thin ``@inner_wrapper(is_async=True, model_adapter=...)`` that calls
:func:`.async_handoff.install_async` (docs/async_cp.md, worked example).
"""
from __future__ import annotations

from ..registry import inner_wrapper
from .async_handoff import install_async, validate_async

__all__ = ["async_colossal_cp_wrapper", "async_ulysses_cp_wrapper", "async_hybrid_cp_wrapper",
           "async_load_balance_cp_wrapper", "HANDOFF_ADAPTERS"]

# architectures whose model adapter implements the handoff protocol (hyper_parallel/models/*/adapter)
HANDOFF_ADAPTERS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
_PKG = "hyper_parallel.distributed.context_parallel.wrappers"


def _validator(method: str, who: str, degree: bool):
    if degree:
        def validate(target_module, *, cp_size, ulysses_degree, tp_size=1, probe=True):
            validate_async(target_module, method, who, cp_size=cp_size, tp_size=tp_size,
                           ulysses_degree=ulysses_degree, probe=probe)
    else:
        def validate(target_module, *, cp_size, tp_size=1, probe=True):
            validate_async(target_module, method, who, cp_size=cp_size, tp_size=tp_size, probe=probe)
    validate.__qualname__ = f"validate[{who}]"
    return validate


def _public(fn):
    fn.__module__ = _PKG
    return fn


@inner_wrapper(method="colossal", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("colossal", "async_colossal_cp_wrapper", False))
@_public
def async_colossal_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Colossal: K and V AllGather launched at ``cp_k_handoff`` / ``cp_v_handoff`` (on the comm
    thread) and waited at ``cp_attn_wait``; Q stays local. Backward: the wait nodes launch the
    ReduceScatter of dK/dV, the launch nodes wait it right before the K/V projection backward."""
    return install_async("colossal", target_module, mesh, cp_mesh, "async_colossal_cp_wrapper")


@inner_wrapper(method="ulysses", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("ulysses", "async_ulysses_cp_wrapper", False))
@_public
def async_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Pure Ulysses: Q/K/V seq->head A2A launched at their handoffs; the output head->seq A2A
    is sync. Backward: inverse A2A of dQ/dK/dV launched at the wait nodes, waited at the handoffs.
    Every head layout the sync wrapper accepts (``Hq % Hk == 0``, ``Hq >= cp_size``): uneven
    query blocks and KV heads replicated when fewer than cp_size (the backward sums the copies'
    gradients), per :func:`..strategies.ulysses_layout.ulysses_head_layout`."""
    return install_async("ulysses", target_module, mesh, cp_mesh, "async_ulysses_cp_wrapper")


@inner_wrapper(method="hybrid", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("hybrid", "async_hybrid_cp_wrapper", True))
@_public
def async_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Async Hybrid (full async, not half-async): K/V ulysses-group A2A chained into the
    colossal-group AllGather on the comm thread, Q ulysses A2A; backward ReduceScatter(colossal)
    chained into the inverse A2A(ulysses). Output head->seq A2A sync. Head layouts as the sync
    Hybrid (``Hq >= ulysses_degree``; uneven / replicated KV on the ulysses sub-group, the
    colossal AllGather acting on each rank's KV-head shard unchanged)."""
    return install_async("hybrid", target_module, mesh, cp_mesh, "async_hybrid_cp_wrapper",
                         ulysses_degree=ulysses_degree)


@inner_wrapper(method="load_balance", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("load_balance", "async_load_balance_cp_wrapper", False))
@_public
def async_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Colossal Head-Tail (batch policy 'load_balance'; rank r computes sub-chunks
    head = r and tail = 2C-1-r of the 2C-way split).

    Forward, in this order::

        launch K AllGather  (cp_k_handoff)          \\ overlap the V projection and the
        launch V AllGather  (cp_v_handoff)          / whole Q branch (q_proj, norm, RoPE)
        launch Q dispatch   (cp_q_handoff: ONE sparse A2A carrying both Q branches, head then tail)
        wait Q, K, V        (cp_attn_wait)
        head branch:  engine(q_head, K[:(r+1)S/2C])        (first)
        tail branch:  engine(q_tail, K[:(2C-r)S/2C])       (second)
        combine (head, tail) -> contiguous chunk r (sync A2A: feeds o_proj at once)

    Both Q branches travel in one collective (they leave and arrive together, so one launch
    and one wait); the K/V gathers overlap compute, the Q dispatch overlaps the K/V gathers
    still in flight. Backward (autograd, reverse creation order): combine backward (dispatch of
    dO, sync) -> tail branch attention backward -> head branch attention backward -> the wait
    nodes launch the inverse collectives (dQ combine of (dq_head, dq_tail), dK/dV ReduceScatter)
    -> the Q launch node waits dQ first -> Q branch backward (RoPE, norm, q_proj grad GEMM)
    while dK/dV are in flight -> V, then K launch nodes wait -> V/K projection backward.
    (``tests/async_cp/test_async_protocol.py`` checks this order on the trace.)
    """
    return install_async("load_balance", target_module, mesh, cp_mesh, "async_load_balance_cp_wrapper")
