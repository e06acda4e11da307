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


def snr(noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ᾱ_t / (1 − ᾱ_t) of each timestep, fp32 ``[B]``."""
    ab = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return ab / (1 - ab)


def min_snr_weights(snr_t: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-γ loss weights (Hang et al. 2023), per sample ``[B]``.

    For an ε target the MSE is weighted by min(SNR, γ)/SNR; for a v target, whose MSE is
    already (SNR+1)× the ε one, by min(SNR, γ)/(SNR + 1) (as in diffusers' scripts).
    """
    clipped = torch.clamp(snr_t, max=gamma)
    if prediction_type == "epsilon":
        # SNR 0 (t = T−1 of a zero-terminal-SNR schedule): 0/0, whose limit is 1; a NaN
        # there skipped every optimizer step whose batch drew that timestep.
        return torch.where(snr_t > 0, clipped / snr_t, torch.ones_like(snr_t))
    if prediction_type == "v_prediction":
        return clipped / (snr_t + 1)
    raise ValueError(f"train.prediction_type: unknown prediction type {prediction_type!r}")


def offset_noise(noise: torch.Tensor, offset: float) -> torch.Tensor:
    """Noise offset (Guttenberg 2023): add a per-sample, per-channel constant so the model
    learns to shift overall brightness. ``offset=0`` returns ``noise`` and draws nothing."""
    if not offset:
        return noise
    b, c = noise.shape[:2]
    shift = torch.randn((b, c) + (1,) * (noise.dim() - 2), device=noise.device, dtype=noise.dtype)
    return noise + offset * shift


def denoising_loss(
    model_pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error in fp32 (half-precision MSE loses the small late-timestep errors).
    With per-sample ``weights`` ``[B]``: mean over samples of weight × per-sample MSE.

    ``mask`` ``[B, 1, h, w]`` in [0, 1] (data.masked_loss, broadcast over channels)
    multiplies the squared error before the same mean (as kohya's masked loss): a latent
    pixel at 0 teaches nothing, and a sample's loss shrinks with the share it masks out
    (not renormalised by the mask's area, so an all-zero mask gives exactly zero loss and
    zero gradient rather than 0/0)."""
    if weights is None and mask is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    per_sample = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    if mask is not None:
        per_sample = per_sample * mask.float()
    per_sample = per_sample.mean(dim=tuple(range(1, per_sample.dim())))
    return per_sample.mean() if weights is None else (per_sample * weights.float()).mean()


def split_pairs(*tensors: torch.Tensor | None) -> tuple[tuple, tuple]:
    """A prior-preservation batch ``[2B, ...]`` (B instance samples, then B class samples,
    as diffusers' DreamBooth collate stacks them) → (instance halves, class halves) of each
    tensor; None stays None in both."""
    halves = [t.chunk(2, dim=0) if t is not None else (None, None) for t in tensors]
    return tuple(h[0] for h in halves), tuple(h[1] for h in halves)


def combine_prior(instance: torch.Tensor, prior: torch.Tensor, weight: float) -> torch.Tensor:
    """The DreamBooth objective: instance loss + ``weight`` × class (prior) loss."""
    return instance + weight * prior


def latent_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A batch's loss mask on the latent grid: pixel-resolution uint8 ``[B, 1, H, W]``
    (255: full weight) or float in [0, 1] → float32 ``[B, 1, h, w]``, each latent pixel the
    mean of the image pixels it encodes (area pooling: an avg-pool by the VAE factor when
    it divides, as it does for every family's grid). A mask already ``size`` (the latent
    cache stores it pooled) only becomes float."""
    m = mask.float() / 255.0 if mask.dtype == torch.uint8 else mask.float()
    if tuple(m.shape[-2:]) != tuple(size):
        m = F.interpolate(m, size=tuple(size), mode="area")
    return m
