"""``data.cache: latents``: encode every image and caption once, train from parquet.

Encoding is most of a LoRA step's frozen work (VAE encoder on every image, one or two
text encoders on every caption) and it gives the same answer every epoch. The cache runs
it once, as one Ray Data actor stage (``EncodeFiles``, on accelerators where there are
some) over the source shard files: each actor reads a file's rows in order, drops the
held-out split, preprocesses, encodes and writes parquet parts named by the file's
position. Training workers read the parts instead of images, loading neither the VAE nor
the text encoders, in the same row order as uncached training reads the source.

What a cached row holds: ``latent_params`` = the VAE posterior's mean ‖ logvar
(so training still draws a fresh latent sample every step, as uncached training does),
``prompt_embeds``, and for SDXL ``pooled_prompt_embeds`` and ``time_ids``; with
data.masked_loss ``loss_mask`` ``[1, h, w]``, the mask pooled to the latent grid; with
data.control_images ``control_params``, the control image's posterior as ``latent_params``
(training takes its mean, as the uncached step does), and ``control_params_2``, ... for
the other inputs with data.control_inputs > 1. Each
tensor is stored in the dtype it was computed in (``to_column``): a bf16 run's cache is
half an fp32 one's and holds exactly what uncached training would feed the denoiser.

An entry lives at ``{cache_uri}/{fingerprint}/`` and is complete once its
``manifest.json`` exists (written last). The manifest also records what the build decoded
(rows kept, bad rows per reason: ``record_build``): a rerun that reuses the entry decodes
nothing, and is judged on those (data.max_bad_fraction) as the build's run was. The
fingerprint covers the model's encoder files, the precision, the resolution and crop
policy, the held-out split and the data files' names, sizes and mtimes: a rerun or a
Tune trial with the same inputs reuses the entry, and any change makes a new one. Random
crop/flip and tag shuffling are refused by the config (a cache holds one view of each
image and caption). Caption dropout is not: the
driver encodes the family's empty prompt once (``encode_for_workers``) and training swaps
it in for the dropped rows' caption columns (``raylora.data.captions``). The entry's rows
are the same at any rate above 0, but not at 0: with dropout on, a row with no caption is
kept (as the empty prompt, as uncached training keeps it), so the fingerprint says which.
The decode settings that drop rows or change pixels (data.min_size, small_images,
max_image_pixels, background_color) are in it too.

A language-model caption (Qwen-Image, Z-Image, Lumina 2, Sana) is cut after the longest of
the batch it is encoded in, so rows encoded apart differ in length; a part, a training
batch and class rows beside instance rows zero-pad them to the longest
(``raylora.data.captions.PADDED_CAPTIONS``), as the pipelines pad past each caption.
Training then cuts each batch back to its own longest caption (``cut_captions``): the
batch an uncached run encodes for the same rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

import numpy as np

from raylora import storage
from raylora.config import MAX_CONTROL_INPUTS, RayLoraConfig, control_key, control_values
from raylora.data.captions import concat_rows, stack_rows, with_prefix
from raylora.data.formats import MASK_SUFFIX, get_format
from raylora.data.formats.base import CONTROL_INFIX, control_infix
from raylora.data.plan import DataPlan, SourceFiles, apply_shares
from raylora.storage import Storage

log = logging.getLogger("raylora.cache")

# 2: images are decoded upright (EXIF orientation, raylora.data.decode.upright); a version-1
# entry may hold a phone photo's latent sideways, so it is built again.
# 3: a PNG's tRNS colour key is transparency (composited over data.background_color), and
# a turned TIFF or a PNG whose orientation comes after its pixels is sized and turned once:
# a version-2 entry holds such images' latents as the decode made them before.
CACHE_VERSION = 3
MANIFEST = "manifest.json"
# Each build encodes into a folder of its own (BUILD_PREFIX + its start time and a random
# tag), which its manifest names: two runs that start one entry together (README: the two
# Wan 2.2 experts share a cache) each build and train on their own parts, where the second
# deleted the first's half-built parts as a dead build's. The runs after them read the
# manifest written last. A folder no manifest names and in which nothing has changed for
# STALE_BUILD_S is a build that died (or lost that race): the next run of the entry deletes
# it. A live build writes a part every few minutes; a week also covers one waiting for
# GPUs, and a run still training on a build whose manifest another build overwrote.
BUILD_PREFIX = "parts"
STALE_BUILD_S = 7 * 24 * 3600
# A caption folder's images are cached in at least this many parts, or one per worker
# past that (while it has that many images). data.sharding=files deals the cache's parts
# to the workers as it deals the images of an uncached run; runs of up to 256 images made
# a few hundred images one part, which left a second worker none (a bucketed multi-worker
# run was refused after the cache was built).
CAPTIONFOLDER_MIN_PARTS = 64
CACHED_READ_CPUS = 0.25  # per read task of cached rows (no decoding: mostly I/O)


def _inputs(base: str) -> tuple[str, ...]:
    """Every input's column under ``base``: ``control_params``, ``control_params_2``, ..."""
    return tuple(control_key(base, i) for i in range(MAX_CONTROL_INPUTS))


