"""Doge (transformers ``doge``): the dynamic-mask attention under CP, its catalogue row and its refusal
words for other methods (:mod:`.dynamic_mask`); importing the package registers them."""
from . import dynamic_mask  # noqa: F401
