"""Qwen3 adapters."""
