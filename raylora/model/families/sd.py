"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet, ε or v-prediction (DDPM)."""

from __future__ import annotations

import logging

import torch

from raylora.model.families.base import Cond, Family, TextInput

log = logging.getLogger(__name__)


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
    def kohya_version(cls, sd: dict[str, torch.Tensor]) -> dict[str, str]:
        # A1111/Forge list a LoRA with a checkpoint of its version only, and read the
        # version from these keys (no ss_v2: SD 1). SD 2's cross-attention reads OpenCLIP
        # ViT-H's 1024-wide states, SD 1's CLIP ViT-L's 768: the input width of a
        # cross-attention key/value LoRA, else of a text-encoder LoRA (targets without
        # to_k/to_v, e.g. [to_q, to_out.0], with the text encoder trained).
        def widths(keep) -> set[int]:
            return {v.shape[1] for k, v in sd.items()
                    if keep(k) and ("lora.down" in k or "lora_A" in k)}

        found = (widths(lambda k: ".attn2.to_k." in k or ".attn2.to_v." in k)
                 or widths(lambda k: k.startswith("text_encoder.") and ".self_attn." in k))
        if not found:
            log.warning("kohya export: this SD adapter has no cross-attention key/value or "
                        "text-encoder LoRA to tell SD 1 from SD 2 by; its file says SD 1 "
                        "(ss_base_model_version sd_v1)")
        v2 = found == {1024}
        return {"ss_base_model_version": "sd_v2" if v2 else "sd_v1", "ss_v2": str(v2)}

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        return Cond(prompt_embeds=encoders[0](batch["input_ids"], return_dict=False)[0])

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        return model(noisy, t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]


FAMILY = SD
