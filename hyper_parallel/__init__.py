"""hyper_parallel: declared context parallelism for Hugging Face LLM training.

Layers (each its own subpackage): ``platform`` (device/backend/streams; the only caller of
torch.distributed collectives), ``distributed`` (meshes, config validation, sharding
planner/applier, ``context_parallel``), ``ops`` + ``csrc`` (attention engine),
``models/<name>/adapter`` (model-specific wrappers), ``trainer``.
"""
__version__ = "0.1.0"

from . import models  # noqa: E402,F401  every model family registers its rows, classes and adapters
