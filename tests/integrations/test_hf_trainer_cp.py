"""Exact CP inside the HF Trainer / TRL SFTTrainer (hyper_parallel.integrations.hf).

Each case runs the same script (tests/integrations/_hf_workers.py::build_trainer) twice on warm gloo
pools: at cp 1 on one rank (the plain script: ``context_parallel`` returns the trainer untouched)
and at cp 2 on two ranks; 5 optimizer steps, gradient accumulation 2, fp32, AdamW lr 1e-2 with a
linear schedule, then ``trainer.evaluate()``. Asserted: every logged training loss within relative
1e-5, the learning rates equal, the eval loss within relative 1e-5, and every parameter after the
steps within 1e-5 of the largest |parameter|; which parameters train (LoRA: the adapters only).

The default suite runs one case per entry (SFTTrainer packing + completion-only, Trainer +
DataCollatorWithFlattening, SFTTrainer + LoRA) and the refusals; ``HYPER_PARALLEL_HF=all`` adds
the rest of the matrix.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from tests.integrations import _hf_workers as W  # noqa: E402

TOL = 1e-5
FULL = os.environ.get("HYPER_PARALLEL_HF", "") == "all"
full_only = pytest.mark.skipif(not FULL, reason="full HF matrix: set HYPER_PARALLEL_HF=all")


def _compare(ranks, entry: str, arch: str = "llama", plan: str | None = None, param_tol: float = TOL, dp: int = 1,
             **extra) -> dict:
    """The script at cp 1 on ``dp`` ranks against cp 2 on ``2 dp`` ranks (``dp`` data-parallel groups)."""
    save_dir = extra.pop("save_dir", None)
    ref = ranks(dp).run(W.train_case, entry, arch, 1, plan=plan, timeout=300, **extra)[0]
    got = ranks(2 * dp).run(W.train_case, entry, arch, 2, plan=plan, save_dir=save_dir, timeout=300, **extra)[0]
    if extra.get("fsdp_dir"):
        assert "DTensor" in got["sharded"], got["sharded"]     # FSDP2 really sharded the CP run's model
    assert len(ref["loss"]) == len(got["loss"]) == 5, (ref["loss"], got["loss"])
    loss_rel = max(abs(a - b) / abs(a) for a, b in zip(ref["loss"], got["loss"]))
    eval_rel = abs(ref["eval_loss"] - got["eval_loss"]) / abs(ref["eval_loss"])
    pmax, p_abs, worst, moved = W.param_gap(ref, got)
    print(f"{entry}/{arch}: losses cp1 {ref['loss']}\n  cp2 {got['loss']}\n"
          f"  loss max rel {loss_rel:.2e}, eval {ref['eval_loss']:.6f} vs {got['eval_loss']:.6f} (rel {eval_rel:.2e}), "
          f"params max abs {p_abs:.2e} = {p_abs / pmax:.2e} of the largest (tol {param_tol:g}, {worst}); largest update "
          f"{moved:.2e}")
    assert ref["lr"] == got["lr"]
    assert ref["trainable"] == got["trainable"]
    for key, values in ref["metrics"].items():      # TRL's entropy / token accuracy: from the whole row's logits
        assert len(values) == len(got["metrics"][key]), key
        if values:
            m_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(values, got["metrics"][key]))
            print(f"  {key}: cp1 {values}\n  cp2 {got['metrics'][key]} (max rel {m_rel:.2e})")
            assert m_rel <= TOL, key
    assert loss_rel <= TOL and eval_rel <= TOL and p_abs <= param_tol * pmax
    assert moved > 100 * TOL * pmax, "the parameters did not move: the comparison would prove nothing"
    return {"ref": ref, "got": got}


def test_sft_packing_completion_only_llama(ranks):
    """TRL SFTTrainer, packing=True (BFD, padding-free rows: position_ids restarting per document, no
    mask), completion-only loss, gradient checkpointing (SFTConfig's default): CP=2 == CP=1."""
    _compare(ranks, "sft_packing")


def test_trainer_flattening_llama(ranks, tmp_path):
    """transformers Trainer + DataCollatorWithFlattening (labels -100 on prompts), the model's own loss;
    the model the Trainer saves under CP is a plain HF directory: transformers reloads it and its
    eval loss is the one logged under CP."""
    import transformers as T

    out = _compare(ranks, "trainer_flatten", save_dir=str(tmp_path))
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype="float32", attn_implementation="sdpa")
    got = W.plain_eval_loss(model, "trainer_flatten")
    rel = abs(got - out["got"]["eval_loss"]) / abs(got)
    print(f"reloaded with plain transformers: eval loss {got:.6f} vs logged under CP {out['got']['eval_loss']:.6f} "
          f"(rel {rel:.2e}, tol {TOL:g})")
    assert rel <= TOL


