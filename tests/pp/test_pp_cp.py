"""Pipeline parallelism beside CP (hyper_parallel.distributed.pipeline_parallel) against one rank.

PP=2 x CP=2 (4 ranks; 8 with dp_shard 2), FSDP2 on each stage, torch.distributed.pipelining's
schedules, 2 optimizer steps on packed rows (2 microbatches of 2 rows per step): every step's loss and
every final parameter of each stage against the same model trained on one rank on the same global
batches (loss = the global token mean). SGD, so that the parameters compare the gradients (Adam's
update divides by the gradient's own size and turns fp rounding on near-zero gradients into
step-sized differences). Parameters: max |diff| relative to the largest parameter change of the
reference. Tolerance 1e-5 (fp32).
"""
from __future__ import annotations

import pytest
import torch
import transformers as T

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.mesh import MeshSizes
from hyper_parallel.distributed.pipeline_parallel import build_stage, check_pipelinable, check_schedule, stage_layers

from tests.cp.test_mixer_cp import build_mamba2_family
from tests.pp._workers import pp_cp_train
from tests.wrappers._workers import _COMMON

TOL = 1e-5
CASES = [("llama", "1f1b", "colossal"), ("llama", "gpipe", "colossal"), ("llama", "interleaved_1f1b", "colossal"),
         ("qwen3", "1f1b", "colossal"), ("mistral", "1f1b", "colossal"), ("qwen3_next", "1f1b", "colossal"),
         ("llama", "1f1b", "async_colossal"), ("llama", "interleaved_1f1b", "async_ulysses"),
         ("gemma2", "1f1b", "colossal")]


def _check(res, what: str) -> None:
    for got in res:
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], got["ref_losses"]))
        print(f"{what} pp rank {got['pp_rank']} (layers {got['layers']}, {got['names']} tensors): losses "
              f"{got['losses']} vs {got['ref_losses']} (max rel {loss_rel:.1e}); params max abs {got['params_abs']:.1e}, "
              f"rel {got['params']:.1e} (worst {got['worst']}; tol {TOL:g})")
        assert loss_rel <= TOL and got["params"] <= TOL, got
    assert {got["pp_rank"] for got in res} == {0, 1}


@pytest.mark.parametrize("arch,schedule,method", CASES, ids=[f"{a}-{s}-{m}" for a, s, m in CASES])
def test_pp2_cp2_trains_like_one_rank(ranks, arch, schedule, method):
    """Llama, Qwen3, Mistral (sliding window 5 < every document) and Qwen3-Next (Gated DeltaNet + attention
    + MoE on each stage) under 1f1b; Llama under gpipe and interleaved 1F1B (2 stages per rank: layers
    0 and 2 on pp rank 0, 1 and 3 on pp rank 1) too; Gemma 2 (final logit softcapping applied by the
    last stage's tiled loss, attention softcap, window); async CP inside the stages (the Llama adapter's
    Colossal and Ulysses Targets, the handoffs' collectives on the comm thread beside the pipeline's sends)."""
    _check(ranks(4).run(pp_cp_train, arch, method=method, schedule=schedule, timeout=600),
           f"{arch}/{schedule}/{method}")


def test_pp2_cp2_dp_shard2_trains_like_one_rank(ranks):
    """8 ranks: each DP rank pipelines its own microbatches; FSDP2 over (dp_shard, cp) of each stage."""
    _check(ranks(8).run(pp_cp_train, "llama", dp_shard=2, timeout=900), "llama/1f1b/dp_shard2")


def test_stage_layers_cover_every_layer_once():
    for n, pp in ((4, 2), (7, 3), (8, 4), (5, 5)):
        got = [list(stage_layers(n, pp, r)) for r in range(pp)]
        assert sum(got, []) == list(range(n)) and max(map(len, got)) - min(map(len, got)) <= 1, got


def _llama(**kw):
    cfg = T.LlamaConfig(**dict(_COMMON, num_hidden_layers=4, tie_word_embeddings=False), **kw)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg)


def test_a_stage_keeps_the_whole_models_parameter_names():
    full = set(dict(_llama().named_parameters()))
    names = [set(dict(build_stage(_llama(), r, 2).named_parameters())) for r in range(2)]
    assert names[0] | names[1] == full and not names[0] & names[1]
    assert "model.embed_tokens.weight" in names[0] and "model.layers.3.mlp.up_proj.weight" in names[1]
    assert "lm_head.weight" in names[1] and "model.norm.weight" in names[1]
    model = _llama()
    build_stage(model, 0, 2)
    with pytest.raises(RuntimeError, match="cut into pipeline stages"):    # pruned in place: not runnable whole
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def _shared_layers():
    model = _llama()
    model.model.layers[1] = model.model.layers[0]
    return model


