"""``short_conv_halo``: exact CP for LFM2's gated short convolution.

The halo exchange (:func:`..comm.halo_exchange`, shared with the state-passing methods' convs) puts
the previous CP rank's last ``h`` tokens in front of this rank's ``[B, L, H]``; the method runs the
module's own forward on ``[halo + local]`` and drops the halo outputs: exact because everything
around the causal depthwise conv of kernel ``k = h + 1`` is token-wise.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..comm import halo_exchange
from ..registry import inner_wrapper
from .families import FamilyRegistry
from .rows import CPMixerError, accepts, current_fqn, hidden_param, is_seq, mixer_call, require_class, run_rows

__all__ = ["HALO_FAMILIES", "halo_exchange", "conv_kernel", "short_conv_halo_cp_wrapper", "validate_short_conv_halo"]

#: classes whose forward is token-wise around one causal depthwise conv (LFM2's short conv and its kin),
#: registered by their families (``models/lfm2*/``)
HALO_FAMILIES = FamilyRegistry("short_conv_halo_cp_wrapper")


def conv_kernel(module: nn.Module) -> Optional[int]:
    conv = getattr(module, "conv", None)
    if isinstance(conv, nn.Conv1d):
        return int(conv.kernel_size[0])
    return None


def validate_short_conv_halo(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "short_conv_halo_cp_wrapper"
    classes = HALO_FAMILIES.classes()
    require_class(what, target_module, tp_size, classes,
                  "is exact only for a short convolution whose forward is token-wise around one causal depthwise "
                  f"conv ({', '.join(classes)})")
    cls = type(target_module).__name__
    conv, k = getattr(target_module, "conv", None), conv_kernel(target_module)
    if k is None or not all(hasattr(target_module, n) for n in ("in_proj", "out_proj")):
        raise ValueError(f"{what}: {cls} has no conv (nn.Conv1d) / in_proj / out_proj")
    if conv.groups != conv.in_channels or conv.padding[0] != k - 1 or conv.stride[0] != 1 or conv.dilation[0] != 1:
        raise ValueError(f"{what}: {cls}.conv is not a causal depthwise conv (groups={conv.groups}, "
                         f"channels={conv.in_channels}, padding={conv.padding}, stride={conv.stride}, "
                         f"dilation={conv.dilation}, kernel={k})")
    L_cache = getattr(target_module, "conv_kernel_size", k)
    if L_cache != k:
        raise ValueError(f"{what}: {cls}.conv_kernel_size={L_cache} but conv kernel is {k}")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_short_conv_halo)
def short_conv_halo_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Exact CP for LFM2's short convolution: halo exchange of the previous rank's last ``k - 1``
    input tokens, the module's own forward on ``[halo + local]``, halo outputs dropped."""
    del mesh, tp_mesh, ep_mesh
    what = "short_conv_halo_cp_wrapper"
    original = target_module.forward
    name = hidden_param(target_module)
    h = conv_kernel(target_module) - 1
    mask_param = accepts(target_module, "attention_mask")
    fqn = current_fqn()

    def forward(*args, **kwargs):
        entry = mixer_call(what, fqn, name, cp_mesh, args, kwargs)
        if entry is None or h == 0:
            return original(*args, **kwargs)
        meta, hs, rebuild, rest_args, rest_kwargs = entry
        B, L, _ = hs.shape
        if L < h:
            raise CPMixerError(f"{what} on '{fqn}': {L} tokens per CP rank < kernel - 1 = {h}: the halo would "
                               "span more than one rank; use longer sequences or fewer CP ranks")
        leaves = [x for x in tree_flatten((rest_args, rest_kwargs))[0] if is_seq(x, B, L)]
        if leaves:
            raise CPMixerError(f"{what} on '{fqn}': got a sequence-shaped argument {tuple(leaves[0].shape)} (e.g. a "
                               "local attention_mask); CP passes padding and documents through the CP batch meta — "
                               "call the model without attention_mask, or declare sequence_gather")
        ext = halo_exchange(hs, cp_mesh, h)                                               # [B, h + L, H]
        r = meta.cp_rank
        if meta.key_doc is None:
            if r == 0:      # no predecessor: the local tokens alone, as at CP=1 (still through ext: backward)
                return run_rows(original, rebuild, ext[:, h:], None, 0, L, rest_args, rest_kwargs,
                                 mask_param=mask_param, what=what, fqn=fqn)
            return run_rows(original, rebuild, ext, None, h, h + L, rest_args, rest_kwargs,
                             mask_param=mask_param, what=what, fqn=fqn)
        lo = r * L
        key_doc = meta.key_doc.to(hs.device)
        halo_doc = key_doc[:, lo - h:lo] if r > 0 else torch.full((B, h), -1, dtype=key_doc.dtype,
                                                                  device=key_doc.device)
        doc_ext = torch.cat([halo_doc, key_doc[:, lo:lo + L]], dim=1)
        return run_rows(original, rebuild, ext, doc_ext, h, h + L, rest_args, rest_kwargs,
                         mask_param=mask_param, what=what, fqn=fqn)

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    return forward
