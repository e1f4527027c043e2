"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): model + optimizer + step + data.

Layout of ``<dir>/step_<N>/``:

  DCP files     ``model`` (FSDP/TP DTensors saved sharded), ``optim``, and ``trainer.step`` /
                ``trainer.data_position`` tensors
  hyper_meta.json  rank 0: topology (cp_size, dp_shard, dp_replicate, tp, world_size), step,
                data position, LR-scheduler state, the optimizer class, the run config and
                ``files``: the size and CRC-32 of every other file of the directory (each rank
                checksums the files it wrote; gathered through :mod:`hyper_parallel.platform`)

Loading first verifies the directory (:func:`verify_checkpoint`: ``hyper_meta.json`` readable,
every recorded file present with its size and CRC-32; the ranks split the files between them),
then the structure (:func:`check_structure`: every tensor and optimizer field of this model and
optimizer is in the checkpoint with the same shape, and nothing more), and only then reads the
tensors. Every failure is one :class:`CPConfigError` naming ``schedule.resume_from``, the
checkpoint and the damaged file or mismatching tensor, raised identically on every rank.

Saves are atomic: the files go to ``step_<N>.partial/`` and rank 0 renames it to ``step_<N>/``
once every rank has written and checksummed its files (an agreement through the platform layer,
with the collective timeout), so a ``step_<N>`` directory is always complete; ``keep_last`` then
removes the oldest complete ones. ``resume_from: latest`` is the newest complete ``step_<N>``.

Resuming at another CP size, DP size or world size reshards: DCP saves every tensor by its
global shape (FSDP2/DTensor shards with their offsets) and reads back the pieces this run's
shards need, model and optimizer state alike, so CP=2 -> 1 or 4 and a DP change load the same
state; the data position (global micro-batches consumed per DP rank) carries over unchanged.
Another TP size is refused by name (:func:`check_topology`).

Every collective of a save or a load honours ``accelerator.comm_timeout_s``: DCP runs on
:func:`~hyper_parallel.platform.process_group.timed_world_group` (the default group may have been
created before the config was read, with the launcher-wide timeout), the agreements go through
the platform layer's timed waits.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.errors import CPConfigError
from ..distributed.preflight import agree_or_raise
from ..platform import all_gather_object, barrier
from ..platform.faults import maybe_inject_fault
from ..platform.process_group import timed_world_group

log = logging.getLogger("hyper_parallel.trainer")
META_FILE = "hyper_meta.json"
FORMAT = "hyper_parallel.trainer/1"
DCP_METADATA = ".metadata"
CHECKSUM = "crc32"
_CHUNK = 8 << 20
_RECOVER = ("resume from an earlier complete checkpoint (another step_<N> directory), or start a "
            "fresh run without schedule.resume_from")
TOPOLOGY_KEYS = (("cp_size", "accelerator.cp_size"), ("dp_shard", "accelerator.dp_shard_size"),
                 ("dp_replicate", "accelerator.dp_replicate_size"), ("tp", "accelerator.tp_size"),
                 ("world_size", "world size"))


def topology_of(mesh) -> dict:
    s = mesh.sizes
    return {"cp_size": s.cp, "dp_shard": s.dp_shard, "dp_replicate": s.dp_replicate, "tp": s.tp,
            "world_size": mesh.world_size}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


PARTIAL = ".partial"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root`` (``step_<N>`` directories holding hyper_meta.json,
    never a ``.partial`` one), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(path: str | Path, root: str | Path | None) -> Path:
    """``resume_from`` as a directory: ``latest`` -> the newest complete checkpoint under ``root``
    (``schedule.checkpoint_dir``); raises :class:`CPConfigError` when there is none."""
    if str(path) != LATEST:
        return Path(path)
    found = complete_checkpoints(root) if root is not None else []
    if not found:
        raise CPConfigError("schedule.resume_from", f"'latest' found no complete checkpoint (step_<N> with "
                            f"{META_FILE}) in {root}", fix="set schedule.checkpoint_dir to the directory that "
                            "holds the step_<N> checkpoints, or start a fresh run without resume_from")
    return found[-1]


