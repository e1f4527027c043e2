"""doge model code under CP (everything specific to this model family)."""
