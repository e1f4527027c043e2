"""Qwen3: its async CP adapter (:mod:`.async_cp`); importing this package makes the adapter's public
``_target_`` path (``...qwen3.adapter.distributed.context_parallel_async``) resolve."""
from . import async_cp  # noqa: F401
