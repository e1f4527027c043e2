"""Hugging Face checkpoints read and written shard by shard.

``save_hf(trainer_or_model, out_dir, *, tokenizer_dir=None)`` writes a directory that plain
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads: ``model-0000i-of-0000N
.safetensors`` + ``model.safetensors.index.json`` + ``config.json`` (+ the tokenizer files of
``tokenizer_dir``). Collective: every rank calls it. No rank gathers the model: each rank writes
the chunks of the (TP/FSDP-sharded) parameters it holds through torch DCP's
``HuggingFaceStorageWriter`` (replicated chunks written once), then the output files are
assembled from those chunks with the files split between ranks (one full tensor at a time in
host memory, never on the device).

``load_hf_into(model, path)`` fills an already sharded (meta-built, materialized) model from a
local HF directory (one ``.safetensors`` file or a sharded set with its index): each rank reads
only the slices of its own shards through DCP's ``HuggingFaceStorageReader``. Before any tensor
is read the checkpoint's names, shapes and dtypes are checked against the model (missing, extra,
shape, a dtype that cannot be cast) and one :class:`~..distributed.errors.CPConfigError` naming
the tensor is raised, identical on every rank.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.errors import CPConfigError
from ..distributed.preflight import agree_or_raise
from ..platform import barrier
from ..platform.process_group import timed_world_group
from .grad_utils import clean_param_name

__all__ = ["save_hf", "load_hf_into", "model_tensors", "read_checkpoint_index"]

INDEX_NAME = "model.safetensors.index.json"
MAX_FILE_BYTES = 4 << 30       # output files of at most ~4 GiB (a tensor larger than that gets its own)
_SHARDED_TMP = ".hp_sharded"


# ---------------------------------------------------------------------- names
def model_tensors(model: nn.Module) -> tuple[dict, set]:
    """``({HF name: tensor}, {tied alias names})``: every parameter once (a tied parameter under its
    first name, as HF checkpoints store it) and every persistent buffer; the aliases are the other
    names of tied parameters (``lm_head.weight`` of a tied-embedding model)."""
    out, seen, aliases = {}, {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_param_name(name)
        if id(p) in seen:
            aliases.add(name)
            continue
        seen[id(p)] = name
        out[name] = p
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out[clean_param_name(f"{mod_name}.{b_name}" if mod_name else b_name)] = b
    return out, aliases


def read_checkpoint_index(path: str | Path) -> dict:
    """``{name: (file, shape, dtype)}`` from the safetensors headers of ``path`` (no tensor is read).
    With ``model.safetensors.index.json``, every file it names must exist and hold its tensors."""
    from safetensors import safe_open

    path = Path(path)
    index_file = path / INDEX_NAME
    files = sorted(path.glob("*.safetensors"))
    if index_file.exists():
        weight_map = json.loads(index_file.read_text()).get("weight_map", {})
        for name, fname in sorted(weight_map.items()):
            if not (path / fname).exists():
                raise CPConfigError("model.path", f"{index_file.name} maps tensor {name} to {fname}, which does not "
                                    f"exist in {path}", fix="copy every shard file of the checkpoint")
    if not files:
        raise CPConfigError("model.path", f"no .safetensors file in {path}",
                            fix="save the model with safe_serialization (HF's default) or save_hf")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                out[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
    return out


# ---------------------------------------------------------------------- load
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _castable(src: str, dst: torch.dtype) -> bool:
    s = _ST_DTYPES.get(src)
    if s is None:
        return False
    if dst.is_floating_point:
        return s.is_floating_point
    return s == dst


def _check_against(model_t: dict, aliases: set, ckpt: dict, vocab_rows: tuple | None, path) -> set:
    """Raise naming the first mismatching tensor; return the names whose rows were resized."""
    resized = set()
    missing = sorted(n for n in model_t if n not in ckpt)
    if missing:
        raise CPConfigError("model.path", f"tensor {missing[0]} of the model is missing from the checkpoint {path}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                            fix="point model.path at a checkpoint of this architecture and config")
    extra = sorted(n for n in ckpt if n not in model_t and n not in aliases)
    if extra:
        raise CPConfigError("model.path", f"the checkpoint {path} has tensor {extra[0]} that the model does not"
                            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                            fix="the checkpoint's config.json does not describe these weights")
    for name, t in model_t.items():
        _, shape, dtype = ckpt[name]
        want = tuple(t.shape)
        if shape != want:
            if vocab_rows and len(shape) == len(want) and shape[0] == vocab_rows[0] and want[0] == vocab_rows[1] \
                    and shape[1:] == want[1:]:
                resized.add(name)
            else:
                raise CPConfigError("model.path", f"tensor {name} has shape {list(shape)} in the checkpoint but "
                                    f"{list(want)} in the model", fix="the checkpoint and its config.json disagree")
        if not _castable(dtype, t.dtype):
            raise CPConfigError("model.path", f"tensor {name} is {dtype} in the checkpoint and cannot be cast to "
                                f"the model's {t.dtype}", fix="convert the checkpoint, or set model.dtype to match")
    return resized


@torch.no_grad()
def _load_rows(dst: torch.Tensor, file, name: str, rows: int) -> None:
    """Rows ``[0, rows)`` of checkpoint tensor ``name`` into this rank's part of ``dst`` (resized vocab)."""
    from safetensors import safe_open

    if hasattr(dst, "_local_tensor"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
        local = dst._local_tensor
    else:
        shape, offset, local = tuple(dst.shape), (0,) * dst.dim(), dst
    lo, hi = offset[0], min(offset[0] + shape[0], rows)
    if hi <= lo:
        return
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))
    with safe_open(str(file), framework="pt") as h:
        part = h.get_slice(name)[(slice(lo, hi),) + rest]
    local[: hi - lo].copy_(part)


