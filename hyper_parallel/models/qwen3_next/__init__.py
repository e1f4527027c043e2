"""qwen3_next model code under CP (everything specific to this model family)."""
