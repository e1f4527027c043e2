"""The tiled MLP (activation memory per rank) on real transformers MLP classes: output, d input and every
parameter gradient equal the untiled module (fp32, float64), whatever the chunk boundaries; the
trainer's install tiles exactly the dense MLPs of the decoder layers and refuses what it cannot
tile exactly (MoE blocks, a module that mixes tokens, TP)."""
import pytest
import torch
import torch.nn as nn

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.ops.tiled_mlp import tiled_mlp
from hyper_parallel.trainer.tiled_mlp import install_tiled_mlp

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa")


def _grads(module, x, dy, fn):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = fn(module, x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("cls,dtype,tol", [("LlamaMLP", torch.float32, 2e-6), ("Qwen3MLP", torch.float64, 1e-13),
                                           ("Gemma2MLP", torch.float32, 2e-6)])
@pytest.mark.parametrize("chunk", [1, 16])
def test_tiled_mlp_equals_module(cls, dtype, tol, chunk):
    import transformers as T

    cfg_cls = {"LlamaMLP": T.LlamaConfig, "Qwen3MLP": T.Qwen3Config, "Gemma2MLP": T.Gemma2Config}[cls]
    mod = __import__(f"transformers.models.{cls[:-3].lower()}.modeling_{cls[:-3].lower()}", fromlist=[cls])
    torch.manual_seed(0)
    mlp = getattr(mod, cls)(cfg_cls(**COMMON)).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 32, generator=g, dtype=dtype)
    dy = torch.randn(2, 37, 32, generator=g, dtype=dtype)
    y0, dx0, gp0 = _grads(mlp, x, dy, lambda m, t: m(t))
    y1, dx1, gp1 = _grads(mlp, x, dy, lambda m, t: tiled_mlp(m.forward, t, list(m.parameters()), chunk_size=chunk))
    gmax = max(v.abs().max().item() for v in gp0.values())
    yerr = (y1 - y0).abs().max().item() / y0.abs().max().item()
    dxerr = (dx1 - dx0).abs().max().item() / dx0.abs().max().item()
    perr = max((gp1[n] - gp0[n]).abs().max().item() for n in gp0) / gmax
    print(f"{cls} {dtype} chunk {chunk}: out rel {yerr:.2e}; dx rel {dxerr:.2e}; param grads rel(largest) "
          f"{perr:.2e} (tol {tol:g})")
    assert yerr <= tol and dxerr <= tol and perr <= tol


def test_saves_only_the_input():
    """Autograd keeps x and the parameters, not the [B, S, intermediate] activations."""
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(T.LlamaConfig(**COMMON))
    x = torch.randn(1, 64, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        tiled_mlp(mlp.forward, x, list(mlp.parameters()), chunk_size=16)
    assert (1, 64, 32) in saved and not any(88 in s and 64 in s for s in saved), saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        mlp(x)
    assert any(s == (1, 64, 88) for s in saved), "the untiled MLP saves its intermediates (control)"


def _llama():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).train()


def test_install_on_a_model_keeps_loss_and_every_gradient():
    ids = torch.randint(0, 97, (2, 45), generator=torch.Generator().manual_seed(2))
    ref_model, model = _llama(), _llama()
    ref_model(input_ids=ids, labels=ids).loss.backward()
    names = install_tiled_mlp(model, chunk_size=8)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = dict(ref_model.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.values())
    err = max((p.grad - ref[n].grad).abs().max().item() for n, p in model.named_parameters()) / gmax
    print(f"installed tiled MLP: loss diff {abs(loss.item() - ref_model(input_ids=ids, labels=ids).loss.item()):.2e};"
          f" grads rel(largest) {err:.2e} (tol 2e-6)")
    assert err <= 2e-6


def test_install_refuses_what_it_cannot_tile_exactly():
    import transformers as T

    with pytest.raises(CPConfigError, match="schedule.tiled_mlp.*tensor parallelism"):
        install_tiled_mlp(_llama(), 8, tp_size=2)
    moe = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=16, decoder_sparse_step=1))
    with pytest.raises(CPConfigError, match=r"model\.layers\.0\.mlp \(Qwen3MoeSparseMoeBlock\) is not a dense"):
        install_tiled_mlp(moe, 8)
    mixing = _llama()

    class CumsumMLP(nn.Module):          # named like an MLP, but mixes tokens: the probe must see it
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).cumsum(dim=1)

    for layer in mixing.model.layers:
        layer.mlp = CumsumMLP(layer.mlp)
    with pytest.raises(CPConfigError, match="CumsumMLP.*not token-wise"):
        install_tiled_mlp(mixing, 8)


def test_install_probes_a_meta_built_model():
    """A model built on the meta device (the trainer's build) is probed on a CPU copy of each MLP class."""
    import transformers as T

    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    assert install_tiled_mlp(model, 8) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(p.device.type == "meta" for p in model.parameters()), "the model itself stays on meta"
