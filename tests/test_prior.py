"""Prior preservation (DreamBooth): the loss maths, the class stream, every family's
paired batch (in-process, no Ray), and one end-to-end pair of runs on a local Ray that
generates the missing class images on 2 CPU actors, then reuses them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from raylora.config import ConfigError, validate
from raylora.train.loss import combine_prior, denoising_loss, split_pairs

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of
from raylora.model import families


# ---------------------------------------------------------------- pure


def test_prior_loss_is_instance_plus_weighted_class_mse():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, 5, 5, generator=g)
    w = torch.tensor([1.0, 2.0, 0.5, 3.0])
    (pi, ti, wi), (pc, tc, wc) = split_pairs(pred, target, w)
    # By hand: rows 0-1 are the instance samples, rows 2-3 the class samples.
    inst = ((pred[:2] - target[:2]) ** 2).mean(dim=(1, 2, 3))
    prior = ((pred[2:] - target[2:]) ** 2).mean(dim=(1, 2, 3))
    hand_i, hand_p = (inst * w[:2]).mean(), (prior * w[2:]).mean()
    torch.testing.assert_close(denoising_loss(pi, ti, wi), hand_i)
    torch.testing.assert_close(denoising_loss(pc, tc, wc), hand_p)
    torch.testing.assert_close(combine_prior(hand_i, hand_p, 0.3), hand_i + 0.3 * hand_p)
    # Weight 0: the instance-only loss (of the instance half alone).
    torch.testing.assert_close(combine_prior(denoising_loss(pi, ti), denoising_loss(pc, tc), 0.0),
                               denoising_loss(pred[:2], target[:2]))
    assert split_pairs(pred, None)[1][1] is None


def test_prior_loss_with_a_loss_mask_masks_each_half():
    """data.masked_loss with prior preservation: the mask splits with the batch, each half's
    squared error is masked before its mean, the terms combine as without masks."""
    from raylora.train.step import _prior_loss

    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, 2, 3, 3, generator=g)
    mask = torch.zeros(4, 1, 3, 3)
    mask[0, :, :, 0] = 1  # instance 0: one column; instance 1: nothing
    mask[2:] = 1  # class samples: unmasked (all ones, as the class stage emits them)
    se = (pred - target) ** 2
    hand_i = (se[:2] * mask[:2]).mean(dim=(1, 2, 3)).mean()
    hand_p = se[2:].mean()
    terms = {}
    got = _prior_loss(0.5, terms, pred, target, None, mask)
    torch.testing.assert_close(terms["loss_instance"], hand_i)
    torch.testing.assert_close(terms["loss_prior"], hand_p)
    torch.testing.assert_close(got, hand_i + 0.5 * hand_p)


def test_config_checks_name_the_keys(base_config):
    t = dict(base_config, data={**base_config["data"], "class_prompt": "a shape",
                                "cache": "latents", "bucketing": True})
    with pytest.raises(ConfigError) as e:
        validate(t)
    assert e.value.problems == ["data.bucketing: not supported with prior preservation (a batch "
                                "pairs instance and class images of one size); set it false"]
    t = dict(base_config, data={**base_config["data"], "class_generation": {"seed": 3}})
    with pytest.raises(ConfigError, match="data.class_generation: set, but prior preservation is off"):
        validate(t)
    ok = validate(dict(base_config, data={**base_config["data"], "class_sources": [
        {"uri": "/x", "prompt": "a dog"}]}, train={"prior_loss_weight": 0.5}))
    assert ok.data.prior_preservation and ok.train.prior_loss_weight == 0.5
    assert not validate(base_config).data.prior_preservation
    tune = {"search_space": {"data.num_class_images": {"choice": [10, 20]},
                             "train.prior_loss_weight": {"choice": [0.5, 1.0]}}}
    with pytest.raises(ConfigError) as e:
        validate(dict(base_config, data={**base_config["data"], "class_prompt": "a dog",
                                         "validation_split": 0.1}, tune=tune))
    assert e.value.problems == ["tune.search_space.data.num_class_images: the class images are "
                                "read (and generated) once for every trial; data.class_* and "
                                "data.num_class_images cannot be searched (train.prior_loss_weight can)"]


# ---------------------------------------------------------------- class stream


def _rows(n: int) -> list[dict]:
    from raylora.data.demo import make_samples

    return [{"image": img, "text": f"class {i}"} for i, (img, _) in enumerate(make_samples(n, size=48))]


def test_class_stream_cycles_seeded_per_rank_and_pairs_batches(tiny_model):
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.data.prior import ClassBatches, paired

    stage = Preprocess(StageSpec(tiny_model, 32, center_crop=False, random_flip=True))
    classes = ClassBatches(_rows(5), stage, seed=1, rank=0)
    # Every class row once before any twice, within a pass; pass and rank reshuffle.
    first = classes.indices(0, 0, 2) + classes.indices(0, 1, 2) + classes.indices(0, 2, 2)[:1]
    assert sorted(first) == [0, 1, 2, 3, 4]
    assert classes.indices(0, 1, 2) == ClassBatches(_rows(5), stage, 1, 0).indices(0, 1, 2)
    other = ClassBatches(_rows(5), stage, seed=1, rank=1)
    assert [other.indices(0, i, 5) for i in range(3)] != [classes.indices(0, i, 5) for i in range(3)]

    inst = {"pixel_values": np.zeros((2, 3, 32, 32), np.uint8),
            "input_ids": np.zeros((2, 77), np.int64),
            **{k: np.zeros((2, 2), np.int64) for k in ("original_size", "crop_top_left", "target_size")}}
    out = list(paired(iter([(0, inst), (0, inst), (1, inst)]), classes))
    assert [e for e, _ in out] == [0, 0, 1]
    b = out[1][1]
    assert b["pixel_values"].shape == (4, 3, 32, 32) and b["input_ids"].shape == (4, 77)
    assert (b["pixel_values"][:2] == 0).all() and b["pixel_values"][2:].any()
    # Batch 1 of pass 0, again: the same class rows and the same crop/flip draws.
    again = classes.batch(0, 1, 2)
    np.testing.assert_array_equal(b["pixel_values"][2:], again["pixel_values"])
    np.testing.assert_array_equal(b["input_ids"][2:], again["input_ids"])


# ---------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_on_paired_batches(tiny, family, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch

    from raylora.train.setup import build_run
    from raylora.train.step import compute_loss

    model = tiny(family)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64, "class_prompt": "a shape"},
                    "train": {"prior_loss_weight": 0.5, "seed": 0},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 1, rank=0)
    assert run.parts.prior_loss_weight == 0.5
    rows = demo_batch(family, model, demo_data, n=6)
    pick = lambda idx: {k: v[idx] for k, v in rows.items()}  # noqa: E731

    def loss_of(batch):
        torch.manual_seed(0)
        terms = {}
        loss = compute_loss(run.model, run.parts, batch, terms)
        return loss, terms

    # Instance rows 0-1, class rows 2-3 (then 4-5): the family seam encodes the 4 as one batch.
    loss, terms = loss_of(pick([0, 1, 2, 3]))
    torch.testing.assert_close(loss.detach(), terms["loss_instance"] + 0.5 * terms["loss_prior"])
    assert torch.isfinite(loss) and terms["loss_prior"] > 0
    loss.backward()
    grads = [p.grad for p in run.params if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    # Other class samples, same draws: the instance term (first half) does not move.
    _, other = loss_of(pick([0, 1, 4, 5]))
    torch.testing.assert_close(other["loss_instance"], terms["loss_instance"], rtol=1e-5, atol=1e-6)
    assert abs(float(other["loss_prior"] - terms["loss_prior"])) > 1e-6


# Class images are text to image: a family whose pipeline samples only from an input image
# trains on edit pairs, which prior preservation is refused with (test_edit).
@pytest.mark.parametrize("family", [f for f in FAMILIES if not families.get(f).reference_required])
def test_every_family_generates_class_images_with_its_stock_pipeline(tiny, family, tmp_path):
    """The generation stage itself (what each Ray Data actor runs), in this process."""
    from PIL import Image

    from raylora.data.classgen import GenerateStage, _present
    from raylora.model import families

    out = str(tmp_path / "gen")
    stage = GenerateStage(tiny(family), family, "a photo of a shape", out, resolution=32,
                          steps=2, guidance=2.0, max_sequence_length=32)
    # Its text encoders are the ones a training worker holds (the family's adaptation:
    # Flux.2's Mistral without its vision tower, LM head and unused layers), not the
    # stock pipeline's own.
    fam = families.get(family)
    stock = fam.load_pipeline(tiny(family))
    for t in fam.text:
        mine, theirs = getattr(stage.pipe, t.encoder), getattr(stock, t.encoder)
        size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        if family in ("flux2", "flux2klein"):
            assert size(mine) < size(theirs)
        else:
            assert type(mine) is type(theirs) and size(mine) == size(theirs)
    rows: list[int] = []  # batch rows of each denoiser call
    denoiser = getattr(stage.pipe, families.get(family).denoiser)

    def count(mod, args, kw):
        x = args[0] if args else kw["hidden_states"]
        rows.append(len(x) if isinstance(x, list) else x.shape[0])  # Z-Image: a list of images

    denoiser.register_forward_pre_hook(count, with_kwargs=True)
    got = stage({"index": np.array([3, 4]), "seed": np.array([8, 9])})
    assert got["index"].tolist() == [3, 4] and _present(out, _store()) == {3, 4}
    # Guided at 2.0: per step the 2 prompts and their unconditional twins, in one batched
    # call (SD, SDXL, SD3, Sana) or, Qwen-Image (2.1 too), Chroma, Lumina-Image 2.0, Flux.2
    # [klein] and Wan, a second call with the negative prompts. Flux.1-dev (and Kontext) and
    # Flux.2 [dev] are guidance-distilled: the scale is an input of their one call.
    per_step = {"flux": [2], "fluxkontext": [2], "chroma": [2, 2], "qwenimage": [2, 2], "qwenimage21": [2, 2], "flux2klein": [2, 2],
                "flux2": [2], "wan": [2, 2], "lumina2": [2, 2]}.get(family, [4])
    assert rows == per_step * 2
    img = Image.open(os.path.join(out, "00003.png"))
    assert img.size == (32, 32)
    assert open(os.path.join(out, "00004.txt")).read() == "a photo of a shape"
    # Seeded per image: image 3 again (alone, another batch) is the same picture.
    stage({"index": np.array([5]), "seed": np.array([8])})
    a, b = (np.asarray(Image.open(os.path.join(out, f"0000{i}.png"))) for i in (3, 5))
    np.testing.assert_allclose(a.astype(float), b.astype(float), atol=2)


def test_class_images_are_generated_with_the_text_encoders_quantized_as_configured(tiny, tmp_path):
    """model.quantize_text_encoders reaches the generation stage: Flux.2 [dev]'s adapted
    Mistral in nf4, and the image it renders differs from the unquantized one's only by
    what the quantization changes (same seed, same size, finite)."""
    import bitsandbytes as bnb
    from PIL import Image

    from raylora.data.classgen import GenerateStage

    images = {}
    for kind in ("none", "nf4"):
        out = str(tmp_path / kind)
        stage = GenerateStage(tiny("flux2"), "flux2", "a photo of a shape", out, resolution=32,
                              steps=2, guidance=2.0, max_sequence_length=32,
                              model={"quantize_text_encoders": kind})
        quantized = [m for m in stage.pipe.text_encoder.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert bool(quantized) == (kind == "nf4")
        stage({"index": np.array([0]), "seed": np.array([4])})
        images[kind] = np.asarray(Image.open(os.path.join(out, "00000.png"))).astype(float)
    assert images["nf4"].shape == images["none"].shape == (32, 32, 3)
    assert np.abs(images["nf4"] - images["none"]).max() > 0


def test_a_generation_key_is_what_changes_the_images_not_their_count():
    """A generated folder is found by its key: the key names the pipeline call, the model
    and the prompt's padded length, not how many images a run wants (image i is seed + i
    whatever the count), so a run that wants more tops the folder up. Pinned: a change to
    the key makes every user's folder be drawn again."""
    from raylora.data.classgen import generation_key

    cfg = validate({"model": {"pretrained": "org/base"},
                    "data": {"uri": "/nowhere", "resolution": 32, "class_prompt": "a dog",
                             "class_sources": [{"uri": "/x", "prompt": "a dog"}],
                             "num_class_images": 3},
                    "output": {"uri": "/o"}})
    keys = {f: generation_key(cfg, f, "org/base", _store()) for f in FAMILIES}
    assert len(set(keys.values())) == len(FAMILIES) and all(len(k) == 16 for k in keys.values())
    assert {f: keys[f] for f in ("sd", "sdxl")} == PINNED_KEYS
    tree = cfg.model_dump()
    tree["data"]["num_class_images"] = 30  # more images: the same folder
    assert generation_key(validate(tree), "sd", "org/base", _store()) == keys["sd"]
    for section, key, value in (("model", "quantize_text_encoders", "nf4"),  # other images
                                ("model", "max_sequence_length", 128), ("data", "class_prompt", "a cat")):
        other = cfg.model_dump()
        other[section][key] = value
        assert generation_key(validate(other), "sd", "org/base", _store()) != keys["sd"], key


