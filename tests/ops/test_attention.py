"""Parity of hyper_parallel.ops.attention (C++ CPU engine) with the float64 math reference.

Run: ``pytest tests/ops -q`` (add ``-s`` to see every max-abs / relative error line).
"""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from hyper_parallel.ops import attention, engine_info, reference_attention

from ._parity import TOL, Case, error, isa_available, run_parity

ar = torch.arange


def chunk(r: int, n: int, length: int) -> torch.Tensor:
    return ar(r * length, (r + 1) * length)


# ------------------------------------------------------------------------------------------
# CP layouts
@pytest.mark.parametrize("C,r", [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
                         + [(8, r) for r in range(8)])
def test_contiguous_offset_causal(C, r):
    """q is the r-th contiguous chunk of a C-way split; keys are the whole sequence."""
    S_local = 32 if C == 8 else 64
    S = C * S_local
    run_parity(Case(q_pos=chunk(r, C, S_local), k_pos=ar(S), seed=r), f"contiguous C={C} r={r}")


@pytest.mark.parametrize("C,r", [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_zigzag_two_range_queries(C, r):
    """Head-Tail / zigzag: q = chunk r and chunk 2C-1-r of a 2C split (positions not sorted)."""
    L = 24
    q_pos = torch.cat([chunk(r, 2 * C, L), chunk(2 * C - 1 - r, 2 * C, L)])
    run_parity(Case(q_pos=q_pos, k_pos=ar(2 * C * L), Hq=4, Hk=4, D=80, seed=10 + r),
               f"zigzag C={C} r={r}")


def test_zigzag_keys_in_shard_order():
    """Keys also arrive in a permuted (zigzag) order, as after an all-gather of zigzag shards."""
    C, L = 2, 40
    order = torch.cat([torch.cat([chunk(r, 2 * C, L), chunk(2 * C - 1 - r, 2 * C, L)])
                       for r in range(C)])
    q_pos = torch.cat([chunk(1, 2 * C, L), chunk(2, 2 * C, L)])
    run_parity(Case(q_pos=q_pos, k_pos=order, seed=3), "zigzag keys")


@pytest.mark.parametrize("Hq,Hk", [(8, 2), (8, 1), (4, 4)])
def test_gqa_mqa(Hq, Hk):
    run_parity(Case(Hq=Hq, Hk=Hk, q_pos=ar(100, 200), k_pos=ar(200), seed=Hq * 10 + Hk),
               f"heads {Hq}:{Hk}")


# ------------------------------------------------------------------------------------------
# documents, padding, non-causal
def packed_docs(lengths, pad: int) -> torch.Tensor:
    ids = [torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)]
    return torch.cat(ids + [torch.full((pad,), -1, dtype=torch.long)])


@pytest.mark.parametrize("causal", [True, False])
def test_documents_and_padding(causal):
    doc = packed_docs([50, 7, 90, 33], pad=20)  # 200 tokens, the last 20 are padding (-1)
    S = doc.numel()
    pos = ar(S)
    # queries: rank 1 of 2 (second half) -> sees docs 2, 3 and padding rows
    q_sl = slice(S // 2, S)
    run_parity(Case(q_pos=pos[q_sl], k_pos=pos, q_doc=doc[q_sl], k_doc=doc, causal=causal,
                    Hq=4, Hk=1, seed=5), f"docs causal={causal}")


def test_per_batch_positions_and_docs():
    """[B, S] positions and docs that differ per batch row."""
    B, S = 3, 130
    docs = torch.stack([packed_docs([60, 70], 0), packed_docs([10, 100], 20),
                        packed_docs([130], 0)])
    pos = torch.stack([ar(S), ar(S).flip(0), ar(S) + 7])
    q_pos, q_doc = pos[:, 65:], docs[:, 65:]
    run_parity(Case(B=B, q_pos=q_pos, k_pos=pos, q_doc=q_doc, k_doc=docs, Hq=2, Hk=1, D=32,
                    seed=6), "per-batch")


def test_non_causal():
    run_parity(Case(q_pos=ar(70), k_pos=ar(150), causal=False, Hq=8, Hk=2, seed=7), "non-causal")


# ------------------------------------------------------------------------------------------
# odd sizes / dtypes
@pytest.mark.parametrize("Sq,Sk,D", [(1, 200, 64), (1, 1, 64), (5, 100, 80), (64, 65, 128),
                                     (77, 131, 72), (130, 3, 16), (13, 77, 33)])
def test_odd_sizes(Sq, Sk, D):
    run_parity(Case(q_pos=ar(Sk - Sq, Sk) if Sk >= Sq else ar(Sq), k_pos=ar(Sk), D=D,
                    seed=Sq + Sk + D), f"Sq={Sq} Sk={Sk} D={D}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype):
    run_parity(Case(q_pos=ar(128, 256), k_pos=ar(256), Hq=8, Hk=2, dtype=dtype, seed=8),
               f"dtype {dtype}")


@pytest.mark.parametrize("Sq,Sk,D", [(1, 70, 64), (5, 100, 80), (77, 131, 72), (13, 77, 33)])
def test_bf16_odd_sizes(Sq, Sk, D):
    """bf16 runs its own dot-product kernels where the CPU has AVX512_BF16."""
    run_parity(Case(q_pos=ar(Sk - Sq, Sk), k_pos=ar(Sk), D=D, Hq=4, Hk=1, dtype=torch.bfloat16,
                    seed=Sq * Sk), f"bf16 Sq={Sq} Sk={Sk} D={D}")


def test_bf16_documents_gqa_d128():
    doc = packed_docs([100, 60], pad=12)
    pos = ar(doc.numel())
    run_parity(Case(q_pos=pos[86:], k_pos=pos, q_doc=doc[86:], k_doc=doc, Hq=8, Hk=2, D=128,
                    dtype=torch.bfloat16, seed=9), "bf16 docs d128")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_non_positive_scale(dtype, scale):
    run_parity(Case(q_pos=ar(40, 100), k_pos=ar(100), scale=scale, dtype=dtype, seed=17),
               f"scale={scale}")


def test_custom_scale_and_no_lse_grad():
    run_parity(Case(q_pos=ar(40, 80), k_pos=ar(80), scale=0.3, with_lse_grad=False, seed=11),
               "scale=0.3")


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(12)
    base = torch.randn(1, 96, 4, 64, generator=g)  # [B, S, H, D] -> transpose to [B, H, S, D]
    q = base.transpose(1, 2)
    kv = torch.randn(1, 160, 2, 2, 64, generator=g)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    q_pos = ar(64, 160)[::1]
    k_pos = ar(160)
    out = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    ref = reference_attention(q.double(), k.double(), v.double(), q_pos=q_pos, k_pos=k_pos)
    a, r = error(out, ref)
    print(f"[parity non-contiguous float32 tol={TOL[torch.float32]:g}] "
          f"out: abs={a:.2e} rel={r:.2e}")
    assert r <= TOL[torch.float32]


# ------------------------------------------------------------------------------------------
# empty rows, gradcheck, determinism, kernels
def test_fully_masked_queries_zero_output_and_grads():
    # queries 0..3 see nothing: their doc (-1 / 9) matches no key; query 4 sees keys at pos < 0
    k_pos = ar(10, 30)
    k_doc = torch.zeros(20, dtype=torch.long)
    q_pos = torch.tensor([50, 51, 52, 53, 5, 40])
    q_doc = torch.tensor([-1, 9, -1, 9, 0, 0])
    q = torch.randn(1, 2, 6, 16, requires_grad=True)
    k = torch.randn(1, 1, 20, 16, requires_grad=True)
    v = torch.randn(1, 1, 20, 16, requires_grad=True)
    out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, q_doc=q_doc, k_doc=k_doc,
                         return_lse=True)
    assert torch.all(out[:, :, :5] == 0)
    assert torch.all(lse[:, :, :5] == -math.inf) and torch.isfinite(lse[:, :, 5]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in (q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()
    assert torch.all(q.grad[:, :, :5] == 0)
    # every key is visible only to query 5, so grads exist there
    assert q.grad[:, :, 5].abs().sum() > 0

    # no key at all, and all keys padding
    out, lse = attention(q, k[:, :, :0], v[:, :, :0], q_pos=q_pos, k_pos=k_pos[:0],
                         return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    out = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, q_doc=q_doc.clamp(min=0),
                    k_doc=torch.full((20,), -1))
    out.sum().backward()
    assert torch.all(out == 0)


def test_gradcheck_double():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    q_pos = torch.tensor([3, 4, 5, 6, 7, 8])
    k_pos = ar(9)
    q_doc = torch.tensor([0, 0, 1, 1, 1, 1])
    k_doc = torch.tensor([0, 0, 0, 0, 1, 1, -1, 1, 1])

    def f(q, k, v):
        out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, q_doc=q_doc, k_doc=k_doc,
                             return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v))

    def g2(q, k, v):  # non-causal, GQA, out only
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=False)

    assert torch.autograd.gradcheck(g2, (q, k, v))


def test_deterministic_and_thread_count_independent():
    c = dict(q_pos=ar(192, 384), k_pos=ar(384))
    g = torch.Generator().manual_seed(14)
    q = torch.randn(1, 4, 192, 64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 384, 64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 384, 64, generator=g, requires_grad=True)

    def run():
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v, **c)
        out.square().sum().backward()
        return [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(n)
    for a, b in zip(first, single):
        assert error(a, b)[1] <= 1e-6


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "base"])
def test_every_kernel_build(isa, monkeypatch):
    """Every kernel build against float64. Where the CPU/build lacks an ISA, forcing it must raise
    a ValueError that names the variable, instead of silently falling back to another build."""
    available = isa_available(isa)
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_ISA", isa)
    if not available:
        with pytest.raises(ValueError, match=f"HYPER_PARALLEL_ATTN_ISA={isa}"):
            attention(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16),
                      q_pos=ar(4), k_pos=ar(4))
        return
    assert f"kernels={isa}" in engine_info()
    doc = packed_docs([70, 50], pad=8)
    pos = ar(doc.numel())
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        run_parity(Case(q_pos=pos[64:], k_pos=pos, q_doc=doc[64:], k_doc=doc, D=80, Hq=4, Hk=2,
                        dtype=dtype, seed=15), f"isa={isa}")


