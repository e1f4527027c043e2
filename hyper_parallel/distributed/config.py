"""AcceleratorConfig: topology degrees only. The CP *method* never lives here.

``accelerator.cp_size`` is the CP degree; the method of every attention boundary is declared
in ``plan_overrides`` (see :mod:`hyper_parallel.distributed.plan.spec`). Generic CP
algorithm keys (``cp.algorithm``, ``schedule``, ``ulysses_degree``, ``load_balance``,
``async_fallback`` ...) are rejected with a pointer to the plan_overrides way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .config_schema import check_section, load_section, option
from .mesh import MeshSizes

# Keys that used to select a CP algorithm globally; each maps to the plan_overrides way.
FORBIDDEN_ACCELERATOR_KEYS = {
    "cp": "the CP method is declared per attention module",
    "cp_algorithm": "the CP method is declared per attention module",
    "algorithm": "the CP method is declared per attention module",
    "cp_method": "the CP method is declared per attention module",
    "schedule": "sync/async is a property of the declared wrapper",
    "cp_schedule": "sync/async is a property of the declared wrapper",
    "ulysses_degree": "Hybrid's ulysses_degree is a named parameter of the hybrid wrapper Target",
    "load_balance": "Head-Tail load balance is its own wrapper (sdpa_hf_load_balance_cp_wrapper)",
    "async_fallback": "there is no runtime fallback; choose the sync wrapper explicitly",
    "async": "async CP is its own wrapper Target (a model adapter)",
    "cp_async": "async CP is its own wrapper Target (a model adapter)",
}

PLAN_OVERRIDES_POINTER = (
    "remove it and declare the method in plan_overrides, e.g. "
    "{match: '*.self_attn', when: cp, region_dispatch: false, inner_target: self, "
    "inner_wrapper: {_target_: hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_hybrid_cp_wrapper, "
    "ulysses_degree: 2}}"
)


@dataclasses.dataclass
class AcceleratorConfig:
    """The ``accelerator`` YAML section: topology degrees, device, timeouts. Fields, types, bounds
    and help live in the schema below (:mod:`.config_schema`); ``from_dict`` is its loader."""

    dp_shard_size: int = option(1, ge=1, help="FSDP2 shard degree (the FSDP mesh is dp_shard x cp)")
    dp_replicate_size: int = option(1, ge=1, help="data-parallel replicas (HSDP when > 1)")
    tp_size: int = option(1, ge=1, help="tensor-parallel degree")
    cp_size: int = option(1, ge=1, help="context-parallel degree (the method of each attention is "
                                        "declared in plan_overrides)")
    ep_size: int = option(1, ge=1, help="expert-parallel degree: each MoE layer's experts split over groups of this "
                          "many dense ranks (must divide dp_shard x cp and the experts; docs/expert_parallel.md)")
    pp_size: int = option(1, ge=1, help="pipeline-parallel degree: the model's decoder layers split into this many "
                          "stages, CP inside each (docs/pipeline_parallel.md)")
    sequence_parallel: bool = option(False, help="TP sequence parallel")
    loss_parallel: bool = option(False, help="TP loss parallel")
    device_type: str | None = option(None, choices=("cpu", "cuda", "npu"), shown_default="null (auto)",
                                     help="device type; null auto-detects (npu > cuda > cpu)")
    comm_timeout_s: float | None = option(
        None, gt=0, shown_default="null (HYPER_PARALLEL_COMM_TIMEOUT, 300)",
        help="seconds before a collective fails (CommTimeoutError) instead of hanging; applied to every "
             "hyper_parallel collective and every mesh sub-group")
    cp_preflight_proof: bool = option(
        True, help="with cp_size > 1, prove on a probe batch before the first step that the model computes "
                   "under CP what it computes without it, layer by layer (one extra CP + full forward)")

    #: load_section arguments when this class is a section of a larger schema (TrainerConfig)
    _schema_load_kwargs = {"forbidden": FORBIDDEN_ACCELERATOR_KEYS, "forbidden_fix": PLAN_OVERRIDES_POINTER}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, field: str = "accelerator") -> "AcceleratorConfig":
        """Load and check the section (forbidden CP-method keys point to plan_overrides)."""
        return load_section(cls, data, field, **cls._schema_load_kwargs)

    def validate(self, field: str = "accelerator") -> None:
        """Re-check every field (types, bounds, pp_size) of an instance built in Python."""
        check_section(self, field)

    def mesh_sizes(self) -> MeshSizes:
        return MeshSizes(dp_replicate=self.dp_replicate_size, dp_shard=self.dp_shard_size,
                         cp=self.cp_size, tp=self.tp_size, pp=self.pp_size, ep=self.ep_size)
