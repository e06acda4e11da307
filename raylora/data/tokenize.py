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

import os
import tempfile
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a stage needs to tokenize as the model's tokenizer does (plain data, so
    it pickles small and its repr is stable)."""

    backend_json: str
    max_length: int
    pad_id: int
    pad_token: str

    def __repr__(self) -> str:  # the JSON is megabytes; a digest names it
        import hashlib

        digest = hashlib.sha256(self.backend_json.encode()).hexdigest()[:16]
        return f"TokenizerSpec({digest}, {self.max_length}, {self.pad_id}, {self.pad_token!r})"


def spec_from_tokenizer(tok) -> TokenizerSpec:
    """From a loaded transformers fast tokenizer."""
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{type(tok).__name__} has no fast (tokenizers) backend")
    return TokenizerSpec(tok.backend_tokenizer.to_str(), int(tok.model_max_length),
                         int(tok.pad_token_id), str(tok.pad_token))


def load_specs(model_path: str, family: str, store) -> tuple[TokenizerSpec, ...]:
    """The model's tokenizer (SDXL: both) as specs. A model in object storage has only its
    small tokenizer folders copied, to a temporary folder, not the whole model."""
    from transformers import AutoTokenizer

    from raylora import storage as st
    from raylora.model.load import is_hub_id

    subfolders = ["tokenizer", "tokenizer_2"] if family == "sdxl" else ["tokenizer"]
    if st.is_local(model_path) or is_hub_id(model_path):
        return tuple(spec_from_tokenizer(AutoTokenizer.from_pretrained(model_path, subfolder=s))
                     for s in subfolders)
    with tempfile.TemporaryDirectory(prefix="raylora-tok-") as tmp:
        for s in subfolders:
            store.download_dir(f"{model_path.rstrip('/')}/{s}", os.path.join(tmp, s))
        return tuple(spec_from_tokenizer(AutoTokenizer.from_pretrained(tmp, subfolder=s))
                     for s in subfolders)


class CaptionTokenizer:
    """``tokenizer(captions, padding="max_length", truncation=True,
    max_length=model_max_length).input_ids`` as int64 ``[B, max_length]``."""

    def __init__(self, spec: TokenizerSpec):
        from tokenizers import Tokenizer

        self.model_max_length = spec.max_length
        self.backend = Tokenizer.from_str(spec.backend_json)
        self.backend.enable_truncation(spec.max_length)
        self.backend.enable_padding(length=spec.max_length, pad_id=spec.pad_id, pad_token=spec.pad_token)

    def __call__(self, captions: list[str]) -> np.ndarray:
        out = self.backend.encode_batch(list(captions), add_special_tokens=True)
        return np.array([e.ids for e in out], dtype=np.int64).reshape(len(out), self.model_max_length)
