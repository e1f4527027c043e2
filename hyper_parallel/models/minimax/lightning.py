"""MiniMax's lightning attention (``MiniMaxLightningAttention``) under CP: ``lightning_state_passing``.

Every rank runs all heads on its own tokens: ``act(qkv_proj)``, the module's block recurrence
(decay ``lambda = exp(-slope_rate)``, one constant per head) per local document from a zero state,
the incoming ``K^T V`` state composed from the earlier ranks' ``(lambda^T, S_T)`` (one AllGather,
:func:`...mixers.state_passing.exchange_states`) and its contribution ``lambda^(t+1) q_t S_in`` in
closed form, then the RMS norm, the sigmoid output gate and ``out_proj``. Re-runs the module's
forward lines (transformers 5.24). docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers import state_passing as SP
from ...distributed.context_parallel.mixers.rows import CPMixerError, current_fqn, hidden_param, require_layout
from ...distributed.context_parallel.registry import inner_wrapper

__all__ = ["LIGHTNING_CLASSES", "lightning_state_passing_cp_wrapper", "validate_lightning_state_passing",
           "check_decay", "lightning_scan"]

LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)
WHAT = "lightning_state_passing_cp_wrapper"


def validate_lightning_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    require_layout(WHAT, target_module, tp_size, LIGHTNING_CLASSES, "MiniMax lightning attention",
                   ("qkv_proj", "act_fn", "norm", "output_gate", "out_proj", "slope_rate", "query_decay", "key_decay",
                    "diagonal_decay", "block_size", "num_attention_heads", "head_dim"))
    m = target_module
    if not m.slope_rate.is_meta:        # a meta model (the trainer plans before init) is checked at first call
        check_decay(m)


def check_decay(m: nn.Module) -> None:
    """The block decays (``query_decay``) are ``exp(-slope_rate * (1..block_size))`` per head: the decay
    the method passes between ranks in closed form is the module's; ValueError otherwise."""
    slope = m.slope_rate.detach().float().cpu()
    j = torch.arange(int(m.block_size), dtype=torch.float32) + 1
    if tuple(slope.shape) != (m.num_attention_heads, 1, 1) or not torch.allclose(
            m.query_decay.detach().float().cpu(), torch.exp(-slope * j[:, None]), rtol=1e-5, atol=0):
        raise ValueError(f"{WHAT}: {type(m).__name__}.query_decay is not exp(-slope_rate * (1..block_size)) per "
                         "head: the decay the method passes between ranks would differ from the module's; declare "
                         "sequence_gather (generic, exact) for it instead")


def lightning_scan(m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The module's block recurrence on ``q, k, v [N, H, T, d]`` from a zero state: ``(o [N, H, T, d],
    final K^T V state [N, H, d, d])`` — the lines of ``MiniMaxLightningAttention.forward``."""
    N, H, T, d = v.shape
    state = v.new_zeros(N, H, d, d)
    outs = []
    for start in range(0, T, m.block_size):
        end = min(start + m.block_size, T)
        n = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * m.diagonal_decay[:, :, :n, :n], vb)
        inter = torch.matmul(qb * m.query_decay[:, :n], state)
        outs.append(inter + intra)
        state = state * torch.exp(-m.slope_rate * n) + torch.matmul((kb * m.key_decay[:, -n:]).transpose(-1, -2), vb)
    return torch.cat(outs, dim=-2), state


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_lightning_state_passing)
def lightning_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for MiniMax's lightning attention: all heads on the local tokens.

    Exactness: ``S_t = lambda S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t`` with a constant ``lambda`` per
    head, so a run of ``t`` tokens started from ``S_in`` gives ``o_t = o0_t + lambda^(t+1) q_t S_in``
    and ``S_out = lambda^T S_in + S0_T``. Forward: ``act(qkv_proj)`` on the local tokens; the block
    recurrence per local document (rows left-aligned: leading pads keep a zero state, so a row's
    final state is its document's); one AllGather of every rank's ``(lambda^T, S0_T)`` (``B x H x
    (1 + d^2)`` floats per rank, independent of S); the closed-form correction for the document
    continuing from the previous rank; RMS norm, sigmoid gate, ``out_proj``. Backward: autograd (the
    AllGather's backward is a ReduceScatter to the owners). Packed documents restart the state;
    padding is never an input of a real token. Returns ``(output, None)``. Head rules: none.
    """
    del mesh, tp_mesh, ep_mesh
    m = target_module
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    H, d = m.num_attention_heads, m.head_dim
    checked = []

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(WHAT, fqn, name, cp_mesh, 0, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        if not checked:         # local, before any collective; the same on every rank
            try:
                check_decay(m)
            except ValueError as exc:
                raise CPMixerError(f"{exc} (module '{fqn}')") from None
            checked.append(True)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        qkv = m.act_fn(m.qkv_proj(hs)).reshape(B, L, H, 3 * d)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        cont, through = SP.chain_flags(key_doc, B, C, L)
        rows = SP.StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], B, L, hs.device, cont[r],
                            align="left")
        N, Lmax, c_idx, slot = rows.N, rows.Lmax, rows.first_cont, rows.slot
        q, k, v = (t.transpose(1, 2) for t in torch.split(rows.pack(qkv), d, dim=-1))     # [N, H, Lmax, d]
        o, sT = lightning_scan(m, q, k, v)
        # per-row token index inside its document, and lambda^(t+1) / lambda^len of every row
        t_idx = (slot.cumsum(1) - 1).clamp(min=0).to(o.dtype)                                # [N, Lmax]
        slope = m.slope_rate.view(1, H, 1).to(o.dtype)
        dec_last = [i if i >= 0 and bool(through[r, rb]) and int(rows.starts[i]) == 0 else -1
                    for rb, i in enumerate(rows.last)]
        trans = torch.exp(-slope[..., 0] * rows.lens.to(o.dtype)[:, None])                   # [N, H]
        anchor, s_in = SP.exchange_states(rows.per_batch_row(trans, dec_last, (H,)),
                                          rows.per_batch_row(sT, rows.last, (H, d, d)), q, cp_mesh, r, through,
                                          lambda t, s_: t[..., None, None] * s_, "cp.lightning_state")
        o = o + anchor
        if c_idx.numel() and s_in is not None:
            dec = torch.exp(-slope * (t_idx[c_idx][:, None, :] + 1)) * slot[c_idx][:, None, :].to(o.dtype)
            corr = torch.matmul(q[c_idx], s_in[rows.rows[c_idx]]) * dec[..., None]           # [n, H, Lmax, d]
            o = o.index_add(0, c_idx, corr)
        out = rows.unpack(o.transpose(1, 2).reshape(N, Lmax, H * d))                          # [B, L, H d]
        out = F.sigmoid(m.output_gate(hs)) * m.norm(out)
        return m.out_proj(out), None

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="lightning_state_passing", title="lightning attention state passing (MiniMax)", kind="mixer",
        cost="mixers.cost:STATE_PASSING",
        batch_policy="all_gather", head_rule="module", head_doc="none (all heads on the local tokens)",
        offers=(catalogue.Offer("hf", "lightning_state_passing_cp_wrapper", "lightning_state_passing",
                                module=__name__),)))
register_catalogue_names(__name__, globals())