def test_sft_lora_llama(ranks, tmp_path):
    """SFTTrainer + peft LoRA on q/k/v/o and gate/up/down of the CP model: only adapters train, exact;
    the adapter saved under CP (peft's save_pretrained through the Trainer) and the merged model
    reload with plain peft / transformers and give the same logits (no CP in the test process)."""
    import torch
    import transformers as T
    from peft import PeftModel

    out = _compare(ranks, "sft_lora", save_dir=str(tmp_path))
    trainable = out["ref"]["trainable"]
    assert trainable and all("lora_" in n for n in trainable), trainable
    base = W.build_model("llama")
    adapted = PeftModel.from_pretrained(base, tmp_path / "model").eval()
    merged = T.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="float32",
                                                    attn_implementation="sdpa").eval()
    params = out["got"]["params"]
    lora = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    assert lora and all(torch.equal(p, params[n.replace(".default.", ".default.")]) for n, p in lora.items()
                        if n in params)
    ids = torch.randint(3, W.VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, m = adapted(input_ids=ids, use_cache=False).logits, merged(input_ids=ids, use_cache=False).logits
        plain = W.build_model("llama").eval()(input_ids=ids, use_cache=False).logits
    err = (a - m).abs().max().item()
    print(f"adapter vs merged reload: logits max abs {err:.2e} (tol 1e-5); adapter changed the logits by "
          f"{(a - plain).abs().max().item():.2e}")
    assert err <= 1e-5 and (a - plain).abs().max().item() > 1e-4


def test_trainer_fsdp2_llama(ranks, tmp_path):
    """FSDP2 under the HF Trainer: the model is loaded as transformers shards it at load time
    (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=world))``, FSDP2 over all
    ranks; the Trainer then neither wraps it in DDP nor shards it again), CP added by
    ``context_parallel``. FSDP2's reduce-scatter averages over all ranks as DDP does, so the same loss
    normalisation gives the CP=1 numbers: Trainer + flattening at cp 2 (both ranks one FSDP2 group)
    against the plain script at cp 1; the model the Trainer saves (gathered from the shards) reloads
    with plain transformers and gives the logged eval loss."""
    import transformers as T

    out = _compare(ranks, "trainer_flatten", save_dir=str(tmp_path / "saved"), fsdp_dir=str(tmp_path / "load"))
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "saved" / "model", dtype="float32",
                                                   attn_implementation="sdpa")
    got = W.plain_eval_loss(model, "trainer_flatten")
    rel = abs(got - out["got"]["eval_loss"]) / abs(got)
    print(f"reloaded with plain transformers: eval loss {got:.6f} vs logged under CP x FSDP2 "
          f"{out['got']['eval_loss']:.6f} (rel {rel:.2e}, tol {TOL:g})")
    assert rel <= TOL


@full_only
def test_sft_fsdp2_dp2_cp2(ranks, tmp_path):
    """SFTTrainer packing + completion-only on 4 ranks, dp 2 x cp 2, FSDP2 over all 4 (transformers'
    DistributedConfig) against the plain script on 2 ranks (DDP, cp 1). SGD (note above SGD): the
    parameters within 1e-5 of the largest (measured 1.1e-8); under AdamW lr 1e-2 one embedding
    element differs by 1.1e-4 of the largest, as in the same comparison without FSDP (1.8e-4)."""
    _compare(ranks, "sft_packing", dp=2, fsdp_dir=str(tmp_path), **SGD)


@full_only
def test_sft_lora_fsdp2(ranks, tmp_path):
    """LoRA on a model FSDP2 shards at load time: peft adds the adapters after sharding, the Trainer
    keeps them replicated (broadcast, gradients averaged over all ranks), CP=2 == CP=1."""
    out = _compare(ranks, "sft_lora", fsdp_dir=str(tmp_path))
    assert all("lora_" in n for n in out["ref"]["trainable"])


@full_only
def test_sft_dft_loss_llama(ranks):
    """TRL's DFT loss (``loss_type='dft'``: each token's NLL weighted by its detached probability), which the
    compute_loss_func refusal names as a fix: a per-token loss of the fused head, exact under CP."""
    _compare(ranks, "sft_packing", loss_type="dft")


@full_only
def test_sft_padded_rows_llama(ranks):
    """No packing: right-padded rows with an attention mask, completion-only."""
    _compare(ranks, "sft_padded")


