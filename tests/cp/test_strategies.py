"""Forward and dq/dk/dv parity of every sync strategy with the single-rank engine (fp32, gloo).

Tolerance: |cp - ref| <= 2e-5 + 1e-4 * |ref| elementwise (common.ATOL / RTOL); every run prints
the worst max abs / rel error per field; a failure reports them per scenario and field.
"""
import pytest

from hyper_parallel.distributed.context_parallel.strategies import (AllGatherStrategy, HeadTailStrategy,
                                                                   HybridStrategy, UlyssesStrategy,
                                                                   build_strategy)
from tests.cp.common import ATOL, RTOL, SCENARIOS, fmt, mesh_ctx, parity, sub_group3


def report(label: str, per_rank_rows) -> None:
    """Print the worst max abs / max rel error per field over ranks and scenarios (every run)."""
    worst: dict = {}
    for rows in per_rank_rows:
        for _, field, a, r, _ in rows:
            wa, wr = worst.get(field, (0.0, 0.0))
            worst[field] = (max(wa, a), max(wr, r))
    for field, (a, r) in worst.items():
        print(f"{label} {field}: max abs {a:.2e} rel {r:.2e} (tol {ATOL:g} + {RTOL:g} * |ref|)")


def run_parity(method, cp, u, Hq, Hk):
    ctx = mesh_ctx(cp, (u,) if method == "hybrid" else ())
    strategy = build_strategy(method, ctx, ulysses_degree=u)
    expect = {"colossal": AllGatherStrategy, "ulysses": UlyssesStrategy, "hybrid": HybridStrategy,
              "load_balance": HeadTailStrategy}[method]
    assert type(strategy) is expect
    rows = []
    for sc in SCENARIOS:
        rows += parity(strategy, ctx.cp_mesh, sc, Hq=Hq, Hk=Hk)
    return rows


CASES = [
    # method, cp, ulysses_degree, Hq, Hk
    ("colossal", 2, None, 4, 2), ("colossal", 4, None, 4, 2), ("colossal", 4, None, 4, 1),
    ("colossal", 2, None, 4, 4),
    ("ulysses", 2, None, 4, 2), ("ulysses", 4, None, 8, 4),
    ("hybrid", 4, 2, 4, 2), ("hybrid", 8, 2, 4, 2), ("hybrid", 8, 4, 8, 4),
    ("load_balance", 2, None, 4, 2), ("load_balance", 4, None, 4, 1), ("load_balance", 8, None, 2, 2),
]


@pytest.mark.parametrize("method,cp,u,hq,hk", CASES, ids=[f"{m}-cp{c}-u{u}-hq{a}-hk{b}" for m, c, u, a, b in CASES])
def test_parity(ranks, method, cp, u, hq, hk):
    res = ranks(cp).run(run_parity, method, cp, u, hq, hk, timeout=180)
    report(f"{method} cp{cp} u{u} hq{hq} hk{hk}", res)
    for r, rows in enumerate(res):
        assert all(ok for *_, ok in rows), f"rank {r}: {fmt(rows)}"


def run_head_tail_odd():
    """Head-Tail on a 3-rank subgroup of the 4-rank world (odd C: two sub-chunks per peer slot)."""
    group = sub_group3()
    if group is None:
        return []
    strategy = HeadTailStrategy(group)
    rows = []
    for sc in ("causal", "packed", "padding"):
        rows += parity(strategy, group, sc, Hq=4, Hk=2)
    return rows


def test_head_tail_odd_cp3(ranks):
    res = ranks(4).run(run_head_tail_odd)
    report("head_tail cp3", res[:3])
    for r, rows in enumerate(res[:3]):
        assert rows and all(ok for *_, ok in rows), f"rank {r}: {fmt(rows)}"
