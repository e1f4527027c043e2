"""Engine inputs beyond causal + documents: sliding window, softcap, sinks, value head dim.

Every parity case runs the engine (forward + backward, through ``lse`` too) against the float64
``reference_attention`` and prints ``max abs`` / ``rel`` per tensor with the tolerance
(``pytest tests/ops/test_attention_features.py -s`` shows the lines).
"""
from __future__ import annotations

import math

import pytest
import torch

from hyper_parallel.ops import attention, merge_partial_attention, reference_attention
from hyper_parallel.ops.reference import visibility

from ._parity import TOL, Case, error, make_inputs, run_parity, use_isa_or_skip

ar = torch.arange


def packed_docs(lengths, pad: int) -> torch.Tensor:
    ids = [torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)]
    return torch.cat(ids + [torch.full((pad,), -1, dtype=torch.long)])


# ------------------------------------------------------------------------------------------
# sliding window: the definition is transformers'
@pytest.mark.parametrize("window", [1, 3, 16, 64, 1000])
def test_window_visibility_is_transformers_sliding_window(window):
    """``window`` is exactly transformers.masking_utils' sliding window (causal and overlay)."""
    mu = pytest.importorskip("transformers.masking_utils")
    S = 150
    qi = ar(S)[:, None]
    ki = ar(S)[None, :]
    b = torch.zeros((), dtype=torch.long)
    hf_causal = mu.sliding_window_causal_mask_function(window)(b, b, qi, ki)
    hf_overlay = mu.sliding_window_overlay(window)(b, b, qi, ki)
    ours_causal = visibility(ar(S), ar(S), True, window=window)[0, 0]
    ours_overlay = visibility(ar(S), ar(S), False, window=window)[0, 0]
    assert torch.equal(hf_causal, ours_causal)
    assert torch.equal(hf_overlay, ours_overlay)

    # and the engine computes exactly that mask (dense float64 softmax with transformers' mask)
    g = torch.Generator().manual_seed(window)
    q = torch.randn(1, 2, S, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, S, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, S, 16, generator=g, dtype=torch.float64)
    s = (q @ k.transpose(-1, -2)) / 4.0
    s = s.masked_fill(~hf_causal, -math.inf)
    dense = torch.softmax(s, -1) @ v
    for dtype in (torch.float64, torch.float32):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=ar(S), k_pos=ar(S),
                        window=window)
        a, r = error(out, dense)
        print(f"[window={window} vs transformers mask {dtype} tol={TOL[dtype]:g}] "
              f"abs={a:.2e} rel={r:.2e}")
        assert r <= TOL[dtype]


