"""TrainerConfig: the typed schema of the whole YAML file and its one validating loader.

Top-level sections: ``model``, ``data``, ``optimizer``, ``schedule``, ``loss``, ``accelerator``,
``plan_overrides``, ``logging``. Every field is declared once below with
:func:`~hyper_parallel.distributed.config_schema.option` — its type, default, bounds, choices
and help text — and that declaration is the single source of the YAML fields: the loader checks
against it, ``hyper-train --help`` prints it, and the field reference in docs/trainer.md is
generated from it (``python -m hyper_parallel.trainer.field_docs --write-docs``; a test fails when
they drift). ``accelerator`` is :class:`~hyper_parallel.distributed.config.AcceleratorConfig`
(topology degrees only); ``plan_overrides`` is parsed by
:func:`~hyper_parallel.distributed.plan.spec.parse_plan_overrides` (the CP method of each
attention). Type rules are in :mod:`hyper_parallel.distributed.config_schema`.

The YAML file and every ``a.b.c=value`` override go through the same path: YAML text -> plain
data (:func:`load_yaml_text`, YAML 1.2 floats: ``lr: 3e-4`` is a float) -> overrides applied to
the data (:func:`apply_overrides`) -> :meth:`TrainerConfig.from_dict`. An error names the dotted
field (``[optimizer.betas] must be a list of 2 numbers, got 0.9``) and, when an override set it,
the override.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..distributed.config import AcceleratorConfig
from ..distributed.config_schema import FieldInfo, check_section, describe_fields, load_section, option
from ..distributed.context_parallel.meta import PACKED_DOCUMENTS
from ..distributed.errors import CPConfigError
from ..distributed.pipeline_parallel import SCHEDULES as PIPELINE_SCHEDULES
from ..distributed.plan.spec import parse_plan_overrides
from .yaml_text import SECTIONS, apply_overrides, blame_override, load_yaml_text

MIXED_PRECISION = (None, "bf16")
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "sgd")
NONFINITE_POLICIES = ("stop", "skip")
MAX_NONFINITE_SKIPS = 3
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclasses.dataclass
class ModelConfig:
    """``architecture`` + ``config`` build a random-init HF model; ``path`` loads a local dir."""
    architecture: str | None = option(None, help="HF model_type (llama, qwen3, qwen3_moe, ...) of a random-init "
                                                 "model")
    config: dict | None = option(None, help="HF config kwargs (merged over config_file)")
    config_file: str | None = option(None, help="YAML/JSON file of HF config kwargs; relative paths are tried "
                                                "from the working directory, then the repository root")
    path: str | None = option(None, help="local HF checkpoint directory (config.json + safetensors, one file or "
                                         "sharded with its index); each rank reads only its shards' slices")
    attn_implementation: str = option("sdpa", help="HF attention implementation (the CP wrappers intercept SDPA)")
    dtype: str = option("float32", help="parameter dtype (keep float32; use schedule.mixed_precision for bf16)")
    seed: int = option(0, help="init seed (the same model on every rank and in every run)")
    freeze_vision_tower: bool = option(False, help="a vision-language model's tower is not trained: with data.source: "
                                                   "media its media are encoded without autograd and exchanged with no "
                                                   "backward exchange (docs/vlm.md)")


DATA_SOURCES = ("bytes", "files", "media")
DATA_FORMATS = (None, "json", "parquet", "text")


def _file_list(value, path: str):
    """``data.files``: one path/glob or a list of them -> a tuple of strings (None stays None)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
        raise CPConfigError(path, f"must be a path/glob or a non-empty list of them, got {value!r}",
                            fix="e.g. files: [data/*.jsonl]")
    return tuple(items)


