"""K/V pipelining of async Colossal through the attention with an LSE merge: the K/V gathers
hidden behind the attention, not only behind the Q branch.

The K and V handoffs split the local K/V into G sequence chunks, one AllGather each (launch
order K_0, V_0, K_1, V_1, ...); the consumer waits chunk c, runs the engine with ``return_lse``
on it and merges into the running result (``hyper_parallel.ops.merge.merge_partial_attention``)
before waiting chunk c+1. Every query sees exactly the same keys; only fp rounding changes.

* Parity (fp32): logits and every gradient (summed over CP) of the async Colossal adapter with
  ``kv_chunks`` G equal the sync ``sdpa_hf_cp_wrapper`` and CP=1 — cp 2 with G in {1, 2, 4} and a G
  that does not divide the local length (3 -> 2), padded rows, packed documents (+ padding),
  Mistral and Qwen3 with their sliding window (window 5 < a chunk's reach: rows that see no key of
  a chunk), Qwen3-MoE; cp 4 with G = 4. Errors printed as max abs and relative to the reference's
  largest |logit| / |gradient|; tolerances as tests/async_cp/test_async_adapters.py.
* Sinks: no async adapter model has sinks (gpt-oss has no async adapter), so an attention with
  gpt-oss style sinks through the generic ``async_colossal_cp_wrapper`` (sinks passed to chunk 0
  only) equals the same module on the whole sequence in float64 (gpt-oss's eager sink softmax).
* Every K/V chunk is launched, waited, launched in backward and waited in backward exactly once
  per layer; no handle is pending after forward+backward.
* Order (``async_trace``): chunk 0's attention runs between the launch and the wait of every later
  chunk's gather; in backward a chunk's ReduceScatter is launched right after its attention
  backward and before the earlier chunk's attention backward; the last ones are waited only after
  the Q branch's backward.
* ``kv_chunks`` / ``q_chunks`` are YAML parameters of the per-model Targets (and ``kv_chunks`` of
  the generic Colossal Target), refused by name before any collective when not an int >= 1.
"""
import pytest

from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import (DEFAULT_KV_CHUNKS, check_kv_chunks,
                                                                                 q_chunk_count)
from tests.async_cp.test_async_pipelined import GRADS_RTOL, check_case

SINK_RTOL = 2e-6        # fp32 vs the float64 reference, relative to its largest output / gradient


def _run(cases):
    from tests.async_cp._colossal_pipelined_workers import colossal_cases

    return colossal_cases(cases)


def _check(results, cases):
    for rank, res in enumerate(results):
        for case, r in zip(cases, res):
            G = case[3]
            g = q_chunk_count(r["local_seq_len"], G)
            names = [b if c == 0 else f"{b}.{c}" for b in ("k", "v") for c in range(g)]
            check_case(r, f"{r['case']} rank {rank}", names, G, g)


def test_kv_chunks_parameter():
    assert DEFAULT_KV_CHUNKS == 4 and check_kv_chunks(None, "w") == 4 and check_kv_chunks(2, "w") == 2
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match=r"w: kv_chunks=.* must be an int >= 1"):
            check_kv_chunks(bad, "w")


def test_targets_take_kv_chunks_and_q_chunks():
    """``kv_chunks`` on the generic and per-model Colossal Targets, ``q_chunks`` on the per-model
    Ulysses / Hybrid / Head-Tail Targets: optional named YAML parameters; a bad value is refused
    by name in the preflight hook (this process has no process group: no collective can run)."""
    import importlib

    from hyper_parallel.distributed.context_parallel import wrappers as W
    from tests.async_cp._workers import ADAPTERS, build

    info = W.async_colossal_cp_wrapper.__hp_inner_wrapper__
    assert info.named_params == ("kv_chunks",) and not info.required_params
    for arch, prefix in ADAPTERS.items():
        mod, _, stem = prefix.rpartition(".")
        mod = importlib.import_module(mod)
        assert getattr(mod, f"{stem}colossal_cp_wrapper").__hp_inner_wrapper__.named_params == ("kv_chunks",), arch
        for method in ("ulysses", "load_balance", "hybrid"):
            params = getattr(mod, f"{stem}{method}_cp_wrapper").__hp_inner_wrapper__.named_params
            assert "q_chunks" in params and "kv_chunks" not in params, (arch, method, params)
    llama = importlib.import_module(ADAPTERS["llama"].rpartition(".")[0])
    [model] = build("llama", 1)
    attn = model.model.layers[0].self_attn
    colossal = llama.llama_async_colossal_cp_wrapper.__hp_inner_wrapper__.validate
    colossal(attn, cp_size=2, kv_chunks=2, probe=False)
    with pytest.raises(ValueError, match=r"llama_async_colossal_cp_wrapper: kv_chunks=0 must be an int >= 1"):
        colossal(attn, cp_size=2, kv_chunks=0, probe=False)
    with pytest.raises(ValueError, match=r"llama_async_ulysses_cp_wrapper: q_chunks='2' must be an int >= 1"):
        llama.llama_async_ulysses_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=2, q_chunks="2",
                                                                           probe=False)
    with pytest.raises(ValueError, match=r"llama_async_hybrid_cp_wrapper: q_chunks=-1 must be an int >= 1"):
        llama.llama_async_hybrid_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=4, ulysses_degree=2,
                                                                          q_chunks=-1, probe=False)
    with pytest.raises(ValueError, match=r"async_colossal_cp_wrapper: kv_chunks=1.5 must be an int >= 1"):
        info.validate(attn, cp_size=2, kv_chunks=1.5, probe=False)


