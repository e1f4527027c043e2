"""Bamba's Mamba2 mixer (``BambaMixer``) under CP: ``mamba2_state_passing``.

Its torch forward is ``in_proj(hs)`` -> gate | xBC | dt -> causal conv -> ``mamba2_chunk_scan`` ->
``norm(y, gate)`` (gated group RMS norm) -> ``out_proj`` (its padding-mask multiplies only touch
padding, which CP never feeds to a real token): the shared core
(:mod:`hyper_parallel.distributed.context_parallel.mixers.mamba2`) with :func:`gated_norm_spec`.
"""
from __future__ import annotations

from ...distributed.context_parallel.mixers.mamba2 import gated_norm_spec

__all__ = ["MAMBA2_SPEC"]

MAMBA2_SPEC = gated_norm_spec("Bamba")
