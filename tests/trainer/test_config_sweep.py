"""Config mutation sweep: every shipped example (examples/*.yaml, examples/cp/*.yaml)
with one mutation of each kind below is a configuration error naming the field: 0 tracebacks,
0 silent accepts. In-process through the CLI's own config path (``cli.load_config``: YAML file +
overrides -> schema -> cross-field checks; local, before any collective), plus a few end-to-end
``hyper-train`` runs asserting exit code 2, the one line and no traceback."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.testing import scaled
from hyper_parallel.trainer.cli import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "examples" / "*.yaml"))
                  + glob.glob(str(ROOT / "examples" / "cp" / "*.yaml")))
BAD_WRAPPER = ("plan_overrides=[{match: '*.self_attn', when: cp, region_dispatch: false, inner_target: self, "
               "inner_wrapper: {_target_: no_such_package.wrappers.my_cp_wrapper}}]")

# kind -> (overrides, file-text mutation or None, the field the error must name)
MUTATIONS = {
    "lr negative": (["optimizer.lr=-1"], None, "optimizer.lr"),
    "eps negative": (["optimizer.eps=-1"], None, "optimizer.eps"),
    "weight_decay negative": (["optimizer.weight_decay=-1"], None, "optimizer.weight_decay"),
    "lr a string": (["optimizer.lr=abc"], None, "optimizer.lr"),
    "seq_len a string": (["data.seq_len=long"], None, "data.seq_len"),
    "steps a float": (["schedule.steps=2.5"], None, "schedule.steps"),
    "cuda on a CPU machine": (["accelerator.device_type=cuda"], None, "accelerator.device_type"),
    "section a scalar": (["optimizer=5"], None, "optimizer"),
    "section a list": (["schedule=[1, 2]"], None, "schedule"),
    "file a scalar": ([], lambda t: "42\n", "<root>"),
    "file a list": ([], lambda t: "- model\n- data\n", "<root>"),
    "unparsable file": ([], lambda t: t + "\nextra: [unclosed\n", "<root>"),
    "unparsable override": (["optimizer.betas=[0.9,"], None, "optimizer.betas"),
    "attn_implementation bogus": (["model.attn_implementation=bogus"], None, "model.attn_implementation"),
    "hidden_act nope": (["model.config.hidden_act=nope"], None, "model.config.hidden_act"),
    "head_dim 7": (["model.config.head_dim=7"], None, "model.config.head_dim"),
    "heads not dividing hidden": (["model.config.num_attention_heads=3"], None, "model.config.num_attention_heads"),
    "pad_token_id -1": (["data.pad_token_id=-1"], None, "data.pad_token_id"),
    "min_lr_ratio -1": (["schedule.min_lr_ratio=-1"], None, "schedule.min_lr_ratio"),
    "min_lr_ratio 'x'": (["schedule.min_lr_ratio=x"], None, "schedule.min_lr_ratio"),
    "plot 'no'": (["logging.plot='no'"], None, "logging.plot"),
    "plot yes (YAML 1.1 boolean)": (["logging.plot=yes"], None, "logging.plot"),
    "min_lr_ratio 1.5": (["schedule.min_lr_ratio=1.5"], None, "schedule.min_lr_ratio"),
    "HF config key typo": (["model.config.num_hiden_layers=1"], None, "model.config.num_hiden_layers"),
    "pad_token_id past the vocabulary": (["data.pad_token_id=1000000"], None, "data.pad_token_id"),
    "vocab_size below the data's ids": (["model.config.vocab_size=200"], None, "model.config.vocab_size"),
    "section twice": ([], lambda t: t + "\nmodel:\n  seed: 3\n", "model"),
    "key twice": ([], lambda t: t.replace("model:\n", "model:\n  seed: 1\n  seed: 2\n", 1), "model.seed"),
    "key twice in an override": (["model.config={hidden_size: 64, hidden_size: 32}"], None, "model.config.hidden_size"),
    "max_position_embeddings < seq_len": (["model.config.max_position_embeddings=8", "data.seq_len=64"], None,
                                          "model.config.max_position_embeddings"),
    "when: cp wrapper missing at cp_size 1": (["accelerator.cp_size=1", BAD_WRAPPER], None,
                                              "plan_overrides[0].inner_wrapper._target_"),
}


#: mutations that give a valid configuration for one example (they must load): an odd head_dim is an
#: error only where rotary embeddings rotate channel pairs; these models' attention has no RoPE (NoPE)
VALID = {
    ("examples/cp/kimi_linear_cp2.yaml", "head_dim 7"): "Kimi Linear: NoPE MLA, no rotary embedding",
    ("examples/cp/nemotron_h_cp2.yaml", "head_dim 7"): "NemotronH: NoPE attention, no rotary embedding",
}


def _outcome(example: str, kind: str, tmp: Path):
    overrides, mutate, field = MUTATIONS[kind]
    path = ROOT / example
    if mutate is not None:
        path = tmp / Path(example).name
        path.write_text(mutate((ROOT / example).read_text()))
    try:
        load_config([str(path), *overrides])
    except CPConfigError as exc:
        text = str(exc)
        if exc.field != field and not exc.field.startswith(field + "."):
            return f"names {exc.field!r}, not {field!r}: {text}"
        if "\n" in text:
            return f"not one line: {text!r}"
        return None
    except Exception as exc:  # noqa: BLE001 - a traceback in the CLI: what the sweep hunts
        return f"raw {type(exc).__name__}: {exc}"
    return "silently accepted"


def test_every_example_with_every_mutation_is_a_config_error_naming_the_field(tmp_path):
    """len(EXAMPLES) x len(MUTATIONS) cases (25 x 30 today); prints the tally."""
    assert len(EXAMPLES) >= 15
    for example in EXAMPLES:   # the unmutated examples load (the sweep is not refusing everything)
        load_config([str(ROOT / example)])
    bad = {}
    for example in EXAMPLES:
        for kind in MUTATIONS:
            problem = _outcome(example, kind, tmp_path)
            if (example, kind) in VALID:         # a valid configuration: it must load, not be refused
                if problem != "silently accepted":
                    bad[(example, kind)] = f"refused, but valid ({VALID[(example, kind)]}): {problem}"
            elif problem is not None:
                bad[(example, kind)] = problem
    total = len(EXAMPLES) * len(MUTATIONS)
    print(f"config sweep: {total} mutated configs, {total - len(bad)} configuration errors naming the field, "
          f"{len(bad)} other")
    assert not bad, "\n".join(f"{e} / {k}: {p}" for (e, k), p in list(bad.items())[:20])


def test_a_directory_as_the_config_path(tmp_path):
    with pytest.raises(CPConfigError, match=r"^\[<config file>\] .* is a directory, not a YAML file"):
        load_config([str(tmp_path)])


@pytest.mark.parametrize("args,field", [
    (["examples/train_cp1.yaml", "optimizer.eps=-1"], "optimizer.eps"),
    (["examples/train_cp1.yaml", "accelerator.device_type=cuda"], "accelerator.device_type"),
    (["examples"], "<config file>"),
    (["examples/train_cp1.yaml", "model.config.vocab_size=255"], "model.config.vocab_size"),
    (["examples/train_long_cp2.yaml", "model.config.vocab_size=4095", "data.files=[examples/data/stdlib_small.jsonl]"],
     "model.config.vocab_size"),
], ids=["bound", "cuda", "directory", "vocab-bytes", "vocab-files"])
def test_cli_exit_2_one_line_no_traceback(tmp_path, cli_shell, capsys, args, field):
    """``hyper-train ARGS`` refused by the parent's check: exit 2, one line, nothing run. In-process
    (``cli.main`` from the repository root): every one of these is refused before a rank could start; a
    real console-script process is tests/trainer/test_launcher.py's refusal test."""
    from hyper_parallel.trainer import cli

    code = cli.main([*args, f"logging.out_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2, out[-2000:] + err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("INFO ", "DEBUG "))]
    assert len(lines) == 1 and lines[0].startswith(f"hyper-train: configuration error: [{field}]"), err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()    # refused before anything ran


def test_custom_wrapper_example_runs_from_any_folder(tmp_path):
    """examples/cp/custom_wrapper.yaml names ``examples.cp.custom_wrapper_example...``: a ``_target_``
    module that is not importable is looked for beside the config file and in its parent folders
    (config_checks.resolve_plan_targets), so the example trains 1 step under torchrun started in an
    unrelated folder, with nothing of the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1")
    cfg = ROOT / "examples" / "cp" / "custom_wrapper.yaml"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "hyper_parallel.trainer.cli", str(cfg), "schedule.steps=1", "data.seq_len=64",
                        "logging.progress=false", "logging.plot=false", f"logging.out_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "my_allgather_cp_wrapper" in p.stdout and "done: 1 steps" in p.stdout, p.stdout[-2000:]
