"""Rank functions of the HF / TRL integration tests (module-level: the warm gloo pool runs them).

:func:`train_case` runs one unchanged HF script — a tiny random fp32 model built from its config,
a pre-tokenized in-memory dataset, ``Trainer`` or TRL ``SFTTrainer`` — for a few optimizer steps
with gradient accumulation, with ``context_parallel(trainer, cp, PLAN)`` added, and returns the
logged per-step losses, the eval loss, the learning rates and (rank 0) every parameter after the
steps. Run on a pool of ``cp`` ranks; ``cp = 1`` is the plain script (the reference).
"""
from __future__ import annotations

import os
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "data", "stdlib_tokenizer")
VOCAB = 256

ATTN = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
PLANS = {
    "llama": [{**ATTN, "inner_wrapper": "sdpa_hf"}],
    "llama_ulysses": [{**ATTN, "inner_wrapper": "sdpa_hf_ulysses"}],
    "llama_balanced": [{**ATTN, "inner_wrapper": "sdpa_hf_balanced"}],     # rows permuted across ranks
    "gpt_oss": [{**ATTN, "inner_wrapper": "sdpa_hf"}],
    "qwen3_next": [{**ATTN, "inner_wrapper": "sdpa_hf_ulysses"},
                   {**ATTN, "match": "*.linear_attn", "inner_wrapper": "gated_deltanet_ulysses"}],
}


def _dist_env() -> None:
    """What torchrun would export, for accelerate's PartialState (the pool's group is already up)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29555"))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def model_config(arch: str):
    import transformers as T

    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False)
    if arch.startswith("llama"):
        return T.LlamaConfig(**c)
    if arch == "gpt_oss":
        return T.GptOssConfig(**dict(c, sliding_window=12, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"]))
    if arch == "qwen3_next":
        return T.Qwen3NextConfig(**dict(c, num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
                                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                        layer_types=["linear_attention"] * 3 + ["full_attention"]))
    raise ValueError(arch)


def build_model(arch: str, fsdp_dir: str | None = None, vocab_size: int | None = None):
    """The tiny random model of ``arch`` (``vocab_size``: another vocabulary than :data:`VOCAB`); with
    ``fsdp_dir`` (and more than one rank) it is saved there and loaded back as a user loads a checkpoint
    sharded by transformers' own FSDP2: ``from_pretrained(..., distributed_config=DistributedConfig(
    fsdp_size=world))``."""
    import transformers as T

    torch.manual_seed(0)
    cfg = model_config(arch)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    cfg._attn_implementation = "eager" if arch == "gpt_oss" else "sdpa"   # transformers refuses SDPA with sinks
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    for m in model.modules():          # gpt-oss: default init leaves the sinks at 0; make them matter per head
        if hasattr(m, "sinks"):
            m.sinks.data.copy_(torch.linspace(-1.0, 1.5, m.sinks.numel()))
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if fsdp_dir is None or world == 1:
        return model
    from transformers.distributed import DistributedConfig

    src = os.path.join(fsdp_dir, "model")
    if dist.get_rank() == 0:
        model.save_pretrained(src)
    dist.barrier()
    return T.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation=cfg._attn_implementation,
                                                  distributed_config=DistributedConfig(fsdp_size=world)).train()


def param_gap(ref: dict, got: dict) -> tuple:
    """``(largest |parameter| of ref, max |ref - got| over every parameter, the worst one's name, the
    largest update of ref from its initial parameters)`` of two runs' reports (``params`` / ``init``)."""
    pmax = max(p.abs().max().item() for p in ref["params"].values())
    gap, worst = max(((ref["params"][n] - got["params"][n]).abs().max().item(), n) for n in ref["params"])
    moved = max((ref["params"][n] - ref["init"][n]).abs().max().item() for n in ref["params"])
    return pmax, gap, worst, moved


