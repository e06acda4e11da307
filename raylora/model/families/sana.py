"""Sana (1.0 and 1.5: SanaPipeline): a linear-attention DiT with flow matching over the
deep-compression autoencoder's latents (DC-AE, 32 channels at 32× down, patch 1), whose
blocks cross-attend to the last hidden state of Gemma 2 (2B) over the lower-cased caption
behind the pipeline's complex human instruction, of which the conditioning keeps the first
and last tokens. Its transformer takes [B, C, h, w], the caption mask, and the timestep
1000·σ, and predicts the flow target ε − x₀. As diffusers' Sana LoRA script
(train_dreambooth_lora_sana.py), which leaves the instruction out unless
``--complex_human_instruction`` is given; raylora trains with the pipeline's default
instruction, the one the stock pipeline then samples with (``model.system_prompt: ""``
trains without one, as that script does)."""

from __future__ import annotations

import torch

from raylora.model.families.base import Cond, Family, TextInput, instruction_conditioning

# SanaPipeline.__call__'s default complex_human_instruction, which encode_prompt joins
# with newlines and writes before every lower-cased prompt (its negative prompt bare).
INSTRUCTION = "\n".join([
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions "
    "suitable for image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, "
    "and spatial relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round "
    "shape, sleeping peacefully on a warm sunny windowsill, surrounded by pots of blooming red "
    "flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, "
    "featuring glowing street lamps, a diverse crowd of people in colorful clothing, and a "
    "double-decker bus passing by towering glass skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any "
    "additional commentary or evaluations:",
    "User Prompt: ",
])

# DC-AE encodes deterministically (``.latent``); as a posterior its log-variance is the
# floor DiagonalGaussianDistribution clamps to: a draw is the latent ± e^-15.
_LOGVAR = -30.0


def template(instruction: str) -> str:
    """The caption template behind ``instruction`` (model.system_prompt; "" for none)."""
    return instruction.replace("{", "{{").replace("}", "}}") + "{}"


class Sana(Family):
    name = "sana"
    class_names = ("SanaPipeline",)
    pipeline = "SanaPipeline"
    cuts_captions = True  # instruction_conditioning: each batch's captions as long as its longest
    # 300 caption tokens (the pipeline's max_sequence_length; model.max_sequence_length
    # sets it) after the instruction's, padded on the right as encode_prompt pads.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=300,
                      template=template(INSTRUCTION), mask_key="attention_mask", long_context=True,
                      template_empty=False, lower=True, instruction=True),)
    # train_dreambooth_lora_sana.py's default --lora_layers (self- and cross-attention)
    lora_targets = ("to_k", "to_q", "to_v")
    repeated_blocks = ("SanaTransformerBlock",)
    # SanaPipeline's default
    default_guidance_scale = 4.5
    system_prompt = INSTRUCTION
    description = "Sana (linear-attention DiT, DC-AE, Gemma 2 text encoder)"

    @classmethod
    def system_template(cls, system_prompt: str) -> str:
        return template(system_prompt)

    @classmethod
    def prompt_kwargs(cls, system_prompt: str | None = None) -> dict:
        # The pipeline's complex_human_instruction: lines it joins with newlines; an empty
        # list is no instruction.
        if system_prompt is None:
            return {}
        return {"complex_human_instruction": [system_prompt] if system_prompt else []}

    @classmethod
    def size_kwargs(cls, height, width) -> dict:
        # The pipeline's resolution binning would sample at the nearest of its fixed sizes
        # (the 1024² model's for a 64² call) and resize; raylora samples where it trained.
        return {"use_resolution_binning": False} if height or width else {}

    @staticmethod
    def vae_factor(vae_config: dict) -> int:
        return 2 ** (len(vae_config["encoder_block_out_channels"]) - 1)  # as the pipeline's

    @staticmethod
    def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
        latent = vae.encode(pixels).latent
        return torch.cat([latent, torch.full_like(latent, _LOGVAR)], dim=1)

    @classmethod
    def cond_keys(cls):
        return ("prompt_embeds", "prompt_embeds_mask")

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        return instruction_conditioning(encoders[0], batch)

    @classmethod
    def model_timestep(cls, t):
        return t * 1000

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        # The pipeline scales the scheduler's timestep by the config's timestep_scale (1 for
        # Sana; DDP wraps the model, its config is on the module inside).
        scale = getattr(model, "module", model).config.timestep_scale
        # ...in fp32, as the pipeline passes it (in bf16 997 would read as 996).
        return model(hidden_states=noisy, timestep=cls.model_timestep(t.float()) * scale,
                     encoder_hidden_states=cond["prompt_embeds"],
                     encoder_attention_mask=cond["prompt_embeds_mask"], return_dict=False)[0]


FAMILY = Sana
