"""MiniMax (transformers ``minimax``): the lightning attention under CP and its catalogue row
(:mod:`.lightning`); importing the package registers them."""
from . import lightning  # noqa: F401
