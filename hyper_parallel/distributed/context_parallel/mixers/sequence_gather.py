"""``sequence_gather``: the generic exact CP for any token mixer — AllGather the sequence, the
module's own forward on it (each document its own row), this rank's slice kept; backward
ReduceScatter(sum). Compute and activation memory of the layer are not divided by cp."""
from __future__ import annotations

import torch.nn as nn

from ..comm import all_gather_seq
from ..registry import inner_wrapper
from .rows import (accepts, current_fqn, gather_any, hidden_param, map_seq, mixer_call, run_rows,
                   validate_common)

__all__ = ["sequence_gather_cp_wrapper", "validate_sequence_gather"]


def validate_sequence_gather(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    validate_common("sequence_gather_cp_wrapper", target_module, tp_size)


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_sequence_gather)
def sequence_gather_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Generic exact CP for a token mixer: AllGather the sequence, run the module's own forward on
    it (each document as its own row), keep this rank's slice; backward ReduceScatter(sum).
    Compute and activation memory of this layer are not divided by cp (see the module doc)."""
    del mesh, tp_mesh, ep_mesh
    what = "sequence_gather_cp_wrapper"
    original = target_module.forward
    name = hidden_param(target_module)
    mask_param = accepts(target_module, "attention_mask")
    fqn = current_fqn()

    def forward(*args, **kwargs):
        entry = mixer_call(what, fqn, name, cp_mesh, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, rebuild, rest_args, rest_kwargs = entry
        B, L, _ = hs.shape
        lo = meta.cp_rank * L
        full = all_gather_seq(hs.contiguous(), cp_mesh, dim=1, tag="cp.mixer_gather")      # [B, S, H]
        gather = lambda t: gather_any(t, cp_mesh, "cp.mixer_gather_arg")              # noqa: E731
        rest_args = map_seq(rest_args, B, L, gather)
        rest_kwargs = map_seq(rest_kwargs, B, L, gather)
        key_doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        return run_rows(original, rebuild, full, key_doc, lo, lo + L, rest_args, rest_kwargs,
                         mask_param=mask_param, what=what, fqn=fqn)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward
