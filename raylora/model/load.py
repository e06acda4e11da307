"""Load the frozen base model components with ``from_pretrained(path, subfolder=...)``.

The same code path serves a hub id (``stable-diffusion-v1-5/stable-diffusion-v1-5``) and a
local diffusers folder, so the tiny test model exercises what users run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from raylora.config import ModelSection

SD_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass
class Components:
    tokenizer: Any
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    unet: torch.nn.Module
    noise_scheduler: Any


def resolve_model_path(model: ModelSection) -> str:
    """A local folder becomes an absolute path; anything else is passed on as a hub id."""
    p = os.path.expanduser(model.pretrained)
    if os.path.isdir(p) or p.startswith((".", "/", "~")):
        return os.path.abspath(p)
    return model.pretrained


def check_local_model(path: str) -> dict:
    """Problems with a local diffusers folder, found before any worker starts.

    Returns the parsed ``model_index.json``; raises FileNotFoundError naming the path.
    """
    index = os.path.join(path, "model_index.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.pretrained: {path}: no such directory")
    if not os.path.isfile(index):
        raise FileNotFoundError(
            f"model.pretrained: {path}: not a diffusers folder (no model_index.json)"
        )
    with open(index) as f:
        info = json.load(f)
    missing = [c for c in SD_COMPONENTS if not os.path.isdir(os.path.join(path, c))]
    if missing:
        raise FileNotFoundError(
            f"model.pretrained: {path}: missing component folder(s): {', '.join(missing)}"
        )
    return info


def vae_scale_factor(path: str) -> int:
    """Pixel → latent downsampling of a local model's VAE (8 for SD, 2 for the tiny one)."""
    with open(os.path.join(path, "vae", "config.json")) as f:
        return 2 ** (len(json.load(f)["block_out_channels"]) - 1)


def load_components(model: ModelSection, weight_dtype: torch.dtype) -> Components:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel

    path = resolve_model_path(model)
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
