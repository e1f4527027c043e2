"""One folder per sync/async CP method of the catalogue (docs/strategies/): ``colossal/``,
``ulysses/`` (with ``layout.py``, the per-rank head split), ``hybrid/``, ``head_tail/``; each holds
``strategy.py`` (the :class:`~.base.ContextParallelStrategy`), ``collectives.py`` (its
differentiable collectives) and ``async_.py`` (its async comm plans). Shared: :mod:`.base` (the
strategy interface, ``engine_attention``), :mod:`.factory` (``build_strategy`` from the catalogue
row) and :mod:`..comm` (group helpers, autograd primitives, regather). Imports nothing here so that
the method modules can be imported one by one."""
