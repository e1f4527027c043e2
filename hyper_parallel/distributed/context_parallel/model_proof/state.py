"""The model state around the probe: :func:`cp_disabled` (original forwards back for the reference
run) and :func:`_preserved` (eval/no_grad, RNG and parameter dtypes restored)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .report import _NOTSET, NO_INSTANCE_FORWARD


@contextlib.contextmanager
def cp_disabled(model: nn.Module):
    """Every CP-wrapped module runs its original forward (and original config) in the body.

    The original is the method's declared one-rank computation (``__hp_one_rank__`` on the CP
    forward: a method that defines a selection transformers leaves unspecified — DSA's and Doge's
    tie rules — runs the same code at a CP group of one), else what the applier replaced
    (``__hp_cp_prev_forward__``), else the wrapper's ``__wrapped__``, else the class forward; a wrapper's undo steps (``__hp_undo__``, e.g. the
    ``flex_hf*`` private config) are run. On exit every module's attributes are put back as
    they were, so the CP path is exactly restored.
    """
    saved = []
    try:
        for mod in model.modules():
            d = mod.__dict__
            if "__hp_cp_wrapped__" not in d:
                continue
            snapshot = dict(d)
            saved.append((mod, snapshot))
            fwd = d.get("forward")
            for undo in reversed(list(getattr(fwd, "__hp_undo__", []) or [])):
                undo()
            if getattr(fwd, "__hp_one_rank__", None) is not None:
                orig = fwd.__hp_one_rank__          # the method's own computation at a CP group of one
            elif "__hp_cp_prev_forward__" in d:
                orig = d["__hp_cp_prev_forward__"]
            elif fwd is not None and hasattr(fwd, "__wrapped__"):
                orig = fwd.__wrapped__
            else:
                orig = NO_INSTANCE_FORWARD
            if orig is NO_INSTANCE_FORWARD:
                d.pop("forward", None)
            else:
                d["forward"] = orig
        yield
    finally:
        for mod, snapshot in reversed(saved):
            d = mod.__dict__
            for k in [k for k in d if k not in snapshot]:
                del d[k]
            for k, v in snapshot.items():
                if d.get(k, _NOTSET) is not v:
                    d[k] = v


@contextlib.contextmanager
def _preserved(model: nn.Module, upcast: bool):
    """eval() + no_grad for the body; train flags, RNG and (upcast) parameter dtypes restored."""
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    dev_rng = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev_rng = torch.cuda.get_rng_state_all()
    cast: list = []
    try:
        if upcast:
            tensors = list(model.parameters()) + list(model.buffers())
            if not any(hasattr(t, "_local_tensor") for t in tensors):
                for t in tensors:
                    if t.dtype in (torch.bfloat16, torch.float16):
                        cast.append((t, t.data))
                        t.data = t.data.float()
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for t, data in cast:
            t.data = data
        for m, flag in modes:
            m.training = flag
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state_all(dev_rng)
