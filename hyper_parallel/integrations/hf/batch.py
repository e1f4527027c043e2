"""The CP batch contract on what Hugging Face / TRL collators produce.

:class:`CPDataCollator` wraps the Trainer's ``data_collator``. Every rank of one CP group gets the
same global batch from the dataloader (see :mod:`.data`), collates it with the user's collator and
keeps only its own slice:

* in: the collator's ``[B, S]`` batch — padded rows with ``attention_mask``; TRL's
  ``padding_free``/``packing`` rows (``position_ids`` restarting per document, ``cu_seq_lens_*``,
  ``seq_idx``, no mask); ``DataCollatorWithFlattening`` rows; ``labels`` with -100 on prompts
  (completion-only / assistant-only) or none (then ``input_ids`` are the targets, as HF's loss);
* ``shift_labels`` = ``labels[:, 1:]`` followed by -100, computed on the *global* row before
  sharding — exactly the targets transformers' ``ForCausalLMLoss`` and TRL's fused head use at
  CP=1 (so the Trainer's ``num_items_in_batch`` summed over the CP ranks is CP=1's count);
* :func:`~hyper_parallel.distributed.context_parallel.batch.shard_batch_for_cp` with the plan's
  batch policy: global positions, documents from the position restarts, padding to the method's
  multiple (ids ``pad_token_id``, labels -100), this rank's slice;
* out: the local ``input_ids``, ``position_ids`` (global positions of the slice), ``labels``,
  ``shift_labels`` (``[B, S_padded / cp]``), the local ``attention_mask`` slice — for padding-free
  rows a mask of the row's tokens with 0 on the CP padding (TRL counts tokens with it, so its
  ``num_tokens`` is CP=1's; the model never sees it) — and :data:`META_KEY` holding the
  :class:`CPBatchMeta` (global documents and positions) for the forward.

``seq_idx`` (TRL's per-token document index for short convolutions) is dropped: under CP the
documents travel in the meta. Any other tensor the collator returns is refused by name
(``CPBatchError``). No collective runs here.
"""
from __future__ import annotations

import torch

from ...distributed.context_parallel.batch import shard_batch_for_cp

META_KEY = "hyper_parallel_cp_batch"
_DROPPED = ("seq_idx",)


class CPMetaHolder:
    """Opaque carrier of a :class:`CPBatchMeta` through the Trainer's input handling (it is not a
    tensor, mapping or dataclass, so device moves and DDP's input scatter leave it alone)."""

    __slots__ = ("meta",)

    def __init__(self, meta):
        self.meta = meta

    def __repr__(self) -> str:
        m = self.meta
        return f"CPMetaHolder(cp_rank={m.cp_rank}, cp_size={m.cp_size}, global_seq_len={m.global_seq_len})"


def hf_shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels[:, 1:]`` then ``ignore_index`` — transformers' ``ForCausalLMLoss`` shift, ``[B, S]``."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


class CPDataCollator:
    """Wrap ``inner`` (the Trainer's collator); returns this CP rank's shard (module doc).

    ``cp_coords`` is ``(cp_rank, cp_size)``; ``policy`` the plan's batch policy; ``packed_documents``
    what a packed row means (the meta's ``documents``)."""

    def __init__(self, inner, cp_coords: tuple[int, int], policy, *, pad_token_id: int = 0,
                 ignore_index: int = -100, packed_documents=None):
        self.packed_documents = packed_documents
        self.inner = inner
        self.cp_coords = cp_coords
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index

    def shard(self, batch: dict) -> dict:
        """The global collated ``batch`` -> this rank's local batch (module doc)."""
        batch = dict(batch)
        for key in _DROPPED:
            batch.pop(key, None)
        labels = batch.get("labels")
        if labels is None:
            labels = batch.get("input_ids")
        if labels is not None and batch.get("shift_labels") is None:
            batch["shift_labels"] = hf_shift_labels(torch.as_tensor(labels), self.ignore_index)
        mask = batch.get("attention_mask")
        local = shard_batch_for_cp(batch, self.cp_coords, self.policy, ignore_index=self.ignore_index,
                                   pad_token_id=self.pad_token_id, packed_documents=self.packed_documents)
        out = {k: v for k, v in local.items() if k not in ("seq_lens", "seq_lens_padded")}
        if mask is None:     # padding-free rows: a mask of the row's own tokens, 0 on our CP padding, so that
            real = (local.meta.q_index < local.seq_len).to(torch.int64)    # TRL's num_tokens counts the row
            out["attention_mask"] = real[None].expand(out["input_ids"].shape[0], -1).contiguous()
        out[META_KEY] = CPMetaHolder(local.meta)
        return out

    def __call__(self, features):
        return self.shard(self.inner(features))
