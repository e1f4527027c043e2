"""Distributed layer: meshes, config validation, planner/applier and context parallelism."""
from .config import AcceleratorConfig
from .errors import CPConfigError, PreflightError
from .mesh import MeshContext, MeshSizes
from .sharding_config import ModuleShardingSpec, parse_plan_overrides