@dataclasses.dataclass
class DataConfig:
    """Where rows come from: byte-level text (data.py) or tokenized files (data_sources.py,
    packing.py)."""
    source: str = option("bytes", choices=DATA_SOURCES,
                         help="bytes: the UTF-8 bytes of data.path (vocab 256); files: data.files read with HF "
                              "datasets and tokenized by data.tokenizer; media: jsonl records of text with <image> / "
                              "<video> markers and their image files (a vision-language model, docs/vlm.md)")
    path: str | None = option(None, shown_default="examples/data/corpus.txt",
                              help="source bytes: text file; tokens are its UTF-8 bytes (vocab 256)")
    files: tuple | None = option(None, parse=_file_list, type_name="path or list of paths/globs",
                                help="source files: json/jsonl/parquet/text files (globs allowed)")
    format: str | None = option(None, choices=DATA_FORMATS,
                                help="source files: json | parquet | text (null: from the file extension; text = one "
                                     "document per file)")
    text_field: str = option("text", help="source files: the column/key holding each document's text (json, parquet)")
    tokenizer: str | None = option(None, help="source files: local tokenizer directory "
                                              "(AutoTokenizer.from_pretrained, nothing downloaded)")
    cache_dir: str | None = option(None, shown_default="~/.cache/hyper_parallel/tokens",
                                   help="source files: where the tokenized store is written once and reused")
    packing: bool = option(False, help="source files: documents + EOS back to back in rows of seq_len, with "
                                       "document boundaries (seq_lens); false: one document per row, truncated")
    packed_documents: str | None = option(None, choices=PACKED_DOCUMENTS,
                                          help="with packing: what a row of several documents means, at every CP "
                                               "size: independent (each document as if alone) | as_transformers "
                                               "(what plain transformers computes on the packed row); required when "
                                               "the model's result depends on it")
    shuffle: bool = option(True, help="source files: a new document order every epoch (seeded by data.seed)")
    eval_fraction: float = option(0.0, ge=0, help="source files: fraction of documents held out for evaluation")
    eval_every: int | None = option(None, ge=1, help="evaluate on the held-out documents every N optimizer steps "
                                                     "(and after the last step)")
    eval_batches: int = option(2, ge=1, help="micro-batches per DP rank in one evaluation (the same rows every time)")
    media_max_pixels: int | None = option(None, ge=1, shown_default="65536",
                                          help="source media: each image / video frame is resized to at most this "
                                               "many pixels (a multiple of the model's patch grid)")
    seq_len: int = option(128, ge=2, help="global sequence length of a row (the CP shard is cut from it)")
    micro_batch_size: int = option(1, ge=1, help="rows per global micro-batch, per DP rank")
    min_doc_len: int | None = option(None, ge=2, help="source bytes: if set, each row is a document of random "
                                                      "length in [min_doc_len, seq_len], right-padded")
    pad_to_multiple: int | None = option(None, ge=1, help="round the row length up to a multiple")
    seed: int = option(0, help="data seed")
    pad_token_id: int = option(0, ge=0, help="id written into padding (it carries no loss and is never attended to)")
    ignore_index: int = option(-100, help="label value of targets that carry no loss")

    @property
    def tokenized(self) -> bool:
        """Documents tokenized by ``data.tokenizer`` from ``data.files`` (``files``, ``media``)."""
        return self.source in ("files", "media")

    def check_fields(self, path: str) -> None:
        if self.min_doc_len is not None and self.min_doc_len > self.seq_len:
            raise CPConfigError(f"{path}.min_doc_len", f"{self.min_doc_len} exceeds data.seq_len={self.seq_len}",
                                fix="use min_doc_len <= seq_len")
        if self.tokenized:
            for name in ("files", "tokenizer"):
                if getattr(self, name) is None:
                    raise CPConfigError(f"{path}.{name}", f"is required with data.source: {self.source}",
                                        fix="e.g. files: [my_docs.jsonl] and tokenizer: my_tokenizer_dir")
            if self.source == "media":
                for name, default in (("format", None), ("eval_fraction", 0.0), ("eval_every", None),
                                      ("packed_documents", None)):
                    if getattr(self, name) != default:
                        raise CPConfigError(f"{path}.{name}", "is not available with data.source: media",
                                            fix="remove it (media records are jsonl; no held-out split yet; a "
                                                "packed row's samples are always independent documents)")
            elif self.media_max_pixels is not None:
                raise CPConfigError(f"{path}.media_max_pixels", "applies to data.source: media only",
                                    fix="remove it")
            if self.min_doc_len is not None:
                raise CPConfigError(f"{path}.min_doc_len", "applies to data.source: bytes only",
                                    fix="remove it (document lengths come from the files)")
            if self.path is not None:
                raise CPConfigError(f"{path}.path", "applies to data.source: bytes only",
                                    fix="list the files in data.files instead")
            if self.eval_fraction >= 1:
                raise CPConfigError(f"{path}.eval_fraction", f"must be < 1, got {self.eval_fraction}")
        else:
            for name, default in (("files", None), ("tokenizer", None), ("packing", False), ("packed_documents", None),
                                  ("eval_fraction", 0.0), ("eval_every", None), ("media_max_pixels", None)):
                if getattr(self, name) != default:
                    raise CPConfigError(f"{path}.{name}", "applies to data.source: files (or media) only",
                                        fix="set data.source: files (with data.files and data.tokenizer) or remove it")
        if self.packed_documents is not None and not self.packing:
            raise CPConfigError(f"{path}.packed_documents", "says what a packed row means, but data.packing is false",
                                fix="set data.packing: true, or remove it")
        if self.eval_every is not None and self.eval_fraction <= 0:
            raise CPConfigError(f"{path}.eval_every", "needs held-out documents",
                                fix="set data.eval_fraction > 0 (e.g. 0.05)")