_PROVIDER_CASES = [
    ("offset causal C=4 r=3, Sk=4 tiles", dict(q_pos=ar(192, 256), k_pos=ar(256), Hq=8, Hk=2)),
    ("zigzag two-range q", dict(q_pos=torch.cat([ar(0, 24), ar(168, 192)]), k_pos=ar(192),
                                Hq=4, Hk=4, D=80)),
    ("docs + padding, MQA", dict(q_pos=ar(100, 200), k_pos=ar(200), Hq=4, Hk=1,
                                 q_doc=packed_docs([50, 7, 90, 33], pad=20)[100:],
                                 k_doc=packed_docs([50, 7, 90, 33], pad=20))),
    ("non-causal odd sizes", dict(q_pos=ar(77), k_pos=ar(131), causal=False, D=72)),
    ("Sq=1", dict(q_pos=ar(199, 200), k_pos=ar(200), D=64)),
    ("window+softcap+sinks, Dv != D", dict(q_pos=ar(100, 200), k_pos=ar(200), Hq=4, Hk=2,
                                           window=37, softcap=3.0, sinks=True, Dv=48)),
]


def _brgemm_usable(info: str) -> dict:
    """What ATen's brgemm can run on *this* CPU (engine_info's probe line)."""
    m = re.search(r"brgemm usable: fp32=(yes|no) bf16-amx=(yes|no)", info)
    assert m, info
    return {"fp32": m.group(1) == "yes", "bf16-amx": m.group(2) == "yes"}


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "base"])
@pytest.mark.parametrize("provider", ["builtin", "brgemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tile_gemm_providers(provider, isa, dtype, monkeypatch):
    """Both tile-GEMM providers (built-in micro-kernels, ATen/oneDNN brgemm) x every kernel build
    (HYPER_PARALLEL_ATTN_ISA), against float64.

    CPU features this test depends on, and what it asserts where they are missing:
    * the ISA level (AVX512_BF16 / AVX-512 / AVX2; ``base`` runs anywhere): forcing a level the
      CPU lacks must raise a ValueError naming HYPER_PARALLEL_ATTN_ISA at the first call;
    * brgemm: fp32 needs a CPU where oneDNN's brgemm JITs (AVX-512 class), the bf16 kernels
      (``avx512bf16`` level, bf16 inputs) need AMX-BF16; bf16 at the other levels and float16
      run the fp32 kernels, so they need fp32 brgemm. Forcing brgemm where it cannot run must
      raise a ValueError naming HYPER_PARALLEL_ATTN_GEMM at the first call.
    ``engine_info()`` must report in every case, never raise. So on an AMX machine, on an
    AVX-512-without-AMX machine (Zen 4) and on an AVX2-only one, every combination is exercised:
    either it runs and matches float64, or it raises the expected error.
    """
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_ISA", isa)
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_GEMM", provider)
    info = engine_info()  # must not raise whatever the variables say
    small = [torch.randn(1, 1, 4, 16).to(dtype) for _ in range(3)]
    if isa != "base" and f"{isa} cpu=yes" not in info:
        print(f"[provider {provider} isa={isa}] this CPU lacks {isa}: expecting the ISA error")
        assert f"kernels=unavailable(HYPER_PARALLEL_ATTN_ISA={isa}" in info, info
        with pytest.raises(ValueError, match=f"HYPER_PARALLEL_ATTN_ISA={isa}"):
            attention(*small, q_pos=ar(4), k_pos=ar(4))
        return
    assert f"kernels={isa}" in info, info
    if provider == "brgemm":
        uses_bf16_kernels = dtype == torch.bfloat16 and isa == "avx512bf16"
        need = "bf16-amx" if uses_bf16_kernels else "fp32"
        if not _brgemm_usable(info)[need]:
            print(f"[provider brgemm isa={isa} {dtype}] brgemm {need} not usable on this CPU: "
                  "expecting the GEMM error")
            assert "unavailable(HYPER_PARALLEL_ATTN_GEMM=brgemm" in info, info
            with pytest.raises(ValueError, match="HYPER_PARALLEL_ATTN_GEMM=brgemm"):
                attention(*small, q_pos=ar(4), k_pos=ar(4))
            return
    for i, (name, kw) in enumerate(_PROVIDER_CASES):
        run_parity(Case(dtype=dtype, seed=40 + i, **kw),
                   f"gemm={provider} isa={isa} {dtype} {name}")


def test_engine_info_never_raises_on_bad_env(monkeypatch):
    for var, val in (("HYPER_PARALLEL_ATTN_GEMM", "mkl"), ("HYPER_PARALLEL_ATTN_ISA", "sse9")):
        monkeypatch.setenv(var, val)
        info = engine_info()
        assert f"{var} must be" in info, info


def test_bad_gemm_env_raises(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_GEMM", "mkl")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_ATTN_GEMM"):
        attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                  q_pos=ar(4), k_pos=ar(4))


def test_bad_isa_env_raises(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_ISA", "sse9")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_ATTN_ISA"):
        attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                  q_pos=ar(4), k_pos=ar(4))