_LAYOUTS = {
    "offset": dict(q_pos=ar(192, 320), k_pos=ar(320)),
    "zigzag": dict(q_pos=torch.cat([ar(0, 40), ar(280, 320)]), k_pos=ar(320)),
    "docs+pad": dict(q_pos=ar(100, 220), k_pos=ar(220),
                     q_doc=packed_docs([50, 7, 110, 33], pad=20)[100:],
                     k_doc=packed_docs([50, 7, 110, 33], pad=20)),
    "non-causal": dict(q_pos=ar(70, 147), k_pos=ar(211), causal=False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("window", [1, 5, 64, 100, 4096])
def test_window_parity(window, layout, dtype):
    run_parity(Case(window=window, Hq=4, Hk=2, D=72, dtype=dtype, seed=window,
                    **_LAYOUTS[layout]), f"window={window} {layout}")


def test_window_per_batch_positions():
    B, S = 2, 130
    docs = torch.stack([packed_docs([60, 70], 0), packed_docs([10, 100], 20)])
    pos = torch.stack([ar(S), ar(S) + 7])
    run_parity(Case(B=B, q_pos=pos[:, 65:], k_pos=pos, q_doc=docs[:, 65:], k_doc=docs,
                    Hq=2, Hk=1, D=32, window=20, seed=3), "window per-batch")


# ------------------------------------------------------------------------------------------
# softcap
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap_parity(softcap, layout, dtype):
    # larger scale so that the cap actually bends scores (|s| up to ~3-8)
    run_parity(Case(softcap=softcap, Hq=4, Hk=1, D=48, dtype=dtype, scale=0.5, seed=7,
                    **_LAYOUTS[layout]), f"softcap={softcap} {layout}")


def test_softcap_matches_gemma2_eager():
    """softcap is applied after scaling, before the mask, as transformers' Gemma2 eager does."""
    g2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    g = torch.Generator().manual_seed(5)
    B, Hq, Hk, S, D = 1, 4, 2, 40, 16
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(
        ~visibility(ar(S), ar(S), True, window=9)[0], -math.inf)

    class M(torch.nn.Module):
        num_key_value_groups = Hq // Hk
        training = False

    ref, _ = g2.eager_attention_forward(M(), q, k, v, mask, scaling=0.3, softcap=7.0)
    for dtype in (torch.float64, torch.float32):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=ar(S), k_pos=ar(S),
                        scale=0.3, softcap=7.0, window=9)
        a, r = error(out.transpose(1, 2), ref)
        tol = TOL[torch.float32]  # Gemma2's eager softmax runs in float32 even for fp64 inputs
        print(f"[softcap vs gemma2 eager {dtype} tol={tol:g}] abs={a:.2e} rel={r:.2e}")
        assert r <= tol


# ------------------------------------------------------------------------------------------
# sinks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("extra", [dict(), dict(window=33), dict(window=7, softcap=3.0)])
def test_sinks_parity(extra, layout, dtype):
    run_parity(Case(sinks=True, Hq=4, Hk=2, D=40, dtype=dtype, seed=21, **extra,
                    **_LAYOUTS[layout]), f"sinks {extra} {layout}")


def test_sinks_match_gpt_oss_eager():
    """Same as transformers' gpt-oss eager attention (s_aux joins the softmax, then dropped)."""
    go = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    g = torch.Generator().manual_seed(8)
    B, Hq, Hk, S, D = 2, 4, 2, 50, 16
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64) * 2
    mask = torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(
        ~visibility(ar(S), ar(S), True, window=16, batch=B), -math.inf)

    class M(torch.nn.Module):
        num_key_value_groups = Hq // Hk
        training = False

    m = M()
    m.sinks = sinks
    ref, _ = go.eager_attention_forward(m, q, k, v, mask, scaling=0.25)
    for dtype in (torch.float64, torch.float32):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=ar(S), k_pos=ar(S),
                        scale=0.25, window=16, sinks=sinks.to(dtype))
        a, r = error(out.transpose(1, 2), ref)
        print(f"[sinks vs gpt-oss eager {dtype} tol={TOL[dtype]:g}] abs={a:.2e} rel={r:.2e}")
        assert r <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sinks_two_partial_merge_is_exact(dtype):
    """lse includes the sink: passing sinks to exactly one of two partials over disjoint key
    sets and merging with merge_partial_attention equals attention over all keys with sinks
    (values and gradients, the sink gradient included)."""
    g = torch.Generator().manual_seed(31)
    Hq, Hk, Sk = 4, 2, 160
    q0 = torch.randn(1, Hq, 64, 32, generator=g, dtype=torch.float64).to(dtype)
    k0 = torch.randn(1, Hk, Sk, 32, generator=g, dtype=torch.float64).to(dtype)
    v0 = torch.randn(1, Hk, Sk, 32, generator=g, dtype=torch.float64).to(dtype)
    s0 = (torch.randn(Hq, generator=g, dtype=torch.float64) * 2).to(dtype)
    dout = torch.randn(1, Hq, 64, 32, generator=g, dtype=torch.float64).to(dtype)
    q_pos, k_pos = ar(96, 160), ar(Sk)
    perm = torch.randperm(Sk, generator=g)  # two disjoint, interleaved key sets
    ia, ib = perm[:70].sort().values, perm[70:].sort().values

    def grads(fn):
        q, k, v, s = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
        out, lse = fn(q, k, v, s)
        ((out * dout).sum() + lse.sum() * 0.3).backward()
        return [out, lse, q.grad, k.grad, v.grad, s.grad]

    def full(q, k, v, s):
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, sinks=s, window=40,
                         return_lse=True)

    def merged(q, k, v, s):
        a = attention(q, k[:, :, ia], v[:, :, ia], q_pos=q_pos, k_pos=k_pos[ia], sinks=s,
                      window=40, return_lse=True)
        b = attention(q, k[:, :, ib], v[:, :, ib], q_pos=q_pos, k_pos=k_pos[ib], window=40,
                      return_lse=True)
        return merge_partial_attention(*a, *b)

    tol = TOL[dtype]
    for name, x, y in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], grads(full), grads(merged)):
        a, r = error(y, x)
        print(f"[sinks 2-partial merge {dtype} {name} tol={tol:g}] abs={a:.2e} rel={r:.2e}")
        assert r <= tol


