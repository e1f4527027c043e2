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
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
# not shipped by transformers: a user's ROPE_INIT_FUNCTIONS entry (registered on the ranks by
# _register_unknown), length-dependent through transformers' "dynamic" update
UNKNOWN = {"hp_dynamic_custom": {"rope_type": "hp_dynamic_custom", "factor": 2.0, "rope_theta": 10000.0}}
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


def model_config(rope_type: str) -> dict:
    """HF config kwargs: T = max_position_embeddings (dynamic NTK's threshold) or, where the type
    declares it, T = original_max_position_embeddings (then max_position_embeddings = 2T)."""
    rope = copy.deepcopy({**ROPE, **UNKNOWN}[rope_type])
    return {"max_position_embeddings": 2 * T if "original_max_position_embeddings" in rope else T,
            "rope_parameters": rope}


def _cfg(rope_type: str, cp: int):
    from tests.wrappers import _models

    cfg = _models.load_cfg(CFG, (f"accelerator.cp_size={cp}",))
    extra = model_config(rope_type)
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
    from tests.wrappers._workers import parity_errors

    ref_inputs, valid = _reference_inputs(batch)
    return parity_errors(model, ref, mesh, plan, batch, ref_inputs, valid, seed)


def _build(rope_type: str, method: str, rotary=None, hook: bool = True):
    """(CP model, CP=1 reference, mesh, plan). ``rotary``: a class replacing ``model.rotary_emb``
    in both; ``hook=False`` leaves the rotary modules as they are (the failure this fixes)."""
    from unittest import mock

    from hyper_parallel.distributed.plan import applier as sharding_applier
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.wrappers import _workers as W

    cp, wrapper = METHODS[method]
    cfg = _cfg(rope_type, cp)
    model, ref = W.build_pair(cfg, "hf")
    if rotary is not None:
        model.model.rotary_emb, ref.model.rotary_emb = rotary(model.config), rotary(ref.config)
    mesh = W.mesh_ctx(cp)
    plan = ShardingPlanner(plan_overrides=_entry(wrapper)).plan(model, mesh, cp_size=cp)
    with mock.patch.object(sharding_applier, "install_cp_rope", sharding_applier.install_cp_rope if hook
                           else (lambda *a, **k: [])):
        # hook=False is the broken negative control: the default proof would refuse it at apply
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=hook)
    return model, ref, mesh, plan


def rope_cases(method: str, cases, rotary=None, hook: bool = True) -> list:
    """[(rope_type, S, kind)] -> one result dict per case. Consecutive cases of one rope type run
    as successive steps of one model pair (CP and CP=1 see the same sequence, so a stateful
    variant must also follow CP=1 from case to case)."""
    out = []
    model = None
    for i, (rope_type, S, kind) in enumerate(cases):
        if i == 0 or rope_type != cases[i - 1][0]:
            model, ref, mesh, plan = _build(rope_type, method, rotary, hook)
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


def _register_unknown() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def init(config, device=None, seq_len=None, layer_type=None):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](config, device, seq_len=seq_len, layer_type=layer_type)
        return inv_freq * 0.9, scale

    ROPE_INIT_FUNCTIONS.setdefault("hp_dynamic_custom", init)


