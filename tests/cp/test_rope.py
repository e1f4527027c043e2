"""Rotary embeddings under CP: every RoPE variant transformers ships equals CP=1 (or is refused).

A tiny random Llama (fp32, 2 layers, head_dim 16) whose original context is ``T = 48`` tokens
(``max_position_embeddings`` and ``original_max_position_embeddings``), for every ``rope_type``
in transformers (default, linear, dynamic, yarn, longrope, llama3, proportional), at one
sequence length on each side of ``T`` (37 and 61: odd, so the CP batch adds padding to the
policy multiple that CP=1 does not have), each with a right-padded batch (``attention_mask``)
and a packed batch (``seq_lens`` + ``seq_lens_padded``, positions restarting per document), x
Colossal, Ulysses and Head-Tail at cp 2 and Hybrid (u=2) at cp 4. The CP=1 reference is plain
HF on the global batch (packed: the global ``position_ids``, HF derives the documents from them).

Compared on every valid token: logits (max abs <= ``LOGIT_TOL``) and every parameter gradient
(max abs error / the largest |gradient| of the reference model <= ``GRAD_TOL``); each test
prints its max abs / rel errors next to the fp32 tolerance. Plus: dynamic NTK across steps of
different lengths (its inv_freq is stateful), and the preflight probe refusing a rotary module
whose output depends on more than the positions.

Rank functions live in this module (the warm gloo pool imports ``tests.cp.test_rope``); model
building and meshes reuse ``tests/wrappers`` (``_models.load_cfg``, ``_workers.build_pair``,
``_workers.mesh_ctx``).
"""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from hyper_parallel.distributed.errors import CPConfigError

LOGIT_TOL = 1e-5          # fp32: max |logits_cp - logits_cp1| over valid tokens
GRAD_TOL = 1e-5           # fp32: max |g_cp - g_cp1| / max over all parameters of |g_cp1|
T = 48                    # original context of the tiny model
S_SHORT, S_LONG = 37, 61
CFG = "examples/cp/colossal.yaml"
WR = "hyper_parallel.distributed.context_parallel.wrappers."

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": T},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": T,
                 "factor": 2.0, "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
                 "long_factor": [1.0, 1.3, 1.8, 2.5, 4.0, 6.0, 9.0, 12.0]},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": T},
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "factor": 2.0},
}
METHODS = {   # name -> (cp, inner_wrapper)
    "colossal": (2, "sdpa_hf"),
    "ulysses": (2, "sdpa_hf_ulysses"),
    "head_tail": (2, {"_target_": WR + "sdpa_hf_load_balance_cp_wrapper"}),
    "hybrid": (4, {"_target_": WR + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2}),
}


# ------------------------------------------------------------------------------ rank side
def _entry(wrapper):
    return [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
             "inner_wrapper": wrapper}]


def _cfg(rope_type: str, cp: int):
    from tests.wrappers import _models

    cfg = _models.load_cfg(CFG, (f"accelerator.cp_size={cp}",))
    extra = {"max_position_embeddings": T, "rope_parameters": copy.deepcopy(ROPE[rope_type])}
    cfg.model = dataclasses.replace(cfg.model, config={**(cfg.model.config or {}), **extra})
    return cfg


