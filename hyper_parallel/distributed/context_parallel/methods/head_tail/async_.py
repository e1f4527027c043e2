"""Head-Tail async comm plans: ``(forward_comm, backward_comm)`` pairs for
:class:`~...async_collectives.AsyncCollective`, run on the comm thread (docs/async_cp.md)."""
from __future__ import annotations

import torch

from ...async_collectives import comm_chain


def head_tail_q_plan(group) -> tuple:
    """Q ``[B, Hq, L, D]`` (sub-chunks 2r, 2r+1) -> Head-Tail dispatch -> ``cat(q_head, q_tail)``
    along the sequence (sub-chunks r and 2C-1-r, ``[B, Hq, L, D]``); bwd: the combine exchange
    (the inverse permutation) of ``(dq_head, dq_tail)``."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (comm_chain([lambda y: torch.cat(head_tail_dispatch(y, group), dim=2)], "async_head_tail_dispatch"),
            comm_chain([lambda g: head_tail_combine(*g.chunk(2, dim=2), group)], "async_head_tail_dispatch_bwd"))


def head_tail_out_plan(group) -> tuple:
    """Head-Tail output ``cat(o_head, o_tail)`` along the sequence (rows of sub-chunks r and
    2C-1-r, ``[B, Hq, 2m, D]``) -> the combine exchange -> ``cat(o_lo, o_hi)`` (the same rows of
    this rank's sub-chunks 2r, 2r+1); bwd: the dispatch exchange of the gradient. The inverse of
    :func:`head_tail_q_plan` (forward and backward swapped), used per pipelined query chunk."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (comm_chain([lambda y: head_tail_combine(*y.chunk(2, dim=2), group)], "async_head_tail_combine"),
            comm_chain([lambda g: torch.cat(head_tail_dispatch(g, group), dim=2)], "async_head_tail_combine_bwd"))


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Head-Tail: the K/V AllGather plus the query dispatch and the output combine."""
    from ...async_plan import AsyncPlan, group_of
    from ..colossal.async_ import colossal_kv_plan

    group = group_of(cp_mesh)
    kv = colossal_kv_plan(group)
    checker = strategy_cls(group)

    def check_meta(meta, owner: str) -> None:
        if meta.global_seq_len % (2 * checker.cp_size):
            raise ValueError(f"module '{owner}': global sequence length {meta.global_seq_len} is not a multiple of "
                             f"2*cp_size={2 * checker.cp_size}; shard the batch with policy='load_balance'")
    return AsyncPlan(method, {"k": kv, "v": kv, "q": head_tail_q_plan(group), "out": head_tail_out_plan(group)},
                     checker, group=group, attend=head_tail_attend, split_q=head_tail_split_q, check_meta=check_meta)


def head_tail_split_q(q: torch.Tensor, q_chunks: int) -> list:
    """The G query chunks of Head-Tail: the same rows of each of the two local sub-chunks (2r, 2r+1),
    concatenated ``[B, Hq, 2*L/(2G), D]``, so one dispatch per chunk carries both branches' rows
    (:func:`head_tail_q_plan`)."""
    from ...async_plan import q_chunk_count

    g = q_chunk_count(q.shape[2] // 2, q_chunks)
    lo, hi = q.chunk(2, dim=2)
    return [torch.cat([a, b], dim=2) for a, b in zip(lo.chunk(g, dim=2), hi.chunk(g, dim=2))]


def head_tail_attend(plan, c, q, k, v, meta, sinks, kw: dict, keep: bool) -> torch.Tensor:
    """Per query chunk (waited one by one): the head branch, then the tail, each on the key prefix it
    sees, then the chunk's combine launched; the outputs waited last and put back in this rank's
    sub-chunk order. One regather for all chunks (the branches save key prefixes, views of k / v)."""
    from ...async_collectives import trace_event
    from ...async_plan import chunk_name, trace_chunk
    from ..base import engine_attention
    from .collectives import head_tail_sub_chunks

    C, r = plan.checker.cp_size, plan.checker.cp_rank
    sub = meta.global_seq_len // (2 * C)
    rows = sub // len(c.q_parts)
    outs = []
    with c.regather("k", "v", (k, v), keep):
        for ci, (coll, tok) in enumerate(c.q_parts):
            q_c = coll.wait(tok)             # [B, Hq, 2*rows, D]: rows of the head, then the tail branch
            trace_chunk(q_c, ci)
            res = []
            # head branch first, then tail (the docstring of the Head-Tail entry point states this order)
            for q_part, chunk in zip(q_c.chunk(2, dim=2), head_tail_sub_chunks(r, C)):
                lo = chunk * sub + ci * rows
                q_pos = torch.arange(lo, lo + rows, dtype=torch.int64)
                # keys past the last query (but the rest of a block they belong to: meta.key_block)
                n_keys = meta.block_reach(lo, lo + rows) if meta.causal else meta.global_seq_len
                trace_event("compute", f"attention_chunk{chunk}")
                res.append(engine_attention(q_part, k[:, :, :n_keys], v[:, :, :n_keys], q_pos=q_pos,
                                            k_pos=torch.arange(n_keys, dtype=torch.int64), sinks=sinks, **kw))
            outs.append(c.launch(chunk_name("out", ci), c.plans["out"], torch.cat(res, dim=2)))
    got = [oc.wait(t) for oc, t in outs]     # each [B, Hq, 2*rows, D]: rows of sub-chunk 2r, then 2r+1
    return torch.cat([g[:, :, :rows] for g in got] + [g[:, :, rows:] for g in got], dim=2)
