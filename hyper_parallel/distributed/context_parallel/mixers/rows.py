"""What every token-mixer method shares: finding a mixer's hidden-states argument, checking a call
against the CP batch meta, and running a module on each document as its own row.

:func:`run_rows` runs ``call`` on ``x_ext [B, T, H]`` and returns this rank's tokens ``[lo, hi)``:
without documents the rows as they are; with ``key_doc`` every document overlapping the kept range
is its own right-padded row (a 2-D ``attention_mask`` passed when the forward takes one), so a
recurrent state or a conv window restarts at every document and padding is never an input of a
real token (padding outputs 0). Local only: no collective. docs/wrappers.md, "Token mixers".

Every mixer method is written for the contiguous layout; :func:`.layout.on_contiguous_layout` moves a
permuted batch (balanced split) to it and back, for the arguments the registration states.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .... import platform as P
from ..comm import all_gather_seq, resolve_group
from ..interception.hf_interface import HF_FALSY_KWARGS, HF_IGNORED_KWARGS
from ..meta import AS_TRANSFORMERS, INDEPENDENT, CPBatchMeta, current_cp_batch_meta, documents_semantics

__all__ = ["CPMixerError", "CACHE_KEYS", "hidden_param", "accepts", "split_hidden", "check_call", "is_seq", "map_seq",
           "gather_any", "zero_out", "segments", "run_rows", "documents_alone", "current_fqn", "validate_common",
           "require_class"]

CACHE_KEYS = ("cache", "past_key_values", "cache_params", "past_key_value")


class CPMixerError(RuntimeError):
    """A CP mixer method met an input it does not support (raised before any collective)."""


# ============================================================================ helpers
def hidden_param(module: nn.Module) -> Optional[str]:
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


def accepts(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def split_hidden(name: str, args: tuple, kwargs: dict):
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


def check_call(what: str, fqn: str, hs, kwargs: dict, meta: CPBatchMeta) -> None:
    if not isinstance(hs, torch.Tensor) or hs.dim() != 3:
        raise CPMixerError(f"{what} on '{fqn}': hidden_states must be a [B, S_local, H] tensor, got "
                           f"{type(hs).__name__}{tuple(hs.shape) if isinstance(hs, torch.Tensor) else ''}")
    if hs.shape[1] != meta.local_seq_len:
        raise CPMixerError(f"{what} on '{fqn}': hidden_states {tuple(hs.shape)} has {hs.shape[1]} tokens but this "
                           f"rank's CP chunk has {meta.local_seq_len} (meta.local_seq_len): the module is not on the "
                           "contiguous CP sequence layout")
    if meta.perm is not None:
        raise CPMixerError(f"{what} on '{fqn}': the batch is in the balanced split's permuted layout (meta.perm) "
                           "but the mixer method runs on the contiguous one; install it with apply_sharding_plan, "
                           "which moves its tokens to the contiguous layout and back (mixers.layout.on_contiguous_layout)")
    for key in CACHE_KEYS:      # the model's default cache (use_cache, eval): not filled under CP
        if kwargs.get(key) is not None:
            kwargs[key] = None


def mixer_call(what: str, fqn: str, name: str, cp_mesh, args: tuple, kwargs: dict):
    """Common start of a mixer forward: ``None`` at cp 1 (run the original), else
    ``(meta, hidden_states, rebuild, rest_args, rest_kwargs)`` after :func:`check_call`. Packed
    documents declared ``as_transformers``: the meta without documents (the mixer runs across their
    boundaries, as transformers' torch paths do on the packed row); undeclared: refused."""
    meta = current_cp_batch_meta()
    hs, rebuild, rest_args, rest_kwargs = split_hidden(name, args, kwargs)
    check_call(what, fqn, hs, rest_kwargs, meta)
    if cp_mesh is None or meta.cp_size == 1:
        return None
    if _documents(what, fqn, meta) == AS_TRANSFORMERS:
        meta = dataclasses.replace(meta, key_doc=None)
    return meta, hs, rebuild, rest_args, rest_kwargs


def _documents(what: str, fqn: str, meta: CPBatchMeta):
    try:
        return documents_semantics(meta, f"{what} on '{fqn}'")
    except ValueError as exc:
        raise CPMixerError(str(exc)) from None


def documents_alone(module: nn.Module, fqn: str, unread: tuple = ()) -> Callable:
    """A token mixer's forward at cp_size 1 under ``independent`` packed documents: the module's own
    forward on each document of the batch meta as its own right-padded row (:func:`run_rows`: the
    state and the conv window restart, as under CP); the original forward without a meta, without a
    row of two documents, or under ``as_transformers`` (without a meta in training: refused, never
    guessed). ``unread``: arguments the module's method
    states it does not read (``seq_dims`` None), passed as None. Local, no collective."""
    original, name, mask_param = module.forward, hidden_param(module), accepts(module, "attention_mask")
    what = "packed documents at cp_size 1"

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)
        if meta is None and module.training:
            raise CPMixerError(f"{what} on '{fqn}': the module is installed to compute each packed document alone "
                               "at cp_size 1 but runs outside cp_batch_context: shard the batch with "
                               "shard_batch_for_cp(..., packed_documents=...) and run the forward in "
                               "cp_batch_context(local.meta)")
        if meta is None or _documents(what, fqn, meta) != INDEPENDENT:
            return original(*args, **kwargs)
        hs, rebuild, rest_args, rest_kwargs = split_hidden(name, args, kwargs)
        rest_kwargs.update({k: None for k in unread if k in rest_kwargs})
        check_call(what, fqn, hs, rest_kwargs, meta)
        return run_rows(original, rebuild, hs, meta.key_doc.to(hs.device), 0, hs.shape[1], rest_args, rest_kwargs,
                        mask_param=mask_param, what=what, fqn=fqn)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = "documents_alone"
    return forward


