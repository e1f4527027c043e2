"""Rows of documents: a token store's documents -> a deterministic, endless stream of global rows
-> global micro-batches per DP rank.

Row stream (:class:`DocumentRows`; pure function of ``(seed, epoch, row)``, O(rows) memory for
the current epoch only):

* epoch ``e`` visits the split's documents in the order ``permutation(seed, e)`` (``shuffle``;
  otherwise in file order), every epoch a different order, the same in every run;
* ``packing: true``: the epoch is the documents of that order written back to back, each followed
  by one EOS token, cut into rows of ``seq_len`` tokens. A document that does not fit in the rest
  of a row is **split at the row boundary**: its remainder starts the next row as a document of
  its own (positions restart at 0 there; the two pieces never attend to each other), so a
  document longer than ``seq_len`` fills whole rows. Only the last row of an epoch is shorter; it
  is right-padded, and the next epoch starts a fresh row;
* ``packing: false``: one document (+ EOS) per row, truncated to ``seq_len``, right-padded.

Micro-batch ``index`` of DP rank ``d`` (of ``dp_size``) holds the global rows
``(index * dp_size + d) * B + b``, ``b < B``: DP ranks read disjoint rows, every CP/TP rank of one
DP rank builds the same global micro-batch (the CP shard is cut from it afterwards), and a stream
position is one number — global rows consumed — that does not depend on the DP size.

Batch fields (``[B, S]``, ``S = seq_len`` rounded up to ``pad_to_multiple``): ``input_ids``
(``pad_token_id`` on padding), ``labels`` (= ``input_ids``; ``ignore_index`` on padding),
``attention_mask`` (1 on tokens, 0 on padding), ``position_ids`` (restarting at 0 in every
document; the padding tail counts on from 0), ``seq_lens`` (``[B, n_docs]`` token count of each
document of the row, zero-filled to the batch's largest count). ``shard_batch_for_cp`` turns
``seq_lens`` into document ids: attention never crosses a document and no target predicts the
first token of the next document, at every CP size and method.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..distributed.errors import CPConfigError
from .paths import mix_seed
from .data_sources import TokenStore


class DocumentRows:
    """Global row ``g`` of the endless row stream over ``docs`` of ``store`` (module doc)."""

    def __init__(self, store: TokenStore, docs: np.ndarray, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 packing: bool = True):
        if len(docs) == 0:
            raise CPConfigError("data.eval_fraction", "leaves no document for this split",
                                fix="lower data.eval_fraction or add documents")
        self.store, self.docs, self.seq_len = store, np.asarray(docs, dtype=np.int64), seq_len
        self.seed, self.shuffle, self.packing = seed, shuffle, packing
        units = store.lengths[self.docs] + 1                    # + EOS
        self.total = int(units.sum())
        self.rows_per_epoch = -(-self.total // seq_len) if packing else len(self.docs)
        self._epoch, self._order, self._ends = None, None, None

    def epoch_of(self, g: int) -> int:
        return g // self.rows_per_epoch

    def _layout(self, epoch: int):
        if self._epoch != epoch:
            n = len(self.docs)
            order = (np.random.Generator(np.random.PCG64(mix_seed(self.seed, epoch))).permutation(n)
                     if self.shuffle else np.arange(n))
            self._order = self.docs[order]
            self._ends = np.cumsum(self.store.lengths[self._order] + 1)
            self._epoch = epoch
        return self._order, self._ends

    def _unit(self, doc: int) -> np.ndarray:
        return np.concatenate([np.asarray(self.store.doc(doc), dtype=np.int64),
                               np.array([self.store.eos_token_id], dtype=np.int64)])

    def row(self, g: int) -> tuple[np.ndarray, list[int]]:
        """(tokens int64 [<= seq_len], token count of each document piece in order)."""
        epoch, r = divmod(int(g), self.rows_per_epoch)
        order, ends = self._layout(epoch)
        S = self.seq_len
        if not self.packing:
            tokens = self._unit(int(order[r]))[:S]
            return tokens, [int(tokens.size)]
        lo, hi = r * S, min((r + 1) * S, self.total)
        i = int(np.searchsorted(ends, lo, side="right"))
        pieces, lens = [], []
        while i < len(order) and lo < hi:
            start = int(ends[i]) - int(self.store.lengths[order[i]]) - 1
            a, b = lo - start, min(hi, int(ends[i])) - start
            pieces.append(self._unit(int(order[i]))[a:b])
            lens.append(b - a)
            lo = start + b
            i += 1
        return np.concatenate(pieces), lens


@dataclasses.dataclass
class RowBatcher:
    """Global micro-batch ``index`` of DP rank ``dp_rank`` from a :class:`DocumentRows` stream."""

    rows: DocumentRows
    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    pad_to_multiple: int | None = None
    pad_token_id: int = 0
    ignore_index: int = -100

    @property
    def seed(self) -> int:
        return self.rows.seed

    @property
    def padded_len(self) -> int:
        m = self.pad_to_multiple or 1
        return -(-self.rows.seq_len // m) * m

    def global_rows(self, index: int) -> list[int]:
        B = self.micro_batch_size
        first = (index * self.dp_size + self.dp_rank) * B
        return list(range(first, first + B))

    def rows_before(self, index: int) -> int:
        """Global rows consumed (over every DP rank) before micro-batch ``index``."""
        return index * self.dp_size * self.micro_batch_size

    def batch(self, index: int) -> dict:
        B, S = self.micro_batch_size, self.padded_len
        rows = [self.rows.row(g) for g in self.global_rows(index)]
        n_docs = max(len(lens) for _, lens in rows)
        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((B, S), dtype=torch.int64)
        pos = torch.zeros((B, S), dtype=torch.int64)
        seq_lens = torch.zeros((B, n_docs), dtype=torch.int64)
        for b, (tokens, lens) in enumerate(rows):
            n = int(tokens.size)
            input_ids[b, :n] = torch.from_numpy(tokens)
            mask[b, :n] = 1
            seq_lens[b, :len(lens)] = torch.tensor(lens, dtype=torch.int64)
            pos[b, :n] = torch.cat([torch.arange(k, dtype=torch.int64) for k in lens])
            pos[b, n:] = torch.arange(S - n, dtype=torch.int64)
        labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, self.ignore_index))
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": pos,
                "seq_lens": seq_lens}


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train doc ids, held-out doc ids): ``round(eval_fraction * n_docs)`` documents (at least one
    when the fraction is > 0) chosen by a seeded permutation, the same in every run; both sorted."""
    if eval_fraction <= 0:
        return np.arange(n_docs, dtype=np.int64), np.zeros(0, dtype=np.int64)
    n_eval = max(1, int(round(eval_fraction * n_docs)))
    if n_eval >= n_docs:
        raise CPConfigError("data.eval_fraction", f"{eval_fraction} holds out {n_eval} of {n_docs} documents, "
                            "leaving none to train on", fix="lower it or add documents")
    perm = np.random.Generator(np.random.PCG64(mix_seed(seed, 0x5EED))).permutation(n_docs)
    return np.sort(perm[n_eval:]).astype(np.int64), np.sort(perm[:n_eval]).astype(np.int64)
