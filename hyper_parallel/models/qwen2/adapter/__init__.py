"""Qwen2 adapter package."""
