"""The architecture zoo: every causal-LM architecture of the installed transformers, built tiny on
CPU (random weights, nothing downloaded), planned and applied at CP=2 through the library API
(``ShardingPlanner.plan`` -> ``apply_sharding_plan``, default preflight proof) and compared with
the same model at CP=1 (logits and every gradient, plain and packed rows).

Outcomes: ``PASS`` (applied, within tolerance), ``REFUSED`` (refused before the first step or at
the first call, with the message), ``WRONG`` (applied and outside tolerance: a bug), ``SKIP``
(transformers cannot build it tiny, or it is not a decoder the CP batch can feed: the reason).
Used by ``tests/cp/test_zoo.py`` (a fixed subset; all with ``HYPER_PARALLEL_ZOO=all``) and
``scripts/zoo_table.py`` (docs/zoo.md).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

TOL = 1e-4          # fp32: relative to max |logits| / to the model's largest gradient
KINDS = ("plain", "packed")
S = 24

#: fixed CI subset: one representative per semantic the CP path carries or refuses
SUBSET = ("llama", "qwen3", "mistral", "gemma2", "gpt_oss", "deepseek_v3", "deepseek_v32", "doge",
          "qwen3_next", "lfm2", "falcon_h1", "minimax")

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, attention_dropout=0.0, attn_dropout=0.0, dropout=0.0, hidden_dropout=0.0,
             resid_dropout=0.0, embd_dropout=0.0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_local_experts=4, num_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, max_position_embeddings=256, n_embd=64, n_head=4, n_layer=2, d_model=64,
             ffn_dim=64, n_inner=64, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=12, n_group=1, topk_group=1, index_topk=6, index_head_dim=16, index_n_heads=16,
             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
             mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
             block_size=16, sliding_window=16, attention_chunk_size=16, intermediate_size_mlp=64,
             first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
#: model_type -> config kwargs of its own (over _TINY)
_EXTRA = {
    "doge": dict(keep_window_size=64),
}

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer", "attn_layer")
_SPECIAL = {"DeepseekV32Attention": "dsa_all_gather", "GlmMoeDsaAttention": "dsa_all_gather",
            "DogeAttention": "doge_dynamic_mask",
            "KimiLinearAttention": "sdpa_hf"}   # Kimi Linear's MLA softmax attention (its KDA is the mixer)


def _mixer_classes() -> dict:
    """Token-mixer class name -> its state-passing method, from each method module's class list."""
    from hyper_parallel.distributed.context_parallel.mixers.mamba1 import MAMBA1_FAMILIES
    from hyper_parallel.models.kimi_linear.kda import KDA_CLASSES
    from hyper_parallel.models.minimax.lightning import LIGHTNING_CLASSES
    from hyper_parallel.models.recurrent_gemma.rglru import RGLRU_CLASSES

    table = {}
    for classes, method in ((MAMBA1_FAMILIES.classes(), "mamba1_state_passing"), (KDA_CLASSES, "kda_state_passing"),
                            (LIGHTNING_CLASSES, "lightning_state_passing"), (RGLRU_CLASSES, "rglru_state_passing")):
        table.update(dict.fromkeys(classes, method))
    return table


def architectures() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layered(cfg, n: int) -> dict:
    """Per-layer list fields cut to ``n`` layers keeping each distinct entry once (hybrids keep every kind)."""
    out = {}
    L = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(L, int):
        return out
    for name, val in vars(cfg).items():
        if isinstance(val, (list, tuple)) and len(val) == L and L > 0 and name not in ("architectures",):
            picks = []
            for i, v in enumerate(val):
                if all(v != val[j] for j in picks):
                    picks.append(i)
            while len(picks) < n and len(picks) < L:
                picks.append(next(i for i in range(L) if i not in picks))
            out[name] = [val[i] for i in sorted(picks)[:max(n, len(picks))]]
    return out


_MINIMAL = ("vocab_size", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings",
            "attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "resid_dropout", "embd_dropout",
            "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob")
_SIZES = _MINIMAL + ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "n_embd",
                     "n_head", "n_layer", "d_model", "ffn_dim", "n_inner")


