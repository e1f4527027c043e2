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
        if self.cfg.data.source == "media":     # a vision-language model's samples (media.py)
            from .media import build_media_stream

            self.eval_data = None
            return build_media_stream(self.cfg.data, self.model, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size)
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
        tok = self.cfg.data.tokenizer if self.cfg.data.tokenized else None
        return save_hf(self, out, tokenizer_dir=str(resolve_path(tok)) if tok else None)

    def media_embeddings(self, prepared: PreparedBatch) -> dict:
        """This rank's ``mm_encoder_outputs`` of a VLM batch: each medium encoded by one CP rank, each
        token's embedding sent to the rank holding its placeholder (at CP=1 the same code, a group of one)."""
        from ..distributed.context_parallel.batch import CONTIGUOUS_POLICY
        from ..distributed.context_parallel.vision import media_embeddings_for_cp

        media = {k: (pv.to(self.device), grid) for k, (pv, grid) in prepared.media.items()}
        cp = self.cp_size > 1
        return media_embeddings_for_cp(self.model, prepared.global_ids, media, self.mesh.cp_mesh if cp else None,
                                       (self.cp_policy or CONTIGUOUS_POLICY) if cp else CONTIGUOUS_POLICY,
                                       frozen=self.cfg.model.freeze_vision_tower)

    def compute_loss(self, prepared: PreparedBatch):
        """-> (logits, local loss sum, local valid targets). With an MoE router loss on
        (:mod:`.router_loss`), also sets ``self.router_stats`` to this rank's local router sums
        (else None); :func:`~hyper_parallel.trainer.step.run_step` reduces them."""
        ignore = self.cfg.data.ignore_index
        head = self.tiled_head
        spec = router_spec(self)
        kw = {"output_router_logits": True} if spec is not None else {}
        if prepared.media is not None:      # the vision tower spread over the CP group (docs/vlm.md)
            kw["mm_encoder_outputs"] = self.media_embeddings(prepared)
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