def load_hf_into(model: nn.Module, path: str | Path) -> None:
    """Fill ``model``'s parameters and persistent buffers (already materialized, possibly sharded)
    from the HF checkpoint directory ``path``; collective when distributed (see the module doc).

    Checks first, agreed on every rank (one error naming the tensor): every model tensor present,
    no extra tensor (a tied alias such as ``lm_head.weight`` is allowed), equal shapes, a dtype that
    casts (floating to floating; integer and bool tensors must match). A vocabulary resized above
    the checkpoint's (``config._hp_checkpoint_vocab``) reads the checkpoint's rows and keeps the
    initialised rows past them. Then one DCP load through ``HuggingFaceStorageReader``: each rank
    reads only the slices of its own shards (``safe_open(...).get_slice``), cast on copy.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = Path(path)
    model_t, aliases = model_tensors(model)
    cfg = getattr(model, "config", None)
    old_vocab = getattr(cfg, "_hp_checkpoint_vocab", None) if cfg is not None else None
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    vocab_rows = (old_vocab, text.vocab_size) if old_vocab else None

    def check():
        ckpt = read_checkpoint_index(path)
        return ckpt, _check_against(model_t, aliases, ckpt, vocab_rows, path)

    ckpt, resized = agree_or_raise(check, what="model.path checkpoint", same_error=True)
    for name in sorted(resized):
        _load_rows(model_t[name], ckpt[name][0], name, old_vocab)
    state = {n: t.detach() for n, t in model_t.items() if n not in resized}
    with torch.no_grad():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), process_group=timed_world_group())


# ---------------------------------------------------------------------- save
def _file_plan(sizes: dict, world: int) -> dict:
    """``{name: file index (1-based)}``: at least one file per rank (the files are assembled in
    parallel, one rank per file), files of at most :data:`MAX_FILE_BYTES`, balanced greedily."""
    total = sum(sizes.values())
    n_files = max(1, min(len(sizes), max(world, math.ceil(total / MAX_FILE_BYTES))))
    load = [0] * n_files
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = min(range(n_files), key=lambda k: (load[k], k))
        load[i] += sizes[name]
        out[name] = i + 1
    used = sorted(set(out.values()))
    renum = {old: new for new, old in enumerate(used, start=1)}
    return {n: renum[i] for n, i in out.items()}


def _save_config(model: nn.Module, out: Path, dtype) -> None:
    import copy

    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    cfg = copy.deepcopy(cfg)
    cfg.__dict__.pop("_hp_checkpoint_vocab", None)
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = True          # training turned the KV cache off; inference wants it
    cfg.dtype = dtype
    cfg.save_pretrained(str(out))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(out))
        except Exception:  # noqa: BLE001 - a generation config HF refuses to write is not a weight
            pass


def save_hf(trainer_or_model, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
            dtype=None) -> Path:
    """Write the (possibly sharded) model as an HF checkpoint directory; see the module doc.

    ``trainer_or_model``: a :class:`~.base.BaseTrainer` (its ``model``) or an ``nn.Module``.
    ``dtype``: cast on write (default: the parameters' dtype). Collective: every rank calls it.
    Steps: (1) DCP save through ``HuggingFaceStorageWriter(save_distributed=True)`` — each rank
    writes the chunks it holds (replicated chunks once) into ``out_dir/.hp_sharded``; (2) the output
    files are assembled from those chunks, output file ``i`` by rank ``i % world``
    (``consolidate_safetensors_files_on_every_rank``: one full tensor in host memory at a time);
    (3) rank 0 writes ``model.safetensors.index.json``, ``config.json`` (``use_cache`` back on) and
    the tokenizer files, and removes the chunk folder. Returns ``out_dir``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    from torch.distributed.checkpoint._hf_utils import _gen_file_name

    model = trainer_or_model if isinstance(trainer_or_model, nn.Module) else trainer_or_model.model
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tensors, _ = model_tensors(model)
    state = {n: (t.detach().to(dtype) if dtype is not None else t.detach()) for n, t in tensors.items()}
    save_dtype = dtype or next(iter(state.values())).dtype
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    if world > 1:      # pipeline stages hold different tensors: the file plan covers every rank's
        from ..platform import all_gather_object

        sizes = {n: b for part in all_gather_object(sizes) for n, b in part.items()}
    mapping = _file_plan(sizes, world)
    tmp = out / _SHARDED_TMP

    def prepare():
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
            raise CPConfigError("tokenizer_dir", f"{tokenizer_dir} is not a directory")

    agree_or_raise(prepare, what="HF export", same_error=True)
    group = timed_world_group()
    writer = HuggingFaceStorageWriter(path=str(tmp), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, storage_writer=writer, process_group=group)
    barrier()
    consolidate_safetensors_files_on_every_rank(input_dir=str(tmp), output_dir=str(out),
                                                fqn_to_index_mapping=mapping, process_group=group)
    barrier()
    if rank == 0:
        n_files = max(mapping.values())
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: _gen_file_name(i, n_files) for n, i in sorted(mapping.items())}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        _save_config(model, out, save_dtype)
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(out))
        shutil.rmtree(tmp)
    barrier()
    return out
