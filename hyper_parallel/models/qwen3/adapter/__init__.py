"""Qwen3 adapter package."""
