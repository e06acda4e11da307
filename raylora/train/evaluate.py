"""Held-out denoising loss at fixed timesteps with fixed noise. Plain PyTorch, no Ray.

Training loss is noisy: every step draws new timesteps and noise, so two adapters (or two
Tune trials) cannot be ranked by it. Here every held-out image is evaluated at the same K
timesteps, evenly spaced over the schedule, with noise drawn once from a fixed seed, and its
latents taken as the VAE posterior mean. Everything but the adapter is fixed, so the same
adapter gives the same number and two adapters differ only by what they learned.

``prepare_heldout`` does the fixed part once (VAE and text encoder run once per worker);
``heldout_loss`` is then K·N UNet forwards, split across ranks and summed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from raylora.train.loss import diffusion_target
from raylora.train.step import FrozenParts


def eval_timesteps(num_train_timesteps: int, k: int) -> list[int]:
    """K timesteps at the centres of K equal slices of [0, T): (i + 0.5)·T/K."""
    return [int((i + 0.5) * num_train_timesteps / k) for i in range(k)]


@dataclass
class HeldOut:
    """N images × K timesteps, ready for the UNet. Item j is image ``text_index[j]``."""

    noisy: torch.Tensor  # [N·K, C, h, w]
    timesteps: torch.Tensor  # [N·K] long
    target: torch.Tensor  # [N·K, C, h, w] fp32
    text: torch.Tensor  # [N, L, D]
    text_index: torch.Tensor  # [N·K] long

    def __len__(self) -> int:
        return self.timesteps.shape[0]


@torch.no_grad()
def prepare_heldout(
    parts: FrozenParts,
    pixel_values: torch.Tensor,
    input_ids: torch.Tensor,
    num_timesteps: int,
    seed: int,
    batch_size: int = 8,
) -> HeldOut:
    """pixels ``[N,3,H,W]`` in [-1,1] and ids ``[N,L]`` → fixed noisy latents and targets."""
    device = next(parts.vae.parameters()).device
    latents, texts = [], []
    for i in range(0, pixel_values.shape[0], batch_size):
        px = pixel_values[i : i + batch_size].to(device, parts.weight_dtype)
        dist = parts.vae.encode(px).latent_dist
        latents.append(dist.mean.float() * parts.vae.config.scaling_factor)
        texts.append(parts.text_encoder(input_ids[i : i + batch_size].to(device), return_dict=False)[0])
    latents = torch.cat(latents)
    n = latents.shape[0]
    sched = parts.noise_scheduler
    ts = eval_timesteps(sched.config.num_train_timesteps, num_timesteps)
    # Noise drawn on the CPU from its own generator: the same on every device and rank,
    # and untouched by (and not touching) the training RNG streams.
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, len(ts), *latents.shape[1:]), generator=gen).to(device)
    lat = latents.unsqueeze(1).expand(-1, len(ts), *latents.shape[1:]).reshape(-1, *latents.shape[1:])
    noise = noise.reshape(-1, *latents.shape[1:])
    t = torch.tensor(ts, device=device, dtype=torch.long).repeat(n)
    noisy = sched.add_noise(lat, noise, t)
    target = diffusion_target(sched, lat, noise, t, parts.prediction_type).float()
    index = torch.arange(n, device=device).repeat_interleave(len(ts))
    return HeldOut(noisy, t, target, torch.cat(texts), index)


@torch.no_grad()
def heldout_loss(
    unet: torch.nn.Module,
    heldout: HeldOut,
    weight_dtype: torch.dtype,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean MSE over all N·K items. Rank r evaluates items r, r+world, ...; the per-rank
    (sum, count) pairs are summed with ``all_reduce_sum`` when running distributed."""
    was_training = unet.training
    unet.eval()  # LoRA dropout off
    idx = torch.arange(rank, len(heldout), world, device=heldout.timesteps.device)
    total = torch.zeros(2, dtype=torch.float64, device=heldout.timesteps.device)
    try:
        for i in range(0, idx.numel(), batch_size):
            j = idx[i : i + batch_size]
            pred = unet(
                heldout.noisy[j].to(weight_dtype),
                heldout.timesteps[j],
                heldout.text[heldout.text_index[j]],
                return_dict=False,
            )[0]
            err = (pred.float() - heldout.target[j]).pow(2).flatten(1).mean(1)
            total[0] += err.double().sum()
            total[1] += j.numel()
    finally:
        unet.train(was_training)
    if all_reduce_sum is not None:
        total = all_reduce_sum(total)
    return float(total[0] / total[1])
