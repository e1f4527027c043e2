"""A token-mixer family added from this test module alone (no file under ``hyper_parallel/``
edited), the way ``models/<model_type>/`` adds one (docs/architecture.md, Recipe 2):

* its class ``ToyShortConv`` registered with a generic core (the short-conv halo exchange,
  ``HALO_FAMILIES.registered``), which then accepts it by name;
* its own mixer ``ToyPrefixMixer`` (a causal prefix sum: ``out_proj(cumsum(in_proj(x)))``, restarted at
  every document) with its own method row ``toy_prefix_sum`` and entry point here
  (``extension.registered_method`` with a mixer row);

run end to end in a real transformers LFM2 (tiny random config) — planner, applier with the preflight
proof, CP=2 against CP=1 on plain, padded and packed batches — and gone again after the block."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from hyper_parallel.distributed.context_parallel import catalogue
from hyper_parallel.distributed.context_parallel.collectives import all_gather_seq
from hyper_parallel.distributed.context_parallel.extension import registered_method
from hyper_parallel.distributed.context_parallel.mixers import HALO_FAMILIES
from hyper_parallel.distributed.context_parallel.mixers.rows import current_fqn, hidden_param, mixer_call, require_class
from hyper_parallel.distributed.context_parallel.registry import inner_wrapper

CP, S, TOL = 2, 30, 2e-5      # fp32: the CP path differs from CP=1 by summation order only
NAME = "toy_prefix_sum"
WHAT = "toy_prefix_sum_cp_wrapper"


class ToyPrefixMixer(nn.Module):
    """A toy token mixer: ``out_proj(cumsum_t(in_proj(x)))``; LFM2's conv call signature."""

    def __init__(self, hidden: int):
        super().__init__()
        self.in_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        del cache, attention_mask, kwargs   # CP=1 reference: one document per row, right padding
        return self.out_proj(torch.cumsum(self.in_proj(hidden_states), dim=1))


def prefix_sums(u: torch.Tensor, doc) -> torch.Tensor:
    """``cumsum`` over dim 1 of ``u [B, S, H]``, restarted where ``doc [B, S]`` (document ids) changes."""
    cs = torch.cumsum(u, dim=1)
    if doc is None:
        return cs
    B, T = doc.shape
    t = torch.arange(T, device=u.device).expand(B, T)
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values      # each token's document start
    before = torch.cat([torch.zeros_like(cs[:, :1]), cs[:, :-1]], dim=1)
    return cs - before.gather(1, first[..., None].expand_as(cs))


