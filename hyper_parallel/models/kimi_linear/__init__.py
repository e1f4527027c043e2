"""Kimi Linear (transformers ``kimi_linear``): the KDA mixer under CP and its catalogue row (:mod:`.kda`);
importing the package registers them."""
from . import kda  # noqa: F401
