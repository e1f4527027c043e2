"""Saving a checkpoint atomically (collective).

Every rank writes its DCP files under ``step_<N>.partial/`` and checksums them; rank 0 writes the
signed manifest (:mod:`.manifest`) and renames the directory to ``step_<N>/`` once every rank is
done, so a ``step_<N>`` directory is always complete. A rank whose launcher is gone stops before
the rename (:func:`~hyper_parallel.platform.shutdown.stop_if_launcher_gone`): an interrupted save
stays a ``.partial`` that ``resume_from: latest`` never picks. Every rank-0-only file operation is
agreed (a timed all-gather), so a failure raises on every rank.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ...distributed.preflight import agree_or_raise
from ...platform import all_gather_object
from ...platform.faults import maybe_inject_fault
from ...platform.process_group import timed_world_group
from ...platform.shutdown import stop_if_launcher_gone
from .files import CHECKSUM, FORMAT, PARTIAL, own_file_sums, rotate
from .manifest import write_meta


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(path: str | Path, model, optimizer, *, step: int, data_position: int,
                    topology: dict, scheduler_state: dict | None = None, extra: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory ``path``.

    Atomic: everything is written under ``<path>.partial`` (cleared first), which rank 0 renames to
    ``path`` (replacing an older ``path``) once every rank's files are written and checksummed;
    then, with ``keep_last``, the oldest complete checkpoints beside ``path`` are removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    path = Path(path)
    final, path = path, path.with_name(path.name + PARTIAL)

    def clear():
        if _is_main() and path.exists():
            shutil.rmtree(path)

    agree_or_raise(clear, what="checkpoint save (clearing the temporary directory)", same_error=True)
    # optimizer state flattened per parameter name (hyperparameters too): a resume at another PP size
    # finds each parameter's state and group settings whichever stage saved it
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(step, dtype=torch.int64),
                         "data_position": torch.tensor(data_position, dtype=torch.int64)}}
    rank = dist.get_rank() if dist.is_initialized() else 0
    maybe_inject_fault(rank, step, "save")   # test hook (platform/faults.py)
    dcp.save(state, checkpoint_id=str(path), process_group=timed_world_group())
    try:  # each rank checksums what it wrote; the outcome is gathered even on failure
        mine = own_file_sums(path, rank)
    except OSError as exc:
        mine = f"rank {rank} could not read back its checkpoint files in {path}: {exc}"
    gathered = all_gather_object(mine)
    errors = [g for g in gathered if isinstance(g, str)]
    if errors:
        raise OSError(errors[0])
    files = {}
    for part in gathered:
        files.update(part)
    if _is_main():
        write_meta(path, {"format": FORMAT, "step": step, "data_position": data_position, "topology": topology,
                          "scheduler": scheduler_state, "optimizer": type(optimizer).__name__, "optimizer_layout": "flat",
                          "checksum": CHECKSUM, "files": dict(sorted(files.items())), **(extra or {})})

    def publish():
        if not _is_main():
            return
        stop_if_launcher_gone()   # an orphaned rank commits no checkpoint
        if final.exists():   # re-saving the same step: the new one replaces it
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(path, final)
            shutil.rmtree(old)
        else:
            os.rename(path, final)
        rotate(final.parent, keep_last, keep=final)

    agree_or_raise(publish, what="checkpoint save (rename)", same_error=True)   # platform all-gather: the barrier
    return final
