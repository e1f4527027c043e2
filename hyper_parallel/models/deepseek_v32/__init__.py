"""DeepSeek V3.2 (transformers ``deepseek_v32``; GLM-MoE-DSA shares it): DeepSeek sparse attention under
CP, its catalogue row and its refusal words for other methods (:mod:`.dsa`); importing the package
registers them."""
from . import dsa  # noqa: F401
