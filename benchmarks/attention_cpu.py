"""CPU benchmark of hyper_parallel.ops.attention (C++ engine) against the dense-mask baselines.

Setting (the context-parallel local attention): B=1, Hq=8, Hk=2, D=64, C=4 ranks,
S_global = 4 * S_local; queries are one rank's contiguous chunk (positions
[r*S_local, (r+1)*S_local)), keys the whole sequence, causal with that offset. Every rank r is
measured; the report gives the last rank (r = C-1, the heaviest: 7/8 of the score matrix is
visible) and the average over all ranks (1/2 visible on average).

Implementations:
  engine : hyper_parallel.ops.attention (tile skipping from the positions, no mask).
  sdpa   : F.scaled_dot_product_attention with the materialized bool [Sq, Sk] offset mask
           (built inside the timed region) and enable_gqa=True (or --sdpa-gqa repeat).
  flex   : torch.nn.attention.flex_attention compiled for CPU with a block mask built from the
           offset (forward only: FlexAttention has no CPU backward in this torch).

Time: best of --reps runs after one warm-up (min is the robust estimator on a noisy machine);
the implementations are interleaved rep by rep, so load from other processes hits all alike.
fwd runs under torch.no_grad(); fwd+bwd is forward plus backward of (out * dout).sum().
Memory: peak resident-set growth during one call, measured with the kernel's high-water mark
(/proc/self/status VmHWM, reset through /proc/self/clear_refs) minus the resident set just
before the call, for the last rank. It runs in a child process started with
MALLOC_MMAP_THRESHOLD_=65536 so that every large buffer is mmap-ed and returned on free (torch's
CPU allocator does not cache), which makes the resident set track live tensors; timing runs in
the parent with the default allocator settings (the fixed threshold slows every method down).
Inputs and their gradients of earlier calls are excluded;
outputs / gradients produced by the call are included (they are O(S) for every method).

On a shared machine, `--threads 1 --timer cpu` measures process CPU time single-threaded:
load from other processes then hardly changes the numbers (the default wall-clock numbers on
all cores are what a user sees, but they are only as quiet as the machine).

Usage:
  python benchmarks/attention_cpu.py                 # full table (several minutes on 2 cores)
  python benchmarks/attention_cpu.py --quick         # S_local=1024 only, fp32 + bf16
  python benchmarks/attention_cpu.py --out results.json --ranks last
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch._dynamo.config.recompile_limit = 64  # flex: one compile per block-mask / grad mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.ops import attention, engine_info  # noqa: E402

B, HQ, HK, D, C = 1, 8, 2, 64, 4


# ------------------------------------------------------------------------------------------
# memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmHWM") > 0
    except OSError:
        return False


def peak_extra_mb(fn) -> float | None:
    """Peak resident-set growth (MiB) while fn() runs; None if the kernel can't reset VmHWM."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_kb("VmRSS")
    res = fn()
    peak = _status_kb("VmHWM")
    del res
    gc.collect()
    return max(0, peak - before) / 1024.0


def memory_in_child(argv: list[str]) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-child"],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"memory child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
def query_positions(s_local: int, rank: int, layout: str) -> torch.Tensor:
    """Global positions of rank `rank`'s queries: one contiguous chunk, or (Head-Tail) chunks
    rank and 2C-1-rank of 2C half-size chunks (the design's load balance for Colossal)."""
    if layout == "contiguous":
        return torch.arange(rank * s_local, (rank + 1) * s_local)
    h = s_local // 2
    tail = 2 * C - 1 - rank
    return torch.cat([torch.arange(rank * h, (rank + 1) * h), torch.arange(tail * h, (tail + 1) * h)])


