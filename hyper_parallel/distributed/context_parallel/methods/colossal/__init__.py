"""Colossal (AllGather) CP: ``strategy.py``, ``collectives.py``, ``async_.py``."""