def full_params(model) -> dict:
    """Every parameter of ``model`` as a plain tensor (a DTensor shard gathered: a collective, every rank)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def examples(n: int, seed: int, *, completion_mask: bool = True, labels: bool = False):
    """``n`` prompt+completion rows of 6..40 random ids; ``completion_mask`` (TRL) or ``labels``
    with -100 on the prompt (transformers)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 41, (1,), generator=g))
        prompt = int(torch.randint(2, length - 2, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        row = {"input_ids": ids}
        if completion_mask:
            row["completion_mask"] = [0] * prompt + [1] * (length - prompt)
        if labels:
            row["labels"] = [-100] * prompt + ids[prompt:]
        rows.append(row)
    return rows


class _Losses:
    """A TrainerCallback recording every logged training loss, eval loss and learning rate."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Rec(TrainerCallback):
            def __init__(self):
                self.loss, self.eval_loss, self.lr, self.grad_norm = [], [], [], []
                self.metrics = {"entropy": [], "mean_token_accuracy": [], "num_tokens": []}   # TRL's

            def on_log(self, args, state, control, logs=None, **kwargs):
                logs = logs or {}
                if "loss" in logs:
                    self.loss.append(float(logs["loss"]))
                    self.lr.append(float(logs.get("learning_rate", float("nan"))))
                    self.grad_norm.append(float(logs.get("grad_norm", float("nan"))))
                    for key, values in self.metrics.items():
                        if key in logs:
                            values.append(float(logs[key]))
                if "eval_loss" in logs:
                    self.eval_loss.append(float(logs["eval_loss"]))

        return Rec()


def _common_args(out: str, steps: int, **extra) -> dict:
    args = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no", bf16=False, fp16=False)
    args.update(extra)
    return args


def build_trainer(entry: str, arch: str, out: str, steps: int, fsdp_dir: str | None = None, **extra):
    """The user's script, before ``context_parallel``: one of 'sft_packing' (TRL SFTTrainer,
    packing + padding-free, completion-only), 'sft_padded' (no packing: padded rows with a mask),
    'sft_lora' (packing + LoRA on attention and MLP), 'trainer_flatten' (transformers Trainer +
    DataCollatorWithFlattening, labels -100 on prompts). ``fsdp_dir``: :func:`build_model`'s."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    model = build_model(arch, fsdp_dir)
    rec = _Losses()
    if entry == "trainer_flatten":
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

        train = Dataset.from_list(examples(48, 1, completion_mask=False, labels=True))
        evald = Dataset.from_list(examples(8, 2, completion_mask=False, labels=True))
        args = TrainingArguments(**_common_args(out, steps, **extra))
        trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evald,
                          data_collator=DataCollatorWithFlattening(), callbacks=[rec])
        return trainer, rec
    from trl import SFTConfig, SFTTrainer

    train = Dataset.from_list(examples(96, 1))
    evald = Dataset.from_list(examples(8, 2))
    packing = entry in ("sft_packing", "sft_lora")
    if arch in ("gpt_oss", "qwen3_next"):   # MoE: TRL turns the router aux loss on, refused under CP
        extra.setdefault("router_aux_loss_coef", 0.0)
    args = SFTConfig(**_common_args(out, steps, packing=packing, max_length=64, completion_only_loss=True,
                                    dataset_num_proc=None, **extra))
    peft_config = None
    if entry == "sft_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evald, processing_class=tok,
                         peft_config=peft_config, callbacks=[rec])
    return trainer, rec


def train_case(entry: str, arch: str, cp: int, steps: int = 5, params: bool = True, evaluate: bool = True,
               plan: str | None = None, save_dir: str | None = None, packed_documents: str | None = None,
               fsdp_dir: str | None = None, **extra) -> dict:
    """Train ``steps`` optimizer steps at CP degree ``cp`` (the pool's size) and report (module doc).
    ``plan``: a key of PLANS (default: ``arch``). ``save_dir``: after training, the Trainer's
    ``save_model`` writes the model (LoRA: the adapter) to ``save_dir/model`` and rank 0 writes the
    merged LoRA model to ``save_dir/merged``. ``fsdp_dir``: the model is loaded sharded by transformers'
    FSDP2 (:func:`build_model`)."""
    from hyper_parallel.integrations.hf import context_parallel

    _dist_env()
    with tempfile.TemporaryDirectory() as out:
        trainer, rec = build_trainer(entry, arch, out, steps, fsdp_dir=fsdp_dir, **extra)
        init = full_params(trainer.model)
        sharded = sorted({type(p).__name__ for p in trainer.model.parameters()})     # as loaded
        context_parallel(trainer, cp_size=cp, plan_overrides=PLANS[plan or arch], packed_documents=packed_documents)
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"] if evaluate else None
        model = trainer.model
        result = {"loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm, "eval_loss": eval_loss,
                  "aux": getattr(getattr(model, "config", None), "output_router_logits", None) or None,
                  "metrics": rec.metrics,
                  "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
                  "sharded": sharded}
        final = full_params(model) if params else None
        if params and trainer.args.process_index == 0:
            result["params"] = final
            result["init"] = init
        if save_dir is not None:
            trainer.save_model(os.path.join(save_dir, "model"))
            if entry == "sft_lora" and trainer.args.process_index == 0:
                merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
                merged.save_pretrained(os.path.join(save_dir, "merged"))
    return result


