"""Trainer building blocks on the CP=1 path: config, model factory, data, loss, checkpoints, CLI."""
from __future__ import annotations

import json
import os

import pytest
import torch

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig
from hyper_parallel.trainer.data import ByteCorpus, TextBatcher, count_valid_targets
from hyper_parallel.trainer.loss import mean_global_loss, token_loss_sum
from hyper_parallel.trainer.model import HyperAutoModel

from . import _workers as W

ROOT = W.ROOT


# ----------------------------------------------------------------------------- config
def test_config_roundtrip_and_overrides(tmp_path):
    cfg = TrainerConfig.from_yaml(os.path.join(ROOT, "examples", "train_cp2.yaml"),
                                  ["schedule.steps=3", "accelerator.cp_size=1", "data.seq_len=32"])
    assert cfg.schedule.steps == 3 and cfg.accelerator.cp_size == 1 and cfg.data.seq_len == 32
    assert cfg.plan_overrides and cfg.plan_overrides[0].when == "cp"
    json.dumps(cfg.to_dict())  # JSON-able for logs / checkpoint metadata


@pytest.mark.parametrize("override,field", [
    ("schedule.grad_accum_steps=0", "schedule.grad_accum_steps"),
    ("schedule.mixed_precision=fp8", "schedule.mixed_precision"),
    ("schedule.lr_schedule=linear", "schedule.lr_schedule"),
    ("optimizer.name=lion", "optimizer.name"),
    ("data.min_doc_len=999", "data.min_doc_len"),
    ("data.sequence_length=5", "data.sequence_length"),
    ("trainer.steps=5", "trainer"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(CPConfigError) as err:
        TrainerConfig.from_yaml(os.path.join(ROOT, "examples", "train_cp1.yaml"), [override])
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize("name", sorted(os.path.basename(p) for p in
                                         __import__("glob").glob(os.path.join(ROOT, "examples", "train_*.yaml"))))
def test_example_configs_resolve(name):
    from hyper_parallel.distributed.plan.resolver import PlanOverrideResolver

    cfg = TrainerConfig.from_yaml(os.path.join(ROOT, "examples", name))
    model = HyperAutoModel.from_config(cfg.model)
    plan = PlanOverrideResolver(cfg.plan_overrides, cfg.accelerator.cp_size).resolve(model)
    assert len(plan.targets) == (len(plan.boundaries) if cfg.accelerator.cp_size > 1 else 0)
    data = cfg.data                    # the byte corpus (28 KB) is shorter than a 32k row: check 8k rows there
    data = data if data.seq_len <= 8192 else __import__("dataclasses").replace(data, seq_len=8192)
    batch = TextBatcher.from_config(data).batch(0)
    assert batch["input_ids"].shape == (data.micro_batch_size, data.seq_len)


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_tiny_models_build(arch):
    cfg = TrainerConfig.from_dict(W.make_cfg(arch))
    model = HyperAutoModel.from_config(cfg.model)
    assert model.config.vocab_size == 256 and model.config.hidden_size == 64
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    again = HyperAutoModel.from_config(cfg.model)  # fixed seed: identical init
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


def test_model_from_local_checkpoint_dir(tmp_path):
    cfg = TrainerConfig.from_dict(W.make_cfg("qwen3"))
    model = HyperAutoModel.from_config(cfg.model)
    HyperAutoModel.save_pretrained(model, tmp_path / "ckpt")
    cfg.model.path, cfg.model.architecture, cfg.model.config_file = str(tmp_path / "ckpt"), None, None
    loaded = HyperAutoModel.from_config(cfg.model)
    assert type(loaded) is type(model)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, loaded(input_ids=x).logits)
    with pytest.raises(CPConfigError, match="model.path"):
        cfg.model.path = str(tmp_path / "missing")
        HyperAutoModel.from_config(cfg.model)


# ----------------------------------------------------------------------------- data
def test_batches_deterministic_and_dp_distinct():
    c = TrainerConfig.from_dict(W.make_cfg(min_doc_len=8))
    b0, b1 = TextBatcher.from_config(c.data, 0), TextBatcher.from_config(c.data, 1)
    x, y, z = b0.batch(3), TextBatcher.from_config(c.data, 0).batch(3), b1.batch(3)
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(x["input_ids"], z["input_ids"])
    assert not torch.equal(b0.batch(4)["input_ids"], x["input_ids"])


def test_padding_heavy_batch_contract():
    c = TrainerConfig.from_dict(W.make_cfg(min_doc_len=4, seq_len=48, micro_batch_size=8, data__pad_to_multiple=8))
    b = TextBatcher.from_config(c.data).batch(0)
    assert b["input_ids"].shape == (8, 48)
    lengths = b["attention_mask"].sum(1)
    assert lengths.min() < 48, "expected padded rows"
    for row, n in enumerate(lengths.tolist()):
        assert b["attention_mask"][row, :n].all() and not b["attention_mask"][row, n:].any()
        assert (b["labels"][row, n:] == -100).all() and (b["input_ids"][row, n:] == 0).all()
        assert torch.equal(b["labels"][row, :n], b["input_ids"][row, :n])
    assert count_valid_targets(b) == int((lengths - 1).sum())


def test_corpus_is_bytes():
    corpus = ByteCorpus(W.CORPUS)
    assert 20_000 < len(corpus) < 400_000
    assert int(corpus.tokens.max()) < 256 and int(corpus.tokens.min()) > 0


# ----------------------------------------------------------------------------- loss (no dist)
def test_mean_global_loss_single_rank_matches_hf():
    torch.manual_seed(0)
    logits = torch.randn(2, 10, 256, requires_grad=True)
    labels = torch.randint(0, 256, (2, 10))
    labels[1, 6:] = -100
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    s, n = token_loss_sum(logits, shift)
    out = mean_global_loss(s, n, None)
    from transformers.loss.loss_utils import ForCausalLMLoss

    ref = ForCausalLMLoss(logits, labels, 256, num_items_in_batch=torch.tensor(int(n)))
    assert int(n) == 9 + 5 and int(out.global_valid_tokens) == 14
    assert torch.equal(out.loss, ref) and torch.equal(out.loss_value, ref.detach())
    scaled = mean_global_loss(s, n, None, grad_scale=4.0)
    assert torch.allclose(scaled.loss, 4 * ref) and torch.equal(scaled.loss_value, ref.detach())


# ----------------------------------------------------------------------------- loss (2 ranks)
def dp_cp_token_reduction(sizes: dict, local_tokens: list, local_sums: list):
    import torch.distributed as dist

    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    ctx = MeshContext(MeshSizes(**sizes))
    r = dist.get_rank()
    s = torch.tensor(float(local_sums[r]), requires_grad=True)
    out = mean_global_loss(s, local_tokens[r], ctx.dp_cp_mesh, grad_scale=float(ctx.fsdp_mesh.size()))
    out.loss.backward()
    return int(out.global_valid_tokens), float(out.loss_value), float(s.grad)


@pytest.mark.parametrize("sizes", [{"cp": 2}, {"dp_shard": 2}])
def test_mean_global_loss_counts_every_cp_token_once(ranks, sizes):
    res = ranks(2).run(dp_cp_token_reduction, sizes, [30, 10], [60.0, 40.0])
    for n, value, grad in res:
        assert n == 40
        assert value == pytest.approx(100.0 / 40)
        assert grad == pytest.approx(2 / 40)  # grad_scale = fsdp mesh size (2) / N


def test_mean_global_loss_tp_replicas_not_double_counted(ranks):
    res = ranks(4).run(dp_cp_token_reduction, {"cp": 2, "tp": 2}, [5, 5, 7, 7], [1.0, 1.0, 2.0, 2.0])
    assert [r[0] for r in res] == [12, 12, 12, 12]  # cp group {0,2} and {1,3}: 5 + 7
    assert all(r[1] == pytest.approx(3.0 / 12) for r in res)


# ----------------------------------------------------------------------------- CP=1 trainer
def test_cp1_trainer_bit_for_bit_equals_plain_hf_loop(ranks):
    cfg = W.make_cfg("llama", min_doc_len=16)
    batches = W.make_batches(cfg)
    [res] = ranks(1).run(W.run_steps, cfg, batches)
    [ref] = ranks(1).run(W.plain_hf_loop, cfg, batches)
    [res_noplan] = ranks(1).run(W.run_steps, W.make_cfg("llama", min_doc_len=16, plan=False), batches)
    for step, (a, b, c) in enumerate(zip(res["steps"], ref, res_noplan["steps"])):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["grad_norm"] == b["grad_norm"], step
        for name, g in b["grads"].items():
            assert torch.equal(a["grads"][name], g), f"step {step} grad {name}"
        for name, p in b["params"].items():
            assert torch.equal(a["params"][name], p), f"step {step} param {name}"
        # the same trainer with no plan_overrides at all: identical (when: cp entries are skipped)
        assert a["loss"] == c["loss"] and all(torch.equal(a["params"][k], c["params"][k]) for k in a["params"])
        assert a["tokens"] == sum(count_valid_targets(mb) for mb in batches[0][step])


def test_cp1_grad_accum_equals_one_big_batch(ranks):
    cfg_ga = W.make_cfg("qwen3", ga=2, min_doc_len=12)
    batches = W.make_batches(cfg_ga)
    big = [[[_cat(mbs)] for mbs in batches[0]]]
    [ga] = ranks(1).run(W.run_steps, cfg_ga, batches, False)
    [one] = ranks(1).run(W.run_steps, W.make_cfg("qwen3", micro_batch_size=4, min_doc_len=12), big, False)
    for a, b in zip(ga["steps"], one["steps"]):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], rtol=1e-5, atol=1e-6)


def _cat(mbs):
    from hyper_parallel.trainer.data import concat_batches

    return concat_batches(mbs)


def test_cp1_activation_checkpointing_and_bf16(ranks):
    cfg = W.make_cfg("llama", steps=2)
    batches = W.make_batches(cfg)
    [base] = ranks(1).run(W.run_steps, cfg, batches, False)
    [ac] = ranks(1).run(W.run_steps, W.make_cfg("llama", steps=2, ac=True), batches, False)
    [bf16] = ranks(1).run(W.run_steps, W.make_cfg("llama", steps=2, mp="bf16"), batches, False)
    for a, b, c in zip(base["steps"], ac["steps"], bf16["steps"]):
        assert a["loss"] == b["loss"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert c["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert all(v.dtype == torch.float32 for v in c["params"].values())  # fp32 master weights


# ----------------------------------------------------------------------------- checkpoints
def test_resume_continues_the_loss_curve_exactly(ranks, tmp_path):
    cfg = W.make_cfg("llama", steps=4, warmup=2, out_dir=str(tmp_path / "straight"), min_doc_len=16)
    [straight] = ranks(1).run(W.train_losses, cfg)
    cfg_a = W.make_cfg("llama", steps=4, warmup=2, out_dir=str(tmp_path / "split"), min_doc_len=16)
    [first] = ranks(1).run(W.train_losses, cfg_a, None, 2)
    assert first["step"] == 2 and os.path.isdir(first["path"])
    meta = json.loads(open(os.path.join(first["path"], "hyper_meta.json")).read())
    assert meta["topology"]["cp_size"] == 1 and meta["step"] == 2 and meta["data_position"] == 2
    cfg_b = W.make_cfg("llama", steps=4, warmup=2, out_dir=str(tmp_path / "split"), min_doc_len=16,
                       schedule__resume_from=first["path"])
    [second] = ranks(1).run(W.train_losses, cfg_b)
    assert second["step"] == 4 and second["position"] == 4
    assert first["losses"] + second["losses"] == straight["losses"]
    log = json.loads((tmp_path / "split" / "train_log.json").read_text())
    assert [r["loss"] for r in log["steps"]] == straight["losses"]


def test_resume_rejects_a_missing_checkpoint(ranks, tmp_path):
    """A resume_from that does not exist is a config error naming the field (a checkpoint at another
    CP/DP size now reshards: tests/trainer/test_resume_topology.py, which also covers the TP refusal)."""
    missing = W.make_cfg("llama", steps=1, schedule__resume_from=str(tmp_path / "nope"))
    [err] = ranks(1).run(W.build_error, missing)
    assert err[0] == "CPConfigError" and "schedule.resume_from" in err[1]


# ----------------------------------------------------------------------------- CLI
def test_cli_single_process_writes_log_and_plot(tmp_path, capsys):
    """World size 1 without torchrun: ``hyper-train CONFIG overrides`` in this process."""
    from hyper_parallel.trainer.cli import main

    out = tmp_path / "run"
    code = main([os.path.join(ROOT, "examples", "train_cp1.yaml"), "schedule.steps=3",
                 f"logging.out_dir={out}", "data.seq_len=32", f"data.path={W.CORPUS}",
                 f"model.config_file={W.MODELS['llama'][1]}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["steps"]] == [1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in log["steps"])
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert "done: 3 steps" in captured.out and "tok/s=" in captured.err


def test_cli_config_error_exit_code(capsys):
    from hyper_parallel.trainer.cli import main

    assert main([os.path.join(ROOT, "examples", "train_cp1.yaml"), "schedule.stepz=3"]) == 2
    assert "schedule.stepz" in capsys.readouterr().err
    assert main([]) == 2
