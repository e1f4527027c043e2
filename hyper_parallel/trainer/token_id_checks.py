"""Token ids against the model's vocabulary, before any collective.

An id at or above the vocabulary size indexes past the embedding: on one rank it fails inside
the first collective that touches it (the CP preflight's probe forward) while its peers wait for
the collective's timeout. :func:`check_token_ids` refuses it from the config alone, on every rank.
"""
from __future__ import annotations

from ..distributed.errors import CPConfigError

__all__ = ["check_token_ids", "checked_token_ids", "model_vocab"]

_CONFIG_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def model_vocab(text_config, data_rows: int | None) -> int | None:
    """The embedding rows the trainer builds (:mod:`.vocab_rule`): the config's ``vocab_size``
    (already set from the data when not given), a ``model.path`` checkpoint's raised to the
    data's ids when that is larger; None when the config has no vocab_size."""
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    return max(vocab, data_rows or 0)


def check_token_ids(cfg, text_config, given: dict, tokenizer=None, data_rows: int | None = None,
                    note: str = "") -> None:
    """Raise CPConfigError naming the field when ``data.pad_token_id``, the HF config's
    pad/bos/eos id (``given``: the ``model.config`` / ``config_file`` kwargs, to name the field
    the user wrote) or the tokenizer's eos id (``data.source: files``) is not below the model's
    vocabulary (:func:`model_vocab`; ``note``: how that size was reached, for the message).
    Local, no collective."""
    vocab = model_vocab(text_config, data_rows)
    if vocab is None:
        return
    where = f"the model's vocabulary ({vocab} ids{note})"
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
    """``model`` (built, its vocabulary set by :mod:`.vocab_rule`) after :func:`check_token_ids`
    on its config. ``say`` (rank 0): one start-up log line when the vocabulary was set from the
    data (INFO) or a checkpoint's was resized up (WARNING)."""
    hf = getattr(model, "config", None)
    if hf is not None:
        import logging

        log = logging.getLogger("hyper_parallel.trainer")
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        have = hf.__dict__.get("_hp_checkpoint_vocab")
        from_data = hf.__dict__.pop("_hp_vocab_from_data", None)
        note = (" set from the data: vocab_size was not given" if from_data is not None else
                f": model.path's {have} resized up to the data's ids" if have is not None else "")
        check_token_ids(cfg, text, dict(cfg.model.config or {}), note=note)
        if say and from_data is not None:
            log.info("[model.config.vocab_size] not given: set to %s, the token ids the data can produce (%s)",
                     from_data, "len(data.tokenizer)" if cfg.data.tokenized else "data.source: bytes")
        if say and have is not None:
            log.warning("[model.path] the checkpoint's vocab_size %s is below the token ids the data can produce: "
                        "the embedding and the head are built with %s rows (resized up; the new rows are "
                        "initialized)", have, text.vocab_size)
    return model
