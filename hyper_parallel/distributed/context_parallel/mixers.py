"""Exact CP methods for token mixers that are not attention (issue 21 part 2).

A hybrid decoder (Qwen3-Next / Qwen3.5 Gated DeltaNet, Falcon-H1 / Bamba / NemotronH Mamba2,
LFM2 short convolution, ...) mixes tokens along the sequence in modules that are not attention.
Under CP each of them must be declared like the attention, on the mixer's own module::

    plan_overrides:
      - match: "*.linear_attn"          # Qwen3-Next; "*.mamba" Falcon-H1; "*[0-9].conv" LFM2
        when: cp
        region_dispatch: false
        inner_target: self
        inner_wrapper: sequence_gather  # or {_target_: <this module>.sequence_gather_cp_wrapper}

Methods (all ``@inner_wrapper(mixer=True)``: declarable on a non-attention module, contiguous
layout only — the planner refuses them next to a Head-Tail load-balance attention):

``sequence_gather`` (:func:`sequence_gather_cp_wrapper`) — generic, for any module whose forward
    takes ``hidden_states [B, S_local, H]`` (first argument or ``hidden_states=``) and returns
    ``[B, S_local, H']`` or a tuple whose first element is that. Forward: AllGather of the hidden
    states (and of every other sequence-shaped tensor argument, e.g. a 2-D ``attention_mask``)
    over the CP group, the module's **own** forward on the global sequence, this rank's slice
    kept. Backward: the gathered gradient is ReduceScatter(sum)-ed back to the owning ranks
    (:func:`~.collectives.all_gather_seq`). Exact by construction: the module's own math (conv
    windows, recurrent states, chunked scans) on the same tokens it sees at CP=1.
    **Cost:** this layer's compute and activation memory are *not* divided by cp (each rank runs
    the module on every token of the documents that overlap its chunk), plus one AllGather of
    ``B x S x H`` forward and one ReduceScatter backward. A correctness baseline, not a scaling
    method.

``short_conv_halo`` (:func:`short_conv_halo_cp_wrapper`) — LFM2's gated short convolution
    (``Lfm2ShortConv`` and the classes with the same forward: ``Lfm2MoeShortConv``,
    ``Lfm3ShortConv``). Each rank receives the previous rank's last ``k - 1`` *input* hidden states
    (``k = config.conv_L_cache``; rank 0 receives nothing), runs the module's own forward on
    ``[halo + local]`` and drops the halo outputs. Backward returns the halo's input gradient to the
    previous rank, where it is added to the gradient of its last ``k - 1`` tokens. Exact because
    everything in ``Lfm2ShortConv.forward`` before ``self.conv`` is token-wise (padding mask
    multiply, ``in_proj``, the ``B * x`` gate) and everything after it too (``C * conv``,
    ``out_proj``): the only cross-token operation is the causal depthwise conv of kernel ``k``,
    whose output at token t reads inputs ``t-k+1 .. t``. Cost: compute / S_local (+ k - 1 tokens),
    one ring exchange of ``B x (k-1) x H`` forward and backward.

``gated_deltanet_ulysses`` (:func:`gated_deltanet_ulysses_cp_wrapper`) — Qwen3-Next's Gated DeltaNet
    split by its linear heads: token-wise projections on the local tokens, sequence->head all-to-all
    of q/k/v and the b/a gates, the module's causal conv1d (the weight's channels of the rank's
    heads) and transformers' ``torch_chunk_gated_delta_rule`` per document on the whole sequence,
    head->sequence all-to-all back, the token-wise gated norm and ``out_proj`` (the module's own
    forward lines, split by heads; ``linear_num_key_heads`` and ``linear_num_value_heads`` must be
    divisible by cp). Compute / cp; 5 all-to-alls forward and backward.

``gated_deltanet_state_passing`` (:func:`gated_deltanet_state_passing_cp_wrapper`) — the same module
    on the local tokens with all its heads (no head rule: cp may exceed the linear head counts). The
    conv gets a ``k - 1`` token halo from the previous rank; the recurrence of the first local
    document starts from the state the previous ranks hand over. No rank waits for another rank's
    recurrence: the delta rule is affine in its initial state, so each rank runs its documents from
    a zero state plus, for a document continuing from the previous rank, an identity-state run
    that gives the state's contribution to every output and the chunk's transition; one AllGather
    of ``(transition, final state)`` (``B x Hv x dk x (dk + dv)`` per rank, independent of S) lets
    every rank compose its incoming state locally. Cost: compute / cp, but ranks > 0 run the
    recurrence of their first document twice (measured in benchmarks/linear_mixer_cp.py).

``mamba2_state_passing`` (:func:`mamba2_state_passing_cp_wrapper`) — Falcon-H1's Mamba2 mixer on the
    local tokens with all its heads: conv halo, transformers' ``mamba2_chunk_scan`` from a zero state,
    and the incoming SSM state's contribution added in closed form (Mamba2's decay is a scalar per
    head, so no second scan is needed); one AllGather of ``(decay, final state)`` per rank. Compute /
    cp, no idle rank, no head rule.

Padding and packed documents (all methods): the CP batch's ``meta.key_doc`` says which tokens are
padding (-1) and which document every token belongs to. Every document is run as **its own
sequence** (a right-padded row, with a 2-D ``attention_mask`` when the module's forward takes one,
as transformers passes it at CP=1 for a padded batch), so the recurrent state and the conv window
restart at each document boundary, and padding (right padding, the CP padding appended after the
real tokens, ``seq_lens_padded`` gaps) is never an input of a real token. That is what the CP
preflight proof and the attention wrappers treat as the model's computation (documents are
independent). Padding outputs are 0. Without padding or packing (``key_doc is None``) the rows
are run unchanged. (transformers' torch paths at CP=1 do *not* reset these mixers at a packed
document boundary — a packed row leaks state across documents there; CP does not reproduce that
leak.)

Training only: a ``cache`` / ``past_key_values`` the model passes (transformers creates one by
default in eval mode) is not handed to the module and is not filled — as with the CP attention
wrappers, CP is not a decoding path. Refused with a message: TP > 1 on the mixer, a mixer method on
a ``torch.nn`` layer (e.g. LFM2's inner ``conv.conv``) or around another CP-declared module, the
halo method on a module it is not exact for, fewer than ``k - 1`` tokens per rank (halo).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import platform as P
from .catalogue import mixer_methods
from .collectives import all_gather_seq, resolve_group
from .meta import CPBatchMeta, current_cp_batch_meta
from .registry import inner_wrapper, register_inner_wrapper

__all__ = ["sequence_gather_cp_wrapper", "short_conv_halo_cp_wrapper", "gated_deltanet_ulysses_cp_wrapper",
           "gated_deltanet_state_passing_cp_wrapper", "mamba2_state_passing_cp_wrapper", "MAMBA2_CLASSES",
           "CPMixerError", "HALO_CLASSES", "GDN_CLASSES", "halo_exchange"]

#: classes whose forward is ``Lfm2ShortConv.forward`` (token-wise around one causal depthwise conv)
HALO_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
_CACHE_KEYS = ("cache", "past_key_values", "cache_params", "past_key_value")


class CPMixerError(RuntimeError):
    """A CP mixer method met an input it does not support (raised before any collective)."""


# ============================================================================ helpers
def _hidden_param(module: nn.Module) -> Optional[str]:
    """Name of the hidden-states parameter of ``module.forward`` (``hidden_states`` or the first)."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    if "hidden_states" in names:
        return "hidden_states"
    return names[0] if names else None


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _split_hidden(name: str, args: tuple, kwargs: dict):
    """(hidden_states, rebuild(x, args, kwargs) -> (args, kwargs), other args, other kwargs)."""
    if "hidden_states" in kwargs:
        hs = kwargs["hidden_states"]
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return hs, (lambda x, a, kw: (a, {"hidden_states": x, **kw})), tuple(args), rest
    if name in kwargs and name != "hidden_states":
        hs = kwargs[name]
        rest = {k: v for k, v in kwargs.items() if k != name}
        return hs, (lambda x, a, kw: (a, {name: x, **kw})), tuple(args), rest
    if not args:
        raise CPMixerError("CP mixer method: the module was called without hidden states")
    return args[0], (lambda x, a, kw: ((x,) + tuple(a), kw)), tuple(args[1:]), dict(kwargs)


