"""Bytes moved by each strategy (platform comm_counter) == the formulas in docs/strategies/*.md."""
import os
import re

import pytest
import torch

from hyper_parallel import platform as P
from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
from hyper_parallel.distributed.context_parallel.strategies import build_strategy
from hyper_parallel.distributed.context_parallel.methods.ulysses.layout import ulysses_head_layout
from tests.cp.common import mesh_ctx, sub_group3

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "docs", "strategies")
PAGES = {"colossal": "colossal.md", "ulysses": "ulysses.md", "hybrid": "hybrid.md", "load_balance": "head_tail.md",
         "balanced": "load_balance_packed.md"}
KEYS = ("forward_sent", "forward_received", "backward_sent", "backward_received")


def doc_formulas(page: str) -> dict:
    text = open(os.path.join(DOCS, page)).read()
    block = re.search(r"```volume\n(.*?)```", text, re.S)
    assert block, f"{page} has no ```volume block"
    out = dict(line.split(" = ", 1) for line in block.group(1).strip().splitlines())
    assert set(out) == set(KEYS), f"{page}: {sorted(out)}"
    return out


def measure(cp, plans):
    """plans: [(method, u, B, S, Hq, Hk, D, dtype_name)] -> measured (fwd sent, recv, bwd sent, recv)."""
    degrees = tuple(sorted({u for m, u, *_ in plans if m == "hybrid"}))
    ctx = mesh_ctx(cp, degrees)
    out = []
    for method, u, B, S, Hq, Hk, D, dt in plans:
        strategy = build_strategy(method, ctx, ulysses_degree=u)
        dtype = getattr(torch, dt)
        L = S // cp
        meta = CPBatchMeta(cp_rank=ctx.cp_rank, cp_size=cp, global_seq_len=S, local_seq_len=L, key_doc=None,
                           policy=strategy.name, perm=torch.arange(S).flip(0) if method == "balanced" else None)
        g = torch.Generator().manual_seed(ctx.cp_rank)
        q = torch.randn(B, Hq, L, D, generator=g).to(dtype).requires_grad_(True)
        k = torch.randn(B, Hk, L, D, generator=g).to(dtype).requires_grad_(True)
        v = torch.randn(B, Hk, L, D, generator=g).to(dtype).requires_grad_(True)
        with P.comm_counter() as fwd:
            o = strategy.attention(q, k, v, meta=meta)
        with P.comm_counter() as bwd:
            o.backward(torch.ones_like(o))
        out.append(tuple(sum(getattr(c, f) for c in recs) for recs in (fwd, bwd)
                         for f in ("bytes_sent", "bytes_received")))
    return out


PLANS = {
    2: [("colossal", None, 2, 16, 4, 2, 8, "float32"), ("ulysses", None, 1, 8, 4, 2, 4, "float32"),
        ("ulysses", None, 1, 8, 3, 1, 4, "float32"),                        # MQA, uneven 2/1
        ("load_balance", None, 2, 16, 4, 1, 8, "float32"), ("colossal", None, 1, 8, 2, 2, 4, "float64"),
        ("balanced", None, 2, 16, 4, 2, 8, "float32")],
    4: [("colossal", None, 2, 32, 4, 2, 8, "float32"), ("ulysses", None, 2, 16, 8, 4, 4, "float32"),
        ("hybrid", 2, 2, 32, 4, 2, 8, "float32"), ("load_balance", None, 1, 32, 4, 2, 4, "float32"),
        ("load_balance", None, 1, 16, 2, 2, 4, "float64"),
        ("ulysses", None, 1, 16, 4, 1, 4, "float32"), ("ulysses", None, 2, 16, 6, 2, 4, "float32"),  # MQA; uneven
        ("hybrid", 2, 1, 32, 3, 1, 4, "float32"),                          # Hybrid sub-group: MQA, uneven
        ("balanced", None, 1, 32, 4, 1, 4, "float32")],
    8: [("hybrid", 2, 1, 32, 4, 2, 4, "float32"), ("hybrid", 4, 1, 32, 8, 4, 4, "float32"),
        ("load_balance", None, 1, 32, 2, 1, 4, "float32")],
}


@pytest.mark.parametrize("cp", sorted(PLANS))
def test_comm_volume_matches_docs(ranks, cp):
    res = ranks(cp).run(measure, cp, PLANS[cp], timeout=180)
    for plan, *per_rank in zip(PLANS[cp], *res):
        method, u, B, S, Hq, Hk, D, dt = plan
        env = dict(B=B, S=S, Hq=Hq, Hk=Hk, D=D, C=cp, U=u or 1, e=torch.tensor([], dtype=getattr(torch, dt)).element_size())
        if method in ("ulysses", "hybrid"):      # per-rank heads of the Ulysses layout (docs/strategies/ulysses.md)
            lay = ulysses_head_layout(Hq, Hk, u or cp)
            env.update(nq=list(lay.q_counts), nk=list(lay.kv_counts), NK=lay.kv_copies)
        formulas = doc_formulas(PAGES[method])
        for r, got in enumerate(per_rank):  # r: this rank's cp rank (formulas may depend on it)
            expect = tuple(eval(formulas[key], {"__builtins__": {}}, {**env, "r": r}) for key in KEYS)  # noqa: S307
            assert expect[0] > 0
            assert got == expect, f"{plan} rank {r}: measured {got} != docs {expect} ({formulas})"


def measure_odd(B, S, Hq, Hk, D):
    """Head-Tail on the 3-rank subgroup (odd C) of the 4-rank world."""
    group = sub_group3()
    if group is None:
        return None
    from hyper_parallel.distributed.context_parallel.strategies import HeadTailStrategy
    strategy, C = HeadTailStrategy(group), 3
    meta = CPBatchMeta(cp_rank=strategy.cp_rank, cp_size=C, global_seq_len=S, local_seq_len=S // C,
                       key_doc=None, policy="load_balance")
    q, k, v = (torch.randn(B, h, S // C, D, requires_grad=True) for h in (Hq, Hk, Hk))
    with P.comm_counter() as fwd:
        o = strategy.attention(q, k, v, meta=meta)
    with P.comm_counter() as bwd:
        o.sum().backward()
    return tuple(sum(getattr(c, f) for c in recs) for recs in (fwd, bwd) for f in ("bytes_sent", "bytes_received"))


def test_head_tail_odd_cp_volume_matches_docs(ranks):
    B, S, Hq, Hk, D = 1, 24, 4, 2, 4
    res = ranks(4).run(measure_odd, B, S, Hq, Hk, D)
    formulas = doc_formulas("head_tail.md")
    env = dict(B=B, S=S, Hq=Hq, Hk=Hk, D=D, C=3, e=4)
    for r, got in enumerate(res[:3]):
        expect = tuple(eval(formulas[key], {"__builtins__": {}}, {**env, "r": r}) for key in KEYS)  # noqa: S307
        assert got == expect, f"rank {r}: measured {got} != docs {expect}"
