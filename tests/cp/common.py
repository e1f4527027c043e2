"""Shared helpers for the CP component tests (imported inside rank worker processes)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hyper_parallel import ops, platform as P
from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.collectives import resolve_group
from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

ATOL, RTOL = 2e-5, 1e-4            # fp32 parity tolerance: |cp - ref| <= ATOL + RTOL * |ref|

from hyper_parallel.platform import on_release  # noqa: E402

_CTX: dict = {}
on_release(_CTX.clear)     # the harness frees idle groups between tests (platform.release_subgroups)


def mesh_ctx(cp: int, hybrid=()) -> MeshContext:
    """One MeshContext per (cp, hybrid degrees) per worker process (groups built once)."""
    key = (cp, tuple(sorted(hybrid)))
    if key not in _CTX:
        _CTX[key] = MeshContext(MeshSizes(cp=cp), hybrid_degrees=hybrid)
    return _CTX[key]


def sub_group3():
    """A cached 3-rank group {0, 1, 2} of the 4-rank world (odd cp for Head-Tail); None on rank 3."""
    if "sub3" not in _CTX:
        _CTX["sub3"] = dist.new_group([0, 1, 2])          # collective on all 4 ranks, once
    return None if dist.get_rank() == 3 else _CTX["sub3"]


def pg_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


SCENARIOS = ("causal", "noncausal", "padding", "packed")


def scenario_batch(name: str, B: int, S: int) -> dict:
    """A global collated batch for a scenario (S unpadded; the policy pads it)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 50, (B, S), generator=g)
    batch = {"input_ids": ids}
    if name == "padding":
        mask = torch.ones(B, S, dtype=torch.int64)
        for b in range(B):
            mask[b, S - 3 - 5 * b:] = 0          # right padding, different per row
        mask[B - 1, :2] = 0                     # and some left padding
        batch["attention_mask"] = mask
    if name == "packed":
        lens = torch.tensor([[S // 3, S // 4, S // 3], [S - 6, 3, 0]])[:B]
        batch["seq_lens"] = lens
    return batch


def global_qkv(B, Hq, Hk, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    return mk(B, Hq, S, D), mk(B, Hk, S, D), mk(B, Hk, S, D), mk(B, Hq, S, D)


def reference(q, k, v, dout, key_doc, causal):
    """Single-rank engine on the full sequence: out, dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    pos = torch.arange(q.shape[2])
    out = ops.attention(q, k, v, q_pos=pos, k_pos=pos, causal=causal, q_doc=key_doc, k_doc=key_doc)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def gather(t, group):
    return P.all_gather(t.contiguous(), resolve_group(group), dim=2)


def err(a, b):
    diff = (a - b).abs()
    mabs = diff.max().item() if diff.numel() else 0.0
    mrel = (diff / b.abs().clamp_min(1e-6)).max().item() if diff.numel() else 0.0
    ok = bool((diff <= ATOL + RTOL * b.abs()).all())
    return mabs, mrel, ok


def parity(strategy, group, scenario, *, B=2, Hq=4, Hk=2, S=30, D=8, policy=None):
    """Run ``strategy`` on this rank's shard; compare gathered out/dq/dk/dv with the reference.

    Returns [(scenario, field, max_abs, max_rel, ok)].
    """
    local = shard_batch_for_cp(scenario_batch(scenario, B, S), group, policy or strategy)
    meta = local.meta
    if scenario == "noncausal":
        meta = dataclasses.replace(meta, causal=False)
    Sp = meta.global_seq_len
    q, k, v, dout = global_qkv(B, Hq, Hk, Sp, D, seed=SCENARIOS.index(scenario) if scenario in SCENARIOS else 99)
    lo, hi = meta.cp_rank * meta.local_seq_len, (meta.cp_rank + 1) * meta.local_seq_len
    ql, kl, vl = (t[:, :, lo:hi].clone().requires_grad_(True) for t in (q, k, v))
    out = strategy.attention(ql, kl, vl, meta=meta)
    out.backward(dout[:, :, lo:hi])
    got = [gather(t.detach(), group) for t in (out, ql.grad, kl.grad, vl.grad)]
    ref = reference(q, k, v, dout, meta.key_doc, meta.causal)
    return [(scenario, f) + err(a, b) for f, a, b in zip(("out", "dq", "dk", "dv"), got, ref)]


def fmt(rows) -> str:
    return "; ".join(f"{s}/{f}: max_abs={a:.2e} max_rel={r:.2e}{'' if ok else ' FAIL'}" for s, f, a, r, ok in rows)
