"""Qwen3-Next and Qwen3.5 (transformers ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``): the Gated DeltaNet
under CP, its two methods and their catalogue rows (:mod:`.gated_deltanet`); importing the package
registers them."""
from . import gated_deltanet  # noqa: F401
