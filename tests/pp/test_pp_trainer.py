"""The trainer at accelerator.pp_size > 1 (trainer/pipeline.py): PP=2 x CP=2 on 4 ranks against one rank,
the same YAML otherwise (meta build, FSDP2 on each stage, AdamW, gradient clipping, 2 microbatches per
step; activation checkpointing inside the stages): every step's loss, the HF export (one plain transformers directory), a checkpoint written at
PP=2 resumed at PP=1 and at PP=2 with the next losses of the uninterrupted run; and what the trainer
refuses with a pipeline, before anything is built."""
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


NOT_YET = [("accelerator.tp_size", {"accelerator__tp_size": 2}),
           ("schedule.tiled_mlp", {"schedule__tiled_mlp": True}),
           ("schedule.activation_offload", {"schedule__activation_offload": True, "schedule__activation_checkpointing": True})]


@pytest.mark.parametrize("field,extra", NOT_YET, ids=[f for f, _e in NOT_YET])
def test_what_the_pipeline_does_not_run_with_yet_is_refused_by_name(field, extra, tmp_path):
    cfg = TrainerConfig.from_dict(_cfg(2, tmp_path, **extra))
    with pytest.raises(CPConfigError, match=rf"\[{field}\] is not combined with accelerator.pp_size=2 yet"):
        check_pipeline_run(cfg)


def test_a_schedule_the_sizes_cannot_run_is_refused_by_name(tmp_path):
    cfg = TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__grad_accum_steps=1))
    with pytest.raises(CPConfigError, match=r"1f1b with pp_size=2 needs at least 2 microbatches"):
        check_pipeline_run(cfg)
    check_pipeline_run(TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__grad_accum_steps=1,
                                                    schedule__pipeline="gpipe")))
    with pytest.raises(CPConfigError, match=r"schedule\.pipeline"):
        TrainerConfig.from_dict(_cfg(2, tmp_path, schedule__pipeline="zero_bubble"))