# ------------------------------------------------------------------------------------------
# validation and dispatch
def _qkv(Sq=4, Sk=6, D=8, Hq=2, Hk=1, dtype=torch.float32):
    return (torch.randn(1, Hq, Sq, D, dtype=dtype), torch.randn(1, Hk, Sk, D, dtype=dtype),
            torch.randn(1, Hk, Sk, D, dtype=dtype))


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(q=a["q"][0]), "q must be 4-D"),
    (lambda a: a.update(k=a["k"].double()), "share one dtype"),
    (lambda a: a.update(q=a["q"].int()), "q must be float"),
    (lambda a: a.update(v=a["v"][:, :, :5]), "v must have k's shape"),
    (lambda a: a.update(q=torch.randn(1, 3, 4, 8), k=torch.randn(1, 2, 6, 8),
                        v=torch.randn(1, 2, 6, 8)), "multiple of k/v heads"),
    (lambda a: a.update(k=torch.randn(1, 1, 6, 4), v=torch.randn(1, 1, 6, 4)), "head dim"),
    (lambda a: a.update(q_pos=ar(5)), "q_pos must have shape"),
    (lambda a: a.update(k_pos=ar(6).float()), "k_pos must be an integer"),
    (lambda a: a.update(q_doc=torch.zeros(4, dtype=torch.long)), "given together"),
    (lambda a: a.update(q_doc=torch.zeros(4, dtype=torch.long), k_doc=torch.zeros(5)),
     "k_doc must be an integer"),
    (lambda a: a.update(q_pos=torch.zeros(2, 4, dtype=torch.long)), r"q_pos must have shape"),
    (lambda a: a.update(scale="x"), "scale"),
    (lambda a: a.update(causal=1), "causal must be a bool"),
])
def test_validation_errors_name_the_argument(mutate, match):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, q_pos=ar(4), k_pos=ar(6))
    mutate(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **args)