# Columns shaped by the bucket (a variable-shaped tensor column with data.bucketing).
PER_BUCKET = ("latent_params", "loss_mask", *_inputs("control_params"))
# The preprocessed pixel columns a bucket's rows are stacked in for one VAE call.
STACKED = ("pixel_values", "loss_mask", *_inputs("control_values"))


def _dtype_name(cfg: RayLoraConfig) -> str:
    """The encoders' weight dtype (as training would load them), e.g. "bfloat16"."""
    from raylora.train.setup import DTYPES

    return str(DTYPES[cfg.train.mixed_precision]).removeprefix("torch.")


class EncodeStage:
    """Ray Data batch stage: preprocessed pixels + token ids → cached tensors.

    Loads the VAE and text encoder(s) once per actor, on the actor's GPU when it has one.
    """

    def __init__(self, model_path: str, family: str, dtype: str, revision=None, variant=None,
                 endpoint_url=None, region=None, resolution: int | None = None, vae: bool = True):
        import torch

        from raylora.model import families
        from raylora.model.load import load_text_encoders, load_vae, materialize, read_index
        from raylora.config import ModelSection

        path = materialize(model_path, Storage(endpoint_url, region), revision)
        index = read_index(ModelSection(pretrained=path, revision=revision), path)
        weight_dtype = getattr(torch, dtype)
        self.family = families.get(family)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _, self.text_encoders = load_text_encoders(path, self.family, weight_dtype, index, revision, variant)
        # vae=False: captions alone are encoded (caption_columns)
        self.vae = load_vae(path, self.family, weight_dtype, index, revision, variant) if vae else None
        for m in (*self.text_encoders, *([self.vae] if vae else [])):
            m.to(self.device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """→ ``latent_params`` and the family's conditioning columns (fp32 numpy)."""
        import torch

        from raylora.train.encode import batch_condition, vae_posterior

        tensors = {k: torch.from_numpy(np.asarray(v)).to(self.device) for k, v in batch.items()}
        params = vae_posterior(self.family, self.vae, tensors["pixel_values"])
        with torch.no_grad():
            cond = batch_condition(self.family, self.text_encoders, tensors)
        out = {"latent_params": params, **cond}
        # data.control_images: each input's posterior (control_values_2 → control_params_2)
        for i, raw in enumerate(control_values(tensors, "control_values")):
            out[control_key("control_params", i)] = vae_posterior(
                self.family, self.vae, self.family.reference_pixels(raw, self.vae))
        if "loss_mask" in tensors:  # data.masked_loss: stored pooled to the latent grid
            from raylora.train.loss import latent_mask

            out["loss_mask"] = latent_mask(tensors["loss_mask"], params.shape[-2:])
        return {k: to_column(v) for k, v in out.items()}


def to_column(t) -> np.ndarray:
    """A tensor as a cache column, in the dtype it was computed in; bf16 as its bits
    (uint16): neither numpy nor Arrow has a bfloat16. Storing fp32 (as before) doubled a
    bf16 run's cache without adding a bit: Flux.2 [klein]'s 512×7680 caption is 7.5 MiB in
    bf16. ``from_column`` reads it back."""
    import torch

    t = t.detach().cpu()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def from_column(a: np.ndarray):
    """A batch column → tensor; uint16 is ``to_column``'s bf16 (no raw column is uint16:
    pixels are uint8, token ids int64). fp32 caches written before stay fp32."""
    import torch

    t = torch.from_numpy(np.asarray(a))
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t


@dataclass
class CacheEntry:
    uri: str
    files: list[str]
    file_rows: list[int]
    reused: bool
    # Per file: the source its rows came from, and the times they count per epoch (a
    # caption folder's N_name folders): applied when training reads the cache.
    sources: list[int] | None = None
    repeats: list[int] | None = None
    # data.bucketing: per file, rows per bucket id (JSON keys: the ids as strings).
    buckets: list[dict[str, int]] | None = None
    # Per file, the place data.sharding=files deals it by (SourceFiles.deals): the place of
    # the source file it was cut from, so each worker reads the rows it reads uncached.
    deals: list[int] | None = None
    # What the build decoded (raylora.data.badrecords.Tally.summary: rows kept, bad rows per
    # reason, a few examples); None: an entry built before entries recorded them.
    counts: dict | None = None

    @property
    def rows(self) -> int:
        return sum(self.file_rows)

    def plan(self, data) -> DataPlan:
        """Training over the cache's files (``data``: the run's data section), with each
        source's repeats and multiplier."""
        sources = self.sources or [0] * len(self.files)
        repeats = self.repeats or [1] * len(self.files)
        out = []
        for src in dict.fromkeys(sources):
            idx = [i for i, s in enumerate(sources) if s == src]
            rows = [self.file_rows[i] for i in idx]
            reps = [repeats[i] for i in idx]
            counts = None if self.buckets is None else \
                [{int(b): n for b, n in self.buckets[i].items()} for i in idx]
            out.append(SourceFiles(src, "parquet", [self.files[i] for i in idx], sum(rows), rows,
                                   reps if any(r != 1 for r in reps) else None, self.uri,
                                   bucket_counts=counts,
                                   deals=None if self.deals is None else [self.deals[i] for i in idx]))
        return DataPlan.of(apply_shares(data, out))


def captionfolder_parts(cfg: RayLoraConfig) -> int:
    """The fewest parts a caption folder is cached in (fewer only with fewer images). Runs
    of up to 64 workers share one cache entry; a larger run has its own, whose parts
    still cover every worker."""
    return max(CAPTIONFOLDER_MIN_PARTS, cfg.scaling.max_workers)


def cache_root(cfg: RayLoraConfig) -> str:
    return cfg.data.cache_uri or storage.join(cfg.output.uri, "cache")


def hub_revision(cfg: RayLoraConfig, model_path: str) -> str | None:
    """A hub model's pinned commit, for the keys of what its encoders or pipeline made. A
    stored folder's pinned version (``at_commit``) is left out: it changes with any file
    (a new UNet), and the keys hash the files that matter themselves."""
    from raylora.model.load import is_hub_id

    return cfg.model.revision if is_hub_id(model_path) else None


def _decode_key(d) -> dict:
    """The data section's decode settings (``decode_kwargs``) that differ from the defaults."""
    from raylora.config import DataSection

    default = DataSection.model_construct().decode_kwargs()
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in d.decode_kwargs().items() if v != default[k]}


