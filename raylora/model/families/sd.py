"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet, ε or v-prediction (DDPM)."""

from __future__ import annotations

import torch

from raylora.model.families.base import Cond, Family, TextInput


class SD(Family):
    name = "sd"
    class_names = ("StableDiffusionPipeline",)
    pipeline = "StableDiffusionPipeline"
    denoiser = "unet"
    text = (TextInput("text_encoder", "tokenizer", "input_ids"),)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # Regional compilation: diffusers' UNet2DConditionModel._repeated_blocks.
    repeated_blocks = ("BasicTransformerBlock",)
    description = "SD 1.x/2.x (UNet, CLIP)"
    kohya_export = True
    lycoris_file = True
    legacy_lora_keys = True  # train_text_to_image_lora*.py convert_state_dict_to_diffusers
    cudnn_sdpa = True  # PyTorch's default backend choice for the UNet

    @classmethod
    def set_attention(cls, model, kind: str) -> None:
        """sdpa: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPUs
        that have them). Set explicitly so a model saved with another processor trains on it."""
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        model.set_attn_processor(AttnProcessor2_0() if kind == "sdpa" else AttnProcessor())

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        return Cond(prompt_embeds=encoders[0](batch["input_ids"], return_dict=False)[0])

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        return model(noisy, t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]


FAMILY = SD