def _check_call(what: str, fqn: str, hs, kwargs: dict, meta: CPBatchMeta) -> None:
    if not isinstance(hs, torch.Tensor) or hs.dim() != 3:
        raise CPMixerError(f"{what} on '{fqn}': hidden_states must be a [B, S_local, H] tensor, got "
                           f"{type(hs).__name__}{tuple(hs.shape) if isinstance(hs, torch.Tensor) else ''}")
    if hs.shape[1] != meta.local_seq_len:
        raise CPMixerError(f"{what} on '{fqn}': hidden_states {tuple(hs.shape)} has {hs.shape[1]} tokens but this "
                           f"rank's CP chunk has {meta.local_seq_len} (meta.local_seq_len): the module is not on the "
                           "contiguous CP sequence layout")
    for key in _CACHE_KEYS:      # the model's default cache (use_cache, eval): not filled under CP
        if kwargs.get(key) is not None:
            kwargs[key] = None


def _is_seq(t: Any, B: int, L: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == L and t.shape[0] in (1, B)


def _map_seq(tree, B: int, L: int, fn: Callable):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) if _is_seq(x, B, L) else x for x in leaves], spec)


def _gather_any(t: torch.Tensor, cp_mesh, tag: str) -> torch.Tensor:
    if t.is_floating_point() and t.requires_grad:
        return all_gather_seq(t.contiguous(), cp_mesh, dim=1, tag=tag)
    return P.all_gather(t.contiguous(), resolve_group(cp_mesh), dim=1, tag=tag)


