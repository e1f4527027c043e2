"""Per-step CP batch metadata, visible to attention wrappers during the model's forward.

The trainer (or a test) shards a global batch with ``shard_batch_for_cp`` and runs the
forward inside ``with cp_batch_context(meta):``. Attention wrappers read
:func:`current_cp_batch_meta` to learn the global positions of their local queries and the
validity / document id of every global key — HF's local causal mask is never trusted.

Layout contract (all strategies): every CP rank holds the *contiguous* chunk ``cp_rank`` of
the (padded) global sequence: global token indices
``q_index = cp_rank * local_seq_len + arange(local_seq_len)`` — of the row permuted by ``perm``
under the balanced split (batch policy ``balanced``): ``q_index = perm[cp_rank * L:(cp_rank + 1) * L]``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional

import torch

#: what a row holding several packed documents means (``CPBatchMeta.documents``; the trainer's
#: ``data.packed_documents``): each document computed as if alone, or what plain transformers
#: computes on the packed row (its recurrent mixers and row-indexed semantics run across the
#: boundaries; its attention keeps the documents apart). docs/wrappers.md, "Packed documents".
INDEPENDENT, AS_TRANSFORMERS = "independent", "as_transformers"
PACKED_DOCUMENTS = (INDEPENDENT, AS_TRANSFORMERS)


@dataclasses.dataclass
class CPBatchMeta:
    """What a CP attention wrapper knows about the current step's batch on this rank.

    This rank (``cp_rank`` of ``cp_size`` in the CP group) holds tokens
    ``[cp_rank * local_seq_len, (cp_rank + 1) * local_seq_len)`` of the padded global
    sequence of length ``global_seq_len`` (``local_seq_len == global_seq_len // cp_size``).
    ``key_doc`` is ``[B, global_seq_len]`` int64 doc ids for *every* global key (``-1`` =
    padding, never attended; different ids do not see each other), or None for one valid
    document per row. ``causal`` selects the causal rule on global positions.
    ``position_ids`` (``[B|1, global_seq_len]``, global, CP pad tokens continuing the row) and
    ``seq_len`` (unpadded global S) let the rotary embeddings run on the global positions
    (:mod:`.rope`). Plain data:
    built by ``shard_batch_for_cp`` (no collective here), read-only for wrappers, carries no
    gradient.
    """

    cp_rank: int
    cp_size: int
    global_seq_len: int                 # padded global S (multiple of the policy's multiple)
    local_seq_len: int                  # global_seq_len // cp_size
    key_doc: Optional[torch.Tensor]     # [B, global_seq_len] int64 doc id per key, -1 = padding; None = all valid, one doc
    policy: str = "all_gather"          # padding policy used to build the batch
    causal: bool = True
    # global positions [B|1, global_seq_len] (CP pad tokens continue the row) and the unpadded
    # global S: what the rotary embeddings need to be computed as for the whole sequence
    # (context_parallel.rope); None when the batch was not built by shard_batch_for_cp
    position_ids: Optional[torch.Tensor] = None
    seq_len: Optional[int] = None
    # chunked attention (Llama 4 ``attention_chunk_size``) already folded into ``key_doc`` by
    # :func:`with_attention_chunk`; None = no chunking. Informational: the engine reads key_doc only.
    chunk: Optional[int] = None
    # balanced split (batch policy "balanced"): [global_seq_len] int64, slot i of the permuted row
    # holds global token perm[i]; rank r holds slots [r*L, (r+1)*L). None: the identity
    perm: Optional[torch.Tensor] = None
    # multimodal 3-D RoPE ids [3, B|1, global_seq_len] (temporal/height/width, global order, CP pad
    # tokens continuing each row) when the batch gave 3-D position_ids (context_parallel.rope_mrope);
    # ``position_ids`` then holds the 1-D positions that drive causality and documents
    mrope_position_ids: Optional[torch.Tensor] = None
    # the declared meaning of packed documents (:data:`PACKED_DOCUMENTS`); None: undeclared, and a
    # method whose result depends on it refuses a row holding two documents (:func:`documents_semantics`)
    documents: Optional[str] = None
    # bidirectional blocks [B, global_seq_len] int64, global order like ``key_doc`` (-1 = none; CP pad
    # tokens -1): under the causal rule a key is also visible to the queries of its own block (one
    # image's tokens, Gemma 3; numbered on the global row, so they compare across ranks). None: none.
    key_block: Optional[torch.Tensor] = None

    @property
    def q_index(self) -> torch.Tensor:
        """Global sequence indices of this rank's local tokens, [local_seq_len] int64."""
        start = self.cp_rank * self.local_seq_len
        if self.perm is not None:
            return self.perm[start:start + self.local_seq_len]
        return torch.arange(start, start + self.local_seq_len, dtype=torch.int64)

    @property
    def k_index(self) -> torch.Tensor:
        """Global indices of every key in rank order (what an AllGather returns): ``perm`` or
        ``arange(global_seq_len)`` int64."""
        if self.perm is not None:
            return self.perm
        return torch.arange(self.global_seq_len, dtype=torch.int64)

    @property
    def packs_documents(self) -> bool:
        """Some row holds more than one document (doc ids are non-decreasing along a row)."""
        kd = self.key_doc
        if kd is None:
            return False
        lo = torch.where(kd >= 0, kd, torch.full_like(kd, torch.iinfo(kd.dtype).max)).min(dim=1).values
        return bool((kd.max(dim=1).values > lo).any())

    def doc_slice(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """Doc ids [B, len(index)] of the given global indices (None when no docs/padding)."""
        if self.key_doc is None:
            return None
        return self.key_doc.index_select(1, index.to(self.key_doc.device))

    def block_slice(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """Bidirectional block ids [B, len(index)] of the given global indices (None when none)."""
        if self.key_block is None:
            return None
        return self.key_block.index_select(1, index.to(self.key_block.device))

    def block_reach(self, lo: int, hi: int) -> int:
        """One past the last global index a query in ``[lo, hi)`` may see under the causal rule:
        ``hi``, or further when a block of those queries continues past ``hi`` (its keys are visible).
        Every rank computes the same value from the global ``key_block``."""
        kb = self.key_block
        if kb is None or hi >= kb.shape[1]:
            return hi
        reach = hi
        for row in kb:                  # block ids are numbered per row
            ids = row[lo:hi]
            ids = ids[ids >= 0].unique()
            if ids.numel():
                later = torch.isin(row[hi:], ids).nonzero()
                if later.numel():
                    reach = max(reach, hi + int(later.max()) + 1)
        return reach


def documents_semantics(meta: CPBatchMeta, who: str) -> Optional[str]:
    """What ``meta``'s packed documents mean for a method whose result depends on it: None when no
    row holds two documents, else ``meta.documents``; ValueError naming the declaration when it is
    missing (raised on every rank alike: every rank holds the same global document ids)."""
    if not meta.packs_documents:
        return None
    if meta.documents not in PACKED_DOCUMENTS:
        raise ValueError(
            f"{who}: a row holds several packed documents, and this module computes differently whether they are "
            f"independent or run as plain transformers runs the packed row; declare which: "
            f"data.packed_documents: {' | '.join(PACKED_DOCUMENTS)} (library API: shard_batch_for_cp(..., "
            "packed_documents=...); HF Trainer: context_parallel(..., packed_documents=...)); docs/wrappers.md, "
            "\"Packed documents\"")
    return meta.documents


def refuse_blocks(meta: CPBatchMeta, who: str) -> None:
    """ValueError naming ``key_block`` when ``meta`` carries bidirectional blocks and the caller
    (``who``: the module and its method) selects its keys itself instead of running the engine with
    them. Local (every rank holds the same global ``key_block``), so raised before any collective."""
    if meta.key_block is not None:
        raise ValueError(
            f"{who}: the batch carries bidirectional blocks (CPBatchMeta.key_block, e.g. Gemma 3's image tokens "
            "from token_type_ids), which this method's own key selection does not apply; declare an attention "
            "method that runs the engine (colossal, ulysses, load_balance, hybrid, balanced) or shard the batch "
            "without block_ids (shard_batch_for_cp(..., block_ids=None))")


def with_attention_chunk(meta: CPBatchMeta, chunk: int, batch: int) -> CPBatchMeta:
    """``meta`` for one chunked-attention call: each key's doc id refined by its chunk.

    transformers' chunked mask lets a query see a key only when both fall in the same chunk
    ``pos // chunk``, with ``pos`` counted from the start of the token's document (position_ids
    of a packed row, the row index minus left padding otherwise). A document here is a maximal run
    of one doc id in ``key_doc``, so the refined id ``doc * n + (index - run_start) // chunk`` (padding
    stays -1) is the same restriction on documents and chunks; ids stay non-decreasing along a row,
    so the engine skips whole tiles of other chunks as it does for documents. ``batch``: B (used
    when ``key_doc`` is None). Local, no collective; a new meta, ``meta`` is unchanged.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"with_attention_chunk: chunk must be an int >= 1, got {chunk!r}")
    S = meta.global_seq_len
    kd = meta.key_doc
    if kd is None:
        kd = torch.zeros(batch, S, dtype=torch.int64)
    idx = torch.arange(S, device=kd.device).expand_as(kd)
    new_run = torch.ones_like(kd, dtype=torch.bool)
    new_run[:, 1:] = kd[:, 1:] != kd[:, :-1]
    run_start = torch.where(new_run, idx, torch.zeros_like(idx)).cummax(dim=1).values
    n = S // chunk + 1
    refined = kd.to(torch.int64) * n + (idx - run_start) // chunk
    refined = torch.where(kd >= 0, refined, torch.full_like(refined, -1))
    return dataclasses.replace(meta, key_doc=refined, chunk=int(chunk))


class _Stack(threading.local):
    def __init__(self):
        self.items: list[CPBatchMeta] = []


_STACK = _Stack()


@contextlib.contextmanager
def cp_batch_context(meta: CPBatchMeta):
    """Make ``meta`` the current CP batch for wrappers running in this thread."""
    _STACK.items.append(meta)
    try:
        yield meta
    finally:
        _STACK.items.pop()


def current_cp_batch_meta(required: bool = True) -> Optional[CPBatchMeta]:
    """The innermost :func:`cp_batch_context` meta of this thread (thread-local stack).

    Returns None when there is none and ``required`` is False; with ``required=True`` (the
    default, what wrappers use) raises RuntimeError explaining how to enter the context.
    """
    if _STACK.items:
        return _STACK.items[-1]
    if required:
        raise RuntimeError(
            "a CP attention wrapper ran outside cp_batch_context(): shard the global batch with "
            "shard_batch_for_cp(...) and run the forward inside `with cp_batch_context(local.meta)`"
        )
    return None
