"""The probe input (:func:`probe_length`, :func:`probe_batch`) and the small helpers that read
tensors out of module inputs/outputs and attributes off the model. Local: no collective."""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import CPConfigError
from .report import OPT_OUT

log = logging.getLogger("hyper_parallel.cp.proof")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for x in obj:
            t = _first_tensor(x)
            if t is not None:
                return t
        return None
    if isinstance(obj, dict):   # ModelOutput / BaseModelOutput
        for key in ("logits", "last_hidden_state", "hidden_states"):
            if isinstance(obj.get(key), torch.Tensor):
                return obj[key]
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _hidden_in(args, kwargs) -> Optional[torch.Tensor]:
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t


def _seq_shaped(t, B: int, S: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == B and t.shape[1] == S


def _model_config(model: nn.Module):
    return getattr(model, "config", None)


def _cfg_int(cfg, name: str) -> Optional[int]:
    if cfg is None:
        return None
    vals = []
    for c in (cfg, getattr(cfg, "text_config", None)):
        v = getattr(c, name, None) if c is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            vals.append(v)
    return max(vals) if vals else None


def _vocab(model: nn.Module) -> int:
    v = _cfg_int(_model_config(model), "vocab_size")
    if v is None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        v = getattr(emb, "num_embeddings", None)
    if not v:
        raise CPConfigError("accelerator.cp_preflight_proof", f"cannot find the vocabulary size of "
                            f"{type(model).__name__} to build the probe input",
                            fix=f"give the model a config.vocab_size, or set {OPT_OUT}")
    return int(v)


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if hasattr(p, "_local_tensor"):
            return p._local_tensor.device
        return p.device
    return torch.device("cpu")


def probe_length(model: nn.Module, multiple: int, cp_size: int, *, seq_len: Optional[int] = None,
                 max_seq_len: int = 4096) -> int:
    """Probe S: a multiple of ``multiple``, >= 16 tokens per rank, > a config ``sliding_window``."""
    cfg = _model_config(model)
    if seq_len is None:
        want = max(16 * cp_size, 64)
        window = _cfg_int(cfg, "sliding_window")
        if window is not None:
            want = max(want, window + max(16, window // 4))
        want = min(want, max_seq_len)
        if window is not None and want <= window:
            log.warning("CP preflight proof: probe length %d does not exceed sliding_window=%d (max_seq_len cap); "
                        "the window is not exercised", want, window)
    else:
        want = int(seq_len)
    S = -(-want // multiple) * multiple
    limit = _cfg_int(cfg, "max_position_embeddings")
    if limit is not None and S > limit:
        S = max(multiple, (limit // multiple) * multiple)
    return S


def probe_batch(S: int, vocab: int, *, packed: bool, seed: int = 0, pad_token_id: int = 0):
    """(global batch dict, documents [(row, start, length)]) of the probe (CPU tensors)."""
    g = torch.Generator().manual_seed(1234 + seed)
    packed = packed and S >= 24          # three documents of >= 1 token and 2 padding tokens
    rows = 3 if packed else 2
    ids = torch.randint(0, vocab, (rows, S), generator=g)
    pad = max(1, S // 5)
    mask = torch.ones(rows, S, dtype=torch.int64)
    mask[1, S - pad:] = 0
    ids[1, S - pad:] = pad_token_id
    docs = [(0, 0, S), (1, 0, S - pad)]
    batch = {"input_ids": ids, "attention_mask": mask}
    if packed:
        a = S // 2 - 3                      # ends just before a cp=2 shard edge
        b = S // 4 + 5                      # crosses it
        c = S - a - b - 2                   # 2 padding tokens at the end
        lens = torch.tensor([[S, 0, 0], [S - pad, 0, 0], [a, b, c]], dtype=torch.int64)
        batch["seq_lens"] = lens
        mask[2, a + b + c:] = 0
        ids[2, a + b + c:] = pad_token_id
        docs += [(2, 0, a), (2, a, b), (2, a + b, c)]
    return batch, docs


def _call_kwargs(model: nn.Module, **kw) -> dict:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kw
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in kw.items() if k in params or var_kw or k in ("input_ids",)}