def _zero_out(x_keep: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros [B, L, width] that stay connected to ``x_keep`` (so the collectives' backward still runs
    on this rank when none of its tokens is a real token)."""
    return (x_keep.sum(-1, keepdim=True) * 0).expand(*x_keep.shape[:2], width)


def _segments(doc: torch.Tensor, lo: int, hi: int):
    """Runs of one document (id >= 0) in ``doc [B, T]`` that overlap positions ``[lo, hi)``:
    (row, start, length) int64 tensors."""
    B, T = doc.shape
    valid = doc >= 0
    change = torch.ones(B, T + 1, dtype=torch.bool, device=doc.device)
    change[:, 1:T] = doc[:, 1:] != doc[:, :-1]
    starts = valid & change[:, :T]
    ends = valid & change[:, 1:]
    sb, ss = starts.nonzero(as_tuple=True)
    _eb, se = ends.nonzero(as_tuple=True)          # same order: one end per start, row-major
    keep = (ss < hi) & (se >= lo)
    return sb[keep], ss[keep], (se - ss + 1)[keep]


def _run_rows(call: Callable, rebuild: Callable, x_ext: torch.Tensor, doc_ext: Optional[torch.Tensor],
              keep_lo: int, keep_hi: int, rest_args: tuple, rest_kwargs: dict, *, mask_param: bool,
              what: str, fqn: str):
    """Run ``call`` on ``x_ext [B, T, H]`` (every other argument already in the same [B|1, T] layout)
    and return this rank's output tokens ``[keep_lo, keep_hi)``.

    ``doc_ext`` None: the rows as they are. Else every document overlapping the kept range is its
    own right-padded row (``attention_mask`` passed when the forward takes one and a row is padded)."""
    B, T, _H = x_ext.shape
    L = keep_hi - keep_lo
    if doc_ext is None:
        a, kw = rebuild(x_ext, rest_args, rest_kwargs)
        out = call(*a, **kw)
        y = out if isinstance(out, torch.Tensor) else out[0]
        if not isinstance(y, torch.Tensor) or y.dim() < 2 or tuple(y.shape[:2]) != (B, T):
            raise CPMixerError(f"{what} on '{fqn}': the module returned {type(y).__name__}"
                               f"{tuple(y.shape) if isinstance(y, torch.Tensor) else ''}, expected [B={B}, S={T}, ...]")
        y = y[:, keep_lo:keep_hi]
        return y if isinstance(out, torch.Tensor) else (y,) + tuple(out[1:])

    rows, starts, lens = _segments(doc_ext, keep_lo, keep_hi)
    N = int(rows.numel())
    if N == 0:       # no real token here: zeros, still connected to the exchanged tensor
        return _zero_out(x_ext[:, keep_lo:keep_hi], _H)
    Lmax = int(lens.max())
    j = torch.arange(Lmax, device=x_ext.device)
    slot = j[None, :] < lens[:, None]                                            # [N, Lmax]
    pos = starts[:, None] + torch.where(slot, j[None, :], torch.zeros_like(j)[None, :])
    flat = (rows[:, None] * T + pos).reshape(-1)                                  # gather index into [B*T]

    def pack(t: torch.Tensor) -> torch.Tensor:
        t = t.expand(B, *t.shape[1:]) if t.shape[0] == 1 else t
        rest = tuple(t.shape[2:])
        p = t.reshape(B * T, *rest).index_select(0, flat).view(N, Lmax, *rest)
        m = slot.view(N, Lmax, *([1] * len(rest)))
        return p * m.to(p.dtype) if p.is_floating_point() else torch.where(m, p, torch.zeros_like(p))

    x_rows = pack(x_ext)
    args = _map_seq(rest_args, B, T, pack)
    kwargs = _map_seq({k: v for k, v in rest_kwargs.items() if k != "attention_mask"}, B, T, pack)
    if mask_param:
        given = rest_kwargs.get("attention_mask")
        mask = slot.to(torch.int64)
        if given is not None:
            if not _is_seq(given, B, T) or given.dim() != 2:
                raise CPMixerError(f"{what} on '{fqn}': attention_mask {tuple(given.shape)} is not a 2-D [B, S] "
                                   "padding mask; CP passes padding and documents through the CP batch meta")
            mask = mask * (pack(given) != 0).to(torch.int64)
        kwargs["attention_mask"] = None if bool(mask.all()) else mask
    elif "attention_mask" in rest_kwargs:
        kwargs["attention_mask"] = rest_kwargs["attention_mask"]
    a, kw = rebuild(x_rows, args, kwargs)
    out = call(*a, **kw)
    y = out if isinstance(out, torch.Tensor) else out[0]
    if not isinstance(y, torch.Tensor) or y.dim() < 2 or tuple(y.shape[:2]) != (N, Lmax):
        raise CPMixerError(f"{what} on '{fqn}': the module returned {type(y).__name__}"
                           f"{tuple(y.shape) if isinstance(y, torch.Tensor) else ''} for {N} document rows of "
                           f"{Lmax} tokens, expected [{N}, {Lmax}, ...]")
    tail = tuple(y.shape[2:])
    gpos = starts[:, None] + j[None, :]
    sel = (slot & (gpos >= keep_lo) & (gpos < keep_hi)).reshape(-1)
    tgt = (rows[:, None] * L + (gpos - keep_lo)).reshape(-1)[sel]
    src = y.reshape(N * Lmax, *tail)[sel]
    res = y.new_zeros((B * L,) + tail).index_add(0, tgt, src).view(B, L, *tail)
    return res if isinstance(out, torch.Tensor) else (res,) + tuple(out[1:])


def _fqn() -> str:
    try:
        from .interception import current_apply_context
        ctx = current_apply_context()
        return getattr(ctx, "fqn", None) or "?"
    except Exception:  # noqa: BLE001 - name only
        return "?"


def _validate_common(what: str, target_module: nn.Module, tp_size: int) -> None:
    if type(target_module).__module__.startswith("torch.nn"):
        raise ValueError(f"{what} is declared on a torch.nn layer ({type(target_module).__name__}), not on a "
                         "token-mixer module: match the mixer itself (e.g. '*[0-9].conv' for LFM2's "
                         "Lfm2ShortConv — '*.conv' also matches its inner nn.Conv1d 'conv.conv')")
    if _hidden_param(target_module) is None:
        raise ValueError(f"{what} needs a module whose forward takes hidden_states [B, S_local, H]; "
                         f"{type(target_module).__name__}.forward takes no argument")
    if tp_size > 1:
        raise ValueError(f"{what} is not combined with tensor parallelism (tp_size={tp_size}) on the mixer "
                         f"{type(target_module).__name__}: use tp_size: 1")


def _require_class(what: str, target_module: nn.Module, tp_size: int, classes: tuple, exact_for: str) -> None:
    """:func:`_validate_common`, then refuse a module whose class is not in ``classes`` (the method is
    exact only for their forward): ``"{what} {exact_for}; {cls} is not one of them — declare
    sequence_gather ..."``."""
    _validate_common(what, target_module, tp_size)
    cls = type(target_module).__name__
    if cls not in classes:
        raise ValueError(f"{what} {exact_for}; {cls} is not one of them — declare sequence_gather (generic, exact) "
                         "for it instead")


# ============================================================================ sequence_gather
def validate_sequence_gather(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    _validate_common("sequence_gather_cp_wrapper", target_module, tp_size)


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_sequence_gather)
def sequence_gather_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Generic exact CP for a token mixer: AllGather the sequence, run the module's own forward on
    it (each document as its own row), keep this rank's slice; backward ReduceScatter(sum).
    Compute and activation memory of this layer are not divided by cp (see the module doc)."""
    del mesh, tp_mesh, ep_mesh
    what = "sequence_gather_cp_wrapper"
    original = target_module.forward
    name = _hidden_param(target_module)
    mask_param = _accepts(target_module, "attention_mask")
    fqn = _fqn()

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta()
        hs, rebuild, rest_args, rest_kwargs = _split_hidden(name, args, kwargs)
        _check_call(what, fqn, hs, rest_kwargs, meta)
        if cp_mesh is None or meta.cp_size == 1:
            return original(*args, **kwargs)
        B, L, _ = hs.shape
        lo = meta.cp_rank * L
        full = all_gather_seq(hs.contiguous(), cp_mesh, dim=1, tag="cp.mixer_gather")      # [B, S, H]
        gather = lambda t: _gather_any(t, cp_mesh, "cp.mixer_gather_arg")              # noqa: E731
        rest_args = _map_seq(rest_args, B, L, gather)
        rest_kwargs = _map_seq(rest_kwargs, B, L, gather)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        return _run_rows(original, rebuild, full, key_doc, lo, lo + L, rest_args, rest_kwargs,
                         mask_param=mask_param, what=what, fqn=fqn)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


# ============================================================================ short_conv_halo
class _HaloCat(torch.autograd.Function):
    """fwd: ``x [B, L, H] -> [B, h + L, H]``: the previous CP rank's last ``h`` tokens, then ``x``
    (rank 0: zeros, never used as a real input). One ring ``all_to_all_uneven`` (rank r sends its
    tail to r+1; the last rank's tail goes to rank 0, which discards it).
    bwd: the halo's gradient goes back to the previous rank (the inverse ring) and is added to the
    gradient of its last ``h`` tokens."""

    @staticmethod
    def forward(ctx, x, group, h):
        world, me = P.group_size(group), P.group_rank(group)
        ctx.group, ctx.h = group, h
        send = [1 if d == (me + 1) % world else 0 for d in range(world)]
        recv = [1 if s == (me - 1) % world else 0 for s in range(world)]
        halo = P.all_to_all_uneven(x[:, -h:].contiguous(), group, send, recv, dim=1, tag="cp.mixer_halo")
        if me == 0:
            halo = torch.zeros_like(halo)
        return torch.cat([halo, x], dim=1)

    @staticmethod
    def backward(ctx, grad):
        group, h = ctx.group, ctx.h
        world, me = P.group_size(group), P.group_rank(group)
        g_halo = grad[:, :h].contiguous()
        if me == 0:
            g_halo = torch.zeros_like(g_halo)
        send = [1 if d == (me - 1) % world else 0 for d in range(world)]
        recv = [1 if s == (me + 1) % world else 0 for s in range(world)]
        back = P.all_to_all_uneven(g_halo, group, send, recv, dim=1, tag="cp.mixer_halo.bwd")
        gx = grad[:, h:].clone()
        if me != world - 1:
            gx[:, -h:] += back
        return gx, None, None


def halo_exchange(x: torch.Tensor, cp_mesh, h: int) -> torch.Tensor:
    """``[B, L, H] -> [B, h + L, H]`` with the previous CP rank's last ``h`` tokens in front (rank 0:
    zeros); differentiable (the halo's gradient returns to its owner). Identity cat for cp 1."""
    group = resolve_group(cp_mesh)
    if h == 0:
        return x
    if P.group_size(group) == 1:
        return torch.cat([x.new_zeros(x.shape[0], h, *x.shape[2:]), x], dim=1)
    return _HaloCat.apply(x, group, h)


def _kernel(module: nn.Module) -> Optional[int]:
    conv = getattr(module, "conv", None)
    if isinstance(conv, nn.Conv1d):
        return int(conv.kernel_size[0])
    return None


def validate_short_conv_halo(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "short_conv_halo_cp_wrapper"
    _require_class(what, target_module, tp_size, HALO_CLASSES,
                   "is exact only for a short convolution whose forward is token-wise around one causal depthwise "
                   f"conv ({', '.join(HALO_CLASSES)})")
    cls = type(target_module).__name__
    conv, k = getattr(target_module, "conv", None), _kernel(target_module)
    if k is None or not all(hasattr(target_module, n) for n in ("in_proj", "out_proj")):
        raise ValueError(f"{what}: {cls} has no conv (nn.Conv1d) / in_proj / out_proj")
    if conv.groups != conv.in_channels or conv.padding[0] != k - 1 or conv.stride[0] != 1 or conv.dilation[0] != 1:
        raise ValueError(f"{what}: {cls}.conv is not a causal depthwise conv (groups={conv.groups}, "
                         f"channels={conv.in_channels}, padding={conv.padding}, stride={conv.stride}, "
                         f"dilation={conv.dilation}, kernel={k})")
    L_cache = getattr(target_module, "conv_kernel_size", k)
    if L_cache != k:
        raise ValueError(f"{what}: {cls}.conv_kernel_size={L_cache} but conv kernel is {k}")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_short_conv_halo)
def short_conv_halo_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Exact CP for LFM2's short convolution: halo exchange of the previous rank's last ``k - 1``
    input tokens, the module's own forward on ``[halo + local]``, halo outputs dropped."""
    del mesh, tp_mesh, ep_mesh
    what = "short_conv_halo_cp_wrapper"
    original = target_module.forward
    name = _hidden_param(target_module)
    h = _kernel(target_module) - 1
    mask_param = _accepts(target_module, "attention_mask")
    fqn = _fqn()

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta()
        hs, rebuild, rest_args, rest_kwargs = _split_hidden(name, args, kwargs)
        _check_call(what, fqn, hs, rest_kwargs, meta)
        if cp_mesh is None or meta.cp_size == 1 or h == 0:
            return original(*args, **kwargs)
        B, L, _ = hs.shape
        if L < h:
            raise CPMixerError(f"{what} on '{fqn}': {L} tokens per CP rank < kernel - 1 = {h}: the halo would "
                               "span more than one rank; use longer sequences or fewer CP ranks")
        leaves = [x for x in tree_flatten((rest_args, rest_kwargs))[0] if _is_seq(x, B, L)]
        if leaves:
            raise CPMixerError(f"{what} on '{fqn}': got a sequence-shaped argument {tuple(leaves[0].shape)} (e.g. a "
                               "local attention_mask); CP passes padding and documents through the CP batch meta — "
                               "call the model without attention_mask, or declare sequence_gather")
        ext = halo_exchange(hs, cp_mesh, h)                                               # [B, h + L, H]
        r = meta.cp_rank
        if meta.key_doc is None:
            if r == 0:      # no predecessor: the local tokens alone, as at CP=1 (still through ext: backward)
                return _run_rows(original, rebuild, ext[:, h:], None, 0, L, rest_args, rest_kwargs,
                                 mask_param=mask_param, what=what, fqn=fqn)
            return _run_rows(original, rebuild, ext, None, h, h + L, rest_args, rest_kwargs,
                             mask_param=mask_param, what=what, fqn=fqn)
        lo = r * L
        key_doc = meta.key_doc.to(hs.device)
        halo_doc = key_doc[:, lo - h:lo] if r > 0 else torch.full((B, h), -1, dtype=key_doc.dtype,
                                                                  device=key_doc.device)
        doc_ext = torch.cat([halo_doc, key_doc[:, lo:lo + L]], dim=1)
        return _run_rows(original, rebuild, ext, doc_ext, h, h + L, rest_args, rest_kwargs,
                         mask_param=mask_param, what=what, fqn=fqn)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


# ============================================================================ gated_deltanet_ulysses
GDN_CLASSES = ("Qwen3NextGatedDeltaNet",)


def validate_gated_deltanet_ulysses(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    what = "gated_deltanet_ulysses_cp_wrapper"
    _require_class(what, target_module, tp_size, GDN_CLASSES,
                   f"re-runs the forward of {', '.join(GDN_CLASSES)} head-parallel")
    cls = type(target_module).__name__
    hk, hv = target_module.num_k_heads, target_module.num_v_heads
    if hk % cp_size or hv % cp_size:
        raise ValueError(f"{what}: Ulysses splits the linear-attention heads over cp_size={cp_size}, but {cls} has "
                         f"linear_num_key_heads={hk}, linear_num_value_heads={hv} (both must be divisible by "
                         "cp_size) — declare sequence_gather, or a cp_size that divides them")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_gated_deltanet_ulysses)
def gated_deltanet_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Ulysses for Qwen3-Next's Gated DeltaNet: the token-wise projections on the local tokens, a
    sequence->head all-to-all of q/k/v/b/a (rank i gets linear heads [i*H/C, (i+1)*H/C) of the
    whole sequence), the module's causal conv1d (its weight's channels of those heads) and
    ``torch_chunk_gated_delta_rule`` per document on the full sequence, head->sequence all-to-all
    back, then the token-wise gated norm and ``out_proj``. The same lines as the module's forward
    (transformers 5.24), split by heads: compute / cp, 5 + 1 all-to-alls forward (and backward)."""
    del mesh, tp_mesh, ep_mesh
    import sys

    import torch.nn.functional as F

    from .collectives import ulysses_head_to_seq, ulysses_seq_to_head

    what = "gated_deltanet_ulysses_cp_wrapper"
    m = target_module
    original = m.forward
    name = _hidden_param(m)
    fqn = _fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, rule = hf.causal_conv1d_fn, hf.torch_chunk_gated_delta_rule
    dk, dv = m.head_k_dim, m.head_v_dim

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta()
        hs, _rebuild, rest_args, rest_kwargs = _split_hidden(name, args, kwargs)
        _check_call(what, fqn, hs, rest_kwargs, meta)
        if cp_mesh is None or meta.cp_size == 1:
            return original(*args, **kwargs)
        group = resolve_group(cp_mesh)
        C, r = P.group_size(group), P.group_rank(group)
        hk, hv = m.num_k_heads // C, m.num_v_heads // C
        B, L, _ = hs.shape
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hs), m.in_proj_ba(hs))
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
        o = _run_rows(core, lambda x, a_, kw: ((x,), {}), feats, key_doc, 0, S, (), {}, mask_param=False,
                      what=what, fqn=fqn)                                                      # [B, S, hv*dv]
        o = ulysses_head_to_seq(o.reshape(B, S, hv, dv).contiguous(), group, seq_dim=1, head_dim=2,
                                tag="cp.gdn_h2s")                                              # [B, L, Hv, dv]
        o = m.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, L, -1)
        return m.out_proj(o)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


# ============================================================================ gated_deltanet_state_passing
def validate_gated_deltanet_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "gated_deltanet_state_passing_cp_wrapper"
    _require_class(what, target_module, tp_size, GDN_CLASSES,
                   f"re-runs the forward of {', '.join(GDN_CLASSES)} with a passed recurrent state")


def _pack_rows(doc: Optional[torch.Tensor], B: int, L: int, device):
    """Document runs of the local chunk as rows: (row, start, length) int64 tensors, every run
    inside ``[0, L)``; ``doc`` None = one run per batch row."""
    if doc is None:
        z = torch.zeros(B, dtype=torch.int64, device=device)
        return torch.arange(B, device=device), z, torch.full((B,), L, dtype=torch.int64, device=device)
    return _segments(doc, 0, L)


def _chain_flags(key_doc: Optional[torch.Tensor], B: int, C: int, L: int):
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


def _module_conv(m: nn.Module, conv_fn: Callable) -> Callable:
    """``[N, T, F] -> [N, T, F]``: the module's causal ``conv1d`` (weight, bias, activation) through
    transformers' ``causal_conv1d_fn`` — the call the module's own forward makes."""
    def conv(x):
        return conv_fn(x.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias,
                       activation=m.activation).transpose(1, 2)
    return conv


def _state_passing_entry(what: str, fqn: str, name: str, cp_mesh, h: int, args: tuple, kwargs: dict):
    """Common start of a state-passing forward: ``None`` at cp 1 (run the original), else
    ``(meta, hidden_states, C, r)`` after the local checks (``L >= h`` for the conv halo)."""
    meta = current_cp_batch_meta()
    hs, _rebuild, _rest_args, rest_kwargs = _split_hidden(name, args, kwargs)
    _check_call(what, fqn, hs, rest_kwargs, meta)
    if cp_mesh is None or meta.cp_size == 1:
        return None
    group = resolve_group(cp_mesh)
    L = hs.shape[1]
    if L < h:
        raise CPMixerError(f"{what} on '{fqn}': {L} tokens per CP rank < conv kernel - 1 = {h}: the conv halo "
                           "would span more than one rank; use longer sequences or fewer CP ranks")
    return meta, hs, P.group_size(group), P.group_rank(group)


def _halo_conv(conv: Callable, x: torch.Tensor, cp_mesh, h: int, key_doc: Optional[torch.Tensor], r: int,
               what: str, fqn: str) -> torch.Tensor:
    """A causal conv (kernel ``h + 1``) over this rank's ``x [B, L, F]`` as over the whole sequence:
    the previous rank's last ``h`` tokens in front (:func:`halo_exchange`), each document its own row
    (the window restarts at a document start; padding outputs 0), the halo outputs dropped."""
    B, L, _ = x.shape
    ext = halo_exchange(x, cp_mesh, h)                                                   # [B, h + L, F]
    ident = lambda t, a_, kw: ((t,), {})                                                 # noqa: E731
    if key_doc is None:
        if r == 0:      # no predecessor (still through ext: the halo's backward runs on every rank)
            return _run_rows(conv, ident, ext[:, h:], None, 0, L, (), {}, mask_param=False, what=what, fqn=fqn)
        return _run_rows(conv, ident, ext, None, h, h + L, (), {}, mask_param=False, what=what, fqn=fqn)
    lo = r * L
    halo_doc = (key_doc[:, lo - h:lo] if r > 0 else
                torch.full((B, h), -1, dtype=key_doc.dtype, device=key_doc.device))
    return _run_rows(conv, ident, ext, torch.cat([halo_doc, key_doc[:, lo:lo + L]], dim=1), h, h + L, (), {},
                     mask_param=False, what=what, fqn=fqn)


class _StateRows:
    """The documents of this rank's chunk as rows ``[N, Lmax, ...]`` for a recurrent scan.

    ``align="right"``: a row starts at slot 0 and is zero-padded after its end (the scan must leave
    the state unchanged on those pads); ``"left"``: zero pads come first (a zero state stays zero).
    ``cont[b]`` says whether batch row ``b``'s first run continues the previous rank's last document
    (:func:`_chain_flags`); ``first_cont`` are the indices of those runs, ``last[b]`` the run ending
    this chunk (``-1``: none). :meth:`pack` / :meth:`unpack` move ``[B, L, ...]`` <-> rows."""

    def __init__(self, local_doc: Optional[torch.Tensor], B: int, L: int, device, cont_r: torch.Tensor,
                 align: str = "right"):
        rows, starts, lens = _pack_rows(local_doc, B, L, device)
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


def _exchange_states(trans: torch.Tensor, state: torch.Tensor, anchor: torch.Tensor, cp_mesh, r: int,
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


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_gated_deltanet_state_passing)
def gated_deltanet_state_passing_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """State passing for Qwen3-Next's Gated DeltaNet: every rank runs all heads on its own tokens.

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
    import sys

    import torch.nn.functional as F

    what = "gated_deltanet_state_passing_cp_wrapper"
    m = target_module
    original = m.forward
    name = _hidden_param(m)
    fqn = _fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, rule = hf.causal_conv1d_fn, hf.torch_chunk_gated_delta_rule
    dk, dv, Hk, Hv = m.head_k_dim, m.head_v_dim, m.num_k_heads, m.num_v_heads
    h = int(m.conv1d.weight.shape[-1]) - 1
    conv = _module_conv(m, conv_fn)

    def forward(*args, **kwargs):
        entry = _state_passing_entry(what, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        B, L, _ = hs.shape
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hs), m.in_proj_ba(hs))
        mixed = torch.cat([x.reshape(B, L, -1) for x in (q, k, v)], dim=-1)            # [B, L, F] pre-conv
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        mixed = _halo_conv(conv, mixed, cp_mesh, h, key_doc, r, what, fqn)              # [B, L, F], pads 0
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)                  # [B, L, Hv]

        # -- documents of the local chunk as right-aligned rows (beta = g = 0 after a row's end: the
        # state is unchanged there, so a row's final state is its document's)
        cont, through = _chain_flags(key_doc, B, C, L)
        rows = _StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], B, L, hs.device, cont[r])
        N, Lmax, c_idx = rows.N, rows.Lmax, rows.first_cont
        x = rows.pack(mixed).float()
        qq, kk, vv = torch.split(x, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        qq, kk, vv = qq.reshape(N, Lmax, Hk, dk), kk.reshape(N, Lmax, Hk, dk), vv.reshape(N, Lmax, Hv, dv)
        gg, bb = rows.pack(g), rows.pack(beta.float())
        o0, s0 = rule(qq, kk, vv, g=gg, beta=bb, initial_state=None, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)                                    # [N, Lmax, Hv, dv], [N,Hv,dk,dv]

        # -- the continuing first run of each batch row: identity run -> P_t^T q_t and P_T
        oI, P_last = None, [-1] * B
        pT = s0.new_zeros(0, Hv, dk, dk)
        if c_idx.numel():
            eye = torch.eye(dk, dtype=s0.dtype, device=hs.device).expand(len(c_idx), Hv, dk, dk).contiguous()
            oI, pT = rule(qq[c_idx], kk[c_idx], vv.new_zeros(len(c_idx), Lmax, Hv, dk), g=gg[c_idx], beta=bb[c_idx],
                          initial_state=eye, output_final_state=True, use_qk_l2norm_in_kernel=True)
            for i, ci in enumerate(c_idx.tolist()):
                rb = int(rows.rows[ci])
                if bool(through[r, rb]):
                    P_last[rb] = i
        anchor, s_in = _exchange_states(rows.per_batch_row(pT, P_last, (Hv, dk, dk)),
                                        rows.per_batch_row(s0, rows.last, (Hv, dk, dv)), x, cp_mesh, r, through,
                                        lambda t, s_: t @ s_, "cp.gdn_state")
        o = o0 + anchor
        if oI is not None and s_in is not None:
            o = o.index_add(0, c_idx, torch.einsum("nthk,nhkv->nthv", oI, s_in[rows.rows[c_idx]]))
        # -- rows back to [B, L, Hv*dv] (padding outputs 0), gated norm and out_proj as the module
        core = rows.unpack(o.reshape(N, Lmax, Hv * dv)).to(hs.dtype).view(B, L, Hv, dv)
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, L, -1)
        return m.out_proj(core)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward


