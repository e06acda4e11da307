"""Image and caption transforms: plain functions plus one callable stage class.

No Ray imports: ``Preprocess`` is a callable class that tests and the held-out encoder call
directly; Ray Data runs it through ``preprocess_batch``, a function (so Ray tasks, not
actors) that keeps one ``Preprocess`` per process.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from PIL import Image


def transform_image(
    img: Image.Image,
    resolution: int,
    center_crop: bool,
    random_flip: bool,
    rng: np.random.Generator,
) -> np.ndarray:
    """RGB, shorter side resized to ``resolution``, square crop, optional h-flip.

    Returns float32 ``[3, resolution, resolution]`` in [-1, 1] (what the VAE expects).
    """
    return to_unit_range(transform_image_coords(img, resolution, center_crop, random_flip, rng)[0])


def to_unit_range(pixels):
    """uint8 pixels (numpy or torch) → float32 in [-1, 1], the VAE's input range.

    The data stage ships uint8 (a quarter of float32's bytes through Ray's object store and
    to the accelerator); this is the one place they are scaled, in float32 whatever the
    model dtype, so the result is the same as scaling in the stage was."""
    return pixels.astype(np.float32) / 127.5 - 1.0 if isinstance(pixels, np.ndarray) \
        else pixels.float() / 127.5 - 1.0


def transform_image_coords(
    img: Image.Image,
    resolution: int,
    center_crop: bool,
    random_flip: bool,
    rng: np.random.Generator,
) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """``transform_image`` as uint8 ``[3, resolution, resolution]`` (0-255), plus what SDXL
    is conditioned on: the original ``(h, w)`` and the crop's ``(top, left)`` in the resized
    image, measured in the flipped image when flipped (as diffusers' SDXL script does:
    flip, then crop)."""
    img = img.convert("RGB")
    w, h = img.size
    scale = resolution / min(w, h)
    # round() not int(): 511.9999 must become 512, never leave the crop short of a pixel.
    nw, nh = max(resolution, round(w * scale)), max(resolution, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    if center_crop:
        left, top = (nw - resolution) // 2, (nh - resolution) // 2
    else:
        left = int(rng.integers(0, nw - resolution + 1))
        top = int(rng.integers(0, nh - resolution + 1))
    img = img.crop((left, top, left + resolution, top + resolution))
    arr = np.asarray(img, dtype=np.uint8)
    if random_flip and rng.random() < 0.5:
        arr = arr[:, ::-1, :]
        left = nw - resolution - left
    return np.ascontiguousarray(arr.transpose(2, 0, 1)), (h, w), (top, left)


def tokenize(tokenizer, captions: list[str]) -> np.ndarray:
    """Pad/truncate to the tokenizer's max length: int64 ``[B, model_max_length]``."""
    ids = tokenizer(
        list(captions),
        padding="max_length",
        truncation=True,
        max_length=tokenizer.model_max_length,
        return_tensors="np",
    ).input_ids
    return ids.astype(np.int64)


