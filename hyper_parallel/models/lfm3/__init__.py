"""LFM3 (transformers ``lfm3``) under CP: its mixer ``Lfm3ShortConv`` runs on
the short-conv halo exchange (``short_conv_halo``), registered here."""
from ...distributed.context_parallel.mixers.halo import HALO_FAMILIES

HALO_FAMILIES.add("Lfm3ShortConv")
