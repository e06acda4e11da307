"""Tiny random diffusers pipelines (SD-1.x, SDXL, Flux.1 and Flux.1 Kontext, SD3, Qwen-Image and 2.1,
Z-Image, Lumina-Image 2.0, Flux.2 [klein] and [dev], Wan), built offline.

Tests and the demo need a model but have no hub access. This builds the real diffusers /
transformers classes with tiny sizes and writes them with ``save_pretrained``, so training
loads them through exactly the ``from_pretrained(path, subfolder=...)`` path that a user's
``stable-diffusion-v1-5`` (or ``FLUX.1-dev``, ``stable-diffusion-3.5-large``,
``Qwen-Image``) folder takes.

The tokenizers are genuine, built here from a small English corpus, all with a fast
(``tokenizers``) backend:

* CLIP: byte-level BPE, the vocabulary built the way OpenAI's CLIP builds its own (256 byte
  symbols, the same with ``</w>``, then merges, then the two special tokens).
* T5: a SentencePiece-style Unigram model (``▁`` word boundaries; ``<pad>`` 0, ``</s>`` 1,
  ``<unk>`` 2, then pieces, then the 100 ``<extra_id_N>`` sentinels in reverse as T5's).
* Qwen2: GPT-2-style byte-level BPE (no ``</w>``; Qwen2's pre-tokenizer regex) with
  Qwen2.5-VL's special tokens; the corpus holds QwenImagePipeline's prompt template, so its
  system prefix is 34 tokens exactly as with the real tokenizer (the pipeline drops that
  many hidden states: ``prompt_template_encode_start_idx``).
* Mistral (Flux.2 [dev]): the same byte-level BPE with Mistral's control tokens and chat
  template (``build_mistral_tokenizer``).
* Gemma (Lumina-Image 2.0): SentencePiece-style BPE over characters with byte fallback
  (``build_gemma_tokenizer``).
"""

from __future__ import annotations

import inspect
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


def learn_bpe(words: Counter, num_merges: int, end_of_word: str = "</w>",
              byte_level: bool = True) -> list[tuple[str, str]]:
    """Plain BPE over byte-mapped words whose last symbol carries ``end_of_word`` (CLIP's
    ``</w>``; ``""`` for GPT-2-style BPE, whose words carry their leading space instead).
    ``byte_level`` False: over the words' characters (SentencePiece-style BPE with byte
    fallback, Gemma's). Stops early once every word is a single symbol.

    Ties break on the pair itself so the vocabulary is identical on every machine.
    """
    byte_map = bytes_to_unicode()
    corpus: dict[tuple[str, ...], int] = {}
    for word, n in words.items():
        symbols = [byte_map[b] for b in word.encode("utf-8")] if byte_level else list(word)
        symbols[-1] += end_of_word
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


def build_clip_tokenizer(dest: str | Path, num_merges: int = 400, pad_token: str | None = None):
    """Write a CLIP tokenizer (vocab.json, merges.txt + tokenizer files) to ``dest``.

    ``pad_token``: default ``<|endoftext|>`` (CLIP-L's); ``"!"`` as the OpenCLIP bigG
    tokenizer of SD3's ``tokenizer_2``.
    """
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
    extra = {} if pad_token is None else {"pad_token": pad_token}
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, **extra)
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


