"""LFM2-MoE (transformers ``lfm2_moe``) under CP: its mixer ``Lfm2MoeShortConv`` runs on
the short-conv halo exchange (``short_conv_halo``), registered here."""
from ...distributed.context_parallel.mixers.halo import HALO_FAMILIES

HALO_FAMILIES.add("Lfm2MoeShortConv")
