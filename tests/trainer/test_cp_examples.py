"""The CP examples of the model families (``examples/cp/<model_type>_cp2.yaml``: a hybrid decoder or
a model with attention semantics of its own, every token mixer declared in plan_overrides) train
with CP=2 and give the same losses, step for step, as the same file with the CLI-style override
``accelerator.cp_size=1``.

The YAML is read exactly as ``hyper-train`` reads it (``yaml.safe_load`` + the trainer's own
``apply_overrides``); the rank function is the shared :func:`tests.trainer._workers.train_losses`
(``trainer.train()`` on the built-in data stream, preflight proof on by default at cp 2).
"""
from __future__ import annotations

import os
import time

import pytest
import yaml

from hyper_parallel.trainer.config import apply_overrides
from tests.trainer import _workers as TW

#: example file -> the methods it declares (match -> inner_wrapper)
EXAMPLES = {
    # tiny Qwen3-Next: attention and Gated DeltaNet, both Ulysses
    "qwen3_next_cp2.yaml": {"*.self_attn": "sdpa_hf_ulysses", "*.linear_attn": "gated_deltanet_ulysses"},
    # tiny Qwen3.5 text (3-D mrope positions): Colossal attention, Gated DeltaNet state passing
    "qwen3_5_text_cp2.yaml": {"*.self_attn": "sdpa_hf", "*.linear_attn": "gated_deltanet_state_passing"},
    # tiny Llama 4 text: chunked attention and temperature tuning carried by the Colossal wrapper
    "llama4_text_cp2.yaml": {"*.self_attn": "sdpa_hf"},
    # tiny Kimi Linear: MLA Colossal, KDA state passing (every mixer is named self_attn: by layer index)
    "kimi_linear_cp2.yaml": {"model.layers.3.self_attn": "sdpa_hf",
                             "model.layers.[012].self_attn": "kda_state_passing"},
    # tiny MiniMax: softmax attention Ulysses, lightning attention state passing
    "minimax_cp2.yaml": {"model.layers.3.self_attn": "sdpa_hf_ulysses",
                         "model.layers.[012].self_attn": "lightning_state_passing"},
    # tiny NemotronH: attention Colossal, Mamba2 state passing (every mixer is named mixer)
    "nemotron_h_cp2.yaml": {"model.layers.3.mixer": "sdpa_hf", "model.layers.[02].mixer": "mamba2_state_passing"},
    # tiny DeepSeek V3.2: the DSA indexer's top-k over the gathered global keys
    "deepseek_v32_cp2.yaml": {"*.self_attn": "dsa_all_gather"},
}

#: fp32 tolerance on the per-step loss (global token mean), relative: the CP run computes the same
#: math with a different summation order (all-to-alls, per-rank partial sums, gradient reduction),
#: i.e. fp32 rounding only; measured ~1e-7.
LOSS_RTOL = 1e-5


def _cfg(example: str, tmp_path, *overrides: str) -> dict:
    with open(os.path.join(TW.ROOT, "examples", "cp", example)) as fh:
        data = yaml.safe_load(fh)
    return apply_overrides(data, ["schedule.steps=3", "logging.progress=false", "logging.plot=false",
                                  f"logging.out_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("example,declared", list(EXAMPLES.items()), ids=list(EXAMPLES))
def test_cp_example_cp2_same_losses_as_cp1(ranks, tmp_path, example, declared):
    cfg2 = _cfg(example, tmp_path / "cp2")
    assert cfg2["accelerator"]["cp_size"] == 2
    assert {e["match"]: e["inner_wrapper"] for e in cfg2["plan_overrides"]} == declared
    cfg1 = _cfg(example, tmp_path / "cp1", "accelerator.cp_size=1")

    t0 = time.perf_counter()
    cp2 = ranks(2).run(TW.train_losses, cfg2, timeout=300.0)
    t1 = time.perf_counter()
    cp1 = ranks(1).run(TW.train_losses, cfg1, timeout=300.0)[0]["losses"]
    t2 = time.perf_counter()

    l2 = cp2[0]["losses"]
    assert cp2[1]["losses"] == l2, "the CP ranks logged different losses"
    assert len(l2) == len(cp1) == 3
    abs_err = [abs(a - b) for a, b in zip(cp1, l2)]
    rel_err = [e / abs(a) for e, a in zip(abs_err, cp1)]
    print(f"cp1 losses {cp1}\ncp2 losses {l2}\nmax abs err {max(abs_err):.3e}  max rel err "
          f"{max(rel_err):.3e}  tolerance rel {LOSS_RTOL:.0e}  (cp2 {t1 - t0:.1f}s, cp1 {t2 - t1:.1f}s)")
    assert l2[-1] < l2[0], "the loss should go down over 3 steps"
    for step, (a, b) in enumerate(zip(cp1, l2)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (step, cp1, l2)