@full_only
def test_sft_packing_ulysses_llama(ranks):
    """The same packed script with Ulysses declared instead of Colossal. Parameters: 5e-5 of the
    largest — measured 1.72e-5 in one element of one embedding row (its gradient nearly cancels, so
    AdamW's g / sqrt(v) turns Ulysses' different summation order into a 1.8e-3 relative update
    difference); every other parameter within 5.7e-7, losses 8.6e-8, eval loss 1.7e-7."""
    _compare(ranks, "sft_packing", plan="llama_ulysses", param_tol=5e-5)


@full_only
def test_sft_padded_rows_gpt_oss(ranks):
    """gpt-oss (eager through the attention interface: sinks, a sliding-window layer, MoE) on padded
    rows; TRL's router aux loss off (refused under CP). Packed gpt-oss rows are not a parity case:
    transformers' gpt-oss mask ignores position_ids, so at CP=1 packed documents see each other."""
    _compare(ranks, "sft_padded", "gpt_oss")


@full_only
def test_sft_padded_rows_qwen3_next(ranks):
    """Hybrid Qwen3-Next (3 Gated DeltaNet + 1 attention layer, MoE) on padded rows: attention
    sdpa_hf_ulysses + GDN gated_deltanet_ulysses declared. Packed rows fail at CP=1 on CPU already
    (transformers needs causal_conv1d to keep packed sequences apart in the short convolution)."""
    _compare(ranks, "sft_padded", "qwen3_next")


@full_only
@pytest.mark.parametrize("average", [True, False])
def test_average_tokens_across_devices(ranks, average):
    """num_items_in_batch over GA and ranks, on and off (off: the count is summed over the CP group)."""
    _compare(ranks, "trainer_flatten", average_tokens_across_devices=average)


REFUSALS = [
    ("group_by_length", {"train_sampling_strategy": "group_by_length"}, "TrainingArguments.train_sampling_strategy"),
    ("neftune", {"neftune_noise_alpha": 5.0}, "TrainingArguments.neftune_noise_alpha"),
    ("liger", {"use_liger_kernel": True}, "TrainingArguments.use_liger_kernel"),
    ("label_smoothing", {"label_smoothing_factor": 0.1}, "TrainingArguments.label_smoothing_factor"),
    # on CPU accelerate runs DDP whatever fsdp says (distributed_type MULTI_CPU): refused, not ignored
    ("fsdp", {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}, "TrainingArguments.fsdp"),
]


def test_refusals_before_the_first_step(ranks):
    """Each undeliverable declaration is one CPConfigError naming the field and the fix, raised on
    every rank by context_parallel (before trainer.train())."""
    cases = [(entry, extra) for _, extra, _ in REFUSALS for entry in ("trainer_flatten",)]
    cases += [("trainer_flatten", {"_collator": "unknown"}), ("trainer_flatten", {"_attn": "flash_attention_2"}),
              ("trainer_flatten", {"_plan": []}),
              # transformers' own TP, or FSDP2 over fewer ranks than launched, on a model sharded at load time
              ("trainer_flatten", {"_distributed_config": {"tp_size": 2}}),
              ("trainer_flatten", {"_distributed_config": {"fsdp_size": 1}}),
              # a loss of the user's (a function, an override), or GRPO's policy loss: it would see one shard
              ("trainer_flatten", {"_loss": "func"}), ("sft_packing", {"_loss": "func"}),
              ("trainer_flatten", {"_loss": "subclass"}), ("trainer_flatten", {"_loss": "rloo"})]
    expected = [field for _, _, field in REFUSALS] + ["Trainer.data_collator", "model.config.attn_implementation",
                                                       "plan_overrides", "from_pretrained(distributed_config).tp_size",
                                                       "from_pretrained(distributed_config).fsdp_size",
                                                       "Trainer.compute_loss_func", "Trainer.compute_loss_func",
                                                       "Trainer.compute_loss", "Trainer.compute_loss"]
    assert len(cases) == len(expected)
    results = ranks(2).run(W.refusal_cases, cases, timeout=300)
    for rank, messages in enumerate(results):
        for msg, field in zip(messages, expected):
            print(f"rank {rank}: {msg}")
            assert f"[{field}]" in msg and "Fix:" in msg, (field, msg)


