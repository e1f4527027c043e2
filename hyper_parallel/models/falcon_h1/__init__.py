"""Falcon-H1 (transformers ``falcon_h1``) under CP: its mixer ``FalconH1Mixer`` runs on the Mamba2
SSD core (``mamba2_state_passing``) with the family's own lines around the scan (:mod:`.mamba2`)."""
from ...distributed.context_parallel.mixers.mamba2 import MAMBA2_FAMILIES
from .mamba2 import MAMBA2_SPEC

MAMBA2_FAMILIES.add("FalconH1Mixer", MAMBA2_SPEC)
