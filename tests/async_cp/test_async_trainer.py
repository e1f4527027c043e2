"""Trainer-level parity of one async config per adapter: 3 optimizer steps of the real TextTrainer
(FSDP2, AdamW, grad clipping) at CP=2 equal a CP=1 run on the same data in loss, valid tokens,
logits, every gradient, grad norm and every parameter after each step (the checks and tolerances of
``tests/trainer/test_parity.py``). Llama and Mistral (window 16) take async Colossal, Qwen2 (window
16 on layer 0) and Qwen3-MoE async Ulysses, Qwen3 async Head-Tail; plus Llama async Ulysses with
activation checkpointing (the recomputed forward launches and waits its collectives again)."""
import os

import pytest

from tests.trainer import _workers as W
from tests.trainer.test_parity import run_parity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = {"llama": "colossal", "mistral": "colossal", "qwen2": "ulysses", "qwen3": "load_balance",
         "qwen3_moe": "ulysses"}


@pytest.mark.parametrize("arch", list(CASES))
def test_async_trainer_three_step_parity(ranks, arch, monkeypatch):
    method = CASES[arch]
    key = f"async_{method}_{arch}"
    monkeypatch.setitem(W.METHODS, key, {"_target_": f"hyper_parallel.models.{arch}.adapter.distributed."
                                                      f"context_parallel_async.{arch}_async_{method}_cp_wrapper"})
    if arch not in W.MODELS:
        monkeypatch.setitem(W.MODELS, arch, (arch, os.path.join(ROOT, "examples", "models", f"tiny_{arch}.yaml")))
    run_parity(ranks, arch, dict(cp=2, method=key))


def test_async_trainer_parity_with_activation_checkpointing(ranks, monkeypatch):
    key = "async_ulysses_llama"
    monkeypatch.setitem(W.METHODS, key, {"_target_": "hyper_parallel.models.llama.adapter.distributed."
                                                      "context_parallel_async.llama_async_ulysses_cp_wrapper"})
    run_parity(ranks, "llama", dict(cp=2, method=key, ac=True))
