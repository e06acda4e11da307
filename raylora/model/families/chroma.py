"""Chroma (Chroma1-HD, Chroma1-Base): Flux.1-schnell's architecture pruned of its
modulation layers (a small "approximator" MLP makes every block's modulation from the
timestep alone) and of CLIP, conditioned on T5-XXL alone, read with its attention mask;
sampled with real classifier-free guidance (a negative prompt, two passes a step).
As ``ChromaPipeline``, which loads the adapter (``FluxLoraLoaderMixin``)."""

from __future__ import annotations

import torch

from raylora.checkpoint.kohya import Rule
from raylora.model.families.base import Cond, TextInput, checkpoint_each, grid_ids, pack_2x2, unpack_2x2
from raylora.model.families.flux import KOHYA_RULES as FLUX_RULES, Flux

# Its released checkpoints keep BFL's Flux module names (double_blocks_*, single_blocks_*,
# img_in, txt_in, final_layer_linear: Flux.1's rules), plus the approximator's, as
# diffusers' convert_chroma_transformer_checkpoint_to_diffusers reads them.
KOHYA_RULES = (
    *FLUX_RULES,
    Rule(r"distilled_guidance_layer\.(in_proj|out_proj)", "distilled_guidance_layer_{0}"),
    Rule(r"distilled_guidance_layer\.layers\.(\d+)\.linear_1", "distilled_guidance_layer_layers_{0}_in_layer"),
    Rule(r"distilled_guidance_layer\.layers\.(\d+)\.linear_2", "distilled_guidance_layer_layers_{0}_out_layer"),
)


def text_mask(tokens: torch.Tensor, dtype) -> torch.Tensor:
    """The transformer's mask over a caption's ``tokens`` (its tokenizer mask): every
    caption token and the first padding token after it (ChromaPipeline keeps one pad
    visible, as Chroma was trained), in ``dtype`` as the pipeline builds it."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return (positions.unsqueeze(0) <= tokens.sum(1, keepdim=True)).to(dtype)


class Chroma(Flux):
    name = "chroma"
    class_names = ("ChromaPipeline",)
    pipeline = "ChromaPipeline"
    # The pipeline pads every caption to 512 T5 tokens and keeps them all (padding_side
    # None: T5's own, the right); the mask decides which the transformer sees.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512,
                      mask_key="attention_mask", long_context=True, padding_side=None),)
    # Flux.1's: both streams' attention and feed-forwards (Chroma has no modulation
    # linears: its blocks' shift/scale/gate come from distilled_guidance_layer).
    repeated_blocks = ("ChromaTransformerBlock", "ChromaSingleTransformerBlock")
    # ChromaPipeline's own default: real CFG, an empty negative prompt (Family.empty_caption)
    default_guidance_scale = 5.0
    description = "Chroma (Flux.1-schnell pruned, T5-XXL alone, real CFG)"
    kohya_rules = KOHYA_RULES
    kohya_network = "networks.lora_flux"

    @classmethod
    def text_encoder_lora(cls):
        # None: its one encoder is T5-XXL (4.7 B), which Flux.1 never trains either (its
        # text-encoder LoRA is CLIP-L's), and which ChromaPipeline would load as
        # "text_encoder." layers meant for CLIP in Flux's key layout.
        return ()

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "prompt_embeds_mask")

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        (t5,) = encoders
        mask = batch["attention_mask"]
        # Unlike Flux.1, the caption is encoded with its attention mask.
        emb = t5(batch["input_ids"], attention_mask=mask, output_hidden_states=False)[0]
        return Cond(prompt_embeds=emb, prompt_embeds_mask=text_mask(mask, emb.dtype))

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        b, _, h, w = noisy.shape
        dtype, dev = noisy.dtype, noisy.device
        tokens = pack_2x2(noisy)
        emb = cond["prompt_embeds"]
        # The caption's mask, then every image token (the pipeline's _prepare_attention_mask:
        # a bool tail on the float text mask, which the concatenation makes float).
        mask = torch.cat([cond["prompt_embeds_mask"].to(emb.dtype),
                          torch.ones(b, tokens.shape[1], device=dev, dtype=torch.bool)], dim=1)
        out = model(hidden_states=tokens, timestep=t.to(dtype), encoder_hidden_states=emb,
                    txt_ids=torch.zeros(emb.shape[1], 3, device=dev, dtype=dtype),
                    img_ids=grid_ids(h // 2, w // 2, 3, dev).to(dtype), attention_mask=mask,
                    return_dict=False)[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def checkpoint_blocks(cls, denoiser, enable: bool = True) -> None:
        # diffusers 0.42's ChromaTransformer2DModel drops attention_mask from its single
        # blocks on its gradient-checkpointing path (they would attend to every padding
        # token, another loss than without it): each block checkpoints its own forward
        # instead, with the model on its plain path.
        checkpoint_each((*denoiser.transformer_blocks, *denoiser.single_transformer_blocks), enable)

    @classmethod
    def kohya_names(cls):
        # sd-scripts' lora_flux.py for Chroma: the transformer only (T5 is not its te1)
        return {"transformer.": "lora_unet_"}


FAMILY = Chroma