# sdxl changed on 2026-12-06: its call names negative_prompt "" (the empty prompt its
# dropped captions train on), which draws other images than its all-zero default
PINNED_KEYS = {"sd": "70ae0000c4f25c39", "sdxl": "003c8d384e5ec8f2"}


def test_class_rows_need_a_prompt_and_an_interrupted_folder_is_completed(tiny_model, demo_data,
                                                                         tmp_path):
    """Without Ray: the user's images are counted (generated ones left out), a row without
    caption or prompt and a shortfall without data.class_prompt are refused by key, and a
    generated folder whose build stopped before its manifest is taken over, not redone."""
    from raylora.data.classgen import GenerateStage, ensure_class_images, generation_key

    given = tmp_path / "dogs"
    given.mkdir()
    for i, row in enumerate(_rows(2)):
        (given / f"g{i}.png").write_bytes(row["image"])
    (given / "g0.txt").write_text("a dog on grass")

    def cfg(**data):
        return validate({"model": {"pretrained": tiny_model},
                         "data": {"uri": demo_data, "resolution": 32, "class_sources": str(given),
                                  "num_class_images": 3, **data},
                         "output": {"uri": str(tmp_path / "o")}})

    with pytest.raises(ValueError, match=r"data.class_sources: .*g1.png has no caption"):
        ensure_class_images(cfg(), "sd", tiny_model, _store())
    with pytest.raises(ValueError, match="data.num_class_images: 3 wanted, data.class_sources has 2"):
        ensure_class_images(cfg(num_class_images=3, class_sources=[
            {"uri": str(given), "prompt": "a dog"}]), "sd", tiny_model, _store())
    c = cfg(class_prompt="a dog", class_generation={"num_inference_steps": 2})
    # An interrupted build: its one image written, no manifest yet.
    folder = given / "raylora-generated" / generation_key(c, "sd", tiny_model, _store())
    GenerateStage(tiny_model, "sd", "a dog", str(folder), 32, 2, 7.5)(
        {"index": np.array([0]), "seed": np.array([0])})
    found = ensure_class_images(c, "sd", tiny_model, _store())
    assert [r["text"] for r in found.rows] == ["a dog on grass", "a dog", "a dog"]
    assert (found.user_rows, found.generated, found.uri) == (2, 0, str(folder))
    assert json.load(open(folder / "manifest.json"))["files"] == ["00000.png"]
    # Now complete: the next call counts the same (the generated image is not a user's).
    again = ensure_class_images(c, "sd", tiny_model, _store())
    assert again.summary() == found.summary()
    # One more wanted: the same folder, topped up (image 1 is seed + 1 whatever the count;
    # here already drawn, as an interrupted top-up leaves it), image 0 kept as it was.
    stamp = (folder / "00000.png").stat().st_mtime_ns
    GenerateStage(tiny_model, "sd", "a dog", str(folder), 32, 2, 7.5)(
        {"index": np.array([1]), "seed": np.array([1])})
    more = ensure_class_images(cfg(class_prompt="a dog", num_class_images=4,
                                   class_generation={"num_inference_steps": 2}), "sd", tiny_model, _store())
    assert (more.user_rows, more.generated, more.uri, len(more.rows)) == (2, 0, str(folder), 4)
    assert json.load(open(folder / "manifest.json"))["count"] == 2
    assert (folder / "00000.png").stat().st_mtime_ns == stamp

    # Class images without captions, beside parquet instance data (data.format: parquet,
    # as `raylora demo-data` writes): the folder is read as what it is, each image taking
    # the prompt (they were refused as uncaptioned, or skipped as "no parquet files").
    from raylora.data.classgen import read_user_rows

    plain = tmp_path / "plain"
    plain.mkdir()
    for i, row in enumerate(_rows(3)):
        (plain / f"p{i}.png").write_bytes(row["image"])
    d = cfg(format="parquet", class_sources=str(plain), class_prompt="a dog").data
    assert [r["text"] for r in read_user_rows(d, _store(), str(plain / "raylora-generated"), 3)] == ["a dog"] * 3
    # ...with a README beside them (an hf:// class repo always has one), or as an image
    # folder whose metadata has no caption key: still images taking their prompt (the
    # checks that refuse such instance data do not apply to class images)
    (plain / "README.md").write_text("class images")
    assert [r["text"] for r in read_user_rows(d, _store(), str(plain / "raylora-generated"), 3)] == ["a dog"] * 3
    (plain / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"p{i}.png", "label": 1}) + "\n"
                                                  for i in range(3)))
    assert [r["text"] for r in read_user_rows(d, _store(), str(plain / "raylora-generated"), 3)] == ["a dog"] * 3

    # kohya's reg_data_dir layout, 1_dog/ without caption files: the prompt set for them
    # (data.class_prompt, else the source's) is their caption, not the folder's class
    # tokens ("dog" it was, beside top-ups generated with the prompt); a caption file wins.
    reg = tmp_path / "reg" / "1_dog"
    reg.mkdir(parents=True)
    for i, row in enumerate(_rows(3)):
        (reg / f"r{i}.png").write_bytes(row["image"])
    (reg / "r2.txt").write_text("a dog on a sofa")
    skip = str(tmp_path / "reg" / "raylora-generated")
    for given in ({"class_sources": str(tmp_path / "reg"), "class_prompt": "a photo of a dog"},
                  {"class_sources": [{"uri": str(tmp_path / "reg"), "prompt": "a photo of a dog"}],
                   "class_prompt": "a dog"}):
        got = read_user_rows(cfg(format="parquet", **given).data, _store(), skip, 3)
        assert [r["text"] for r in got] == ["a photo of a dog"] * 2 + ["a dog on a sofa"], given


