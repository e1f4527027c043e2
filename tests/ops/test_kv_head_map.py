"""The engine's query-head -> KV-head map (``kv_group`` / ``kv_offset``): query head ``h`` reads KV
head ``(h + kv_offset) // kv_group``, K/V read in place (no per-query-head copy), dK/dV summed
over each KV head's query heads.

This is how a Ulysses rank whose query heads start or end inside a KV group (uneven layouts,
e.g. 3 query heads over 2 KV heads) runs the engine. Parity against the float64 reference
(which expands K/V by the same map) on every kernel build this CPU has, and against the engine
run on K/V copied per query head (``index_select``, what the Ulysses paths did before).
"""
from __future__ import annotations

import pytest
import torch

from hyper_parallel.ops import attention
from hyper_parallel.ops.attention import expand_kv_heads, kv_head_map

from ._parity import TOL, Case, error, run_parity, use_isa_or_skip
from .test_attention_features import packed_docs

ar = torch.arange

# (Hq, Hk, kv_group, kv_offset): a rank's query heads and the KV heads they read
MAPS = [
    (3, 2, 2, 1),    # 1 head at the end of group 0, then a whole group of 2
    (3, 2, 4, 3),    # 12/3 heads at degree 4, rank 1: heads 3..5 -> KV 0 (one), KV 1 (two)
    (5, 3, 3, 2),    # partial, whole, partial
    (2, 2, 3, 2),    # the last head of one group, the first of the next
    (4, 1, 6, 1),    # inside one group (MQA-like)
    (6, 2, 3, 0),    # plain GQA written out explicitly
]


@pytest.mark.parametrize("hmap", MAPS, ids=[f"Hq{m[0]}_Hk{m[1]}_g{m[2]}_o{m[3]}" for m in MAPS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kv_head_map_parity(hmap, dtype):
    """Forward out / lse and dq, dk, dv vs the float64 reference on packed documents + padding, plain
    and with window + sinks + softcap + a value head dim of its own."""
    Hq, Hk, group, offset = hmap
    doc = packed_docs([40, 9, 51], pad=6)
    pos = ar(doc.numel())
    for opts in (dict(), dict(window=13, sinks=True, softcap=2.5, Dv=24)):
        run_parity(Case(q_pos=pos[30:], k_pos=pos, q_doc=doc[30:], k_doc=doc, D=40, Hq=Hq, Hk=Hk,
                        kv_group=group, kv_offset=offset, dtype=dtype, seed=Hq * 7 + offset, scale=0.4,
                        **opts), f"map {hmap} {opts}")


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "base"])
def test_kv_head_map_every_kernel_build(isa, monkeypatch):
    """The map in every kernel build this CPU can run (the others are reported and skipped)."""
    use_isa_or_skip(isa, monkeypatch)
    pos = ar(150)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for Hq, Hk, group, offset in MAPS[:3]:
            run_parity(Case(q_pos=pos[70:], k_pos=pos, D=48, Hq=Hq, Hk=Hk, kv_group=group, kv_offset=offset,
                            dtype=dtype, seed=5, window=60, sinks=True),
                       f"isa={isa} map {(Hq, Hk, group, offset)}")


@pytest.mark.parametrize("B", [1, 2])
def test_kv_head_map_equals_the_copied_kv(B):
    """The same numbers as the engine on K/V copied to one head per query head (``index_select``,
    whose backward sums the copies' gradients): fp32, within the fp32 tolerance."""
    Hq, Hk, group, offset = 5, 3, 3, 2
    g = torch.Generator().manual_seed(11)
    S = 96
    q = torch.randn(B, Hq, S, 32, generator=g, requires_grad=True)
    k = torch.randn(B, Hk, S, 32, generator=g, requires_grad=True)
    v = torch.randn(B, Hk, S, 32, generator=g, requires_grad=True)
    w = torch.randn(B, Hq, S, 32, generator=g)
    out = attention(q, k, v, q_pos=ar(S), k_pos=ar(S), kv_group=group, kv_offset=offset)
    (out * w).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ke, ve = (expand_kv_heads(t, Hq, group, offset) for t in (k, v))
    assert ke.shape[1] == Hq
    ref = attention(q, ke, ve, q_pos=ar(S), k_pos=ar(S))
    (ref * w).sum().backward()
    for name, a, b in zip(("out", "dq", "dk", "dv"), [out] + grads, [ref, q.grad, k.grad, v.grad]):
        ab, rel = error(a, b)
        print(f"[map vs copied K/V B={B}] {name}: abs={ab:.2e} rel={rel:.2e} tol={TOL[torch.float32]:g}")
        assert rel <= TOL[torch.float32], name


