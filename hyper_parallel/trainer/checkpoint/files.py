"""The files of one checkpoint directory: names, layout, CRC-32 of each file, the damage checks.

A checkpoint is ``<checkpoint_dir>/step_<N>/`` (written as ``step_<N>.partial/`` and renamed);
``hyper_meta.json`` records the size and CRC-32 of every other file (:func:`own_file_sums`, per
rank) and :func:`verify_checkpoint` compares them. Local only: no collective here. See
docs/trainer.md "Checkpoints and failures".
"""
from __future__ import annotations

import re
import shutil
import zlib
from pathlib import Path

from ...distributed.errors import CPConfigError

META_FILE = "hyper_meta.json"
FORMAT = "hyper_parallel.trainer/1"
DCP_METADATA = ".metadata"
CHECKSUM = "crc32"
PARTIAL = ".partial"
LATEST = "latest"
_CHUNK = 8 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")
RECOVER = ("resume from an earlier complete checkpoint (another step_<N> directory, or resume_from: latest), "
           "or start a fresh run without schedule.resume_from")


_DAMAGED = " is damaged: "


def damaged(path, name: str, problem: str) -> CPConfigError:
    """The error for a checkpoint whose files (or ``hyper_meta.json``) changed after the save."""
    return CPConfigError("schedule.resume_from", f"checkpoint {path}{_DAMAGED}{name} {problem}", fix=RECOVER)


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` is :func:`damaged`'s (``resume_from: latest`` then tries an older checkpoint;
    any other refusal, e.g. another TP size, stands). Survives the pickling between ranks."""
    return isinstance(exc, CPConfigError) and _DAMAGED in str(getattr(exc, "problem", ""))


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root`` (``step_<N>`` directories holding hyper_meta.json,
    never a ``.partial`` one), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def rotate(root: str | Path, keep_last: int | None, *, keep: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints under ``root`` (never ``keep``);
    returns the removed directories. Rank 0 only (called by ``save_checkpoint``)."""
    if not keep_last:
        return []
    done = complete_checkpoints(root)
    removed = [p for p in done[:-keep_last] if keep is None or p.resolve() != keep.resolve()]
    for p in removed:
        shutil.rmtree(p)
    return removed


def file_checksum(path: str | Path) -> int:
    """CRC-32 (``zlib.crc32``) of a file, read in 8 MiB chunks (about 0.45 s/GB on one core)."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def own_file_sums(path: Path, rank: int) -> dict:
    """{file name: {"size", "crc32"}} for the DCP files ``rank`` wrote (``__<rank>_*.distcp``;
    rank 0 also the DCP ``.metadata``)."""
    names = sorted(p.name for p in path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(DCP_METADATA)
    return {n: {"size": (path / n).stat().st_size, CHECKSUM: file_checksum(path / n)} for n in names}


def verify_checkpoint(path: str | Path, meta: dict, *, part: int = 0, parts: int = 1) -> None:
    """Local check of the files recorded in ``meta["files"]``: present, same size, same CRC-32.
    Only every ``parts``-th file starting at ``part`` is read (ranks split the work). A legacy
    checkpoint (no ``files``; loaded only with ``schedule.allow_unverified_checkpoint``, see
    :mod:`.manifest`) gets the presence check of ``.metadata`` only. Raises
    :func:`damaged` naming the checkpoint and the first damaged file."""
    path = Path(path)
    files = meta.get("files")
    if not isinstance(files, dict):
        if not (path / DCP_METADATA).is_file():
            raise damaged(path, DCP_METADATA, "is missing (the DCP index of every tensor)")
        return
    for i, (name, rec) in enumerate(sorted(files.items())):
        if i % parts != part:
            continue
        f = path / name
        if not f.is_file():
            raise damaged(path, name, "is missing")
        size = f.stat().st_size
        if size != rec.get("size"):
            raise damaged(path, name, f"has {size} bytes but the save wrote {rec.get('size')} "
                                      "(truncated or overwritten)")
        crc = file_checksum(f)
        if crc != rec.get(CHECKSUM):
            raise damaged(path, name, f"fails its checksum ({CHECKSUM} {crc:08x}, the save recorded "
                                      f"{rec.get(CHECKSUM, 0):08x}): its bytes changed after the save")
