"""Exact tiled LM-head cross-entropy (no full-vocabulary logits held) against the untiled transformers-style path:
``F.cross_entropy(post(F.linear(h, W, b)).float(), reduction="none")`` with post = scale, divisor,
softcap in the logits' dtype. Fresh random data; loss and every gradient compared; max abs and
relative errors printed against the stated tolerance."""
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.ops import tiled_lm_loss

IGN = -100
# fp32: same math, chunked summation order only. bf16: the untiled path rounds the whole-logits
# matmul and its grads in bf16 once; the tiled path rounds per chunk, and accumulates dW in fp32.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _untiled(h, w, b, t, scale, divisor, softcap):
    x = F.linear(h, w, b)
    if scale is not None:
        x = x * scale
    if divisor is not None:
        x = x / divisor
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return F.cross_entropy(x.float(), t, ignore_index=IGN, reduction="none")


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("post", [dict(), dict(softcap=3.0), dict(scale=0.0625), dict(divisor=4.0),
                                  dict(scale=2.0, softcap=5.0)])
@pytest.mark.parametrize("chunk", [37, 4096])
def test_tiled_loss_equals_untiled(dtype, post, chunk):
    g = torch.Generator().manual_seed(hash((str(dtype), tuple(post.items()), chunk)) % 2**31)
    N, H, V = 301, 48, 257
    h0 = torch.randn(N, H, generator=g).to(dtype)
    w0 = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    b0 = (torch.randn(V, generator=g) * 0.1).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = IGN
    gout = torch.rand(N, generator=g)
    res = {}
    for name, fn in (("tiled", lambda h, w, b: tiled_lm_loss(h, w, b, t, ignore_index=IGN, chunk_size=chunk,
                                                             logit_scale=post.get("scale"),
                                                             logit_divisor=post.get("divisor"),
                                                             softcap=post.get("softcap"))),
                     ("ref", lambda h, w, b: _untiled(h, w, b, t, post.get("scale"), post.get("divisor"),
                                                      post.get("softcap")))):
        h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))
        loss = fn(h, w, b)
        (loss * gout).sum().backward()
        res[name] = (loss.detach(), h.grad, w.grad, b.grad)
    assert res["tiled"][0].dtype == torch.float32
    assert bool((res["tiled"][0][t == IGN] == 0).all())
    tol = TOL[dtype]
    for i, what in enumerate(("loss", "d hidden", "d weight", "d bias")):
        a, r = res["tiled"][i], res["ref"][i]
        assert a.dtype == r.dtype and a.shape == r.shape, what
        err = _rel(a, r)
        print(f"{dtype} {post} chunk={chunk} {what}: max abs {(a.float() - r.float()).abs().max().item():.2e} "
              f"rel {err:.2e} (tol {tol:g})")
        assert err <= tol, (what, err)


def test_tiled_loss_saves_no_logits():
    """Autograd keeps only hidden / weight / bias / targets: nothing of [N, V] size is saved."""
    N, H, V = 512, 16, 1000
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = tiled_lm_loss(h, w, None, torch.randint(0, V, (N,)), chunk_size=64)
    loss.sum().backward()
    print("saved:", saved)
    assert max(torch.Size(s).numel() for s in saved) == V * H, saved
    assert (N, V) not in saved and all(torch.Size(s).numel() < N * V for s in saved)


def test_tiled_loss_rejects_bad_shapes():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="targets"):
        tiled_lm_loss(h, w, None, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        tiled_lm_loss(h, torch.randn(10, 7), None, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        tiled_lm_loss(h, w, None, torch.zeros(4, dtype=torch.long), chunk_size=0)


@pytest.mark.parametrize("post", [dict(), dict(softcap=3.0)])
def test_tiled_loss_under_bf16_autocast(post):
    """fp32 hidden and weight under ``torch.autocast("cpu", bfloat16)`` (the mixed-precision trainer):
    the head matmul runs in bf16 in forward *and* in the tiled backward's recompute, and the loss and
    every gradient match the untiled path under the same autocast (bf16 tolerance), in fp32."""
    g = torch.Generator().manual_seed(11)
    N, H, V = 203, 32, 311
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5
    b0 = torch.randn(V, generator=g) * 0.1
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = IGN
    gout = torch.rand(N, generator=g)
    res = {}
    for name in ("tiled", "ref"):
        h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (tiled_lm_loss(h, w, b, t, ignore_index=IGN, chunk_size=50, softcap=post.get("softcap"))
                    if name == "tiled" else _untiled(h, w, b, t, None, None, post.get("softcap")))
        (loss * gout).sum().backward()          # outside the autocast region, as in a training loop
        res[name] = (loss.detach(), h.grad, w.grad, b.grad)
    exact = {}
    h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))      # fp32 without autocast
    (_untiled(h, w, b, t, None, None, post.get("softcap")) * gout).sum().backward()
    exact = (h.grad, w.grad, b.grad)
    for i, what in enumerate(("loss", "d hidden", "d weight", "d bias")):
        a, r = res["tiled"][i], res["ref"][i]
        assert a.dtype == r.dtype == torch.float32, (what, a.dtype, r.dtype)
        err = _rel(a, r)
        print(f"autocast bf16 {post} {what}: max abs {(a - r).abs().max().item():.2e} rel {err:.2e} (tol 2e-2)")
        assert err <= 2e-2, (what, err)
    # the recompute really runs in bf16: the tiled grads differ from fp32 math by bf16 rounding, as the untiled do
    for i, what in enumerate(("d hidden", "d weight", "d bias")):
        assert _rel(res["tiled"][i + 1], exact[i]) > 1e-4, (what, "backward recomputed in fp32, not under autocast")


def test_tiled_loss_holds_one_logits_chunk():
    """Counted by the C++ tensor accounting: the forward holds at most one fp32 ``[chunk, V]`` buffer
    beyond its output (the logsumexp runs in place), the backward at most one such buffer beyond the
    gradients it returns (softmax in place, ``d weight`` accumulated with ``addmm_``)."""
    from hyper_parallel.platform.host_memory import host_tensor_bytes, reset_host_tensor_peak, track_host_tensors

    N, H, V, chunk = 1024, 64, 16384, 128
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 8).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    gout = torch.rand(N, generator=g)
    buf, grads = chunk * V * 4, (V * H + N * H) * 4
    slack = buf // 16                                       # per-row vectors, the targets' masks
    was_on = bool(torch.ops.hyper_parallel.host_tensor_accounting_enabled())
    assert track_host_tensors("cpu")
    try:
        reset_host_tensor_peak()
        before = host_tensor_bytes()[0]
        loss = tiled_lm_loss(h, w, None, t, chunk_size=chunk)
        fwd = host_tensor_bytes()[1] - before
        reset_host_tensor_peak()
        before = host_tensor_bytes()[0]
        loss.backward(gout)
        bwd = host_tensor_bytes()[1] - before
    finally:
        if not was_on:
            torch.ops.hyper_parallel.host_tensor_accounting(False)
    print(f"tiled loss peak beyond its inputs: forward {fwd / 2**20:.2f} MiB, backward {bwd / 2**20:.2f} MiB "
          f"(one [chunk, V] fp32 buffer {buf / 2**20:.2f} MiB, the gradients {grads / 2**20:.2f} MiB)")
    assert fwd <= buf + slack, fwd
    assert bwd <= buf + grads + slack, bwd
