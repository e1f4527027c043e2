"""Qwen2 adapters."""
