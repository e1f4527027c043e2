"""Pipeline parallelism beside CP: a causal LM cut into stages from transformers' ``base_model_pp_plan``
(:mod:`.stages`), run by ``torch.distributed.pipelining`` schedules with CP inside each stage
(:mod:`.schedule`). docs/pipeline_parallel.md."""
from .schedule import INTERLEAVED, SCHEDULES, PipelineStep, check_schedule, reduce_stage_grads
from .router import StageRouterLoss
from .stages import StageModule, build_stage, check_pipelinable, rank_stages, stage_layers

__all__ = ["INTERLEAVED", "SCHEDULES", "PipelineStep", "StageModule", "StageRouterLoss", "build_stage", "check_pipelinable", "check_schedule",
           "rank_stages", "reduce_stage_grads", "stage_layers"]
