"""Image and caption transforms: plain functions plus one callable stage class.

No Ray imports: ``Preprocess`` is a callable class that tests and the held-out encoder call
directly; Ray Data runs it through ``preprocess_batch``, a function (so Ray tasks, not
actors) that keeps one ``Preprocess`` per process.
"""

from __future__ import annotations

from collections import OrderedDict

from dataclasses import dataclass

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
    resolution: int | tuple[int, int],
    center_crop: bool,
    random_flip: bool,
    rng: np.random.Generator,
) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """``transform_image`` as uint8 ``[3, H, W]`` (0-255), plus what SDXL is conditioned
    on: the original ``(h, w)`` and the crop's ``(top, left)`` in the resized image,
    measured in the flipped image when flipped (as diffusers' SDXL script does: flip, then
    crop). ``resolution``: the square's side, or a bucket ``(width, height)``: the image
    is resized to cover it (aspect kept) and cropped to it."""
    return transform_sample(img, None, resolution, center_crop, random_flip, rng)[:3]


@dataclass(frozen=True)
class View:
    """Where a training crop comes from: the image resized to ``size`` ``(w, h)``, cut at
    ``(top, left)`` to ``crop`` ``(w, h)``, then flipped horizontally or not. Drawn once
    per sample, so an image and its mask get the same one."""

    size: tuple[int, int]
    top: int
    left: int
    crop: tuple[int, int]
    flip: bool


def draw_view(width: int, height: int, resolution: int | tuple[int, int], center_crop: bool,
              random_flip: bool, rng: np.random.Generator) -> View:
    """The crop (and flip) of a ``width`` × ``height`` image: the random draws, in the
    order they have always been made (crop offset, then flip)."""
    from raylora.data.buckets import cover_crop_box

    bw, bh = (resolution, resolution) if isinstance(resolution, int) else resolution
    (nw, nh), (top, left) = cover_crop_box(width, height, (bw, bh), center_crop, rng)
    return View((nw, nh), top, left, (bw, bh), bool(random_flip and rng.random() < 0.5))


def apply_view(img: Image.Image, view: View) -> np.ndarray:
    """``img`` resized, cropped and flipped as ``view`` says: uint8 ``[H, W, C]`` (``[H,
    W]`` for a one-channel image)."""
    if view.size != img.size:
        img = img.resize(view.size, Image.Resampling.BILINEAR)
    (bw, bh), top, left = view.crop, view.top, view.left
    arr = np.asarray(img.crop((left, top, left + bw, top + bh)), dtype=np.uint8)
    return arr[:, ::-1] if view.flip else arr


def transform_sample(
    img: Image.Image,
    mask: Image.Image | None,
    resolution: int | tuple[int, int],
    center_crop: bool,
    random_flip: bool,
    rng: np.random.Generator,
    controls: list[Image.Image] | None = None,
) -> tuple[np.ndarray, tuple[int, int], tuple[int, int], np.ndarray | None, list[np.ndarray] | None]:
    """``transform_image_coords`` plus the image's loss ``mask`` (an "L" image of its
    size, or None) through the same view: uint8 ``[1, H, W]`` (255: full weight), or
    None; and its ``controls`` (control images of its size, one per input, or None)
    likewise: uint8 ``[3, H, W]`` each, cut exactly where the image is, so an edit
    sample's images stay aligned pixel for pixel."""
    img = img.convert("RGB")
    w, h = img.size
    view = draw_view(w, h, resolution, center_crop, random_flip, rng)
    arr = apply_view(img, view)
    left = view.size[0] - view.crop[0] - view.left if view.flip else view.left
    pixels = np.ascontiguousarray(arr.transpose(2, 0, 1))
    masked = None if mask is None else np.ascontiguousarray(apply_view(mask, view)[None])
    paired = None if controls is None else [
        np.ascontiguousarray(apply_view(c.convert("RGB"), view).transpose(2, 0, 1))
        for c in controls]
    return pixels, (h, w), (view.top, left), masked, paired


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


