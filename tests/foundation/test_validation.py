"""Every declaration/validation error, triggered from a YAML file and asserted on its message."""
import logging

import pytest

from hyper_parallel.distributed.context_parallel.registry import WrapperSignatureError, inner_wrapper
from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.infrastructure import check_world
from hyper_parallel.distributed.plan.resolver import PlanOverrideResolver
from hyper_parallel.trainer.config import TrainerConfig
from hyper_parallel.trainer.model import build_model

HEADER = """
model:
  architecture: llama
  config_file: examples/models/tiny_llama.yaml
accelerator:
  cp_size: {cp}
"""

GOOD_ENTRY = """
  - match: "*.self_attn"
    when: cp
    region_dispatch: false
    inner_target: self
    inner_wrapper: sdpa_hf
"""


@pytest.fixture(scope="module")
def model():
    cfg = TrainerConfig.from_yaml("examples/demo_plan_cp2.yaml")
    return build_model(cfg.model)


def load(tmp_path, body: str, cp: int = 2) -> TrainerConfig:
    path = tmp_path / "cfg.yaml"
    path.write_text(HEADER.format(cp=cp) + body)
    return TrainerConfig.from_yaml(path)


def resolve(tmp_path, model, body: str, cp: int = 2):
    cfg = load(tmp_path, body, cp)
    return PlanOverrideResolver(cfg.plan_overrides, cfg.accelerator.cp_size).resolve(model)


def test_good_plan_resolves_every_boundary(tmp_path, model):
    plan = resolve(tmp_path, model, "plan_overrides:" + GOOD_ENTRY)
    assert [t.fqn for t in plan.targets] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "sdpa_hf [colossal, sync]" in plan.summary()


@pytest.mark.parametrize("key,value", [
    ("cp", "{algorithm: ulysses}"), ("schedule", "async"), ("ulysses_degree", "2"),
    ("load_balance", "true"), ("async_fallback", "true"), ("cp_algorithm", "allgather"),
])
def test_forbidden_accelerator_keys_point_to_plan_overrides(tmp_path, key, value):
    with pytest.raises(CPConfigError) as ei:
        load(tmp_path, f"  {key}: {value}\n")
    msg = str(ei.value)
    assert f"[accelerator.{key}]" in msg and "plan_overrides" in msg


@pytest.mark.parametrize("body,field,fragment", [
    ("  cp_sise: 2\n", "accelerator.cp_sise", "unknown key"),
    ("  pp_size: 0\n", "accelerator.pp_size", "integer >= 1"),
    ("  tp_size: 0\n", "accelerator.tp_size", "integer >= 1"),
    ("trainer: {}\n", "trainer", "unknown top-level key"),
    ("schedule: {stepz: 3}\n", "schedule.stepz", "unknown key"),
    ("plan_overrides:\n  - match: '*.self_attn'\n    inner_wraper: sdpa_hf\n",
     "plan_overrides[0].inner_wraper", "unknown key"),
    ("plan_overrides:\n  - when: cp\n", "plan_overrides[0].match", "is required"),
    ("plan_overrides:\n  - match: '*.self_attn'\n    when: always\n", "plan_overrides[0].when", "unknown value"),
    ("plan_overrides:\n  - match: '*.self_attn'\n    when: cp\n    region_dispatch: 'no'\n",
     "plan_overrides[0].region_dispatch", "true or false"),
    ("plan_overrides:\n  - match: '*.self_attn'\n    when: cp\n    inner_wrapper: {ulysses_degree: 2}\n",
     "plan_overrides[0].inner_wrapper", "without '_target_'"),
])
def test_schema_errors(tmp_path, body, field, fragment):
    with pytest.raises(CPConfigError) as ei:
        load(tmp_path, body)
    assert f"[{field}]" in str(ei.value) and fragment in str(ei.value)


