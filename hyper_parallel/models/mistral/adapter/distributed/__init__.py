"""Mistral distributed adapters (async CP wrappers)."""