@dataclasses.dataclass
class OptimizerConfig:
    name: str = option("adamw", choices=OPTIMIZERS, case_insensitive=True, help="optimizer")
    lr: float = option(1e-3, gt=0, help="peak learning rate")
    weight_decay: float = option(0.0, ge=0, le=1, help="decoupled weight decay (AdamW) / L2 (SGD)")
    betas: tuple[float, float] = option((0.9, 0.95), help="AdamW (beta1, beta2)")
    eps: float = option(1e-8, gt=0, lt=1, help="AdamW epsilon")
    grad_clip: float | None = option(1.0, gt=0, help="max global gradient 2-norm (null: no clipping; the norm is "
                                                    "still logged)")
    foreach: bool | None = option(None, help="torch.optim foreach implementation (null: torch default)")

    def check_fields(self, path: str) -> None:
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise CPConfigError(f"{path}.betas[{i}]", f"must be in [0, 1), got {beta!r}")


@dataclasses.dataclass
class ScheduleConfig:
    steps: int = option(10, ge=0, help="total optimizer steps (a resumed run continues up to this number)")
    warmup_steps: int = option(0, ge=0, help="linear warm-up steps")
    grad_accum_steps: int = option(1, ge=1, help="micro-batches per optimizer step (with pp_size > 1: the "
                                   "pipeline's microbatches)")
    pipeline: str = option("1f1b", choices=tuple(PIPELINE_SCHEDULES),
                           help="pipeline schedule when accelerator.pp_size > 1 (torch.distributed.pipelining)")
    virtual_stages: int | None = option(None, ge=1, shown_default="null (2 with interleaved_1f1b, else 1)",
                                        help="pipeline stages per rank (interleaved_1f1b: 2 or more)")
    seed: int = option(0, help="global torch seed")
    activation_checkpointing: bool = option(False, help="recompute each decoder layer in backward")
    activation_offload: bool = option(False, help="keep the activations saved at activation-checkpoint boundaries "
                                                  "(each decoder layer's input) in host memory, pinned on an "
                                                  "accelerator, prefetched for backward on a side stream (exact; "
                                                  "needs activation_checkpointing; refused with tp_size > 1)")
    tiled_mlp: bool = option(False, help="each decoder layer's dense MLP in chunks of tiled_mlp_chunk_size local "
                                         "tokens, recomputed in backward: its [S_local, intermediate] activations "
                                         "are never saved (exact; refused for MoE blocks and with tp_size > 1)")
    tiled_mlp_chunk_size: int = option(2048, ge=1, help="tokens per tiled-MLP chunk (schedule.tiled_mlp)")
    mixed_precision: str | None = option(None, choices=MIXED_PRECISION,
                                         help="bf16: FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32), fp32 "
                                              "master weights; null: fp32")
    save_every: int | None = option(None, ge=1, help="save a checkpoint every N steps (and at the end of the run)")
    resume_from: str | None = option(None, help="a step_<N> checkpoint directory to resume from (same topology), "
                                                "or 'latest': the newest intact step_<N> in checkpoint_dir (damaged "
                                                "newer ones are skipped, with a log line each)")
    keep_last: int | None = option(None, ge=1, help="keep only the newest N complete checkpoints in checkpoint_dir "
                                                    "(older ones are removed after each save); null: keep all")
    allow_unverified_checkpoint: bool = option(False, help="resume from a checkpoint whose hyper_meta.json has no "
                                                           "checksum of its own (saved before meta checksums): "
                                                           "refused unless true")
    lr_schedule: str = option("constant", choices=LR_SCHEDULES,
                              help="after warm-up: constant, or cosine down to min_lr_ratio x lr")
    min_lr_ratio: float = option(0.1, ge=0, le=1, help="cosine floor, as a fraction of optimizer.lr")
    checkpoint_dir: str | None = option(None, shown_default="<logging.out_dir>/checkpoints",
                                        help="where step_<N>/ checkpoint directories go")
    on_nonfinite: str = option("stop", choices=NONFINITE_POLICIES,
                               help="a step whose loss or gradient norm is NaN/Inf (on any rank): stop = end the "
                                    "run at that step naming the last good checkpoint; skip = apply no update "
                                    "for it (the LR schedule still advances), log it and go on, up to "
                                    "max_nonfinite_skips times")
    max_nonfinite_skips: int = option(MAX_NONFINITE_SKIPS, ge=1,
                                      help="with on_nonfinite: skip, the run stops at the next non-finite step "
                                           "after this many skipped ones")

    def check_fields(self, path: str) -> None:
        if self.on_nonfinite != "skip" and self.max_nonfinite_skips != MAX_NONFINITE_SKIPS:
            raise CPConfigError(f"{path}.max_nonfinite_skips", "applies to schedule.on_nonfinite: skip only",
                                fix="set schedule.on_nonfinite: skip or remove it")


