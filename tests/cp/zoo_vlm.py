"""The architecture zoo's image-text-to-text half: every model type of transformers'
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, built tiny on CPU (its own config class, every sub-config
— text, vision, projector — with small sizes; random weights, nothing downloaded), planned and applied at
CP=2 through the library API (``ShardingPlanner.plan`` -> ``apply_sharding_plan``) with the zoo's
declarations on the language model's attentions.

Outcomes (docs/zoo.md, second table): ``PASS`` (a registered tower: its family's one-step test,
``PARITY``, gives logits of every token and every gradient, tower included, equal to one rank with the
images spread by ``media_embeddings_for_cp``; or a mapped class that takes no images, compared on text
rows as the text zoo does), ``REFUSED`` (the planner's message), ``NOT BUILT`` (transformers cannot build
it tiny here: the reason), ``WRONG`` (a bug: a wrong result, or a model with a media input accepted at
cp 2 without a registered tower, whose tower would see only a shard).
"""
from __future__ import annotations

import importlib
import time

import torch

from tests.cp import zoo

#: CI subset: a registered tower (PASS with images) and a model whose tower has no attention (Fuyu's patch
#: projection: REFUSED by its media input, which no family's registration changes)
SUBSET = ("qwen2_5_vl", "fuyu")
MAX_PARAMS = 50_000_000
#: a registered tower's family test (tests/vlm/): model_type -> (module, function, kwargs), called with cp=2
#: on every rank; one step with images through media_embeddings_for_cp against one rank -> its errors
#: (``logits``, ``grads`` relative; ``vision_grad_max`` > 0: the tower is trained)
PARITY = {"qwen2_vl": ("tests.vlm._workers", "vlm_parity", {"arch": "qwen2_vl"}),
          "qwen2_5_vl": ("tests.vlm._workers", "vlm_parity", {"arch": "qwen2_5_vl"}),
          "qwen3_vl": ("tests.vlm._workers", "vlm_parity", {"arch": "qwen3_vl"}),
          # the families landing from their own branches (their tests' workers)
          "llava": ("tests.vlm._family_workers", "family_parity", {"arch": "llava"}),
          "qwen3_5": ("tests.vlm._family_workers", "family_parity", {"arch": "qwen3_5"}),
          "qwen3_5_moe": ("tests.vlm._family_workers", "family_parity", {"arch": "qwen3_5_moe"}),
          "gemma3": ("tests.vlm._gemma3_workers", "gemma3_parity", {})}
#: vision / projector sizes over zoo._TINY (where the sub-config has the field)
_VISION = dict(depth=2, num_layers=2, num_hidden_layers=2, num_heads=4, embed_dim=64, out_hidden_size=64,
               projection_dim=64, hidden_size=64, intermediate_size=64, mlp_ratio=1, num_attention_heads=4,
               vision_output_dim=64, projector_hidden_size=64, qformer_hidden_size=64, encoder_hidden_size=64,
               num_global_layers=1, decoder_layers=2, encoder_layers=2, text_hidden_size=64, vocab_size=128)
_TEXT_CONFIGS = ("text_config", "decoder")
#: model_type -> config kwargs of its own (a sub-config's under its name): Chameleon / Emu3 need an image
#: vocabulary, Molmo2's adapter the layers of the tiny tower
_IMAGE_VOCAB = {"<image>": 100, **{f"IMGIMG{chr(65 + i)}Z": 110 + i for i in range(10)}}
_EXTRA = {"chameleon": dict(vocabulary_map=_IMAGE_VOCAB), "emu3": dict(vocabulary_map=_IMAGE_VOCAB),
          "molmo2": dict(adapter_config=dict(vision_feature_layer=[-1, -2]))}