def test_sinks_empty_rows():
    """A row that sees no key: out = 0, lse = sink; the sink still gets its lse gradient."""
    q = torch.randn(1, 2, 3, 8)
    k, v = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    s = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = attention(q, k, v, q_pos=torch.tensor([0, 1, 2]), k_pos=ar(10, 15), sinks=s,
                         return_lse=True)
    assert torch.all(out == 0)
    assert torch.equal(lse, s.detach().view(1, 2, 1).expand(1, 2, 3))
    lse.sum().backward()
    assert torch.equal(s.grad, torch.tensor([3.0, 3.0]))
    s.grad = None
    out, lse = attention(q, k[:, :, :0], v[:, :, :0], q_pos=ar(3), k_pos=ar(0), sinks=s,
                         return_lse=True)
    assert torch.all(out == 0) and torch.equal(lse[0, :, 0], s.detach())
    (lse.sum() + out.sum()).backward()
    assert torch.equal(s.grad, torch.tensor([3.0, 3.0]))


# ------------------------------------------------------------------------------------------
# value head dim != qk head dim (MLA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("D,Dv", [(192, 128), (48, 80), (33, 7), (64, 16)])
def test_value_head_dim_parity(D, Dv, layout, dtype):
    run_parity(Case(D=D, Dv=Dv, Hq=4, Hk=1, dtype=dtype, seed=D + Dv, **_LAYOUTS[layout]),
               f"D={D} Dv={Dv} {layout}")


@pytest.mark.parametrize("Sq,Sk", [(1, 70), (5, 100), (77, 131), (64, 128)])
def test_value_head_dim_odd_sizes_all_features(Sq, Sk):
    for dtype in (torch.float32, torch.bfloat16):
        run_parity(Case(q_pos=ar(Sk - Sq, Sk), k_pos=ar(Sk), D=40, Dv=24, Hq=6, Hk=2,
                        dtype=dtype, window=23, softcap=4.0, sinks=True, scale=0.4,
                        seed=Sq * Sk), f"all features Sq={Sq} Sk={Sk} D=40 Dv=24")


def test_value_head_dim_gradcheck():
    q, k, v = _gc_inputs(Dv=5)
    sinks = torch.tensor([0.3, -0.5, 1.2, 0.0], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, s):
        return attention(q, k, v, **_GC_POS, scale=0.9, return_lse=True, sinks=s, window=4,
                         softcap=2.0)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_value_head_dim_validation():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="v must have k's shape"):
        attention(q, k, torch.randn(1, 1, 5, 8), q_pos=ar(4), k_pos=ar(6))
    out = attention(q, k, torch.randn(1, 1, 6, 3), q_pos=ar(4), k_pos=ar(6))
    assert out.shape == (1, 2, 4, 3)


# ------------------------------------------------------------------------------------------
# gradcheck of the new backward terms (float64, tiny shapes)
def _gc_inputs(Dv=8, seed=13):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


_GC_POS = dict(q_pos=torch.tensor([3, 4, 5, 6, 7, 8]), k_pos=ar(9),
               q_doc=torch.tensor([0, 0, 1, 1, 1, 1]),
               k_doc=torch.tensor([0, 0, 0, 0, 1, 1, -1, 1, 1]))


@pytest.mark.parametrize("opts", [dict(window=2), dict(softcap=0.7),
                                  dict(window=3, softcap=1.5, causal=False)])
def test_gradcheck_window_softcap(opts):
    q, k, v = _gc_inputs()

    def f(q, k, v):
        return attention(q, k, v, **_GC_POS, scale=0.9, return_lse=True, **opts)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("opts", [dict(), dict(window=3, softcap=1.1)])
def test_gradcheck_sinks(opts):
    q, k, v = _gc_inputs()
    sinks = torch.tensor([0.3, -0.5, 1.2, 0.0], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, s):
        return attention(q, k, v, **_GC_POS, scale=0.9, return_lse=True, sinks=s, **opts)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_compile_and_opcheck_with_features():
    torch._dynamo.reset()
    q_pos, k_pos = ar(16, 48), ar(48)
    sinks = torch.randn(4, requires_grad=True)

    def f(q, k, v, s):
        out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, return_lse=True, window=8,
                             softcap=5.0, sinks=s)
        return out * 2, lse

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    q = torch.randn(1, 4, 32, 16, requires_grad=True)
    k = torch.randn(1, 2, 48, 16, requires_grad=True)
    v = torch.randn(1, 2, 48, 16, requires_grad=True)
    out, lse = cf(q, k, v, sinks)
    ref_out, ref_lse = f(q, k, v, sinks)
    assert torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse)
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    torch.library.opcheck(torch.ops.hyper_parallel.attn_fwd.default,
                          (q.detach(), k.detach(), v.detach(), q_pos, k_pos, None, None, True,
                           0.25, 8, 5.0, sinks.detach()),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


# ------------------------------------------------------------------------------------------
# every kernel build with the new inputs
@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "base"])
def test_features_every_kernel_build(isa, monkeypatch):
    use_isa_or_skip(isa, monkeypatch)
    doc = packed_docs([70, 50], pad=8)
    pos = ar(doc.numel())
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for opts in FEATURE_SETS:
            run_parity(Case(q_pos=pos[64:], k_pos=pos, q_doc=doc[64:], k_doc=doc, D=80, Hq=4,
                            Hk=2, dtype=dtype, seed=15, scale=0.3, **opts),
                       f"isa={isa} {opts}")
        _alibi_parity(Case(q_pos=pos[64:], k_pos=pos, q_doc=doc[64:], k_doc=doc, D=80, Hq=4,
                           Hk=2, dtype=dtype, seed=16, window=33),
                      torch.tensor([0.5, 0.25, 0.125, 0.0625]), f"isa={isa} alibi+window")


