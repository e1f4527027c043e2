"""Which checkpoint a resume loads, verified on every rank (collective; see :func:`validate_resume`)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from ...distributed.errors import CPConfigError
from ...distributed.preflight import agree_or_raise
from ...platform import all_gather_object
from ...platform.process_group import timed_world_group
from .files import LATEST, META_FILE, complete_checkpoints, is_damage, verify_checkpoint
from .manifest import read_meta
from .topology import check_topology

log = logging.getLogger("hyper_parallel.trainer")


def resume_candidates(path: str | Path | None, root: str | Path | None) -> list[str]:
    """The directories a resume may load, in order of preference: none without ``path``, ``[path]``
    for a named one, every complete ``step_<N>`` under ``root`` newest first for ``latest`` (raises
    :class:`CPConfigError` when there is none). Local."""
    if not path:
        return []
    if str(path) != LATEST:
        return [str(path)]
    found = complete_checkpoints(root) if root is not None else []
    if not found:
        raise CPConfigError("schedule.resume_from", f"'latest' found no complete checkpoint (step_<N> with "
                            f"{META_FILE}) in {root}", fix="set schedule.checkpoint_dir to the directory that "
                            "holds the step_<N> checkpoints, or start a fresh run without resume_from")
    return [str(p) for p in reversed(found)]


def resolve_resume(path: str | Path, root: str | Path | None) -> Path:
    """``resume_from`` as a directory, without verifying it: ``latest`` -> the newest complete
    checkpoint under ``root`` (:func:`validate_resume` is the verifying, falling-back path)."""
    return Path(resume_candidates(path, root)[0])


def validate_resume(path: str | Path | None, topology: dict, root: str | Path | None = None, *,
                    allow_unverified: bool = False) -> dict | None:
    """Collective (every rank calls it, also those without ``path``): the checkpoint to resume from,
    verified on every rank (manifest checksum, every file split between the ranks, topology); the
    same :class:`CPConfigError` on every rank otherwise. Returns its manifest with ``path`` (the
    directory checked), ``reshard`` and ``skipped`` (``latest`` only: ``[(dir, reason)]`` of the
    damaged newer checkpoints passed over, each logged), or None without ``path``.

    The ranks first agree on the candidate list (a ``resume_from`` or checkpoint directory that
    differs between ranks is refused), then check the candidates in order with one agreement
    each, so every rank runs the same collectives and loads the same checkpoint."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timed_world_group()   # created here, at set-up on every rank, before any save or load needs it
    candidates = agree_or_raise(lambda: resume_candidates(path, root), what="checkpoint resume", same_error=True)
    plans = all_gather_object(candidates) if dist.is_initialized() else [candidates]
    if any(p != plans[0] for p in plans):
        differ = next(r for r, p in enumerate(plans) if p != plans[0])
        raise CPConfigError("schedule.resume_from", f"the ranks disagree on the checkpoint to resume from "
                            f"(rank 0: {plans[0][:1] or 'none'}, rank {differ}: {plans[differ][:1] or 'none'})",
                            fix="give every rank the same resume_from and checkpoint_dir on a shared filesystem")
    skipped: list[tuple[str, str]] = []

    def check(where: Path) -> dict:
        meta = read_meta(where, allow_unverified=allow_unverified)
        reshard = check_topology(where, meta.get("topology", {}), topology)
        verify_checkpoint(where, meta, part=rank, parts=world)
        return {**meta, "path": str(where), "reshard": reshard}

    latest = str(path) == LATEST
    for where in candidates:
        try:
            meta = agree_or_raise(lambda: check(Path(where)), what="checkpoint resume", same_error=True)
        except CPConfigError as exc:
            if not is_damage(exc) or not latest or where == candidates[-1]:
                if skipped:
                    raise CPConfigError("schedule.resume_from", f"'latest': every checkpoint in {root} is damaged "
                                        f"(newest: {exc.problem})", fix=exc.fix) from None
                raise
            skipped.append((where, exc.problem))
            if rank == 0:
                log.warning("resume_from latest: skipping %s: %s", where, exc.problem)
            continue
        if latest and rank == 0:
            why = f" (skipped {len(skipped)} damaged newer checkpoint(s), see above)" if skipped else ""
            (log.warning if skipped else log.info)("resume_from latest: loading %s (step %s), the newest intact checkpoint%s",
                        where, meta.get("step"), why)
        return {**meta, "skipped": skipped}
    return None
