"""Image-edit LoRAs: ``data.control_images`` (a control image per sample, the edit's input;
several with ``data.control_inputs``) on the families whose denoiser takes one: Flux.1
Kontext (``fluxkontext``), Flux.2 [klein] and [dev], Qwen-Image-Edit (``qwenimageedit``,
whose text encoder reads the input too; also as 2511 is laid out). The denoiser call with
one input image and with two against each stock pipeline's; where control images come
from in each format and in built shards; that they get their target's crop, flip and
bucket; bad and missing ones counted; the keys refused where they cannot apply; the step's
reference tokens, the same from the latent cache; and a Kontext run and a two-input
Qwen-Image-Edit run on a local Ray from a WebDataset of pairs to an adapter the stock
pipeline edits with (previews and held-out loss on pairs, ``raylora sample --image``).

Every pair here is an image and its negative (control = 255 − image), so whether a control
image was cut where its target was is a check of equality. A sample of two inputs
(data.control_inputs: 2) has a second one, the image with its channels reversed (RGB → BGR),
which no crop, flip or resize changes but where it was cut."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raylora.config import control_key, validate
from raylora.data.preprocess import Preprocess, StageSpec
from raylora.model import families
from raylora.model.tiny import FAMILIES
from raylora.storage import Storage
from test_bad_data import png

FAMILY = "fluxkontext"


def pattern(seed: int, w: int = 40, h: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def pair(seed: int, w: int = 40, h: int = 32) -> tuple[bytes, bytes]:
    """(image, its negative) as PNG bytes."""
    a = pattern(seed, w, h)
    return png(Image.fromarray(a)), png(Image.fromarray(255 - a))


def swapped(seed: int, w: int = 40, h: int = 32) -> bytes:
    """A sample's second input: its image with the channels reversed, as PNG bytes."""
    return png(Image.fromarray(np.ascontiguousarray(pattern(seed, w, h)[..., ::-1])))


