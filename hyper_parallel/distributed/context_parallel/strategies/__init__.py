"""CP strategies behind :class:`ContextParallelStrategy` (docs/strategies/)."""
from .all_gather import AllGatherStrategy
from .base import ContextParallelStrategy, engine_attention
from .factory import build_strategy
from .head_tail import HeadTailStrategy
from .hybrid import HybridStrategy
from .ulysses import UlyssesStrategy

__all__ = ["AllGatherStrategy", "ContextParallelStrategy", "HeadTailStrategy", "HybridStrategy",
           "UlyssesStrategy", "build_strategy", "engine_attention"]
