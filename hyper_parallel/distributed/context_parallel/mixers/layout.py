"""A mixer method's sequence arguments, and the move of a permuted batch to the contiguous layout.

Every mixer method is written for the contiguous layout. :func:`on_contiguous_layout` (installed by
the plan applier around every ``@inner_wrapper(mixer=True)`` forward) moves a permuted batch
(balanced split, ``meta.perm``) to it and back, one all-to-all each way per tensor
(:class:`~..comm.Relayout`; docs/strategies/load_balance_packed.md, "Token mixers").

Which arguments move is stated, never guessed from shapes: the registration's ``seq_dims``
(``@inner_wrapper(mixer=True, seq_dims={name: dim | None})``) on top of :data:`DEFAULT_SEQ_DIMS`
names, per argument of the module's forward (a ``**kwargs`` key is its own name; a tuple's every
tensor), the dim that carries this rank's ``L`` tokens (moved along it) or ``None`` (carries no
sequence: passed unchanged). The hidden-states argument carries it on dim 1. A tensor of an
argument not named there, or of a named one whose stated dim is not ``L`` long, with any dim of
length ``L`` is refused (:class:`~.rows.CPMixerError` naming the module and the argument) before
any collective: it may be sequence data the relayout would leave in the permuted order.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .... import platform as P
from ..comm import Relayout, resolve_group
from ..interception.model_mask import IGNORES_MODEL_MASK
from ..meta import cp_batch_context, current_cp_batch_meta
from .rows import CPMixerError, hidden_param, map_seq

__all__ = ["DEFAULT_SEQ_DIMS", "on_contiguous_layout"]

#: the transformers per-token inputs of a mixer forward: 2-D padding mask, positions, RoPE (cos, sin)
#: on dim 1; ``cache_position`` carries none the methods read (positions come from the CP batch meta)
DEFAULT_SEQ_DIMS = {"attention_mask": 1, "position_ids": 1, "position_embeddings": 1, "cache_position": None}


def _bound(sig: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict, who: str):
    try:
        ba = sig.bind(module, *args, **kwargs)
    except TypeError as exc:
        raise CPMixerError(f"{who}: the call does not bind to {type(module).__name__}.forward ({exc})") from exc
    return ba


def _named(sig: inspect.Signature, ba) -> list:
    """(name, value) of every argument of the call, ``**kwargs`` keys as their own names."""
    out = []
    for name, value in list(ba.arguments.items())[1:]:
        if sig.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
            out.extend(value.items())
        elif sig.parameters[name].kind != inspect.Parameter.VAR_POSITIONAL:
            out.append((name, value))
        elif value:
            raise CPMixerError(f"{type(ba.args[0]).__name__}.forward takes *{name}: its positional extras have no "
                               "names to state their sequence dim by; pass them by keyword")
    return out


def _move(t: torch.Tensor, dim: int, fn: Callable) -> torch.Tensor:
    """``fn`` (a [1, L, ...] relayout along dim 1) applied along ``dim`` of ``t``."""
    return fn(t.movedim(dim, 0).unsqueeze(0)).squeeze(0).movedim(0, dim)


def on_contiguous_layout(forward: Callable, module: nn.Module, cp_mesh, seq_dims: Optional[dict] = None,
                         fqn: str = "") -> Callable:
    """``forward`` (a mixer method, written for the contiguous layout) runnable under any split.

    When the current batch is permuted (``meta.perm``) every stated sequence tensor (module doc) moves
    from the permuted slots to this rank's contiguous chunk (global tokens ``[r*L, (r+1)*L)``),
    ``forward`` runs unchanged under the contiguous view of the meta (``perm=None``; doc ids and
    positions are global) and every ``[B|1, L, ...]`` output moves back with the inverse exchange.
    Backward: the inverse exchanges. Otherwise (contiguous batch, cp 1) ``forward`` itself runs."""
    name = hidden_param(module)
    sig = inspect.signature(type(module).forward)
    dims = {**DEFAULT_SEQ_DIMS, **(seq_dims or {}), name: 1}   # seq_dims checked by @inner_wrapper
    if getattr(forward, IGNORES_MODEL_MASK, False) and "attention_mask" not in (seq_dims or {}):
        dims["attention_mask"] = None          # the method reads no model mask: passed unchanged
    positional = [p.name for p in list(sig.parameters.values())[1:]
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    who = (f"{getattr(forward, '__hp_mixer__', 'mixer method')} on " + (f"'{fqn}' " if fqn else "")
           + f"({type(module).__name__})")

    def relaid(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)
        if meta is None or meta.perm is None or cp_mesh is None or meta.cp_size == 1:
            return forward(*args, **kwargs)
        L = meta.local_seq_len
        ba = _bound(sig, module, args, kwargs, who)
        named = _named(sig, ba)
        hs = dict(named).get(name)
        if not isinstance(hs, torch.Tensor) or hs.dim() != 3 or hs.shape[1] != L:
            raise CPMixerError(f"{who}: hidden_states {tuple(getattr(hs, 'shape', ()))} is not this rank's [B, "
                               f"{L}, H] chunk of the balanced split; refused before the relayout")
        for arg, value in named:
            dim = dims.get(arg, "undeclared")
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor) or L not in t.shape or dim is None:
                    continue
                if dim == "undeclared" or t.dim() <= dim or t.shape[dim] != L:
                    stated = "is not stated" if dim == "undeclared" else f"is stated on dim {dim}"
                    raise CPMixerError(
                        f"{who}: argument '{arg}' {tuple(t.shape)} has a dim of this rank's sequence length {L} "
                        f"but its sequence dim {stated}: under the balanced split it would reach the method in "
                        f"the permuted order. Fix: state it in the registration, @inner_wrapper(mixer=True, "
                        f"seq_dims={{'{arg}': <dim>}}) (None: it carries no sequence)")
        group = resolve_group(cp_mesh)
        rl = Relayout.cached(meta.perm, P.group_rank(group), P.group_size(group), group, tag="cp.mixer_relayout")
        moved = {}
        for arg, value in named:
            dim = dims.get(arg)
            if dim is None:
                continue
            leaves, spec = tree_flatten(value)
            moved[arg] = tree_unflatten([_move(t, dim, rl.to_contiguous) if isinstance(t, torch.Tensor)
                                         and t.dim() > dim and t.shape[dim] == L else t for t in leaves], spec)
        a = tuple(moved.get(positional[i], v) if i < len(positional) else v for i, v in enumerate(args))
        kw = {k: moved.get(k, v) for k, v in kwargs.items()}
        with cp_batch_context(dataclasses.replace(meta, perm=None, policy="all_gather")):
            out = forward(*a, **kw)
        return map_seq(out, hs.shape[0], L, rl.to_permuted)

    marks = getattr(forward, "__dict__", {})     # every marker the applier reads (__hp_mixer__, __hp_undo__, ...)
    relaid.__dict__.update({k: v for k, v in marks.items() if k.startswith("__hp_") or k == "__wrapped__"})
    return relaid