CP2 = [("llama", "padding", 32, 1, 2), ("llama", "padding", 32, 2, 2), ("llama", "packed", 32, 4, 2),
       ("llama", "packed_padding", 32, 3, 2), ("mistral", "packed_padding", 32, 4, 2),
       ("qwen3", "packed_padding", 32, 4, 2), ("qwen3_moe", "packed_padding", 32, 4, 2)]


def test_async_colossal_pipelined_equals_sync_and_cp1_cp2(ranks):
    _check(ranks(2).run(_run, CP2, timeout=900), CP2)


CP4 = [("llama", "packed_padding", 32, 4, 4), ("mistral", "padding", 32, 2, 4)]


def test_async_colossal_pipelined_equals_sync_and_cp1_cp4(ranks):
    _check(ranks(4).run(_run, CP4, timeout=900), CP4)


def _sinks(Gs):
    from tests.async_cp._colossal_pipelined_workers import sinks_parity

    return sinks_parity(Gs)


def test_async_colossal_pipelined_sinks_generic_wrapper(ranks):
    Gs = (1, 2, 4)
    for rank, res in enumerate(ranks(2).run(_sinks, Gs)):
        for r in res:
            print(f"sinks G={r['G']} rank {rank}: out vs CP=1 (fp64) max abs {r['out_abs_cp1']:.2e} rel "
                  f"{r['out_rel_cp1']:.2e}; grads max abs {r['grads_abs_cp1']:.2e} rel {r['grads_rel_cp1']:.2e} "
                  f"(sinks' own grad rel {r['sinks_grad_rel_cp1']:.2e}); vs G=1 out rel {r['out_rel_g1']:.2e} "
                  f"grads rel {r['grads_rel_g1']:.2e} (tol {SINK_RTOL:g} / {GRADS_RTOL:g})")
            assert r["out_rel_cp1"] < SINK_RTOL and r["out_rel_g1"] < SINK_RTOL, (rank, r)
            assert r["grads_rel_cp1"] < GRADS_RTOL and r["grads_rel_g1"] < GRADS_RTOL, (rank, r)
            assert r["sinks_grad_rel_cp1"] < GRADS_RTOL, (rank, r)
            assert r["pending"] == 0, (rank, r)


def _trace(arch, G):
    from tests.async_cp._colossal_pipelined_workers import colossal_trace

    return colossal_trace(arch, G)


def _first(trace, event, name, start=0):
    for i in range(start, len(trace)):
        if trace[i] == (event, name):
            return i
    raise AssertionError(f"{(event, name)} not in trace after {start}: {trace}")


def _name(base, c):
    return base if c == 0 else f"{base}.{c}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_colossal_pipelined_launch_wait_order(ranks, arch):
    G = 4
    for rank, r in enumerate(ranks(2).run(_trace, arch, G)):
        t, where = r["trace"], f"{arch} rank {rank}"
        assert r["pending"] == 0, f"{where}: {r['pending']} handles pending after backward"
        g = q_chunk_count(r["local_seq_len"], G)
        assert g == G, f"{where}: expected {G} chunks, local length {r['local_seq_len']}"
        # forward (first layer): K_0 at the K handoff, then V_0, K_1, V_1, ... at the V handoff,
        # all before the Q branch; the first wait after it
        launches = [_first(t, "launch", _name(b, c)) for c in range(g) for b in ("k", "v")]
        assert launches == sorted(launches), (where, t)
        assert launches[-1] < _first(t, "compute", "q_proj") < _first(t, "wait", "k"), (where, t)
        # chunk c's attention runs after its wait and before the wait of chunk c+1, while every
        # later chunk's gather is in flight (launched, not yet waited)
        for c in range(g):
            a = _first(t, "compute", f"attention_kv{c}")
            assert _first(t, "wait", _name("v", c)) < a, (where, c, t)
            for later in range(c + 1, g):
                for b in ("k", "v"):
                    assert _first(t, "launch", _name(b, later)) < a < _first(t, "wait", _name(b, later)), \
                        (where, c, later, b, t)
        # backward (the last layer's, first in backward): chunks in reverse order; chunk c's dK/dV
        # ReduceScatter launched after its attention backward and before chunk c-1's; the waits
        # only after the Q branch's backward (the launch nodes sit at the K/V projections)
        s = next(i for i, (e, _n) in enumerate(t) if e.startswith("bwd_"))
        bc = [_first(t, "bwd_compute", f"attention_kv{c}", s) for c in range(g)]
        assert bc == sorted(bc, reverse=True), (where, bc, t)
        for c in range(1, g):
            for b in ("k", "v"):
                assert bc[c] < _first(t, "bwd_launch", _name(b, c), s) < bc[c - 1], (where, c, b, t)
        qb = _first(t, "bwd_compute", "q_proj", s)
        assert max(_first(t, "bwd_launch", _name(b, 0), s) for b in "kv") < qb, (where, t)
        assert qb < min(_first(t, "bwd_wait", _name(b, c), s) for b in "kv" for c in range(g)), (where, t)