def _class_cfg(tiny_model, demo_data, out, **data):
    from raylora.launch import resolve_paths

    return resolve_paths(validate({"model": {"pretrained": tiny_model},
                                   "data": {"uri": demo_data, "resolution": 32,
                                            "class_prompt": "a dog", "num_class_images": 3, **data},
                                   "output": {"uri": str(out)}}))


def test_class_images_are_generated_beside_the_output_unless_the_source_is_one_writable_folder(
        tiny_model, demo_data, tmp_path, monkeypatch):
    """The generated root: {data.class_sources}/raylora-generated only for one folder this
    process can write (where earlier runs put them, still found there); a single file (a
    path inside a file: the actors died with NotADirectoryError), a glob, a brace list,
    hf:// (read only) or a folder it cannot write: {output.uri}/class_images."""
    from raylora.data.classgen import generated_root
    from raylora.storage import Storage

    folder = tmp_path / "dogs"
    folder.mkdir()
    single = tmp_path / "dogs.parquet"
    single.write_bytes(b"PAR1")
    out = str(tmp_path / "o" / "class_images")
    for given, want in ((str(folder), str(folder / "raylora-generated")),
                        (str(tmp_path / "not-yet"), str(tmp_path / "not-yet" / "raylora-generated")),
                        (str(single), out), (f"{folder}/*.png", out), (f"{tmp_path}/{{a,b}}", out),
                        ("hf://datasets/someone/dog-photos", out)):
        assert generated_root(_class_cfg(tiny_model, demo_data, tmp_path / "o",
                                         class_sources=given)) == want, given
    # A folder on a read-only mount (as root here, permission bits are not one: the
    # write probe's answer is set)
    ro = str(folder)
    monkeypatch.setattr(Storage, "write_problem",
                        lambda self, uri: f"{uri}: no permission to write in {ro}" if uri == ro else None)
    cfg = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_sources=ro)
    assert generated_root(cfg) == out
    from raylora.data.classgen import generated_place

    assert generated_place(cfg, Storage()) == ("output.uri", out)


