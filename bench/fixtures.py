"""Inputs the CPU benchmarks share: a tiny random SD model and photo-like JPEG shards.

Photo-like: smooth gradients plus noise, saved as quality-90 JPEG at 768x512, so decoding
costs what a real dataset's decoding costs (the demo's flat PNG shapes decode far faster).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def photo_jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([
        127 + 100 * np.sin(x / rng.uniform(20, 90) + rng.uniform(0, 6)),
        127 + 100 * np.cos(y / rng.uniform(20, 90) + rng.uniform(0, 6)),
        127 + 100 * np.sin((x + y) / rng.uniform(30, 120)),
    ], axis=-1)
    img = np.clip(base + rng.normal(0, 18, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def photo_shards(dest: str, n: int, num_shards: int, width: int = 768, height: int = 512,
                 seed: int = 0) -> list[str]:
    """``n`` JPEG + caption rows in ``num_shards`` parquet files (row groups of 32)."""
    os.makedirs(dest, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    per = -(-n // num_shards)
    for s in range(num_shards):
        count = min(per, n - s * per)
        images = [photo_jpeg(rng, width, height) for _ in range(count)]
        texts = [f"a photo, sample {s * per + i}, soft light" for i in range(count)]
        table = pa.table({"image": pa.array(images, pa.binary()), "text": texts})
        path = os.path.join(dest, f"part-{s:05d}.parquet")
        pq.write_table(table, path, row_group_size=32)
        paths.append(path)
    return paths


def tiny_model(dest: str) -> str:
    from raylora.model.tiny import build_tiny_sd

    if not os.path.exists(os.path.join(dest, "model_index.json")):
        build_tiny_sd(dest)
    return dest
