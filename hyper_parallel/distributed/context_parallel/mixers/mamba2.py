"""``mamba2_state_passing``: a Mamba2 (SSD) mixer under CP, all heads on the local tokens.

The model-independent core: the causal conv with a ``k - 1`` token halo from the previous rank,
transformers' ``mamba2_chunk_scan`` per local document from a zero state, the incoming SSM state's
contribution in closed form (the decay is a scalar per head: no second scan), one AllGather of
``(exp(a_T), h0_T)`` per rank (:mod:`.state_passing`). What differs between model families — how
the in-projection is formed, the norm / gate after the scan, which configurations are exact — is
a :class:`Mamba2Spec` its family registers with its class in :data:`MAMBA2_FAMILIES` from
``models/<model_type>/`` (or none: the gated-norm layout, :func:`gated_norm_spec`).
docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..registry import inner_wrapper
from . import register_catalogue_names
from . import state_passing as SP
from .families import FamilyRegistry
from .rows import current_fqn, hidden_param, require_class

__all__ = ["MAMBA2_FAMILIES", "Mamba2Spec", "gated_norm_spec", "mamba2_spec_for", "check_ssd_layout",
           "mamba2_state_passing_cp_wrapper"]

WHAT = "mamba2_state_passing_cp_wrapper"
#: the Mamba2 mixer classes ``mamba2_state_passing`` is exact for -> their family's spec (None: the
#: gated-norm layout), registered by the families (``models/<model_type>/__init__.py``)
MAMBA2_FAMILIES = FamilyRegistry(WHAT)


@dataclasses.dataclass(frozen=True)
class Mamba2Spec:
    """A model family's lines around the SSD scan.

    ``project(m, hs [B, L, hidden]) -> [B, L, I + conv_dim + H]`` (gate | xBC | dt, token-wise);
    ``finish(m, y [B, L, I] fp32-or-input dtype, gate [B, L, I]) -> [B, L, I]`` (norm / gate, before
    ``out_proj``); ``validate(m)`` raises ValueError (naming the class and the field) for a
    configuration the family's lines would not reproduce exactly."""
    family: str
    project: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    finish: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    validate: Optional[Callable[[nn.Module], None]] = None


def _in_proj(m: nn.Module, hs: torch.Tensor) -> torch.Tensor:
    return m.in_proj(hs)


