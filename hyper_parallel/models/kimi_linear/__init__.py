"""Kimi Linear (transformers ``kimi_linear``): the KDA mixer under CP (:mod:`.kda`)."""
