"""Tokenized files and packed rows (sources, packing, resume state, batch fields), single process except the store build.

Asserts, on the shipped standard-library slice and tokenizer:
  * the token store holds exactly the tokenizer's output per document (jsonl == parquet), is built
    once and reused (a second open does not tokenize), and on 2 ranks is built by rank 0 only;
  * bad inputs are refused by field name before any step (missing file, wrong text field,
    model vocabulary smaller than the tokenizer's, options of the other source);
  * packed rows: every document + EOS appears once per epoch, in the epoch's order, split only
    at row boundaries; seq_lens / restarting positions / labels / padding of the last row; the CP
    batch contract derives targets that never cross a document;
  * the stream: DP ranks read disjoint rows covering the same global rows as one rank;
    epochs reshuffle deterministically by seed; the state dict resumes at the same global row.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig
from hyper_parallel.trainer.data import DataStream, build_data_stream
from hyper_parallel.trainer.data_sources import open_token_store
from hyper_parallel.trainer.packing import DocumentRows, RowBatcher, split_documents

from . import _data_workers as D


def _cfg(tmp_path, files=None, **kw):
    files = files or D.SLICE
    return TrainerConfig.from_dict({"data": D.data_cfg(files, str(tmp_path / "cache"), **kw)}).data


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    return D.short_docs_jsonl(str(d / "short.jsonl"))


@pytest.fixture(scope="module")
def store(tmp_path_factory, short_docs):
    d = tmp_path_factory.mktemp("store")
    return open_token_store(TrainerConfig.from_dict({"data": D.data_cfg(short_docs, str(d))}).data)


def test_store_matches_tokenizer_and_is_reused(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from hyper_parallel.trainer import data_sources as ds

    cfg = _cfg(tmp_path)
    s = open_token_store(cfg)
    tok = AutoTokenizer.from_pretrained(D.TOKENIZER)
    texts = [json.loads(line)["text"] for line in open(D.SLICE, encoding="utf-8")]
    assert len(s) == len(texts) == 32
    for i, t in enumerate(texts):
        assert s.doc(i).tolist() == tok(t, add_special_tokens=False)["input_ids"], f"document {i}"
    assert s.eos_token_id == tok.eos_token_id and s.vocab_size == len(tok) == D.VOCAB
    lens = s.lengths
    print(f"stdlib slice: {len(s)} documents, {int(lens.sum())} tokens, per document min {lens.min()} "
          f"median {int(np.median(lens))} max {lens.max()}")
    assert lens.max() > 10 * lens.min()          # very uneven lengths
    # reused: a second open builds nothing
    monkeypatch.setattr(ds, "build_token_store", lambda *a, **k: pytest.fail("tokenized twice"))
    again = open_token_store(cfg)
    assert again.path == s.path and np.array_equal(again.offsets, s.offsets)
    # parquet slice: the same documents -> the same tokens (a different store: different files)
    monkeypatch.undo()
    p = open_token_store(_cfg(tmp_path, files=D.SLICE_PARQUET))
    assert p.path != s.path and np.array_equal(p.offsets, s.offsets)
    assert np.array_equal(np.asarray(p.tokens), np.asarray(s.tokens))


def test_store_built_once_on_two_ranks(ranks, tmp_path, short_docs):
    markers = tmp_path / "markers"
    markers.mkdir()
    data = D.data_cfg(short_docs, str(tmp_path / "cache"))
    out = ranks(2).run(D.build_store_counting, data, str(markers), timeout=180)
    assert out[0] == out[1], out
    built = sorted(os.listdir(markers))
    assert len(built) == 1 and built[0].startswith("built_by_rank0_"), built


@pytest.mark.parametrize("bad, field", [
    (dict(files=["no/such/file_*.jsonl"]), "data.files"),
    (dict(text_field="body"), "data.text_field"),
    (dict(tokenizer="no/such/tokenizer"), "data.tokenizer"),
])
def test_bad_inputs_name_the_field(tmp_path, bad, field):
    data = D.data_cfg(D.SLICE, str(tmp_path / "cache"))
    data.update(bad)
    with pytest.raises(CPConfigError, match=rf"^\[{field}\]"):
        build_data_stream(TrainerConfig.from_dict({"data": data}).data, dp_rank=0, dp_size=1, vocab_size=D.VOCAB)


def test_vocab_checked_against_the_model(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(CPConfigError, match=r"^\[model.config.vocab_size\] 256 is below the token ids the data "
                                            r"can produce \(len\(data.tokenizer\) = 4096\)"):
        build_data_stream(cfg, dp_rank=0, dp_size=1, vocab_size=256)
    cfg.pad_token_id = D.VOCAB
    with pytest.raises(CPConfigError, match=r"^\[data.pad_token_id\]"):
        build_data_stream(cfg, dp_rank=0, dp_size=1, vocab_size=D.VOCAB)


def test_options_of_the_other_source_refused():
    with pytest.raises(CPConfigError, match=r"^\[data.packing\] applies to data.source: files \(or media\) only"):
        TrainerConfig.from_dict({"data": {"packing": True}})
    with pytest.raises(CPConfigError, match=r"^\[data.tokenizer\] is required"):
        TrainerConfig.from_dict({"data": {"source": "files", "files": "x.jsonl"}})
    with pytest.raises(CPConfigError, match=r"^\[data.eval_every\] needs held-out documents"):
        TrainerConfig.from_dict({"data": D.data_cfg(D.SLICE, "/tmp/x", eval_every=2)})


def _epoch_stream(store, rows: DocumentRows, epoch: int) -> np.ndarray:
    order, _ = rows._layout(epoch)
    return np.concatenate([np.append(np.asarray(store.doc(int(d))), store.eos_token_id) for d in order])


def test_packed_rows_cover_each_document_once_per_epoch(store):
    S = 64
    rows = DocumentRows(store, np.arange(len(store)), S, seed=3)
    n = rows.rows_per_epoch
    for epoch in (0, 1):
        got, splits = [], 0
        for r in range(n):
            tokens, lens = rows.row(epoch * n + r)
            assert sum(lens) == tokens.size and (tokens.size == S or r == n - 1)
            got.append(tokens)
            splits += int(tokens[-1] != store.eos_token_id and r < n - 1)
        assert np.array_equal(np.concatenate(got), _epoch_stream(store, rows, epoch))
        assert splits > 0    # some documents continue in the next row
    o0, o1 = rows._layout(0)[0].copy(), rows._layout(1)[0].copy()
    assert not np.array_equal(o0, o1) and np.array_equal(np.sort(o0), np.sort(o1))  # reshuffled, same docs
    again = DocumentRows(store, np.arange(len(store)), S, seed=3)
    assert np.array_equal(again._layout(1)[0], o1)                                    # deterministic by seed
    other = DocumentRows(store, np.arange(len(store)), S, seed=4)
    assert not np.array_equal(other._layout(0)[0], o0)


def test_packed_batch_fields_and_cp_targets(store):
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    rows = DocumentRows(store, np.arange(len(store)), 64, seed=0)
    last = rows.rows_per_epoch - 1
    # micro-batch whose second row is the padded last row of epoch 0
    b = RowBatcher(rows, 2, pad_token_id=1).batch(0)
    tail = RowBatcher(rows, 1, pad_token_id=1).batch(last)
    for batch in (b, tail):
        ids, lab, mask, pos, lens = (batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids",
                                                        "seq_lens"))
        for r in range(ids.shape[0]):
            n = int(lens[r].sum())
            assert int(mask[r].sum()) == n and bool((ids[r, n:] == 1).all()) and bool((lab[r, n:] == -100).all())
            k = 0
            for L in lens[r].tolist():
                if L:
                    assert torch.equal(pos[r, k:k + L], torch.arange(L)), "positions restart per document"
                    k += L
            # targets: next token inside a document, ignore_index at each document's last token
            local = shard_batch_for_cp(batch, (0, 1), "all_gather")
            sl = local["shift_labels"][r]
            ends = torch.cumsum(lens[r], 0)
            for e in ends.tolist():
                if 0 < e <= ids.shape[1]:
                    assert int(sl[e - 1]) == -100, "a target predicts the next document's first token"
            inside = torch.ones(ids.shape[1], dtype=torch.bool)
            inside[(ends - 1).clamp(min=0)] = False
            inside[n:] = False
            assert torch.equal(sl[:-1][inside[:-1]], ids[r, 1:][inside[:-1]])
    assert int(tail["attention_mask"].sum()) < 64      # the last row of the epoch is padded


def test_dp_ranks_read_disjoint_rows_and_state_resumes(store):
    rows = DocumentRows(store, np.arange(len(store)), 64, seed=0)
    one = RowBatcher(rows, 2, dp_rank=0, dp_size=1)
    two = [RowBatcher(rows, 1, dp_rank=d, dp_size=2) for d in range(2)]
    seen = set()
    for i in range(5):
        mine = [set(b.global_rows(i)) for b in two]
        assert not (mine[0] & mine[1]) and not (mine[0] | mine[1]) & seen
        seen |= mine[0] | mine[1]
        assert mine[0] | mine[1] == set(one.global_rows(i))
        ref = one.batch(i)["input_ids"]
        assert torch.equal(torch.cat([b.batch(i)["input_ids"] for b in two]), ref)
    # state: global rows consumed; a resume at another DP size continues at the same row
    s1 = DataStream(one)
    s1.next_micro_batches(3)
    state = s1.state_dict()
    assert state["rows_consumed"] == 6 and state["epoch"] == 0 and state["seed"] == 0
    s2 = DataStream(two[1])
    s2.load_state_dict(state)
    assert s2.position == 3 and s2.batcher.global_rows(s2.position) == [7]
    with pytest.raises(CPConfigError, match=r"^\[data.seed\]"):
        DataStream(RowBatcher(DocumentRows(store, np.arange(len(store)), 64, seed=9), 2)).load_state_dict(state)


def test_held_out_split_is_seeded_and_disjoint():
    tr, ev = split_documents(100, 0.1, seed=0)
    assert len(ev) == 10 and not set(tr) & set(ev) and len(tr) + len(ev) == 100
    assert np.array_equal(split_documents(100, 0.1, seed=0)[1], ev)
    assert not np.array_equal(split_documents(100, 0.1, seed=1)[1], ev)
    with pytest.raises(CPConfigError, match=r"^\[data.eval_fraction\]"):
        split_documents(3, 0.9, seed=0)


def test_unpacked_rows_one_document_each(store):
    rows = DocumentRows(store, np.arange(len(store)), 64, seed=0, shuffle=False, packing=False)
    assert rows.rows_per_epoch == len(store)
    for r in range(5):
        tokens, lens = rows.row(r)
        full = np.append(np.asarray(store.doc(r)), store.eos_token_id)
        assert lens == [tokens.size] and np.array_equal(tokens, full[:64])
