import io

import numpy as np
import pytest
from PIL import Image

from raylora.data.decode import open_image
from raylora.data.preprocess import Preprocess, StageSpec, transform_image

MAX_PIXELS = 178_956_970  # the data.max_image_pixels default


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _rng():
    return np.random.default_rng(0)


def test_shape_dtype_and_exact_range():
    img = Image.new("RGB", (80, 80), (255, 255, 255))
    img.paste((0, 0, 0), (0, 0, 40, 80))
    out = transform_image(img, 64, center_crop=True, random_flip=False, rng=_rng())
    assert out.shape == (3, 64, 64) and out.dtype == np.float32
    assert out.min() == -1.0 and out.max() == 1.0


def test_shorter_side_resized_then_center_cropped():
    # 200×100: left quarter red, middle half green, right quarter blue.
    img = Image.new("RGB", (200, 100), (0, 255, 0))
    img.paste((255, 0, 0), (0, 0, 50, 100))
    img.paste((0, 0, 255), (150, 0, 200, 100))
    out = transform_image(img, 32, center_crop=True, random_flip=False, rng=_rng())
    # Resized to 64×32, the centre 32×32 is the green middle half (its outermost columns
    # are blended with red/blue by the resampling filter).
    assert out.shape == (3, 32, 32)
    np.testing.assert_allclose(out[1, :, 2:-2], 1.0, atol=1e-6)
    np.testing.assert_allclose(out[0, :, 2:-2], -1.0, atol=1e-6)
    np.testing.assert_allclose(out[2, :, 2:-2], -1.0, atol=1e-6)


def test_random_crop_stays_in_bounds_and_varies():
    img = Image.fromarray(np.arange(100 * 300 * 3, dtype=np.uint32).reshape(100, 300, 3).astype(np.uint8))
    rng = _rng()
    crops = {transform_image(img, 50, False, False, rng).tobytes() for _ in range(10)}
    assert len(crops) > 1


def test_flip_is_a_horizontal_mirror():
    img = Image.new("RGB", (64, 64), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 32, 64))  # left half white
    flipped = [
        transform_image(img, 64, True, True, np.random.default_rng(s)) for s in range(20)
    ]
    lefts = {float(f[0, 0, 0]) for f in flipped}
    assert lefts == {1.0, -1.0}  # some flipped, some not
    for f in flipped:
        np.testing.assert_array_equal(f[:, :, :32], -f[:, :, 32:][:, :, ::-1])


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK"])
def test_non_rgb_modes_become_rgb(mode):
    img = Image.new("RGB", (40, 40), (200, 100, 50)).convert(mode)
    decoded = open_image(_png(img) if mode != "CMYK" else _jpeg(img), MAX_PIXELS)
    out = transform_image(decoded, 32, True, False, _rng())
    assert out.shape == (3, 32, 32)


def _jpeg(img):
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


def test_open_image_accepts_hf_struct_and_rejects_garbage():
    data = _png(Image.new("RGB", (8, 8)))
    assert open_image({"bytes": data, "path": "x.png"}, MAX_PIXELS).size == (8, 8)
    with pytest.raises(ValueError):
        open_image(b"", MAX_PIXELS)
    with pytest.raises(Exception):
        open_image(b"not an image at all", MAX_PIXELS)


def test_preprocess_stage_outputs(tiny_model):
    stage = Preprocess(StageSpec(tiny_model, resolution=64, center_crop=True, random_flip=False))
    imgs = np.array([_png(Image.new("RGB", (96, 64), c)) for c in [(255, 0, 0), (0, 0, 255)]], dtype=object)
    out = stage({"image": imgs, "text": np.array(["a red square", "a blue circle " * 40])})
    # uint8 through the object store; red and blue exactly, scaled only at the VAE.
    px = out["pixel_values"]
    assert px.shape == (2, 3, 64, 64) and px.dtype == np.uint8
    assert (px[0, 0] == 255).all() and (px[0, 1:] == 0).all()
    assert (px[1, 2] == 255).all() and (px[1, :2] == 0).all()
    assert out["input_ids"].shape == (2, 77) and out["input_ids"].dtype == np.int64
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    assert out["input_ids"][0, 0] == tok.bos_token_id
    # Short caption padded with the pad token, long one truncated to end with EOS.
    assert out["input_ids"][0, -1] == tok.pad_token_id
    assert out["input_ids"][1, -1] == tok.eos_token_id


