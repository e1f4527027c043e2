"""What the proof compares against and reports: the per-dtype tolerance, the refusal wording and
:class:`ProofReport`; ``NO_INSTANCE_FORWARD`` is the marker the plan applier records."""
from __future__ import annotations

import dataclasses

import torch

#: relative tolerance per compute dtype: ``max|cp - ref| <= rtol * max|ref|`` on valid tokens
#: (layer updates: ``+ rtol/10 * max|layer output|`` for the residual stream's rounding)
PROOF_TOLERANCE = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
}

#: how to skip the proof, in YAML and through the API (the caller then vouches for the model)
OPT_OUT = "accelerator.cp_preflight_proof: false (API: apply_sharding_plan(..., preflight_proof=False))"
FIX = "declare a CP method for it in plan_overrides, or use accelerator.cp_size: 1"
REASON_UNDECLARED = "mixes tokens along the sequence but is not declared for CP"
REASON_DECLARED = ("declared CP method differs from the module's own computation "
                   "(e.g. a dropped mask or window)")


@dataclasses.dataclass
class ProofReport:
    """What a passing proof checked (returned on every rank)."""

    seq_len: int                 # probe S (global, before policy padding)
    rows: int                    # probe rows (3 with the packed row, else 2)
    packed: bool                 # the packed (seq_lens) row was included
    layers: int                  # decoder layers compared
    checkpoints: int             # compared tensors (layer inputs, layer updates, logits)
    max_rel_error: float         # worst error / max|ref| over all checkpoints (max over ranks)
    dtype: str                   # compute dtype of the comparison
    time_s: float


class _MISSING_T:
    def __repr__(self):
        return "<missing>"


_NOTSET = _MISSING_T()

#: "this module had no instance ``forward`` before CP replaced it" — the value the applier records
#: as ``__hp_cp_prev_forward__`` (the plan applier imports it from here)
NO_INSTANCE_FORWARD = _MISSING_T()


def _dtype(name: str):
    for d in PROOF_TOLERANCE:
        if str(d) == name:
            return d
    return torch.float32
