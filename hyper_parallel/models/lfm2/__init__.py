"""LFM2 (transformers ``lfm2``) under CP: its mixer ``Lfm2ShortConv`` runs on
the short-conv halo exchange (``short_conv_halo``), registered here."""
from ...distributed.context_parallel.mixers.halo import HALO_FAMILIES

HALO_FAMILIES.add("Lfm2ShortConv")
