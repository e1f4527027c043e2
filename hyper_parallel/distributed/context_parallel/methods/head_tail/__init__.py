"""Head-Tail load balance CP: ``strategy.py``, ``collectives.py``, ``async_.py``."""