def rotate(root: str | Path, keep_last: int | None, *, keep: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints under ``root`` (never ``keep``);
    returns the removed directories. Rank 0 only (call it from :func:`save_checkpoint`)."""
    if not keep_last:
        return []
    done = complete_checkpoints(root)
    removed = [p for p in done[:-keep_last] if keep is None or p.resolve() != keep.resolve()]
    for p in removed:
        shutil.rmtree(p)
    return removed


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(path: str | Path, model, optimizer, *, step: int, data_position: int,
                    topology: dict, scheduler_state: dict | None = None, extra: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory ``path``.

    Atomic: everything is written under ``<path>.partial`` (cleared first), which rank 0 renames to
    ``path`` (replacing an older ``path``) once every rank's files are written and checksummed;
    then, with ``keep_last``, the oldest complete checkpoints beside ``path`` are removed. Every
    rank-0-only file operation is agreed (one all-gather with the collective timeout), so a failure
    raises on every rank instead of leaving the others waiting."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    final, path = path, path.with_name(path.name + PARTIAL)

    def clear():
        if _is_main() and path.exists():
            shutil.rmtree(path)

    agree_or_raise(clear, what="checkpoint save (clearing the temporary directory)", same_error=True)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(step, dtype=torch.int64),
                         "data_position": torch.tensor(data_position, dtype=torch.int64)}}
    rank = dist.get_rank() if dist.is_initialized() else 0
    maybe_inject_fault(rank, step, "save")   # test hook (platform/faults.py)
    dcp.save(state, checkpoint_id=str(path), process_group=timed_world_group())
    try:  # each rank checksums what it wrote; the outcome is gathered even on failure
        mine = _own_file_sums(path, rank)
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
        meta = {"format": FORMAT, "step": step, "data_position": data_position, "topology": topology,
                "scheduler": scheduler_state, "optimizer": type(optimizer).__name__,
                "checksum": CHECKSUM, "files": dict(sorted(files.items())), **(extra or {})}
        (path / META_FILE).write_text(json.dumps(meta, indent=1, default=str))

    def publish():
        if not _is_main():
            return
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


def file_checksum(path: str | Path) -> int:
    """CRC-32 (``zlib.crc32``) of a file, read in 8 MiB chunks (about 0.45 s/GB on one core)."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _own_file_sums(path: Path, rank: int) -> dict:
    """{file name: {"size", "crc32"}} for the DCP files ``rank`` wrote (``__<rank>_*.distcp``;
    rank 0 also the DCP ``.metadata``)."""
    names = sorted(p.name for p in path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(DCP_METADATA)
    return {n: {"size": (path / n).stat().st_size, CHECKSUM: file_checksum(path / n)} for n in names}


def _damaged(path, name: str, problem: str) -> CPConfigError:
    return CPConfigError("schedule.resume_from", f"checkpoint {path} is damaged: {name} {problem}", fix=_RECOVER)


def verify_checkpoint(path: str | Path, meta: dict, *, part: int = 0, parts: int = 1) -> None:
    """Local check (no collective) of the files recorded in ``meta["files"]``: present, same size,
    same CRC-32. Only every ``parts``-th file starting at ``part`` is read (ranks split the work).
    A checkpoint saved before checksums existed gets the presence check of ``.metadata`` only.
    Raises :class:`CPConfigError` naming the checkpoint and the first damaged file."""
    path = Path(path)
    files = meta.get("files")
    if not isinstance(files, dict):
        if not (path / DCP_METADATA).is_file():
            raise _damaged(path, DCP_METADATA, "is missing (the DCP index of every tensor)")
        return
    for i, (name, rec) in enumerate(sorted(files.items())):
        if i % parts != part:
            continue
        f = path / name
        if not f.is_file():
            raise _damaged(path, name, "is missing")
        size = f.stat().st_size
        if size != rec.get("size"):
            raise _damaged(path, name, f"has {size} bytes but the save wrote {rec.get('size')} "
                                       "(truncated or overwritten)")
        crc = file_checksum(f)
        if crc != rec.get(CHECKSUM):
            raise _damaged(path, name, f"fails its checksum ({CHECKSUM} {crc:08x}, the save recorded "
                                       f"{rec.get(CHECKSUM, 0):08x}): its bytes changed after the save")


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    meta_file = path / META_FILE
    partial = path.with_name(path.name + PARTIAL)
    if not path.exists() and partial.is_dir():
        raise CPConfigError("schedule.resume_from", f"checkpoint {path} was never completed: its save was "
                            f"interrupted (only {partial} exists)", fix=_RECOVER + " (or resume_from: latest)")
    if not meta_file.is_file():
        raise CPConfigError("schedule.resume_from", f"{path} is not a hyper_parallel checkpoint "
                            f"(no {META_FILE})", fix="point it at a <checkpoint_dir>/step_<N> directory")
    try:
        text = meta_file.read_text()
    except OSError as exc:
        raise _damaged(path, META_FILE, f"cannot be read ({exc})") from None
    if not text.strip():
        raise _damaged(path, META_FILE, "is empty")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise _damaged(path, META_FILE, f"is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise _damaged(path, META_FILE, f"is not a JSON object (got {type(meta).__name__})")
    if meta.get("format") != FORMAT:
        raise CPConfigError("schedule.resume_from", f"{path}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def check_topology(path, saved: dict, current: dict) -> dict | None:
    """What a resume from a checkpoint saved with topology ``saved`` onto ``current`` needs.

    Returns None for the same topology, else ``{"from": saved, "to": current}``: the CP size, the
    DP sizes and the world size may change, because DCP reshards every FSDP2/DTensor tensor
    (model and optimizer state are saved by global shape and read back as this run's shards) and
    the data stream position is per DP rank (global micro-batches consumed). The TP size may not:
    a TP plan restructures its modules (heads split per rank, fused projections) and nothing
    checks that the saved shards map onto another TP layout, so it raises :class:`CPConfigError`
    naming ``accelerator.tp_size`` and both sizes."""
    if saved.get("tp", 1) != current["tp"]:
        raise CPConfigError(
            "schedule.resume_from",
            f"checkpoint {path} was saved with accelerator.tp_size={saved.get('tp')} but this run has "
            f"accelerator.tp_size={current['tp']}: tensor-parallel state is not resharded (the TP plan "
            "restructures its modules: attention heads and MLP columns split per rank)",
            fix=f"resume with accelerator.tp_size={saved.get('tp')} (cp_size and the DP sizes may change)")
    changed = [k for k, _ in TOPOLOGY_KEYS if saved.get(k) != current[k]]
    return {"from": {k: saved.get(k) for k, _ in TOPOLOGY_KEYS}, "to": dict(current)} if changed else None


def describe_reshard(reshard: dict) -> str:
    """``cp_size 2 -> 1, world_size 2 -> 1`` for the sizes that differ."""
    return ", ".join(f"{field.split('.')[-1]} {reshard['from'][k]} -> {reshard['to'][k]}"
                     for k, field in TOPOLOGY_KEYS if reshard["from"].get(k) != reshard["to"].get(k))


def validate_resume(path: str | Path | None, topology: dict, root: str | Path | None = None) -> dict | None:
    """Agreed on every rank: the checkpoint exists, is intact (:func:`verify_checkpoint`, the files
    split between the ranks) and its topology can be loaded here (:func:`check_topology`: another
    CP / DP / world size is resharded, ``meta["reshard"]``; another TP size is refused); the same
    error on every rank.

    Collective: every rank calls it, also those with no ``path`` (they check nothing and
    return None), so that a ``resume_from`` set on only some ranks fails every rank here.
    ``latest`` is resolved under ``root`` (:func:`resolve_resume`); the returned metadata carries
    the directory actually checked as ``meta["path"]``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timed_world_group()   # created here, at set-up on every rank, before any save or load needs it

    def check():
        if not path:
            return None
        where = resolve_resume(path, root)
        meta = read_meta(where)
        reshard = check_topology(where, meta.get("topology", {}), topology)
        verify_checkpoint(where, meta, part=rank, parts=world)
        return {**meta, "path": str(where), "reshard": reshard}

    return agree_or_raise(check, what="checkpoint resume", same_error=True)


_MODEL_FIX = ("resume with the model config the checkpoint was saved with (its hyper_meta.json 'config' "
              "holds it), or start a fresh run without schedule.resume_from")
_OPTIM_FIX = ("resume with the optimizer the checkpoint was saved with (optimizer.name; its hyper_meta.json "
              "'config' holds it), or start a fresh run without schedule.resume_from")


def _shape(size) -> str:
    return "[" + ", ".join(str(int(d)) for d in size) + "]"


def check_structure(path: str | Path, meta: dict, state: dict, optimizer) -> None:
    """Local (no collective): this run's model and optimizer state fit the checkpoint.

    Compares the optimizer class recorded in ``hyper_meta.json``, then every entry of ``state``
    (flattened the way DCP names them: ``model.<fqn>``, ``optim.state.<fqn>.<field>``,
    ``optim.param_groups.<i>.<field>``) with the DCP index ``.metadata``: present, a tensor where
    a tensor is expected, the same global shape; then the checkpoint's ``model.``/``optim.``
    entries this run lacks. Raises :class:`CPConfigError` naming the first mismatch (model order)."""
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
        raise _damaged(path, DCP_METADATA, f"cannot be read ({type(exc).__name__}: {exc})") from None
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
        if key.startswith(("model.", "optim.")) and key not in flat:
            rec = saved[key]
            shape = f" (shape {_shape(rec.size)})" if isinstance(rec, TensorStorageMetadata) else ""
            refuse(key, f"is in the checkpoint{shape} but not in this "
                        f"{'model' if key.startswith('model.') else 'optimizer'}")


def load_checkpoint(path: str | Path, model, optimizer, *, topology: dict, meta: dict | None = None) -> dict:
    """Collective. Validates the checkpoint first (:func:`validate_resume`; skipped when ``meta``
    is the result of that call for this ``path``), then loads model + optimizer in place.

    Returns the checkpoint metadata (step, data_position, scheduler state, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if meta is None:
        meta = validate_resume(path, topology)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd,
             "trainer": {"step": torch.tensor(-1, dtype=torch.int64),
                         "data_position": torch.tensor(-1, dtype=torch.int64)}}
    agree_or_raise(lambda: check_structure(path, meta, state, optimizer), what="checkpoint structure",
                   same_error=True)
    reshard = meta.get("reshard")
    if reshard and _is_main():
        log.info("resuming %s at another topology (%s): DCP reshards the model and optimizer state; the data "
                 "position (%s micro-batches per DP rank) carries over", path, describe_reshard(reshard),
                 meta.get("data_position"))
    dcp.load(state, checkpoint_id=str(path), process_group=timed_world_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["trainer"]["step"])
    pos = int(state["trainer"]["data_position"])
    if step != meta["step"] or pos != meta["data_position"]:
        raise CPConfigError("schedule.resume_from", f"{path}: DCP state (step={step}, data_position={pos}) "
                            f"disagrees with {META_FILE} (step={meta['step']}, "
                            f"data_position={meta['data_position']})", fix="the checkpoint is corrupt")
    return meta
