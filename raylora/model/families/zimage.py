"""Z-Image (Turbo): a single-stream DiT with flow matching, conditioned on the second-to-last
hidden state of a Qwen3 language model over the caption in Qwen3's chat template; the Flux.1
VAE (16 channels, shift/scale). Its transformer takes a list of images and a list of
captions, each of its own length, and a timestep that is 1 at the image and 0 at pure
noise, and predicts x₀ − ε, the negative of the flow target. As diffusers' Z-Image LoRA
script."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule, fused
from raylora.model.families.base import Cond, Family, TextInput, llm_conditioning

# What ZImagePipeline's tokenizer.apply_chat_template(add_generation_prompt=True,
# enable_thinking=True) makes of a one-message conversation with Qwen3's template.
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

_L = r"((?:layers|noise_refiner|context_refiner)\.\d+)\."
# diffusers ZImageTransformer2DModel → the released single-file checkpoint's module names
# (fused attention.qkv, attention.out; ComfyUI's, as musubi-tuner's
# convert_z_image_lora_to_comfy.py writes them and diffusers' Z-Image loader splits them).
KOHYA_RULES = (
    *fused(_L + r"attention\.", ("to_q", "to_k", "to_v"), "{0}_attention_qkv"),
    Rule(_L + r"attention\.to_out\.0", "{0}_attention_out"),
    Rule(_L + r"(feed_forward\.w[123]|adaLN_modulation\.0)", "{0}_{1}"),
    Rule(r"all_x_embedder\.2-1", "x_embedder"),
    Rule(r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)", "final_layer_{0}"),
    Rule(r"(t_embedder\.mlp\.[02]|cap_embedder\.1)", "{0}"),
)


class ZImage(Family):
    name = "zimage"
    class_names = ("ZImagePipeline",)
    pipeline = "ZImagePipeline"
    cuts_captions = True  # llm_conditioning: each batch's captions as long as its longest
    # 512 as the pipeline's max_sequence_length, the template's tokens included (the
    # pipeline truncates the templated text, and keeps every token that is not padding)
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512, template=TEMPLATE,
                      mask_key="attention_mask", long_context=True),)
    # diffusers' train_dreambooth_lora_z_image.py defaults
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    repeated_blocks = ("ZImageTransformerBlock",)
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_zimage"  # musubi-tuner's
    kohya_fused_load = "whole"  # diffusers' Z-Image converter: q, k, v each the fused down
    patch = 2
    # ZImagePipeline's default; Z-Image-Turbo (guidance-distilled) samples at 0.
    default_guidance_scale = 5.0
    description = "Z-Image (single-stream DiT, Qwen3 text encoder)"

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "prompt_embeds_mask")

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        # The second-to-last hidden state, template tokens kept; denoise passes each
        # caption's own tokens only.
        return llm_conditioning(encoders[0], batch, layer=-2)

    @classmethod
    def model_timestep(cls, t):
        return 1.0 - t  # the pipeline's (1000 − t) / 1000 with t = 1000·σ

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        emb = cond["prompt_embeds"]
        # The model takes each caption at its own length: reading the lengths is one host
        # sync per step, as the pipeline's boolean mask is (captions are right-padded).
        lengths = cond["prompt_embeds_mask"].sum(1).tolist()
        captions = [e[:n] for e, n in zip(emb, lengths)]
        images = list(noisy.unsqueeze(2).unbind(0))  # each [C, frames=1, h, w]
        # The timestep in fp32, as the pipeline passes it (the model casts only its sinusoidal
        # embedding): 1 − σ in bf16 steps by 1/256 near 1, and σ < 0.002 would read as t = 1.
        out = model(images, cls.model_timestep(t.float()), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)


FAMILY = ZImage
