"""CUDA attention routes (hyper_parallel/ops/cuda_routes.py, docs/attention_engine.md "CUDA routes").

1. Selection: every documented case picks its documented route (pure host logic, CPU).
2. Pieces: for random run layouts, the pieces of ``sdpa_lse_merge`` cover exactly the visible
   (query, key) pairs, each once.
3. Math: each route run on CPU tensors (the torch ops exist there: SDPA with
   ``causal_lower_right``, the CPU flash kernel with logsumexp and its backward; flash-attn's
   kernels through float64 stand-ins with its documented semantics) against the float64
   reference: out, lse (where the route returns it) and dq / dk / dv (plus dsinks), fp32, with
   an lse gradient where the route returns lse.
4. CUDA (skipped without a GPU): the same cases through ``attention`` on the device, bf16.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hyper_parallel.ops._cuda as cuda_backend
from hyper_parallel.ops import cuda_routes as cr
from hyper_parallel.ops import reference_attention
from hyper_parallel.ops.reference import visibility

from ._parity import error
from .test_attention import packed_docs

ar = torch.arange
C, S_L = 4, 64  # ranks, local length of the math cases
HEAD_TAIL_Q = torch.cat([ar(S_L // 2, S_L), ar(7 * S_L // 2, 4 * S_L)])  # rank 1 of 4: chunks 1 and 6
SHARD_ORDER_K = torch.cat([torch.cat([ar(r * 32, r * 32 + 32), ar((7 - r) * 32, (8 - r) * 32)])
                           for r in range(C)])  # Head-Tail K/V all-gathered in rank order


def meta(q_pos, k_pos, causal=True, device="cuda", dtype=torch.bfloat16, D=64, Dv=64, **kw):
    kw["flash"] = cr.flash_usable(device, dtype, D, Dv)
    kw["flash_attn"] = kw["flash"] and kw.get("flash_attn", False)
    return cr.CallMeta(device=device, dtype=dtype, head_dim=D, v_head_dim=Dv, causal=causal,
                       q_runs=cr.runs_of(q_pos), k_runs=cr.runs_of(k_pos), **kw)


CHUNK = dict(q_pos=ar(128, 192), k_pos=ar(256))
SELECTION = [
    ("contiguous chunk", CHUNK, {}, "sdpa_lower_right"),
    ("Head-Tail, keys in shard order", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K), {}, "sdpa_lower_right"),
    ("Head-Tail, lse needed", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K), dict(need_lse=True), "sdpa_lse_merge"),
    ("ring step, keys start inside the queries", dict(q_pos=ar(64, 128), k_pos=ar(96, 128)), {}, "sdpa_lse_merge"),
    ("full visibility", dict(CHUNK, causal=False), {}, "sdpa_full"),
    ("full visibility, lse needed", dict(CHUNK, causal=False), dict(need_lse=True), "sdpa_lse_merge"),
    ("sinks", CHUNK, dict(sinks=True), "sdpa_lse_merge"),
    ("lse needed, fp32 on CUDA", dict(CHUNK, dtype=torch.float32), dict(need_lse=True), "flex"),
    ("lse needed, Dv != D", dict(CHUNK, Dv=32), dict(need_lse=True), "flex"),
    ("lse needed, fp32 on CPU", dict(CHUNK, device="cpu", dtype=torch.float32), dict(need_lse=True), "sdpa_lse_merge"),
    ("ALiBi", CHUNK, dict(alibi=True), "flex"),
    ("contiguous chunk, fp32 on CUDA (no flash kernel: no mask materialised)", dict(CHUNK, dtype=torch.float32), {}, "flex"),
    ("full visibility, D not a multiple of 8 on CUDA", dict(CHUNK, causal=False, D=36, Dv=36), {}, "flex"),
    ("permuted keys, sorted back into one run", dict(q_pos=ar(200, 264), k_pos=torch.randperm(264, generator=torch.Generator().manual_seed(0))),
     dict(need_lse=True), "sdpa_lse_merge"),
    ("scattered key positions", dict(q_pos=ar(200, 264), k_pos=ar(0, 528, 2)), {}, "flex"),
    ("scattered query positions", dict(q_pos=ar(0, 128, 2), k_pos=ar(128)), {}, "flex"),
    ("per-batch positions differ", dict(q_pos=torch.stack([ar(64), ar(1, 65)]), k_pos=ar(65)), {}, "flex"),
    ("packed docs, flash-attn installed", CHUNK, dict(docs=True, flash_attn=True), "flash_varlen"),
    ("packed docs, no flash-attn (torch's flash varlen)", CHUNK, dict(docs=True), "flash_varlen"),
    ("packed docs on CPU", dict(CHUNK, device="cpu"), dict(docs=True), "flex"),
    ("packed docs, D not a multiple of 8", dict(CHUNK, D=36, Dv=36), dict(docs=True, flash_attn=True), "flex"),
    ("packed docs, lse needed", CHUNK, dict(docs=True, flash_attn=True, need_lse=True), "flex"),
    ("window, flash-attn installed", CHUNK, dict(window=32, flash_attn=True), "flash_window"),
    ("softcap, flash-attn installed", CHUNK, dict(softcap=True, flash_attn=True), "flash_window"),
    ("window, no flash-attn (torch's flash)", CHUNK, dict(window=32), "flash_window"),
    ("softcap, no flash-attn", CHUNK, dict(softcap=True), "flex"),
    ("window, flash-attn, fp32", dict(CHUNK, dtype=torch.float32), dict(window=32, flash_attn=True), "flex"),
    ("window + docs, flash-attn", CHUNK, dict(window=32, docs=True, flash_attn=True), "flash_varlen"),
]


@pytest.mark.parametrize("name,where,opts,route", SELECTION, ids=[c[0] for c in SELECTION])
def test_route_selection(name, where, opts, route):
    p = cr.plan(meta(**where, **opts))
    print(f"{name}: {p.route} ({p.reason}), key order {p.key_order}, pieces {len(p.pieces)}")
    assert p.route == route


def test_head_tail_lower_right_is_two_calls_on_sorted_keys():
    p = cr.plan(meta(HEAD_TAIL_Q, SHARD_ORDER_K))
    assert p.key_order is not None and len(p.pieces) == 2
    # chunk 1 (positions 32..63) sees keys 0..63, chunk 6 (224..255) sees 0..255 (sorted order)
    assert p.pieces == ((0, 32, 0, 64), (32, 64, 0, 256))


def test_routes_table_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "attention_engine.md").read_text()
    sec = doc.split("## CUDA routes", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(\w+)` \|", sec, flags=re.M))
    assert named == set(cr.ROUTES), f"docs table routes {sorted(named)} != ROUTES {sorted(cr.ROUTES)}"


@pytest.mark.parametrize("seed", range(6))
def test_pieces_cover_visible_pairs_once(seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(8, generator=g)
    k_pos = torch.cat([ar(int(c) * 16, int(c) * 16 + 16) for c in perm[:6]])
    q_pos = torch.cat([ar(int(c) * 16 + 3, int(c) * 16 + 16) for c in perm[6:8].sort().values])
    p = cr.plan(meta(q_pos, k_pos, need_lse=True))
    assert p.route == "sdpa_lse_merge"
    k_sorted = k_pos if p.key_order is None else torch.cat([k_pos[i:i + n] for i, n in p.key_order])
    count = torch.zeros(q_pos.numel(), k_pos.numel(), dtype=torch.long)
    for pc in p.pieces:
        blk = torch.ones(pc.q1 - pc.q0, pc.k1 - pc.k0, dtype=torch.long)
        count[pc.q0:pc.q1, pc.k0:pc.k1] += blk.tril() if pc.causal else blk
        if pc.causal:
            assert pc.q1 - pc.q0 == pc.k1 - pc.k0
            assert torch.equal(q_pos[pc.q0:pc.q1], k_sorted[pc.k0:pc.k1])
    vis = visibility(q_pos, k_sorted, True)[0, 0].long()
    assert torch.equal(count, vis), "pieces must cover each visible pair exactly once"


# ------------------------------------------------------------------------------------------
# flash-attn stand-ins (float64 math with the package's documented semantics)
def _flash_dense(q, k, v, softmax_scale, causal, window_size, softcap):
    """[B, S, H, D] -> [B, Sq, H, Dv]; causal aligned bottom-right, window (left, right)."""
    Sq, Sk, H, Hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(H // Hk, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = ar(Sq)[:, None] + (Sk - Sq), ar(Sk)[None, :]
    vis = (j <= i) if causal else torch.ones(Sq, Sk, dtype=torch.bool)
    if window_size[0] >= 0:
        vis = vis & (j >= i - window_size[0])
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()).to(q.dtype)


def flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap):
    return _flash_dense(q, k, v, softmax_scale, causal, window_size, softcap)


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size,
                           softcap):
    outs = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        assert b - a <= max_q and d - c <= max_k
        outs.append(_flash_dense(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, causal,
                                 window_size, softcap)[0])
    return torch.cat(outs)


STANDINS = dict(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
DOC = packed_docs([40, 70, 90, 30], pad=26)  # 256 tokens, the last 26 padding
MATH = [
    ("sdpa_lower_right", "contiguous chunk", dict(q_pos=ar(128, 192), k_pos=ar(256)), {}),
    ("sdpa_lower_right", "Head-Tail", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K), {}),
    ("sdpa_full", "full visibility", dict(q_pos=ar(64), k_pos=SHARD_ORDER_K, causal=False), {}),
    ("sdpa_lse_merge", "Head-Tail + lse", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K), dict(lse=True)),
    ("sdpa_lse_merge", "ring step + lse", dict(q_pos=ar(64, 128), k_pos=ar(96, 160)), dict(lse=True)),
    ("sdpa_lse_merge", "full + lse", dict(q_pos=ar(64), k_pos=ar(256), causal=False), dict(lse=True)),
    ("sdpa_lse_merge", "sinks", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K), dict(sinks=True)),
    ("flash_window", "window + softcap", dict(q_pos=HEAD_TAIL_Q, k_pos=SHARD_ORDER_K),
     dict(window=40, softcap=5.0)),
    ("flash_varlen", "packed docs + padding, rank 1 of 2",
     dict(q_pos=ar(128, 256), k_pos=ar(256), q_doc=DOC[128:], k_doc=DOC), {}),
    ("flash_varlen", "packed docs + window", dict(q_pos=ar(64, 192), k_pos=ar(256), q_doc=DOC[64:192],
                                                  k_doc=DOC), dict(window=24)),
    ("flex", "ALiBi (fallback)", dict(q_pos=ar(128, 192), k_pos=ar(256)), dict(alibi=True)),
]


def _check(label, got, ref, tol):
    max_abs, rel = error(got, ref)
    print(f"{label}: max abs {max_abs:.2e} rel {rel:.2e} (tol {tol:g})")
    assert rel <= tol, f"{label}: rel {rel:.2e} > {tol:g}"


def _run_case(where, opts, device, dtype, tol, route=None, seed=0):
    where = dict(where)
    causal = where.pop("causal", True)
    kw = {k: t.to(device) for k, t in where.items()}
    B, Hq, Hk, D = 2, 4, 2, 32
    Sq, Sk = kw["q_pos"].shape[-1], kw["k_pos"].shape[-1]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, generator=g) for h, s in ((Hq, Sq), (Hk, Sk), (Hk, Sk)))
    dout, dlse = torch.randn(B, Hq, Sq, D, generator=g), torch.randn(B, Hq, Sq, generator=g)
    extra = {}
    if opts.get("window"):
        extra["window"] = opts["window"]
    if opts.get("softcap"):
        extra["softcap"] = opts["softcap"]
    if opts.get("sinks"):
        extra["sinks"] = torch.linspace(-1.0, 1.0, Hq)
    if opts.get("alibi"):
        extra["alibi_slopes"] = torch.tensor([2.0 ** -i for i in range(1, Hq + 1)])
    want_lse = bool(opts.get("lse") or opts.get("sinks"))
    if route is not None:  # the case really exercises the route it is named after
        meta_ = cr.describe(q, k, v, kw["q_pos"], kw["k_pos"], causal, kw.get("q_doc"),
                            extra.get("window"), extra.get("softcap"), extra.get("sinks"),
                            extra.get("alibi_slopes"), want_lse, flash_attn=True)
        assert cr.plan(meta_).route == route
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    sinks_ref = extra["sinks"].double().requires_grad_() if "sinks" in extra else None
    ref_extra = dict(extra, sinks=sinks_ref) if sinks_ref is not None else extra
    ro, rl = reference_attention(*ref_in, causal=causal, return_lse=True, **kw,
                                 **{k_: (t.double() if torch.is_tensor(t) else t) for k_, t in ref_extra.items()})
    loss = (ro * dout.double()).sum() + ((rl.where(torch.isfinite(rl), 0) * dlse.double()).sum() if want_lse else 0)
    loss.backward()
    inp = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    dev_extra = {k_: (t.to(device).requires_grad_() if k_ == "sinks" else
                      t.to(device) if torch.is_tensor(t) else t) for k_, t in extra.items()}
    return inp, dev_extra, kw, causal, (ro, rl, ref_in, sinks_ref), (dout, dlse), want_lse


def _compare(label, out, lse, inp, dev_extra, refs, grads, want_lse, tol):
    ro, rl, ref_in, sinks_ref = refs
    dout, dlse = grads
    _check(f"{label} out", out, ro, tol)
    loss = (out.float() * dout.to(out.device)).sum()
    if want_lse:
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse).cpu(), fin)
        _check(f"{label} lse", lse[fin.to(lse.device)], rl[fin], tol)
        loss = loss + (lse.where(torch.isfinite(lse), 0).float() * dlse.to(lse.device)).sum()
    loss.backward()
    gmax = max(t.grad.abs().max().item() for t in ref_in)
    for name, a, r in zip("qkv", inp, ref_in):
        max_abs = (a.grad.double().cpu() - r.grad).abs().max().item()
        print(f"{label} d{name}: max abs {max_abs:.2e} rel {max_abs / gmax:.2e} (tol {tol:g})")
        assert max_abs / gmax <= tol
    if sinks_ref is not None:
        _check(f"{label} dsinks", dev_extra["sinks"].grad, sinks_ref.grad, tol)


CPU_MATH = [c for c in MATH if c[0] != "flex"]  # FlexAttention has no CPU backward (its forward: test_device_backends_on_cpu)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("route,name,where,opts", CPU_MATH, ids=[c[1] for c in CPU_MATH])
def test_route_math_on_cpu(route, name, where, opts):
    inp, dev_extra, kw, causal, refs, grads, want_lse = _run_case(where, opts, "cpu", torch.float32,
                                                                  2e-5, route=route)
    out, lse = cuda_backend.cuda_attention(*inp, kw["q_pos"], kw["k_pos"], causal, kw.get("q_doc"),
                                           kw.get("k_doc"), 32 ** -0.5, need_lse=want_lse,
                                           flash_impl=STANDINS, **dev_extra)
    _compare(f"{route} [{name}] cpu fp32", out, lse, inp, dev_extra, refs, grads, want_lse, 2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device kernels)")
@pytest.mark.parametrize("route,name,where,opts", MATH, ids=[c[1] for c in MATH])
def test_route_math_on_cuda(route, name, where, opts):
    from hyper_parallel.ops import attention

    inp, dev_extra, kw, causal, refs, grads, want_lse = _run_case(where, opts, "cuda", torch.bfloat16, 3e-2)
    res = attention(*inp, causal=causal, scale=32 ** -0.5, return_lse=want_lse, **kw, **dev_extra)
    out, lse = res if want_lse else (res, None)
    ran = cr.plan(cr.describe(*inp, kw["q_pos"], kw["k_pos"], causal, kw.get("q_doc"), dev_extra.get("window"),
                              dev_extra.get("softcap"), dev_extra.get("sinks"), dev_extra.get("alibi_slopes"),
                              want_lse)).route
    route = route if ran == route else f"{route}->{ran} (flash-attn installed: {cr.flash_attn_installed()})"
    _compare(f"{route} [{name}] cuda bf16", out, lse, inp, dev_extra, refs, grads, want_lse, 3e-2)


BF16_MATH = [c for c in CPU_MATH if c[0].startswith("sdpa_")]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("route,name,where,opts", BF16_MATH, ids=[c[1] for c in BF16_MATH])
def test_route_math_on_cpu_bf16(route, name, where, opts):
    """The dtype handling the GPU runs (bf16 pieces, fp32 lse and merge, the bf16 dlse column)."""
    inp, dev_extra, kw, causal, refs, grads, want_lse = _run_case(where, opts, "cpu", torch.bfloat16,
                                                                  3e-2, route=route)
    out, lse = cuda_backend.cuda_attention(*inp, kw["q_pos"], kw["k_pos"], causal, kw.get("q_doc"),
                                           kw.get("k_doc"), 32 ** -0.5, need_lse=want_lse, **dev_extra)
    assert out.dtype == torch.bfloat16 and (lse is None or lse.dtype == torch.float32)
    _compare(f"{route} [{name}] cpu bf16", out, lse, inp, dev_extra, refs, grads, want_lse, 3e-2)


def test_varlen_segments_and_refusal():
    from hyper_parallel.ops._flash_attn import varlen_segments

    doc = packed_docs([40, 70, 90, 30], pad=26)
    qi, ki, cq, ck, mq, mk = varlen_segments(doc[128:], doc, (0, 128, 0, 256), 1)
    # queries 128..255: doc 2 (110..199) from 128, doc 3 (200..229), padding 230..255 (no segment)
    assert cq == [0, 72, 102] and ck == [0, 90, 120] and (mq, mk) == (72, 90)
    assert torch.equal(qi, ar(0, 102)) and torch.equal(ki, torch.cat([ar(110, 200), ar(200, 230)]))
    other = doc.clone()
    other[150] = 3  # the key docs at the queries' positions differ from the query docs
    assert varlen_segments(doc[128:], other, (0, 128, 0, 256), 1) is None
