"""Render the device check's JSONs as one markdown section and put it into docs/performance.md.

``python benchmarks/device_report.py --routes R.json --long L.json --doc docs/performance.md``
replaces the text between ``<!-- device_check:begin -->`` and ``<!-- device_check:end -->`` in
``--doc`` (written in place, or to ``--doc-out``) and writes the combined JSON to ``--json-out``.
scripts/device_check.sh calls it on the device (its ``$OUT`` gets the edited copy) and on CPU in
its dry run.
"""
from __future__ import annotations

import argparse
import json
import re

BEGIN, END = "<!-- device_check:begin -->", "<!-- device_check:end -->"
ALST_ANCHOR = 500_000  # ALST: Llama-8B at 500K tokens on one H100
TARGET = 0.90  # every route at >= 90 % of SDPA-flash throughput per score (the FlexAttention case is the old path)


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def render(routes: dict, long: dict | None) -> str:
    m = routes["machine"]
    lines = [f"Device: **{m['device']}**, torch {m['torch']} (CUDA {m['cuda']}), flash-attn installed: "
             f"{m['flash_attn']}; {m['dtype']}, B=1, Hq/Hk={m['heads'][0]}/{m['heads'][1]}, D={m['dim']}, "
             f"C={m['C']}. Throughput = visible pairs × Hq / time (fwd+bwd); `vs flash` = that / SDPA "
             "flash-or-cuDNN on a square causal block of S_local (the better of the two).", "",
             "| S_local | case | route | fwd+bwd ms | G pairs/s | baseline G pairs/s | vs flash |",
             "|---|---|---|---|---|---|---|"]
    for r in routes["results"]:
        ms = f"{r['ms']:.2f}" + ("" if r.get("fwd_bwd", True) else " (fwd only)")
        lines.append(f"| {r['s_local']} | {r['case']} | `{r['route']}` | {ms} | "
                     f"{r['gpairs_per_s']:.3g} | {_fmt(r['baseline_gpairs_per_s'], '.3g')} | "
                     f"{_fmt(r['vs_flash'], '.2f')} |")
    rated = [r for r in routes["results"] if r["vs_flash"] is not None and r["case"] != "flex"]
    if rated:
        low = [f"{r['case']}@{r['s_local']} ({r['vs_flash']:.2f})" for r in rated if r["vs_flash"] < TARGET]
        lines += ["", f"Routes at ≥ {TARGET:.2f} of SDPA flash / cuDNN per score: {len(rated) - len(low)} of "
                  f"{len(rated)}" + (f"; below: {', '.join(low)}." if low else ".")]
    if long is not None:
        lm = long["machine"]
        md = long["model"]
        lines += ["", f"Trainer, Llama hidden {md['hidden_size']}, intermediate {md['intermediate_size']}, heads "
                  f"{md['num_attention_heads']}/{md['num_key_value_heads']}, vocab {md['vocab_size']} "
                  f"({long['layers_run']} of {long['layers_full']} layers; the "
                  f"missing layers' weights are {long['missing_weights_gb']:.1f} GB), bf16 mixed precision: "
                  f"{long['mixed_precision_bf16']}, SGD, tiled loss + MLP, activation checkpointing + offload, "
                  f"on {lm['device']} ({lm['device_gb']:.1f} GB):", "",
                  "| sequence | ok | peak GB | step s |", "|---|---|---|---|"]
        for p in long["points"]:
            step = p.get("step_time_s", [None])[-1] if p["ok"] else None
            lines.append(f"| {p['seq']} | {'yes' if p['ok'] else 'no: ' + ('OOM' if p.get('oom') else 'failed')} | "
                         f"{_fmt(p.get('peak_gb'), '.2f')} | {_fmt(step, '.2f')} |")
        f = long.get("fit")
        longest = long.get("longest_measured")
        lines.append("")
        lines.append(f"Longest measured: **{longest}** tokens." + (
            f" Fit through {f['fit_seqs']}: {f['fixed_gb']:.2f} GB + {f['kb_per_token']:.1f} KB/token → "
            f"longest ≈ **{f['fitted_longest']}** tokens with these layers, ≈ **{f['fitted_longest_32_layers']}** "
            f"with all 32 (ALST: {ALST_ANCHOR} on one H100)." if f else " (no fit: fewer than two points)"))
    return "\n".join(lines)


def insert(doc_text: str, section: str) -> str:
    if BEGIN not in doc_text or END not in doc_text:
        raise ValueError(f"the document has no {BEGIN} ... {END} section to replace")
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), flags=re.S)
    return pat.sub(lambda _: f"{BEGIN}\n{section}\n{END}", doc_text, count=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", required=True)
    ap.add_argument("--long")
    ap.add_argument("--doc", required=True)
    ap.add_argument("--doc-out")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    with open(a.routes) as fh:
        routes = json.load(fh)
    long = None
    if a.long:
        with open(a.long) as fh:
            long = json.load(fh)
    section = render(routes, long)
    with open(a.doc) as fh:
        text = insert(fh.read(), section)
    with open(a.doc_out or a.doc, "w") as fh:
        fh.write(text)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(dict(routes=routes, long_context=long), fh, indent=1)
    print(section)


if __name__ == "__main__":
    main()
