"""TRL SFTTrainer with exact context parallelism: the usual script plus one call.

    torchrun --nproc-per-node 2 examples/hf/sft_cp.py      # CP=2 on 2 CPU ranks
    torchrun --nproc-per-node 1 examples/hf/sft_cp.py      # CP=1: the reference, same losses
    torchrun --nproc-per-node 2 examples/hf/sft_cp.py --fsdp2   # CP=2 with the model FSDP2-sharded

Trains a tiny random Llama (examples/models/tiny_llama.yaml, vocabulary of the shipped BPE
tokenizer) on prompt/completion pairs cut from examples/data/stdlib_small.jsonl: packing=True
(padding-free rows, positions restarting per document), completion-only loss, gradient
accumulation 2, fp32, 6 optimizer steps; prints every step's loss and the eval loss on rank 0, then
saves a plain HF directory to runs/hf_sft_cp<N>/final. Nothing is downloaded.

``--fsdp2``: the model is loaded as transformers shards it at load time,
``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE))`` (FSDP2 over
every rank); a real script passes its checkpoint there. Same losses as without it.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main() -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hyper_parallel.integrations.hf import context_parallel

    cp = int(os.environ.get("WORLD_SIZE", "1"))          # every rank is one CP rank of one row
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "examples", "data", "stdlib_tokenizer"))
    with open(os.path.join(ROOT, "examples", "models", "tiny_llama.yaml")) as f:
        cfg = LlamaConfig(**{**yaml.safe_load(f), "vocab_size": len(tok)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    if "--fsdp2" in sys.argv[1:] and cp > 1:
        from transformers.distributed import DistributedConfig

        init = os.path.join(ROOT, "runs", "hf_sft_init", f"rank{os.environ.get('RANK', '0')}")
        model.save_pretrained(init)        # the tiny random model as a checkpoint (a real script has one)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(fsdp_size=cp))

    rows = []
    with open(os.path.join(ROOT, "examples", "data", "stdlib_small.jsonl")) as f:
        for line in f:
            text = json.loads(line)["text"][:1200]
            cut = len(text) // 3
            rows.append({"prompt": text[:cut], "completion": text[cut:]})
    train, evald = Dataset.from_list(rows[:-8]), Dataset.from_list(rows[-8:])

    class PrintLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and ("loss" in logs or "eval_loss" in logs):
                keys = ("loss", "eval_loss", "learning_rate", "grad_norm")
                print(f"cp={cp} step {state.global_step}: " + ", ".join(f"{k} {logs[k]}" for k in keys if k in logs),
                      flush=True)

    out = os.path.join(ROOT, "runs", f"hf_sft_cp{cp}")
    args = SFTConfig(output_dir=out, max_steps=6, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=1, logging_steps=1,
                     packing=True, max_length=512, completion_only_loss=True, bf16=False, use_cpu=True,
                     report_to=[], save_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evald, processing_class=tok,
                         callbacks=[PrintLoss()])
    # the one added line: the CP degree and the declared methods (the YAML trainer's plan_overrides)
    context_parallel(trainer, cp_size=cp, plan_overrides=os.path.join(HERE, "plan_cp.yaml"))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.is_world_process_zero():
        print(f"cp={cp} eval_loss {metrics['eval_loss']:.6f}; plain HF model saved to {os.path.join(out, 'final')}")


if __name__ == "__main__":
    sys.exit(main())
