"""Denoising loss maths: pure tensor functions, no models, no Ray.

Shapes: latents/noise/target ``[B, C, h, w]``; timesteps ``[B]`` int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_timesteps(
    batch_size: int, num_train_timesteps: int, device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Integer timesteps drawn uniformly from [0, T)."""
    return torch.randint(
        0, num_train_timesteps, (batch_size,), device=device, generator=generator
    ).long()


def diffusion_target(
    noise_scheduler,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    prediction_type: str,
) -> torch.Tensor:
    """What the UNet should predict: the noise (epsilon) or the velocity (v-prediction).

    v = sqrt(ᾱ_t)·ε − sqrt(1−ᾱ_t)·x₀ (Salimans & Ho 2022), via the scheduler's own
    ``get_velocity`` so the schedule is the one the model was trained with.
    """
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"train.prediction_type: unknown prediction type {prediction_type!r}")


def denoising_loss(model_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (half-precision MSE loses the small late-timestep errors)."""
    return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