def fingerprint(cfg: RayLoraConfig, family: str, model_path: str, data: DataPlan,
                store: Storage) -> str:
    """sha256 over everything that changes what the encoders produce."""
    from raylora.checkpoint.export import data_fingerprint
    from raylora.model import families
    from raylora.model.load import is_hub_id

    d = cfg.data
    h = hashlib.sha256()
    h.update(json.dumps({
        "version": CACHE_VERSION, "model": model_path, "revision": hub_revision(cfg, model_path),
        "variant": cfg.model.variant, "family": family, "dtype": _dtype_name(cfg),
        "resolution": d.resolution, "center_crop": d.center_crop, "random_flip": d.random_flip,
        "image_column": d.image_column, "caption_column": d.caption_column,
        "validation_split": d.validation_split,
        # Only where it changes the rows (or the parts): older entries keep their fingerprints.
        # "parts", not the earlier "min_parts": entries cut by the earlier rule (runs
        # rounded up, so fewer parts than promised) are rebuilt.
        **({"caption_extension": d.caption_extension, "parts": {"min": captionfolder_parts(cfg)}}
           if any(s.format == "captionfolder" for s in data.sources) else {}),
        **({"sources": [{k: getattr(s, k) for k in ("format", "image_column", "caption_column",
                                                     "caption_extension", "caption_prefix")}
                        for s in d.source_sections()]}
           if d.sources is not None or d.caption_prefix else {}),
        **({"masks": {"column": d.mask_column, "suffix": MASK_SUFFIX,
                      # each source's own column (a source's mask_column), with sources
                      **({"columns": [s.mask_column for s in d.source_sections()]}
                         if d.sources is not None else {})}} if d.masked_loss else {}),
        **({"controls": _controls_key(d)} if d.control_images else {}),
        # inputs shrunk as the pipeline shrinks them (Family.reference_max_area): where
        # images may pass it, so entries of smaller runs keep their fingerprints
        **({"reference_max_area": a} if d.control_images
           and (a := families.get(family).reference_max_area) and d.max_resolution() ** 2 >= a else {}),
        # The caption embeddings' length and template (model.max_sequence_length,
        # model.system_prompt): only when set, so entries built with the defaults keep
        # their fingerprints.
        **({"max_sequence_length": m} if (m := cfg.model.max_sequence_length) else {}),
        **({"system_prompt": sp} if (sp := cfg.model.system_prompt) is not None else {}),
        # Which rows the decode keeps and how it composites transparency
        # (data.min_size, small_images, max_image_pixels, background_color), and whether
        # caption dropout keeps the rows with no caption (as the empty prompt): only where
        # not the defaults, so entries built with them keep their fingerprints.
        **({"decode": dec} if (dec := _decode_key(d)) else {}),
        # "dropped_at_training": entries built before the cache stage stopped drawing
        # dropout itself (and encoded a kept blank caption as "", not the family's empty
        # prompt) are built again; only runs with dropout were affected.
        **({"keep_empty_captions": keep, "dropped_at_training": True}
           if any(keep := [s.caption_dropout > 0 for s in d.source_sections()]) else {}),
        # Each image's bucket (its latent's shape) follows these.
        **({"buckets": {"step": d.bucket_step,
                        "resolutions": [s.resolutions() for s in d.source_sections()]}}
           if d.bucketing else {}),
    }, sort_keys=True).encode())
    # A hub model's weights are its commit: model.revision above, pinned to the commit the
    # plan read (RayLoraConfig.at_commit), so a push to the repo is a new cache.
    if not is_hub_id(model_path):
        # The encoders' weights and configs: a retrained or swapped VAE is a new cache.
        # Every encoder and tokenizer folder of the family (SD3's third, Qwen-Image 2.1's
        # processor) and what else its encoding reads (Family.encoder_extras), not the
        # denoiser's or the scheduler's.
        fam = families.get(family)
        encoders = (set(fam.components()) | set(fam.encoder_extras)) - {fam.denoiser, "scheduler"}
        model_files = [
            f for f in store.list_files(model_path)
            if f[len(model_path.rstrip("/")) + 1 :].split("/", 1)[0] in encoders
        ]
        h.update(data_fingerprint(sorted(model_files), store).encode())
    h.update(data_fingerprint(data.content_files(), store).encode())
    return h.hexdigest()[:20]


