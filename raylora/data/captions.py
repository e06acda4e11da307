"""What happens to a caption between its file and the tokenizer: a source's trigger-word
prefix (fixed: applied where rows are read, so the latent cache encodes it), then, per
read, caption dropout and tag shuffling (random: applied in the preprocess stage, from
its seeded generator, so ``data.sharding=files`` repeats them exactly on resume).

Tags are the comma-separated parts of a caption, as kohya-ss writes and shuffles them:
``keep_tokens`` first tags stay in place (the trigger word, once prefixed, is the first),
the rest are shuffled, and the caption is joined again with ", ".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raylora.data.formats import NOT_UTF8


@dataclass(frozen=True)
class CaptionPolicy:
    """One source's random caption treatment (``raylora.config.DataSection`` keys)."""

    dropout: float = 0.0  # probability of the empty prompt instead
    shuffle_tags: bool = False
    keep_tokens: int = 0  # tags kept in place at the front when shuffling


def caption_policies(data) -> tuple[CaptionPolicy, ...]:
    """Each source's policy (by its place in ``data.sources``; one for ``data.uri``)."""
    return tuple(CaptionPolicy(s.caption_dropout, s.shuffle_tags, s.keep_tokens)
                 for s in data.source_sections())


def with_prefix(prefix: str, text: str | None) -> str | None:
    """``prefix`` as the caption's first tag: ``"sks"`` + ``"a dog"`` → ``"sks, a dog"``
    (a trailing comma on the prefix is not doubled). A row without a caption keeps none:
    it is a missing_caption row, not one captioned with the trigger word alone."""
    prefix = prefix.strip().rstrip(",").strip()
    if not prefix or text is None or not text.strip() or text.startswith(NOT_UTF8):
        return text
    return f"{prefix}, {text}"


def shuffle_tags(text: str, keep_tokens: int, rng: np.random.Generator) -> str:
    """The caption's comma-separated tags after the first ``keep_tokens`` in a random
    order; blank tags dropped."""
    tags = [t.strip() for t in text.split(",")]
    tags = [t for t in tags if t]
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
