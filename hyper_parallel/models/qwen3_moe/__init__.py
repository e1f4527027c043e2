"""Qwen3-MoE adapters."""
