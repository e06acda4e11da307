"""Frozen encoders: images → latents, captions → denoiser conditioning. Plain PyTorch, no Ray.

One code path for every model family (``raylora.model.families``) and for raw batches
(pixels + token ids, encoded every step) and cached ones (VAE posterior parameters + the
family's conditioning tensors, encoded once by ``raylora.data.cache``). A batch is a dict:

raw:    pixel_values [B,3,H,W] uint8, input_ids [B,L] (+ input_ids_2/_3, attention_mask for
        families with more encoders or a masked one), original_size, crop_top_left,
        target_size [B,2] (SDXL's micro-conditioning)
cached: latent_params [B,2C,h,w] (posterior mean ‖ logvar) + the family's cond_keys()
        (prompt_embeds [B,L,D], pooled_prompt_embeds [B,P], time_ids [B,6], ...)

Either may carry ``loss_mask`` (data.masked_loss): uint8 [B,1,H,W] raw, float [B,1,h,w]
cached; ``raylora.train.step.compute_loss`` brings it to the latent grid. And an edit
pair's input image (data.control_images): ``control_values`` uint8 [B,3,H,W] raw,
``control_params`` [B,2C,h,w] cached, which ``batch_reference`` makes the conditioning's
``reference_latents`` (the posterior's mean, normalised: what the family's pipeline feeds
its denoiser for an input image); a sample's input k ≥ 2 (data.control_inputs) under
``control_values_k`` / ``control_params_k`` → ``reference_latents_k``.
"""

from __future__ import annotations

import torch

from raylora.config import control_key
from raylora.model.families.base import Cond, Family

__all__ = ["Cond", "batch_condition", "batch_posterior", "batch_reference", "sample_latents",
           "vae_posterior"]


@torch.no_grad()
def vae_posterior(family: type[Family], vae: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixels ``[B,3,H,W]``, uint8 as the data stage ships them or float already in
    [-1,1] → posterior parameters ``[B,2C,h,w]`` (mean ‖ logvar)."""
    dtype = next(vae.parameters()).dtype
    if pixel_values.dtype == torch.uint8:
        from raylora.data.preprocess import to_unit_range

        pixel_values = to_unit_range(pixel_values)
    # contiguous: the conv may return channels-last; keep one layout for every consumer.
    return family.encode_pixels(vae, pixel_values.to(dtype)).contiguous()


def _per_channel(x, like: torch.Tensor):
    """A float or a per-channel list as something that broadcasts over ``[B,C,h,w]``."""
    if isinstance(x, (int, float)):
        return x
    return torch.tensor(x, device=like.device, dtype=like.dtype).view(1, -1, 1, 1)


def sample_latents(params: torch.Tensor, shift=0.0, scale=1.0, sample: bool = True) -> torch.Tensor:
    """Posterior parameters → normalised latents (z − shift)·scale: a draw from torch's
    global RNG (the draw ``latent_dist.sample()`` makes, so cached and uncached runs
    match), or the mean."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    dist = DiagonalGaussianDistribution(params.contiguous())
    z = dist.sample() if sample else dist.mean
    if shift != 0.0:
        z = z - _per_channel(shift, z)
    return (z * _per_channel(scale, z)).contiguous()


def batch_condition(family: type[Family], text_encoders, batch: dict) -> Cond:
    """The denoiser conditioning of a raw or cached batch."""
    return family.condition(text_encoders, batch)


def batch_posterior(family: type[Family], vae, batch: dict) -> torch.Tensor:
    if "latent_params" in batch:
        return batch["latent_params"]
    return vae_posterior(family, vae, batch["pixel_values"])


def batch_reference(family: type[Family], vae, batch: dict, shift=0.0, scale=1.0,
                    index: int = 0) -> torch.Tensor | None:
    """The normalised latents of a batch's control images, input ``index`` of each sample
    (data.control_inputs; its posterior's mean: the pipelines encode an input image with
    ``sample_mode="argmax"``), None for a batch without them."""
    cached, raw = control_key("control_params", index), control_key("control_values", index)
    if cached in batch:
        params = batch[cached]
    elif raw in batch:
        params = vae_posterior(family, vae, family.reference_pixels(batch[raw], vae))
    else:
        return None
    return sample_latents(params, shift, scale, sample=False)