def eval_batches(entry: str):
    """The eval rows of ``entry`` collated as the CP=1 Trainer's eval loop sees them (batch 2, in order)."""
    if entry != "trainer_flatten" and entry != "sft_lora_padded":
        raise ValueError(entry)
    from transformers import DataCollatorWithFlattening

    rows = examples(8, 2, completion_mask=False, labels=True)
    collate = DataCollatorWithFlattening()
    return [collate(rows[i:i + 2]) for i in range(0, len(rows), 2)]


def plain_eval_loss(model, entry: str) -> float:
    """Mean over the eval batches of the model's own loss (what Trainer.evaluate logs at CP=1, equal batches)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for b in eval_batches(entry):
            losses.append(float(model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                                      use_cache=False).loss))
    return sum(losses) / len(losses)


def grpo_reward(completions, **kwargs):
    """A reward that varies between the samples of one prompt: vowels minus a length cost."""
    return [sum(ch in "aeiou" for ch in c) - 0.05 * len(c) for c in completions]


def grpo_trainer(out: str, steps: int = 1, **extra):
    """A TRL GRPOTrainer on the tiny Llama: 16 short code prompts, 4 samples each, :func:`grpo_reward`;
    nothing downloaded."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    prompts = Dataset.from_list([{"prompt": f"def f{i}(x):\n    return x *"} for i in range(16)])
    grpo = {"num_generations": 4, "max_completion_length": 24}
    for key in ("num_generations", "max_completion_length", "num_iterations", "beta", "loss_type",
                "steps_per_generation", "scale_rewards"):
        if key in extra:
            grpo[key] = extra.pop(key)
    args = GRPOConfig(**_common_args(out, steps, **{"per_device_train_batch_size": 4, **extra}), **grpo)
    model = build_model("llama", vocab_size=len(tok))    # the prompts are text: the tokenizer's ids
    if grpo.get("beta"):             # TRL loads the reference model from the policy's path: give it one
        from safetensors.torch import save_file

        init = os.path.join(out, "init")          # this rank's own directory (save_pretrained writes on rank 0 only)
        os.makedirs(init)
        model.config.architectures = [type(model).__name__]
        model.config.to_json_file(os.path.join(init, "config.json"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(init, "model.safetensors"),
                  metadata={"format": "pt"})
        model.config._name_or_path = init
    return GRPOTrainer(model=model, reward_funcs=grpo_reward, args=args, train_dataset=prompts, processing_class=tok)


def grpo_case(cp: int, steps: int = 3, plan: str = "llama", **extra) -> dict:
    """GRPO for ``steps`` optimizer steps at CP degree ``cp`` (the pool's size / cp data-parallel groups;
    cp 1: the plain script): the logged losses, grad norms and rewards, the last generated completions
    (TRL's log keeps one generation batch), and (rank 0) the parameters. ``extra``: GRPOConfig fields."""
    from hyper_parallel.integrations.hf import context_parallel

    _dist_env()
    with tempfile.TemporaryDirectory() as out:
        trainer = grpo_trainer(out, steps, **{"warmup_steps": 0, **extra})   # step 1 already moves the policy
        rec = _Losses()
        trainer.add_callback(rec)
        rewards = []

        class Rewards(type(rec).__mro__[1]):      # TrainerCallback
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    rewards.append(float(logs["reward"]))

        trainer.add_callback(Rewards())
        init = full_params(trainer.model)
        context_parallel(trainer, cp_size=cp, plan_overrides=PLANS[plan])
        trainer.train()
        final = full_params(trainer.model)
        out_ = {"loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm, "reward": rewards,
                "completions": list(trainer._logs["completion"])}
        if trainer.args.process_index == 0:
            out_["params"], out_["init"] = final, init
    return out_


class _UnknownCollator:
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, features):
        return self.inner(features)