def _attempt(model_type: str, cls, kw: dict, base):
    import transformers as T

    lists = _layered(base, 2)
    n = max([2] + [len(v) for v in lists.values()])
    kw = dict(kw)
    if hasattr(base, "num_hidden_layers"):
        kw["num_hidden_layers"] = n
        kw.update(_layered(base, n))
    last = None
    for impl in ("sdpa", "eager"):
        try:
            with torch.device("meta"):          # count first: a default-sized model never materializes
                n_params = sum(p.numel() for p in T.AutoModelForCausalLM.from_config(
                    cls(**kw), attn_implementation=impl).parameters())
            if n_params > 20_000_000:
                return None, f"not tiny: {n_params / 1e6:.0f}M parameters with the tiny overrides"
            torch.manual_seed(0)
            model = T.AutoModelForCausalLM.from_config(cls(**kw), attn_implementation=impl)
            break
        except Exception as exc:  # noqa: BLE001
            last = exc
    else:
        return None, f"build: {type(last).__name__}: {str(last)[:160]}"
    model = model.float().train()
    try:
        with torch.no_grad():
            ids = torch.randint(3, 100, (1, 8))
            try:
                model(input_ids=ids, use_cache=False)
            except TypeError:
                model(input_ids=ids)
    except Exception as exc:  # noqa: BLE001
        return None, f"forward: {type(exc).__name__}: {str(exc)[:160]}"
    return model, None


def _has(cfg, name: str) -> bool:
    """``hasattr`` that also treats transformers' per-layer attributes (which raise on global access) as present."""
    try:
        getattr(cfg, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError: the field exists
        return True
    return True


def mla_sizes(kw: dict) -> None:
    """The tiny sizes of multi-head latent attention, in place: the rotary width is ``head_dim``, and K/V
    are expanded to every query head."""
    if "qk_rope_head_dim" in kw and "head_dim" in kw:
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)


def build_tiny(model_type: str):
    """(model in train mode, None) or (None, reason transformers cannot build it tiny): the full tiny
    overrides, then only the sizes, then only vocabulary / dropout (each with 2+ layers, every
    per-layer kind kept)."""
    import transformers as T

    try:
        cls = T.CONFIG_MAPPING[model_type]
        base = cls()
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return None, f"config: {type(exc).__name__}: {str(exc)[:120]}"
    if getattr(base, "is_encoder_decoder", False):
        return None, "encoder-decoder (not a decoder-only causal LM)"
    full = {k: v for k, v in {**_TINY, **_EXTRA.get(model_type, {})}.items() if _has(base, k)}
    for k, v in vars(base).items():                         # every dropout of the config off (train mode)
        if ("drop" in k or "pdrop" in k) and isinstance(v, float) and not isinstance(v, bool):
            full[k] = 0.0
    mla_sizes(full)
    reasons = []
    for keys in (None, _SIZES, _MINIMAL):
        kw = full if keys is None else {k: v for k, v in full.items() if k in keys or "drop" in k}
        model, why = _attempt(model_type, cls, kw, base)
        if model is not None:
            return model, None
        reasons.append(why)
    return None, " | ".join(dict.fromkeys(reasons))


