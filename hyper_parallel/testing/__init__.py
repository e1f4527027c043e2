"""Test utilities shipped with the package (multi-rank harness)."""
from .multirank import MultiRankError, RankDied, RankPool, RankTimeout, scaled, timeout_scale
