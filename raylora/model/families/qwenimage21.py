"""Qwen-Image 2.1: a single-stream DiT with block-causal attention (text causal, each image
bidirectional) and flow matching over unpatched latents, conditioned on the output of
Qwen3-VL's last decoder layer (before its final norm) over the caption in the pipeline's
chat template, the system turn dropped; an RGBA VAE, 16× per side, with per-channel
latent mean/std. As diffusers' QwenImage21Pipeline (text to image); the rest is
Qwen-Image's."""

from __future__ import annotations

import torch

from raylora.model.families.base import Cond, TextInput, language_model, llm_conditioning
from raylora.model.families.qwenimage import QwenImage

# QwenImage21Pipeline.sys_prompt and prompt_template_t2i
SYSTEM = "Comprehend and analyze the provided prompt."
TEMPLATE = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


def caption_processor(tokenizer):
    """A ``Qwen3VLProcessor`` that reads captions alone, with ``tokenizer``. The checkpoint's
    processor folder holds Qwen3-VL's tokenizer, image and video processors; transformers 5
    builds the video processor only with torchvision installed, and QwenImage21Pipeline
    reads text alone for text-to-image (its ``processor(text=...)``,
    ``apply_chat_template`` and ``tokenizer``), which the tokenizer does alike: raylora's
    own sampling needs no torchvision. A subclass, as the pipeline's loader requires."""
    from transformers import Qwen3VLProcessor

    class CaptionProcessor(Qwen3VLProcessor):
        def __init__(self, tokenizer):  # not ProcessorMixin's: it would build the others
            self.tokenizer = tokenizer
            self.chat_template = tokenizer.chat_template

        def __call__(self, text=None, images=None, videos=None, **kw):
            if images is not None or videos is not None:
                raise ValueError("qwenimage21: raylora's processor reads captions alone "
                                 "(text to image); condition images need Qwen3VLProcessor")
            return self.tokenizer(text, **kw)

        def apply_chat_template(self, conversation, **kw):
            # the processor's batch of one conversation
            return [self.tokenizer.apply_chat_template(conversation, **kw)]

    return CaptionProcessor(tokenizer)


def system_turn(ids: torch.Tensor) -> int:
    """Tokens of the template's system turn in captions tokenized from ``TEMPLATE``: up to
    the second ``<|im_start|>``, the first token (what QwenImage21Pipeline drops: its
    system message through the chat template). Counted from the ids, as the tokenizer's
    own split of the system message decides it. 0 on meta ids (a memory estimate,
    ``raylora.memory``), which have no values: a few tokens more or less."""
    if ids.is_meta:
        return 0
    starts = (ids[0] == ids[0, 0]).nonzero()
    return int(starts[1]) if len(starts) > 1 else 0


