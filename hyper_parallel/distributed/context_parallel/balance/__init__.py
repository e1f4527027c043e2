"""Balanced split of packed rows over CP ranks: cost model (:mod:`.cost`), solver (:mod:`.solver`) and the
batch-side permutation (:mod:`.split`). docs/strategies/load_balance_packed.md."""
