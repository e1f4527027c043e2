"""Differentiable CP collectives (public API), re-exported from their homes: :mod:`..comm` (the CP
group, shape checks, AllGather / AllToAll autograd primitives, the saved-K/V regather) and each
method's ``methods/<method>/collectives.py`` (Colossal, Ulysses, Hybrid, Head-Tail). Layouts are
``[B, H, S, D]`` (``seq_dim=2``, ``head_dim=1`` by default); the sequence order of a CP group is
group-rank order. Every collective goes through :mod:`hyper_parallel.platform`; a group of size 1
is the identity (no collective); shapes are checked before any collective and errors name the
dimension and the group.
"""
from ..comm import (CPCollectiveError, all_gather_seq, all_reduce_sum_replicated, group_desc, regather_saved_kv,
                    resolve_group)
from ..methods.colossal.collectives import (flex_cp_allgather, flex_cp_window_gather, regather_allgather,
                                            regather_window_gather, window_chunk_ranges)
from ..methods.head_tail.collectives import head_tail_combine, head_tail_dispatch, head_tail_sub_chunks
from ..methods.hybrid.collectives import hybrid_kv_allgather
from ..methods.ulysses.collectives import ulysses_head_to_seq, ulysses_seq_to_head

__all__ = [
    "resolve_group", "group_desc", "flex_cp_allgather", "all_gather_seq", "ulysses_seq_to_head",
    "ulysses_head_to_seq", "hybrid_kv_allgather", "head_tail_dispatch", "head_tail_combine",
    "head_tail_sub_chunks", "CPCollectiveError", "window_chunk_ranges", "flex_cp_window_gather",
    "all_reduce_sum_replicated", "regather_saved_kv", "regather_allgather", "regather_window_gather",
]
