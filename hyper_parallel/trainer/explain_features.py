"""The memory features and CP methods of ``hyper-train --explain`` beyond the attention methods of
:mod:`.explain_estimates`: Hybrid CP, the token-mixer methods, the tiled MLP and activation offload.

* :func:`method_name` — the catalogue row of a resolved CP target (attention wrappers carry it in
  their ``WrapperInfo``; a mixer wrapper is found by its entry function among the rows' offers);
* :func:`target_comm_bytes` — bytes one rank sends for one declared layer and one row (forward and
  backward, per exchange), from the exchanges the method's code issues: Hybrid (Ulysses All-to-All
  inside the degree ``u``, K/V AllGather / dK/dV ReduceScatter across ``cp / u``, the backward
  K/V regather), sequence gather, the short-conv halo, Gated DeltaNet Ulysses (q/k/v/b/a and the
  output All-to-All) and the state-passing methods (conv halo plus one AllGather of every rank's
  transition and final state, fp32);
* :func:`hybrid_gathered_bytes` — the one layer's gathered K/V a Hybrid layer holds while it runs;
* :func:`tiled_mlp_transient` — what a tiled MLP's backward holds for one chunk (intermediates,
  their gradients and the fp32 parameter-gradient accumulators of one MLP);
* :func:`offload_split` — device / host bytes of the checkpointed layer inputs under activation
  offload (on CPU the host buffers are tensors of the same memory).
docs/trainer.md "--explain" states the measured error of each.
"""
from __future__ import annotations

import torch.nn as nn


def method_name(target) -> str:
    """The catalogue row name of ``target`` (a ResolvedCPTarget), or ``"custom"``."""
    from ..distributed.context_parallel.catalogue import METHODS

    if target.info is not None and target.info.method != "custom":
        return target.info.method
    entry = getattr(target.fn, "__name__", "")
    for row in METHODS.values():
        if any(o.entry == entry for o in row.offers):
            return row.name
    return "custom"


def _conv(m: nn.Module) -> tuple[int, int]:
    """(kernel - 1 halo tokens, conv channels) of the module's causal depthwise conv, or (0, 0)."""
    for c in m.modules():
        if isinstance(c, nn.Conv1d):
            return int(c.kernel_size[0]) - 1, int(c.in_channels)
    return 0, 0


def _state_numel(m: nn.Module) -> tuple[int, int]:
    """(transition, state) elements per row that a state-passing mixer all-gathers (fp32)."""
    if hasattr(m, "head_k_dim") and hasattr(m, "num_v_heads"):          # Gated DeltaNet / KDA: S [Hv, dk, dv]
        hv, dk, dv = m.num_v_heads, m.head_k_dim, getattr(m, "head_v_dim", m.head_k_dim)
        return hv * dk * dk, hv * dk * dv
    if hasattr(m, "ssm_state_size") and hasattr(m, "num_heads"):         # Mamba2: decay [H], S [H, hd, N]
        hd = getattr(m, "head_dim", 0) or getattr(m, "intermediate_size", 0) // m.num_heads
        return m.num_heads, m.num_heads * hd * m.ssm_state_size
    if hasattr(m, "ssm_state_size"):                                    # Mamba1: [I, N]
        n = getattr(m, "intermediate_size", 0) * m.ssm_state_size
        return n, n
    width = next((p.shape[-1] for p in m.parameters()), 0)             # a diagonal recurrence of the width
    return width, width


def _gather_comm(m: nn.Module, L: float, cp: int, H: int, elem: int) -> dict:
    g = L * H * elem * (cp - 1)
    return {"fwd hidden AllGather": g, "bwd ReduceScatter": g}


def _halo_comm(m: nn.Module, L: float, cp: int, H: int, elem: int) -> dict:
    h, ch = _conv(m)
    return {"fwd halo": h * ch * elem, "bwd halo gradient": h * ch * elem}


def _gdn_ulysses_comm(m: nn.Module, L: float, cp: int, H: int, elem: int) -> dict:
    share = (cp - 1) / cp * L * elem
    s2h = (2 * m.key_dim + m.value_dim + 2 * m.num_v_heads) * share
    return {"fwd q/k/v/b/a + out All-to-All": s2h + m.value_dim * share,
            "bwd gradients All-to-All": s2h + m.value_dim * share}


def _state_passing_comm(m: nn.Module, L: float, cp: int, H: int, elem: int) -> dict:
    h, ch = _conv(m)
    nt, ns = _state_numel(m)
    states = (nt + ns) * 4 * (cp - 1)
    return {"fwd conv halo": h * ch * elem, "fwd state AllGather": states,
            "bwd halo gradient": h * ch * elem, "bwd state ReduceScatter": states}


#: every mixer row of the catalogue -> its comm model ``f(module, S/cp, cp, H, elem)``, or None where
#: --explain prints "not modelled" (a test checks the keys against the catalogue's mixer rows)
MIXER_COMM = {
    "sequence_gather": _gather_comm, "short_conv_halo": _halo_comm, "gated_deltanet_ulysses": _gdn_ulysses_comm,
    "gated_deltanet_state_passing": _state_passing_comm, "mamba2_state_passing": _state_passing_comm,
    "mamba1_state_passing": _state_passing_comm, "rglru_state_passing": _state_passing_comm,
    "kda_state_passing": _state_passing_comm, "lightning_state_passing": _state_passing_comm,
    "dsa_all_gather": None, "doge_dynamic_mask": None,
}