class _Tokenize:
    """``tokenize`` bound to a transformers tokenizer (the form of ``CaptionTokenizer``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_max_length = tokenizer.model_max_length

    def __call__(self, captions: list[str]) -> np.ndarray:
        return tokenize(self.tokenizer, captions)


class Preprocess:
    """Batch stage: ``{image, caption}`` columns → ``{pixel_values, input_ids}`` (pixels
    uint8 ``[B, 3, R, R]``, scaled by ``to_unit_range`` where the VAE takes them), plus
    ``input_ids_2``, ``original_size`` and ``crop_top_left`` for SDXL (two tokenizers)."""

    def __init__(
        self,
        tokenizer_path: str,
        resolution: int,
        center_crop: bool,
        random_flip: bool,
        image_column: str = "image",
        caption_column: str = "text",
        seed: int = 0,
        tokenizer_subfolder: str | None = "tokenizer",
        endpoint_url: str | None = None,
        region: str | None = None,
        caption_dropout: float = 0.0,
        family: str = "sd",
        max_image_pixels: int = 178_956_970,
        min_size: int = 0,
        small_images: str = "skip",
        background_color: tuple[int, int, int] = (255, 255, 255),
        bad_records: str | None = None,
        tokenizer_specs: tuple | None = None,
    ):
        """``tokenizer_specs``: the model's tokenizer(s) as ``raylora.data.tokenize`` specs,
        made by the driver (what Ray Data's tasks get: no transformers import, no model
        download here); without them the tokenizer is loaded from ``tokenizer_path``."""
        self.tokenizer = self.tokenizer_2 = None
        if tokenizer_specs:
            from raylora.data.tokenize import CaptionTokenizer

            if len(tokenizer_specs) != (2 if family == "sdxl" else 1):
                raise ValueError(f"{len(tokenizer_specs)} tokenizer spec(s) for family {family!r}")
            self.encoders = [CaptionTokenizer(s) for s in tokenizer_specs]
        else:
            from transformers import AutoTokenizer

            from raylora.model.load import materialize
            from raylora.storage import Storage

            # A model in object storage is downloaded once per node (shared with the workers).
            tokenizer_path = materialize(tokenizer_path, Storage(endpoint_url, region))
            kwargs = {"subfolder": tokenizer_subfolder} if tokenizer_subfolder else {}
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, **kwargs)
            if family == "sdxl":
                self.tokenizer_2 = AutoTokenizer.from_pretrained(tokenizer_path, subfolder="tokenizer_2")
            self.encoders = [_Tokenize(t) for t in (self.tokenizer, self.tokenizer_2) if t is not None]
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.image_column = image_column
        self.caption_column = caption_column
        self.rng = np.random.default_rng(seed)
        self.caption_dropout = caption_dropout
        self.decode = dict(
            max_pixels=max_image_pixels, min_size=min_size, small_images=small_images,
            keep_empty_captions=caption_dropout > 0, background=tuple(background_color),
        )
        from raylora.data.badrecords import Reporter

        self.reporter = Reporter(bad_records)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from collections import Counter

        from raylora.data.decode import BadRecord, decode_row

        out, captions, bad, examples = [], [], Counter(), {}
        images, texts = batch[self.image_column], batch[self.caption_column]
        where = batch.get("key", batch.get("path"))
        for i, (image, text) in enumerate(zip(images, texts)):
            try:
                img, caption = decode_row(image, text, **self.decode)
            except BadRecord as exc:
                # Dropped and counted, never fatal here: whether the run may go on is
                # decided on the totals (data.max_bad_fraction).
                bad[exc.reason] += 1
                loc = str(where[i]) if where is not None else "row"
                examples.setdefault(exc.reason, []).append(f"{loc}: {exc}"[:200])
                continue
            out.append(transform_image_coords(
                img, self.resolution, self.center_crop, self.random_flip, self.rng))
            captions.append(caption)
        self.reporter.send(len(out), bad, examples)
        sdxl = len(self.encoders) == 2
        if not out:  # every row of the batch was bad: an empty batch of the right shapes
            r, n = self.resolution, self.encoders[0].model_max_length
            empty = {"pixel_values": np.zeros((0, 3, r, r), np.uint8),
                     "input_ids": np.zeros((0, n), np.int64)}
            if sdxl:
                empty.update(input_ids_2=np.zeros((0, self.encoders[1].model_max_length), np.int64),
                             original_size=np.zeros((0, 2), np.int64),
                             crop_top_left=np.zeros((0, 2), np.int64))
            return empty
        if self.caption_dropout:
            # The empty prompt, as the unconditional branch of classifier-free guidance sees
            # it at inference: keeps the adapter usable with guidance.
            drop = self.rng.random(len(captions)) < self.caption_dropout
            captions = ["" if d else c for c, d in zip(captions, drop)]
        result = {
            "pixel_values": np.stack([o[0] for o in out]),
            "input_ids": self.encoders[0](captions),
        }
        if sdxl:
            result["input_ids_2"] = self.encoders[1](captions)
            result["original_size"] = np.array([o[1] for o in out], dtype=np.int64)
            result["crop_top_left"] = np.array([o[2] for o in out], dtype=np.int64)
        return result


# Preprocess stages built in this process, by their arguments (most recent last). Ray Data
# re-creates an actor pool on every epoch: a new process per actor, paying its imports and
# the tokenizer load again (15-20 s to the first batch of each epoch on 2 cores with the
# actor pool, bench/ingest.py). Ray keeps task worker processes between tasks, so a stage
# cached here mostly survives across epochs; a few are kept for processes shared by Tune
# trials. (sharding=files still uses an actor per epoch: see source.build_dataset.)
_STAGES: OrderedDict[tuple, Preprocess] = OrderedDict()
_MAX_STAGES = 4


def preprocess_batch(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    """``Preprocess(**kwargs)(batch)`` with the stage built once per process."""
    key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
    stage = _STAGES.get(key)
    if stage is None:
        stage = _STAGES[key] = Preprocess(**kwargs)
        while len(_STAGES) > _MAX_STAGES:
            _STAGES.popitem(last=False)
    else:
        _STAGES.move_to_end(key)
    return stage(batch)
