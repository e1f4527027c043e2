"""The LM head as a tiled loss on real transformers classes: loss and every
gradient equal cross-entropy of the model's own logits (fp32, train(), dropout 0), including the
head post-processing transformers declares (Gemma2 softcap, Cohere logit_scale, Granite
logits_scaling) and tied embeddings; an unknown post-processing is detected by the probe."""
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.trainer.tiled_head import head_post, install_tiled_head, verify_tiled_head

IGN = -100
TOL = 2e-6     # fp32: same matmuls per chunk, fp32 reductions in another order

COMMON = dict(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa")


def _model(kind: str):
    import transformers as T

    torch.manual_seed(0)
    cfg = {"llama": lambda: T.LlamaConfig(**COMMON),
           "llama_tied": lambda: T.LlamaConfig(**COMMON, tie_word_embeddings=True),
           "gemma2": lambda: T.Gemma2Config(**{**COMMON, "attn_implementation": "eager"}, head_dim=8, final_logit_softcapping=2.0, sliding_window=64),
           "cohere": lambda: T.CohereConfig(**COMMON, logit_scale=0.25),
           "granite": lambda: T.GraniteConfig(**COMMON, logits_scaling=3.0)}[kind]()
    return T.AutoModelForCausalLM.from_config(cfg).float().train()


@pytest.mark.parametrize("kind,post", [("llama", {}), ("llama_tied", {}), ("gemma2", {"softcap": 2.0}),
                                       ("cohere", {"logit_scale": 0.25}), ("granite", {"logit_divisor": 3.0})])
def test_tiled_head_equals_model_logits_loss(kind, post):
    model = _model(kind)
    assert head_post(model) == post
    assert verify_tiled_head(model) is None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 211, (2, 40), generator=g)
    tgt = torch.randint(0, 211, (2, 40), generator=g)
    tgt[:, ::7] = IGN
    ref_loss = F.cross_entropy(model(input_ids=ids).logits.float().reshape(-1, 211), tgt.reshape(-1),
                               ignore_index=IGN, reduction="sum")
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    head = install_tiled_head(model, chunk_size=13, ignore_index=IGN)
    with head.targets(tgt):
        out = model(input_ids=ids)
        loss = head.loss_sum(out.logits)
    assert out.logits.shape == (2, 40, 0)
    loss.backward()
    gmax = max(g.abs().max().item() for g in ref.values())
    gerr, worst = max(((p.grad - ref[n]).abs().max().item(), n) for n, p in model.named_parameters())
    lerr = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    print(f"{kind}: loss rel {lerr:.2e}; grads max abs {gerr:.2e} rel(largest grad) {gerr / gmax:.2e} [{worst}] "
          f"(tol {TOL:g})")
    assert lerr <= TOL and gerr / gmax <= TOL
    head.remove()
    assert model(input_ids=ids).logits.shape == (2, 40, 211), "removed: the original head again"


def test_unknown_head_post_processing_is_detected():
    import transformers as T

    class ScaledLlama(T.LlamaForCausalLM):       # a head transformers does not declare in the config
        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            out.logits = out.logits * 1.01
            return out

    torch.manual_seed(0)
    model = ScaledLlama(T.LlamaConfig(**COMMON)).train()
    reason = verify_tiled_head(model)
    print(reason)
    assert reason is not None and "ScaledLlama's logits differ from its lm_head output" in reason
    assert "forward" not in model.lm_head.__dict__, "the probe leaves the model unchanged"


# ---------------------------------------------------------------------------- the trainer
def _losses_tiled_vs_untiled(cfg: dict) -> dict:
    import copy

    from tests.trainer import _workers as TW

    out = {}
    for tiled in (True, False):
        c = copy.deepcopy(cfg)
        c["loss"] = {"tiled": tiled, "chunk_size": 24}
        c["logging"]["out_dir"] += f"_{tiled}"
        out[tiled] = TW.train_losses(c)["losses"]
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    c = copy.deepcopy(cfg)
    c["schedule"]["steps"] = 1
    trainer = TextTrainer(TrainerConfig.from_dict(c))
    res = trainer.train()
    out["head"] = trainer.tiled_head is not None
    out["record"] = res[0].record()
    return out


