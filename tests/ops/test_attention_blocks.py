"""Bidirectional blocks (``q_block`` / ``k_block``): one image's tokens see each other (Gemma 3).

The definition is transformers' (``blockwise_overlay`` OR'ed into the causal mask, the sliding
window AND'ed after it: ``create_masks_for_vision_model``); the engine is checked against the
float64 ``reference_attention`` (forward, backward, lse) on blocks that straddle the 64-key tiles,
in shard-like query layouts, with documents and windows, and merged over disjoint key sets.
``pytest tests/ops/test_attention_blocks.py -s`` prints every error.
"""
from __future__ import annotations

import pytest
import torch

from hyper_parallel.ops import attention, merge_partial_attention, reference_attention
from hyper_parallel.ops.reference import visibility

from ._parity import TOL, Case, error, run_parity, use_isa_or_skip

ar = torch.arange
S = 200


def blocks_of(token_type: torch.Tensor) -> torch.Tensor:
    """Block id per token from a 0/1 image mask: the index of its run of image tokens, -1 for text
    (transformers' ``get_block_sequence_ids_for_mask``)."""
    img = token_type == 1
    prev = torch.nn.functional.pad(img, (1, 0))[..., :-1]
    ids = torch.cumsum((img & ~prev).long(), dim=-1) - 1
    return torch.where(img, ids, torch.full_like(ids, -1))


def image_row(spans, n=S) -> torch.Tensor:
    tt = torch.zeros(n, dtype=torch.long)
    for a, b in spans:
        tt[a:b] = 1
    return tt


# images straddling the 64-key tiles (50..140 crosses tiles 0-2; 150..170 inside tile 2; 171..176
# directly after it: a separate block)
TT = image_row([(50, 140), (150, 171), (171, 176)])
TT[171:176] = 1
BLK = blocks_of(image_row([(50, 140), (150, 171)]))
BLK[171:176] = 2          # adjacent to block 1 but a different image (ids differ)


@pytest.mark.parametrize("window", [None, 7, 40])
def test_block_visibility_is_transformers_gemma3(window):
    """The reference's block rule is transformers' Gemma 3 mask (full: causal OR block; sliding:
    window AND (causal OR block)), and the engine computes that mask."""
    mu = pytest.importorskip("transformers.masking_utils")
    g3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    tt = image_row([(50, 140), (150, 176)])[None]
    blk = g3.get_block_sequence_ids_for_mask(tt)
    assert torch.equal(blk[0], blocks_of(tt[0]))
    qi, ki, b = ar(S)[:, None], ar(S)[None, :], torch.zeros((), dtype=torch.long)
    fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blk))
    if window is not None:
        fn = mu.and_masks(fn, mu.sliding_window_overlay(window))
    hf = fn(b, b, qi, ki)
    ours = visibility(ar(S), ar(S), True, window=window, q_block=blk[0], k_block=blk[0])[0, 0]
    assert torch.equal(hf, ours)
    plain = visibility(ar(S), ar(S), True, window=window)[0, 0]
    assert (ours & ~plain).any(), "the blocks must add visible keys"

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, S, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    dense = torch.softmax((q @ k.transpose(-1, -2) / 4.0).masked_fill(~hf, float("-inf")), -1) @ v
    for dtype in (torch.float64, torch.float32):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=ar(S), k_pos=ar(S), window=window,
                        q_block=blk[0], k_block=blk[0])
        a, r = error(out, dense)
        print(f"[blocks window={window} vs transformers mask {dtype}] abs={a:.2e} rel={r:.2e}")
        assert r <= TOL[dtype]


def _layouts():
    """(label, q index, k index): shard-like query sets against all keys in some order."""
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(7))
    zig = torch.cat([ar(0, 50), ar(150, 200)])                       # Head-Tail: rank 0 of 2
    return [("whole", ar(S), ar(S)),
            ("shard0-of-2", ar(0, 100), ar(S)),                         # block 0 continues on rank 1
            ("shard1-of-2", ar(100, 200), ar(S)),
            ("head-tail", zig, ar(S)),
            ("first-tile-vs-permuted-keys", ar(0, 64), perm),           # a query tile whose block keys sit in later tiles
            ("keys-prefix", ar(40, 104), ar(0, 104))]


@pytest.mark.parametrize("window", [None, 9, 70])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_block_parity(window, dtype):
    for label, qi, ki in _layouts():
        run_parity(Case(q_pos=qi, k_pos=ki, q_block=BLK[qi], k_block=BLK[ki], D=48, Hq=4, Hk=2,
                        dtype=dtype, window=window, seed=int(qi[0]) + 1), f"blocks {label} window={window}")


