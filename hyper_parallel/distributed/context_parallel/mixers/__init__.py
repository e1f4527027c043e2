"""Exact CP methods for token mixers that are not attention (hybrid decoders).

A module that mixes tokens along the sequence (a Gated DeltaNet, a Mamba2 mixer, a short
convolution, ...) is declared under CP like the attention, on its own module (``plan_overrides``,
``inner_wrapper: <method>``); every method is an ``@inner_wrapper(mixer=True)`` written for the
contiguous layout (a permuted batch is moved to it and back: :func:`.rows.on_contiguous_layout`),
and one row of :mod:`..catalogue`. The generic methods live here — :mod:`.sequence_gather`
(any mixer; compute not divided by cp) and :mod:`.halo` (LFM2's short conv) — with what every
method shares (:mod:`.rows`: documents as rows, call checks; :mod:`.state_passing`: the blocks of
a recurrence run on the local tokens from a passed state; :mod:`.mamba2` / :mod:`.mamba1`: the SSM
cores, exact for the classes their families register: :mod:`.families`). Model-specific methods
live in ``hyper_parallel/models/<model_type>/`` with their catalogue rows (Gated DeltaNet, Kimi
Linear KDA, MiniMax lightning attention, RecurrentGemma RG-LRU, DeepSeek sparse attention, Doge),
as do the classes and specs each family registers with a core. Padding
and packed documents: every document is run as its own sequence (state and conv window restart;
padding outputs 0). Training only (a cache is neither read nor filled). docs/wrappers.md.
"""
from __future__ import annotations

from .. import catalogue
from ..registry import register_inner_wrapper


def register_catalogue_names(module_name: str, namespace: dict) -> None:
    """Register the YAML short names of the catalogue's mixer rows whose entry lives in ``module_name``."""
    for row in catalogue.mixer_methods():
        for offer in row.offers:
            if offer.entry and offer.registry_name and offer.module == module_name:
                register_inner_wrapper(offer.registry_name, namespace[offer.entry], overwrite=True)


from .halo import HALO_FAMILIES, halo_exchange, short_conv_halo_cp_wrapper  # noqa: E402
from .rows import CPMixerError  # noqa: E402
from .sequence_gather import sequence_gather_cp_wrapper  # noqa: E402

__all__ = ["sequence_gather_cp_wrapper", "short_conv_halo_cp_wrapper", "CPMixerError", "HALO_FAMILIES",
           "halo_exchange", "register_catalogue_names"]

register_catalogue_names(__name__, globals())