def _tiny_vae(latent_channels: int = 4, blocks: tuple[int, ...] = (32, 64), **extra):
    """VAE with channels ``blocks`` (32, 64): downsample factor 2 (2 ** (len − 1)),
    ``latent_channels`` latent channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=blocks,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        latent_channels=latent_channels,
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


# ---------------------------------------------------------------------------------------
# T5 (Flux's tokenizer_2, SD3's tokenizer_3): a SentencePiece-style Unigram tokenizer.

T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"  # ids 0, 1, 2 as T5's spiece.model
T5_EXTRA_IDS = 100
# T5-XXL's tokenizer limit (Flux.1-dev's pipeline default max_sequence_length: 512; SD3's:
# 256). T5 has relative position buckets, no position table: any length runs.
T5_MAX_LENGTH = 512
_SPIECE_SPACE = "▁"  # SentencePiece's word-boundary mark (U+2581)


def unigram_pieces(words: Counter, max_piece_len: int = 8, min_count: int = 2) -> list[tuple[str, float]]:
    """SentencePiece-style Unigram pieces with log-probability scores, specials first.

    Pieces: every corpus word with its ``▁`` prefix, every substring (≤ ``max_piece_len``)
    seen at least ``min_count`` times, and every printable ASCII character (so unseen words
    still tokenize, character by character). Score = log(count / total): the seed
    vocabulary of SentencePiece's Unigram trainer, without its EM pruning. Computed here,
    not with ``tokenizers.trainers.UnigramTrainer``, because that trainer is not
    reproducible run to run (thread-order float sums; hash-ordered alphabet ties), and the
    tiny model must be identical on every machine. Viterbi over these scores keeps corpus
    words whole: one piece's log-probability beats the sum of two or more.
    """
    import math
    import string

    whole: Counter = Counter()
    sub: Counter = Counter()
    for word, n in words.items():
        w = _SPIECE_SPACE + word
        whole[w] += n
        for i in range(len(w)):
            for j in range(i + 2, min(len(w), i + max_piece_len) + 1):
                if j - i < len(w):
                    sub[w[i:j]] += n
    counts: Counter = Counter(whole)
    for piece, n in sub.items():
        if n >= min_count:
            counts[piece] += n
    for word, n in words.items():
        for ch in _SPIECE_SPACE + word:
            counts[ch] += n
    total = sum(counts.values())
    scored = {p: math.log(n / total) for p, n in counts.items()}
    floor = min(scored.values()) - 1.0  # unseen characters: fallback only
    for ch in string.ascii_letters + string.digits + string.punctuation:
        scored.setdefault(ch, floor)
    pieces = sorted(scored.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0)] + [(p, round(s, 6)) for p, s in pieces]


def build_t5_tokenizer(dest: str | Path | None = None):
    """A T5 tokenizer (``T5TokenizerFast``; in transformers 5 the same class as
    ``T5Tokenizer``, a ``tokenizers`` Unigram backend) over the corpus; saved to ``dest``
    when given. Layout as T5's: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, pieces, then
    ``<extra_id_99>`` … ``<extra_id_0>``; ``</s>`` is appended to every sequence."""
    from transformers import T5TokenizerFast

    words = Counter(re.findall(r"[a-z]+", _CORPUS.lower()))
    vocab = unigram_pieces(words)
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(T5_EXTRA_IDS - 1, -1, -1)]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=T5_EXTRA_IDS, model_max_length=T5_MAX_LENGTH)
    if dest is not None:
        tok.save_pretrained(dest)
    return tok


def _t5_config(tokenizer, d_model: int = 64, num_layers: int = 2, num_heads: int = 4):
    """T5 v1.1 encoder config (gated-GELU FFN, untied head, T5-XXL's position buckets) at
    tiny sizes: ``d_model`` 64 → ``prompt_embeds`` of shape (B, L, 64)."""
    from transformers import T5Config

    return T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // num_heads,
        d_ff=2 * d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        dropout_rate=0.1,  # T5-XXL's; from_pretrained returns the model in eval mode
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _clip_config(tokenizer, hidden: int, projection: int, heads: int = 4, layers: int = 2):
    """A CLIP text config like ``_text_config`` with other widths (SD3's CLIP-G stand-in)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=77,
        hidden_act="gelu",  # OpenCLIP bigG's
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=projection,
    )


# ---------------------------------------------------------------------------------------
# Qwen2 (Qwen-Image's tokenizer): byte-level BPE with Qwen2.5-VL's special tokens.

# QwenImagePipeline.prompt_template_encode; the pipeline drops the hidden states of the
# first QWEN_DROP_IDX tokens (its prompt_template_encode_start_idx): the system prefix up to
# and including "<|im_start|>user\n".
QWEN_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_DROP_IDX = 34
# Qwen2.5-VL's special tokens in their real order (ids 151643… there; here after the BPE
# vocabulary). eos is <|im_end|>, pad <|endoftext|>, no bos/unk, as Qwen2.5-VL's tokenizer.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN_MAX_LENGTH = 131072  # Qwen2.5-VL's model_max_length (the pipeline passes 1024 + 34)
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer PRETOKENIZE_REGEX): words keep
# their leading space, digits split one by one, punctuation runs apart.
_QWEN2_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_qwen2_tokenizer(dest: str | Path | None = None, corpus: str = ""):
    """A Qwen2 tokenizer (``Qwen2Tokenizer``: in transformers 5 the fast class, a
    ``tokenizers`` BPE backend) learned from the corpus and QwenImagePipeline's prompt
    template; saved to ``dest`` when given. Every corpus/template word is one token, so the
    template's system prefix is ``QWEN_DROP_IDX`` (34) tokens as with the real tokenizer.
    ``corpus``: more words to learn (a family's own template)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer

    split = pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE), behavior="isolated")
    specials = re.compile("|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS))
    text = specials.sub("\n", QWEN_PROMPT_TEMPLATE.format(" ".join((_CORPUS + corpus).split())))
    words = Counter(piece for piece, _ in split.pre_tokenize_str(text))
    # Enough merges to make every word one symbol (learn_bpe stops there).
    merges = learn_bpe(words, num_merges=10_000, end_of_word="")
    tokens = list(bytes_to_unicode().values()) + ["".join(m) for m in merges]
    tokens += QWEN_SPECIAL_TOKENS
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=QWEN_MAX_LENGTH,
    )
    if dest is not None:
        tok.save_pretrained(dest)
    return tok


# ---------------------------------------------------------------------------------------
# Flow-matching families. Scheduler configs: the real checkpoints' scheduler_config.json.

FLUX_DEV_SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
)
FLUX_SCHNELL_SCHEDULER = dict(FLUX_DEV_SCHEDULER, shift=1.0, use_dynamic_shifting=False)
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # SD3-medium and SD3.5
QWENIMAGE_SCHEDULER = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    time_shift_type="exponential",
)


# Flux.1's transformer at tiny sizes (Chroma's too): 1 double + 2 single blocks, 2 heads × 16
# (inner 32), rope axes summing to the head dim like Flux's (16, 56, 56) of 128, in_channels
# 64 = 16 latent channels × 2×2 packing
FLUX1_TINY_BLOCKS = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                         attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6))


def _flux1_vae(blocks: tuple[int, ...] = (32, 64)):
    """Flux.1's VAE at tiny sizes (factor 2, 16 channels, its scaling 0.3611 / shift 0.1159,
    no quant convs), which Chroma, Z-Image and Lumina-Image 2.0 ship too. ``blocks``: its
    channels (``_tiny_vae``)."""
    return _tiny_vae(latent_channels=16, blocks=blocks, scaling_factor=0.3611, shift_factor=0.1159,
                     use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)


def build_tiny_fluxkontext(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random FluxKontextPipeline to ``dest``: ``build_tiny_flux``'s components
    (Flux.1 Kontext [dev] is Flux.1-dev's architecture), under Kontext's pipeline class."""
    return build_tiny_flux(dest, seed, pipeline="FluxKontextPipeline")