def _is_hybrid(name: str) -> bool:
    from ..distributed.context_parallel.catalogue import METHODS, has_ulysses_degree

    return name in METHODS and has_ulysses_degree(METHODS[name])


def target_comm_bytes(name: str, module: nn.Module, params: dict, *, S: int, cp: int, hq: int, hk: int, d: int,
                      H: int, elem: int) -> dict:
    """Bytes one rank sends for one layer of method ``name`` and one row of global length ``S``
    (forward / backward per exchange); {} for cp 1 and for methods not known here."""
    if cp <= 1:
        return {}
    L = S / cp
    if _is_hybrid(name):
        u = int(params.get("ulysses_degree", 1))
        ring = cp // u
        a2a = (u - 1) / u * L * d * elem
        kv = 2 * hk * d * L * elem * (ring - 1)        # the head-exchanged K/V shard to each ring peer
        return {"fwd Q/K/V/O All-to-All": (2 * hq + 2 * hk) * a2a, "fwd K/V AllGather": kv,
                "bwd K/V regather": kv, "bwd dK/dV ReduceScatter": kv,
                "bwd dO/dQ/dK/dV All-to-All": (2 * hq + 2 * hk) * a2a}
    model = MIXER_COMM.get(name)
    return model(module, L, cp, H, elem) if model is not None else {}


def hybrid_gathered_bytes(plan, S: int, hk: int, d: int, elem: int, B: int) -> float:
    """One Hybrid layer's gathered K/V ``[B, Hk/u, S, D]`` x 2 while it runs (the largest ``1/u``)."""
    us = [int(t.params.get("ulysses_degree", 1)) for t in plan.cp_targets if _is_hybrid(method_name(t))]
    return 2 * S * max(1, hk // min(us)) * d * elem * B if us else 0.0


def tiled_mlp_transient(model: nn.Module, mlp_names: list, chunk: int, s_local: int, B: int, elem: int) -> float:
    """A tiled MLP's backward for one chunk of ``chunk`` tokens: the recomputed intermediates it
    saves (every Linear output but the last, and the activation's), two intermediate-sized
    gradients alive at a time, plus the fp32 accumulators of one MLP's parameters."""
    if not mlp_names:
        return 0.0
    mlp = model.get_submodule(mlp_names[0])
    lin = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    width = lin[0].out_features if lin else 0
    inter = sum(m.out_features for m in lin[:-1]) + width + 2 * width   # saved + the activation's + 2 gradients
    tokens = min(chunk, s_local) * B
    acc = sum(p.numel() for p in mlp.parameters()) * 4
    return tokens * inter * elem + acc


def offload_split(L: int, s_local: int, B: int, H: int, elem: int) -> tuple[float, float]:
    """(device bytes kept, host bytes) of the layer inputs under activation offload: all ``L``
    inputs go to host, two come back at a time (the layer being recomputed and the prefetched one)."""
    per = s_local * B * H * elem
    return 2 * per * (L > 1), L * per


def _rule_saved_bytes(module: nn.Module, L: int) -> float:
    """Bytes autograd saves in one call of the module's transformers delta-rule kernel over ``L``
    tokens from zero state (meta tensors; 0 when the module has no such kernel)."""
    import sys

    import torch

    rule = getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", None)
    if rule is None:
        return 0.0
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    seen: dict = {}

    def pack(t):
        base = t._base if t._base is not None else t
        seen[id(base)] = base.numel() * base.element_size()
        return t

    mk = lambda *shape: torch.zeros(*shape, device="meta", requires_grad=True)   # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rule(mk(1, L, hk, dk), mk(1, L, hk, dk), mk(1, L, hv, dv), g=mk(1, L, hv), beta=mk(1, L, hv),
             initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return float(sum(seen.values()))


def state_passing_extra(name: str, module: nn.Module, s_local: int, B: int) -> float:
    """What a state-passing layer saves beyond the module's own forward on the same tokens, on the
    rank whose first local document continues the previous rank's (the largest): the per-document
    packed fp32 copies of the core inputs, the fp32 output and its correction term; for a delta
    rule also its second run (values 0, identity initial state) over the continuing document,
    bounded by all local tokens. 0 for the other methods."""
    m, L = module, s_local
    if name in ("gated_deltanet_state_passing", "kda_state_passing") and hasattr(m, "key_dim"):
        packs = (2 * m.key_dim + m.value_dim + 2 * m.num_v_heads) * 4 * L
        return B * (packs + 2 * m.value_dim * 4 * L + _rule_saved_bytes(m, L))
    if name == "mamba2_state_passing" and hasattr(m, "conv_dim"):
        return B * (m.conv_dim + 3 * m.num_heads + 2 * m.intermediate_size) * 4 * L
    return 0.0


def relayout_bytes(S: int, cp: int, H: int, elem: int) -> dict:
    """A token mixer next to the balanced split: its hidden states move to the contiguous layout and
    its output back (one all-to-all each; a rank sends the tokens that change rank, (cp-1)/cp of
    its ``S/cp`` on average), and the same two exchanges in backward."""
    one = (cp - 1) / cp * (S / cp) * H * elem
    return {"fwd relayout All-to-All": 2 * one, "bwd relayout All-to-All": 2 * one}