def test_caption_dropout_replaces_captions_with_the_empty_prompt(tiny_model):
    import numpy as np

    from raylora.data.preprocess import Preprocess, StageSpec
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buf, "PNG")
    n = 400
    batch = {"image": np.array([buf.getvalue()] * n, dtype=object),
             "text": np.array(["a red square"] * n, dtype=object)}
    stage = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False, seed=0, caption_dropout=0.25))
    ids = stage(batch)["input_ids"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    empty = tok([""], padding="max_length", max_length=77, return_tensors="np").input_ids[0]
    dropped = (ids == empty).all(axis=1)
    assert 0.18 < dropped.mean() < 0.32
    kept = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False, seed=0))(batch)["input_ids"]
    assert not (kept == empty).all(axis=1).any()
    assert (ids[~dropped] == kept[0]).all()


def test_cached_caption_dropout_swaps_in_the_empty_prompt_row_by_row_and_repeats_on_resume():
    """data.cache=latents with caption dropout: a dropped row's caption columns (all of
    them, SDXL's pooled embedding too) become the empty prompt's, nothing else of the row
    changes; about p of the rows are dropped; batch i of a pass drops the same rows
    whatever came before it (a run resumed at an epoch), another rank other rows."""
    import numpy as np

    from raylora.data.captions import drop_cached_captions

    rng = np.random.default_rng(0)

    def stream(epochs, batches=50, n=4):
        for e in epochs:
            for _ in range(batches):
                yield e, {"prompt_embeds": rng.normal(size=(n, 3, 4)).astype(np.float32),
                          "pooled_prompt_embeds": rng.normal(size=(n, 4)).astype(np.float32),
                          "latent_params": rng.normal(size=(n, 2, 2)).astype(np.float32)}

    empty = {"prompt_embeds": np.full((1, 3, 4), 9.0, np.float32),
             "pooled_prompt_embeds": np.full((1, 4), 7.0, np.float32)}

    def dropped_rows(epochs, p=0.3, rank=0):
        raw = list(stream(epochs))
        out = list(drop_cached_captions(iter(raw), empty, p, seed=7, rank=rank))
        masks = []
        for (e, before), (e2, after) in zip(raw, out):
            assert e == e2 and set(after) == set(before)
            np.testing.assert_array_equal(after["latent_params"], before["latent_params"])
            drop = (after["prompt_embeds"] == 9.0).all(axis=(1, 2))
            assert ((after["pooled_prompt_embeds"] == 7.0).all(axis=1) == drop).all()
            np.testing.assert_array_equal(after["prompt_embeds"][~drop], before["prompt_embeds"][~drop])
            assert not (before["prompt_embeds"] == 9.0).any()  # the input batch is not written to
            masks.append(drop)
        return np.array(masks)

    straight = dropped_rows([0, 1])
    assert 0.22 < straight.mean() < 0.38  # 400 rows at p=0.3
    np.testing.assert_array_equal(dropped_rows([1]), straight[50:])  # resumed at pass 1
    assert (dropped_rows([0, 1], rank=1) != straight).any()
    assert not dropped_rows([0], p=0.0).any()
    # A language-model caption (cut after its batch's longest) longer than the batch's:
    # the batch's captions are zero-padded to it (PADDED_CAPTIONS)
    longer = {"prompt_embeds": np.full((1, 5, 4), 9.0, np.float32)}
    out = [b for _, b in drop_cached_captions(stream([0]), longer, 0.5, seed=7, rank=0)]
    padded = [b for b in out if b["prompt_embeds"].shape[1] == 5]
    assert {b["prompt_embeds"].shape for b in out} == {(4, 3, 4), (4, 5, 4)}  # those with a drop
    drop = np.concatenate([(b["prompt_embeds"] == 9.0).all(axis=(1, 2)) for b in padded])
    assert drop.reshape(-1, 4).any(axis=1).all()
    tails = np.concatenate([b["prompt_embeds"][:, 3:] for b in padded])
    assert 0 < drop.sum() < len(drop) and not tails[~drop].any()
    wrong = {"prompt_embeds": np.zeros((1, 3, 5), np.float32)}
    with pytest.raises(ValueError, match="cached prompt_embeds is float32 \\(3, 4\\) a row, "
                                         "the empty prompt's float32 \\(3, 5\\)"):
        list(drop_cached_captions(stream([0]), wrong, 0.9, seed=7, rank=0))


