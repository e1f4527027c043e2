"""TextTrainer: byte-level causal language modeling on a text file (see data.py, loss.py,
tiled_head.py: with ``loss.tiled`` the LM head computes the loss in token chunks)."""
from __future__ import annotations

from .base import BaseTrainer, PreparedBatch
from .data import DataStream, TextBatcher
from .loss import token_loss_sum


class TextTrainer(BaseTrainer):
    """Next-token prediction: sum of token CE over local ``shift_labels`` (ignore_index masked)."""

    def build_data(self) -> DataStream:
        return DataStream(TextBatcher.from_config(self.cfg.data, dp_rank=self.mesh.dp_rank))

    def compute_loss(self, prepared: PreparedBatch):
        ignore = self.cfg.data.ignore_index
        head = self.tiled_head
        if head is None or self.capture_logits:        # untiled: [B, S_local, vocab] logits
            out = self.model(**prepared.inputs, use_cache=False)
            loss_sum, valid = token_loss_sum(out.logits, prepared.shift_labels, ignore)
            return out.logits, loss_sum, valid
        with head.targets(prepared.shift_labels):      # tiled: the LM head returns empty logits
            out = self.model(**prepared.inputs, use_cache=False)
        return out.logits, head.loss_sum(out.logits), (prepared.shift_labels != ignore).sum()