def bound_call(what: str, fqn: str, sig: inspect.Signature, module: nn.Module, cp_mesh, args: tuple, kwargs: dict,
               one_rank: bool = False):
    """Common start of an attention-like method that re-runs the module's lines from its bound
    arguments: ``None`` at cp 1 (run the original; ``one_rank``: the method's own computation on a
    CP group of one instead), else ``(meta, arguments, hidden_states)``; keyword arguments the CP
    method does not carry are refused, never dropped."""
    meta = current_cp_batch_meta()
    a = dict(sig.bind(module, *args, **kwargs).arguments)
    extra = dict(a.pop("kwargs", {}) or {})
    hs = a["hidden_states"]
    check_call(what, fqn, hs, a, meta)
    if (cp_mesh is None or meta.cp_size == 1) and not one_rank:
        return None
    bad = sorted(k for k, v in extra.items()
                 if v is not None and k not in HF_IGNORED_KWARGS and not (k in HF_FALSY_KWARGS and not v))
    if bad:
        raise CPMixerError(f"{what} on '{fqn}': {type(module).__name__} was called with {bad}, which the CP method "
                           "does not carry; refused rather than dropped")
    return meta, a, hs


def is_seq(t: Any, B: int, L: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == L and t.shape[0] in (1, B)


def map_seq(tree, B: int, L: int, fn: Callable):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) if is_seq(x, B, L) else x for x in leaves], spec)


def gather_any(t: torch.Tensor, cp_mesh, tag: str) -> torch.Tensor:
    if t.is_floating_point() and t.requires_grad:
        return all_gather_seq(t.contiguous(), cp_mesh, dim=1, tag=tag)
    return P.all_gather(t.contiguous(), resolve_group(cp_mesh), dim=1, tag=tag)


