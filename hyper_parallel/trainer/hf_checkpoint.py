"""Hugging Face checkpoints read and written shard by shard (issue 18).

``save_hf(trainer_or_model, out_dir, *, tokenizer_dir=None)`` writes a directory that plain
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads: ``model-0000i-of-0000N
.safetensors`` + ``model.safetensors.index.json`` + ``config.json`` (+ the tokenizer files of
``tokenizer_dir``). Collective: every rank calls it. No rank gathers the model: each rank writes
the chunks of the (TP/FSDP-sharded) parameters it holds through torch DCP's
``HuggingFaceStorageWriter`` (replicated chunks written once), then the output files are
assembled from those chunks with the files split between ranks (one full tensor at a time in
host memory, never on the device).

``load_hf_into(model, path)`` fills an already sharded (meta-built, materialized) model from a
local HF directory (one ``.safetensors`` file or a sharded set with its index): each rank reads
only the slices of its own shards through DCP's ``HuggingFaceStorageReader``. Before any tensor
is read the checkpoint's names, shapes and dtypes are checked against the model (missing, extra,
shape, a dtype that cannot be cast) and one :class:`~..distributed.errors.CPConfigError` naming
the tensor is raised, identical on every rank.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["save_hf", "load_hf_into"]


def save_hf(trainer_or_model, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
            dtype=None) -> Path:
    """Write the (possibly sharded) model as an HF checkpoint directory; see the module doc.

    ``trainer_or_model``: a :class:`~.base.BaseTrainer` (its ``model``) or an ``nn.Module``.
    ``dtype``: cast on write (default: the parameters' dtype). Returns ``out_dir``.
    """
    raise NotImplementedError("issue 18: sharded HF save lands here")


def load_hf_into(model, path: str | Path) -> None:
    """Fill ``model``'s (sharded) parameters and persistent buffers from the HF checkpoint at ``path``."""
    raise NotImplementedError("issue 18: sharded HF load lands here")
