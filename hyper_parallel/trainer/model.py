"""HyperAutoModel: a real ``transformers`` causal LM from a small config or a local directory.

Nothing is downloaded: ``model.architecture`` + ``model.config`` (or ``config_file``) build a
randomly initialized model with a fixed seed; ``model.path`` loads a local checkpoint dir.

Every build starts on the ``meta`` device (:func:`build_meta_model`); :func:`materialize` then
allocates and fills what this rank holds — the whole model (the ordinary build), or, after the
trainer applied its sharding plan to the empty model, only this rank's shards. Random values come
from the model's own ``_init_weights`` per unit (a decoder layer, or one other module) under a seed
derived from ``(model.seed, unit name)``, so they do not depend on the sharding; ``model.path``
fills the shards from the checkpoint (:mod:`.hf_checkpoint`).
"""
from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import torch
import torch.nn as nn

from ..distributed.errors import CPConfigError
from .config import ModelConfig
from .hf_config_keys import hf_config_kwargs as _hf_config_kwargs  # noqa: F401  (also used by config_checks)
from .paths import REPO_ROOT, resolve_path  # noqa: F401  (REPO_ROOT: public name of this module)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}




class HyperAutoModel:
    """Factory for HF causal LMs (``HyperAutoModel.from_config(ModelConfig)``).

    Every build starts on the ``meta`` device (no parameter memory anywhere). ``meta=True``
    returns that empty model — the trainer applies its sharding plan to it and then calls
    :func:`materialize`, so each rank allocates and fills only its own shards. ``meta=False``
    (default) materializes the whole model on ``device`` at once (the ordinary, unsharded build).
    Both fill every tensor the same way (:func:`materialize`), so a sharded random build equals
    the ordinary build at the same seed, parameter by parameter.
    """

    @staticmethod
    def from_config(cfg: ModelConfig, *, meta: bool = False, device="cpu", vocab_size: int | None = None,
                    image_text: bool = False):
        """Build the model of ``cfg`` (see the class doc). ``vocab_size``: the token ids the data
        can produce (:func:`.vocab_rule.build_vocab`): set as the vocabulary when ``model.config``
        gives none, refused when it gives fewer; with ``model.path`` the checkpoint's vocabulary is
        resized up to it (the new rows initialised like the random build). ``image_text``: the model type's
        image-text-to-text class (a vision-language model with its tower), else its causal-LM class."""
        import transformers

        if cfg.dtype not in _DTYPES:
            raise CPConfigError("model.dtype", f"unknown dtype {cfg.dtype!r}", fix=f"use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[cfg.dtype]
        if cfg.path:
            path = Path(cfg.path)
            if not path.is_dir():
                raise CPConfigError("model.path", f"{path} is not a local checkpoint directory")
            try:
                hf_cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise CPConfigError("model.path", f"no readable config.json in {path}: {exc}") from exc
            source = ("hf", str(path))
        else:
            if not cfg.architecture:
                raise CPConfigError("model.architecture", "is required when model.path is not given",
                                    fix="set e.g. architecture: llama with a small config")
            try:
                hf_cfg = transformers.AutoConfig.for_model(cfg.architecture, **_hf_config_kwargs(cfg))
            except ValueError as exc:
                raise CPConfigError("model.architecture", str(exc)) from exc
            source = ("random", None)
        if vocab_size is not None:
            from .vocab_rule import apply_vocab

            apply_vocab(hf_cfg, int(vocab_size), cfg)
        hf_cfg._attn_implementation = cfg.attn_implementation
        model = build_meta_model(hf_cfg, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                 image_text=image_text)
        model.__dict__["_hp_source"] = _Source(kind=source[0], path=source[1], seed=cfg.seed)
        model = _for_training(model)
        if not meta:
            materialize(model, device)
        return model

    @staticmethod
    def save_pretrained(model, path: str | Path) -> None:
        """Write an HF checkpoint directory loadable through ``model.path``, shard by shard
        (:func:`~.hf_checkpoint.save_hf`; collective when the model is distributed)."""
        from .hf_checkpoint import save_hf

        save_hf(model, path)


# ---------------------------------------------------------------------- meta build + materialize
@dataclasses.dataclass
class _Source:
    """How :func:`materialize` fills a meta-built model: ``random`` (HF init, per-unit seeds derived
    from ``seed``) or ``hf`` (the safetensors of ``path``; buffers and resized rows from the init)."""
    kind: str
    path: str | None
    seed: int


def run_model(cfg):
    """The run's model on the meta device: ``cfg`` a :class:`~.config.TrainerConfig` (its vocabulary rule;
    the image-text-to-text class with ``data.source: media``)."""
    from .vocab_rule import build_vocab

    return HyperAutoModel.from_config(cfg.model, meta=True, vocab_size=build_vocab(cfg),
                                      image_text=cfg.data.source == "media")


def auto_class(image_text: bool):
    import transformers

    return transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM


def build_meta_model(hf_cfg, *, dtype, attn_implementation: str, image_text: bool = False):
    """An HF causal LM of ``hf_cfg`` with every parameter and buffer on ``meta`` (no memory, no
    init), plus a pristine deep copy of it (``_hp_pristine``) that :func:`materialize` builds its
    per-unit full-size twins from after the model itself has been sharded."""
    import copy

    import transformers
    from transformers import initialization as hf_init

    with torch.device("meta"), hf_init.meta_device_safe_creation_ops():
        model = auto_class(image_text).from_config(hf_cfg, attn_implementation=attn_implementation, dtype=dtype)
    model.__dict__["_hp_image_text"] = image_text
    model.__dict__["_hp_pristine"] = copy.deepcopy(model)   # not a registered submodule
    return model


def check_fsdp_dtypes(model: nn.Module, dtype_name: str) -> None:
    """Refuse, at ``model.dtype``, a model whose parameters mix dtypes when FSDP2 will shard it.

    FSDP2 shards the parameters of one unit in one dtype; transformers keeps some modules of a
    model in float32 whatever the requested dtype (``_keep_in_fp32_modules``: e.g. DeepSeek V3.2's
    MoE gate and indexer ``weights_proj``), so ``model.dtype: bfloat16`` gives such a model mixed
    parameter dtypes, which FSDP2 rejects only at its first forward — inside the CP preflight proof
    — with a message that names neither the field nor the fix. The training path to bf16 is
    ``model.dtype: float32`` + ``schedule.mixed_precision: bf16`` (FSDP2 computes in bf16 and
    keeps fp32 master weights), which this error names. No-op when the dtypes are uniform."""
    by_dtype: dict = {}
    for name, p in model.named_parameters():
        by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) <= 1:
        return
    want = _DTYPES.get(dtype_name)
    odd = {dt: names for dt, names in by_dtype.items() if dt != want} or by_dtype
    detail = "; ".join(f"{str(dt).replace('torch.', '')}: {', '.join(names[:3])}"
                       f"{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}" for dt, names in odd.items())
    keep = sorted(set(getattr(model, "_keep_in_fp32_modules", None) or [])
                  | set(getattr(model, "_keep_in_fp32_modules_strict", None) or []))
    why = f" (transformers keeps {', '.join(keep)} in float32)" if keep else ""
    raise CPConfigError(
        "model.dtype", f"model.dtype={dtype_name} gives {type(model).__name__} parameters of mixed dtypes{why} — "
        f"{detail} — and FSDP2 shards the parameters of a unit in one dtype",
        fix="keep model.dtype: float32 and train in bf16 with schedule.mixed_precision: bf16 (FSDP2 computes in "
            "bf16 with fp32 master weights)")


