"""Batch preparation of the step: one global micro-batch -> this rank's model inputs and targets.

Every CP size runs the same batch contract, ``shard_batch_for_cp``
(:mod:`hyper_parallel.distributed.context_parallel.batch`); CP=1 is a CP group of one
(``cp_mesh=(0, 1)``, policy ``all_gather``: no CP padding, the "shard" is the whole row). So
every batch — plain, right-padded, packed (``seq_lens`` / ``seq_lens_padded`` / restarting
``position_ids`` / transformers' ``cu_seq_lens_*``), padded inside packed rows — gets the same
``shift_labels`` (global next-token targets, ``ignore_index`` on padding, on the last token and at
every document boundary) and the same valid-token count at every CP size.

What differs is only who applies the masking:

* CP > 1: the declared CP wrappers read ``CPBatchMeta`` (key documents, padding) inside
  ``cp_batch_context``;
* CP = 1: no CP code runs in the model (unless methods are installed at cp 1 — an ``at_cp1`` one,
  or every declared one under ``data.packed_documents: independent`` — which then read the CP
  group of one's meta); it gets ``input_ids`` and the (restarting, for packed
  rows) ``position_ids`` and no ``attention_mask``, so transformers separates packed documents
  from the position restarts (``find_packed_sequence_indices``) and causality hides padding that
  ends a document. Padding followed by a valid token of the *same* document would be visible to
  that token, so it is refused (:func:`check_cp1_masking`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["PreparedBatch", "prepare_batch", "check_cp1_masking", "CP1_GROUP"]

#: the CP coordinates (cp_rank, cp_size) of a CP group of one, as ``shard_batch_for_cp`` reads them
CP1_GROUP = (0, 1)


@dataclasses.dataclass
class PreparedBatch:
    """One micro-batch ready for forward on this rank."""

    inputs: dict                    # model kwargs: local input_ids [B, S_local], global position_ids
    shift_labels: torch.Tensor      # local next-token targets [B, S_local] (global shift)
    num_valid_tokens: int           # local targets != ignore_index
    meta: Any = None                # CPBatchMeta when CP > 1 or a method is installed at CP = 1 (else None)
    seq_len: int = 0                # global (unpadded) sequence length of the micro-batch
    local: Any = None               # the shard_batch_for_cp result (CPBatch), at every CP size
    media: dict | None = None       # a VLM batch's media {kind: (pixel_values, grid_thw)} (global, every CP rank)
    global_ids: Any = None          # with media: the global input_ids [B, S] (where each placeholder is)


def prepare_batch(batch: dict, *, cp_mesh, cp_size: int, policy, device, ignore_index: int = -100,
                  pad_token_id: int = 0, prepare_fn: Callable | None = None, packed_documents: str | None = None,
                  keep_meta: bool = False) -> PreparedBatch:
    """Shard ``batch`` (the global micro-batch, identical on every CP rank) for this CP rank.

    ``cp_mesh``: the 1-D cp mesh (CP > 1; ignored at ``cp_size == 1``, where the CP group of one
    :data:`CP1_GROUP` is used). ``policy``: the sharding plan's batch policy (None, and always at
    CP = 1 -> the contiguous policy, ``batch.CONTIGUOUS_POLICY``: no CP padding).
    ``prepare_fn``: a registered model spec's batch contract (same signature and result as
    ``shard_batch_for_cp``), else ``shard_batch_for_cp``. ``packed_documents``: the meta's
    ``documents`` (``data.packed_documents``). ``keep_meta``: the meta at CP = 1 too (methods are
    installed at cp 1 and read it). No collective runs here.
    """
    from ..distributed.context_parallel.batch import CONTIGUOUS_POLICY, shard_batch_for_cp

    prepare = prepare_fn or shard_batch_for_cp
    media = batch.get("media")
    if media is not None:      # the media travel beside the batch contract (context_parallel/vision.py)
        batch = {k: v for k, v in batch.items() if k != "media"}
    cp1 = cp_size == 1
    local = prepare(batch, CP1_GROUP if cp1 else cp_mesh, CONTIGUOUS_POLICY if cp1 else (policy or CONTIGUOUS_POLICY),
                    ignore_index=ignore_index, pad_token_id=pad_token_id)
    if cp1:
        check_cp1_masking(local)
    if getattr(local, "meta", None) is not None:
        local.meta.documents = packed_documents
    inputs = {"input_ids": _field(local, "input_ids").to(device),
              "position_ids": _field(local, "position_ids").to(device)}
    shift = _field(local, "shift_labels").to(device)
    seq_len = int(getattr(local, "seq_len", batch["input_ids"].shape[1]))
    return PreparedBatch(inputs, shift, int(local.num_valid_tokens_local),
                         local.meta if keep_meta or not cp1 else None, seq_len, local,
                         media, None if media is None else batch["input_ids"])


def check_cp1_masking(local) -> None:
    """CP = 1 passes no ``attention_mask``: the model's own causal + packed-document mask (documents
    from restarting ``position_ids``) must hide every padding key from every valid query.

    That holds iff, inside each position run, no padding token is followed by a valid token —
    checked on adjacent pairs, O(B·S). Raises ``CPBatchError`` (a ValueError) naming the row and
    token otherwise, before any collective.
    """
    from ..distributed.context_parallel.batch import CPBatchError

    meta = getattr(local, "meta", None)
    key_doc = getattr(meta, "key_doc", None)
    if key_doc is None:
        return
    pos = meta.position_ids
    pos = pos.expand(key_doc.shape[0], -1) if pos.shape[0] != key_doc.shape[0] else pos
    pad = key_doc < 0
    same_run = (pos[:, 1:] - pos[:, :-1]) == 1
    bad = pad[:, :-1] & ~pad[:, 1:] & same_run
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise CPBatchError(
            f"row {b}: padding at token {j} is followed by valid token {j + 1} of the same document "
            "(position_ids do not restart there); at cp_size 1 the model gets no attention_mask, so "
            "that token would attend to the padding. Right-pad each document, or start the next "
            "document with restarting position_ids / seq_lens")


def _field(local, name: str):
    if isinstance(local, dict):
        return local[name]
    if hasattr(local, name):
        return getattr(local, name)
    return local[name]