def test_the_generated_class_root_is_checked_before_ray(tiny_model, demo_data, tmp_path, monkeypatch):
    """launch.write_problems names data.class_generation.uri when the run may generate
    there and cannot write, or when it lies inside the instance data (the next run would
    train on the generated images); a root it cannot write that already holds generated
    folders passes (a shared read-only set: ensure_class_images checks the folder it would
    write, still before any actor loads a pipeline)."""
    from raylora.data.classgen import ensure_class_images
    from raylora.launch import write_problems
    from raylora.storage import Storage

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = _class_cfg(tiny_model, demo_data, tmp_path / "o",
                     class_generation={"uri": str(blocker / "gen")})
    assert write_problems(cfg, Storage()) == [
        f"data.class_generation.uri: the missing class images are generated into {blocker}/gen, "
        f"but {blocker}/gen: {blocker} is a file, not a folder"]
    # Without data.class_prompt nothing is generated: nothing to check
    quiet = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_prompt=None,
                       class_sources=str(blocker))
    assert write_problems(quiet, Storage()) == []
    inside = _class_cfg(tiny_model, demo_data, tmp_path / "o",
                        class_generation={"uri": f"{demo_data}/class-gen"})
    assert [p.split(" is inside ")[0] for p in write_problems(inside, Storage())] == \
        [f"data.class_generation.uri: {demo_data}/class-gen"]
    # A class folder inside the instance data: its raylora-generated folder too
    (tmp_path / "shards").mkdir()
    nested = _class_cfg(tiny_model, f"{tmp_path}/shards", tmp_path / "o",
                        class_sources=f"{tmp_path}/shards/dogs")
    assert [p.split(" is inside ")[0] for p in write_problems(nested, Storage())] == \
        [f"data.class_sources: {tmp_path}/shards/dogs/raylora-generated"]

    readonly = tmp_path / "readonly"
    (readonly / "0123456789abcdef").mkdir(parents=True)
    (readonly / "0123456789abcdef" / "manifest.json").write_text('{"count": 3}')
    monkeypatch.setattr(Storage, "write_problem", lambda self, uri: (
        f"{uri}: no permission to write in {readonly}" if uri.startswith(str(readonly)) else None))
    ro = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_generation={"uri": str(readonly)})
    assert write_problems(ro, Storage()) == []

    def never(*a, **k):
        raise AssertionError("generated")

    monkeypatch.setattr("raylora.data.classgen.generate", never)
    with pytest.raises(ConfigError) as e:  # not this model's folder: it would write
        ensure_class_images(ro, "sd", tiny_model, Storage())
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(
        f"data.class_generation.uri: 3 class image(s) to generate into {readonly}/") \
        and e.value.problems[0].endswith(f": no permission to write in {readonly}")


