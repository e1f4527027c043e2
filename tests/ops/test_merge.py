"""merge_partial_attention: combining engine results over disjoint key sets (ring / split-K)."""
from __future__ import annotations

import math

import torch

from hyper_parallel.ops import attention, merge_partial_attention, reference_attention

from ._parity import TOL, error


def test_merge_two_key_halves_matches_full_attention():
    g = torch.Generator().manual_seed(0)
    S = 192
    q_pos, k_pos = torch.arange(64, 192), torch.arange(S)
    q = torch.randn(1, 4, 128, 32, generator=g, requires_grad=True)
    k = torch.randn(1, 2, S, 32, generator=g, requires_grad=True)
    v = torch.randn(1, 2, S, 32, generator=g, requires_grad=True)
    # zigzag-ish split of the keys: the second part is invisible to the first queries
    parts = [torch.arange(0, 100), torch.arange(100, S)]
    outs = [attention(q, k[:, :, p], v[:, :, p], q_pos=q_pos, k_pos=k_pos[p], return_lse=True)
            for p in parts]
    out, lse = merge_partial_attention(outs[0][0], outs[0][1], outs[1][0], outs[1][1])
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    rout, rlse = reference_attention(qr, kr, vr, q_pos=q_pos, k_pos=k_pos, return_lse=True)
    dout = torch.randn(rout.shape, generator=g, dtype=torch.float64)
    ((out.double() * dout).sum() + lse.double().sum()).backward()
    ((rout * dout).sum() + rlse.sum()).backward()
    tol = TOL[torch.float32]
    errs = {n: error(a, b) for n, a, b in [("out", out, rout), ("lse", lse, rlse),
                                           ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                                           ("dv", v.grad, vr.grad)]}
    print("[parity merge float32 tol=%.0e] " % tol
          + " ".join(f"{n}: abs={a:.2e} rel={r:.2e}" for n, (a, r) in errs.items()))
    assert all(r <= tol for _, r in errs.values()), errs


def test_merge_handles_minus_inf_on_either_and_both_sides():
    out_a = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    out_b = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    ninf = -math.inf
    lse_a = torch.tensor([[[0.5, ninf, ninf, 2.0]]], dtype=torch.float64)
    lse_b = torch.tensor([[[ninf, 1.0, ninf, -1.0]]], dtype=torch.float64)
    out_a[0, 0, 1:3] = 0
    out_b[0, 0, [0, 2]] = 0
    leaves = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_partial_attention(*leaves)
    assert torch.allclose(out[0, 0, 0], out_a[0, 0, 0]) and lse[0, 0, 0] == 0.5
    assert torch.allclose(out[0, 0, 1], out_b[0, 0, 1]) and lse[0, 0, 1] == 1.0
    assert torch.all(out[0, 0, 2] == 0) and lse[0, 0, 2] == ninf
    assert torch.isclose(lse[0, 0, 3], torch.logaddexp(lse_a[0, 0, 3], lse_b[0, 0, 3]))
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in leaves:
        assert not torch.isnan(t.grad).any()
    assert torch.all(lse_a.grad[0, 0, 1:3] == 0) and torch.all(out_a.grad[0, 0, 1:3] == 0)


def test_merge_gradcheck():
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(1, 2, 3, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(1, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(merge_partial_attention, args)