@dataclasses.dataclass
class LossConfig:
    tiled: bool = option(True, help="LM head + cross-entropy in token chunks with recompute in backward: no "
                                    "[S_local, vocab] logits tensor (exact; a head it cannot reproduce falls "
                                    "back to the untiled loss with a log line)")
    chunk_size: int = option(256, ge=1, help="tokens per chunk of the tiled loss (transient memory: one chunk_size x vocab fp32 buffer, in forward and in backward)")
    router_loss: bool = option(True, help="MoE: add the model's router load-balancing loss (router_aux_loss_coef x "
                                          "aux, as its forward with labels) when its config sets "
                                          "output_router_logits; statistics reduced over the whole sequence "
                                          "(exact under CP)")
    router_balance_domain: str = option("global_micro_batch", choices=("global_micro_batch", "local_micro_batch"),
                                        help="tokens the router statistics are balanced over: global_micro_batch "
                                             "= micro-batch i of every DP and CP rank (CP=1 on one rank with the "
                                             "DP rows concatenated); local_micro_batch = each DP rank's rows, "
                                             "mean over DP. Per micro-batch; the step's router loss is the mean "
                                             "over grad_accum_steps")


@dataclasses.dataclass
class LoggingConfig:
    out_dir: str = option("runs/default", help="where the log, the plot and (by default) checkpoints go")
    log_every: int = option(1, ge=1, help="print a line every N steps when the progress bar is off")
    progress: bool = option(True, help="tqdm bar on rank 0 with loss, tokens/s and lr")
    plot: bool = option(True, help="write the loss-curve PNG")
    level: str = option("INFO", choices=LOG_LEVELS, case_insensitive=True,
                        help="Python logging level (ranks other than 0 log warnings only)")
    json_log: str = option("train_log.json", help="per-step JSON records (written under out_dir)")
    plot_file: str = option("loss_curve.png", help="loss curve per optimizer step (written under out_dir)")
    tensorboard: bool = option(False, help="also write TensorBoard event files (loss, lr, tokens/s, grad norm, peak "
                                           "memory per step) to <out_dir>/tensorboard on rank 0")
    export_hf: bool = option(False, help="after training, write the model in Hugging Face format (+ data.tokenizer's "
                                         "files) to <out_dir>/hf (hf_checkpoint.save_hf)")


