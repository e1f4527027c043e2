"""The CPU host allocator policy (platform/host_memory.py): with the mmap threshold fixed, freed
large tensor buffers leave the resident set; with glibc's dynamic threshold they stay on the heap.

Each case runs in a fresh interpreter (the policy is process-wide and one-way). The probe frees
every other one of 96 x 2 MiB tensors after a first large free has raised glibc's dynamic threshold,
then reports how much of the freed 192 MiB left the resident set.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from hyper_parallel.platform.host_memory import configure_host_allocator

PROBE = r"""
import json, os, torch
from hyper_parallel.platform.host_memory import configure_host_allocator
applied = configure_host_allocator("cpu")
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * page
big = torch.ones(16 << 20, dtype=torch.uint8); del big      # a large free: glibc's dynamic threshold rises
blocks = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(192)]
before = rss()
del blocks[::2]                                                # 96 x 2 MiB holes between live blocks
freed = before - rss()
print(json.dumps({"applied": applied, "released_mib": freed / 2**20}))
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"),
                                reason="the mmap threshold is a glibc policy (Linux /proc for the resident set)")


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "HYPER_PARALLEL_MMAP_THRESHOLD")}
    if env_value is not None:
        env["HYPER_PARALLEL_MMAP_THRESHOLD"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_fixed_threshold_returns_freed_blocks_and_dynamic_keeps_them():
    fixed, dynamic = _probe(None), _probe("0")
    print(f"released of 192 MiB freed: fixed threshold {fixed['released_mib']:.1f} MiB, "
          f"glibc dynamic {dynamic['released_mib']:.1f} MiB")
    assert fixed["applied"] == 128 * 1024 and dynamic["applied"] is None
    assert fixed["released_mib"] >= 180, fixed       # every freed 2 MiB block was mmapped: back to the OS
    assert dynamic["released_mib"] <= 96, dynamic   # heap holes between live blocks stay resident


def test_policy_is_cpu_only_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert configure_host_allocator("cuda") is None and configure_host_allocator("npu") is None
    monkeypatch.setenv("HYPER_PARALLEL_MMAP_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_MMAP_THRESHOLD='lots'"):
        configure_host_allocator("cpu")
    monkeypatch.setenv("HYPER_PARALLEL_MMAP_THRESHOLD", "-5")
    with pytest.raises(ValueError, match="bytes >= 0"):
        configure_host_allocator("cpu")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")     # the user's own glibc switch wins
    assert configure_host_allocator("cpu") is None