def validate_toy_prefix_sum(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    require_class(WHAT, target_module, tp_size, ("ToyPrefixMixer",), "re-runs ToyPrefixMixer's prefix sum")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_toy_prefix_sum)
def toy_prefix_sum_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """The prefix sum over the gathered ``in_proj`` outputs (AllGather; backward: ReduceScatter),
    restarted at every document of the batch meta; this rank's slice through ``out_proj``."""
    del mesh, tp_mesh, ep_mesh
    m, original, name, fqn = target_module, target_module.forward, hidden_param(target_module), current_fqn()

    def forward(*args, **kwargs):
        entry = mixer_call(WHAT, fqn, name, cp_mesh, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, hs, _rebuild, _rest_args, _rest_kwargs = entry
        L = hs.shape[1]
        u = all_gather_seq(m.in_proj(hs), cp_mesh, dim=1, tag="cp.toy_prefix")
        doc = None if meta.key_doc is None else meta.key_doc.to(hs.device)
        return m.out_proj(prefix_sums(u, doc)[:, meta.cp_rank * L:(meta.cp_rank + 1) * L])

    forward.__wrapped__ = original
    forward.__hp_mixer__ = WHAT
    return forward


ROW = catalogue.CPMethod(
    name=NAME, title="toy prefix sum (a test module's own family)", kind="mixer", batch_policy="all_gather",
    head_rule="module", head_doc="none (all channels on the gathered sequence)", cost="mixers.cost:SEQUENCE_GATHER",
    offers=(catalogue.Offer("hf", WHAT, NAME, module=__name__),))


@contextlib.contextmanager
def toy_family():
    """What the family's ``models/<model_type>/__init__.py`` would do at import, for a ``with`` block."""
    with registered_method(ROW, None, globals()), HALO_FAMILIES.registered("ToyShortConv"):
        yield


def build_toy():
    """A tiny LFM2 whose layer 0 conv is the family's ToyShortConv, layer 1 its ToyPrefixMixer."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.Lfm2Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                       layer_types=["conv", "conv", "full_attention"])
    model = T.AutoModelForCausalLM.from_config(cfg)
    conv = model.model.layers[0].conv      # a new family's short conv with LFM2's layout: a subclass by its name
    conv.__class__ = type("ToyShortConv", (type(conv),), {})
    model.model.layers[1].conv = ToyPrefixMixer(cfg.hidden_size)
    return model.float().train()


PLAN = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": "sdpa_hf"},
        {"match": "model.layers.0.conv", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": "short_conv_halo"},
        {"match": "model.layers.1.conv", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": NAME}]


def toy_family_case(cp: int) -> dict:
    """On each rank: the family registered, planned and applied (preflight proof), parity per batch."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    from tests.cp.test_mixer_cp import parity_step
    from tests.wrappers._workers import mesh_ctx

    with toy_family():
        model, ref = build_toy(), build_toy()
        ref.load_state_dict(model.state_dict())
        mesh = mesh_ctx(cp)
        plan = ShardingPlanner(plan_overrides=PLAN).plan(model, mesh, cp_size=cp)
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=True)
        layers = model.model.layers
        installed = [getattr(layers[i].conv.forward, "__hp_mixer__", None) for i in (0, 1)]
        steps = [parity_step(model, ref, mesh, plan, k, S + i, 10 * i + 3)
                 for i, k in enumerate(("plain", "padding", "packed"))]
    return {"installed": installed, "steps": steps, "left": NAME in catalogue.METHODS or "ToyShortConv" in HALO_FAMILIES}


def test_a_mixer_family_added_from_a_test_module_runs_end_to_end_toy_family(ranks):
    for r, got in enumerate(ranks(CP).run(toy_family_case, CP, timeout=600.0)):
        assert got["installed"] == ["short_conv_halo_cp_wrapper", WHAT], got["installed"]
        for st in got["steps"]:
            print(f"toy family rank {r} {st['kind']} S={st['S']}: logits max abs {st['logits_abs']:.2e} "
                  f"(rel {st['logits_rel']:.2e}), grads max abs {st['grads_abs']:.2e} (rel {st['grads']:.2e}, "
                  f"worst {st['worst_param']}), tol {TOL:g}")
            assert st["logits_rel"] <= TOL and st["grads"] <= TOL, st
        assert not got["left"], "the family stayed registered after its block"
    assert NAME not in catalogue.METHODS and "ToyShortConv" not in HALO_FAMILIES


def test_a_registered_family_is_read_everywhere_and_removed_after_toy_family():
    from hyper_parallel.distributed.context_parallel.mixers.halo import validate_short_conv_halo
    from hyper_parallel.distributed.context_parallel.registry import get_registered
    from hyper_parallel.distributed.context_parallel.semantics import mixer_methods_for

    model = build_toy()
    conv, toy = model.model.layers[0].conv, model.model.layers[1].conv
    with pytest.raises(ValueError, match="ToyShortConv is not one of them"):
        validate_short_conv_halo(conv, cp_size=2)
    before = dict(catalogue.METHODS)
    with toy_family():
        validate_short_conv_halo(conv, cp_size=2)                 # the core now accepts the family's class
        assert get_registered(NAME) is toy_prefix_sum_cp_wrapper and catalogue.get_method(NAME, "mixer") is ROW
        assert mixer_methods_for(toy, 2) == ["sequence_gather", NAME] and "short_conv_halo" in mixer_methods_for(conv, 2)
        assert catalogue.cost_model(NAME) is catalogue.cost_model("sequence_gather")
        assert f"`{NAME}`" in catalogue.support_matrix_markdown()
        with pytest.raises(ValueError, match="already"):
            with toy_family():
                pass
    assert catalogue.METHODS == before and get_registered(NAME) is None
    with pytest.raises(ValueError, match="ToyShortConv is not one of them"):
        validate_short_conv_halo(conv, cp_size=2)
    with pytest.raises(ValueError, match="takes no strategy"):
        with registered_method(ROW, type("S", (), {}), globals()):
            pass
