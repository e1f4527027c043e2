"""Built-in CP wrappers (public ``_target_`` API, design section 3.1.1).

Every built-in wrapper fixes one CP method (its strategy) and one attention calling convention;
the methods, the styles and which cells are offered (or why not) are the rows of
:mod:`..catalogue`, which this table restates:

===========================  ===================  =======================================
registry name                ``_target_``         method / style
===========================  ===================  =======================================
``sdpa_hf``                  sdpa_hf_cp_wrapper                 colossal / hf
``sdpa_hf_ulysses``          sdpa_hf_ulysses_cp_wrapper         ulysses / hf
(Target only)                sdpa_hf_hybrid_cp_wrapper          hybrid(ulysses_degree) / hf
(Target only)                sdpa_hf_load_balance_cp_wrapper    load_balance / hf
``sdpa_qkv``                 sdpa_qkv_cp_wrapper                colossal / qkv
``sdpa_qkv_ulysses``         sdpa_qkv_ulysses_cp_wrapper        ulysses / qkv
(Target only)                sdpa_qkv_hybrid_cp_wrapper         hybrid(ulysses_degree) / qkv
(Target only)                sdpa_qkv_load_balance_cp_wrapper   load_balance / qkv
``flex_hf``                  flex_hf_cp_wrapper                 colossal / flex (HF module)
``flex_hf_ulysses``          flex_hf_ulysses_cp_wrapper         ulysses / flex (HF module)
``flex_qkv``                 flex_qkv_cp_wrapper                colossal / flex (core module)
``flex_qkv_ulysses``         flex_qkv_ulysses_cp_wrapper        ulysses / flex (core module)
===========================  ===================  =======================================

Hybrid and Head-Tail have no flex entry point: not offered yet, with the reason in their
catalogue rows (docs/wrappers.md prints it).

Modules (one job each): :mod:`.heads` (head counting, the head/degree rule: public
``module_heads``, ``check_heads``, ``unrepeat_kv``), :mod:`.preflight` (module and call checks,
the probe forward), :mod:`.validate_mode` (the reference of validate mode),
:mod:`.routes` (installation: strategy, handler, one route per primitive) and
:mod:`.entry_points` (the public functions below, re-exported here).

How each style hooks in (see :mod:`..interception` and docs/wrappers.md):

* ``sdpa_hf*``: HF ``forward(hidden_states, ...)`` (``attn_implementation`` "sdpa" or
  "eager"); the forward runs unchanged (projections, QK-norm, RoPE, o_proj) and its single
  attention call is replaced by the strategy: through transformers' attention interface (a
  private config naming ``hyper_parallel_cp``, as ``flex_hf*``: the call's ``sliding_window``,
  ``softcap``, ``s_aux`` sinks, ``scaling`` and ``dropout`` are read) when the probe sees the
  module use it, else its direct ``F.scaled_dot_product_attention`` call (scoped
  TorchFunctionMode; the mask is then the only carrier, so windows and additive biases are
  refused).
* ``sdpa_qkv*``: ``forward(q, k, v, ...)`` core attention that calls SDPA; the arguments are
  bound and checked, the forward runs unchanged, the SDPA call is replaced.
* ``flex_hf*``: HF attention built with ``attn_implementation="flex_attention"``; its
  attention-interface call is routed to the strategy (private config naming the additional
  ``hyper_parallel_cp`` interface). The HF BlockMask is local and is ignored; the mask over
  the *global* KV length is the engine's position/document rule from the CP batch meta.
* ``flex_qkv*``: ``forward(q, k, v, ..., block_mask=None, scale=None)`` core module around
  ``flex_attention``: the arguments are bound and the whole body is replaced by the strategy
  (a ``score_mod`` or ``return_lse`` is rejected).

In every style HF's local mask is never trusted: causality, padding and packed documents come
from :func:`~..meta.current_cp_batch_meta` (global positions, key doc ids). K/V that HF already
repeated for GQA (``repeat_kv``) are un-repeated by a strided view (``k_rep[:, ::g] == k``), so
only Hk heads are communicated; ``enable_gqa=True`` K/V are used as given.

Validation (``validate`` hook, at resolution and again in the planner with TP-local heads):
style/signature, ``attn_implementation``, refused inputs (attention dropout > 0, ALiBi, and on
the probe's recorded call: unknown kwargs, non-causal, a window or an additive bias on the SDPA
route), head divisibility for the method, and for HF styles a probe forward (train mode) on a
2-token dummy input that counts attention calls (0 = misfire, >1 = double interception). The
same call checks run again at every real call.

Modes (``apply_sharding_plan(mode=...)``): ``production`` runs the CP path; ``validate`` also
computes a full-sequence reference from the CP-gathered input and raises
:class:`CPValidationError` on every CP rank when they differ by more than
:data:`VALIDATE_TOLERANCE`. HF styles run the original forward on the gathered sequence; an
attention-interface call is computed by the module's own attention function with its own
kwargs and the model's own mask for the layer (transformers' mask functions on the global
sequence, the batch's padding/documents added); SDPA-route calls by the engine; qkv styles
attend this rank's queries to the gathered K/V with the engine (float32 for half inputs). Only
validate mode builds an ``S x S`` mask (the model's own, for its reference); production never
does. Outputs and gradients are those of the CP path in both modes.
"""
from __future__ import annotations

from .entry_points import (BUILTIN_NAMES, flex_hf_cp_wrapper, flex_hf_ulysses_cp_wrapper, flex_qkv_cp_wrapper,
                           flex_qkv_ulysses_cp_wrapper, sdpa_hf_cp_wrapper, sdpa_hf_hybrid_cp_wrapper,
                           sdpa_hf_load_balance_cp_wrapper, sdpa_hf_ulysses_cp_wrapper, sdpa_qkv_cp_wrapper,
                           sdpa_qkv_hybrid_cp_wrapper, sdpa_qkv_load_balance_cp_wrapper, sdpa_qkv_ulysses_cp_wrapper)
from .heads import check_heads, module_heads, unrepeat_kv
from .async_entry_points import (async_colossal_cp_wrapper, async_hybrid_cp_wrapper,  # noqa: E402
                                 async_load_balance_cp_wrapper, async_ulysses_cp_wrapper)
from .validate_mode import VALIDATE_TOLERANCE, CPValidationError

__all__ = [
    "sdpa_hf_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper",
    "sdpa_hf_load_balance_cp_wrapper", "sdpa_qkv_cp_wrapper", "sdpa_qkv_ulysses_cp_wrapper",
    "sdpa_qkv_hybrid_cp_wrapper", "sdpa_qkv_load_balance_cp_wrapper", "flex_hf_cp_wrapper",
    "flex_hf_ulysses_cp_wrapper", "flex_qkv_cp_wrapper", "flex_qkv_ulysses_cp_wrapper",
    "CPValidationError", "VALIDATE_TOLERANCE", "module_heads", "check_heads", "unrepeat_kv", "BUILTIN_NAMES",
    "async_colossal_cp_wrapper", "async_ulysses_cp_wrapper", "async_hybrid_cp_wrapper", "async_load_balance_cp_wrapper",
]
