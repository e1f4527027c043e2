"""The balanced split's cost per layer (cost_model.py): Colossal's (or Hybrid's) exchanges on the
permuted row, which moves no more bytes than the contiguous one."""
from __future__ import annotations

from ..colossal.cost import ColossalCost
from ..hybrid.cost import HybridCost

COST = ColossalCost()
HYBRID_COST = HybridCost()
