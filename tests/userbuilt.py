"""Flux and SD3 folders built the way a user's converted checkpoint arrives: directly with
the diffusers / transformers classes and ``pipe.save_pretrained``, not through
``raylora.model.tiny``'s builders, and with other sizes than tiny.py's (more double blocks,
other head counts, a factor-8 VAE like the real ones, an SD3.5-medium MMDiT-X block).

Code that only works on tiny.py's exact configs (a hard-coded width, a VAE factor of 2, a
fixed number of blocks) fails on these. Only the tokenizer files come from raylora's
offline builders: the hub is unreachable here, and a tokenizer is data, not architecture.

Not a test module (no ``test_`` prefix); tests import it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from raylora.model.tiny import build_clip_tokenizer, build_t5_tokenizer


def _clip_tokenizer(pad_token: str | None = None):
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_clip_tokenizer(tmp, pad_token=pad_token)
        return CLIPTokenizer.from_pretrained(tmp)


def _clip_config(tok, hidden: int, projection: int, layers: int, heads: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
        projection_dim=projection, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def _t5_encoder(tok, d_model: int, layers: int, heads: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=d_model, d_kv=d_model // heads, d_ff=3 * d_model,
        num_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, tie_word_embeddings=False,
    ))


def _vae_factor_8(scaling: float, shift: float):
    """4 down blocks (8, 16, 16, 16) like the real 16-channel VAEs' (128, 256, 512, 512):
    downsampling factor 8, so 64 px → 8×8 latents."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        block_out_channels=(8, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=8, sample_size=128,
        scaling_factor=scaling, shift_factor=shift,
        use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
    )


def build_user_flux(dest: str | Path, guidance_embeds: bool = True, seed: int = 1) -> Path:
    """A Flux folder: 2 double + 1 single blocks of 4 heads × 8 (inner 32, rope axes
    (2, 2, 4)); CLIP hidden 24 (→ pooled_projection_dim 24); T5 d_model 48, 3 layers;
    VAE factor 8 (64 px → latents (B, 16, 8, 8) → packed (B, 16, 64))."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    tok = _clip_tokenizer()
    tok_2 = build_t5_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(tok, hidden=24, projection=24, layers=1, heads=2))
    text_encoder_2 = _t5_encoder(tok_2, d_model=48, layers=3, heads=2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=48,
        pooled_projection_dim=24, guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=_vae_factor_8(0.3611, 0.1159), text_encoder=text_encoder,
        tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok_2,
        transformer=transformer,
    )
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    pipe.save_pretrained(dest)
    return dest


def build_user_sd3(dest: str | Path, seed: int = 1) -> Path:
    """An SD3.5-medium-like folder: 3 joint blocks of 2 heads × 16 (inner 32), the first an
    MMDiT-X dual-attention block (``dual_attention_layers=(0,)``), qk RMS-norm; CLIP-L and
    CLIP-G stand-ins both hidden 32 / projection 32 (pooled 64; CLIP sequence 64 wide =
    T5 d_model, so no zero padding); VAE factor 8 (64 px → latents (B, 16, 8, 8))."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tok, tok_2, tok_3 = _clip_tokenizer(), _clip_tokenizer(pad_token="!"), build_t5_tokenizer()
    te = CLIPTextModelWithProjection(_clip_config(tok, 32, 32, layers=2, heads=2))
    te_2 = CLIPTextModelWithProjection(_clip_config(tok_2, 32, 32, layers=3, heads=4))
    te_3 = _t5_encoder(tok_3, d_model=64, layers=1, heads=4)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae_factor_8(1.5305, 0.0609), text_encoder=te, tokenizer=tok,
        text_encoder_2=te_2, tokenizer_2=tok_2, text_encoder_3=te_3, tokenizer_3=tok_3,
    )
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    pipe.save_pretrained(dest)
    return dest
