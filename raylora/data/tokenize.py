"""Captions → token ids with the ``tokenizers`` library alone, in preprocessing processes.

A fresh Ray worker process that gets its first preprocess task builds its stage; importing
transformers for ``AutoTokenizer`` was 2.7-3.5 s of that on 2 cores (bench/ingest.py), paid
again by every new process, every run. The driver, which has transformers loaded anyway,
reads the model's tokenizer once and ships its fast (Rust) backend as JSON with the padding
and truncation ``padding="max_length", truncation=True`` asks for; the stage rebuilds it
with ``tokenizers`` only. ``tests/test_transforms.py`` checks the ids equal transformers'.
No Ray here.
"""

from __future__ import annotations

import html
import os
import re
import tempfile
from dataclasses import dataclass

import numpy as np

# TextInput.instruction's mark (raylora.model.families.base.DROPPED; not imported from
# there, which would import torch into every preprocess process).
DROPPED = 2


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a stage needs to tokenize as the model's tokenizer does (plain data, so
    it pickles small and its repr is stable): the backend, the length every caption is
    padded/truncated to, the family's caption template and whether the mask is kept."""

    backend_json: str
    max_length: int
    pad_id: int
    pad_token: str
    template: str = "{}"
    # The batch columns of the ids and (for an encoder that takes it) the attention mask:
    # the family's, so a preprocess process needs no import of the model families, hence
    # none of torch (seconds per process).
    ids_key: str = "input_ids"
    mask_key: str | None = None
    clean: bool = False  # clean_prompt each caption first, as the family's pipeline does
    special_tokens: bool = True  # the tokenizer's own (bos/eos) added around each caption
    # The sides captions are padded (the family's TextInput.padding_side) and truncated on
    # (the tokenizer's truncation_side, as the pipeline's call truncates).
    padding_side: str = "right"
    truncation_side: str = "right"
    remove: tuple[str, ...] = ()  # deleted from each caption first, as the pipeline does
    bare_empty: bool = False  # an empty caption skips the template (TextInput.template_empty)
    lower: bool = False  # each caption lower-cased and stripped first (TextInput.lower)
    # Instruction tokens after the first that the conditioning drops (TextInput.instruction):
    # marked DROPPED in the mask of every templated caption.
    dropped: int = 0

    @property
    def mask(self) -> bool:
        return self.mask_key is not None

    def __repr__(self) -> str:  # the JSON is megabytes; a digest names it
        import hashlib

        digest = hashlib.sha256(self.backend_json.encode()).hexdigest()[:16]
        # Only what differs from the defaults: the repr is part of the latent cache's
        # fingerprint, which stays the same for tokenizers that tokenized the same before.
        extra = "".join([", clean" if self.clean else "",
                         ", no special tokens" if not self.special_tokens else "",
                         f", pad {self.padding_side}" if self.padding_side != "right" else "",
                         f", truncate {self.truncation_side}" if self.truncation_side != "right" else "",
                         f", remove {list(self.remove)}" if self.remove else "",
                         ", bare empty" if self.bare_empty else "",
                         ", lower" if self.lower else "",
                         f", drop {self.dropped}" if self.dropped else ""])
        return (f"TokenizerSpec({digest}, {self.max_length}, {self.pad_id}, {self.pad_token!r}, "
                f"{self.template!r}, {self.mask}{extra})")


def spec_from_tokenizer(tok, text=None, max_sequence_length: int | None = None) -> TokenizerSpec:
    """From a loaded transformers fast tokenizer; ``text``: the family's ``TextInput`` for
    it (template, length, mask), default the tokenizer's own length and no template."""
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{type(tok).__name__} has no fast (tokenizers) backend")
    length = text.length(int(tok.model_max_length), max_sequence_length) if text else int(tok.model_max_length)
    dropped = _instruction_drop(tok, text)
    return TokenizerSpec(tok.backend_tokenizer.to_str(), length + dropped, int(tok.pad_token_id),
                         str(tok.pad_token), text.template if text else "{}",
                         text.ids_key if text else "input_ids", text.mask_key if text else None,
                         bool(text and text.clean), text.special_tokens if text else True,
                         _padding_side(tok, text), str(tok.truncation_side),
                         tuple(text.remove) if text else (),
                         bool(text and not text.template_empty), bool(text and text.lower), dropped)


