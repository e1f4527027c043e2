"""The trainer's typed configuration schema: one declaration per field is the
source of the loader's checks, ``hyper-train --help`` and the docs/trainer.md field reference.

Covers: YAML 1.1 string floats (``3e-4``) read as floats, list/mapping swaps as field errors, every
override validated exactly like the file (same error, plus the override named), ``--help`` listing
every field, ``--version``, the docs drift check, and every example YAML loading unchanged.
"""
from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import yaml

from hyper_parallel.distributed.config import AcceleratorConfig
from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TOP_LEVEL, OptimizerConfig, TrainerConfig, apply_overrides

from . import _workers as W

ROOT = W.ROOT
CP1 = os.path.join(ROOT, "examples", "train_cp1.yaml")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def _error(fn) -> CPConfigError:
    with pytest.raises(CPConfigError) as ei:
        fn()
    return ei.value


# ----------------------------------------------------------------------------- string floats
def test_exponent_floats_are_floats_in_the_file_in_overrides_and_in_dicts(tmp_path):
    path = _write(tmp_path, "optimizer:\n  lr: 3e-4\n  eps: 1E-6\n  betas: [9e-1, 0.95]\n"
                            "accelerator:\n  comm_timeout_s: 1e2\nschedule:\n  min_lr_ratio: 5e-2\n")
    cfg = TrainerConfig.from_yaml(path)
    assert (cfg.optimizer.lr, cfg.optimizer.eps, cfg.optimizer.betas) == (3e-4, 1e-6, (0.9, 0.95))
    assert cfg.accelerator.comm_timeout_s == 100.0 and cfg.schedule.min_lr_ratio == 0.05
    assert all(type(v) is float for v in (cfg.optimizer.lr, cfg.optimizer.eps, *cfg.optimizer.betas))
    over = TrainerConfig.from_yaml(CP1, ["optimizer.lr=3e-4", "optimizer.weight_decay=1e-2"])
    assert type(over.optimizer.lr) is float and over.optimizer.lr == 3e-4 and over.optimizer.weight_decay == 0.01
    # plain-data callers (PyYAML 1.1 output) get the same reading
    assert TrainerConfig.from_dict({"optimizer": {"lr": "3e-4"}}).optimizer.lr == 3e-4
    # ints stay ints: an exponent is not an integer
    assert _error(lambda: TrainerConfig.from_yaml(CP1, ["schedule.steps=1e3"])).field == "schedule.steps"


