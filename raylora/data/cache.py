"""``data.cache: latents``: encode every image and caption once, train from parquet.

Encoding is most of a LoRA step's frozen work (VAE encoder on every image, one or two
text encoders on every caption) and it gives the same answer every epoch. The cache runs
it once, as Ray Data stages (read → held-out filter → ``Preprocess`` → ``EncodeStage`` on
accelerator actors where there are some → parquet), and training workers read the
result instead of images, loading neither the VAE nor the text encoders.

What a cached row holds (float32): ``latent_params`` = the VAE posterior's mean ‖ logvar
(so training still draws a fresh latent sample every step, as uncached training does),
``prompt_embeds``, and for SDXL ``pooled_prompt_embeds`` and ``time_ids``.

An entry lives at ``{cache_uri}/{fingerprint}/`` and is complete once its
``manifest.json`` exists (written last). The fingerprint covers the model's encoder files,
the precision, the resolution and crop policy, the held-out split and the data files'
names, sizes and mtimes: a rerun or a Tune trial with the same inputs reuses the entry,
and any change makes a new one. Random crop/flip and caption dropout are refused by the
config (a cache holds one view of each image).
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from raylora import storage
from raylora.config import RayLoraConfig
from raylora.storage import Storage

log = logging.getLogger("raylora.cache")

CACHE_VERSION = 1
MANIFEST = "manifest.json"
CACHED_COLUMNS = ("latent_params", "prompt_embeds", "pooled_prompt_embeds", "time_ids")


def _dtype_name(cfg: RayLoraConfig) -> str:
    """The encoders' weight dtype (as training would load them), e.g. "bfloat16"."""
    from raylora.train.setup import DTYPES

    return str(DTYPES[cfg.train.mixed_precision]).removeprefix("torch.")


@contextmanager
def _ordered():
    """Ray Data keeps rows in input order while inside (the cache lists rows in source
    order, and held-out rows must come back in the order they were sent)."""
    import ray.data

    options = ray.data.DataContext.get_current().execution_options
    before = options.preserve_order
    options.preserve_order = True
    try:
        yield
    finally:
        options.preserve_order = before


class EncodeStage:
    """Ray Data batch stage: preprocessed pixels + token ids → cached tensors.

    Loads the VAE and text encoder(s) once per actor, on the actor's GPU when it has one.
    """

    def __init__(self, model_path: str, family: str, dtype: str, revision=None, variant=None,
                 endpoint_url=None, region=None, resolution: int | None = None):
        import torch

        from raylora.model.load import load_text_encoders, load_vae, materialize

        path = materialize(model_path, Storage(endpoint_url, region))
        weight_dtype = getattr(torch, dtype)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _, self.text_encoders = load_text_encoders(path, family, weight_dtype, revision, variant)
        self.vae = load_vae(path, weight_dtype, revision, variant)
        for m in (*self.text_encoders, self.vae):
            m.to(self.device)
        self.resolution = resolution

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from raylora.train.encode import batch_condition, vae_posterior

        tensors = {k: torch.from_numpy(np.asarray(v)).to(self.device) for k, v in batch.items()
                   if k in ("pixel_values", "input_ids", "input_ids_2", "original_size", "crop_top_left")}
        params = vae_posterior(self.vae, tensors["pixel_values"])
        cond = batch_condition(self.text_encoders, tensors, self.resolution)
        out = {
            "latent_params": params,
            "prompt_embeds": cond.hidden,
            "pooled_prompt_embeds": cond.pooled,
            "time_ids": cond.time_ids,
        }
        return {k: v.float().cpu().numpy() for k, v in out.items() if v is not None}


@dataclass
class CacheEntry:
    uri: str
    files: list[str]
    file_rows: list[int]
    reused: bool

    @property
    def rows(self) -> int:
        return sum(self.file_rows)


def cache_root(cfg: RayLoraConfig) -> str:
    return cfg.data.cache_uri or storage.join(cfg.output.uri, "cache")


def fingerprint(cfg: RayLoraConfig, family: str, model_path: str, data_files: list[str],
                store: Storage) -> str:
    """sha256 over everything that changes what the encoders produce."""
    from raylora.checkpoint.export import data_fingerprint
    from raylora.model.load import is_hub_id

    d = cfg.data
    h = hashlib.sha256()
    h.update(json.dumps({
        "version": CACHE_VERSION, "model": model_path, "revision": cfg.model.revision,
        "variant": cfg.model.variant, "family": family, "dtype": _dtype_name(cfg),
        "resolution": d.resolution, "center_crop": d.center_crop, "random_flip": d.random_flip,
        "image_column": d.image_column, "caption_column": d.caption_column,
        "validation_split": d.validation_split,
    }, sort_keys=True).encode())
    if not is_hub_id(model_path):
        # The encoders' weights and configs: a retrained or swapped VAE is a new cache.
        model_files = [
            f for f in store.list_files(model_path)
            if f[len(model_path.rstrip("/")) + 1 :].split("/", 1)[0]
            in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
        ]
        h.update(data_fingerprint(sorted(model_files), store).encode())
    h.update(data_fingerprint(list(data_files), store).encode())
    return h.hexdigest()[:20]


