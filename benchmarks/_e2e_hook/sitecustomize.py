"""Per-rank attention engine CPU time for ``benchmarks/load_balance_e2e.py`` (active only when
``HP_E2E_ATTN_OUT`` is set; this folder is put on PYTHONPATH by that benchmark, never by the library).

Wraps ``torch.ops.hyper_parallel.attn_fwd`` / ``attn_bwd`` (the CPU engine's two entry points) with
``time.thread_time`` (the calling thread's CPU time: it holds with more ranks than cores) and, after
every optimizer step, appends ``{"rank", "step", "fwd_s", "bwd_s", "calls", "step_cpu_s"}`` (the last:
the main thread's CPU time since the previous step, everything the rank computed) to
``$HP_E2E_ATTN_OUT/rank<r>.jsonl`` (flushed per step; the trainer may leave through ``os._exit``).
"""
import os

if os.environ.get("HP_E2E_ATTN_OUT") and "LOCAL_RANK" in os.environ:
    import json
    import time

    import torch
    import hyper_parallel.ops  # noqa: F401  (registers torch.ops.hyper_parallel.*)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _ns = torch.ops.hyper_parallel
    _acc = {"fwd_s": 0.0, "bwd_s": 0.0, "calls": 0, "step": 0, "t0": time.thread_time()}

    def _wrap(name, key):
        op = getattr(_ns, name)

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return op(*args, **kwargs)
            finally:
                _acc[key] += time.thread_time() - t0
                _acc["calls"] += 1
        return timed

    _ns.attn_fwd = _wrap("attn_fwd", "fwd_s")
    _ns.attn_bwd = _wrap("attn_bwd", "bwd_s")

    def _after_step(_opt, _args, _kwargs):
        _acc["step"] += 1
        rank = int(os.environ.get("RANK", os.environ["LOCAL_RANK"]))
        rec = {"rank": rank, "step": _acc["step"], "fwd_s": round(_acc["fwd_s"], 4),
               "bwd_s": round(_acc["bwd_s"], 4), "calls": _acc["calls"],
               "step_cpu_s": round(time.thread_time() - _acc["t0"], 4), "loadavg_1": os.getloadavg()[0]}
        with open(os.path.join(os.environ["HP_E2E_ATTN_OUT"], f"rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        _acc.update(fwd_s=0.0, bwd_s=0.0, calls=0, t0=time.thread_time())

    register_optimizer_step_post_hook(_after_step)
