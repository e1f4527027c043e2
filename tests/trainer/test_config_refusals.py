"""Config mistakes refused before training, naming the field and the fix: YAML 1.1 booleans
(``plot: yes``), out-of-range schedule/optimizer numbers, unknown HF config keys (typos), an
attention implementation whose package is missing, token ids past the model's vocabulary; and the
two legal-but-suspicious values that only warn (warm-up longer than the run, float16 on a CPU)."""
from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig
from hyper_parallel.trainer.config_checks import check_run_config
from hyper_parallel.trainer.config_warnings import config_warnings

from . import _workers as W

TOKENIZER = os.path.join(W.ROOT, "examples", "data", "stdlib_tokenizer")


def _error(fn) -> CPConfigError:
    with pytest.raises(CPConfigError) as ei:
        fn()
    return ei.value


def _checked(model_config: dict | None = None, **sections) -> TrainerConfig:
    """check_run_config of the tiny llama (vocab 256) with ``model.config`` and other sections."""
    data = {"model": {"architecture": "llama", "config_file": W.MODELS["llama"][1], "config": model_config},
            "data": {"path": W.CORPUS, "seq_len": 32}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return check_run_config(TrainerConfig.from_dict(data))


# ----------------------------------------------------------------------------- YAML 1.2 booleans
@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "OFF"])
def test_yaml11_boolean_words_are_field_errors(tmp_path, word):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"logging:\n  plot: {word}\n")
    for load in (lambda: TrainerConfig.from_yaml(path), lambda: TrainerConfig.from_yaml(W.ROOT + "/examples/"
                                                                                         "train_cp1.yaml",
                                                                                         [f"logging.plot={word}"])):
        err = _error(load)
        assert err.field == "logging.plot" and "true or false" in str(err) and repr(word) in str(err)


def test_true_and_false_stay_booleans(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("logging:\n  plot: False\n  progress: TRUE\n  tensorboard: false\n")
    cfg = TrainerConfig.from_yaml(path)
    assert (cfg.logging.plot, cfg.logging.progress, cfg.logging.tensorboard) == (False, True, False)


def test_yaml11_boolean_in_the_hf_config_is_refused():
    err = _error(lambda: _checked({"tie_word_embeddings": "no"}))
    assert err.field == "model.config.tie_word_embeddings" and "true or false" in str(err)


# ----------------------------------------------------------------------------- ranges + warnings
@pytest.mark.parametrize("override, field, fragment", [
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio", "in [0, 1]"),
    ("schedule.min_lr_ratio=-0.1", "schedule.min_lr_ratio", "in [0, 1]"),
    ("optimizer.weight_decay=2", "optimizer.weight_decay", "in [0, 1]"),
    ("optimizer.eps=1", "optimizer.eps", "in (0, 1)"),
    ("optimizer.lr=.inf", "optimizer.lr", "finite"),
    ("optimizer.grad_clip=.nan", "optimizer.grad_clip", "finite"),
    ("optimizer.lr=0", "optimizer.lr", "> 0"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps", ">= 0"),
    ("schedule.max_nonfinite_skips=0", "schedule.max_nonfinite_skips", ">= 1"),
])
def test_out_of_range_numbers_name_the_field(override, field, fragment):
    err = _error(lambda: TrainerConfig.from_yaml(W.ROOT + "/examples/train_cp1.yaml", [override]))
    assert err.field == field and fragment in str(err), str(err)


def test_range_shows_in_the_field_reference():
    types = {f.path: f.type for f in TrainerConfig.schema_fields()}
    assert types["schedule.min_lr_ratio"] == "float in [0, 1]" and types["optimizer.eps"] == "float in (0, 1)"


def test_warmup_longer_than_the_run_and_float16_on_cpu_warn_once():
    cfg = TrainerConfig.from_dict({"schedule": {"steps": 10, "warmup_steps": 20}, "model": {"dtype": "float16"}})
    lines = config_warnings(cfg, "cpu")
    assert len(lines) == 2 and lines[0].startswith("[schedule.warmup_steps] 20 exceeds schedule.steps=10")
    assert lines[1].startswith("[model.dtype] float16 on a CPU")
    assert config_warnings(cfg, "cuda") == lines[:1]
    assert config_warnings(TrainerConfig.from_dict({"schedule": {"steps": 10, "warmup_steps": 10}}), "cpu") == []


# ----------------------------------------------------------------------------- unknown HF keys
def test_unknown_hf_config_key_names_the_nearest_field():
    err = _error(lambda: _checked({"num_hiden_layers": 3}))
    assert err.field == "model.config.num_hiden_layers" and "'num_hidden_layers'" in str(err)


def test_unknown_key_in_the_config_file_names_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("vocab_size: 256\nhidden_size: 64\nnum_attention_heads: 4\nintermedate_size: 128\n")
    err = _error(lambda: check_run_config(TrainerConfig.from_dict(
        {"model": {"architecture": "llama", "config_file": str(path)}, "data": {"path": W.CORPUS, "seq_len": 32}})))
    assert err.field == "model.config_file" and "intermedate_size" in str(err) and "intermediate_size" in str(err)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(W.ROOT, "examples", "models", "*.yaml"))))