def declarations(model: nn.Module, skip=None) -> list:
    """plan_overrides for ``model``: every softmax attention (by leaf name) with ``sdpa_hf`` (or its
    family's method), known token mixers with their catalogue method; the rest is left to the proof.
    ``skip(fqn)``: modules left undeclared (a registered vision tower); a leaf name they share is
    declared by exact module paths."""
    from hyper_parallel.distributed.context_parallel.mixers import HALO_FAMILIES
    from hyper_parallel.distributed.context_parallel.mixers.mamba2 import MAMBA2_FAMILIES
    from hyper_parallel.models.qwen3_next.gated_deltanet import GDN_CLASSES

    mixers = _mixer_classes()
    found, skipped = [], set()                   # (fqn, leaf, method) of every module to declare
    for fqn, mod in model.named_modules():
        leaf, cls = fqn.rsplit(".", 1)[-1], type(mod).__name__
        if skip is not None and skip(fqn):
            skipped.add(leaf)
            continue
        method = None
        if cls in _SPECIAL:
            method = _SPECIAL[cls]
        elif cls in mixers:
            method = mixers[cls]
        elif cls in MAMBA2_FAMILIES:
            method = "mamba2_state_passing"
        elif cls in GDN_CLASSES:
            method = "gated_deltanet_state_passing"
        elif cls in HALO_FAMILIES:
            method = "short_conv_halo"
        elif leaf in ATTN_NAMES and "Attention" in cls and not cls.endswith(("LinearAttention", "DeltaAttention")):
            method = "sdpa_hf"
        if method is not None:
            found.append((fqn, leaf, method))
    methods_of: dict = {}
    for _, leaf, method in found:
        methods_of.setdefault(leaf, set()).add(method)
    entries, seen = [], set()
    for fqn, leaf, method in found:
        # one method per attention leaf name: a wildcard; several (hybrids naming every mixer alike): exact fqns
        match = f"*.{leaf}" if leaf in ATTN_NAMES and len(methods_of[leaf]) == 1 and leaf not in skipped else fqn
        if match in seen:
            continue
        seen.add(match)
        entries.append({"match": match, "when": "cp", "region_dispatch": False, "inner_target": "self",
                        "inner_wrapper": method})
    return entries


def _refusal(exc: BaseException) -> bool:
    mod = type(exc).__module__ or ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return mod.startswith("hyper_parallel") or "/hyper_parallel/" in where


def run_one(model_type: str) -> dict:
    """One architecture at CP=2 on this rank (all ranks call it): the outcome dict."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx

    t0 = time.perf_counter()
    out = {"arch": model_type}
    model, reason = build_tiny(model_type)
    if model is None:
        return {**out, "status": "SKIP", "detail": reason, "time_s": time.perf_counter() - t0}
    ref, _ = build_tiny(model_type)
    ref.load_state_dict(model.state_dict())
    from tests.cp.test_dsa_cp import tie_rule_reference   # DSA / Doge: CP=1 with the methods' tie rules

    if hasattr(getattr(ref, "model", None), "layers"):
        tie_rule_reference(ref)
    entries = declarations(model)
    out["declared"] = sorted({f"{e['match']}: {e['inner_wrapper']}" for e in entries})
    mesh = mesh_ctx(2)
    try:
        plan = ShardingPlanner(plan_overrides=entries).plan(model, mesh, cp_size=2)
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {**out, "status": "REFUSED", "detail": f"{type(exc).__name__}: {str(exc)[:400]}",
                "time_s": time.perf_counter() - t0}
    return compare(model, ref, mesh, plan, out, t0)


def compare(model, ref, mesh, plan, out: dict, t0: float) -> dict:
    """The CP model against ``ref`` on plain and packed text rows: ``out`` with PASS / WRONG and the errors,
    or REFUSED / ERROR at the first step."""
    from tests.cp.test_mixer_cp import parity_step

    worst = {"logits_rel": 0.0, "grads": 0.0}
    for i, kind in enumerate(KINDS):
        try:
            st = parity_step(model, ref, mesh, plan, kind, S, 10 * i + 3)
        except Exception as exc:  # noqa: BLE001
            status = "REFUSED" if _refusal(exc) else "ERROR"
            return {**out, "status": status, "detail": f"at the first {kind} step: {type(exc).__name__}: "
                                                       f"{str(exc)[:400]}", "time_s": time.perf_counter() - t0}
        worst = {k: max(worst[k], st[k]) for k in worst}
    ok = worst["logits_rel"] <= TOL and worst["grads"] <= TOL
    return {**out, "status": "PASS" if ok else "WRONG", "logits_rel": worst["logits_rel"], "grads": worst["grads"],
            "detail": out.get("detail", ""), "time_s": time.perf_counter() - t0}


def run_many(model_types: list, run=None) -> list:
    """``run`` (default :func:`run_one`) on each type, an exception recorded as ERROR: one type never
    stops the sweep."""
    res = []
    for t in model_types:
        try:
            res.append((run or run_one)(t))
        except Exception as exc:  # noqa: BLE001 - one architecture never stops the sweep
            res.append({"arch": t, "status": "ERROR", "detail": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return res
