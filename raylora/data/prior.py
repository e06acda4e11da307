"""Prior preservation on a worker: every instance batch gets as many class samples.

As in diffusers' DreamBooth scripts, a training batch is the B instance samples followed
by B class samples (the model-family seam encodes the 2B rows as one batch, and
``raylora.train.step`` splits the prediction in two). No Ray here.

The class rows (a few hundred at most, read by the driver: ``raylora.data.classgen``) are
held raw on each worker and preprocessed per batch like the instance images (same size,
crop and flip settings; no caption dropout). Which class rows a batch gets, and their
crop/flip draws, depend on the seed, the worker's rank, the pass and the batch's place in
the pass alone: a ``data.sharding=files`` run resumed at an epoch pairs every batch with
the class samples of the straight run (with stream sharding the instance batches of a
resumed epoch already differ, and so do their class samples).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

PRIOR_SEED_SALT = 0x5EED_C1A5


class ClassBatches:
    """``batch(pass, i, n)``: the ``n`` class samples paired with batch ``i`` of ``pass``.

    Each pass walks a seeded permutation of the class rows (a new one when it wraps),
    ``n`` rows per batch, so every class row is used before any is used twice."""

    def __init__(self, rows: list[dict], stage, seed: int, rank: int):
        if not rows:
            raise ValueError("prior preservation: no class images")
        self.images = np.array([r["image"] for r in rows], dtype=object)
        self.texts = np.array([r["text"] for r in rows], dtype=object)
        # where each is (raylora.data.classgen: a file, parquet file#row), for messages
        self.keys = np.array([str(r.get("key", f"class row {i}")) for i, r in enumerate(rows)],
                             dtype=object)
        self.count = len(rows)
        self.stage, self.seed, self.rank = stage, seed, rank

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([PRIOR_SEED_SALT, self.seed, self.rank, *keys])

    def indices(self, epoch: int, i: int, n: int) -> list[int]:
        rows = self.count
        out = []
        for k in range(i * n, i * n + n):
            cycle, at = divmod(k, rows)
            out.append(int(self._rng(epoch, cycle).permutation(rows)[at]))
        return out

    def batch(self, epoch: int, i: int, n: int) -> dict[str, np.ndarray]:
        idx = self.indices(epoch, i, n)
        # The draws (crop, flip) of this batch alone: the same whatever came before.
        self.stage.rng = self._rng(epoch, 1 << 20, i)
        out = self.stage({"image": self.images[idx], "text": self.texts[idx], "key": self.keys[idx]})
        if len(out["pixel_values"]) != n:
            # The driver judged every class row as this stage does (classgen.bad_class_rows):
            # this is a node whose decoders differ (another PIL, a missing plugin).
            judge = {k: v for k, v in self.stage.decode.items() if k != "background"}
            bad = [f"{self.keys[j]}: {problem}" for j in dict.fromkeys(idx)
                   if (problem := class_row_problem({"image": self.images[j], "text": self.texts[j]},
                                                    masks=self.stage.masks, **judge))]
            raise ValueError(f"prior preservation: {n - len(out['pixel_values'])} class "
                             "image(s) of this batch could not be decoded on this worker "
                             f"({'; '.join(bad) or 'see the bad-record counts'}); replace "
                             "them in data.class_sources")
        return out


def class_row_problem(row: dict, *, masks: bool, max_pixels: int, min_size: int,
                      small_images: str):
    """Why the class stage (``raylora.data.preprocess.Preprocess`` built with
    ``stage_kwargs("class", ...)``) would drop class row ``{image, text}``: the
    ``raylora.data.decode.BadRecord`` (``.reason``: corrupt_image, too_small, ...), or
    None. The stage's one judgement, ``open_masked_row``, as it calls it for class rows:
    no mask column (``masks``: the alpha channel read, as data.masked_loss does), no
    control images, blank captions not kept (no caption dropout)."""
    from raylora.data.decode import row_problem

    return row_problem(row, masks=masks, max_pixels=max_pixels, min_size=min_size,
                       small_images=small_images, keep_empty_captions=False)


class EncodedClassBatches(ClassBatches):
    """``ClassBatches`` of class rows the driver encoded (data.cache=latents:
    ``raylora.data.cache.encode_rows``): the same rows for the same batch, picked from
    ``columns`` instead of preprocessed (a cache holds one view of each image: centre
    crop, no flip). A column may be folded (``fold_repeats``)."""

    def __init__(self, columns: dict, seed: int, rank: int):
        first = next(iter(columns.values()), ())
        self.count = len(first[1] if isinstance(first, tuple) else first)
        if not self.count:
            raise ValueError("prior preservation: no class images")
        self.columns, self.seed, self.rank = columns, seed, rank

    def batch(self, epoch: int, i: int, n: int) -> dict[str, np.ndarray]:
        idx = self.indices(epoch, i, n)
        return {k: unfold(v, idx) for k, v in self.columns.items()}


def fold_repeats(columns: dict[str, np.ndarray]) -> dict:
    """Encoded class rows with each column's repeated rows kept once: ``(distinct rows,
    each row's index into them)`` where a column repeats, else the column. Class images
    mostly share one prompt, and a prompt embedding is the big part of a row (Flux.2
    [dev]'s: 512 × 15360 bf16, 15 MiB; 100 images' would be 1.5 GiB on every worker).
    Rows are the same when their bytes are: nothing is rounded."""
    import hashlib

    out: dict = {}
    for name, v in columns.items():
        first: dict[bytes, int] = {}
        index = np.array([first.setdefault(hashlib.sha1(np.ascontiguousarray(row).tobytes())
                                           .digest(), i) for i, row in enumerate(v)], dtype=np.int64)
        kept = sorted(set(index.tolist()))
        if len(kept) == len(v):
            out[name] = v
            continue
        where = {row: j for j, row in enumerate(kept)}
        out[name] = (v[kept], np.array([where[i] for i in index.tolist()], dtype=np.int64))
    return out


def unfold(column, idx) -> np.ndarray:
    """Rows ``idx`` of a column as ``fold_repeats`` left it."""
    if isinstance(column, tuple):
        distinct, index = column
        return distinct[index[idx]]
    return column[idx]


def concat_pair(instance: dict[str, np.ndarray], prior: dict[str, np.ndarray]) -> dict:
    """One batch: the instance rows, then the class rows, column by column."""
    missing = set(instance) - set(prior)
    if missing:
        raise KeyError(f"prior preservation: class batches lack {sorted(missing)}")
    from raylora.data.captions import concat_rows

    return {k: concat_rows(k, [v, prior[k].astype(v.dtype, copy=False)]) for k, v in instance.items()}


def paired(stream: Iterator[tuple[int, dict]], classes: ClassBatches,
           deal: tuple[int, int] | None = None) -> Iterator[tuple[int, dict]]:
    """``(pass, batch)`` → ``(pass, batch ‖ its class samples)``; batch i of each pass
    (counted from the pass's first batch in this stream; ``deal``: see
    ``raylora.data.captions.numbered``) gets ``classes.batch(pass, i)``."""
    from raylora.data.captions import numbered

    for epoch, i, batch in numbered(stream, deal):
        n = len(next(iter(batch.values())))
        yield epoch, concat_pair(batch, classes.batch(epoch, i, n))
