"""Gemma 3 (transformers ``gemma3``, ``Gemma3ForConditionalGeneration``): its vision tower (SigLIP + the
multi-modal projector) spread over the CP group, and the bidirectional attention inside each image
carried to the engine as block ids (:mod:`.vision`); importing the package registers it. docs/vlm.md,
"Gemma 3"."""
from . import vision  # noqa: F401
from .vision import image_block_ids, image_media  # noqa: F401
