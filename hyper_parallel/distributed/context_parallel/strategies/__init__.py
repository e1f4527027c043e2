"""The sync CP strategies behind :class:`ContextParallelStrategy` (docs/strategies/), re-exported from
their method folders (``methods/<method>/strategy.py``) and :mod:`..methods.factory`."""
from ..methods.balanced.strategy import BalancedStrategy
from ..methods.base import ContextParallelStrategy, engine_attention
from ..methods.colossal.strategy import AllGatherStrategy
from ..methods.factory import build_strategy
from ..methods.head_tail.strategy import HeadTailStrategy
from ..methods.hybrid.strategy import HybridStrategy
from ..methods.ulysses.strategy import UlyssesStrategy

__all__ = ["AllGatherStrategy", "BalancedStrategy", "ContextParallelStrategy", "HeadTailStrategy", "HybridStrategy",
           "UlyssesStrategy", "build_strategy", "engine_attention"]
