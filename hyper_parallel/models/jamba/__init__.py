"""Jamba (transformers ``jamba``) under CP: its mixer ``JambaMambaMixer`` runs on
the Mamba1 selective-scan core (``mamba1_state_passing``), registered here."""
from ...distributed.context_parallel.mixers.mamba1 import MAMBA1_FAMILIES

MAMBA1_FAMILIES.add("JambaMambaMixer")
