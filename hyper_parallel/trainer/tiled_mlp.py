"""The decoder layers' MLPs as tiled MLPs (``schedule.tiled_mlp``).

:func:`install_tiled_mlp` replaces the forward of each decoder layer's ``mlp`` (instance attribute:
parameter names, FSDP2 units and checkpoints are unchanged) with
:func:`hyper_parallel.ops.tiled_mlp` over chunks of ``chunk_size`` local tokens: the MLP
intermediates (``[B, S_local, intermediate]``, several copies for a gated MLP) are never saved for
backward, only the MLP input is; backward recomputes one chunk at a time. Exact (module doc of
:mod:`hyper_parallel.ops.tiled_mlp`).

Which MLPs: a dense, token-wise feed-forward block — a module named ``mlp`` in a decoder layer
(transformers' ``_no_split_modules``) whose class name ends in ``MLP`` and that owns no ``experts``
/ ``router`` (mixture-of-experts blocks record router logits for the auxiliary loss through hooks,
which a no-grad chunked forward would break). Before anything is changed, each MLP class is
probed once on random rows: the chunked output must equal the whole call row for row, else the
class is refused by name. Refused as well: ``tp_size > 1`` (the TP MLP is a DTensor island whose
collectives would run per chunk; not supported yet) and a model without any such MLP.

Local only: no collective; every rank reaches the same verdict on the same config.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..distributed.errors import CPConfigError
from ..distributed.tensor_parallel import find_decoder_layers
from ..ops.tiled_mlp import tiled_mlp

__all__ = ["install_tiled_mlp"]

FIELD = "schedule.tiled_mlp"


def _refuse(problem: str, fix: str) -> CPConfigError:
    return CPConfigError(FIELD, problem, fix=fix)


def _dense_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found, refused = [], []
    for name in find_decoder_layers(model):
        mlp = getattr(model.get_submodule(name), "mlp", None)
        if mlp is None:
            continue
        cls = type(mlp).__name__
        children = {n for n, _ in mlp.named_children()}
        if not cls.endswith("MLP") or children & {"experts", "router"}:
            refused.append(f"{name}.mlp ({cls})")
        else:
            found.append((f"{name}.mlp", mlp))
    if refused:
        raise _refuse(f"{refused[0]} is not a dense token-wise MLP (mixture-of-experts blocks record router "
                      f"logits through hooks; {len(refused)} such module(s))",
                      "set schedule.tiled_mlp: false for this model")
    if not found:
        raise _refuse(f"{type(model).__name__} has no decoder layer with an `mlp` module",
                      "set schedule.tiled_mlp: false")
    return found


def _probe_tokenwise(name: str, mlp: nn.Module) -> None:
    """The chunked forward equals the whole forward row for row on random rows (fp32, no grad)."""
    p = next(mlp.parameters(), None)
    if p is None:
        raise _refuse(f"{name} ({type(mlp).__name__}) has no parameters", "set schedule.tiled_mlp: false")
    gen = torch.Generator().manual_seed(0)
    if p.device.type == "meta":      # a meta-built model: probe a CPU copy with random values
        mlp = copy.deepcopy(mlp).to_empty(device="cpu")
        with torch.no_grad():
            for q in mlp.parameters():
                q.copy_(torch.randn(q.shape, generator=gen) * 0.1)
        p = next(mlp.parameters())
    hidden = p.shape[-1] if p.dim() == 2 else p.numel()
    x = torch.randn(1, 6, hidden, generator=gen).to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        whole = mlp(x)
        parts = torch.cat([mlp(x[:, :2]), mlp(x[:, 2:5]), mlp(x[:, 5:])], dim=1)
    # rounding only (a GEMM over fewer rows may block its sums differently): 1e-4 of the output's
    # scale; a module that mixes tokens differs at the output's own scale
    diff = (whole - parts).abs().max().item()
    if not diff <= 1e-4 * whole.abs().max().item() + 1e-6:
        raise _refuse(f"{name} ({type(mlp).__name__}) is not token-wise: its output for a token depends on "
                      f"other tokens (max diff {diff:.3g})",
                      "set schedule.tiled_mlp: false for this model")


def install_tiled_mlp(model: nn.Module, chunk_size: int, *, tp_size: int = 1) -> list[str]:
    """Tile every decoder layer's dense MLP (module doc); returns the module names."""
    if tp_size > 1:
        raise _refuse(f"not supported with tensor parallelism (accelerator.tp_size={tp_size})",
                      "set schedule.tiled_mlp: false, or tp_size: 1")
    mlps = _dense_mlps(model)
    probed = set()
    for name, mlp in mlps:
        if type(mlp) not in probed:
            _probe_tokenwise(name, mlp)
            probed.add(type(mlp))
    for _, mlp in mlps:
        inner = mlp.forward

        def forward(x, *args, _inner=inner, _mlp=mlp, **kwargs):
            if args or kwargs or x.dim() != 3:
                return _inner(x, *args, **kwargs)
            return tiled_mlp(_inner, x, [p for p in _mlp.parameters() if p.requires_grad], chunk_size=chunk_size)

        mlp.forward = forward
    return [name for name, _ in mlps]