def _norm_gate(m: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return m.norm(y, gate)


def _check_norm(m: nn.Module) -> None:
    cls, I = type(m).__name__, m.intermediate_size
    norm = getattr(m, "norm", None)
    gs = getattr(norm, "group_size", None)
    if norm is None or getattr(norm, "weight", None) is None or norm.weight.numel() != I or not gs or I % gs:
        raise ValueError(f"{WHAT}: {cls}.norm is not a gated RMS norm over intermediate_size = {I} in groups "
                         f"dividing it (group_size={gs}); declare sequence_gather (generic, exact) for it instead")


def gated_norm_spec(family: str) -> Mamba2Spec:
    """The spec of the transformers Mamba2 mixers whose torch forward is ``in_proj(hs)`` ->
    gate | xBC | dt -> conv -> scan -> ``norm(y, gate)`` (gated group RMS norm) -> ``out_proj``
    (Bamba, NemotronH, Granite 4, Zamba2: the same lines)."""
    return Mamba2Spec(family=family, project=_in_proj, finish=_norm_gate, validate=_check_norm)


def mamba2_spec_for(module: nn.Module) -> Optional[Mamba2Spec]:
    """The spec of ``module``'s class, or None when the class is not in :data:`MAMBA2_FAMILIES`:
    the one its family registered where the family has its own lines (Falcon-H1), else
    :func:`gated_norm_spec` (whose ``validate`` refuses any other layout)."""
    cls = type(module).__name__
    if cls not in MAMBA2_FAMILIES:
        return None
    return MAMBA2_FAMILIES.spec(cls) or gated_norm_spec(cls)


def check_ssd_layout(m: nn.Module) -> None:
    """The fields every transformers Mamba2 mixer's torch forward relies on; ValueError otherwise."""
    cls = type(m).__name__
    need = ("num_heads", "head_dim", "ssm_state_size", "n_groups", "intermediate_size", "conv_dim",
            "conv_kernel_size", "chunk_size", "time_step_limit", "in_proj", "conv1d", "out_proj", "A_log", "D",
            "dt_bias", "activation")
    missing = [f for f in need if not hasattr(m, f)]
    if missing:
        raise ValueError(f"{WHAT}: {cls} has no {', '.join(missing)}: not a transformers Mamba2 mixer layout")
    H, Pd, N, G, I = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.intermediate_size

    def bad(field: str, why: str):
        raise ValueError(f"{WHAT}: {cls}.{field} {why}; declare sequence_gather (generic, exact) for it instead")

    if H * Pd != I:
        bad("intermediate_size", f"= {I} != num_heads x head_dim = {H} x {Pd}")
    if G < 1 or H % G:
        bad("n_groups", f"= {G} does not divide num_heads = {H}")
    if m.conv_dim != I + 2 * G * N:
        bad("conv_dim", f"= {m.conv_dim} != intermediate_size + 2 x n_groups x ssm_state_size")
    if m.in_proj.out_features != I + m.conv_dim + H:
        bad("in_proj", f"has {m.in_proj.out_features} outputs, not gate | xBC | dt = {I + m.conv_dim + H}")
    w = m.conv1d.weight
    if m.conv1d.groups != m.conv_dim or w.shape[1] != 1 or w.shape[-1] != int(m.conv_kernel_size):
        bad("conv1d", "is not a depthwise causal conv of conv_kernel_size taps over conv_dim channels")
    if int(m.chunk_size) < 1:
        bad("chunk_size", f"= {m.chunk_size}")
    if tuple(m.A_log.shape) != (H,) or tuple(m.D.shape) != (H,) or tuple(m.dt_bias.shape) != (H,):
        bad("A_log", "/ D / dt_bias are not one value per head")
    lim = tuple(m.time_step_limit)
    if len(lim) != 2 or not float(lim[0]) <= float(lim[1]):
        bad("time_step_limit", f"= {lim} is not a (min, max) pair")


def validate_mamba2_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    classes = MAMBA2_FAMILIES.classes()
    require_class(WHAT, target_module, tp_size, classes,
                  f"re-runs the forward of {', '.join(classes)} with a passed SSM state")
    check_ssd_layout(target_module)
    spec = mamba2_spec_for(target_module)
    if spec.validate is not None:
        spec.validate(target_module)


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_mamba2_state_passing)
def mamba2_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for a Mamba2 mixer (the classes of ``MAMBA2_FAMILIES``): all heads on
    the local tokens.

    Exactness: the SSD recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``
    has a scalar decay per head, so a chunk started from ``h_in`` gives ``y_t = y0_t + exp(a_t) C_t h_in``
    and ``h_out = exp(a_T) h_in + h0_T`` with ``a_t = sum_{s<=t} dt_s A`` (``dt`` after the module's
    ``dt_bias``, softplus and ``time_step_limit`` clamp): ``y0``/``h0`` come from transformers'
    ``mamba2_chunk_scan`` from a zero state (``return_final_states``), the correction is one einsum.

    Forward: the family's token-wise in-projection (``spec.project``), split gate | xBC | dt; the
    causal conv1d on ``[halo + local]`` per document (``k - 1`` pre-conv tokens from the previous
    rank); the scan per local document (rows left-aligned so a row's final state is its document's);
    one AllGather of every rank's ``(exp(a_T), h0_T)`` (``B x H x (1 + P x N)`` per rank, independent
    of S) from which each rank composes the incoming state of its first document (a chain that
    restarts where a document starts); the family's norm / gate (``spec.finish``) and ``out_proj``.
    Backward: autograd through the same graph (the AllGather's backward is a ReduceScatter(sum) to
    the owners; the halo's gradient returns to the previous rank). Packed documents restart the
    state and the conv window; padding outputs ``out_proj(finish(0, gate))`` and is never an input.
    """
    del mesh, tp_mesh, ep_mesh
    m = target_module
    spec = mamba2_spec_for(m)
    if spec is None:        # installed without the plan-time validation
        validate_mamba2_state_passing(m, cp_size=0)
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    conv = SP.module_conv(m, hf.causal_conv1d_fn)
    scan = hf.mamba2_chunk_scan
    h = int(m.conv_kernel_size) - 1

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(WHAT, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        proj = spec.project(m, hs)
        gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        xbc = SP.halo_conv(conv, xbc, cp_mesh, h, key_doc, r, WHAT, fqn)                   # [B, L, conv_dim]
        y = ssd_scan_passed(m, scan, xbc, dt, key_doc, cp_mesh, C, r)
        return m.out_proj(spec.finish(m, y, gate).to(hs.dtype))

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


def ssd_scan_passed(m: nn.Module, scan: Callable, xbc: torch.Tensor, dt: torch.Tensor,
                    key_doc: Optional[torch.Tensor], cp_mesh, C: int, r: int) -> torch.Tensor:
    """``[B, L, I]``: the module's SSD scan (``D`` skip included) over this rank's post-conv ``xbc
    [B, L, conv_dim]`` and raw ``dt [B, L, H]`` as over the whole sequence: each local document from
    a zero state, plus ``exp(a_t) C_t h_in`` for the one continuing the previous rank's (``h_in``
    composed from the AllGathered per-rank maps). Tokens outside every document: 0."""
    Bsz, L, _ = xbc.shape
    H, Pd, Ns, G, I = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.intermediate_size
    lo_lim, hi_lim = (float(x) for x in m.time_step_limit)
    # local documents as LEFT-aligned rows: leading pads (x = 0) leave a zero state at zero
    cont, through = SP.chain_flags(key_doc, Bsz, C, L)
    rows = SP.StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], Bsz, L, xbc.device, cont[r],
                        align="left")
    N, Lmax, c_idx, slot = rows.N, rows.Lmax, rows.first_cont, rows.slot
    xs, Bm, Cm = torch.split(rows.pack(xbc), [I, G * Ns, G * Ns], dim=-1)
    dtp = rows.pack(dt)
    A = -torch.exp(m.A_log.float())
    y0, hT = scan(xs.reshape(N, Lmax, H, Pd), dtp, A, Bm.reshape(N, Lmax, G, Ns), Cm.reshape(N, Lmax, G, Ns),
                  chunk_size=m.chunk_size, D=m.D, z=None, return_final_states=True, dt_bias=m.dt_bias,
                  dt_softplus=True, dt_limit=m.time_step_limit)                         # [N,Lmax,H,Pd], [N,H,Pd,Ns]
    # the per-head log decay of every real token, as the scan discretizes it
    dts = torch.clamp(F.softplus(dtp.float() + m.dt_bias.float()), min=lo_lim, max=hi_lim)
    a = torch.cumsum(dts * A * slot[..., None].float(), dim=1)                            # [N, Lmax, H]
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
    return rows.unpack(y.reshape(N, Lmax, H * Pd))


register_catalogue_names(__name__, globals())