FEATURE_SETS = [dict(window=9), dict(softcap=2.0), dict(window=40, softcap=3.0),
                dict(sinks=True), dict(Dv=48), dict(window=17, softcap=4.0, sinks=True, Dv=112)]


# ------------------------------------------------------------------------------------------
# validation
@pytest.mark.parametrize("kw,match", [
    (dict(window=0), "window must be an int >= 1"),
    (dict(window=2.5), "window must be an int >= 1"),
    (dict(window=True), "window must be an int >= 1"),
    (dict(softcap=0.0), "softcap must be a finite number > 0"),
    (dict(softcap=-1.0), "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \[Hq\] = \[2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.long)), "sinks must be a floating tensor"),
    (dict(sinks=[0.0, 1.0]), "sinks must be a torch.Tensor"),
])
def test_feature_validation(kw, match):
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, q_pos=ar(4), k_pos=ar(6), **kw)


def test_direct_op_checks_window_softcap():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="window must be >= 1"):
        torch.ops.hyper_parallel.attn_fwd(q, k, v, ar(4), ar(6), None, None, True, 1.0, 0, None)
    with pytest.raises(ValueError, match="softcap must be"):
        torch.ops.hyper_parallel.attn_fwd(q, k, v, ar(4), ar(6), None, None, True, 1.0, None,
                                          -2.0)



# ------------------------------------------------------------------------------------------
# ALiBi
def _alibi_parity(c: Case, slopes: torch.Tensor, label: str):
    """run_parity with alibi_slopes (constants: no gradient)."""
    q, k, v, dout, dlse = make_inputs(c)
    kw = dict(q_pos=c.q_pos, k_pos=c.k_pos, causal=c.causal, q_doc=c.q_doc, k_doc=c.k_doc,
              scale=c.scale, return_lse=True, window=c.window)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qe, ke, ve, alibi_slopes=slopes.float(), **kw)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    rout, rlse = reference_attention(qr, kr, vr, alibi_slopes=slopes.double(), **kw)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    for o, l in ((out, lse), (rout, rlse)):
        ((o.double() * dout).sum() + (torch.where(fin, l.double(), 0.0) * dlse).sum()).backward()
    tol = TOL[c.dtype]
    errs = {"out": error(out, rout), "lse": error(lse[fin], rlse[fin]),
            "dq": error(qe.grad, qr.grad), "dk": error(ke.grad, kr.grad),
            "dv": error(ve.grad, vr.grad)}
    line = " ".join(f"{n}: abs={a:.2e} rel={r:.2e}" for n, (a, r) in errs.items())
    print(f"[parity {label} {c.dtype} tol={tol:g}] {line}")
    assert all(r <= tol for _, r in errs.values()), line


def _bloom_slopes(n):
    bl = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    return bl._get_alibi_slopes(n, torch.device("cpu")).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_alibi_parity(layout, dtype):
    c = Case(Hq=4, Hk=2, D=40, dtype=dtype, seed=41, **_LAYOUTS[layout])
    _alibi_parity(c, _bloom_slopes(4), f"alibi {layout}")
    _alibi_parity(Case(Hq=4, Hk=2, D=40, dtype=dtype, seed=42, window=30, **_LAYOUTS[layout]),
                  _bloom_slopes(4) * 3, f"alibi+window {layout}")