# ============================================================================ mamba2_state_passing
MAMBA2_CLASSES = ("FalconH1Mixer",)


def validate_mamba2_state_passing(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "mamba2_state_passing_cp_wrapper"
    _require_class(what, target_module, tp_size, MAMBA2_CLASSES,
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
    import sys

    import torch.nn.functional as F

    what = "mamba2_state_passing_cp_wrapper"
    m = target_module
    original = m.forward
    name = _hidden_param(m)
    fqn = _fqn()
    hf = sys.modules[type(m).__module__]
    conv_fn, scan = hf.causal_conv1d_fn, hf.mamba2_chunk_scan
    H, Pd, Ns, G, I = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.intermediate_size
    h = int(m.conv_kernel_size) - 1
    lo_lim, hi_lim = (float(x) for x in m.time_step_limit)
    conv = _module_conv(m, conv_fn)

    def forward(*args, **kwargs):
        entry = _state_passing_entry(what, fqn, name, cp_mesh, h, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, C, r = entry
        Bsz, L, _ = hs.shape
        dtype = hs.dtype
        proj = m.in_proj(hs * m.ssm_in_multiplier) * m.mup_vector
        gate, xbc, dt = proj.split([I, m.conv_dim, H], dim=-1)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        xbc = _halo_conv(conv, xbc, cp_mesh, h, key_doc, r, what, fqn)                  # [B, L, conv_dim], pads 0

        # -- local documents as LEFT-aligned rows: leading pads (x = 0) leave a zero state at zero
        cont, through = _chain_flags(key_doc, Bsz, C, L)
        rows = _StateRows(None if key_doc is None else key_doc[:, r * L:(r + 1) * L], Bsz, L, hs.device, cont[r],
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
        anchor, s_in = _exchange_states(rows.per_batch_row(a[:, -1].exp(), dec_last, (H,)),
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


# the registry names are the method catalogue's mixer rows (one row per method, catalogue.py)
for _row in mixer_methods():
    for _offer in _row.offers:
        if _offer.entry and _offer.registry_name and _offer.module == __name__:
            register_inner_wrapper(_offer.registry_name, globals()[_offer.entry], overwrite=True)
