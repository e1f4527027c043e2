"""Built-in CP wrappers (public ``_target_`` API): every sync entry point of :mod:`..catalogue`
(one per offered ``(method, style)`` cell, :mod:`.entry_points`) and every generic async Target
(:mod:`.async_entry_points`), re-exported here by the names the catalogue gives them; the matrix
of methods x styles, with the reason for every absent cell, is docs/wrappers.md (generated).

Modules (one job each): :mod:`.factory` (makes the entry points from the rows), :mod:`.heads`
(head counting, the head/degree rule), :mod:`.preflight` (module and call checks, the probe
forward), :mod:`.routes` (installation: strategy, handler, one route per primitive),
:mod:`.async_handoff` (the handoff protocol, async installation and preflight) and
:mod:`.validate_mode` (the reference of validate mode). How each style hooks in, what is read from
an attention call and what is refused: docs/wrappers.md.
"""
from __future__ import annotations

from . import async_entry_points as _async
from . import entry_points as _sync
from .heads import check_heads, module_heads, unrepeat_kv
from .validate_mode import VALIDATE_TOLERANCE, CPValidationError

globals().update({n: getattr(_sync, n) for n in _sync.__all__})
globals().update({n: getattr(_async, n) for n in _async.__all__})

__all__ = [*_sync.__all__, *_async.__all__, "CPValidationError", "VALIDATE_TOLERANCE", "module_heads",
           "check_heads", "unrepeat_kv"]
