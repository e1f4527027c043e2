"""Query-side pipelining of async Ulysses / Hybrid / Head-Tail: the Q and output
collectives hidden behind the attention chunks.

The Q handoff launches G query chunks (sequence sub-chunks of the local query, one collective
each); the consumer waits chunk c, runs its attention and launches its output collective
(Ulysses/Hybrid: head->seq A2A; Head-Tail: the combine) before waiting chunk c+1; the outputs are
waited last and concatenated. G changes when the collectives run, never the math.

* Parity (fp32): logits and every gradient (summed over CP) of the async adapter at depth G equal
  the sync wrapper and CP=1 — async Ulysses at cp 2 with G in {1, 2, 4} and a G that does not
  divide the local length (reduced to the largest divisor below it), padded rows, packed
  documents (+ padding), uneven heads (Qwen3 3 query / 1 KV head, and MQA 4/1), Qwen3 with its
  sliding window; Hybrid at cp 4 (ulysses_degree 2); Head-Tail at cp 2. Errors are printed as max
  abs and relative to the reference's largest |logit| / |gradient|.
* Every query / output chunk is launched, waited, launched in backward and waited in backward
  exactly once per layer; no handle is pending after forward+backward.
* Order (``async_trace``): an attention chunk runs between a later chunk's Q launch and its wait
  and between an output launch and its wait; in backward the dO exchanges are all launched before
  the first chunk's attention backward, and the dQ exchange of a chunk is waited only after the
  attention backward of an earlier chunk (the next in backward order) ran.
"""
import pytest

from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import (DEFAULT_Q_CHUNKS, check_q_chunks,
                                                                                 q_chunk_count)

LOGITS_RTOL = 2e-6      # as tests/async_cp/test_async_adapters.py (measured there: ~1e-7 / ~1e-6)
GRADS_RTOL = 2e-5
MQA, UNEVEN = (4, 1), (3, 1)


def _run(cases):
    from tests.async_cp._pipelined_workers import pipelined_cases

    return pipelined_cases(cases)


def _chunks(method: str, local_len: int, G: int) -> int:
    return q_chunk_count(local_len // 2 if method == "load_balance" else local_len, G)


def check_case(r: dict, where: str, names: list, G: int, g: int) -> None:
    """One case's result of a pipelined parity worker (``_workers.compare_async`` fields):
    logits and gradients vs CP=1 and vs the sync wrapper within the tolerances, no pending handle,
    and each collective of ``names`` launched, waited, launched and waited in backward once per
    layer, none other launched (G asked, g chunks used)."""
    (ga, gr), (sa, sr), (_xa, xr) = r["grads_cp1"], r["grads_sync"], r["sync_cp1"]
    print(f"{where}: logits vs CP=1 max abs {r['logits_abs_cp1']:.2e} rel {r['logits_rel_cp1']:.2e}, "
          f"vs sync abs {r['logits_abs_sync']:.2e} rel {r['logits_rel_sync']:.2e}; grads vs CP=1 max abs "
          f"{ga:.2e} rel {gr:.2e}, vs sync abs {sa:.2e} rel {sr:.2e} (tol rel {LOGITS_RTOL:g} / {GRADS_RTOL:g})")
    assert r["logits_rel_cp1"] < LOGITS_RTOL and r["logits_rel_sync"] < LOGITS_RTOL, where
    assert gr < GRADS_RTOL and sr < GRADS_RTOL, where
    assert xr < GRADS_RTOL, f"{where}: the sync counterpart itself differs from CP=1"
    assert r["pending"] == 0, f"{where}: {r['pending']} async handles left pending"
    for name in names:
        for ev in ("launch", "wait", "bwd_launch", "bwd_wait"):
            n = r["counts"].get((ev, name), 0)
            assert n == r["layers"], f"{where}: {ev} of {name} happened {n} times for {r['layers']} layers"
    extra = [n for (ev, n) in r["counts"] if ev == "launch" and n not in names]
    assert not extra, f"{where}: unexpected collectives {extra} (G={G} -> {g} chunks)"


def _check(results, cases):
    for rank, res in enumerate(results):
        for case, r in zip(cases, res):
            method, G = case[1], case[4]
            g = _chunks(method, r["local_seq_len"], G)
            names = ["k", "v"] + [b if c == 0 else f"{b}.{c}" for b in ("q", "out") for c in range(g)]
            check_case(r, f"{r['case']} rank {rank}", names, G, g)


def test_q_chunks_parameter_and_reduction():
    assert DEFAULT_Q_CHUNKS == 4 and check_q_chunks(None, "w") == 4 and check_q_chunks(2, "w") == 2
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match=r"w: q_chunks=.* must be an int >= 1"):
            check_q_chunks(bad, "w")
    # the largest divisor of the local rows not above q_chunks (1 = no pipelining)
    assert [q_chunk_count(16, g) for g in (1, 2, 3, 4, 5, 7, 8, 64)] == [1, 2, 2, 4, 4, 4, 8, 16]
    assert q_chunk_count(1024, 4) == 4 and q_chunk_count(6, 4) == 3 and q_chunk_count(7, 4) == 1


