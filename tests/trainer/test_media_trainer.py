"""The trainer's media source (``data.source: media``, trainer/media.py) with a vision-language model:
``examples/vlm_cp2.yaml`` (tiny Qwen2.5-VL on the generated images and video frames of
examples/data/media, packed rows) trains 5 steps at CP=2 with the losses and the parameters of CP=1,
and its HF export reloads with plain transformers; the refusals name their field. fp32, tolerance 1e-5
relative (losses; parameters relative to the largest)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig, apply_overrides
from tests.trainer import _media_workers as MW

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _cfg(out, *overrides: str) -> dict:
    with open(ROOT / "examples" / "vlm_cp2.yaml") as fh:
        data = yaml.safe_load(fh)
    return apply_overrides(data, ["schedule.steps=5", "logging.progress=false", "logging.plot=false",
                                  f"logging.out_dir={out}", *overrides])


def test_vlm_example_cp2_equals_cp1_and_the_export_reloads(ranks, tmp_path):
    """The example as written (AdamW): the losses of 5 steps; its HF export reloads with plain transformers
    and holds the trained parameters."""
    cp2 = ranks(2).run(MW.train_media, _cfg(tmp_path / "cp2"), timeout=600)
    cp1 = ranks(1).run(MW.train_media, _cfg(tmp_path / "cp1", "accelerator.cp_size=1",
                                            "logging.export_hf=false"), timeout=600)[0]
    l1, l2 = cp1["losses"], cp2[0]["losses"]
    assert cp2[1]["losses"] == l2 and len(l1) == len(l2) == 5
    rel = max(abs(a - b) / abs(a) for a, b in zip(l1, l2))
    print(f"cp1 losses {l1}\ncp2 losses {l2}\nloss rel {rel:.2e} (tolerance {TOL:g}); videos in the 5 batches: "
          f"{cp1['videos_seen']}; FSDP at cp 2: {cp2[0]['fsdp']}")
    assert rel <= TOL and l2[-1] < l2[0] and cp1["videos_seen"] > 0 and cp2[0]["fsdp"]
    from transformers import AutoModelForImageTextToText

    p2 = cp2[0]["params"]
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "cp2" / "hf")
    state = {k: v.float() for k, v in reloaded.state_dict().items()}
    missing = [n for n in p2 if n not in state]
    assert not missing, missing[:4]
    diff = max((state[n] - p2[n]).abs().max().item() for n in p2)
    print(f"HF export reloaded as {type(reloaded).__name__}: max difference to the trained parameters {diff:.1e}")
    assert diff == 0.0 and type(reloaded).__name__ == "Qwen2_5_VLForConditionalGeneration"


def test_vlm_updates_at_cp2_equal_cp1(ranks, tmp_path):
    """Every parameter's update over 2 SGD steps (the gradients, vision tower included; AdamW would turn
    the rounding of gradients that are zero in exact math, e.g. the key biases', into full steps),
    relative to the largest update."""
    from hyper_parallel.trainer.model import HyperAutoModel

    over = ("schedule.steps=2", "optimizer.name=sgd", "optimizer.lr=0.5", "logging.export_hf=false")
    cp2 = ranks(2).run(MW.train_media, _cfg(tmp_path / "cp2", *over), timeout=600)[0]
    cp1 = ranks(1).run(MW.train_media, _cfg(tmp_path / "cp1", *over, "accelerator.cp_size=1"), timeout=600)[0]
    start = {n: p.detach().float() for n, p in
             HyperAutoModel.from_config(_loaded().model, image_text=True).named_parameters()}
    d1 = {n: cp1["params"][n] - start[n] for n in start}
    d2 = {n: cp2["params"][n] - start[n] for n in start}
    big = max(d.abs().max().item() for d in d1.values())
    worst = max(d1, key=lambda n: (d1[n] - d2[n]).abs().max().item())
    err = (d1[worst] - d2[worst]).abs().max().item() / big
    tower = max((d1[n] - d2[n]).abs().max().item() for n in d1 if ".visual." in n) / big
    moved = max(d1[n].abs().max().item() for n in d1 if ".visual." in n)
    print(f"updates: rel {err:.2e} (worst {worst}), vision tower {tower:.2e}, the tower's largest update {moved:.2e}; "
          f"losses cp1 {cp1['losses']} cp2 {cp2['losses']}; tolerance {TOL:g}")
    assert err <= TOL and moved > 0


def _loaded(*overrides: str) -> TrainerConfig:
    return TrainerConfig.from_dict(_cfg("/tmp/unused", *overrides))


@pytest.mark.parametrize("override,field", [
    ("accelerator.tp_size=2", "accelerator.tp_size"),
    ("model.architecture=llama", "model.architecture"),
])
def test_media_refusals_name_the_field(override, field):
    """What the media source does not combine with, and a model without a registered media path."""
    from hyper_parallel.trainer.config_checks import check_run_config

    with pytest.raises(CPConfigError) as err:
        check_run_config(_loaded(override))
    print(err.value)
    assert f"[{field}]" in str(err.value)


def test_media_fields_belong_to_the_media_source():
    with pytest.raises(CPConfigError, match=r"data\.eval_fraction.*not available with data.source: media"):
        _loaded("data.eval_fraction=0.1")
    with pytest.raises(CPConfigError, match=r"data\.media_max_pixels.*applies to data.source: media only"):
        _loaded("data.source=files", "data.media_max_pixels=1024")


def test_a_record_the_model_cannot_place_is_refused_by_record(tmp_path):
    """More markers than images, and a sample longer than a row (its image tokens would be cut)."""
    from hyper_parallel.trainer.media import build_media_stream
    from hyper_parallel.trainer.model import HyperAutoModel

    cfg = _loaded()
    model = HyperAutoModel.from_config(cfg.model, image_text=True)
    img = os.path.relpath(ROOT / "examples/data/media/images/img00.png", tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "<image> <image> two markers", "images": ["%s"]}\n' % img)
    cfg.data.files = (str(bad),)
    with pytest.raises(CPConfigError, match=r"media record 0: 2 <image> markers but 1 images"):
        build_media_stream(cfg.data, model, dp_rank=0, dp_size=1)
    bad.write_text('{"text": "<image> one image", "images": ["%s"]}\n' % img)
    cfg.data.seq_len = 16
    with pytest.raises(CPConfigError, match=r"media record 0 is \d+ tokens, longer than a row of 16"):
        build_media_stream(cfg.data, model, dp_rank=0, dp_size=1)
    cfg.data.seq_len = 256
    stream = build_media_stream(cfg.data, model, dp_rank=0, dp_size=1)
    batch = stream.batcher.batch(0)
    pv, grid = batch["media"]["image"]
    ids = batch["input_ids"]
    n = int((ids == model.config.image_token_id).sum())
    assert n == int(grid.prod(-1).sum()) // 4 and pv.shape[0] == int(grid.prod(-1).sum())
    assert torch.all(batch["labels"][ids == model.config.image_token_id] == cfg.data.ignore_index)


def test_frozen_tower_trains_the_rest_equally_and_keeps_the_tower(ranks, tmp_path):
    """``model.freeze_vision_tower``: CP 2 equals CP 1 (losses) and the tower's parameters are the initial
    ones after the steps, at both sizes."""
    from hyper_parallel.trainer.model import HyperAutoModel

    over = ("schedule.steps=2", "model.freeze_vision_tower=true", "logging.export_hf=false")
    cp2 = ranks(2).run(MW.train_media, _cfg(tmp_path / "cp2", *over), timeout=600)[0]
    cp1 = ranks(1).run(MW.train_media, _cfg(tmp_path / "cp1", *over, "accelerator.cp_size=1"), timeout=600)[0]
    start = {n: p.detach().float() for n, p in
             HyperAutoModel.from_config(_loaded().model, image_text=True).named_parameters()}
    rel = max(abs(a - b) / abs(a) for a, b in zip(cp1["losses"], cp2["losses"]))
    moved = {n: max((r["params"][n] - start[n]).abs().max().item() for r in (cp1, cp2)) for n in start}
    tower = max(v for n, v in moved.items() if ".visual." in n)
    rest = max(v for n, v in moved.items() if ".visual." not in n)
    print(f"frozen tower: losses cp1 {cp1['losses']} cp2 {cp2['losses']} (rel {rel:.2e}); the tower moved {tower:.1e}, "
          f"the rest up to {rest:.1e}")
    assert rel <= TOL and tower == 0.0 and rest > 0
