"""Model-specific adapters (``models/<name>/adapter/``): wrappers that need a model's internals."""