def global_batch(kind: str, S: int, vocab: int, seed: int = 1234) -> dict:
    """``padding``: right-padded rows (attention_mask); ``packed``: documents in slots
    (seq_lens / seq_lens_padded) with trailing free tokens."""
    g = torch.Generator().manual_seed(seed + S)
    batch = {"input_ids": torch.randint(0, vocab, (2, S), generator=g)}
    if kind == "padding":
        mask = torch.ones(2, S, dtype=torch.int64)
        mask[0, S - 5:] = 0
        mask[1, S - 11:] = 0
        batch["attention_mask"] = mask
    elif kind == "packed":
        lens = torch.tensor([[S // 2, S // 3, S // 12], [S - 12, 6, 0]])
        padded = lens + torch.tensor([[1, 1, 0], [2, 0, 0]])
        assert int(padded.sum(1).max()) <= S
        batch["seq_lens"], batch["seq_lens_padded"] = lens, padded
    return batch


def _reference_inputs(batch: dict):
    """What plain HF gets at CP=1, and the valid-token mask [B, S] (real tokens)."""
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    one = shard_batch_for_cp(batch, (0, 1), "all_gather")
    inputs = {"input_ids": batch["input_ids"]}
    if "attention_mask" in batch:
        inputs["attention_mask"] = batch["attention_mask"]
    if "seq_lens" in batch:
        inputs["position_ids"] = one["position_ids"]       # HF finds the documents from the restarts
    S = batch["input_ids"].shape[1]
    key_doc = one.meta.key_doc
    valid = key_doc >= 0 if key_doc is not None else torch.ones(2, S, dtype=torch.bool)
    return inputs, valid


def _step(model, ref, mesh, plan, batch: dict, seed: int) -> dict:
    """One forward+backward of the CP model and of the CP=1 reference; errors on this rank."""
    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.batch import gather_from_cp, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context

    S = batch["input_ids"].shape[1]
    vocab = model.config.vocab_size
    ref_inputs, valid = _reference_inputs(batch)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    meta = local.meta
    w = torch.randn(2, meta.global_seq_len, vocab, generator=torch.Generator().manual_seed(seed))
    w[:, :S] *= valid[..., None]
    w[:, S:] = 0
    lo = meta.cp_rank * meta.local_seq_len
    for p in list(model.parameters()) + list(ref.parameters()):
        p.grad = None
    with cp_batch_context(meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        (logits * w[:, lo:lo + meta.local_seq_len]).sum().backward()
    full = gather_from_cp(logits.detach().contiguous(), mesh.cp_mesh, dim=1)[:, :S]
    ref_logits = ref(**ref_inputs).logits
    (ref_logits * w[:, :S]).sum().backward()
    ref_logits = ref_logits.detach()
    diff = ((full - ref_logits).abs() * valid[..., None]).max().item()
    ref_max = (ref_logits.abs() * valid[..., None]).max().item()
    ref_grads = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    gerr = 0.0
    for n, p in model.named_parameters():
        gp = P.all_reduce(p.grad.contiguous(), mesh.cp_mesh.get_group())
        gerr = max(gerr, (gp - ref_grads[n].grad).abs().max().item())
    return {"logits": diff, "logits_rel": diff / max(ref_max, 1e-12), "grads_abs": gerr,
            "grads": gerr / max(gmax, 1e-12)}


def _build(rope_type: str, method: str):
    from hyper_parallel.distributed.sharding_applier import apply_sharding_plan
    from hyper_parallel.distributed.sharding_planner import ShardingPlanner
    from tests.wrappers import _workers as W

    cp, wrapper = METHODS[method]
    cfg = _cfg(rope_type, cp)
    model, ref = W.build_pair(cfg, "hf")
    mesh = W.mesh_ctx(cp)
    plan = ShardingPlanner(plan_overrides=_entry(wrapper)).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    return model, ref, mesh, plan


def rope_cases(method: str, cases) -> list:
    """[(rope_type, S, kind)] -> one result dict per case (fresh model pair per case)."""
    out = []
    for i, (rope_type, S, kind) in enumerate(cases):
        model, ref, mesh, plan = _build(rope_type, method)
        batch = global_batch(kind, S, model.config.vocab_size)
        out.append({"case": f"{method}/{rope_type}/S={S}/{kind}", **_step(model, ref, mesh, plan, batch, i)})
    return out


def rope_steps(method: str, rope_type: str, lengths, kind: str = "padding") -> list:
    """One model pair, several steps of different lengths (stateful dynamic NTK inv_freq)."""
    model, ref, mesh, plan = _build(rope_type, method)
    out = []
    for i, S in enumerate(lengths):
        batch = global_batch(kind, S, model.config.vocab_size, seed=100 + i)
        out.append({"case": f"{method}/{rope_type}/step{i}/S={S}", **_step(model, ref, mesh, plan, batch, i)})
    return out


# ------------------------------------------------------------------------------ test side
def check(results) -> None:
    """Print the worst errors over ranks and cases with the fp32 tolerance, then assert each case."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].rsplit("::", 1)[-1]
    flat = [r for per_rank in results for r in per_rank]
    print(f"{test} ({len(results[0])} cases) logits: max abs {max(r['logits'] for r in flat):.2e} "
          f"rel {max(r['logits_rel'] for r in flat):.2e} (tol abs {LOGIT_TOL:g}); grads: max abs "
          f"{max(r['grads_abs'] for r in flat):.2e} rel {max(r['grads'] for r in flat):.2e} "
          f"(tol {GRAD_TOL:g} x the largest |grad|)")
    bad = [r for r in flat if r["logits"] > LOGIT_TOL or r["grads"] > GRAD_TOL]
    assert not bad, "\n".join(f"{r['case']}: logits {r['logits']:.2e} grads {r['grads']:.2e}" for r in bad)


ALL_CASES = [(t, S, kind) for t in ROPE for S in (S_SHORT, S_LONG) for kind in ("padding", "packed")]


@pytest.mark.parametrize("method", ["colossal", "ulysses", "head_tail"])
def test_every_rope_type_cp2(ranks, method):
    """7 rope types x 2 lengths (each side of T) x {padding, packed} in one pool call."""
    check(ranks(2).run(rope_cases, method, ALL_CASES, timeout=300))


def test_every_rope_type_hybrid_cp4(ranks):
    """Hybrid at cp 4: every rope type, the long length, padding and packed alternating."""
    cases = [(t, S_LONG, ("padding", "packed")[i % 2]) for i, t in enumerate(ROPE)]
    cases += [("dynamic", S_SHORT, "packed"), ("longrope", S_SHORT, "padding"),
              ("dynamic", S_LONG, "packed"), ("longrope", S_LONG, "padding")]
    check(ranks(4).run(rope_cases, "hybrid", cases, timeout=300))


@pytest.mark.parametrize("method,kind", [("colossal", "padding"), ("head_tail", "packed")])
def test_dynamic_ntk_across_steps(ranks, method, kind):
    """Long (grow) -> shorter but beyond T (cached inv_freq kept) -> short (reset) -> long again."""
    check(ranks(2).run(rope_steps, method, "dynamic", (61, 53, 37, 57), kind, timeout=300))