def test_the_new_users_command_builds_the_optimizer(tmp_path, capsys):
    """``hyper-train examples/train_cp1.yaml optimizer.lr=3e-4`` used to end in a TypeError inside AdamW."""
    from hyper_parallel.trainer.cli import main

    out = tmp_path / "run"
    code = main([CP1, "optimizer.lr=3e-4", "schedule.steps=1", "data.seq_len=32", f"logging.out_dir={out}",
                 "logging.plot=false", f"data.path={W.CORPUS}", f"model.config_file={W.MODELS['llama'][1]}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "done: 1 steps" in captured.out


# ----------------------------------------------------------------------------- shape swaps
SWAPS = [  # (YAML body, override, field, fragment)
    ("optimizer:\n  betas: 0.9\n", "optimizer.betas=0.9", "optimizer.betas", "must be a list of 2 numbers"),
    ("optimizer:\n  betas: {b1: 0.9}\n", "optimizer.betas={b1: 0.9}", "optimizer.betas", "got a mapping"),
    ("optimizer:\n  betas: [0.9]\n", "optimizer.betas=[0.9]", "optimizer.betas", "must be a list of 2 numbers"),
    ("model:\n  config: [64, 2]\n", "model.config=[64, 2]", "model.config", "must be a mapping"),
    ("optimizer: [adamw]\n", "optimizer=[adamw]", "optimizer", "must be a mapping of its fields"),
    ("accelerator: [2]\n", "accelerator=[2]", "accelerator", "must be a mapping of its fields"),
    ("logging: runs/x\n", "logging=runs/x", "logging", "must be a mapping of its fields"),
    ("plan_overrides: {match: '*.self_attn', when: cp}\n", "plan_overrides={match: '*.self_attn', when: cp}",
     "plan_overrides", "must be a list of entries"),
    ("plan_overrides: sdpa_hf\n", "plan_overrides=sdpa_hf", "plan_overrides", "must be a list of entries"),
]
BAD_VALUES = [
    ("optimizer:\n  lr: fast\n", "optimizer.lr=fast", "optimizer.lr", "must be a number > 0"),
    ("optimizer:\n  lr: -1.0\n", "optimizer.lr=-1.0", "optimizer.lr", "> 0"),
    ("optimizer:\n  betas: [0.9, 1.5]\n", "optimizer.betas=[0.9, 1.5]", "optimizer.betas[1]", "[0, 1)"),
    ("optimizer:\n  name: lion\n", "optimizer.name=lion", "optimizer.name", "unknown value"),
    ("schedule:\n  steps: 2.5\n", "schedule.steps=2.5", "schedule.steps", "must be an integer >= 0"),
    ("schedule:\n  activation_checkpointing: 'yes'\n", "schedule.activation_checkpointing='yes'",
     "schedule.activation_checkpointing", "must be true or false"),
    ("data:\n  seq_len: 1\n", "data.seq_len=1", "data.seq_len", "integer >= 2"),
    ("data:\n  seq_len: 32\n  min_doc_len: 64\n", "data.min_doc_len=999", "data.min_doc_len", "exceeds data.seq_len"),
    ("logging:\n  level: loud\n", "logging.level=loud", "logging.level", "unknown value"),
    ("accelerator:\n  cp_size: 0\n", "accelerator.cp_size=0", "accelerator.cp_size", "integer >= 1"),
    ("accelerator:\n  comm_timeout_s: soon\n", "accelerator.comm_timeout_s=soon", "accelerator.comm_timeout_s",
     "must be a number > 0 or null"),
    ("accelerator:\n  ulysses_degree: 2\n", "accelerator.ulysses_degree=2", "accelerator.ulysses_degree",
     "plan_overrides"),
    ("schedule:\n  stepz: 3\n", "schedule.stepz=3", "schedule.stepz", "unknown key"),
]


@pytest.mark.parametrize("body,override,field,fragment", SWAPS + BAD_VALUES,
                         ids=[c[1] for c in SWAPS + BAD_VALUES])
def test_file_and_override_fail_the_same_way_naming_the_field(tmp_path, body, override, field, fragment):
    from_file = _error(lambda: TrainerConfig.from_yaml(_write(tmp_path, body)))
    from_override = _error(lambda: TrainerConfig.from_yaml(CP1, [override]))
    for err in (from_file, from_override):
        assert err.field == field, str(err)
        assert fragment in str(err), str(err)
    assert f"(from the command-line override {override!r})" in str(from_override)
    if "min_doc_len" not in field:  # same values -> the same problem text
        assert from_override.problem.startswith(from_file.problem), (str(from_file), str(from_override))


@pytest.mark.parametrize("override,field,fragment", [
    ("optimizer.lr.x=1", "optimizer.lr", "cannot set a field inside it"),
    ("plan_overrides.0.match=x", "plan_overrides", "is a list"),
    ("optimizer.betas=[0.9", "optimizer.betas", "not valid YAML"),
    ("optimizer.lr", "optimizer.lr", "must look like key.path=value"),
    ("optimizer..lr=1", "optimizer..lr", "empty field name"),
    ("trainer.steps=5", "trainer", "unknown top-level key"),
])
def test_malformed_overrides_name_the_field(override, field, fragment):
    err = _error(lambda: TrainerConfig.from_yaml(CP1, [override]))
    assert err.field == field and fragment in str(err), str(err)


def test_cli_reports_the_field_not_a_type_error(capsys):
    """``optimizer.betas=0.9`` used to end in ``TypeError: 'float' object is not iterable``."""
    from hyper_parallel.trainer.cli import main

    assert main([CP1, "optimizer.betas=0.9"]) == 2
    err = capsys.readouterr().err
    assert "[optimizer.betas] must be a list of 2 numbers, got 0.9" in err and "TypeError" not in err


def test_configs_built_in_python_are_checked_by_the_same_rules():
    cfg = TrainerConfig(optimizer=OptimizerConfig(lr="fast"))
    assert _error(cfg.validate).field == "optimizer.lr"
    acc = AcceleratorConfig(cp_size=2.0)
    assert _error(acc.validate).field == "accelerator.cp_size"
    ok = TrainerConfig(optimizer=OptimizerConfig(lr=1, betas=[0.8, 0.9])).validate()
    assert ok.optimizer.lr == 1.0 and type(ok.optimizer.lr) is float and ok.optimizer.betas == (0.8, 0.9)


def test_override_creates_a_missing_section_and_is_then_checked():
    data = apply_overrides({}, ["schedule.steps=4", "model.config.hidden_size=32"])
    assert data == {"schedule": {"steps": 4}, "model": {"config": {"hidden_size": 32}}}
    assert TrainerConfig.from_dict(data).model.config == {"hidden_size": 32}


# ----------------------------------------------------------------------------- examples
EXAMPLES = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True)
                  if os.sep + "models" + os.sep not in p)


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.relpath(p, ROOT) for p in EXAMPLES])
def test_every_example_yaml_loads_unchanged(path):
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    assert set(raw) <= set(TOP_LEVEL), f"{path} is not a trainer config: {sorted(raw)}"
    cfg = TrainerConfig.from_yaml(path)
    for section in ("model", "data", "optimizer", "schedule", "accelerator", "logging"):
        for key, value in (raw.get(section) or {}).items():
            got = getattr(getattr(cfg, section), key)
            assert got == (tuple(value) if isinstance(value, list) else value), f"{path}: {section}.{key}"
    assert len(cfg.plan_overrides) == len(raw.get("plan_overrides") or [])


