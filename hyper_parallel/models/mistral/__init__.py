"""Mistral adapters."""