def test_cached_captions_are_cut_after_the_longest_caption_of_their_batch():
    """Cached language-model captions carry the padding of the rows they were encoded or
    stacked with; a training batch (numpy) or evaluation chunk (tensors) is cut back to its
    own longest caption, the mask's last marked position, and nothing else changes."""
    import numpy as np
    import torch

    from raylora.data.captions import cut_captions, stack_rows
    from raylora.model.families.base import Cond

    rng = np.random.default_rng(1)

    def row(length, width):  # a caption of ``length`` tokens, zero-padded to ``width``
        emb = np.zeros((width, 4), np.float32)
        emb[:length] = rng.normal(size=(length, 4))
        return emb, (np.arange(width) < length).astype(np.int64)

    rows = [row(3, 9), row(5, 9), row(2, 6)]  # two from a part padded to 9, one to 6
    batch = {"prompt_embeds": stack_rows("prompt_embeds", [e for e, _ in rows]),
             "prompt_embeds_mask": stack_rows("prompt_embeds_mask", [m for _, m in rows]),
             "latent_params": rng.normal(size=(3, 2, 2)).astype(np.float32)}
    assert batch["prompt_embeds"].shape == (3, 9, 4)
    cut = cut_captions(batch)
    assert cut["prompt_embeds"].shape == (3, 5, 4) and cut["prompt_embeds_mask"].shape == (3, 5)
    assert cut["prompt_embeds"].flags.c_contiguous
    np.testing.assert_array_equal(cut["prompt_embeds"], batch["prompt_embeds"][:, :5])
    np.testing.assert_array_equal(cut["prompt_embeds_mask"].sum(1), [3, 5, 2])
    assert cut["latent_params"] is batch["latent_params"]
    assert cut_captions(cut) is cut  # the longest fills it: nothing to cut
    short = cut_captions({k: v[[0, 2]] for k, v in batch.items()})
    assert short["prompt_embeds"].shape == (2, 3, 4)
    # One length always (no mask, or SDXL's columns): nothing is cut
    fixed = {"prompt_embeds": np.zeros((2, 77, 4), np.float32)}
    assert cut_captions(fixed) is fixed
    # An evaluation chunk's tensors, selected out of the held-out rows' padded conditioning
    text = Cond({k: torch.from_numpy(v) for k, v in batch.items() if k != "latent_params"})
    chunk = text.select(torch.tensor([2, 0])).cut_captions()
    assert isinstance(chunk, Cond) and chunk["prompt_embeds"].shape == (2, 3, 4)
    torch.testing.assert_close(chunk["prompt_embeds"], text["prompt_embeds"][[2, 0], :3])
    # Conditioning of chunks encoded apart joins zero-padded (the held-out rows' Cond.cat)
    joined = Cond.cat([chunk, text.select(torch.tensor([1]))])
    assert joined["prompt_embeds"].shape == (3, 9, 4) and not joined["prompt_embeds"][:2, 3:].any()
    np.testing.assert_array_equal(joined["prompt_embeds_mask"].sum(1).numpy(), [2, 3, 5])