def _plan_overrides(value) -> list:
    """``plan_overrides`` through :func:`parse_plan_overrides` (its semantics unchanged), after
    refusing the shape mistakes it would not name: one entry written as a mapping without the
    leading ``-``, or a scalar."""
    if isinstance(value, Mapping) and not all(isinstance(v, Mapping) or hasattr(v, "match") for v in value.values()):
        raise CPConfigError("plan_overrides", f"must be a list of entries, got a mapping with keys {sorted(value)}",
                            fix="write each entry as a list item: '- match: \"*.self_attn\"' followed by its keys")
    if value is not None and not isinstance(value, (list, tuple, Mapping)):
        raise CPConfigError("plan_overrides", f"must be a list of entries, got {type(value).__name__}: {value!r}",
                            fix="write plan_overrides: [] or a list of '- match: ...' entries")
    return parse_plan_overrides(value)


TOP_LEVEL = SECTIONS


@dataclasses.dataclass
class TrainerConfig:
    """The whole trainer YAML (see the module doc)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    accelerator: AcceleratorConfig = dataclasses.field(default_factory=AcceleratorConfig)
    plan_overrides: list = option(default_factory=list, parse=lambda value, path: _plan_overrides(value),
                                  type_name="list of entries",
                                  help="one declared CP method per attention module (docs/yaml_schema.md)")
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    source: str | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "TrainerConfig":
        """Load and check plain data (a parsed YAML document); every field through the schema."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise CPConfigError("<root>", f"the YAML document must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(TOP_LEVEL), key=str)
        if unknown:
            raise CPConfigError(str(unknown[0]), f"unknown top-level key(s) {unknown}",
                                fix=f"use only {list(TOP_LEVEL)} (check for typos)")
        sections = {}
        for name in TOP_LEVEL:
            f = _FIELDS[name]
            if name == "plan_overrides":
                sections[name] = f.metadata["parse"](data.get(name), name)
            elif name == "accelerator":
                sections[name] = AcceleratorConfig.from_dict(data.get(name), name)
            else:
                sections[name] = load_section(f.default_factory, data.get(name), name)
        return cls(**sections, source=source)

    def validate(self) -> "TrainerConfig":
        """Re-check every section of a config built or edited in Python (the same rules as the loader)."""
        for name in TOP_LEVEL:
            if name != "plan_overrides":
                check_section(getattr(self, name), name)
        self.plan_overrides = _plan_overrides(self.plan_overrides)
        return self

    def to_dict(self) -> dict:
        """Plain-data view (JSON-able) for logs and checkpoint metadata."""
        out = {}
        for name in ("model", "data", "optimizer", "schedule", "loss", "accelerator", "logging"):
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
        """Read ``path`` (YAML 1.2 floats), apply ``overrides`` (``a.b.c=value``), load; an error
        caused by an override says so."""
        path = Path(path)
        if path.is_dir():
            raise CPConfigError("<config file>", f"{path} is a directory, not a YAML file",
                                fix="pass the YAML file, e.g. examples/train_cp2.yaml")
        try:
            with open(path) as fh:
                text = fh.read()
        except FileNotFoundError:
            raise
        except (OSError, UnicodeDecodeError) as exc:
            raise CPConfigError("<config file>", f"{path} cannot be read: {exc}") from None
        try:
            data = load_yaml_text(text)
        except yaml.YAMLError as exc:
            raise CPConfigError("<root>", f"{path} is not valid YAML: {exc}".replace("\n", " ")) from None
        data = apply_overrides(data, overrides)
        try:
            return cls.from_dict(data, source=str(path))
        except CPConfigError as exc:
            raise blame_override(exc, overrides) from None

    @classmethod
    def schema_fields(cls):
        """Every leaf field of the schema (:class:`~hyper_parallel.distributed.config_schema.FieldInfo`),
        ``plan_overrides`` as one entry, in YAML order."""
        out = []
        for name in TOP_LEVEL:
            f = _FIELDS[name]
            if name == "plan_overrides":
                out.append(FieldInfo(name, f.metadata["type_name"], "[]", f.metadata["help"]))
            else:
                out.extend(describe_fields(f.default_factory, name + "."))
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(TrainerConfig)}
if tuple(n for n in _FIELDS if n != "source") != TOP_LEVEL:   # the sections, checked against the schema
    raise AssertionError(f"trainer/yaml_text.SECTIONS {TOP_LEVEL} != TrainerConfig's fields {tuple(_FIELDS)}")