def test_bad_class_images_are_refused_by_file_before_any_is_generated(tiny_model, demo_data,
                                                                      tmp_path, monkeypatch):
    """A truncated class image, or one under data.min_size, was found only when a batch
    first drew it (any number of steps in), with a message naming no file and calling a
    too-small image undecodable. The driver judges every class row as the workers' class
    stage does, and refuses each by file and reason, before generating anything."""
    from raylora.data.classgen import ensure_class_images
    from raylora.data.demo import make_samples
    from raylora.launch import apply_class_images, plan
    from raylora.storage import Storage

    def never(*a, **k):
        raise AssertionError("generated")

    monkeypatch.setattr("raylora.data.classgen.generate", never)
    given = tmp_path / "dogs"
    given.mkdir()
    big = [img for img, _ in make_samples(3, size=64)]
    (given / "a.png").write_bytes(big[0])
    (given / "b.png").write_bytes(big[1][:200])  # truncated
    (given / "c.png").write_bytes(_rows(1)[0]["image"])  # 48x48
    (given / "d.png").write_bytes(big[2])
    cfg = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_sources=str(given),
                     min_size=56, num_class_images=6)
    with pytest.raises(ConfigError) as e:
        apply_class_images(cfg, plan(cfg))
    got = e.value.problems
    assert len(got) == 3, got
    assert got[0].startswith(f"data.class_sources: {given}/b.png: corrupt_image: ")
    assert got[0].endswith("; check that the images were copied whole")
    assert got[1] == (f"data.class_sources: {given}/c.png: too_small: 48x48 < data.min_size=56; "
                      "lower data.min_size, or set data.small_images: upscale")
    assert got[2].startswith("data.class_sources: replace or remove the 2 class image(s) above")
    # Only the rows the run uses are judged: the first 2 are a.png and b.png
    with pytest.raises(ConfigError) as e:
        ensure_class_images(cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"num_class_images": 2})}), "sd", tiny_model, Storage())
    assert [p.split(": ")[1] for p in e.value.problems[:-1]] == [f"{given}/b.png"]
    # List form: the entry's key
    (given / "b.png").unlink()
    listed = _class_cfg(tiny_model, demo_data, tmp_path / "o", min_size=56, num_class_images=3,
                        class_sources=[{"uri": str(tmp_path / "none"), "prompt": "a dog"},
                                       {"uri": str(given)}])
    with pytest.raises(ConfigError) as e:
        ensure_class_images(listed, "sd", tiny_model, Storage())
    assert e.value.problems[0].startswith(f"data.class_sources[1]: {given}/c.png: too_small: ")
    # Good ones (too small no more): read, with where each is
    ok = cfg.model_copy(update={"data": cfg.data.model_copy(update={"min_size": 0, "num_class_images": 3})})
    found = ensure_class_images(ok, "sd", tiny_model, Storage())
    assert [r["key"] for r in found.rows] == [f"{given}/{n}.png" for n in "acd"]
    # Generated images would all be too small (drawn at data.resolution): refused before
    # generating them
    with pytest.raises(ConfigError) as e:
        ensure_class_images(cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"min_size": 40, "num_class_images": 5})}), "sd", tiny_model, Storage())
    assert e.value.problems == [
        "data.min_size: 40 is above data.resolution 32, the size the 2 missing class image(s) "
        "are generated at: the class stage would drop every one (data.small_images: skip); "
        "lower data.min_size, or set data.small_images: upscale"]


