"""scripts/device_check.sh cannot rot: its CPU dry run runs end to end and writes what the device
run writes (route benchmark rows for every case, the trainer sweep, the docs section), and the
report's fit and docs insertion are checked on synthetic numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention_routes  # noqa: E402
import device_report  # noqa: E402
import long_context_cuda  # noqa: E402


def test_fit_and_longest():
    pts = [{"seq": 16384, "ok": True, "peak_gb": 20.0}, {"seq": 32768, "ok": True, "peak_gb": 24.0},
           {"seq": 65536, "ok": False}]
    f = long_context_cuda.fit(pts, device_gb=80.0, missing_weights_gb=8.0)
    per_token = 4.0 / 16384
    assert f["fit_seqs"] == [16384, 32768]
    assert abs(f["fixed_gb"] - 16.0) < 1e-9
    assert f["fitted_longest"] == int((80.0 - 16.0) / per_token)
    assert f["fitted_longest_32_layers"] == int((80.0 - 16.0 - 8.0) / per_token)
    assert long_context_cuda.fit(pts[:1], 80.0, 0.0) is None


def test_auto_layers_keep_weights_under_half_the_device():
    cfg = long_context_cuda.LLAMA_8B
    layer, fixed = long_context_cuda.params(cfg)
    assert 7.9e9 < 32 * layer + fixed < 8.1e9, "the 8B shape must have ~8B parameters"
    n = long_context_cuda.auto_layers(cfg, 80.0)
    assert (n * layer + fixed) * 8 <= 40 * 2**30 < ((n + 1) * layer + fixed) * 8
    assert long_context_cuda.auto_layers(cfg, 1000.0) == 32


def test_visible_pairs_exact():
    import torch

    from hyper_parallel.ops.reference import visibility

    for case in attention_routes.CASES:
        q_pos, k_pos, causal, q_doc, k_doc, window, _ = attention_routes.layout(case, 64, torch.device("cpu"))
        vis = visibility(q_pos, k_pos, causal, q_doc, k_doc, window=window)
        assert attention_routes.visible_pairs(q_pos, k_pos, causal, q_doc, k_doc, window) == int(vis.sum()), case


def test_report_replaces_only_the_marked_section():
    routes = {"machine": dict(device="X", torch="t", cuda=None, flash_attn=False, dtype="bf16", heads=[8, 2], dim=64, C=4),
              "results": [dict(s_local=16384, case="chunk", route="sdpa_lower_right", ms=2.0, gpairs_per_s=500.0,
                               baseline_gpairs_per_s=520.0, vs_flash=0.96)]}
    doc = f"head\n{device_report.BEGIN}\nold\n{device_report.END}\ntail\n"
    out = device_report.insert(doc, device_report.render(routes, None))
    assert out.startswith("head\n") and out.endswith("tail\n") and "old" not in out
    assert "| 16384 | chunk | `sdpa_lower_right` | 2.00 | 500 | 520 | 0.96 |" in out
    assert "≥ 0.90 of SDPA flash / cuDNN per score: 1 of 1." in out
    with pytest.raises(ValueError):
        device_report.insert("no markers", "x")


def test_device_script_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    before = (ROOT / "docs" / "performance.md").read_text()
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (ROOT / "docs" / "performance.md").read_text() == before, "the dry run must not edit the docs"
    res = json.loads((tmp_path / "device_check.json").read_text())
    cases = {r["case"] for r in res["routes"]["results"]}
    assert cases == set(attention_routes.CASES)
    routes = {r["case"]: r["route"] for r in res["routes"]["results"]}
    assert routes["chunk"] == "sdpa_lower_right" and routes["head_tail_lse"] == "sdpa_lse_merge"
    long = res["long_context"]
    assert long["points"] and long["points"][0]["ok"], long["points"]
    edited = (tmp_path / "performance.md").read_text()
    section = edited.split(device_report.BEGIN)[1].split(device_report.END)[0]
    assert "`sdpa_lower_right`" in section and "Longest measured: **128**" in section
