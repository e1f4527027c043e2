"""The model classes a generic token-mixer core is exact for, registered by their model families.

A core (the halo exchange, the Mamba1 selective scan, the Mamba2 SSD scan) re-runs one layout of
transformers' forward; each family whose mixer has that layout adds its class name — and, where the
family's lines around the core differ, a spec the core takes — from ``models/<model_type>/`` when it
is imported. The core reads the registry when it validates or installs a module, never at import.
docs/architecture.md, Recipe 2.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

__all__ = ["FamilyRegistry"]


class FamilyRegistry:
    """Class name -> spec (or None) for one core, in registration order (messages list them so)."""

    def __init__(self, core: str):
        self.core = core
        self._specs: dict = {}

    def add(self, cls_name: str, spec: Any = None) -> None:
        """Register ``cls_name`` (idempotent for the same spec; ValueError for another one)."""
        if cls_name in self._specs and self._specs[cls_name] is not spec:
            raise ValueError(f"{self.core}: {cls_name} is already registered with another spec")
        self._specs[cls_name] = spec

    def remove(self, cls_name: str) -> None:
        self._specs.pop(cls_name, None)

    @contextlib.contextmanager
    def registered(self, cls_name: str, spec: Any = None):
        """``cls_name`` registered for the length of a ``with`` block (a test's own family)."""
        if cls_name in self._specs:
            raise ValueError(f"{self.core}: {cls_name} is already registered")
        self.add(cls_name, spec)
        try:
            yield
        finally:
            self.remove(cls_name)

    def classes(self) -> tuple:
        return tuple(self._specs)

    def spec(self, cls_name: str) -> Optional[Any]:
        return self._specs.get(cls_name)

    def __contains__(self, cls_name: str) -> bool:
        return cls_name in self._specs
