"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): model + optimizer + step + data.

Layout of ``<dir>/step_<N>/`` (docs/trainer.md "Checkpoints and failures"):

  DCP files        ``model`` (FSDP/TP DTensors saved sharded), ``optim``, and ``trainer.step`` /
                   ``trainer.data_position`` tensors
  hyper_meta.json  the signed manifest (:mod:`.manifest`): topology, step, data position, LR
                   scheduler state, optimizer class, run config, ``files`` (size + CRC-32 of
                   every DCP file, shards included) and ``meta_sha256`` over all of it

Saves are atomic (:mod:`.save`: ``step_<N>.partial/`` renamed once complete). Loading
(:func:`~.resume.validate_resume`, then :func:`~.load.load_checkpoint`) verifies the manifest's own
checksum, every recorded file's size and CRC-32 (the ranks split the files), the topology
(:mod:`.topology`: CP / DP / world size reshard, TP size refused) and the structure against this
model and optimizer, before any tensor is read. Every failure is one :class:`CPConfigError` naming
``schedule.resume_from``, the checkpoint and the damaged file or mismatching tensor, the same on
every rank. ``resume_from: latest`` takes the newest *intact* ``step_<N>``: damaged newer ones
(:func:`~.files.is_damage`) are skipped with a log line each, and the one loaded is logged.
Every collective honours ``accelerator.comm_timeout_s`` (DCP on ``timed_world_group``, agreements
through the platform layer's timed all-gather).
"""
from __future__ import annotations

from .files import (CHECKSUM, DCP_METADATA, FORMAT, LATEST, META_FILE, PARTIAL, complete_checkpoints, file_checksum,
                    is_damage, own_file_sums, rotate, step_dir, verify_checkpoint)
from .load import check_structure, load_checkpoint
from .manifest import OPT_IN, SIGNATURE, meta_digest, read_meta, sign_meta
from .resume import resolve_resume, resume_candidates, validate_resume
from .save import save_checkpoint
from .topology import TOPOLOGY_KEYS, check_topology, describe_reshard, topology_of

__all__ = ["CHECKSUM", "DCP_METADATA", "FORMAT", "LATEST", "META_FILE", "OPT_IN", "PARTIAL", "SIGNATURE",
           "TOPOLOGY_KEYS", "check_structure", "check_topology", "complete_checkpoints",
           "describe_reshard", "file_checksum", "is_damage", "load_checkpoint", "meta_digest", "own_file_sums",
           "read_meta", "resolve_resume", "resume_candidates", "rotate", "save_checkpoint", "sign_meta", "step_dir",
           "topology_of", "validate_resume", "verify_checkpoint"]
