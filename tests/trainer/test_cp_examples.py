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
    # tiny Doge: dynamic-mask attention over 256-token documents with keep_window_size 64 (the dynamic
    # top-k drops keys; A = 0 at initialization: every dt ties, the lower key index is kept at every CP size)
    "doge_cp2.yaml": {"*.self_attn": "doge_dynamic_mask"},
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


def train_recording_selection(cfg: dict) -> dict:
    """:func:`tests.trainer._workers.train_losses` with every DSA indexer selection of the run
    recorded (this rank's queries: ``[B, L_local, k]`` global key indices, in call order)."""
    from hyper_parallel.models.deepseek_v32 import dsa as D

    plain, seen = D.select_topk, []

    def recording(*args, **kwargs):
        sel, tied = plain(*args, **kwargs)
        seen.append(sel.clone())
        return sel, tied

    D.select_topk = recording
    try:
        out = TW.train_losses(cfg)
    finally:
        D.select_topk = plain
    out["selections"] = seen
    return out


#: bf16 (schedule.mixed_precision: bf16, FSDP2 bf16 compute, fp32 master weights and reductions):
#: per-step loss tolerance, relative — the CP ranks' gradient reduce-scatter sums other partial sums
#: than CP=1, so the fp32 master weights differ by rounding after step 1 and the bf16 forward with
#: them; bf16's unit roundoff is 3.9e-3
BF16_LOSS_RTOL = 1e-3


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_DSA_LONG") != "1",
                    reason="long rows (1024 and 4096 tokens) in bf16 and fp32: HYPER_PARALLEL_DSA_LONG=1")
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("seq_len", [1024, 4096])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_dsa_long_rows_same_selection_and_losses(ranks, tmp_path, arch, seq_len, precision):
    """deepseek_v32_cp2.yaml (and GLM-MoE-DSA on the same tiny config) for 5 steps at CP=2 and CP=1:
    the indexer's selected key indices of the first step are bitwise identical on every layer (CP=2's
    two ranks' queries side by side = CP=1's), later steps' differences are printed, the losses are
    within 1e-6 relative (fp32) or BF16_LOSS_RTOL (bf16)."""
    import torch

    extra = [f"data.seq_len={seq_len}", "schedule.steps=5", "schedule.warmup_steps=1", f"model.architecture={arch}"]
    if arch == "glm_moe_dsa":
        extra.append("model.config.indexer_types=[full,shared]")
    if precision == "bf16":
        extra.append("schedule.mixed_precision=bf16")
    cp2 = ranks(2).run(train_recording_selection, _cfg("deepseek_v32_cp2.yaml", tmp_path / "cp2", *extra),
                       timeout=600.0)
    cp1 = ranks(1).run(train_recording_selection, _cfg("deepseek_v32_cp2.yaml", tmp_path / "cp1", *extra,
                                                       "accelerator.cp_size=1"), timeout=600.0)[0]
    # CP=2 also ran the preflight proof first (its CP forward and its one-rank reference): the training
    # steps' calls are the last ones
    s1, s2a, s2b = cp1["selections"], cp2[0]["selections"], cp2[1]["selections"]
    assert len(s2a) == len(s2b) >= len(s1) > 0, (len(s1), len(s2a), len(s2b))
    s2a, s2b = s2a[len(s2a) - len(s1):], s2b[len(s2b) - len(s1):]
    per_call = [int((a != torch.cat([b0, b1], dim=1)).any(-1).sum()) for a, b0, b1 in zip(s1, s2a, s2b)]
    differ = sum(per_call)
    print(f"queries with a different selection per indexer call (step-major): {per_call}")
    l1, l2 = cp1["losses"], cp2[0]["losses"]
    rel = [abs(a - b) / abs(a) for a, b in zip(l1, l2)]
    tol = 1e-6 if precision == "fp32" else BF16_LOSS_RTOL
    print(f"{arch} {precision} S={seq_len}: {len(s1)} indexer calls, queries with a different selection "
          f"{differ}; losses cp1 {l1} cp2 {l2}; max rel {max(rel):.3e} (tolerance {tol:g})")
    # the first step's selections (identical weights at both CP sizes) are bitwise identical on every
    # layer; later steps start from weights that differ by the gradient reduction's rounding (AdamW's
    # first steps turn a near-zero gradient's sign into a full +-lr update), so their selections are
    # measured, not asserted
    n_layers = len(s1) // 5
    assert sum(per_call[:n_layers]) == 0, per_call
    assert max(rel) <= tol, (l1, l2)


def test_doge_bf16_cp2_first_step_equal_to_cp1(ranks, tmp_path):
    """Doge in bf16 (FSDP2 bf16 compute): at cp_size 1 the method runs as a CP group of one (the same
    key channel, engine and lower-index tie rule as CP=2, no gather), so the first step's loss is the
    same number at both sizes up to the loss reduction's summation order (measured bit-equal on the
    EPYC; the dense-mask forward it replaced was 1.2e-6 apart); later steps differ by bf16 rounding of
    the weights only (within BF16_LOSS_RTOL over 5 steps)."""
    losses = {}
    for cp in (1, 2):
        cfg = _cfg("doge_cp2.yaml", tmp_path / f"cp{cp}", f"accelerator.cp_size={cp}", "schedule.mixed_precision=bf16",
                   "schedule.steps=5")
        losses[cp] = ranks(cp).run(TW.train_losses, cfg, timeout=600.0)[0]["losses"]
    rel = [abs(a - b) / abs(a) for a, b in zip(losses[1], losses[2])]
    print(f"doge bf16: cp1 {losses[1]}\n  cp2 {losses[2]}\n  rel {['%.1e' % r for r in rel]} (tol {BF16_LOSS_RTOL:g})")
    assert rel[0] <= 5e-7 and max(rel) <= BF16_LOSS_RTOL, losses
