"""Flux.2 [dev]: Flux.2 [klein]'s MMDiT (at 32B: 8 double and 48 single blocks) and VAE,
guidance-distilled (the transformer embeds the guidance scale), conditioned on hidden
states 10, 20 and 30 of Mistral Small 3 (24B) over the caption in its chat template with
Flux2Pipeline's system message, padded to 512 tokens. As diffusers' Flux2Pipeline and
train_dreambooth_lora_flux2.py; everything else is Flux.2 [klein]'s."""

from __future__ import annotations

from raylora.model.families.base import TextInput, language_model
from raylora.model.families.flux2klein import Flux2Klein

# diffusers.pipelines.flux2.system_messages.SYSTEM_MESSAGE, the system message
# Flux2Pipeline.encode_prompt formats every caption with (test_families' conditioning test
# compares with the stock pipeline, which uses diffusers' own).
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses "
    "focusing on object relationships, object\nattribution and actions without speculation."
)
# What Mistral Small's chat template makes of format_input's [system, user] conversation.
# It writes <s> itself, so the pipeline's processor adds no special tokens (transformers
# does not, for a rendered prompt that starts with bos), and neither does raylora.
TEMPLATE = "<s>[SYSTEM_PROMPT]" + SYSTEM_MESSAGE + "[/SYSTEM_PROMPT][INST]{}[/INST]"
# Flux2Pipeline's text_encoder_out_layers (and the LoRA script's)
LAYERS = (10, 20, 30)


class Flux2(Flux2Klein):
    name = "flux2"
    class_names = ("Flux2Pipeline",)
    pipeline = "Flux2Pipeline"
    # 512 as the pipeline's max_sequence_length, the template's tokens included; every
    # padding position kept, on the side the tokenizer pads.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=512, template=TEMPLATE,
                      mask_key="attention_mask", long_context=True, special_tokens=False,
                      padding_side=None, remove=("[IMG]",)),)
    layers = LAYERS
    # Flux2Pipeline's default; the embedded guidance of the distilled model, not CFG.
    default_guidance_scale = 4.0
    description = "Flux.2 [dev] (MMDiT, Mistral Small 3 text encoder)"

    @classmethod
    def stock_components(cls, path: str, revision: str | None = None) -> dict:
        # The checkpoint's tokenizer folder is a PixtralProcessor (Mistral's tokenizer and an
        # image processor), which transformers 5 builds only with torchvision installed.
        # The pipeline reads captions alone through it, with apply_chat_template, which the
        # tokenizer inside has too and tokenizes alike (test_families: equal embeddings):
        # raylora's own sampling needs no torchvision.
        from transformers import AutoTokenizer

        return {"tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer",
                                                           revision=revision)}

    @classmethod
    def adapt_component(cls, component: str, module):
        if component == "text_encoder":
            # Mistral3ForConditionalGeneration → its language model: captions never reach
            # the vision tower (~0.4B) and the LM head (5120 × 131k) would project every
            # position for nothing; the pipeline's hidden states are the language model's.
            module = language_model(module)
        return super().adapt_component(component, module)


FAMILY = Flux2
