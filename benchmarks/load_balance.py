"""Attention work per CP rank on packed rows: slowest rank / mean for five ways to split a row.

One command (default run: about 35 s of CPU; 2-4 min wall on 2 heavily shared cores)::

    python benchmarks/load_balance.py [--rows 1.0] [--max-row 524288] [--max-cp 32]

Rows: the main job's documents (the Python standard library's ``.py`` files as
``scripts/build_example_data.py`` collects them, ``--max-mb`` 8 MiB, tokenized with the shipped
``examples/data/stdlib_tokenizer``, + 1 EOS each; read from ``examples/data/stdlib/stdlib_docs.jsonl``
when built) and a long-tailed synthetic distribution (lognormal, median e^7.5 ~ 1800 tokens,
sigma 1.5), packed as the trainer packs them (documents back to back, the last one cut at the row
end), random rows per setting (fewer for long rows). Work = visible (query, key) pairs of the
model's attention layers (:mod:`hyper_parallel.distributed.context_parallel.balance.cost`, exact):
``causal``, ``window`` 4096, and ``mixed`` (one window-4096 layer and one global layer, summed).

Splits (equal tokens per rank unless said):

* ``contiguous`` — rank r holds tokens [r S/C, (r+1) S/C);
* ``head_tail`` — ours today: 2C chunks, rank r holds chunks r and 2C-1-r;
* ``torch_per_doc`` — PyTorch's ``_PerDocumentHeadTailLoadBalancer`` (called from the installed
  torch) as its sharding uses it: the row reordered by ``_generate_indices()`` and cut into C
  contiguous chunks. It needs every document padded to a multiple of 2C (padding does no work but
  adds tokens). Its index lists, per document, rank 0's head and tail, then rank 1's, ... (document
  major: ``[[8, 8]]``, C=2 gives ``[0,1,6,7,2,3,4,5,8,9,14,15,...]``), so cut into contiguous chunks
  whole documents land on one rank;
* ``torch_per_doc_rule`` — the rule its docstring draws: every rank holds its head and tail chunk of
  every document (read from the same index, regrouped rank-major);
* ``torch_ptrr`` — PyTorch's ``_PTRRLoadBalancer.ptrr_scheduling`` on 128-token blocks (its flex
  block) weighted by the same work;
* ``balanced`` — ours (``sdpa_hf_balanced``): the solver on 64-token blocks weighted by the engine
  tiles each block computes (``balance/tiles.py``), its spread counted in visible pairs like the others.

Engine-tile columns (the 64x64 tiles the CPU engine computes, what its time follows): ``head_tail_tiles``,
``pairs_solved_tiles`` (the split solved on visible pairs, the cost model before tiles) and
``balanced_tiles`` (ours).

Also the time to compute our split (cost + solver, one row). Writes a markdown table to stdout,
``benchmarks/results/load_balance.json`` and ``benchmarks/results/load_balance.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._machine import cpu_name  # noqa: E402
from hyper_parallel.distributed.context_parallel.balance.cost import (CAUSAL, AttentionKind,  # noqa: E402
                                                                      AttentionProfile, block_work)
from hyper_parallel.distributed.context_parallel.balance.solver import solve  # noqa: E402
from hyper_parallel.distributed.context_parallel.balance.tiles import block_tiles  # noqa: E402

PROFILES = {"causal": CAUSAL, "window": AttentionProfile((AttentionKind("window", 4096),)),
            "mixed": AttentionProfile((AttentionKind("window", 4096), AttentionKind("causal")))}
METHODS = ("contiguous", "head_tail", "torch_per_doc", "torch_per_doc_rule", "torch_ptrr", "balanced")
TILE_COLUMNS = ("head_tail_tiles", "pairs_solved_tiles", "balanced_tiles")   # spreads of engine tiles
ROWS = {8192: 40, 32768: 20, 131072: 8, 524288: 3}


def stdlib_lengths() -> list:
    """Token counts (+1 EOS) of the main job's documents."""
    from tokenizers import Tokenizer

    path = os.path.join(ROOT, "examples", "data", "stdlib", "stdlib_docs.jsonl")
    if os.path.exists(path):
        texts = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    else:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from build_example_data import stdlib_documents

        texts = [d["text"] for d in stdlib_documents(int(8 * 2**20))]
    tok = Tokenizer.from_file(os.path.join(ROOT, "examples", "data", "stdlib_tokenizer", "tokenizer.json"))
    return [len(e.ids) + 1 for e in tok.encode_batch(texts)]


def synthetic_lengths(rng, n: int = 20000) -> list:
    return [int(x) + 1 for x in np.minimum(rng.lognormal(7.5, 1.5, n), 2**20)]


def packed_rows(lengths: list, S: int, count: int, rng) -> list:
    """``count`` rows: documents in a random order back to back, the last one cut at S."""
    rows, lens = [], np.asarray(lengths)
    for _ in range(count):
        row, tot = [], 0
        while tot < S:
            for n in lens[rng.permutation(lens.size)]:
                n = int(min(n, S - tot))
                row.append(n)
                tot += n
                if tot >= S:
                    break
        rows.append(row)
    return rows


