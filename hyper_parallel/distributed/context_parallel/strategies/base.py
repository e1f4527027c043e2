"""ContextParallelStrategy: the runtime interface a CP wrapper calls (design section 3.3).

A strategy fixes one communication method; wrappers adapt a model's attention signature and
pick exactly one strategy. Strategies never read global config and never depend on HF class
names: they receive local q/k/v, the process groups they were built with, and the step's
:class:`~hyper_parallel.distributed.context_parallel.meta.CPBatchMeta`.

Tensor layout at the boundary (in and out): q ``[B, Hq, S_local, D]``, k/v
``[B, Hk, S_local, D]`` on the contiguous local sequence shard; ``attention`` returns
``[B, Hq, S_local, D]`` in the same local layout (``restore_output`` is the identity for
strategies that restore inside ``attention``). Every strategy ends in
:func:`hyper_parallel.ops.attention` with global positions — never a dense mask.
"""
from __future__ import annotations

from typing import Any

import torch

from ....platform import group_rank, group_size

from .... import ops as _ops
from ..meta import CPBatchMeta


class ContextParallelStrategy:
    name: str = "base"
    is_async: bool = False

    def padding_multiple(self, cp_size: int) -> int:
        """S must be a multiple of this before sharding (see shard_batch_for_cp)."""
        return cp_size

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise ValueError naming the heads/degree that do not fit (called at apply time)."""

    def shard_batch(self, batch: dict, cp_mesh) -> dict:
        from ..batch import shard_batch_for_cp

        return shard_batch_for_cp(batch, cp_mesh, policy=self.name)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None) -> torch.Tensor:
        raise NotImplementedError

    def restore_output(self, output: torch.Tensor, *, meta: CPBatchMeta) -> torch.Tensor:
        return output

    # async strategies (model adapters) override these
    def launch(self, q, k, v, *, meta: CPBatchMeta) -> Any:
        raise NotImplementedError(f"{self.name} is a sync strategy: it has no launch/wait")

    def wait(self, state: Any, *, meta: CPBatchMeta):
        raise NotImplementedError(f"{self.name} is a sync strategy: it has no launch/wait")

    # -- shared helpers (local checks only: they never communicate) ---------------------------
    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPBatchMeta,
                     *, cp_size: int, cp_rank: int) -> None:
        """Check the local q/k/v layout against ``meta`` and the strategy's group; raise ValueError."""
        who = type(self).__name__
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{who}: {name} must be [B, H, S_local, D], got shape {tuple(t.shape)}")
        if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or q.shape[3] != k.shape[3]:
            raise ValueError(f"{who}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree "
                             "on batch, kv heads or head dim")
        if meta.cp_size != cp_size or meta.cp_rank != cp_rank:
            raise ValueError(f"{who}: meta was built for cp rank {meta.cp_rank} of {meta.cp_size}, but this "
                             f"strategy's group puts this rank at {cp_rank} of {cp_size}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[2] != meta.local_seq_len:
                raise ValueError(f"{who}: {name} local sequence length {t.shape[2]} != meta.local_seq_len "
                                 f"{meta.local_seq_len} (global {meta.global_seq_len} / cp {meta.cp_size})")
        if meta.key_doc is not None and tuple(meta.key_doc.shape) != (q.shape[0], meta.global_seq_len):
            raise ValueError(f"{who}: meta.key_doc has shape {tuple(meta.key_doc.shape)}, expected "
                             f"[B={q.shape[0]}, S={meta.global_seq_len}]")
        self.validate(num_q_heads=q.shape[1], num_kv_heads=k.shape[1], cp_size=cp_size)


class CPGroupStrategy(ContextParallelStrategy):
    """A strategy that communicates on one CP group (1-D DeviceMesh, ProcessGroup, or None = cp 1)."""

    def __init__(self, cp_group=None):
        from ..collectives import resolve_group

        self.group = resolve_group(cp_group)

    @property
    def cp_size(self) -> int:
        return group_size(self.group)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.group)

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Colossal semantics (Q stays local, K/V gathered): any GQA ratio, no head divisibility."""
        check_gqa(type(self).__name__, num_q_heads, num_kv_heads)
        self.check_cp_size(cp_size, num_q_heads, num_kv_heads)

    def check_cp_size(self, cp_size: int, num_q_heads: int, num_kv_heads: int) -> None:
        """Raise ValueError when the declared cp_size is not this strategy's group size."""
        if cp_size != self.cp_size:
            from ..collectives import group_desc

            raise ValueError(f"{type(self).__name__}: cp_size={cp_size} but the strategy's "
                             f"{group_desc(self.group)} has size {self.cp_size} "
                             f"(num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads})")


def check_gqa(who: str, num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{who}: num_q_heads={num_q_heads} must be a positive multiple of "
                         f"num_kv_heads={num_kv_heads} (GQA groups)")


def engine_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, meta: CPBatchMeta, scale: float | None = None) -> torch.Tensor:
    """Run :func:`hyper_parallel.ops.attention` for queries/keys at global indices ``q_pos``/``k_pos``.

    Doc ids come from ``meta.key_doc`` (padding = -1 is never attended, packed documents do
    not see each other); causality from ``meta.causal``. No dense mask is ever built here.
    """
    dev = q.device
    q_doc, k_doc = meta.doc_slice(q_pos), meta.doc_slice(k_pos)
    if q_doc is not None:
        q_doc, k_doc = q_doc.to(dev), k_doc.to(dev)
    return _ops.attention(q, k, v, q_pos=q_pos.to(dev), k_pos=k_pos.to(dev), causal=meta.causal,
                          q_doc=q_doc, k_doc=k_doc, scale=scale)
