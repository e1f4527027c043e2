"""Async CP Targets for Llama (LlamaAttention), handoff protocol (docs/async_cp.md).

``hyper_parallel.models.llama.adapter.distributed.context_parallel_async.llama_async_<method>_cp_wrapper``
for ``<method>`` in colossal, ulysses, hybrid (``ulysses_degree``), load_balance. no sliding window (HF passes none).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers, target_names

SPEC = HFAttentionSpec("llama", "Llama", "transformers.models.llama.modeling_llama", "LlamaAttention",
                       qk_norm=False, window=None)
globals().update(adapter_wrappers(SPEC, __name__))
__all__ = ["SPEC", *target_names(SPEC.arch)]
