"""Shared CP communication primitives every method uses: the CP group helpers, shape checks and
the AllGather / AllToAll / gradient-scale autograd functions (:mod:`.primitives`), and the saved-K/V regather in
backward (:mod:`.regather`), the conv halo exchange (:mod:`.halo`), the permuted <-> contiguous
token exchange of the balanced split (:mod:`.relayout`). Layouts ``[B, H, S, D]``; every collective goes through
:mod:`hyper_parallel.platform`; a group of size 1 is the identity."""
from .primitives import (AllToAll, AllToAllUneven, CPCollectiveError, KVAllGather, all_gather_seq,
                         all_reduce_sum_replicated, check_dim, check_divisible, group_desc, resolve_group,
                         scale_grad)
from .halo import halo_exchange
from .regather import regather_saved_kv
from .relayout import Relayout

__all__ = ["CPCollectiveError", "all_gather_seq", "all_reduce_sum_replicated", "group_desc", "resolve_group",
           "check_dim", "check_divisible", "KVAllGather", "AllToAll", "AllToAllUneven", "regather_saved_kv",
           "halo_exchange", "Relayout", "scale_grad"]