def architectures() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _tiny_kwargs(cfg, sizes: dict) -> dict:
    """``sizes`` where ``cfg`` has the field (every dropout off), per-layer lists cut to the layer count."""
    kw = {}
    for k, v in sizes.items():
        if not zoo._has(cfg, k):
            continue
        old = vars(cfg).get(k)
        if isinstance(old, (list, tuple, dict)):       # e.g. per-stage widths: left at their defaults
            continue
        kw[k] = float(v) if isinstance(old, float) and not isinstance(v, bool) else v
    for k, v in vars(cfg).items():
        if ("drop" in k or "pdrop" in k) and isinstance(v, float):
            kw[k] = 0.0
    zoo.mla_sizes(kw)
    if "num_hidden_layers" in kw and isinstance(vars(cfg).get("num_hidden_layers"), int):
        # as zoo.build_tiny: 2+ layers, every per-layer kind kept
        n = max([kw["num_hidden_layers"]] + [len(v) for v in zoo._layered(cfg, kw["num_hidden_layers"]).values()])
        kw["num_hidden_layers"] = n
        kw.update(zoo._layered(cfg, n))
    rope = vars(cfg).get("rope_parameters")
    rope = rope if isinstance(rope, dict) and "rope_type" in rope else None        # one flat dict (not per layer)
    heads = kw.get("num_attention_heads") or vars(cfg).get("num_attention_heads") or 1
    half = (kw.get("head_dim") or kw.get("hidden_size", 0) // heads) // 2
    # 3-D RoPE (its sections, or the model's default [16, 24, 24]): sections summing to the tiny head's half
    sec = rope.get("mrope_section") if rope else None
    if rope and not sec and "mrope_section" in getattr(type(cfg), "ignore_keys_at_rope_validation", ()):
        sec = [16, 24, 24]
    if sec and half and "hidden_size" in kw:
        new = [max(1, half * s // sum(sec)) for s in sec]
        new[-1] += half - sum(new)
        kw["rope_parameters"] = {**rope, "mrope_section": new}
    return kw


def _sub_dict(sub, sizes: dict) -> dict:
    from transformers import PretrainedConfig

    d = sub.to_dict()
    if d.get("per_layer_config"):         # layers configured by index: their count stays
        sizes = {k: v for k, v in sizes.items() if k != "num_hidden_layers"}
    d.update(_tiny_kwargs(sub, sizes))
    for name in getattr(sub, "sub_configs", {}) or {}:        # nested sub-configs, tiny as well
        inner = getattr(sub, name, None)
        if isinstance(inner, PretrainedConfig):
            d[name] = _sub_dict(inner, sizes)
    return d


def tiny_config(model_type: str, level: int = 0):
    """The model's own config with small sizes: ``level`` 0 every sub-config tiny, 1 the same without
    grouped K/V heads, 2 the text config only, 3 sizes left at their defaults (vocabulary and dropout)."""
    import transformers as T

    cls = T.CONFIG_MAPPING[model_type]
    base = cls()
    text = {**zoo._TINY, "num_hidden_layers": 2} if level < 3 else \
        {k: v for k, v in zoo._TINY.items() if k in zoo._MINIMAL}
    if level == 1:
        text["num_key_value_heads"] = text["num_attention_heads"]
    kw, has_text = {}, False
    for name in getattr(base, "sub_configs", {}) or {}:
        sub = getattr(base, name, None)
        if not isinstance(sub, T.PretrainedConfig):
            continue
        is_text = name in _TEXT_CONFIGS
        has_text |= is_text
        kw[name] = _sub_dict(sub, text if is_text else (_VISION if level < 2 else {}))
    # the language model's sizes at the top level where there is no text sub-config (Chameleon, Emu3)
    minimal = {k: v for k, v in zoo._TINY.items() if k in zoo._MINIMAL}
    kw.update(_tiny_kwargs(base, text if not has_text else minimal))
    for k, v in _EXTRA.get(model_type, {}).items():
        if isinstance(kw.get(k), dict) and isinstance(v, dict):
            kw[k].update(v)
        else:
            kw[k] = v
    kw["use_cache"] = False
    return cls(**kw)


def build_tiny(model_type: str):
    """(the mapped class in train mode, fp32, None) or (None, the reason it is not built tiny here)."""
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_cls = getattr(T, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    reasons = []
    for level in (0, 1, 2, 3):
        try:
            cfg = tiny_config(model_type, level)
        except Exception as exc:  # noqa: BLE001 - the reason is the result
            reasons.append(f"config: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        for impl in ("sdpa", "eager"):
            try:
                with torch.device("meta"):
                    n = sum(p.numel() for p in model_cls._from_config(cfg, attn_implementation=impl).parameters())
                if n > MAX_PARAMS:
                    reasons.append(f"not tiny: {n / 1e6:.0f}M parameters with the tiny sizes")
                    break
                torch.manual_seed(0)
                model = model_cls._from_config(cfg, attn_implementation=impl)
                return model.float().train(), None
            except Exception as exc:  # noqa: BLE001
                reasons.append(f"build: {type(exc).__name__}: {str(exc)[:160]}")
    return None, " | ".join(dict.fromkeys(reasons))


def run_one(model_type: str) -> dict:
    """One image-text-to-text type at CP=2 on this rank (all ranks call it): the outcome dict."""
    from hyper_parallel.distributed.context_parallel.vision import media_input_names, vision_tower
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx

    t0 = time.perf_counter()
    out = {"arch": model_type}
    model, reason = build_tiny(model_type)
    if model is None:
        return {**out, "status": "NOT BUILT", "detail": reason, "time_s": time.perf_counter() - t0}
    tower = vision_tower(model)       # (hyper_parallel imports every family's registration)
    entries = zoo.declarations(model, skip=tower.holds if tower is not None else None)
    out["declared"] = sorted({f"{e['match']}: {e['inner_wrapper']}" for e in entries})
    out["tower"] = tower.prefix if tower is not None else ""
    mesh = mesh_ctx(2)
    try:
        plan = ShardingPlanner(plan_overrides=entries).plan(model, mesh, cp_size=2)
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        status = "REFUSED" if zoo._refusal(exc) else "ERROR"
        return {**out, "status": status, "detail": f"{type(exc).__name__}: {str(exc)[:400]}",
                "time_s": time.perf_counter() - t0}
    if tower is None and media_input_names(model):    # accepted with no registered tower: it would see a shard
        return {**out, "status": "WRONG", "detail": "accepted at cp 2 without a registered vision tower",
                "time_s": time.perf_counter() - t0}
    if tower is None:      # the mapped class takes no images (a text model): the text zoo's comparison
        ref, _ = build_tiny(model_type)
        ref.load_state_dict(model.state_dict())
        return zoo.compare(model, ref, mesh, plan, {**out, "detail": f"{type(model).__name__} takes no images: "
                                                                     "compared on text rows"}, t0)
    if model_type not in PARITY:
        return {**out, "status": "ERROR", "time_s": time.perf_counter() - t0,
                "detail": f"registered tower, but no one-step test with images in zoo_vlm.PARITY for {model_type!r}"}
    module, fn, kw = PARITY[model_type]
    st = getattr(importlib.import_module(module), fn)(cp=2, **kw)
    ok = st["logits"] <= zoo.TOL and st["grads"] <= zoo.TOL and st["vision_grad_max"] > 0
    return {**out, "status": "PASS" if ok else "WRONG", "logits_rel": st["logits"], "grads": st["grads"],
            "detail": "" if ok else f"worst {st['worst']}", "time_s": time.perf_counter() - t0}


def run_many(model_types: list) -> list:
    """:func:`zoo.run_many` with this module's :func:`run_one`."""
    return zoo.run_many(model_types, run_one)
