"""``hyper_meta.json``: the checkpoint's signed manifest.

It holds the topology, step, data position, scheduler state, optimizer class, run config and
``files`` (size + CRC-32 of every DCP file, shards included), and ``meta_sha256``: the SHA-256 of
all of that (:func:`meta_digest`: canonical JSON, sorted keys, without ``meta_sha256`` itself).
:func:`read_meta` recomputes it, so an edit anywhere in the manifest (a removed ``files`` key, a
changed size or CRC) is refused as damage before any file is trusted. A manifest without
``meta_sha256`` (saved before it existed) is refused unless the run opts in by name with
``schedule.allow_unverified_checkpoint: true``. Local only: no collective.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ...distributed.errors import CPConfigError
from .files import FORMAT, META_FILE, PARTIAL, RECOVER, damaged

log = logging.getLogger("hyper_parallel.trainer")
SIGNATURE = "meta_sha256"
OPT_IN = "schedule.allow_unverified_checkpoint"


def _canonical(meta: dict) -> bytes:
    plain = json.loads(json.dumps(meta, default=str))   # what the file holds after a round trip
    plain.pop(SIGNATURE, None)
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def meta_digest(meta: dict) -> str:
    """SHA-256 (hex) of ``meta`` without its own ``meta_sha256``, as canonical JSON."""
    return hashlib.sha256(_canonical(meta)).hexdigest()


def sign_meta(meta: dict) -> dict:
    """``meta`` with ``meta_sha256`` set (the save writes this)."""
    return {**{k: v for k, v in meta.items() if k != SIGNATURE}, SIGNATURE: meta_digest(meta)}


def write_meta(path: str | Path, meta: dict) -> None:
    """Write the signed manifest to ``<path>/hyper_meta.json`` (rank 0 of a save)."""
    (Path(path) / META_FILE).write_text(json.dumps(sign_meta(meta), indent=1, default=str))


def check_signature(path: Path, meta: dict, *, allow_unverified: bool = False) -> None:
    """Raises :func:`~.files.damaged` when ``meta_sha256`` does not match, or a
    :class:`CPConfigError` for an unsigned (legacy) manifest unless ``allow_unverified``."""
    recorded = meta.get(SIGNATURE)
    if recorded is None:
        if not allow_unverified:
            raise CPConfigError(
                "schedule.resume_from", f"checkpoint {path}: {META_FILE} has no checksum of its own "
                f"({SIGNATURE}; saved by an older version), so its file list and checksums cannot be trusted",
                fix=f"set {OPT_IN}: true to load it anyway (the files it lists are still checked), or "
                    "resume from a checkpoint saved by this version")
        log.warning("resuming %s without a manifest checksum (%s: true): its recorded files are checked, "
                    "the manifest itself is not", path, OPT_IN)
        return
    actual = meta_digest(meta)
    if actual != recorded:
        raise damaged(path, META_FILE, f"fails its own checksum ({SIGNATURE} {actual[:16]}..., the save recorded "
                                       f"{str(recorded)[:16]}...): it was edited or damaged after the save")
    if not isinstance(meta.get("files"), dict):
        raise damaged(path, META_FILE, "lists no files")


def read_meta(path: str | Path, *, allow_unverified: bool = False) -> dict:
    """The verified manifest of checkpoint ``path`` (see the module doc); one :class:`CPConfigError`
    naming the checkpoint otherwise."""
    path = Path(path)
    meta_file = path / META_FILE
    partial = path.with_name(path.name + PARTIAL)
    if not path.exists() and partial.is_dir():
        raise CPConfigError("schedule.resume_from", f"checkpoint {path} was never completed: its save was "
                            f"interrupted (only {partial} exists)", fix=RECOVER)
    if not meta_file.is_file():
        raise CPConfigError("schedule.resume_from", f"{path} is not a hyper_parallel checkpoint "
                            f"(no {META_FILE})", fix="point it at a <checkpoint_dir>/step_<N> directory")
    try:
        text = meta_file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise damaged(path, META_FILE, f"cannot be read ({exc})") from None
    if not text.strip():
        raise damaged(path, META_FILE, "is empty")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise damaged(path, META_FILE, f"is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise damaged(path, META_FILE, f"is not a JSON object (got {type(meta).__name__})")
    if meta.get("format") != FORMAT:
        raise damaged(path, META_FILE, f"has an unknown checkpoint format {meta.get('format')!r}")
    check_signature(path, meta, allow_unverified=allow_unverified)
    return meta
