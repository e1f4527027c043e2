"""Model-specific code (``models/<model_type>/``): async CP adapters (``async_cp.py``, public path
``models.<model_type>.adapter.distributed.context_parallel_async``), token-mixer methods and specs."""