def write_pairs(root, fmt: str, n: int = 3, w: int = 40, h: int = 32, inputs: int = 1,
                columns: tuple[str, str] = ("control_image", "control_image_2")) -> str:
    """``n`` pairs in ``fmt``; returns the data URI. Sidecars: KEY.control.png (the folder
    formats also one KEY.control.JPG, found by its own extension's absence). ``inputs``
    2: each sample's second input too (``swapped``), KEY.control_2.png (the folder
    formats' k1 a KEY.control_2.jpg), the parquet column ``columns[1]``."""
    root.mkdir(parents=True, exist_ok=True)
    pairs = [pair(i, w, h) for i in range(n)]
    seconds = [swapped(i, w, h) for i in range(n)] if inputs == 2 else []
    if fmt == "parquet":
        pq.write_table(pa.table({"image": [p[0] for p in pairs], "text": [f"edit {i}" for i in range(n)],
                                 columns[0]: [p[1] for p in pairs],
                                 **({columns[1]: seconds} if seconds else {})}), str(root / "p.parquet"))
        return str(root / "p.parquet")
    if fmt == "webdataset":
        with tarfile.open(root / "000.tar", "w") as tar:
            for i, (img, ctl) in enumerate(pairs):
                for name, data in ((f"k{i}.png", img), (f"k{i}.control.png", ctl),
                                   *([(f"k{i}.control_2.png", seconds[i])] if seconds else []),
                                   (f"k{i}.txt", f"edit {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return str(root)
    lines = []
    for i, (img, ctl) in enumerate(pairs):
        (root / f"k{i}.png").write_bytes(img)
        if i == 0:  # a JPEG sidecar of a PNG image: looked for after its own extension,
            # upper-case as a camera or Windows names it (it was never found)
            Image.open(io.BytesIO(ctl)).save(root / f"k{i}.control.JPG", format="JPEG", quality=100,
                                             subsampling=0)
        else:
            (root / f"k{i}.control.png").write_bytes(ctl)
        if seconds and i == 1:  # input 2's JPEG sidecar
            Image.open(io.BytesIO(seconds[i])).save(root / f"k{i}.control_2.jpg", quality=100,
                                                    subsampling=0)
        elif seconds:
            (root / f"k{i}.control_2.png").write_bytes(seconds[i])
        if fmt == "captionfolder":
            (root / f"k{i}.txt").write_text(f"edit {i}")
        lines.append(json.dumps({"file_name": f"k{i}.png", "text": f"edit {i}"}))
    if fmt == "imagefolder":
        (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


def section(uri: str, **kw):
    return validate({"model": {"pretrained": "m"}, "output": {"uri": "o"},
                     "data": {"uri": uri, "control_images": True, **kw}}).data


def stage(model: str, resolution: int = 32, **kw) -> tuple[Preprocess, list]:
    kw = {"center_crop": True, "random_flip": False, "controls": True, **kw}
    s = Preprocess(StageSpec(model, resolution, family=FAMILY, max_sequence_length=32, **kw))
    sent = []
    s.reporter.send = lambda ok, bad, examples, **_: sent.append((ok, dict(bad)))
    return s, sent


def run_stage(s: Preprocess, rows: list[dict]) -> dict[str, np.ndarray]:
    """The stage on ``rows``: their image, text and control columns (``control_2``, ...
    where any row has one)."""
    more = sorted({k for r in rows for k in r if k.startswith("control_")})
    return s({k: np.array([r.get(k) for r in rows], dtype=object)
              for k in ("image", "text", "control", *more)})


def decoded(value: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(value)).convert("RGB"))


# ---------------------------------------------------------------- the denoiser call


EDIT_FAMILIES = [f for f in FAMILIES if families.get(f).reference_image]


class _Probed(Exception):
    pass


def test_the_families_that_take_an_input_image():
    assert sorted(EDIT_FAMILIES) == ["flux2", "flux2klein", "fluxkontext", "qwenimageedit"]
    # several a sample (data.control_inputs) where the pipeline takes a list of images
    assert {f: families.get(f).max_references for f in EDIT_FAMILIES} == \
        {"flux2": 4, "flux2klein": 4, "fluxkontext": 1, "qwenimageedit": 4}


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_a_preview_input_of_another_aspect_is_resized_to_the_output_as_training_pairs_it(family):
    """Previews and `raylora sample --image --size` give the pipeline each input at the
    output's size, as training pairs an input with its target (Qwen-Image-Edit kept a 2:1
    input at 2:1 beside a square output); without a size, the pipeline's own choice."""
    wide = Image.new("RGB", (128, 64))
    fam = families.get(family)
    assert fam.reference_kwargs(wide, 32, 48)["image"].size == (48, 32)
    if fam.max_references > 1:
        assert [x.size for x in fam.reference_kwargs([wide, wide], 32, 48)["image"]] == [(48, 32)] * 2
    assert fam.reference_kwargs(wide, None, None)["image"].size == (128, 64)


def test_flux2_trains_an_input_above_one_megapixel_as_its_pipeline_shrinks_it():
    """Flux2Pipeline and Flux2KleinPipeline shrink an input image above 1 MP to 1 MP (its
    aspect kept, cut to the latent grid): a 2048x1024 control trains as the 1440x720 input
    they encode, not at the target's 2 MP; 1 MP and under, and other families, as given."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from raylora.data.preprocess import to_unit_range

    class Vae:  # the latent grid's factor, as the family reads it from a VAE config
        config = {"block_out_channels": [1, 1, 1, 1]}

    y, x = np.mgrid[0:1024, 0:2048]
    img = np.stack([x * 255 // 2048, y * 255 // 1024, (x + y) * 255 // 3072], -1).astype(np.uint8)
    pixels = torch.from_numpy(img).permute(2, 0, 1)[None]
    proc = Flux2ImageProcessor(vae_scale_factor=16)
    shrunk = proc._resize_to_target_area(Image.fromarray(img), 1024 * 1024)
    theirs = proc.preprocess(shrunk, height=shrunk.size[1] // 16 * 16, width=shrunk.size[0] // 16 * 16,
                             resize_mode="crop")
    for family in ("flux2", "flux2klein"):
        ours = families.get(family).reference_pixels(pixels, Vae())
        assert ours.shape == theirs.shape == (1, 3, 720, 1440) and ours.dtype == torch.uint8
        assert (to_unit_range(ours) - theirs).abs().mean() < 1e-3  # bicubic vs their Lanczos
    small = pixels[..., :512, :1024]
    assert families.get("flux2").reference_pixels(small, Vae()) is small
    assert families.get("fluxkontext").reference_pixels(pixels, Vae()) is pixels


# (family, input images a sample, variant): every edit family with one, and with two
# where its pipeline takes a list; Qwen-Image-Edit also as 2511 is laid out
INPUT_CASES = [(f, 1, None) for f in EDIT_FAMILIES] + \
    [(f, 2, None) for f in EDIT_FAMILIES if families.get(f).max_references > 1] + \
    [("qwenimageedit", n, "2511") for n in (1, 2)]


def edit_model(tiny, family: str, variant: str | None = None) -> str:
    """The tiny model of ``family``, or of its ``variant``: "2511", Qwen-Image-Edit-2511's
    transformer layout (``zero_cond_t``: the inputs' tokens modulated at timestep 0, the
    noisy ones at the step's), a config switch over the same weights."""
    import shutil

    model = tiny(family)
    if variant is None:
        return model
    copy = f"{model}-{variant}"
    if not os.path.isdir(copy):
        shutil.copytree(model, copy)
        path = os.path.join(copy, "transformer", "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({**config, "zero_cond_t": True}, f)
    return copy


@pytest.mark.parametrize("family,inputs,variant", INPUT_CASES,
                         ids=[f"{f}{'-' + v if v else ''}-{n}" for f, n, v in INPUT_CASES])
def test_denoise_with_input_images_is_the_stock_pipeline_call(tiny, family, inputs, variant):
    """For the latents, step and prompt of each of two sampling steps of the family's
    stock pipeline editing one input image, or two (``image=[a, b]``, data.control_inputs:
    2), the family's ``denoise`` (given the reference latents raylora's data path makes of
    them) hands the denoiser the pipeline's sequence (noisy tokens, then each input's in
    order), position ids and timestep, and returns the pipeline's prediction, read from
    the noisy tokens only. Where each latent value lands is read by feeding ``denoise``
    numbered latents (as test_families does); the image is taller than wide, so rows and
    columns swapped anywhere fail it, and the two inputs differ, so swapping them does.
    Qwen-Image-Edit-2511's layout (``zero_cond_t``) reads which tokens are inputs from
    ``img_shapes``: the same call, its output included."""
    from raylora.train.encode import batch_reference
    from stock import PIPELINES, stock_pipeline
    from test_families import _raylora_batch

    H, W = 96, 64  # Flux.2's image processor takes no input under 64 px a side
    model, fam = edit_model(tiny, family, variant), families.get(family)
    if variant == "2511":
        assert json.load(open(os.path.join(model, "transformer", "config.json")))["zero_cond_t"]
    comps, batch = _raylora_batch(model, family, ["make it red"], size=(H, W), references=inputs)
    pipe = stock_pipeline(family, model)
    pipe.set_progress_bar_config(disable=True)
    net = pipe.transformer
    seen: list[dict] = []

    def before(m, a, kw):
        seen.append(dict(kw))

    hooks = [net.register_forward_pre_hook(before, with_kwargs=True),
             net.register_forward_hook(lambda m, a, kw, out: seen[-1].update(out=out[0]),
                                       with_kwargs=True)]
    stepped: list[torch.Tensor] = []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda out, *a, **k: (stepped.append(out), step(out, *a, **k))[1]
    sources = [Image.fromarray(pattern(7 + k, W, H)) for k in range(inputs)]
    with torch.no_grad():
        # through the family's images: how raylora samples (Kontext's max_area and
        # Qwen-Image-Edit's VAE input at the output's size)
        extra = {k: v for k, v in PIPELINES[family][1].items() if k not in fam.size_kwargs(H, W)}
        given = sources[0] if inputs == 1 else sources
        fam.images(pipe, prompt="make it red", num_inference_steps=2, height=H, width=W,
                   output_type="np", generator=torch.Generator().manual_seed(0),
                   **{**extra, **fam.guidance_kwargs(1.0), **fam.reference_kwargs(given, H, W)})
        theirs = list(seen)
        assert len(theirs) == 2, "one unguided denoiser pass per step expected"
        # the raw batch's input pixels, as a worker gets them (Qwen-Image-Edit's text
        # encoder reads them too)
        raw = {control_key("control_values", k): torch.from_numpy(np.array(s)).permute(2, 0, 1)[None]
               for k, s in enumerate(sources)}
        cond = fam.encode_text(comps.text_encoders, {**batch, **raw})
        shift, scale = fam.latent_stats(pipe.vae.config)
        refs = [batch_reference(fam, pipe.vae, raw, shift, scale, index=k) for k in range(inputs)]
        shape, n = refs[0].shape, refs[0].numel()
        m = (1 + inputs) * n

        # Where each value of the noisy latents (0..n-1) and of input k's (the k+1-th n) lands.
        def probe(m_, a, kw):
            seen.append(dict(kw))
            raise _Probed

        h = net.register_forward_pre_hook(probe, with_kwargs=True, prepend=True)
        numbered = torch.arange(m, dtype=torch.float32)
        with pytest.raises(_Probed):
            fam.denoise(net, numbered[:n].view(shape), torch.ones(1),
                        {**cond, **{control_key("reference_latents", k): numbered[(k + 1) * n:(k + 2) * n].view(shape)
                                    for k in range(inputs)}}, guidance=1.0)
        h.remove()
        where = seen.pop()["hidden_states"].flatten().long()
        assert sorted(where.tolist()) == list(range(m))
        assert where[:n].lt(n).all()  # the noisy tokens first, then the inputs'
        # The pipeline's encoding of each image is raylora's of its uint8 pixels, in order.
        x = torch.empty(m)
        x[where] = theirs[0]["hidden_states"].flatten().float()
        for k, ref in enumerate(refs):
            torch.testing.assert_close(x[(k + 1) * n:(k + 2) * n].view(shape), ref, rtol=1e-5, atol=1e-5)
            cond[control_key("reference_latents", k)] = ref
        for i, call in enumerate(theirs):
            x = torch.empty(m)
            x[where] = call["hidden_states"].flatten().float()
            del seen[:]
            pred = fam.denoise(net, x[:n].view(shape), pipe.scheduler.sigmas[i].reshape(1),
                               cond, guidance=1.0)
            ours = seen[0]
            torch.testing.assert_close(ours["hidden_states"], call["hidden_states"], rtol=1e-5, atol=1e-5)
            if "img_ids" in call:  # Flux.1 Kontext, Flux.2: position ids per token
                ids, want = ours["img_ids"].reshape(-1, ours["img_ids"].shape[-1]), \
                    call["img_ids"].reshape(-1, call["img_ids"].shape[-1])
                assert torch.equal(ids.to(want.dtype), want)
                k = ids.shape[0] // (1 + inputs)  # tokens per image; each input's first axis its own
                firsts = [set(ids[j * k:(j + 1) * k, 0].tolist()) for j in range(1 + inputs)]
                assert firsts[0] == {0} and all(len(f) == 1 for f in firsts)
                assert len(set().union(*firsts)) == 1 + inputs
            else:  # Qwen-Image-Edit: a rope grid per image, and the caption read with the images
                assert ours["img_shapes"] == call["img_shapes"] == [[(1, H // 4, W // 4)] * (1 + inputs)]
                torch.testing.assert_close(ours["encoder_hidden_states"], call["encoder_hidden_states"],
                                           rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours["timestep"], call["timestep"])
            torch.testing.assert_close(ours["out"], call["out"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(pred.flatten()[where[:n]], stepped[i].flatten(),
                                       rtol=1e-4, atol=1e-5)
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("inputs, processor", [(1, "stock"), (2, "stock"), (1, "own")])
def test_qwenimageedit_reads_each_captions_input_images_as_its_pipeline_does(tiny, tmp_path, inputs,
                                                                            processor):
    """A batch of two captions of different lengths, each with its own input image (or
    two: "Picture 1", "Picture 2"; right-padded ids, each picture slot widened to its
    image's vision tokens): each row's conditioning is what QwenImageEditPlusPipeline's
    ``encode_prompt`` gives that caption with its condition images (each input at 384² px
    of area, as the pipeline resizes it) alone; past each caption, zeros under a zero mask.
    ``own``: the folder's image processor has a mean, std and pixel bound of its own (a
    fine-tune's folder may); the pipeline reads the images with it, and so does training."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        calculate_dimensions,
    )

    from stock import stock_pipeline
    from test_families import _raylora_batch

    family, (H, W) = "qwenimageedit", (48, 80)
    model = tiny(family)
    if processor == "own":
        model = str(shutil.copytree(model, tmp_path / "own-processor"))
        config = os.path.join(model, "processor", "preprocessor_config.json")
        values = json.load(open(config))
        assert values["image_mean"] != [0.3, 0.5, 0.7]
        # At most 80 patches of 28 px: the 480 × 288 px condition image is made smaller.
        values.update(image_mean=[0.3, 0.5, 0.7], image_std=[0.2, 0.25, 0.3],
                      size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 80})
        with open(config, "w") as f:
            json.dump(values, f)
    captions = ["make it red", "turn the small blue square into a green circle"]
    comps, batch = _raylora_batch(model, family, captions, size=(H, W), references=inputs)
    pipe = stock_pipeline(family, model)
    images = [[pattern(10 * s + k, W, H) for k in range(inputs)] for s in (1, 2)]  # [row][input]
    raw = {control_key("control_values", k): torch.from_numpy(np.stack([row[k] for row in images])).permute(0, 3, 1, 2)
           for k in range(inputs)}
    with torch.no_grad():
        ours = families.get(family).encode_text(comps.text_encoders, {**batch, **raw})
        lengths = []
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, W / H)
        for i, (caption, row) in enumerate(zip(captions, images)):
            want, mask = pipe.encode_prompt(
                [caption], image=[pipe.image_processor.resize(Image.fromarray(x), h, w) for x in row])
            n = want.shape[1]
            lengths.append(n)
            assert mask is None  # one caption: every position valid
            torch.testing.assert_close(ours["prompt_embeds"][i, :n], want[0], rtol=1e-5, atol=1e-6)
            assert ours["prompt_embeds_mask"][i, :n].all() and not ours["prompt_embeds_mask"][i, n:].any()
            assert not ours["prompt_embeds"][i, n:].any()
    assert lengths[0] < lengths[1] == ours["prompt_embeds"].shape[1]
    # Vision tokens per input: 170 (480 × 288 px → 20 × 34 patches of 14 px, merged 2×2);
    # under the folder's bound 66 (308 × 168 px: 22 × 12 patches).
    resized = pipe.image_processor.resize(Image.fromarray(images[0][0]), h, w)
    grid = pipe.processor.image_processor(images=[resized], return_tensors="pt")["image_grid_thw"]
    assert int(grid.prod()) // 4 == {"stock": 170, "own": 66}[processor]
    assert lengths[0] > int(grid.prod()) // 4 * inputs


# ---------------------------------------------------------------- where control images come from


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("fmt", ["webdataset", "captionfolder", "imagefolder", "parquet"])
def test_every_format_reads_each_samples_control_image(tmp_path, fmt, inputs):
    """The sidecar (tar member, folder file; PNG or JPEG) or the parquet column reaches
    each row as ``control``; with two inputs the second's (KEY.control_2.<ext>, the
    column control_image_2) as ``control_2``. Sidecars are never training images
    themselves, and the plan counts the pairs, not their files. With data.control_images
    off rows have none and nothing is read for them."""
    from raylora.data.formats import get_format
    from raylora.data.plan import plan_data

    uri = write_pairs(tmp_path / fmt, fmt, inputs=inputs)
    data = section(uri, control_inputs=inputs)
    plan = plan_data(data, Storage())
    (src,) = plan.sources
    assert src.format == fmt and src.rows == 3
    rows = sorted(get_format(fmt).iter_rows(data, src.files, Storage()), key=lambda r: r["text"])
    assert [r["text"] for r in rows] == ["edit 0", "edit 1", "edit 2"]
    folder = fmt in ("captionfolder", "imagefolder")
    for i, r in enumerate(rows):
        image = np.array(Image.open(io.BytesIO(r["image"])))
        control = decoded(r["control"])
        np.testing.assert_array_equal(image, pattern(i))
        if folder and i == 0:  # the JPEG one
            assert np.abs(control.astype(int) - (255 - image)).mean() < 8
        else:
            np.testing.assert_array_equal(control, 255 - image)
        assert ("control_2" in r) == (inputs == 2)
        if inputs == 2:
            second = decoded(r["control_2"])
            tolerance = 8 if folder and i == 1 else 1e-9  # k1's is a JPEG
            assert np.abs(second.astype(int) - image[..., ::-1]).mean() < tolerance
            assert np.abs(second.astype(int) - image).mean() > 30  # not the image itself
    off = get_format(fmt).iter_rows(section(uri, control_images=False), src.files, Storage())
    assert all("control" not in r and "control_2" not in r for r in off)
    # the sidecars are part of the data: a change to one is a change to the cache's input
    assert sum(".control." in f for f in src.companions) == (3 if folder else 0)
    assert sum(".control_2." in f for f in src.companions) == (3 if folder and inputs == 2 else 0)
    assert sum(".control" in f for f in plan_data(section(uri, control_images=False),
                                                   Storage()).content_files()) == 0


def test_parquet_columns_of_several_inputs_named_or_derived(tmp_path):
    """parquet with two inputs: the columns data.control_column names (a list), or the
    first's and ``{column}_2``; a shard without input 2's column gives every row a None
    ``control_2`` (a missing_control later), not an error."""
    from raylora.data.formats import get_format

    def rows(uri, **kw):
        data = section(uri, control_inputs=2, **kw)
        return list(get_format("parquet").iter_rows(data, [uri], Storage()))

    named = write_pairs(tmp_path / "named", "parquet", inputs=2, columns=("before", "reference"))
    derived = write_pairs(tmp_path / "derived", "parquet", inputs=2, columns=("src", "src_2"))
    for got in (rows(named, control_column=["before", "reference"]),
                rows(derived, control_column="src")):
        assert len(got) == 3
        for i, r in enumerate(got):
            np.testing.assert_array_equal(decoded(r["control"]), 255 - pattern(i))
            np.testing.assert_array_equal(decoded(r["control_2"]), pattern(i)[..., ::-1])
    # input 2's column read from the list, not derived: src_2 is not looked at
    got = rows(derived, control_column=["src", "other"])
    assert all(r["control"] is not None and r["control_2"] is None for r in got)


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("fmt", ["captionfolder", "imagefolder"])
def test_control_images_in_a_folder_of_their_own(tmp_path, fmt, inputs):
    """data.control_uri (ai-toolkit's control_path): each image's control image under its
    path relative to data.uri in another folder, any extension (one here is a JPEG of a
    PNG image); with two inputs a list of two folders, input k's in the k-th. They are
    the plan's companions (the cache's fingerprint), and sidecars beside the images are
    then not read."""
    from raylora.data.formats import get_format
    from raylora.data.plan import plan_data

    write_pairs(tmp_path / "data" / "sub", fmt, inputs=inputs)
    folders = [tmp_path / "control", tmp_path / "second"][:inputs]
    for folder, infix in zip(folders, (".control", ".control_2")):
        (folder / "sub").mkdir(parents=True)
        for f in (tmp_path / "data" / "sub").glob(f"*{infix}.*"):
            f.rename(folder / "sub" / f.name.replace(infix, ""))
    uris = [str(f) for f in folders]
    data = section(str(tmp_path / "data"), control_inputs=inputs,
                   control_uri=uris if inputs > 1 else uris[0])
    (src,) = plan_data(data, Storage()).sources
    assert src.rows == 3
    controls = folders[0] / "sub"
    assert sorted(c for c in src.companions if "/control/" in c) == \
        [str(controls / "k0.JPG"), str(controls / "k1.png"), str(controls / "k2.png")]
    if inputs == 2:
        seconds = folders[1] / "sub"
        assert sorted(c for c in src.companions if "/second/" in c) == \
            [str(seconds / "k0.png"), str(seconds / "k1.jpg"), str(seconds / "k2.png")]
    rows = sorted(get_format(fmt).iter_rows(data, src.files, Storage()), key=lambda r: r["text"])
    for i, r in enumerate(rows):
        image = np.array(Image.open(io.BytesIO(r["image"])))
        control = decoded(r["control"])
        assert np.abs(control.astype(int) - (255 - image)).mean() < (8 if i == 0 else 1e-9)
        if inputs == 2:
            second = decoded(r["control_2"])
            assert np.abs(second.astype(int) - image[..., ::-1]).mean() < (8 if i == 1 else 1e-9)
    # a sidecar beside an image is not read when the controls are in their own folder
    (tmp_path / "data" / "sub" / "k1.control.png").write_bytes(pair(9)[1])
    (tmp_path / "data" / "sub" / "k1.control_2.png").write_bytes(pair(9)[1])
    (controls / "k1.png").unlink()
    if inputs == 2:
        (folders[1] / "sub" / "k2.png").unlink()
    rows = sorted(get_format(fmt).iter_rows(data, src.files, Storage()), key=lambda r: r["text"])
    assert [r["control"] is None for r in rows] == [False, True, False]
    if inputs == 2:
        assert [r["control_2"] is None for r in rows] == [False, False, True]


def test_held_out_rows_carry_every_input(tmp_path):
    """The held-out rows read on the driver (``read_heldout_rows``) have each of their
    inputs: ``control`` and ``control_2``, from their sidecars."""
    from raylora.data.plan import plan_data
    from raylora.data.split import read_heldout_rows

    data = section(write_pairs(tmp_path / "d", "captionfolder", inputs=2), control_inputs=2)
    rows = read_heldout_rows(data, plan_data(data, Storage()), Storage(), 1.0)  # every row
    assert sorted(r["text"] for r in rows) == ["edit 0", "edit 1", "edit 2"]
    for r in rows:
        image = np.array(Image.open(io.BytesIO(r["image"])))
        assert sorted(r) == ["control", "control_2", "image", "text"]
        assert np.abs(decoded(r["control"]).astype(int) - (255 - image)).mean() < 8
        assert np.abs(decoded(r["control_2"]).astype(int) - image[..., ::-1]).mean() < 8


def test_held_out_pairs_come_with_their_inputs(tiny, tmp_path):
    """The held-out rows the plan carries to the workers have their control images: from
    the split of the training folder (its data.control_uri), and from data.validation_uri,
    whose control images are its sidecars (data.control_uri mirrors the training folder)."""
    from raylora.launch import plan

    train = tmp_path / "train"
    write_pairs(train, "captionfolder", n=6, w=32, h=32)
    (tmp_path / "control").mkdir()
    for f in train.glob("*.control.*"):
        f.rename(tmp_path / "control" / f.name.replace(".control", ""))
    held = write_pairs(tmp_path / "held", "captionfolder", n=2, w=32, h=32)
    tree = {"model": {"pretrained": tiny(FAMILY), "max_sequence_length": 32},
            "data": {"uri": str(train), "control_uri": str(tmp_path / "control"),
                     "control_images": True, "resolution": 32, "validation_uri": held},
            "train": {"batch_size": 1}, "output": {"uri": str(tmp_path / "o")}}
    rows = plan(validate(tree)).heldout
    assert len(rows) == 2
    for r in rows:
        image = np.array(Image.open(io.BytesIO(r["image"])))
        control = np.array(Image.open(io.BytesIO(r["control"])).convert("RGB"))
        assert np.abs(control.astype(int) - (255 - image)).mean() < (8 if r["text"] == "edit 0" else 1e-9)
    tree["data"].pop("validation_uri")
    tree["data"]["validation_split"] = 0.5
    rows = plan(validate(tree)).heldout
    assert rows and all(r["control"] for r in rows)


def test_a_control_folder_that_cannot_serve_is_refused_naming_its_key(tmp_path):
    """Before Ray: data.control_uri inside data.uri (its images would be targets), empty,
    with shards, or set with data.control_images off; images without a control image over
    data.max_bad_fraction (named, with examples), for data.uri and per source."""
    from raylora.config import ConfigError
    from raylora.data.plan import DataProblems, plan_data

    uri = write_pairs(tmp_path / "d", "captionfolder")
    shards = write_pairs(tmp_path / "w", "webdataset")
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "d" / "ctl"): f"data.control_uri: {tmp_path / 'd' / 'ctl'} is inside data.uri "
                                     f"({tmp_path / 'd'}): its images would train as targets",
        str(tmp_path / "empty"): f"data.control_uri: {tmp_path / 'empty'}: no files",
    }
    for control, want in cases.items():
        with pytest.raises(DataProblems) as exc:
            plan_data(section(uri, control_uri=control), Storage())
        assert exc.value.problems == [want]
    with pytest.raises(DataProblems) as exc:
        plan_data(section(shards, control_uri=str(tmp_path / "d")), Storage())
    assert exc.value.problems == [f"data.control_uri: {tmp_path / 'd'}: webdataset shards hold their "
                                  "own control images (KEY.control.<ext> members, "
                                  "data.control_column); leave it unset"]
    with pytest.raises(ConfigError) as exc:
        validate({"model": {"pretrained": "m"}, "output": {"uri": "o"},
                  "data": {"uri": uri, "control_uri": str(tmp_path / "empty")}})
    assert exc.value.problems == ["data.control_uri: set, but data.control_images is off (nothing "
                                  "reads it); turn it on or drop it"]
    # 2 of 3 without a control image: refused at the default 5 %, dropped at 0.7
    for f in ("k1.control.png", "k2.control.png"):
        (tmp_path / "d" / f).unlink()
    with pytest.raises(DataProblems) as exc:
        plan_data(section(uri), Storage())
    assert exc.value.problems == [
        f"data.control_images: 2 of 3 images have no control image (no KEY.control.<ext> beside "
        f"them; e.g. {tmp_path / 'd' / 'k1.png'}, {tmp_path / 'd' / 'k2.png'}); 66.7% of the "
        "reads, over data.max_bad_fraction=0.05"]
    assert plan_data(section(uri, max_bad_fraction=0.7), Storage()).rows == 3
    mixed = validate({"model": {"pretrained": "m"}, "output": {"uri": "o"},
                      "data": {"control_images": True, "sources": [
                          {"uri": shards}, {"uri": uri, "control_uri": str(tmp_path / "empty")}]}}).data
    with pytest.raises(DataProblems) as exc:
        plan_data(mixed, Storage())
    assert exc.value.problems == [f"data.sources[1].control_uri: {tmp_path / 'empty'}: no files"]
    mixed.sources[1].control_uri = None  # its sidecars: 2 of 3 missing
    with pytest.raises(DataProblems) as exc:
        plan_data(mixed, Storage())
    assert [p.split(": 2 of 3")[0] for p in exc.value.problems] == ["data.control_images (data.sources[1])"]
    # set once for every source: named as data's key, with the source it failed for
    shared = validate({"model": {"pretrained": "m"}, "output": {"uri": "o"},
                       "data": {"control_images": True, "control_uri": str(tmp_path / "empty"),
                                "sources": [{"uri": uri}]}}).data
    with pytest.raises(DataProblems) as exc:
        plan_data(shared, Storage())
    assert exc.value.problems == [f"data.control_uri (data.sources[0]): {tmp_path / 'empty'}: no files"]


def test_folders_and_sidecars_of_several_inputs_that_cannot_serve_are_refused(tmp_path):
    """Two inputs, before Ray: each data.control_uri folder inside data.uri or empty is
    named (all at once); images without input 2's sidecar over data.max_bad_fraction are
    refused naming data.control_images and KEY.control_2.<ext>; and images each lacking
    one input or the other, each input under the bound, are refused together."""
    from raylora.data.plan import DataProblems, plan_data

    d = tmp_path / "d"
    uri = write_pairs(d, "captionfolder", inputs=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "k0.png").write_bytes(pair(0)[1])

    def problems(**kw) -> list[str]:
        with pytest.raises(DataProblems) as exc:
            plan_data(section(uri, control_inputs=2, **kw), Storage())
        return exc.value.problems

    assert problems(control_uri=[str(tmp_path / "good"), str(d / "ctl")]) == [
        f"data.control_uri: {d / 'ctl'} is inside data.uri ({d}): its images would train as targets"]
    assert problems(control_uri=[str(tmp_path / "empty"), str(d / "ctl")]) == [
        f"data.control_uri: {tmp_path / 'empty'}: no files",
        f"data.control_uri: {d / 'ctl'} is inside data.uri ({d}): its images would train as targets"]
    # the good folder has k0's input 1 only; the sidecars beside the images are not read
    assert problems(control_uri=[str(tmp_path / "good"), str(tmp_path / "good")]) == [
        f"data.control_images: 2 of 3 images have no input {k}'s control image (none in "
        f"{tmp_path / 'good'}; e.g. {d / 'k1.png'}, {d / 'k2.png'}); 66.7% of the reads, "
        "over data.max_bad_fraction=0.05" for k in (1, 2)]

    assert plan_data(section(uri, control_inputs=2), Storage()).rows == 3
    for f in ("k1.control_2.jpg", "k2.control_2.png"):  # 2 of 3 without input 2
        (d / f).unlink()
    assert problems() == [
        f"data.control_images: 2 of 3 images have no input 2's control image (no "
        f"KEY.control_2.<ext> beside them; e.g. {d / 'k1.png'}, {d / 'k2.png'}); 66.7% of "
        "the reads, over data.max_bad_fraction=0.05"]
    (d / "k2.control_2.png").write_bytes(swapped(2))
    (d / "k2.control.png").unlink()  # k1 lacks input 2, k2 input 1: a third each
    assert problems(max_bad_fraction=0.4) == [
        f"data.control_images: 2 of 3 images lack at least one of their 2 control images "
        f"(e.g. {d / 'k1.png'}, {d / 'k2.png'}); 66.7% of the reads, over "
        "data.max_bad_fraction=0.4"]
    plan = plan_data(section(uri, control_inputs=2, max_bad_fraction=0.7), Storage())
    assert plan.rows == 3 and sorted(c.rsplit("/", 1)[1] for c in plan.sources[0].companions
                                     if ".control" in c) == \
        ["k0.control.JPG", "k0.control_2.png", "k1.control.png", "k2.control_2.png"]


def test_missing_control_images_are_judged_by_their_reads_kohya_repeats_counted(tmp_path, caplog):
    """A kohya ``10_name`` folder's image is read 10 times an epoch, and the run's
    data.max_bad_fraction counts rows read: one image of 30 without its control image is
    a third of a 10_char folder's reads, 10 of 48 (20.8 %). Judged per image (3.3 %) it
    passed planning and stopped the run once read; it is refused before Ray, as the
    caption check refuses the same share of reads. Two inputs: images lacking one input
    or the other are judged together by their reads too."""
    import logging

    from raylora.data.plan import DataProblems, plan_data

    d = tmp_path / "d"
    for folder, n in (("10_char", 2), ("1_reg", 28)):
        (d / folder).mkdir(parents=True)
        for i in range(n):
            img, ctl = pair(i, 32, 32)
            (d / folder / f"{folder}{i}.png").write_bytes(img)
            (d / folder / f"{folder}{i}.control.png").write_bytes(ctl)
            (d / folder / f"{folder}{i}.control_2.png").write_bytes(swapped(i, 32, 32))
            (d / folder / f"{folder}{i}.txt").write_text(f"edit {i}")
    (d / "10_char" / "10_char0.control.png").unlink()
    c0 = d / "10_char" / "10_char0.png"

    def problems(**kw) -> list[str]:
        with pytest.raises(DataProblems) as exc:
            plan_data(section(str(d), **kw), Storage())
        return exc.value.problems

    assert problems() == [
        f"data.control_images: 1 of 30 images have no control image (no KEY.control.<ext> "
        f"beside them; e.g. {c0}); 20.8% of the reads, over data.max_bad_fraction=0.05"]
    with caplog.at_level(logging.WARNING, logger="raylora.data"):
        assert plan_data(section(str(d), max_bad_fraction=0.25), Storage()).rows == 48
    assert "1 of 30 images have no control image" in caplog.text
    # two inputs: 10_char0 lacks input 1, 10_char1 input 2: 10 of 48 reads each, under
    # 0.3, but 20 of 48 together, over it (per image: 2 of 30, 6.7 %, passed)
    (d / "10_char" / "10_char1.control_2.png").unlink()
    assert problems(control_inputs=2, max_bad_fraction=0.3) == [
        f"data.control_images: 2 of 30 images lack at least one of their 2 control images "
        f"(e.g. {c0}, {d / '10_char' / '10_char1.png'}); 41.7% of the reads, over "
        "data.max_bad_fraction=0.3"]


def drop_control(uri: str, fmt: str, key: int, infix: str = ".control") -> None:
    """Take sample ``k{key}``'s control image (``infix``: whose input) out of ``write_pairs``'
    data: its sidecar file, its tar member, its parquet cell (None)."""
    import glob

    if fmt == "parquet":
        table = pq.read_table(uri)
        column = "control_image" + infix[len(".control"):]
        cells = table[column].to_pylist()
        cells[key] = None
        pq.write_table(table.set_column(table.schema.get_field_index(column), column,
                                        pa.array(cells, pa.binary())), uri)
    elif fmt == "webdataset":
        tar_path = os.path.join(uri, "000.tar")
        with tarfile.open(tar_path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()
                       if m.name != f"k{key}{infix}.png"]
        with tarfile.open(tar_path, "w") as tar:
            for m, data in members:
                tar.addfile(m, io.BytesIO(data))
    else:
        (found,) = glob.glob(os.path.join(uri, f"k{key}{infix}.*"))
        os.unlink(found)


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("fmt", ["captionfolder", "imagefolder", "webdataset", "parquet"])
def test_the_bucket_scan_counts_no_row_without_its_control_image(tmp_path, fmt, inputs):
    """data.bucketing: a row without its control image (any input's) is dropped by the
    workers as missing_control, so the bucket scan counts it in no bucket: counted, the
    schedule planned a batch the workers could never fill (alone in its bucket, the run
    stopped mid-epoch). Every format: a folder's row as the control lookup found it, a
    shard's by its member or column. The epoch still reads all 4 rows."""
    from raylora.data.plan import plan_data

    uri = write_pairs(tmp_path / fmt, fmt, n=4, w=32, h=32, inputs=inputs)
    drop_control(uri, fmt, 1, ".control_2" if inputs == 2 else ".control")
    data = section(uri, control_inputs=inputs, bucketing=True, resolution=32, bucket_step=16,
                   max_bad_fraction=0.5)
    plan = plan_data(data, Storage())
    assert plan.rows == 4
    assert plan.bucket_histogram() == plan.bucket_rows() == {0: 3}  # 0: 32x32
    # with every control image there, every row is counted
    full = write_pairs(tmp_path / "full", fmt, n=4, w=32, h=32, inputs=inputs)
    assert plan_data(section(full, control_inputs=inputs, bucketing=True, resolution=32,
                             bucket_step=16), Storage()).bucket_rows() == {0: 4}


def test_a_bucket_of_images_without_control_images_is_not_scheduled(tiny, tmp_path):
    """The one wide image of a folder of square pairs has no control image (1 of 5, under
    data.max_bad_fraction): it is in no bucket, so the epoch's schedule (4 square steps)
    is what the workers' rows fill, read and preprocessed as a worker does (no Ray). It
    was scheduled in its own 48x16 bucket, and the epoch stopped with "no usable row of
    bucket ..." once the square steps were done."""
    from raylora.data.buckets import bucket_batches, bucket_set, epoch_steps, schedule
    from raylora.data.parquet_parts import READ_UNIT_ROWS
    from raylora.data.plan import pass_items, plan_data, read_units
    from raylora.data.preprocess import stage_kwargs
    from raylora.data.source import _read_items

    uri = write_pairs(tmp_path / "d", "captionfolder", n=4, w=32, h=32)
    (tmp_path / "d" / "wide.png").write_bytes(pair(9, 64, 32)[0])
    (tmp_path / "d" / "wide.txt").write_text("edit wide")
    data = section(uri, bucketing=True, resolution=32, bucket_step=16, center_crop=True,
                   max_bad_fraction=0.25)
    store = Storage()
    plan, buckets = plan_data(data, store), bucket_set(data)
    steps = epoch_steps([plan.bucket_rows()], 1)
    assert {buckets.name(b): n for b, n in steps.items()} == {"32x32": 4}
    sections = data.source_sections()
    kw = dict(sections=[sections[s.index].model_dump() for s in plan.sources],
              files=[s.files for s in plan.sources], formats=[s.format for s in plan.sources],
              cached=False, endpoint_url=None, region=None)
    s = Preprocess(StageSpec(**stage_kwargs("train", data, model_path=tiny(FAMILY), family=FAMILY,
                                            storage=store, max_sequence_length=32)))
    sent = []
    s.reporter.send = lambda ok, bad, examples, **_: sent.append((ok, dict(bad)))
    blocks = []
    for item in pass_items(read_units(data, plan, store, READ_UNIT_ROWS), 0, 0, False):
        for t in _read_items({k: np.array([v], dtype=object) for k, v in item.items()}, **kw):
            out = s({k: np.array(t[k].to_pylist(), dtype=object) for k in t.column_names})
            out["epoch"] = np.zeros(len(out["bucket"]), np.int32)
            blocks.append(out)
    assert sum(ok for ok, _ in sent) == 4 and [b for _, b in sent if b] == [{"missing_control": 1}]
    trained = [b for _, b in bucket_batches(blocks, 1, lambda e: schedule(steps, 0, e), lambda e: e)]
    assert len(trained) == 4 and all(b["pixel_values"].shape == (1, 3, 32, 32) for b in trained)


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_shards_built_from_a_folder_of_pairs_keep_their_control_images_and_masks(tmp_path, fmt, inputs):
    """``raylora shards build`` of a caption folder with sidecars: each shard sample keeps
    its control images (input 2's too: a KEY.control_2.<ext> member, a control_image_2
    column) and a loss mask where the folder has one, where the readers look for them,
    and none becomes a sample of its own."""
    from raylora.data.formats import get_format
    from raylora.data.plan import plan_data
    from raylora.data.shards import collect_items, write_shard

    src = write_pairs(tmp_path / "src", "captionfolder", inputs=inputs)
    mask = png(Image.fromarray(np.full((32, 40), 128, np.uint8), "L"))
    (tmp_path / "src" / "k1.mask.png").write_bytes(mask)
    store = Storage()
    items = collect_items(store, src)
    assert [it["key"] for it in items] == ["k0", "k1", "k2"]
    assert [sorted(k for k in it if k.startswith("control_uri")) for it in items] == \
        [["control_uri", "control_uri_2"][:inputs]] * 3
    write_shard(store, str(tmp_path / "out"), fmt, 0, items)
    if fmt == "webdataset":  # each input's member keeps its sidecar's extension
        with tarfile.open(tmp_path / "out" / "shard-00000.tar") as tar:
            names = [m.name.split(".", 1)[1] for m in tar.getmembers() if m.name.startswith("000000001.")]
        assert names == ["png", "txt", "json", "mask.png", "control.png", "control_2.jpg"][:6 if inputs == 2 else 5]
    data = section(str(tmp_path / "out"), masked_loss=True, control_inputs=inputs)
    (s,) = plan_data(data, store).sources
    assert s.format == fmt and s.rows == 3
    rows = sorted(get_format(fmt).iter_rows(data, s.files, store), key=lambda r: r["text"])
    for i, r in enumerate(rows):
        image = np.array(Image.open(io.BytesIO(r["image"])))
        control = decoded(r["control"])
        assert np.abs(control.astype(int) - (255 - image)).mean() < (8 if i == 0 else 1e-9)
        assert r["mask"] == (mask if i == 1 else None)
        if inputs == 2:
            second = decoded(r["control_2"])
            assert np.abs(second.astype(int) - image[..., ::-1]).mean() < (8 if i == 1 else 1e-9)


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("bucketing", [False, True])
def test_control_image_gets_its_targets_crop_flip_and_bucket(tiny, bucketing, inputs):
    """Random crops and flips, drawn once per sample: the control image is cut where its
    image is (exactly, without a resize; to a pixel, bilinear, with a bucket's), and one
    of another size is first resized to its image's; with two inputs the second
    (``control_values_2``) likewise, its own. The draws are those of a run without
    control images (the same crops)."""
    model = tiny(FAMILY)
    kw = dict(center_crop=False, random_flip=True, seed=3)
    if bucketing:
        from raylora.data.buckets import BucketSet

        kw["buckets"] = BucketSet.of([[32]], 16)
    rows = []

    def half(image: bytes) -> bytes:
        return png(Image.open(io.BytesIO(image)).resize((20, 16), Image.Resampling.BILINEAR))

    for i in range(8):
        img, ctl = pair(i)
        if i == 5:  # a control of half the size: resized to the image's first
            ctl = half(ctl)
        rows.append({"image": img, "text": f"e{i}", "control": ctl})
        if inputs == 2:  # input 2 of half the size in another row
            rows[-1]["control_2"] = half(swapped(i)) if i == 6 else swapped(i)
    s, sent = stage(model, control_inputs=inputs, **kw)
    out = run_stage(s, rows)
    plain, _ = stage(model, **{**kw, "controls": False})
    ref = run_stage(plain, rows)
    assert sent == [(8, {})] and "control_values" not in ref
    assert ("control_values_2" in out) == (inputs == 2) and "control_values_3" not in out
    for i in range(8):
        px, cv = np.asarray(out["pixel_values"][i]), np.asarray(out["control_values"][i])
        np.testing.assert_array_equal(px, np.asarray(ref["pixel_values"][i]))  # same draws
        assert cv.shape == px.shape and cv.dtype == np.uint8
        err = np.abs(cv.astype(int) - (255 - px.astype(int)))
        if i == 5:  # upsampled 2x: its own detail is gone, the layout is not
            assert err.mean() < 60 and np.corrcoef(cv.ravel(), 255 - px.ravel())[0, 1] > 0.3
        else:
            assert err.max() <= (1 if bucketing else 0), (i, err.max())
        if inputs == 2:
            c2 = np.asarray(out["control_values_2"][i])
            assert c2.shape == px.shape and c2.dtype == np.uint8
            err = np.abs(c2.astype(int) - px[::-1].astype(int))  # the channels reversed
            if i == 6:
                assert err.mean() < 60 and np.corrcoef(c2.ravel(), px[::-1].ravel())[0, 1] > 0.3
            else:
                assert err.max() <= (1 if bucketing else 0), (i, err.max())


def test_missing_and_broken_control_images_are_counted_bad_rows(tiny, tmp_path):
    """A row without a control image is ``missing_control``, one that does not decode
    ``bad_control``: dropped and counted like any bad record. Shards none of whose sampled
    rows has one are refused before anything starts, saying where they go."""
    from raylora.data.plan import plan_data, sample_problems

    s, sent = stage(tiny(FAMILY))
    img, ctl = pair(0)
    out = run_stage(s, [{"image": img, "text": "a", "control": ctl},
                        {"image": img, "text": "b", "control": None},
                        {"image": img, "text": "c", "control": b"not an image"}])
    assert sent == [(1, {"missing_control": 1, "bad_control": 1})]
    assert out["pixel_values"].shape == out["control_values"].shape == (1, 3, 32, 32)

    # shards (a folder's images are checked against its listing when planned: see
    # test_a_control_folder_that_cannot_serve_is_refused_naming_its_key)
    shards = tmp_path / "p.parquet"
    pq.write_table(pa.table({"image": [pair(i)[0] for i in range(3)], "text": ["x"] * 3}), str(shards))
    data = section(str(shards))
    (problem,) = sample_problems(data, plan_data(data, Storage()), Storage())
    assert problem.startswith(f"data.uri: {shards}: none of the 3 rows read to check it is usable "
                              "(missing_control=3")
    assert "KEY.control.<ext>" in problem and "data.control_images off" in problem


def test_a_row_lacking_any_of_its_inputs_is_a_bad_row(tiny, tmp_path):
    """Two inputs: a row without input 2 (or input 1) is ``missing_control``, one whose
    input 2 does not decode ``bad_control``, each message naming the input; the rows kept
    have both, ``control_values_2`` the second's pixels. Shards without input 2's column
    are refused before anything starts, saying where input k's goes."""
    from raylora.data.plan import plan_data, sample_problems

    s, _ = stage(tiny(FAMILY), control_inputs=2)
    reported = []
    s.reporter.send = lambda ok, bad, examples, **_: reported.append((ok, dict(bad), examples))
    img, ctl = pair(0, 32, 32)
    out = run_stage(s, [{"image": img, "text": "a", "control": ctl, "control_2": swapped(0, 32, 32)},
                        {"image": img, "text": "b", "control": ctl, "control_2": None},
                        {"image": img, "text": "c", "control": None, "control_2": swapped(0, 32, 32)},
                        {"image": img, "text": "d", "control": ctl, "control_2": b"not an image"}])
    ((ok, bad, examples),) = reported
    assert (ok, bad) == (1, {"missing_control": 2, "bad_control": 1})
    assert [e.split(": ", 2)[2][:36] for e in examples["missing_control"]] == [
        "input 2: no KEY.control_2.<ext> besi", "input 1: no KEY.control.<ext> beside"]
    assert examples["bad_control"][0].split(": ", 1)[1].startswith(
        "bad_control: control image (input 2): not_an_image")
    assert out["pixel_values"].shape == out["control_values"].shape == \
        out["control_values_2"].shape == (1, 3, 32, 32)
    np.testing.assert_array_equal(out["control_values_2"][0], pattern(0, 32, 32).transpose(2, 0, 1)[::-1])
    np.testing.assert_array_equal(out["control_values"][0], 255 - out["pixel_values"][0])
    # a batch without input 2's column at all: every row lacks it
    run_stage(s, [{"image": img, "text": "a", "control": ctl}])
    assert reported[-1][:2] == (0, {"missing_control": 1})

    shards = write_pairs(tmp_path / "one", "parquet")  # control_image only
    data = section(shards, control_inputs=2)
    (problem,) = sample_problems(data, plan_data(data, Storage()), Storage())
    assert problem.startswith(f"data.uri: {shards}: none of the 3 rows read to check it is usable "
                              "(missing_control=3")
    assert "input 2: no KEY.control_2.<ext>" in problem
    assert "input k's is KEY.control_k.<ext>, the k-th folder of data.control_uri" in problem


def test_control_keys_are_refused_where_they_cannot_apply(tiny):
    """One line per key, before Ray: a family whose pipeline takes no input image,
    preview input images without pair training or not one per prompt, and prior
    preservation (class images have no control images)."""
    from raylora.config import ConfigError
    from raylora.launch import family_problems

    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"},
            "data": {"uri": "d", "control_images": True}}
    cfg = validate(base)
    assert family_problems(cfg, families.get(FAMILY), 16, "flow_matching") == []
    (line,) = [p for p in family_problems(cfg, families.get("flux"), 16, "flow_matching")
               if p.startswith("data.control_images")]
    assert line == ("data.control_images: flux (FluxPipeline) takes no input image; image-edit "
                    "pairs train a family that does (flux2, flux2klein, fluxkontext, qwenimageedit)")
    two = validate({**base, "data": {**base["data"], "control_inputs": 2}})
    assert family_problems(two, families.get("flux2klein"), 16, "flow_matching") == []
    assert family_problems(two, families.get(FAMILY), 16, "flow_matching") == [
        "data.control_inputs: 2 input images a sample, but FluxKontextPipeline takes 1; several "
        "inputs train flux2, flux2klein, qwenimageedit"]
    # Flux.2's image processor takes no input under 64 px a side: previews at 32 px would
    # fail at the first one, so they are refused here
    small = validate({**base, "data": {**base["data"], "resolution": 32},
                      "validation": {"prompts": ["a"], "control_images": ["x.png"]}})
    assert family_problems(small, families.get("flux2klein"), 16, "flow_matching") == [
        "validation.control_images: Flux2KleinPipeline takes no input image under 64 px a side, "
        "and previews render at data.resolution 32 px; raise it or drop validation.control_images"]
    assert family_problems(small, families.get(FAMILY), 16, "flow_matching") == []
    assert family_problems(small.model_copy(update={"data": small.data.model_copy(update={"resolution": 64})}),
                           families.get("flux2klein"), 16, "flow_matching") == []
    cases = {
        "validation.control_images: previews take an input image only when the run trains on "
        "them (data.control_images: true)":
            {"data": {"uri": "d"}, "validation": {"prompts": ["a"], "control_images": ["x.png"]}},
        "validation.control_images: 1 image(s) for 2 validation.prompts; give one per prompt":
            {"validation": {"prompts": ["a", "b"], "control_images": ["x.png"]}},
        "data.prior_preservation: class images have no control images; prior preservation "
        "cannot be combined with data.control_images":
            {"data": {"uri": "d", "control_images": True, "class_prompt": "a photo"}},
        # several inputs a sample: the lists that name them, one entry per input
        "data.control_inputs: 2, but data.control_images is off; turn it on or drop it":
            {"data": {"uri": "d", "control_inputs": 2}},
        "validation.control_images[0]: 1 input image(s), but data.control_inputs is 2; give "
        "a list of 2 per prompt":
            {"data": {"uri": "d", "control_images": True, "control_inputs": 2},
             "validation": {"prompts": ["a"], "control_images": ["x.png"]}},
        "validation.control_images[1]: 3 input image(s), but data.control_inputs is 2; give "
        "a list of 2 per prompt":
            {"data": {"uri": "d", "control_images": True, "control_inputs": 2},
             "validation": {"prompts": ["a", "b"], "control_images": [["x", "y"], ["x", "y", "z"]]}},
        "data.control_uri: 1 folder(s) for data.control_inputs 2; give a list of 2, input "
        "k's in the k-th":
            {"data": {"uri": "d", "control_images": True, "control_inputs": 2, "control_uri": "c"}},
        "data.sources[1].control_column: 3 column(s) for data.control_inputs 2; give one per input":
            {"data": {"control_images": True, "control_inputs": 2,
                      "sources": [{"uri": "a"}, {"uri": "b", "control_column": ["x", "y", "z"]}]}},
    }
    for want, change in cases.items():
        with pytest.raises(ConfigError) as exc:
            validate({**base, **change})
        assert want in exc.value.problems, exc.value.problems


def test_plan_refuses_pairs_for_a_text_to_image_model_and_unreadable_preview_inputs(tiny, tmp_path):
    """``raylora plan`` (what ``train`` runs before Ray): data.control_images with a
    folder of another family, and a preview input that is missing or not an image, each
    one line naming the key and the file; a Kontext plan of the same pairs passes."""
    from raylora.config import ConfigError
    from raylora.launch import plan

    data = write_pairs(tmp_path / "d", "captionfolder", w=32, h=32)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    tree = {"model": {"pretrained": tiny(FAMILY), "max_sequence_length": 32},
            "data": {"uri": data, "resolution": 32, "control_images": True},
            "train": {"batch_size": 1},
            "validation": {"prompts": ["a", "b"], "control_images": [str(tmp_path / "nope.png"),
                                                                    str(tmp_path / "bad.png")]},
            "output": {"uri": str(tmp_path / "o")}}
    with pytest.raises(ConfigError) as exc:
        plan(validate(tree))
    assert exc.value.problems[0] == f"validation.control_images: {tmp_path / 'nope.png'}: no such file"
    assert len(exc.value.problems) == 1  # the first unreadable one stops the reading
    Image.fromarray(pattern(1)).save(tmp_path / "nope.png")
    with pytest.raises(ConfigError) as exc:
        plan(validate(tree))
    assert exc.value.problems[0].startswith(f"validation.control_images: {tmp_path / 'bad.png'}: ")
    tree["validation"]["control_images"][1] = str(tmp_path / "nope.png")
    assert plan(validate(tree)).family == FAMILY
    tree["model"]["pretrained"] = tiny("flux")
    with pytest.raises(ConfigError) as exc:
        plan(validate(tree))
    assert exc.value.problems == ["data.control_images: flux (FluxPipeline) takes no input "
                                  "image; image-edit pairs train a family that does (flux2, "
                                  "flux2klein, fluxkontext, qwenimageedit)"]
    # Qwen-Image-Edit samples only from an input image: it trains on pairs alone, and its
    # previews each need one.
    tree["model"]["pretrained"] = tiny("qwenimageedit")
    assert plan(validate(tree)).family == "qwenimageedit"
    del tree["validation"]["control_images"]
    with pytest.raises(ConfigError) as exc:
        plan(validate(tree))
    assert exc.value.problems == ["validation.control_images: QwenImageEditPlusPipeline samples "
                                  "only from an input image: give one per validation.prompts entry"]
    tree["data"]["control_images"] = False
    with pytest.raises(ConfigError) as exc:
        plan(validate({**tree, "validation": {}}))
    assert exc.value.problems == ["data.control_images: qwenimageedit (QwenImageEditPlusPipeline) "
                                  "edits an input image and samples only from one: train it on "
                                  "image-edit pairs (data.control_images: true)"]


# ---------------------------------------------------------------- the step


# every edit family with one input a sample, and a Flux.2 and Qwen-Image-Edit step of two
STEP_CASES = [(f, 1) for f in EDIT_FAMILIES] + [("flux2klein", 2), ("qwenimageedit", 2)]


@pytest.mark.parametrize("family,inputs", STEP_CASES, ids=[f"{f}-{n}" for f, n in STEP_CASES])
def test_the_step_gives_the_denoiser_the_input_tokens_and_the_cache_the_same_loss(tiny, tmp_path, family, inputs):
    """With control images the transformer sees the noisy image tokens and then each
    input's (twice the tokens with one input, three times with two) and the loss differs
    from the text-to-image step's; a batch from the latent cache (``control_params``,
    ``control_params_2``, encoded once) gives the loss the raw batch gives, for the same
    draws; the memory preflight sizes the longer sequence, more for two inputs."""
    from inproc import _fresh_accelerator

    from raylora.data.cache import EncodeStage, _stage_kwargs, encode_chunk, from_column
    from raylora.memory import estimate
    from raylora.train.setup import build_run
    from raylora.train.step import compute_loss

    model = tiny(family)
    uri = write_pairs(tmp_path / "d", "captionfolder", w=32, h=32, inputs=inputs)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": uri, "resolution": 32, "center_crop": True, "control_images": True,
                             "control_inputs": inputs},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 1, rank=0)
    rows = [{"image": pair(i, 32, 32)[0], "text": f"edit {i}", "control": pair(i, 32, 32)[1],
             **({"control_2": swapped(i, 32, 32)} if inputs == 2 else {})} for i in range(2)]
    pre, enc = _stage_kwargs(cfg, model, family, Storage())
    assert pre["controls"] is True and pre["control_inputs"] == inputs
    raw = {k: torch.from_numpy(v) for k, v in run_stage(Preprocess(StageSpec(**pre)), rows).items()}
    cached = {k: from_column(v) for k, v in encode_chunk(Preprocess(StageSpec(**pre)),
                                                          EncodeStage(**enc), rows).items()}
    names = [control_key("control_params", k) for k in range(inputs)]
    assert sorted(k for k in cached if k.startswith("control_params")) == names
    assert all(cached[k].shape == cached["latent_params"].shape for k in names)

    tokens: list[int] = []
    net = run.accelerator.unwrap_model(run.model)
    hook = net.register_forward_pre_hook(
        lambda m, a, kw: tokens.append(kw["hidden_states"].shape[1]), with_kwargs=True)

    def loss(batch):
        torch.manual_seed(0)
        with torch.no_grad():
            return compute_loss(run.model, run.parts, batch).item()

    text = {k: v for k, v in raw.items() if not k.startswith("control_values")}
    with_ref, from_cache = loss(raw), loss(cached)
    with pytest.raises(ValueError, match="^data.control_images: a batch without control images"):
        loss(text)
    run.parts.control_images = False  # the family's text-to-image step, for comparison
    text_only = loss(text)
    hook.remove()
    n = tokens[-1]  # the text-to-image step's image tokens
    # 32 px → a 2×2-patched 16² latent grid
    assert tokens == [(1 + inputs) * n, (1 + inputs) * n, n] and n == 64
    assert abs(with_ref - from_cache) < 1e-5 and abs(with_ref - text_only) > 1e-4
    kw = dict(batch_size=1, resolution=32, mixed_precision="no", device="cpu",
              max_sequence_length=32)
    paired, plain = estimate(model, control_images=inputs, **kw), estimate(model, **kw)
    assert paired.activations > plain.activations
    words = ", an input image per sample" if inputs == 1 else ", 2 input images per sample"
    assert words in paired.table().splitlines()[0]
    assert "input image" not in plain.table()
    if inputs == 2:  # the second input's tokens cost more than the first's alone
        assert paired.activations > estimate(model, control_images=1, **kw).activations


@pytest.mark.integration
def test_control_images_reach_training_rows_through_ray_data(ray_local, tiny, tmp_path):
    """A mix of a parquet source (its control column) and a WebDataset (its tar members),
    read by Ray Data as training reads them, random crops and flips on: every row's
    ``control_values`` is its ``pixel_values``' negative, cut the same way."""
    from raylora.data.plan import plan_data
    from raylora.data.source import build_dataset

    model = tiny(FAMILY)
    sources = [{"uri": write_pairs(tmp_path / f, f, n=3)} for f in ("parquet", "webdataset")]
    data = validate({"model": {"pretrained": model}, "output": {"uri": "o"},
                     "data": {"sources": sources, "resolution": 32, "random_flip": True,
                              "control_images": True}}).data
    rows = build_dataset(data, plan_data(data, Storage()), Storage(), model_path=model, seed=1,
                         family=FAMILY).take_all()
    assert len(rows) == 6
    for r in rows:
        assert r["control_values"].shape == r["pixel_values"].shape == (3, 32, 32)
        np.testing.assert_array_equal(r["control_values"], 255 - r["pixel_values"])


@pytest.mark.parametrize("family", [FAMILY, "qwenimageedit"])
def test_the_bucketed_cache_keeps_each_inputs_latents_beside_its_targets(tiny, tmp_path, family):
    """data.bucketing with the latent cache: rows of two buckets are encoded bucket by
    bucket and put back in order; each row's ``control_params`` has its
    ``latent_params``' shape, and is the posterior of its own input (an image's negative
    has other latents than the image). Qwen-Image-Edit's captions are encoded with their
    inputs: a bucket's inputs have their own number of vision tokens."""
    from raylora.data.cache import EncodeStage, _stage_kwargs, encode_chunk

    model = tiny(family)
    uri = write_pairs(tmp_path / "d", "captionfolder")
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": uri, "resolution": 32, "center_crop": True, "bucketing": True,
                             "bucket_step": 16, "sharding": "files", "control_images": True,
                             "cache": "latents"},
                    "output": {"uri": str(tmp_path / "o")}})
    pre, enc = _stage_kwargs(cfg, model, family, Storage())
    sizes = [(48, 24), (24, 48), (48, 24)]  # (w, h): a wide bucket, a tall one, the wide again
    rows = [{"image": pair(i, w, h)[0], "text": f"e{i}", "control": pair(i, w, h)[1]}
            for i, (w, h) in enumerate(sizes)]
    out = encode_chunk(Preprocess(StageSpec(**pre)), EncodeStage(**enc), rows)
    assert out["bucket"].tolist()[0] == out["bucket"].tolist()[2] != out["bucket"].tolist()[1]
    shapes = [np.asarray(p).shape for p in out["latent_params"]]
    assert [np.asarray(c).shape for c in out["control_params"]] == shapes
    assert shapes[0] == shapes[2] != shapes[1] and shapes[0][-1] > shapes[0][-2]  # wide
    for lat, ctl in zip(out["latent_params"], out["control_params"]):
        assert np.abs(np.asarray(lat) - np.asarray(ctl)).max() > 1e-3
    if family == "qwenimageedit":  # each caption's conditioning holds its input's vision tokens
        from raylora.model.families.qwenimageedit import vision_tokens
        from transformers import AutoConfig

        vc = AutoConfig.from_pretrained(model, subfolder="text_encoder").vision_config
        for (w, h), m in zip(sizes, out["prompt_embeds_mask"]):
            n = vision_tokens((h, w), vc)
            assert n > 100 and int(np.asarray(m).sum()) > n


def test_the_cache_keeps_each_inputs_latents_and_tells_input_counts_apart(tiny, tmp_path):
    """Two inputs through the bucketed latent cache: ``control_params_2`` per bucket, of
    its row's ``latent_params``' shape, the posterior of its own input (neither the
    target's nor input 1's). The fingerprint differs from one input's over the same
    shard, and with the inputs' columns swapped; the same config gives the same one."""
    from raylora.data.cache import EncodeStage, _stage_kwargs, encode_chunk, fingerprint
    from raylora.data.plan import plan_data

    model = tiny(FAMILY)
    uri = write_pairs(tmp_path / "d", "parquet", inputs=2)

    def config(**data):
        return validate({"model": {"pretrained": model, "max_sequence_length": 32},
                         "data": {"uri": uri, "resolution": 32, "center_crop": True,
                                  "bucketing": True, "bucket_step": 16, "sharding": "files",
                                  "control_images": True, "cache": "latents", **data},
                         "output": {"uri": str(tmp_path / "o")}})

    cfg = config(control_inputs=2)
    pre, enc = _stage_kwargs(cfg, model, FAMILY, Storage())
    assert pre["control_inputs"] == 2
    sizes = [(48, 24), (24, 48), (48, 24)]
    rows = [{"image": pair(i, w, h)[0], "text": f"e{i}", "control": pair(i, w, h)[1],
             "control_2": swapped(i, w, h)} for i, (w, h) in enumerate(sizes)]
    out = encode_chunk(Preprocess(StageSpec(**pre)), EncodeStage(**enc), rows)
    assert out["bucket"].tolist()[0] == out["bucket"].tolist()[2] != out["bucket"].tolist()[1]
    assert out["control_params_2"].dtype == object  # a variable-shaped column, as latent_params
    shapes = [np.asarray(p).shape for p in out["latent_params"]]
    assert [np.asarray(c).shape for c in out["control_params_2"]] == shapes
    assert shapes[0] == shapes[2] != shapes[1] and "control_params_3" not in out
    for lat, first, second in zip(out["latent_params"], out["control_params"], out["control_params_2"]):
        lat, first, second = (np.asarray(a, dtype=np.float32) for a in (lat, first, second))
        assert np.abs(second - lat).max() > 1e-3 and np.abs(second - first).max() > 1e-3
    # each input's posterior is its own: input 2 encoded alone as a row's only input
    alone = encode_chunk(Preprocess(StageSpec(**{**pre, "control_inputs": 1})), EncodeStage(**enc),
                         [{**r, "control": r["control_2"]} for r in rows])
    for a, b in zip(alone["control_params"], out["control_params_2"]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)

    def key(c) -> str:
        return fingerprint(c, FAMILY, model, plan_data(c.data, Storage()), Storage())

    one, two = key(config()), key(cfg)
    swapped_columns = key(config(control_inputs=2, control_column=["control_image_2", "control_image"]))
    assert len({one, two, swapped_columns}) == 3 and key(config(control_inputs=2)) == two


def test_the_cache_key_holds_the_processor_qwen_image_edits_text_encoder_reads(tiny, tmp_path):
    """Qwen-Image-Edit's text encoder sees the input images through processor/'s image
    processor, which was not in the latent cache's key: a fine-tune's folder with another
    processor reused the entry's caption embeddings (max |diff| 1.3 against a fresh build)."""
    from raylora.data.cache import fingerprint
    from raylora.data.plan import plan_data

    model = shutil.copytree(tiny("qwenimageedit"), tmp_path / "m")
    cfg = validate({"model": {"pretrained": str(model), "max_sequence_length": 32},
                    "data": {"uri": write_pairs(tmp_path / "d", "parquet"), "resolution": 32,
                             "center_crop": True, "control_images": True, "cache": "latents"},
                    "output": {"uri": str(tmp_path / "o")}})

    def key() -> str:
        return fingerprint(cfg, "qwenimageedit", str(model), plan_data(cfg.data, Storage()), Storage())

    before = key()
    config = model / "processor" / "preprocessor_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    assert key() != before


# ---------------------------------------------------------------- a run, end to end


@pytest.mark.integration
@pytest.mark.parametrize("family,inputs", [(FAMILY, 1), ("qwenimageedit", 2)],
                         ids=[FAMILY, "qwenimageedit-2"])
def test_an_edit_run_on_pairs_edits_in_the_stock_pipeline(ray_local, tiny, tmp_path, family, inputs):
    """``raylora train`` on a WebDataset of pairs (Qwen-Image-Edit: of samples with two
    inputs, data.control_inputs: 2), through the latent cache (the inputs encoded once:
    Qwen-Image-Edit's captions with them), with held-out samples and a preview of an input
    image (two): the held-out loss moves, the adapter loads in the family's stock pipeline
    (FluxKontextPipeline, QwenImageEditPlusPipeline) and changes what it makes of its
    input(s), the card shows the edit call, and ``raylora sample --image`` (given twice)
    writes an edit of the asked size."""
    from raylora.launch import run
    from raylora.sample import sample
    from stock import PIPELINES, edit_input, stock_pipeline

    model = tiny(family)
    data = write_pairs(tmp_path / "pairs", "webdataset", n=8, w=32, h=32, inputs=inputs)
    sources = [tmp_path / f"input{k}.png" for k in range(inputs)]
    for k, source in enumerate(sources):
        Image.fromarray(pattern(11 + k, 32, 32)).save(source)
    source = sources[0]
    given = [str(x) for x in sources] if inputs > 1 else str(source)
    out = tmp_path / "out"
    summary = run(validate({
        "model": {"pretrained": model, "max_sequence_length": 32},
        "data": {"uri": data, "resolution": 32, "center_crop": True, "control_images": True,
                 "control_inputs": inputs, "cache": "latents", "validation_split": 0.3},
        "lora": {"rank": 4},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-2, "seed": 1},
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": 4},
        "validation": {"prompts": ["edit it"], "control_images": [given],
                       "num_inference_steps": 2},
        "output": {"uri": str(out)},
    }))
    m = summary["metrics"]
    assert m["steps"] == 4 and np.isfinite(m["train_loss_last"])
    # evaluated on the held-out pairs, input tokens and all: before and after training
    assert np.isfinite(m["eval_loss_base"]) and np.isfinite(m["eval_loss_last"])
    assert m["eval_loss_base"] != m["eval_loss_last"]
    pipeline = PIPELINES[family][0]
    meta = json.loads((out / "adapter" / "raylora.json").read_text())["data"]
    assert (meta["family"], meta["pipeline"], meta["control_inputs"]) == (family, pipeline, inputs)
    # the preview grid: the input(s), then what the adapter made of them
    grid = np.asarray(Image.open(out / "validation" / "step_000004.png").convert("RGB"))
    assert grid.shape == (32, 32 * (1 + inputs), 3)
    for k in range(inputs):
        np.testing.assert_array_equal(grid[:, 32 * k:32 * (k + 1)], pattern(11 + k, 32, 32))
    card = (out / "adapter" / "README.md").read_text()
    fam = families.get(family)
    guidance = {FAMILY: "guidance_scale=2.5", "qwenimageedit": "true_cfg_scale=4.0, negative_prompt=[' ']"}
    image = 'load_image("your input image.png")' if inputs == 1 else \
        '[load_image("input 1.png"), load_image("input 2.png")]'
    # and the caption length it trained at (model.max_sequence_length)
    assert f'image = pipe(image={image}, prompt="your edit", {guidance[family]}, ' \
           'max_sequence_length=32).images[0]' in card

    pipe = stock_pipeline(family, model)
    pipe.set_progress_bar_config(disable=True)
    _, area = edit_input(pipeline, 32, 32)
    images = [Image.open(x) for x in sources]

    def edit():
        with area():
            return pipe(prompt="edit it", num_inference_steps=2, height=32, width=32,
                        generator=torch.Generator().manual_seed(0), output_type="np",
                        **{**PIPELINES[family][1], **fam.size_kwargs(32, 32)},
                        **fam.reference_kwargs(images if inputs > 1 else images[0], 32, 32)).images[0]

    before = edit()
    pipe.load_lora_weights(str(out / "adapter"))
    after = edit()
    assert after.shape == (32, 32, 3) and np.isfinite(after).all()
    assert np.abs(after - before).max() > 1e-3

    png_out = sample(model, str(out / "adapter"), "edit it", str(tmp_path / "s.png"), steps=2,
                     size=32, image=given)
    assert Image.open(png_out).size == (32, 32)
    with pytest.raises(ValueError, match=r"^--image: .*nope\.png: no such file$"):
        sample(model, str(out / "adapter"), "x", str(tmp_path / "t.png"), steps=1, size=32,
               image=str(tmp_path / "nope.png"))
    with pytest.raises(ValueError, match=r"^--image: sd \(StableDiffusionPipeline\) takes no input image$"):
        sample(tiny("sd"), str(out / "adapter"), "x", str(tmp_path / "t.png"), image=str(source))
    with pytest.raises(ValueError, match=r"^--image: Flux2KleinPipeline takes no input image under 64 px "
                                         r"a side; this one gets 32 px \(--size, else the image's own\)$"):
        sample(tiny("flux2klein"), str(out / "adapter"), "x", str(tmp_path / "t.png"), image=str(source))
    with pytest.raises(ValueError, match=r"^--image: 2 input images, but FluxKontextPipeline takes 1$"):
        sample(tiny(FAMILY), str(out / "adapter"), "x", str(tmp_path / "t.png"),
               image=[str(source), str(source)])
