"""Qwen2 distributed adapters (async CP wrappers)."""