def test_position_range_checked_in_engine():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q_pos values must fit in int32"):
        attention(q, k, v, q_pos=ar(4) + 2**40, k_pos=ar(6))


def test_direct_op_validates_too():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of Hk"):
        torch.ops.hyper_parallel.attn_fwd(q, k[:, :0], v[:, :0], ar(4), ar(0), None, None,
                                          True, 1.0)


def test_unsupported_device_names_it():
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(NotImplementedError, match="meta"):
        attention(q, k, v, q_pos=ar(4, device="meta"), k_pos=ar(6, device="meta"))


def test_compile_smoke():
    """One small torch.compile run (fake kernels + autograd registration)."""
    torch._dynamo.reset()
    q_pos, k_pos = ar(16, 48), ar(48)

    def f(q, k, v):
        out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, return_lse=True)
        return out * 2, lse

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    q, k, v = (t.requires_grad_() for t in _qkv(Sq=32, Sk=48, D=16, Hq=4, Hk=2))
    out, lse = cf(q, k, v)
    ref_out, ref_lse = f(q, k, v)
    assert torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse)
    out.sum().backward()
    assert q.grad is not None and not torch.isnan(q.grad).any()
    torch.library.opcheck(torch.ops.hyper_parallel.attn_fwd.default,
                          (q.detach(), k.detach(), v.detach(), q_pos, k_pos, None, None, True,
                           0.25),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_flex_matches_cpu_engine(dtype):
    doc = packed_docs([150, 90], pad=16)
    pos = ar(doc.numel())
    q_pos, q_doc = pos[128:], doc[128:]
    g = torch.Generator().manual_seed(16)
    q = torch.randn(2, 8, 128, 64, generator=g).to(dtype)
    k = torch.randn(2, 2, 256, 64, generator=g).to(dtype)
    v = torch.randn(2, 2, 256, 64, generator=g).to(dtype)
    kw = dict(causal=True, return_lse=True)
    out_c, lse_c = attention(q, k, v, q_pos=q_pos, k_pos=pos, q_doc=q_doc, k_doc=doc, **kw)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out_g, lse_g = attention(qc, kc, vc, q_pos=q_pos.cuda(), k_pos=pos.cuda(),
                             q_doc=q_doc.cuda(), k_doc=doc.cuda(), **kw)
    fin = torch.isfinite(lse_c)
    assert torch.equal(torch.isfinite(lse_g.cpu()), fin)
    tol = TOL[dtype] * 2
    assert error(out_g.cpu(), out_c.float())[1] <= tol
    assert error(lse_g.cpu()[fin], lse_c[fin])[1] <= tol
    out_g.float().sum().backward()
    assert not torch.isnan(qc.grad).any()