def _doc_ids(slots: list, reals: list) -> np.ndarray:
    d = np.full(sum(slots), -1, dtype=np.int64)
    pos = 0
    for i, (m, n) in enumerate(zip(slots, reals)):
        d[pos:pos + n] = i
        pos += m
    return d


def spreads(row: list, S: int, cp: int, profile) -> dict:
    """Slowest/mean work for every method on one row."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer)

    def sp(loads):
        loads = np.asarray(loads, dtype=np.float64)
        return float(loads.max() / loads.mean())

    tok = block_work(None, 1, profile, lengths=row)                       # per-token work [S]
    L = S // cp
    out = {"contiguous": sp(tok.reshape(cp, L).sum(1))}
    ch = tok.reshape(2 * cp, -1).sum(1)
    out["head_tail"] = sp([ch[r] + ch[2 * cp - 1 - r] for r in range(cp)])
    slots = [-(-n // (2 * cp)) * 2 * cp for n in row]
    ptok = block_work(_doc_ids(slots, row), 1, profile)
    idx = _PerDocumentHeadTailLoadBalancer([slots], cp, "cpu")._generate_indices()[0].numpy()
    out["torch_per_doc"] = sp(ptok[idx].reshape(cp, -1).sum(1))         # its index, cut in cp chunks
    rule = np.zeros(cp)                                                  # rank r: its 2 chunks of every doc
    pos = 0
    for m in slots:
        rule += ptok[idx[pos:pos + m]].reshape(cp, -1).sum(1)
        pos += m
    out["torch_per_doc_rule"] = sp(rule)
    w128 = tok.reshape(-1, 128).sum(1)
    groups = _PTRRLoadBalancer.ptrr_scheduling(torch.from_numpy(w128), cp)
    out["torch_ptrr"] = sp([w128[np.asarray(g)].sum() for g in groups.tolist()])
    doc = _doc_ids(row, row)
    w64 = block_work(doc, 64, profile)
    t0 = time.perf_counter()
    tiles = block_tiles(doc, 64, profile)                                 # the cost our solver balances
    blocks = solve(tiles, cp)
    out["split_ms"] = (time.perf_counter() - t0) * 1e3
    out["balanced"] = sp(w64[blocks].reshape(cp, -1).sum(1))
    out["balanced_tiles"] = sp(tiles[blocks].reshape(cp, -1).sum(1))
    out["head_tail_tiles"] = sp([c[r] + c[2 * cp - 1 - r] for c in [tiles.reshape(2 * cp, -1).sum(1)] for r in range(cp)])
    out["pairs_solved_tiles"] = sp(tiles[solve(w64, cp)].reshape(cp, -1).sum(1))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=float, default=1.0, help="scale the rows per setting (default 1.0)")
    ap.add_argument("--max-row", type=int, default=524288)
    ap.add_argument("--max-cp", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_balance.json"))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()
    sources = {"stdlib": stdlib_lengths(), "synthetic": synthetic_lengths(rng)}
    results = []
    for src, lengths in sources.items():
        for S, count in ROWS.items():
            if S > args.max_row:
                continue
            rows = packed_rows(lengths, S, max(2, int(count * args.rows)), rng)
            for cp in (2, 4, 8, 16, 32):
                if cp > args.max_cp:
                    continue
                for pname, prof in PROFILES.items():
                    per = [spreads(r, S, cp, prof) for r in rows]
                    rec = {"source": src, "row": S, "cp": cp, "profile": pname, "rows": len(rows),
                           "split_ms_p50": float(np.median([p["split_ms"] for p in per])),
                           "split_ms_max": float(max(p["split_ms"] for p in per))}
                    for m in METHODS + TILE_COLUMNS:
                        v = [p[m] for p in per]
                        rec[m] = {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90))}
                    results.append(rec)
    load = os.getloadavg()
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in load],
            "wall_s": round(time.perf_counter() - t_start, 1), "docs": {k: len(v) for k, v in sources.items()},
            "stdlib_median_tokens": float(np.median(sources["stdlib"])), "block": 64, "window": 4096}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"machine": meta, "results": results}, fh, indent=1)
    print(table(results))
    print(f"\n{meta}")
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return {"machine": meta, "results": results}


def table(results: list) -> str:
    cols = METHODS + TILE_COLUMNS
    lines = ["| source | row | cp | profile | " + " | ".join(f"{m} p50 / p90" for m in cols)
             + " | our split ms (p50 / max) |", "|---|---|---|---|" + "---|" * (len(cols) + 1)]
    for r in results:
        cells = " | ".join(f"{r[m]['p50']:.3f} / {r[m]['p90']:.3f}" for m in cols)
        lines.append(f"| {r['source']} | {r['row']} | {r['cp']} | {r['profile']} | {cells} | "
                     f"{r['split_ms_p50']:.1f} / {r['split_ms_max']:.1f} |")
    return "\n".join(lines)


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, pname in zip(axes, PROFILES):
        for m in METHODS:
            for S, style in ((32768, "-"), (131072, "--")):
                pts = sorted((r["cp"], r[m]["p90"]) for r in results
                             if r["source"] == "stdlib" and r["profile"] == pname and r["row"] == S)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{m} ({S // 1024}k)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pname}: p90 slowest/mean (main job docs)")
        ax.set_xlabel("cp")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("slowest rank / mean work")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