def test_alibi_matches_bloom_bias():
    """alibi_slopes = Bloom's slopes gives Bloom's attention (bias slope * key position from
    build_alibi_tensor, added to the scaled scores, causal + left padding)."""
    bl = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    B, H, S, D = 2, 4, 40, 16
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :7] = 0  # left padding in row 1
    alibi = bl.build_alibi_tensor(mask, H, torch.float64).view(B, H, 1, S)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    pos = ((mask.cumsum(-1) - 1) * mask)  # the positions Bloom's alibi uses
    doc = torch.where(mask.bool(), 0, -1)
    vis = visibility(ar(S), ar(S), True, doc, doc, batch=B)
    s = alibi + (q @ k.transpose(-1, -2)) * 0.25
    s = s.masked_fill(~vis, -math.inf)
    ref = torch.nan_to_num(torch.softmax(s, -1)) @ v
    for dtype in (torch.float64, torch.float32):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=pos, k_pos=pos, q_doc=doc,
                        k_doc=doc, scale=0.25, alibi_slopes=_bloom_slopes(H).to(dtype))
        rows = mask.bool()[:, None, :, None]  # padding query rows: engine 0, Bloom undefined
        a, r = error(torch.where(rows, out.double(), 0.0), torch.where(rows, ref, 0.0))
        print(f"[alibi vs bloom bias {dtype} tol={TOL[dtype]:g}] abs={a:.2e} rel={r:.2e}")
        assert r <= TOL[dtype]


def test_alibi_gradcheck_and_merge():
    q, k, v = _gc_inputs()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def f(q, k, v):
        return attention(q, k, v, **_GC_POS, scale=0.9, return_lse=True, alibi_slopes=slopes,
                         window=5, sinks=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))

    assert torch.autograd.gradcheck(f, (q, k, v))
    # the bias is relative (k_pos - q_pos): partial attentions over disjoint keys merge exactly
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 30, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 90, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 90, 16, generator=g, dtype=torch.float64)
    kw = dict(q_pos=ar(60, 90), alibi_slopes=slopes, return_lse=True)
    full = attention(q, k, v, k_pos=ar(90), **kw)
    a = attention(q, k[:, :, :50], v[:, :, :50], k_pos=ar(50), **kw)
    b = attention(q, k[:, :, 50:], v[:, :, 50:], k_pos=ar(50, 90), **kw)
    merged = merge_partial_attention(*a, *b)
    for name, x, y in zip(("out", "lse"), full, merged):
        ae, re_ = error(y, x)
        print(f"[alibi 2-partial merge float64 {name} tol=1e-10] abs={ae:.2e} rel={re_:.2e}")
        assert re_ <= 1e-10


@pytest.mark.parametrize("kw,match", [
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must have shape \[Hq\] = \[2\]"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), "alibi_slopes are constants"),
    (dict(alibi_slopes=torch.ones(2), softcap=2.0), "alibi_slopes and softcap together"),
])
def test_alibi_validation(kw, match):
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, q_pos=ar(4), k_pos=ar(6), **kw)


# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_window_softcap_sinks_dv(dtype):
    """The CUDA path (compiled FlexAttention) with every new input, forward and backward (the
    sink gradient through FlexAttention's lse), against the float64 reference on the GPU."""
    doc = packed_docs([150, 90], pad=16).cuda()
    pos = ar(doc.numel()).cuda()
    g = torch.Generator().manual_seed(17)
    q = torch.randn(2, 8, 128, 64, generator=g).cuda()
    k = torch.randn(2, 2, 256, 64, generator=g).cuda()
    v = torch.randn(2, 2, 256, 32, generator=g).cuda()  # Dv != D
    s = torch.randn(8, generator=g).cuda()
    dout = torch.randn(2, 8, 128, 32, generator=g).cuda()
    kw = dict(q_pos=pos[128:], k_pos=pos, q_doc=doc[128:], k_doc=doc, window=48, softcap=4.0,
              scale=0.3, return_lse=True)
    res = []
    for dt, fn in ((dtype, attention), (torch.float64, reference_attention)):
        qq, kk, vv = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
        sd = torch.float64 if dt == torch.float64 else torch.float32
        ss = s.detach().to(sd).clone().requires_grad_()
        out, lse = fn(qq, kk, vv, sinks=ss, **kw)
        ((out.double() * dout.double()).sum() + lse.double().sum() * 0.5).backward()
        res.append([out, lse, qq.grad, kk.grad, vv.grad, ss.grad])
    tol = TOL[dtype] * 2
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], *res):
        ae, re_ = error(a.cpu(), b.cpu())
        print(f"[cuda all features {dtype} {name} tol={tol:g}] abs={ae:.2e} rel={re_:.2e}")
        assert re_ <= tol, name
