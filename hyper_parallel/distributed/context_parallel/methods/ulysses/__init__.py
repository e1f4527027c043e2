"""Ulysses (sequence <-> head all-to-all) CP: ``strategy.py``, ``collectives.py``, ``async_.py``."""