def _controls_key(d) -> dict:
    """What of data.control_images the fingerprint holds: the column and infix (one input,
    as entries made before several inputs had); with several, also how many and, per
    source, each input's column and folder, and each input's infix: a 1-input entry is
    never read for 2, nor one whose folders were swapped."""
    key = {"column": d.control_column, "infix": CONTROL_INFIX}
    if d.control_inputs == 1:
        # with sources, each one's column (a source's control_column: another column's
        # images were read from the entry of the first)
        return key if d.sources is None else {**key, "columns": [s.control_columns() for s in d.source_sections()]}
    return {**key, "inputs": d.control_inputs,
            "infixes": [control_infix(i) for i in range(d.control_inputs)],
            "columns": [s.control_columns() for s in d.source_sections()],
            "folders": [s.control_folders() for s in d.source_sections()]}


def read_entry(uri: str, store: Storage) -> CacheEntry | None:
    """A complete cache entry, or None (absent, or a build that never finished)."""
    manifest = storage.join(uri, MANIFEST)
    if not store.exists(manifest):
        return None
    m = json.loads(store.read_bytes(manifest))
    files = [storage.join(uri, name) for name in m["files"]]
    return CacheEntry(uri, files, list(m["file_rows"]), reused=True,
                      sources=m.get("file_sources"), repeats=m.get("file_repeats"),
                      buckets=m.get("file_buckets"), deals=m.get("file_deals"),
                      counts=m.get("decode_counts"))


def _stage_kwargs(cfg: RayLoraConfig, model_path: str, family: str, store: Storage) -> tuple[dict, dict]:
    from raylora.data.preprocess import stage_kwargs

    pre = stage_kwargs("cache", cfg.data, model_path=model_path, family=family, storage=store,
                       max_sequence_length=cfg.model.max_sequence_length,
                       revision=cfg.model.revision, system_prompt=cfg.model.system_prompt)
    enc = dict(
        model_path=model_path, family=family, dtype=_dtype_name(cfg),
        revision=cfg.model.revision, variant=cfg.model.variant,
        endpoint_url=store.endpoint_url, region=store.region, resolution=cfg.data.max_resolution(),
    )
    return pre, enc