def build_tiny_flux(dest: str | Path, seed: int = 0, schnell: bool = False,
                    pipeline: str = "FluxPipeline") -> Path:
    """Save a tiny random FluxPipeline (Flux.1-dev layout; ``schnell``: no guidance
    embedding and schnell's static-shift scheduler) to ``dest``; returns the path.

    * ``text_encoder``: CLIPTextModel, hidden 32 → ``pooled_prompt_embeds`` (B, 32)
      (the pooler output, as Flux uses CLIP-L's 768-d pooler output); ``tokenizer`` CLIP, 77.
    * ``text_encoder_2``: T5EncoderModel, d_model 64 → ``prompt_embeds`` (B, L, 64);
      ``tokenizer_2`` T5 Unigram, model_max_length 512.
    * ``transformer``: FluxTransformer2DModel, 1 double + 2 single blocks, 2 heads × 16
      (inner 32), rope axes (4, 6, 6), in_channels 64 = 16 latent channels × 2×2 packing,
      joint_attention_dim 64, pooled_projection_dim 32.
    * ``vae``: AutoencoderKL (32, 64) → factor 2, 16 latent channels, Flux's
      scaling 0.3611 / shift 0.1159, no quant convs: 64 px → latents (B, 16, 32, 32) →
      packed (B, 256, 64).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(dest / "_tokenizer_build")
    tokenizer_2 = build_t5_tokenizer()
    text_encoder = CLIPTextModel(_text_config(tokenizer))
    text_encoder_2 = T5EncoderModel(_t5_config(tokenizer_2))
    transformer = FluxTransformer2DModel(
        **FLUX1_TINY_BLOCKS,
        joint_attention_dim=text_encoder_2.config.d_model,
        pooled_projection_dim=text_encoder.config.hidden_size,
        guidance_embeds=not schnell,
    )
    vae = _flux1_vae()
    scheduler = FlowMatchEulerDiscreteScheduler(
        **(FLUX_SCHNELL_SCHEDULER if schnell else FLUX_DEV_SCHEDULER)
    )
    import diffusers

    pipe = getattr(diffusers, pipeline)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
        image_encoder=None, feature_extractor=None,
    )
    pipe.save_pretrained(dest)
    shutil.rmtree(dest / "_tokenizer_build", ignore_errors=True)
    return dest


def build_tiny_chroma(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random ChromaPipeline to ``dest``; returns the path.

    * ``text_encoder``: T5EncoderModel, d_model 64 (``build_tiny_flux``'s T5) →
      ``prompt_embeds`` (B, 512, 64), read with its attention mask; ``tokenizer`` T5, 512.
    * ``transformer``: ChromaTransformer2DModel, 1 double + 2 single blocks, 2 heads × 16
      (inner 32), rope axes (4, 6, 6), in_channels 64 = 16 × 2×2 packing,
      joint_attention_dim 64; an approximator of 64 input channels, hidden 32, 2 layers
      (Chroma1-HD: 64, 5120, 5).
    * ``vae``: Flux.1's tiny one (factor 2, 16 channels, scaling 0.3611 / shift 0.1159).
    * ``scheduler``: Flux.1-dev's config (dynamic shift), which ChromaPipeline samples with
      through its ``mu``.
    """
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer()
    text_encoder = T5EncoderModel(_t5_config(tokenizer))
    transformer = ChromaTransformer2DModel(
        **FLUX1_TINY_BLOCKS,
        joint_attention_dim=text_encoder.config.d_model,
        approximator_num_channels=64,
        approximator_hidden_dim=32,
        approximator_layers=2,
    )
    vae = _flux1_vae()
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
        image_encoder=None, feature_extractor=None,
    )
    pipe.save_pretrained(dest)
    return dest