def test_block_parity_with_docs_and_batch_rows():
    """Per-row [B, S] positions, documents and blocks (a block never crosses a document: the doc
    rule still applies), padding keys (-1) never seen; sinks and softcap on top."""
    doc0 = torch.cat([torch.zeros(120, dtype=torch.long), torch.ones(72, dtype=torch.long),
                      torch.full((8,), -1)])
    doc1 = torch.zeros(S, dtype=torch.long)
    blk1 = blocks_of(image_row([(10, 30), (60, 190)]))
    doc, blk = torch.stack([doc0, doc1]), torch.stack([BLK, blk1])
    blk[0, 192:] = -1
    pos = ar(S).expand(2, S)
    for opts in (dict(), dict(window=33), dict(softcap=3.0, sinks=True)):
        run_parity(Case(B=2, q_pos=pos[:, 30:150], k_pos=pos, q_doc=doc[:, 30:150], k_doc=doc,
                        q_block=blk[:, 30:150], k_block=blk, D=32, Hq=2, Hk=1, dtype=torch.float64,
                        seed=5, **opts), f"blocks+docs {opts}")


def test_blocks_ignored_without_causal():
    """Without ``causal`` every key of the document is visible already: the block ids change nothing."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 90, 16, generator=gen) for _ in range(3))
    kw = dict(q_pos=ar(90), k_pos=ar(90), causal=False, window=20)
    a = attention(q, k, v, **kw)
    b = attention(q, k, v, q_block=BLK[:90], k_block=BLK[:90], **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("window", [None, 30])
def test_block_partials_merge_exactly(window):
    """Two partial attentions over disjoint key sets (a shard edge inside an image), merged by lse,
    equal the whole: values and every gradient."""
    gen = torch.Generator().manual_seed(11)
    qi = ar(60, 130)
    q = torch.randn(1, 2, qi.numel(), 32, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, S, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, S, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, qi.numel(), 32, generator=gen, dtype=torch.float64)
    kw = dict(q_pos=qi, q_block=BLK[qi], window=window, return_lse=True)
    whole, _ = attention(q, k, v, k_pos=ar(S), k_block=BLK, **kw)
    g_whole = torch.autograd.grad((whole * w).sum(), (q, k, v))
    cut = 100
    oa, la = attention(q, k[:, :, :cut], v[:, :, :cut], k_pos=ar(cut), k_block=BLK[:cut], **kw)
    ob, lb = attention(q, k[:, :, cut:], v[:, :, cut:], k_pos=ar(cut, S), k_block=BLK[cut:], **kw)
    merged, _ = merge_partial_attention(oa, la, ob, lb)
    g_merged = torch.autograd.grad((merged * w).sum(), (q, k, v))
    errs = [error(merged, whole)] + [error(a, b) for a, b in zip(g_merged, g_whole)]
    print(f"[blocks merge window={window}] " + " ".join(f"abs={a:.2e} rel={r:.2e}" for a, r in errs))
    assert all(r <= 1e-12 for _, r in errs)
    # the future half holds visible block keys for some queries (else the test would prove nothing)
    assert torch.isfinite(lb).any() and (qi < cut).any()


def test_block_gradcheck():
    gen = torch.Generator().manual_seed(2)
    n = 20
    blk = blocks_of(image_row([(3, 9), (12, 18)], n))
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def f(q, k, v):
        out, lse = attention(q, k, v, q_pos=ar(n), k_pos=ar(n), window=4, q_block=blk, k_block=blk,
                             return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "base"])
def test_blocks_every_kernel_build(isa, monkeypatch):
    use_isa_or_skip(isa, monkeypatch)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for window in (None, 25):
            run_parity(Case(q_pos=ar(0, 100), k_pos=ar(S), q_block=BLK[:100], k_block=BLK, D=80, Hq=4,
                            Hk=2, dtype=dtype, seed=9, window=window, scale=0.3),
                       f"isa={isa} blocks window={window}")


def test_block_validation():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    kw = dict(q_pos=ar(4), k_pos=ar(6))
    with pytest.raises(ValueError, match="q_block and k_block must be given together"):
        attention(q, k, v, q_block=ar(4), **kw)
    with pytest.raises(ValueError, match="k_block must have shape"):
        attention(q, k, v, q_block=ar(4), k_block=ar(5), **kw)
    with pytest.raises(ValueError, match="q_block must be an integer tensor"):
        attention(q, k, v, q_block=torch.zeros(4), k_block=ar(6), **kw)
    with pytest.raises(ValueError, match="q_block and k_block must be given together"):
        torch.ops.hyper_parallel.attn_fwd(q, k, v, ar(4), ar(6), None, None, True, 1.0, q_block=ar(4))
    m = torch.device("meta")
    with pytest.raises(NotImplementedError, match="q_block / k_block"):
        attention(q.to(m), k.to(m), v.to(m), q_pos=ar(4, device=m), k_pos=ar(6, device=m),
                  q_block=ar(4, device=m), k_block=ar(6, device=m))
