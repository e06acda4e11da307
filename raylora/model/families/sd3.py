"""Stable Diffusion 3 / 3.5: an MMDiT with flow matching over two CLIP encoders (penultimate
hidden states joined, padded to T5's width, then T5's sequence appended; pooled = both CLIP
projections joined) and T5-XXL; the transformer patchifies 16-channel latents itself and
takes the timestep as σ·1000. As diffusers' SD3 LoRA script."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylora.checkpoint.kohya import Rule, fused
from raylora.model.families.base import Cond, Family, TextInput

_J = r"transformer_blocks\.(\d+)\."
# diffusers SD3Transformer2DModel → SAI's MMDiT module names (the sd3/sd3.5 checkpoints), as
# sd-scripts' lora_sd3.py writes them and ComfyUI reads them; the mapping diffusers'
# single-file loader (convert_sd3_transformer_checkpoint_to_diffusers) undoes.
KOHYA_RULES = (
    *fused(_J + r"attn\.", ("to_q", "to_k", "to_v"), "joint_blocks_{0}_x_block_attn_qkv"),
    Rule(_J + r"attn\.to_out\.0", "joint_blocks_{0}_x_block_attn_proj"),
    *fused(_J + r"attn2\.", ("to_q", "to_k", "to_v"), "joint_blocks_{0}_x_block_attn2_qkv"),  # SD3.5M
    Rule(_J + r"attn2\.to_out\.0", "joint_blocks_{0}_x_block_attn2_proj"),
    Rule(_J + r"ff\.net\.0\.proj", "joint_blocks_{0}_x_block_mlp_fc1"),
    Rule(_J + r"ff\.net\.2", "joint_blocks_{0}_x_block_mlp_fc2"),
    Rule(_J + r"norm1\.linear", "joint_blocks_{0}_x_block_adaLN_modulation_1"),
    *fused(_J + r"attn\.", ("add_q_proj", "add_k_proj", "add_v_proj"), "joint_blocks_{0}_context_block_attn_qkv"),
    Rule(_J + r"attn\.to_add_out", "joint_blocks_{0}_context_block_attn_proj"),
    Rule(_J + r"ff_context\.net\.0\.proj", "joint_blocks_{0}_context_block_mlp_fc1"),
    Rule(_J + r"ff_context\.net\.2", "joint_blocks_{0}_context_block_mlp_fc2"),
    # the last block's is an AdaLayerNormContinuous (scale, shift), swapped
    Rule(_J + r"norm1_context\.linear", "joint_blocks_{0}_context_block_adaLN_modulation_1",
         scale_shift=True),
    Rule(r"pos_embed\.proj", "x_embedder_proj"),
    Rule(r"context_embedder", "context_embedder"),
    Rule(r"time_text_embed\.timestep_embedder\.linear_1", "t_embedder_mlp_0"),
    Rule(r"time_text_embed\.timestep_embedder\.linear_2", "t_embedder_mlp_2"),
    Rule(r"time_text_embed\.text_embedder\.linear_1", "y_embedder_mlp_0"),
    Rule(r"time_text_embed\.text_embedder\.linear_2", "y_embedder_mlp_2"),
    Rule(r"norm_out\.linear", "final_layer_adaLN_modulation_1", scale_shift=True),
    Rule(r"proj_out", "final_layer_linear"),
)


class SD3(Family):
    name = "sd3"
    class_names = ("StableDiffusion3Pipeline",)
    pipeline = "StableDiffusion3Pipeline"
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=77),
            TextInput("text_encoder_2", "tokenizer_2", "input_ids_2", max_length=77),
            # 256 as the pipeline's max_sequence_length default
            TextInput("text_encoder_3", "tokenizer_3", "input_ids_3", max_length=256,
                      long_context=True))
    # diffusers' train_dreambooth_lora_sd3.py defaults
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
    # SD3Transformer2DModel declares no _repeated_blocks; these are its blocks.
    repeated_blocks = ("JointTransformerBlock",)
    patch = 2
    default_guidance_scale = 7.0
    max_sequence_limit = 512  # StableDiffusion3Pipeline raises above it
    description = "SD3 / SD3.5 (MMDiT, CLIP-L + CLIP-G + T5-XXL)"
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_sd3"

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        hidden, pooled = [], []
        for enc, t in zip(encoders[:2], cls.text[:2]):
            out = enc(batch[t.ids_key], output_hidden_states=True)
            pooled.append(out[0])  # text_embeds [B, P]
            hidden.append(out.hidden_states[-2])
        t5 = encoders[2](batch["input_ids_3"])[0]
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return Cond(prompt_embeds=torch.cat([clip, t5], dim=-2),
                    pooled_prompt_embeds=torch.cat(pooled, dim=-1))

    @classmethod
    def model_timestep(cls, t):
        return t * 1000

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        # σ·1000 in fp32, as the pipeline passes it (in bf16 997 would read as 996).
        return model(hidden_states=noisy, timestep=cls.model_timestep(t.float()),
                     encoder_hidden_states=cond["prompt_embeds"],
                     pooled_projections=cond["pooled_prompt_embeds"], return_dict=False)[0]

    @classmethod
    def kohya_names(cls):
        # sd-scripts' lora_sd3.py: CLIP-L te1, CLIP-G te2 (T5 te3)
        return {"transformer.": "lora_unet_", "text_encoder.": "lora_te1_", "text_encoder_2.": "lora_te2_"}


FAMILY = SD3
