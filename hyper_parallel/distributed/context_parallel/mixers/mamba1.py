"""``mamba1_state_passing``: a Mamba1 (selective scan) mixer under CP, all channels on the local tokens.

For the transformers mixers whose torch forward is ``in_proj`` -> x | gate -> causal conv1d ->
``x_proj`` -> dt / B / C RMS norms -> ``dt_proj`` -> ``mamba_selective_scan`` (``D`` skip, ``silu(gate)``)
-> ``out_proj`` (Jamba's ``JambaMambaMixer``, Falcon-Mamba's ``FalconMambaMixer``: the same lines).
The decay ``exp(dt_t A)`` is diagonal (one value per channel and state), so the incoming state's
contribution is closed form: no second scan. docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..registry import inner_wrapper
from . import register_catalogue_names
from . import state_passing as SP
from .families import FamilyRegistry
from .rows import current_fqn, hidden_param, require_causal_depthwise, require_layout

__all__ = ["MAMBA1_FAMILIES", "mamba1_state_passing_cp_wrapper", "validate_mamba1_state_passing"]

#: classes whose torch forward is the Mamba1 lines above (dt / B / C norms included), registered by their
#: families (``models/jamba/``, ``models/falcon_mamba/``)
MAMBA1_FAMILIES = FamilyRegistry("mamba1_state_passing_cp_wrapper")
WHAT = "mamba1_state_passing_cp_wrapper"


def validate_mamba1_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    require_layout(WHAT, target_module, tp_size, MAMBA1_FAMILIES.classes(), "Mamba1 selective scan",
                   ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D", "dt_layernorm", "b_layernorm",
                    "c_layernorm", "intermediate_size", "ssm_state_size", "time_step_rank", "activation"))
    m, cls = target_module, type(target_module).__name__
    I, N = m.intermediate_size, m.ssm_state_size
    require_causal_depthwise(WHAT, m, "conv1d", I, "intermediate_size")
    if tuple(m.A_log.shape) != (I, N) or m.in_proj.out_features != 2 * I:
        raise ValueError(f"{WHAT}: {cls}.A_log {tuple(m.A_log.shape)} / in_proj ({m.in_proj.out_features} outputs) "
                         f"are not [intermediate_size, ssm_state_size] = [{I}, {N}] / x | gate; declare "
                         "sequence_gather (generic, exact) for it instead")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_mamba1_state_passing)
def mamba1_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for a Mamba1 mixer (a class of ``MAMBA1_FAMILIES``): all channels on the local tokens.

    Exactness: ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t`` (elementwise over ``[I, N]``),
    ``y_t = C_t h_t + D x_t``: a run started from ``h_in`` gives ``y_t = y0_t + C_t (exp(a_t) * h_in)``
    and ``h_out = exp(a_T) * h_in + h0_T`` with ``a_t = sum_{s<=t} dt_s A`` (``dt`` after ``dt_proj``'s
    bias and softplus, as the scan discretizes it). Forward: ``in_proj`` and the conv on ``[halo +
    local]`` per document; ``x_proj`` and the dt / B / C norms; transformers' ``mamba_selective_scan``
    per local document from a zero state (rows left-aligned: a row's final state is its document's;
    ``z`` applied after the correction); one AllGather of every rank's ``(exp(a_T), h0_T)`` (``B x I x
    2N`` floats per rank, independent of S); ``silu(gate)`` and ``out_proj``. Backward: autograd (the
    AllGather's backward is a ReduceScatter to the owners, the halo's gradient returns to the
    previous rank). Packed documents restart the state and the conv window. Head rules: none.
    """
    del mesh, tp_mesh, ep_mesh
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    scan = hf.mamba_selective_scan
    conv = SP.module_conv(m, hf.causal_conv1d_fn)
    h = int(m.conv1d.weight.shape[-1]) - 1
    I, Ns, R = m.intermediate_size, m.ssm_state_size, m.time_step_rank

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(WHAT, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        x, gate = m.in_proj(hs).chunk(2, dim=-1)                                          # [B, L, I] each
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        x = SP.halo_conv(conv, x, cp_mesh, h, key_doc, r, WHAT, fqn)
        ts, Bm, Cm = torch.split(m.x_proj(x), [R, Ns, Ns], dim=-1)
        dt = m.dt_layernorm(ts) @ m.dt_proj.weight.t()                                   # [B, L, I], before bias
        Bm, Cm = m.b_layernorm(Bm), m.c_layernorm(Cm)
        bias = m.dt_proj.bias.float() if m.dt_proj.bias is not None else None
        cont, through = SP.chain_flags(key_doc, B, C, L)
        rows = SP.StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], B, L, hs.device, cont[r],
                            align="left")
        c_idx, slot = rows.first_cont, rows.slot
        xr, dtr, Br, Cr = (rows.pack(t) for t in (x, dt, Bm, Cm))
        A = -torch.exp(m.A_log.float())                                                  # [I, Ns]
        y, hT = scan(xr.transpose(1, 2), dtr.transpose(1, 2), A, Br.transpose(1, 2), Cr.transpose(1, 2),
                     D=m.D.float(), z=None, delta_bias=bias, delta_softplus=True, return_last_state=True,
                     use_mambapy=getattr(m, "use_mambapy", False),
                     use_associative_scan=getattr(m, "use_associative_scan", False))      # [N, I, Lmax], [N, I, Ns]
        y = y.transpose(1, 2)                                                             # [N, Lmax, I]
        d = F.softplus(dtr.float() + (0 if bias is None else bias)) * slot[..., None].float()
        a = torch.cumsum(d[..., None] * A, dim=1)                                         # [N, Lmax, I, Ns]
        dec_last = [i if i >= 0 and bool(through[r, rb]) and int(rows.starts[i]) == 0 else -1
                    for rb, i in enumerate(rows.last)]
        anchor, s_in = SP.exchange_states(rows.per_batch_row(a[:, -1].exp(), dec_last, (I, Ns)),
                                          rows.per_batch_row(hT.float(), rows.last, (I, Ns)), xr, cp_mesh, r,
                                          through, lambda t, s_: t * s_, "cp.mamba1_state")
        y = y + anchor
        if c_idx.numel() and s_in is not None:
            corr = torch.einsum("nts,ntcs,ncs->ntc", Cr[c_idx].float(), a[c_idx].exp(), s_in[rows.rows[c_idx]])
            y = y.index_add(0, c_idx, (corr * slot[c_idx][..., None].float()).to(y.dtype))
        y = rows.unpack(y) * F.silu(gate)
        return m.out_proj(y.to(hs.dtype))

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


register_catalogue_names(__name__, globals())
