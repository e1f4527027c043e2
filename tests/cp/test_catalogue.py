"""The CP method catalogue is the one description of the methods, and every row works end to end.

* every readers' view (registry, strategy factory, batch policies, planner policy, wrapper entry
  points, docs support matrix) equals the catalogue's rows;
* every offered attention cell (method x style) is declared in a YAML file, planned, its batch
  sharded with the row's policy and length multiple, and its logits and gradients equal CP=1 on
  a tiny Llama at cp 4 (fp32; tolerance: logits max abs 1e-5, gradients max abs / max |ref grad|
  1e-5 per parameter; errors printed);
* every design / example ``_target_`` path still resolves.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import yaml

from hyper_parallel.distributed.context_parallel import catalogue
from hyper_parallel.distributed.context_parallel.batch import policy_multiple, shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.registry import (STYLES, get_registered, import_target, wrapper_methods,
                                                                  registered_names, wrapper_info)
from hyper_parallel.distributed.context_parallel.methods.factory import STRATEGY_CLASSES, build_strategy

from tests.wrappers import _workers as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DESIGN = "/work/shared/design/cp_design_phase1.zh.txt"
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5
CP = 4
S = 36            # a multiple of cp (4) but not of 2*cp (8): Head-Tail pads to 40, the others do not pad


def _cells():
    return [(m, o) for m, o in catalogue.offers("attention")]


# ---------------------------------------------------------------- the readers agree with the rows
def test_rows_are_complete():
    for m in catalogue.METHODS.values():
        styles = [o.style for o in m.offers]
        if m.kind == "attention":
            assert sorted(styles) == sorted(catalogue.STYLES), f"{m.name}: one offer per style, got {styles}"
            assert m.strategy in STRATEGY_CLASSES, m
        for o in m.offers:
            assert (o.entry is None) != (o.reason is None), f"{m.name} x {o.style}: entry xor reason"
            assert o.reason is None or len(o.reason) > 20


def test_method_families_are_read_off_the_rows():
    """Every attention row is in exactly one exchange family, and the families are what the readers
    (--explain's comm model, the async handoffs) use: no reader keeps its own list of names."""
    from hyper_parallel.distributed.context_parallel.wrappers import async_handoff, async_protocol

    fams = {}
    for m in catalogue.attention_methods():
        got = [f for f, hit in (("kv_only", catalogue.gathers_kv_only(m)),
                                ("head_tail", catalogue.gathers_kv(m) and not catalogue.gathers_kv_only(m)),
                                ("hybrid", catalogue.has_ulysses_degree(m)), ("ulysses", catalogue.splits_heads_over_cp(m))) if hit]
        assert len(got) == 1, f"{m.name}: one exchange family, got {got}"
        fams[m.name] = got[0]
    # the async plans: a family's rows share its builder (the balanced split: Colossal's / Hybrid's on the
    # permuted row), and wrappers/ keeps no list of names: every async loop is the method's own
    builders = {m.name: catalogue.async_plan_builder(m).__module__.rsplit(".", 2)[-2] for m in catalogue.async_methods()}
    own = {"kv_only": "colossal", "head_tail": "head_tail", "hybrid": "hybrid", "ulysses": "ulysses"}
    for name, fam in fams.items():
        layout = catalogue.METHODS[name].layout
        assert builders[name] == ("balanced" if layout == "balanced" else own[fam]), (name, builders[name])
    assert not any(hasattr(async_handoff, n) for n in ("KV_PIPELINED", "_HYBRID", "_PERMUTED"))
    assert {m for m in catalogue.METHODS if async_protocol.handoff_comm(m)} == {m.name for m in catalogue.async_methods()}


def _explain_comm(name, cp=4, **extra):
    from hyper_parallel.distributed.context_parallel.cost_model import LayerShape

    x = LayerShape(S=64, cp=cp, hq=4, hk=2, d=8, H=32, elem=4, params={"ulysses_degree": 2}, **extra)
    return catalogue.cost_model(name).comm(x)


def test_every_row_names_its_cost_model_and_the_trainer_names_no_method():
    """Each row's ``cost`` resolves to a CostModel, which every attention row fills in; --explain
    reads them through the row: no row name or alias is a string literal anywhere under trainer/, nor
    under wrappers/ (which drives the async handoff protocol around each row's own AsyncPlan)."""
    import ast
    import pathlib

    from hyper_parallel.distributed.context_parallel.cost_model import CostModel

    for m in catalogue.METHODS.values():
        assert m.cost, f"{m.name}: the row names no cost model"
        assert isinstance(catalogue.cost_model(m.name), CostModel), m.name
        for alias in m.aliases:
            assert catalogue.cost_model(alias) is catalogue.cost_model(m.name), alias
    for m in catalogue.attention_methods():
        got = _explain_comm(m.name)
        assert got and all(v > 0 for v in got.values()), f"{m.name}: no comm model ({got})"
        assert "bwd K/V regather" not in _explain_comm(m.name, recomputed=True), m.name   # the recompute gathers
    assert type(catalogue.cost_model("custom")) is CostModel and _explain_comm("custom") == {}
    names = {n for m in catalogue.METHODS.values() for n in (m.name,) + m.aliases}
    package = pathlib.Path(catalogue.__file__).parents[3]
    for folder in (package / "trainer", package / "distributed" / "context_parallel" / "wrappers"):
        found = [(p.name, node.lineno, node.value) for p in sorted(folder.rglob("*.py"))
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
        assert not found, f"method names in {folder.name}/: {found}"


def test_every_async_row_names_its_own_async_plan():
    """A row with async Targets names the builder of its async plan in its method folder
    (``methods/<m>/async_.py::async_plan``); a row without has none. wrappers/ only resolves it."""
    import inspect

    from hyper_parallel.distributed.context_parallel.wrappers import async_pipeline

    for m in catalogue.METHODS.values():
        build = catalogue.async_plan_builder(m)
        assert (build is not None) == bool(m.async_targets), m.name
        if build is not None:
            assert ".methods." in build.__module__ and build.__name__.endswith("async_plan"), (m.name, build)
    src = inspect.getsource(async_pipeline.make_plan)
    assert not any(f'"{n}"' in src for n in catalogue.METHODS), "make_plan names a method"


def test_registry_reads_the_catalogue():
    assert wrapper_methods() == tuple(m.name for m in catalogue.attention_methods()) + ("custom",)
    assert {s.registry_style for s in catalogue.STYLES.values()} <= set(STYLES)
    names = set(registered_names())
    for reg, target in catalogue.builtin_names().items():
        assert reg in names and get_registered(reg) is import_target(target), reg


def test_every_entry_point_is_a_catalogue_cell_and_back():
    from hyper_parallel.distributed.context_parallel import wrappers

    defined = {n for n in dir(wrappers) if wrapper_info(getattr(wrappers, n)) is not None
               and not wrapper_info(getattr(wrappers, n)).is_async}
    offered = {o.entry for _m, o in _cells()}
    assert defined == offered, (defined ^ offered)
    # the package's async (handoff-protocol) Targets are the catalogue rows' generic async targets
    generic_async = {n for n in dir(wrappers) if wrapper_info(getattr(wrappers, n)) is not None
                     and wrapper_info(getattr(wrappers, n)).is_async}
    listed = {t.rsplit(".", 1)[1] for m in catalogue.attention_methods() for t in catalogue.async_targets(m)
              if t.startswith(catalogue.WRAPPERS_MODULE + ".")}
    assert generic_async == listed and generic_async <= set(wrappers.__all__), generic_async ^ listed
    assert offered <= set(wrappers.__all__)
    for m, o in _cells():
        fn = import_target(o.target)
        info = wrapper_info(fn)
        assert info.method == m.name and info.style == catalogue.STYLES[o.style].registry_style, (o, info)
        assert info.qualname == o.target and not info.is_async and info.validate is not None
        assert info.named_params == ((m.degree_param,) if m.degree == "param" else ()), info
        if o.registry_name:
            assert wrappers.BUILTIN_NAMES[o.registry_name] is fn
    for m in catalogue.mixer_methods():
        (o,) = m.offers
        fn = import_target(o.target)
        assert wrapper_info(fn).mixer and get_registered(o.registry_name) is fn, m
    # and back: every registered built-in token-mixer method is a catalogue row
    mixers = {n for n in registered_names() if wrapper_info(get_registered(n)).mixer}
    assert mixers <= set(catalogue.builtin_names("mixer")), mixers - set(catalogue.builtin_names("mixer"))


def test_generated_entry_points_bind_their_signature():
    """The factory's entry points take exactly the row's named parameters: an unknown or missing
    one is a TypeError before anything is installed, as for a written function."""
    import inspect

    from hyper_parallel.distributed.context_parallel import wrappers

    for m in catalogue.async_methods():
        fn = import_target(m.async_targets[0])
        required, optional = catalogue.entry_params(m, True)
        assert tuple(inspect.signature(fn).parameters)[5:] == required + optional, fn
        assert m.async_param in optional and m.title in fn.__doc__ and m.async_doc in fn.__doc__
        vparams = inspect.signature(wrapper_info(fn).validate).parameters
        assert set(required + optional) <= set(vparams) and "tp_size" in vparams and "probe" in vparams
    with pytest.raises(TypeError, match="ulysses_degree"):
        wrappers.sdpa_hf_hybrid_cp_wrapper(torch.nn.Module(), None, None, None, None)
    with pytest.raises(TypeError, match="q_chunks"):
        wrappers.sdpa_hf_cp_wrapper(torch.nn.Module(), None, None, None, None, q_chunks=2)
    for m, o in _cells():
        assert m.title in import_target(o.target).__doc__


def test_async_variants_resolve():
    for m in catalogue.attention_methods():
        for target in catalogue.async_targets(m):
            info = wrapper_info(import_target(target))
            assert info.is_async and info.method == m.name and info.model_adapter, target
        assert m.async_targets or m.async_reason


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_batch_policies_read_the_catalogue(cp):
    for m in catalogue.attention_methods():
        for key in (m.name, m.batch_policy) + m.aliases:
            assert policy_multiple(key, cp) == (m.batch_policy, m.length_factor * cp), key
    with pytest.raises(ValueError, match="unknown CP padding policy"):
        policy_multiple("ring", cp)


def test_strategy_factory_reads_the_catalogue():
    """cp 1 (no group): every non-degree method and alias builds its row's class; the class's
    policy name and padding multiple are the row's."""
    METHOD_POLICY = catalogue.method_policies()

    for m in catalogue.attention_methods():
        cls = STRATEGY_CLASSES[m.strategy]
        assert cls.name == m.batch_policy == METHOD_POLICY[m.name] and cls.method == m.name
        if m.degree == "param":
            with pytest.raises(ValueError, match=f"needs {m.degree_param}"):
                build_strategy(m.name, None)
            continue
        for key in (m.name,) + m.aliases:
            s = build_strategy(key, None)
            assert type(s) is cls and s.padding_multiple(4) == 4 * m.length_factor
    with pytest.raises(ValueError, match="unknown CP method 'ring'"):
        build_strategy("ring", None)


def test_degree_rule_is_one_function():
    from hyper_parallel.distributed.context_parallel.wrappers import check_heads

    with pytest.raises(ValueError, match=r"1 < ulysses_degree < cp_size.*ulysses_degree=4, cp_size=4"):
        catalogue.check_degree("hybrid", 4, 4)
    with pytest.raises(ValueError, match="takes no ulysses_degree"):
        catalogue.check_degree("head_tail", 4, 2)
    with pytest.raises(ValueError, match="ulysses_degree == cp_size=4"):
        catalogue.check_degree("ulysses", 4, 2)
    catalogue.check_degree("hybrid", 8, 2)
    attn = torch.nn.Module()
    attn.num_heads, attn.num_key_value_heads = 4, 2
    with pytest.raises(ValueError, match=r"w: Hybrid needs .*ulysses_degree=3, cp_size=4"):
        check_heads("hybrid", attn, 4, 1, 3, "w")
    check_heads("ulysses", attn, 4, who="w")                              # KV heads replicated, sync and async
    few = torch.nn.Module()
    few.num_heads, few.num_key_value_heads = 2, 1
    with pytest.raises(ValueError, match=r"w: .*2.*4"):
        check_heads("ulysses", few, 4, who="w")                           # fewer query heads than the degree
    check_heads("colossal", attn, 4)
    check_heads("hybrid", attn, 4, ulysses_degree=2)


def test_planner_batch_policy_reads_the_catalogue():
    assert catalogue.batch_policy_for([]) == "all_gather"
    assert catalogue.batch_policy_for(["colossal", "custom"]) == "all_gather"
    assert catalogue.batch_policy_for(["colossal", "ulysses"]) == "ulysses"
    assert catalogue.batch_policy_for(["ulysses", "hybrid", "colossal"]) == "hybrid"
    assert catalogue.batch_policy_for(["head_tail"]) == "load_balance"


def test_docs_print_the_catalogue_matrix():
    text = open(os.path.join(ROOT, "docs", "wrappers.md"), encoding="utf-8").read()
    assert catalogue.support_matrix_markdown() in text, \
        "docs/wrappers.md's method catalogue is stale: paste catalogue.support_matrix_markdown()"
    assert catalogue.entry_table_markdown() in text, \
        "docs/wrappers.md's list of entry points is stale: paste catalogue.entry_table_markdown()"
    for m, o in ((m, o) for m in catalogue.attention_methods() for o in m.offers if o.reason):
        assert o.reason in text


# ---------------------------------------------------------------- design / example _target_ paths
def _design_targets() -> list:
    paths = set(re.findall(r"_target_:\s*(hyper_parallel\.[\w.]+)", open(DESIGN, encoding="utf-8").read()))
    for f in sorted(os.listdir(os.path.join(ROOT, "examples", "cp"))):
        if f.endswith(".yaml"):
            text = open(os.path.join(ROOT, "examples", "cp", f), encoding="utf-8").read()
            paths |= set(re.findall(r"_target_:\s*(hyper_parallel\.[\w.]+)", text))
    return sorted(paths)


def test_design_and_example_targets_resolve():
    targets = _design_targets()
    assert len(targets) >= 7, targets
    for t in targets:
        fn = import_target(t)
        assert wrapper_info(fn) is not None, t
    assert "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_load_balance_cp_wrapper" in targets


# ---------------------------------------------------------------- every offered cell end to end
def _cell_yaml(tmp_path, m, o) -> tuple[str, tuple, str]:
    """(YAML path declaring the cell on every attention, config overrides, model kind)."""
    st = catalogue.STYLES[o.style]
    wrapper = {"_target_": o.target}
    if m.degree == "param":
        wrapper[m.degree_param] = 2
    inner = "self" if st.forward == "hf" else "core_attention"
    doc = yaml.safe_load(open(os.path.join(ROOT, "examples", "cp", "colossal.yaml"), encoding="utf-8"))
    doc["accelerator"]["cp_size"] = CP
    doc["plan_overrides"] = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": inner,
                              "inner_wrapper": wrapper}]
    path = tmp_path / f"{o.entry}.yaml"
    path.write_text(yaml.safe_dump(doc))
    kv = ("model.config.num_key_value_heads=4",) if m.head_rule == "split" and m.degree == "cp" else ()
    kind = {"hf": "hf", "qkv": "qkv", "flex_hf": "flex_hf", "flex_qkv": "flex_qkv"}[o.style]
    return str(path), kv, kind


