"""Helpers for the tokenized / packed data tests (module-level, picklable for the warm gloo pool).

The documents are real text no one here wrote: the shipped slice of the Python standard library
(examples/data/stdlib_small.jsonl), optionally cut into many short pieces so that packed rows
hold many documents and documents cross CP-rank boundaries. The tokenizer is the shipped BPE
(examples/data/stdlib_tokenizer, 4096 tokens).
"""
from __future__ import annotations

import json
import os
import random

import torch

from . import _workers as W

ROOT = W.ROOT
SLICE = os.path.join(ROOT, "examples", "data", "stdlib_small.jsonl")
SLICE_PARQUET = os.path.join(ROOT, "examples", "data", "stdlib_small.parquet")
TOKENIZER = os.path.join(ROOT, "examples", "data", "stdlib_tokenizer")
VOCAB = 4096


def short_docs_jsonl(path: str, n_docs: int = 120, seed: int = 0, lo: int = 20, hi: int = 400) -> str:
    """Write ``n_docs`` documents of random length (``lo``..``hi`` characters) cut from the slice."""
    texts = [json.loads(line)["text"] for line in open(SLICE, encoding="utf-8")]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n_docs):
            t = texts[rng.randrange(len(texts))]
            n = rng.randint(lo, hi)
            a = rng.randrange(max(1, len(t) - n))
            fh.write(json.dumps({"text": t[a:a + n]}) + "\n")
    return path


def data_cfg(files, cache_dir: str, *, seq_len: int = 64, micro_batch_size: int = 2, packing: bool = True,
             **extra) -> dict:
    return {"source": "files", "files": files if isinstance(files, list) else [files], "tokenizer": TOKENIZER,
            "cache_dir": cache_dir, "packing": packing, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
            "seed": 0, **extra}


def trainer_cfg(data: dict, **kw) -> dict:
    """A tiny-Llama trainer config (``_workers.make_cfg``) whose data section is ``data`` and whose
    vocabulary is the shipped tokenizer's."""
    cfg = W.make_cfg("llama", seq_len=data["seq_len"], micro_batch_size=data["micro_batch_size"], **kw)
    cfg["data"] = dict(data)
    cfg["model"]["config"] = {"vocab_size": VOCAB}
    return cfg


def packed_batches(cfg: dict, dp_size: int, steps: int) -> list:
    """batches[dp_rank][step] = the GA global micro-batches the trainer's stream would yield."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.data import build_data_stream

    c = TrainerConfig.from_dict(cfg)
    ga = c.schedule.grad_accum_steps
    out = []
    for dp in range(dp_size):
        stream, _ = build_data_stream(c.data, dp_rank=dp, dp_size=dp_size, vocab_size=VOCAB)
        out.append([stream.next_micro_batches(ga) for _ in range(steps)])
    return out


def run_many(cfgs: list, batches: list) -> list:
    """Several trainers (one per config: CP methods) in one worker call, each on ``batches``."""
    return [W.run_steps(cfg, batches, logits=False) for cfg in cfgs]


def build_store_counting(data: dict, marker_dir: str):
    """Open the token store from every rank; each real build drops a marker file (rank, pid)."""
    import torch.distributed as dist

    from hyper_parallel.trainer import data_sources as ds
    from hyper_parallel.trainer.config import TrainerConfig

    real = ds.build_token_store

    def counting(*a, **k):
        rank = dist.get_rank() if dist.is_initialized() else 0
        open(os.path.join(marker_dir, f"built_by_rank{rank}_{os.getpid()}"), "w").close()
        return real(*a, **k)

    ds.build_token_store = counting
    try:
        c = TrainerConfig.from_dict({"data": data})
        store = ds.open_token_store(c.data, is_builder=dist.get_rank() == 0)
        return {"path": str(store.path), "n_docs": len(store), "checksum": int(store.tokens.astype("int64").sum())}
    finally:
        ds.build_token_store = real


def resume_run(cfg: dict, steps: int, save_at: int | None = None, resume: str | None = None):
    """trainer.train() (optionally stopping at ``save_at`` with a checkpoint, or resuming from
    ``resume``): per-step losses, token counts and the stream state."""
    import copy

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    cfg = copy.deepcopy(cfg)
    if resume:
        cfg["schedule"]["resume_from"] = resume
    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    res = trainer.train(steps=save_at if save_at is not None else steps)
    path = str(trainer.save_checkpoint()) if save_at is not None else None
    return {"losses": [r.loss for r in res], "tokens": [r.valid_tokens for r in res],
            "grad_norms": [r.grad_norm for r in res], "state": trainer.data.state_dict(), "path": path,
            "eval": {r["step"]: r["eval_loss"] for r in trainer.run_log.records if r.get("eval_loss") is not None}}


def torch_equal_lists(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def train_export_packed(cfg: dict) -> dict:
    """trainer.train() with ``logging.export_hf``; rank 0 reloads ``<out_dir>/hf`` with plain
    transformers and compares its logits on a packed row (restarting position_ids) with the trained
    model's (its full parameters in the ordinary build), and its tokenizer with data.tokenizer's."""
    import transformers
    import torch.distributed as dist

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel
    from hyper_parallel.trainer.text import TextTrainer

    c = TrainerConfig.from_dict(cfg)
    trainer = TextTrainer(c)
    losses = [r.loss for r in trainer.train()]
    full = trainer.named_full("param")
    batch = trainer.data.batcher.batch(0)
    out = {"losses": losses}
    if dist.get_rank() == 0:
        export = os.path.join(c.logging.out_dir, "hf")
        ref = HyperAutoModel.from_config(c.model)
        ref.load_state_dict(full, strict=True)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
        with torch.no_grad():
            # use_cache=False: with a KV cache transformers ignores the packed-document restarts
            kw = {"input_ids": batch["input_ids"][:1], "position_ids": batch["position_ids"][:1], "use_cache": False}
            a, b = ref.eval()(**kw).logits, loaded.eval()(**kw).logits
        tok_src = transformers.AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
        tok_out = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
        text = "def f(x):\n    return {'a': x} # packed\n"
        out.update(max_abs=float((a - b).abs().max()), scale=float(a.abs().max()), files=sorted(os.listdir(export)),
                   docs_in_row=int((batch["seq_lens"][0] > 0).sum()),
                   same_ids=tok_src(text)["input_ids"] == tok_out(text)["input_ids"],
                   eos=(tok_src.eos_token_id, tok_out.eos_token_id))
    return out


def held_out_loss(cfg: dict, merge_documents: bool = False) -> dict:
    """A fresh trainer's held-out evaluation (``evaluate.evaluate``) on its held-out stream;
    ``merge_documents`` (negative control): rows without document boundaries (no seq_lens,
    positions 0..S-1), so attention and targets cross documents."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.evaluate import evaluate
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    if merge_documents:
        batcher = trainer.eval_data.batcher
        packed = batcher.batch

        def merged(i):
            b = packed(i)
            b.pop("seq_lens")
            b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"]).contiguous()
            return b

        batcher.batch = merged
    return evaluate(trainer, trainer.eval_data)