def test_uint8_pixels_reach_the_vae_as_the_float_stage_made_them(tiny_model):
    """The stage ships uint8; the VAE sees exactly what float32 scaling in the stage gave."""
    import torch
    from diffusers import AutoencoderKL

    from raylora.data.preprocess import to_unit_range
    from raylora.model.families.sd import SD
    from raylora.train.encode import vae_posterior

    px = np.random.default_rng(3).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8)
    old = px.astype(np.float32) / 127.5 - 1.0  # what the stage shipped before
    np.testing.assert_array_equal(to_unit_range(px), old)
    assert to_unit_range(px).min() >= -1.0 and to_unit_range(px).max() <= 1.0
    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae").eval()
    a = vae_posterior(SD, vae, torch.from_numpy(px))
    b = vae_posterior(SD, vae, torch.from_numpy(old))
    assert a.shape == (2, 2 * vae.config.latent_channels, 64 // 2 ** (len(vae.config.block_out_channels) - 1),
                       64 // 2 ** (len(vae.config.block_out_channels) - 1))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_preprocess_batch_builds_one_stage_per_process_and_config(tiny_model):
    """The task form keeps its stage between calls (Ray reuses task processes across
    epochs), one per set of arguments, at most _MAX_STAGES."""
    from raylora.data import preprocess as pp

    pp._STAGES.clear()
    batch = {"image": np.array([_png(Image.new("RGB", (64, 64), (9, 9, 9)))], dtype=object),
             "text": np.array(["x"], dtype=object)}
    kw = dict(tokenizer_path=tiny_model, resolution=32, center_crop=True, random_flip=False)
    a = pp.preprocess_batch(batch, **kw)
    stage = next(iter(pp._STAGES.values()))
    b = pp.preprocess_batch(batch, **kw)
    assert len(pp._STAGES) == 1 and next(iter(pp._STAGES.values())) is stage
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])
    assert a["pixel_values"].shape == (1, 3, 32, 32) and (a["pixel_values"] == 9).all()
    for res in (8, 16, 24, 40, 48):
        assert pp.preprocess_batch(batch, **{**kw, "resolution": res})["pixel_values"].shape[-1] == res
    assert len(pp._STAGES) == pp._MAX_STAGES
    assert stage not in pp._STAGES.values()  # the oldest went first
    pp._STAGES.clear()


CAPTIONS = ["", "a", "a photo of a cat", "A Photo OF  a   DOG!!", "café 東京 🚀 naïve",
            "word " * 200, "  leading and trailing  ", "line\nbreak\ttab"]


@pytest.mark.parametrize("pad", [None, "!"])  # "!": SDXL's second tokenizer pads with it
def test_caption_tokenizer_gives_transformers_ids(tiny_model, pad):
    """What preprocessing tasks tokenize with (``tokenizers`` only, from the driver's spec)
    gives the ids of ``tokenize`` with the model's transformers tokenizer."""
    import pickle

    from transformers import AutoTokenizer

    from raylora.data.preprocess import tokenize
    from raylora.data.tokenize import CaptionTokenizer, spec_from_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer", **({"pad_token": pad} if pad else {}))
    spec = pickle.loads(pickle.dumps(spec_from_tokenizer(tok)))  # as a task receives it
    got = CaptionTokenizer(spec)(CAPTIONS)
    want = tokenize(tok, CAPTIONS)
    assert got.dtype == np.int64 and got.shape == (len(CAPTIONS), 77)
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == tok.bos_token_id and got[0, 1] == tok.eos_token_id
    assert (got[0, 2:] == tok.pad_token_id).all() and got[5, -1] == tok.eos_token_id
    if pad:
        assert tok.pad_token_id != AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer").pad_token_id
    assert "TokenizerSpec(" in repr(spec) and len(repr(spec)) < 120  # a digest, not the JSON


