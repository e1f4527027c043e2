"""The vocabulary rule of docs/trainer.md ("The vocabulary"), the same for every data source:
the data can produce 256 ids (``data.source: bytes``) or ``len(data.tokenizer)`` (``files``); a
``model.config.vocab_size`` below that is a configuration error naming the field, the data's size
and the fix — in the CLI's / launcher's config check, in the library build and in the data check
against a model the caller built; equal is kept; not given is set to the data's size, said in
one start-up log line. One parametrized test per path covers every source x (below / equal / unset)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.cli import load_config
from hyper_parallel.trainer.data import build_data_stream
from hyper_parallel.trainer.data_sources import load_tokenizer
from hyper_parallel.trainer.model import HyperAutoModel
from hyper_parallel.trainer.token_id_checks import checked_token_ids
from hyper_parallel.trainer.vocab_rule import build_vocab

from . import _workers as W

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = "examples/data/stdlib_tokenizer"
SOURCES = {
    "bytes": [f"data.path={W.CORPUS}"],
    "files": ["data.source=files", "data.path=null", "data.files=[examples/data/stdlib_small.jsonl]",
              f"data.tokenizer={TOKENIZER}"],
}
CASES = ("below", "equal", "unset")


def _rows(source: str) -> int:
    return 256 if source == "bytes" else len(load_tokenizer(TOKENIZER))


def _overrides(source: str, case: str, tmp_path) -> list:
    """train_cp1.yaml on ``source`` with the tiny llama's vocab_size below / equal to the data's
    ids, or left out (a copy of its config_file without the vocab_size line)."""
    model_file = Path(W.MODELS["llama"][1])
    out = [*SOURCES[source], f"logging.out_dir={tmp_path / 'run'}"]
    if case == "unset":
        text = "".join(ln for ln in model_file.read_text().splitlines(True) if not ln.startswith("vocab_size"))
        (tmp_path / "no_vocab.yaml").write_text(text)
        return [*out, f"model.config_file={tmp_path / 'no_vocab.yaml'}"]
    vocab = _rows(source) - 1 if case == "below" else _rows(source)
    return [*out, f"model.config_file={model_file}", f"model.config.vocab_size={vocab}"]


def _assert_refusal(err: CPConfigError, source: str) -> None:
    rows = _rows(source)
    what = f"len(data.tokenizer) = {rows}" if source == "files" else "256 byte values"
    text = str(err)
    assert err.field == "model.config.vocab_size" and "\n" not in text, text
    assert f"{rows - 1} is below the token ids the data can produce" in text and what in text, text
    assert f"set vocab_size: {rows} (or more)" in text, text


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_rule_in_the_config_check_and_the_build(source, case, tmp_path, caplog):
    """The CLI's / launcher's config path (``load_config``: schema + ``check_run_config``), then
    the library build (``build_vocab`` -> ``from_config`` -> ``checked_token_ids``)."""
    argv = [str(ROOT / "examples" / "train_cp1.yaml"), *_overrides(source, case, tmp_path)]
    rows = _rows(source)
    if case == "below":
        with pytest.raises(CPConfigError) as ei:
            load_config(argv)
        _assert_refusal(ei.value, source)
        cfg = load_config([argv[0], *_overrides(source, "unset", tmp_path)])   # loads without vocab_size ...
        cfg.model.config = {"vocab_size": rows - 1}
        with pytest.raises(CPConfigError) as ei:  # ... and the library build refuses it the same way
            build_vocab(cfg)
        _assert_refusal(ei.value, source)
        with pytest.raises(CPConfigError, match=r"^\[model\.config\.vocab_size\]"):
            HyperAutoModel.from_config(cfg.model, meta=True, vocab_size=rows)
        return
    cfg = load_config(argv)
    with caplog.at_level(logging.INFO, logger="hyper_parallel.trainer"):
        model = checked_token_ids(cfg, HyperAutoModel.from_config(cfg.model, meta=True, vocab_size=build_vocab(cfg)),
                                  say=True)
    assert model.config.vocab_size == rows
    said = [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()]
    if case == "unset":
        assert said == [f"[model.config.vocab_size] not given: set to {rows}, the token ids the data can produce "
                        f"({'len(data.tokenizer)' if source == 'files' else 'data.source: bytes'})"], said
    else:
        assert said == [], said
    assert "_hp_vocab_from_data" not in model.config.to_dict()


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_data_check_refuses_a_smaller_model_the_caller_built(source, tmp_path):
    """``build_data_stream`` against the rows of a model the caller passed in (no config check):
    the same refusal, one id short of the data's."""
    cfg = load_config([str(ROOT / "examples" / "train_cp1.yaml"), *_overrides(source, "equal", tmp_path),
                       f"data.cache_dir={tmp_path / 'cache'}"])
    rows = _rows(source)
    build_data_stream(cfg.data, dp_rank=0, dp_size=1, vocab_size=rows)
    with pytest.raises(CPConfigError) as ei:
        build_data_stream(cfg.data, dp_rank=0, dp_size=1, vocab_size=rows - 1)
    _assert_refusal(ei.value, source)


def test_an_id_past_the_data_vocabulary_is_refused():
    rows = _rows("files")
    argv = [str(ROOT / "examples" / "train_cp1.yaml"), *SOURCES["files"], f"model.config.vocab_size={rows}"]
    load_config([*argv, f"data.pad_token_id={rows - 1}"])
    with pytest.raises(CPConfigError, match=rf"^\[data\.pad_token_id\] {rows} is outside the model's vocabulary"):
        load_config([*argv, f"data.pad_token_id={rows}"])


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_rank_refuses_it_at_the_build(ranks, source, tmp_path):
    """The Python API on 2 ranks (no CLI config check): refused inside the agreed model build."""
    cfg = W.make_cfg("llama", cp=2, seq_len=32, out_dir=str(tmp_path / "run"))
    rows = _rows(source)
    if source == "files":
        cfg["data"] = {"source": "files", "files": [str(ROOT / "examples" / "data" / "stdlib_small.jsonl")],
                       "tokenizer": str(ROOT / TOKENIZER), "cache_dir": str(tmp_path / "cache"), "seq_len": 32,
                       "micro_batch_size": 1}
    cfg["model"]["config"] = {"vocab_size": rows - 1}
    outs = ranks(2).run(W.build_error, cfg)
    for out in outs:
        assert out is not None and "[model.config.vocab_size]" in out[1] and str(rows) in out[1], outs


def test_a_text_config_smaller_than_the_data_is_refused_even_under_a_larger_top_level_size(monkeypatch):
    """A multimodal config embeds ``text_config.vocab_size`` rows: a larger top-level ``vocab_size``
    must not hide a text vocabulary below the data's ids."""
    from types import SimpleNamespace

    import transformers

    from hyper_parallel.trainer import vocab_rule

    monkeypatch.setattr(vocab_rule, "given_vocab_size", lambda _cfg: 300000)
    cfg = transformers.Qwen2VLConfig(text_config={"vocab_size": 100, "bos_token_id": 0, "eos_token_id": 1})
    with pytest.raises(CPConfigError, match=r"\[model.config.vocab_size\] 100 is below .*256"):
        vocab_rule.apply_vocab(cfg, 256, SimpleNamespace(path=None))
    vocab_rule.apply_vocab(transformers.LlamaConfig(vocab_size=4096), 256, SimpleNamespace(path=None))
