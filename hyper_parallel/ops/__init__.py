"""Attention engine front (see docs/attention_engine.md).

``attention`` is the single computation every CP strategy ends in: local queries at known
global positions attending to keys at known global positions, under a causal and optionally
document rule. On CPU it runs the C++ engine (``hyper_parallel._C``), on CUDA the routed SDPA / flash
kernels (FlexAttention as the fallback), on
NPU torch_npu's fused attention. ``reference_attention`` is the float64-capable math reference
(tests only: it materializes the mask). ``merge_partial_attention`` combines results computed
over disjoint key sets. ``tiled_lm_loss`` is the LM head + cross-entropy in token chunks (no
``[N, vocab]`` logits tensor alive, exact backward by recompute).
"""
from .attention import attention, engine_info
from .merge import merge_partial_attention
from .reference import reference_attention
from .tiled_loss import tiled_lm_loss

__all__ = ["attention", "engine_info", "merge_partial_attention", "reference_attention", "tiled_lm_loss"]
