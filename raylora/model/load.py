"""Load the frozen base model components with ``from_pretrained(path, subfolder=...)``.

The same code path serves a hub id (``stable-diffusion-v1-5/stable-diffusion-v1-5``) and a
local diffusers folder, so the tiny test model exercises what users run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from raylora import storage
from raylora.config import ModelSection
from raylora.storage import Storage

SD_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass
class Components:
    tokenizer: Any
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    unet: torch.nn.Module
    noise_scheduler: Any


def resolve_model_path(model: ModelSection) -> str:
    """Local folder → absolute path; storage URI as is; anything else is a hub id."""
    p = os.path.expanduser(model.pretrained)
    if "://" in p and not p.startswith("file://"):
        return p
    if os.path.isdir(p) or p.startswith((".", "/", "~", "file://")):
        return storage.local_path(p)
    return model.pretrained


def is_hub_id(path: str) -> bool:
    return "://" not in path and not os.path.isabs(path)


def check_model(path: str, store: Storage) -> dict:
    """Problems with a local or stored diffusers folder, found before any worker starts.

    Returns ``{"index": model_index.json, "vae_scale_factor": int}``; raises
    FileNotFoundError naming the path.
    """
    info = store.info(path)
    if info.type.name == "NotFound":
        raise FileNotFoundError(f"model.pretrained: {path}: no such directory")
    files = {f[len(path.rstrip("/")) + 1 :] for f in store.list_files(path)}
    if "model_index.json" not in files:
        raise FileNotFoundError(
            f"model.pretrained: {path}: not a diffusers folder (no model_index.json)"
        )
    present = {f.split("/", 1)[0] for f in files if "/" in f}
    missing = [c for c in SD_COMPONENTS if c not in present]
    if missing:
        raise FileNotFoundError(
            f"model.pretrained: {path}: missing component folder(s): {', '.join(missing)}"
        )
    vae = json.loads(store.read_bytes(storage.join(path, "vae", "config.json")))
    return {
        "index": json.loads(store.read_bytes(storage.join(path, "model_index.json"))),
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
    }


def cache_root() -> str:
    return os.environ.get("RAYLORA_CACHE") or os.path.expanduser("~/.cache/raylora")


def materialize(path: str, store: Storage) -> str:
    """A local path for ``path``: local folders and hub ids unchanged; a storage URI is
    downloaded once per node into the cache.

    Every process on the node (training workers, preprocess actors) calls this; an
    exclusive file lock lets one download while the others wait, and a ``.complete``
    marker written last means a crashed download is never mistaken for a model.
    """
    if storage.is_local(path) or is_hub_id(path):
        return path
    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
    dest = os.path.join(cache_root(), "models", digest)
    done = os.path.join(dest, ".complete")
    if os.path.exists(done):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(done):
                tmp = f"{dest}.partial-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                store.download_dir(path, tmp)
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
                with open(done, "w") as f:
                    f.write(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dest


def load_components(
    model: ModelSection, weight_dtype: torch.dtype, store: Storage | None = None
) -> Components:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel

    path = materialize(resolve_model_path(model), store or Storage())
    kw: dict[str, Any] = {"revision": model.revision}
    tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
    noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kw)
    kw["variant"] = model.variant
    kw["torch_dtype"] = weight_dtype
    text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kw)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kw)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", **kw)
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
    # Frozen modules stay in eval mode so dropout in the text encoder never fires.
    text_encoder.eval()
    vae.eval()
    return Components(tokenizer, text_encoder, vae, unet, noise_scheduler)
