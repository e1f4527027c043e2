"""The vocabulary rule: one for every data source (docs/trainer.md, "The vocabulary").

* The data can produce ``data_rows`` token ids: 256 with ``data.source: bytes`` (every byte
  value), ``len(data.tokenizer)`` with ``data.source: files`` (added tokens included; the
  tokenizer's eos and pad ids are among them).
* A ``vocab_size`` given in ``model.config`` / ``model.config_file`` below ``data_rows`` is a
  configuration error naming ``model.config.vocab_size``, the data's size and the fix.
* A ``vocab_size`` not given is set to ``data_rows``; rank 0 says so in one start-up log line.
* ``model.path``: a checkpoint's vocabulary below ``data_rows`` is resized up to it (the new rows
  initialised like the random build, one warning line), never down.

Checked from the config alone (local, no collective) by the launcher's parent, by every rank's
config load and by the library build (:func:`build_vocab`), before any collective.
"""
from __future__ import annotations

import dataclasses

from ..distributed.errors import CPConfigError

__all__ = ["BYTE_ROWS", "VocabChoice", "apply_vocab", "build_vocab", "data_rows", "given_vocab_size", "too_small", "vocab_choice"]

#: token ids of ``data.source: bytes``: every byte value
BYTE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class VocabChoice:
    """``rows``: what the data can produce; ``what``: that in words (for messages and the log);
    ``given``: the ``vocab_size`` that ``model.config`` / ``config_file`` gives (None: not given,
    or a ``model.path`` build)."""
    rows: int
    what: str
    given: int | None


def data_rows(data, tokenizer=None) -> tuple[int, str]:
    """(token ids the ``data`` section can produce, that in words). ``tokenizer``: the loaded
    ``data.tokenizer`` (loaded here when None and the source needs it)."""
    if data.tokenized:
        if tokenizer is None:
            from .data_sources import load_tokenizer

            tokenizer = load_tokenizer(data.tokenizer)
        return len(tokenizer), f"len(data.tokenizer) = {len(tokenizer)}"
    return BYTE_ROWS, f"{BYTE_ROWS} byte values (data.source: bytes)"


def given_vocab_size(model_cfg) -> int | None:
    """The ``vocab_size`` that ``model.config`` (over ``config_file``) gives, or None (not given,
    or ``model.path``: the checkpoint's config.json decides)."""
    if model_cfg.path:
        return None
    from .hf_config_keys import hf_config_kwargs

    kwargs = hf_config_kwargs(model_cfg)
    value = kwargs.get("vocab_size")
    if value is None and isinstance(kwargs.get("text_config"), dict):
        value = kwargs["text_config"].get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def too_small(vocab: int, rows: int, what: str) -> CPConfigError:
    """The one refusal of the rule: the model embeds ``vocab`` ids, the data produces ``rows``."""
    return CPConfigError("model.config.vocab_size", f"{vocab} is below the token ids the data can produce "
                         f"({what})", fix=f"set vocab_size: {rows} (or more) in model.config, or leave it out to "
                                          "take the data's size")


def vocab_choice(cfg, tokenizer=None) -> VocabChoice:
    """The rule for the whole config ``cfg``; raises :func:`too_small` for a given ``vocab_size``
    below the data's ids."""
    rows, what = data_rows(cfg.data, tokenizer)
    given = given_vocab_size(cfg.model)
    if given is not None and given < rows:
        raise too_small(given, rows, what)
    return VocabChoice(rows, what, given)


def build_vocab(cfg, tokenizer=None) -> int:
    """The ``vocab_size`` argument of :meth:`~.model.HyperAutoModel.from_config` for ``cfg``:
    the data's rows after :func:`vocab_choice` (set when not given, resized up for ``model.path``,
    a no-op for a given size at least as large)."""
    return vocab_choice(cfg, tokenizer).rows


def apply_vocab(hf_cfg, vocab: int, cfg) -> None:
    """The rule on a built HF config (``cfg``: the ``model`` section): ``vocab`` rows are what the
    data needs. ``model.path``: resized up, never down; a random build without a given
    ``vocab_size``: set to ``vocab``; a given one below ``vocab``: CPConfigError."""
    if cfg.path:
        _resize_vocab_config(hf_cfg, vocab)
        return
    given = given_vocab_size(cfg)
    text = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    if given is not None:
        built = getattr(text, "vocab_size", None)   # what the embedding gets (a text_config's own size wins)
        if given < vocab or (isinstance(built, int) and built < vocab):
            raise too_small(min(given, built) if isinstance(built, int) else given, vocab, f"{vocab} ids")
        return
    if getattr(text, "vocab_size", None) is None:
        raise CPConfigError("model.config.vocab_size", f"{type(hf_cfg).__name__} has no vocab_size to set")
    _set_vocab(hf_cfg, text, vocab)
    hf_cfg.__dict__["_hp_vocab_from_data"] = vocab


def _set_vocab(hf_cfg, text, vocab: int) -> None:
    text.vocab_size = vocab
    if text is not hf_cfg and hasattr(hf_cfg, "vocab_size"):
        hf_cfg.vocab_size = vocab


def _resize_vocab_config(hf_cfg, vocab: int) -> None:
    text = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    have = getattr(text, "vocab_size", None)
    if have is None:
        raise CPConfigError("model.path", f"{type(hf_cfg).__name__} has no vocab_size to resize")
    if vocab <= have:       # never shrink: a (padded) vocabulary at least the data's is kept as it is
        return
    _set_vocab(hf_cfg, text, vocab)
    hf_cfg.__dict__["_hp_checkpoint_vocab"] = have