# ----------------------------------------------------------------------------- --help / --version / docs
def _schema_leaf_paths() -> list[str]:
    """Every YAML field, read from the dataclasses themselves (not from the help generator)."""
    out = []
    for f in dataclasses.fields(TrainerConfig):
        if f.name == "source":
            continue
        if f.name == "plan_overrides":
            out.append(f.name)
            continue
        section = f.default_factory
        out += [f"{f.name}.{g.name}" for g in dataclasses.fields(section) if not g.name.startswith("_")]
    return out


def test_help_lists_every_field(capsys):
    from hyper_parallel.trainer.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    paths = _schema_leaf_paths()
    assert len(paths) > 40
    missing = [p for p in paths if f"  {p}  (" not in out]
    assert not missing, f"--help does not list {missing}"
    for f in TrainerConfig.schema_fields():  # with its type, default and help
        assert f"  {f.path}  ({f.type}; default {f.default})" in out
        assert f.help.split()[0] in out
    assert main([CP1, "--help"]) == 0 and "optimizer.lr" in capsys.readouterr().out


def test_version(capsys):
    from importlib.metadata import version

    from hyper_parallel.trainer.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hyper-train (hyper_parallel) {version('hyper_parallel')}"
    assert main(["--verbose"]) == 2 and "unknown option '--verbose'" in capsys.readouterr().err


def test_docs_field_reference_is_generated_from_the_schema():
    from hyper_parallel.trainer.field_docs import DOCS_PATH, docs_with_field_reference

    text = DOCS_PATH.read_text()
    assert text == docs_with_field_reference(text), (
        "docs/trainer.md's field reference differs from the schema: run "
        "python -m hyper_parallel.trainer.field_docs --write-docs")
    for path in _schema_leaf_paths():
        section, _, name = path.partition(".")
        assert f"### `{section}`" in text and (f"| `{name}` |" in text or not name), path
