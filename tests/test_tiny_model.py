"""The tiny offline models: tokenizers (CLIP BPE, T5 Unigram, Qwen2 byte-level BPE) and the
flux / sd3 / qwenimage / zimage pipelines, which load through diffusers and raylora's loader."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from raylora.model import tiny
from raylora.model.families import flux2, flux2klein, lumina2, sana, zimage
from raylora.model.tiny import BOS, EOS, bytes_to_unicode, learn_bpe


def test_bytes_to_unicode_is_a_printable_bijection():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert all(not c.isspace() for c in m.values())
    assert m[ord("a")] == "a" and m[ord(" ")] != " "


def test_bpe_merges_are_deterministic_and_frequency_ordered():
    words = Counter({"low": 5, "lower": 2, "newest": 6, "widest": 3})
    merges = learn_bpe(words, 10)
    assert merges == learn_bpe(words, 10)
    assert merges[0] == ("s", "t</w>")  # in "newest"×6 + "widest"×3, the most frequent pair


def test_tiny_tokenizer_is_clip_shaped(tiny_model):
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    assert tok.model_max_length == 77
    assert tok.bos_token == BOS and tok.eos_token == EOS and tok.pad_token == EOS
    ids = tok("a red circle").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    # Demo caption words are whole tokens thanks to the learned merges.
    assert tok.convert_ids_to_tokens(ids[1:-1]) == ["a</w>", "red</w>", "circle</w>"]
    # Unseen text still tokenizes (byte fallback) and decodes back.
    assert tok.decode(tok("zebra xylophone!").input_ids, skip_special_tokens=True) == "zebra xylophone !"
    te_cfg = json.load(open(f"{tiny_model}/text_encoder/config.json"))
    assert te_cfg["vocab_size"] == len(tok) and te_cfg["eos_token_id"] == tok.eos_token_id


# ---------------------------------------------------------------------------------------
# Flow-matching families: flux, fluxkontext, chroma, sd3, qwenimage, zimage, lumina2, sana,
# flux2klein, flux2, wan.
# Each is built once for the module.

NEW_FAMILIES = ("flux", "fluxkontext", "chroma", "sd3", "qwenimage", "zimage", "lumina2", "sana",
                "flux2klein", "flux2", "wan")
PIPELINE_CLASS = {"flux": "FluxPipeline", "fluxkontext": "FluxKontextPipeline", "chroma": "ChromaPipeline",
                  "sd3": "StableDiffusion3Pipeline",
                  "qwenimage": "QwenImagePipeline", "zimage": "ZImagePipeline",
                  "lumina2": "Lumina2Pipeline", "sana": "SanaPipeline", "flux2klein": "Flux2KleinPipeline", "flux2": "Flux2Pipeline", "wan": "WanPipeline"}
TOKENIZERS = {
    "flux": {"tokenizer": "CLIPTokenizer", "tokenizer_2": "T5Tokenizer"},
    "fluxkontext": {"tokenizer": "CLIPTokenizer", "tokenizer_2": "T5Tokenizer"},
    "chroma": {"tokenizer": "T5Tokenizer"},
    "sd3": {"tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer",
            "tokenizer_3": "T5Tokenizer"},
    "qwenimage": {"tokenizer": "Qwen2Tokenizer"},
    "zimage": {"tokenizer": "Qwen2Tokenizer"},
    "lumina2": {"tokenizer": "GemmaTokenizer"},
    "sana": {"tokenizer": "GemmaTokenizer"},
    "flux2klein": {"tokenizer": "Qwen2Tokenizer"},
    # the Mistral tokenizer alone (the real checkpoint wraps it in a PixtralProcessor,
    # which needs torchvision: tiny.build_tiny_flux2)
    "flux2": {"tokenizer": "TokenizersBackend"},
    "wan": {"tokenizer": "T5Tokenizer"},
}
# 64 px through a factor-2 VAE with 16 channels (Qwen-Image's and Wan's VAEs are video VAEs:
# frames axis; the tiny Flux.2 VAE has 8, patchified to 32 by the pipeline; Lumina-Image
# 2.0's is factor 8, as Lumina2Pipeline assumes; Sana's DC-AE: factor 4 with 8 channels)
LATENT_SHAPE = {"flux": (1, 16, 32, 32), "fluxkontext": (1, 16, 32, 32), "chroma": (1, 16, 32, 32), "sd3": (1, 16, 32, 32), "qwenimage": (1, 16, 1, 32, 32),
                "zimage": (1, 16, 32, 32), "lumina2": (1, 16, 8, 8), "sana": (1, 8, 16, 16), "flux2klein": (1, 8, 32, 32), "flux2": (1, 8, 32, 32),
                "wan": (1, 16, 1, 32, 32)}
VIDEO = ("qwenimage", "wan")  # a frames axis in the VAE's input and latents
CAPTIONS = ["a red circle", "a small blue square on the green grass"]  # different lengths


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family_model(request, tmp_path_factory):
    """(family, folder) built once per module per family."""
    fam = request.param
    return fam, str(tiny.build_tiny(tmp_path_factory.mktemp(fam) / f"tiny-{fam}", fam))


@pytest.fixture(scope="module")
def family_pipe(family_model):
    from diffusers import DiffusionPipeline

    fam, path = family_model
    return fam, DiffusionPipeline.from_pretrained(path)


def test_model_index_names_the_pipeline_and_its_components(family_model, family_pipe):
    fam, path = family_model
    index = json.load(open(f"{path}/model_index.json"))
    assert index["_class_name"] == PIPELINE_CLASS[fam]
    assert type(family_pipe[1]).__name__ == PIPELINE_CLASS[fam]
    for sub, cls in TOKENIZERS[fam].items():
        assert index[sub] == ["transformers", cls]
    denoiser = {"flux": "FluxTransformer2DModel", "fluxkontext": "FluxTransformer2DModel",
                "chroma": "ChromaTransformer2DModel", "sd3": "SD3Transformer2DModel",
                "qwenimage": "QwenImageTransformer2DModel", "zimage": "ZImageTransformer2DModel",
                "lumina2": "Lumina2Transformer2DModel", "sana": "SanaTransformer2DModel", "flux2klein": "Flux2Transformer2DModel", "flux2": "Flux2Transformer2DModel",
                "wan": "WanTransformer3DModel"}[fam]
    assert index["transformer"] == ["diffusers", denoiser]
    # Wan's checkpoints ship UniPC over flow sigmas, Sana's DPM-Solver++
    scheduler = {"wan": "UniPCMultistepScheduler", "sana": "DPMSolverMultistepScheduler"}.get(
        fam, "FlowMatchEulerDiscreteScheduler")
    assert index["scheduler"] == ["diffusers", scheduler]


def test_two_step_inference_at_64px(family_pipe):
    fam, pipe = family_pipe
    # Flux.2 [dev]'s system message alone is 31 of the tiny tokenizer's tokens
    kw = {"max_sequence_length": 64 if fam in ("flux2", "lumina2") else 32}
    if fam == "sana":
        kw["use_resolution_binning"] = False  # else it samples at 512² (the tiny's bin) and resizes
    if fam == "qwenimage":
        kw["true_cfg_scale"] = 1.0  # no negative prompt: plain conditional sampling
    if fam == "wan":
        kw["num_frames"] = 1  # a video pipeline: one frame is an image
    if fam == "fluxkontext":
        kw["max_area"] = 64 * 64  # it samples at max_area (1024²) whatever height × width say
    # a copy: ZImagePipeline writes the templated text into the list it is given
    out = pipe(prompt=list(CAPTIONS), num_inference_steps=2, height=64, width=64, output_type="np",
               generator=torch.Generator().manual_seed(0), **kw)
    if fam == "wan":
        assert out.frames.shape == (2, 1, 64, 64, 3)  # (videos, frames, H, W, RGB)
        out.images = out.frames[:, 0]
    out = out.images
    assert out.shape == (2, 64, 64, 3)
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    assert out.std() > 0.01  # random weights still give an image, not a constant


def test_tokenizers_load_fast_and_ship_as_json(family_model):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    fam, path = family_model
    for sub, cls in TOKENIZERS[fam].items():
        tok = AutoTokenizer.from_pretrained(path, subfolder=sub)
        assert type(tok).__name__ == cls and tok.is_fast
        # What data workers get: the backend as JSON, rebuilt with `tokenizers` alone.
        backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
        assert backend.encode(CAPTIONS[1]).ids == tok(CAPTIONS[1]).input_ids


@pytest.mark.parametrize("family_model", ["flux", "sd3"], indirect=True)
def test_t5_tokenizer_has_t5_ids_and_whole_word_pieces(family_model):
    from transformers import AutoTokenizer

    fam, path = family_model
    sub, enc = ("tokenizer_2", "text_encoder_2") if fam == "flux" else ("tokenizer_3", "text_encoder_3")
    tok = AutoTokenizer.from_pretrained(path, subfolder=sub)
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", 1)
    assert (tok.unk_token, tok.unk_token_id) == ("<unk>", 2)
    assert tok.model_max_length == tiny.T5_MAX_LENGTH == 512
    # Sentinels at the end, reversed, as T5's spiece.model (<extra_id_0> is the last id).
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1
    assert tok.convert_tokens_to_ids("<extra_id_99>") == len(tok) - 100
    ids = tok("a red circle", padding="max_length", max_length=8).input_ids
    assert tok.convert_ids_to_tokens(ids[:4]) == ["▁a", "▁red", "▁circle", "</s>"]
    assert ids[4:] == [0, 0, 0, 0]
    # Unseen words fall back to characters, never <unk>, and decode back.
    zebra = tok("zebra 42").input_ids
    assert 2 not in zebra and tok.decode(zebra, skip_special_tokens=True) == "zebra 42"
    cfg = json.load(open(f"{path}/{enc}/config.json"))
    assert cfg["vocab_size"] == len(tok) and cfg["pad_token_id"] == 0 and cfg["eos_token_id"] == 1


def test_t5_and_qwen_vocabularies_are_reproducible():
    # The tiny model must be byte-identical on every machine and run.
    assert tiny.build_t5_tokenizer().backend_tokenizer.to_str() == \
        tiny.build_t5_tokenizer().backend_tokenizer.to_str()
    assert tiny.build_qwen2_tokenizer().backend_tokenizer.to_str() == \
        tiny.build_qwen2_tokenizer().backend_tokenizer.to_str()
    pieces = tiny.unigram_pieces(Counter({"red": 3, "circle": 2}))
    assert [p for p, _ in pieces[:3]] == ["<pad>", "</s>", "<unk>"]
    scores = dict(pieces)
    # Score = log(count / total); one whole-word piece outscores any split into two.
    assert scores["▁circle"] == scores["▁ci"] and scores["▁circle"] < 0
    assert scores["▁circle"] > scores["▁ci"] + scores["rcle"]
    assert math.isclose(scores["▁red"] - scores["▁circle"], math.log(3 / 2), abs_tol=1e-5)
    assert "▁circ" in scores and "▁c" in scores and "z" in scores  # ASCII fallback


@pytest.mark.parametrize("family_model", ["lumina2"], indirect=True)
def test_gemma_tokenizer_has_gemmas_layout_bos_and_byte_fallback(family_model):
    """The tiny Lumina-Image 2.0 tokenizer: Gemma's special ids, <bos> first, the 256 byte
    tokens after the specials (unseen characters fall back to them, never <unk>), whole
    words with SentencePiece's ``▁``, right padding, reproducible; the encoder's config
    names the same ids."""
    from transformers import AutoTokenizer

    from raylora.model.families import lumina2

    path = family_model[1]
    tok = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    assert [tok.convert_tokens_to_ids(t) for t in tiny.GEMMA_SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids("<0x00>") == 5 and tok.convert_tokens_to_ids("<0xFF>") == 260
    ids = tok("a red circle", padding="max_length", max_length=6).input_ids
    assert tok.convert_ids_to_tokens(ids[:4]) == ["<bos>", "a", "▁red", "▁circle"] and ids[4:] == [0, 0]
    zebra = tok("zebra 42 é").input_ids
    assert 3 not in zebra and tok.decode(zebra, skip_special_tokens=True) == "zebra 42 é"
    assert "<0xC3>" in tok.convert_ids_to_tokens(zebra)  # é (not in the corpus) as UTF-8 bytes
    # the system prompt is one token per word (<bos> first, and the space before an empty
    # caption a "▁" of its own): the tiny's template length is the corpus', not luck's
    system = tok.convert_ids_to_tokens(tok(lumina2.TEMPLATE.format("")).input_ids)
    assert len(system) == 1 + len(lumina2.TEMPLATE.format("").split()) + 1 and system[-1] == "▁"
    assert tiny.build_gemma_tokenizer().backend_tokenizer.to_str() == \
        tiny.build_gemma_tokenizer().backend_tokenizer.to_str()
    cfg = json.load(open(f"{path}/text_encoder/config.json"))
    assert (cfg["vocab_size"], cfg["pad_token_id"], cfg["bos_token_id"]) == (len(tok), 0, 2)


@pytest.mark.parametrize("family_model", ["qwenimage"], indirect=True)
def test_qwen_template_prefix_is_34_tokens_as_the_pipeline_drops(family_model, family_pipe):
    from transformers import AutoTokenizer

    fam, path = family_model
    pipe = family_pipe[1]
    assert pipe.prompt_template_encode == tiny.QWEN_PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == tiny.QWEN_DROP_IDX == 34
    tok = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    prefix = tiny.QWEN_PROMPT_TEMPLATE.split("{}")[0]
    ids = tok(prefix).input_ids
    assert len(ids) == 34
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[:4] == ["<|im_start|>", "system", "Ċ", "Describe"]
    assert toks[-5:] == ["<|im_end|>", "Ċ", "<|im_start|>", "user", "Ċ"]
    # Qwen2.5-VL's specials: eos <|im_end|>, pad <|endoftext|>, no bos; the encoder's config
    # names the same ids.
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    cfg = json.load(open(f"{path}/text_encoder/config.json"))
    assert cfg["text_config"]["vocab_size"] == len(tok)
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg["text_config"]["eos_token_id"] == tok.eos_token_id
    # Caption words are whole tokens with GPT-2's leading-space mark.
    assert tok.convert_ids_to_tokens(tok("a red circle").input_ids) == ["a", "Ġred", "Ġcircle"]


@pytest.mark.parametrize("family_model", ["zimage"], indirect=True)
def test_zimage_tokenizer_writes_qwen3s_chat_template_as_the_family_does(family_model):
    """ZImagePipeline formats each caption with ``tokenizer.apply_chat_template``; the tiny
    tokenizer carries Qwen3's template, which gives raylora's ``zimage.TEMPLATE`` (the
    tokens the preprocess stage writes), with an empty think block only when thinking is off
    (Flux2KleinPipeline turns it off: ``flux2klein.TEMPLATE``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_model[1], subfolder="tokenizer")
    msg = [{"role": "user", "content": CAPTIONS[1]}]
    text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert text == zimage.TEMPLATE.format(CAPTIONS[1])
    off = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == text + "<think>\n\n</think>\n\n" == flux2klein.TEMPLATE.format(CAPTIONS[1])
    assert tok.convert_ids_to_tokens(tok(text).input_ids)[:3] == ["<|im_start|>", "user", "Ċ"]
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|endoftext|>", "right")


