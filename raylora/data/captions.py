"""What happens to a caption between its file and the tokenizer: a source's trigger-word
prefix (fixed: applied where rows are read, so the latent cache encodes it), then, per
read, caption dropout and tag shuffling (random: applied in the preprocess stage, from
its seeded generator, so ``data.sharding=files`` repeats them exactly on resume).

Tags are the comma-separated parts of a caption, as kohya-ss writes and shuffles them:
``keep_tokens`` first tags stay in place, and always the trigger word(s) prefixed (the
prefix's tags: ``caption_policies``), the rest are shuffled, and the caption is joined
again with ", ".

An image may have several captions (a parquet ``list<string>`` cell, a metadata.jsonl
``"text": [...]``): each read trains on one of them, drawn in the preprocess stage from
its seeded generator (``pick_caption``), as diffusers' training scripts ``random.choice``
one; the prefix goes on each, dropout and shuffling act on the one drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from raylora.data.formats import NOT_UTF8, decode_text


@dataclass(frozen=True)
class CaptionPolicy:
    """One source's random caption treatment (``raylora.config.DataSection`` keys)."""

    dropout: float = 0.0  # probability of the empty prompt instead
    shuffle_tags: bool = False
    keep_tokens: int = 0  # tags kept in place at the front when shuffling


def caption_policies(data) -> tuple[CaptionPolicy, ...]:
    """Each source's policy (by its place in ``data.sources``; one for ``data.uri``). A
    source's ``caption_prefix`` tags are its trigger word(s), first in every caption (the
    model card says so, its prompt leads with them): shuffling keeps at least them in place,
    ``keep_tokens`` or more (kohya users set keep_tokens=1 for exactly this)."""
    return tuple(CaptionPolicy(s.caption_dropout, s.shuffle_tags,
                               max(s.keep_tokens, len(_tags(s.caption_prefix or ""))))
                 for s in data.source_sections())


# Several captions of one image travel as one string: SEVERAL + their JSON list. Between
# the file and the preprocess stage captions pass through string columns and str() (an
# image folder's rows in Ray Data, the prefix put in by the read stage), and the held-out
# hash and the driver's bucket scan must see the value the stage's split sees.
SEVERAL = "\x00raylora:captions\x00"


def caption_list(value: Any) -> list[str] | None:
    """The captions of a cell that holds several: a list, tuple or numpy array (pyarrow's
    ``list<string>`` as Ray Data hands it over), or ``joined_captions``' string; blank and
    missing ones left out. None for any other value (one caption, or none)."""
    if isinstance(value, str):
        return json.loads(value[len(SEVERAL):]) if value.startswith(SEVERAL) else None
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None
    out = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
           for v in (value.tolist() if isinstance(value, np.ndarray) else value) if v is not None]
    return [c for c in out if c.strip()]


def joined_captions(value: Any) -> Any:
    """A caption cell as the readers pass it on: several captions (``caption_list``) as one
    string (``SEVERAL`` + JSON), one as itself, none as ""; any other value unchanged."""
    captions = caption_list(value)
    if captions is None:
        return value
    if len(captions) < 2:
        return captions[0] if captions else ""
    return SEVERAL + json.dumps(captions, ensure_ascii=False)


def pick_caption(value: Any, rng: np.random.Generator | None) -> Any:
    """``value`` with one caption where it holds several (``caption_list``): drawn from
    ``rng``, one integer draw, only where there are two or more (rows of one caption draw
    nothing: their crops and dropout draw as before); the first without ``rng`` (the
    driver's sample check). "" for a list of none; any other value unchanged."""
    captions = caption_list(value)
    if captions is None:
        return value
    if len(captions) < 2 or rng is None:
        return captions[0] if captions else ""
    return captions[int(rng.integers(len(captions)))]


