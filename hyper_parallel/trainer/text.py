"""TextTrainer: causal language modeling on byte-level text or tokenized (optionally packed)
documents (see data.py, data_sources.py, packing.py, loss.py, tiled_head.py: with ``loss.tiled``
the LM head computes the loss in token chunks; evaluate.py: the held-out loss)."""
from __future__ import annotations

from .base import BaseTrainer, PreparedBatch
from .data import DataStream, build_data_stream
from .loss import token_loss_sum
from .router_loss import local_router_stats, router_spec, valid_input_mask


class TextTrainer(BaseTrainer):
    """Next-token prediction: sum of token CE over local ``shift_labels`` (ignore_index masked)."""

    def build_data(self) -> DataStream:
        """The training stream (``self.eval_data``: the held-out stream or None); the tokenized store
        is built by rank 0 once and the model's vocabulary checked against it before any step."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        stream, self.eval_data = build_data_stream(self.cfg.data, dp_rank=self.mesh.dp_rank,
                                                   dp_size=self.mesh.dp_size, vocab_size=vocab,
                                                   is_builder=self.is_main)
        return stream

    def train(self, steps: int | None = None):
        """:meth:`BaseTrainer.train`, then with ``logging.export_hf`` the HF export (:meth:`export_hf`)."""
        results = super().train(steps)
        if self.cfg.logging.export_hf:
            self.export_hf()
        return results

    def export_hf(self, out_dir=None):
        """Collective: the trained model in Hugging Face format (``save_pretrained`` layout, gathered
        shard by shard by :func:`~hyper_parallel.trainer.hf_checkpoint.save_hf`) with the tokenizer
        files of ``data.tokenizer``, in ``out_dir`` (default ``<logging.out_dir>/hf``)."""
        from pathlib import Path

        from .hf_checkpoint import save_hf
        from .paths import resolve_path

        out = Path(out_dir) if out_dir is not None else Path(self.cfg.logging.out_dir) / "hf"
        tok = self.cfg.data.tokenizer if self.cfg.data.source == "files" else None
        return save_hf(self, out, tokenizer_dir=str(resolve_path(tok)) if tok else None)

    def compute_loss(self, prepared: PreparedBatch):
        """-> (logits, local loss sum, local valid targets). With an MoE router loss on
        (:mod:`.router_loss`), also sets ``self.router_stats`` to this rank's local router sums
        (else None); :func:`~hyper_parallel.trainer.step.run_step` reduces them."""
        ignore = self.cfg.data.ignore_index
        head = self.tiled_head
        spec = router_spec(self)
        kw = {"output_router_logits": True} if spec is not None else {}
        self.router_stats = None
        if head is None or self.capture_logits:        # untiled: [B, S_local, vocab] logits
            out = self.model(**prepared.inputs, use_cache=False, **kw)
            loss_sum, valid = token_loss_sum(out.logits, prepared.shift_labels, ignore)
        else:
            with head.targets(prepared.shift_labels):  # tiled: the LM head returns empty logits
                out = self.model(**prepared.inputs, use_cache=False, **kw)
            loss_sum, valid = head.loss_sum(out.logits), (prepared.shift_labels != ignore).sum()
        if spec is not None:
            self.router_stats = local_router_stats(getattr(out, "router_logits", None), spec,
                                                   valid_input_mask(prepared, loss_sum.device))
        return out.logits, loss_sum, valid
