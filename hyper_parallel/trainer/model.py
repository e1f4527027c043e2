"""HyperAutoModel: a real ``transformers`` causal LM from a small config or a local directory.

Nothing is downloaded: ``model.architecture`` + ``model.config`` (or ``config_file``) build a
randomly initialized model with a fixed seed; ``model.path`` loads a local checkpoint dir.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from ..distributed.errors import CPConfigError
from .config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    """``path`` as given if it exists, else relative to the repository root (examples/...)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    alt = REPO_ROOT / p
    return alt if alt.exists() else p


def _hf_config_kwargs(cfg: ModelConfig) -> dict:
    kwargs = dict(cfg.config or {})
    if cfg.config_file:
        path = resolve_path(cfg.config_file)
        if not path.exists():
            raise CPConfigError("model.config_file", f"{path} does not exist")
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        kwargs = {**loaded, **kwargs}
    return kwargs


class HyperAutoModel:
    """Factory for HF causal LMs (``HyperAutoModel.from_config(ModelConfig)``)."""

    @staticmethod
    def from_config(cfg: ModelConfig):
        import transformers

        if cfg.dtype not in _DTYPES:
            raise CPConfigError("model.dtype", f"unknown dtype {cfg.dtype!r}", fix=f"use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[cfg.dtype]
        if cfg.path:
            path = Path(cfg.path)
            if not path.is_dir():
                raise CPConfigError("model.path", f"{path} is not a local checkpoint directory")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, attn_implementation=cfg.attn_implementation, dtype=dtype)
            return _for_training(model)
        if not cfg.architecture:
            raise CPConfigError("model.architecture", "is required when model.path is not given",
                                fix="set e.g. architecture: llama with a small config")
        try:
            hf_cfg = transformers.AutoConfig.for_model(cfg.architecture, **_hf_config_kwargs(cfg))
        except ValueError as exc:
            raise CPConfigError("model.architecture", str(exc)) from exc
        hf_cfg._attn_implementation = cfg.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=cfg.attn_implementation)
        return _for_training(model.to(dtype))

    @staticmethod
    def save_pretrained(model, path: str | Path) -> None:
        """Write an HF checkpoint directory loadable through ``model.path`` (full tensors)."""
        model.save_pretrained(str(path), safe_serialization=True)


def _for_training(model):
    # training never uses the KV cache (CP rejects past_key_values / use_cache)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    model.train()
    return model


def build_model(cfg: ModelConfig):
    return HyperAutoModel.from_config(cfg)
