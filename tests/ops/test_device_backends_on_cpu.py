"""The CUDA and NPU backends' own logic, exercised on CPU (no GPU / NPU in CI).

What is tested here is *our* code around the vendor kernels: the position/doc block mask and
lse convention of the CUDA (FlexAttention) path, run through FlexAttention's eager CPU
implementation (forward only: FlexAttention has no CPU backward and its compiled CPU kernel has
no lse); and the query chunking, per-chunk mask, invisible-row and lse handling of the NPU path,
with a float64 stand-in for ``torch_npu.npu_fusion_attention``. The vendor kernels themselves
are not covered (tests/ops/test_attention.py::test_cuda_flex_matches_cpu_engine runs on CUDA).
"""
from __future__ import annotations

import pytest
import torch

import hyper_parallel.ops._cuda as cuda_backend
import hyper_parallel.ops._npu as npu_backend
from hyper_parallel.ops import attention

from ._parity import error
from .test_attention import packed_docs

ar = torch.arange


def checked(label: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Print max abs and rel (``_parity.error``: max abs / max(1, max |ref|)) every run; assert rel <= tol."""
    max_abs, rel = error(got, ref)
    print(f"{label}: max abs {max_abs:.2e} rel {rel:.2e} (tol rel {tol:g})")
    assert rel <= tol, f"{label}: rel {rel:.2e} > tol {tol:g} (max abs {max_abs:.2e})"


def _inputs(B=2, Hq=8, Hk=2, Sq=128, Sk=256, D=32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, generator=g, dtype=torch.float64)
               for h, s in ((Hq, Sq), (Hk, Sk), (Hk, Sk)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


# ------------------------------------------------------------------------------------------
# CUDA path: FlexAttention block mask from positions
@pytest.fixture
def eager_flex(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(cuda_backend, "_compiled", flex_attention)
    cuda_backend._block_masks.clear()
    yield
    cuda_backend._block_masks.clear()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("layout", ["docs+padding, rank 1 of 2", "zigzag two-range", "non-causal"])
def test_cuda_backend_mask_and_lse(layout, eager_flex):
    doc = packed_docs([150, 90], pad=16)
    pos = ar(256)
    kw = dict(q_pos=pos[128:], k_pos=pos, causal=True, q_doc=doc[128:], k_doc=doc)
    if layout == "zigzag two-range":
        kw = dict(q_pos=torch.cat([ar(0, 64), ar(192, 256)]), k_pos=pos, causal=True,
                  q_doc=None, k_doc=None)
    elif layout == "non-causal":
        kw = dict(q_pos=pos[:128], k_pos=pos, causal=False, q_doc=None, k_doc=None)
    q, k, v = _inputs(seed=len(layout))
    out, lse = cuda_backend.flex_attention_call(q, k, v, kw["q_pos"], kw["k_pos"], kw["causal"],
                                           kw["q_doc"], kw["k_doc"], 0.125)
    ref, ref_lse = attention(q, k, v, scale=0.125, return_lse=True, **kw)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "invisible rows must have lse = -inf"
    assert lse.dtype == torch.float64
    checked(f"cuda-path {layout} out", out, ref, 1e-7)
    checked(f"cuda-path {layout} lse", lse[fin], ref_lse[fin], 1e-7)
    if (~fin).any():
        assert out.permute(0, 2, 1, 3)[~fin.permute(0, 2, 1)].abs().max() == 0


def test_cuda_backend_block_mask_cache(eager_flex):
    pos = ar(256)
    a = cuda_backend._block_mask(pos[128:], pos, True, None, None, 1, 128, 256, "cpu")
    b = cuda_backend._block_mask(pos[128:].clone(), pos.clone(), True, None, None, 1, 128, 256,
                                 "cpu")
    assert a is b, "equal positions must reuse the cached block mask"
    c = cuda_backend._block_mask(pos[:128], pos, True, None, None, 1, 128, 256, "cpu")
    assert c is not a, "other positions must build a new block mask"
    # rank 0's queries see only the first half of the keys: the second half's blocks are empty
    dense = c.to_dense()[0, 0]  # [q blocks, k blocks]
    assert dense[:, dense.shape[1] // 2:].sum() == 0 and dense.sum() > 0


# ------------------------------------------------------------------------------------------
# NPU path: query chunks, never an Sq x Sk mask
class FakeFused:
    """float64 stand-in for npu_fusion_attention (BNSD, mask True = masked out).

    Returns (out, softmax_max, softmax_sum) with the vendor's [B, N, S, 8] statistics layout;
    fully masked rows get garbage (the backend must override them). Records mask shapes.
    """

    def __init__(self):
        self.masks = []

    def __call__(self, q, k, v, head_num, atten_mask, scale):
        self.masks.append(tuple(atten_mask.shape))
        assert q.shape[1] == head_num
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(atten_mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        dead = torch.isinf(m)
        m = torch.where(dead, torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        l = torch.where(dead, torch.ones_like(l), l)
        out = torch.where(dead, torch.full_like(q, 7.0), (p / l) @ v)
        return out, m.expand(*m.shape[:-1], 8), l.expand(*l.shape[:-1], 8)


@pytest.mark.parametrize("budget", [npu_backend.MASK_BUDGET, 2 * 256 * 32])
def test_npu_backend_chunks_queries(budget):
    doc = packed_docs([100, 7, 120], pad=29)
    pos = ar(256)
    q_pos, q_doc = pos[128:], doc[128:]
    q, k, v = _inputs(seed=3, grad=True)
    fake = FakeFused()
    out, lse = npu_backend.npu_attention(q, k, v, q_pos, pos, True, q_doc, doc, 0.2,
                                         _fused=fake, _budget=budget)
    ref, ref_lse = attention(q, k, v, q_pos=q_pos, k_pos=pos, q_doc=q_doc, k_doc=doc,
                             scale=0.2, return_lse=True)
    B, Sk = q.shape[0], k.shape[2]
    assert all(m[0] * m[2] * m[3] <= max(budget, B * 16 * Sk) for m in fake.masks), fake.masks
    assert sum(m[2] for m in fake.masks) == q.shape[2]
    if budget < npu_backend.MASK_BUDGET:
        assert len(fake.masks) == 4, "a small budget must split the queries into chunks"
    fin = torch.isfinite(ref_lse)
    assert (~fin).any() and torch.equal(torch.isfinite(lse), fin)
    checked(f"npu-path budget={budget} out", out, ref, 1e-10)
    checked(f"npu-path budget={budget} lse", lse[fin], ref_lse[fin].float(), 1e-6)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        checked(f"npu-path budget={budget} d{name}", a, b, 1e-10)


def test_npu_backend_without_torch_npu_names_the_device():
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match="torch_npu"):
        npu_backend.npu_attention(q, k, v, ar(128), ar(256), True, None, None, 0.1)


# ------------------------------------------------------------------------------------------
# window / softcap / sinks on the device paths
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("opts", [dict(window=40), dict(softcap=2.0),
                                  dict(window=17, softcap=3.0, sinks=True), dict(Dv=16),
                                  dict(alibi=True, window=50)])
def test_cuda_backend_window_softcap_sinks(opts, eager_flex):
    """window -> mask_mod (and its block mask), softcap -> score_mod, sinks -> lse correction,
    through FlexAttention's eager CPU implementation, against the CPU engine (forward)."""
    doc = packed_docs([150, 90], pad=16)
    pos = ar(256)
    q, k, v = _inputs(seed=4)
    opts = dict(opts)
    if "Dv" in opts:  # MLA: value head dim != qk head dim
        v = v[..., :opts.pop("Dv")]
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.tensor([2.0 ** -i for i in range(1, 9)], dtype=torch.float64)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.linspace(-1.0, 2.0, q.shape[1], dtype=torch.float64)
    out, lse = cuda_backend.flex_attention_call(q, k, v, pos[128:], pos, True, doc[128:], doc, 0.2,
                                           **opts)
    ref, ref_lse = attention(q, k, v, q_pos=pos[128:], k_pos=pos, q_doc=doc[128:], k_doc=doc,
                             scale=0.2, return_lse=True, **opts)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    checked(f"cuda-path {opts.keys()} out", out, ref, 1e-7)
    checked(f"cuda-path {opts.keys()} lse", lse[fin], ref_lse[fin], 1e-7)
    if "window" in opts:
        p = ar(512)  # queries 384..511, window 40: key blocks 0 and 1 (0..255) are invisible
        bm = cuda_backend._block_mask(p[384:], p, True, None, None, 1, 128, 512, "cpu",
                                      window=opts["window"])
        dense = bm.to_dense()[0, 0]
        assert dense[:, :2].sum() == 0 and dense[:, 2:].sum() > 0, dense


def test_cuda_apply_sinks_gradient():
    """The CUDA path's sink correction is exact in out, lse and the sink (float64 gradcheck)."""
    g = torch.Generator().manual_seed(2)
    out = torch.randn(1, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(1, 3, 5, generator=g, dtype=torch.float64)
    lse[0, 1, 2] = float("-inf")
    lse.requires_grad_()
    s = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cuda_backend.apply_sinks, (out, lse, s))


def test_npu_backend_window_and_refusals():
    doc = packed_docs([100, 7, 120], pad=29)
    pos = ar(256)
    q, k, v = _inputs(seed=5, grad=True)
    out, lse = npu_backend.npu_attention(q, k, v, pos[128:], pos, True, doc[128:], doc, 0.2,
                                         window=30, _fused=FakeFused(), _budget=2 * 256 * 32)
    ref, ref_lse = attention(q, k, v, q_pos=pos[128:], k_pos=pos, q_doc=doc[128:], k_doc=doc,
                             scale=0.2, window=30, return_lse=True)
    checked("npu-path window out", out, ref, 1e-10)
    with pytest.raises(NotImplementedError, match="softcap is not supported on NPU"):
        npu_backend.npu_attention(q, k, v, pos[128:], pos, True, None, None, 0.2, softcap=2.0,
                                  _fused=FakeFused())
    with pytest.raises(NotImplementedError, match="value head dim different"):
        npu_backend.npu_attention(q, k, v[..., :16], pos[128:], pos, True, None, None, 0.2,
                                  _fused=FakeFused())
    with pytest.raises(NotImplementedError, match="ALiBi"):
        npu_backend.npu_attention(q, k, v, pos[128:], pos, True, None, None, 0.2,
                                  alibi_slopes=torch.ones(8), _fused=FakeFused())
    with pytest.raises(NotImplementedError, match="sinks are not supported on NPU"):
        npu_backend.npu_attention(q, k, v, pos[128:], pos, True, None, None, 0.2,
                                  sinks=torch.zeros(8), _fused=FakeFused())