def entry(**over):
    base = {"match": '"*.self_attn"', "when": "cp", "region_dispatch": "false", "inner_target": "self",
            "inner_wrapper": "sdpa_hf"}
    base.update(over)
    lines = [f"    {k}: {v}" for k, v in base.items() if v is not None]
    lines[0] = "  - " + lines[0].strip()
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("body,field,module,fragment", [
    # when: cp entry that matches nothing
    ("plan_overrides:\n" + entry(match='"*.attention"'), "plan_overrides[0].match", None, "matches no module"),
    # cp>1 and no method declared at all
    ("plan_overrides: []\n", "plan_overrides", "model.layers.0.self_attn", "no CP method declared"),
    # only layer 0 declared -> layer 1 missing
    ("plan_overrides:\n" + entry(match='"model.layers.0.self_attn"'), "plan_overrides",
     "model.layers.1.self_attn", "no CP method declared"),
    # two methods for one attention
    ("plan_overrides:\n" + entry() + entry(match='"model.layers.1.*"'), "plan_overrides[1].match",
     "model.layers.1.self_attn", "conflicts with plan_overrides[0]"),
    # inner_wrapper and local_compute_fn together
    ("plan_overrides:\n" + entry(local_compute_fn="tests.foundation.custom_wrappers.compute_fn"),
     "plan_overrides[0].local_compute_fn", "model.layers.0.self_attn", "mutually exclusive"),
    # neither
    ("plan_overrides:\n" + entry(inner_wrapper=None), "plan_overrides[0]", "model.layers.0.self_attn",
     "declares no CP method"),
    # region_dispatch omitted / true
    ("plan_overrides:\n" + entry(region_dispatch=None), "plan_overrides[0].region_dispatch",
     "model.layers.0.self_attn", "is required"),
    ("plan_overrides:\n" + entry(region_dispatch="true"), "plan_overrides[0].region_dispatch",
     "model.layers.0.self_attn", "must be false"),
    ("plan_overrides:\n" + entry(local_compute_fn="tests.foundation.custom_wrappers.compute_fn",
                                 inner_wrapper=None, region_dispatch="true"),
     "plan_overrides[0].region_dispatch", "model.layers.0.self_attn", "must be false"),
    # _target_ problems
    ("plan_overrides:\n" + entry(inner_wrapper="{_target_: no_such_pkg.cp.wrapper}"),
     "plan_overrides[0].inner_wrapper._target_", "model.layers.0.self_attn", "cannot import"),
    ("plan_overrides:\n" + entry(inner_wrapper="{_target_: tests.foundation.custom_wrappers.missing}"),
     "plan_overrides[0].inner_wrapper._target_", "model.layers.0.self_attn", "has no attribute"),
    ("plan_overrides:\n" + entry(inner_wrapper="{_target_: tests.foundation.custom_wrappers.undecorated}"),
     "plan_overrides[0].inner_wrapper", "model.layers.0.self_attn", "not decorated with @inner_wrapper"),
    ("plan_overrides:\n" + entry(inner_wrapper="{_target_: tests.foundation.custom_wrappers.needs_degree, "
                                               "ulysses_degre: 2}"),
     "plan_overrides[0].inner_wrapper.ulysses_degre", "model.layers.0.self_attn", "has no parameter(s)"),
    ("plan_overrides:\n" + entry(inner_wrapper="{_target_: tests.foundation.custom_wrappers.needs_degree}"),
     "plan_overrides[0].inner_wrapper.ulysses_degree", "model.layers.0.self_attn", "requires parameter(s)"),
    ("plan_overrides:\n" + entry(inner_wrapper="no_such_wrapper"), "plan_overrides[0].inner_wrapper",
     "model.layers.0.self_attn", "unknown inner_wrapper name"),
    # wrapper on a non-attention module
    ("plan_overrides:\n" + entry(match='"*.mlp"'), "plan_overrides[0].match", "model.layers.0.mlp",
     "not an attention boundary"),
    # inner_target
    ("plan_overrides:\n" + entry(inner_target="core_attention"), "plan_overrides[0].inner_target",
     "model.layers.0.self_attn", "no submodule 'core_attention'"),
    ("plan_overrides:\n" + entry(inner_target=None), "plan_overrides[0].inner_target",
     "model.layers.0.self_attn", "is required"),
    # a CP method without when: cp
    ("plan_overrides:\n" + entry(when=None), "plan_overrides[0].when", None, "must say 'when: cp'"),
])
def test_resolution_errors(tmp_path, model, body, field, module, fragment):
    with pytest.raises(CPConfigError) as ei:
        resolve(tmp_path, model, body)
    err = ei.value
    assert err.field == field, str(err)
    assert err.module == module, str(err)
    assert fragment in str(err), str(err)
    assert err.fix and "Fix:" in str(err), "every resolution error says what would fix it"


def test_cp1_skips_when_cp_entries_with_info(tmp_path, model, caplog):
    with caplog.at_level(logging.INFO, logger="hyper_parallel.plan"):
        plan = resolve(tmp_path, model, "plan_overrides:" + GOOD_ENTRY, cp=1)
    assert plan.targets == [] and len(plan.skipped) == 1
    assert any("skipping plan_overrides[0]" in r.getMessage() for r in caplog.records)


def test_cp1_with_no_entries_is_fine(tmp_path, model):
    plan = resolve(tmp_path, model, "plan_overrides: []\n", cp=1)
    assert plan.targets == []


def test_world_size_mismatch_from_yaml(tmp_path):
    cfg = load(tmp_path, "  dp_shard_size: 2\n", cp=2)
    with pytest.raises(CPConfigError) as ei:
        check_world(cfg.accelerator)
    assert "dp_shard(2) x cp(2) x tp(1) = 4, but world_size = 1" in str(ei.value)
    assert "[accelerator]" in str(ei.value)


def test_star_args_wrapper_rejected_at_decoration():
    with pytest.raises(WrapperSignatureError, match=r"\*args"):
        @inner_wrapper
        def bad(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, *args):
            return None
    with pytest.raises(WrapperSignatureError, match="must start with parameters"):
        @inner_wrapper
        def bad2(module, cp_mesh):
            return None