def test_kv_head_map_gradcheck():
    Hq, Hk, group, offset = 3, 2, 2, 1
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, Hq, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, Hk, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, Hk, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return attention(q, k, v, q_pos=ar(3, 9), k_pos=ar(9), window=4, return_lse=True,
                         kv_group=group, kv_offset=offset)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_kv_head_map_opcheck():
    q, k, v = torch.randn(1, 3, 16, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    torch.library.opcheck(torch.ops.hyper_parallel.attn_fwd.default,
                          (q, k, v, ar(8, 24), ar(24), None, None, True, 0.25, None, None, None, None, 2, 1),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("Hq,Hk,kw,match", [
    (3, 2, dict(), "must be a multiple of k/v heads Hk=2"),
    (4, 2, dict(kv_offset=1), "kv_offset 0"),
    (3, 2, dict(kv_group=0), "kv_group >= 1"),
    (3, 2, dict(kv_group=2, kv_offset=2), "0 <= kv_offset < kv_group"),
    (3, 2, dict(kv_group=2, kv_offset=-1), "0 <= kv_offset < kv_group"),
    (3, 2, dict(kv_group=4, kv_offset=0), "read KV heads 0..0, but k/v have Hk=2"),
    (3, 1, dict(kv_group=2, kv_offset=1), "read KV heads 0..1, but k/v have Hk=1"),
    (3, 2, dict(kv_group=2.0, kv_offset=1), "int kv_group"),
])
def test_kv_head_map_validation(Hq, Hk, kw, match):
    """Bad maps are refused by name, in Python and at the op (direct torch.ops calls)."""
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
        kv_head_map(Hq, Hk, **kw)
    q, k = torch.randn(1, Hq, 4, 8), torch.randn(1, Hk, 4, 8)
    with pytest.raises(ValueError, match="kv_|Hk="):
        attention(q, k, k, q_pos=ar(4), k_pos=ar(4), **kw)
    if isinstance(kw.get("kv_group", 1), int):
        with pytest.raises(ValueError, match="kv_offset|Hk="):
            torch.ops.hyper_parallel.attn_fwd(q, k, k, ar(4), ar(4), None, None, True, 1.0, None, None, None,
                                              None, kw.get("kv_group"), kw.get("kv_offset", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kv_head_map_cuda_matches_cpu_engine():
    """CUDA expands K/V by the map (``expand_kv_heads``) before FlexAttention: the same outputs and
    K/V gradients (summed over each KV head's query heads) as the CPU engine's in-place map."""
    Hq, Hk, group, offset = 5, 3, 3, 2
    g = torch.Generator().manual_seed(21)
    S = 192
    q, k, v = (torch.randn(2, h, S, 64, generator=g) for h in (Hq, Hk, Hk))
    w = torch.randn(2, Hq, S, 64, generator=g)
    kw = dict(q_pos=ar(S), k_pos=ar(S), kv_group=group, kv_offset=offset)
    res = {}
    for dev in ("cpu", "cuda"):
        qd, kd, vd = (t.to(dev).requires_grad_() for t in (q, k, v))
        out = attention(qd, kd, vd, **{n: (x.to(dev) if torch.is_tensor(x) else x) for n, x in kw.items()})
        (out * w.to(dev)).sum().backward()
        res[dev] = [t.detach().cpu() for t in (out, qd.grad, kd.grad, vd.grad)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), res["cuda"], res["cpu"]):
        ab, rel = error(a, b)
        print(f"[map cuda vs cpu] {name}: abs={ab:.2e} rel={rel:.2e} tol={2 * TOL[torch.float32]:g}")
        assert rel <= 2 * TOL[torch.float32], name
