"""Qwen3-VL (transformers ``qwen3_vl``): its vision tower spread over the CP group, deepstack features
included (:mod:`.vision`); importing the package registers it."""
from . import vision  # noqa: F401
