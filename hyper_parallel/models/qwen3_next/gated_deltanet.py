"""Qwen3-Next's and Qwen3.5's Gated DeltaNet (``GDN_CLASSES``) under CP: two exact mixer methods.

``gated_deltanet_ulysses``: the token-wise projections on the local tokens, a sequence->head
all-to-all of q/k/v and the b/a gates, the module's conv and delta rule per document on the whole
sequence for this rank's linear heads, head->sequence back, gated norm and ``out_proj``
(``linear_num_key_heads`` and ``linear_num_value_heads`` divisible by cp). ``gated_deltanet_state_passing``:
all heads on the local tokens, conv halo, the delta rule from a zero state plus, for a document
continuing from the previous rank, an identity-state run (the rule is affine in its initial state);
one AllGather of ``(transition, final state)`` per rank (:mod:`...mixers.state_passing`). Both
re-run the module's own forward lines (transformers 5.24; the classes differ only in their input
projections, :func:`project`). docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import platform as P
from ...distributed.context_parallel.collectives import resolve_group, ulysses_head_to_seq, ulysses_seq_to_head
from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers import state_passing as SP
from ...distributed.context_parallel.mixers.rows import (current_fqn, hidden_param, mixer_call, require_class,
                                                         run_rows)
from ...distributed.context_parallel.registry import inner_wrapper

__all__ = ["GDN_CLASSES", "gated_deltanet_ulysses_cp_wrapper", "gated_deltanet_state_passing_cp_wrapper"]


GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


def project(m: nn.Module, hs: torch.Tensor):
    """The module's token-wise input projections of ``hs [B, L, hidden]``: ``q, k [B, L, Hk, dk]``,
    ``v, z [B, L, Hv, dv]``, ``b, a [B, L, Hv]`` — Qwen3-Next's interleaved ``in_proj_qkvz``/``in_proj_ba``
    (``fix_query_key_value_ordering``) or Qwen3.5's separate ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/
    ``in_proj_a`` (``[q | k | v]`` channels, the conv's order); the rest of both forwards is the same."""
    if hasattr(m, "in_proj_qkvz"):
        return m.fix_query_key_value_ordering(m.in_proj_qkvz(hs), m.in_proj_ba(hs))
    B, L, _ = hs.shape
    q, k, v = torch.split(m.in_proj_qkv(hs), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    return (q.reshape(B, L, -1, m.head_k_dim), k.reshape(B, L, -1, m.head_k_dim), v.reshape(B, L, -1, m.head_v_dim),
            m.in_proj_z(hs).reshape(B, L, -1, m.head_v_dim), m.in_proj_b(hs), m.in_proj_a(hs))


def validate_gated_deltanet_ulysses(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    what = "gated_deltanet_ulysses_cp_wrapper"
    require_class(what, target_module, tp_size, GDN_CLASSES,
                  f"re-runs the forward of {', '.join(GDN_CLASSES)} head-parallel")
    cls = type(target_module).__name__
    hk, hv = target_module.num_k_heads, target_module.num_v_heads
    if hk % cp_size or hv % cp_size:
        raise ValueError(f"{what}: Ulysses splits the linear-attention heads over cp_size={cp_size}, but {cls} has "
                         f"linear_num_key_heads={hk}, linear_num_value_heads={hv} (both must be divisible by "
                         "cp_size) — declare sequence_gather, or a cp_size that divides them")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_gated_deltanet_ulysses)
def gated_deltanet_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Ulysses for the Gated DeltaNet (GDN_CLASSES): the token-wise projections on the local tokens, a
    sequence->head all-to-all of q/k/v/b/a (rank i gets linear heads [i*H/C, (i+1)*H/C) of the
    whole sequence), the module's causal conv1d (its weight's channels of those heads) and
    ``torch_chunk_gated_delta_rule`` per document on the full sequence, head->sequence all-to-all
    back, then the token-wise gated norm and ``out_proj``. The same lines as the module's forward
    (transformers 5.24), split by heads: compute / cp, 5 + 1 all-to-alls forward (and backward)."""
    del mesh, tp_mesh, ep_mesh
    what = "gated_deltanet_ulysses_cp_wrapper"
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, rule = hf.causal_conv1d_fn, hf.torch_chunk_gated_delta_rule
    dk, dv = m.head_k_dim, m.head_v_dim

    def forward(*args, **kwargs):
        entry = mixer_call(what, fqn, name, cp_mesh, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs = entry[:2]
        group = resolve_group(cp_mesh)
        C, r = P.group_size(group), P.group_rank(group)
        hk, hv = m.num_k_heads // C, m.num_v_heads // C
        B, L, _ = hs.shape
        q, k, v, z, b, a = project(m, hs)
        s2h = lambda x, t: ulysses_seq_to_head(x, group, seq_dim=1, head_dim=2, tag=f"cp.gdn_s2h_{t}")  # noqa: E731
        q, k, v = s2h(q.contiguous(), "q"), s2h(k.contiguous(), "k"), s2h(v.contiguous(), "v")       # [B, S, h, d]
        ba = s2h(torch.stack([b, a], dim=-1).contiguous(), "ba")                                      # [B, S, hv, 2]
        S = q.shape[1]
        ks, vs = slice(r * hk * dk, (r + 1) * hk * dk), slice(r * hv * dv, (r + 1) * hv * dv)
        w = m.conv1d.weight.squeeze(1)
        w = torch.cat([w[ks], w[m.key_dim:][ks], w[2 * m.key_dim:][vs]], dim=0)
        heads = slice(r * hv, (r + 1) * hv)
        A_log, dt_bias = m.A_log[heads], m.dt_bias[heads]
        feats = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1), ba.reshape(B, S, -1)],
                          dim=-1)
        nq, nv = hk * dk, hv * dv

        def core(x):                     # [N, T, F] -> [N, T, hv * dv]: the module's lines 683-755
            n, t = x.shape[:2]
            mixed, bb_aa = x[..., :2 * nq + nv], x[..., 2 * nq + nv:].reshape(n, t, hv, 2)
            mixed = conv_fn(mixed.transpose(1, 2), w, None, activation=m.activation).transpose(1, 2)
            qq, kk, vv = torch.split(mixed, [nq, nq, nv], dim=-1)
            qq, kk, vv = qq.reshape(n, t, hk, dk), kk.reshape(n, t, hk, dk), vv.reshape(n, t, hv, dv)
            beta = bb_aa[..., 0].sigmoid()
            g = -A_log.float().exp() * F.softplus(bb_aa[..., 1].float() + dt_bias)
            out, _ = rule(qq, kk, vv, g=g, beta=beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=True)
            return out.reshape(n, t, -1)

        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        o = run_rows(core, lambda x, a_, kw: ((x,), {}), feats, key_doc, 0, S, (), {}, mask_param=False,
                      what=what, fqn=fqn)                                                      # [B, S, hv*dv]
        o = ulysses_head_to_seq(o.reshape(B, S, hv, dv).contiguous(), group, seq_dim=1, head_dim=2,
                                tag="cp.gdn_h2s")                                              # [B, L, Hv, dv]
        o = m.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, L, -1)
        return m.out_proj(o)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward




def validate_gated_deltanet_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "gated_deltanet_state_passing_cp_wrapper"
    require_class(what, target_module, tp_size, GDN_CLASSES,
                  f"re-runs the forward of {', '.join(GDN_CLASSES)} with a passed recurrent state")




@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_gated_deltanet_state_passing)
def gated_deltanet_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for the Gated DeltaNet (GDN_CLASSES): every rank runs all heads on its own tokens.

    Exactness: the gated delta rule is affine in the incoming state. With ``S_t = A_t S_{t-1} +
    B_t`` (``A_t = exp(g_t)(I - beta_t k_t k_t^T)``, ``[dk, dk]`` per head) and ``o_t = S_t^T q_t``,
    a chunk started from state ``S_in`` gives ``o_t = o0_t + (P_t^T q_t) S_in`` and ``S_out = P_T
    S_in + S0_T``, where ``o0``/``S0`` are the chunk run from a zero state and ``P_t = A_t..A_1``.
    transformers' ``torch_chunk_gated_delta_rule`` computes ``P_t^T q_t`` and ``P_T`` when run on
    the same q/k/g/beta with values 0 (``[.., dk]``) and ``initial_state = I``.

    Forward (no rank waits for another's recurrence):
      1. token-wise projections on the local tokens; the causal conv1d on ``[halo + local]`` with the
         previous rank's last ``k - 1`` pre-conv tokens (:func:`halo_exchange`), per document;
      2. the delta rule per local document from a zero state (all documents) and, for the first
         document when it continues from the previous rank, the identity run above (2x the
         recurrence work of that document — the price of never idling);
      3. one AllGather of every rank's ``(P_T, S0_T)`` (``B x Hv x dk x (dk + dv)`` floats per rank);
         each rank composes the incoming state of its first document from ranks ``0..r-1`` (a
         chain that restarts where a document starts) and adds ``(P_t^T q_t) S_in`` to it;
      4. the token-wise gated norm and ``out_proj``.
    Backward: autograd through the same graph; the AllGather's backward is a ReduceScatter(sum) that
    returns each ``(P_T, S0_T)``'s gradient to its owner, the halo's to the previous rank.
    Packed documents: the state and the conv window restart at each document (exact w.r.t. documents
    as their own sequences, like every mixer method here). Head rules: none (no head split).
    """
    del mesh, tp_mesh, ep_mesh
    what = "gated_deltanet_state_passing_cp_wrapper"
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, rule = hf.causal_conv1d_fn, hf.torch_chunk_gated_delta_rule
    dk, dv, Hk, Hv = m.head_k_dim, m.head_v_dim, m.num_k_heads, m.num_v_heads
    h = int(m.conv1d.weight.shape[-1]) - 1
    conv = SP.module_conv(m, conv_fn)

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(what, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        q, k, v, z, b, a = project(m, hs)
        mixed = torch.cat([x.reshape(B, L, -1) for x in (q, k, v)], dim=-1)            # [B, L, F] pre-conv
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        mixed = SP.halo_conv(conv, mixed, cp_mesh, h, key_doc, r, what, fqn)              # [B, L, F], pads 0
        qq, kk, vv = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)                  # [B, L, Hv]
        core = SP.passed_delta_rule(rule, qq.reshape(B, L, Hk, dk), kk.reshape(B, L, Hk, dk),
                                    vv.reshape(B, L, Hv, dv), g, b.sigmoid(), key_doc, cp_mesh, C, r,
                                    "cp.gdn_state")                                     # [B, L, Hv, dv]
        # -- gated norm and out_proj as the module (padding outputs out_proj(norm(0, z)))
        core = core.to(hs.dtype)
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, L, -1)
        return m.out_proj(core)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="gated_deltanet_ulysses", title="Gated DeltaNet Ulysses (Qwen3-Next, Qwen3.5)", kind="mixer",
        cost="mixers.cost:HEAD_ALL_TO_ALL",
        batch_policy="all_gather", head_rule="module",
        head_doc="linear key and value heads divisible by cp_size",
        offers=(catalogue.Offer("hf", "gated_deltanet_ulysses_cp_wrapper", "gated_deltanet_ulysses",
                                module=__name__),)),
    catalogue.CPMethod(
        name="gated_deltanet_state_passing", title="Gated DeltaNet state passing (Qwen3-Next, Qwen3.5)", kind="mixer",
        cost="mixers.cost:DELTA_RULE_STATE_PASSING",
        batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local tokens; cp may exceed the linear head counts)",
        offers=(catalogue.Offer("hf", "gated_deltanet_state_passing_cp_wrapper", "gated_deltanet_state_passing",
                                module=__name__),)))
register_catalogue_names(__name__, globals())