def test_generic_entry_points_take_q_chunks():
    """``q_chunks`` is a named YAML parameter of the generic async Ulysses / Hybrid / Head-Tail
    Targets (not of Colossal), checked at preflight before any collective."""
    from hyper_parallel.distributed.context_parallel import wrappers as W
    from tests.async_cp.test_async_protocol import _with_protocol

    for name in ("async_ulysses_cp_wrapper", "async_hybrid_cp_wrapper", "async_load_balance_cp_wrapper"):
        info = getattr(W, name).__hp_inner_wrapper__
        assert "q_chunks" in info.named_params and "q_chunks" not in info.required_params, name
    assert "q_chunks" not in W.async_colossal_cp_wrapper.__hp_inner_wrapper__.named_params
    attn = _with_protocol()
    W.async_ulysses_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=2, q_chunks=2, probe=False)
    with pytest.raises(ValueError, match=r"async_ulysses_cp_wrapper: q_chunks=0 must be an int >= 1"):
        W.async_ulysses_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=2, q_chunks=0, probe=False)
    with pytest.raises(ValueError, match=r"async_hybrid_cp_wrapper: q_chunks=1.5 must be an int >= 1"):
        W.async_hybrid_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=4, ulysses_degree=2, q_chunks=1.5,
                                                                probe=False)


ULYSSES = [("llama", "ulysses", "padding", 32, 1, None), ("llama", "ulysses", "padding", 32, 2, None),
           ("llama", "ulysses", "packed", 32, 4, None), ("llama", "ulysses", "packed_padding", 32, 3, None),
           ("qwen3", "ulysses", "packed_padding", 32, 4, UNEVEN), ("llama", "ulysses", "packed_padding", 32, 4, MQA),
           ("qwen3", "ulysses", "packed_padding", 64, 4, None)]


def test_async_ulysses_pipelined_equals_sync_and_cp1_cp2(ranks):
    _check(ranks(2).run(_run, ULYSSES, timeout=900), ULYSSES)


HYBRID = [("llama", "hybrid", "packed_padding", 32, 2, None), ("llama", "hybrid", "packed_padding", 32, 4, None),
          ("qwen3", "hybrid", "packed_padding", 32, 4, UNEVEN)]


def test_async_hybrid_pipelined_equals_sync_and_cp1_cp4(ranks):
    _check(ranks(4).run(_run, HYBRID, timeout=900), HYBRID)


HEAD_TAIL = [("llama", "load_balance", "packed_padding", 32, 1, None),
             ("llama", "load_balance", "packed_padding", 32, 2, None),
             ("llama", "load_balance", "padding", 32, 4, None), ("qwen3", "load_balance", "packed", 64, 4, None)]


def test_async_head_tail_pipelined_equals_sync_and_cp1_cp2(ranks):
    _check(ranks(2).run(_run, HEAD_TAIL, timeout=900), HEAD_TAIL)


def _trace(arch, method, G):
    from tests.async_cp._pipelined_workers import pipelined_trace

    return pipelined_trace(arch, method, G)


def _first(trace, event, name, start=0):
    for i in range(start, len(trace)):
        if trace[i] == (event, name):
            return i
    raise AssertionError(f"{(event, name)} not in trace after {start}: {trace}")


def _name(base, c):
    return base if c == 0 else f"{base}.{c}"


@pytest.mark.parametrize("method,cp", [("ulysses", 2), ("load_balance", 2), ("hybrid", 4)])
def test_pipelined_launch_wait_order(ranks, method, cp):
    G = 4
    for rank, r in enumerate(ranks(cp).run(_trace, "llama", method, G)):
        t, where = r["trace"], f"{method} rank {rank}"
        assert r["pending"] == 0, f"{where}: {r['pending']} handles pending after backward"
        g = _chunks(method, r["local_seq_len"], G)
        assert g == G, f"{where}: expected {G} chunks, local length {r['local_seq_len']}"
        # forward (first layer): every Q chunk launched at the handoff, before any wait
        lq = [_first(t, "launch", _name("q", c)) for c in range(g)]
        assert _first(t, "compute", "q_proj") < lq[0] < lq[-1] < _first(t, "wait", "k"), (where, t)
        for c in range(g - 1):
            # attention of chunk c runs while Q chunk c+1 travels ...
            a = _first(t, "compute", f"attention_q{c}")
            assert lq[c + 1] < a < _first(t, "wait", _name("q", c + 1)), (where, c, t)
            # ... and while output chunk c travels, the next chunk computes
            lo = _first(t, "launch", _name("out", c))
            assert a < lo < _first(t, "compute", f"attention_q{c + 1}") < _first(t, "wait", _name("out", c)), \
                (where, c, t)
        # backward (the last layer's, first in backward): every dO exchange launched before the
        # first chunk's attention backward; the chunks' backward in reverse order; the dQ of chunk
        # c launched right after its attention backward and waited after chunk c-1's backward
        b = _first(t, "bwd_launch", _name("out", g - 1))
        bc = [_first(t, "bwd_compute", f"attention_q{c}", b) for c in range(g)]
        assert max(_first(t, "bwd_launch", _name("out", c), b) for c in range(g)) < bc[g - 1], (where, t)
        assert bc == sorted(bc, reverse=True), (where, bc, t)
        for c in range(1, g):
            ld = _first(t, "bwd_launch", _name("q", c), b)
            assert bc[c] < ld < bc[c - 1] < _first(t, "bwd_wait", _name("q", c), b), (where, c, t)
        assert bc[0] < _first(t, "bwd_wait", _name("q", g - 1), b) < _first(t, "bwd_compute", "q_proj", b), (where, t)
