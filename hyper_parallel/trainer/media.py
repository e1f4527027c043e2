"""The trainer's media source (``data.source: media``): vision-language samples -> global micro-batches
with their images and videos (docs/vlm.md, "The trainer").

Records: ``data.files`` jsonl (read with HF ``datasets``), one sample each::

    {"text": "<image> a red square <image> then a clip <video> ...", "images": ["a.png", "b.png"],
     "videos": [["f0.png", "f1.png", "f2.png"]]}

``<image>`` / ``<video>`` mark where each medium goes, in order; paths are relative to the jsonl file's
folder (or absolute). The text between markers is tokenized by ``data.tokenizer`` (no special tokens)
and the sample ends with its EOS. Each medium goes through the model family's own image processor
(:class:`~hyper_parallel.distributed.context_parallel.vision.MediaInputs`, registered with its vision
tower; at most ``data.media_max_pixels`` pixels per image or frame) and takes the family's placeholder
tokens in the text; the sample's positions are the model's ``get_rope_index`` on the sample alone. Labels
are the tokens, ``ignore_index`` on every placeholder token. Everything is processed once at start-up
(the same on every rank, no collective).

Rows: one sample per row (``data.packing: false``), right-padded, or samples packed back to back in
order (``true``), each an independent document. A sample longer than ``data.seq_len`` is refused by
record (its media tokens would be cut). Batch (global micro-batch ``index`` of DP rank ``dp_rank``,
rows ``(index * dp_size + dp_rank) * B + j`` of the epoch's order, reshuffled per epoch with
``data.shuffle``)::

    input_ids, labels, attention_mask  [B, S]
    position_ids                       [4, B, S]  row 0 the text positions (restarting per sample: the
                                                  documents), rows 1-3 the model's 3-D positions
    media                              {kind: (pixel_values [rows, d], grid_thw [n, 3])}, the batch's
                                       media in row-major placeholder order
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from ..distributed.errors import CPConfigError
from .paths import mix_seed

MARKER = re.compile(r"<(image|video)>")
DEFAULT_MAX_PIXELS = 65536


@dataclasses.dataclass
class MediaSample:
    ids: torch.Tensor          # [n] int64
    labels: torch.Tensor       # [n] int64, ignore_index on placeholders
    positions: torch.Tensor    # [3, n] int64
    media: dict                # kind -> list of (pixel_values [rows, d], grid_thw [3])


def check_media_run(cfg) -> None:
    """What ``data.source: media`` does not combine with yet, and ``model.freeze_vision_tower`` on a model
    without a tower, refused by field before anything is built (local: the same error on every rank)."""
    from ..distributed.context_parallel.vision import carried_towers

    arch = cfg.model.architecture
    if cfg.model.freeze_vision_tower and arch is not None and arch not in carried_towers():
        raise CPConfigError("model.freeze_vision_tower", f"model.architecture {arch!r} has no registered vision tower",
                            fix="remove it (it applies to a vision-language model: docs/vlm.md)")
    if cfg.data.source != "media":
        return
    a = cfg.accelerator
    for field, value in (("accelerator.pp_size", a.pp_size), ("accelerator.tp_size", a.tp_size),
                         ("accelerator.ep_size", a.ep_size)):
        if value > 1:
            raise CPConfigError(field, f"is {value}, but data.source: media runs with CP, DP and FSDP only (the vision "
                                "tower is replicated and runs per rank on its own media)", fix=f"set {field}: 1")
    known = carried_towers(with_inputs=True)
    if arch is not None and arch not in known:
        raise CPConfigError("model.architecture", f"is {arch!r}, whose media path is not registered, but data.source "
                            "is media", fix=f"use one of {list(known)}, or data.source: files")


def freeze_vision_tower(model) -> int:
    """``model.freeze_vision_tower``: the registered tower's parameters stop requiring gradients (no
    optimizer state, no gradient sync); -> how many were frozen. CPConfigError for a model without one."""
    from ..distributed.context_parallel.vision import vision_tower

    tower = vision_tower(model)
    if tower is None:
        raise CPConfigError("model.freeze_vision_tower", f"{type(model).__name__} has no registered vision tower",
                            fix="remove it (it applies to a vision-language model: docs/vlm.md)")
    frozen = [p for n, p in model.named_parameters() if tower.holds(n)]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def media_tower(model):
    """The model's registered tower, with its :class:`MediaInputs`; CPConfigError naming the fix otherwise."""
    from ..distributed.context_parallel.vision import carried_towers, vision_tower

    tower = vision_tower(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if tower is None or tower.inputs is None:
        raise CPConfigError("data.source", f"media needs a vision-language model whose media path is registered; "
                            f"model type {model_type!r} has none",
                            fix=f"use one of {list(carried_towers(with_inputs=True))} (model.architecture), or "
                                "data.source: files")
    return tower


def _load_records(path: Path, first: int) -> list:
    """The records of one jsonl file (``first``: the index of its first record among all files')."""
    import datasets

    ds = datasets.load_dataset("json", data_files=[str(path)], split="train")
    out = []
    for i, rec in enumerate(ds, start=first):
        if not isinstance(rec.get("text"), str):
            raise CPConfigError("data.files", f"media record {i} has no 'text' string",
                                fix='each record: {"text": "... <image> ...", "images": [paths], "videos": [[frames]]}')
        out.append(rec)
    return out


def _open(path: str, base: Path, record: int):
    from PIL import Image

    p = Path(path) if Path(path).is_absolute() else base / path
    if not p.is_file():
        raise CPConfigError("data.files", f"media record {record}: {path} is not a file (looked in {base})",
                            fix="paths are relative to the jsonl file's folder")
    with Image.open(p) as im:
        return im.convert("RGB")


def build_sample(rec: dict, record: int, base: Path, model, tower, tokenizer, max_pixels: int,
                 ignore_index: int) -> MediaSample:
    """One record -> :class:`MediaSample` (module doc)."""
    cfg, inputs = model.config, tower.inputs
    parts = MARKER.split(rec["text"])
    texts, kinds = parts[0::2], parts[1::2]
    given = {"image": list(rec.get("images") or []), "video": list(rec.get("videos") or [])}
    for kind in ("image", "video"):
        if kinds.count(kind) != len(given[kind]):
            raise CPConfigError("data.files", f"media record {record}: {kinds.count(kind)} <{kind}> markers but "
                                f"{len(given[kind])} {kind}s", fix="one marker per medium, in order")
        if given[kind] and kind not in tower.kinds:
            raise CPConfigError("data.files", f"media record {record}: {model.config.model_type} carries no {kind}s "
                                f"under CP (carried: {sorted(tower.kinds)})", fix=f"drop the {kind}s")
    media, grids = {}, {}
    for kind, items in given.items():
        if not items:
            continue
        opened = ([_open(p, base, record) for p in items] if kind == "image"
                  else [[_open(p, base, record) for p in frames] for frames in items])
        pv, grid = inputs.preprocess(cfg, kind, opened, max_pixels)
        rows = [int(r) for r in tower.rows(grid)]
        starts = [0] + torch.tensor(rows).cumsum(0).tolist()
        media[kind] = [(pv[starts[i]:starts[i + 1]], grid[i]) for i in range(len(rows))]
        grids[kind] = grid
    ids, labels, used = [], [], {"image": 0, "video": 0}
    for i, text in enumerate(texts):
        if text:
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += t
            labels += t
        if i < len(kinds):
            kind = kinds[i]
            _, grid = media[kind][used[kind]]
            used[kind] += 1
            n = int(tower.tokens(cfg, grid[None])[0])
            ph = inputs.placeholders(cfg, kind, n)
            ids += ph
            labels += [ignore_index] * len(ph)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    ids_t = torch.tensor(ids, dtype=torch.long)
    pos = inputs.positions(model, ids_t[None], grids)[:, 0]
    return MediaSample(ids_t, torch.tensor(labels, dtype=torch.long), pos.long(), media)


def pack_rows(lengths: list, seq_len: int, packing: bool) -> list:
    """Samples -> rows (lists of sample indices, in order); a sample longer than ``seq_len`` refused."""
    rows, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise CPConfigError("data.seq_len", f"media record {i} is {n} tokens, longer than a row of {seq_len} "
                                "(its media tokens would be cut)", fix="raise data.seq_len or lower data.media_max_pixels")
        if cur and (not packing or used + n > seq_len):
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


class MediaBatcher:
    """Global micro-batches of media rows (module doc); ``batch(index)`` is a pure function of the
    index, ``dp_rank`` and ``seed``."""

    def __init__(self, samples: list, rows: list, *, seq_len: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool, pad_to_multiple, pad_token_id: int, ignore_index: int):
        self.samples, self.rows = samples, rows
        m = pad_to_multiple or 1
        self.S = -(-seq_len // m) * m
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.seed, self.shuffle, self.pad, self.ignore = seed, shuffle, pad_token_id, ignore_index
        self._epoch_order = (None, [])

    def _order(self, epoch: int) -> list:
        """The rows' order in ``epoch`` (a new one per epoch with ``shuffle``), computed once per epoch."""
        if self._epoch_order[0] != epoch:
            n = len(self.rows)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch))).tolist() \
                if self.shuffle else list(range(n))
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def _row(self, g: int) -> list:
        epoch, i = divmod(g, len(self.rows))
        return self.rows[self._order(epoch)[i]]

    def batch(self, index: int) -> dict:
        B, S = self.micro_batch_size, self.S
        ids = torch.full((B, S), self.pad, dtype=torch.long)
        labels = torch.full((B, S), self.ignore, dtype=torch.long)
        mask = torch.zeros((B, S), dtype=torch.long)
        pos = torch.zeros((4, B, S), dtype=torch.long)
        media: dict = {}
        for b in range(B):
            at = 0
            for s in self._row((index * self.dp_size + self.dp_rank) * B + b):
                smp = self.samples[s]
                n = smp.ids.numel()
                ids[b, at:at + n], labels[b, at:at + n], mask[b, at:at + n] = smp.ids, smp.labels, 1
                pos[0, b, at:at + n] = torch.arange(n)
                pos[1:, b, at:at + n] = smp.positions
                for kind, items in smp.media.items():
                    media.setdefault(kind, []).extend(items)
                at += n
            if at < S:            # padding continues the last sample's positions (masked out as keys)
                tail = torch.arange(1, S - at + 1)
                pos[:, b, at:] = pos[:, b, at - 1:at] + tail
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}
        if media:
            out["media"] = {k: (torch.cat([v for v, _ in items]), torch.stack([g for _, g in items]))
                            for k, items in media.items()}
        return out