def with_prefix(prefix: str, text: Any) -> Any:
    """``prefix`` as the caption's first tag: ``"sks"`` + ``"a dog"`` → ``"sks, a dog"``
    (a trailing comma on the prefix is not doubled). A row without a caption keeps none:
    it is a missing_caption row, not one captioned with the trigger word alone. Several
    captions (``caption_list``): each gets it, joined (``joined_captions``): the read
    stage's string column holds them. A binary caption column's bytes are decoded as a
    caption file's are (``decode_text``: not UTF-8 stays marked, a caption_not_utf8 row)."""
    captions = caption_list(text)
    if captions is not None:
        return joined_captions([with_prefix(prefix, c) for c in captions])
    prefix = prefix.strip().rstrip(",").strip()
    if isinstance(text, (bytes, bytearray, memoryview)) and prefix:
        text = decode_text(bytes(text))
    if not prefix or text is None or not text.strip() or text.startswith(NOT_UTF8):
        return text
    return f"{prefix}, {text}"


def _tags(text: str) -> list[str]:
    """The caption's comma-separated tags, blank ones dropped."""
    return [t for t in (t.strip() for t in text.split(",")) if t]


def shuffle_tags(text: str, keep_tokens: int, rng: np.random.Generator) -> str:
    """The caption's comma-separated tags after the first ``keep_tokens`` in a random
    order; blank tags dropped."""
    tags = _tags(text)
    rest = tags[keep_tokens:]
    return ", ".join(tags[:keep_tokens] + [rest[i] for i in rng.permutation(len(rest))])


def apply_policies(captions: list[str], policies: list[CaptionPolicy],
                   rng: np.random.Generator, empty: str = "") -> list[str]:
    """Caption dropout, then tag shuffling, each row by its own policy. Draws from ``rng``
    only for what is on: one draw per row for dropout when any row has it (as a single
    ``data.caption_dropout`` always drew), one permutation per shuffled row."""
    p = np.array([pol.dropout for pol in policies], dtype=np.float64)
    if p.any():
        # ``empty``: the prompt of the unconditional branch of classifier-free guidance as
        # the family samples (Family.empty_caption): keeps the adapter usable with guidance.
        drop = rng.random(len(captions)) < p
        captions = [empty if d else c for c, d in zip(captions, drop)]
    return [shuffle_tags(c, pol.keep_tokens, rng) if pol.shuffle_tags and c.strip() else c
            for c, pol in zip(captions, policies)]


# Caption columns that a language-model text encoder cuts after the longest caption of the
# batch it encodes (Qwen-Image, Z-Image, Lumina 2, Sana: ``llm_conditioning``). Cached rows
# encoded in different batches differ in length there; where they meet (a cache part, a
# training batch, class rows beside instance rows) they are zero-padded to the longest: the
# pipelines pad with zeros past each caption, and the mask says where it ends. In columns
# of one length (every other family) nothing is padded.
PADDED_CAPTIONS = ("prompt_embeds", "prompt_embeds_mask")


def _padded(arrays: list[np.ndarray], axis: int) -> list[np.ndarray]:
    n = max(a.shape[axis] for a in arrays)
    return [a if a.shape[axis] == n else
            np.pad(a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])
            for a in arrays]


def stack_rows(key: str, rows: list) -> np.ndarray:
    """Rows of column ``key`` as one batch array (``np.stack``), a caption column's rows
    zero-padded to the longest (``PADDED_CAPTIONS``)."""
    rows = [np.asarray(r) for r in rows]
    if key in PADDED_CAPTIONS and rows and rows[0].ndim and len({r.shape[0] for r in rows}) > 1:
        rows = _padded(rows, 0)
    return np.stack(rows)


def concat_rows(key: str, parts: list[np.ndarray]) -> np.ndarray:
    """Batch arrays of column ``key`` one after the other (``np.concatenate``), a caption
    column's zero-padded to the longest (``PADDED_CAPTIONS``)."""
    parts = [np.asarray(p) for p in parts]
    if key in PADDED_CAPTIONS and all(p.ndim > 1 for p in parts) and len({p.shape[1] for p in parts}) > 1:
        parts = _padded(parts, 1)
    return np.concatenate(parts)


