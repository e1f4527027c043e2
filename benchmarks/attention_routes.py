"""Attention per visible score, every CUDA route against SDPA's flash / cuDNN kernels.

The companion of benchmarks/attention_cuda.py (same timing helpers): for each ``S_local`` one
call per CP layout, each through :func:`hyper_parallel.ops._cuda.cuda_attention` (the route the
planner picks is recorded), forward + backward, bf16, B=1, Hq=8, Hk=2, D=64 (``--heads``,
``--dim``), C=4 ranks, S_global = 4 * S_local:

* ``chunk``: the last rank's contiguous chunk over all gathered keys (``sdpa_lower_right``);
* ``head_tail``: rank 0 of Head-Tail (chunks 0 and 7), keys in shard order (``sdpa_lower_right``
  after one key reorder); ``head_tail_lse``: the same with ``return_lse`` (``sdpa_lse_merge``);
* ``full``: non-causal (``sdpa_full``); ``docs``: packed documents of S_local/4 tokens
  (``flash_varlen`` with flash-attn, else ``flex``); ``window``: window 4096 (``flash_window`` /
  ``flex``); ``flex``: the chunk case forced through FlexAttention (the path before the routes).

Throughput = visible (query, key) pairs per second, counted exactly from the positions; the
baseline is SDPA's flash and cuDNN kernels (``sdpa_kernel`` pinned) on a square causal block of
S_local, best of the two; ``vs_flash`` = route throughput / baseline throughput (fwd+bwd).
Stops starting new sizes after ``--budget-s``. ``--dry-run``: CPU, tiny sizes, forward and
backward where the CPU kernels have one (the code path and the JSON, not the speed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from hyper_parallel.ops import _cuda as cuda_backend  # noqa: E402
from hyper_parallel.ops import cuda_routes  # noqa: E402

C = 4
CASES = ("chunk", "head_tail", "head_tail_lse", "full", "docs", "window", "flex")


def layout(case: str, s: int, dev):
    """(q_pos, k_pos, causal, q_doc, k_doc, window, need_lse) of one case at S_local = s."""
    ar = lambda a, b: torch.arange(a, b, device=dev)  # noqa: E731
    sg = C * s
    if case in ("chunk", "flex", "full", "window", "docs"):
        q_pos = ar((C - 1) * s, sg)
        doc = ar(0, sg) // max(1, s // 4) if case == "docs" else None
        return (q_pos, ar(0, sg), case != "full", None if doc is None else doc[(C - 1) * s:], doc,
                4096 if case == "window" else None, False)
    h = s // 2
    shards = [torch.cat([ar(r * h, (r + 1) * h), ar((2 * C - 1 - r) * h, (2 * C - r) * h)]) for r in range(C)]
    return shards[0], torch.cat(shards), True, None, None, None, case == "head_tail_lse"


def visible_pairs(q_pos, k_pos, causal, q_doc, k_doc, window) -> int:
    """Exact count of visible (query, key) pairs (per head), without an Sq x Sk mask."""
    if not causal:
        return q_pos.numel() * k_pos.numel()
    ks = torch.sort(k_pos).values
    hi = torch.searchsorted(ks, q_pos, right=True)
    lo = torch.zeros_like(hi)
    if window is not None:
        lo = torch.searchsorted(ks, q_pos - window, right=True)
    if q_doc is not None:  # docs are position-contiguous here: keys from the doc's first position
        first = torch.searchsorted(k_doc, q_doc, right=False)
        lo = torch.maximum(lo, first)
    return int((hi - lo).clamp(min=0).sum())


def timed(fn, reps: int, dev) -> float:
    """Median ms of fn() after one warm-up (CUDA events on CUDA, perf_counter on CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def baseline(s, dtype, hq, hk, d, reps, dev) -> dict:
    """SDPA flash and cuDNN on a square causal block of s (pairs s(s+1)/2 per head), fwd+bwd ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, device=dev, dtype=dtype, generator=g).requires_grad_()
               for h in (hq, hk, hk))
    out = {}
    backends = (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)) \
        if dev.type == "cuda" else (("math", SDPBackend.MATH),)
    for name, be in backends:
        def step():
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk).sum().backward()
        try:
            out[name] = timed(step, reps, dev)
        except RuntimeError as exc:  # a kernel this GPU / torch lacks
            out[name] = None
            print(f"baseline {name} unavailable: {str(exc).splitlines()[0][:120]}", flush=True)
    return out


def run_case(case, s, dtype, hq, hk, d, reps, dev) -> dict:
    q_pos, k_pos, causal, q_doc, k_doc, window, need_lse = layout(case, s, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    sq, sk = q_pos.numel(), k_pos.numel()
    q, k, v = (torch.randn(1, h, n, d, device=dev, dtype=dtype, generator=g) for h, n in ((hq, sq), (hk, sk), (hk, sk)))
    meta = cuda_routes.describe(q, k, v, q_pos, k_pos, causal, q_doc, window, None, None, None, need_lse)
    route = "flex" if case == "flex" else cuda_routes.plan(meta).route
    grad = dev.type == "cuda" or route != "flex"  # FlexAttention has no CPU backward

    def call():
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
        if case == "flex":
            out, lse = cuda_backend.flex_attention_call(qq, kk, vv, q_pos, k_pos, causal, q_doc, k_doc, d ** -0.5,
                                                        window=window)
        else:
            out, lse = cuda_backend.cuda_attention(qq, kk, vv, q_pos, k_pos, causal, q_doc, k_doc, d ** -0.5,
                                                   window=window, need_lse=need_lse)
        if grad:
            loss = out.float().sum() + (lse.float().sum() if need_lse else 0)
            loss.backward()

    ms = timed(call, reps, dev)
    pairs = visible_pairs(q_pos, k_pos, causal, q_doc, k_doc, window)
    return dict(case=case, route=route, s_local=s, fwd_bwd=grad, ms=ms, pairs_per_head=pairs,
                gpairs_per_s=pairs * hq / ms / 1e6)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("HQ", "HK"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (the code path, not the speed)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "attention_routes.json"))
    a = ap.parse_args(argv)
    if a.dry_run:
        from torch.nn.attention.flex_attention import flex_attention

        cuda_backend._compiled = flex_attention  # eager: compiled FlexAttention on CPU has no lse
        dev, dtype, sizes, reps = torch.device("cpu"), torch.float32, [64], 1
    elif not torch.cuda.is_available():
        sys.exit("attention_routes.py needs a CUDA device (or --dry-run)")
    else:
        dev, dtype, sizes, reps = torch.device("cuda"), torch.bfloat16, a.sizes, a.reps
    info = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, cuda=torch.version.cuda, heads=a.heads, dim=a.dim, C=C,
                dtype=str(dtype), flash_attn=cuda_routes.flash_attn_installed())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save():  # after every row: a run cut by its timeout keeps what it measured
        with open(a.out, "w") as fh:
            json.dump(dict(machine=info, results=rows), fh, indent=1)

    t0, rows = time.time(), []
    for s in sizes:
        if time.time() - t0 > a.budget_s:
            print(f"budget {a.budget_s}s spent: sizes from {s} not run", flush=True)
            break
        base = baseline(s, dtype, *a.heads, a.dim, reps, dev)
        best = min((v for v in base.values() if v), default=None)
        base_rate = (s * (s + 1) / 2) * a.heads[0] / best / 1e6 if best else None
        for case in a.cases:
            row = run_case(case, s, dtype, *a.heads, a.dim, reps, dev)
            row.update(baseline_ms=base, baseline_gpairs_per_s=base_rate,
                       vs_flash=row["gpairs_per_s"] / base_rate if base_rate and row["fwd_bwd"] else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    save()
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
