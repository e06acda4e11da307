"""Base pipeline + adapter → one image. What a user does after training, in one call."""

from __future__ import annotations

import os

import torch


def sample(
    model: str,
    adapter: str,
    prompt: str,
    out: str,
    seed: int = 0,
    steps: int = 25,
    guidance_scale: float = 7.5,
    size: int | None = None,
) -> str:
    from diffusers import AutoPipelineForText2Image

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    path = os.path.abspath(model) if os.path.isdir(model) else model
    # The pipeline class (SD or SDXL) comes from the model's model_index.json.
    pipe = AutoPipelineForText2Image.from_pretrained(path, torch_dtype=dtype)
    pipe.load_lora_weights(adapter)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    size = size or pipe.unet.config.sample_size * pipe.vae_scale_factor
    image = pipe(
        prompt,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=size,
        width=size,
        generator=torch.Generator(device="cpu").manual_seed(seed),
    ).images[0]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    image.save(out)
    return out
