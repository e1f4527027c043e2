"""``comm.relayout.Relayout`` copies its four index tensors to a device once per step's ``perm``
and device, not on every call (counted through the ``_to_device`` seam; one rank, group None)."""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel.comm import relayout as R


def test_index_tensors_go_to_the_device_once_per_step(monkeypatch):
    copies = []
    real = R._to_device
    monkeypatch.setattr(R, "_to_device", lambda t, device: copies.append(device) or real(t, device))
    torch.manual_seed(0)
    perm = torch.randperm(16)
    x = torch.randn(2, 16, 3)
    for layer in range(3):   # every mixer layer of one step, each moving there and back
        rl = R.Relayout.cached(perm, 0, 1, None)
        y = rl.to_contiguous(x)
        assert torch.equal(y, x[:, torch.argsort(perm)])   # contiguous: global token t at position t
        assert torch.equal(rl.to_permuted(y), x)
    print(f"host->device index copies after 3 layers x 2 calls: {len(copies)} (expected 4)")
    assert len(copies) == 4, copies
    R.Relayout.cached(torch.randperm(16), 0, 1, None).to_contiguous(x)   # the next step's perm: built again
    assert len(copies) == 8, copies