def zero_out(x_keep: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros [B, L, width] that stay connected to ``x_keep`` (so the collectives' backward still runs
    on this rank when none of its tokens is a real token)."""
    return (x_keep.sum(-1, keepdim=True) * 0).expand(*x_keep.shape[:2], width)


def segments(doc: torch.Tensor, lo: int, hi: int):
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


def run_rows(call: Callable, rebuild: Callable, x_ext: torch.Tensor, doc_ext: Optional[torch.Tensor],
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

    rows, starts, lens = segments(doc_ext, keep_lo, keep_hi)
    N = int(rows.numel())
    if N == 0:       # no real token here: zeros, still connected to the exchanged tensor
        return zero_out(x_ext[:, keep_lo:keep_hi], _H)
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
    args = map_seq(rest_args, B, T, pack)
    kwargs = map_seq({k: v for k, v in rest_kwargs.items() if k != "attention_mask"}, B, T, pack)
    if mask_param:
        given = rest_kwargs.get("attention_mask")
        mask = slot.to(torch.int64)
        if given is not None:
            if not is_seq(given, B, T) or given.dim() != 2:
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


def current_fqn() -> str:
    try:
        from ..interception import current_apply_context
        ctx = current_apply_context()
        return getattr(ctx, "fqn", None) or "?"
    except Exception:  # noqa: BLE001 - name only
        return "?"


def validate_common(what: str, target_module: nn.Module, tp_size: int) -> None:
    if type(target_module).__module__.startswith("torch.nn"):
        raise ValueError(f"{what} is declared on a torch.nn layer ({type(target_module).__name__}), not on a "
                         "token-mixer module: match the mixer itself (e.g. '*[0-9].conv' for LFM2's "
                         "Lfm2ShortConv — '*.conv' also matches its inner nn.Conv1d 'conv.conv')")
    if hidden_param(target_module) is None:
        raise ValueError(f"{what} needs a module whose forward takes hidden_states [B, S_local, H]; "
                         f"{type(target_module).__name__}.forward takes no argument")
    if tp_size > 1:
        raise ValueError(f"{what} is not combined with tensor parallelism (tp_size={tp_size}) on the mixer "
                         f"{type(target_module).__name__}: use tp_size: 1")


def require_class(what: str, target_module: nn.Module, tp_size: int, classes: tuple, exact_for: str) -> None:
    """:func:`validate_common`, then refuse a module whose class is not in ``classes`` (the method is
    exact only for their forward): ``"{what} {exact_for}; {cls} is not one of them — declare
    sequence_gather ..."``."""
    validate_common(what, target_module, tp_size)
    cls = type(target_module).__name__
    if cls not in classes:
        raise ValueError(f"{what} {exact_for}; {cls} is not one of them — declare sequence_gather (generic, exact) "
                         "for it instead")


def require_layout(what: str, target_module: nn.Module, tp_size: int, classes: tuple, family: str,
                   need: tuple) -> None:
    """:func:`require_class` for a state-passing method that re-runs ``family``'s forward, then refuse
    a module missing one of the attributes ``need`` (not the transformers layout the method re-runs)."""
    require_class(what, target_module, tp_size, classes,
                  f"re-runs the forward of {', '.join(classes)} ({family}) with a passed state")
    missing = [f for f in need if not hasattr(target_module, f)]
    if missing:
        raise ValueError(f"{what}: {type(target_module).__name__} has no {', '.join(missing)}: not transformers' "
                         f"{family} layout")


def require_causal_depthwise(what: str, module: nn.Module, attr: str, channels: int, over: str) -> None:
    """Refuse ``module.<attr>`` unless it is a depthwise causal ``nn.Conv1d`` over ``channels`` channels
    (stride 1, dilation 1): the halo of ``kernel - 1`` tokens is then all the conv needs from the
    previous rank."""
    c = getattr(module, attr)
    if c.groups != channels or c.in_channels != channels or c.stride[0] != 1 or c.dilation[0] != 1:
        raise ValueError(f"{what}: {type(module).__name__}.{attr} is not a depthwise causal conv over {over} "
                         f"({channels} channels); declare sequence_gather (generic, exact) for it instead")
