"""Variants of the balanced split beyond the sync Colossal wrapper (docs/strategies/load_balance_packed.md).

* Async balanced: the model adapters' ``<arch>_async_balanced_cp_wrapper`` (the async Colossal
  pipeline on the permuted row: K/V AllGather chunks are slots of the permuted row, keys at
  ``meta.perm`` of those slots, queries at ``meta.q_index``), declared through the planner
  (batch policy ``balanced`` with the model's profile, block 4 so documents really scatter) on the
  packed rows with padding of tests/cp/test_balanced_cp.py: logits and every gradient (summed over
  CP) equal CP=1 (transformers, one document per row) in fp32, at cp 2 and 4, ``kv_chunks`` 1 / 4
  / 3, for Llama (causal) and Qwen3 (sliding-window and global layers alternating; Gemma 3 and
  gpt-oss have no async adapter). The same run checks every K/V chunk gather is launched and
  waited once per layer in forward and backward, no handle is left pending, and chunk 0's attention
  runs while every later chunk's gather is in flight.
* Refusals (local, no ranks): the async balanced Target on a batch without the permutation.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.cp.test_balanced_cp import _check as check_parity

SYNC_HYBRID = "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_hybrid_balanced_cp_wrapper"
ADAPTER = "hyper_parallel.models.{a}.adapter.distributed.context_parallel_async.{a}_async_balanced_cp_wrapper"


def _plan(model, mesh, cp: int, wrapper, match: str = "*.self_attn"):
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    entry = [{"match": match, "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": wrapper}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    plan.batch_policy = dataclasses.replace(plan.batch_policy, block=4)
    policy = str(plan.batch_policy)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    return model, plan, policy


def _trace_counts(trace: list, layers: int, g: int) -> dict:
    """Per K/V chunk name: (launch, wait, bwd_launch, bwd_wait) counts, which must all equal ``layers``;
    and whether, in the first layer, chunk 0's attention ran while every later chunk was in flight."""
    names = [b if c == 0 else f"{b}.{c}" for b in ("k", "v") for c in range(g)]
    bad = {}
    for n in names:
        cnt = tuple(sum(1 for e, m in trace if e == ev and m == n)
                    for ev in ("launch", "wait", "bwd_launch", "bwd_wait"))
        if cnt != (layers,) * 4:
            bad[n] = cnt
    overlap = True
    if g > 1:
        a0 = trace.index(("compute", "attention_kv0"))
        for n in names:
            if n in ("k", "v"):
                continue
            overlap &= trace.index(("launch", n)) < a0 < trace.index(("wait", n))
    return {"bad_counts": bad, "overlap": overlap}