def test_a_class_image_a_worker_cannot_decode_is_named_in_its_error(tiny_model):
    """ClassBatches' own error (a worker whose decoders differ from the driver's): which
    file, and why."""
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.data.prior import ClassBatches

    rows = [dict(r, key=f"/c/{i}.png") for i, r in enumerate(_rows(2))]
    rows[1]["image"] = rows[1]["image"][:200]
    classes = ClassBatches(rows, Preprocess(StageSpec(tiny_model, 32, center_crop=True, random_flip=False)), seed=0, rank=0)
    with pytest.raises(ValueError) as e:
        classes.batch(0, 0, 2)
    assert "1 class image(s) of this batch could not be decoded on this worker (/c/1.png: " \
        "corrupt_image: " in str(e.value)


def test_images_an_earlier_run_generated_in_a_class_folder_are_never_user_images(
        tiny_model, demo_data, tmp_path):
    """{folder}/raylora-generated/<key>/ from a run with class_sources: folder was read as
    the user's own class images (captioned with the prompt of whatever model drew them)
    once the generated root moved: the folder given as a list entry, or
    data.class_generation.uri set. Any raylora-generated folder below a source is left
    out, at any depth; a source that is such a folder itself is read whole."""
    from raylora.data.classgen import generated_root, read_user_rows

    dogs = tmp_path / "dogs"
    old = dogs / "raylora-generated" / "0123456789abcdef"
    deep = dogs / "sub" / "raylora-generated" / "fedcba9876543210"
    for d in (old, deep):
        d.mkdir(parents=True)
    rows = _rows(4)
    for i in range(2):
        (dogs / f"user{i}.png").write_bytes(rows[i]["image"])
    (old / "00000.png").write_bytes(rows[2]["image"])
    (old / "00000.txt").write_text("a dog (old model)")
    (deep / "00000.png").write_bytes(rows[3]["image"])
    for given, extra in ((str(dogs), {}), ([{"uri": str(dogs)}], {}),
                         (str(dogs), {"class_generation": {"uri": str(tmp_path / "gen")}})):
        cfg = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_sources=given,
                         num_class_images=10, **extra)
        got = read_user_rows(cfg.data, _store(), generated_root(cfg), 10)
        assert [r["text"] for r in got] == ["a dog", "a dog"], given
        assert [r["key"].rsplit("/", 1)[-1] for r in got] == ["user0.png", "user1.png"]
    itself = _class_cfg(tiny_model, demo_data, tmp_path / "o", class_sources=str(old.parent))
    assert [r["text"] for r in read_user_rows(itself.data, _store(), generated_root(itself), 10)] \
        == ["a dog (old model)"]


