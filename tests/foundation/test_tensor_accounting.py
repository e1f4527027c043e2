"""The counting CPU allocator (csrc/memory/host_tensor_accounting.cpp, platform/host_memory.py): live
and peak bytes of CPU tensor storage, the host analogue of a device allocator's max_memory_allocated.

Each case runs in a fresh interpreter: the allocator is process-wide, and a block counts only when it
was allocated after installation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, torch
from hyper_parallel.platform import host_memory as hm
out = {"before": hm.host_tensor_bytes(), "installed": hm.track_host_tensors("cpu")}
out["again"] = hm.track_host_tensors("cpu")                     # idempotent
if not out["installed"]:
    out["bytes"] = hm.host_tensor_bytes()
    print(json.dumps(out)); raise SystemExit(0)
base = hm.host_tensor_bytes()[0]
MB = 1 << 20
a = torch.empty(8 * MB, dtype=torch.uint8)
b = torch.empty(3 * MB, dtype=torch.uint8)
out["live_ab"] = hm.host_tensor_bytes()[0] - base
del a
c = torch.empty(2 * MB, dtype=torch.uint8)
live, peak = hm.host_tensor_bytes()
out["live_bc"], out["peak"] = live - base, peak - base
hm.reset_host_tensor_peak()
out["peak_after_reset"] = hm.host_tensor_bytes()[1] - base
# autograd: a training step's tensors come and go through the same allocator
w = torch.randn(256, 256, requires_grad=True)
x = torch.randn(64, 256)
loss = (torch.tanh(x @ w) ** 2).sum(); loss.backward()
w2 = w.detach().clone().requires_grad_()
ref = torch.autograd.grad((torch.tanh(x @ w2) ** 2).sum(), [w2])[0]
out["grad_ok"] = bool(torch.equal(w.grad, ref))
del w, w2, x, loss, ref
out["live_after_step"] = hm.host_tensor_bytes()[0] - base
# uninstall: new blocks are not counted, counted blocks still leave the count when freed
out["uninstalled"] = torch.ops.hyper_parallel.host_tensor_accounting(False)
d = torch.empty(5 * MB, dtype=torch.uint8)
out["after_uninstall"] = hm.host_tensor_bytes()
del b
torch.ops.hyper_parallel.host_tensor_accounting(True)
out["live_after_free"] = hm.host_tensor_bytes()[0] - base
out["cuda"] = hm.track_host_tensors("cuda")
print(json.dumps(out))
"""


def _probe(env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_TENSOR_ACCOUNTING"}
    env.update(env_extra or {})
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_counting_allocator_tracks_live_and_peak_bytes():
    MB = 1 << 20
    r = _probe()
    print(r)
    assert r["before"] is None and r["installed"] is True and r["again"] is True
    assert r["live_ab"] == 11 * MB                       # exactly the requested bytes
    assert r["live_bc"] == 5 * MB and r["peak"] == 11 * MB
    assert r["peak_after_reset"] == 5 * MB
    assert r["grad_ok"] is True
    assert r["live_after_step"] == 5 * MB                # every temporary of the step was returned
    assert r["uninstalled"] is False and r["after_uninstall"] is None
    assert r["live_after_free"] == 2 * MB                # b (3 MiB, counted) left; d (uncounted) never came in
    assert r["cuda"] is False


def test_accounting_can_be_switched_off():
    r = _probe({"HYPER_PARALLEL_TENSOR_ACCOUNTING": "0"})
    assert r["installed"] is False and r["again"] is False and r["bytes"] is None
