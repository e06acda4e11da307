"""Flux.1 (dev, schnell): a 2×2-patched MMDiT with flow matching; CLIP-L gives the pooled
embedding, T5-XXL the sequence; latents are 16-channel, packed into tokens with 3-axis
position ids; Flux.1-dev also takes a guidance embedding. As diffusers' Flux LoRA script."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule, fused
from raylora.model.families.base import (
    Cond,
    Family,
    TextInput,
    embedded_guidance,
    grid_ids,
    pack_2x2,
    unpack_2x2,
)

_D = r"transformer_blocks\.(\d+)\."
_S = r"single_transformer_blocks\.(\d+)\."
# diffusers FluxTransformer2DModel → BFL's Flux module names, as sd-scripts' lora_flux.py
# writes them and ComfyUI and diffusers' kohya-Flux loader read them.
KOHYA_RULES = (
    *fused(_D + r"attn\.", ("to_q", "to_k", "to_v"), "double_blocks_{0}_img_attn_qkv"),
    Rule(_D + r"attn\.to_out\.0", "double_blocks_{0}_img_attn_proj"),
    Rule(_D + r"ff\.net\.0\.proj", "double_blocks_{0}_img_mlp_0"),
    Rule(_D + r"ff\.net\.2", "double_blocks_{0}_img_mlp_2"),
    Rule(_D + r"norm1\.linear", "double_blocks_{0}_img_mod_lin"),
    *fused(_D + r"attn\.", ("add_q_proj", "add_k_proj", "add_v_proj"), "double_blocks_{0}_txt_attn_qkv"),
    Rule(_D + r"attn\.to_add_out", "double_blocks_{0}_txt_attn_proj"),
    Rule(_D + r"ff_context\.net\.0\.proj", "double_blocks_{0}_txt_mlp_0"),
    Rule(_D + r"ff_context\.net\.2", "double_blocks_{0}_txt_mlp_2"),
    Rule(_D + r"norm1_context\.linear", "double_blocks_{0}_txt_mod_lin"),
    # linear1 = q, k, v and the MLP's input (mlp_ratio 4) in one linear
    *fused(_S, ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "single_blocks_{0}_linear1",
           sizes=(1, 1, 1, 4)),
    Rule(_S + r"proj_out", "single_blocks_{0}_linear2"),
    Rule(_S + r"norm\.linear", "single_blocks_{0}_modulation_lin"),
    Rule(r"x_embedder", "img_in"),
    Rule(r"context_embedder", "txt_in"),
    Rule(r"time_text_embed\.timestep_embedder\.linear_1", "time_in_in_layer"),
    Rule(r"time_text_embed\.timestep_embedder\.linear_2", "time_in_out_layer"),
    Rule(r"time_text_embed\.text_embedder\.linear_1", "vector_in_in_layer"),
    Rule(r"time_text_embed\.text_embedder\.linear_2", "vector_in_out_layer"),
    Rule(r"time_text_embed\.guidance_embedder\.linear_1", "guidance_in_in_layer"),
    Rule(r"time_text_embed\.guidance_embedder\.linear_2", "guidance_in_out_layer"),
    # diffusers' kohya-Flux loader reads final_layer without its alpha: fold it in
    Rule(r"norm_out\.linear", "final_layer_adaLN_modulation_1", scale_shift=True, bake_alpha=True),
    Rule(r"proj_out", "final_layer_linear", bake_alpha=True),
)


class Flux(Family):
    name = "flux"
    class_names = ("FluxPipeline",)
    pipeline = "FluxPipeline"
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=77),
            # 512 as Flux.1-dev's pipeline (schnell: 256, via model.max_sequence_length)
            TextInput("text_encoder_2", "tokenizer_2", "input_ids_2", max_length=512,
                      long_context=True))
    # diffusers' train_dreambooth_lora_flux.py defaults
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                    "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
                    "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    repeated_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    patch = 2
    default_guidance_scale = 3.5
    max_sequence_limit = 512  # FluxPipeline (and Kontext's, Chroma's) raise above it
    description = "Flux.1 dev/schnell (MMDiT, CLIP-L + T5-XXL)"
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_flux"
    kohya_fused_load = "split"  # diffusers' kohya-Flux.1 converter (Kontext, Chroma: its names)

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        clip, t5 = encoders
        pooled = clip(batch["input_ids"], output_hidden_states=False).pooler_output
        return Cond(prompt_embeds=t5(batch["input_ids_2"], output_hidden_states=False)[0],
                    pooled_prompt_embeds=pooled)

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, guidance: float = 1.0, **extra) -> torch.Tensor:
        b, _, h, w = noisy.shape
        dtype, dev = noisy.dtype, noisy.device
        # Position ids (0, row, col) of the 2×2-token grid.
        ids = grid_ids(h // 2, w // 2, 3, dev)
        tokens = pack_2x2(noisy)
        ref = cond.get("reference_latents")
        if ref is not None:
            # An input image (Kontext, data.control_images): its 2×2 tokens after the noisy
            # ones, the ids of its own grid with the first axis 1 (the pipeline's image_ids).
            ref_ids = grid_ids(ref.shape[-2] // 2, ref.shape[-1] // 2, 3, dev)
            ref_ids[:, 0] = 1
            ids = torch.cat([ids, ref_ids])
            tokens = torch.cat([tokens, pack_2x2(ref.to(dtype))], dim=1)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=dev, dtype=dtype)
        # Flux.1-dev embeds the distilled guidance; schnell has no such input.
        out = model(hidden_states=tokens, timestep=t.to(dtype),
                    guidance=embedded_guidance(model, guidance, b, dev),
                    pooled_projections=cond["pooled_prompt_embeds"],
                    encoder_hidden_states=cond["prompt_embeds"], txt_ids=txt_ids,
                    img_ids=ids.to(dtype), return_dict=False)[0]
        # The prediction is the noisy tokens' (an input image's follow them).
        return unpack_2x2(out[:, : (h // 2) * (w // 2)], h, w)

    @classmethod
    def kohya_names(cls):
        # sd-scripts' lora_flux.py names the CLIP-L encoder te1 (T5 would be te2)
        return {"transformer.": "lora_unet_", "text_encoder.": "lora_te1_"}


FAMILY = Flux
