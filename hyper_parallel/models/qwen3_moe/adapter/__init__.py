"""Qwen3-MoE adapter package."""
