"""Hybrid (Ulysses x Colossal) CP: ``strategy.py``, ``collectives.py``, ``async_.py``."""
