"""Aspect-ratio buckets (``data.bucketing``): which size each image trains at, and which
bucket each step's batch comes from. No Ray here.

A resolution R with a step S gives the buckets kohya's sd-scripts makes: the square R×R
and every (w, h), both multiples of S, with w the longer side stepped by S above R and h
the largest multiple of S keeping w·h ≤ R², up to an aspect of ``MAX_ASPECT`` (and each
bucket's transpose). Several resolutions (``data.resolution: [512, 1024]``, or a source's
own) give the union of their buckets. An image goes to one resolution, the largest whose
area it covers (``√(w·h) ≥ R``; the smallest when it covers none: it is upscaled), and
there to the bucket nearest its aspect ratio in log space (|log(w/h) − log(bw/bh)|, so 2:1 and
1:2 are equally far from 1:1; kohya's sd-scripts compares w/h linearly, which favours the
wider bucket near a tie). It is resized to
cover the bucket and cropped to it; the crop's offset goes to SDXL's conditioning.

Batches: every micro-batch holds rows of one bucket, and every worker trains the same
bucket at the same step. The driver counts each bucket's rows per worker from image
headers (``scan_rows``; held-out rows, data.validation_split, and rows without a control
image, data.control_images, are not counted); an epoch trains each bucket
floor(rows / batch) times (the smallest worker's count, as ``data.sharding=files`` does
for the whole epoch: the remainder of each bucket is dropped, as kohya does), in an
order drawn from the seed and the epoch alone (``schedule``), so every worker computes
the same one. A worker (``bucket_batches``) buffers rows by bucket and hands out the
scheduled bucket's batch next; a bucket that runs short (rows dropped as bad records)
is filled with rows of that bucket seen earlier in the pass, so the workers never
disagree about a step (one left with no row at all stops the run with an error rather
than hang the others).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from raylora.data.captions import stack_rows

# Longest side / shortest side a bucket may have (kohya's default range 256-1024 at 512
# reaches 4:1).
MAX_ASPECT = 4.0


@functools.lru_cache(maxsize=64)
def resolution_buckets(resolution: int, step: int) -> tuple[tuple[int, int], ...]:
    """The ``(width, height)`` buckets of one resolution, square first, then by width."""
    area, out = resolution * resolution, {(resolution, resolution)}
    w = resolution + step
    while True:
        h = area // w // step * step
        if h < step or w / h > MAX_ASPECT:
            break
        out |= {(w, h), (h, w)}
        w += step
    return tuple(sorted(out, key=lambda b: (b != (resolution, resolution), b)))


@dataclass(frozen=True)
class BucketSet:
    """The run's buckets (``sizes``: ``(width, height)``, a bucket's id is its place here)
    and, per source, the resolutions its images go to."""

    sizes: tuple[tuple[int, int], ...]
    source_resolutions: tuple[tuple[int, ...], ...]
    step: int

    @classmethod
    def of(cls, source_resolutions: list[list[int]], step: int) -> BucketSet:
        sizes: dict[tuple[int, int], None] = {}
        for r in sorted({r for rs in source_resolutions for r in rs}):
            sizes.update(dict.fromkeys(resolution_buckets(r, step)))
        return cls(tuple(sizes), tuple(tuple(sorted(rs)) for rs in source_resolutions), step)

    def name(self, bucket: int) -> str:
        w, h = self.sizes[bucket]
        return f"{w}x{h}"

    def largest(self) -> tuple[int, int]:
        """The bucket with the most pixels ``(width, height)``: what memory is sized by."""
        return max(self.sizes, key=lambda b: (b[0] * b[1], -abs(b[0] - b[1])))

    def assign(self, width: int, height: int, source: int = 0) -> int:
        """The bucket of an image of ``width`` × ``height`` from source ``source``."""
        rs = self.source_resolutions[source]
        fits = [r for r in rs if r * r <= width * height]
        r = max(fits) if fits else rs[0]
        target = math.log(width / height)
        own = resolution_buckets(r, self.step)
        candidates = [i for i, b in enumerate(self.sizes) if b in own]
        # Ties (an aspect halfway between two buckets): the larger area, then the wider.
        return min(candidates, key=lambda i: (abs(math.log(self.sizes[i][0] / self.sizes[i][1]) - target),
                                              -self.sizes[i][0] * self.sizes[i][1], -self.sizes[i][0]))


def cover_crop_box(width: int, height: int, bucket: tuple[int, int], center: bool,
                   rng: np.random.Generator) -> tuple[tuple[int, int], tuple[int, int]]:
    """Resize ``width`` × ``height`` to cover ``bucket`` ``(bw, bh)`` (aspect kept), then
    crop it: ``((resized w, resized h), (top, left))`` of the crop in the resized image."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    # round() not int(): 511.9999 must become 512, never leave the crop short of a pixel.
    nw, nh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if center:
        return (nw, nh), ((nh - bh) // 2, (nw - bw) // 2)
    return (nw, nh), (int(rng.integers(0, nh - bh + 1)), int(rng.integers(0, nw - bw + 1)))


def image_size(value, max_pixels: int | None = None) -> tuple[int, int] | None:
    """``(width, height)`` from an encoded image's header (no pixels decoded), upright
    (EXIF orientation applied); None when it cannot be read (the validating decode drops
    such a row anyway). ``max_pixels``: data.max_image_pixels, PIL's bomb bound here as in
    the decode (``raylora.data.decode.open_image`` sets it process-wide): PIL refuses a
    header over twice its bound, so an image a raised bound lets the run decode was in no
    bucket while no decode had yet raised it on the driver."""
    import warnings

    from PIL import Image

    from raylora.data.decode import upright_size
    from raylora.data.formats.base import image_bytes

    data = image_bytes(value)
    if max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # between the bound and twice it: scan_rows compares with the bound itself
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            # Upright, as the decode turns it (raylora.data.decode.upright).
            return upright_size(img, data)
    except Exception:  # noqa: BLE001 - any unreadable header is a row training drops
        return None


def bucket_set(data) -> BucketSet | None:
    """The run's ``BucketSet`` (``data``: the config's data section); None without
    data.bucketing."""
    if not data.bucketing:
        return None
    return BucketSet.of([sec.resolutions() for sec in data.source_sections()], data.bucket_step)


def scan_rows(rows: Iterable[dict], buckets: BucketSet, source: int, min_size: int = 0,
              skip_small: bool = True, keep_empty: bool = False,
              max_pixels: int | None = None, split: float = 0.0,
              prefix: str = "", controls: Sequence[str] = (),
              lacking: Container[str] = frozenset()) -> np.ndarray:
    """Each ``{key, image, text}`` row's bucket id as training will bucket it, int16 in
    row order; -1 for a row no bucket trains: one the preprocess stage drops (no caption,
    unreadable, too small or too large image, no control image: ``controls``, the row keys
    its control images are in, one None or empty; or its ``key`` in ``lacking``), or held
    out by ``split`` (data.validation_split; ``prefix``: the source's caption prefix,
    which the held-out hash reads as training does, ``raylora.data.split``)."""
    from raylora.data.captions import joined_captions, with_prefix
    from raylora.data.decode import missing_image
    from raylora.data.split import row_fraction

    out = []
    for row in rows:
        size = image_size(row["image"], max_pixels)
        # several captions as the readers join them: a list of blank ones is no caption
        text = joined_captions(row.get("text"))
        if size is None or not size[0] or not size[1] or \
                (not keep_empty and (text is None or not str(text).strip())) or \
                row.get("key") in lacking or any(missing_image(row.get(c)) for c in controls) or \
                (skip_small and min_size and min(size) < min_size) or \
                (max_pixels and size[0] * size[1] > max_pixels) or \
                (split and row_fraction(row["image"], with_prefix(prefix, text) if prefix else text)
                 < split):
            out.append(-1)
        else:
            out.append(buckets.assign(size[0], size[1], source))
    return np.array(out, dtype=np.int16)


def bucket_counts(ids: np.ndarray) -> dict[int, int]:
    """Rows per bucket id of ``scan_rows``' ids (the -1 rows left out)."""
    vals, n = np.unique(ids[ids >= 0], return_counts=True)
    return dict(zip(vals.tolist(), n.tolist()))


def epoch_steps(per_worker: list[dict[int, float]], batch_size: int) -> dict[int, int]:
    """Micro-batches per bucket per epoch, the same on every worker: the smallest of the
    workers' ``floor(rows / batch_size)`` (``per_worker``: each worker's rows per bucket
    an epoch brings); a bucket with no full batch somewhere is left out."""
    keys = sorted({b for w in per_worker for b in w})
    steps = {b: min(int(w.get(b, 0) // batch_size) for w in per_worker) for b in keys}
    return {b: n for b, n in steps.items() if n > 0}


def schedule(steps: dict[int, int], seed: int, epoch: int) -> list[int]:
    """The bucket of each micro-batch of epoch ``epoch``: every bucket ``steps[b]`` times,
    in an order drawn from the seed and the epoch alone (the same on every worker)."""
    order = [b for b in sorted(steps) for _ in range(steps[b])]
    perm = np.random.default_rng([seed, epoch, 0xB0C]).permutation(len(order))
    return [order[i] for i in perm]


def bucket_batches(blocks: Iterable[dict[str, np.ndarray]], batch_size: int,
                   plan: Callable[[int], list[int]], seed: Callable[[int], int],
                   ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Rows in pass order (blocks with ``epoch`` and ``bucket`` columns) → ``(pass,
    batch)``, the batches of pass e in the buckets ``plan(e)`` names, in that order. Rows
    wait in their bucket's buffer; a batch is drawn at random from its bucket's rows (the
    pass's generator ``seed(e)``). A bucket short of rows at the end of its pass is
    filled with its rows seen earlier in the pass; rows left over are dropped. Depends on
    the rows' order alone, not on how they were cut into blocks."""
    current, rng, todo, bufs, seen = None, None, [], {}, {}

    def ready():
        while todo and len(bufs.get(todo[0], ())) >= batch_size:
            yield current, _draw(bufs[todo.pop(0)], batch_size, rng)

    def finish():
        while todo:
            b = todo.pop(0)
            pool = bufs.setdefault(b, [])
            if not seen.get(b):
                # Skipping the step would leave this worker a batch short of the others
                # (a hang at their next all-reduce): stop instead, saying why.
                raise RuntimeError(
                    f"epoch {current}: no usable row of bucket {b} (raylora.json data.buckets."
                    "sizes) reached this worker this epoch, though the plan counted some: they "
                    "were dropped as bad records (see data.bad_records)")
            while len(pool) < batch_size:
                pool.append(seen[b][int(rng.integers(len(seen[b])))])
            yield current, _draw(pool, batch_size, rng)

    for block in blocks:
        for i, (e, b) in enumerate(zip(block["epoch"].tolist(), block["bucket"].tolist())):
            if e != current:
                yield from finish()
                current, rng = e, np.random.default_rng(seed(e))
                # seen restarts too: a resumed pass must fill exactly as the straight run did
                todo, bufs, seen = list(plan(e)), {}, {}
            bufs.setdefault(b, []).append((block, i))
            last = seen.setdefault(b, [])  # the bucket's latest rows: what a short one repeats
            last.append((block, i))
            if len(last) > batch_size:
                last.pop(0)
            yield from ready()
    yield from finish()


def sequence_digest(buckets: list) -> str:
    """A short digest of a rank's bucket per step (``metrics.jsonl``'s ``bucket``)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(buckets).encode()).hexdigest()[:16]


def _draw(pool: list, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    picks = sorted(rng.choice(len(pool), n, replace=False).tolist(), reverse=True)
    rows = [pool[j] for j in picks]
    for j in picks:  # swap-remove, largest index first
        pool[j] = pool[-1]
        pool.pop()
    return {k: stack_rows(k, [blk[k][r] for blk, r in rows])
            for k in rows[0][0] if k not in ("epoch",)}