class Problem:
    def __init__(self, s_local: int, rank: int, dtype: torch.dtype, seed: int = 0,
                 layout: str = "contiguous"):
        g = torch.Generator().manual_seed(seed)
        self.s_local, self.rank, self.dtype, self.layout = s_local, rank, dtype, layout
        self.sq, self.sk = s_local, C * s_local
        self.offset = rank * s_local
        self.q = torch.randn(B, HQ, self.sq, D, generator=g).to(dtype)
        self.k = torch.randn(B, HK, self.sk, D, generator=g).to(dtype)
        self.v = torch.randn(B, HK, self.sk, D, generator=g).to(dtype)
        self.dout = torch.randn(B, HQ, self.sq, D, generator=g).to(dtype)
        self.q_pos = query_positions(s_local, rank, layout)
        self.k_pos = torch.arange(self.sk)

    def leaves(self):
        return [t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v)]


def engine_call(p: Problem, grad: bool):
    if not grad:
        with torch.no_grad():
            return attention(p.q, p.k, p.v, q_pos=p.q_pos, k_pos=p.k_pos)
    q, k, v = p.leaves()
    out = attention(q, k, v, q_pos=p.q_pos, k_pos=p.k_pos)
    out.backward(p.dout)
    return out, q.grad, k.grad, v.grad


def sdpa_call(p: Problem, grad: bool, gqa_mode: str):
    def run(q, k, v):
        mask = p.k_pos[None, :] <= p.q_pos[:, None]  # materialized [Sq, Sk] offset mask
        if gqa_mode == "repeat":
            rep = HQ // HK
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                  v.repeat_interleave(rep, 1), attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    if not grad:
        with torch.no_grad():
            return run(p.q, p.k, p.v)
    q, k, v = p.leaves()
    out = run(q, k, v)
    out.backward(p.dout)
    return out, q.grad, k.grad, v.grad


_FLEX = {}


def flex_call(p: Problem, grad: bool):
    if grad:
        raise NotImplementedError("FlexAttention does not support backward on CPU")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cfg = (p.sq, p.sk, p.dtype)
    if _FLEX.get("cfg") != cfg:  # one compiled function per shape / dtype, no recompile limit
        torch._dynamo.reset()
        _FLEX.clear()
        _FLEX["cfg"] = cfg
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    key = (p.sq, p.sk, p.layout, p.offset)
    if key not in _FLEX:
        off, qpos = p.offset, p.q_pos

        if p.layout == "contiguous":
            def mask_mod(b, h, qi, ki):
                return ki <= qi + off
        else:
            def mask_mod(b, h, qi, ki):
                return ki <= qpos[qi]

        _FLEX[key] = create_block_mask(mask_mod, 1, 1, p.sq, p.sk, device="cpu")
    with torch.no_grad():
        return _FLEX["fn"](p.q, p.k, p.v, block_mask=_FLEX[key], enable_gqa=True)