def _scaled_inputs_embeds():
    """A Llama whose model forward scales ``inputs_embeds`` (as Gemma did before transformers moved the
    normalizer into its embedding): a later stage would scale again."""
    model = _llama()
    forward = model.model.forward
    model.model.forward = lambda inputs_embeds=None, **kw: forward(inputs_embeds=inputs_embeds * 8.0, **kw)
    return model


REFUSED = [
    ("Zamba2", lambda: build_mamba2_family("zamba2"), "declares no pipeline cut points"),
    ("Bamba", lambda: build_mamba2_family("bamba"), "declares no pipeline cut points"),
    ("tied embeddings", lambda: T.LlamaForCausalLM(T.LlamaConfig(**dict(_COMMON, tie_word_embeddings=True))),
     "tie_word_embeddings"),
    ("fewer layers", lambda: T.LlamaForCausalLM(T.LlamaConfig(**dict(_COMMON, num_hidden_layers=1,
                                                                      tie_word_embeddings=False))), "fewer than"),
    ("shared layers", _shared_layers, "share parameter"),
    ("embeds scaled in forward", lambda: _scaled_inputs_embeds(), "transforms inputs_embeds"),
]


@pytest.mark.parametrize("build,words", [(b, w) for _n, b, w in REFUSED], ids=[n for n, _b, _w in REFUSED])
def test_a_model_that_cannot_be_cut_exactly_is_refused(build, words):
    model = build()
    with pytest.raises(CPConfigError, match=words) as err:
        check_pipelinable(model, 2)
    print(err.value)
    assert type(model).__name__ in str(err.value) or "tie_word_embeddings" in str(err.value)


def test_a_schedule_that_cannot_run_is_refused():
    with pytest.raises(CPConfigError, match="unknown pipeline schedule 'zero_bubble'"):
        check_schedule("zero_bubble", 2, 4)
    with pytest.raises(CPConfigError, match="needs at least 2 microbatches"):
        check_schedule("1f1b", 2, 1)
    with pytest.raises(CPConfigError, match=r"\[schedule.virtual_stages\] interleaved_1f1b runs 2 or more stages"):
        check_schedule("interleaved_1f1b", 2, 4)
    with pytest.raises(CPConfigError, match=r"\[schedule.virtual_stages\] 1f1b runs one stage per rank"):
        check_schedule("1f1b", 2, 4, virtual=2)
    with pytest.raises(CPConfigError, match="needs a multiple of max"):
        check_schedule("interleaved_1f1b", 2, 5, virtual=2)
    assert check_schedule("gpipe", 2, 1).__name__ == "ScheduleGPipe"
    assert check_schedule("interleaved_1f1b", 2, 6, virtual=2).__name__ == "ScheduleInterleaved1F1B"


def test_the_mesh_takes_a_pipeline_dimension():
    MeshSizes(pp=2, cp=2).check(4)
    with pytest.raises(ValueError, match=r"pp\(2\) x dp_replicate\(1\) x dp_shard\(1\) x cp\(2\) x tp\(1\) = 4"):
        MeshSizes(pp=2, cp=2).check(8)


def test_a_model_one_rank_cannot_cut_fails_every_rank_before_any_collective(ranks):
    """One rank's model has a single layer (fewer than the 2 stages): every rank fails in the agreed plan
    step, the others naming that rank; with 4 layers everywhere each pp rank gets its two."""
    from hyper_parallel.distributed.errors import PreflightError

    from tests.pp._workers import pp_setup

    pool = ranks(4)
    outs = pool.outcomes(pp_setup, rank_args=[(4,), (4,), (4,), (1,)], timeout=120)
    assert isinstance(outs[3], CPConfigError) and "fewer than pp_size=2" in str(outs[3]), outs
    assert all(isinstance(o, PreflightError) and "rank 3" in str(o) for o in outs[:3]), outs
    assert pool.run(pp_setup, 4) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_a_router_loss_the_stage_cannot_compute_is_refused_before_any_collective():
    """Through the API, a MoE model whose objective has the router loss needs the stage's StageRouterLoss
    (the trainer sets it): without it a step is refused, not run without the loss."""
    from hyper_parallel.distributed.pipeline_parallel import PipelineStep

    model = T.MixtralForCausalLM(T.MixtralConfig(**dict(_COMMON, tie_word_embeddings=False), num_local_experts=2,
                                                 output_router_logits=True))
    step = PipelineStep(build_stage(model, 0, 2), mesh=None)
    with pytest.raises(CPConfigError, match=r"\[model.config.output_router_logits\] .* no StageRouterLoss"):
        step.run([])
