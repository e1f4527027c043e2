"""Distributed layer: meshes, config validation, planner/applier and context parallelism."""
from .config import AcceleratorConfig
from .errors import CPConfigError, PreflightError
from .mesh import MeshContext, MeshSizes
from .plan import (ModuleShardingSpec, PlanOverrideResolver, ShardingPlan, ShardingPlanner, TPGradInfo,
                   apply_sharding_plan, parse_plan_overrides)
