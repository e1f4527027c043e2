"""Rank functions of tests/async_cp/test_async_pipelined.py (module-level for the warm gloo pool).

The cases install the model adapters' async Ulysses / Hybrid / Head-Tail without a ``q_chunks``
argument, so their pipeline depth G is the library default ``async_handoff.DEFAULT_Q_CHUNKS``; each
case sets that default for the wrappers it installs and restores it afterwards (the pool's processes
are reused). The adapters' Targets also take ``q_chunks`` explicitly (test_async_colossal_pipelined).
"""
from __future__ import annotations

import contextlib

from tests.async_cp._workers import ADAPTERS, METHODS, SYNC, _apply, build, compare_async
from tests.wrappers._workers import attention_batch, cp_forward_backward, mesh_ctx


@contextlib.contextmanager
def q_chunks(g: int):
    from hyper_parallel.distributed.context_parallel.wrappers import async_handoff as AH

    prev, AH.DEFAULT_Q_CHUNKS = AH.DEFAULT_Q_CHUNKS, g
    try:
        yield
    finally:
        AH.DEFAULT_Q_CHUNKS = prev


def pipelined_cases(cases) -> list:
    """[(arch, method, kind, S, G, heads or None)] on this rank -> one dict per case: logits and
    every gradient (summed over CP) of the async adapter with pipeline depth G vs the sync wrapper
    and vs CP=1 (max abs and relative to the reference's largest |logit| / |gradient|), the handles
    left pending after forward+backward, and the per-name trace counts."""
    out = []
    for i, (arch, method, kind, S, G, heads) in enumerate(cases):
        heads = tuple(heads) if heads else None
        cp, suffix, sync_name, params = METHODS[method]
        mesh = mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
        model_a, model_s, ref = build(arch, 3, heads)
        with q_chunks(G):
            model_a, plan_a = _apply(model_a, mesh, cp, ADAPTERS[arch] + suffix, params)
        model_s, plan_s = _apply(model_s, mesh, cp, SYNC + sync_name, params)
        out.append({"case": f"{arch}/{method}/{kind}/S={S}/G={G}" + (f"/heads={heads[0]}:{heads[1]}" if heads else ""),
                    **compare_async(model_a, plan_a, model_s, plan_s, ref, mesh, kind, S, seed=i)})
    return out


def pipelined_trace(arch: str, method: str, G: int, S: int = 64) -> dict:
    """One forward+backward of the async adapter at depth G on a padded batch: the ``async_trace``
    ``(event, name)`` list, the handles pending afterwards and the local sequence length."""
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.platform import pending_handles

    cp, suffix, _sync, params = METHODS[method]
    mesh = mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
    [model] = build(arch, 1)
    with q_chunks(G):
        model, plan = _apply(model, mesh, cp, ADAPTERS[arch] + suffix, params)
    batch, _ref, valid = attention_batch("padding", S, model.config.vocab_size)
    with async_trace() as trace:
        _full, _w, meta = cp_forward_backward(model, mesh, plan, batch, valid, seed=0, use_cache=False)
    return {"trace": [(e, n) for e, n, _t in trace], "pending": pending_handles(),
            "local_seq_len": meta.local_seq_len, "layers": model.config.num_hidden_layers}
