"""Falcon-H1's Mamba2 mixer (``FalconH1Mixer``) under CP: ``mamba2_state_passing``.

All heads on the local tokens: the module's token-wise lines, the causal conv with a ``k - 1``
token halo, transformers' ``mamba2_chunk_scan`` per local document from a zero state, and the
incoming SSM state's contribution in closed form (the decay is a scalar per head: no second scan);
one AllGather of ``(exp(a_T), h0_T)`` per rank (:mod:`...mixers.state_passing`).
docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers import state_passing as SP
from ...distributed.context_parallel.mixers.rows import current_fqn, hidden_param, require_class
from ...distributed.context_parallel.registry import inner_wrapper

__all__ = ["MAMBA2_CLASSES", "mamba2_state_passing_cp_wrapper"]


MAMBA2_CLASSES = ("FalconH1Mixer",)


def validate_mamba2_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "mamba2_state_passing_cp_wrapper"
    require_class(what, target_module, tp_size, MAMBA2_CLASSES,
                  f"re-runs the forward of {', '.join(MAMBA2_CLASSES)} with a passed SSM state")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_mamba2_state_passing)
def mamba2_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for a Mamba2 mixer (Falcon-H1's ``FalconH1Mixer``): all heads on the local tokens.

    Exactness: the SSD recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``
    has a scalar decay per head, so a chunk started from ``h_in`` gives ``y_t = y0_t + exp(a_t) C_t h_in``
    and ``h_out = exp(a_T) h_in + h0_T`` with ``a_t = sum_{s<=t} dt_s A`` (``dt`` after the module's
    ``dt_bias``, softplus and ``time_step_limit`` clamp): ``y0``/``h0`` come from transformers'
    ``mamba2_chunk_scan`` from a zero state (``return_final_states``), the correction is one einsum.

    Forward: the module's token-wise lines (``ssm_in_multiplier``, ``in_proj``, ``mup_vector``, split);
    the causal conv1d on ``[halo + local]`` per document (``k - 1`` pre-conv tokens from the previous
    rank, :func:`halo_exchange`); the scan per local document (rows left-aligned so a row's final state
    is its document's); one AllGather of every rank's ``(exp(a_T), h0_T)`` (``B x H x (1 + P x N)``
    per rank, independent of S) from which each rank composes the incoming state of its first document
    (a chain that restarts where a document starts); the gated norm (or ``silu`` gate) and ``out_proj``.
    No rank waits for another's scan, and no recurrence runs twice. Backward: autograd through the
    same graph (the AllGather's backward is a ReduceScatter(sum) to the owners; the halo's gradient
    returns to the previous rank). Packed documents restart the state and the conv window.
    """
    del mesh, tp_mesh, ep_mesh
    what = "mamba2_state_passing_cp_wrapper"
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, scan = hf.causal_conv1d_fn, hf.mamba2_chunk_scan
    H, Pd, Ns, G, I = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.intermediate_size
    h = int(m.conv_kernel_size) - 1
    lo_lim, hi_lim = (float(x) for x in m.time_step_limit)
    conv = SP.module_conv(m, conv_fn)

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(what, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        Bsz, L, _ = hs.shape
        dtype = hs.dtype
        proj = m.in_proj(hs * m.ssm_in_multiplier) * m.mup_vector
        gate, xbc, dt = proj.split([I, m.conv_dim, H], dim=-1)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        xbc = SP.halo_conv(conv, xbc, cp_mesh, h, key_doc, r, what, fqn)                  # [B, L, conv_dim], pads 0

        # -- local documents as LEFT-aligned rows: leading pads (x = 0) leave a zero state at zero
        cont, through = SP.chain_flags(key_doc, Bsz, C, L)
        rows = SP.StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], Bsz, L, hs.device, cont[r],
                          align="left")
        N, Lmax, c_idx, slot = rows.N, rows.Lmax, rows.first_cont, rows.slot
        xs, Bm, Cm = torch.split(rows.pack(xbc), [I, G * Ns, G * Ns], dim=-1)
        dtp = rows.pack(dt)
        A = -torch.exp(m.A_log.float())
        y0, hT = scan(xs.reshape(N, Lmax, H, Pd), dtp, A, Bm.reshape(N, Lmax, G, Ns), Cm.reshape(N, Lmax, G, Ns),
                      chunk_size=m.chunk_size, D=m.D, z=None, return_final_states=True, dt_bias=m.dt_bias,
                      dt_softplus=True, dt_limit=m.time_step_limit)                     # [N,Lmax,H,Pd], [N,H,Pd,Ns]
        # the per-head log decay of every real token, as the scan discretizes it
        dts = torch.clamp(F.softplus(dtp.float() + m.dt_bias.float()), min=lo_lim, max=hi_lim)
        a = torch.cumsum(dts * A * slot[..., None].float(), dim=1)                        # [N, Lmax, H]
        dec_last = [i if i >= 0 and bool(through[r, rb]) and int(rows.starts[i]) == 0 else -1
                    for rb, i in enumerate(rows.last)]
        anchor, s_in = SP.exchange_states(rows.per_batch_row(a[:, -1].exp(), dec_last, (H,)),
                                        rows.per_batch_row(hT, rows.last, (H, Pd, Ns)), xs, cp_mesh, r, through,
                                        lambda t, s_: t[..., None, None] * s_, "cp.mamba2_state")
        y = y0 + anchor
        if c_idx.numel() and s_in is not None:
            Ch = Cm[c_idx].reshape(len(c_idx), Lmax, G, Ns).float().repeat_interleave(H // G, dim=2)
            corr = torch.einsum("nths,nhps->nthp", Ch, s_in[rows.rows[c_idx]]) * a[c_idx].exp()[..., None]
            y = y.index_add(0, c_idx, corr * slot[c_idx][..., None, None].to(corr.dtype))
        scan_out = rows.unpack(y.reshape(N, Lmax, H * Pd))
        if m.mamba_rms_norm:
            scan_out = m.norm(scan_out, gate)
        else:
            scan_out = scan_out * F.silu(gate)
        return m.out_proj(scan_out.to(dtype))

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


register_catalogue_names(__name__, globals())
