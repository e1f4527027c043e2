"""RecurrentGemma (transformers ``recurrent_gemma``): the RG-LRU recurrent block under CP (:mod:`.rglru`)."""