@dataclass(frozen=True)
class StageSpec:
    """What a ``Preprocess`` stage is built from (plain values: Ray Data pickles it to its
    tasks and actors). ``tokenizer_specs``: the model's tokenizers as
    ``raylora.data.tokenize`` specs, made by the driver (what Ray Data's tasks get: no
    transformers import, no model download here); without them they are read from
    ``tokenizer_path``. ``caption_policies``: per source (``raylora.data.captions``), for rows
    with a ``source`` column; default: ``caption_dropout`` for every row. ``buckets``: a
    ``raylora.data.buckets.BucketSet`` (data.bucketing): each image is cropped to its bucket,
    ``pixel_values`` is then a 1-D object array of ``[3, H, W]`` arrays and a ``bucket``
    column (int32, the bucket's id) is added. ``masks`` (data.masked_loss): each row's
    loss mask (a ``mask`` column of encoded images, or the image's alpha) goes through
    the image's crop into a ``loss_mask`` column, uint8 ``[B, 1, H, W]`` (all 255 for a row
    without one); a mask that does not fit is a ``bad_mask`` row. ``controls``
    (data.control_images): each row's control images (``control_inputs`` of them: the
    ``control``, ``control_2``, ... columns of encoded images) go through the image's crop
    into ``control_values``, ``control_values_2``, ... columns, shaped and bucketed as
    ``pixel_values``; a row without any one of them is a ``missing_control`` row."""

    tokenizer_path: str
    resolution: int
    center_crop: bool
    random_flip: bool
    image_column: str = "image"
    caption_column: str = "text"
    seed: int = 0
    endpoint_url: str | None = None
    region: str | None = None
    caption_dropout: float = 0.0
    empty_caption: str = ""  # what a dropped caption becomes: the family's (Family.empty_caption)
    family: str = "sd"
    max_image_pixels: int = 178_956_970
    min_size: int = 0
    small_images: str = "skip"
    background_color: tuple[int, int, int] = (255, 255, 255)
    bad_records: str | None = None
    tokenizer_specs: tuple | None = None
    max_sequence_length: int | None = None
    revision: str | None = None  # of a hub model's tokenizers: model.revision (pinned)
    system_prompt: str | None = None  # model.system_prompt: the captions' template's
    caption_policies: tuple | None = None
    # False (the latent cache): captions are encoded as read. Dropout is drawn per step
    # at training (raylora.data.cache.drop_cached_captions); drawn here too it would be
    # baked into the cache: those rows never see their caption, the rest drop at p again.
    caption_draws: bool = True
    buckets: object = None
    masks: bool = False
    controls: bool = False
    control_inputs: int = 1


STAGE_PURPOSES = ("train", "cache", "heldout", "class")


def stage_kwargs(purpose: str, data, *, model_path: str, family: str, storage,
                 max_sequence_length: int | None = None, tokenizer_specs: tuple | None = None,
                 seed: int = 0, bad_records: str | None = None, revision: str | None = None,
                 system_prompt: str | None = None, heldout_resolution: int | None = None) -> dict:
    """``StageSpec`` fields for one of the run's four preprocess stages, from the run's
    ``data`` section (plain values: Ray Data passes them to its tasks as kwargs). What
    they share (decode limits, tokenizers, size, storage) is set once here, so the
    stages cannot drift apart; they differ where their images are used differently:

    - ``train``: the configured crop and flip, caption dropout and per-source caption
      policies, buckets, loss masks, bad rows counted under ``bad_records``;
    - ``cache`` (latents encoded once, reused every epoch): centre crop, no flip, buckets
      and masks as training (random crops, flips and tag shuffling are refused with a
      cache: raylora.data.cache); captions encoded as read, blank ones kept for dropout
      as the family's empty prompt (dropout is drawn per step at training);
    - ``heldout`` (the evaluation batch, uncached and encoded for the latent cache alike):
      centre crop, no flip, one square size (``heldout_resolution``: validation.resolution,
      default the largest data.resolution), no masks; captions as written, a blank one a
      ``missing_caption`` row whatever the dropout, so every run and trial scores the same
      rows (the driver reads only rows this stage keeps: raylora.data.split);
    - ``class`` (prior preservation): the configured crop and flip; class prompts as
      given (no dropout or prefixes); masks when the instance rows have them, so the two
      halves of a batch have the same columns (buckets are refused with prior).

    Control images (data.control_images, data.control_inputs of them) go with every
    stage but ``class`` (refused with prior): the denoiser of an edit model takes them
    with every sample, held-out ones too."""
    from raylora.data.buckets import bucket_set
    from raylora.data.captions import caption_policies

    if purpose not in STAGE_PURPOSES:
        raise ValueError(f"preprocess stage {purpose!r}: expected one of {STAGE_PURPOSES}")
    kw = dict(
        tokenizer_path=model_path, family=family,
        resolution=heldout_resolution if purpose == "heldout" and heldout_resolution
        else data.max_resolution(),
        endpoint_url=storage.endpoint_url, region=storage.region,
        max_sequence_length=max_sequence_length, tokenizer_specs=tokenizer_specs,
        revision=revision, system_prompt=system_prompt, center_crop=True, random_flip=False,
        seed=seed, **data.decode_kwargs(),
    )
    if purpose in ("train", "class"):
        kw.update(center_crop=data.center_crop, random_flip=data.random_flip)
    if purpose in ("train", "cache"):
        from raylora.model import families

        # The policies' dropout also keeps rows with a blank caption, as the empty prompt.
        kw.update(caption_policies=caption_policies(data), buckets=bucket_set(data),
                  empty_caption=families.get(family).empty_caption,
                  caption_draws=purpose == "train")
    if purpose == "train":
        kw.update(caption_dropout=data.caption_dropout, bad_records=bad_records)
    if purpose != "heldout":
        kw.update(masks=data.masked_loss)
    if purpose != "class":
        kw.update(controls=data.control_images, control_inputs=data.control_inputs)
    return kw