def read_entry(uri: str, store: Storage) -> CacheEntry | None:
    """A complete cache entry, or None (absent, or a build that never finished)."""
    manifest = storage.join(uri, MANIFEST)
    if not store.exists(manifest):
        return None
    m = json.loads(store.read_bytes(manifest))
    files = [storage.join(uri, name) for name in m["files"]]
    return CacheEntry(uri, files, list(m["file_rows"]), reused=True)


def _stage_kwargs(cfg: RayLoraConfig, model_path: str, family: str, store: Storage) -> tuple[dict, dict]:
    pre = dict(
        tokenizer_path=model_path, resolution=cfg.data.resolution, center_crop=True,
        random_flip=False, image_column="image", caption_column="text", seed=0,
        endpoint_url=store.endpoint_url, region=store.region, family=family,
    )
    enc = dict(
        model_path=model_path, family=family, dtype=_dtype_name(cfg),
        revision=cfg.model.revision, variant=cfg.model.variant,
        endpoint_url=store.endpoint_url, region=store.region, resolution=cfg.data.resolution,
    )
    return pre, enc


def _encode(ds, cfg: RayLoraConfig, model_path: str, family: str, store: Storage):
    """Rows ``{image, text}`` → cached columns, as two Ray Data actor stages."""
    import ray.data

    from raylora.data.preprocess import Preprocess

    pre, enc = _stage_kwargs(cfg, model_path, family, store)
    actors = max(1, cfg.scaling.num_workers)
    ds = ds.map_batches(
        Preprocess, fn_constructor_kwargs=pre, batch_size=32, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors), num_cpus=0.5,
    )
    gpu = {"num_gpus": 1} if cfg.scaling.use_gpu else {"num_cpus": 1}
    return ds.map_batches(
        EncodeStage, fn_constructor_kwargs=enc, batch_size=cfg.train.batch_size * 4,
        batch_format="numpy", compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
        **gpu,
    )


def _ordered_names():
    """Parquet part names that sort in write-task order (with ``preserve_order``: data
    order), so a cache lists its rows in the order of the source files."""
    from ray.data.datasource import FilenameProvider

    class OrderedNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"part-{task_index:06d}-{write_uuid}.parquet"

    return OrderedNames()


def _natural_key(name: str) -> list:
    """'part-000001_ab-10.parquet' after 'part-000001_ab-9.parquet'."""
    import re

    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def ensure_cache(cfg: RayLoraConfig, family: str, model_path: str, data_format: str,
                 data_files: list[str], store: Storage, rows_per_file: int = 1024) -> CacheEntry:
    """The complete cache entry for this config, built first when missing. Needs Ray."""
    import pyarrow.parquet as pq

    from raylora.data.source import DataPlan, read_rows
    from raylora.data.split import KeepSplit

    uri = storage.join(cache_root(cfg), fingerprint(cfg, family, model_path, data_files, store))
    entry = read_entry(uri, store)
    if entry is not None:
        log.info("latent cache: reusing %s (%d rows)", uri, entry.rows)
        return entry
    parts = storage.join(uri, "parts")
    if store.exists(parts):  # a build that died before its manifest: start over
        store.delete_dir(parts)
    log.info("latent cache: encoding %d file(s) into %s", len(data_files), uri)
    with _ordered():
        ds = read_rows(cfg.data, DataPlan(data_format, data_files, 0), store, seed=0, shuffle=False)
        if cfg.data.validation_split:
            ds = ds.map_batches(KeepSplit(cfg.data.validation_split), batch_format="numpy")
        ds = _encode(ds, cfg, model_path, family, store)
        fs, path = store.fs(parts)
        ds.write_parquet(path, filesystem=fs, filename_provider=_ordered_names(),
                         min_rows_per_file=rows_per_file)
    files = sorted((f for f in store.list_files(parts) if f.endswith(".parquet")), key=_natural_key)
    if not files:
        raise ValueError(f"data.cache: encoding {cfg.data.uri} produced no rows")
    file_rows = []
    for f in files:
        with store.open_input(f) as fh:
            file_rows.append(pq.ParquetFile(fh).metadata.num_rows)
    rel = [f[len(uri.rstrip("/")) + 1 :] for f in files]
    manifest = {"version": CACHE_VERSION, "family": family, "files": rel, "file_rows": file_rows,
                "source": {"uri": cfg.data.uri, "files": len(data_files)}}
    # Written last: its presence is what marks the entry complete.
    store.write_bytes(storage.join(uri, MANIFEST), json.dumps(manifest, indent=1).encode())
    log.info("latent cache: wrote %d rows in %d file(s)", sum(file_rows), len(files))
    return CacheEntry(uri, files, file_rows, reused=False)


def encode_rows(cfg: RayLoraConfig, family: str, model_path: str, rows: list[dict],
                store: Storage) -> dict[str, np.ndarray]:
    """Held-out rows ``{image, text}`` → cached columns, in order (same stages as the cache)."""
    import ray.data

    with _ordered():
        ds = _encode(ray.data.from_items(rows), cfg, model_path, family, store)
        batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def read_cached_dataset(entry_files: list[str], store: Storage, seed: int):
    """Training rows from cache files: parquet straight into the workers, no stage."""
    import ray.data
    from ray.data import FileShuffleConfig

    fs, _ = store.fs(entry_files[0])
    return ray.data.read_parquet(
        [storage.fs_path(f) for f in entry_files], filesystem=fs,
        shuffle=FileShuffleConfig(seed=seed, reseed_after_execution=True),
    )
