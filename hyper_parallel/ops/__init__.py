"""Attention engine front (see docs/attention_engine.md).

``attention`` is the single computation every CP strategy ends in: local queries at known
global positions attending to keys at known global positions. Until the C++ engine is wired
in, it falls back to the reference (TEMPORARY, replaced by the engine issue).
"""
from .reference import reference_attention


def attention(q, k, v, *, q_pos, k_pos, causal=True, q_doc=None, k_doc=None, scale=None,
              return_lse=False):
    return reference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, q_doc=q_doc,
                               k_doc=k_doc, scale=scale, return_lse=return_lse)


__all__ = ["attention", "reference_attention"]