def _store():
    from raylora.storage import Storage

    return Storage()


# ---------------------------------------------------------------- end to end (Ray)


@pytest.fixture(scope="module")
def class_dir(tmp_path_factory):
    """A class folder with 2 images and no captions (they take data.class_prompt)."""
    d = tmp_path_factory.mktemp("classes") / "dogs"
    d.mkdir()
    for i, row in enumerate(_rows(2)):
        (d / f"given{i}.png").write_bytes(row["image"])
    return str(d)


def _tree(tiny_model, demo_data, class_dir, out):
    return {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 32, "center_crop": True,
                 "class_sources": class_dir, "class_prompt": "a photo of a shape",
                 "num_class_images": 4,
                 "class_generation": {"num_inference_steps": 2, "batch_size": 1, "seed": 5}},
        "train": {"batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "prior_loss_weight": 0.7},
        "checkpoint": {"every_n_steps": 2},
        "output": {"uri": str(out)},
    }


@pytest.mark.integration
def test_generates_missing_class_images_then_reuses_them(ray_local, tiny_model, demo_data,
                                                         class_dir, tmp_path):
    from raylora.launch import run

    first = run(validate(_tree(tiny_model, demo_data, class_dir, tmp_path / "a")))
    ci = first["class_images"]
    assert ci["class_images"] == 4 and ci["class_images_given"] == 2
    assert ci["class_images_generated"] == 2
    gen = ci["class_images_uri"]
    assert gen.startswith(os.path.join(class_dir, "raylora-generated") + "/")
    names = sorted(os.listdir(gen))
    assert names == ["00000.png", "00000.txt", "00001.png", "00001.txt", "manifest.json"]
    assert open(os.path.join(gen, "00001.txt")).read() == "a photo of a shape"
    from PIL import Image

    assert Image.open(os.path.join(gen, "00000.png")).size == (32, 32)
    assert json.load(open(os.path.join(gen, "manifest.json")))["count"] == 2
    stamps = {n: os.stat(os.path.join(gen, n)).st_mtime_ns for n in names}

    rows = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    assert len(rows) == 2
    for r in rows:
        assert all(np.isfinite([r["loss"], r["loss_instance"], r["loss_prior"]]))
        assert r["loss"] == pytest.approx(r["loss_instance"] + 0.7 * r["loss_prior"], rel=1e-5)
    m = first["metrics"]
    assert np.isfinite(m["train_loss_last"])

    # The second run's preamble (where class images are found, generated or reused):
    # the generated folder is complete, so nothing is generated and no file is rewritten.
    from raylora.launch import Setup, prepared

    cfg = validate(_tree(tiny_model, demo_data, class_dir, tmp_path / "b"))
    with prepared(cfg, Setup(need_cpus=lambda c: 2)) as second:
        assert second.plan.class_images == {**ci, "class_images_generated": 0}
        assert [r["image"] for r in second.plan.class_rows[2:]] == \
            [open(os.path.join(gen, f"0000{i}.png"), "rb").read() for i in range(2)]
    assert {n: os.stat(os.path.join(gen, n)).st_mtime_ns for n in sorted(os.listdir(gen))} == stamps
    raylora_json = json.load(open(tmp_path / "a" / "adapter" / "raylora.json"))
    assert raylora_json["data"]["class_images"] == ci


