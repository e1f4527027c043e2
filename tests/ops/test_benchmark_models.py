"""The benchmarks' problem definitions and the fp32 ceiling model count what they claim to.

No timing here (timings live in benchmarks/); these check the query layouts and the visible
tile-pair count that benchmarks/attention_cpu_ceiling.py turns into FLOPs.
"""
import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
from attention_cpu import C, query_positions  # noqa: E402
from attention_cpu_ceiling import BK, visible_tile_pairs  # noqa: E402


def test_head_tail_layout_covers_every_position_once_and_balances_work():
    s_local = 16
    k_pos = torch.arange(C * s_local)
    chunks = [query_positions(s_local, r, "head_tail") for r in range(C)]
    assert torch.equal(torch.sort(torch.cat(chunks)).values, k_pos)
    for r, q in enumerate(chunks):  # chunks r and 2C-1-r of 2C half-size chunks
        h = s_local // 2
        assert q[:h].tolist() == list(range(r * h, (r + 1) * h))
        assert q[h:].tolist() == list(range((2 * C - 1 - r) * h, (2 * C - r) * h))
    visible = [int((k_pos[None, :] <= q[:, None]).sum()) for q in chunks]
    assert max(visible) == min(visible)  # Head-Tail: every rank the same causal work


def test_contiguous_layout_is_the_rank_chunk():
    assert query_positions(8, 2, "contiguous").tolist() == list(range(16, 24))


@pytest.mark.parametrize("s_local", [64, 128, 1024])
def test_visible_tile_pairs_matches_brute_force(s_local):
    r = C - 1
    q_pos = query_positions(s_local, r, "contiguous")
    k_pos = torch.arange(C * s_local)
    bq = min(64, s_local)
    vis = (k_pos[None, :] <= q_pos[:, None])  # [Sq, Sk] (small here)
    tiles = vis.view(s_local // bq, bq, C * s_local // BK, BK).any(3).any(1)
    got, total = visible_tile_pairs(s_local, r)
    assert got == int(tiles.sum())
    assert total == tiles.numel()
