"""RecurrentGemma's recurrent block (``RecurrentGemmaRecurrentBlock``: conv1d + RG-LRU) under CP:
``rglru_state_passing``.

Every rank runs all channels on its own tokens: ``linear_y`` / ``linear_x``, the conv1d with a
``k - 1`` token halo from the previous rank, the RG-LRU gates, the module's ``_rnn_scan`` per local
document from a zero state, the incoming state's contribution in closed form (the decay is diagonal:
``prod a_s * h_in``) from one AllGather of every rank's ``(prod a, h_T)``
(:func:`...mixers.state_passing.exchange_states`), then ``x * y`` and ``linear_out``. The state resets
where a document starts (position 0 at CP=1), not where a rank's chunk starts. Re-runs the module's
forward lines (transformers 5.24). docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel import catalogue
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers import state_passing as SP
from ...distributed.context_parallel.mixers.rows import (current_fqn, hidden_param, require_causal_depthwise,
                                                         require_layout)
from ...distributed.context_parallel.meta import current_cp_batch_meta
from ...distributed.context_parallel.registry import inner_wrapper

__all__ = ["RGLRU_CLASSES", "rglru_state_passing_cp_wrapper", "validate_rglru_state_passing"]

RGLRU_CLASSES = ("RecurrentGemmaRecurrentBlock",)
WHAT = "rglru_state_passing_cp_wrapper"


def validate_rglru_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    require_layout(WHAT, target_module, tp_size, RGLRU_CLASSES, "RG-LRU",
                   ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn", "lru_width"))
    m = target_module
    require_causal_depthwise(WHAT, m, "conv_1d", m.lru_width, "lru_width")
    if m.conv_1d.padding[0] != m.conv_1d.kernel_size[0] - 1:
        raise ValueError(f"{WHAT}: {type(m).__name__}.conv_1d is not causal (padding {m.conv_1d.padding[0]} != "
                         f"kernel - 1); declare sequence_gather (generic, exact) for it instead")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_rglru_state_passing,
               seq_dims={"attention_mask": None})   # the block reads no mask: documents come from the CP meta
def rglru_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for RecurrentGemma's recurrent block: all channels on the local tokens.

    Exactness: ``h_t = a_t * h_{t-1} + x~_t`` (diagonal ``a_t``; ``a = 0`` and no ``sqrt(1 - a^2)``
    normalization at a document's first token) gives, for a run started from ``h_in``,
    ``h_t = h0_t + (prod_{s<=t} a_s) * h_in`` and ``h_out = (prod a) * h_in + h0_T``. Forward: the
    projections, the conv on ``[halo + local]`` per document, the gates, ``_rnn_scan`` per local
    document (rows left-aligned: a row's final state is its document's), one AllGather of ``(prod a,
    h0_T)`` (``B x 2 lru_width`` floats per rank), the closed-form correction, ``x * y`` and
    ``linear_out``; returns ``(output, None)`` like the module. Backward: autograd. Packed documents
    restart the state and the conv window. Training only (the module's decode cache is not used).
    """
    del mesh, tp_mesh, ep_mesh
    m = target_module
    lru = m.rg_lru
    original = m.forward
    name = hidden_param(m)
    fqn = current_fqn()
    sqrt_bound = sys.modules[type(m).__module__].SqrtBoundDerivative.apply
    h = int(m.conv_1d.kernel_size[0]) - 1
    H, W = lru.num_attention_heads, lru.block_width

    def conv(x):                                                   # [N, T, F] -> [N, T, F]: the module's conv
        return m.conv_1d(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)

    def forward(*args, **kwargs):
        entry = SP.state_passing_entry(WHAT, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        y_branch = m.act_fn(m.linear_y(hs))
        conv_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        x = SP.halo_conv(conv, m.linear_x(hs), cp_mesh, h, conv_doc, r, WHAT, fqn)         # [B, L, lru_width]
        # the recurrence restarts at every document in either packed-document meaning: transformers
        # resets it where position_ids is 0 (``as_transformers`` keeps the documents from the conv only)
        key_doc = current_cp_batch_meta().key_doc
        key_doc = None if key_doc is None else key_doc.to(hs.device)
        cont, through = SP.chain_flags(key_doc, B, C, L)
        rows = SP.StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], B, L, hs.device, cont[r],
                            align="left")
        N, Lmax, c_idx, slot = rows.N, rows.Lmax, rows.first_cont, rows.slot
        xr = rows.pack(x)                                                                  # [N, Lmax, width]
        # a document's first token resets the state (position 0 at CP=1); a continuing row's does not
        first = slot & ~torch.cat([torch.zeros_like(slot[:, :1]), slot[:, :-1]], dim=1)
        reset = (first & ~torch.isin(torch.arange(N, device=hs.device), c_idx)[:, None])[..., None]
        act = xr.reshape(N * Lmax, H, W).permute(1, 0, 2)                                  # the module's gate lines
        res = torch.baddbmm(lru.input_gate_bias[:, None, :], act, lru.input_gate_weight)
        input_gate = torch.sigmoid(res.transpose(0, 1).reshape(N, Lmax, -1))
        res = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], act, lru.recurrent_gate_weight)
        recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(N, Lmax, -1))
        log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)
        a = torch.exp(log_a)
        multiplier = sqrt_bound(1 - torch.exp(2 * log_a))
        multiplier = reset + ~reset * multiplier
        x_in = xr * input_gate * multiplier.type(xr.dtype)
        h0, hT = lru._rnn_scan(hidden_states=x_in, recurrent_gate=a, reset=reset, recurrent_states=None)
        # prod of a over each row's real tokens (1 on the leading pads), for the continuing rows
        cum = torch.cumprod(torch.where(slot[..., None], a * ~reset, torch.ones_like(a)), dim=1)  # [N, Lmax, width]
        dec_last = [i if i >= 0 and bool(through[r, rb]) and int(rows.starts[i]) == 0 else -1
                    for rb, i in enumerate(rows.last)]
        width = xr.shape[-1]
        anchor, s_in = SP.exchange_states(rows.per_batch_row(cum[:, -1].float(), dec_last, (width,)),
                                          rows.per_batch_row(hT.float(), rows.last, (width,)), xr, cp_mesh, r,
                                          through, lambda t, s_: t * s_, "cp.rglru_state")
        out = h0 + anchor
        if c_idx.numel() and s_in is not None:
            corr = cum[c_idx] * s_in[rows.rows[c_idx]][:, None, :] * slot[c_idx][..., None].to(cum.dtype)
            out = out.index_add(0, c_idx, corr.to(out.dtype))
        out = rows.unpack(out) * y_branch
        return m.linear_out(out), None

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


# this family's rows of the CP method catalogue (their entry points are above)
catalogue.add_rows(
    catalogue.CPMethod(
        name="rglru_state_passing", title="RG-LRU state passing (RecurrentGemma)", kind="mixer",
        cost="mixers.cost:STATE_PASSING",
        batch_policy="all_gather", head_rule="module", head_doc="none (all channels on the local tokens)",
        offers=(catalogue.Offer("hf", "rglru_state_passing_cp_wrapper", "rglru_state_passing", module=__name__),)))
register_catalogue_names(__name__, globals())