def test_encode_prompt_shapes(family_pipe):
    fam, pipe = family_pipe
    with torch.no_grad():
        if fam in ("flux", "fluxkontext"):
            embeds, pooled, text_ids = pipe.encode_prompt("a red circle", None, max_sequence_length=32)
            assert embeds.shape == (1, 32, 64) and pooled.shape == (1, 32)
            assert text_ids.shape == (32, 3) and not text_ids.any()
        elif fam == "chroma":
            embeds, text_ids, mask, *_ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                            max_sequence_length=32)
            # T5's last hidden state at every one of the 32 positions (read with its mask);
            # the transformer's mask keeps each caption's tokens (</s> included) and one pad
            n = [len(pipe.tokenizer(c).input_ids) for c in CAPTIONS]
            assert embeds.shape == (2, 32, 64) and text_ids.shape == (32, 3) and n[0] < n[1]
            assert mask.sum(1).tolist() == [k + 1 for k in n]
            assert mask[0, : n[0] + 1].all() and not mask[0, n[0] + 1:].any()
            assert embeds[0, n[0] + 1:].abs().amax() > 0  # the masked pads are encoded, kept
        elif fam == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt("a red circle", None, None,
                                                      do_classifier_free_guidance=False,
                                                      max_sequence_length=32)
            # 77 CLIP tokens (32 + 48 wide, zero-padded to T5's 96) then 32 T5 tokens
            assert embeds.shape == (1, 77 + 32, 96) and pooled.shape == (1, 32 + 48)
            assert not embeds[:, :77, 80:].any()
        elif fam == "flux2klein":
            embeds, text_ids = pipe.encode_prompt(CAPTIONS, max_sequence_length=32)
            # layers 9, 18 and 27 of the 16-wide LM side by side; every padding position kept,
            # and text position ids (0, 0, 0, l)
            assert embeds.shape == (2, 32, 48) and text_ids.shape == (2, 32, 4)
            assert text_ids[..., 3].tolist() == [list(range(32))] * 2
            assert not text_ids[..., :3].any()
            n = len(pipe.tokenizer(flux2klein.TEMPLATE.format(CAPTIONS[0])).input_ids)
            assert n < 32 and embeds[0, n:].abs().amin() > 0  # pads are encoded, not zeroed
        elif fam == "flux2":
            embeds, text_ids = pipe.encode_prompt(CAPTIONS, max_sequence_length=64)
            # layers 10, 20 and 30 of the 16-wide Mistral side by side, 64 positions with
            # text position ids (0, 0, 0, l); the tokenizer pads on the left, so each
            # caption's template ends at the last position and its padding comes first
            assert embeds.shape == (2, 64, 48) and text_ids.shape == (2, 64, 4)
            assert text_ids[..., 3].tolist() == [list(range(64))] * 2
            tok = pipe.tokenizer
            n = [len(tok(flux2.TEMPLATE.format(c), add_special_tokens=False).input_ids) for c in CAPTIONS]
            assert n[0] < n[1] < 64
            ids = tok.apply_chat_template(
                [[{"role": "system", "content": [{"type": "text", "text": flux2.SYSTEM_MESSAGE}]},
                  {"role": "user", "content": [{"type": "text", "text": c}]}] for c in CAPTIONS],
                tokenize=True, return_dict=True, padding="max_length", max_length=64)["input_ids"]
            assert [r.count(tok.pad_token_id) for r in ids] == [64 - k for k in n]
            assert ids[0][:64 - n[0]] == [tok.pad_token_id] * (64 - n[0])
            assert ids[0][64 - n[0]] == tok.bos_token_id and ids[0].count(tok.bos_token_id) == 1
            # the template and caption are the last n positions (the pad embedding row is
            # zero in a fresh Mistral, and the masked pads stay zero through its layers)
            assert embeds[0, 64 - n[0]:].abs().amax(1).gt(0).all()
            assert not embeds[0, :64 - n[0]].any()
        elif fam == "zimage":
            # a copy: the pipeline writes the templated text into the list it is given
            embeds, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False)
            # one (L_i, 32) per caption: its own tokens in Qwen3's chat template, no padding
            n = [len(pipe.tokenizer(zimage.TEMPLATE.format(c)).input_ids) for c in CAPTIONS]
            assert [tuple(e.shape) for e in embeds] == [(k, 32) for k in n] and n[0] < n[1]
        elif fam == "lumina2":
            embeds, mask, neg, neg_mask = pipe.encode_prompt(CAPTIONS, max_sequence_length=64)
            # Gemma's second-to-last hidden state at 64 positions; each caption behind the
            # system prompt, padded on the right (the side the transformer reads); the
            # negative prompt "" bare: <bos> alone
            n = [len(pipe.tokenizer(lumina2.TEMPLATE.format(c)).input_ids) for c in CAPTIONS]
            assert embeds.shape == neg.shape == (2, 64, 32) and n[0] < n[1] <= 64
            assert mask.sum(1).tolist() == n and mask[0, :n[0]].all()
            assert neg_mask.sum(1).tolist() == [1, 1] and neg_mask[:, 0].all()
        elif fam == "sana":
            instruction = sana.INSTRUCTION.split("\n")  # __call__'s default; encode_prompt's is none
            embeds, mask, neg, neg_mask = pipe.encode_prompt(CAPTIONS, max_sequence_length=32,
                                                             complex_human_instruction=instruction)
            # Gemma's last hidden state: <bos>, the instruction's last token, then the
            # lower-cased caption, right-padded to 32; the negative prompt "" bare
            k = len(pipe.tokenizer.encode(sana.INSTRUCTION))
            n = [len(pipe.tokenizer(sana.INSTRUCTION + c).input_ids) - k + 2 for c in CAPTIONS]
            assert embeds.shape == neg.shape == (2, 32, 32) and k > 100 and n[0] < n[1] <= 32
            assert mask.sum(1).tolist() == n and mask[0, :n[0]].all()
            assert neg_mask.sum(1).tolist() == [1, 1] and neg_mask[:, 0].all()
        elif fam == "wan":
            embeds, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                           max_sequence_length=32)
            # UMT5's last hidden state at 32 positions, zero past each caption's tokens (</s>
            # included), the transformer takes no mask
            n = [len(pipe.tokenizer(c).input_ids) for c in CAPTIONS]
            assert embeds.shape == (2, 32, 64) and n[0] < n[1]
            assert all(not e[k:].any() and e[:k].abs().amin(1).gt(0).all()
                       for e, k in zip(embeds, n))
        else:
            embeds, mask = pipe.encode_prompt(CAPTIONS)
            # caption tokens + the 5 template tokens after it (<|im_end|> \n <|im_start|>
            # assistant \n); the shorter caption is zero-padded and masked
            n = [len(pipe.tokenizer(c).input_ids) + 5 for c in CAPTIONS]
            assert embeds.shape == (2, max(n), 32)
            assert mask.sum(1).tolist() == n
            assert not embeds[0, n[0]:].any()


