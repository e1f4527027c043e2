"""ContextParallelStrategy: the runtime interface a CP wrapper calls.

A strategy fixes one communication method; wrappers adapt a model's attention signature and
pick exactly one strategy. Strategies never read global config and never depend on HF class
names: they receive local q/k/v, the process groups they were built with, and the step's
:class:`~hyper_parallel.distributed.context_parallel.meta.CPBatchMeta`.

Tensor layout at the boundary (in and out): q ``[B, Hq, S_local, D]``, k/v
``[B, Hk, S_local, D]`` on the contiguous local sequence shard; ``attention`` returns
``[B, Hq, S_local, D]`` in the same local layout (strategies restore the layout inside
``attention``). Every strategy ends in
:func:`hyper_parallel.ops.attention` with global positions — never a dense mask.
"""
from __future__ import annotations

import torch

from ....platform import group_rank, group_size

from .... import ops as _ops
from ..meta import CPBatchMeta


class ContextParallelStrategy:
    """One sync CP communication method behind the wrapper-facing ``attention`` call.

    Contract (every subclass):

    * built from its process group(s) only (never global config); ``cp_size`` / ``cp_rank``
      are this rank's size/position in the CP group the strategy communicates on;
    * ``attention(q, k, v, meta=..., scale=...)`` takes the contiguous local chunk
      ``cp_rank`` of the sequence, q ``[B, Hq, S_local, D]`` and k/v ``[B, Hk, S_local, D]``
      (``Hq % Hk == 0``, ``S_local == meta.local_seq_len``), and returns this rank's chunk of
      the full-sequence attention, ``[B, Hq, S_local, D]`` in q's dtype;
    * inputs are checked locally (:meth:`check_inputs`) before the first collective;
    * causality, padding and packed documents come from ``meta`` (global positions, key doc
      ids); no dense mask is built;
    * ``attention`` is differentiable in q, k, v: backward runs the mirror of every forward
      collective (ReduceScatter for an AllGather, the inverse all-to-all for an all-to-all) on
      the same group(s) and returns gradients in the local input layout.
    """

    name: str = "base"
    #: computes a batch permuted by the balanced split (``meta.perm``); only the balanced method does
    accepts_permuted: bool = False

    def padding_multiple(self, cp_size: int) -> int:
        """S must be a multiple of this before sharding (see shard_batch_for_cp)."""
        return cp_size

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise ValueError naming the heads/degree that do not fit (called at apply time)."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Local-chunk attention over the global sequence (see the class contract).

        q ``[B, Hq, S_local, D]``, k ``[B, Hk, S_local, D]``, v ``[B, Hk, S_local, Dv]`` (chunk
        ``meta.cp_rank``; the value head dim may differ from the qk head dim, MLA);
        ``scale`` defaults to ``1/sqrt(D)``. ``window`` (left sliding window on global
        positions, transformers' ``sliding_window``), ``softcap`` (logit softcapping) and
        ``sinks`` (``[Hq]`` per-head sink logits, sliced by head where heads are split) go to
        :func:`hyper_parallel.ops.attention` unchanged. Returns ``[B, Hq, S_local, Dv]``.
        Collectives run on the strategy's group(s); backward mirrors them.
        """
        raise NotImplementedError

    # -- shared helpers (local checks only: they never communicate) ---------------------------
    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPBatchMeta,
                     *, cp_size: int, cp_rank: int) -> None:
        """Check the local q/k/v layout against ``meta`` and the strategy's group; raise ValueError."""
        self.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape), meta, cp_size=cp_size,
                          cp_rank=cp_rank)

    def check_shapes(self, q_shape: tuple, k_shape: tuple, v_shape: tuple, meta: CPBatchMeta,
                     *, cp_size: int, cp_rank: int) -> None:
        """:meth:`check_inputs` on shapes only (for callers that check before computing q).

        ``cp_size`` / ``cp_rank`` are this rank's position in the strategy's group; they must
        match ``meta``. Every shape is ``[B, H, S_local, D]`` with ``S_local ==
        meta.local_seq_len``; then :meth:`validate` runs on the (local) head counts.
        """
        who = type(self).__name__
        shapes = (("q", tuple(q_shape)), ("k", tuple(k_shape)), ("v", tuple(v_shape)))
        for name, t in shapes:
            if len(t) != 4:
                raise ValueError(f"{who}: {name} must be [B, H, S_local, D], got shape {t}")
        q, k, v = (t for _, t in shapes)
        if not (q[0] == k[0] == v[0]) or k[1] != v[1] or q[3] != k[3]:
            raise ValueError(f"{who}: q {q}, k {k}, v {v} disagree on batch, kv heads or qk head dim "
                             "(v's head dim may differ)")
        if getattr(meta, "perm", None) is not None and not self.accepts_permuted:
            raise ValueError(f"{who}: the CP batch was sharded with the balanced split (policy {meta.policy!r}, a "
                             "permuted row), which only the 'balanced' CP method computes; declare it on every "
                             "attention, or shard with this method's policy")
        if meta.cp_size != cp_size or meta.cp_rank != cp_rank:
            raise ValueError(f"{who}: meta was built for cp rank {meta.cp_rank} of {meta.cp_size}, but this "
                             f"strategy's group puts this rank at {cp_rank} of {cp_size}")
        for name, t in shapes:
            if t[2] != meta.local_seq_len:
                raise ValueError(f"{who}: {name} local sequence length {t[2]} != meta.local_seq_len "
                                 f"{meta.local_seq_len} (global {meta.global_seq_len} / cp {meta.cp_size})")
        for field in ("key_doc", "key_block"):
            t = getattr(meta, field)
            if t is not None and tuple(t.shape) != (q[0], meta.global_seq_len):
                raise ValueError(f"{who}: meta.{field} has shape {tuple(t.shape)}, expected "
                                 f"[B={q[0]}, S={meta.global_seq_len}]")
        self.validate(num_q_heads=q[1], num_kv_heads=k[1], cp_size=cp_size)


