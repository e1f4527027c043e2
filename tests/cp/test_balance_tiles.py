"""The balancer's engine-tile cost (``balance/tiles.py``) against a brute-force replay of the CPU
engine's tile classification (``csrc/attention/kernel_impl.h`` ``classify``) on packed rows with
padding, for every attention kind; and the balanced split's tile spread on the main job's rows."""
from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.distributed.context_parallel.balance.cost import AttentionKind, AttentionProfile, rank_work, spread
from hyper_parallel.distributed.context_parallel.balance.solver import solve
from hyper_parallel.distributed.context_parallel.balance.tiles import block_tiles


def _engine_ids(d: np.ndarray, chunk) -> np.ndarray:
    """Doc ids as the strategies hand them to the engine: runs numbered; chunked: refined by chunk."""
    out, run, start = np.full(d.size, -1), -1, 0
    for i in range(d.size):
        if i == 0 or d[i] != d[i - 1]:
            run, start = run + 1, i
        if d[i] >= 0:
            out[i] = run * 10 ** 6 + ((i - start) // chunk if chunk else 0)
    return out


def _brute(d: np.ndarray, tile: int, kind: AttentionKind) -> np.ndarray:
    ids = _engine_ids(d, kind.size if kind.kind == "chunked" else None).reshape(-1, tile)
    pos = np.arange(d.size).reshape(-1, tile)
    out = np.zeros(ids.shape[0])
    for qi in range(ids.shape[0]):
        for ki in range(ids.shape[0]):
            qr, kr = ids[qi] >= 0, ids[ki] >= 0
            if not qr.any() or not kr.any():
                continue
            qp, kp, qd, kd = pos[qi][qr], pos[ki][kr], ids[qi][qr], ids[ki][kr]
            if kind.kind != "bidirectional" and kp.min() > qp.max():
                continue
            if kind.kind == "window" and kp.max() + kind.size <= qp.min():
                continue
            if kd.max() < qd.min() or qd.max() < kd.min():
                continue
            out[qi] += kind.layers
    return out


KINDS = [AttentionKind("causal"), AttentionKind("window", 5), AttentionKind("window", 23, 2),
         AttentionKind("chunked", 7), AttentionKind("bidirectional")]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k.kind}{k.size or ''}x{k.layers}")
def test_block_tiles_replays_the_engine_classification(kind):
    rng = np.random.default_rng(5)
    worst = 0.0
    for _ in range(25):
        S, tile = 8 * int(rng.integers(2, 16)), 8
        d, pos, i = np.full(S, -1), int(rng.integers(0, 4)), 0
        while pos < S:
            n = int(rng.integers(1, 30))
            d[pos:pos + n] = i
            i += 1
            pos += n + (int(rng.integers(0, 6)) if rng.random() < 0.3 else 0)
        got = block_tiles(d, tile, AttentionProfile((kind,)))
        worst = max(worst, float(np.abs(got - _brute(d, tile, kind)).max()))
    print(f"{kind}: max abs error {worst} tiles (tolerance 0: exact counts)")
    assert worst == 0


def test_balanced_split_on_tiles_evens_the_engine_tiles():
    """Solving on tiles gives every rank the same engine tiles (<= 1.005) where solving on visible
    pairs leaves the blocks that straddle documents uneven."""
    from hyper_parallel.distributed.context_parallel.balance.cost import block_work

    rng = np.random.default_rng(0)
    for S, cp in ((32768, 4), (8192, 2)):
        for _ in range(4):
            lens, tot = [], 0
            while tot < S:
                lens.append(int(min(np.exp(rng.normal(8.0, 1.0)), S - tot)))
                tot += lens[-1]
            d = np.repeat(np.arange(len(lens)), lens)
            tiles = block_tiles(d, 64)
            on_tiles = spread(rank_work(tiles, solve(tiles, cp), cp))
            print(f"S={S} cp={cp} docs={len(lens)}: tile spread solved on tiles {on_tiles:.4f}")
            assert on_tiles <= 1.005
            assert spread(rank_work(block_work(d, 64), solve(tiles, cp), cp)) <= 1.05