def test_clean_prompt_is_wan_pipelines_prompt_clean():
    """A spec with ``clean`` (Wan's text input) tokenizes each caption as WanPipeline's
    ``prompt_clean`` leaves it; diffusers' own function is the reference."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    from raylora.data.tokenize import clean_prompt

    messy = ["  a  red\ncircle\t", "fish &amp;amp; chips", "caf&eacute; &lt;b&gt;", "", " ",
             "plain text"]
    assert [clean_prompt(c) for c in messy] == [prompt_clean(c) for c in messy]
    assert clean_prompt(messy[0]) == "a red circle" and clean_prompt(messy[1]) == "fish & chips"


def test_preprocess_with_driver_specs_equals_loading_the_tokenizer(tiny_model):
    from raylora.data.tokenize import load_specs
    from raylora.storage import Storage

    specs = load_specs(tiny_model, "sd", Storage())
    imgs = np.array([_png(Image.new("RGB", (96, 64), (i * 40, 10, 200))) for i in range(4)], dtype=object)
    batch = {"image": imgs, "text": np.array(CAPTIONS[:4], dtype=object)}
    a = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))(batch)
    b = Preprocess(StageSpec("/nonexistent", 64, center_crop=True, random_flip=False, tokenizer_specs=specs))(batch)
    assert sorted(a) == sorted(b) == ["crop_top_left", "input_ids", "original_size", "pixel_values",
                                      "target_size"]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    # A preprocess process built from the driver's specs imports neither torch nor the
    # model families nor transformers (each new Ray Data process paid seconds for them).
    import pickle
    import subprocess
    import sys

    probe = (
        "import pickle, sys, numpy as np\n"
        "from raylora.data.preprocess import Preprocess\n"
        "spec, batch = pickle.loads(sys.stdin.buffer.read())\n"
        "out = Preprocess(spec)(batch)\n"
        "print(sorted(out['input_ids'].shape), sorted(m for m in ('torch', 'transformers', "
        "'diffusers', 'raylora.model') if m in sys.modules))\n"
    )
    spec = StageSpec("/nonexistent", 64, center_crop=True, random_flip=False, tokenizer_specs=specs)
    got = subprocess.run([sys.executable, "-c", probe], input=pickle.dumps((spec, batch)),
                         capture_output=True, check=True)
    assert got.stdout.decode().strip() == f"{sorted(a['input_ids'].shape)} []"


def test_the_cache_stage_encodes_captions_as_read_and_blank_ones_as_the_empty_prompt(tiny_model):
    """The latent cache encodes each caption once; dropout is drawn per step at training
    (drop_cached_captions). Drawn in the cache stage too, the dropped rows would never see
    their caption. A blank caption kept for dropout becomes the family's empty prompt (a
    stand-in string here: CLIP tokenizes Qwen-Image's " " as "")."""
    from raylora.config import DataSection
    from raylora.data.preprocess import stage_kwargs
    from raylora.storage import Storage

    data = DataSection(uri="/data", resolution=32, center_crop=True, caption_dropout=0.5,
                       cache="latents")
    texts = [f"a red square number {i}" for i in range(40)] + ["", "  ", None]
    batch = {"image": np.array([_png(Image.new("RGB", (40, 40)))] * len(texts), dtype=object),
             "text": np.array(texts, dtype=object)}
    kw = stage_kwargs("cache", data, model_path=tiny_model, family="sd", storage=Storage())
    stage = Preprocess(StageSpec(**{**kw, "empty_caption": "nothing here"}))
    ids = stage(batch)["input_ids"]
    assert ids.shape[0] == 43  # blank captions kept: dropout trains on the empty prompt
    assert (ids[:40] == stage.text_columns(texts[:40])["input_ids"]).all()
    assert (ids[40:] == stage.text_columns(["nothing here"])["input_ids"][0]).all()
    # The train stage of the same section draws dropout: about half the rows.
    train = Preprocess(StageSpec(**stage_kwargs("train", data, model_path=tiny_model, family="sd",
                                                storage=Storage())))
    empty = train.text_columns([""])["input_ids"][0]
    assert 10 <= (train(batch)["input_ids"][:40] == empty).all(axis=1).sum() <= 30


def test_the_four_preprocess_stages_differ_only_where_their_images_are_used_differently(tiny_model):
    """raylora.data.preprocess.stage_kwargs: one data section, four stages. Every stage
    decodes and tokenizes alike; crop, flip, dropout, buckets and masks follow the use."""
    from raylora.config import DataSection
    from raylora.data.preprocess import stage_kwargs
    from raylora.storage import Storage

    data = DataSection(uri="/data", resolution=32, center_crop=False, random_flip=True,
                       caption_dropout=0.25, masked_loss=True, min_size=16, small_images="upscale")
    store = Storage("http://127.0.0.1:9", "eu-west-1")
    stages = {p: StageSpec(**stage_kwargs(p, data, model_path=tiny_model, family="sd", storage=store,
                                          max_sequence_length=24, seed=7, bad_records="bad"))
              for p in ("train", "cache", "heldout", "class")}
    for s in stages.values():
        assert (s.tokenizer_path, s.resolution, s.family, s.max_sequence_length) == (tiny_model, 32, "sd", 24)
        assert (s.endpoint_url, s.region, s.min_size, s.small_images) == ("http://127.0.0.1:9", "eu-west-1",
                                                                          16, "upscale")
    crop_flip = {p: (s.center_crop, s.random_flip) for p, s in stages.items()}
    assert crop_flip == {"train": (False, True), "cache": (True, False), "heldout": (True, False),
                         "class": (False, True)}
    assert {p: s.caption_dropout for p, s in stages.items()} == {"train": 0.25, "cache": 0, "heldout": 0,
                                                                 "class": 0}
    assert {p for p, s in stages.items() if s.masks} == {"train", "cache", "class"}
    assert {p for p, s in stages.items() if s.caption_policies} == {"train", "cache"}
    assert stages["train"].caption_policies[0].dropout == 0.25
    assert stages["train"].bad_records == "bad" and stages["class"].bad_records is None
    # Each builds a working stage: the class stage's batch carries loss masks.
    out = Preprocess(stages["class"])({"image": np.array([_png(Image.new("RGB", (40, 40)))], dtype=object),
                                       "text": np.array(["a photo"], dtype=object)})
    assert out["pixel_values"].shape == (1, 3, 32, 32) and out["loss_mask"].shape == (1, 1, 32, 32)
    with pytest.raises(ValueError, match="preprocess stage 'eval'"):
        stage_kwargs("eval", data, model_path=tiny_model, family="sd", storage=store)


