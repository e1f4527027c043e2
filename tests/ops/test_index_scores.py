"""The engine's lightning-indexer scores (csrc/indexer/index_scores.cpp, ``ops.index_scores``):
the DSA formula against a float64 reference on fresh random data, and the property DSA's CP relies
on — a (query, key) pair's score is the same bits whatever the call's queries and keys (every CP
rank's local queries against the same global key blocks, CP=1 all queries)."""
from __future__ import annotations

import pytest
import torch

from hyper_parallel.ops.index_scores import index_scores

TOL = 1e-5       # fp32 accumulation of H*D products, relative to the largest |score|


def _inputs(B=2, L=37, H=5, D=24, n=41, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=g).to(dtype)
    w = torch.randn(B, L, H, generator=g).to(dtype)
    k = torch.randn(B, n, D, generator=g).to(dtype)
    return q, w, k


def _reference(q, w, k, scale):
    d = torch.einsum("blhd,bnd->blhn", q.double(), k.double()) * scale
    return torch.einsum("blh,blhn->bln", w.double(), torch.relu(d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_match_the_float64_formula(dtype):
    q, w, k = _inputs(dtype=dtype)
    got = index_scores(q, w, k, 0.37)
    ref = _reference(q, w, k, 0.37)
    err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
    print(f"{dtype}: max rel err {err:.2e} (tol {TOL:g})")
    assert got.dtype == torch.float32 and got.shape == (2, 37, 41) and err <= TOL


def test_a_pair_scores_the_same_bits_in_any_call():
    q, w, k = _inputs(L=64, n=96, seed=3)
    full = index_scores(q, w, k, 0.5)
    for q0, q1, k0, k1 in ((0, 32, 0, 96), (32, 64, 0, 96), (5, 6, 40, 41), (0, 64, 32, 64), (17, 50, 7, 90)):
        part = index_scores(q[:, q0:q1], w[:, q0:q1], k[:, k0:k1], 0.5)
        assert torch.equal(part, full[:, q0:q1, k0:k1]), (q0, q1, k0, k1)
    one = index_scores(q[1:], w[1:], k[1:], 0.5)           # another batch size
    assert torch.equal(one, full[1:])


def test_nan_propagates_and_bad_calls_are_refused():
    q, w, k = _inputs(B=1, L=3, H=2, D=4, n=5)
    q[0, 1, 0, 2] = float("nan")
    got = index_scores(q, w, k, 1.0)
    assert torch.isnan(got[0, 1]).all() and not torch.isnan(got[0, [0, 2]]).any()
    with pytest.raises(RuntimeError, match="shapes disagree"):
        index_scores(q, w, k[..., :3], 1.0)
    with pytest.raises(ValueError, match="no backward"):
        index_scores(q.requires_grad_(), w, k, 1.0)
