"""RecurrentGemma (transformers ``recurrent_gemma``): the RG-LRU recurrent block under CP and its catalogue
row (:mod:`.rglru`); importing the package registers them."""
from . import rglru  # noqa: F401
