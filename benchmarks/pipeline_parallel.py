"""Pipeline parallelism beside CP: what one rank stores at PP 1 and PP 2, and its measured peak.

The trainer (meta build, FSDP2, AdamW, 1F1B, 2 micro-batches of 2 rows x 512 tokens) on a Llama of
8 decoder layers (hidden 256, vocabulary 512, fp32): CP 2 on 2 CPU gloo ranks (PP 1) against PP 2 x CP 2
on 4 ranks, 2 optimizer steps each. Per rank, after the last step: the bytes of the parameters this rank
stores (FSDP2 shards of its stage), of their gradients (kept by a hook at the last backward) and of the
AdamW state, and the peak tensor storage the trainer reports (``peak_tensor_gb_per_rank``).

Prints a table and writes ``benchmarks/results/pipeline_parallel.json`` (with the CPU).

    python benchmarks/pipeline_parallel.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _machine import cpu_name  # noqa: E402
from _pools import rows_of  # noqa: E402

MODEL = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def run(pp: int, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer
    from tests.trainer import _workers as TW

    cfg = TW.make_cfg("llama", cp=2, steps=2, ga=2, seq_len=512, out_dir=out_dir, accelerator__pp_size=pp,
                      model__config=dict(MODEL))
    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    grads: dict = {}
    for name, p in trainer.model.named_parameters():     # the gradient bytes before zero_grad frees them
        p.register_post_accumulate_grad_hook(lambda q, n=name: grads.__setitem__(n, _local(q.grad)))
    res = trainer.train()

    def size(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    params = size(_local(p) for p in trainer.model.parameters())
    optim = size(_local(v) for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
                 and v.dim() > 0)
    return {"pp": pp, "rank": dist.get_rank(), "params_bytes": params, "grads_bytes": size(grads.values()),
            "optimizer_bytes": optim, "stored_bytes": params + size(grads.values()) + optim,
            "peak_tensor_gb": res[-1].peak_tensor_gb_per_rank[dist.get_rank()], "losses": [r.loss for r in res]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_of([(world, run, (pp, os.path.join(tmp, f"pp{pp}"))) for pp, world in ((1, 2), (2, 4))])
    base = max(r["stored_bytes"] for r in rows if r["pp"] == 1)
    print(f"{'pp':>3} {'rank':>4} {'params':>10} {'grads':>10} {'AdamW':>10} {'stored':>10} {'/ pp 1':>7} {'peak':>9}")
    for r in rows:
        r["stored_over_pp1"] = r["stored_bytes"] / base
        print(f"{r['pp']:>3} {r['rank']:>4} {r['params_bytes'] / 1e6:>7.2f} MB {r['grads_bytes'] / 1e6:>7.2f} MB "
              f"{r['optimizer_bytes'] / 1e6:>7.2f} MB {r['stored_bytes'] / 1e6:>7.2f} MB {r['stored_over_pp1']:>7.3f} "
              f"{r['peak_tensor_gb'] * 1e3:>6.1f} MB")
    out = os.path.join(ROOT, "benchmarks", "results", "pipeline_parallel.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"cpu": cpu_name(), "model": MODEL, "seq_len": 512, "micro_batch": 2, "microbatches": 2,
                   "schedule": "1f1b", "rows": rows}, f, indent=1)
    print(f"wrote {out} ({cpu_name()})")


if __name__ == "__main__":
    main()
