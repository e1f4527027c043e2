"""Differentiable CP collectives, one module per job: :mod:`.comm` (the CP group, shape checks,
AllGather / AllToAll autograd primitives), :mod:`.regather` (saved K/V regathered in backward),
and one module per CP method — :mod:`.colossal`, :mod:`.ulysses`, :mod:`.hybrid`,
:mod:`.head_tail`. Layouts are ``[B, H, S, D]`` (``seq_dim=2``, ``head_dim=1`` by default); the
sequence order of a CP group is group-rank order. Every collective goes through
:mod:`hyper_parallel.platform`; a group of size 1 is the identity (no collective); shapes are
checked before any collective and errors name the dimension and the group.
"""
from .colossal import (flex_cp_allgather, flex_cp_window_gather, regather_allgather, regather_window_gather,
                       window_chunk_ranges)
from .comm import CPCollectiveError, all_gather_seq, all_reduce_sum_replicated, group_desc, resolve_group
from .head_tail import head_tail_combine, head_tail_dispatch, head_tail_sub_chunks
from .hybrid import hybrid_kv_allgather
from .regather import regather_saved_kv
from .ulysses import ulysses_head_to_seq, ulysses_seq_to_head

__all__ = [
    "resolve_group", "group_desc", "flex_cp_allgather", "all_gather_seq", "ulysses_seq_to_head",
    "ulysses_head_to_seq", "hybrid_kv_allgather", "head_tail_dispatch", "head_tail_combine",
    "head_tail_sub_chunks", "CPCollectiveError", "window_chunk_ranges", "flex_cp_window_gather",
    "all_reduce_sum_replicated", "regather_saved_kv", "regather_allgather", "regather_window_gather",
]
