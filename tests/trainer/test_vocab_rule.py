"""The vocabulary rule of docs/trainer.md ("tokenizer" row): with ``data.source: files`` a
``vocab_size`` below ``len(tokenizer)`` is raised to it, never lowered, and rank 0 says so in one
warning line; an id past the raised vocabulary is refused naming the field."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.cli import load_config
from hyper_parallel.trainer.data_sources import load_tokenizer
from hyper_parallel.trainer.model import HyperAutoModel, tokenizer_vocab
from hyper_parallel.trainer.token_id_checks import checked_token_ids

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = "examples/data/stdlib_tokenizer"
FILES = ["data.source=files", "data.path=null", "data.files=[examples/data/stdlib_small.jsonl]",
         f"data.tokenizer={TOKENIZER}"]


def _built(*overrides, say=True):
    cfg = load_config([str(ROOT / "examples" / "train_cp1.yaml"), *FILES, *overrides])
    model = HyperAutoModel.from_config(cfg.model, meta=True, vocab_size=tokenizer_vocab(cfg))
    return cfg, checked_token_ids(cfg, model, say=say)


def test_a_smaller_vocab_size_is_raised_to_the_tokenizer_with_one_warning(caplog):
    rows = len(load_tokenizer(TOKENIZER))
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.trainer"):
        _, model = _built("model.config.vocab_size=256")
    assert model.config.vocab_size == rows
    said = [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()]
    assert said == [f"[model.config.vocab_size] 256 is below len(data.tokenizer) = {rows}: the embedding and the "
                    f"head are built with {rows} rows (resized up; the new rows are initialized); set vocab_size: "
                    f"{rows} to say so"], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.trainer"):
        _, model = _built(f"model.config.vocab_size={rows + 8}")   # larger: kept, nothing said
    assert model.config.vocab_size == rows + 8 and not caplog.records


def test_an_id_past_the_raised_vocabulary_is_refused():
    rows = len(load_tokenizer(TOKENIZER))
    with pytest.raises(CPConfigError, match=r"^\[data\.pad_token_id\] .*vocab_size raised to the tokenizer's size"):
        _built("model.config.vocab_size=256", f"data.pad_token_id={rows}")
