"""Flux.2 [klein] (4B, 9B; base and step-distilled): an MMDiT with double- and single-stream
blocks and flow matching, conditioned on three intermediate hidden states of a Qwen3
language model (the caption in Qwen3's chat template, thinking off, padded to 512 tokens);
the Flux.2 VAE, whose latents are 2×2-patchified and normalised by the VAE's own batch-norm
statistics; 4-axis (t, h, w, l) position ids. As diffusers' Flux.2 [klein] pipeline and
LoRA script."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule, fused
from raylora.config import MAX_CONTROL_INPUTS
from raylora.model.families.base import (Cond, Family, TextInput, embedded_guidance, grid_ids,
                                         inputs_at, references)

# What Flux2KleinPipeline's tokenizer.apply_chat_template(add_generation_prompt=True,
# enable_thinking=False) makes of a one-message conversation with Qwen3's template.
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The pipeline's text_encoder_out_layers: the hidden states it stacks, joined per token.
# (diffusers' train_dreambooth_lora_flux2_klein.py defaults to (10, 20, 30), Flux.2-dev's
# Mistral layers; the pipeline that samples the adapter reads (9, 18, 27), so train on that.)
LAYERS = (9, 18, 27)
# The time axis of the first reference image's position ids (the pipelines' _prepare_image_ids
# scale: image i at 10 + 10·i; the noisy latents at 0).
REFERENCE_T = 10

_D = r"transformer_blocks\.(\d+)\."
_S = r"single_transformer_blocks\.(\d+)\."
# diffusers Flux2Transformer2DModel → BFL's Flux.2 module names, as ComfyUI and diffusers'
# kohya-Flux.2 loader read them. The single blocks' linear1 is already one linear in
# diffusers (to_qkv_mlp_proj), so only the double blocks' q/k/v are fused here.
KOHYA_RULES = (
    *fused(_D + r"attn\.", ("to_q", "to_k", "to_v"), "double_blocks_{0}_img_attn_qkv"),
    Rule(_D + r"attn\.to_out\.0", "double_blocks_{0}_img_attn_proj"),
    *fused(_D + r"attn\.", ("add_q_proj", "add_k_proj", "add_v_proj"), "double_blocks_{0}_txt_attn_qkv"),
    Rule(_D + r"attn\.to_add_out", "double_blocks_{0}_txt_attn_proj"),
    Rule(_D + r"ff\.linear_in", "double_blocks_{0}_img_mlp_0"),
    Rule(_D + r"ff\.linear_out", "double_blocks_{0}_img_mlp_2"),
    Rule(_D + r"ff_context\.linear_in", "double_blocks_{0}_txt_mlp_0"),
    Rule(_D + r"ff_context\.linear_out", "double_blocks_{0}_txt_mlp_2"),
    Rule(_S + r"attn\.to_qkv_mlp_proj", "single_blocks_{0}_linear1"),
    Rule(_S + r"attn\.to_out", "single_blocks_{0}_linear2"),
    Rule(r"x_embedder", "img_in"),
    Rule(r"context_embedder", "txt_in"),
    Rule(r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in_in_layer"),
    Rule(r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in_out_layer"),
    Rule(r"time_guidance_embed\.guidance_embedder\.linear_1", "guidance_in_in_layer"),
    Rule(r"time_guidance_embed\.guidance_embedder\.linear_2", "guidance_in_out_layer"),
    Rule(r"(double_stream_modulation_(?:img|txt)|single_stream_modulation)\.linear", "{0}_lin"),
    Rule(r"proj_out", "final_layer_linear"),
    # diffusers' AdaLayerNormContinuous: (scale, shift); BFL's final layer: (shift, scale)
    Rule(r"norm_out\.linear", "final_layer_adaLN_modulation_1", scale_shift=True),
)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` → ``[B, 4C, h/2, w/2]``, channel c·4 + 2·dy + dx, as the pipeline's
    ``_patchify_latents`` (the order the VAE's batch-norm statistics are kept in)."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * 4, h // 2, w // 2)


def keep_layers(lm, n: int) -> None:
    """Drop the frozen Qwen3's decoder layers after the first ``n``: the conditioning reads
    hidden state 27 at most (the output of layers[26]; transformers replaces the last hidden
    state by its final-normed one, so layers[27] stays), and Qwen3-4B's and -8B's
    layers[28:36] ran for nothing: their time on every uncached caption and their memory on
    every worker. Keeping ``max(LAYERS) + 1`` leaves hidden states 0..27 as the full model's
    (test_families: equal to the stock pipeline's encode_prompt)."""
    model = getattr(lm, "model", lm)
    if len(model.layers) <= n:
        return
    model.layers = torch.nn.ModuleList(list(model.layers)[:n])
    for config in {id(c): c for c in (lm.config, model.config)}.values():
        config.num_hidden_layers = n
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:n]


