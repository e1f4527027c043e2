"""DistributedSetup: process group -> agreed sharding plan -> MeshContext.

Order matters for fail-fast: the process group is initialized first, then every check runs
inside :func:`agree_or_raise` (no collective inside a check), so a bad config on any rank
fails all ranks together before the first real collective. The plan is built once per run,
here (:class:`~.plan.ShardingPlanner`), and the meshes — including every Hybrid sub-mesh a
declared wrapper needs — are derived from it; the trainer applies this same plan. With
``pp_size > 1`` the model is checked for cutting with the plan, this rank's stage is cut once the
mesh gives its pipeline rank, and the plan is made again for the stage (agreed too):
:attr:`DistributedSetup.stage` is then the module to parallelize (docs/pipeline_parallel.md).
"""
from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
import torch.nn as nn

from ..platform import Platform, get_platform, init_distributed, set_default_timeout
from .config import AcceleratorConfig
from .errors import CPConfigError
from .mesh import MeshConfigError, MeshContext
from .pipeline_parallel import StageModule, check_pipelinable
from .plan import ShardingPlan, ShardingPlanner
from .preflight import agree_or_raise

log = logging.getLogger("hyper_parallel.setup")


@dataclasses.dataclass
class DistributedSetup:
    platform: Platform
    mesh: MeshContext
    plan: ShardingPlan
    stage: nn.Module | None = None    # pp_size > 1: this rank's pipeline stage (the plan is the stage's)

    def summary(self) -> str:
        lines = [self.mesh.summary()]
        if self.stage is not None:
            st = self.stage
            held = ", ".join(f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in zip(st.stage_ids, st.layer_chunks))
            lines.append(f"pipeline: pp rank {st.pp_rank} of {st.pp_size} holds {held} (the plan below is its own)")
        return "\n".join(lines + [self.plan.summary()])


def check_world(accel: AcceleratorConfig) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        accel.mesh_sizes().check(world)
    except MeshConfigError as exc:
        raise CPConfigError("accelerator", str(exc), fix="make the product of the *_size fields equal the "
                            "number of launched processes (torchrun --nproc-per-node)") from exc


def setup_distributed(accel: AcceleratorConfig, plan_overrides: list, model: nn.Module,
                      platform: Platform | None = None, *, packed_documents: str | None = None,
                      packed_rows: bool = False, documents_field: str = "data.packed_documents",
                      virtual_stages: int = 1) -> DistributedSetup:
    """Plan (agreed across ranks), then build the meshes the plan needs. Prints both on rank 0.

    ``accel.comm_timeout_s`` (when set) becomes the collective timeout first, so the preflight
    agreement, every later hyper_parallel collective and every mesh sub-group use it.
    ``packed_documents`` / ``packed_rows``: :class:`~.plan.planner.ShardingPlanner`'s.
    ``virtual_stages``: pipeline stages per rank (``accel.pp_size > 1``; 2 or more interleaved).
    """
    platform = platform or get_platform(accel.device_type)
    if accel.comm_timeout_s is not None:
        set_default_timeout(accel.comm_timeout_s)
    init_distributed(platform)

    def make_plan(module) -> ShardingPlan:
        return ShardingPlanner(plan_overrides, packed_documents, documents_field).plan(
            module, tp_size=accel.tp_size, cp_size=accel.cp_size, ep_size=accel.ep_size,
            sequence_parallel=accel.sequence_parallel, loss_parallel=accel.loss_parallel, packed_rows=packed_rows)

    def check() -> ShardingPlan:
        check_world(accel)
        if accel.pp_size > 1:
            check_pipelinable(model, accel.pp_size * virtual_stages)
        return make_plan(model)

    plan = agree_or_raise(check, what="sharding plan")
    mesh = MeshContext.shared(accel.mesh_sizes(), platform, hybrid_degrees=plan.hybrid_degrees())
    stage = None
    if accel.pp_size > 1:
        # checked in check() above, agreed: cut without checking again
        stage = StageModule(model, mesh.pp_mesh.get_local_rank(), accel.pp_size, virtual_stages)
        plan = agree_or_raise(lambda: make_plan(stage), what="sharding plan of the pipeline stage")
    setup = DistributedSetup(platform, mesh, plan, stage)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(setup.summary(), flush=True)
    return setup