class EncodeFiles:
    """Ray Data stage over work items ``(item, source k, file index, start, stop)``: reads
    the item's rows in file order, holds out the split's rows, preprocesses, encodes, and
    writes ``part-{item:06d}-{k:04d}.parquet`` itself. Returns a row per part (``item``,
    ``name``, ``rows``, ``buckets``) and the item's decode counts (``counts``: JSON of
    ``Tally.summary``, on its first row; an item none of whose rows was kept gets one row,
    ``name`` "", for them).

    Why not ``map_batches(...).write_parquet()``: with ``preserve_order`` on, Ray Data
    still sometimes wrote a file's blocks out of order (seen 1 build in 4 here), and a
    cache whose rows are permuted trains on a different sequence than the source does.
    Naming parts by item makes the order a property of the names, not of scheduling.
    """

    def __init__(self, data: dict, formats: list[str], files: list[list[str]], parts_uri: str,
                 pre: dict, enc: dict, rows_per_part: int, encode_batch: int):
        from raylora.config import DataSection
        from raylora.data.preprocess import Preprocess, StageSpec

        self.data = DataSection.model_validate(data)
        self.sections = self.data.source_sections()
        self.formats, self.files, self.parts_uri = formats, files, parts_uri
        self.store = Storage(pre["endpoint_url"], pre["region"])
        self.pre, self.enc = Preprocess(StageSpec(**pre)), EncodeStage(**enc)
        self.rows_per_part, self.encode_batch = rows_per_part, encode_batch
        from raylora.data.badrecords import Counting

        # Counted here and recorded with the entry (record_build), not sent to the run's
        # counter: a rerun reusing the entry decodes nothing, and is judged on them too.
        self.counting = self.pre.reporter = Counting()

    def _rows(self, k: int, source: int, index: int, start: int, stop: int):
        """A unit's rows as training reads them: the source's caption prefix applied."""
        section = self.sections[source]
        for row in get_format(self.formats[k]).iter_unit(section, self.files[k], self.store,
                                                         index, start, stop):
            yield {**row, "text": with_prefix(section.caption_prefix, row["text"]),
                   "source": source}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import itertools

        from raylora.data.badrecords import Tally
        from raylora.data.split import held_out_mask

        out = {"item": [], "name": [], "rows": [], "buckets": [], "counts": []}
        for item, k, source, index, start, stop in zip(
                batch["item"], batch["k"], batch["source"], batch["index"], batch["start"],
                batch["stop"]):
            self.counting.tally = Tally()  # this item's
            names, counts, buckets = [], [], []
            rows = iter(self._rows(int(k), int(source), int(index), int(start), int(stop)))
            encoded, part = [], 0
            while chunk := list(itertools.islice(rows, self.encode_batch)):
                if self.data.validation_split:
                    keep = ~held_out_mask([r["image"] for r in chunk], [r["text"] for r in chunk],
                                          self.data.validation_split)
                    chunk = [r for r, k in zip(chunk, keep) if k]
                # a chunk of bad rows alone (dropped and counted) encodes to nothing: before,
                # encode_batch bad rows in a row failed the build in the VAE
                if chunk and (done := encode_chunk(self.pre, self.enc, chunk, skip_empty=True)):
                    encoded.append(done)
                while encoded and sum(len(e["latent_params"]) for e in encoded) >= self.rows_per_part:
                    encoded = self._write(int(item), part, encoded, names, counts, buckets)
                    part += 1
            if encoded:
                self._write(int(item), part, encoded, names, counts, buckets)
            if not names:  # every row bad or held out: no part, but the counts say why
                names, counts, buckets = [""], [0], ["{}"]
            out["item"] += [int(item)] * len(names)
            out["name"] += names
            out["rows"] += counts
            out["buckets"] += buckets
            out["counts"] += [json.dumps(self.counting.tally.summary())] + [""] * (len(names) - 1)
        return {"item": np.array(out["item"], dtype=np.int64),
                "name": np.array(out["name"], dtype=object),
                "rows": np.array(out["rows"], dtype=np.int64),
                "buckets": np.array(out["buckets"], dtype=object),
                "counts": np.array(out["counts"], dtype=object)}

    def _write(self, item: int, part: int, encoded: list[dict], names: list, counts: list,
               buckets: list) -> list[dict]:
        """Write the first ``rows_per_part`` buffered rows as one part; return the rest."""
        import io

        import pyarrow.parquet as pq
        from ray.data.block import BlockAccessor

        # Caption columns of chunks encoded apart may differ in length (PADDED_CAPTIONS)
        joined = {k: concat_rows(k, [e[k] for e in encoded]) for k in encoded[0]}
        head = {k: v[: self.rows_per_part] for k, v in joined.items()}
        rest = {k: v[self.rows_per_part :] for k, v in joined.items()}
        name = f"part-{item:06d}-{part:04d}.parquet"
        buf = io.BytesIO()
        # Ray's tensor extension type: read back in a Ray task, the arrays keep their shapes.
        pq.write_table(BlockAccessor.batch_to_block(head), buf)
        self.store.write_bytes(storage.join(self.parts_uri, name), buf.getvalue())
        names.append(name)
        counts.append(len(head["latent_params"]))
        # data.bucketing: the part's rows per bucket (JSON: the manifest keeps it per file)
        ids, n = np.unique(head.get("bucket", np.zeros(0, np.int32)), return_counts=True)
        buckets.append(json.dumps({str(int(b)): int(c) for b, c in zip(ids, n)}))
        return [rest] if len(rest["latent_params"]) else []