def build_tiny_sd3(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random StableDiffusion3Pipeline (SD3.5-large layout: qk RMS-norm, no
    dual-attention layers) to ``dest``; returns the path.

    * ``text_encoder``: CLIPTextModelWithProjection hidden 32, projection 32 (CLIP-L's part);
      ``tokenizer`` CLIP, 77, pads with ``<|endoftext|>``.
    * ``text_encoder_2``: CLIPTextModelWithProjection hidden 48, projection 48 (CLIP-G's
      part); ``tokenizer_2`` the same BPE, pads with ``"!"`` as bigG's.
    * ``text_encoder_3``: T5EncoderModel, d_model 96; ``tokenizer_3`` T5, 512.
    * The pipeline: pooled = concat of both projections (B, 80); CLIP sequence = concat of
      both penultimate hidden states (B, 77, 80), zero-padded to 96 and stacked before the
      T5 sequence: ``prompt_embeds`` (B, 77 + L, 96).
    * ``transformer``: SD3Transformer2DModel, 2 joint blocks, 4 heads × 8 (inner 32),
      patch 2, in/out 16, sample_size 32, pos_embed_max_size 96, joint_attention_dim 96,
      caption_projection_dim 32, pooled_projection_dim 80.
    * ``vae``: AutoencoderKL (32, 64) → factor 2, 16 channels, SD3's scaling 1.5305 /
      shift 0.0609, no quant convs: 64 px → latents (B, 16, 32, 32).
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_clip_tokenizer(dest / "_tokenizer_build")
    tokenizer_2 = build_clip_tokenizer(dest / "_tokenizer_build_2", pad_token="!")
    tokenizer_3 = build_t5_tokenizer()
    text_encoder = CLIPTextModelWithProjection(_text_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2, hidden=48, projection=48))
    text_encoder_3 = T5EncoderModel(_t5_config(tokenizer_3, d_model=96))
    pooled = text_encoder.config.projection_dim + text_encoder_2.config.projection_dim
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=text_encoder_3.config.d_model,
        caption_projection_dim=32,
        pooled_projection_dim=pooled,
        # SD3's 192 covers 128-latent (1024 px) images 1.5×; 96 here covers up to 384 px.
        pos_embed_max_size=96,
        qk_norm="rms_norm",
        dual_attention_layers=(),
    )
    vae = _tiny_vae(
        latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
        image_encoder=None, feature_extractor=None,
    )
    pipe.save_pretrained(dest)
    shutil.rmtree(dest / "_tokenizer_build", ignore_errors=True)
    shutil.rmtree(dest / "_tokenizer_build_2", ignore_errors=True)
    return dest


def _qwen2_5_vl_config(tokenizer, hidden: int = 32):
    """Qwen2.5-VL config at tiny sizes: text hidden ``hidden``, 2 layers, 2 heads (head dim
    16, M-RoPE sections (2, 3, 3) = 8 = head_dim / 2 like the real (16, 24, 24) of 64), GQA
    with 1 KV head; a 2-block vision tower whose merger outputs the text width."""
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            max_position_embeddings=128000,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            rope_theta=1000000.0,
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def build_tiny_qwenimage(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random QwenImagePipeline to ``dest``; returns the path.

    * ``text_encoder``: Qwen2_5_VLForConditionalGeneration, text hidden 32; the pipeline
      takes its last hidden state, drops the first 34 (template) tokens and pads the rest:
      ``prompt_embeds`` (B, L, 32) with ``prompt_embeds_mask`` (B, L) (None when all ones).
      ``tokenizer``: Qwen2 byte-level BPE.
    * ``transformer``: QwenImageTransformer2DModel, 2 blocks, 2 heads × 16 (inner 32), rope
      axes (4, 6, 6), patch 2, in_channels 64 = 16 × 2×2 packing, out_channels 16,
      joint_attention_dim 32, no guidance embedding.
    * ``vae``: AutoencoderKLQwenImage z_dim 16, base_dim 32, dim_mult (1, 2): one
      downsampling → factor 2, Qwen-Image's per-channel latents_mean / latents_std.
      Latents are 5-D: 64 px → (B, 16, 1, 32, 32) → packed (B, 256, 64).
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer()
    text_encoder = Qwen2_5_VLForConditionalGeneration(_qwen2_5_vl_config(tokenizer)).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_encoder.config.text_config.hidden_size,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim, like Qwen-Image's (16, 56, 56)
    )
    # Qwen-Image's VAE (the Wan-2.1 one) has dim_mult (1, 2, 4, 4) → factor 8; the real
    # latents_mean/std defaults are kept, being the per-channel statistics the pipeline uses.
    vae = AutoencoderKLQwenImage(
        base_dim=32,
        z_dim=16,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
    )
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
    pipe.save_pretrained(dest)
    return dest


# Qwen3-VL's chat template, the part QwenImage21Pipeline reaches (a system message whose
# content is a list of text parts): each message in ChatML.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen-Image 2.1's scheduler (flow matching, shifted by image size)
QWENIMAGE21_SCHEDULER = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
)


