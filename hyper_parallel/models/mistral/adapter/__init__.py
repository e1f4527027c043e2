"""Mistral adapter package."""