def test_every_example_model_config_passes(path):
    arch = os.path.basename(path)[len("tiny_"):-len(".yaml")]
    check_run_config(TrainerConfig.from_dict({"model": {"architecture": arch, "config_file": path},
                                              "data": {"path": W.CORPUS, "seq_len": 32}}))


def test_legacy_and_modeling_read_keys_are_known():
    # rope_theta is converted by every config; head_dim is read (not declared) by Qwen3-MoE's modeling
    _checked({"rope_theta": 5000.0})
    check_run_config(TrainerConfig.from_dict({"model": {"architecture": "qwen3_moe", "config_file":
                                                        W.MODELS["qwen3_moe"][1], "config": {"head_dim": 16}},
                                              "data": {"path": W.CORPUS, "seq_len": 32}}))


# ----------------------------------------------------------------------------- attention packages
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_flash_attention_without_the_package_is_a_config_error():
    err = _error(lambda: _checked(model={"attn_implementation": "flash_attention_2"}))
    assert err.field == "model.attn_implementation" and "'flash_attn'" in str(err) and "sdpa" in err.fix


@pytest.mark.skipif(importlib.util.find_spec("kernels") is not None, reason="kernels is installed")
def test_hub_kernel_without_the_kernels_package_is_a_config_error():
    err = _error(lambda: _checked(model={"attn_implementation": "kernels-community/flash-attn"}))
    assert err.field == "model.attn_implementation" and "'kernels'" in str(err)


# ----------------------------------------------------------------------------- token ids
def test_pad_token_id_past_the_vocabulary_is_refused():
    _checked(data={"pad_token_id": 255})
    err = _error(lambda: _checked(data={"pad_token_id": 256}))
    assert err.field == "data.pad_token_id" and "256 ids" in str(err)


def test_hf_config_eos_id_past_the_vocabulary_is_refused():
    err = _error(lambda: _checked({"eos_token_id": 300}))
    assert err.field == "model.config.eos_token_id" and "300" in str(err)


def test_files_source_counts_the_tokenizer_rows():
    from hyper_parallel.trainer.data_sources import load_tokenizer

    rows = len(load_tokenizer(TOKENIZER))
    files = {"source": "files", "files": [os.path.join(W.ROOT, "examples", "data", "stdlib_small.jsonl")],
             "tokenizer": TOKENIZER, "path": None}
    err = _error(lambda: _checked(data=files))   # the tiny llama's vocab_size 256: below the tokenizer's
    assert err.field == "model.config.vocab_size" and f"len(data.tokenizer) = {rows}" in str(err)
    _checked({"vocab_size": rows}, data={**files, "pad_token_id": rows - 1})
    err = _error(lambda: _checked({"vocab_size": rows}, data={**files, "pad_token_id": rows}))
    assert err.field == "data.pad_token_id" and "tokenizer" in str(err)


def test_pad_id_past_the_vocabulary_fails_every_rank_at_the_build(ranks, tmp_path):
    """The Python API (no CLI config check): refused inside the agreed model build, so no rank
    reaches the preflight's collective and none waits for a timeout."""
    cfg = W.make_cfg("llama", cp=2, seq_len=32, out_dir=str(tmp_path / "run"), data__pad_token_id=300)
    outs = ranks(2).run(W.build_error, cfg)
    for out in outs:
        assert out is not None and "data.pad_token_id" in out[1], outs


def test_cli_refuses_a_pad_id_past_the_vocabulary(tmp_path, capsys):
    from hyper_parallel.trainer.cli import main

    code = main([W.ROOT + "/examples/train_cp1.yaml", "data.pad_token_id=256", f"data.path={W.CORPUS}",
                 f"model.config_file={W.MODELS['llama'][1]}", f"logging.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "configuration error: [data.pad_token_id]" in err, err[-2000:]


def test_mixed_parameter_dtypes_under_fsdp_name_model_dtype_and_mixed_precision():
    """model.dtype: bfloat16 on a model transformers keeps partly in float32 (DeepSeek V3.2's MoE gate)
    is refused at model.dtype, naming the float32 parameters and the fix (schedule.mixed_precision: bf16),
    not as a CP declaration problem; the float32 build passes."""
    import torch
    import transformers

    from hyper_parallel.trainer.model import build_meta_model, check_fsdp_dtypes

    cfg = transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        index_topk=4, index_head_dim=8, index_n_heads=2, mlp_layer_types=["dense", "sparse"])
    check_fsdp_dtypes(build_meta_model(cfg, dtype=torch.float32, attn_implementation="sdpa"), "float32")
    with pytest.raises(CPConfigError) as err:
        check_fsdp_dtypes(build_meta_model(cfg, dtype=torch.bfloat16, attn_implementation="sdpa"), "bfloat16")
    msg = str(err.value)
    print(msg)
    assert msg.startswith("[model.dtype] model.dtype=bfloat16") and "mlp.gate.weight" in msg, msg
    assert "schedule.mixed_precision: bf16" in msg and "plan_overrides" not in msg, msg