@pytest.mark.parametrize("cell", _cells(), ids=[o.entry for _m, o in _cells()])
def test_cell_end_to_end(ranks, tmp_path, cell):
    m, o = cell
    path, overrides, kind = _cell_yaml(tmp_path, m, o)
    # batch sharding with the row's policy: S padded to the row's multiple, before any collective
    local = shard_batch_for_cp({"input_ids": torch.ones(2, S, dtype=torch.long)}, (0, CP), m.batch_policy)
    mult = m.length_factor * CP
    assert local.meta.global_seq_len == -(-S // mult) * mult and local.meta.policy == m.batch_policy
    res = ranks(CP).run(W.cp_parity, path, overrides, model_kind=kind, S=S, grads=True, fsdp=False)
    la = max(r["logits"] for r in res)
    lr = max(r["logits_rel"] for r in res)
    ga = max(r["grads_abs"] for r in res)
    gr = max(r["grads"] for r in res)
    print(f"{o.entry} ({m.name} x {o.style}, cp {CP}): logits max abs {la:.2e} rel {lr:.2e} (tol abs {LOGIT_TOL:g}); "
          f"grads max abs {ga:.2e} rel {gr:.2e} (tol rel {GRAD_TOL:g})")
    for r in res:
        assert r["policy"] == m.batch_policy, r["summary"]
        assert r["logits"] <= LOGIT_TOL and r["grads"] <= GRAD_TOL, r
