"""Zamba2 (transformers ``zamba2``) under CP: its mixer ``Zamba2MambaMixer`` runs on
the Mamba2 SSD core (``mamba2_state_passing``), gated-norm layout, registered here."""
from ...distributed.context_parallel.mixers.mamba2 import MAMBA2_FAMILIES

MAMBA2_FAMILIES.add("Zamba2MambaMixer")
