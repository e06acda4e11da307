"""data.masked_loss: the masked loss itself (numbers, and a real tiny-model step for every
family), where masks come from (alpha, sidecar files in a tar or a folder, a parquet
column), that they follow the image's crop/resize/flip/bucket, that a mask that does not
fit is a counted bad row, and that the latent cache stores them. One process, no Ray (the
Ray Data path: test_formats.py::test_masks_reach_training_rows_through_ray_data, which
shares that module's local Ray; a whole masked run through it: test_formats.py::test_a_masked_
run_through_ray_learns_nothing_where_every_mask_is_black)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raylora.config import DataSection
from raylora.data import formats
from raylora.data.preprocess import Preprocess, StageSpec
from raylora.storage import Storage
from raylora.train.loss import denoising_loss, latent_mask

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def left_half(w: int, h: int, mode: str = "L") -> Image.Image:
    """255 on columns [0, w/2), 0 elsewhere."""
    a = np.zeros((h, w), np.uint8)
    a[:, : w // 2] = 255
    return Image.fromarray(a, "L").convert(mode)


def stage(model: str, resolution: int = 16, **kw) -> tuple[Preprocess, list]:
    """A masked preprocess stage and the tallies it reports ``(ok, {reason: n})``."""
    kw = {"center_crop": True, "random_flip": False, "masks": True, **kw}
    s = Preprocess(StageSpec(model, resolution, **kw))
    sent = []
    s.reporter.send = lambda ok, bad, examples, **_: sent.append((ok, dict(bad)))
    return s, sent


def run_stage(s: Preprocess, rows: list[dict]) -> dict[str, np.ndarray]:
    cols = ("image", "text", "mask") if "mask" in rows[0] else ("image", "text")
    return s({k: np.array([r.get(k) for r in rows], dtype=object) for k in cols})


# ---------------------------------------------------------------- the loss, pure


def test_masked_loss_is_the_hand_computed_masked_mse():
    # B=2, C=2, 1x2 latents: errors e, squared e², mask per latent pixel, shared by channels.
    pred = torch.tensor([[[[1.0, 2.0]], [[0.0, -1.0]]], [[[3.0, 0.0]], [[1.0, 1.0]]]])
    target = torch.zeros_like(pred)
    mask = torch.tensor([[[[1.0, 0.0]]], [[[0.5, 1.0]]]])
    # sample 0: (1·1 + 4·0 + 0·1 + 1·0)/4 = 0.25; sample 1: (9·.5 + 0·1 + 1·.5 + 1·1)/4 = 1.5
    assert denoising_loss(pred, target, mask=mask).item() == pytest.approx((0.25 + 1.5) / 2)
    w = torch.tensor([2.0, 0.5])
    assert denoising_loss(pred, target, w, mask=mask).item() == pytest.approx((0.5 + 0.75) / 2)
    # all ones: the unmasked loss, weighted or not
    ones = torch.ones_like(mask)
    torch.testing.assert_close(denoising_loss(pred, target, mask=ones), denoising_loss(pred, target))
    torch.testing.assert_close(denoising_loss(pred, target, w, mask=ones), denoising_loss(pred, target, w))
    assert denoising_loss(pred, target, w, mask=torch.zeros_like(mask)).item() == 0.0


def test_latent_mask_area_pools_pixels_to_the_latent_grid():
    px = torch.zeros(1, 1, 16, 24, dtype=torch.uint8)
    px[..., :, :12] = 255  # left half
    px[..., :4, 16:20] = 255  # a quarter of the top-right latent pixel... half its rows
    m = latent_mask(px, (2, 3))
    assert m.dtype == torch.float32 and m.shape == (1, 1, 2, 3)
    torch.testing.assert_close(m[0, 0], torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.5, 0.0]]))
    # already on the grid (the latent cache's): only made float
    assert latent_mask(m.half(), (2, 3)).dtype == torch.float32


# ---------------------------------------------------------------- a real step, every family


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_mask_gives_zero_loss_and_zero_lora_gradient(tiny, family, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch

    from raylora.config import validate
    from raylora.train.setup import build_run
    from raylora.train.step import compute_loss

    model = tiny(family)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 1, rank=0)
    batch = demo_batch(family, model, demo_data, n=1)
    b, _, h, w = batch["pixel_values"].shape

    def loss_and_grads(mask, backward=True):
        torch.manual_seed(0)  # the same noise, timesteps and posterior draw every call
        run.model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(backward):
            loss = compute_loss(run.model, run.parts, batch if mask is None else
                                {**batch, "loss_mask": mask})
        if backward:
            loss.backward()
        return loss.detach(), [p.grad for p in run.params]

    half = torch.zeros((b, 1, h, w), dtype=torch.uint8)
    half[..., : w // 2] = 255
    plain, plain_grads = loss_and_grads(None)
    zero, zero_grads = loss_and_grads(torch.zeros((b, 1, h, w), dtype=torch.uint8))
    ones, _ = loss_and_grads(torch.full((b, 1, h, w), 255, dtype=torch.uint8), backward=False)
    halved, _ = loss_and_grads(half, backward=False)

    assert zero.item() == 0.0
    assert all(g is None or not g.any() for g in zero_grads)
    assert any(g is not None and g.abs().sum() > 0 for g in plain_grads)  # it could fail
    torch.testing.assert_close(ones, plain, rtol=1e-6, atol=0)
    assert 0.0 < halved.item() < plain.item()


# ---------------------------------------------------------------- sources of masks


def test_alpha_channel_is_the_mask_and_the_pixels_are_composited_as_before(tiny_model):
    rgba = Image.new("RGBA", (16, 16), (10, 200, 30, 255))
    rgba.putalpha(left_half(16, 16))
    row = {"image": png(rgba), "text": "a"}
    out = run_stage(stage(tiny_model)[0], [row])
    want = np.zeros((1, 1, 16, 16), np.uint8)
    want[..., :8] = 255
    np.testing.assert_array_equal(out["loss_mask"], want)
    plain = Preprocess(StageSpec(tiny_model, 16, center_crop=True, random_flip=False))
    np.testing.assert_array_equal(out["pixel_values"], plain({k: np.array([v], dtype=object)
                                                             for k, v in row.items()})["pixel_values"])
    assert "loss_mask" not in plain({k: np.array([v], dtype=object) for k, v in row.items()})
    # no mask and no alpha: all ones
    rgb = run_stage(stage(tiny_model)[0], [{"image": png(Image.new("RGB", (16, 16))), "text": "a"}])
    assert (rgb["loss_mask"] == 255).all()


def _tar(path, samples: dict[str, dict[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for key, files in samples.items():
            for ext, payload in files.items():
                info = tarfile.TarInfo(key + ext)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return str(path)


def test_webdataset_sidecar_mask(tmp_path, tiny_model):
    img = png(Image.new("RGB", (16, 16), (90, 90, 90)))
    mask = png(left_half(16, 16))
    uri = _tar(tmp_path / "shard-0.tar", {
        "000": {".png": img, ".txt": b"masked", ".mask.png": mask},
        "001": {".png": img, ".txt": b"plain"}})
    fmt = formats.get_format("webdataset")
    on, off = DataSection(uri=uri, masked_loss=True), DataSection(uri=uri)
    assert fmt.count_rows(on, [uri], Storage())[0] == 2  # the mask is no sample of its own
    rows = list(fmt.iter_rows(on, [uri], Storage()))
    assert [r["mask"] for r in rows] == [mask, None] and rows[0]["image"] == img
    assert all("mask" not in r for r in fmt.iter_rows(off, [uri], Storage()))
    out = run_stage(stage(tiny_model)[0], rows)
    assert (out["loss_mask"][0, 0, :, :8] == 255).all() and (out["loss_mask"][0, 0, :, 8:] == 0).all()
    assert (out["loss_mask"][1] == 255).all()


@pytest.mark.parametrize("fmt", ["captionfolder", "imagefolder"])
def test_folder_sidecar_mask_and_the_sidecar_is_not_an_image(tmp_path, fmt):
    img = png(Image.new("RGB", (16, 16)))
    mask = png(left_half(16, 16))
    (tmp_path / "cat.png").write_bytes(img)
    (tmp_path / "cat.mask.png").write_bytes(mask)
    (tmp_path / "dog.png").write_bytes(img)
    for stem in ("cat", "dog"):
        (tmp_path / f"{stem}.txt").write_text(stem)
    if fmt == "imagefolder":
        (tmp_path / "metadata.jsonl").write_text('{"file_name": "cat.png", "text": "cat"}\n'
                                                 '{"file_name": "dog.png", "text": "dog"}\n')
    from raylora.data.plan import plan_data

    on = DataSection(uri=str(tmp_path), masked_loss=True)
    plan = plan_data(on, Storage())
    assert plan.format == fmt and plan.rows == 2
    assert not any(f.endswith(".mask.png") for f in plan.files)
    rows = list(formats.get_format(fmt).iter_rows(on, plan.files, Storage()))
    assert {r["key"].rsplit("/", 1)[1]: r["mask"] for r in rows} == {"cat.png": mask, "dog.png": None}
    # the sidecar is part of the data (cache fingerprint) with masks on, not with them off
    assert str(tmp_path / "cat.mask.png") in plan.content_files()
    off = plan_data(DataSection(uri=str(tmp_path)), Storage())
    assert off.rows == 2 and str(tmp_path / "cat.mask.png") not in off.content_files()
    assert all("mask" not in r for r in formats.get_format(fmt).iter_rows(
        DataSection(uri=str(tmp_path)), off.files, Storage()))


def test_parquet_mask_column_in_plain_and_training_reads(tmp_path):
    from raylora.data.source import _part_tables

    img, mask = png(Image.new("RGB", (16, 16))), png(left_half(16, 16))
    with_col, without = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"image": [img, img], "text": ["x", "y"],
                             "m": pa.array([mask, None], pa.binary())}), with_col)
    pq.write_table(pa.table({"image": [img], "text": ["z"]}), without)
    on = DataSection(uri=str(tmp_path), masked_loss=True, mask_column="m")
    fmt = formats.get_format("parquet")
    assert [r["mask"] for r in fmt.iter_rows(on, [with_col, without], Storage())] == [mask, None, None]
    item = {"part": 0, "parts": 1, "keep": -1, "offset": 0}
    (a,) = _part_tables({**item, "uri": with_col}, on, False, Storage())
    (b,) = _part_tables({**item, "uri": without}, on, False, Storage())
    assert a["mask"].to_pylist() == [mask, None] and b["mask"].to_pylist() == [None]
    (plain,) = _part_tables({**item, "uri": with_col}, DataSection(uri=str(tmp_path)), False, Storage())
    assert plain.column_names == ["image", "text", "key"]


# ---------------------------------------------------------------- the mask follows the image


def test_mask_follows_the_crop_to_the_latent_grid(tiny_model):
    # 32x16 → 16x16 centre crop: no resize, columns 8..24 kept; the mask's left half
    # (columns 0..16) leaves columns 0..8 of the crop, the left latent column at factor 8.
    row = {"image": png(Image.new("RGB", (32, 16))), "text": "a", "mask": png(left_half(32, 16))}
    out = run_stage(stage(tiny_model)[0], [row])
    lat = latent_mask(torch.from_numpy(out["loss_mask"]), (2, 2))
    torch.testing.assert_close(lat[0, 0], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


@pytest.mark.parametrize("bucketing", [False, True])
def test_mask_gets_the_same_random_crop_flip_and_resize_as_the_image(tiny_model, bucketing):
    """An image whose every channel is its mask: after random crops, flips, resizes (and
    buckets) the mask must still equal the pixels, row by row."""
    from raylora.data.buckets import BucketSet

    rng = np.random.default_rng(0)
    rows, square = [], None
    for w, h in [(16, 16), (40, 24), (24, 40), (60, 20), (20, 70), (33, 21)]:
        a = rng.integers(0, 256, (h, w), dtype=np.uint8)
        square = a if square is None else square
        rows.append({"image": png(Image.fromarray(a, "L").convert("RGB")), "text": "a",
                     "mask": png(Image.fromarray(a, "L"))})
    buckets = BucketSet.of([[16]], 8) if bucketing else None
    s, _ = stage(tiny_model, center_crop=False, random_flip=True, seed=3, buckets=buckets)
    mirrored = 0
    for _ in range(6):
        out = run_stage(s, rows)
        for pixels, mask in zip(out["pixel_values"], out["loss_mask"]):
            np.testing.assert_array_equal(mask[0], pixels[0])
        # the 16x16 image is only ever flipped: some passes must have flipped it
        first = out["loss_mask"][0][0]
        assert (first == square).all() or (first == square[:, ::-1]).all()
        mirrored += int((first == square[:, ::-1]).all())
    assert 0 < mirrored < 6
    if bucketing:
        assert {tuple(m.shape) for m in out["loss_mask"]} != {(1, 16, 16)}  # several buckets


def test_masks_off_draws_the_same_crops_as_before(tiny_model):
    """Masks on or off, the same seed gives the same crops, flips and pixels."""
    rng = np.random.default_rng(1)
    rows = [{"image": png(Image.fromarray(rng.integers(0, 256, (30, 44, 3), dtype=np.uint8))),
             "text": "a"} for _ in range(6)]
    kw = dict(center_crop=False, random_flip=True, seed=7)
    on = run_stage(stage(tiny_model, **kw)[0], rows)
    off = Preprocess(StageSpec(tiny_model, 16, **kw))({k: np.array([r[k] for r in rows], dtype=object)
                                                       for k in ("image", "text")})
    assert set(on) - set(off) == {"loss_mask"}
    for k in off:
        np.testing.assert_array_equal(on[k], off[k])


# ---------------------------------------------------------------- masks that do not fit


def test_wrong_size_colour_or_broken_mask_is_a_counted_bad_row(tiny_model):
    img = png(Image.new("RGB", (16, 16)))
    rows = [{"image": img, "text": "ok", "mask": png(left_half(16, 16))},
            {"image": img, "text": "size", "mask": png(left_half(16, 8))},
            {"image": img, "text": "colour", "mask": png(left_half(16, 16, "RGB"))},
            {"image": img, "text": "broken", "mask": b"not a png"},
            {"image": img, "text": "none", "mask": None},
            {"image": img, "text": "16-bit", "mask": png(Image.fromarray(
                np.full((16, 16), 65535, np.uint16)))}]
    s, sent = stage(tiny_model)
    out = run_stage(s, rows)
    assert sent == [(3, {"bad_mask": 3})]
    assert out["pixel_values"].shape[0] == out["loss_mask"].shape[0] == 3
    assert (out["loss_mask"][1:] == 255).all()  # no mask, and 16-bit full scale


# ---------------------------------------------------------------- the latent cache


def test_cache_stores_the_mask_on_the_latent_grid(tiny_model, tmp_path):
    from raylora.config import validate
    from raylora.data.cache import EncodeStage, _stage_kwargs, encode_chunk, fingerprint
    from raylora.data.plan import plan_data

    rows = [{"image": png(Image.new("RGB", (64, 64))), "text": "a",
             "mask": png(left_half(64, 64))},
            {"image": png(Image.new("RGB", (64, 64))), "text": "b", "mask": None}]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.png").write_bytes(rows[0]["image"])
    (tmp_path / "d" / "x.txt").write_text("a")
    tree = {"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "o")},
            "data": {"uri": str(tmp_path / "d"), "resolution": 64, "center_crop": True,
                     "cache": "latents", "caption_dropout": 0.0}}
    cfg = validate({**tree, "data": {**tree["data"], "masked_loss": True}})
    store = Storage()
    pre, enc = _stage_kwargs(cfg, tiny_model, "sd", store)
    assert pre["masks"] is True
    out = encode_chunk(Preprocess(StageSpec(**pre)), EncodeStage(**enc), rows)
    assert out["loss_mask"].dtype == np.float32
    # the grid of the VAE the cache ran (the tiny one downsamples 64 px by 2: 32), whatever it is
    h, w = out["latent_params"].shape[-2:]
    assert out["loss_mask"].shape == (2, 1, h, w) and h < 64
    np.testing.assert_array_equal(out["loss_mask"][0, 0, :, : w // 2], 1.0)
    np.testing.assert_array_equal(out["loss_mask"][0, 0, :, w // 2 :], 0.0)
    np.testing.assert_array_equal(out["loss_mask"][1], 1.0)
    plain = validate(tree)
    plan = plan_data(cfg.data, store)
    assert fingerprint(cfg, "sd", tiny_model, plan, store) != \
        fingerprint(plain, "sd", tiny_model, plan_data(plain.data, store), store)



# ---------------------------------------------------------------- a masked run, end to end


def test_masked_run_trains_and_its_adapter_loads_in_the_stock_pipeline(tiny_model, demo_data,
                                                                        tmp_path):
    """The training loop (run_loop → train_micro_step → compute_loss) on batches whose
    masks keep only the left half; the exported adapter loads in stock diffusers and
    changes its image."""
    from inproc import _train, demo_batch
    from stock import stock_image_change

    from raylora.config import validate
    from raylora.model.lora import save_diffusers_adapter

    cfg = validate({"model": {"pretrained": tiny_model},
                    "data": {"uri": demo_data, "resolution": 64, "center_crop": True,
                             "masked_loss": True},
                    "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-2},
                    "checkpoint": {"every_n_steps": 4}, "output": {"uri": str(tmp_path / "o")}})
    batch = demo_batch("sd", tiny_model, demo_data, n=2)
    mask = torch.zeros((2, 1, 64, 64), dtype=torch.uint8)
    mask[..., :32] = 255
    run, saved = _train(cfg, [{**batch, "loss_mask": mask}] * 2, 4, str(tmp_path / "ck"))
    assert saved[-1] == (4, True) and run.state.global_step == 4
    assert 0 < run.state.train_loss_last < float("inf")
    adapter = tmp_path / "adapter"
    save_diffusers_adapter(run.accelerator.unwrap_model(run.model), str(adapter), run.family)
    assert stock_image_change("sd", tiny_model, adapter) > 1e-3
