"""``hyper-train CONFIG.yaml --explain``: what a run will use, before any rank starts.

One process, no process group, the model on the meta device (nothing allocated, nothing
downloaded). Prints, per rank: the meshes (every group of every dimension), the sharding and CP
plan (the planner's own summary), parameter / gradient / optimizer bytes (FSDP2 shards over
``dp_shard x cp``, TP splits the decoder layers), activation and loss-buffer bytes at the
configured length (:func:`~.explain_estimates.saved_bytes_per_token`), communication bytes per
step per declared layer and for FSDP2, the attention work spread of the first batch (visible
(q, k) pairs per CP rank, max / mean), and the peak it adds up to. Every CP method's figures come
from the cost model its catalogue row names (``catalogue.cost_model``: exchanges, what a layer
keeps for backward, holds while it runs, saves beyond its module); the padding and the work spread
from the batch layer; no method is named here. The tiled MLP and activation offload through
:mod:`.explain_features`. docs/trainer.md "--explain" compares the estimate with measured peaks.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..distributed.expert_parallel import ep_cost
from .explain_estimates import fsdp_bytes, saved_bytes_per_token
from .explain_features import method_name, offload_split, tiled_mlp_transient
from .explain_pipeline import pipeline_figures
from .pipeline import virtual_stages

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.3f} GB"


def mesh_lines(sizes) -> list[str]:
    """Every group of every mesh dimension (ranks laid out pp x dp_replicate x dp_shard x cp x tp)."""
    shape = (sizes.pp, sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp)
    world = sizes.pp * sizes.dp_replicate * sizes.dp_shard * sizes.cp * sizes.tp
    grid = torch.arange(world).reshape(shape)

    def groups(dims):
        keep = [i for i in range(5) if i not in dims]
        g = grid.permute(*keep, *dims).reshape(-1, int(torch.tensor([shape[d] for d in dims]).prod()))
        return g.tolist()

    pp = f"pp {sizes.pp} x " if sizes.pp > 1 else ""
    lines = [f"world {world} = {pp}dp_replicate {sizes.dp_replicate} x dp_shard {sizes.dp_shard} x cp {sizes.cp} "
             f"x tp {sizes.tp} (ep {sizes.ep} derived)"]
    for name, dims in ((("pp (stages)", (0,)),) if sizes.pp > 1 else ()) + (
            ("cp", (3,)), ("tp", (4,)), ("dp (dp_replicate x dp_shard)", (1, 2)), ("fsdp (dp_shard x cp)", (2, 3))):
        lines.append(f"  {name}: groups {groups(dims)}")
    return lines


def _rss_bytes() -> float:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def _on_device(accel) -> bool:
    """An accelerator run (CUDA / NPU), not a CPU one."""
    from ..platform.device import detect_device_type

    return (accel.device_type or detect_device_type()) != "cpu"


def _first_batch(cfg, vocab: int, dp: int, model):
    from .data import build_data_stream

    if cfg.data.source == "media":
        from .media import build_media_stream

        return build_media_stream(cfg.data, model, dp_rank=0, dp_size=dp).next_micro_batches(1)[0]
    stream, _ = build_data_stream(cfg.data, dp_rank=0, dp_size=dp, vocab_size=vocab, is_builder=True)
    return stream.next_micro_batches(1)[0]


def _media_line(model, batch: dict, cp: int) -> str:
    """The first batch's media and the patch rows each CP rank's tower encodes (context_parallel/vision.py)."""
    from ..distributed.context_parallel.vision import assign_media, vision_tower

    tower, media = vision_tower(model), batch.get("media") or {}
    rows = [int(r) for k in media for r in tower.rows(media[k][1])]
    load = [0] * cp
    for r, owner in zip(rows, assign_media(rows, cp)):
        load[owner] += r
    tower_params = sum(p.numel() for n, p in model.named_parameters() if tower.holds(n))
    counts = ", ".join(f"{len(media[k][1])} {k}(s)" for k in media) or "no media"
    return (f"media of the first batch: {counts}; patch rows encoded per CP rank {load} (the vision tower, "
            f"{tower_params / 1e6:.3f} M parameters, is replicated: each rank runs it on its own media)")


def explain(cfg, echo=print) -> dict:
    """Print the explanation of the checked config ``cfg`` (see the module doc); returns its
    numbers (bytes per rank) for tests and benchmarks."""
    from ..distributed.context_parallel.balance.layout_spread import work_spread
    from ..distributed.context_parallel.batch import policy_multiple
    from ..distributed.context_parallel.catalogue import METHODS, attention_methods, cost_model, uses_balanced_permutation
    from ..distributed.context_parallel.cost_model import LayerShape
    from ..distributed.plan import ShardingPlanner
    from ..distributed.context_parallel.vision import vision_tower
    from .model import run_model

    a, d, s = cfg.accelerator, cfg.data, cfg.schedule
    sizes = a.mesh_sizes()
    model = run_model(cfg)
    plan = ShardingPlanner(cfg.plan_overrides, d.packed_documents).plan(
        model, tp_size=a.tp_size, cp_size=a.cp_size, ep_size=a.ep_size, sequence_parallel=a.sequence_parallel,
        loss_parallel=a.loss_parallel, packed_rows=d.packing)
    echo("== meshes ==")
    for line in mesh_lines(sizes):
        echo(line)
    echo("== plan ==")
    echo(plan.summary())
    S = d.seq_len + ((-d.seq_len) % (d.pad_to_multiple or 1))
    S += (-S) % (a.cp_size if plan.batch_policy is None else policy_multiple(plan.batch_policy, a.cp_size)[1])

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    H, V, L = text.hidden_size, text.vocab_size, text.num_hidden_layers
    hq = text.num_attention_heads
    hk = getattr(text, "num_key_value_heads", None) or hq
    hd = getattr(text, "head_dim", None) or H // hq
    elem = next(model.parameters()).element_size()
    cp, tp = a.cp_size, a.tp_size
    n_fsdp = sizes.dp_shard * cp
    p_total = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = [m for n, m in model.named_modules() if n in set(plan.decoder_layers)]
    pipe = None
    if a.pp_size > 1:     # per rank: the stage with the most parameters (explain_pipeline.py)
        pipe = pipeline_figures(model, plan.decoder_layers, a.pp_size, s.pipeline, s.grad_accum_steps,
                                S // cp * d.micro_batch_size * H * elem, virtual_stages(s))
        echo("== pipeline ==")
        for line in pipe.lines(s.pipeline, s.grad_accum_steps):
            echo(line)
        p_total = pipe.ranks[pipe.largest]["param_bytes"]
        layers = [layers[i] for i in pipe.ranks[pipe.largest]["layers"]]
    p_layers = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    tower = vision_tower(model)     # replicated on every rank, not sharded by FSDP (docs/vlm.md)
    p_tower = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if tower.holds(n)) \
        if tower is not None and pipe is None else 0
    p_rank = ((p_total - p_layers - p_tower) + p_layers / tp) / n_fsdp + p_tower
    opt_factor = 2 if cfg.optimizer.name.lower() == "adamw" else 1
    opt_rank = p_rank / elem * 4 * opt_factor
    unit = max((sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers), default=0) / tp
    ep_fig = ep_cost(model, plan.ep_targets, a.ep_size, elem)
    if ep_fig is not None:      # a layer gathers only this rank's experts (over the ranks holding them)
        unit -= ep_fig.layer_expert_bytes * (1 - 1 / a.ep_size)
    echo("== parameters and optimizer (per rank) ==")
    echo(f"parameters {_gb(p_total)} in all; per rank (FSDP2 over {n_fsdp}, TP {tp}): parameters {_gb(p_rank)}, "
         f"gradients {_gb(p_rank)}, optimizer state {_gb(opt_rank)} ({cfg.optimizer.name}, fp32), "
         f"unsharded layers in flight {_gb(2 * unit * (n_fsdp > 1))} (one decoder layer + the prefetched next)")
    if p_tower:
        echo(f"the vision tower is replicated on every rank (not sharded by FSDP): {_gb(p_tower)} of the parameters "
             "per rank above, and its gradients and optimizer state alike")
    if ep_fig is not None:
        echo(f"experts: {ep_fig.layers} MoE layers x {ep_fig.experts} experts, {ep_fig.experts_per_rank} per rank "
             f"(ep {a.ep_size}); {_gb(ep_fig.expert_bytes)} of experts in all, {_gb(ep_fig.expert_bytes / n_fsdp)} "
             f"per rank at rest; one layer's experts in flight {_gb(ep_fig.layer_expert_bytes / a.ep_size)} "
             f"(without EP {_gb(ep_fig.layer_expert_bytes)})")

    s_local, B = S // cp, d.micro_batch_size
    mlps = []
    if s.tiled_mlp:   # the MLPs tiled as a run tiles them: autograd then saves only their inputs
        from .tiled_mlp import install_tiled_mlp

        mlps = install_tiled_mlp(model, s.tiled_mlp_chunk_size, tp_size=tp)
    per_token = saved_bytes_per_token(model, s_local)
    act = per_token * s_local * B
    cp_targets = plan.cp_targets
    if pipe is not None:     # the boundaries of the stage the per-rank figures are for
        mine = tuple(f"{plan.decoder_layers[i]}." for i in pipe.ranks[pipe.largest]["layers"])
        cp_targets = [t for t in cp_targets if t.fqn.startswith(mine)]
    names = {id(t): method_name(t) for t in cp_targets}
    methods = sorted(set(names.values()))
    permuted = any(uses_balanced_permutation(METHODS[m]) for m in methods if m in METHODS)

    def shape(t, full: bool = False) -> LayerShape:
        """Target ``t``'s layer at this config; ``full``: all heads (memory), else one TP shard's."""
        return LayerShape(S=S, cp=cp, hq=hq if full else hq // tp, hk=hk if full else max(1, hk // tp), d=hd, H=H,
                          elem=elem, B=B, module=t.inner_module, params=t.params,
                          recomputed=bool(s.activation_checkpointing), permuted=permuted)

    costs = {id(t): cost_model(names[id(t)]) for t in cp_targets}   # each row's own cost model
    passing = sum(costs[id(t)].extra_saved(shape(t)) for t in cp_targets)
    act += passing
    gathered = float(sum(costs[id(t)].kept_for_backward(shape(t, full=True)) for t in cp_targets))
    if s.activation_checkpointing:
        act = L * s_local * B * H * elem + act / max(L, 1)
        gathered = gathered / max(L, 1)
    if pipe is not None:     # pp rank 0's stage layers, for every stage-microbatch it holds at once (the most)
        first = pipe.ranks[0]
        act = act * first["chunk_layers"] / max(L, 1) * first["in_flight"]
        passing = passing * first["chunk_layers"] / max(L, 1) * first["in_flight"]
    host = 0.0
    if s.activation_offload:    # the layer inputs live in host buffers, two at a time on the device
        kept, host = offload_split(L, s_local, B, H, elem)
        act += kept - host
    if plan.batch_policy is not None and cp > 1:   # one layer's gathered K/V while it runs
        gathered += max((costs[id(t)].in_flight(shape(t, full=True)) for t in cp_targets), default=0.0)
    transient = tiled_mlp_transient(model, mlps, s.tiled_mlp_chunk_size, s_local, B, elem)
    if cfg.loss.tiled:
        loss_buf = 2 * min(cfg.loss.chunk_size, s_local * B) * V * 4 + s_local * B * (H * elem + 8)
        what = f"tiled loss: 2 x {cfg.loss.chunk_size} x {V} fp32 chunk buffers + the head input"
    else:
        loss_buf = 3 * s_local * B * V * 4
        what = f"untiled loss: [S_local, {V}] logits, their fp32 copy and gradient"
    echo("== activations and loss buffers (per rank) ==")
    echo(f"row length {S} (S_local {s_local} per CP rank, micro-batch {B}); saved for backward "
         f"{per_token / 1e3:.1f} kB/token -> {_gb(act)}"
         + (" (activation checkpointing: layer inputs + one layer recomputed)" if s.activation_checkpointing else "")
         + (f"; gathered K/V {_gb(gathered)}" if gathered else "")
         + (f"; state passing's own {_gb(passing)} (packed rows, a delta rule's second run)" if passing else ""))
    if mlps:
        echo(f"tiled MLP ({len(mlps)} MLPs, chunks of {s.tiled_mlp_chunk_size} tokens): intermediates not saved; "
             f"one chunk's backward {_gb(transient)}")
    if s.activation_offload:
        echo(f"activation offload: layer inputs {_gb(host)} in host memory, two layers' on the device"
             + (" (CPU: the host buffers are this same memory, counted in the tensors)" if not _on_device(a) else ""))
    echo(f"loss buffers {_gb(loss_buf)} ({what})")

    echo("== communication per step (bytes sent per rank) ==")
    ga, recompute = s.grad_accum_steps, 2 if s.activation_checkpointing else 1
    comm = {}
    for m in methods:
        targets = [t for t in cp_targets if names[id(t)] == m]
        n, per = len(targets), {}
        for t in targets:
            for k, v in (costs[id(t)].comm(shape(t)) if cp > 1 else {}).items():
                per[k] = per.get(k, 0.0) + v / n
        title = METHODS[m].title if m in METHODS else m
        if not per:
            echo(f"{title} ({n} layers): not modelled here")
            continue
        total = sum(v * (recompute if k.startswith("fwd") else 1) for k, v in per.items()) * n * B * ga
        comm[m] = total
        echo(f"{title} ({n} layers): {_gb(total)} per step = " +
             ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in per.items()) + f" per layer per row x {n * B * ga}")
    if ep_fig is not None:
        tokens = s_local * B
        per, worst = ep_fig.sent_per_layer(tokens), ep_fig.worst_recv_rows(tokens)
        comm["ep"] = per * (1 + recompute) * ep_fig.layers * ga
        echo(f"expert all-to-all ({ep_fig.layers} layers, uniform routing): {_gb(comm['ep'])} per step = "
             f"{per / 1e6:.2f} MB per layer (dispatch + combine of {ep_fig.rows(tokens)} rows) x {1 + recompute} "
             f"(forward{', recomputed' if recompute > 1 else ''}, backward) x {ep_fig.layers * ga}; dropless: "
             f"a rank may receive up to {worst} rows per layer ({a.ep_size} x its share, "
             f"{worst * H * elem / 1e6:.2f} MB of rows)")
    if pipe is not None:
        comm["pipeline"] = pipe.p2p_bytes
        echo(f"pipeline point-to-point: {_gb(pipe.p2p_bytes)} per step")
    fsdp = fsdp_bytes(p_rank * n_fsdp, n_fsdp)
    if fsdp:
        comm["fsdp"] = sum(fsdp.values()) * ga
        echo(f"FSDP2 over {n_fsdp} ranks: {_gb(comm['fsdp'])} per step (" +
             ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in fsdp.items()) + f" per micro-batch x {ga})")

    echo("== attention work spread of the first batch ==")
    spread = None
    attention = [m for m in methods if m in METHODS and METHODS[m].kind == "attention"]
    if cp > 1 and methods:
        try:
            batch = _first_batch(cfg, V, sizes.dp_replicate * sizes.dp_shard, model)
        except Exception as exc:  # noqa: BLE001 - the explanation goes on without the data
            echo(f"first batch not read ({type(exc).__name__}: {exc})")
        else:
            row = METHODS[attention[-1]] if attention else attention_methods()[0]   # mixers: contiguous
            spread = work_spread(batch, row.layout, cp, heads_split=row.head_rule == "split")
            mean = sum(spread) / cp
            echo(f"{row.title}, layout {row.layout}: visible (q, k) pairs per CP rank {spread}; "
                 f"max/mean {max(spread) / mean if mean else float('nan'):.3f}")
            if d.source == "media":
                echo(_media_line(model, batch, cp))
    else:
        echo("cp_size 1: no split")

    on_device = _on_device(a)
    tensors = 2 * p_rank + opt_rank + 2 * unit * (n_fsdp > 1) + act + gathered + loss_buf + transient \
        + (0.0 if on_device else host)
    # CPU: a rank's resident set is its tensors plus the runtime (torch, transformers, the data, the
    # tokenizer), about what this process holds now that it has built the meta model and read a batch
    baseline = 0.0 if on_device else _rss_bytes()
    echo("== estimated peak per rank ==")
    echo(f"tensors {_gb(tensors)}" + (f"; resident set {_gb(tensors + baseline)} (runtime baseline {_gb(baseline)}: "
                                      "this process's resident set after building the meta model and reading a "
                                      "batch)" if baseline else ""))
    return {"params": p_rank, "grads": p_rank, "optimizer": opt_rank, "activations": act, "gathered_kv": gathered,
            "loss_buffers": loss_buf, "tiled_mlp_transient": transient, "offloaded_host": host,
            "tensor_peak": tensors, "baseline": baseline, "peak": tensors + baseline,
            "comm": comm, "spread": spread, "bytes_per_token": per_token}


def explain_cli(argv: list) -> int:
    """``hyper-train CONFIG.yaml [k=v ...] --explain``: the config checked like a run
    (schema + cross-field checks, as ``cli.load_config``), then :func:`explain`; exit 2 with one line on a config error."""
    import sys

    from ..distributed.errors import CPConfigError
    from .config import TrainerConfig
    from .config_checks import check_run_config

    if not argv:
        print("usage: hyper-train CONFIG.yaml [dotted.key=value ...] --explain", file=sys.stderr)
        return 2
    try:
        explain(check_run_config(TrainerConfig.from_yaml(argv[0], argv[1:])))
    except (CPConfigError, FileNotFoundError) as exc:
        print(f"hyper-train: configuration error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
