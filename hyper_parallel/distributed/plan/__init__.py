"""The plan pipeline: ``plan_overrides`` -> one resolved plan per run -> applied to the model.

* :mod:`.spec` — one entry (:class:`ModuleShardingSpec`), parsed and normalised once;
* :mod:`.resolver` — every entry bound to the model's modules, one CP method per attention
  boundary (:class:`PlanOverrideResolver`), and the model-free target check the CLI runs
  (:func:`~.resolver.check_plan_targets`);
* :mod:`.rules` — the Phase-1 refusals that need the whole plan or the topology;
* :mod:`.planner` — :class:`ShardingPlanner` -> :class:`ShardingPlan` (resolver + rules + TP);
* :mod:`.applier` — :func:`apply_sharding_plan`: TP -> CP -> activation checkpointing -> FSDP2.

The trainer builds the plan once, in the distributed set-up (the meshes are derived from it),
and applies that same plan. docs/architecture.md.
"""
from .applier import apply_sharding_plan
from .planner import ShardingPlan, ShardingPlanner
from .resolver import PlanOverrideResolver, ResolvedCPTarget, ResolvedPlan, check_plan_targets
from .spec import ModuleShardingSpec, TargetRef, parse_plan_overrides
from ..tensor_parallel import TPGradInfo

__all__ = ["apply_sharding_plan", "ShardingPlan", "ShardingPlanner", "PlanOverrideResolver", "ResolvedCPTarget",
           "ResolvedPlan", "check_plan_targets", "ModuleShardingSpec", "TargetRef", "parse_plan_overrides",
           "TPGradInfo"]
