"""The held-out split: which rows are evaluation data, decided by content, not position.

A row is held out when ``row_fraction(image, caption) < data.validation_split``: a hash of
its image bytes and caption mapped to [0, 1). That decision needs no row index (Ray Data
has none to give) and does not depend on file order, shuffling, worker count or which
trial reads the data, so every run and every Tune trial trains on the same rows and is
scored on the same held-out rows. Exact duplicates always land on the same side, so a
duplicated image cannot leak from training into evaluation.

``read_heldout_rows`` runs on the driver with plain readers (no Ray): it returns the first
``validation_max_samples`` usable held-out rows in file order, which every worker then
evaluates. Usable: what the ``heldout`` preprocess stage keeps (``heldout_row_problem``), so
the count the plan reports is the count scored, and a held-out set with no usable row is
refused before Ray starts.
"""

from __future__ import annotations

import hashlib
from collections import Counter
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


def heldout_row_problem(row: dict, data: DataSection):
    """Why the ``heldout`` preprocess stage (``raylora.data.preprocess.stage_kwargs``, in
    both the uncached worker and the latent cache's driver task) would drop held-out row
    ``{image, text, control...}``: the ``raylora.data.decode.BadRecord`` (``.reason``), or
    None. The stage's one judgement, ``open_masked_row``, as it calls it there: the
    decode limits of ``data``, no mask, the row's control images (data.control_images),
    and a blank caption not kept: a held-out row is scored with its caption as written,
    whatever data.caption_dropout (a training knob, which a Tune search may vary: every
    trial must score the same rows)."""
    from raylora.data.decode import row_problem

    return row_problem(row, masks=False, max_pixels=data.max_image_pixels,
                       min_size=data.min_size, small_images=data.small_images,
                       keep_empty_captions=False,
                       controls=control_names(data) if data.control_images else None)


# What to look at when no held-out row is usable, where the training hint does not fit
# (caption dropout keeps blank training captions, never held-out ones).
_HINTS = {"missing_caption": "Caption the held-out images (data.caption_column, or the caption "
                             "files): a held-out row is scored with its caption, never a blank one"}


def read_heldout_rows(
    data: DataSection, plan: DataPlan, storage: Storage, split: float | None
) -> list[dict]:
    """The evaluation rows: with ``split`` the first usable held-out rows of the training
    files, else (``data.validation_uri``) the first usable rows of the validation files
    (each row once, whatever its repeats); at most ``data.validation_max_samples``.
    Usable: ``heldout_row_problem`` finds none, so the stage keeps every row returned.
    Each row is ``{"image": bytes, "text": str}`` (and its control images, ``control``,
    ``control_2``, ..., with data.control_images: an edit model is evaluated on its pairs).
    ValueError (naming ``data.uri``, the reasons and an example) when held-out rows were
    found and none is usable: the run would have nothing to score."""
    from raylora.data.plan import SAMPLE_HINTS

    rows, names, bad, examples = [], control_names(data), Counter(), {}
    for row in iter_plan_rows(data, plan, storage):
        if split is not None and row_fraction(row["image"], row["text"]) >= split:
            continue
        problem = heldout_row_problem(row, data)
        if problem is not None:
            bad[problem.reason] += 1
            examples.setdefault(problem.reason, f"{row.get('key', 'row')}: {problem}"[:200])
            continue
        rows.append({"image": row["image"], "text": "" if row["text"] is None else str(row["text"]),
                     **{name: row.get(name) for name in names}})
        if len(rows) >= data.validation_max_samples:
            break
    if not rows and bad:
        counts = ", ".join(f"{r}={n}" for r, n in bad.most_common())
        hints = "".join(f" {h}." for r in bad if (h := _HINTS.get(r) or SAMPLE_HINTS.get(r)))
        where = data.uri if data.sources is None else ", ".join(str(s.uri) for s in data.sources)
        raise ValueError(
            f"{where}: none of the {sum(bad.values())} held-out rows is usable ({counts}; "
            f"e.g. {'; '.join(examples.values())}): there is nothing to evaluate.{hints}")
    return rows
