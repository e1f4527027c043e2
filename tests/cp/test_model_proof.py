"""CP preflight proof (refuses an undeclared token mixer, and a declared method that drops a mask or
window): the whole model under CP against its own forward without CP, layer by layer, on real
transformers classes (tiny random configs, nothing downloaded) at cp=2 on the warm gloo pool.

* hybrid decoders declared for their attention only (``*.self_attn``): Qwen3-Next (Gated
  DeltaNet), LFM2 (short conv), Falcon-H1 (Mamba2) -> refused, naming the mixer and its class;
* Llama declared correctly (Colossal, Ulysses) -> passes, model left exactly as before;
* Mistral with ``sliding_window`` < probe length on Colossal -> refused naming the attention
  (the built-in wrappers drop the window), or passes once windows are exact;
* a toy cumsum mixer no list knows -> refused;
* one bad rank -> every rank fails promptly (no hang).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

ATTN = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
from hyper_parallel.platform import on_release  # noqa: E402

_MESH: dict = {}
on_release(_MESH.clear)     # the harness frees idle groups between tests (platform.release_subgroups)


# ============================================================================ rank functions
def _mesh(cp: int):
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    if cp not in _MESH:
        _MESH[cp] = MeshContext(MeshSizes(cp=cp))
    return _MESH[cp]


class ToyCumsumMLP(nn.Module):
    """An MLP plus a running mean over the sequence: a token mixer no name list knows."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        n = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        return self.inner(x) + x.cumsum(dim=1) / n


def build_model(kind: str):
    import transformers as T

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind in ("llama", "toy", "toy_inline", "toy_final"):
        cfg = T.LlamaConfig(**common)
    elif kind == "mistral":
        cfg = T.MistralConfig(sliding_window=16, **common)
    elif kind == "qwen3_next":
        cfg = T.Qwen3NextConfig(**common, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                layer_types=["linear_attention", "full_attention"], num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    elif kind == "lfm2":
        cfg = T.Lfm2Config(**common, layer_types=["conv", "full_attention"])
    elif kind == "falcon_h1":
        cfg = T.FalconH1Config(**common, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                               mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16)
    else:
        raise ValueError(kind)
    model = T.AutoModelForCausalLM.from_config(cfg)
    if kind == "toy":
        model.model.layers[1].mlp = ToyCumsumMLP(model.model.layers[1].mlp)
    elif kind == "toy_inline":      # the layer's own forward mixes tokens (no child does)
        layer = model.model.layers[0]
        original = layer.forward

        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            return out + 0.5 * torch.roll(hidden_states, 1, dims=1)
        layer.forward = forward
    elif kind == "toy_final":       # mixing after the last decoder layer
        model.model.norm = nn.Sequential(ToyCumsumMLP(nn.Identity()), model.model.norm)
    return model


def _snapshot(model):
    return ({n: p.detach().clone() for n, p in model.state_dict().items()},
            [m.training for m in model.modules()], torch.get_rng_state(),
            {n: m.__dict__.get("forward") for n, m in model.named_modules()})


def _unchanged(model, snap) -> bool:
    state, modes, rng, fwds = snap
    return (all(torch.equal(state[n], p) for n, p in model.state_dict().items())
            and [m.training for m in model.modules()] == modes and torch.equal(torch.get_rng_state(), rng)
            and all(p.grad is None for p in model.parameters())
            and {n: m.__dict__.get("forward") for n, m in model.named_modules()} == fwds
            and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))


def proof_case(kind: str, wrapper="sdpa_hf", cp: int = 2, bad_rank: int | None = None, dtype=None,
               **proof_kwargs) -> dict:
    """Build, plan (attention declared with ``wrapper``), apply, prove; -> outcome dict (never raises)."""
    import torch.distributed as dist

    from hyper_parallel.distributed.context_parallel.model_proof import prove_cp_model
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    t0 = time.perf_counter()
    model = build_model(kind)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.train()
    mesh = _mesh(cp)
    plan = ShardingPlanner(plan_overrides=[{**ATTN, "inner_wrapper": wrapper}]).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=False)   # proved below
    if bad_rank is not None and dist.get_rank() == bad_rank:
        def boom(mod, args, kwargs):   # only the reference forward sees the whole sequence
            if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] > 32:
                raise RuntimeError("injected failure on this rank")
        model.register_forward_pre_hook(boom, with_kwargs=True)
    snap = _snapshot(model)
    try:
        report = prove_cp_model(model, plan, mesh, **proof_kwargs)
        out = {"ok": True, "report": report.__dict__}
    except Exception as exc:  # noqa: BLE001 - the outcome is the test subject
        out = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
    if bad_rank is None:
        out["unchanged"] = _unchanged(model, snap)
    out["time_s"] = time.perf_counter() - t0
    return out


