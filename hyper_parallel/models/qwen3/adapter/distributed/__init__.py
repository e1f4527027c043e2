"""Qwen3 distributed adapters (async CP wrappers)."""
