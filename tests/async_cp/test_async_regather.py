"""Async Colossal / Head-Tail / Hybrid do not keep the gathered K/V between forward and backward
(memory per rank falls as 1/cp): the attention's saved K/V become the local tensors the handoffs sent,
and backward runs the forward collective again on the comm thread.

On a real transformers Llama (2 layers, GQA 4:2, the async adapters of ``models/llama``), per rank:

* live tensor bytes right after the forward fall, against ``keep_gathered_kv = True``, by exactly
  the gathered K and V less the local ones, per layer (Colossal with one and with 4 K/V chunks,
  Head-Tail, Hybrid cp=4 u=2);
* logits and every gradient are bitwise those of the run that keeps the gathered K/V;
* backward issues one regather per gathered K/V pair and layer (``regather_launch`` /
  ``regather_wait`` trace events), none in forward, and no handle is left pending;
* the K/V pipeline prefetches: chunk c-1's regather is launched before chunk c's attention
  backward has finished, i.e. it travels while that backward computes.
"""
from __future__ import annotations

import pytest
import torch

from tests.async_cp._workers import ADAPTERS, METHODS, _apply, build
from tests.wrappers._workers import attention_batch, mesh_ctx

S_GLOBAL = 64


def regather_run(method: str, kv_chunks: int | None, cp: int | None = None, heads=None, u: int | None = None,
                 modes=(True, False) * 3, retain: bool = True) -> dict:
    """Forward (live bytes measured after it) and backward of the async adapter ``method`` with
    ``keep_gathered_kv`` True then False (three pairs; every pair after the first must give the same
    figure, read after a synchronisation point: testing/memory.py); then a
    ``retain_graph`` double backward. ``cp`` / ``heads`` (Hq, Hk) / ``u`` override the method's
    world, the model's heads and Hybrid's ulysses degree; ``modes``: the ``keep_gathered_kv`` values
    run in turn (the first pair warms up one-time caches); ``retain``: also the double backward."""
    import gc

    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.wrappers import async_handoff as AH
    from hyper_parallel.platform import pending_handles
    from hyper_parallel.platform.host_memory import track_host_tensors
    from hyper_parallel.testing.memory import settled_tensor_bytes

    assert track_host_tensors("cpu")
    cp0, suffix, _sync, params = METHODS[method]
    cp = cp or cp0
    params = dict(params, **({"kv_chunks": kv_chunks} if kv_chunks else {}), **({"ulysses_degree": u} if u else {}))
    mesh = mesh_ctx(cp, hybrid=(params["ulysses_degree"],) if method == "hybrid" else ())
    [model] = build("llama", 1, heads)
    model, plan = _apply(model, mesh, cp, ADAPTERS["llama"] + suffix, params)
    batch, _ref, _valid = attention_batch("padding", S_GLOBAL, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    meta = local.meta
    w = torch.randn(*local["input_ids"].shape, model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    runs = {}
    try:
        for keep in modes:
            AH.keep_gathered_kv = keep
            for p in model.parameters():
                p.grad = None
            with cp_batch_context(meta), async_trace() as trace:
                gc.collect()
                gc.disable()
                try:
                    before = settled_tensor_bytes()
                    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                                   use_cache=False).logits
                    loss = (logits * w).sum()
                    held = settled_tensor_bytes() - before
                finally:
                    gc.enable()
                mark = len(trace)
                loss.backward()
            rec = runs.setdefault(keep, {"held": []})
            rec["held"].append(held)
            rec.update(fwd=[(e, n) for e, n, _t in trace[:mark]], bwd=[(e, n) for e, n, _t in trace[mark:]],
                       pending=pending_handles(), logits=logits.detach().clone(),
                       grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        AH.keep_gathered_kv = False
    twice, second = None, None
    if retain:     # retain_graph: the second backward regathers again (on demand) and doubles every gradient
        for p in model.parameters():
            p.grad = None
        with cp_batch_context(meta), async_trace() as trace:
            loss = (model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                          use_cache=False).logits * w).sum()
            loss.backward(retain_graph=True)
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            mark = len(trace)
            loss.backward()
        twice = all(torch.equal(p.grad, 2 * first[n]) for n, p in model.named_parameters() if n in first)
        second = [n for e, n, _t in trace[mark:] if e == "regather_launch"]
    cfg = model.config
    hk, L, S = cfg.num_key_value_heads, meta.local_seq_len, meta.global_seq_len
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    B = local["input_ids"].shape[0]
    if method == "hybrid":      # [B, nk_i, S, D] gathered over the colossal group; local [B, Hk, L, D]
        from hyper_parallel.distributed.context_parallel.methods.ulysses.layout import ulysses_head_layout

        u = params["ulysses_degree"]
        nk = ulysses_head_layout(cfg.num_attention_heads, hk, u).kv_counts[meta.cp_rank % u]
        gathered, sent = B * nk * S * d, B * hk * L * d
    else:
        gathered, sent = B * hk * S * d, B * hk * L * d
    rg = runs[False]
    keep = runs.get(True, rg)
    measured = list(zip(keep["held"][1:] or keep["held"], rg["held"][1:] or rg["held"]))   # the first: warm-up
    return {"saved": sorted({a - b for a, b in measured}),
            "expect": cfg.num_hidden_layers * 2 * (gathered - sent) * 4, "layers": cfg.num_hidden_layers,
            "same_logits": torch.equal(keep["logits"], rg["logits"]),
            "same_grads": sorted(keep["grads"]) == sorted(rg["grads"])
            and all(torch.equal(keep["grads"][n], rg["grads"][n]) for n in keep["grads"]),
            "fwd_regather": [x for x in rg["fwd"] if x[0].startswith("regather")],
            "bwd": rg["bwd"], "keep_bwd_regather": [x for x in keep["bwd"] if x[0].startswith("regather")],
            "pending": [keep["pending"], rg["pending"], pending_handles()], "twice": twice, "second": second}


CASES = [("colossal", 1), ("colossal", 4), ("load_balance", None), ("hybrid", None)]


@pytest.mark.parametrize("method,kv_chunks", CASES, ids=[f"{m}-G{g}" if g else m for m, g in CASES])
def test_async_attention_regathers_kv_in_backward(ranks, method, kv_chunks):
    cp = METHODS[method][0]
    for r, res in enumerate(ranks(cp).run(regather_run, method, kv_chunks)):
        tags = [n for e, n in res["bwd"] if e == "regather_launch"]
        print(f"{method} G={kv_chunks} rank {r}: {res['saved']} bytes less held after forward (expected: the "
              f"gathered K/V less the local ones, {res['expect']}); backward regathers {tags}")
        assert res["saved"] == [res["expect"]], res["saved"]
        assert res["same_logits"] and res["same_grads"], f"rank {r}: regathering changed a value"
        assert res["pending"] == [0, 0, 0], res["pending"]
        assert res["twice"] and len(res["second"]) == len(tags), res["second"]
        assert not res["fwd_regather"] and not res["keep_bwd_regather"], res
        pairs = kv_chunks if method == "colossal" else 1
        assert len(tags) == pairs * res["layers"], tags
        waits = [n for e, n in res["bwd"] if e == "regather_wait"]
        assert sorted(waits) == sorted(tags), (waits, tags)
        # every regather but the backward's first was started early: something computed while it travelled
        ev, pending_at = res["bwd"], {}
        for i, (e, n) in enumerate(ev):
            if e == "regather_launch":
                pending_at.setdefault(n, []).append(i)
            elif e == "regather_wait":
                start = pending_at[n].pop(0)
                between = [x for x in ev[start:i] if x[0] == "bwd_compute"]
                first = start == min(j for j, x in enumerate(ev) if x[0] == "regather_launch")
                assert first or between, (n, start, i, ev)
        if pairs > 1:
            # per layer the pairs are read last chunk first; reading chunk c launches chunk c-1's, which is
            # then in flight while chunk c's attention backward computes (bwd_compute attention_kv{c})
            ev = res["bwd"]
            for c in range(pairs - 1, 0, -1):
                prev = f"k.{c - 1}+v.{c - 1}" if c > 1 else "k+v"
                launches = [i for i, x in enumerate(ev) if x == ("regather_launch", prev)]
                computes = [i for i, x in enumerate(ev) if x == ("bwd_compute", f"attention_kv{c}")]
                waits_prev = [i for i, x in enumerate(ev) if x == ("regather_wait", prev)]
                assert len(launches) == len(computes) == len(waits_prev) == res["layers"], (c, ev)
                for lo, co, wa in zip(launches, computes, waits_prev):
                    assert lo < co < wa, (c, lo, co, wa, ev)


def copying_backend_run(*args):
    """:func:`regather_run` with the CPU engine made to behave like CUDA / NPU for head maps
    (``kv_map_in_place`` False: ``attention`` copies K/V per query head before the kernel, so a
    mapped rank's engine saves that copy)."""
    import sys

    from hyper_parallel.distributed.context_parallel.wrappers import async_handoff as AH

    ops_mod = sys.modules["hyper_parallel.ops.attention"]
    real = ops_mod.kv_map_in_place
    ops_mod.kv_map_in_place = AH.kv_map_in_place = lambda device: False
    try:
        return regather_run(*args)
    finally:
        ops_mod.kv_map_in_place = AH.kv_map_in_place = real


def test_async_hybrid_uneven_layout_with_a_copying_backend_keeps_kv_and_runs(ranks):
    """The same uneven layout where the backend copies K/V per query head for a head map (CUDA, NPU,
    emulated on the CPU engine): ranks 1 and 2 would save that copy and not regather while 0 and 3
    regather — an A2A the others never issue, a hang. So no rank regathers; the run finishes with
    nothing pending."""
    for r, res in enumerate(ranks(8).run(copying_backend_run, "hybrid", None, 8, (12, 3), 4, (False,), False,
                                         timeout=300)):
        tags = [n for e, n in res["bwd"] if e == "regather_launch"]
        assert not tags, (r, tags)
        assert res["pending"] == [0, 0, 0], (r, res["pending"])


def test_async_hybrid_uneven_layout_regathers_on_every_rank(ranks):
    """Hybrid cp 8, ulysses degree 4, 12 query / 3 KV heads: the query heads of ulysses ranks 1 and 2
    start inside a KV group (the engine reads their 2 gathered KV heads through its head map,
    ``kv_map_args``), those of 0 and 3 do not (1 KV head each). Every rank regathers — the choice
    cannot depend on a rank's own layout, since the regather re-runs the ulysses A2A — and frees
    exactly its gathered K/V less the local ones (the head map saves the gathered heads themselves,
    not a per-query-head copy); logits and gradients bitwise equal to keeping; nothing pending."""
    for r, res in enumerate(ranks(8).run(regather_run, "hybrid", None, 8, (12, 3), 4, (False, True, False), False,
                                         timeout=300)):
        tags = [n for e, n in res["bwd"] if e == "regather_launch"]
        print(f"uneven hybrid rank {r}: {res['saved']} bytes less held (expected {res['expect']}); regathers {tags}")
        assert len(tags) == res["layers"], (r, tags)
        assert res["saved"] == [res["expect"]], (r, res["saved"], res["expect"])
        assert res["same_logits"] and res["same_grads"], f"rank {r}: regathering changed a value"
        assert res["pending"] == [0, 0, 0], (r, res["pending"])