def test_component_configs_are_consistent(family_model):
    fam, path = family_model

    def cfg(sub):
        name = "scheduler_config.json" if sub == "scheduler" else "config.json"
        return json.load(open(f"{path}/{sub}/{name}"))

    tr, vae, sch = cfg("transformer"), cfg("vae"), cfg("scheduler")
    if fam in ("flux", "fluxkontext"):
        assert tr["in_channels"] == 4 * vae["latent_channels"] == 64
        assert tr["joint_attention_dim"] == cfg("text_encoder_2")["d_model"] == 64
        assert tr["pooled_projection_dim"] == cfg("text_encoder")["hidden_size"] == 32
        assert tr["guidance_embeds"] is True
        assert sum(tr["axes_dims_rope"]) == tr["attention_head_dim"]
        assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)
        assert sch["shift"] == 3.0 and sch["use_dynamic_shifting"] is True
        assert (sch["base_shift"], sch["max_shift"]) == (0.5, 1.15)
        assert (sch["base_image_seq_len"], sch["max_image_seq_len"]) == (256, 4096)
    elif fam == "chroma":
        assert tr["in_channels"] == 4 * vae["latent_channels"] == 64
        assert tr["joint_attention_dim"] == cfg("text_encoder")["d_model"] == 64
        assert "guidance_embeds" not in tr and "pooled_projection_dim" not in tr  # no CLIP
        assert sum(tr["axes_dims_rope"]) == tr["attention_head_dim"]
        assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)  # Flux.1's VAE
        assert sch["shift"] == 3.0 and sch["use_dynamic_shifting"] is True
    elif fam == "sd3":
        te, te2, te3 = cfg("text_encoder"), cfg("text_encoder_2"), cfg("text_encoder_3")
        assert tr["pooled_projection_dim"] == te["projection_dim"] + te2["projection_dim"] == 80
        assert tr["joint_attention_dim"] == te3["d_model"] == 96
        assert te3["d_model"] >= te["hidden_size"] + te2["hidden_size"]
        assert (tr["in_channels"], tr["out_channels"], tr["patch_size"]) == (16, 16, 2)
        assert (vae["scaling_factor"], vae["shift_factor"]) == (1.5305, 0.0609)
        assert sch["shift"] == 3.0 and sch["use_dynamic_shifting"] is False
    elif fam == "flux2klein":
        te = cfg("text_encoder")
        assert tr["joint_attention_dim"] == 3 * te["hidden_size"] == 48
        assert te["num_hidden_layers"] > max(flux2klein.LAYERS)  # intermediate layers, as 4B's
        assert tr["in_channels"] == 4 * vae["latent_channels"] == 32 and tr["patch_size"] == 1
        assert tr["guidance_embeds"] is False
        assert len(tr["axes_dims_rope"]) == 4  # (t, h, w, l)
    elif fam == "flux2":
        te = cfg("text_encoder")
        assert te["architectures"] == ["Mistral3ForConditionalGeneration"]
        text = te["text_config"]
        assert tr["joint_attention_dim"] == 3 * text["hidden_size"] == 48
        assert text["num_hidden_layers"] > max(flux2.LAYERS)  # intermediate layers, as 24B's 40
        assert tr["in_channels"] == 4 * vae["latent_channels"] == 32 and tr["patch_size"] == 1
        assert tr["guidance_embeds"] is True  # guidance-distilled, as Flux.1-dev
        assert len(tr["axes_dims_rope"]) == 4
        assert sum(tr["axes_dims_rope"]) == tr["attention_head_dim"]
        assert sch["shift"] == 3.0 and sch["use_dynamic_shifting"] is True
    elif fam == "zimage":
        assert tr["cap_feat_dim"] == cfg("text_encoder")["hidden_size"] == 32
        assert tr["in_channels"] == vae["latent_channels"] == 16 and tr["all_patch_size"] == [2]
        assert sum(tr["axes_dims"]) == tr["dim"] // tr["n_heads"]
        assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)  # Flux.1's VAE
        assert sch["shift"] == 3.0 and sch["use_dynamic_shifting"] is False
    elif fam == "lumina2":
        te = cfg("text_encoder")
        assert te["model_type"] == "gemma2" and tr["cap_feat_dim"] == te["hidden_size"] == 32
        assert tr["in_channels"] == vae["latent_channels"] == 16 and tr["patch_size"] == 2
        assert sum(tr["axes_dim_rope"]) == tr["hidden_size"] // tr["num_attention_heads"]
        assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)  # Flux.1's VAE
        assert len(vae["block_out_channels"]) == 4  # factor 8
        assert sch["use_dynamic_shifting"] is False
    elif fam == "sana":
        te = cfg("text_encoder")
        assert te["model_type"] == "gemma2" and tr["caption_channels"] == te["hidden_size"] == 32
        assert tr["in_channels"] == tr["out_channels"] == vae["latent_channels"] == 8
        assert tr["patch_size"] == 1 and tr["timestep_scale"] == 1.0 and tr["guidance_embeds"] is False
        assert vae["scaling_factor"] == 0.41407 and len(vae["encoder_block_out_channels"]) == 3
        assert (sch["prediction_type"], sch["use_flow_sigmas"], sch["flow_shift"]) == \
            ("flow_prediction", True, 3.0)
    elif fam == "wan":
        te = cfg("text_encoder")
        assert te["model_type"] == "umt5" and tr["text_dim"] == te["d_model"] == 64
        assert tr["in_channels"] == tr["out_channels"] == vae["z_dim"] == 16
        assert tr["patch_size"] == [1, 2, 2]
        assert vae["latents_std"][0] == 2.8184 and vae["scale_factor_spatial"] == 2
        assert (sch["prediction_type"], sch["use_flow_sigmas"], sch["flow_shift"]) == \
            ("flow_prediction", True, 3.0)
    else:
        te = cfg("text_encoder")
        assert tr["joint_attention_dim"] == te["text_config"]["hidden_size"] == 32
        assert tr["in_channels"] == 4 * vae["z_dim"] and tr["out_channels"] == vae["z_dim"] == 16
        assert sum(tr["axes_dims_rope"]) == tr["attention_head_dim"]
        assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 16
        assert vae["latents_std"][0] == 2.8184  # Qwen-Image's per-channel statistics
        assert sch["shift"] == 1.0 and sch["use_dynamic_shifting"] is True
        assert (sch["base_shift"], sch["max_shift"], sch["shift_terminal"]) == (0.5, 0.9, 0.02)
        assert (sch["base_image_seq_len"], sch["max_image_seq_len"]) == (256, 8192)
        assert sch["time_shift_type"] == "exponential"
    if fam not in ("qwenimage", "flux2klein", "flux2", "wan", "sana"):  # AutoencoderKLFlux2 keeps its quant convs
        assert vae["use_quant_conv"] is False and vae["use_post_quant_conv"] is False


