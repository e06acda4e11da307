"""One training micro-step and one optimizer step; plain PyTorch + Accelerate, no Ray.

``compute_loss`` is the whole diffusion objective for a batch; ``train_micro_step`` wraps it
in Accelerate's accumulation context, which skips the DDP all-reduce on non-final
micro-steps, unscales and clips before the optimizer step, and steps the optimizer and LR
scheduler only when gradients were synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylora.train.loss import (
    denoising_loss,
    diffusion_target,
    min_snr_weights,
    offset_noise,
    sample_timesteps,
    snr,
)


@dataclass
class FrozenParts:
    """Everything the step needs besides the trainable UNet."""

    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    noise_scheduler: Any
    weight_dtype: torch.dtype
    prediction_type: str
    snr_gamma: float | None = None  # min-SNR-γ weighting; None = plain MSE
    noise_offset: float = 0.0


def encode_batch(parts: FrozenParts, pixel_values: torch.Tensor, input_ids: torch.Tensor):
    """pixels ``[B,3,H,W]`` in [-1,1], ids ``[B,L]`` → latents ``[B,4,H/f,W/f]``, text ``[B,L,D]``."""
    with torch.no_grad():
        dist = parts.vae.encode(pixel_values.to(parts.weight_dtype)).latent_dist
        latents = dist.sample() * parts.vae.config.scaling_factor
        text = parts.text_encoder(input_ids, return_dict=False)[0]
    return latents, text


def compute_loss(unet: torch.nn.Module, parts: FrozenParts, batch: dict[str, torch.Tensor]):
    """The diffusion training objective for one batch; randomness from torch's global RNG."""
    latents, text = encode_batch(parts, batch["pixel_values"], batch["input_ids"])
    noise = torch.randn_like(latents)
    timesteps = sample_timesteps(
        latents.shape[0], parts.noise_scheduler.config.num_train_timesteps, latents.device
    )
    noise = offset_noise(noise, parts.noise_offset)
    noisy = parts.noise_scheduler.add_noise(latents, noise, timesteps)
    target = diffusion_target(parts.noise_scheduler, latents, noise, timesteps, parts.prediction_type)
    pred = unet(noisy, timesteps, text, return_dict=False)[0]
    weights = None
    if parts.snr_gamma is not None:
        weights = min_snr_weights(
            snr(parts.noise_scheduler, timesteps), parts.snr_gamma, parts.prediction_type
        )
    return denoising_loss(pred, target, weights)


def train_micro_step(
    accelerator,
    unet: torch.nn.Module,
    parts: FrozenParts,
    optimizer,
    lr_scheduler,
    params: list[torch.nn.Parameter],
    batch: dict[str, torch.Tensor],
    max_grad_norm: float,
) -> torch.Tensor:
    """Forward + backward for one micro-batch; the optimizer steps on the last of each
    accumulation group. Returns the detached loss, NaN when the optimizer step was skipped.

    Non-finite gradients skip the optimizer step. Backward always runs (DDP expects it),
    and the check happens after the gradients were all-reduced, so a NaN on any rank, in
    any micro-batch of the group, reaches every rank and all of them skip together. Under
    fp16 the GradScaler makes that call itself (and lowers its scale), so it still steps.
    """
    skip = False
    with accelerator.accumulate(unet):
        loss = compute_loss(unet, parts, batch)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(params, max_grad_norm)
            skip = norm is not None and not bool(torch.isfinite(torch.as_tensor(norm)))
        if not skip or accelerator.scaler is not None:
            optimizer.step()
        if lr_scheduler is not None:  # None: the caller sets the lr itself (lr-find)
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    return torch.full_like(loss, float("nan")) if skip else loss
