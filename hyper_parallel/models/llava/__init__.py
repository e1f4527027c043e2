"""LLaVA (transformers ``llava``): its vision tower (a CLIP-style encoder and the multimodal projector)
spread over the CP group (:mod:`.vision`); importing the package registers it."""
from . import vision  # noqa: F401
