"""MeshContext: the root DeviceMesh and every CP-related sub-mesh, built once at set-up.

Root mesh dims (outer -> inner): ``pp, dp_replicate, dp_shard, cp, tp`` with
``world = pp * dp_replicate * dp_shard * cp * tp``. Every derived mesh below is a slice of the root
without ``pp``: a pipeline stage's ranks hold their own CP / DP / TP groups. Derived meshes:

  pp_mesh        root["pp"]                       pipeline stages (point-to-point activations; docs/pipeline_parallel.md)

  cp_mesh        root["cp"]                       attention AllGather / Ulysses A2A
  dp_cp_mesh     flatten(dp_replicate,dp_shard,cp) loss / valid-token reduction
  fsdp_mesh      flatten(dp_shard, cp)             FSDP2 shard domain; 2-D (dp_replicate, dp_shard_cp) for HSDP
  dp_mesh        flatten(dp_replicate, dp_shard)   data-loader rank (every CP rank of a DP rank reads the same batch)
  tp_mesh        root["tp"]
  experts_mesh   fsdp_mesh with dp_shard_cp unflattened into (ep_replicate, ep) when ep_size > 1 (not
                 part of the product); ep is the inner dim, so dense rank i holds expert shard i % ep
  ep_mesh        experts_mesh["ep"]: the token all-to-all group (ranks holding different experts)
  experts_fsdp_mesh  experts_mesh without ep: the ranks holding the same experts (FSDP2 / HSDP over them)
  hybrid(u)      cp unflattened into (colossal = cp/u, ulysses = u); ulysses is the inner
                 (fastest-varying) dim, so cp rank r = colossal_idx * u + ulysses_idx.

Every sub-mesh and process group is created here, collectively, during set-up and cached:
strategies only call :meth:`hybrid_mesh` for degrees that were declared up front, so no
group is ever created during forward.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..platform import Platform, default_timeout, get_platform, on_release

ROOT_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class MeshConfigError(ValueError):
    """Mesh sizes that do not fit the world size or each other."""


@dataclasses.dataclass(frozen=True)
class MeshSizes:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def product(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def check(self, world_size: int) -> None:
        """Raise MeshConfigError showing the arithmetic when the sizes do not fit."""
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise MeshConfigError(f"accelerator.{name}_size must be an integer >= 1, got {val!r}")
        prod = self.product()
        if prod != world_size:
            raise MeshConfigError(
                "accelerator sizes do not match the world size: "
                f"pp({self.pp}) x dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x "
                f"cp({self.cp}) x tp({self.tp}) = {prod}, but world_size = {world_size}"
            )
        dense = self.dp_shard * self.cp
        if self.ep > 1 and dense % self.ep:
            raise MeshConfigError(
                f"accelerator.ep_size={self.ep} must divide dp_shard({self.dp_shard}) x cp({self.cp}) = {dense} "
                "(EP is derived from the dense FSDP rank domain, not part of the mesh product)"
            )


def check_ulysses_degree(cp_size: int, degree: int, field: str = "ulysses_degree") -> None:
    if not isinstance(degree, int) or degree < 1:
        raise MeshConfigError(f"{field} must be a positive integer, got {degree!r}")
    if cp_size % degree:
        raise MeshConfigError(f"{field}={degree} must divide accelerator.cp_size={cp_size}")


_SHARED: dict = {}
on_release(_SHARED.clear)       # platform.release_subgroups destroyed the groups: drop the meshes


class MeshContext:
    """Owns the root DeviceMesh and cached sub-meshes. Construct on every rank (collective)."""

    def __init__(self, sizes: MeshSizes, platform: Platform | None = None,
                 hybrid_degrees: Iterable[int] = ()):
        self.platform = platform or get_platform()
        self._world = dist.group.WORLD if dist.is_initialized() else None
        self.sizes = sizes
        world = dist.get_world_size() if dist.is_initialized() else 1
        sizes.check(world)
        self.world_size = world
        shape = (sizes.pp, sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp)
        # every sub-group gets the collective timeout (platform.default_timeout), not torch's
        # 30-minute default: FSDP2 / DTensor / DCP collectives on them must not hang either
        self._opts = self.platform.group_options(default_timeout())
        self.root: DeviceMesh = init_device_mesh(self.platform.device_type, shape, mesh_dim_names=ROOT_DIMS,
                                                 backend_override=self._override(ROOT_DIMS))
        self.pp_mesh: DeviceMesh = self.root["pp"]
        self.cp_mesh: DeviceMesh = self.root["cp"]
        self.tp_mesh: DeviceMesh = self.root["tp"]
        self.dp_cp_mesh: DeviceMesh = self._flatten(self.root["dp_replicate", "dp_shard", "cp"], "dp_cp")
        self.dp_mesh: DeviceMesh = self._flatten(self.root["dp_replicate", "dp_shard"], "dp")
        shard_cp = self._flatten(self.root["dp_shard", "cp"], "dp_shard_cp")
        if sizes.dp_replicate > 1:
            self.fsdp_mesh: DeviceMesh = self.root["dp_replicate", "dp_shard_cp"]
        else:
            self.fsdp_mesh = shard_cp
        self.ep_mesh = self.experts_mesh = self.experts_fsdp_mesh = None
        if sizes.ep > 1:
            n = sizes.dp_shard * sizes.cp
            names = ("ep_replicate", "ep")
            dim = self.fsdp_mesh.ndim - 1       # the dp_shard_cp dim (after dp_replicate under HSDP)
            self.experts_mesh = self.fsdp_mesh._unflatten(dim, (n // sizes.ep, sizes.ep), names,
                                                          backend_override=self._override(names))
            self.ep_mesh = self.experts_mesh["ep"]
            self.experts_fsdp_mesh = (self.experts_mesh["dp_replicate", "ep_replicate"] if sizes.dp_replicate > 1
                                      else self.experts_mesh["ep_replicate"])
        self._hybrid: dict[int, DeviceMesh] = {}
        for u in sorted(set(int(d) for d in hybrid_degrees)):
            self._build_hybrid(u)

    @classmethod
    def shared(cls, sizes: MeshSizes, platform: Platform | None = None,
               hybrid_degrees: Iterable[int] = ()) -> "MeshContext":
        """The process's MeshContext for these sizes, built on first use (collective) and reused.

        Every gloo/NCCL/HCCL group costs threads and connections for the life of the process and
        is never freed by dropping the mesh, so a process that sets up training several times
        (tests, notebooks, repeated ``setup_distributed``) must not rebuild identical groups.
        The key is everything the groups depend on: the sizes, the device type and backend, the
        collective timeout baked into the groups, and the world process group itself (a new
        ``init_process_group`` starts a new cache). All ranks take the same path (the sizes are
        agreed before this is called), so a hit on one rank is a hit on every rank. Hybrid
        sub-meshes are added to the cached context as requested.
        """
        platform = platform or get_platform()
        world = dist.group.WORLD if dist.is_initialized() else None
        key = (sizes, platform.device_type, platform.backend, default_timeout(), id(world))
        ctx = _SHARED.get(key)
        if ctx is None or ctx._world is not world or not ctx.alive:
            ctx = _SHARED[key] = cls(sizes, platform)
        ctx.ensure_hybrid(hybrid_degrees)
        return ctx

    @property
    def alive(self) -> bool:
        """Whether every group of the root mesh still exists (``platform.release_subgroups`` destroys
        them; a context whose groups are gone must be built again)."""
        if not dist.is_initialized():
            return True
        try:
            groups = self.root.get_all_groups()
        except RuntimeError:        # "Could not resolve the process group registered under the name ..."
            return False
        live = dist.distributed_c10d._world.pg_map
        return all(g in live for g in groups)

    def _override(self, names):
        """backend_override giving each named new dim's group the collective timeout."""
        if self._opts is None:
            return None
        return {n: (self.platform.backend, self._opts) for n in names}

    def _flatten(self, mesh: DeviceMesh, name: str) -> DeviceMesh:
        override = None if self._opts is None else (self.platform.backend, self._opts)
        return mesh._flatten(name, backend_override=override)

    # -- properties -------------------------------------------------------------------
    @property
    def cp_size(self) -> int:
        return self.sizes.cp

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank()

    @property
    def cp_group(self):
        return self.cp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.sizes.dp_replicate * self.sizes.dp_shard

    # -- hybrid -------------------------------------------------------------------------
    def _build_hybrid(self, u: int) -> DeviceMesh:
        check_ulysses_degree(self.sizes.cp, u)
        names = (f"cp_colossal_u{u}", f"cp_ulysses_u{u}")
        mesh = self.cp_mesh._unflatten(0, (self.sizes.cp // u, u), names,
                                       backend_override=self._override(names))
        self._hybrid[u] = mesh
        return mesh

    def hybrid_mesh(self, ulysses_degree: int) -> DeviceMesh:
        """Cached 2-D (colossal, ulysses) mesh over this rank's cp group.

        Only degrees declared at set-up exist; asking for another raises instead of creating
        a process group mid-training.
        """
        if ulysses_degree not in self._hybrid:
            raise MeshConfigError(
                f"no Hybrid sub-mesh for ulysses_degree={ulysses_degree}: degrees are built at set-up "
                f"from plan_overrides (built: {sorted(self._hybrid)})"
            )
        return self._hybrid[ulysses_degree]

    def hybrid_groups(self, ulysses_degree: int):
        """(colossal_group, ulysses_group) process groups for ``ulysses_degree``."""
        mesh = self.hybrid_mesh(ulysses_degree)
        return mesh.get_group(0), mesh.get_group(1)

    def ensure_hybrid(self, degrees: Iterable[int]) -> None:
        """Build missing hybrid meshes (set-up time only; collective on every rank)."""
        for u in sorted(set(int(d) for d in degrees)):
            if u not in self._hybrid:
                self._build_hybrid(u)

    # -- reporting ------------------------------------------------------------------------
    def summary(self) -> str:
        s = self.sizes
        lines = [
            f"mesh: world={self.world_size} device={self.platform.device_type} backend={self.platform.backend}",
            f"  root dims {'pp=%d ' % s.pp if s.pp > 1 else ''}dp_replicate={s.dp_replicate} dp_shard={s.dp_shard} "
            f"cp={s.cp} tp={s.tp} ({'' if s.pp > 1 else 'pp=1, '}ep={s.ep} derived)",
            f"  cp_mesh ranks={self.cp_mesh.mesh.tolist()}  dp_cp_mesh ranks={self.dp_cp_mesh.mesh.tolist()}",
            f"  fsdp_mesh dims={self.fsdp_mesh.mesh_dim_names} ranks={self.fsdp_mesh.mesh.tolist()}",
        ]
        for u, m in sorted(self._hybrid.items()):
            lines.append(f"  hybrid u={u}: (colossal={s.cp // u}, ulysses={u}) ranks={m.mesh.tolist()}")
        return "\n".join(lines)