def refused_in_apply(kind: str) -> tuple:
    """apply_sharding_plan(preflight_proof=True) refuses and rolls the CP install back."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    model = build_model(kind)
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    mesh = _mesh(2)
    plan = ShardingPlanner(plan_overrides=[{**ATTN, "inner_wrapper": "sdpa_hf"}]).plan(model, mesh, cp_size=2)
    try:
        apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof={"seq_len": 48})
    except Exception as exc:  # noqa: BLE001
        restored = ({n: m.__dict__.get("forward") for n, m in model.named_modules()} == before
                    and not any(k.startswith("__hp_cp") for m in model.modules() for k in m.__dict__))
        return type(exc).__name__, str(exc), restored
    return None, "", False


def proof_cases(cases: list) -> list:
    return [proof_case(*c[0], **c[1]) for c in cases]


# ============================================================================ tests
def _run(ranks, cases, timeout=240.0):
    res = ranks(2).run(proof_cases, cases, timeout=timeout)
    return list(zip(*res))   # per case: (rank0 outcome, rank1 outcome)


def test_hybrid_decoders_refused_declared_ones_pass(ranks):
    """One pool call: 3 hybrids refused with the mixer named; Llama (Colossal, Ulysses) passes."""
    t0 = time.perf_counter()
    cases = [
        (("qwen3_next",), {}), (("lfm2",), {}), (("falcon_h1",), {}),
        (("llama",), {}), (("llama", "sdpa_hf_ulysses"), {}), (("toy",), {}),
        (("toy_inline",), {}), (("toy_final",), {}),
    ]
    out = _run(ranks, cases)
    expect = {
        0: ("model.layers.0.linear_attn", "Qwen3NextGatedDeltaNet"),
        1: ("model.layers.0.conv", "Lfm2ShortConv"),
        2: ("model.layers.0.mamba", "FalconH1Mixer"),
        5: ("model.layers.1.mlp", "ToyCumsumMLP"),
    }
    for i, per_rank in enumerate(out):
        for o in per_rank:
            print(cases[i][0], {k: v for k, v in o.items() if k != "msg"}, o.get("msg", "")[:400])
            assert o["unchanged"], f"{cases[i]}: the proof changed the model"
        if i in expect:
            fqn, cls = expect[i]
            for o in per_rank:
                assert not o["ok"] and o["type"] == "CPConfigError", o
                msg = o["msg"]
                assert f"'{fqn}' ({cls})" in msg, msg
                assert "not covered by any plan_overrides declaration" in msg, msg
                assert "mixes tokens along the sequence but is not declared for CP" in msg, msg
                assert "max relative error" in msg and "Fix: declare a CP method for it in plan_overrides, or " \
                       "use accelerator.cp_size: 1" in msg, msg
            assert per_rank[0]["msg"] == per_rank[1]["msg"]
        elif i == 6:
            for o in per_rank:
                assert not o["ok"] and o["type"] == "CPConfigError", o
                assert "first differing decoder layer 'model.layers.0'; none of its submodules differs on " \
                       "identical inputs, so the layer's own forward (LlamaDecoderLayer)" in o["msg"], o["msg"]
        elif i == 7:
            for o in per_rank:
                assert not o["ok"] and o["type"] == "CPConfigError", o
                assert "every decoder layer matches, but the logits differ" in o["msg"], o["msg"]
        else:
            for o in per_rank:
                assert o["ok"], o
                rep = o["report"]
                assert rep["packed"] and rep["rows"] == 3 and rep["layers"] == 2
                assert rep["max_rel_error"] < 1e-5, rep
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_window_dropped_by_declared_method_is_refused_or_exact(ranks):
    """Mistral sliding_window=16 < probe S on Colossal: refused naming the attention (declared
    but not the module's computation) — or passes where windows have been made exact."""
    out = _run(ranks, [(("mistral",), {}), (("llama",), {"packed": False, "seq_len": 40}),
                       (("llama",), {"dtype": "bfloat16"}), (("lfm2",), {"dtype": "bfloat16"})])
    mistral, llama, llama_bf16, lfm2_bf16 = out
    for o in llama_bf16:     # bf16 parameters: probed in fp32 (upcast, then restored bit-exactly)
        assert o["ok"] and o["unchanged"] and o["report"]["dtype"] == "torch.float32", o
        assert o["report"]["max_rel_error"] < 1e-5, o
    for o in lfm2_bf16:
        assert not o["ok"] and o["unchanged"] and "'model.layers.0.conv' (Lfm2ShortConv)" in o["msg"], o
        assert "torch.float32" in o["msg"], o["msg"]
    for o in mistral:
        print({k: v for k, v in o.items() if k != "msg"}, o.get("msg", "")[:500])
        assert o["unchanged"]
        if o["ok"]:
            assert o["report"]["seq_len"] > 16
        else:
            assert o["type"] == "CPConfigError", o
            msg = o["msg"]
            assert "'model.layers.0.self_attn' (MistralAttention)" in msg, msg
            assert "covered by plan_overrides[0]" in msg and "declared CP method differs from the module's own " \
                   "computation" in msg, msg
            assert msg.startswith("[plan_overrides[0].inner_wrapper]"), msg
    assert mistral[0]["ok"] == mistral[1]["ok"]
    for o in llama:
        assert o["ok"] and not o["report"]["packed"] and o["report"]["rows"] == 2, o
        assert o["report"]["seq_len"] == 40


def test_one_bad_rank_fails_every_rank_without_hang(ranks):
    t0 = time.perf_counter()
    res = ranks(2).outcomes(proof_case, "llama", bad_rank=1, timeout=60.0)
    assert time.perf_counter() - t0 < 60
    r0, r1 = res
    assert isinstance(r0, dict) and isinstance(r1, dict)
    assert not r1["ok"] and "injected failure" in r1["msg"], r1
    assert not r0["ok"] and r0["type"] == "PreflightError" and "rank 1" in r0["msg"], r0


# ============================================================================ trainer + YAML
LFM2_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"]}


def test_cp_preflight_proof_field_is_validated():
    from hyper_parallel.distributed.config import AcceleratorConfig
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.trainer.config import TrainerConfig

    assert AcceleratorConfig().cp_preflight_proof is True
    assert AcceleratorConfig.from_dict({"cp_preflight_proof": False}).cp_preflight_proof is False
    for bad in ("no", 0, None):
        with pytest.raises(CPConfigError, match=r"\[accelerator\.cp_preflight_proof\] must be true or false"):
            AcceleratorConfig.from_dict({"cp_preflight_proof": bad})
    cfg = TrainerConfig.from_dict({"accelerator": {"cp_size": 1, "cp_preflight_proof": False}})
    assert cfg.to_dict()["accelerator"]["cp_preflight_proof"] is False


def test_trainer_refuses_undeclared_mixer_before_the_first_step(ranks, tmp_path):
    """On by default in the trainer (every rank refuses at construction); the YAML switch skips it."""
    from tests.trainer import _workers as TW

    cfg = TW.make_cfg("llama", cp=2, steps=1, out_dir=str(tmp_path))
    cfg["model"] = {"architecture": "lfm2", "config": dict(LFM2_TINY), "seed": 0}
    off = dict(cfg, accelerator=dict(cfg["accelerator"], cp_preflight_proof=False))
    pool = ranks(2)
    refused = pool.run(TW.build_error, cfg)
    for err in refused:
        assert err is not None and err[0] == "CPConfigError", err
        assert "'model.layers.0.conv' (Lfm2ShortConv)" in err[1] and "not declared for CP" in err[1], err
    assert refused[0] == refused[1]
    assert pool.run(TW.build_error, off) == [None, None]   # switched off: builds (and would run wrong)


def test_refusal_inside_apply_rolls_back(ranks):
    for name, msg, restored in ranks(2).run(refused_in_apply, "lfm2"):
        assert name == "CPConfigError" and "'model.layers.0.conv' (Lfm2ShortConv)" in msg and "S=48" in msg, msg
        assert restored, "the refused CP install was not rolled back"
