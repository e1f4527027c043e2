"""Bamba (transformers ``bamba``) under CP: its mixer ``BambaMixer`` runs on
the Mamba2 SSD core (``mamba2_state_passing``), gated-norm layout, registered here."""
from ...distributed.context_parallel.mixers.mamba2 import MAMBA2_FAMILIES

MAMBA2_FAMILIES.add("BambaMixer")
