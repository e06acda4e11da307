"""Lumina-Image 2.0 (and checkpoints of its layout, Neta Lumina): a single-stream DiT with
flow matching over 2×2-patched Flux.1-VAE latents (16 channels, shift/scale), conditioned
on the second-to-last hidden state of Gemma 2 (2B) over the caption behind the pipeline's
system prompt. Its transformer takes the caption tokens its mask marks (the first ones of
each row: right padding), a timestep that is 1 at the image and 0 at pure noise, and
predicts x₀ − ε, the negative of the flow target: Z-Image's conditioning, timestep and
target, with a batched transformer call. As diffusers' Lumina2 LoRA script
(train_dreambooth_lora_lumina2.py)."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule, fused
from raylora.model.families.base import Cond, TextInput, checkpoint_each
from raylora.model.families.zimage import ZImage

# Lumina2Pipeline.system_prompt; encode_prompt writes each prompt as
# system_prompt + " <Prompt Start> " + prompt (its negative prompt bare: template_empty).
SYSTEM = ("You are an assistant designed to generate superior images with the superior "
          "degree of image-text alignment based on textual prompts or user prompts.")


def template(system: str) -> str:
    """The caption template behind the system prompt ``system`` (model.system_prompt)."""
    return system.replace("{", "{{").replace("}", "}}") + " <Prompt Start> {}"


TEMPLATE = template(SYSTEM)

_L = r"((?:layers|noise_refiner|context_refiner)\.\d+)\."
# diffusers Lumina2Transformer2DModel → the released checkpoint's (Alpha-VLLM's NextDiT)
# module names, which sd-scripts' networks/lora_lumina.py trains ("lora_unet_" + the path)
# and ComfyUI matches; diffusers' convert_lumina2_to_diffusers reads them back. The fused
# attention.qkv holds 24 query heads and 8 key/value heads (2304 : 768 : 768 rows): a
# checkpoint of another ratio is refused at export ("different ranks or widths").
KOHYA_RULES = (
    *fused(_L + r"attn\.", ("to_q", "to_k", "to_v"), "{0}_attention_qkv", sizes=(3, 1, 1)),
    Rule(_L + r"attn\.to_out\.0", "{0}_attention_out"),
    Rule(_L + r"feed_forward\.linear_([123])", "{0}_feed_forward_w{1}"),
    Rule(_L + r"norm1\.linear", "{0}_adaLN_modulation_1"),
    Rule(r"x_embedder", "x_embedder"),
    Rule(r"time_caption_embed\.caption_embedder\.1", "cap_embedder_1"),
    Rule(r"time_caption_embed\.timestep_embedder\.linear_1", "t_embedder_mlp_0"),
    Rule(r"time_caption_embed\.timestep_embedder\.linear_2", "t_embedder_mlp_2"),
    Rule(r"norm_out\.linear_1", "final_layer_adaLN_modulation_1"),
    Rule(r"norm_out\.linear_2", "final_layer_linear"),
)


class Lumina2(ZImage):
    name = "lumina2"
    class_names = ("Lumina2Pipeline",)
    pipeline = "Lumina2Pipeline"
    # The pipeline pads to max_sequence_length (256) with the template inside it and
    # truncates the rest. Right padding whatever the tokenizer's own side (Gemma's is
    # left): the transformer reads each caption as the first mask-sum tokens of its row.
    # Cutting the padding after the longest caption (llm_conditioning) changes no kept
    # hidden state under Gemma's causal attention, nor the transformer's output (it drops
    # masked tokens before the joint blocks).
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=256, template=TEMPLATE,
                      mask_key="attention_mask", long_context=True, template_empty=False),)
    # train_dreambooth_lora_lumina2.py's default --lora_layers (Z-Image's too)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # The joint blocks and the noise/context refiners are all Lumina2TransformerBlock.
    repeated_blocks = ("Lumina2TransformerBlock",)
    # Lumina2Pipeline's default, run with its cfg_normalization (on) and cfg_trunc_ratio
    # (1.0: guidance at every step), which raylora's previews leave at the pipeline's.
    default_guidance_scale = 4.0
    max_sequence_limit = 512  # Lumina2Pipeline raises above it
    system_prompt = SYSTEM
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_lumina"  # sd-scripts'
    kohya_fused_load = None  # Lumina2Pipeline's loader reads no kohya file
    description = "Lumina-Image 2.0 (single-stream DiT, Gemma 2 text encoder)"

    # cond_keys, encode_text (hidden_states[-2], the template's tokens kept) and
    # model_timestep (1 − σ): Z-Image's.

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        # [B, C, h, w] in and out: the transformer patches the latents itself.
        # The timestep in fp32, as the pipeline passes it: Z-Image's reason.
        out = model(hidden_states=noisy, timestep=cls.model_timestep(t.float()),
                    encoder_hidden_states=cond["prompt_embeds"],
                    encoder_attention_mask=cond["prompt_embeds_mask"], return_dict=False)[0]
        return -out

    @classmethod
    def system_template(cls, system_prompt: str) -> str:
        return template(system_prompt)

    @classmethod
    def checkpoint_blocks(cls, denoiser, enable: bool = True) -> None:
        # diffusers' switch recomputes the joint layers alone, not the noise and context
        # refiners (Lumina2TransformerBlock too, the noise refiner's activations as large
        # as a joint layer's image part): each block checkpoints its own forward instead.
        checkpoint_each((*denoiser.noise_refiner, *denoiser.context_refiner, *denoiser.layers), enable)


FAMILY = Lumina2
