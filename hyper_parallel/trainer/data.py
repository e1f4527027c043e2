"""Training data: byte-level text rows (here) and the stream every source feeds
(:class:`DataStream`, :func:`build_data_stream`; tokenized files and packed documents are in
:mod:`.data_sources` and :mod:`.packing`).

Byte-level text data: a corpus file -> deterministic global micro-batches per DP rank.

Tokens are the UTF-8 bytes of the file (vocab 256; byte 0, which never occurs in text, is the
pad id). Every *global micro-batch* is a pure function of ``(data.seed, dp_rank, index)``:

* every CP rank (and TP rank) of one DP rank builds the **same** global micro-batch — the CP
  shard is cut from it afterwards by ``shard_batch_for_cp`` — while different DP ranks read
  different rows (``dp_rank`` enters the seed);
* the data position is a single integer (micro-batches consumed), so a checkpoint restores the
  stream exactly.

A row is a window of the corpus of length ``seq_len``, or — with ``data.min_doc_len`` — a
shorter "document" of random length in ``[min_doc_len, seq_len]``, right-padded. Rows are never
packed, so there are no document boundaries inside a row. Batch fields (all ``[B, S]``):

  input_ids       int64, pad_token_id after the document
  labels          int64, = input_ids on the document, ignore_index on padding (unshifted, HF style)
  attention_mask  int64, 1 on the document, 0 on padding
  position_ids    int64, 0..S-1 (global positions)

``S = seq_len`` rounded up to ``data.pad_to_multiple``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..distributed.errors import CPConfigError
from .config import DataConfig
from .paths import mix_seed, resolve_path
from .vocab_rule import BYTE_ROWS, too_small

DEFAULT_CORPUS = "examples/data/corpus.txt"


class ByteCorpus:
    """The bytes of a text file as int64 tokens."""

    def __init__(self, path: str | Path):
        self.path = resolve_path(path)
        if not self.path.is_file():
            raise CPConfigError("data.path", f"{path} is not a file",
                                fix=f"point it at a text file, e.g. {DEFAULT_CORPUS}")
        raw = self.path.read_bytes()
        if len(raw) < 4:
            raise CPConfigError("data.path", f"{path} holds only {len(raw)} bytes")
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclasses.dataclass
class TextBatcher:
    """Builds global micro-batch ``index`` for ``dp_rank`` (see module doc)."""

    corpus: ByteCorpus
    seq_len: int
    micro_batch_size: int
    dp_rank: int = 0
    seed: int = 0
    min_doc_len: int | None = None
    pad_to_multiple: int | None = None
    pad_token_id: int = 0
    ignore_index: int = -100

    @classmethod
    def from_config(cls, cfg: DataConfig, dp_rank: int = 0, corpus: ByteCorpus | None = None) -> "TextBatcher":
        corpus = corpus or ByteCorpus(cfg.path or DEFAULT_CORPUS)
        if len(corpus) < cfg.seq_len + 1:
            raise CPConfigError("data.seq_len", f"{cfg.seq_len} exceeds the corpus length {len(corpus)} bytes")
        return cls(corpus, cfg.seq_len, cfg.micro_batch_size, dp_rank, cfg.seed, cfg.min_doc_len,
                   cfg.pad_to_multiple, cfg.pad_token_id, cfg.ignore_index)

    @property
    def padded_len(self) -> int:
        m = self.pad_to_multiple or 1
        return -(-self.seq_len // m) * m

    def batch(self, index: int) -> dict:
        B, S = self.micro_batch_size, self.padded_len
        tokens = self.corpus.tokens
        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((B, S), dtype=torch.int64)
        for row in range(B):
            g = torch.Generator().manual_seed(mix_seed(self.seed, self.dp_rank, index, row))
            if self.min_doc_len is not None:
                length = int(torch.randint(self.min_doc_len, self.seq_len + 1, (1,), generator=g))
            else:
                length = self.seq_len
            start = int(torch.randint(0, len(tokens) - length + 1, (1,), generator=g))
            input_ids[row, :length] = tokens[start:start + length]
            mask[row, :length] = 1
        labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, self.ignore_index))
        position_ids = torch.arange(S, dtype=torch.int64).unsqueeze(0).expand(B, S).contiguous()
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": position_ids}


class DataStream:
    """Iterator over global micro-batches with a position (checkpointed).

    ``position``: micro-batches consumed by this DP rank (every DP rank consumes the same number).
    :meth:`state_dict` also records the stream as a DP-size-free dict — ``rows_consumed`` (global
    rows over every DP rank), ``epoch``, ``seed`` — which :meth:`load_state_dict` prefers for a
    row-indexed batcher (:class:`~hyper_parallel.trainer.packing.RowBatcher`), so a resume at
    another DP size continues at the same global row."""

    def __init__(self, batcher, position: int = 0):
        self.batcher = batcher
        self.position = position

    def next_micro_batches(self, n: int) -> list[dict]:
        out = [self.batcher.batch(self.position + i) for i in range(n)]
        self.position += n
        return out

    def state_dict(self) -> dict:
        state = {"position": self.position, "dp_rank": self.batcher.dp_rank, "seed": self.batcher.seed}
        if hasattr(self.batcher, "rows_before"):
            rows = self.batcher.rows_before(self.position)
            state.update(rows_consumed=rows, epoch=self.batcher.rows.epoch_of(rows),
                         micro_batch_size=self.batcher.micro_batch_size)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows_consumed") is not None and hasattr(self.batcher, "rows_before"):
            if int(state.get("seed", self.batcher.seed)) != self.batcher.seed:
                raise CPConfigError("data.seed", f"is {self.batcher.seed}, the checkpoint's stream used "
                                    f"{state['seed']}: the resumed rows would differ",
                                    fix=f"resume with data.seed={state['seed']}")
            per_index = self.batcher.rows_before(1)
            rows = int(state["rows_consumed"])
            if rows % per_index:
                raise CPConfigError("data.micro_batch_size", f"the checkpoint consumed {rows} global rows, not a "
                                    f"multiple of dp_size x micro_batch_size = {per_index}: no row boundary "
                                    "to resume at", fix="resume with a DP size / micro-batch size dividing it")
            self.position = rows // per_index
        else:
            self.position = int(state["position"])


def build_data_stream(cfg: DataConfig, *, dp_rank: int, dp_size: int, vocab_size: int | None,
                      is_builder: bool = True) -> tuple[DataStream, DataStream | None]:
    """(training stream, held-out stream or None) for the ``data`` section.

    ``source: bytes``: :class:`TextBatcher` (no held-out split). ``source: files``: the token store
    (:func:`~hyper_parallel.trainer.data_sources.open_token_store`: built once by
    ``is_builder``, collective when a process group is up), split by ``eval_fraction``, rows by
    :mod:`~hyper_parallel.trainer.packing`. ``vocab_size`` (the model's embedding rows) is checked
    against the tokenizer, every token id and ``pad_token_id`` before any step."""
    if cfg.source == "bytes":
        batcher = TextBatcher.from_config(cfg, dp_rank=dp_rank)
        _check_vocab(vocab_size, BYTE_ROWS, int(batcher.corpus.tokens.max()), cfg.pad_token_id,
                     f"{BYTE_ROWS} byte values (data.source: bytes)")
        return DataStream(batcher), None
    from .data_sources import open_token_store
    from .packing import DocumentRows, RowBatcher, split_documents

    store = open_token_store(cfg, is_builder=is_builder)
    _check_vocab(vocab_size, store.vocab_size, store.max_token_id, cfg.pad_token_id,
                 f"len(data.tokenizer) = {store.vocab_size}")
    train_docs, eval_docs = split_documents(len(store), cfg.eval_fraction, cfg.seed)

    def batcher(docs, shuffle):
        rows = DocumentRows(store, docs, cfg.seq_len, seed=cfg.seed, shuffle=shuffle, packing=cfg.packing)
        return RowBatcher(rows, cfg.micro_batch_size, dp_rank, dp_size, cfg.pad_to_multiple, cfg.pad_token_id,
                          cfg.ignore_index)

    held_out = DataStream(batcher(eval_docs, False)) if len(eval_docs) else None
    return DataStream(batcher(train_docs, cfg.shuffle)), held_out


def _check_vocab(vocab_size: int | None, rows: int, max_id: int, pad_id: int, what: str) -> None:
    """The vocabulary rule (:mod:`.vocab_rule`) against the model actually built (also one the
    caller passed in): ``rows`` ids the data can produce (``what``), the largest one in it."""
    if vocab_size is None:
        return
    if rows > vocab_size or max_id >= vocab_size:
        raise too_small(vocab_size, max(rows, max_id + 1), what)
    if not 0 <= pad_id < vocab_size:
        raise CPConfigError("data.pad_token_id", f"{pad_id} is not a token id of the model (vocab {vocab_size})",
                            fix="use the tokenizer's pad id or 0")


def concat_batches(batches: list[dict]) -> dict:
    """Row-concatenate micro-batches (e.g. every DP rank's batch -> the CP=1 reference batch)."""
    return {k: torch.cat([b[k] for b in batches], dim=0) for k in batches[0]}


def count_valid_targets(batch: dict, ignore_index: int = -100) -> int:
    """Number of next-token targets (global shift) that carry loss."""
    labels = batch["labels"]
    return int((labels[:, 1:] != ignore_index).sum())