def build_tiny_qwenimageedit(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's layout) to
    ``dest``; returns the path. ``build_tiny_qwenimage``'s transformer, VAE and Qwen2.5-VL
    encoder (whose 2-block vision tower reads the input image: 14 px patches, merged 2×2),
    a tokenizer that also learned the edit template (its system prefix is 64 tokens, as
    the pipeline drops), and the ``processor`` folder the released checkpoints carry
    (``Qwen2VLProcessor``: that tokenizer and Qwen2-VL's image processor), written file by
    file because transformers 5 builds the processor itself only with torchvision."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from raylora.model.families.qwenimageedit import SYSTEM

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer(corpus=SYSTEM.replace("{}", " Picture 1: "))
    text_encoder = Qwen2_5_VLForConditionalGeneration(_qwen2_5_vl_config(tokenizer)).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_encoder.config.text_config.hidden_size,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(base_dim=32, z_dim=16, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False])
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, processor=None, transformer=transformer,
    )
    pipe.save_pretrained(dest)
    tokenizer.save_pretrained(dest / "processor")
    Qwen2VLImageProcessorPil().save_pretrained(dest / "processor")
    index = json.loads((dest / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (dest / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return dest


def build_tiny_qwenimage21(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random QwenImage21Pipeline (Qwen-Image 2.1) to ``dest``; returns the path.

    * ``text_encoder``: Qwen3VLForConditionalGeneration, text hidden 32, 2 layers (M-RoPE
      sections (2, 3, 3) of head dim 16), a 1-block vision tower the captions never reach;
      the pipeline takes the last decoder layer's output before the final norm and drops
      the system turn → ``prompt_embeds`` (B, L, 32). ``processor``: the Qwen2 byte-level
      BPE with ``QWEN3_VL_CHAT_TEMPLATE``, saved as the processor folder's tokenizer
      (``model_index.json`` names Qwen3VLProcessor, as the real checkpoint's does; its
      image and video processors need torchvision, which has no CPU build here, and
      text-to-image reads captions alone: raylora's ``qwenimage21.caption_processor``).
    * ``transformer``: QwenImage21Transformer2DModel, 2 blocks, 2 heads × 16, rope axes
      (4, 6, 6), 16 latent channels unpatched, context 32.
    * ``vae``: AutoencoderKLQwenImage21 (RGBA in and out), base_dim 8, four downsamplings →
      16× per side as the real one: 64 px → (B, 16, 1, 4, 4); per-channel latents_mean /
      latents_std of the first 16 of the real 64.
    """
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from raylora.model.families.qwenimage21 import SYSTEM, caption_processor

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer(corpus=SYSTEM)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    hidden = 32
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-6, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=hidden, deepstack_visual_indexes=[0],
                           num_position_embeddings=16, patch_size=8),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )).eval()
    transformer = QwenImage21Transformer2DModel(
        in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=hidden, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
    )
    # the real statistics are the class's defaults
    init = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False] * 4, latents_mean=list(init["latents_mean"].default[:16]),
        latents_std=list(init["latents_std"].default[:16]),
    )
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE21_SCHEDULER), vae=vae,
        text_encoder=text_encoder, processor=caption_processor(tokenizer), transformer=transformer,
    )
    pipe.save_pretrained(dest)
    # The class the real checkpoint's folder names (save_pretrained wrote raylora's).
    index_path = dest / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return dest


# Qwen3's chat template, the part ZImagePipeline reaches (one user message, a generation
# prompt, enable_thinking=True): each message in ChatML, then "<|im_start|>assistant\n";
# thinking off would add an empty think block, as Qwen3's own template does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _qwen3_text_encoder(model_class: str, hidden: int, layers: int):
    """Qwen3's tokenizer (the Qwen2 byte-level BPE with ``QWEN3_CHAT_TEMPLATE``) and a random
    transformers ``model_class`` (``Qwen3Model``, ``Qwen3ForCausalLM``) over it, ``hidden``
    wide (2 query heads, 1 key/value head) with ``layers`` layers, in eval mode."""
    import transformers

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    encoder = getattr(transformers, model_class)(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden // 2, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
    )).eval()
    return tokenizer, encoder


ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # Z-Image-Turbo


def build_tiny_zimage(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random ZImagePipeline to ``dest``; returns the path.

    * ``text_encoder``: Qwen3Model, hidden 32, 2 layers; the pipeline takes the
      second-to-last hidden state of each caption's own tokens (its chat template included,
      padding dropped): a list of (L_i, 32). ``tokenizer``: the Qwen2 byte-level BPE with
      Qwen3's chat template (``QWEN3_CHAT_TEMPLATE``).
    * ``transformer``: ZImageTransformer2DModel, dim 32 = 2 heads × 16, 2 layers plus one
      noise- and one caption-refiner block, rope axes (4, 6, 6), patch 2, 16 latent
      channels, cap_feat_dim 32.
    * ``vae``: AutoencoderKL (32, 64) → factor 2, 16 latent channels, Flux's scaling 0.3611
      / shift 0.1159 (Z-Image uses the Flux.1 VAE): 64 px → latents (B, 16, 32, 32).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer, text_encoder = _qwen3_text_encoder("Qwen3Model", hidden=32, layers=2)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
        axes_dims=[4, 6, 6],  # sums to the head dim, like Z-Image's (32, 48, 48) of 128
    )
    vae = _flux1_vae()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
    pipe.save_pretrained(dest)
    return dest


GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0-4 as Gemma's
GEMMA_MAX_LENGTH = 8192  # Gemma 2's context (Lumina2Pipeline passes 256)
# A static shift, as Lumina2Pipeline's (its mu is ignored without dynamic shifting); 6.0 is
# not checked against Lumina-Image 2.0's scheduler_config.json (no hub here).
LUMINA2_SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)


def build_gemma_tokenizer(dest: str | Path | None = None, corpus: str = ""):
    """A Gemma tokenizer (``GemmaTokenizer``: in transformers 5 the fast class, a
    ``tokenizers`` BPE with byte fallback whose normalizer writes spaces as ``▁``) learned
    from the corpus and ``corpus``; saved to ``dest`` when given. Layout as Gemma's:
    ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4, the 256 byte tokens
    ``<0x00>`` … ``<0xFF>``, then characters and merges; ``<bos>`` starts every sequence.
    Every corpus word, with and without its ``▁``, is one token. Padding on the right, the
    side Lumina2's transformer reads captions from (Gemma's own default is the left)."""
    from transformers import GemmaTokenizer

    words = Counter()
    for w in (_CORPUS + " " + corpus).split():
        words[w] += 1
        words[_SPIECE_SPACE + w] += 1
    merges = learn_bpe(words, num_merges=10_000, end_of_word="", byte_level=False)
    chars = sorted({c for w in words for c in w})
    tokens = [*GEMMA_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *chars,
              *("".join(m) for m in merges)]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    # add_bos_token: the class's default is off in transformers 5; Gemma's checkpoints set it
    tok = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=GEMMA_MAX_LENGTH,
                         padding_side="right", add_bos_token=True)
    if dest is not None:
        tok.save_pretrained(dest)
    return tok


def _gemma2_text_encoder(tokenizer):
    """A Gemma2Model for ``tokenizer`` (``build_gemma_tokenizer``'s ids): hidden 32, 2 layers,
    2 query heads to 1 key/value head (Lumina-Image 2.0's and Sana's encoder, Gemma 2 2B)."""
    import transformers

    return transformers.Gemma2Model(transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )).eval()


def build_tiny_lumina2(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Lumina2Pipeline to ``dest``; returns the path.

    * ``text_encoder``: Gemma2Model, hidden 32, 2 layers (2 query heads, 1 key/value head);
      the pipeline takes the second-to-last hidden state of the caption behind its system
      prompt. ``tokenizer``: ``build_gemma_tokenizer`` with that system prompt's words.
    * ``transformer``: Lumina2Transformer2DModel, hidden 48 = 3 heads × 16 and 1 key/value
      head (Lumina-Image 2.0's 3 : 1, 24 : 8 there, which its fused q/k/v export assumes),
      2 joint layers plus one noise- and one context-refiner block, rope axes (4, 6, 6),
      patch 2, 16 latent channels, cap_feat_dim 32.
    * ``vae``: the Flux.1 VAE at tiny widths (Lumina-Image 2.0 ships Flux.1's) with its real
      factor, 8 (channels 32, 32, 32, 32), because Lumina2Pipeline sizes latents by a fixed
      8 whatever the VAE: 64 px → latents (B, 16, 8, 8).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    from raylora.model.families.lumina2 import SYSTEM

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_gemma_tokenizer(corpus=SYSTEM + " <Prompt Start>")
    text_encoder = _gemma2_text_encoder(tokenizer)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, hidden_size=48, num_layers=2,
        num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
        axes_dim_rope=(4, 6, 6), cap_feat_dim=32,
    )
    pipe = Lumina2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LUMINA2_SCHEDULER), vae=_flux1_vae((32,) * 4),
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
    pipe.save_pretrained(dest)
    return dest


# Sana's scheduler as the pipeline samples: DPM-Solver++ on flow sigmas (flow_prediction),
# shifted by flow_shift 3.0. Written from memory of Sana_1600M_1024px_diffusers'
# scheduler_config.json, not checked against it (no hub here).
SANA_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                      flow_shift=3.0, algorithm_type="dpmsolver++", solver_order=2)


def build_tiny_sana(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random SanaPipeline to ``dest``; returns the path.

    * ``text_encoder``: Gemma2Model, hidden 32, 2 layers (2 query heads, 1 key/value head);
      the pipeline takes its last hidden state. ``tokenizer``: ``build_gemma_tokenizer``
      with the words of the pipeline's complex human instruction.
    * ``transformer``: SanaTransformer2DModel, hidden 32 = 2 heads × 16 of linear
      self-attention, 2 cross-attention heads of 16, 2 layers, patch 1, 8 latent channels,
      caption_channels 32, sample_size 16.
    * ``vae``: AutoencoderDC (Sana's deep-compression autoencoder, 32× down there) at
      tiny widths: 3 ResBlock stages (16, 32, 32), 4× down, 8 latent channels, Sana's
      scaling factor 0.41407: 64 px → latents (B, 8, 16, 16).
    """
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    from raylora.model.families.sana import INSTRUCTION

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_gemma_tokenizer(corpus=INSTRUCTION)
    text_encoder = _gemma2_text_encoder(tokenizer)
    transformer = SanaTransformer2DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
        caption_channels=32, mlp_ratio=2.5, sample_size=16, patch_size=1,
    )
    blocks = (16, 32, 32)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=8, attention_head_dim=8,
        encoder_block_types="ResBlock", decoder_block_types="ResBlock",
        encoder_block_out_channels=blocks, decoder_block_out_channels=blocks,
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), ()), decoder_qkv_multiscales=((), (), ()),
        scaling_factor=0.41407,
    )
    pipe = SanaPipeline(scheduler=DPMSolverMultistepScheduler(**SANA_SCHEDULER), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(dest)
    return dest


def _save_flux2(pipeline_class, dest: Path, tokenizer, text_encoder, text_width: int,
                guidance_embeds: bool) -> Path:
    """A Flux.2 pipeline (``pipeline_class``: [klein]'s or [dev]'s) around ``tokenizer`` and
    ``text_encoder`` (whose three stacked layers are ``text_width`` wide), saved to ``dest``:

    * ``transformer``: Flux2Transformer2DModel, 1 double + 2 single blocks, 2 heads × 16,
      rope axes (4, 4, 4, 4), in_channels 32 = 8 latent channels × 2×2 patchify; the
      guidance embedding of a guidance-distilled model when ``guidance_embeds``.
    * ``vae``: AutoencoderKLFlux2 (32, 64) → factor 2, 8 latent channels, its batch norm
      over the 32 patchified channels given random running statistics (a fresh one is the
      identity): 64 px → latents (B, 8, 32, 32) → patchified (B, 32, 16, 16), 256 tokens.
    * ``scheduler``: Flux.1-dev's dynamic-shift config (``FLUX_DEV_SCHEDULER``).
    """
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=32, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=8,
        layers_per_block=1, norm_num_groups=32, sample_size=64,
    )
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    pipe = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
    pipe.save_pretrained(dest)
    return dest


def build_tiny_flux2klein(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Flux2KleinPipeline (the base model: not distilled) to ``dest``;
    returns the path.

    * ``text_encoder``: Qwen3ForCausalLM, hidden 16, 30 layers (so the pipeline's layers
      9, 18 and 27 are intermediate ones, as in Qwen3-4B's 36, and raylora's loader drops
      layers 28-29 as it drops 28-35 there) → ``prompt_embeds``
      (B, L, 48), every padding position kept. ``tokenizer``: the Qwen2 byte-level BPE with
      Qwen3's chat template (``QWEN3_CHAT_TEMPLATE``; the pipeline turns thinking off).
    * ``transformer``, ``vae``, ``scheduler``: ``_save_flux2``'s, joint_attention_dim 48,
      no guidance embedding (Klein's).
    """
    from diffusers import Flux2KleinPipeline

    dest = Path(dest)
    torch.manual_seed(seed)
    # 30 layers: the pipeline's 9, 18 and 27 are intermediate ones, and 28-29 are dropped
    tokenizer, text_encoder = _qwen3_text_encoder("Qwen3ForCausalLM", hidden=16, layers=30)
    return _save_flux2(Flux2KleinPipeline, dest, tokenizer, text_encoder,
                       3 * text_encoder.config.hidden_size, guidance_embeds=False)


# Mistral (Flux.2 [dev]'s tokenizer, a PixtralProcessor's): byte-level BPE with the
# control tokens Flux2Pipeline's chat template and the processor use, first as in Tekken
# (whose ids 0-999 are control tokens; here only those named). bos <s>, eos </s>, pad <pad>.
MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)
MISTRAL_MAX_LENGTH = 131072  # Mistral Small 3.x's context
# Mistral Small 3.x's chat template, the part Flux2Pipeline reaches: <s>, the system
# message (a string or, as format_input sends it, a list of text blocks) in
# [SYSTEM_PROMPT]…[/SYSTEM_PROMPT], each user message in [INST]…[/INST] (text blocks joined,
# an image block as [IMG]), assistant messages closed by </s>.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def build_mistral_tokenizer(corpus: str = ""):
    """A Mistral-style tokenizer: byte-level BPE learned from the caption corpus and
    ``corpus`` (Flux2Pipeline's system message), Qwen2's pre-tokenizer split, the control
    tokens ``MISTRAL_SPECIAL_TOKENS`` (ids 0-10), a post-processor that prepends <s> (the
    processor's ``apply_chat_template`` turns it off for a template that writes <s> itself),
    Mistral Small's chat template. It pads on the left, the default of transformers'
    LlamaTokenizer: raylora reads the side from the tokenizer, so this tiny checks that
    path (a right-padding checkpoint takes the other)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import Regex
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE), behavior="isolated")
    text = corpus + "\n" + " ".join(_CORPUS.split())
    merges = learn_bpe(Counter(p for p, _ in split.pre_tokenize_str(text)), 10_000, end_of_word="")
    tokens = list(MISTRAL_SPECIAL_TOKENS) + list(bytes_to_unicode().values()) + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])])
    backend.add_special_tokens(list(MISTRAL_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", padding_side="left", model_max_length=MISTRAL_MAX_LENGTH,
    )
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


def build_tiny_flux2(dest: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Flux2Pipeline (Flux.2 [dev]) to ``dest``; returns the path.

    * ``text_encoder``: Mistral3ForConditionalGeneration, text hidden 16 with 32 layers (so
      the pipeline's layers 10, 20 and 30 are intermediate ones, as in Mistral Small's 40,
      and raylora's loader drops layer 31 as it drops 31-39 there), a 1-layer Pixtral
      vision tower the captions never reach → ``prompt_embeds`` (B, 512, 48), every padding
      position kept. ``tokenizer``: ``build_mistral_tokenizer`` itself, where the real
      checkpoint has a PixtralProcessor around its tokenizer: transformers 5's
      PixtralProcessor requires torchvision, which has no CPU build here. The pipeline
      calls ``tokenizer.apply_chat_template(...)`` on either; the processor's tokenizes
      with its tokenizer and, for a template that writes <s> itself, adds no special
      tokens, as a tokenizer's never does: the same ids.
    * ``transformer``, ``vae``, ``scheduler``: ``_save_flux2``'s, as Flux.2 [klein]'s tiny,
      but with the guidance embedding of the guidance-distilled [dev].
    """
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_mistral_tokenizer(SYSTEM_MESSAGE)
    ids = tokenizer.convert_tokens_to_ids
    hidden = 16
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=len(tokenizer), hidden_size=hidden,
            intermediate_size=2 * hidden, num_hidden_layers=32, num_attention_heads=2,
            num_key_value_heads=1, head_dim=hidden // 2, rms_norm_eps=1e-5,
            max_position_embeddings=4096, rope_theta=1000000000.0, sliding_window=None,
            bos_token_id=ids("<s>"), eos_token_id=ids("</s>"), pad_token_id=ids("<pad>"),
        ),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32, image_size=32,
                           patch_size=8, num_channels=3),
        image_token_index=ids("[IMG]"), spatial_merge_size=1, vision_feature_layer=-1,
        tie_word_embeddings=False,
    )).eval()
    return _save_flux2(Flux2Pipeline, dest, tokenizer, text_encoder, 3 * hidden, guidance_embeds=True)


# Wan2.1-T2V-1.3B's scheduler: UniPC over flow sigmas, shifted statically
WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction",
                     use_flow_sigmas=True, flow_shift=3.0)


def build_tiny_wan(dest: str | Path, seed: int = 0, experts: bool = False) -> Path:
    """Save a tiny random WanPipeline (Wan 2.1 text-to-video layout) to ``dest``; returns
    the path. ``experts``: Wan 2.2 A14B's layout, a second transformer (other random
    weights) as ``transformer_2`` for σ below ``boundary_ratio`` 0.875.

    * ``text_encoder``: UMT5EncoderModel, d_model 64, 2 layers (a position bias per layer,
      UMT5's), over the tiny T5 tokenizer; the pipeline takes its last hidden state, zero
      past each caption: ``prompt_embeds`` (B, max_sequence_length, 64).
    * ``transformer``: WanTransformer3DModel, 2 blocks, 2 heads × 16, patch (1, 2, 2),
      16 latent channels, text_dim 64.
    * ``vae``: AutoencoderKLWan z_dim 16, base_dim 32, dim_mult (1, 2): one downsampling
      (``scale_factor_spatial`` 2), Wan's per-channel latents_mean / latents_std. Latents
      are 5-D: 64 px, one frame → (B, 16, 1, 32, 32).
    * ``scheduler``: UniPC with ``flow_prediction`` and ``flow_shift`` 3.0 (``WAN_SCHEDULER``),
      as the Wan checkpoints ship it.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    dest = Path(dest)
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer()
    t5 = _t5_config(tokenizer).to_dict()
    text_encoder = UMT5EncoderModel(UMT5Config(**{k: v for k, v in t5.items()
                                                  if k in UMT5Config().to_dict()})).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=text_encoder.config.d_model, freq_dim=32, ffn_dim=64,
        num_layers=2, rope_max_seq_len=256,
    )
    # Wan's VAE has dim_mult (1, 2, 4, 4) → factor 8; the real latents_mean/std defaults are
    # kept, being the per-channel statistics the pipeline uses.
    vae = AutoencoderKLWan(base_dim=32, z_dim=16, dim_mult=[1, 2], num_res_blocks=1,
                           temperal_downsample=[False], scale_factor_spatial=2)
    second = {}
    if experts:
        second = {"transformer_2": WanTransformer3DModel.from_config(transformer.config),
                  "boundary_ratio": 0.875}
    pipe = WanPipeline(
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, transformer=transformer, **second,
    )
    pipe.save_pretrained(dest)
    return dest


BUILDERS = {
    "sd": build_tiny_sd,
    "sdxl": build_tiny_sdxl,
    "flux": build_tiny_flux,
    "fluxkontext": build_tiny_fluxkontext,
    "chroma": build_tiny_chroma,
    "sd3": build_tiny_sd3,
    "qwenimage": build_tiny_qwenimage,
    "qwenimage21": build_tiny_qwenimage21,
    "qwenimageedit": build_tiny_qwenimageedit,
    "zimage": build_tiny_zimage,
    "lumina2": build_tiny_lumina2,
    "sana": build_tiny_sana,
    "flux2klein": build_tiny_flux2klein,
    "flux2": build_tiny_flux2,
    "wan": build_tiny_wan,
}
FAMILIES = tuple(BUILDERS)


def build_tiny(dest: str | Path, family: str = "sd", seed: int = 0, *, schnell: bool = False,
               experts: bool = False) -> Path:
    """Build the tiny ``family`` pipeline (one of ``FAMILIES``) at ``dest``. ``schnell``:
    Flux.1-schnell instead of -dev (flux only); ``experts``: Wan 2.2 A14B's two
    transformers (wan only)."""
    if family not in BUILDERS:
        raise ValueError(f"tiny model: unknown family {family!r}; one of {', '.join(FAMILIES)}")
    if schnell and family != "flux":
        raise ValueError(f"tiny model: schnell is a Flux variant, not {family}")
    if experts and family != "wan":
        raise ValueError(f"tiny model: experts are a Wan 2.2 layout, not {family}")
    if family == "flux":
        return build_tiny_flux(dest, seed, schnell=schnell)
    if family == "wan":
        return build_tiny_wan(dest, seed, experts=experts)
    return BUILDERS[family](dest, seed)
