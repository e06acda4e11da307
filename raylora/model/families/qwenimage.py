"""Qwen-Image: an MMDiT with flow matching conditioned on the last hidden state of a
Qwen2.5-VL language model (the caption wrapped in the pipeline's chat template, whose 34
template tokens are dropped), with an attention mask over the text; a video-style VAE
(frames axis of 1) with per-channel latent mean/std; 2×2-packed latent tokens.
As diffusers' Qwen-Image LoRA script."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule
from raylora.model.families.base import (
    Cond,
    Family,
    TextInput,
    encode_one_frame,
    llm_conditioning,
    pack_2x2,
    per_channel_stats,
    unpack_2x2,
)

# QwenImagePipeline.prompt_template_encode and its start index
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
            "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP = 34

# Qwen-Image's released transformer is in diffusers' layout, and so are ComfyUI's module
# names for it: the kohya names are the denoiser's own paths, for its modules only (so an
# adapter of another family does not pass for Qwen-Image's when raylora guesses one).
KOHYA_RULES = (
    Rule(r"transformer_blocks\.(\d+)\.(attn\.(?:to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)"
         r"|(?:img|txt)_mlp\.net\.(?:0\.proj|2)|(?:img|txt)_mod\.1)", "transformer_blocks_{0}_{1}"),
    Rule(r"(img_in|txt_in|proj_out|norm_out\.linear|time_text_embed\.timestep_embedder\.linear_[12])", "{0}"),
)


class QwenImage(Family):
    name = "qwenimage"
    class_names = ("QwenImagePipeline",)
    pipeline = "QwenImagePipeline"
    cuts_captions = True  # llm_conditioning: each batch's captions as long as its longest
    # 512: the pipeline's max_sequence_length (it tokenizes up to 1024 + 34, then keeps 512)
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512,
                      template=TEMPLATE, mask_key="attention_mask", long_context=True, drop=DROP),)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    repeated_blocks = ("QwenImageTransformerBlock",)
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_qwen_image"  # musubi-tuner's
    patch = 2
    default_guidance_scale = 4.0  # as true_cfg_scale (see guidance_kwargs)
    # The empty negative prompt the pipeline's docstring names (None turns guidance off).
    empty_caption = " "
    max_sequence_limit = 1024  # QwenImagePipeline (and the Edit one) raise above it
    description = "Qwen-Image (MMDiT, Qwen2.5-VL text encoder)"
    # a video VAE (per-channel statistics), a still image as one frame
    latent_stats = staticmethod(per_channel_stats)
    encode_pixels = staticmethod(encode_one_frame)

    @classmethod
    def guidance_kwargs(cls, scale: float | None = None, batch: int = 1) -> dict:
        # QwenImagePipeline ignores guidance_scale unless the transformer is guidance-
        # distilled (Qwen-Image is not); it runs classifier-free guidance (a second
        # transformer pass per step) only for true_cfg_scale > 1 *and* a negative prompt.
        # One per prompt: a single one is encoded as a text batch of 1, which the
        # transformer (diffusers 0.42, SDPA) happens to broadcast over a batch of images.
        s = cls.resolve_guidance(scale)
        if s <= 1:  # no guidance: a negative prompt would only be encoded, warned about, unused
            return {"true_cfg_scale": s}
        return {"true_cfg_scale": s, "negative_prompt": [cls.empty_caption] * batch}

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "prompt_embeds_mask")

    @staticmethod
    def vae_factor(vae_config):
        return 2 ** len(vae_config["temperal_downsample"])

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        return llm_conditioning(encoders[0], batch, layer=-1, drop=DROP)  # the last hidden state

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        b, _, h, w = noisy.shape
        out = model(hidden_states=pack_2x2(noisy), encoder_hidden_states=cond["prompt_embeds"],
                    encoder_hidden_states_mask=cond["prompt_embeds_mask"],
                    timestep=t.to(noisy.dtype), img_shapes=[(1, h // 2, w // 2)] * b,
                    return_dict=False)[0]
        return unpack_2x2(out, h, w)


FAMILY = QwenImage
