"""Where the trainer finds files named in a config, and the deterministic seeds of the data stream.

* :func:`resolve_path` — a path as given if it exists (or is absolute), else relative to the
  repository root (so ``examples/...`` in a shipped YAML works from any folder);
* :func:`mix_seed` — a 63-bit seed from integers (splitmix64-style), the same on every rank and
  every run: the data stream's row order and sampling derive from it.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT", "resolve_path", "mix_seed"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    """``path`` as given if it exists, else relative to the repository root (examples/...)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    alt = REPO_ROOT / p
    return alt if alt.exists() else p


def mix_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (splitmix64-style)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x ^= (int(p) + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2)) & 0xFFFFFFFFFFFFFFFF
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF
