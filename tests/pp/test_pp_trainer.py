"""The trainer at accelerator.pp_size > 1 (trainer/pipeline.py): PP=2 x CP=2 on 4 ranks against one rank,
the same YAML otherwise (meta build, FSDP2 on each stage, AdamW, gradient clipping, 2 microbatches per
step): every step's loss with activation checkpointing, interleaved 1F1B, bf16, TP, EP, the tiled MLP
with activation offload, and evaluation; the HF export (one plain transformers directory); a
checkpoint written at PP=2 resumed at PP=1 and at PP=2 with the next losses of the uninterrupted run;
and a schedule the sizes cannot run, refused before anything is built."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig
from hyper_parallel.trainer.pipeline import check_pipeline_run

from tests.ep._workers import train_export
from tests.trainer import _workers as TW

RTOL = 1e-5
LAYERS = {"num_hidden_layers": 4}


def _cfg(pp: int, out, **extra) -> dict:
    return TW.make_cfg("llama", cp=2 if pp > 1 else 1, steps=4, ga=2, out_dir=str(out), accelerator__pp_size=pp,
                       model__config=dict(LAYERS), **extra)


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_trainer_pp2_cp2_equals_one_rank_exports_and_resumes_at_another_pp_size(ranks, tmp_path):
    [one] = ranks(1).run(train_export, _cfg(1, tmp_path / "pp1", logging__export_hf=False), timeout=600)
    # activation checkpointing inside the stages (the reference runs without: recomputation changes nothing)
    pp2 = ranks(4).run(train_export, _cfg(2, tmp_path / "pp2", schedule__save_every=2,
                                          schedule__activation_checkpointing=True), timeout=600)
    assert all(r["losses"] == pp2[0]["losses"] for r in pp2)
    rel = _rel(pp2[0]["losses"], one["losses"])
    print(f"trainer llama pp1 {one['losses']}\n  pp2 x cp2 {pp2[0]['losses']}\n  max rel {rel:.2e} (tol {RTOL:g})")
    assert len(one["losses"]) == 4 and rel <= RTOL
    exported = T.AutoModelForCausalLM.from_pretrained(pp2[0]["hf"]).state_dict()
    reference = T.AutoModelForCausalLM.from_pretrained(one["hf"]).state_dict()
    assert exported.keys() == reference.keys()
    werr = max((exported[k] - reference[k]).abs().max().item() for k in reference)
    print(f"HF export of the stages vs one rank's: {len(exported)} tensors, max abs difference {werr:.2e}")
    assert werr <= 1e-5
    # interleaved 1F1B: 2 stages per rank (layers 0 and 2 on pp rank 0, 1 and 3 on pp rank 1)
    inter = ranks(4).run(train_export, _cfg(2, tmp_path / "inter", schedule__pipeline="interleaved_1f1b",
                                            schedule__steps=2), timeout=600)
    rel = _rel(inter[0]["losses"], one["losses"][:2])
    print(f"interleaved_1f1b (2 stages per rank): {inter[0]['losses']} (max rel {rel:.2e})")
    assert len(inter[0]["losses"]) == 2 and rel <= RTOL
    step2 = tmp_path / "pp2" / "checkpoints" / "step_2"
    for pp, world in ((1, 1), (2, 4)):
        res = ranks(world).run(TW.train_losses, _cfg(pp, tmp_path / f"resume{pp}", schedule__resume_from=str(step2)),
                               timeout=600)
        rel = _rel(res[0]["losses"], one["losses"][2:])
        print(f"resumed at pp {pp} from the pp 2 checkpoint at step 2: {res[0]['losses']} vs {one['losses'][2:]} "
              f"(max rel {rel:.2e})")
        assert res[0]["step"] == 4 and len(res[0]["losses"]) == 2 and rel <= RTOL


def test_trainer_pp2_cp2_bf16_equals_one_rank_bf16(ranks, tmp_path):
    """bf16 (FSDP2's mixed-precision policy, fp32 master weights): bf16 activations between the stages;
    the losses of PP=1 at the same policy within the bf16 tolerance of the CP tests."""
    from tests.trainer.test_cp_examples import BF16_LOSS_RTOL

    [one] = ranks(1).run(TW.train_losses, _cfg(1, tmp_path / "one", schedule__steps=3, schedule__mixed_precision="bf16"),
                         timeout=600)
    pp2 = ranks(4).run(TW.train_losses, _cfg(2, tmp_path / "pp2", schedule__steps=3, schedule__mixed_precision="bf16"),
                       timeout=600)
    rel = _rel(pp2[0]["losses"], one["losses"])
    print(f"bf16: pp1 {one['losses']}\n  pp2 x cp2 {pp2[0]['losses']}\n  max rel {rel:.2e} (tol {BF16_LOSS_RTOL:g})")
    assert len(one["losses"]) == 3 and rel <= BF16_LOSS_RTOL


COMBOS = [  # (name, world, arch, overrides): PP2 x CP2 with another parallelism or memory feature
    ("tp2", 8, "llama", {"accelerator__tp_size": 2}),
    ("ep2", 4, "qwen3_moe", {"accelerator__ep_size": 2}),
    ("tiled_mlp_offload", 4, "llama", {"schedule__tiled_mlp": True, "schedule__tiled_mlp_chunk_size": 16,
                                      "schedule__activation_checkpointing": True, "schedule__activation_offload": True}),
]


@pytest.mark.parametrize("name,world,arch,extra", COMBOS, ids=[c[0] for c in COMBOS])
def test_trainer_pp2_cp2_beside_tp_ep_and_memory_features_equals_one_rank(ranks, tmp_path, name, world, arch, extra):
    """TP 2 inside each stage (8 ranks), EP 2 over each stage's dense ranks (Qwen3-MoE), the tiled MLP
    with activation offload: 3 AdamW steps against the same model on one rank."""
    def cfg(pp, out, **kw):
        return TW.make_cfg(arch, cp=2 if pp > 1 else 1, steps=3, ga=2, out_dir=str(out), accelerator__pp_size=pp,
                           model__config=dict(LAYERS), **kw)

    [one] = ranks(1).run(TW.train_losses, cfg(1, tmp_path / "one"), timeout=600)
    got = ranks(world).run(TW.train_losses, cfg(2, tmp_path / "pp2", **extra), timeout=600)
    rel = _rel(got[0]["losses"], one["losses"])
    print(f"{name} ({arch}): pp1 {one['losses']}\n  pp2 x cp2 {got[0]['losses']}\n  max rel {rel:.2e} (tol {RTOL:g})")
    assert all(r["losses"] == got[0]["losses"] for r in got) and len(one["losses"]) == 3 and rel <= RTOL


def test_trainer_pp2_cp2_moe_router_loss_equals_one_rank(ranks, tmp_path):
    """Qwen3-MoE with its router load-balancing loss (output_router_logits): the statistics of every
    stage's routers travel with the hidden states and the totals come back with the gradients
    (pipeline_parallel/router.py), under 1f1b and interleaved 1F1B: losses, router losses and tokens
    per expert of one rank."""
    from tests.pp._workers import train_router

    def cfg(pp, out, **kw):
        return TW.make_cfg("qwen3_moe", cp=2 if pp > 1 else 1, steps=3, ga=2, out_dir=str(out), accelerator__pp_size=pp,
                           model__config=dict(LAYERS, output_router_logits=True), **kw)

    [one] = ranks(1).run(train_router, cfg(1, tmp_path / "one"), timeout=600)
    for pipeline in ("1f1b", "interleaved_1f1b"):
        got = ranks(4).run(train_router, cfg(2, tmp_path / pipeline, schedule__pipeline=pipeline), timeout=600)
        rel, rrel = _rel(got[0]["losses"], one["losses"]), _rel(got[0]["router"], one["router"])
        print(f"router loss, {pipeline}: losses {got[0]['losses']} vs {one['losses']} (max rel {rel:.2e}); router "
              f"{got[0]['router']} vs {one['router']} (max rel {rrel:.2e}); tokens per expert {got[0]['tokens']}")
        assert all(r == got[0] for r in got) and rel <= RTOL and rrel <= RTOL and got[0]["tokens"] == one["tokens"]


def test_trainer_pp2_cp2_evaluates_like_one_rank(ranks, tmp_path):
    """Held-out evaluation through the schedule's forward (packed documents from files): the same eval
    losses as one rank, beside the training losses."""
    from tests.trainer import _data_workers as D

    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=24, lo=10, hi=150)
    data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=64, micro_batch_size=2, eval_fraction=0.1,
                      eval_every=2, eval_batches=2)

    def cfg(pp, name):
        c = D.trainer_cfg(data, steps=4, ga=2, cp=2 if pp > 1 else 1, out_dir=str(tmp_path / name),
                          accelerator__pp_size=pp)
        c["model"]["config"].update(LAYERS)
        return c

    [one] = ranks(1).run(D.resume_run, cfg(1, "one"), 4, timeout=600)
    got = ranks(4).run(D.resume_run, cfg(2, "pp2"), 4, timeout=600)
    ev = max(abs(got[0]["eval"][k] - v) / abs(v) for k, v in one["eval"].items())
    rel = _rel(got[0]["losses"], one["losses"])
    print(f"evaluation: pp1 {one['eval']} vs pp2 x cp2 {got[0]['eval']} (max rel {ev:.2e}); losses max rel {rel:.2e}")
    assert sorted(one["eval"]) == sorted(got[0]["eval"]) == [2, 4] and ev <= RTOL and rel <= RTOL


def test_a_schedule_the_sizes_cannot_run_is_refused_by_name(tmp_path):
    cfg = TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__grad_accum_steps=1))
    with pytest.raises(CPConfigError, match=r"1f1b with pp_size=2 needs at least 2 microbatches"):
        check_pipeline_run(cfg)
    check_pipeline_run(TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__grad_accum_steps=1,
                                                    schedule__pipeline="gpipe")))
    with pytest.raises(CPConfigError, match=r"schedule\.pipeline"):
        TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__pipeline="zero_bubble"))
    from tests.trainer import _data_workers as D     # an evaluation's micro-batches run the same schedule

    data = D.data_cfg(D.short_docs_jsonl(str(tmp_path / "d.jsonl"), n_docs=8), str(tmp_path / "c"),
                      eval_fraction=0.2, eval_every=2, eval_batches=1)
    ev = D.trainer_cfg(data, ga=2, cp=2, accelerator__pp_size=2, out_dir=str(tmp_path / "e"))
    with pytest.raises(CPConfigError, match=r"\[data\.eval_batches\] 1f1b with pp_size=2 needs at least 2"):
        check_pipeline_run(TrainerConfig.from_dict(ev))



@pytest.mark.parametrize("override,words", [
    ("schedule.grad_accum_steps=1", "[schedule.grad_accum_steps] 1f1b with pp_size=2 needs at least 2 microbatches"),
    ("model.config.num_hidden_layers=1", "[accelerator.pp_size] LlamaForCausalLM (model_type 'llama') has 1 decoder "
                                         "layers, fewer than pp_size=2 stages"),
    ("model.config.tie_word_embeddings=true", "[model.config.tie_word_embeddings] LlamaForCausalLM"),
])
def test_the_cli_refuses_a_pipeline_it_cannot_run_in_one_line_before_any_rank_starts(capsys, override, words):
    """``hyper-train examples/pp2_cp2.yaml`` with a bad override: exit 2 and one line, from the config
    check (the model built on the meta device), before a launcher or a rank exists."""
    import os

    from hyper_parallel.trainer.cli import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert main([os.path.join(root, "examples", "pp2_cp2.yaml"), override,
                 f"data.path={os.path.join(root, 'examples', 'data', 'corpus.txt')}",
                 f"model.config_file={os.path.join(root, 'examples', 'models', 'tiny_llama.yaml')}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    print(err)
    assert len(err) == 1 and words in err[0], err


def test_a_head_the_last_stage_does_not_reproduce_is_refused_by_name(tmp_path):
    """The last stage computes the tiled loss with the head post-processing transformers declares; a
    head that does something else (here a forward that doubles the logits) fails the tiled-head probe
    and is refused before anything is built."""
    from hyper_parallel.trainer.pipeline import check_pipeline_head

    cfg = TrainerConfig.from_dict(_cfg(2, tmp_path))
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    check_pipeline_head(model, cfg)                  # the plain head: nothing to refuse
    forward = model.forward

    def doubled(*a, **kw):
        out = forward(*a, **kw)
        out.logits = out.logits * 2
        return out
    model.forward = doubled
    with pytest.raises(CPConfigError, match=r"\[accelerator.pp_size\] the pipeline's last stage computes the tiled "
                                            r"loss, which does not reproduce this model's head"):
        check_pipeline_head(model, cfg)
