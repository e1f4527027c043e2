"""Llama adapters."""