class Preprocess:
    """Batch stage: ``{image, caption}`` columns → ``{pixel_values, input_ids, ...}``: pixels
    uint8 ``[B, 3, R, R]`` (scaled by ``to_unit_range`` where the VAE takes them), token ids
    (and masks) under the columns the model family's text inputs name (``input_ids``,
    ``input_ids_2``, ``attention_mask``, ...), and each image's ``original_size``,
    ``crop_top_left`` and ``target_size`` ``[B, 2]`` (SDXL's micro-conditioning)."""

    def __init__(self, spec: StageSpec):
        from raylora.data.captions import CaptionPolicy
        from raylora.data.tokenize import CaptionTokenizer, load_specs

        tokenizer_specs = spec.tokenizer_specs
        if not tokenizer_specs:
            from raylora.storage import Storage

            tokenizer_specs = load_specs(spec.tokenizer_path, spec.family,
                                         Storage(spec.endpoint_url, spec.region), spec.max_sequence_length,
                                         spec.revision,
                                         references=spec.control_inputs if spec.controls else 0,
                                         system_prompt=spec.system_prompt)
        # Column names come with the specs: no import of the model families (and torch).
        self.keys = [(s.ids_key, s.mask_key) for s in tokenizer_specs]
        self.encoders = [CaptionTokenizer(s) for s in tokenizer_specs]
        self.resolution = spec.resolution
        self.buckets = spec.buckets
        self.center_crop = spec.center_crop
        self.random_flip = spec.random_flip
        self.image_column = spec.image_column
        self.caption_column = spec.caption_column
        self.rng = np.random.default_rng(spec.seed)
        self.policies = tuple(spec.caption_policies or (CaptionPolicy(spec.caption_dropout),))
        self.empty_caption = spec.empty_caption
        self.caption_draws = spec.caption_draws
        self.decode = dict(
            max_pixels=spec.max_image_pixels, min_size=spec.min_size, small_images=spec.small_images,
            background=tuple(spec.background_color),
        )
        from raylora.data.badrecords import Reporter

        self.reporter = Reporter(spec.bad_records)
        self.masks = spec.masks
        self.controls = spec.controls
        from raylora.config import control_key

        # The rows' control columns and the batch's (control_values, ...): one per input
        inputs = spec.control_inputs if spec.controls else 0
        self.control_names = [control_key("control", i) for i in range(inputs)]
        self.control_outputs = [control_key("control_values", i) for i in range(inputs)]

    def text_columns(self, captions: list[str]) -> dict[str, np.ndarray]:
        """Captions → the token columns (ids, masks) of every text encoder."""
        out = {}
        for (ids_key, mask_key), enc in zip(self.keys, self.encoders):
            ids, mask = enc.encode(captions)
            out[ids_key] = ids
            if mask_key:
                out[mask_key] = mask
        return out

    def _decode(self, image, text, mask, controls: list | None, src: int):
        """One row → (RGB image, caption, "L" mask or None, RGB control images or None),
        or ``BadRecord``."""
        from raylora.data.decode import open_masked_row, to_rgb

        # Caption dropout trains on the empty prompt anyway: a blank caption is kept. One of
        # a row's several captions is drawn from the stage's generator, per read (before
        # the row's crop and flip; rows of one caption draw nothing for it).
        img, caption, loss_mask, paired = open_masked_row(
            image, text, mask, masks=self.masks,
            **{k: v for k, v in self.decode.items() if k != "background"},
            keep_empty_captions=self.policies[src].dropout > 0, controls=controls,
            rng=self.rng)
        background = self.decode["background"]
        return (to_rgb(img, background), caption, loss_mask,
                None if paired is None else [to_rgb(c, background) for c in paired])

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from collections import Counter

        from raylora.data.captions import apply_policies
        from raylora.data.decode import BadRecord

        out, captions, kept, bad, examples, ids = [], [], [], Counter(), {}, []
        images, texts = batch[self.image_column], batch[self.caption_column]
        masks = batch.get("mask") if self.masks else None
        # A batch without an input's column: every row lacks it (missing_control)
        controls = [batch.get(name) for name in self.control_names]
        where = batch.get("key", batch.get("path"))
        sources = batch.get("source")
        for i, (image, text) in enumerate(zip(images, texts)):
            src = 0 if sources is None else int(sources[i])
            try:
                img, caption, mask, control = self._decode(
                    image, text, None if masks is None else masks[i],
                    [None if c is None else c[i] for c in controls] if self.controls else None,
                    src)
            except BadRecord as exc:
                # Dropped and counted, never fatal here: whether the run may go on is
                # decided on the totals (data.max_bad_fraction).
                bad[exc.reason] += 1
                loc = str(where[i]) if where is not None else "row"
                examples.setdefault(exc.reason, []).append(f"{loc}: {exc}"[:200])
                continue
            size = self.resolution
            if self.buckets is not None:
                bucket = self.buckets.assign(img.size[0], img.size[1], src)
                size = self.buckets.sizes[bucket]
                ids.append(bucket)
            out.append(transform_sample(img, mask, size, self.center_crop, self.random_flip,
                                        self.rng, control))
            # A blank caption kept for dropout is the family's empty prompt (Qwen-Image's
            # is " "), the unconditional input it samples with, not a third one.
            captions.append(caption or self.empty_caption)
            kept.append(src)
        # Rows kept per source: the run's per-source counts (raylora.json data.sources).
        by_source = {} if sources is None else {"by_source": dict(Counter(kept))}
        self.reporter.send(len(out), bad, examples, **by_source)
        if self.caption_draws:
            captions = apply_policies(captions, [self.policies[s] for s in kept], self.rng,
                                      self.empty_caption)
        result = {"pixel_values": self._pixels([o[0] for o in out]),
                  **self.text_columns(captions)}
        result["original_size"] = np.array([o[1] for o in out], dtype=np.int64).reshape(-1, 2)
        result["crop_top_left"] = np.array([o[2] for o in out], dtype=np.int64).reshape(-1, 2)
        result["target_size"] = np.array([o[0].shape[-2:] for o in out], dtype=np.int64).reshape(-1, 2)
        if self.masks:
            result["loss_mask"] = self._pixels([
                o[3] if o[3] is not None else np.full((1, *o[0].shape[-2:]), 255, np.uint8)
                for o in out], channels=1)
        for j, name in enumerate(self.control_outputs):
            result[name] = self._pixels([o[4][j] for o in out])
        if self.buckets is not None:
            result["bucket"] = np.array(ids, dtype=np.int32)
        return result

    def _pixels(self, images: list[np.ndarray], channels: int = 3) -> np.ndarray:
        """The batch's pixels (or masks): stacked ``[B, channels, R, R]``; with buckets, a
        1-D object array (rows of several buckets: Ray Data keeps it as a variable-shaped
        tensor column)."""
        if self.buckets is not None:
            pixels = np.empty(len(images), dtype=object)
            for i, a in enumerate(images):
                pixels[i] = a
            return pixels
        r = self.resolution
        # every row of the batch bad: an empty batch of the right shapes
        return np.stack(images) if images else np.zeros((0, channels, r, r), np.uint8)


# Preprocess stages built in this process, by their arguments (most recent last). Ray Data
# re-creates an actor pool on every epoch: a new process per actor, paying its imports and
# the tokenizer load again (15-20 s to the first batch of each epoch on 2 cores with the
# actor pool, bench/ingest.py). Ray keeps task worker processes between tasks, so a stage
# cached here mostly survives across epochs; a few are kept for processes shared by Tune
# trials. (sharding=files still uses an actor per epoch: see source.build_dataset.)
_STAGES: OrderedDict[tuple, Preprocess] = OrderedDict()
_MAX_STAGES = 4


def preprocess_batch(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    """``Preprocess(StageSpec(**kwargs))(batch)`` with the stage built once per process."""
    key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
    stage = _STAGES.get(key)
    if stage is None:
        stage = _STAGES[key] = Preprocess(StageSpec(**kwargs))
        while len(_STAGES) > _MAX_STAGES:
            _STAGES.popitem(last=False)
    else:
        _STAGES.move_to_end(key)
    return stage(batch)
