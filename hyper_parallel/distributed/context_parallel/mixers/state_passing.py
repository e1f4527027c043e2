"""Building blocks of the state-passing mixer methods (a recurrence run on the local tokens with
the state the earlier ranks hand over; the model-specific methods live in ``models/<model_type>/``).

A rank's chunk is split into its documents (:class:`StateRows`); :func:`chain_flags` says which
chunk continues the previous rank's last document; :func:`halo_conv` runs a causal conv as over
the whole sequence; :func:`exchange_states` AllGathers every rank's ``(transition, final state)``
— independent of S — and composes this rank's incoming state locally (the recurrence is affine in
its initial state), so no rank waits for another's scan. Backward: autograd (the AllGather's
backward is a ReduceScatter to the owners).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from .... import platform as P
from ..comm import all_gather_seq, halo_exchange, resolve_group
from .rows import CPMixerError, mixer_call, run_rows, segments

__all__ = ["pack_rows", "chain_flags", "module_conv", "state_passing_entry", "halo_conv", "StateRows",
           "exchange_states", "passed_delta_rule"]


def pack_rows(doc: Optional[torch.Tensor], B: int, L: int, device):
    """Document runs of the local chunk as rows: (row, start, length) int64 tensors, every run
    inside ``[0, L)``; ``doc`` None = one run per batch row."""
    if doc is None:
        z = torch.zeros(B, dtype=torch.int64, device=device)
        return torch.arange(B, device=device), z, torch.full((B,), L, dtype=torch.int64, device=device)
    return segments(doc, 0, L)


def chain_flags(key_doc: Optional[torch.Tensor], B: int, C: int, L: int):
    """Per CP rank j and batch row b (``[C, B]`` bool): ``cont`` — chunk j's first token continues
    the document of chunk j-1's last token (it starts from the passed state); ``through`` — chunk j
    is one run of that continuing document, so its outgoing state is an affine map of the incoming
    one (else the outgoing state does not depend on it)."""
    if key_doc is None:
        cont = torch.ones(C, B, dtype=torch.bool)
        cont[0] = False
        return cont, cont.clone()
    kd = key_doc.detach().to("cpu").view(B, C, L).transpose(0, 1)                 # [C, B, L]
    first, last_prev = kd[:, :, 0], torch.roll(kd[:, :, -1], 1, dims=0)
    cont = (first >= 0) & (first == last_prev)
    cont[0] = False
    through = cont & (kd == first[..., None]).all(-1)
    return cont, through


def module_conv(m: nn.Module, conv_fn: Callable) -> Callable:
    """``[N, T, F] -> [N, T, F]``: the module's causal ``conv1d`` (weight, bias, activation) through
    transformers' ``causal_conv1d_fn`` — the call the module's own forward makes."""
    def conv(x):
        return conv_fn(x.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias,
                       activation=m.activation).transpose(1, 2)
    return conv


def state_passing_entry(what: str, fqn: str, name: str, cp_mesh, h: int, args: tuple, kwargs: dict):
    """Common start of a state-passing forward: ``None`` at cp 1 (run the original), else
    ``(meta, hidden_states, C, r)`` after the local checks (``L >= h`` for the conv halo)."""
    entry = mixer_call(what, fqn, name, cp_mesh, args, kwargs)
    if entry is None:
        return None
    meta, hs = entry[:2]
    group = resolve_group(cp_mesh)
    L = hs.shape[1]
    if L < h:
        raise CPMixerError(f"{what} on '{fqn}': {L} tokens per CP rank < conv kernel - 1 = {h}: the conv halo "
                           "would span more than one rank; use longer sequences or fewer CP ranks")
    return meta, hs, P.group_size(group), P.group_rank(group)


def halo_conv(conv: Callable, x: torch.Tensor, cp_mesh, h: int, key_doc: Optional[torch.Tensor], r: int,
               what: str, fqn: str) -> torch.Tensor:
    """A causal conv (kernel ``h + 1``) over this rank's ``x [B, L, F]`` as over the whole sequence:
    the previous rank's last ``h`` tokens in front (:func:`halo_exchange`), each document its own row
    (the window restarts at a document start; padding outputs 0), the halo outputs dropped."""
    B, L, _ = x.shape
    ext = halo_exchange(x, cp_mesh, h)                                                   # [B, h + L, F]
    ident = lambda t, a_, kw: ((t,), {})                                                 # noqa: E731
    if key_doc is None:
        if r == 0:      # no predecessor (still through ext: the halo's backward runs on every rank)
            return run_rows(conv, ident, ext[:, h:], None, 0, L, (), {}, mask_param=False, what=what, fqn=fqn)
        return run_rows(conv, ident, ext, None, h, h + L, (), {}, mask_param=False, what=what, fqn=fqn)
    lo = r * L
    halo_doc = (key_doc[:, lo - h:lo] if r > 0 else
                torch.full((B, h), -1, dtype=key_doc.dtype, device=key_doc.device))
    return run_rows(conv, ident, ext, torch.cat([halo_doc, key_doc[:, lo:lo + L]], dim=1), h, h + L, (), {},
                     mask_param=False, what=what, fqn=fqn)


class StateRows:
    """The documents of this rank's chunk as rows ``[N, Lmax, ...]`` for a recurrent scan.

    ``align="right"``: a row starts at slot 0 and is zero-padded after its end (the scan must leave
    the state unchanged on those pads); ``"left"``: zero pads come first (a zero state stays zero).
    ``cont[b]`` says whether batch row ``b``'s first run continues the previous rank's last document
    (:func:`chain_flags`); ``first_cont`` are the indices of those runs, ``last[b]`` the run ending
    this chunk (``-1``: none). :meth:`pack` / :meth:`unpack` move ``[B, L, ...]`` <-> rows."""

    def __init__(self, local_doc: Optional[torch.Tensor], B: int, L: int, device, cont_r: torch.Tensor,
                 align: str = "right"):
        rows, starts, lens = pack_rows(local_doc, B, L, device)
        if rows.numel() == 0:           # no real token here: one empty row keeps the graph on every rank
            rows, starts, lens = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(3))
        self.B, self.L, self.rows, self.starts, self.lens = B, L, rows, starts, lens
        self.N, self.Lmax = int(rows.numel()), max(int(lens.max()), 1)
        j = torch.arange(self.Lmax, device=device)
        off = (self.Lmax - lens) if align == "left" else torch.zeros_like(lens)
        self.slot = (j[None, :] >= off[:, None]) & (j[None, :] < (off + lens)[:, None])     # [N, Lmax]
        pos = torch.where(self.slot, j[None, :] - off[:, None], 0)
        self.flat = (rows[:, None] * L + starts[:, None] + pos).reshape(-1)
        self.first_cont = ((starts == 0) & (lens > 0) & cont_r.to(device)[rows]).nonzero(as_tuple=True)[0]
        self.last = [-1] * B
        for i, (rb, st, ln) in enumerate(zip(rows.tolist(), starts.tolist(), lens.tolist())):
            if ln and st + ln == L:
                self.last[rb] = i

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        rest = tuple(t.shape[2:])
        p = t.reshape(self.B * self.L, *rest).index_select(0, self.flat).view(self.N, self.Lmax, *rest)
        return p * self.slot.view(self.N, self.Lmax, *([1] * len(rest))).to(p.dtype)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, Lmax, F]`` -> ``[B, L, F]`` (tokens outside every document: 0)."""
        sel = self.slot.reshape(-1)
        out = y.reshape(self.N * self.Lmax, -1)[sel]
        return out.new_zeros(self.B * self.L, out.shape[-1]).index_add(0, self.flat[sel], out).view(
            self.B, self.L, -1)

    def per_batch_row(self, values: torch.Tensor, idx: list, shape: tuple) -> torch.Tensor:
        """``[B, *shape]``: ``values[idx[b]]`` for each batch row (0 where ``idx[b] < 0``)."""
        out = values.new_zeros((self.B,) + tuple(shape))
        for rb, i in enumerate(idx):
            if i >= 0:
                out = out.index_copy(0, torch.tensor([rb], device=out.device), values[i][None])
        return out