def refusal_cases(cases) -> list[str]:
    """For each ``(entry, extra)``: build the script (cp = the pool's size) with ``extra``
    TrainingArguments — or ``_collator`` / ``_attn`` / ``_plan`` / ``_moe_router`` / ``_distributed_config`` to
    swap the collator, the model's attention implementation or the declaration, set ``output_router_logits``,
    or mark the model as sharded at load time with that ``DistributedConfig``; ``_loss``: 'func' (a
    ``compute_loss_func``), 'subclass' / 'rloo' (an overridden ``compute_loss``, in a class so named) —
    call ``context_parallel`` and return the
    refusal's message ("no refusal" if none)."""
    import torch.distributed as dist

    from hyper_parallel.integrations.hf import context_parallel

    _dist_env()
    cp = dist.get_world_size()
    out_msgs = []
    for entry, extra in cases:
        extra = dict(extra)
        collator, attn, plan = extra.pop("_collator", None), extra.pop("_attn", None), extra.pop("_plan", None)
        router = extra.pop("_moe_router", False)
        sharded_as = extra.pop("_distributed_config", None)
        loss = extra.pop("_loss", None)
        with tempfile.TemporaryDirectory() as out:
            trainer, _ = build_trainer(entry, "llama", out, 1, **extra)
            if collator:
                trainer.data_collator = _UnknownCollator(trainer.data_collator)
            if attn:
                trainer.model.config._attn_implementation = attn
            if router:        # what an MoE config with its router loss on declares
                trainer.model.config.output_router_logits = True
            if loss == "func":           # a user's loss function on the model's outputs and the labels
                trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean()
            elif loss == "subclass":     # a Trainer subclass with its own compute_loss
                trainer.__class__ = type("MyTrainer", (type(trainer),), {
                    "compute_loss": lambda self, model, inputs, **kw: model(**inputs).logits.mean()})
            elif loss == "rloo":           # an RL trainer whose loss is not carried (GRPO's is)
                trainer.__class__ = type("RLOOTrainer", (type(trainer),), {
                    "compute_loss": lambda self, model, inputs, **kw: model(**inputs).logits.mean()})
            if sharded_as is not None:   # what from_pretrained(distributed_config=...) records on the model
                from transformers.distributed import DistributedConfig

                trainer.model.config.distributed_config = DistributedConfig(**sharded_as)
                trainer.model._is_distributed_loading_by_transformers = True
            try:
                context_parallel(trainer, cp_size=cp, plan_overrides=PLANS["llama"] if plan is None else plan)
                out_msgs.append("no refusal")
            except Exception as exc:  # noqa: BLE001 - the message is the result
                out_msgs.append(f"{type(exc).__name__}: {exc}")
    return out_msgs


def resume_case(entry: str, arch: str, cp: int, ckpt_dir: str, steps: int = 4, save_at: int = 2,
                resume: bool = False) -> dict:
    """The Trainer's own checkpoints under CP: without ``resume``, train ``steps`` steps saving a
    checkpoint every ``save_at`` steps into ``ckpt_dir`` (``save_strategy="steps"``); with it, a fresh
    script resumes from ``ckpt_dir/checkpoint-<save_at>`` and trains to ``steps``. Returns the logged
    losses and rank 0's parameters at the end."""
    from hyper_parallel.integrations.hf import context_parallel

    _dist_env()
    trainer, rec = build_trainer(entry, arch, ckpt_dir, steps, save_strategy="steps", save_steps=save_at,
                                 save_only_model=False)
    context_parallel(trainer, cp_size=cp, plan_overrides=PLANS[arch])
    trainer.train(resume_from_checkpoint=os.path.join(ckpt_dir, f"checkpoint-{save_at}") if resume else None)
    out = {"loss": rec.loss, "lr": rec.lr}
    if trainer.args.process_index == 0:
        out["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return out
