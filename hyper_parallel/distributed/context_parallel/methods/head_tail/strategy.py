"""Head-Tail load balance on Colossal semantics (sync).

The wrapper boundary keeps the contiguous layout (rank r holds chunk r = sub-chunks 2r, 2r+1
of the 2C-way split). Inside, rank r computes one head and one tail sub-chunk so causal work
is balanced:

  sub-chunks:   0   1 | 2   3 | ... | 2C-2 2C-1        (S / 2C tokens each)
  holds (in):   rank 0 | rank 1 | ... | rank C-1
  computes:     rank r -> head r  and  tail 2C-1-r
  e.g. C=2:     rank 0 computes {0, 3}, rank 1 computes {1, 2}

  k/v [B,Hk,S/C,D] --AllGather(cp)--> [B,Hk,S,D]
  q   [B,Hq,S/C,D] --A2A dispatch(cp)--> q_head, q_tail [B,Hq,S/2C,D]
  o_head = engine(q_head, K[:(r+1)S/2C],   q_pos = r*S/2C + arange,        k_pos = 0..)
  o_tail = engine(q_tail, K[:(2C-r)S/2C],  q_pos = (2C-1-r)*S/2C + arange, k_pos = 0..)
           (keys past the last query are dropped when causal: every rank sees (2C+1)*S/2C keys;
            with bidirectional blocks, meta.key_block, the prefix reaches the end of the last block
            its queries belong to)
  (o_head, o_tail) --A2A combine(cp)--> out [B,Hq,S/C,D] chunk r
Backward mirrors every exchange: dO dispatch, dQ combine, dK/dV ReduceScatter. Between forward and
backward the rank keeps its local K/V, not the gathered ones (the two engine calls save key prefixes,
views of the gathered K/V), and backward gathers them again once for both calls
(:func:`~...comm.regather_saved_kv`, tags ``cp.allgather.regather_k`` / ``_v``);
``HeadTailStrategy.keep_gathered_kv = True`` keeps them instead (no second exchange).
Constraints: S % 2C == 0 (batch policy 'load_balance'); any GQA ratio; Colossal only — Ulysses or
Hybrid combined with Head-Tail is rejected.
"""
from __future__ import annotations

import contextlib

import torch

from ...comm import regather_saved_kv
from ...meta import CPBatchMeta
from ..base import CPGroupStrategy, check_sinks, engine_attention
from ..colossal.collectives import flex_cp_allgather, regather_allgather
from .collectives import head_tail_combine, head_tail_dispatch, head_tail_sub_chunks


class HeadTailStrategy(CPGroupStrategy):
    """Sync Colossal CP with Head-Tail load balance on ``cp_group`` (1-D mesh, group, or None)."""

    name = "load_balance"
    method = "load_balance"
    #: True: the attention keeps the gathered K/V for backward (no regather, more memory per rank)
    keep_gathered_kv = False

    def padding_multiple(self, cp_size: int) -> int:
        return 2 * cp_size

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,S/C,D], k/v [B,Hk,S/C,D] local chunk -> out [B,Hq,S/C,D] local chunk."""
        C, r = self.cp_size, self.cp_rank
        if C == 1:      # one rank (a CP group of one): head and tail are the whole row in order, nothing to move
            self.check_inputs(q, k, v, meta, cp_size=C, cp_rank=r)
            check_sinks(type(self).__name__, sinks, q.shape[1])
            return engine_attention(q, k, v, q_pos=meta.q_index, k_pos=meta.k_index, meta=meta, scale=scale,
                                    window=window, softcap=softcap, sinks=sinks)
        if meta.global_seq_len % (2 * C):
            raise ValueError(
                f"HeadTailStrategy: global sequence length {meta.global_seq_len} is not a multiple of "
                f"2*cp_size={2 * C} (batch policy {meta.policy!r}); shard the batch with policy='load_balance'"
            )
        self.check_inputs(q, k, v, meta, cp_size=C, cp_rank=r)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        k_all, v_all = flex_cp_allgather(k, v, 2, self.group)
        q_head, q_tail = head_tail_dispatch(q, self.group)
        sub = meta.global_seq_len // (2 * C)
        outs = []
        regather = (contextlib.nullcontext() if self.keep_gathered_kv
                    else regather_saved_kv((k, v), (k_all, v_all), regather_allgather(2, self.group)))
        with regather:
            for q_part, chunk in zip((q_head, q_tail), head_tail_sub_chunks(r, C)):
                q_pos = torch.arange(chunk * sub, (chunk + 1) * sub, dtype=torch.int64)
                # keys past the last query are invisible when causal, except the rest of a block (image)
                # the sub-chunk's queries belong to (meta.key_block)
                n_keys = meta.block_reach(chunk * sub, (chunk + 1) * sub) if meta.causal else meta.global_seq_len
                k_pos = torch.arange(n_keys, dtype=torch.int64)
                outs.append(engine_attention(q_part, k_all[:, :, :n_keys], v_all[:, :, :n_keys], q_pos=q_pos,
                                             k_pos=k_pos, meta=meta, scale=scale, window=window, softcap=softcap,
                                             sinks=sinks))
        return head_tail_combine(outs[0], outs[1], self.group)
