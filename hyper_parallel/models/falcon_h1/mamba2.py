"""Falcon-H1's Mamba2 mixer (``FalconH1Mixer``) under CP: ``mamba2_state_passing``.

The family's lines around the shared SSD core
(:mod:`hyper_parallel.distributed.context_parallel.mixers.mamba2`): the in-projection
``in_proj(hs * ssm_in_multiplier) * mup_vector``, and after the scan the gated RMS norm
(``mamba_rms_norm``) or the ``silu`` gate. docs/wrappers.md, "Token mixers".
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel.mixers.mamba2 import Mamba2Spec

__all__ = ["MAMBA2_SPEC"]


def _project(m: nn.Module, hs: torch.Tensor) -> torch.Tensor:
    return m.in_proj(hs * m.ssm_in_multiplier) * m.mup_vector


def _finish(m: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return m.norm(y, gate) if m.mamba_rms_norm else y * F.silu(gate)


def _validate(m: nn.Module) -> None:
    width = m.intermediate_size + m.conv_dim + m.num_heads
    mup = getattr(m, "mup_vector", None)
    if mup is None or mup.shape[-1] != width:
        raise ValueError(f"mamba2_state_passing_cp_wrapper: {type(m).__name__}.mup_vector is not one multiplier per "
                         f"in_proj output ({width}); declare sequence_gather (generic, exact) for it instead")
    if not hasattr(m, "ssm_in_multiplier") or not hasattr(m, "mamba_rms_norm"):
        raise ValueError(f"mamba2_state_passing_cp_wrapper: {type(m).__name__} has no ssm_in_multiplier / "
                         "mamba_rms_norm: not Falcon-H1's mixer layout")


MAMBA2_SPEC = Mamba2Spec(family="Falcon-H1", project=_project, finish=_finish, validate=_validate)
