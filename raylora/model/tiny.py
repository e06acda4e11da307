"""A tiny random Stable-Diffusion-1.x-layout pipeline, built offline.

Tests and the demo need a model but have no hub access. This builds the real diffusers /
transformers classes with tiny sizes and writes them with ``save_pretrained``, so training
loads them through exactly the ``from_pretrained(path, subfolder=...)`` path that a user's
``stable-diffusion-v1-5`` folder takes.

The tokenizer is a genuine CLIP byte-level BPE tokenizer: the vocabulary is built the way
OpenAI's CLIP builds its own (256 byte symbols, the same with ``</w>``, then merges, then
the two special tokens), with merges learned here from a small English corpus.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# Words the demo captions use plus common caption vocabulary, so frequent words become
# single tokens; anything else still tokenizes through the byte symbols.
_CORPUS = """
a an the of on in with and at to by from over under near small large big tiny photo picture
image drawing painting render of a red green blue yellow orange purple pink white black gray
brown cyan magenta circle square triangle star ring cross stripe stripes dot dots shape shapes
background sky ground grass water sea sunset night day light dark bright centered left right
top bottom corner middle two three several many one person dog cat car house tree flower
mountain city street portrait style high quality detailed simple flat geometric colorful
"""


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2's reversible byte → printable-unicode map (no whitespace/control chars)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def learn_bpe(words: Counter, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over byte-mapped words whose last symbol carries ``</w>``.

    Ties break on the pair itself so the vocabulary is identical on every machine.
    """
    byte_map = bytes_to_unicode()
    corpus: dict[tuple[str, ...], int] = {}
    for word, n in words.items():
        symbols = [byte_map[b] for b in word.encode("utf-8")]
        symbols[-1] += "</w>"
        corpus[tuple(symbols)] = corpus.get(tuple(symbols), 0) + n
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for symbols, n in corpus.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, n in corpus.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        corpus = merged
    return merges


def build_clip_tokenizer(dest: str | Path, num_merges: int = 400):
    """Write a CLIP tokenizer (vocab.json, merges.txt + tokenizer files) to ``dest``."""
    from transformers import CLIPTokenizer

    words = Counter(re.findall(r"[a-z]+", _CORPUS.lower()))
    merges = learn_bpe(words, num_merges)
    byte_symbols = list(bytes_to_unicode().values())
    tokens = byte_symbols + [s + "</w>" for s in byte_symbols] + ["".join(m) for m in merges]
    tokens += [BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (dest / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )
    # 77 is CLIP's context length; without it truncation overflows the position table.
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tok.save_pretrained(dest)
    return tok


def _text_config(tokenizer):
    """CLIP text encoder config of the tiny models: hidden 32, 2 layers, 32-d projection."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=32,
    )


def _tiny_vae(**extra):
    """VAE with channels (32, 64): downsample factor 2, 4 latent channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=64,
        **extra,
    )


def build_tiny_sd(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random SD-1.x pipeline to ``dest``; returns the path.

    Sizes: CLIP text encoder hidden 32, UNet channels (32, 64), VAE channels (32, 64) with a
    downsample factor of 2, so 64 px images become 4×32×32 latents.
    """
    from diffusers import (
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(dest / "_tokenizer_build")
    text_encoder = CLIPTextModel(_text_config(tokenizer))
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        # Attention only at the 16×16 level: full-resolution attention would make a CPU
        # step ~10× slower for no benefit in a test model.
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = _tiny_vae()
    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        prediction_type="epsilon",
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(dest)
    shutil.rmtree(dest / "_tokenizer_build", ignore_errors=True)
    return dest


def build_tiny_sdxl(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random SDXL pipeline to ``dest`` (the layout of diffusers' own SDXL
    tests): two CLIP text encoders (hidden 32 each; the second with a 32-d projection),
    a UNet with SDXL's ``text_time`` added conditioning (6 size/crop ids × 8 + pooled 32 =
    80), cross-attention over both encoders' features (64), VAE factor 2.
    """
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(dest / "_tokenizer_build")
    text_encoder = CLIPTextModel(_text_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(tokenizer))
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=32,
    )
    vae = _tiny_vae(scaling_factor=0.13025, force_upcast=True)  # SDXL's VAE values
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.save_pretrained(dest)
    shutil.rmtree(dest / "_tokenizer_build", ignore_errors=True)
    return dest


def build_tiny(dest: str | Path, family: str = "sd", seed: int = 0) -> Path:
    return build_tiny_sdxl(dest, seed) if family == "sdxl" else build_tiny_sd(dest, seed)