def encode_chunk(pre, enc: EncodeStage, rows: list[dict],
                 skip_empty: bool = False) -> dict[str, np.ndarray] | None:
    """``{image, text}`` rows (with ``key``, where each is, for bad-row reports) → cached
    columns, in order; ``skip_empty``: None when the decode kept none of them."""
    batch = {"image": np.array([r["image"] for r in rows], dtype=object),
             "text": np.array([r["text"] for r in rows], dtype=object)}
    # where each is (bad-row reports), per-source counts, the loss mask (data.masked_loss),
    # the control images (data.control_images: control, control_2, ...)
    for column in ("key", "source", "mask", *_inputs("control")):
        if all(column in r for r in rows):
            batch[column] = np.array([r[column] for r in rows], dtype=object)
    pre_out = pre(batch)
    if skip_empty and not len(pre_out["pixel_values"]):
        return None  # (the VAE fails on an empty batch)
    if "bucket" not in pre_out:
        return enc(pre_out)
    return _encode_by_bucket(enc, pre_out)


def _encode_by_bucket(enc: EncodeStage, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """data.bucketing: encode each bucket's rows together (one shape per VAE call) and put
    the rows back in order; ``latent_params`` is a 1-D object array of per-row arrays (a
    variable-shaped tensor column in the cache) and ``bucket`` is kept."""
    ids = batch["bucket"]
    parts, order = [], []
    for b in dict.fromkeys(ids.tolist()):
        sel = np.flatnonzero(ids == b)
        group = {k: (np.stack(v[sel]) if k in STACKED else v[sel])
                 for k, v in batch.items() if k != "bucket"}
        parts.append(enc(group))
        order.append(sel)
    where = np.argsort(np.concatenate(order), kind="stable") if order else np.zeros(0, int)
    out = {}
    for k in (parts[0] if parts else {}):
        rows = [r for p in parts for r in p[k]]
        if k in PER_BUCKET:
            col = np.empty(len(rows), dtype=object)
            for i, j in enumerate(where):
                col[i] = rows[j]
        else:  # a caption column's buckets were encoded apart (PADDED_CAPTIONS)
            col = stack_rows(k, [rows[j] for j in where])
        out[k] = col
    out["bucket"] = ids.astype(np.int32)
    return out


def _work_items(cfg: RayLoraConfig, plan: DataPlan, store: Storage, per_item: int) -> list[dict]:
    """Every source's read units (one per shard file; an imagefolder's row list and a
    caption folder's images in runs of at most ``per_item``, and in at least
    ``captionfolder_parts(cfg)`` runs while it has that many images: the number the
    fingerprint holds), numbered in source order, with the source (``k``: its place in the
    plan), the times its rows count and ``deal``: the place data.sharding=files deals its
    parts by (``SourceFiles.deals``). A unit of one shard file, or of one image, gets that
    file's place over every source, as the uncached run deals it: each worker then reads
    the rows it reads uncached, in the same order, whatever parts the file was cut into. A
    caption folder's run of several images (over 127 images) gets its run's place: runs are
    dealt in turn, as many images a worker as uncached, but not the same ones."""
    items, sections, min_parts = [], cfg.data.source_sections(), captionfolder_parts(cfg)
    before = 0  # files of the sources before
    for k, s in enumerate(plan.sources):
        reps = s.file_repeats()
        size = per_item
        if s.format == "captionfolder":  # a file per image: at least min_parts runs
            # Rounded down: runs of n // min_parts images make at least min_parts runs.
            size = max(1, min(per_item, len(s.files) // min_parts))
        units = get_format(s.format).units(sections[s.index], s.files, store, size, s.repeats)
        for n, (index, start, stop) in enumerate(units):
            items.append({"item": len(items), "k": k, "source": s.index, "index": index,
                          "start": start, "stop": stop, "repeats": reps[index],
                          "deal": before + n})
        before += len(s.files)
    return items


def _part_deals(names: list[str], items: list[dict]) -> list[int] | None:
    """Each part's ``deal`` (``_work_items``), by the item in its name
    (``part-{item}-{k}.parquet``); None where a name is not one."""
    try:
        return [items[int(n.rsplit("/", 1)[-1].split("-")[1])]["deal"] for n in names]
    except (IndexError, ValueError):
        return None


def ensure_cache(cfg: RayLoraConfig, family: str, model_path: str, data: DataPlan,
                 store: Storage, rows_per_part: int = 256) -> CacheEntry:
    """The complete cache entry for this config, built first when missing. Needs Ray.
    Its ``counts`` are what the build decoded (recorded with it: a reused entry decodes
    nothing); the run adds them to its own (``raylora.launch.apply_cache``)."""
    import ray.data

    uri = storage.join(cache_root(cfg), fingerprint(cfg, family, model_path, data, store))
    entry = read_entry(uri, store)
    if entry is not None:
        log.info("latent cache: reusing %s (%d rows)", uri, entry.rows)
        clear_dead_builds(uri, store, keep={f[len(uri) + 1:].split("/", 1)[0] for f in entry.files})
        if entry.deals is None:  # built before manifests kept them: from the part names
            entry = replace(entry, deals=_part_deals(entry.files, _work_items(cfg, data, store, rows_per_part)))
        return entry
    clear_dead_builds(uri, store, keep=set())
    build = f"{BUILD_PREFIX}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    parts = storage.join(uri, build)
    log.info("latent cache: encoding %d file(s) into %s", len(data.files), parts)
    pre, enc = _stage_kwargs(cfg, model_path, family, store)
    items = _work_items(cfg, data, store, rows_per_part)
    gpu = {"num_gpus": 1} if cfg.scaling.use_gpu else {"num_cpus": 1}
    written = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        EncodeFiles,
        fn_constructor_kwargs=dict(
            data=cfg.data.model_dump(), formats=[s.format for s in data.sources],
            files=[s.files for s in data.sources], parts_uri=parts,
            pre=pre, enc=enc, rows_per_part=rows_per_part,
            encode_batch=max(8, cfg.train.batch_size * 4),
        ),
        batch_size=1, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.scaling.max_workers)),
        **gpu,
    ).take_all()
    return record_build(cfg, family, data, items, written, uri, store, build)


