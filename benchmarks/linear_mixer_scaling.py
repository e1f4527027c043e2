"""Per-rank compute of the state-passing mixer methods at cp 1, 2 and 4 (``linear_mixer_cp.py --scaling``).

One layer of each family (transformers' own module and torch paths, hidden 256, 4 heads of dim 64):
``gated_deltanet_state_passing`` (Qwen3-Next GDN), ``kda_state_passing`` (Kimi Linear KDA),
``lightning_state_passing`` (MiniMax), ``mamba2_state_passing`` (Bamba), ``mamba1_state_passing``
(Jamba), ``rglru_state_passing`` (RecurrentGemma). One sequence of S global
tokens, fp32, forward + backward of ``out.sum()``. cp 1 runs the module's own forward; cp C runs the
CP method on C gloo ranks. Per rank: the FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts
(matmuls, convs, SDPA; load-independent) and the wall time (median of ``reps``; the machine's load
and core count bound it: C ranks share the cores). The ratio of the busiest rank's FLOPs to cp 1's
is the measure of "compute per rank falls as 1/cp".
"""
from __future__ import annotations

import statistics
import time

__all__ = ["FAMILIES", "build_layer", "scaling_rank", "run_scaling", "with_ratios"]

LIN = ["linear_attention"]
FAMILIES = {   # method -> (transformers config class, module class path, config kwargs)
    "gated_deltanet_state_passing": ("Qwen3NextConfig", "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
                                     dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
                                          linear_value_head_dim=64, linear_conv_kernel_dim=4, layer_types=LIN)),
    "kda_state_passing": ("KimiLinearConfig", "kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
                          dict(linear_num_heads=4, linear_head_dim=64, linear_conv_kernel_dim=4, layer_types=LIN)),
    "lightning_state_passing": ("MiniMaxConfig", "minimax.modeling_minimax.MiniMaxLightningAttention",
                                dict(head_dim=64, block_size=256, layer_types=LIN)),
    "mamba2_state_passing": ("BambaConfig", "bamba.modeling_bamba.BambaMixer",
                             dict(mamba_n_heads=4, mamba_d_head=128, mamba_n_groups=1, mamba_d_state=64,
                                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256)),
    "mamba1_state_passing": ("JambaConfig", "jamba.modeling_jamba.JambaMambaMixer",
                             dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=16)),
    "rglru_state_passing": ("RecurrentGemmaConfig", "recurrent_gemma.modeling_recurrent_gemma."
                            "RecurrentGemmaRecurrentBlock", dict(lru_width=256, conv1d_width=4)),
}
TARGETS = {"gated_deltanet_state_passing": "hyper_parallel.models.qwen3_next.gated_deltanet",
           "kda_state_passing": "hyper_parallel.models.kimi_linear.kda",
           "lightning_state_passing": "hyper_parallel.models.minimax.lightning",
           "mamba2_state_passing": "hyper_parallel.distributed.context_parallel.mixers.mamba2",
           "mamba1_state_passing": "hyper_parallel.distributed.context_parallel.mixers.mamba1",
           "rglru_state_passing": "hyper_parallel.models.recurrent_gemma.rglru"}
HIDDEN = 256


def build_layer(method: str):
    import importlib

    import torch
    import transformers

    cfg_name, cls_path, kw = FAMILIES[method]
    mod_path, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{mod_path}"), cls_name)
    cfg = getattr(transformers, cfg_name)(hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=4,
                                          use_cache=False, **kw)
    torch.manual_seed(0)
    return cls(cfg, 0).float()


def _flops_and_time(fn, reps: int, barrier):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    barrier()
    with FlopCounterMode(display=False) as fc:
        fn()
    flops = fc.get_total_flops()
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    del torch
    return flops, statistics.median(times)


def scaling_rank(method: str, S: int, cp: int, reps: int, threads: int) -> dict:
    """One rank's ``{"flops", "fwd_bwd_ms"}`` for ``method`` at ``cp`` (cp 1: the module's own forward)."""
    import torch

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.context_parallel.registry import import_target
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    torch.set_num_threads(threads)
    mod = build_layer(method)
    torch.manual_seed(1)
    L = S // cp
    if cp == 1:
        h = torch.randn(1, S, HIDDEN, requires_grad=True)

        pos = torch.arange(S)[None]

        def step():
            if method == "rglru_state_passing":
                out = mod(h, pos, None, use_cache=False)
            else:
                out = mod(h, None, None) if method == "lightning_state_passing" else mod(h)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        flops, dt = _flops_and_time(step, reps, lambda: None)
        return {"rank": 0, "flops": flops, "fwd_bwd_ms": dt * 1e3}
    mesh = MeshContext(MeshSizes(cp=cp))
    r = mesh.cp_rank
    mod.forward = import_target(f"{TARGETS[method]}.{method}_cp_wrapper")(mod, mesh, None, mesh.cp_mesh, None)
    h = torch.randn(1, L, HIDDEN, requires_grad=True)
    meta = CPBatchMeta(cp_rank=r, cp_size=cp, global_seq_len=S, local_seq_len=L, key_doc=None)

    def step():
        with cp_batch_context(meta):
            out = mod(h)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
    flops, dt = _flops_and_time(step, reps, lambda: P.barrier(mesh.cp_group))
    return {"rank": r, "flops": flops, "fwd_bwd_ms": dt * 1e3}


def run_scaling(methods: list, S: int, cps: list, reps: int, threads: int) -> list:
    """Rows ``{method, cp, S, flops_per_rank, max_flops_vs_cp1, fwd_bwd_ms_per_rank}``."""
    from hyper_parallel.testing import RankPool

    rows = []
    for cp in cps:
        pool = RankPool(cp, env={"HYPER_PARALLEL_COMM_TIMEOUT": "3600"})
        try:
            for method in methods:
                res = sorted(pool.run(scaling_rank, method, S, cp, reps, threads, timeout=3600),
                             key=lambda x: x["rank"])
                rows.append({"method": method, "cp": cp, "S": S, "flops_per_rank": [x["flops"] for x in res],
                             "fwd_bwd_ms_per_rank": [round(x["fwd_bwd_ms"], 1) for x in res]})
        finally:
            pool.shutdown()
    return with_ratios(rows)


def with_ratios(rows: list) -> list:
    """Add ``max_flops_vs_cp1`` / ``min_flops_vs_cp1`` to every row whose method has a cp 1 row."""
    base = {row["method"]: row["flops_per_rank"][0] for row in rows if row["cp"] == 1}
    for row in rows:
        if row["method"] in base:
            row["max_flops_vs_cp1"] = round(max(row["flops_per_rank"]) / base[row["method"]], 4)
            row["min_flops_vs_cp1"] = round(min(row["flops_per_rank"]) / base[row["method"]], 4)
    return rows
