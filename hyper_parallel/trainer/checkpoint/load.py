"""Loading a verified checkpoint: the structure check against this model and optimizer, then DCP.

:func:`check_structure` (local) compares every tensor and optimizer field of this run with the
DCP index ``.metadata`` before a byte of tensor data is read; :func:`load_checkpoint` (collective)
agrees that check on every rank, then reads the shards this run needs (DCP reshards another CP /
DP / world size) with the collective timeout of ``accelerator.comm_timeout_s``.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ...distributed.errors import CPConfigError
from ...distributed.preflight import agree_or_raise
from ...platform.process_group import timed_world_group
from .files import DCP_METADATA, META_FILE, damaged
from .resume import validate_resume
from .topology import describe_reshard

log = logging.getLogger("hyper_parallel.trainer")


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


_MODEL_FIX = ("resume with the model config the checkpoint was saved with (its hyper_meta.json 'config' "
              "holds it), or start a fresh run without schedule.resume_from")
_OPTIM_FIX = ("resume with the optimizer the checkpoint was saved with (optimizer.name; its hyper_meta.json "
              "'config' holds it), or start a fresh run without schedule.resume_from")


def _shape(size) -> str:
    return "[" + ", ".join(str(int(d)) for d in size) + "]"


def check_structure(path: str | Path, meta: dict, state: dict, optimizer, held=None) -> None:
    """Local (no collective): this run's model and optimizer state fit the checkpoint.

    Compares the optimizer class recorded in ``hyper_meta.json``, then every entry of ``state``
    (flattened the way DCP names them: ``model.<fqn>``, ``optim.state.<fqn>.<field>``,
    ``optim.param_groups.<i>.<field>``) with the DCP index ``.metadata``: present, a tensor where
    a tensor is expected, the same global shape; then the checkpoint's ``model.``/``optim.``
    entries this run lacks (``held``: the keys of every rank, for a pipeline stage holding part of the
    model). Raises :class:`CPConfigError` naming the first mismatch (model order)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    saved_opt, ours = meta.get("optimizer"), type(optimizer).__name__
    if saved_opt is not None and saved_opt != ours:
        raise CPConfigError("schedule.resume_from", f"checkpoint {path} holds {saved_opt} optimizer state but "
                            f"this run's optimizer is {ours}", fix=_OPTIM_FIX)
    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any unreadable index is a damaged checkpoint
        raise damaged(path, DCP_METADATA, f"cannot be read ({type(exc).__name__}: {exc})") from None
    flat, _ = flatten_state_dict({"model": state["model"], "optim": state["optim"]})

    def refuse(key: str, problem: str):
        is_model = key.startswith("model.")
        what = f"tensor {key[len('model.'):]}" if is_model else f"optimizer field {key[len('optim.'):]}"
        raise CPConfigError("schedule.resume_from", f"checkpoint {path} does not fit this "
                            f"{'model' if is_model else 'optimizer'}: {what} {problem}",
                            fix=_MODEL_FIX if is_model else _OPTIM_FIX)

    for key, value in flat.items():
        if key not in saved:
            refuse(key, "is not in the checkpoint" + (f" (the model's shape is {_shape(value.shape)})"
                                                      if torch.is_tensor(value) else ""))
        if torch.is_tensor(value):
            rec = saved[key]
            if not isinstance(rec, TensorStorageMetadata):
                refuse(key, "is a tensor here but not in the checkpoint")
            if tuple(rec.size) != tuple(value.shape):
                refuse(key, f"has shape {_shape(rec.size)} in the checkpoint but {_shape(value.shape)} in this "
                            f"{'model' if key.startswith('model.') else 'optimizer'}")
    for key in saved:
        if key.startswith(("model.", "optim.")) and key not in (flat if held is None else held):
            rec = saved[key]
            shape = f" (shape {_shape(rec.size)})" if isinstance(rec, TensorStorageMetadata) else ""
            refuse(key, f"is in the checkpoint{shape} but not in this "
                        f"{'model' if key.startswith('model.') else 'optimizer'}")


def load_checkpoint(path: str | Path, model, optimizer, *, topology: dict, meta: dict | None = None,
                    allow_unverified: bool = False) -> dict:
    """Collective. Validates the checkpoint first (:func:`validate_resume`; skipped when ``meta``
    is the result of that call for this ``path``), then loads model + optimizer in place.

    Returns the checkpoint metadata (step, data_position, scheduler state, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    if meta is None:
        meta = validate_resume(path, topology, allow_unverified=allow_unverified)
    # checkpoints of this version keep the optimizer state flattened per parameter name (save.py)
    options = StateDictOptions(flatten_optimizer_state_dict=meta.get("optimizer_layout") == "flat")
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(-1, dtype=torch.int64),
                         "data_position": torch.tensor(-1, dtype=torch.int64)}}
    held = None
    if topology.get("pp", 1) > 1:      # each stage holds part of the model: the entries of all of them
        if not options.flatten_optimizer_state_dict:
            raise CPConfigError("schedule.resume_from", f"checkpoint {path} keeps its optimizer state by parameter "
                                "group (saved by an older version), which a pipeline stage cannot read its part of",
                                fix="resume it at accelerator.pp_size: 1 once; its next checkpoint reads at any PP size")
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        from ...platform import all_gather_object

        mine = list(flatten_state_dict({"model": state["model"], "optim": state["optim"]})[0])
        held = set().union(*all_gather_object(mine))
    agree_or_raise(lambda: check_structure(path, meta, state, optimizer, held), what="checkpoint structure",
                   same_error=True)
    reshard = meta.get("reshard")
    if reshard and _is_main():
        log.info("resuming %s at another topology (%s): DCP reshards the model and optimizer state; the data "
                 "position (%s micro-batches per DP rank) carries over", path, describe_reshard(reshard),
                 meta.get("data_position"))
    dcp.load(state, checkpoint_id=str(path), process_group=timed_world_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    step = int(state["trainer"]["step"])
    pos = int(state["trainer"]["data_position"])
    if step != meta["step"] or pos != meta["data_position"]:
        raise CPConfigError("schedule.resume_from", f"{path}: DCP state (step={step}, data_position={pos}) "
                            f"disagrees with {META_FILE} (step={meta['step']}, "
                            f"data_position={meta['data_position']})", fix="the checkpoint is corrupt")
    return meta