def async_cases(items: list) -> list:
    """[(arch, cp, G)] on this rank -> parity of the async balanced adapter (kv_chunks=G) vs CP=1."""
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import q_chunk_count
    from hyper_parallel.platform import pending_handles
    from tests.async_cp._workers import build
    from tests.cp.common import mesh_ctx
    from tests.cp.test_balanced_cp import parity

    out = []
    for arch, cp, G in items:
        model, ref = build(arch, 2)
        for m in (model, ref):
            m.config.use_cache = False
        mesh = mesh_ctx(cp)
        model, plan, policy = _plan(model, mesh, cp, {"_target_": ADAPTER.format(a=arch), "kv_chunks": G})
        with async_trace() as trace:
            res = parity(model, ref, mesh, plan, 11)
        pending = pending_handles()
        g = q_chunk_count(res["global_len"] // cp, G)
        out.append({"case": f"{arch} async cp{cp} kv_chunks={G} ({g} chunks)", "policy": policy, "pending": pending,
                    **_trace_counts([(e, n) for e, n, _t in trace], model.config.num_hidden_layers, g), **res})
    return out


def _check(out, *, trace: bool = False):
    """The balanced parity checks (:func:`tests.cp.test_balanced_cp._check`), then the async trace."""
    check_parity(out)
    for per_rank in zip(*out) if trace else ():
        for r in per_rank:
            assert r["pending"] == 0 and not r["bad_counts"] and r["overlap"], r


def test_async_balanced_cp2_matches_cp1(ranks):
    """Llama and Qwen3 (mixed window/global layers) at cp 2, kv_chunks 4 and 1 (one gather per tensor)."""
    _check(ranks(2).run(async_cases, [("llama", 2, 4), ("qwen3", 2, 4), ("llama", 2, 1)], timeout=600.0),
           trace=True)


def test_async_balanced_cp4_matches_cp1(ranks):
    """The same at cp 4; kv_chunks 5 does not divide the local length 12 (-> 4 chunks of 3)."""
    _check(ranks(4).run(async_cases, [("qwen3", 4, 4), ("llama", 4, 5)], timeout=600.0), trace=True)


def hybrid_cases(items: list) -> list:
    """[(arch, cp, u, G)] on this rank -> parity of Hybrid on the balanced split (ulysses_degree u) vs CP=1:
    G None: the sync ``sdpa_hf_hybrid_balanced_cp_wrapper`` (any HF attention: Gemma 3 too); else the
    model adapter's ``<arch>_async_hybrid_balanced_cp_wrapper`` with ``q_chunks=G``."""
    from hyper_parallel.platform import pending_handles
    from tests.async_cp._workers import build
    from tests.cp.common import mesh_ctx
    from tests.cp.test_balanced_cp import parity
    from tests.wrappers import _workers as W

    out = []
    for arch, cp, u, G in items:
        model, ref = W.build_arch(arch) if G is None else build(arch, 2)
        for m in (model, ref):
            m.config.use_cache = False
        mesh = mesh_ctx(cp, hybrid=(u,))
        if G is None:
            wrapper = {"_target_": SYNC_HYBRID, "ulysses_degree": u}
        else:
            wrapper = {"_target_": ADAPTER.format(a=arch).replace("_balanced_", "_hybrid_balanced_"),
                       "ulysses_degree": u, "q_chunks": G}
        model, plan, policy = _plan(model, mesh, cp, wrapper, W.ATTN_MATCH.get(arch, "*.self_attn"))
        res = parity(model, ref, mesh, plan, 13)
        kind = "sync" if G is None else f"async q_chunks={G}"
        out.append({"case": f"{arch} hybrid u={u} {kind} cp{cp}", "policy": policy, "pending": pending_handles(),
                    **res})
    return out


def test_hybrid_balanced_cp4_matches_cp1(ranks):
    """Hybrid (u 2 x c 2) on the balanced split: sync for Llama and Gemma 3 (window/global layers), async
    adapters for Llama and Qwen3 (window/global layers)."""
    out = ranks(4).run(hybrid_cases, [("llama", 4, 2, None), ("gemma3", 4, 2, None), ("llama", 4, 2, 4),
                                      ("qwen3", 4, 2, 2)], timeout=600.0)
    _check(out)
    assert all(r["pending"] == 0 for per_rank in out for r in per_rank)


# ---------------------------------------------------------------- refusals (local, no ranks)
def test_async_balanced_refuses_a_batch_without_the_permutation():
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.strategies import BalancedStrategy

    meta = shard_batch_for_cp({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, (0, 2), "all_gather").meta
    with pytest.raises(ValueError, match="carries no balanced permutation.*policy='balanced'"):
        BalancedStrategy(None).check_permuted(meta)


def test_async_methods_are_the_catalogue_rows():
    """The handoff tensors of each async method (async_protocol) are read off its row: the balanced
    split's equal the contiguous layout's, and a row without async variants has none."""
    from hyper_parallel.distributed.context_parallel import catalogue
    from hyper_parallel.distributed.context_parallel.wrappers.async_protocol import handoff_comm

    assert handoff_comm("balanced") == handoff_comm("colossal") == ("k", "v")
    assert handoff_comm("hybrid_balanced") == handoff_comm("hybrid") == ("q", "k", "v")
    assert {m for m in catalogue.METHODS if handoff_comm(m)} == {m.name for m in catalogue.async_methods()}


def test_hybrid_balanced_plans_the_balanced_policy_and_is_not_mixed():
    """Hybrid on the balanced split plans the balanced batch policy with the model's profile; next to
    pure Ulysses (contiguous layout) or the sync balanced wrapper in one model it is refused, naming the
    module and the fix."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.wrappers._workers import build_arch

    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    hyb = {"_target_": SYNC_HYBRID, "ulysses_degree": 2}
    model = build_arch("gemma3")[0]
    plan = ShardingPlanner(plan_overrides=[{**base, "match": "*.self_attn", "inner_wrapper": hyb}]).plan(
        model, None, cp_size=4)
    assert "balanced" in str(plan.batch_policy) and "window" in str(plan.batch_policy), str(plan.batch_policy)
    for other, fragment in (("sdpa_hf_ulysses", "cannot be combined"), ("sdpa_hf_balanced", "cannot be mixed")):
        mixed = [{**base, "match": "*.0.self_attn", "inner_wrapper": hyb},
                 {**base, "match": "*.1.self_attn", "inner_wrapper": other}]
        with pytest.raises(CPConfigError, match=fragment) as err:
            ShardingPlanner(plan_overrides=mixed).plan(build_arch("llama")[0], None, cp_size=4)
        print(err.value)
        assert "model.layers.0.self_attn" in str(err.value)
