"""Expert parallelism beside CP: expert bytes per rank and the measured all-to-all against --explain's estimate.

A Qwen3-MoE (8 experts, top-2, hidden 256, 2 MoE layers, fp32) on 4 CPU gloo ranks, dp_shard 2 x cp 2
(sync Colossal), FSDP2, one forward+backward on random tokens at ep 1, 2 and 4. Per rank it measures:

* experts at rest: the bytes of the expert parameters this rank stores (FSDP2 shards);
* experts in flight: one MoE layer's expert parameters this rank computes with, measured inside the
  module's forward (what FSDP2 has all-gathered for the layer: all experts without EP, ``E / ep`` with it);
* the bytes this rank sends in the expert all-to-alls (``platform.comm_counter``, tags ``ep.dispatch``
  / ``ep.combine`` and their backward), against :func:`hyper_parallel.distributed.expert_parallel.ep_cost`
  (uniform routing), the figure ``--explain`` prints.

Prints a table and writes ``benchmarks/results/expert_parallel.json`` (with the CPU).

    python benchmarks/expert_parallel.py
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _machine import cpu_name  # noqa: E402

S, B = 1024, 1
WRAPPER = {"_target_": "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_cp_wrapper"}


def one_step(ep: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers as T

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.config import AcceleratorConfig
    from hyper_parallel.distributed.context_parallel import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.expert_parallel import ep_cost
    from hyper_parallel.distributed.infrastructure import setup_distributed
    from hyper_parallel.distributed.plan import apply_sharding_plan

    cfg = T.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                           num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, norm_topk_prob=True, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).float().train()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    layer_bytes = sum(p.numel() * p.element_size() for p in experts[0].parameters())   # all experts of a layer
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": WRAPPER}]
    setup = setup_distributed(AcceleratorConfig(cp_size=2, dp_shard_size=2, ep_size=ep), entry, model)
    mesh, plan = setup.mesh, setup.plan
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=True, preflight_proof=False)
    at_rest = sum(p.to_local().numel() * p.element_size() for m in experts for p in m.parameters())
    seen = []       # what the experts module computes with: its parameters inside its forward (FSDP2 unsharded)

    def measure(module, args):
        seen.append(sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                        for t in module._parameters.values()))
    for m in experts:
        m.register_forward_pre_hook(measure)
    g = torch.Generator().manual_seed(1 + mesh.dp_mesh.get_local_rank())
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (B, S), generator=g)}
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with P.comm_counter() as records, cp_batch_context(local.meta):
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        out.logits.float().pow(2).mean().backward()
    rows = [r for r in records if r.tag.split(".bwd")[0] in ("ep.dispatch", "ep.combine")]
    sent = sum(r.bytes_sent for r in rows)
    est = ep_cost(model, plan.ep_targets, ep, 4)
    estimate = est.sent_per_layer(S // 2 * B) * 2 * est.layers if est is not None else 0.0   # forward + backward
    return {"ep": ep, "rank": dist.get_rank(), "experts_at_rest_bytes": at_rest,
            "experts_in_flight_bytes": max(seen), "without_ep_bytes": layer_bytes, "a2a_sent_bytes": sent, "a2a_estimate_bytes": estimate}


def main() -> None:
    from hyper_parallel.testing import RankPool

    pool = RankPool(4)
    rows = []
    try:
        for ep in (1, 2, 4):
            rows += pool.run(one_step, ep, timeout=900)
    finally:
        pool.shutdown()
    print(f"{'ep':>3} {'rank':>4} {'experts at rest':>16} {'in flight/layer':>16} {'a2a sent':>12} {'estimate':>12}")
    for r in rows:
        print(f"{r['ep']:>3} {r['rank']:>4} {r['experts_at_rest_bytes'] / 1e6:>13.2f} MB "
              f"{r['experts_in_flight_bytes'] / 1e6:>13.2f} MB {r['a2a_sent_bytes'] / 1e6:>9.2f} MB "
              f"{r['a2a_estimate_bytes'] / 1e6:>9.2f} MB")
    out = os.path.join(ROOT, "benchmarks", "results", "expert_parallel.json")
    with open(out, "w") as fh:
        json.dump({"cpu": cpu_name(), "seq_len": S, "micro_batch": B, "world": "dp_shard 2 x cp 2", "rows": rows},
                  fh, indent=1)
    print(f"wrote {out} ({cpu_name()})")


if __name__ == "__main__":
    main()
