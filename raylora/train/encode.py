"""Frozen encoders: images → latents, captions → UNet conditioning. Plain PyTorch, no Ray.

One code path for SD 1.x/2.x and SDXL, and for raw batches (pixels + token ids, encoded
every step) and cached ones (VAE posterior parameters + text embeddings, encoded once by
``raylora.data.cache``). A batch is a dict of tensors:

raw:    pixel_values [B,3,H,W] uint8, input_ids [B,L] (+ input_ids_2 [B,L],
        original_size [B,2], crop_top_left [B,2] for SDXL)
cached: latent_params [B,2C,h,w] (posterior mean ‖ logvar), prompt_embeds [B,L,D]
        (+ pooled_prompt_embeds [B,P], time_ids [B,6] for SDXL)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ID_KEYS = ("input_ids", "input_ids_2")


@dataclass
class Cond:
    """What the UNet is conditioned on. ``pooled``/``time_ids`` only for SDXL."""

    hidden: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor | None = None  # [B, P]
    time_ids: torch.Tensor | None = None  # [B, 6]

    def unet_kwargs(self) -> dict:
        kw: dict = {"encoder_hidden_states": self.hidden}
        if self.pooled is not None:
            kw["added_cond_kwargs"] = {"text_embeds": self.pooled, "time_ids": self.time_ids}
        return kw

    def select(self, index: torch.Tensor) -> "Cond":
        pick = lambda x: None if x is None else x[index]  # noqa: E731
        return Cond(self.hidden[index], pick(self.pooled), pick(self.time_ids))

    def to(self, device=None, dtype=None) -> "Cond":
        move = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
        return Cond(move(self.hidden), move(self.pooled), move(self.time_ids))

    @staticmethod
    def cat(conds: list["Cond"]) -> "Cond":
        join = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        return Cond(
            join([c.hidden for c in conds]),
            join([c.pooled for c in conds]),
            join([c.time_ids for c in conds]),
        )


def sdxl_time_ids(
    original_size: torch.Tensor, crop_top_left: torch.Tensor, target: int
) -> torch.Tensor:
    """SDXL's micro-conditioning: (orig_h, orig_w, crop_top, crop_left, target_h, target_w)
    per image, as in diffusers' SDXL training script. ``[B,2]``, ``[B,2]`` → ``[B,6]``."""
    tgt = torch.full_like(original_size, target)
    return torch.cat([original_size, crop_top_left, tgt], dim=1).float()


def encode_text(text_encoders: list[torch.nn.Module], ids: list[torch.Tensor]) -> Cond:
    """Token ids per encoder → hidden states (and SDXL's pooled embedding).

    SD: the last hidden state of the one encoder. SDXL: both encoders' penultimate hidden
    states joined along features, and encoder 2's projected pooled output. Builds a graph
    when grad is enabled (text-encoder LoRA); frozen callers run it under ``no_grad``.
    """
    if len(text_encoders) == 1:
        return Cond(text_encoders[0](ids[0], return_dict=False)[0])
    hidden, pooled = [], None
    for enc, x in zip(text_encoders, ids):
        out = enc(x, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]  # CLIPTextModelWithProjection: text_embeds [B, P]
    return Cond(torch.cat(hidden, dim=-1), pooled)


@torch.no_grad()
def vae_posterior(vae: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixels ``[B,3,H,W]``, uint8 as the data stage ships them or float already in
    [-1,1] → posterior parameters ``[B,2C,h,w]`` (mean ‖ logvar)."""
    dtype = next(vae.parameters()).dtype
    if pixel_values.dtype == torch.uint8:
        from raylora.data.preprocess import to_unit_range

        pixel_values = to_unit_range(pixel_values)
    # contiguous: the conv may return channels-last; keep one layout for every consumer.
    return vae.encode(pixel_values.to(dtype)).latent_dist.parameters.contiguous()


def sample_latents(params: torch.Tensor, scale: float, sample: bool = True) -> torch.Tensor:
    """Posterior parameters → scaled latents: a draw from torch's global RNG (the same
    draw ``latent_dist.sample()`` makes, so cached and uncached runs match), or the mean."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    dist = DiagonalGaussianDistribution(params.contiguous())
    latents = dist.sample() if sample else dist.mean
    return (latents * scale).contiguous()


def batch_condition(text_encoders, batch: dict, resolution: int | None = None) -> Cond:
    """The UNet conditioning of a raw or cached batch."""
    if "prompt_embeds" in batch:
        return Cond(batch["prompt_embeds"], batch.get("pooled_prompt_embeds"), batch.get("time_ids"))
    cond = encode_text(text_encoders, [batch[k] for k in ID_KEYS if k in batch])
    if cond.pooled is not None:
        size = resolution or batch["pixel_values"].shape[-1]
        cond.time_ids = sdxl_time_ids(batch["original_size"], batch["crop_top_left"], size).to(
            cond.pooled.device
        )
    return cond


def batch_posterior(vae, batch: dict) -> torch.Tensor:
    if "latent_params" in batch:
        return batch["latent_params"]
    return vae_posterior(vae, batch["pixel_values"])
