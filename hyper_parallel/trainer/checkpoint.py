"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): model + optimizer + step + data.

Layout of ``<dir>/step_<N>/``:

  DCP files     ``model`` (FSDP/TP DTensors saved sharded), ``optim``, and ``trainer.step`` /
                ``trainer.data_position`` tensors
  hyper_meta.json  rank 0: topology (cp_size, dp_shard, dp_replicate, tp, world_size), step,
                data position, LR-scheduler state and the run config (read before loading)

Resuming requires the *same* topology. Resharding to another CP size is out of scope
(design 1.3) and is rejected before anything is loaded, with an error naming
``schedule.resume_from`` and both sizes; other topology changes are rejected the same way
because every DP rank's data stream depends on them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.errors import CPConfigError
from ..platform import barrier

META_FILE = "hyper_meta.json"
FORMAT = "hyper_parallel.trainer/1"
TOPOLOGY_KEYS = (("cp_size", "accelerator.cp_size"), ("dp_shard", "accelerator.dp_shard_size"),
                 ("dp_replicate", "accelerator.dp_replicate_size"), ("tp", "accelerator.tp_size"),
                 ("world_size", "world size"))


def topology_of(mesh) -> dict:
    s = mesh.sizes
    return {"cp_size": s.cp, "dp_shard": s.dp_shard, "dp_replicate": s.dp_replicate, "tp": s.tp,
            "world_size": mesh.world_size}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(path: str | Path, model, optimizer, *, step: int, data_position: int,
                    topology: dict, scheduler_state: dict | None = None, extra: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(step, dtype=torch.int64),
                         "data_position": torch.tensor(data_position, dtype=torch.int64)}}
    dcp.save(state, checkpoint_id=str(path))
    if _is_main():
        meta = {"format": FORMAT, "step": step, "data_position": data_position, "topology": topology,
                "scheduler": scheduler_state, **(extra or {})}
        (path / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
    barrier()  # platform: with the collective timeout
    return path


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CPConfigError("schedule.resume_from", f"{path} is not a hyper_parallel checkpoint "
                            f"(no {META_FILE})", fix="point it at a <checkpoint_dir>/step_<N> directory")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise CPConfigError("schedule.resume_from", f"{path}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def check_topology(path, saved: dict, current: dict) -> None:
    """Raise CPConfigError naming schedule.resume_from and both sizes on any mismatch."""
    if saved.get("cp_size") != current["cp_size"]:
        raise CPConfigError(
            "schedule.resume_from",
            f"checkpoint {path} was saved with accelerator.cp_size={saved.get('cp_size')} but this run has "
            f"accelerator.cp_size={current['cp_size']}: resharding a checkpoint to another CP size is not "
            "supported (out of scope in Phase 1)",
            fix=f"resume with accelerator.cp_size={saved.get('cp_size')}, or start a fresh run without resume_from")
    for key, field in TOPOLOGY_KEYS[1:]:
        if saved.get(key) != current[key]:
            raise CPConfigError(
                "schedule.resume_from",
                f"checkpoint {path} was saved with {field}={saved.get(key)} but this run has "
                f"{field}={current[key]}: resuming requires the same topology (each DP rank's data "
                "stream and the sharded state depend on it)",
                fix=f"resume with {field}={saved.get(key)}")


def validate_resume(path: str | Path | None, topology: dict) -> dict | None:
    """Agreed on every rank: the checkpoint exists and was saved with this topology.

    Collective: every rank calls it, also those with no ``path`` (they check nothing and
    return None), so that a ``resume_from`` set on only some ranks fails every rank here.
    """
    from ..distributed.preflight import agree_or_raise

    def check():
        if not path:
            return None
        meta = read_meta(path)
        check_topology(path, meta.get("topology", {}), topology)
        return meta

    return agree_or_raise(check, what="checkpoint resume")


def load_checkpoint(path: str | Path, model, optimizer, *, topology: dict) -> dict:
    """Collective. Validates the topology first, then loads model + optimizer in place.

    Returns the checkpoint metadata (step, data_position, scheduler state, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = validate_resume(path, topology)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(-1, dtype=torch.int64),
                         "data_position": torch.tensor(-1, dtype=torch.int64)}}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["trainer"]["step"])
    pos = int(state["trainer"]["data_position"])
    if step != meta["step"] or pos != meta["data_position"]:
        raise CPConfigError("schedule.resume_from", f"{path}: DCP state (step={step}, data_position={pos}) "
                            f"disagrees with {META_FILE} (step={meta['step']}, "
                            f"data_position={meta['data_position']})", fix="the checkpoint is corrupt")
    return meta
