"""Llama distributed adapters (async CP wrappers)."""
