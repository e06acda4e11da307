"""The held-out split: which rows are evaluation data, decided by content, not position.

A row is held out when ``row_fraction(image, caption) < data.validation_split``: a hash of
its image bytes and caption mapped to [0, 1). That decision needs no row index (Ray Data
has none to give) and does not depend on file order, shuffling, worker count or which
trial reads the data, so every run and every Tune trial trains on the same rows and is
scored on the same held-out rows. Exact duplicates always land on the same side, so a
duplicated image cannot leak from training into evaluation.

``read_heldout_rows`` runs on the driver with plain readers (no Ray): it returns the first
``validation_max_samples`` held-out rows in file order, which every worker then evaluates.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from raylora.config import DataSection
from raylora.data.formats import control_names, image_bytes
from raylora.data.plan import DataPlan, iter_plan_rows
from raylora.storage import Storage

_SCALE = float(2**64)


def row_fraction(image: Any, caption: Any) -> float:
    """Deterministic position of a row in [0, 1): blake2b of image bytes and caption."""
    h = hashlib.blake2b(digest_size=8)
    h.update(image_bytes(image))
    h.update(b"\0")
    h.update(str(caption if caption is not None else "").encode("utf-8", "replace"))
    return int.from_bytes(h.digest(), "big") / _SCALE


def held_out_mask(images, captions, fraction: float) -> np.ndarray:
    return np.array([row_fraction(i, c) < fraction for i, c in zip(images, captions)], dtype=bool)


class KeepSplit:
    """Ray Data batch stage: keep the training rows (``heldout=False``) or the held-out ones."""

    def __init__(self, fraction: float, heldout: bool = False):
        self.fraction = fraction
        self.heldout = heldout

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        mask = held_out_mask(batch["image"], batch["text"], self.fraction)
        keep = mask if self.heldout else ~mask
        return {k: v[keep] for k, v in batch.items()}


def read_heldout_rows(
    data: DataSection, plan: DataPlan, storage: Storage, split: float | None
) -> list[dict]:
    """The evaluation rows: with ``split`` the first held-out rows of the training files,
    else (``data.validation_uri``) the first rows of the validation files (each row once,
    whatever its repeats). Each row is ``{"image": bytes, "text": str}`` (and its control
    images, ``control``, ``control_2``, ..., with data.control_images: an edit model is
    evaluated on its pairs)."""
    rows, names = [], control_names(data)
    for row in iter_plan_rows(data, plan, storage):
        if split is None or row_fraction(row["image"], row["text"]) < split:
            rows.append({"image": row["image"], "text": "" if row["text"] is None else str(row["text"]),
                         **{name: row.get(name) for name in names}})
            if len(rows) >= data.validation_max_samples:
                break
    return rows