def is_meta_model(model: nn.Module) -> bool:
    """True while any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _unit_seed(seed: int, fqn: str) -> int:
    return zlib.crc32(f"{seed}:{fqn}".encode()) & 0x7FFFFFFF


def _init_units(pristine: nn.Module):
    """(fqn, module, recurse) in a fixed order: each decoder layer as one unit (its own init may
    reach into its children, e.g. GPT-2's scaled ``c_proj``), then every other module that owns
    parameters or buffers directly, alone."""
    from ..distributed.tensor_parallel import find_decoder_layers

    layers = list(find_decoder_layers(pristine))
    names = dict(pristine.named_modules())
    units = [(fqn, names[fqn], True) for fqn in layers]
    inside = tuple(f + "." for f in layers)
    for fqn, mod in pristine.named_modules():
        if fqn in layers or fqn.startswith(inside):
            continue
        if any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
            units.append((fqn, mod, False))
    return units


def _unit_tensors(unit: nn.Module, recurse: bool):
    yield from unit.parameters(recurse=recurse)
    yield from unit.buffers(recurse=recurse)


def _init_owner(pristine: nn.Module, fqn: str):
    """The PreTrainedModel whose ``_init_weights`` covers ``fqn`` (the innermost one on its path,
    as transformers' ``smart_apply`` dispatches)."""
    from transformers import PreTrainedModel

    owner, mod = pristine, pristine
    for part in [p for p in fqn.split(".") if p]:
        mod = getattr(mod, part)
        if isinstance(mod, PreTrainedModel):
            owner = mod
    return owner


def _has_nan(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """``isnan(t).any()`` in chunks (no full-size boolean temporary next to a full-size twin)."""
    flat = t.reshape(-1)
    return any(bool(torch.isnan(part).any()) for part in flat.split(chunk))


class _ConstructedBuffers:
    """Buffers as the model's constructor (and a parent's ``_init_weights``) computes them, for the
    rare buffer a unit's own init leaves unset (Falcon-H1's ``mup_vector`` is written by the
    *model's* init into every layer): built once, on first use, by constructing the model again with
    every parameter moved to ``meta`` as it is registered — the buffers are real, no parameter
    memory is touched."""

    def __init__(self, pristine: nn.Module):
        self.pristine, self._buffers = pristine, None

    def get(self, name: str):
        if self._buffers is None:
            import copy

            import transformers

            register = nn.Module.register_parameter

            def to_meta(mod, pname, param):
                if param is not None and not param.is_meta:
                    param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                register(mod, pname, param)

            nn.Module.register_parameter = to_meta
            try:
                cfg = copy.deepcopy(self.pristine.config)
                model = auto_class(self.pristine.__dict__.get("_hp_image_text", False)).from_config(
                    cfg, attn_implementation=cfg._attn_implementation)
            finally:
                nn.Module.register_parameter = register
            self._buffers = dict(model.named_buffers())
        return self._buffers.get(name)


def _full_twin(owner, unit: nn.Module, recurse: bool, fqn: str, constructed: "_ConstructedBuffers | None" = None
               ) -> nn.Module:
    """A CPU copy of ``unit`` (all of it, or only its own tensors), every float tensor NaN, then
    initialised by ``owner._init_weights`` children first; a buffer the init leaves NaN is taken
    from ``constructed``; any other tensor left NaN raises naming it."""
    import copy

    if recurse:
        twin = copy.deepcopy(unit)
    else:
        twin = copy.copy(unit)
        twin.__dict__["_modules"] = {}
        twin.__dict__["_parameters"] = dict(unit._parameters)
        twin.__dict__["_buffers"] = dict(unit._buffers)
        twin.__dict__["_non_persistent_buffers_set"] = set(unit._non_persistent_buffers_set)
    twin.to_empty(device="cpu")
    with torch.no_grad():
        for t in _tensors(twin):
            if t.is_floating_point():
                t.fill_(float("nan"))
    for sub in reversed(list(twin.modules())):   # descendants before their parent, like smart_apply
        sub.__dict__.pop("_is_hf_initialized", None)
        for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            t.__dict__.pop("_is_hf_initialized", None) if hasattr(t, "__dict__") else None
        owner._init_weights(sub)
    buffer_names = {n for n, _ in twin.named_buffers()}
    for name, t in list(twin.named_parameters()) + list(twin.named_buffers()):
        if t.is_floating_point() and _has_nan(t):
            full = f"{fqn}.{name}" if fqn else name
            value = constructed.get(full) if constructed is not None and name in buffer_names else None
            if value is not None and value.shape == t.shape:
                t.copy_(value)
                continue
            raise CPConfigError("model", f"{type(owner).__name__}._init_weights leaves {full} "
                                "uninitialised on a meta-device build", module=full,
                                fix="give the model a complete _init_weights, or load it from model.path")
    return twin


def copy_into_local(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor ``full`` into ``dst`` (a DTensor: its local shard,
    at its global offset; a plain tensor: all of it), converting the dtype."""
    if hasattr(dst, "_local_tensor"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, dst.device_mesh, dst.placements)
        src = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        dst._local_tensor.copy_(src)
    else:
        dst.copy_(full)


def _to_empty_keep_ties(model: nn.Module, device) -> None:
    """``model.to_empty(device)`` that keeps every Parameter object (tied weights stay tied):
    tensors are swapped in place (what DTensor parameters always do)."""
    prev = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(prev)


def materialize(model: nn.Module, device, *, only_buffers: bool = False) -> nn.Module:
    """Allocate this rank's part of every tensor of a meta-built (and possibly sharded) model on
    ``device`` and fill it: ``random`` — each unit of :func:`_init_units` (a decoder layer, or one
    other module) is built full-size on the CPU, initialised by the model's own ``_init_weights``
    under a seed derived from ``(model.seed, unit fqn)``, and this rank's slices are copied; ``hf``
    — buffers that way, parameters from the checkpoint (:func:`~.hf_checkpoint.load_hf_into`).

    Memory: the local shards on ``device``, plus one unit full-size on the CPU at a time (the
    largest decoder layer or the embedding), freed before the next. Cost: the random numbers of
    the whole model are drawn on every rank (the price of a result independent of the sharding).
    """
    src: _Source = model.__dict__["_hp_source"]
    pristine = model.__dict__["_hp_pristine"]
    _to_empty_keep_ties(model, device)
    real = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # model.path with a vocabulary resized above the checkpoint's: the embedding rows past the
    # checkpoint's come from the random init (the checkpoint's rows are read over them)
    resized_rows = text.vocab_size if getattr(cfg, "_hp_checkpoint_vocab", None) else None
    constructed = _ConstructedBuffers(pristine)
    units = _init_units(pristine)
    # a tensor shared by several units (tied weights) takes the values of its first unit in the
    # canonical order, whatever order the units are materialized in
    owner_of: dict = {}
    # a pipeline stage holds some units of the whole model (under the whole model's names): the rest are skipped
    units = [u for u in units if any((f"{u[0]}.{n}" if u[0] else n) in real for n, _t in
                                     list(u[1].named_parameters(recurse=u[2])) + list(u[1].named_buffers(recurse=u[2])))]
    for fqn, unit, recurse in units:
        for name, t in list(unit.named_parameters(recurse=recurse, remove_duplicate=False)) + list(
                unit.named_buffers(recurse=recurse)):
            key = f"{fqn}.{name}" if fqn else name
            if key in real:
                owner_of.setdefault(id(real[key]), fqn)
    # largest twin first: it is built while few of this rank's shard pages are touched yet, so the
    # peak is the shards plus a small twin rather than the shards plus the largest one (each unit
    # draws from its own seed, so the order does not change any value)
    units = sorted(units, key=lambda u: -sum(t.numel() for t in _unit_tensors(u[1], u[2])))
    with torch.no_grad():
        for fqn, unit, recurse in units:
            buffers_only = only_buffers or (src.kind == "hf" and not (
                resized_rows and any(p.dim() and p.shape[0] == resized_rows for p in unit.parameters(recurse=recurse))))
            if buffers_only and not any(True for _ in unit.buffers(recurse=recurse)):
                continue
            owner = _init_owner(pristine, fqn)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_unit_seed(src.seed, fqn))
                twin = _full_twin(owner, unit, recurse, fqn, constructed)
            items = list(twin.named_buffers()) if buffers_only else (
                list(twin.named_parameters(remove_duplicate=False)) + list(twin.named_buffers()))
            for name, full in items:
                key = f"{fqn}.{name}" if fqn else name
                dst = real.get(key)
                # not on this pipeline stage, or a tied parameter (its first owner's values)
                if dst is None or owner_of.get(id(dst), fqn) != fqn:
                    continue
                copy_into_local(dst, full)
            full = items = twin = None    # no reference left: the twin's pages go back before the next unit
        if src.kind == "hf":
            from .hf_checkpoint import load_hf_into

            load_hf_into(model, src.path)
    return model


def head_probe_model(model: nn.Module, *, vocab_cap: int = 512) -> nn.Module:
    """A small, materialized CPU model of ``model``'s class and head configuration (one decoder
    layer, at most ``vocab_cap`` vocabulary rows, random init at the model's seed) for probes that
    must run a forward before the meta-built model holds any values (the tiled-head check)."""
    import copy

    cfg = copy.deepcopy(model.config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if isinstance(getattr(text, "num_hidden_layers", None), int):
        text.num_hidden_layers = 1
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:1]
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > vocab_cap:
        text.vocab_size = vocab_cap
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            tok = getattr(text, name, None)
            if isinstance(tok, int) and tok >= vocab_cap:
                setattr(text, name, None)
    src: _Source = model.__dict__["_hp_source"]
    dtype = next(iter(model.parameters())).dtype
    probe = build_meta_model(cfg, dtype=dtype, attn_implementation=cfg._attn_implementation,
                             image_text=model.__dict__.get("_hp_image_text", False))
    probe.__dict__["_hp_source"] = _Source(kind="random", path=None, seed=src.seed)
    return materialize(_for_training(probe), "cpu")


def _for_training(model):
    # training never uses the KV cache (CP rejects past_key_values / use_cache)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    model.train()
    return model


def build_model(cfg: ModelConfig):
    return HyperAutoModel.from_config(cfg)
