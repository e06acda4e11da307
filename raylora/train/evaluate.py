"""Held-out denoising loss at fixed timesteps with fixed noise. Plain PyTorch, no Ray.

Training loss is noisy: every step draws new timesteps and noise, so two adapters (or two
Tune trials) cannot be ranked by it. Here every held-out image is evaluated at the same K
timesteps, evenly spaced over the schedule, with noise drawn once from a fixed seed, and its
latents taken as the VAE posterior mean. Everything but the adapter is fixed, so the same
adapter gives the same number and two adapters differ only by what they learned.

``prepare_heldout`` does the fixed part once (VAE and text encoder run once per worker);
``heldout_loss`` is then K·N denoiser forwards, split across ranks and summed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from raylora.model.families.base import Cond, Family
from raylora.train.encode import batch_condition, batch_posterior, sample_latents
from raylora.train.modes import evaluating
from raylora.train.step import FrozenParts, with_reference


@dataclass
class HeldOut:
    """N images × K timesteps, ready for the denoiser. Item j is image ``text_index[j]``."""

    family: type[Family]
    noisy: torch.Tensor  # [N·K, C, h, w]
    timesteps: torch.Tensor  # [N·K]: DDPM steps (long) or flow σ (float)
    target: torch.Tensor  # [N·K, C, h, w] fp32
    text: Cond  # per image: the family's conditioning tensors, [N, ...] each
    text_index: torch.Tensor  # [N·K] long
    # Token ids (and SDXL size/crop) per image, kept when the text encoders train: their
    # output changes with the adapter, so ``encode_heldout_text`` redoes ``text``.
    text_batch: dict[str, torch.Tensor] | None = None
    guidance: float = 1.0

    def __len__(self) -> int:
        return self.timesteps.shape[0]


@torch.no_grad()
def prepare_heldout(
    parts: FrozenParts,
    batch: dict[str, torch.Tensor],
    num_timesteps: int,
    seed: int,
    batch_size: int = 8,
    device=None,
) -> HeldOut:
    """A raw (pixels + ids) or cached batch of N images → fixed noisy latents and targets."""
    if device is None:
        device = next(parts.vae.parameters()).device if parts.vae is not None else "cpu"
    n_rows = next(iter(batch.values())).shape[0]
    latents, texts = [], []
    for i in range(0, n_rows, batch_size):
        chunk = {k: v[i : i + batch_size].to(device) for k, v in batch.items()}
        params = batch_posterior(parts.family, parts.vae, chunk)
        latents.append(sample_latents(params.float(), parts.latent_shift, parts.latent_scale,
                                      sample=False))
        # (an edit pair's input latents: conditioning the text re-encoding keeps)
        texts.append(with_reference(parts, chunk, batch_condition(parts.family, parts.text_encoders,
                                                                 chunk), "held-out rows"))
    latents = torch.cat(latents)
    n = latents.shape[0]
    ts = parts.objective.eval_timesteps(num_timesteps, latents)
    k = ts.shape[0]
    # Noise drawn on the CPU from its own generator: the same on every device and rank,
    # and untouched by (and not touching) the training RNG streams.
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, k, *latents.shape[1:]), generator=gen).to(device)
    lat = latents.unsqueeze(1).expand(-1, k, *latents.shape[1:]).reshape(-1, *latents.shape[1:])
    noise = noise.reshape(-1, *latents.shape[1:])
    t = ts.repeat(n)
    noised = parts.objective.noised(lat, noise, t, weighted=False)
    index = torch.arange(n, device=device).repeat_interleave(len(ts))
    text_batch = None
    if parts.text_encoder_params:
        text_batch = {k: v.to(device) for k, v in batch.items()
                      if k != "pixel_values" and not k.startswith("control_values")}
    return HeldOut(parts.family, noised.noisy, t, noised.target.float(), Cond.cat(texts), index,
                   text_batch, parts.guidance)


@torch.no_grad()
def encode_heldout_text(parts: FrozenParts, heldout: HeldOut, batch_size: int = 8) -> None:
    """Re-encode the held-out captions with the text encoders as they are now (LoRA
    dropout off); a no-op unless the text encoders train."""
    if heldout.text_batch is None:
        return
    with evaluating(parts.text_encoders):
        n = next(iter(heldout.text_batch.values())).shape[0]
        text = Cond.cat([
            batch_condition(parts.family, parts.text_encoders,
                            {k: v[i : i + batch_size] for k, v in heldout.text_batch.items()})
            for i in range(0, n, batch_size)
        ])
        # what is not the text's (an edit pair's reference_latents) stays as encoded
        heldout.text = Cond({**heldout.text, **text})


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    heldout: HeldOut,
    weight_dtype: torch.dtype,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lockstep: bool = False,
) -> float:
    """Mean MSE over all N·K items. Rank r evaluates items r, r+world, ...; the per-rank
    (sum, count) pairs are summed with ``all_reduce_sum`` when running distributed.
    ``lockstep`` (FSDP, where every forward is a collective): every rank makes the same
    number of denoiser calls; a rank out of items evaluates item 0 again, uncounted."""
    idx = torch.arange(rank, len(heldout), world, device=heldout.timesteps.device)
    total = torch.zeros(2, dtype=torch.float64, device=heldout.timesteps.device)
    calls = -(-len(heldout) // world) if lockstep else idx.numel()
    with evaluating([model]):  # LoRA dropout off
        for i in range(0, calls, batch_size):
            j = idx[i : i + batch_size]
            counted = j.numel() > 0
            j = j if counted else idx.new_zeros(1)  # a stand-in call on item 0
            cond = heldout.text.select(heldout.text_index[j])
            if heldout.family.cuts_captions:  # as these rows' captions encode together
                cond = cond.cut_captions()
            pred = heldout.family.denoise(model, heldout.noisy[j].to(weight_dtype),
                                          heldout.timesteps[j], cond, guidance=heldout.guidance)
            if not counted:
                continue
            err = (pred.float() - heldout.target[j]).pow(2).flatten(1).mean(1)
            total[0] += err.double().sum()
            total[1] += j.numel()
    if all_reduce_sum is not None:
        total = all_reduce_sum(total)
    return float(total[0] / total[1])