class _TinyRotary(torch.nn.Module):
    """Custom rotary module (not transformers'): dynamic NTK with the length ``n`` from
    :meth:`length`; ``forward(x, position_ids) -> (cos, sin)`` like transformers'."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads
        self.register_buffer("inv_freq", torch.zeros(self.dim // 2), persistent=False)   # unused (found by name)

    def length(self, x, position_ids) -> int:
        raise NotImplementedError

    def forward(self, x, position_ids):
        n = self.length(x, position_ids)
        base = 10000.0 * max(1.0, 2.0 * n / T - 1.0) ** (self.dim / (self.dim - 2))
        inv = 1.0 / base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LengthFromPositionsRotary(_TinyRotary):
    """Length = max(position_ids) + 1 (the transformers rule, custom code): exact under CP."""

    def length(self, x, position_ids):
        return int(position_ids.max()) + 1


class LengthFromInputRotary(_TinyRotary):
    """Length = x.shape[1] (the *input's* length): under CP each rank would see its chunk — refused."""

    def length(self, x, position_ids):
        return x.shape[1]


class NoPositionsRotary(torch.nn.Module):
    """Old-style ``forward(x, seq_len)``: positions restart at 0 on every rank — refused."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads

    def forward(self, x, seq_len=None):
        freqs = torch.arange(seq_len or x.shape[1], dtype=torch.float32)[:, None] * torch.ones(self.dim)
        return freqs.cos(), freqs.sin()


def custom_rotary(method: str) -> dict:
    """Unknown rope_type and a custom position-only module: exact; bad custom modules: refused."""
    _register_unknown()
    out = {"exact": rope_cases(method, [("hp_dynamic_custom", S_LONG, "padding"), ("hp_dynamic_custom", S_SHORT,
                                                                                   "packed")])
           + rope_cases(method, [("default", S_LONG, "padding"), ("default", S_LONG, "packed")],
                        rotary=LengthFromPositionsRotary)}
    for cls in (LengthFromInputRotary, NoPositionsRotary):
        try:
            _build("default", method, rotary=cls)
        except CPConfigError as exc:
            out[cls.__name__] = str(exc)
        else:
            out[cls.__name__] = None
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


# per rope type: long (beyond T) then short (inside T), padding then packed — on one model pair
ALL_CASES = [(t, S, kind) for t in ROPE for S in (S_LONG, S_SHORT) for kind in ("padding", "packed")]


@pytest.mark.parametrize("method", ["colossal", "ulysses", "head_tail"])
def test_every_rope_type_cp2(ranks, method):
    """7 rope types x 2 lengths (each side of T) x {padding, packed}: 28 cases in one pool call."""
    check(ranks(2).run(rope_cases, method, ALL_CASES, timeout=300))


def test_every_rope_type_hybrid_cp4(ranks):
    """Hybrid at cp 4: every rope type, the long length, padding and packed alternating."""
    cases = []
    for i, t in enumerate(ROPE):
        kind, other = ("padding", "packed")[i % 2], ("packed", "padding")[i % 2]
        cases.append((t, S_LONG, kind))
        if t in ("dynamic", "longrope"):        # the length-dependent ones: both sides, both kinds
            cases += [(t, S_SHORT, other), (t, S_LONG, other)]
    check(ranks(4).run(rope_cases, "hybrid", cases, timeout=300))


@pytest.mark.parametrize("method,kind", [("colossal", "padding"), ("head_tail", "packed")])
def test_dynamic_ntk_across_steps(ranks, method, kind):
    """Long (grow) -> shorter but beyond T (cached inv_freq kept) -> short (reset) -> long again."""
    check(ranks(2).run(rope_steps, method, "dynamic", (61, 53, 37, 57), kind, timeout=300))


def test_without_the_hook_dynamic_and_longrope_are_wrong(ranks):
    """The failure this fixes (guards the sensitivity of the cases above): each rank derives its own
    length from its chunk's positions."""
    cases = [("dynamic", S_LONG, "padding"), ("longrope", S_LONG, "packed"), ("default", S_LONG, "padding")]
    res = ranks(2).run(rope_cases, "colossal", cases, None, False, timeout=300)[0]
    print("without the hook: " + ", ".join(f"{r['case']} logits {r['logits']:.2e} grads {r['grads']:.2e}"
                                             for r in res))
    assert res[0]["logits"] > 10 * LOGIT_TOL and res[1]["logits"] > 10 * LOGIT_TOL, res
    assert res[2]["logits"] <= LOGIT_TOL, res       # fixed frequencies never needed it


def test_custom_and_unknown_rotary_modules(ranks):
    """Preflight probe: an unknown rope_type and a custom module computing from position_ids alone are
    exact under CP; a module taking the length from its input, or without position_ids, is refused on
    every rank with the module FQN and the fix."""
    results = ranks(2).run(custom_rotary, "colossal", timeout=300)
    check([r["exact"] for r in results])
    for r in results:
        for name, what in (("LengthFromInputRotary", "depends on more than the positions"),
                           ("NoPositionsRotary", "has no position_ids argument")):
            msg = r[name]
            assert msg is not None, f"{name} was not refused"
            assert "[model.config.rope_parameters] module 'model.rotary_emb'" in msg and what in msg, msg
            assert "Fix: " in msg and "make the module's output a function of position_ids alone" in msg, msg
    print("refused:", results[0]["LengthFromInputRotary"])


def test_length_contract_and_runtime_checks():
    """Single process: the length every rank uses (padding counts, CP padding does not, packed = the
    longest slot), a forward outside CP runs unchanged, wrong positions raise CPRopeError."""
    import transformers

    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.rope import CPRopeError, install_cp_rope, rope_global_length

    padded = shard_batch_for_cp(global_batch("padding", S_LONG, 50), (1, 2), "load_balance")
    assert padded.meta.global_seq_len == 64 and rope_global_length(padded.meta) == S_LONG
    packed = shard_batch_for_cp(global_batch("packed", S_LONG, 50), (0, 2))
    assert rope_global_length(packed.meta) == 51            # slots [31, 21, 5], [51, 6]: the longest
    assert int(packed.meta.position_ids.max()) + 1 == 51

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, intermediate_size=64, vocab_size=50, **model_config("dynamic"))
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model.model.rotary_emb)
    assert install_cp_rope(model) == ["model.rotary_emb"] and install_cp_rope(model) == []
    rot = model.model.rotary_emb
    x = torch.zeros(2, S_LONG, 64)
    pos = torch.arange(S_LONG)[None]
    assert all(torch.equal(a, b) for a, b in zip(rot(x, pos), ref(x, pos)))       # no meta: unchanged
    local = shard_batch_for_cp(global_batch("padding", S_LONG, 50), (1, 2))
    with cp_batch_context(local.meta):
        cos, _ = rot(x[:, :31], local["position_ids"])
        assert torch.equal(cos[:, :30], ref(x, pos)[0][:, 31:].expand(2, -1, -1))
        with pytest.raises(CPRopeError, match="not this rank's slice"):
            rot(x[:, :31], torch.arange(31)[None])                # HF's default: restarts at 0
        with pytest.raises(CPRopeError, match="3-D RoPE positions only for a module with mrope_section"):
            rot(x[:, :31], local["position_ids"][None].expand(3, -1, -1))


