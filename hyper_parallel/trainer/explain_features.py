"""The memory features of ``hyper-train --explain`` beyond :mod:`.explain_estimates`, and which
catalogue row a resolved CP target is (its cost model is the row's: ``catalogue.cost_model``).

* :func:`method_name` — the catalogue row of a resolved CP target (attention wrappers carry it in
  their ``WrapperInfo``; a mixer wrapper is found by its entry function among the rows' offers);
* :func:`tiled_mlp_transient` — what a tiled MLP's backward holds for one chunk (intermediates,
  their gradients and the fp32 parameter-gradient accumulators of one MLP);
* :func:`offload_split` — device / host bytes of the checkpointed layer inputs under activation
  offload (on CPU the host buffers are tensors of the same memory).
docs/trainer.md "--explain" states the measured error of each.
"""
from __future__ import annotations

import torch.nn as nn


def method_name(target) -> str:
    """The catalogue row name of ``target`` (a ResolvedCPTarget), or ``"custom"``."""
    from ..distributed.context_parallel.catalogue import METHODS

    if target.info is not None and target.info.method != "custom":
        return target.info.method
    entry = getattr(target.fn, "__name__", "")
    for row in METHODS.values():
        if any(o.entry == entry for o in row.offers):
            return row.name
    return "custom"


def tiled_mlp_transient(model: nn.Module, mlp_names: list, chunk: int, s_local: int, B: int, elem: int) -> float:
    """A tiled MLP's backward for one chunk of ``chunk`` tokens: the recomputed intermediates it
    saves (every Linear output but the last, and the activation's), two intermediate-sized
    gradients alive at a time, plus the fp32 accumulators of one MLP's parameters."""
    if not mlp_names:
        return 0.0
    mlp = model.get_submodule(mlp_names[0])
    lin = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    width = lin[0].out_features if lin else 0
    inter = sum(m.out_features for m in lin[:-1]) + width + 2 * width   # saved + the activation's + 2 gradients
    tokens = min(chunk, s_local) * B
    acc = sum(p.numel() for p in mlp.parameters()) * 4
    return tokens * inter * elem + acc


def offload_split(L: int, s_local: int, B: int, H: int, elem: int) -> tuple[float, float]:
    """(device bytes kept, host bytes) of the layer inputs under activation offload: all ``L``
    inputs go to host, two come back at a time (the layer being recomputed and the prefetched one)."""
    per = s_local * B * H * elem
    return 2 * per * (L > 1), L * per