def _keyed_pngs() -> dict[str, tuple[bytes, np.ndarray]]:
    """PNGs whose transparency is a tRNS colour key (what oxipng and pngcrush write for
    all-or-nothing alpha), each with the 4×4 alpha it means: the left half transparent."""
    alpha = np.zeros((4, 4), np.uint8)
    alpha[:, 2:] = 255
    rgb = np.zeros((4, 4, 3), np.uint8)
    rgb[:, :2] = (255, 0, 255)  # the key: magenta
    rgb[:, 2:] = (0, 0, 255)
    grey16 = np.where(alpha == 0, 1000, 60000).astype(np.uint16)
    palette = Image.fromarray(rgb).quantize(2)
    key = palette.getpixel((0, 0))

    def png(img, **kw):
        buf = io.BytesIO()
        img.save(buf, format="PNG", **kw)
        return buf.getvalue()

    return {
        "RGB": (png(Image.fromarray(rgb), transparency=(255, 0, 255)), alpha),
        "L": (png(Image.fromarray(np.where(alpha == 0, 7, 200).astype(np.uint8)), transparency=7), alpha),
        "1": (png(Image.fromarray(alpha).convert("1"), transparency=0), alpha),
        "I;16": (png(Image.fromarray(grey16), transparency=1000), alpha),
        "P": (png(palette, transparency=key), alpha),
    }


def test_colour_key_transparency_is_composited_and_masks_the_loss():
    """A PNG's tRNS colour key (RGB, L, 1, I;16; P's palette key as before) is
    transparency: its pixels train as data.background_color, not as the key colour
    (magenta), and give data.masked_loss its mask, as the same picture with an alpha
    channel does. The 16-bit image's opaque pixels are scaled (60000 → 233), not clipped."""
    from raylora.data.decode import open_masked_row, to_rgb

    background = (0, 128, 0)
    opaque = {"RGB": (0, 0, 255), "L": (200, 200, 200), "1": (255, 255, 255),
              "I;16": (233, 233, 233), "P": (0, 0, 255)}
    for mode, (data, alpha) in _keyed_pngs().items():
        # the stage's path (Preprocess._decode): the mask read before to_rgb
        img, _, mask, _ = open_masked_row(data, "a", None, masks=True, max_pixels=MAX_PIXELS,
                                          min_size=0, small_images="skip", keep_empty_captions=False)
        assert img.mode == mode and "transparency" in img.info, mode
        assert mask is not None and np.asarray(mask).tolist() == alpha.tolist(), mode
        out = np.asarray(to_rgb(img, background))
        assert out[:, :2].reshape(-1, 3).tolist() == [list(background)] * 8, mode
        assert out[:, 2:].reshape(-1, 3).tolist() == [list(opaque[mode])] * 8, mode


def test_a_colour_keyed_control_image_resized_to_its_target_has_no_key_colour_fringe():
    """A control image of another size than its target is resized before to_rgb: its key
    colour becomes alpha first, so resampling leaves no half-magenta pixel at the edge
    of the transparent area (only the key colour itself matched the key)."""
    from raylora.data.decode import open_masked_row, to_rgb

    data, _ = _keyed_pngs()["RGB"]
    target = _png(Image.new("RGB", (8, 8)))
    _, _, _, (control,) = open_masked_row(target, "a", None, masks=False, max_pixels=MAX_PIXELS,
                                          min_size=0, small_images="skip",
                                          keep_empty_captions=False, controls=[data])
    out = np.asarray(to_rgb(control, (0, 128, 0)))
    assert control.size == (8, 8)
    assert out[..., 0].max() == 0  # no red: neither the key (magenta) nor a blend of it
    assert out[:, 0].tolist() == [[0, 128, 0]] * 8 and out[:, -1].tolist() == [[0, 0, 255]] * 8