def test_3d_mrope_positions_text_only():
    """Qwen3.5's text rotary (mrope_section, positions [3, B, n]): text-only 3-D positions (every row
    the token's 1-D position) give the slice of the CP=1 output; rows that differ are refused by name."""
    import transformers

    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.rope import CPRopeError, check_rotary_modules, install_cp_rope

    cfg = transformers.Qwen3_5TextConfig(vocab_size=50, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_hidden_layers=1, intermediate_size=64,
                                         layer_types=["full_attention"])
    model = transformers.Qwen3_5ForCausalLM(cfg)
    ref = copy.deepcopy(model.model.rotary_emb)
    assert check_rotary_modules(model, 2) == ["model.rotary_emb"]
    assert install_cp_rope(model) == ["model.rotary_emb"]
    rot, S = model.model.rotary_emb, 61
    x = torch.zeros(2, S, 64)
    want = ref(x, torch.arange(S)[None].expand(3, 1, -1))[0]
    local = shard_batch_for_cp(global_batch("padding", S, 50), (1, 2))
    three = local["position_ids"][None].expand(3, -1, -1)
    with cp_batch_context(local.meta):
        cos, _ = rot(x[:, :31], three)
        assert torch.equal(cos[:, :30], want[:, 31:].expand(2, -1, -1))
        mm = three.clone()
        mm[1] += 1
        with pytest.raises(CPRopeError, match=r"3-D RoPE positions of shape \(3, 2, 31\) whose rows differ"):
            rot(x[:, :31], mm)


def test_3d_mrope_positions_multimodal():
    """Real multimodal 3-D ids given to shard_batch_for_cp ([3, B, S] and [4, B, S]): every policy's local
    ids are the meta's global ids at ``q_index``, the 1-D meta positions are what transformers' mask sees
    at CP=1 (sequence order; row 0 for [4, ...]), the rotary module returns exactly the slice of its CP=1
    output; ids that are not this rank's slice, other layouts, and a module whose output is not a function
    of the 3-D ids (preflight) are refused."""
    import transformers

    from hyper_parallel.distributed.context_parallel.batch import CPBatchError, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.rope import CPRopeError, check_rotary_modules, install_cp_rope
    from tests.cp.test_qwen3_5_cp import mm_positions

    cfg = transformers.Qwen3_5TextConfig(vocab_size=50, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_hidden_layers=1, intermediate_size=64,
                                         layer_types=["full_attention"])
    model = transformers.Qwen3_5ForCausalLM(cfg)
    ref = copy.deepcopy(model.model.rotary_emb)
    install_cp_rope(model)
    rot, S = model.model.rotary_emb, 29
    ids = mm_positions(2, S, 5)
    assert not torch.equal(ids[0], ids[1])
    want = ref(torch.zeros(2, S, 64), ids)
    for K in (3, 4):
        pos = ids if K == 3 else torch.cat([torch.arange(S).expand(1, 2, S), ids])
        for policy in ("colossal", "head_tail", "ulysses", "balanced"):
            for r in range(2):
                batch = global_batch("padding", S, 50)
                batch["position_ids"] = pos
                local = shard_batch_for_cp(batch, (r, 2), policy)
                meta, q = local.meta, local.meta.q_index
                n_pad = meta.global_seq_len - S
                assert tuple(local["position_ids"].shape) == (K, 2, meta.local_seq_len)
                assert torch.equal(meta.position_ids[0], torch.arange(meta.global_seq_len))  # sequence order
                real = q < S
                assert torch.equal(local["position_ids"][K - 3:, :, real], ids[:, :, q[real]])
                with cp_batch_context(meta):
                    cos, sin = rot(torch.zeros(2, meta.local_seq_len, 64), local["position_ids"][K - 3:])
                    assert torch.equal(cos[:, real], want[0][:, q[real]]) and torch.equal(sin[:, real], want[1][:, q[real]])
                    if n_pad and r == 0:
                        wrong = local["position_ids"][K - 3:].clone()
                        wrong[0] += 1
                        with pytest.raises(CPRopeError, match="not this rank's slice .* 3-D \\(mrope\\) positions"):
                            rot(torch.zeros(2, meta.local_seq_len, 64), wrong)
    with pytest.raises(CPBatchError, match=r"3-D position_ids of shape \(2, 2, 29\).*\[3, B\|1, S\]"):
        shard_batch_for_cp({"input_ids": torch.zeros(2, S, dtype=torch.int64), "position_ids": ids[:2]}, (0, 2))

    class GridFromXRotary(torch.nn.Module):   # exact for text-only ids; for multimodal ones rebuilds them from x's length
        def __init__(self, inner):
            super().__init__()
            self.inner, self.mrope_section = inner, inner.mrope_section

        def forward(self, x, position_ids):
            if not torch.equal(position_ids, position_ids[:1].expand_as(position_ids)):
                position_ids = position_ids[..., :1] + torch.arange(x.shape[1])
            return self.inner(x, position_ids)

    bad = torch.nn.Module()
    bad.rotary_emb = GridFromXRotary(copy.deepcopy(ref))
    with pytest.raises(CPConfigError, match=r"could not be probed for CP|at probe step [4-7] .*differs"):
        check_rotary_modules(bad, 2)       # the text-only steps (0-3) pass; the multimodal ones refuse it


