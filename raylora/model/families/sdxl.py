"""SDXL: two CLIP text encoders (penultimate hidden states joined, the second's projected
pooled embedding) and size/crop micro-conditioning (``add_time_ids``), as in diffusers'
SDXL LoRA script."""

from __future__ import annotations

import torch

from raylora.model.families.base import Cond, TextInput
from raylora.model.families.sd import SD


class SDXL(SD):
    name = "sdxl"
    class_names = ("StableDiffusionXLPipeline",)
    pipeline = "StableDiffusionXLPipeline"
    text = (TextInput("text_encoder", "tokenizer", "input_ids"),
            TextInput("text_encoder_2", "tokenizer_2", "input_ids_2"))
    description = "SDXL (UNet, CLIP-L + CLIP-G)"

    @classmethod
    def guidance_kwargs(cls, scale: float | None = None, batch: int = 1) -> dict:
        # Without a negative prompt StableDiffusionXLPipeline guides from all-zero
        # embeddings (force_zeros_for_empty_prompt); a dropped caption trains on the empty
        # prompt's CLIP embeddings, as kohya-ss and ComfyUI's empty negative encode it:
        # raylora samples with that, and the card's call names it.
        return {**super().guidance_kwargs(scale, batch), "negative_prompt": [cls.empty_caption] * batch}

    @classmethod
    def kohya_version(cls, sd: dict[str, torch.Tensor]) -> dict[str, str]:
        return {"ss_base_model_version": "sdxl_base_v1-0", "ss_v2": "False"}  # as sd-scripts

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "pooled_prompt_embeds", "time_ids")

    @classmethod
    def caption_keys(cls):  # time_ids are the image's size and crop
        return ("prompt_embeds", "pooled_prompt_embeds")

    @staticmethod
    def latent_stats(vae_config):
        """(shift, scale): with a VAE that has both ``latents_mean`` and ``latents_std``
        (Playground v2.5's), per channel (z − mean) · scaling_factor / std, the inverse of
        StableDiffusionXLPipeline's decode (x · std / scaling_factor + mean) and what
        diffusers' SDXL LoRA script trains on; else SD's z · scaling_factor."""
        mean, std = vae_config.get("latents_mean"), vae_config.get("latents_std")
        if mean is None or std is None:  # the pipeline's test: both, or neither is used
            return SD.latent_stats(vae_config)
        scale = float(vae_config.get("scaling_factor", 0.18215))  # AutoencoderKL's default
        return [float(m) for m in mean], [scale / float(s) for s in std]

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        hidden, pooled = [], None
        for enc, t in zip(encoders, cls.text):
            out = enc(batch[t.ids_key], output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out[0]  # CLIPTextModelWithProjection: text_embeds [B, P]
        return Cond(prompt_embeds=torch.cat(hidden, dim=-1), pooled_prompt_embeds=pooled,
                    time_ids=time_ids(batch).to(pooled.device))

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": cond["time_ids"]}
        return model(noisy, t, encoder_hidden_states=cond["prompt_embeds"],
                     added_cond_kwargs=added, return_dict=False)[0]

    @classmethod
    def kohya_names(cls):
        # sd-scripts names SDXL's two encoders te1 / te2
        return {"unet.": "lora_unet_", "text_encoder.": "lora_te1_", "text_encoder_2.": "lora_te2_"}


def time_ids(batch) -> torch.Tensor:
    """SDXL's micro-conditioning per image: (orig_h, orig_w, crop_top, crop_left, target_h,
    target_w), as diffusers' SDXL script builds it. ``[B, 6]`` fp32."""
    return torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], 1).float()


FAMILY = SDXL
