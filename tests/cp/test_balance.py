"""Balanced split of packed rows: the cost model against a brute-force pair count, the solver's
contract (equal tokens per rank, a permutation, deterministic) and its balance on packed rows."""
from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.distributed.context_parallel.balance.cost import (CAUSAL, AttentionKind, AttentionProfile,
                                                                      block_work, rank_work, spread)
from hyper_parallel.distributed.context_parallel.balance.solver import inverse, solve, token_permutation

PROFILES = {
    "causal": CAUSAL,
    "window": AttentionProfile((AttentionKind("window", 5),)),
    "mixed": AttentionProfile((AttentionKind("window", 3, 2), AttentionKind("causal", None, 1),
                               AttentionKind("chunked", 7, 1), AttentionKind("bidirectional", None, 1))),
}


def _brute(doc: np.ndarray, block: int, profile: AttentionProfile) -> np.ndarray:
    S = doc.size
    q, k = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    same = (doc[q] == doc[k]) & (doc[q] >= 0)
    start = np.array([np.flatnonzero(doc == d)[0] if d >= 0 else 0 for d in doc])
    vis = np.zeros((S, S))
    for kind in profile.kinds:
        if kind.kind == "causal":
            m = k <= q
        elif kind.kind == "window":
            m = (k <= q) & (k > q - kind.size)
        elif kind.kind == "chunked":
            m = (k <= q) & ((q - start[q]) // kind.size == (k - start[q]) // kind.size)
        else:
            m = np.ones_like(same)
        vis += kind.layers * (same & m)
    return vis.sum(axis=1).reshape(-1, block).sum(axis=1)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_block_work_is_the_visible_pair_count(name):
    rng = np.random.default_rng(3)
    doc = np.full((2, 96), -1)
    for row in range(2):
        pos = 0
        for i, n in enumerate(rng.integers(1, 30, size=6)):
            doc[row, pos:pos + n] = i
            pos += int(n) + int(rng.integers(0, 3))
            if pos >= 96:
                doc[row, 96 - 1] = -1
                break
    got = block_work(doc, 8, PROFILES[name])
    want = sum(_brute(doc[r], 8, PROFILES[name]) for r in range(2))
    err = np.abs(got - want).max()
    print(f"{name}: max abs error {err} (tolerance 0: exact counts)")
    assert err == 0


def _packed_row(rng, S: int) -> list:
    lens, tot = [], 0
    while tot < S:
        n = int(min(rng.lognormal(7.5, 1.3) + 1, S - tot))
        lens.append(n)
        tot += n
    return lens


def test_solver_contract_and_determinism():
    rng = np.random.default_rng(0)
    work = rng.random(64) ** 3
    a, b = solve(work, 4), solve(work.copy(), 4)
    assert np.array_equal(a, b)
    assert sorted(a.tolist()) == list(range(64))
    for r in range(4):
        assert list(a[r * 16:(r + 1) * 16]) == sorted(a[r * 16:(r + 1) * 16])
    perm = token_permutation(a, 8)
    inv = inverse(perm)
    assert np.array_equal(perm[inv], np.arange(512)) and np.array_equal(inv[perm], np.arange(512))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        solve(work[:63], 4)


@pytest.mark.parametrize("cp", [4, 16])
def test_solver_balances_packed_rows(cp):
    """The issue's targets (p90 slowest/mean <= 1.01 causal, <= 1.05 window / mixed) at 32k rows."""
    rng = np.random.default_rng(1)
    profiles = {"causal": (CAUSAL, 1.01), "window": (AttentionProfile((AttentionKind("window", 4096),)), 1.05),
                "mixed": (AttentionProfile((AttentionKind("window", 4096), AttentionKind("causal"))), 1.05)}
    for name, (profile, limit) in profiles.items():
        spreads, contiguous = [], []
        for _ in range(10):
            work = block_work(None, 64, profile, lengths=_packed_row(rng, 32768))
            spreads.append(spread(rank_work(work, solve(work, cp), cp)))
            contiguous.append(spread(rank_work(work, np.arange(work.size), cp)))
        p90 = float(np.percentile(spreads, 90))
        print(f"cp {cp} {name}: balanced p90 {p90:.4f} (limit {limit}), contiguous p90 "
              f"{np.percentile(contiguous, 90):.3f}")
        assert p90 <= limit
