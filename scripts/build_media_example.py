#!/usr/bin/env python
"""Write the media example's data (no download): small generated images and video frames and a jsonl of
records that place them in text (the trainer's ``data.source: media``, docs/vlm.md).

    python scripts/build_media_example.py [--out examples/data/media]

Each image is a coloured shape on a coloured field (sizes 16-32 pixels a side, so a tiny Qwen-VL with
2-pixel patches merged 2 x 2 gives 16-64 tokens each); each video is 2-3 frames of a square moving
across the field. The records mix one or two images, a video, and text only; the captions say what the
media show. Deterministic: the same files every run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (240, 240, 240), "black": (20, 20, 20)}


def shape(h: int, w: int, fg: str, bg: str, kind: str, at=(0.5, 0.5)) -> Image.Image:
    img = np.empty((h, w, 3), dtype=np.uint8)
    img[:] = COLOURS[bg]
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx, r = at[0] * h, at[1] * w, min(h, w) / 4
    inside = ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r) if kind == "circle" else \
        ((abs(yy - cy) <= r) & (abs(xx - cx) <= r))
    img[inside] = COLOURS[fg]
    return Image.fromarray(img)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "examples" / "data" / "media"))
    out = Path(ap.parse_args().out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names, records = list(COLOURS), []
    for i in range(16):
        fg, bg = rng.choice(names, 2, replace=False)
        kind = ["square", "circle"][i % 2]
        h, w = (int(rng.choice([16, 24, 32])), int(rng.choice([16, 24, 32])))
        path = f"images/img{i:02d}.png"
        shape(h, w, fg, bg, kind).save(out / path)
        if i % 4 == 3:        # a video: a square moving left to right
            frames = []
            for f in range(2 + i % 2):
                fp = f"frames/vid{i:02d}_{f}.png"
                shape(16, 16, fg, bg, "square", at=(0.5, 0.25 + 0.25 * f)).save(out / fp)
                frames.append(fp)
            records.append({"text": f"<video> a {fg} square moves to the right over a {bg} field.",
                            "videos": [frames]})
        elif i % 4 == 2:      # text only
            records.append({"text": f"a {fg} {kind} would sit on a {bg} field, {h} by {w} pixels."})
        elif i % 4 == 1:      # two images
            j = (i + 5) % 16
            other = f"images/img{j:02d}.png"
            if not (out / other).exists():
                shape(16, 16, bg, fg, "circle").save(out / other)
            records.append({"text": f"<image> a {fg} {kind} on {bg}. <image> and another picture.",
                            "images": [path, other]})
        else:
            records.append({"text": f"<image> this is a {fg} {kind} on a {bg} field.", "images": [path]})
    with open(out / "media.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    print(f"wrote {len(records)} records to {out / 'media.jsonl'}")


if __name__ == "__main__":
    main()
