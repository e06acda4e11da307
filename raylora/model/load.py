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
SDXL_COMPONENTS = SD_COMPONENTS + ("text_encoder_2", "tokenizer_2")
COMPONENTS = {"sd": SD_COMPONENTS, "sdxl": SDXL_COMPONENTS}
# Subfolders of the tokenizers / text encoders, in the order their embeddings are joined.
TEXT_SUBFOLDERS = {
    "sd": [("tokenizer", "text_encoder")],
    "sdxl": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")],
}


@dataclass
class Components:
    tokenizers: list[Any]
    text_encoders: list[torch.nn.Module]
    vae: torch.nn.Module
    unet: torch.nn.Module
    noise_scheduler: Any
    family: str = "sd"
    latent_scale: float = 0.18215  # the VAE's scaling_factor (known without loading it)


def detect_family(index: dict) -> str:
    """``model_index.json`` → "sd" | "sdxl". SDXL is the pipeline with a second text
    encoder (the refiner has only ``text_encoder_2`` and is not a LoRA training target)."""
    if "XL" in str(index.get("_class_name", "")) or "text_encoder_2" in index:
        return "sdxl"
    return "sd"


def resolve_family(model: ModelSection, index: dict | None) -> str:
    """The configured family, or the detected one; a mismatch is a config error."""
    if index is None:
        return "sd" if model.family == "auto" else model.family
    found = detect_family(index)
    if model.family not in ("auto", found):
        raise ValueError(
            f"model.family: {model.family} but {model.pretrained} is a {found} pipeline "
            f"({index.get('_class_name')}); use model.family={found} or auto"
        )
    return found


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

    Returns ``{"index": model_index.json, "family": "sd"|"sdxl", "vae_scale_factor": int}``;
    raises FileNotFoundError naming the path.
    """
    info = store.info(path)
    if info.type.name == "NotFound":
        raise FileNotFoundError(f"model.pretrained: {path}: no such directory")
    files = {f[len(path.rstrip("/")) + 1 :] for f in store.list_files(path)}
    if "model_index.json" not in files:
        raise FileNotFoundError(
            f"model.pretrained: {path}: not a diffusers folder (no model_index.json)"
        )
    index = json.loads(store.read_bytes(storage.join(path, "model_index.json")))
    family = detect_family(index)
    present = {f.split("/", 1)[0] for f in files if "/" in f}
    missing = [c for c in COMPONENTS[family] if c not in present]
    if missing:
        raise FileNotFoundError(
            f"model.pretrained: {path}: missing component folder(s) of a {family} "
            f"pipeline: {', '.join(missing)}"
        )
    vae = json.loads(store.read_bytes(storage.join(path, "vae", "config.json")))
    return {
        "index": index,
        "family": family,
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
    }


def cache_root() -> str:
    return os.environ.get("RAYLORA_CACHE") or os.path.expanduser("~/.cache/raylora")


def materialize(path: str, store: Storage) -> str:
    """A local path for ``path``: local folders and hub ids unchanged; a storage URI is
    downloaded once per node into the cache.

    Every process on the node (training workers, preprocess tasks) calls this; an
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


def model_family(model: ModelSection, path: str) -> str:
    """Family of a local (materialized) or hub model, read from its model_index.json."""
    from diffusers import DiffusionPipeline

    try:
        index = DiffusionPipeline.load_config(path, revision=model.revision)
    except (OSError, ValueError):
        index = None
    return resolve_family(model, index)


def load_text_encoders(path: str, family: str, weight_dtype: torch.dtype, revision=None, variant=None):
    """Tokenizers and frozen text encoders, in embedding order.

    SDXL's second encoder is ``CLIPTextModelWithProjection``: its projected pooled output
    is the ``text_embeds`` the UNet's added conditioning expects.
    """
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    tokenizers, encoders = [], []
    for tok_dir, enc_dir in TEXT_SUBFOLDERS[family]:
        tokenizers.append(AutoTokenizer.from_pretrained(path, subfolder=tok_dir, revision=revision))
        cls = CLIPTextModelWithProjection if enc_dir == "text_encoder_2" else CLIPTextModel
        enc = cls.from_pretrained(
            path, subfolder=enc_dir, revision=revision, variant=variant, torch_dtype=weight_dtype
        )
        enc.requires_grad_(False)
        # Frozen modules stay in eval mode so dropout in the text encoder never fires.
        enc.eval()
        encoders.append(enc)
    return tokenizers, encoders


def load_vae(path: str, weight_dtype: torch.dtype, revision=None, variant=None):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(
        path, subfolder="vae", revision=revision, variant=variant, torch_dtype=weight_dtype
    )
    if weight_dtype == torch.float16 and vae.config.get("force_upcast", False):
        # SDXL's VAE overflows in fp16 (NaN latents); its config says so. fp32 costs only
        # the encoder pass.
        vae.to(torch.float32)
    vae.requires_grad_(False)
    vae.eval()
    return vae


def load_components(
    model: ModelSection,
    weight_dtype: torch.dtype,
    store: Storage | None = None,
    encoders: bool = True,
) -> Components:
    """Everything frozen a training worker needs. ``encoders=False`` (cached latents) skips
    the VAE and text encoders: the cache already holds what they would compute."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    path = materialize(resolve_model_path(model), store or Storage())
    family = model_family(model, path)
    kw: dict[str, Any] = {"revision": model.revision}
    noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kw)
    tokenizers, text_encoders, vae = [], [], None
    if encoders:
        tokenizers, text_encoders = load_text_encoders(
            path, family, weight_dtype, model.revision, model.variant
        )
        vae = load_vae(path, weight_dtype, model.revision, model.variant)
    unet = UNet2DConditionModel.from_pretrained(
        path, subfolder="unet", variant=model.variant, torch_dtype=weight_dtype, **kw
    )
    unet.requires_grad_(False)
    set_attention(unet, model.attention)
    vae_config = AutoencoderKL.load_config(path, subfolder="vae", revision=model.revision)
    scale = float(vae_config.get("scaling_factor", 0.18215))
    return Components(tokenizers, text_encoders, vae, unet, noise_scheduler, family, scale)


def set_attention(unet: torch.nn.Module, kind: str) -> None:
    """sdpa: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPUs
    that have them). Set explicitly so a model saved with another processor trains on it."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    unet.set_attn_processor(AttnProcessor2_0() if kind == "sdpa" else AttnProcessor())