def build_media_stream(cfg, model, *, dp_rank: int, dp_size: int):
    """The training :class:`~.data.DataStream` of ``data.source: media`` for ``model`` (module doc)."""
    from .data import DataStream
    from .data_sources import load_tokenizer, resolve_files

    tower = media_tower(model)
    files = resolve_files(cfg.files)
    tokenizer = load_tokenizer(cfg.tokenizer)
    samples = []
    for f in files:
        for rec in _load_records(f, len(samples)):
            samples.append(build_sample(rec, len(samples), f.parent, model, tower, tokenizer,
                                        cfg.media_max_pixels or DEFAULT_MAX_PIXELS, cfg.ignore_index))
    if not samples:
        raise CPConfigError("data.files", "hold no media record", fix="give jsonl files with records")
    vocab = model.config.get_text_config().vocab_size
    top = max(int(s.ids.max()) for s in samples)
    if top >= vocab:
        raise CPConfigError("model.config.text_config.vocab_size", f"is {vocab}, but the samples hold token id {top} "
                            "(the tokenizer's or a media placeholder's)", fix=f"set it to at least {top + 1}")
    rows = pack_rows([s.ids.numel() for s in samples], cfg.seq_len, cfg.packing)
    return DataStream(MediaBatcher(samples, rows, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                   dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed, shuffle=cfg.shuffle,
                                   pad_to_multiple=cfg.pad_to_multiple, pad_token_id=cfg.pad_token_id,
                                   ignore_index=cfg.ignore_index))

