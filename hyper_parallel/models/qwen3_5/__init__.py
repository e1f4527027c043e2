"""Qwen3.5 (transformers ``qwen3_5``, the full class ``Qwen3_5ForConditionalGeneration``): its vision
tower spread over the CP group (:mod:`.vision`); importing the package registers it. The language
model's Gated DeltaNet methods live with Qwen3-Next's (``models/qwen3_next/gated_deltanet.py``)."""
from . import vision  # noqa: F401
