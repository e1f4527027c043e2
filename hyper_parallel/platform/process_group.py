"""Process-group start-up and teardown (torchrun env or an explicit rendezvous)."""
from __future__ import annotations

import datetime
import gc
import os
import socket

import torch.distributed as dist

from .comm import default_timeout
from .device import Platform, get_platform


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(platform: Platform | None = None, *, rank: int | None = None,
                     world_size: int | None = None, init_method: str | None = None,
                     timeout: datetime.timedelta | None = None) -> Platform:
    """Initialize the default process group for ``platform`` (idempotent).

    Under torchrun, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment. A plain
    single process (no env) gets a private loopback rendezvous with world size 1.
    """
    platform = platform or get_platform()
    if dist.is_initialized():
        return platform
    timeout = timeout or default_timeout()
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if init_method is None and "MASTER_ADDR" not in os.environ:
        if world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is unset: launch multi-rank jobs with torchrun"
            )
        init_method = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(platform.backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    return platform


def destroy_distributed() -> None:
    _TIMED_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


_TIMED_GROUPS: dict = {}


def timed_world_group():
    """A group of every rank whose collectives time out after :func:`default_timeout` (the value
    of ``accelerator.comm_timeout_s`` once the trainer set it), for torch code that issues its own
    collectives on a group it is given (DCP's save and load). The default group keeps the timeout
    it was created with, before the config was read. Cached per (world size, timeout); creating
    one is collective (every rank calls it at the same point). None when not distributed."""
    if not dist.is_initialized():
        return None
    timeout = default_timeout()
    key = (dist.get_world_size(), timeout)
    group = _TIMED_GROUPS.get(key)
    # a group of a process group that was destroyed (outside destroy_distributed) is not reused
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        group = _TIMED_GROUPS[key] = dist.new_group(timeout=timeout)
    return group


_ON_RELEASE: list = []


def on_release(fn) -> None:
    """Register ``fn()`` to run when :func:`release_subgroups` frees the groups: a cache holding
    meshes or groups drops them there (a destroyed group's threads stop only once nothing refers
    to it)."""
    if fn not in _ON_RELEASE:
        _ON_RELEASE.append(fn)


def release_subgroups(limit: int = 0) -> int:
    """Destroy every process group but the default one once more than ``limit`` exist; returns how
    many were destroyed. Every rank of the world must call it at the same point, with no collective
    in flight: a gloo group's transport thread wakes every 10 ms for the life of the process (about
    0.1 % of a core per idle group), so a long-lived process that keeps building meshes (a warm test
    worker, a notebook) must free them. Groups this package caches (the meshes of
    ``MeshContext.shared``, :func:`timed_world_group`) are rebuilt on their next use."""
    if not dist.is_initialized():
        return 0
    world = dist.group.WORLD
    groups = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world]
    count = len(groups)
    if count <= limit:
        return 0
    for g in groups:
        dist.destroy_process_group(g)
    _TIMED_GROUPS.clear()
    for fn in _ON_RELEASE:
        fn()
    # DTensor caches sharding decisions per DeviceMesh, and a mesh rebuilt with the same shape and
    # names compares equal to the destroyed one: a cached decision would name a destroyed group
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    del groups
    gc.collect()          # models and meshes in reference cycles still hold the groups' threads
    # a DeviceMesh keeps its groups in ``_pg_registry`` (read only under torch.compile): a mesh that
    # outlives this (held by a cache) kept every destroyed group's backend and threads alive
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    return count
