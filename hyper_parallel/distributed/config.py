"""AcceleratorConfig: topology degrees only. The CP *method* never lives here.

``accelerator.cp_size`` is the CP degree; the method of every attention boundary is declared
in ``plan_overrides`` (see :mod:`hyper_parallel.distributed.sharding_config`). Generic CP
algorithm keys (``cp.algorithm``, ``schedule``, ``ulysses_degree``, ``load_balance``,
``async_fallback`` ...) are rejected with a pointer to the plan_overrides way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .errors import CPConfigError
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
    dp_shard_size: int = 1
    dp_replicate_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    device_type: str | None = None  # None: auto-detect (npu > cuda > cpu)
    # seconds before a collective fails instead of hanging; None: HYPER_PARALLEL_COMM_TIMEOUT
    # (default 300). Applied by setup_distributed to every hyper_parallel collective and every
    # mesh sub-group (see platform.set_default_timeout).
    comm_timeout_s: float | None = None
    # CP > 1: before the first step, prove on a probe batch that the model computes under CP what
    # it computes without it, layer by layer (context_parallel.model_proof); false skips it
    # (very large models: it costs one CP forward + one full-sequence forward of the probe)
    cp_preflight_proof: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, field: str = "accelerator") -> "AcceleratorConfig":
        data = dict(data or {})
        for key in data:
            if key in FORBIDDEN_ACCELERATOR_KEYS:
                raise CPConfigError(
                    f"{field}.{key}",
                    f"'{key}' is not an accelerator field: {FORBIDDEN_ACCELERATOR_KEYS[key]}",
                    fix=PLAN_OVERRIDES_POINTER,
                )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CPConfigError(
                f"{field}.{unknown[0]}",
                f"unknown key(s) {unknown}",
                fix=f"use only {sorted(known)} (check for typos)",
            )
        cfg = cls(**data)
        cfg.validate(field)
        return cfg

    def validate(self, field: str = "accelerator") -> None:
        for name in ("dp_shard_size", "dp_replicate_size", "tp_size", "cp_size", "ep_size", "pp_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise CPConfigError(f"{field}.{name}", f"must be an integer >= 1, got {val!r}")
        for name in ("sequence_parallel", "loss_parallel", "cp_preflight_proof"):
            if not isinstance(getattr(self, name), bool):
                raise CPConfigError(f"{field}.{name}", f"must be true or false, got {getattr(self, name)!r}")
        t = self.comm_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise CPConfigError(f"{field}.comm_timeout_s", f"must be a number of seconds > 0, got {t!r}")
        if self.pp_size != 1:
            raise CPConfigError(f"{field}.pp_size", f"pipeline parallelism is fixed at 1 in Phase 1, got {self.pp_size}")

    def mesh_sizes(self) -> MeshSizes:
        return MeshSizes(dp_replicate=self.dp_replicate_size, dp_shard=self.dp_shard_size,
                         cp=self.cp_size, tp=self.tp_size, pp=self.pp_size, ep=self.ep_size)