# ------------------------------------------------------------------------------------------
def measure(args) -> dict:
    sizes = [1024] if args.quick else args.sizes
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    ranks = [C - 1] if (args.ranks == "last" or args.memory_child) else list(range(C))
    results, errors = [], []
    hwm = _can_reset_hwm()
    for s_local in sizes:
        for dname in args.dtypes:
            dtype = dtypes[dname]
            for r in ranks:
                p = Problem(s_local, r, dtype, seed=r, layout=args.layout)
                reps = args.reps if s_local < 4096 else max(1, args.reps - 1)
                impls = {
                    "engine": lambda grad: engine_call(p, grad),
                    "sdpa": lambda grad: sdpa_call(p, grad, args.sdpa_gqa),
                    "flex": lambda grad: flex_call(p, grad),
                }
                if args.no_flex:
                    impls.pop("flex")
                visible = float((p.k_pos[None, :] <= p.q_pos[:, None]).float().mean())
                rows = {name: dict(impl=name, s_local=s_local, s_global=C * s_local,
                                   dtype=dname, rank=r, layout=args.layout,
                                   visible_fraction=visible)
                        for name in impls}
                for mode, grad in (("fwd", False), ("fwd_bwd", True)):
                    live = {}
                    for name, fn in impls.items():  # warm-up (compiles flex); drop failures
                        try:
                            fn(grad)
                            live[name] = fn
                        except Exception as exc:  # noqa: BLE001 - report, don't abort
                            rows[name][f"{mode}_s"] = None
                            rows[name][f"{mode}_na"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    if args.memory_child:
                        if r == C - 1 and hwm:
                            for name, fn in live.items():
                                rows[name][f"{mode}_peak_mib"] = peak_extra_mb(lambda: fn(grad))
                        continue
                    # interleave the implementations rep by rep so that load changes on a
                    # shared machine hit all of them alike; keep the best time of each
                    best = {name: float("inf") for name in live}
                    clock = time.process_time if args.timer == "cpu" else time.perf_counter
                    for _ in range(reps):
                        for name, fn in live.items():
                            t0 = clock()
                            fn(grad)
                            best[name] = min(best[name], clock() - t0)
                    for name in live:
                        rows[name][f"{mode}_s"] = best[name]
                log = sys.stderr if args.memory_child else sys.stdout
                for name, row in rows.items():
                    results.append(row)
                    print(f"  S_local={s_local:5d} {dname} rank={r} {name:6s} "
                          f"fwd={_fmt_s(row.get('fwd_s'))} fwd+bwd={_fmt_s(row.get('fwd_bwd_s'))}",
                          flush=True, file=log)
                if r == C - 1 and not args.memory_child:
                    # sanity: the engine and the baseline compute the same thing
                    e = engine_call(p, False).float()
                    s = sdpa_call(p, False, args.sdpa_gqa).float()
                    errors.append(dict(s_local=s_local, dtype=dname, rank=r,
                                       max_abs_diff_vs_sdpa=(e - s).abs().max().item()))
                del p
                gc.collect()
    return dict(results=results, parity=errors, hwm_memory=hwm)


def _fmt_s(x):
    return "n/a" if x is None else f"{x * 1e3:8.1f}ms"


def summarize(results: list[dict]) -> list[dict]:
    """Per (S_local, dtype): times and ratios vs the engine for the last rank (contiguous layout,
    the heaviest) or the slowest rank (Head-Tail, per implementation: what bounds a CP step),
    and the average over all ranks."""
    out = []
    keys = sorted({(r["s_local"], r["dtype"]) for r in results}, key=lambda k: (k[1], k[0]))
    for s_local, dname in keys:
        rows = [r for r in results if r["s_local"] == s_local and r["dtype"] == dname]
        ranks = sorted({r["rank"] for r in rows})
        head_tail = rows[0].get("layout") == "head_tail"
        for scope in ("last", "avg"):
            sel = [r for r in rows if scope == "avg" or head_tail or r["rank"] == max(ranks)]
            if (scope == "avg" or head_tail) and len(ranks) < C:
                continue

            def t(impl, mode):
                vals = [r.get(f"{mode}_s") for r in sel if r["impl"] == impl]
                if not vals or any(v is None for v in vals):
                    return None
                return sum(vals) / len(vals) if scope == "avg" else max(vals)

            label = ("HT max" if head_tail else "C-1") if scope == "last" else "avg(0..C-1)"
            entry = dict(s_local=s_local, s_global=C * s_local, dtype=dname,
                         layout=rows[0].get("layout", "contiguous"), ranks=label)
            for impl in ("engine", "sdpa", "flex"):
                for mode in ("fwd", "fwd_bwd"):
                    entry[f"{impl}_{mode}_s"] = t(impl, mode)
            for impl in ("sdpa", "flex"):
                for mode in ("fwd", "fwd_bwd"):
                    a, b = entry[f"{impl}_{mode}_s"], entry[f"engine_{mode}_s"]
                    entry[f"{impl}_over_engine_{mode}"] = (a / b) if (a and b) else None
            last = [r for r in rows if r["rank"] == max(ranks)]
            for r in last:
                for mode in ("fwd", "fwd_bwd"):
                    if f"{mode}_peak_mib" in r:
                        entry[f"{r['impl']}_{mode}_peak_mib"] = r[f"{mode}_peak_mib"]
                    if f"{mode}_na" in r:
                        entry[f"{r['impl']}_{mode}_na"] = r[f"{mode}_na"]
            out.append(entry)
    return out


def print_table(summary: list[dict]) -> None:
    def f(x, spec="{:7.1f}"):
        return "    n/a" if x is None else spec.format(x)

    print()
    print("Times in ms (best of reps); ratio = baseline time / engine time (>1: engine faster).")
    print("mem = peak extra RSS MiB during one fwd+bwd call (fwd for flex), last rank.")
    hdr = (f"{'S_loc':>5} {'dtype':>5} {'ranks':>11} | {'eng fwd':>7} {'sdpa':>7} {'flex':>7} "
           f"{'x sdpa':>6} {'x flex':>6} | {'eng f+b':>7} {'sdpa':>7} {'x sdpa':>6} | "
           f"{'mem eng':>7} {'sdpa':>7} {'flex':>7}")
    print(hdr)
    print("-" * len(hdr))
    for e in summary:
        ms = lambda x: None if x is None else x * 1e3  # noqa: E731
        print(f"{e['s_local']:>5} {e['dtype']:>5} {e['ranks']:>11} | "
              f"{f(ms(e['engine_fwd_s']))} {f(ms(e['sdpa_fwd_s']))} {f(ms(e['flex_fwd_s']))} "
              f"{f(e['sdpa_over_engine_fwd'], '{:6.2f}')} "
              f"{f(e['flex_over_engine_fwd'], '{:6.2f}')} | "
              f"{f(ms(e['engine_fwd_bwd_s']))} {f(ms(e['sdpa_fwd_bwd_s']))} "
              f"{f(e['sdpa_over_engine_fwd_bwd'], '{:6.2f}')} | "
              f"{f(e.get('engine_fwd_bwd_peak_mib'))} {f(e.get('sdpa_fwd_bwd_peak_mib'))} "
              f"{f(e.get('flex_fwd_peak_mib'))}")
    na = {k: v for e in summary for k, v in e.items() if k.endswith("_na")}
    for k, v in sorted(na.items()):
        print(f"  {k}: n/a ({v})")


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(cpu=cpu, logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(),
                engine=engine_info(), cpu_capability=torch.backends.cpu.get_cpu_capability())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="S_local=1024 only")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--ranks", choices=["all", "last"], default="all")
    ap.add_argument("--layout", choices=["contiguous", "head_tail"], default="contiguous",
                    help="queries: one contiguous chunk per rank, or Head-Tail (chunks r and "
                         "2C-1-r of 2C); head_tail reports the slowest rank instead of C-1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sdpa-gqa", choices=["enable_gqa", "repeat"], default="enable_gqa")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "attention_cpu.json"))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's default, all cores)")
    ap.add_argument("--timer", choices=["wall", "cpu"], default="wall",
                    help="wall: perf_counter; cpu: process CPU time (use with --threads 1 on "
                         "a shared machine: other processes' load then hardly matters)")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory child process")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(measure(args)["results"]))
        return 0
    info = machine()
    print(f"machine: {info}")
    t0 = time.time()
    data = measure(args)
    if not args.no_memory:
        mem = memory_in_child(argv if argv is not None else sys.argv[1:])
        for row in data["results"]:
            for m in mem:
                if all(m[k] == row[k] for k in ("impl", "s_local", "dtype", "rank")):
                    row.update({k: v for k, v in m.items() if k.endswith("_peak_mib")})
    summary = summarize(data["results"])
    print_table(summary)
    for e in data["parity"]:
        print(f"  parity S_local={e['s_local']} {e['dtype']}: max |engine - sdpa| = "
              f"{e['max_abs_diff_vs_sdpa']:.2e}")
    doc = dict(machine=info, setting=dict(B=B, Hq=HQ, Hk=HK, D=D, C=C, ranks=args.ranks,
                                          layout=args.layout,
                                          reps=args.reps, sdpa_gqa=args.sdpa_gqa,
                                          threads=torch.get_num_threads(), timer=args.timer,
                                          timing="best of reps after 1 warm-up, interleaved",
                                          memory="peak VmHWM - VmRSS before the call, MiB"),
               summary=summary, results=data["results"], parity=data["parity"],
               wall_s=time.time() - t0)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
