"""The balanced split (Colossal on a work-balanced permutation of the row): ``strategy.py``; the split itself is ``context_parallel/balance/``."""
