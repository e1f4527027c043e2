"""A model that takes images is planned at cp > 1 only with its family's vision tower registered
(docs/vlm.md): otherwise the plan resolver refuses it before any collective, whatever is declared —
its vision attention by name, or, for a tower with no attention the resolver recognises (Fuyu's patch
projection), its media input. Real transformers classes built tiny (tests/cp/zoo_vlm.py)."""
from __future__ import annotations

import pytest

from hyper_parallel.distributed.context_parallel.vision import media_inputs
from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.plan.resolver import PlanOverrideResolver
from hyper_parallel.distributed.plan.spec import parse_plan_overrides

from tests.cp import zoo, zoo_vlm


def _resolve(model, cp: int, skip=None):
    return PlanOverrideResolver(parse_plan_overrides(zoo.declarations(model, skip)), cp).resolve(model)


def test_media_input_without_registered_tower_refused():
    """Fuyu encodes image patches with a Linear (no attention in its tower): the language model's
    attention is declared, yet at cp 2 the model is refused, naming the projection, the input and the
    fix; at cp 1 it resolves (nothing is sharded)."""
    model, why = zoo_vlm.build_tiny("fuyu")
    assert model is not None, why
    assert "pixel_values" in media_inputs(model)
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.vision_embed_tokens'" in msg and "pixel_values" in msg, msg
    assert "no vision tower is registered for model_type 'fuyu'" in msg and "accelerator.cp_size=1" in msg, msg
    _resolve(model, 1)


def test_vision_attention_refused_before_a_declared_method_is_checked():
    """LLaVA with ``*.self_attn`` declared (which also matches its CLIP tower's attention): the refusal
    is the vision encoder's, not the declared wrapper's own check on the tower's attention."""
    model, why = zoo_vlm.build_tiny("llava")
    assert model is not None, why
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.vision_tower.encoder.layers.0.self_attn'" in msg, msg
    assert "attention of a vision encoder" in msg and "docs/vlm.md" in msg, msg


def test_registered_tower_resolves_at_cp2_and_refuses_a_method_on_it():
    """Qwen2.5-VL (registered): with the language model's attentions declared its tower needs no method
    and is not refused; a CP method declared on the tower's attention (``*.attn`` also matches
    ``model.visual.blocks.0.attn``) is refused by name — the tower runs per rank on whole images."""
    from hyper_parallel.distributed.context_parallel.vision import vision_tower

    model, why = zoo_vlm.build_tiny("qwen2_5_vl")
    assert model is not None, why
    plan = _resolve(model, 2, skip=vision_tower(model).holds)
    assert plan.targets and all(t.fqn.startswith("model.language_model.") for t in plan.targets), plan.summary()
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.visual.blocks.0.attn'" in msg and "registered vision tower (model.visual)" in msg, msg
