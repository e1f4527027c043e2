"""Kimi Linear's KDA (``KimiLinearDeltaAttention``) under CP: ``kda_state_passing``.

Every rank runs all linear heads on its own tokens: the q/k/v projections and the causal conv1d
with a ``k - 1`` token halo from the previous rank, the forget gate (a decay per head and key
channel) and ``beta``, the module's ``chunk_kimi_delta_attention`` per local document, the
incoming recurrent state composed from the earlier ranks' affine maps (the delta rule with a
per-channel decay is affine in its initial state: :func:`...mixers.state_passing.passed_delta_rule`,
the same composition as the Gated DeltaNet's), then the gated RMS norm and ``o_proj``. Re-runs the
module's forward lines (transformers 5.24). docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers import state_passing as SP
from ...distributed.context_parallel.mixers.rows import (current_fqn, hidden_param, require_causal_depthwise,
                                                         require_layout)
from ...distributed.context_parallel.registry import inner_wrapper

__all__ = ["KDA_CLASSES", "kda_state_passing_cp_wrapper", "validate_kda_state_passing"]

KDA_CLASSES = ("KimiLinearDeltaAttention",)
WHAT = "kda_state_passing_cp_wrapper"


def validate_kda_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    require_layout(WHAT, target_module, tp_size, KDA_CLASSES, "Kimi Linear KDA",
                   ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
                    "o_proj", "num_heads", "head_dim", "activation"))
    m = target_module
    require_causal_depthwise(WHAT, m, "conv1d", 3 * m.num_heads * m.head_dim, "q | k | v")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_kda_state_passing)
def kda_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for Kimi Linear's KDA: all heads on the local tokens.

    Exactness: ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T`` and
    ``o_t = S_t^T q_t`` (``g_t`` one log decay per head and key channel) is affine in ``S_{t-1}``:
    a chunk started from ``S_in`` gives ``o_t = o0_t + (P_t^T q_t) S_in``, ``S_out = P_T S_in + S0_T``.
    Forward: projections on the local tokens; the conv on ``[halo + local]`` per document; the
    module's chunk kernel per local document from a zero state plus, for the document continuing
    from the previous rank, an identity-state run (``P_t^T q_t``, ``P_T``); one AllGather of every
    rank's ``(P_T, S0_T)`` (``B x H x dk x 2 dk`` floats per rank, independent of S); gated norm and
    ``o_proj``. Backward: autograd (the AllGather's backward is a ReduceScatter to the owners, the
    halo's gradient returns to the previous rank). Packed documents restart the state and the conv
    window; padding is never an input of a real token. Head rules: none.
    """
    del mesh, tp_mesh, ep_mesh
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    rule = hf.chunk_kimi_delta_attention
    conv = SP.module_conv(m, hf.causal_conv1d_fn)
    H, d = m.num_heads, m.head_dim
    h = int(m.conv1d.weight.shape[-1]) - 1

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(WHAT, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        mixed = torch.cat([m.q_proj(hs), m.k_proj(hs), m.v_proj(hs)], dim=-1)              # [B, L, 3 H d] pre-conv
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        mixed = SP.halo_conv(conv, mixed, cp_mesh, h, key_doc, r, WHAT, fqn)
        q, k, v = (t.reshape(B, L, H, d) for t in torch.split(mixed, [H * d] * 3, dim=-1))
        g = m.forget_gate(hs)                                                              # [B, L, H, d] fp32
        beta = torch.sigmoid(m.b_proj(hs))                                                 # [B, L, H]
        core = SP.passed_delta_rule(rule, q, k, v, g, beta, key_doc, cp_mesh, C, r, "cp.kda_state")
        gate = m.g_b_proj(m.g_a_proj(hs)).view(B, L, H, d)
        return m.o_proj(m.o_norm(core.to(hs.dtype), gate).reshape(B, L, -1))

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="kda_state_passing", title="KDA state passing (Kimi Linear)", kind="mixer", batch_policy="all_gather",
        cost="mixers.cost:DELTA_RULE_STATE_PASSING",
        head_rule="module", head_doc="none (all heads on the local tokens)",
        offers=(catalogue.Offer("hf", "kda_state_passing_cp_wrapper", "kda_state_passing", module=__name__),)))
register_catalogue_names(__name__, globals())
