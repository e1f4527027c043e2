"""TextTrainer: byte-level causal language modeling on a text file (see data.py, loss.py)."""
from __future__ import annotations

from .base import BaseTrainer, PreparedBatch
from .data import DataStream, TextBatcher
from .loss import token_loss_sum


class TextTrainer(BaseTrainer):
    """Next-token prediction: sum of token CE over local ``shift_labels`` (ignore_index masked)."""

    def build_data(self) -> DataStream:
        return DataStream(TextBatcher.from_config(self.cfg.data, dp_rank=self.mesh.dp_rank))

    def compute_loss(self, prepared: PreparedBatch):
        out = self.model(**prepared.inputs, use_cache=False)
        logits = out.logits
        loss_sum, valid = token_loss_sum(logits, prepared.shift_labels, self.cfg.data.ignore_index)
        return logits, loss_sum, valid