def clear_dead_builds(uri: str, store: Storage, keep: set[str], now: float | None = None) -> None:
    """Delete the build folders of entry ``uri`` (``BUILD_PREFIX``…) other than ``keep``
    whose newest file is older than ``STALE_BUILD_S``: builds that died before their
    manifest, or whose manifest another build of the entry overwrote."""
    import pyarrow.fs as pafs

    fs, path = store.fs(uri)
    root = path.rstrip("/") + "/"
    newest: dict[str, float] = {}
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        folder, _, rest = info.path[len(root):].partition("/")
        if info.type == pafs.FileType.File and rest and folder.startswith(BUILD_PREFIX) \
                and folder not in keep:
            # (a store that gives no time: taken as written now, never stale)
            stamp = info.mtime.timestamp() if info.mtime else time.time()
            newest[folder] = max(newest.get(folder, 0.0), stamp)
    now = time.time() if now is None else now
    for folder, stamp in sorted(newest.items()):
        if now - stamp > STALE_BUILD_S:
            log.info("latent cache: deleting %s/%s (no manifest names it; unchanged for %.0f h)",
                     uri, folder, (now - stamp) / 3600)
            store.delete_dir(storage.join(uri, folder))


def record_build(cfg: RayLoraConfig, family: str, data: DataPlan, items: list[dict],
                 written: list[dict], uri: str, store: Storage, build: str = BUILD_PREFIX) -> CacheEntry:
    """The entry ``EncodeFiles`` wrote under ``uri`` from ``items`` (``written``: its
    rows) into its folder ``build``: ``manifest.json`` records the parts in source order,
    each one's source, repeats, buckets and deal place, and the decode counts of the whole
    build."""
    from raylora.data.badrecords import Tally

    tally = Tally()
    for r in sorted(written, key=lambda r: int(r["item"])):  # examples in source order
        if r["counts"]:
            tally.add_summary(json.loads(r["counts"]))
    counts = tally.summary()
    done = sorted((r["name"], int(r["rows"])) for r in written if r["name"])  # zero-padded: source order
    part_buckets = {r["name"]: json.loads(r["buckets"]) for r in written if r["name"]}
    if not done:
        bad = f" (bad rows: {counts['bad_records']})" if counts["bad_records"] else ""
        raise ValueError(f"data.cache: encoding {[s.uri for s in data.sources]} produced no rows{bad}")
    names = [n for n, _ in done]
    of_item = [items[int(n.split("-")[1])] for n in names]  # part-{item}-{k}.parquet
    manifest = {"version": CACHE_VERSION, "family": family,
                "files": [f"{build}/{n}" for n in names], "file_rows": [c for _, c in done],
                "file_sources": [data.sources[it["k"]].index for it in of_item],
                "file_repeats": [it["repeats"] for it in of_item],
                "file_deals": [it["deal"] for it in of_item],
                **({"file_buckets": [part_buckets[n] for n in names]} if cfg.data.bucketing else {}),
                "decode_counts": counts,
                "source": {"uri": [s.uri for s in data.sources], "files": len(data.files)}}
    # Written last: its presence is what marks the entry complete.
    store.write_bytes(storage.join(uri, MANIFEST), json.dumps(manifest, indent=1).encode())
    log.info("latent cache: wrote %d rows in %d file(s)", sum(manifest["file_rows"]), len(names))
    parts = storage.join(uri, build)
    return CacheEntry(uri, [storage.join(parts, n) for n in names], manifest["file_rows"],
                      reused=False, sources=manifest["file_sources"],
                      repeats=manifest["file_repeats"], buckets=manifest.get("file_buckets"),
                      deals=manifest["file_deals"], counts=counts)


