"""The model's LM head as a tiled loss: no ``[S_local, vocab]`` logits in training.

:func:`install_tiled_head` replaces the forward of the model's output embedding (``lm_head``) with
one that, while a :meth:`TiledHead.targets` context is active, computes the per-token
cross-entropy of its input hidden states with :func:`hyper_parallel.ops.tiled_lm_loss` (chunks of
``chunk_size`` tokens, recompute in backward) and returns an **empty** logits tensor ``[B, S, 0]``
that stays in the autograd graph (so FSDP2's pre-backward hooks on the model output still fire
before the head's backward reads the unsharded weight). Outside the context the head is the
original module (evaluation, generation, the CP preflight proof).

The model's head post-processing is carried as explicit fields, read from what transformers
declares: ``final_logit_softcapping`` (Gemma 2/3: ``cap * tanh(x / cap)``), ``logit_scale``
(Cohere: ``x * scale``), ``logits_scaling`` (Granite: ``x / scaling``). :func:`verify_tiled_head`
proves on a short probe (before any parallelization) that the tiled loss equals cross-entropy of
the model's own logits; any head it does not reproduce (an unknown post-processing) is refused
and the caller falls back to the untiled loss with a log line saying so.

Contract of one step: ``with head.targets(shift_labels [B, S_local]): out = model(...)``, then
``head.loss_sum(out.logits)`` is the fp32 sum of the local token losses (differentiable; 0 for
``ignore_index`` targets), exactly ``F.cross_entropy(logits.float(), shift_labels,
reduction="sum")`` of the untiled path.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.tiled_loss import apply_head_post, head_post, tiled_lm_loss

log = logging.getLogger(__name__)

__all__ = ["TiledHead", "head_post", "install_tiled_head", "verify_tiled_head"]


class TiledHead:
    """Handle of an installed tiled head (see the module doc)."""

    def __init__(self, head: nn.Module, original, chunk_size: int, ignore_index: int, post: dict):
        self.head, self.original = head, original
        self.chunk_size, self.ignore_index, self.post = int(chunk_size), int(ignore_index), dict(post)
        self._targets: Optional[torch.Tensor] = None
        self._loss: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def targets(self, shift_labels: torch.Tensor):
        """Inside: the head computes the tiled loss against ``shift_labels [B, S_local]``."""
        self._targets, self._loss = shift_labels, None
        try:
            yield self
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self._targets is None:
            return self.original(hidden, *args, **kwargs)
        if args or kwargs:
            raise TypeError(f"tiled head: {type(self.head).__name__} called with extra arguments")
        B, S, H = hidden.shape
        tgt = self._targets.to(hidden.device)
        if tuple(tgt.shape) != (B, S):
            raise ValueError(f"tiled head: targets {tuple(tgt.shape)} do not match the head input [B={B}, S={S}] "
                             "(logits_to_keep / a sliced head input is not supported with the tiled loss)")
        tok = tiled_lm_loss(hidden.reshape(B * S, H), self.head.weight, getattr(self.head, "bias", None),
                            tgt.reshape(-1), ignore_index=self.ignore_index, chunk_size=self.chunk_size,
                            **self.post)
        self._loss = tok.sum()
        # empty logits, still in the graph (FSDP2's pre-backward hooks on the model output fire);
        # cloned so that it is not a view: FSDP2 hooks a module output, and an in-place op on a view
        # would drop that hook (it warns about any view it gets)
        return tok.view(B, S, 1)[..., :0].to(hidden.dtype).clone()

    def loss_sum(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 sum of this micro-batch's local token losses; ``logits`` is the model's (empty) output."""
        if self._loss is None:
            raise RuntimeError("tiled head: the model forward did not reach the LM head inside head.targets(...)")
        if logits.shape[-1] != 0:
            raise RuntimeError(f"tiled head: the model returned logits {tuple(logits.shape)}, not the head's empty "
                               "output: the head is not the model's last computation")
        return self._loss + logits.float().sum()

    def remove(self) -> None:
        """Restore the original head forward."""
        self.head.__dict__.pop("forward", None)


def _output_head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__} has no nn.Linear output embedding (got {type(head).__name__})")
    return head


def install_tiled_head(model: nn.Module, *, chunk_size: int = 256, ignore_index: int = -100) -> TiledHead:
    """Patch the model's ``lm_head`` forward (instance attribute; :meth:`TiledHead.remove` undoes it)."""
    head = _output_head(model)
    handle = TiledHead(head, head.forward, chunk_size, ignore_index, head_post(model))
    head.forward = handle.forward
    return handle


@torch.no_grad()
def verify_tiled_head(model: nn.Module, *, chunk_size: int = 256, ignore_index: int = -100,
                      seq: int = 12, tol: float = 1e-5) -> Optional[str]:
    """Probe (before any parallelization; the model is left unchanged) on a short random sequence:

    1. the model's own logits equal ``post(lm_head(h))`` of the head's input ``h`` with the fields of
       :func:`head_post` (relative to ``max |logits|``) — catches any post-processing the tiled
       head would not carry, however small the logits of a random model are;
    2. the tiled loss equals cross-entropy of those logits.
    Returns None when both hold within ``tol``, else the reason (the caller falls back to the untiled
    loss and logs it).
    """
    try:
        head = _output_head(model)
    except TypeError as exc:
        return str(exc)
    post = head_post(model)
    vocab = head.weight.shape[0]
    p = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(p.device)
    tgt = torch.randint(0, vocab, (1, seq), generator=g).to(p.device)
    tgt[0, -1] = ignore_index
    seen = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    if len(seen) != 1 or tuple(seen[0].shape[:2]) != (1, seq):
        return f"{type(model).__name__}'s forward did not call its lm_head once on the whole sequence"
    mine = apply_head_post(F.linear(seen[0], head.weight, getattr(head, "bias", None)), post.get("logit_scale"),
                 post.get("logit_divisor"), post.get("softcap"))
    if mine.shape != logits.shape:
        return f"{type(model).__name__} returns logits {tuple(logits.shape)}, its lm_head {tuple(mine.shape)}"
    err = float((mine.float() - logits.float()).abs().max() / logits.float().abs().max().clamp_min(1e-30))
    if not err <= tol:
        return (f"{type(model).__name__}'s logits differ from its lm_head output with the declared post-processing "
                f"({sorted(post) or 'none'}) by {err:.2e} (relative): its head applies something after lm_head that "
                "the tiled head does not carry")
    ref = F.cross_entropy(logits.float().reshape(seq, -1), tgt.reshape(-1), ignore_index=ignore_index,
                          reduction="sum")
    handle = install_tiled_head(model, chunk_size=max(chunk_size, seq), ignore_index=ignore_index)
    try:
        with handle.targets(tgt):
            got = handle.loss_sum(model(input_ids=ids, use_cache=False).logits)
    except Exception as exc:  # noqa: BLE001 - any failure means "not reproduced"
        return f"{type(exc).__name__}: {exc}"
    finally:
        handle.remove()
    err = float((got - ref).abs() / ref.abs().clamp_min(1e-30))
    if not err <= tol:
        return f"the tiled loss differs from cross-entropy of {type(model).__name__}'s logits by {err:.2e} (relative)"
    return None