@pytest.mark.parametrize("world,kw", [
    (2, dict(cp=2, ga=2, ac=True)),                       # FSDP2 over cp, grad accumulation, activation ckpt
    (4, dict(cp=2, tp=2)),                                # TP + CP (Colossal)
])
def test_trainer_tiled_loss_equals_untiled(ranks, tmp_path, world, kw):
    """The trainer's losses with loss.tiled (default) equal the untiled loss step for step; every
    step record carries every rank's peak memory and peak tensor storage."""
    from tests.trainer import _workers as TW

    cfg = TW.make_cfg("llama", steps=3, out_dir=str(tmp_path / "run"), **kw)
    res = ranks(world).run(_losses_tiled_vs_untiled, cfg, timeout=600.0)
    for r in res:
        print("tiled", r[True], "untiled", r[False], "record", r["record"])
        assert r["head"], "the tiled head is installed by default"
        for a, b in zip(r[True], r[False]):
            assert abs(a - b) <= 1e-5 * abs(b), (r[True], r[False])
        peaks = r["record"]["peak_mem_gb_per_rank"]
        assert len(peaks) == world and all(p > 0.05 for p in peaks) and r["record"]["peak_mem_gb"] == max(peaks)
        # CPU: the counting allocator's tensor peak is there too, positive and inside the resident set
        tensor = r["record"]["peak_tensor_gb_per_rank"]
        assert len(tensor) == world and all(0 < t < p for t, p in zip(tensor, peaks)), (tensor, peaks)


# ---------------------------------------------------------------------------- the tiled MLP in the trainer
def _losses_tiled_mlp(cfg: dict) -> dict:
    import copy

    from tests.trainer import _workers as TW

    out = {}
    for tiled in (True, False):
        c = copy.deepcopy(cfg)
        c["schedule"].update(tiled_mlp=tiled, tiled_mlp_chunk_size=8)
        c["logging"]["out_dir"] += f"_mlp{tiled}"
        out[tiled] = TW.train_losses(c)["losses"]
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    from hyper_parallel.ops import tiled_mlp as T

    calls = {"forward": 0, "backward": 0}
    fwd, bwd = T._TiledMLP.forward, T._TiledMLP.backward

    def counted(kind, fn):
        def run(*a):
            calls[kind] += 1
            return fn(*a)
        return staticmethod(run)

    T._TiledMLP.forward, T._TiledMLP.backward = counted("forward", fwd), counted("backward", bwd)
    try:
        c = copy.deepcopy(cfg)
        c["schedule"].update(tiled_mlp=True, tiled_mlp_chunk_size=8, steps=1)
        trainer = TextTrainer(TrainerConfig.from_dict(c))
        trainer.train()
    finally:
        T._TiledMLP.forward, T._TiledMLP.backward = staticmethod(fwd), staticmethod(bwd)
    out["installed"], out["calls"] = trainer.tiled_mlp, calls
    return out


def test_trainer_tiled_mlp_equals_untiled(ranks, tmp_path):
    """schedule.tiled_mlp under CP=2 + FSDP2 + grad accumulation + activation checkpointing: every
    step's loss (so every optimizer step) equals the run without it (32 local tokens = 4 chunks)."""
    from tests.trainer import _workers as TW

    cfg = TW.make_cfg("llama", steps=3, out_dir=str(tmp_path / "run"), cp=2, ga=2, ac=True)
    for r in ranks(2).run(_losses_tiled_mlp, cfg, timeout=600.0):
        print("tiled MLP", r[True], "untiled", r[False], "installed", r["installed"])
        assert r["installed"] and all(n.endswith(".mlp") for n in r["installed"])
        # one step: 2 layers x 2 micro-batches, forward run twice under activation checkpointing (plus the
        # CP preflight proof's forwards), backward once per layer and micro-batch
        assert r["calls"]["forward"] >= 8 and r["calls"]["backward"] == 4, r["calls"]
        for a, b in zip(r[True], r[False]):
            assert abs(a - b) <= 1e-5 * abs(b), (r[True], r[False])
