"""A model that takes images is planned at cp > 1 only with its family's vision tower registered
(docs/vlm.md): otherwise the plan resolver refuses it before any collective, whatever is declared —
its vision attention by name, or, for a tower with no attention the resolver recognises (Fuyu's patch
projection), its media input. Real transformers classes built tiny (tests/cp/zoo_vlm.py)."""
from __future__ import annotations

import pytest

from hyper_parallel.distributed.context_parallel.vision import media_input_names
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
    assert "pixel_values" in media_input_names(model)
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.vision_embed_tokens'" in msg and "pixel_values" in msg, msg
    assert "(model_type 'fuyu')" in msg and "whose tower is not registered" in msg, msg
    assert "accelerator.cp_size=1" in msg, msg
    _resolve(model, 1)


def test_vision_attention_refused_before_a_declared_method_is_checked():
    """PaliGemma with ``*.self_attn`` declared (which also matches its SigLIP tower's attention): the
    refusal is the vision encoder's, not the declared wrapper's own check on the tower's attention."""
    model, why = zoo_vlm.build_tiny("paligemma")
    assert model is not None, why
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.vision_tower.encoder.layers.0.self_attn'" in msg, msg
    assert "attention of a vision encoder" in msg and "docs/vlm.md" in msg, msg


def test_registered_tower_resolves_at_cp2_and_refuses_a_method_on_it():
    """Qwen2.5-VL (registered): with the language model's attentions declared its tower needs no method
    and is not refused; an entry matching only the tower's attentions (the zoo's ``*.attn``:
    ``model.visual.blocks.N.attn``) is refused by name — the tower runs per rank on whole images."""
    from hyper_parallel.distributed.context_parallel.vision import vision_tower

    model, why = zoo_vlm.build_tiny("qwen2_5_vl")
    assert model is not None, why
    plan = _resolve(model, 2, skip=vision_tower(model).holds)
    assert plan.targets and all(t.fqn.startswith("model.language_model.") for t in plan.targets), plan.summary()
    with pytest.raises(CPConfigError) as ei:
        _resolve(model, 2)
    msg = str(ei.value)
    print(msg)
    assert "module 'model.visual.blocks.0.attn'" in msg, msg
    assert "only modules of the vision tower (model.visual)" in msg, msg


def test_every_image_text_to_text_class_that_takes_images_is_seen():
    """Every class of transformers' image-text-to-text mapping whose ``forward`` takes anything named
    like a medium (pixel, image, video, patch) has a media input the planner recognises
    (``media_input_names``), so none can be planned at cp > 1 without a registered tower, built or not."""
    import inspect
    import re

    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    medium = re.compile(r"pixel|image|video|patch")
    unseen, seen = [], 0
    for model_type, name in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
        cls = getattr(T, name)
        params = [p for p in inspect.signature(cls.forward).parameters if medium.search(p)]
        if params and not media_input_names(cls):
            unseen.append((model_type, params))
        seen += bool(params)
    print(f"{seen} of {len(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)} classes take media; unrecognised: {unseen}")
    assert seen >= 90 and not unseen, unseen
