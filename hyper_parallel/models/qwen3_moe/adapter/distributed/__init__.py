"""Qwen3-MoE distributed adapters (async CP wrappers)."""