def rgba(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in [-1, 1] → opaque RGBA ``[B, 4, H, W]``: the VAE reads four channels,
    as the pipeline hands it an RGB image converted to RGBA (alpha 255 → 1)."""
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)


class QwenImage21(QwenImage):
    name = "qwenimage21"
    class_names = ("QwenImage21Pipeline",)
    pipeline = "QwenImage21Pipeline"
    max_sequence_limit = None  # its pipeline takes no max_sequence_length (it keeps every token)
    # The pipeline keeps every caption token (it does not truncate); raylora pads to a
    # length: 512 the template's tokens included, model.max_sequence_length sets it.
    text = (TextInput("text_encoder", "processor", "input_ids", max_length=512, template=TEMPLATE,
                      mask_key="attention_mask", long_context=True),)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # Qwen-Image's (diffusers' script)
    repeated_blocks = ("QwenImage21TransformerBlock",)
    # No kohya/ComfyUI key layout mapped for 2.1 yet: export.formats kohya is refused.
    kohya_export = False
    kohya_rules = ()
    # Tokens are latent pixels (unpatched), but each of the text encoder's image slots
    # stands for a 2×2 group of them: latent sides are even (image sides multiples of 32).
    patch = 2
    # QwenImage21Pipeline's true_cfg_scale default: 2.1 is sampled without guidance.
    default_guidance_scale = 1.0
    description = "Qwen-Image 2.1 (single-stream block-causal DiT, Qwen3-VL text encoder)"

    @classmethod
    def load_pipeline(cls, path: str, **kw):
        # The processor goes in as the pipeline is built (its __init__ reads it): the
        # caption-only one around the tokenizer given (raylora hands its tokenizers by
        # their component name, model.load.encoder_kwargs), else the folder's.
        from transformers import AutoTokenizer, Qwen3VLProcessor

        given = kw.pop("processor", None) or AutoTokenizer.from_pretrained(
            path, subfolder="processor", revision=kw.get("revision"))
        kw["processor"] = given if isinstance(given, Qwen3VLProcessor) else caption_processor(given)
        return cls.pipeline_class().from_pretrained(path, **kw)

    @staticmethod
    def vae_factor(vae_config):
        return int(vae_config.get("scale_factor_spatial") or 2 ** (len(vae_config["dim_mult"]) - 1))

    @staticmethod
    def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
        return vae.encode(rgba(pixels).unsqueeze(2)).latent_dist.parameters.squeeze(2)

    @classmethod
    def image_seq_len(cls, latents_shape) -> int:
        return latents_shape[-2] * latents_shape[-1]  # unpatched: a token per latent pixel

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        # The language model alone: captions never reach the vision tower, and the LM head
        # would project every position for nothing.
        lm = language_model(encoders[0])
        # Its last decoder layer's output, before the final RMSNorm, as the pipeline reads
        # it (transformers 5 returns the normed state as hidden_states[-1]; the pipeline
        # and raylora both undo the norm with a hook returning its input).
        handle = lm.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            return llm_conditioning(lm, batch, layer=-1, drop=system_turn(batch["input_ids"]))
        finally:
            handle.remove()

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        """Rows of one caption length per transformer call. Its rope (diffusers'
        QwenImage21Rope) puts the image after every text position of the batch, padding
        included, so a shorter caption padded to a longer one's length moved its image:
        a prediction the pipeline, which never pads a lone prompt, does not make. One
        length (every batch of one row): one call, no host sync."""
        mask = cond["prompt_embeds_mask"]
        if noisy.shape[0] == 1 or mask.is_meta:
            return cls._denoise_rows(model, noisy, t, cond["prompt_embeds"], mask)
        lengths = mask.sum(1).tolist()  # the captions' own lengths (zero-padded after)
        if len(set(lengths)) == 1:
            return cls._denoise_rows(model, noisy, t, cond["prompt_embeds"], mask)
        t = t.expand(noisy.shape[0]) if t.ndim else t.repeat(noisy.shape[0])
        order, parts = [], []
        for n in sorted(set(lengths)):
            rows = [i for i, k in enumerate(lengths) if k == n]
            at = torch.tensor(rows, device=noisy.device)
            n = int(n)
            parts.append(cls._denoise_rows(model, noisy[at], t[at], cond["prompt_embeds"][at, :n],
                                           mask[at, :n]))
            order += rows
        out = torch.cat(parts)
        return out[torch.argsort(torch.tensor(order, device=out.device))]

    @classmethod
    def _denoise_rows(cls, model, noisy, t, emb, mask) -> torch.Tensor:
        b, c, h, w = noisy.shape
        # The joint sequence: the caption, then one image slot per 2×2 group of latent
        # pixels (the transformer expands each to its four tokens); the output covers it
        # all and the image is its tail. The transformer lays the sequence out from this
        # mask's values: on the host for a memory estimate's meta step (raylora.memory).
        device = "cpu" if noisy.is_meta else noisy.device
        img_mask = torch.cat([torch.zeros(b, emb.shape[1], dtype=torch.bool, device=device),
                              torch.ones(b, h * w // 4, dtype=torch.bool, device=device)], dim=1)
        out = model(hidden_states=noisy.flatten(2).transpose(1, 2), encoder_hidden_states=emb,
                    encoder_hidden_states_mask=mask.bool(), timestep=t.to(noisy.dtype),
                    img_shapes=[[(1, h, w)]] * b, img_mask=img_mask, return_dict=False)[0]
        return out[:, -h * w:].transpose(1, 2).reshape(b, c, h, w)


FAMILY = QwenImage21