def caption_columns(stage, encoder: EncodeStage, captions: list[str]) -> dict[str, np.ndarray]:
    """The caption-only conditioning (``Family.caption_keys``) of ``captions`` as cache
    columns, one row each: tokenized by ``stage``'s tokenizers (a ``Preprocess``) and
    encoded by ``encoder``'s text encoders in the cache's dtype, as the uncached step
    encodes a caption."""
    import torch

    from raylora.train.encode import batch_condition

    batch = {k: torch.from_numpy(np.asarray(v)).to(encoder.device)
             for k, v in stage.text_columns(list(captions)).items()}
    # A family whose conditioning also holds the image's size and crop (SDXL's time_ids)
    # computes it from these; it is not a caption column, so not kept.
    sizes = torch.zeros(len(captions), 2, dtype=torch.int64, device=encoder.device)
    batch.update(original_size=sizes, crop_top_left=sizes, target_size=sizes)
    with torch.no_grad():
        cond = batch_condition(encoder.family, encoder.text_encoders, batch)
    return {k: to_column(cond[k]) for k in encoder.family.caption_keys()}


def _encode_rows_task(cfg_dict: dict, family: str, model_path: str, sets: dict[str, list[dict]],
                      captions: list[str]) -> tuple[dict[str, dict], dict | None]:
    from raylora.data.preprocess import Preprocess, StageSpec, stage_kwargs

    cfg = RayLoraConfig.model_validate(cfg_dict)
    store = cfg.storage.client()
    _, enc = _stage_kwargs(cfg, model_path, family, store)
    # One load of the encoders for every set and the captions (no VAE for captions alone)
    encoder = EncodeStage(**enc, vae=any(sets.values()))
    # The uncached workers' held-out stage, not the cache's: that one keeps a blank
    # caption for dropout, so a cached run scored rows an uncached one drops.
    heldout = stage_kwargs("heldout", cfg.data, model_path=model_path, family=family,
                           storage=store, max_sequence_length=cfg.model.max_sequence_length,
                           revision=cfg.model.revision, system_prompt=cfg.model.system_prompt,
                           heldout_resolution=cfg.eval_resolution())
    encoded, stage = {}, Preprocess(StageSpec(**heldout))
    for purpose, rows in sets.items():
        if not rows:
            continue
        if purpose == "class":  # prompts as given; masks when the instance rows have them
            pre = stage_kwargs("class", cfg.data, model_path=model_path, family=family,
                               storage=store, max_sequence_length=cfg.model.max_sequence_length,
                               revision=cfg.model.revision, system_prompt=cfg.model.system_prompt)
            from raylora.data.prior import fold_repeats

            # one copy of a prompt's embedding, not one per image, to the driver and workers
            encoded[purpose] = fold_repeats(encode_chunk(Preprocess(StageSpec(**pre)), encoder, rows))
        else:  # held-out rows are evaluated together: one square size, buckets or not; unmasked
            encoded[purpose] = encode_chunk(stage, encoder, rows)
    # The captions are tokenized as the held-out rows' are: the cache's tokenizers
    captioned = caption_columns(stage, encoder, captions) if captions else None
    return encoded, captioned


def _encode(cfg: RayLoraConfig, family: str, model_path: str, sets: dict[str, list[dict]],
            captions: list[str]) -> tuple[dict[str, dict], dict | None]:
    """``_encode_rows_task`` in one Ray task, on a GPU when training uses them."""
    import ray

    res = {"num_gpus": 1} if cfg.scaling.use_gpu else {"num_cpus": 1}
    task = ray.remote(**res)(_encode_rows_task)
    return ray.get(task.remote(cfg.to_dict(), family, model_path, sets, list(captions)))


def encode_rows(cfg: RayLoraConfig, family: str, model_path: str, rows: list[dict],
                store: Storage, purpose: str = "heldout") -> dict[str, np.ndarray]:
    """Held-out rows, or prior preservation's class rows (``purpose="class"``, their
    repeated rows folded: ``raylora.data.prior.fold_repeats``), ``{image, text}`` → cached
    columns, in order, by the same code as the cache, in one Ray task (on a GPU when
    training uses them): a few hundred rows at most."""
    return _encode(cfg, family, model_path, {purpose: rows}, [])[0][purpose]


def encode_for_workers(cfg: RayLoraConfig, family: str, model_path: str, heldout: list[dict],
                       class_rows: list[dict], captions: list[str]
                       ) -> tuple[dict | None, dict | None, dict | None]:
    """What the workers of a cached run would otherwise need encoders for, from one task
    (the text encoders and the VAE loaded once for all of it): ``encode_rows``' held-out
    columns, its class columns (prior preservation) and ``caption_columns`` of ``captions``
    (data.caption_dropout: the family's empty prompt, which a cached batch's dropped rows
    get, ``raylora.data.captions.drop_cached_captions``); None for each one not asked for."""
    encoded, captioned = _encode(cfg, family, model_path,
                                 {"heldout": heldout, "class": class_rows}, captions)
    return encoded.get("heldout"), encoded.get("class"), captioned
