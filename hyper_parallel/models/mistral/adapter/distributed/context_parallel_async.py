"""Async CP Targets for Mistral (MistralAttention), handoff protocol (docs/async_cp.md).

``hyper_parallel.models.mistral.adapter.distributed.context_parallel_async.mistral_async_<method>_cp_wrapper``
for ``<method>`` in colossal, ulysses, hybrid (``ulysses_degree``), load_balance. Window: ``config.sliding_window`` on every layer, carried to the engine (exact).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers, target_names

SPEC = HFAttentionSpec("mistral", "Mistral", "transformers.models.mistral.modeling_mistral", "MistralAttention",
                       qk_norm=False, window=lambda attn: getattr(attn.config, "sliding_window", None))
globals().update(adapter_wrappers(SPEC, __name__))
__all__ = ["SPEC", *target_names(SPEC.arch)]