# AdamW divides each gradient element by its running RMS: an element whose gradient nearly cancels
# (|g| ~ eps) turns a last-bit difference of the summation order into a visible update difference.
# Cases where that happens compare the parameters under SGD (the gradients themselves, at an lr that
# moves the parameters) and keep AdamW in the full matrix with its measured tolerance; transformers
# compared with itself under AdamW shows the same effect (test_adamw_amplifies_summation_order).
SGD = {"optim": "sgd", "learning_rate": 0.5}


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next"])
def test_sft_packing_independent_documents(ranks, arch):
    """SFTTrainer packing + completion-only on a model whose packed rows mean something else in
    plain transformers (gpt-oss: its mask ignores position_ids, so packed documents see each other;
    Qwen3-Next: the Gated DeltaNet's state crosses them, and transformers refuses the packed row on
    CPU): declared ``packed_documents="independent"``, the declared methods run at cp 1 as a CP group
    of one, so CP=2 == CP=1 with each packed document computed alone. Qwen3-Next under SGD (module
    note above): every parameter within 1e-5 of the largest (measured 4.3e-9); under AdamW see
    test_sft_packing_qwen3_next_adamw."""
    _compare(ranks, "sft_packing", arch, packed_documents="independent", **(SGD if arch == "qwen3_next" else {}))


@full_only
def test_sft_packing_qwen3_next_adamw(ranks):
    """The Qwen3-Next packed case under AdamW lr 1e-2: parameters 5e-5 of the largest — measured 2.8e-5
    in the Gated DeltaNet's ``in_proj_ba`` (near-zero gradients amplified by g / sqrt(v)); 2.9e-6 at lr
    1e-3; losses and the eval loss 8.6e-8."""
    _compare(ranks, "sft_packing", "qwen3_next", packed_documents="independent", param_tol=5e-5)


@full_only
def test_adamw_amplifies_summation_order(ranks):
    """The noise floor of the AdamW parameter comparison, without CP: the plain script on one rank with
    batch 2 x gradient accumulation 2 against batch 4 x 1 — the same rows, the same loss in exact
    math, another summation order. Its losses agree to fp32 rounding, yet its parameters after 5 AdamW
    steps at lr 1e-2 differ by more than 1e-5 of the largest (measured 2.7e-5, an embedding element
    whose gradient nearly cancels): below that floor a parameter comparison under AdamW measures the
    summation order, not CP. CP=2's difference on the same script is 2.0e-6
    (test_sft_packing_completion_only_llama)."""
    a = ranks(1).run(W.train_case, "sft_packing", "llama", 1, evaluate=False, timeout=300)[0]
    b = ranks(1).run(W.train_case, "sft_packing", "llama", 1, evaluate=False, timeout=300,
                     per_device_train_batch_size=4, gradient_accumulation_steps=1)[0]
    pmax = max(p.abs().max().item() for p in a["params"].values())
    diff, name = max(((a["params"][n] - b["params"][n]).abs().max().item(), n) for n in a["params"])
    loss_rel = max(abs(x - y) / abs(x) for x, y in zip(a["loss"], b["loss"]))
    print(f"one rank, batch 2 x GA 2 vs batch 4 x GA 1: losses max rel {loss_rel:.2e}, parameters "
          f"{diff / pmax:.2e} of the largest ({name})")
    assert loss_rel <= TOL and diff > TOL * pmax


@pytest.mark.parametrize("average", [True, False])
def test_sft_router_aux_loss_gpt_oss(ranks, average):
    """An MoE model with its router load-balancing loss on in TRL's SFTTrainer (router_aux_loss_coef,
    here 0.1 so that it moves the parameters visibly): at cp 2 the aux is computed over the CP group's
    whole micro-batch (the padding excluded, as transformers' attention_mask excludes it at cp 1), not
    per shard, with average_tokens_across_devices on and off; losses, the eval loss and the parameters
    equal cp 1's. SGD, so that the parameters compare the gradients: under AdamW one embedding row
    whose gradient is near zero differs by 1.2e-4 of the largest parameter after 5 steps (g / sqrt(v)
    amplifies a 5e-9 relative gradient difference), with every other parameter within 5e-7."""
    out = _compare(ranks, "sft_padded", "gpt_oss", router_aux_loss_coef=0.1, average_tokens_across_devices=average,
                   optim="sgd")
    assert all(r["aux"] for r in (out["ref"], out["got"]))


def test_router_aux_loss_outside_trl_is_refused(ranks):
    """The plain Trainer computes the aux inside the model, on the shard: refused at cp > 1, naming the field."""
    [msg] = ranks(2).run(W.refusal_cases, [("trainer_flatten", {"_moe_router": True})], timeout=300)[0]
    assert "[model.config.output_router_logits]" in msg and "SFTTrainer" in msg, msg
