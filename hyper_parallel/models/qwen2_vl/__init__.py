"""Qwen2-VL (transformers ``qwen2_vl``): its vision tower spread over the CP group (:mod:`.vision`);
importing the package registers it."""
from . import vision  # noqa: F401
