"""Llama adapter package."""
