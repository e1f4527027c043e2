"""MiniMax (transformers ``minimax``): the lightning attention under CP (:mod:`.lightning`)."""
