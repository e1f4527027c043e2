"""TrainerConfig: the whole YAML file, every section checked, unknown keys rejected.

Top-level sections: ``model``, ``data``, ``optimizer``, ``schedule``, ``accelerator``,
``plan_overrides``, ``logging``. ``accelerator`` holds topology degrees only
(:class:`~hyper_parallel.distributed.config.AcceleratorConfig`); the CP method of each
attention is declared in ``plan_overrides``. See docs/yaml_schema.md.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..distributed.config import AcceleratorConfig
from ..distributed.errors import CPConfigError
from ..distributed.sharding_config import ModuleShardingSpec, parse_plan_overrides


def _section(cls, data: Mapping | None, field: str):
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CPConfigError(f"{field}.{unknown[0]}", f"unknown key(s) {unknown}",
                            fix=f"use only {sorted(known)} (check for typos)")
    return cls(**data)


@dataclasses.dataclass
class ModelConfig:
    """``architecture`` + ``config`` build a random-init HF model; ``path`` loads a local dir."""
    architecture: str | None = None   # llama | qwen3 | qwen3_moe (HF model_type)
    config: dict | None = None        # HF config kwargs (tiny random configs ship under examples/)
    config_file: str | None = None    # path to a YAML/JSON file holding the HF config kwargs
    path: str | None = None           # local checkpoint directory (from_pretrained, no download)
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    seed: int = 0


@dataclasses.dataclass
class DataConfig:
    path: str | None = None           # text file; byte-level tokens
    seq_len: int = 128
    micro_batch_size: int = 1
    min_doc_len: int | None = None    # shorter sequences -> padding (padding-heavy batches)
    pad_to_multiple: int | None = None
    seed: int = 0
    pad_token_id: int = 0             # byte 0 never occurs in text
    ignore_index: int = -100          # label value of tokens that carry no loss


@dataclasses.dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: Sequence[float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    foreach: bool | None = None       # torch.optim foreach implementation (None: torch default)


@dataclasses.dataclass
class ScheduleConfig:
    steps: int = 10
    warmup_steps: int = 0
    grad_accum_steps: int = 1
    seed: int = 0
    activation_checkpointing: bool = False
    mixed_precision: str | None = None   # None | "bf16"
    save_every: int | None = None
    resume_from: str | None = None
    lr_schedule: str = "constant"        # constant | cosine (after linear warmup)
    min_lr_ratio: float = 0.1            # cosine floor, as a fraction of optimizer.lr
    checkpoint_dir: str | None = None    # default: <logging.out_dir>/checkpoints


@dataclasses.dataclass
class LoggingConfig:
    out_dir: str = "runs/default"
    log_every: int = 1
    progress: bool = True
    plot: bool = True
    level: str = "INFO"
    json_log: str = "train_log.json"     # written under out_dir
    plot_file: str = "loss_curve.png"    # written under out_dir


MIXED_PRECISION = (None, "bf16")
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "sgd")


def _check_int(value, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CPConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


TOP_LEVEL = ("model", "data", "optimizer", "schedule", "accelerator", "plan_overrides", "logging")


@dataclasses.dataclass
class TrainerConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    accelerator: AcceleratorConfig = dataclasses.field(default_factory=AcceleratorConfig)
    plan_overrides: list = dataclasses.field(default_factory=list)  # list[ModuleShardingSpec]
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    source: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "TrainerConfig":
        if not isinstance(data, Mapping):
            raise CPConfigError("<root>", f"the YAML document must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(TOP_LEVEL))
        if unknown:
            raise CPConfigError(unknown[0], f"unknown top-level key(s) {unknown}",
                                fix=f"use only {list(TOP_LEVEL)} (check for typos)")
        return cls(
            model=_section(ModelConfig, data.get("model"), "model"),
            data=_section(DataConfig, data.get("data"), "data"),
            optimizer=_section(OptimizerConfig, data.get("optimizer"), "optimizer"),
            schedule=_section(ScheduleConfig, data.get("schedule"), "schedule"),
            accelerator=AcceleratorConfig.from_dict(data.get("accelerator")),
            plan_overrides=parse_plan_overrides(data.get("plan_overrides")),
            logging=_section(LoggingConfig, data.get("logging"), "logging"),
            source=source,
        ).validate()

    def validate(self) -> "TrainerConfig":
        """Value checks for the trainer-owned sections (accelerator/plan_overrides check themselves)."""
        _check_int(self.data.seq_len, "data.seq_len", 2)
        _check_int(self.data.micro_batch_size, "data.micro_batch_size", 1)
        if self.data.min_doc_len is not None:
            _check_int(self.data.min_doc_len, "data.min_doc_len", 2)
            if self.data.min_doc_len > self.data.seq_len:
                raise CPConfigError("data.min_doc_len", f"{self.data.min_doc_len} exceeds data.seq_len="
                                    f"{self.data.seq_len}", fix="use min_doc_len <= seq_len")
        if self.data.pad_to_multiple is not None:
            _check_int(self.data.pad_to_multiple, "data.pad_to_multiple", 1)
        _check_int(self.schedule.steps, "schedule.steps", 0)
        _check_int(self.schedule.warmup_steps, "schedule.warmup_steps", 0)
        _check_int(self.schedule.grad_accum_steps, "schedule.grad_accum_steps", 1)
        if self.schedule.save_every is not None:
            _check_int(self.schedule.save_every, "schedule.save_every", 1)
        if self.schedule.mixed_precision not in MIXED_PRECISION:
            raise CPConfigError("schedule.mixed_precision", f"unknown value {self.schedule.mixed_precision!r}",
                                fix="use bf16 or omit it (fp32)")
        if self.schedule.lr_schedule not in LR_SCHEDULES:
            raise CPConfigError("schedule.lr_schedule", f"unknown value {self.schedule.lr_schedule!r}",
                                fix=f"use one of {list(LR_SCHEDULES)}")
        if self.optimizer.name.lower() not in OPTIMIZERS:
            raise CPConfigError("optimizer.name", f"unknown optimizer {self.optimizer.name!r}",
                                fix=f"use one of {list(OPTIMIZERS)}")
        if self.optimizer.grad_clip is not None and not self.optimizer.grad_clip > 0:
            raise CPConfigError("optimizer.grad_clip", f"must be > 0 or null, got {self.optimizer.grad_clip!r}")
        if len(tuple(self.optimizer.betas)) != 2:
            raise CPConfigError("optimizer.betas", f"must be two numbers, got {self.optimizer.betas!r}")
        _check_int(self.logging.log_every, "logging.log_every", 1)
        return self

    def to_dict(self) -> dict:
        """Plain-data view (JSON-able) for logs and checkpoint metadata."""
        out = {}
        for name in ("model", "data", "optimizer", "schedule", "accelerator", "logging"):
            out[name] = dataclasses.asdict(getattr(self, name))
        out["optimizer"]["betas"] = list(out["optimizer"]["betas"])
        out["plan_overrides"] = [
            {"match": s.match, "when": s.when, "inner_target": s.inner_target,
             "region_dispatch": s.region_dispatch,
             "inner_wrapper": s.inner_wrapper.describe() if s.inner_wrapper is not None else None,
             "local_compute_fn": s.local_compute_fn.describe() if s.local_compute_fn is not None else None}
            for s in self.plan_overrides
        ]
        return out

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = ()) -> "TrainerConfig":
        path = Path(path)
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        data = apply_overrides(data, overrides)
        return cls.from_dict(data, source=str(path))


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``dotted.key=value`` overrides (value parsed as YAML) to a nested dict."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise CPConfigError(item, "override must look like key.path=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            nxt = dict(nxt) if isinstance(nxt, Mapping) else {}
            node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return data