def test_trainer_dynamic_ntk_steps_of_different_lengths(ranks):
    """The real trainer (FSDP2, AdamW + clipping, Head-Tail cp 2, padding-heavy rows) with dynamic NTK,
    4 optimizer steps of global lengths 61, 53, 37, 57 (grow, keep, reset, grow), equals its CP=1 run
    step by step: loss, logits, every gradient and every parameter after the step (the
    tests/trainer rank functions and tolerances)."""
    from tests.trainer import _workers as TW
    from tests.trainer.test_parity import LOSS_ATOL, TOL, _check

    lengths = (61, 53, 37, 57)
    kw = dict(method="head_tail", min_doc_len=4, seq_len=max(lengths), steps=len(lengths),
              model__config=model_config("dynamic"))
    cfg = TW.make_cfg("llama", cp=2, **kw)
    batches = [[[{k: v[:, :S] for k, v in mb.items()} for mb in step] for step, S in zip(TW.make_batches(cfg)[0],
                                                                                       lengths)]]
    [ref] = ranks(1).run(TW.run_steps, TW.make_cfg("llama", cp=1, **kw), TW.reference_batches(batches), timeout=300)
    results = ranks(2).run(TW.run_steps, cfg, batches, timeout=300)
    worst: dict = {}
    for rank, res in enumerate(results):
        for s, (got, exp) in enumerate(zip(res["steps"], ref["steps"])):
            where = f"rank {rank} step {s + 1} (S={lengths[s]})"
            errs = {"loss": (abs(got["loss"] - exp["loss"]), abs(got["loss"] - exp["loss"]) / abs(exp["loss"]))}
            assert errs["loss"][0] <= LOSS_ATOL, f"{where}: loss {got['loss']} vs CP=1 {exp['loss']}"
            valid = batches[0][s][0]["attention_mask"].bool()
            errs["logits"] = _check("logits", got["logits"][0][valid], exp["logits"][0][valid], *TOL["logits"], where)
            for field, key in (("grads", "grads"), ("params", "params")):
                for name in exp[key]:
                    e = _check(f"{key[:-1]} {name}", got[key][name], exp[key][name], *TOL[field], where)
                    errs[field] = tuple(max(a, b) for a, b in zip(errs.get(field, (0.0, 0.0)), e))
            for f, e in errs.items():
                worst[f] = tuple(max(a, b) for a, b in zip(worst.get(f, (0.0, 0.0)), e))
    tol = {"loss": f"atol {LOSS_ATOL:g}", **{f: f"atol {a:g} rtol {r:g}" for f, (a, r) in TOL.items()}}
    for f, (a, r) in worst.items():
        print(f"trainer dynamic NTK {lengths} {f}: max abs {a:.2e} rel {r:.2e} ({tol[f]})")
