"""The token-mixer methods' cost per layer (cost_model.py), from the exchanges their code issues:
sequence gather (hidden AllGather / ReduceScatter), the short-conv halo (``k - 1`` tokens of the
conv channels each way), Gated DeltaNet Ulysses (q/k/v/b/a and output All-to-All), state passing
(conv halo plus one fp32 AllGather of every rank's transition and final state, ReduceScatter back,
and what a state-passing layer saves beyond the module's own forward). Next to the balanced split
every mixer also moves its tokens to the contiguous layout and back (``relayout_bytes``). A mixer
whose exchanges are not modelled (DSA, Doge) prints only that relayout, or "not modelled".
Module shapes are read off the module (its conv, its heads and state sizes); no collective."""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from ..cost_model import CostModel, LayerShape, relayout_bytes, saved_bytes


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


class MixerCost(CostModel):
    """A token mixer: its own exchanges (:meth:`own_comm`), plus the relayout next to the balanced split."""

    def comm(self, x: LayerShape) -> dict:
        out = self.own_comm(x) if x.cp > 1 else {}
        return {**out, **relayout_bytes(x)} if x.permuted else out

    def own_comm(self, x: LayerShape) -> dict:
        return {}


class SequenceGatherCost(MixerCost):
    def own_comm(self, x: LayerShape) -> dict:
        g = x.local * x.H * x.elem * (x.cp - 1)
        return {"fwd hidden AllGather": g, "bwd ReduceScatter": g}


class HaloCost(MixerCost):
    def own_comm(self, x: LayerShape) -> dict:
        h, ch = _conv(x.module)
        return {"fwd halo": h * ch * x.elem, "bwd halo gradient": h * ch * x.elem}


class HeadAllToAllCost(MixerCost):
    """Gated DeltaNet Ulysses: q/k/v/b/a seq->head and the output head->seq All-to-All."""

    def own_comm(self, x: LayerShape) -> dict:
        m = x.module
        share = (x.cp - 1) / x.cp * x.local * x.elem
        s2h = (2 * m.key_dim + m.value_dim + 2 * m.num_v_heads) * share
        return {"fwd q/k/v/b/a + out All-to-All": s2h + m.value_dim * share,
                "bwd gradients All-to-All": s2h + m.value_dim * share}


class StatePassingCost(MixerCost):
    """Conv halo plus one fp32 AllGather of every rank's transition and state. ``saves``: what the
    layer saves beyond the module's forward on the rank whose first document continues the previous
    rank's — "delta_rule" (per-document packed fp32 core inputs, the fp32 output and its correction,
    the rule's second run from the identity state), "mamba2" (packed conv input, decay terms and
    output), or None."""

    def __init__(self, saves: str | None = None):
        self.saves = saves

    def own_comm(self, x: LayerShape) -> dict:
        h, ch = _conv(x.module)
        nt, ns = _state_numel(x.module)
        states = (nt + ns) * 4 * (x.cp - 1)
        return {"fwd conv halo": h * ch * x.elem, "fwd state AllGather": states,
                "bwd halo gradient": h * ch * x.elem, "bwd state ReduceScatter": states}

    def extra_saved(self, x: LayerShape) -> float:
        m, L = x.module, x.S // x.cp
        if self.saves == "delta_rule" and hasattr(m, "key_dim"):
            packs = (2 * m.key_dim + m.value_dim + 2 * m.num_v_heads) * 4 * L
            return x.B * (packs + 2 * m.value_dim * 4 * L + _rule_saved_bytes(m, L))
        if self.saves == "mamba2" and hasattr(m, "conv_dim"):
            return x.B * (m.conv_dim + 3 * m.num_heads + 2 * m.intermediate_size) * 4 * L
        return 0.0


def _rule_saved_bytes(module: nn.Module, L: int) -> float:
    """Bytes autograd saves in one call of the module's transformers delta-rule kernel over ``L``
    tokens from zero state (meta tensors; 0 when the module has no such kernel)."""
    rule = getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", None)
    if rule is None:
        return 0.0
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    mk = lambda *shape: torch.zeros(*shape, device="meta", requires_grad=True)   # noqa: E731
    return float(saved_bytes(lambda: rule(mk(1, L, hk, dk), mk(1, L, hk, dk), mk(1, L, hv, dv), g=mk(1, L, hv),
                                          beta=mk(1, L, hv), initial_state=None, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)))


NOT_MODELLED = MixerCost()
SEQUENCE_GATHER = SequenceGatherCost()
HALO = HaloCost()
HEAD_ALL_TO_ALL = HeadAllToAllCost()
STATE_PASSING = StatePassingCost()
DELTA_RULE_STATE_PASSING = StatePassingCost("delta_rule")
MAMBA2_STATE_PASSING = StatePassingCost("mamba2")
