"""Distributed layer: meshes, config validation, planner/applier and context parallelism."""
from .config import AcceleratorConfig
from .errors import CPConfigError, PreflightError
from .mesh import MeshContext, MeshSizes
from .sharding_config import ModuleShardingSpec, parse_plan_overrides
from .sharding_applier import TPGradInfo, apply_sharding_plan
from .sharding_planner import ShardingPlan, ShardingPlanner
