"""Token ids against the model's vocabulary, before any collective.

An id at or above the vocabulary size indexes past the embedding: on one rank it fails inside
the first collective that touches it (the CP preflight's probe forward) while its peers wait for
the collective's timeout. :func:`check_token_ids` refuses it from the config alone, on every rank.
"""
from __future__ import annotations

from ..distributed.errors import CPConfigError

__all__ = ["check_token_ids", "checked_token_ids", "model_vocab"]

_CONFIG_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def model_vocab(text_config, tokenizer_rows: int | None) -> int | None:
    """The embedding rows the trainer builds: the config's ``vocab_size``, raised to the
    tokenizer's size when that is larger (the model is resized up, never down); None when the
    config has no vocab_size."""
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    return max(vocab, tokenizer_rows or 0)


def check_token_ids(cfg, text_config, given: dict, tokenizer=None) -> None:
    """Raise CPConfigError naming the field when ``data.pad_token_id``, the HF config's
    pad/bos/eos id (``given``: the ``model.config`` / ``config_file`` kwargs, to name the field
    the user wrote) or the tokenizer's eos id (``data.source: files``) is not below the model's
    vocabulary (:func:`model_vocab`). Local, no collective."""
    vocab = model_vocab(text_config, len(tokenizer) if tokenizer is not None else None)
    if vocab is None:
        return
    where = (f"the model's vocabulary ({vocab} ids: vocab_size"
             + (" raised to the tokenizer's size" if tokenizer is not None and len(tokenizer) > text_config.vocab_size
                else "") + ")")
    pad = cfg.data.pad_token_id
    if pad >= vocab:
        hint = (f"the tokenizer's pad id {tokenizer.pad_token_id}" if tokenizer is not None
                and tokenizer.pad_token_id is not None else "0")
        raise CPConfigError("data.pad_token_id", f"{pad} is outside {where}",
                            fix=f"use an id below {vocab} (e.g. {hint}), or raise model.config.vocab_size")
    for name in _CONFIG_IDS:
        value = getattr(text_config, name, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        bad = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= vocab]
        if bad:
            field = f"model.config.{name}" if name in given else "model.config.vocab_size"
            raise CPConfigError(field, f"the model config's {name} {value} is outside {where}",
                                fix=f"use {name} below {vocab}, or raise vocab_size above {max(bad)}")
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id >= vocab:
        raise CPConfigError("data.tokenizer", f"its eos token id {tokenizer.eos_token_id} is outside {where}",
                            fix=f"raise model.config.vocab_size above {tokenizer.eos_token_id}")


def checked_token_ids(cfg, model, *, say: bool = False):
    """``model`` (built, its vocabulary already resized) after :func:`check_token_ids` on its config.
    ``say`` (rank 0): a vocabulary raised to the tokenizer's size is logged in one warning line."""
    hf = getattr(model, "config", None)
    if hf is not None:
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        check_token_ids(cfg, text, dict(cfg.model.config or {}))
        have = hf.__dict__.get("_hp_checkpoint_vocab")
        if say and have is not None:
            import logging

            logging.getLogger("hyper_parallel.trainer").warning(
                "[%s] %s is below len(data.tokenizer) = %s: the embedding and the head are built with %s rows "
                "(resized up; the new rows are initialized)%s", "model.path" if cfg.model.path else
                "model.config.vocab_size", have, text.vocab_size, text.vocab_size,
                "" if cfg.model.path else f"; set vocab_size: {text.vocab_size} to say so")
    return model