def _instruction_drop(tok, text) -> int:
    """Tokens of ``text``'s instruction (its template before the caption) that the
    conditioning drops, SanaPipeline's count: the instruction's tokens with the
    tokenizer's special ones, less the first and the last, which it keeps."""
    if not (text and text.instruction):
        return 0
    instruction = text.template.format("")
    return max(len(tok.encode(instruction)) - 2, 0) if instruction else 0


def _padding_side(tok, text) -> str:
    side = text.padding_side if text else "right"
    return str(tok.padding_side) if side is None else side


def load_specs(model_path: str, family: str, store, max_sequence_length: int | None = None,
               revision: str | None = None, references: int = 0,
               system_prompt: str | None = None) -> tuple[TokenizerSpec, ...]:
    """The model's tokenizers, in the family's order, as specs (a hub model's at
    ``revision``: ``model.revision``, the run's pinned commit), for captions of samples
    with ``references`` input images (data.control_inputs) behind ``system_prompt``
    (model.system_prompt; ``Family.texts``). A model in
    object storage has only its small tokenizer folders copied, to a temporary folder, not
    the whole model."""
    from transformers import AutoTokenizer

    from raylora import storage as st
    from raylora.model import families
    from raylora.model.load import is_hub_id

    texts = families.get(family).texts(references, system_prompt)

    def specs(root: str) -> tuple[TokenizerSpec, ...]:
        return tuple(spec_from_tokenizer(AutoTokenizer.from_pretrained(root, subfolder=t.tokenizer,
                                                                       revision=revision),
                                         t, max_sequence_length) for t in texts)

    if st.is_local(model_path) or is_hub_id(model_path):
        return specs(model_path)
    with tempfile.TemporaryDirectory(prefix="raylora-tok-") as tmp:
        for t in texts:
            store.download_dir(f"{model_path.rstrip('/')}/{t.tokenizer}", os.path.join(tmp, t.tokenizer))
        return specs(tmp)


def clean_prompt(text: str) -> str:
    """WanPipeline's ``prompt_clean``, which it applies to every prompt before tokenizing:
    ftfy's ``fix_text`` when ftfy is installed, HTML entities unescaped (twice), whitespace
    runs made one space, the ends stripped."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class CaptionTokenizer:
    """``tokenizer([template.format(c) for c in captions], padding="max_length",
    truncation=True, max_length=max_length)`` → int64 ids ``[B, max_length]`` (and, for a
    spec with ``mask``, the attention mask: ``mask(captions)``)."""

    def __init__(self, spec: TokenizerSpec):
        from tokenizers import Tokenizer

        self.model_max_length = spec.max_length
        self.template = spec.template
        self.clean = spec.clean
        self.special_tokens = spec.special_tokens
        self.remove = spec.remove
        self.bare_empty = spec.bare_empty
        self.lower = spec.lower
        self.dropped = spec.dropped
        self.backend = Tokenizer.from_str(spec.backend_json)
        self.backend.enable_truncation(spec.max_length, direction=spec.truncation_side)
        self.backend.enable_padding(length=spec.max_length, pad_id=spec.pad_id, pad_token=spec.pad_token,
                                    direction=spec.padding_side)

    def encode(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, attention mask), both int64 ``[B, max_length]``."""
        if self.clean:
            captions = [clean_prompt(c) for c in captions]
        for s in self.remove:
            captions = [c.replace(s, "") for c in captions]
        if self.lower:
            captions = [c.lower().strip() for c in captions]
        bare = [self.bare_empty and c == "" for c in captions]
        texts = [c if b else self.template.format(c) for c, b in zip(captions, bare)]
        out = self.backend.encode_batch(texts, add_special_tokens=self.special_tokens)
        shape = (len(out), self.model_max_length)
        ids = np.array([e.ids for e in out], dtype=np.int64).reshape(shape)
        mask = np.array([e.attention_mask for e in out], dtype=np.int64).reshape(shape)
        if self.dropped:
            # 1 + dropped ≤ max_length: the instruction's own tokens precede the caption's.
            templated = ~np.array(bare, dtype=bool)
            mask[templated, 1:1 + self.dropped] = DROPPED
        return ids, mask

    def __call__(self, captions: list[str]) -> np.ndarray:
        return self.encode(captions)[0]
