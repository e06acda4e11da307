"""A small procedurally drawn image-caption dataset for the demo and tests.

Each picture is one coloured shape on a plain background, and its caption says exactly
that ("a red circle on a blue background"), so a LoRA trained on it has something real
to learn and nothing has to be downloaded.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "orange": (240, 140, 30),
}
SHAPES = ("circle", "square", "triangle", "ring")


def draw_scene(shape: str, fg: str, bg: str, size: int, rng: np.random.Generator) -> Image.Image:
    img = Image.new("RGB", (size, size), COLORS[bg])
    d = ImageDraw.Draw(img)
    r = int(size * rng.uniform(0.2, 0.35))
    cx, cy = (int(size * rng.uniform(0.35, 0.65)) for _ in range(2))
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=COLORS[fg])
    elif shape == "square":
        d.rectangle(box, fill=COLORS[fg])
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[fg])
    else:
        d.ellipse(box, outline=COLORS[fg], width=max(2, r // 3))
    return img


def make_samples(n: int, size: int = 64, seed: int = 0) -> list[tuple[bytes, str]]:
    """n (png_bytes, caption) pairs, deterministic for a seed."""
    rng = np.random.default_rng(seed)
    names = list(COLORS)
    out = []
    for _ in range(n):
        shape = SHAPES[rng.integers(len(SHAPES))]
        fg, bg = rng.choice(len(names), size=2, replace=False)
        img = draw_scene(shape, names[fg], names[bg], size, rng)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append((buf.getvalue(), f"a {names[fg]} {shape} on a {names[bg]} background"))
    return out


def write_parquet_shards(
    dest: str | Path,
    n: int = 64,
    num_shards: int = 2,
    size: int = 64,
    seed: int = 0,
    image_column: str = "image",
    caption_column: str = "text",
    hf_struct: bool = False,
) -> list[Path]:
    """Write ``n`` samples as ``num_shards`` parquet files (image bytes + caption).

    ``hf_struct``: store images as the Hugging Face datasets struct ``{bytes, path}``, as
    ``Dataset.to_parquet`` and the hub's parquet exports do.
    """
    if n < 1:
        raise ValueError(f"--num: {n}; at least 1 image")
    if size < 8:  # PIL cannot write an empty image, and the VAE needs 8 pixels a latent
        raise ValueError(f"--size: {size}; at least 8 pixels")
    if not 1 <= num_shards <= n:
        # 0 shards wrote a manifest of n images and no data; more shards than images, empty ones
        raise ValueError(f"--shards: {num_shards}; between 1 and the number of images ({n})")
    dest = Path(dest)
    old = sorted(p.name for p in dest.glob("part-*.parquet")) if dest.is_dir() else []
    if old:
        # a reader of the folder takes every part: old ones beside fewer new ones trained
        # too, and the manifest counted the new ones only (as `raylora shards build` refuses)
        raise ValueError(f"{dest}: already holds {len(old)} demo shard(s) ({', '.join(old[:3])}"
                         f"{', ...' if len(old) > 3 else ''}); give an empty or new folder, or "
                         "remove them first")
    dest.mkdir(parents=True, exist_ok=True)
    samples = make_samples(n, size=size, seed=seed)
    paths = []
    for i in range(num_shards):
        part = samples[i::num_shards]
        if hf_struct:
            images = pa.array(
                [{"bytes": b, "path": f"{i}-{j}.png"} for j, (b, _) in enumerate(part)],
                type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            )
        else:
            images = pa.array([b for b, _ in part], type=pa.binary())
        table = pa.table(
            {image_column: images, caption_column: pa.array([c for _, c in part], type=pa.string())}
        )
        path = dest / f"part-{i:05d}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    (dest / "_manifest.json").write_text(
        json.dumps({"count": n, "shards": num_shards, "image_size": size, "seed": seed})
    )
    return paths


def write_imagefolder(dest: str | Path, n: int = 32, size: int = 64, seed: int = 0,
                      captions: str = "metadata") -> Path:
    """Write PNGs plus captions as ``metadata.jsonl`` (``captions="metadata"``, Hugging Face
    imagefolder) or as a ``.txt`` beside each image (``captions="txt"``)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (png, caption) in enumerate(make_samples(n, size=size, seed=seed)):
        name = f"img_{i:05d}.png"
        (dest / name).write_bytes(png)
        if captions == "txt":
            (dest / f"img_{i:05d}.txt").write_text(caption)
        else:
            lines.append(json.dumps({"file_name": name, "text": caption}))
    if lines:
        (dest / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return dest
