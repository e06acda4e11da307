"""Wan 2.1 / 2.2 (text-to-video), trained and sampled as single frames (an image LoRA on a
video model: each picture a video of one frame): a DiT over 3-D latents (a frame axis of 1
here, patch 1×2×2) with flow matching, conditioned on UMT5-XXL's last hidden state over the
caption, zero past each caption's own tokens (512 in all); the Wan VAE (a frame axis,
per-channel latent mean/std). The checkpoints ship UniPC set to ``flow_prediction`` with a
static ``flow_shift``, which the objective reads as flow matching with that shift. The
timestep is σ·1000.

Wan 2.2 A14B samples with two experts: ``transformer`` for σ ≥ ``boundary_ratio`` (the
high-noise steps), ``transformer_2`` below it. A run trains one (``model.expert``), on the
σ of its range only; its adapter loads with ``load_lora_weights`` (``load_into_transformer_2``
for the low-noise expert). Wan 2.2 TI2V-5B (one transformer, a 16× VAE) trains as 2.1
does; its per-token timesteps are all σ for a text prompt, the same conditioning as one
timestep per sample."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule
from raylora.model.families.base import Cond, Family, TextInput, encode_one_frame, per_channel_stats

_B = r"blocks\.(\d+)\."
_ATTN = (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))
# diffusers WanTransformer3DModel → Wan-AI's module names, as musubi-tuner's lora_wan.py
# writes them and ComfyUI reads them (diffusers' WanPipeline reads this layout, musubi's,
# only when every block's self- and cross-attention and FFN are in it: train those, or load
# the diffusers adapter).
KOHYA_RULES = (
    *(Rule(_B + f"{ours}\\.{p}", f"blocks_{{0}}_{theirs}_{q}")
      for ours, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn")) for p, q in _ATTN),
    Rule(_B + r"attn2\.add_k_proj", "blocks_{0}_cross_attn_k_img"),
    Rule(_B + r"attn2\.add_v_proj", "blocks_{0}_cross_attn_v_img"),
    Rule(_B + r"ffn\.net\.0\.proj", "blocks_{0}_ffn_0"),
    Rule(_B + r"ffn\.net\.2", "blocks_{0}_ffn_2"),
    Rule(r"condition_embedder\.time_embedder\.linear_1", "time_embedding_0"),
    Rule(r"condition_embedder\.time_embedder\.linear_2", "time_embedding_2"),
    Rule(r"condition_embedder\.text_embedder\.linear_1", "text_embedding_0"),
    Rule(r"condition_embedder\.text_embedder\.linear_2", "text_embedding_2"),
    Rule(r"condition_embedder\.time_proj", "time_projection_1"),
    Rule(r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb_proj_1"),
    Rule(r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb_proj_3"),
    Rule(r"proj_out", "head_head"),
    Rule(r"patch_embedding", "patch_embedding"),
)


class Wan(Family):
    name = "wan"
    class_names = ("WanPipeline",)
    pipeline = "WanPipeline"
    # 512: WanPipeline's max_sequence_length; UMT5's </s> included, as the pipeline's. The
    # pipeline cleans each prompt first (HTML entities, whitespace runs): so does raylora.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512,
                      mask_key="attention_mask", long_context=True, clean=True),)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # self- and cross-attention
    repeated_blocks = ("WanTransformerBlock",)
    kohya_export = True
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_wan"  # musubi-tuner's
    patch = 2
    default_guidance_scale = 5.0  # WanPipeline's
    video = True
    experts = {"high_noise": "transformer", "low_noise": "transformer_2"}
    description = "Wan 2.1 / 2.2 (video DiT trained and sampled as single frames, UMT5-XXL)"
    # a video VAE (per-channel statistics), a still image as one frame
    latent_stats = staticmethod(per_channel_stats)
    encode_pixels = staticmethod(encode_one_frame)

    @classmethod
    def sigma_range(cls, index, expert, where, key="model.expert"):
        boundary = index.get("boundary_ratio")
        if (index.get("transformer_2") or [None])[0] is None:
            if expert is not None:
                raise ValueError(f"{key}: {expert}: {where} is a Wan pipeline with one "
                                 f"transformer (Wan 2.1, 2.2 TI2V-5B), no experts; leave {key} unset")
            return (0.0, 1.0)
        if boundary is None:
            raise ValueError(f"{where}: model_index.json has a transformer_2 but no "
                             "boundary_ratio (the σ where sampling hands over to it)")
        if expert is None:
            raise ValueError(
                f"{key}: {where} is a Wan 2.2 pipeline with two experts, transformer for "
                f"σ ≥ boundary_ratio {boundary} (high-noise steps) and transformer_2 below it; "
                f"a run trains one: set {key} to high_noise or low_noise (both: two runs)")
        b = float(boundary)
        return (b, 1.0) if expert == "high_noise" else (0.0, b)

    @classmethod
    def lora_load_kwargs(cls, expert=None):
        # WanLoraLoaderMixin saves an expert's adapter under "transformer" and loads it
        # into transformer_2 when asked.
        return {"load_into_transformer_2": True} if cls.trained_component(expert) == "transformer_2" else {}

    @classmethod
    def pipeline_with(cls, model, expert=None):
        # Previews sample with the trained expert at every step: loading the other expert
        # (14B, unsharded on every rank under FSDP) for a preview would double the
        # denoiser's memory. They follow the training, not the two-expert samples that
        # `raylora sample` and the model card's code make.
        if expert is None:
            return super().pipeline_with(model)
        return {"transformer": model, "transformer_2": None, "boundary_ratio": None}

    @staticmethod
    def vae_factor(vae_config):
        # The pipeline reads scale_factor_spatial (16 for 2.2's patchifying VAE); configs
        # saved before diffusers had the key are 2.1's, whose factor is its downsamplings'.
        if vae_config.get("scale_factor_spatial"):
            return int(vae_config["scale_factor_spatial"])
        return 2 ** len(vae_config["temperal_downsample"]) * int(vae_config.get("patch_size") or 1)

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        # Padding is masked out of every attention, and UMT5's position bias is relative:
        # encoding up to the longest caption gives the same rows for the caption tokens and
        # saves encoding up to ~500 pads. The pipeline zeroes the rest; so does this.
        n = int(mask.sum(1).max())
        hidden = encoders[0](input_ids=ids[:, :n], attention_mask=mask[:, :n]).last_hidden_state
        emb = hidden * mask[:, :n].unsqueeze(-1).to(hidden.dtype)
        return Cond(prompt_embeds=torch.nn.functional.pad(emb, (0, 0, 0, ids.shape[1] - n)))

    @classmethod
    def model_timestep(cls, t):
        return t * 1000

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        out = model(hidden_states=noisy.unsqueeze(2),
                    timestep=cls.model_timestep(t.float()),  # fp32, as the pipeline: bf16 997 is 996
                    encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
        return out.squeeze(2)


FAMILY = Wan