def exchange_states(trans: torch.Tensor, state: torch.Tensor, anchor: torch.Tensor, cp_mesh, r: int,
                     through: torch.Tensor, apply: Callable, tag: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One AllGather of every rank's ``(transition, final state)`` (``[B, ...]`` each, flattened side
    by side) and this rank's incoming state composed from ranks ``0..r-1``:
    ``s_in(j+1) = apply(trans_j, s_in(j)) + state_j`` where chunk j is one run of a continuing
    document (``through[j]``), else ``state_j``. ``anchor`` (a tensor of this rank's graph) keeps
    both ends connected on every rank, so the AllGather's backward ReduceScatter runs everywhere.
    Returns ``(anchor_term, s_in)``: add ``anchor_term`` (0) to the output; ``s_in`` is None on rank 0."""
    B = state.shape[0]
    packed = torch.cat([trans.reshape(B, -1), state.reshape(B, -1)], dim=-1).unsqueeze(1) + anchor.sum() * 0
    allst = all_gather_seq(packed.contiguous(), cp_mesh, dim=1, tag=tag)                  # [B, C, n_t + n_s]
    nt = trans[0].numel()
    s_in = None
    if r > 0:
        s_in = state.new_zeros(state.shape)
        for jr in range(r):
            tj = allst[:, jr, :nt].view(trans.shape)
            sj = allst[:, jr, nt:].view(state.shape)
            thr = through[jr].to(state.device).view(B, *([1] * (state.dim() - 1)))
            s_in = torch.where(thr, apply(tj, s_in), torch.zeros_like(s_in)) + sj
    return allst.sum() * 0, s_in


def passed_delta_rule(rule: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, key_doc: Optional[torch.Tensor], cp_mesh, C: int, r: int,
                      tag: str) -> torch.Tensor:
    """``[B, L, Hv, dv]`` (fp32): a gated delta rule over this rank's post-conv ``q, k [B, L, Hk, dk]``,
    ``v [B, L, Hv, dv]``, decay ``g [B, L, Hv(, dk)]`` (log space) and ``beta [B, L, Hv]`` as over the
    whole sequence. ``rule`` is the module's transformers chunk kernel (``torch_chunk_gated_delta_rule``
    or ``chunk_kimi_delta_attention``: same call). The rule is affine in its initial state: each local
    document runs from a zero state; the one continuing the previous rank's also runs with values 0
    and ``initial_state = I``, giving ``P_t^T q_t`` and ``P_T``; :func:`exchange_states` composes the
    incoming state and ``(P_t^T q_t) S_in`` is added. Rows are right-aligned (``g = beta = 0`` on the
    pads leaves the state unchanged). Tokens outside every document: 0."""
    B, L, _Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    cont, through = chain_flags(key_doc, B, C, L)
    rows = StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], B, L, q.device, cont[r])
    N, Lmax, c_idx = rows.N, rows.Lmax, rows.first_cont
    qq, kk, vv, gg, bb = (rows.pack(t.float()) for t in (q, k, v, g, beta))
    o0, s0 = rule(qq, kk, vv, g=gg, beta=bb, initial_state=None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)                                     # [N, Lmax, Hv, dv], [N, Hv, dk, dv]
    oI, P_last = None, [-1] * B
    pT = s0.new_zeros(0, Hv, dk, dk)
    if c_idx.numel():          # the continuing first run of each batch row: P_t^T q_t and P_T
        eye = torch.eye(dk, dtype=s0.dtype, device=q.device).expand(len(c_idx), Hv, dk, dk).contiguous()
        oI, pT = rule(qq[c_idx], kk[c_idx], vv.new_zeros(len(c_idx), Lmax, Hv, dk), g=gg[c_idx], beta=bb[c_idx],
                      initial_state=eye, output_final_state=True, use_qk_l2norm_in_kernel=True)
        for i, ci in enumerate(c_idx.tolist()):
            rb = int(rows.rows[ci])
            if bool(through[r, rb]):
                P_last[rb] = i
    anchor, s_in = exchange_states(rows.per_batch_row(pT, P_last, (Hv, dk, dk)),
                                   rows.per_batch_row(s0, rows.last, (Hv, dk, dv)), qq, cp_mesh, r, through,
                                   lambda t, s_: t @ s_, tag)
    o = o0.float() + anchor
    if oI is not None and s_in is not None:
        o = o.index_add(0, c_idx, torch.einsum("nthk,nhkv->nthv", oI.float(), s_in[rows.rows[c_idx]]))
    return rows.unpack(o.reshape(N, Lmax, Hv * dv)).view(B, L, Hv, dv)