def test_latents_of_a_64px_image(family_pipe):
    fam, pipe = family_pipe
    # WanPipeline names it for the spatial axes (a temporal one too); Lumina2Pipeline's is a
    # fixed 8, which its tiny VAE has
    assert getattr(pipe, "vae_scale_factor_spatial" if fam == "wan" else "vae_scale_factor") == \
        {"lumina2": 8, "sana": 4}.get(fam, 2)
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    if fam in VIDEO:
        pixels = pixels.unsqueeze(2)  # [B, C, frames=1, H, W]
    with torch.no_grad():
        out = pipe.vae.encode(pixels)
        z = out.latent if fam == "sana" else out.latent_dist.mode()  # DC-AE is deterministic
    assert tuple(z.shape) == LATENT_SHAPE[fam]


@pytest.mark.parametrize("family_model", ["flux2klein"], indirect=True)
def test_flux2klein_posterior_is_the_pipelines_patchified_normalised_latents(family_pipe):
    """Flux2KleinPipeline patchifies the VAE's latents 2×2 and normalises them by the VAE's
    batch-norm statistics (weights, not config). The family folds both into the posterior it
    returns (what the latent cache stores): its mean is the pipeline's image latents, and a
    draw from it has the variance of the normalised draw."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    fam, pipe = family_pipe
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        params = flux2klein.FAMILY.encode_pixels(pipe.vae, pixels)
        want = pipe._encode_vae_image(pixels, generator=None)  # argmax: the mode
        raw = pipe.vae.encode(pixels).latent_dist
    assert params.shape == (2, 64, 16, 16) and want.shape == (2, 32, 16, 16)
    assert pipe.vae.bn.running_var.min() != 1.0  # the tiny VAE's statistics are not identity
    torch.testing.assert_close(params[:, :32], want, rtol=1e-5, atol=1e-5)
    bn_var = pipe.vae.bn.running_var + pipe.vae.config.batch_norm_eps
    var = DiagonalGaussianDistribution(params).var
    torch.testing.assert_close(var, flux2klein.patchify(raw.var) / bn_var.view(1, -1, 1, 1),
                               rtol=1e-4, atol=1e-7)


def test_transformer_trains_at_64px_and_is_cpu_sized(family_pipe):
    """One forward + backward at 64 px (32×32 latents) in the pipeline's own layout."""
    fam, pipe = family_pipe
    tr = pipe.transformer
    # Z-Image's timestep MLP is 256 → 1024 → dim whatever the width (296k of its 365k);
    # Lumina-Image 2.0's is 48 wide (3 query heads to 1 key/value head, as the released 24 : 8)
    limit = {"zimage": 400_000, "lumina2": 200_000}.get(fam, 150_000)
    assert sum(p.numel() for p in tr.parameters()) < limit
    b, g = 2, torch.Generator().manual_seed(0)
    if fam in ("flux", "fluxkontext"):
        x = torch.randn(b, 256, 64, generator=g)  # 16×16 tokens of 2×2×16
        ids = torch.zeros(16, 16, 3)
        ids[..., 1] += torch.arange(16)[:, None]
        ids[..., 2] += torch.arange(16)[None, :]
        out = tr(hidden_states=x, timestep=torch.rand(b), guidance=torch.full((b,), 3.5),
                 pooled_projections=torch.randn(b, 32), encoder_hidden_states=torch.randn(b, 32, 64),
                 txt_ids=torch.zeros(32, 3), img_ids=ids.reshape(-1, 3), return_dict=False)[0]
    elif fam == "chroma":  # no guidance or pooled input; a mask over caption + image tokens
        x = torch.randn(b, 256, 64, generator=g)
        ids = torch.zeros(16, 16, 3)
        ids[..., 1] += torch.arange(16)[:, None]
        ids[..., 2] += torch.arange(16)[None, :]
        mask = torch.ones(b, 32 + 256)
        mask[0, 8:32] = 0
        out = tr(hidden_states=x, timestep=torch.rand(b), encoder_hidden_states=torch.randn(b, 32, 64),
                 txt_ids=torch.zeros(32, 3), img_ids=ids.reshape(-1, 3), attention_mask=mask,
                 return_dict=False)[0]
    elif fam == "sd3":
        x = torch.randn(b, 16, 32, 32, generator=g)
        out = tr(hidden_states=x, timestep=torch.rand(b) * 1000,
                 encoder_hidden_states=torch.randn(b, 77 + 32, 96),
                 pooled_projections=torch.randn(b, 80), return_dict=False)[0]
    elif fam in ("flux2klein", "flux2"):
        x = torch.randn(b, 256, 32, generator=g)  # 16×16 tokens of the patchified 32 channels
        ids = torch.zeros(16, 16, 4)
        ids[..., 1] += torch.arange(16)[:, None]
        ids[..., 2] += torch.arange(16)[None, :]
        txt_ids = torch.zeros(32, 4)
        txt_ids[:, 3] = torch.arange(32)
        out = tr(hidden_states=x, timestep=torch.rand(b),
                 encoder_hidden_states=torch.randn(b, 32, 48), img_ids=ids.reshape(-1, 4),
                 txt_ids=txt_ids, guidance=torch.full((b,), 4.0) if fam == "flux2" else None,
                 return_dict=False)[0]
    elif fam == "zimage":  # lists: each image [C, frames, h, w], each caption at its length
        x = torch.randn(b, 16, 1, 32, 32, generator=g)
        out = torch.stack(tr(list(x), torch.rand(b), [torch.randn(7, 32), torch.randn(12, 32)],
                             return_dict=False)[0])
    elif fam == "lumina2":  # [B, C, h, w]; the mask marks each caption's first tokens
        x = torch.randn(b, 16, 32, 32, generator=g)
        mask = torch.ones(b, 12, dtype=torch.long)
        mask[0, 7:] = 0
        out = tr(hidden_states=x, timestep=torch.rand(b), encoder_hidden_states=torch.randn(b, 12, 32),
                 encoder_attention_mask=mask, return_dict=False)[0]
    elif fam == "sana":  # [B, C, h, w]; a caption mask; the timestep as σ·1000
        x = torch.randn(b, 8, 32, 32, generator=g)
        mask = torch.ones(b, 12, dtype=torch.long)
        mask[0, 7:] = 0
        out = tr(hidden_states=x, timestep=torch.rand(b) * 1000, encoder_hidden_states=torch.randn(b, 12, 32),
                 encoder_attention_mask=mask, return_dict=False)[0]
    elif fam == "wan":  # [B, C, frames, h, w], the timestep as σ·1000
        x = torch.randn(b, 16, 1, 32, 32, generator=g)
        out = tr(hidden_states=x, timestep=torch.rand(b) * 1000,
                 encoder_hidden_states=torch.randn(b, 32, 64), return_dict=False)[0]
    else:
        x = torch.randn(b, 256, 64, generator=g)
        mask = torch.ones(b, 12, dtype=torch.long)
        mask[0, 7:] = 0
        out = tr(hidden_states=x, timestep=torch.rand(b), encoder_hidden_states=torch.randn(b, 12, 32),
                 encoder_hidden_states_mask=mask, img_shapes=[[(1, 16, 16)]] * b,
                 return_dict=False)[0]
    assert out.shape == x.shape
    out.square().mean().backward()
    grads = [p.grad for p in tr.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
    tr.zero_grad(set_to_none=True)


def test_raylora_loader_reads_the_tiny_model_back(family_model):
    from raylora.config import ModelSection
    from raylora.model.load import check_model, load_components
    from raylora.storage import Storage

    fam, path = family_model
    info = check_model(path, Storage())
    # Flux.2's pipeline patchifies the VAE's latents 2×2: 4 pixels per latent side
    assert info["family"].name == fam and info["vae_factor"] == \
        (4 if fam.startswith("flux2") else {"lumina2": 8, "sana": 4}.get(fam, 2))
    c = load_components(ModelSection(pretrained=path), torch.float32)
    assert [type(t).__name__ for t in c.tokenizers] == list(TOKENIZERS[fam].values())
    assert type(c.denoiser).__name__ == json.load(open(f"{path}/model_index.json"))["transformer"][1]
    if fam in ("flux", "fluxkontext", "chroma", "zimage", "lumina2"):
        assert (c.latent_shift, c.latent_scale) == (0.1159, 0.3611)
    elif fam == "sd3":
        assert (c.latent_shift, c.latent_scale) == (0.0609, 1.5305)
    elif fam == "sana":  # DC-AE: a scaling factor, no shift
        assert (c.latent_shift, c.latent_scale) == (0.0, 0.41407)
    elif fam == "flux2klein":  # its batch-norm statistics are applied in encode_pixels
        assert (c.latent_shift, c.latent_scale) == (0.0, 1.0)
        # The Qwen3 runs up to the deepest layer read (27): 28 of the tiny model's 30 layers
        # (test_families: its hidden states still equal the pipeline's full encoder's).
        (te,) = c.text_encoders
        assert len(te.model.layers) == te.config.num_hidden_layers == max(flux2klein.LAYERS) + 1
        assert json.load(open(f"{path}/text_encoder/config.json"))["num_hidden_layers"] == 30
    elif fam == "flux2":
        assert (c.latent_shift, c.latent_scale) == (0.0, 1.0)
        # Mistral3ForConditionalGeneration's language model alone (no vision tower, no LM
        # head), up to the deepest layer read (30): 31 of the tiny model's 32 layers
        (te,) = c.text_encoders
        assert type(te).__name__ == "MistralModel"
        assert len(te.layers) == te.config.num_hidden_layers == max(flux2.LAYERS) + 1
        assert not any("vision" in n or "lm_head" in n for n, _ in te.named_parameters())
        saved = json.load(open(f"{path}/text_encoder/config.json"))
        assert saved["text_config"]["num_hidden_layers"] == 32
    else:
        assert c.latent_shift[0] == -0.7571 and math.isclose(c.latent_scale[0], 1 / 2.8184)


def test_flux_schnell_variant(tmp_path):
    from diffusers import DiffusionPipeline

    path = tiny.build_tiny(tmp_path / "schnell", "flux", schnell=True)
    pipe = DiffusionPipeline.from_pretrained(path)
    assert type(pipe).__name__ == "FluxPipeline"
    assert pipe.transformer.config.guidance_embeds is False
    assert pipe.scheduler.config.shift == 1.0 and pipe.scheduler.config.use_dynamic_shifting is False
    out = pipe("a red circle", num_inference_steps=1, height=64, width=64, output_type="np",
               max_sequence_length=16).images
    assert out.shape == (1, 64, 64, 3) and np.isfinite(out).all()


def test_build_tiny_rejects_unknown_family_and_misplaced_variants(tmp_path):
    with pytest.raises(ValueError, match="unknown family 'sd4'"):
        tiny.build_tiny(tmp_path / "x", "sd4")
    with pytest.raises(ValueError, match="schnell"):
        tiny.build_tiny(tmp_path / "x", "sd3", schnell=True)
    with pytest.raises(ValueError, match="experts are a Wan 2.2 layout, not flux"):
        tiny.build_tiny(tmp_path / "x", "flux", experts=True)
    # Every family module has a tiny model, so every family-parametrized test covers it.
    from raylora.model import families
    from stock import PIPELINES

    assert sorted(tiny.FAMILIES) == sorted(families.names()) == sorted(PIPELINES)
    assert {f: PIPELINES[f][0] for f in tiny.FAMILIES} == {f: families.get(f).pipeline for f in tiny.FAMILIES}


def test_cli_tiny_model_family_choices():
    from raylora.cli import build_parser

    for fam in tiny.FAMILIES:
        args = build_parser().parse_args(["tiny-model", "--family", fam, "out"])
        assert (args.family, args.schnell, args.dest) == (fam, False, "out")
    assert build_parser().parse_args(["tiny-model", "--family", "flux", "--schnell", "o"]).schnell
    assert build_parser().parse_args(["tiny-model", "--family", "wan", "--experts", "o"]).experts
    sample = ["sample", "--model", "m", "--adapter", "a", "--prompt", "p", "--out", "o.png"]
    assert build_parser().parse_args(sample).expert is None
    assert build_parser().parse_args([*sample, "--expert", "low_noise"]).expert == "low_noise"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*sample, "--expert", "transformer_2"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tiny-model", "--family", "sd4", "out"])


@pytest.mark.parametrize("builder,pipeline", [("build_user_flux", "FluxPipeline"),
                                              ("build_user_sd3", "StableDiffusion3Pipeline")])
def test_user_built_folder_loads_learns_and_its_adapter_loads(tmp_path, builder, pipeline,
                                                               demo_data):
    """A folder written straight by diffusers/transformers (other sizes than tiny.py's,
    factor-8 VAE) loads like a converted user checkpoint, raylora's step learns on it, and
    the stock pipeline loads the adapter. (The 2-worker Ray path around the same step runs
    every family's tiny model in test_families_cluster.py.)"""
    from diffusers import DiffusionPipeline

    from raylora.model.load import check_model
    from raylora.storage import Storage

    import userbuilt

    path = getattr(userbuilt, builder)(tmp_path / builder)
    pipe = DiffusionPipeline.from_pretrained(path)
    assert type(pipe).__name__ == pipeline
    assert pipe.vae_scale_factor == 8
    assert pipe.transformer.config.num_layers in (2, 3)  # not tiny.py's 1 / 2
    info = check_model(str(path), Storage())
    assert info["family"].name == {"FluxPipeline": "flux"}.get(pipeline, "sd3")
    assert info["vae_factor"] == 8
    with torch.no_grad():
        z = pipe.vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mode()
    assert tuple(z.shape) == (1, 16, 8, 8)

    from inproc import _fresh_accelerator, demo_batch, overfit
    from stock import stock_image_change

    from raylora.config import validate
    from raylora.model.lora import save_diffusers_adapter
    from raylora.train.setup import build_run

    family = info["family"].name
    cfg = validate({"model": {"pretrained": str(path), "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64}, "lora": {"rank": 8},
                    "train": {"learning_rate": 1e-2, "seed": 0},
                    "output": {"uri": str(tmp_path / "o")}})
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 20, rank=0)
    before, after = overfit(run, demo_batch(family, str(path), demo_data), 20)
    assert after < 0.95 * before, (before, after)
    adapter = tmp_path / "adapter"
    save_diffusers_adapter(accel.unwrap_model(run.model), str(adapter), run.family)
    assert stock_image_change(family, str(path), adapter) > 1e-3


def _broken_copy(tiny_model, dst, edits: dict):
    """A copy of the tiny SD model with each file of ``edits`` (relative name → bytes, or
    a function of the model_index.json dict) written over."""
    import shutil

    shutil.copytree(tiny_model, dst)
    for name, edit in edits.items():
        if callable(edit):
            index = json.loads((dst / name).read_text())
            edit(index)
            edit = json.dumps(index).encode()
        (dst / name).write_bytes(edit)
    return dst


@pytest.mark.parametrize("weights", [True, False])  # train's check, and `raylora plan`'s
@pytest.mark.parametrize("name,edit,problem", [
    ("model_index.json", b'{"_class_name": "StableDiffusionPipeline"\n"unet": 1}',
     "model_index.json: not valid JSON (Expecting ',' delimiter: line 2 column 1)"),
    ("model_index.json", b"", "model_index.json: empty, not JSON"),
    ("model_index.json", b"[1, 2]", "model_index.json: an array, not a JSON object"),
    ("vae/config.json", b'{"in_channels": 3, "out',
     "vae/config.json: not valid JSON (Unterminated string starting at: line 1 column 20)"),
    ("scheduler/scheduler_config.json", b'{"_class_name": "PNDM',
     "scheduler/scheduler_config.json: not valid JSON (Unterminated string starting at: line 1 column 17)"),
    ("unet/config.json", b'{"in_channels": 3, "out',
     "unet/config.json: not valid JSON (Unterminated string starting at: line 1 column 20)"),
    ("tokenizer/tokenizer_config.json", b"\xff\xfe{",
     "tokenizer/tokenizer_config.json: not valid JSON (not UTF-8 text)"),
    ("model_index.json", lambda i: i.pop("vae"),
     'model_index.json has no "vae" entry (the [library, class] pair a sd pipeline needs)'),
    ("model_index.json", lambda i: i.update(vae=[None, None]),
     'model_index.json: "vae" is [null, null], not the [library, class] pair a sd pipeline needs'),
    ("model_index.json", lambda i: i.update(unet="UNet2DConditionModel"),
     'model_index.json: "unet" is "UNet2DConditionModel", not the [library, class] pair a sd '
     "pipeline needs"),
    ("model_index.json", lambda i: i.update(text_encoder=["transformers", "CLIPTextModelV9"]),
     'model_index.json: "text_encoder" is transformers.CLIPTextModelV9, which the transformers '
     "installed here does not have (saved by a newer version?)"),
    ("model_index.json", lambda i: i.update(unet=["diffusers", "FluxTransformer2DModel"]),
     'model_index.json names "unet" as FluxTransformer2DModel, but unet/config.json was saved '
     "by UNet2DConditionModel: the index and that folder are from different models"),
], ids=["index-json", "index-empty", "index-array", "vae-config", "scheduler-config",
        "unet-config", "tokenizer-config", "no-vae", "vae-null", "unet-string", "unknown-class",
        "other-class"])
def test_check_model_names_a_damaged_config_in_one_line(tiny_model, tmp_path, name, edit, problem,
                                                        weights):
    """A damaged model_index.json or component config is one line naming the file, before
    any worker starts: it was json's bare "Expecting ',' delimiter: line 2 column 1", or a
    traceback from the plan's meta model or every worker's load (KeyError 'vae',
    'NoneType' object has no attribute 'startswith', 'list' object has no attribute 'get',
    "unsupported operand type(s) for *: 'NoneType' and 'int'")."""
    from raylora.model.load import check_model
    from raylora.storage import Storage

    path = _broken_copy(tiny_model, tmp_path / "m", {name: edit})
    with pytest.raises(ValueError) as exc:
        check_model(str(path), Storage(), weights=weights)
    assert str(exc.value) == f"model.pretrained: {path}/{problem}"


def test_detect_refuses_an_index_that_is_not_an_object():
    from raylora.model import families

    with pytest.raises(ValueError, match=r"^--model: model_index.json is not a JSON object$"):
        families.detect([1, 2], "--model")


@pytest.mark.parametrize("cut,why", [
    ("half", "truncated: {size:,} of the {full:,} bytes its header describes"),
    ("header", "truncated: 100 bytes, less than its {header:,}-byte header"),
    ("longer", "longer than its header describes: {size:,} bytes, not {full:,}"),
    ("html", "not a safetensors file: its first 8 bytes are no header length"),
], ids=["half", "header", "longer", "html"])
def test_check_model_names_a_truncated_safetensors_file(tiny_model, tmp_path, cut, why):
    """A .safetensors file that is not as long as its header says (an interrupted copy)
    passed the plan and failed every worker's load after Ray started (97 lines of
    traceback, again at each restart); the header alone tells, two small reads."""
    from raylora.model.load import check_model
    from raylora.storage import Storage

    weights = f"{tiny_model}/unet/diffusion_pytorch_model.safetensors"
    data = open(weights, "rb").read()
    header = 8 + int.from_bytes(data[:8], "little")
    broken = {"half": data[:len(data) // 2], "header": data[:100], "longer": data + b"\0" * 8,
              "html": b"<html><body>Service Unavailable</body></html>" * 40}[cut]
    path = _broken_copy(tiny_model, tmp_path / "m", {"unet/diffusion_pytorch_model.safetensors": broken})
    with pytest.raises(FileNotFoundError) as exc:
        check_model(str(path), Storage())
    assert str(exc.value) == (
        f"model.pretrained: {path}: damaged weights in {path}/unet (diffusion_pytorch_model."
        f"safetensors is {why.format(size=len(broken), full=len(data), header=header)}); an "
        "upload or copy that stopped part way? Copy the model again")
    # `raylora plan` reads no weights (it sizes a folder of configs alone)
    assert check_model(str(path), Storage(), weights=False)["family"].name == "sd"


def test_check_model_reads_a_stored_safetensors_header_not_the_file(tiny_model, tmp_path,
                                                                      moto_endpoint, monkeypatch):
    """In object storage the header is read with ranged reads (``Storage.open_input``), so
    a truncated upload is named before any node downloads the model."""
    import boto3

    from raylora.model.load import check_model
    from raylora.storage import Storage

    for k, v in (("AWS_ENDPOINT_URL", moto_endpoint), ("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00032"),
                 ("AWS_SECRET_ACCESS_KEY", "fake/secret"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket="raylora-trunc")
    data = open(f"{tiny_model}/text_encoder/model.safetensors", "rb").read()
    path = _broken_copy(tiny_model, tmp_path / "m", {"text_encoder/model.safetensors": data[:-1000]})
    store = Storage()
    store.upload_dir(str(path), "s3://raylora-trunc/m")
    store.upload_dir(tiny_model, "s3://raylora-trunc/whole")
    with pytest.raises(FileNotFoundError) as exc:
        check_model("s3://raylora-trunc/m", store)
    assert str(exc.value) == (
        "model.pretrained: s3://raylora-trunc/m: damaged weights in s3://raylora-trunc/m/"
        f"text_encoder (model.safetensors is truncated: {len(data) - 1000:,} of the "
        f"{len(data):,} bytes its header describes); an upload that stopped part way?")
    assert check_model("s3://raylora-trunc/whole", store)["family"].name == "sd"