def _control_inputs(tmp_path):
    """An RGBA cut-out (a red square, the rest transparent black) and a 16-bit greyscale
    input, as files: (paths, their bytes)."""
    cut = np.zeros((8, 8, 4), np.uint8)
    cut[2:6, 2:6] = (200, 30, 30, 255)
    grey = np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000
    paths = [tmp_path / "cut.png", tmp_path / "grey16.png"]
    Image.fromarray(cut, "RGBA").save(paths[0])
    Image.fromarray(grey).save(paths[1])
    return [str(p) for p in paths], [p.read_bytes() for p in paths]


def test_preview_control_images_are_read_as_training_reads_control_images(tmp_path):
    """validation.control_images go through training's decode: a cut-out over
    data.background_color (white by default), not black; 16-bit scaled, not clipped
    (63000 → 245, not 255); data.max_image_pixels checked, the file named."""
    from raylora.config import DataSection
    from raylora.data.decode import open_masked_row, to_rgb
    from raylora.storage import Storage
    from raylora.train.preview import read_control_images

    paths, blobs = _control_inputs(tmp_path)
    target = _png(Image.new("RGB", (8, 8)))
    for background in (None, (0, 128, 0)):
        uris = [paths[0], [paths[1], paths[0]]]
        got = read_control_images(uris, Storage()) if background is None else \
            read_control_images(uris, Storage(), DataSection(background_color=background))
        for img, blob in zip([got[0], *got[1]], [blobs[0], blobs[1], blobs[0]]):
            _, _, _, (control,) = open_masked_row(target, "a", None, masks=False,
                                                  max_pixels=MAX_PIXELS, min_size=0,
                                                  small_images="skip",
                                                  keep_empty_captions=False, controls=[blob])
            trained = to_rgb(control, background or (255, 255, 255))  # Preprocess._decode
            assert img.mode == "RGB"
            assert np.asarray(img).tolist() == np.asarray(trained).tolist()
        assert got[0].getpixel((0, 0)) == (background or (255, 255, 255))
        assert got[0].getpixel((3, 3)) == (200, 30, 30)
        assert got[1][0].getpixel((7, 7)) == (245, 245, 245)
    with pytest.raises(ValueError, match=r"^validation\.control_images: .*cut\.png: too_many_pixels: "
                                         r"8x8 > data\.max_image_pixels=63$"):
        read_control_images([paths[0]], Storage(), DataSection(max_image_pixels=63))


def test_sample_image_is_composited_over_the_runs_background_color(tmp_path, monkeypatch):
    """``raylora sample --image``: the input goes to the pipeline as the run that wrote
    the adapter made its control images RGB (its raylora.json data.background_color),
    over white for an adapter without one; 16-bit scaled."""
    import json

    from raylora import sample as sample_mod

    paths, _ = _control_inputs(tmp_path)
    seen = []

    class Family:
        def guidance_kwargs(self, scale):
            return {}

        def prompt_kwargs(self, system_prompt):
            return {}

        def length_kwargs(self, length):
            return {}

        def reference_kwargs(self, control, h, w):
            seen.append(control)
            return {}

        def images(self, pipe, **kw):
            return [Image.new("RGB", (8, 8))]

    class Pipe:
        def to(self, device):
            return self

        def set_progress_bar_config(self, **kw):
            pass

    monkeypatch.setattr(sample_mod, "load_pipeline", lambda *a, **k: (Pipe(), Family()))
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "raylora.json").write_text(json.dumps({"config": {"data": {"background_color": [0, 128, 0]}}}))
    plain = tmp_path / "plain"
    plain.mkdir()
    for adapter in (trained, plain):
        sample_mod.sample("m", str(adapter), "x", str(tmp_path / "o.png"), steps=1, image=paths)
    assert [[c.mode for c in cs] for cs in seen] == [["RGB", "RGB"]] * 2
    assert [cs[0].getpixel((0, 0)) for cs in seen] == [(0, 128, 0), (255, 255, 255)]
    assert [cs[0].getpixel((3, 3)) for cs in seen] == [(200, 30, 30)] * 2
    assert [cs[1].getpixel((7, 7)) for cs in seen] == [(245, 245, 245)] * 2