@pytest.mark.integration
def test_from_the_latent_cache_prior_preservation_trains_as_uncached_training_does(
        ray_local, tiny_model, demo_data, class_dir, tmp_path):
    """data.cache=latents with class images: the driver encodes the class rows once, in the
    Ray task that encodes the held-out rows (the encoders loaded once for both), and every
    worker pairs its batches with rows picked from them, the same rows uncached training
    preprocesses per batch: step for step the same instance and prior losses, and the same
    held-out loss, without an encoder on a worker."""
    import time

    from ray.util.state import list_tasks

    from raylora.data.demo import write_parquet_shards
    from raylora.launch import run

    write_parquet_shards(tmp_path / "heldout", n=3, num_shards=1, size=32, seed=9)

    def tree(name, cache):
        t = _tree(tiny_model, demo_data, class_dir, tmp_path / name)
        t["data"].update(cache=cache, sharding="files",
                         **({"cache_uri": str(tmp_path / "cache")} if cache == "latents" else {}),
                         shuffle_buffer_size=0, num_class_images=2,  # the 2 given images
                         validation_uri=str(tmp_path / "heldout"))
        t["train"]["max_steps"] = 4
        # Two workers: each rank's picks of the class rows must be the same cached and not.
        t["scaling"] = {"num_workers": 2}
        return validate(t)

    def encode_tasks() -> int:
        return sum("_encode_rows_task" in t.name for t in list_tasks(limit=10_000, raise_on_missing_output=False))

    plain = run(tree("plain", "none"))
    before = encode_tasks()
    cached = run(tree("cached", "latents"))
    deadline = time.monotonic() + 15  # task events reach the state API within a few s
    while encode_tasks() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    assert encode_tasks() == before + 1
    assert plain["metrics"]["encoders_on_worker"] is True
    assert cached["metrics"]["encoders_on_worker"] is False
    assert cached["class_images"]["class_images"] == 2
    for key in ("eval_loss_base", "eval_loss_last"):
        assert cached["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-4), key

    def rows(name):
        return [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")]

    for key in ("loss", "loss_instance", "loss_prior"):
        got, want = [r[key] for r in rows("cached")], [r[key] for r in rows("plain")]
        assert len(got) == 4 and all(np.isfinite(got))
        # not bit-equal: the VAE's numerics depend a little on its batch size
        np.testing.assert_allclose(got, want, rtol=1e-4)
    assert all(r["loss_prior"] > 0 for r in rows("cached"))
    # What the workers got: both images' latents, their one prompt's embedding once
    from raylora.data.cache import encode_rows
    from raylora.data.classgen import ensure_class_images
    from raylora.storage import Storage

    cfg = tree("cached", "latents")
    found = ensure_class_images(cfg, "sd", tiny_model, Storage())
    encoded = encode_rows(cfg, "sd", tiny_model, found.rows, Storage(), purpose="class")
    assert encoded["latent_params"].shape[0] == 2
    distinct, index = encoded["prompt_embeds"]
    assert distinct.shape[0] == 1 and index.tolist() == [0, 0]


def test_encoded_class_rows_keep_a_repeated_prompt_embedding_once():
    """fold_repeats: a column whose rows repeat is kept once per distinct row (bytes equal),
    and EncodedClassBatches gives every batch exactly the rows the unfolded columns hold."""
    from raylora.data.prior import EncodedClassBatches, fold_repeats

    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((2, 8, 16)).astype(np.float32)
    columns = {"latent_params": rng.standard_normal((5, 8, 4, 4)).astype(np.float32),
               "prompt_embeds": embeds[[0, 0, 1, 0, 1]],  # two prompts over five images
               "time_ids": np.zeros((5, 6), np.float32)}
    folded = fold_repeats(columns)
    assert folded["latent_params"] is columns["latent_params"]  # no repeats: as it was
    distinct, index = folded["prompt_embeds"]
    assert distinct.shape == (2, 8, 16) and index.tolist() == [0, 0, 1, 0, 1]
    assert folded["time_ids"][0].shape == (1, 6) and folded["time_ids"][1].tolist() == [0] * 5
    whole = EncodedClassBatches(columns, seed=3, rank=1)
    small = EncodedClassBatches(folded, seed=3, rank=1)
    assert small.count == whole.count == 5
    for epoch, i in [(0, 0), (0, 1), (1, 2)]:
        a, b = whole.batch(epoch, i, 3), small.batch(epoch, i, 3)
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
