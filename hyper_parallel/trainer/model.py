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


def _hf_config_kwargs(cfg: ModelConfig) -> dict:
    kwargs = dict(cfg.config or {})
    if cfg.config_file:
        path = Path(cfg.config_file)
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
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, attn_implementation=cfg.attn_implementation, dtype=dtype)
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
        return model.to(dtype)


def build_model(cfg: ModelConfig):
    return HyperAutoModel.from_config(cfg)