class Flux2Klein(Family):
    name = "flux2klein"
    class_names = ("Flux2KleinPipeline",)
    pipeline = "Flux2KleinPipeline"
    # 512 as the pipeline's max_sequence_length, the template's tokens included. The
    # pipeline keeps every padding position: the transformer attends to all 512, unmasked.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512, template=TEMPLATE,
                      mask_key="attention_mask", long_context=True, padding_side=None),)
    # The language model's hidden states the conditioning stacks (text_encoder_out_layers).
    layers: tuple[int, ...] = LAYERS
    # diffusers' train_dreambooth_lora_flux2_klein.py defaults: the double blocks' image-stream
    # attention (the text stream's is add_*_proj / to_add_out), the single blocks' fused
    # qkv+MLP input and (default_lora_targets) their output projection.
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")
    repeated_blocks = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_flux_2"  # musubi-tuner's
    kohya_fused_load = "split"  # diffusers' kohya-Flux.2 converter
    # The 2×2 patchify is the VAE side's (encode_pixels): the objective's latents are
    # already one token per position.
    patch = 1
    # Flux2KleinPipeline's default, which runs classifier-free guidance for the base models;
    # the distilled ones (is_distilled) ignore it and sample in about 4 steps.
    default_guidance_scale = 4.0
    description = "Flux.2 [klein] (MMDiT, Qwen3 text encoder)"
    # Flux2KleinPipeline(image=...) edits: the reference image's tokens follow the noisy ones
    reference_image = True
    # Flux2Pipeline / Flux2KleinPipeline take a list of references (each its own time axis)
    max_references = MAX_CONTROL_INPUTS
    # Flux2ImageProcessor.check_image_input's min_side_length: the pipeline refuses less
    min_reference_side = 64
    # Flux2Pipeline and Flux2KleinPipeline shrink an input above 1 MP to 1 MP
    reference_max_area = 1024 * 1024

    @classmethod
    def default_lora_targets(cls, denoiser) -> tuple[str, ...]:
        # A single block's attn.to_out is a Linear, a double block's a ModuleList (whose
        # Linear is to_out.0): peft matches name suffixes, so name the single ones in full.
        model = getattr(denoiser, "module", denoiser)
        singles = len(model.single_transformer_blocks)
        return cls.lora_targets + tuple(f"single_transformer_blocks.{i}.attn.to_out"
                                        for i in range(singles))

    @classmethod
    def named_lora_targets(cls) -> tuple[str, ...]:
        return cls.lora_targets + ("single_transformer_blocks.*.attn.to_out",)

    @classmethod
    def adapt_component(cls, component: str, module):
        if component == "text_encoder":
            keep_layers(module, max(cls.layers) + 1)
        return module

    # ---- latents ------------------------------------------------------------------------

    @staticmethod
    def latent_stats(vae_config):
        # encode_pixels normalises already (the statistics are weights, not config).
        return 0.0, 1.0

    @staticmethod
    def vae_factor(vae_config):
        return 2 ** (len(vae_config["block_out_channels"]) - 1) * 2  # × the 2×2 patchify

    @staticmethod
    def encode_pixels(vae, pixels):
        # Posterior of the patchified, batch-norm-normalised latents: patchify and the
        # per-channel affine map commute with the Gaussian draw, so a draw from
        # (mean', logvar') = ((mean − μ)/σ, logvar − 2 log σ) has the distribution of the
        # pipeline's (patchify(z) − μ)/σ (its noise laid out in the patchified order), and
        # its mean is exactly the pipeline's image latents. The cache stores these, so the
        # statistics, which are weights and not config, are never needed without the VAE.
        mean, logvar = Family.encode_pixels(vae, pixels).chunk(2, dim=1)
        bn = vae.bn
        mu = bn.running_mean.view(1, -1, 1, 1).to(mean.dtype)
        sd = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(mean.dtype)
        return torch.cat([(patchify(mean) - mu) / sd, patchify(logvar) - 2 * torch.log(sd)], dim=1)

    # ---- text ---------------------------------------------------------------------------

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        lm = encoders[0]
        # The decoder stack alone: Qwen3ForCausalLM's hidden states are its inner model's,
        # and its LM head would project all 512 positions onto a 151k vocabulary for nothing.
        lm = getattr(lm, "model", lm)
        out = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 output_hidden_states=True, use_cache=False)
        h = torch.stack([out.hidden_states[k] for k in cls.layers], dim=1)  # [B, 3, L, D]
        b, n, length, d = h.shape
        return Cond(prompt_embeds=h.permute(0, 2, 1, 3).reshape(b, length, n * d))

    # ---- the denoiser -------------------------------------------------------------------

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, guidance: float = 1.0, **extra) -> torch.Tensor:
        b, c, h, w = noisy.shape
        dev = noisy.device
        # Position ids (t, row, col, l) = (0, i, j, 0) for the image and (0, 0, 0, k) for the
        # text, built where the model runs; the model reads one [S, 4] set for the batch.
        img_ids = grid_ids(h, w, 4, dev)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 4, device=dev)
        txt_ids[:, 3] = torch.arange(txt_ids.shape[0], device=dev)
        tokens = noisy.reshape(b, c, h * w).permute(0, 2, 1)
        for k, ref in enumerate(references(cond)):
            # Input image k (data.control_images): its tokens after the noisy ones and the
            # inputs before it, ids (10 + 10·k, i, j, 0), the pipelines' reference image k.
            rh, rw = ref.shape[-2:]
            ref_ids = grid_ids(rh, rw, 4, dev)
            ref_ids[:, 0] = REFERENCE_T * (k + 1)
            tokens = torch.cat([tokens, ref.to(noisy.dtype).reshape(b, c, rh * rw).permute(0, 2, 1)], 1)
            img_ids = torch.cat([img_ids, ref_ids])
        # Klein has no guidance embedding (the pipeline passes None); Flux.2 [dev], guidance-
        # distilled, embeds train.flow.guidance.
        out = model(hidden_states=tokens, encoder_hidden_states=cond["prompt_embeds"],
                    timestep=t.to(noisy.dtype), img_ids=img_ids, txt_ids=txt_ids,
                    guidance=embedded_guidance(model, guidance, b, dev), return_dict=False)[0]
        return out[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    @classmethod
    def reference_kwargs(cls, image, height: int | None, width: int | None) -> dict:
        # The pipeline keeps an input of at most 1 MP at its own size (cut to a multiple of
        # its grid): resized to the output's, it pairs with it as training does. Several
        # inputs (data.control_inputs): a list, each resized alike.
        return inputs_at(image, height, width)


FAMILY = Flux2Klein
