"""The CP method catalogue: every CP method is one row, and everything else reads it.

A row (:class:`CPMethod`) says, for one method: its public name and aliases, the sync strategy
class that computes it, the batch it needs (``shard_batch_for_cp`` policy, layout and sequence
length multiple), its head rule and degree rule, sync/async, and for every calling style
(:data:`STYLES`) the public entry point that offers it — or why it is not offered. Readers:

* :mod:`.registry` — the method names ``@inner_wrapper(method=...)`` accepts, the wrapper styles,
  and the modules that register built-in names (:func:`builtin_modules`);
* :mod:`.methods.factory` — name/alias resolution, strategy class, degree rule;
* :mod:`.batch` — the padding policies and their length multiple (:func:`batch_policies`);
* :mod:`..plan.planner` — one batch policy per model (:func:`batch_policy_for`), which methods
  reorder the sequence (``layout``) and cannot be mixed;
* :mod:`.wrappers` — the entry points (:func:`entry_meta`), the head and degree checks
  (:func:`check_degree`, :func:`head_split`);
* docs/wrappers.md — the support matrix is :func:`support_matrix_markdown` verbatim (a test
  compares them).

The rows are in :mod:`.rows`, the rules in :mod:`.rules`, the generated docs tables in
:mod:`.markdown`. Pure data plus small rule functions; imports nothing from the rest of the package
(any module may read it without an import cycle). The built-in attention methods and the generic
token-mixer cores are rows here; a model family adds its own mixer rows (:func:`add_rows`) and its
async adapter (:func:`add_async_adapter`) from ``models/<model_type>/`` when it is imported (the
package imports every family), so every reader reads the table live. Adding a method = adding a row
(plus its strategy / entry functions); a test enumerates the rows and runs every offered entry end
to end. docs/architecture.md.
"""
from __future__ import annotations

from .markdown import entry_table_markdown, support_matrix_markdown
from .rows import (ADAPTER_ARCHS, BALANCED, CONTIGUOUS, HEAD_TAIL, METHODS, MIXERS_MODULE, STYLES, WRAPPERS_MODULE,
                   CPMethod, Offer, Style, add_async_adapter, add_rows, async_entry_name, remove_row)
from .rules import (async_adapters, async_methods, async_plan_builder, async_targets, attention_methods,
                    batch_policies, batch_policy_for, builtin_modules, builtin_names, check_degree, cost_model,
                    entry_meta, entry_params, gathers_kv, gathers_kv_only, get_method, has_ulysses_degree, head_split,
                    method_names, method_policies, mixer_methods, offers, reorders, splits_heads_over_cp, token_layout,
                    uses_balanced_permutation, wrapper_styles)

__all__ = ["Style", "Offer", "CPMethod", "STYLES", "METHODS", "WRAPPERS_MODULE", "MIXERS_MODULE", "ADAPTER_ARCHS",
           "CONTIGUOUS", "HEAD_TAIL", "BALANCED", "token_layout", "reorders",
           "add_rows", "remove_row", "add_async_adapter", "async_adapters", "async_targets",
           "get_method", "attention_methods", "mixer_methods", "method_names", "wrapper_styles",
           "batch_policies", "method_policies", "batch_policy_for", "check_degree", "head_split", "offers",
           "entry_meta", "async_methods", "entry_params", "async_entry_name",
           "builtin_modules", "builtin_names", "entry_table_markdown", "support_matrix_markdown",
           "gathers_kv", "gathers_kv_only", "has_ulysses_degree", "splits_heads_over_cp",
           "uses_balanced_permutation", "cost_model", "async_plan_builder"]
