"""Validation images: fixed prompts, fixed seed, the adapter being trained. No Ray.

Rank 0 builds a stock diffusers pipeline around the UNet it trains (LoRA layers live
inside it, so no weights are copied), renders every prompt with the same seed each time,
and frees the pipeline again, so the training GPU holds it only while rendering. With the
latent cache the worker has no VAE or text encoder; they are loaded for the render and
dropped after it.
"""

from __future__ import annotations

import gc
import math
from contextlib import nullcontext

import torch
from PIL import Image


def make_grid(images: list[Image.Image], cols: int | None = None) -> Image.Image:
    """Images (same size) in rows of ``cols`` (default: a near-square grid)."""
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return grid


def build_pipeline(model_path: str, family: str, unet, vae=None, text_encoders=(), tokenizers=(),
                   dtype: torch.dtype = torch.float32, device="cpu"):
    """A stock pipeline that shares ``unet`` (and whatever encoders are already loaded)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    kw: dict = {"unet": unet}
    if vae is not None:
        kw["vae"] = vae
    names = ("text_encoder", "text_encoder_2")
    for name, enc in zip(names, text_encoders):
        kw[name] = enc
    for name, tok in zip(("tokenizer", "tokenizer_2"), tokenizers):
        kw[name] = tok
    if family == "sdxl":
        pipe = StableDiffusionXLPipeline.from_pretrained(model_path, torch_dtype=dtype, **kw)
    else:
        pipe = StableDiffusionPipeline.from_pretrained(
            model_path, torch_dtype=dtype, safety_checker=None, requires_safety_checker=False, **kw
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


@torch.no_grad()
def render(pipe, prompts: list[str], seed: int, steps: int, guidance_scale: float,
           resolution: int, autocast=None) -> list[Image.Image]:
    """One image per prompt; image i uses generator seed ``seed + i`` on the CPU, so the
    same adapter gives the same picture on any device and at any step."""
    was_training = pipe.unet.training
    pipe.unet.eval()
    try:
        images = []
        for i, prompt in enumerate(prompts):
            with autocast() if autocast is not None else nullcontext():
                out = pipe(
                    prompt, num_inference_steps=steps, guidance_scale=guidance_scale,
                    height=resolution, width=resolution,
                    generator=torch.Generator().manual_seed(seed + i),
                )
            images.append(out.images[0])
        return images
    finally:
        pipe.unet.train(was_training)


def free_memory() -> None:
    """After the caller dropped its pipeline: collect it and return cached GPU memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