def cut_captions(batch: dict) -> dict:
    """``batch`` with its ``PADDED_CAPTIONS`` columns cut after its longest caption (the
    last position any row's ``prompt_embeds_mask`` marks), what the family's encoder gives
    these captions encoded together (``Family.cuts_captions``). Cached rows carry the
    padding of the rows they were encoded or stacked with (their encode chunk, cache part,
    the other rows' blocks); cut, a cached batch is the uncached batch: no masked positions
    computed for nothing, and the same prediction where the padded length moves it
    (Qwen-Image 2.1: its transformer places the image after every text position, padding
    included). numpy columns or tensors (read on the host); unchanged without a mask."""
    mask = batch.get("prompt_embeds_mask")
    if mask is None or mask.ndim != 2:
        return batch
    host = mask.cpu().numpy() if hasattr(mask, "cpu") else np.asarray(mask)
    valid = np.flatnonzero(host.any(0))
    n = int(valid[-1]) + 1 if valid.size else 1
    if n == mask.shape[1]:
        return batch
    return {k: (np.ascontiguousarray(v[:, :n]) if isinstance(v, np.ndarray) else v[:, :n])
            if k in PADDED_CAPTIONS else v for k, v in batch.items()}


def numbered(stream, deal: tuple[int, int] | None = None):
    """``(pass, batch)`` → ``(pass, i, batch)``: batch ``i`` of its pass, counted from the
    pass's first batch in this stream. The per-batch draws keyed on it (cached caption
    dropout, prior preservation's class rows) depend on the seed, rank, pass and ``i``
    alone, so a ``data.sharding=files`` run resumed at an epoch repeats the straight run's.
    ``deal=(world, rank)``: the stream is rank's share of one dealt round-robin
    (``global_share``, an elastic run): ``i`` is then the batch's place in the whole pass,
    so its draws are the same at any number of workers."""
    world, rank = deal or (1, 0)
    seen: dict[int, int] = {}
    for epoch, batch in stream:
        i = seen.get(epoch, 0)
        seen[epoch] = i + 1
        yield epoch, i * world + rank, batch


CACHED_DROPOUT_SALT = 0xD50F_CA9E


def drop_cached_captions(stream, empty: dict[str, np.ndarray], p: float, seed: int, rank: int,
                         deal: tuple[int, int] | None = None):
    """Caption dropout over cached rows (data.cache=latents): ``(pass, batch)`` → the same
    with each row's caption columns (``Family.caption_keys``), with probability ``p``,
    those of ``empty``: the family's empty prompt, encoded once by the driver
    (``raylora.data.cache.encode_for_workers``) as the uncached step encodes a
    dropped row's. One draw per row, from the seed, the rank, the pass and the batch's
    index in it alone (``numbered``): a resumed run drops the straight run's rows. An
    elastic run's (``deal``, rank 0): from the batch's place in the whole pass."""
    for epoch, i, batch in numbered(stream, deal):
        n = len(next(iter(batch.values())))
        drop = np.random.default_rng([CACHED_DROPOUT_SALT, seed, rank, epoch, i]).random(n) < p
        if drop.any():
            batch = dict(batch)
            for key, row in empty.items():
                column = np.array(batch[key], copy=True)
                if key in PADDED_CAPTIONS and column.ndim > 1 and row.ndim > 1:
                    column, row = _padded([column, row], 1)  # as long as the longer
                if column.shape[1:] != row.shape[1:] or column.dtype != row.dtype:
                    raise ValueError(
                        f"caption dropout: the cached {key} is {column.dtype} {column.shape[1:]} "
                        f"a row, the empty prompt's {row.dtype} {row.shape[1:]}; rebuild the "
                        "cache (delete its entry under data.cache_uri)")
                column[drop] = row[0]
                batch[key] = column
        yield epoch, batch