class CPGroupStrategy(ContextParallelStrategy):
    """A strategy that communicates on one CP group (1-D DeviceMesh, ProcessGroup, or None = cp 1)."""

    def __init__(self, cp_group=None):
        from ..comm import resolve_group

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
            from ..comm import group_desc

            raise ValueError(f"{type(self).__name__}: cp_size={cp_size} but the strategy's "
                             f"{group_desc(self.group)} has size {self.cp_size} "
                             f"(num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads})")


def check_gqa(who: str, num_q_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError unless ``num_q_heads`` is a positive multiple of ``num_kv_heads``.

    Heads are the counts this rank computes (TP-local when TP is on); ``who`` prefixes the
    message. Pure local check: no group, no collective.
    """
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{who}: num_q_heads={num_q_heads} must be a positive multiple of "
                         f"num_kv_heads={num_kv_heads} (GQA groups)")


def check_sinks(who: str, sinks, num_q_heads: int) -> None:
    """``sinks`` must be None or ``[Hq]`` (this rank's query heads, before any head split)."""
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_q_heads,)):
        raise ValueError(f"{who}: sinks must be a [num_q_heads={num_q_heads}] tensor, got "
                         f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")


def engine_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, meta: CPBatchMeta, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, return_lse: bool = False,
                     kv_group: int | None = None, kv_offset: int = 0):
    """Run :func:`hyper_parallel.ops.attention` for queries/keys at global indices ``q_pos``/``k_pos``.

    Doc ids come from ``meta.key_doc`` (padding = -1 is never attended, packed documents do
    not see each other); bidirectional block ids from ``meta.key_block`` (a query also sees the
    later keys of its own block: Gemma 3's image tokens); causality from ``meta.causal``; ``window`` / ``softcap`` / ``sinks``
    (``[q.shape[1]]``) are passed through. No dense mask is ever built here. ``return_lse``:
    return ``(out, lse)`` as :func:`hyper_parallel.ops.attention` (for partial attentions over
    disjoint key sets merged with :func:`hyper_parallel.ops.merge.merge_partial_attention`).
    ``kv_group`` / ``kv_offset``: the query-head -> KV-head map of a Ulysses rank whose query heads
    start or end inside a KV group (``UlyssesHeadLayout.kv_map_args``; default: plain GQA).
    """
    dev = q.device
    q_doc, k_doc = meta.doc_slice(q_pos), meta.doc_slice(k_pos)
    if q_doc is not None:
        q_doc, k_doc = q_doc.to(dev), k_doc.to(dev)
    extra = {}
    if meta.key_block is not None:
        extra.update(q_block=meta.block_slice(q_pos).to(dev), k_block=meta.block_slice(k_pos).to(dev))
    if window is not None:
        extra["window"] = int(window)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if sinks is not None:
        extra["sinks"] = sinks
    if kv_group is not None:
        extra.update(kv_group=kv_group, kv_offset=kv_offset)
    return _ops.attention(q, k, v, q_pos=q_pos.to(dev), k_pos=k_pos.to(dev), causal=meta.causal,
                          q_doc=q_doc, k_doc=k_doc, scale=scale, return_lse=return_lse, **extra)
