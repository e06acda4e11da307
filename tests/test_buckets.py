"""Aspect-ratio buckets and multi-resolution (data.bucketing): bucket sets and assignment,
crops and SDXL's conditioning, a 2-worker caption-folder run where every rank trains the
same bucket every step, cached = uncached, and a Flux step on a non-square latent."""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from raylora.config import ConfigError, validate
from raylora.data.buckets import (BucketSet, bucket_batches, cover_crop_box, epoch_steps,
                                  resolution_buckets, schedule, sequence_digest)
from raylora.data.preprocess import transform_image_coords


# --- 1. bucket sets, assignment, crops ---------------------------------------------------

def test_bucket_set_of_one_resolution_is_kohyas():
    b = resolution_buckets(512, 64)
    assert b[0] == (512, 512)
    assert all(w % 64 == 0 and h % 64 == 0 and w * h <= 512 * 512 for w, h in b)
    assert all((h, w) in b for w, h in b)  # every bucket and its transpose
    assert max(max(w, h) / min(w, h) for w, h in b) == 4.0  # 1024x256
    assert {(576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (1024, 256)} <= set(b)
    assert len(b) == 17
    assert len(resolution_buckets(64, 16)) == 9  # 64², 80x48, 96x32, 112x32, 128x32 and turned


def test_nearest_aspect_in_log_space_and_multi_resolution():
    bs = BucketSet.of([[512, 1024]], 64)
    name = lambda w, h: "x".join(map(str, bs.sizes[bs.assign(w, h)]))  # noqa: E731
    assert name(800, 600) == "576x448"  # 4:3 → 1.29 (log distance 0.031; 640x384: 0.22)
    assert name(600, 800) == "448x576"
    assert name(1000, 1000) == "512x512"  # covers 512² but not 1024²: the 512 set
    assert name(2000, 2000) == "1024x1024"
    assert name(3000, 2000) == "1216x832"  # 1024 set, 1.5 → 1.46
    assert name(100, 400) == "256x1024"  # covers neither: the smallest set, upscaled
    # log space: 2:1 and 1:2 are equally far from square, so they go to mirrored buckets
    w1, h1 = bs.sizes[bs.assign(1400, 700)]
    w2, h2 = bs.sizes[bs.assign(700, 1400)]
    assert (w1, h1) == (h2, w2)
    # multiples of the step, and the largest bucket (memory) is the largest square
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in bs.sizes)
    assert bs.largest() == (1024, 1024)
    # a source with its own resolutions picks only from them
    two = BucketSet.of([[512], [1024]], 64)
    assert two.sizes[two.assign(2000, 2000, source=0)] == (512, 512)
    assert two.sizes[two.assign(2000, 2000, source=1)] == (1024, 1024)


def test_cover_then_crop_offsets():
    rng = np.random.default_rng(0)
    # 800x600 into 576x448: scale max(0.72, 0.7467) → 597x448, centre crop left (597-576)//2
    assert cover_crop_box(800, 600, (576, 448), True, rng) == ((597, 448), (0, 10))
    img = Image.new("RGB", (800, 600), "red")
    arr, orig, crop = transform_image_coords(img, (576, 448), True, False, rng)
    assert arr.shape == (3, 448, 576) and orig == (600, 800) and crop == (0, 10)
    # random crops stay inside the resized image; a flip mirrors the left edge
    for s in range(10):
        (nw, nh), (top, left) = cover_crop_box(800, 600, (576, 448), False, np.random.default_rng(s))
        assert top == 0 and 0 <= left <= 21
    plain = transform_image_coords(img, (576, 448), False, False, np.random.default_rng(3))[2]
    flip = [transform_image_coords(img, (576, 448), False, True, np.random.default_rng(3))[2]]
    assert flip[0] in (plain, (0, 21 - plain[1]))


def test_schedule_is_the_same_everywhere_and_counts_every_bucket():
    steps = epoch_steps([{0: 10.0, 1: 7.0, 2: 1.0}, {0: 9.0, 1: 8.0}], batch_size=2)
    assert steps == {0: 4, 1: 3}  # the smaller worker's full batches; bucket 2 fills none
    s0, s1 = schedule(steps, 7, 0), schedule(steps, 7, 0)
    assert s0 == s1 and sorted(s0) == [0, 0, 0, 0, 1, 1, 1]
    assert schedule(steps, 7, 1) != s0 or schedule(steps, 7, 2) != s0  # reshuffled per epoch


def test_bucket_batches_follow_the_schedule_and_fill_short_buckets():
    rows = np.array([0, 1, 0, 0, 1, 0, 1, 1, 0], np.int32)  # 5 rows of bucket 0, 4 of 1
    block = {"epoch": np.zeros(9, np.int32), "bucket": rows, "x": np.arange(9)}
    plan = lambda e: [1, 0, 0, 1, 1]  # noqa: E731 - bucket 1 asks for 6 rows, 4 exist
    out = list(bucket_batches([block], 2, plan, seed=lambda e: 0))
    assert [int(b["bucket"][0]) for _, b in out] == [1, 0, 0, 1, 1]
    for _, b in out:
        assert len(set(b["bucket"].tolist())) == 1 and len(b["x"]) == 2
    # the short bucket's last batch repeats its own rows, never another bucket's
    assert {int(x) for _, b in out if b["bucket"][0] == 1 for x in b["x"]} == {1, 4, 6, 7}
    # cut into other blocks, the same batches
    halves = [{k: v[:4] for k, v in block.items()}, {k: v[4:] for k, v in block.items()}]
    again = list(bucket_batches(halves, 2, plan, seed=lambda e: 0))
    assert [b["x"].tolist() for _, b in again] == [b["x"].tolist() for _, b in out]
    # exact resume: a stream opened at pass 1 gives pass 1's batches of the straight run
    # (each pass depends on its rows, its schedule and seed(pass) alone)
    two = [block, {**block, "epoch": np.ones(9, np.int32), "x": np.arange(9) + 100}]
    seed = lambda e: 11 * e  # noqa: E731
    straight = [b["x"].tolist() for e, b in bucket_batches(two, 2, plan, seed) if e == 1]
    resumed = [b["x"].tolist() for _, b in bucket_batches(two[1:], 2, plan, seed)]
    assert resumed == straight and len(straight) == 5
    # a scheduled bucket with no row at all this pass: an error, never a skipped step
    # (the other workers would wait for this one at their next all-reduce)
    with pytest.raises(RuntimeError, match="no usable row of bucket 2"):
        list(bucket_batches([block], 2, lambda e: [0, 2], seed=lambda e: 0))


def test_bucketing_config_errors_name_their_keys(tiny_model, tiny, demo_data, tmp_path):
    base = {"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path)}}
    with pytest.raises(ConfigError) as ei:
        validate({**base, "data": {"uri": demo_data, "resolution": [64, 128]},
                  "train": {"compile": "regional"}})
    got = ei.value.problems
    assert any(p.startswith("data.resolution: a list of resolutions needs data.bucketing") for p in got)
    with pytest.raises(ConfigError) as ei:
        validate({**base, "data": {"uri": demo_data, "bucketing": True, "resolution": [64, 100],
                                   "bucket_step": 32},
                  "scaling": {"num_workers": 2}, "train": {"compile": "regional"}})
    got = ei.value.problems
    assert "data.resolution: 100 is not a multiple of data.bucket_step=32" in got[0]
    assert any(p.startswith("data.bucketing: with scaling.num_workers > 1 needs "
                            "data.sharding=files") for p in got)
    assert any(p.startswith("train.compile: regional compiles for one input shape") for p in got)
    with pytest.raises(ConfigError) as ei:
        validate({**base, "data": {"sources": [{"uri": demo_data, "resolution": 128}]}})
    assert ei.value.problems[0].startswith("data.sources[0].resolution: a per-source "
                                           "resolution needs multi-resolution aspect bucketing")
    ok = validate({**base, "data": {"sources": [{"uri": demo_data, "resolution": [64, 128]}],
                                    "bucketing": True, "bucket_step": 16, "resolution": 64}})
    assert ok.data.source_sections()[0].resolutions() == [64, 128]
    assert ok.compile_mode == "none"
    # The family's latent grid (tiny Flux: VAE 2 x patch 2 = 4): a step off it is refused.
    from raylora.launch import plan

    # No bucket with a full batch on each worker: named, with the histogram.
    with pytest.raises(ConfigError) as ei:
        plan(validate({**base, "data": {"uri": demo_data, "bucketing": True, "resolution": 64,
                                        "bucket_step": 16}, "train": {"batch_size": 40}}))
    assert ei.value.problems == [
        "data.bucketing: no bucket has a full batch (train.batch_size=40) on every one of the "
        "1 workers (images per bucket: 64x64 32); lower train.batch_size, or use fewer "
        "resolutions or a coarser data.bucket_step"]
    with pytest.raises(ConfigError) as ei:
        plan(validate({**base, "model": {"pretrained": tiny("flux")},
                       "data": {"uri": demo_data, "bucketing": True, "resolution": 64,
                                "bucket_step": 2}}))
    assert ei.value.problems == ["data.bucket_step: 2 is not a multiple of 4 (the flux latent "
                                 "grid: VAE downsampling × patch size), which bucket sides "
                                 "must be (e.g. 64)"]


# --- 4. SDXL's time ids carry the bucket crop -------------------------------------------

def test_sdxl_time_ids_carry_the_bucket_crop_and_original_size(tiny):
    import io

    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.model.families.sdxl import time_ids

    def png(w, h):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), "blue").save(buf, format="PNG")
        return buf.getvalue()

    bs = BucketSet.of([[64]], 16)
    stage = Preprocess(StageSpec(tiny("sdxl"), 64, center_crop=True, random_flip=False, family="sdxl",
                       buckets=bs))
    out = stage({"image": np.array([png(120, 80), png(70, 70)], dtype=object),
                 "text": np.array(["a", "b"], dtype=object)})
    assert [bs.sizes[b] for b in out["bucket"]] == [(80, 48), (64, 64)]
    assert out["pixel_values"][0].shape == (3, 48, 80) and out["pixel_values"][1].shape == (3, 64, 64)
    ids = time_ids({k: torch.from_numpy(out[k]) for k in ("original_size", "crop_top_left", "target_size")})
    # 120x80 → cover 80x48: scale max(80/120, 48/80)=0.667 → 80x53, crop top (53-48)//2=2
    # 70x70 → 64x64 (scale 0.914), no offset
    assert ids.tolist() == [[80.0, 120.0, 2.0, 0.0, 48.0, 80.0], [70.0, 70.0, 0.0, 0.0, 64.0, 64.0]]


def test_photos_train_upright_as_their_exif_orientation_shows_them(tiny, tmp_path):
    """A phone JPEG stored landscape with EXIF Orientation 6 is portrait in every viewer
    and in diffusers' ``load_image``: it trains upright (pixels, bucket, SDXL's original
    size), its header size is the upright one for the bucket scan, and a mask drawn on the
    upright photo is its size. Every orientation 1-8, each stored as a camera would."""
    import io

    from raylora.data.buckets import image_size
    from raylora.data.decode import open_masked_row, open_image
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.storage import Storage
    from raylora.train.preview import read_control_images

    # Upright: 32 wide, 64 high, four quadrants of different colours.
    colours = {"tl": (255, 0, 0), "tr": (0, 255, 0), "bl": (0, 0, 255), "br": (255, 255, 0)}
    upright = Image.new("RGB", (32, 64))
    for (x, y), key in zip([(0, 0), (16, 0), (0, 32), (16, 32)], colours):
        upright.paste(colours[key], (x, y, x + 16, y + 32))
    T = Image.Transpose
    # What the camera stored for each orientation: the inverse of the turn a viewer applies.
    stored_by = {1: None, 2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM,
                 5: T.TRANSPOSE, 6: T.ROTATE_90, 7: T.TRANSVERSE, 8: T.ROTATE_270}
    buf = io.BytesIO()
    Image.new("L", (32, 64), 255).save(buf, format="PNG")
    mask = buf.getvalue()  # drawn on the upright photo: 32x64, no EXIF

    bs = BucketSet.of([[64]], 16)
    stage = Preprocess(StageSpec(tiny("sdxl"), 64, center_crop=True, random_flip=False,
                                 family="sdxl", buckets=bs))
    for orientation, turn in stored_by.items():
        stored = upright if turn is None else upright.transpose(turn)
        exif = Image.Exif()
        exif[0x0112] = orientation
        buf = io.BytesIO()
        stored.save(buf, format="JPEG", quality=98, exif=exif.tobytes())
        jpeg = buf.getvalue()
        assert Image.open(io.BytesIO(jpeg)).size == ((32, 64) if orientation < 5 else (64, 32))

        assert image_size(jpeg) == (32, 64), orientation
        img = open_image(jpeg, 10**8)
        assert img.size == (32, 64), orientation
        a = np.asarray(img, dtype=np.int32)
        for (y, x), key in zip([(8, 8), (8, 24), (48, 8), (48, 24)], colours):
            assert np.abs(a[y, x] - colours[key]).max() < 12, (orientation, key, a[y, x])
        _, _, m, _ = open_masked_row(jpeg, "a", mask, masks=True, max_pixels=10**8, min_size=0,
                                     small_images="skip", keep_empty_captions=False)
        assert m.size == (32, 64), orientation

        # an edit run's preview input (validation.control_images, raylora sample --image)
        (tmp_path / f"{orientation}.jpg").write_bytes(jpeg)
        (preview_input,) = read_control_images([str(tmp_path / f"{orientation}.jpg")], Storage())
        assert preview_input.size == (32, 64), orientation

        out = stage({"image": np.array([jpeg], dtype=object), "text": np.array(["a"], dtype=object)})
        w, h = bs.sizes[out["bucket"][0]]
        px = out["pixel_values"][0].astype(np.int32)
        assert h > w and px.shape == (3, h, w), orientation  # a portrait bucket
        assert out["original_size"][0].tolist() == [64, 32], orientation  # (height, width)
        assert np.abs(px[:, 2, 2] - colours["tl"]).max() < 12, orientation
        assert np.abs(px[:, -3, -3] - colours["br"]).max() < 12, orientation


# --- 5. Flux: a bucketed step on a non-square latent --------------------------------------

def _png_chunks(data: bytes) -> list[bytes]:
    """A PNG's chunks, each whole (length, type, data, CRC), after its signature."""
    import struct

    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        out.append(data[pos:pos + 12 + length])
        pos += 12 + length
    return out


def test_the_bucket_scan_reads_a_pngs_orientation_without_decoding_it(monkeypatch):
    """PIL's PngImageFile.getexif decodes every pixel to look for an eXIf chunk after the
    image data: the driver's scan of a folder of 2048² PNGs took 82 ms an image (0.01 ms
    its header). The scan loads no pixels now, and turns a PNG as the decode does: by an
    eXIf chunk before the image data, or after it (found by walking the chunk headers)."""
    import io

    from PIL import ImageFile, PngImagePlugin

    from raylora.data.buckets import image_size
    from raylora.data.decode import open_image

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 64 wide, shown 32 wide
    buf = io.BytesIO()
    Image.new("RGB", (64, 32), (200, 10, 10)).save(buf, format="PNG", exif=exif.tobytes())
    early = buf.getvalue()
    chunks = _png_chunks(early)
    kinds = [c[4:8] for c in chunks]
    assert kinds.index(b"eXIf") < kinds.index(b"IDAT")  # as PIL writes it
    # the same image with its eXIf chunk after the image data, before IEND
    moved = [c for c in chunks if c[4:8] != b"eXIf"]
    late = early[:8] + b"".join(moved[:-1] + [chunks[kinds.index(b"eXIf")], moved[-1]])
    buf = io.BytesIO()
    Image.new("RGB", (64, 32)).save(buf, format="PNG")
    plain = buf.getvalue()

    loads = []
    for cls in (PngImagePlugin.PngImageFile, ImageFile.ImageFile):
        monkeypatch.setattr(cls, "load", lambda self, cls=cls: loads.append(cls.__name__))
    assert [image_size(early), image_size(late), image_size(plain)] == [(32, 64), (32, 64), (64, 32)]
    assert loads == []  # no pixel decoded
    monkeypatch.undo()
    # the decode turns them alike: the scan's bucket is the one training uses
    assert [open_image(d, 10**8).size for d in (early, late, plain)] == [(32, 64), (32, 64), (64, 32)]
    from raylora.data.decode import png_late_info

    assert png_late_info(early) == {} and png_late_info(plain) == {}
    assert png_late_info(late) == {"exif": b"Exif\x00\x00" + chunks[kinds.index(b"eXIf")][8:-4]}


def _with_chunk(png: bytes, kind: bytes, body: bytes, late: bool) -> bytes:
    """``png`` with one more chunk: right after IHDR, or (``late``) just before IEND."""
    import struct
    import zlib

    chunk = struct.pack(">I", len(body)) + kind + body + \
        struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    at = len(png) - 12 if late else 8 + 25  # IEND is the last 12 bytes; IHDR the first 25
    return png[:at] + chunk + png[at:]


def test_the_bucket_scan_sizes_turned_tiffs_and_late_png_text_as_the_decode_does(
        tiny_model, monkeypatch):
    """The scan's size of an image (its bucket) is the size the decode gives it, for the
    orientations the scan read wrong: a TIFF turned a quarter (Pillow ≥ 11 reports its
    turned size at open; the scan turned it again: planned 80x48, trained 48x80, and the
    run stopped with "no usable row of bucket"), and a PNG turned by text after its image
    data, ImageMagick's "Raw profile type exif" (zTXt, tEXt) or XMP tiff:Orientation
    (iTXt), which only the decode read. No pixel decoded by the scan."""
    import io
    import zlib

    from PIL import ImageFile, PngImagePlugin, TiffImagePlugin

    from raylora.data.buckets import image_size, scan_rows
    from raylora.data.decode import open_image
    from raylora.data.preprocess import Preprocess, StageSpec

    stored = Image.new("RGB", (128, 64), (200, 50, 50))  # 128 wide stored
    cases = {}
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        buf = io.BytesIO()
        stored.save(buf, format="TIFF", exif=exif.tobytes())
        cases[f"TIFF exif {o}"] = (buf.getvalue(), (64, 128) if o >= 5 else (128, 64))
    for o in (3, 6, 8):
        tags = TiffImagePlugin.ImageFileDirectory_v2()
        tags[274] = o
        buf = io.BytesIO()
        stored.save(buf, format="TIFF", tiffinfo=tags, compression="tiff_deflate")
        cases[f"TIFF tag {o} deflate"] = (buf.getvalue(), (64, 128) if o >= 5 else (128, 64))

    buf = io.BytesIO()
    stored.save(buf, format="PNG")
    png = buf.getvalue()
    exif = Image.Exif()
    exif[0x0112] = 6
    raw = (b"Exif\x00\x00" + exif.tobytes()).hex()
    profile = f"\nexif\n{len(raw) // 2:8d}\n" + "\n".join(raw[i:i + 72] for i in range(0, len(raw), 72))
    xmp = ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/'
           '02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
           'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>').encode()
    texts = {
        "zTXt raw profile": (b"zTXt", b"Raw profile type exif\0\0" + zlib.compress(profile.encode())),
        "tEXt raw profile": (b"tEXt", b"Raw profile type exif\0" + profile.encode()),
        "iTXt XMP": (b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + xmp),
        "iTXt XMP zipped": (b"iTXt", b"XML:com.adobe.xmp\0\1\0\0\0" + zlib.compress(xmp)),
    }
    for name, (kind, body) in texts.items():
        for late in (False, True):
            cases[f"PNG {name} {'after' if late else 'before'} IDAT"] = (
                _with_chunk(png, kind, body, late), (64, 128))
    # an orientation in text after the image data does not override an eXIf before it, in
    # PIL's reader as in the scan
    buf = io.BytesIO()
    exif[0x0112] = 3
    stored.save(buf, format="PNG", exif=exif.tobytes())
    cases["PNG eXIf 3, late XMP 6"] = (_with_chunk(buf.getvalue(), *texts["iTXt XMP"], True), (128, 64))

    loads = []
    for cls in (PngImagePlugin.PngImageFile, TiffImagePlugin.TiffImageFile, ImageFile.ImageFile):
        monkeypatch.setattr(cls, "load", lambda self, cls=cls: loads.append(cls.__name__))
    scanned = {name: image_size(data) for name, (data, _) in cases.items()}
    assert loads == []
    monkeypatch.undo()
    decoded = {name: open_image(data, 10**8).size for name, (data, _) in cases.items()}
    expected = {name: size for name, (_, size) in cases.items()}
    assert decoded == expected  # the decode (training's) turns them so
    assert scanned == expected

    # the driver's plan and the workers' stage agree on the bucket: 48x80, portrait
    bs = BucketSet.of([[64]], 16)
    rows = [{"key": n, "image": d, "text": "a"} for n, (d, _) in cases.items()]
    stage = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False, buckets=bs))
    out = stage({"image": np.array([r["image"] for r in rows], dtype=object),
                 "text": np.array(["a"] * len(rows), dtype=object)})
    planned = [bs.name(int(b)) for b in scan_rows(rows, bs, 0)]
    assert planned == [bs.name(int(b)) for b in out["bucket"]]
    assert planned == ["48x80" if expected[r["key"]] == (64, 128) else "80x48" for r in rows]


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` × ``height`` (its pixel data is an 8×8 image's):
    what the bucket scan reads of it, without the memory of the pixels."""
    import io
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("1", (8, 8)).save(buf, format="PNG")
    b = bytearray(buf.getvalue())
    b[16:24] = struct.pack(">II", width, height)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])))  # IHDR's CRC
    return bytes(b)


def test_the_bucket_scan_takes_a_raised_max_image_pixels(monkeypatch):
    """PIL refuses a header over twice its bomb bound, which only the training decode set
    to data.max_image_pixels: with the bound raised to 400M a 15000×12000 panorama (180M
    pixels, over twice PIL's default 89M) was in no bucket (dropped unsaid) on a driver
    that had decoded nothing yet. The scan sets the run's bound as the decode does."""
    from raylora.data.buckets import image_size, scan_rows

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)  # PIL's default
    big = _png_header(15000, 12000)
    bs = BucketSet.of([[512]], 64)
    row = {"image": big, "text": "a panorama"}
    assert scan_rows([row], bs, 0, max_pixels=400_000_000).tolist() == [bs.assign(15000, 12000)]
    assert image_size(big, 400_000_000) == (15000, 12000)
    assert Image.MAX_IMAGE_PIXELS == 400_000_000  # as raylora.data.decode.open_image leaves it
    # over the run's bound: in no bucket, as the decode drops it (too_many_pixels)
    assert scan_rows([row], bs, 0, max_pixels=100_000_000).tolist() == [-1]


def test_the_bucket_scan_counts_no_row_without_its_control_image():
    """data.control_images: a row the decode drops as missing_control (an input None or
    empty, as a tar without the member or a null parquet cell reads; or a folder image
    the control lookup found none for, ``lacking``) is in no bucket; one with every
    input is bucketed by its own image."""
    from raylora.data.buckets import scan_rows

    bs = BucketSet.of([[64]], 16)
    img, wide = _png_header(64, 64), _png_header(128, 32)
    rows = [{"key": "a", "image": img, "text": "a", "control": img, "control_2": img},
            {"key": "b", "image": wide, "text": "b", "control": None, "control_2": img},
            {"key": "c", "image": img, "text": "c", "control": img, "control_2": b""},
            {"key": "d", "image": wide, "text": "d", "control": img, "control_2": img}]
    both = ("control", "control_2")
    assert scan_rows(rows, bs, 0, controls=both).tolist() == [0, -1, -1, bs.assign(128, 32)]
    assert scan_rows(rows, bs, 0, controls=both, lacking={"d"}).tolist() == [0, -1, -1, -1]
    # without data.control_images none is looked at
    assert scan_rows(rows, bs, 0).tolist() == [0, bs.assign(128, 32), 0, bs.assign(128, 32)]

def test_flux_step_on_a_non_square_bucket(tiny, demo_data, tmp_path):
    import io

    from inproc import _fresh_accelerator

    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.train.setup import build_run
    from raylora.train.step import train_micro_step

    model = tiny("flux")
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64, "bucketing": True,
                             "bucket_step": 16},
                    "train": {"learning_rate": 1e-3, "seed": 0},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 2, rank=0)
    bs = BucketSet.of([[64]], 16)
    buf = io.BytesIO()
    Image.new("RGB", (150, 60), "green").save(buf, format="PNG")  # 2.5:1 → 96x32 (log 0.18 off)
    stage = Preprocess(StageSpec(model, 64, center_crop=True, random_flip=False, family="flux",
                       max_sequence_length=32, buckets=bs))
    out = stage({"image": np.array([buf.getvalue()] * 2, dtype=object),
                 "text": np.array(["a", "b"], dtype=object)})
    assert bs.sizes[out["bucket"][0]] == (96, 32)
    batch = {k: torch.from_numpy(np.stack(v) if v.dtype == object else v) for k, v in out.items()}
    assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 96)
    seen = {}
    denoiser = run.accelerator.unwrap_model(run.model)
    hook = denoiser.register_forward_pre_hook(
        lambda m, a, kw: seen.update(x=kw["hidden_states"].shape, ids=kw["img_ids"].clone()),
        with_kwargs=True)
    loss = train_micro_step(run.accelerator, run.model, run.parts, run.optimizer,
                            run.lr_scheduler, run.params, batch, 1.0)
    hook.remove()
    assert torch.isfinite(loss)
    f = 2 ** (len(run.parts.vae.config.block_out_channels) - 1)
    lh, lw = 32 // f, 96 // f  # the latent: 3:1, not square
    assert lh != lw and seen["x"][:2] == (2, (lh // 2) * (lw // 2))  # 2x2 packing of h x w
    assert seen["ids"][:, 1].max() == lh // 2 - 1 and seen["ids"][:, 2].max() == lw // 2 - 1


# --- 2, 3. Ray runs ------------------------------------------------------------------------

SHAPES = {"L": (120, 80), "P": (80, 120), "S": (70, 70)}


def write_mixed_folder(root) -> str:
    """A kohya ``5_name`` folder: 12 images cycling landscape/portrait/square (file i goes
    to worker i mod 2: each worker gets 2 of each) and one 4:1 image, worker 0's alone,
    each with a .txt caption."""
    folder = root / "5_shapes"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    kinds = ["L", "P", "S"] * 4 + ["W"]
    for i, kind in enumerate(kinds):
        w, h = SHAPES.get(kind, (160, 40))
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:02d}.png")
        (folder / f"img_{i:02d}.txt").write_text(f"a {kind} picture number {i}")
    return str(root)


def _tree(data: str, out, workers: int, cache: str = "none", **train) -> dict:
    return {
        "data": {"uri": data, "format": "captionfolder", "resolution": 64, "bucketing": True,
                 "bucket_step": 16, "center_crop": True, "sharding": "files", "cache": cache,
                 **({"cache_uri": str(out.parent / "cache")} if cache == "latents" else {})},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-3, "seed": 3, **train},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_n_steps": 4},
        "output": {"uri": str(out)},
    }


def _bucketed_run(data: str, out, tiny_model: str, cache: str) -> tuple[dict, list[dict]]:
    """A bucketed run of ``data`` on 2 workers: its summary and its metrics rows."""
    from raylora.launch import run

    tree = _tree(data, out, workers=2, cache=cache)
    tree["model"] = {"pretrained": tiny_model}
    summary = run(validate(tree))
    return summary, [json.loads(x) for x in open(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def uncached(ray_local, tiny_model, tmp_path_factory):
    """The mixed folder trained on 2 workers without a cache: what the first test below
    checks, and what the second compares its cached run with."""
    root = tmp_path_factory.mktemp("buckets")
    data = write_mixed_folder(root / "data")
    return (data, root / "out", *_bucketed_run(data, root / "out", tiny_model, "none"))


@pytest.mark.integration
def test_caption_folder_trains_in_buckets_on_two_workers_in_step(uncached, tiny_model):
    from stock import stock_image_change

    from raylora.progress import summary_lines

    _, out, summary, rows = uncached
    m = summary["metrics"]
    assert m["steps"] == 4 and m["replicas_in_sync"] is True
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    buckets = meta["data"]["buckets"]
    # The histogram: distinct images per bucket WxH. 128x32, the one 4:1 image, counts 5
    # times: its copies are dealt to both workers (3 and 2), a batch of 2 on each. (Dealt
    # whole, it was worker 0's only, filled no batch on worker 1, and never trained.)
    assert buckets["rows"] == {"64x64": 4, "80x48": 4, "48x80": 4, "128x32": 1}
    # Each worker: 20 copies of a bucket's 4 images dealt in turn = 10 rows = 5 batches of 2.
    assert buckets["batches_per_epoch"] == {"64x64": 5, "80x48": 5, "48x80": 5, "128x32": 1}
    per_step = [buckets["sizes"][r["bucket"]] for r in rows]
    assert len(set(per_step)) >= 2, per_step
    # Every rank trained the same bucket at every step (gathered from each rank's history).
    digest = sequence_digest([r["bucket"] for r in rows])
    assert m["replica_bucket_digests"] == [digest, digest] and m["buckets_in_sync"] is True
    # The run log prints the histogram once.
    lines = [ln for ln in summary_lines(summary) if ln.startswith("raylora: buckets")]
    assert lines == ["raylora: buckets      48x80 4, 64x64 4, 80x48 4, 128x32 1 rows (4 of 4 fill a batch)"]
    assert stock_image_change("sd", tiny_model, out / "adapter") > 0


@pytest.mark.integration
def test_bucketed_cached_run_equals_uncached(uncached, tiny_model, tmp_path):
    """The same folder cached, on the same 2 workers (before, a caption folder of up to
    256 images was one cache part, and data.sharding=files refused a second worker after
    the cache was built): each image its own part, dealt out as the images were."""
    data, _, plain, plain_rows = uncached
    cached, cached_rows = _bucketed_run(data, tmp_path / "cached", tiny_model, "latents")
    assert plain["metrics"]["encoders_on_worker"] is True
    assert cached["metrics"]["encoders_on_worker"] is False
    # the same buckets in the same order on both ranks, and the same losses (VAE batch
    # numerics aside)
    assert [r["bucket"] for r in cached_rows] == [r["bucket"] for r in plain_rows]
    assert cached["metrics"]["replica_bucket_digests"] == plain["metrics"]["replica_bucket_digests"]
    assert len({r["bucket"] for r in plain_rows}) >= 2
    np.testing.assert_allclose([r["loss"] for r in cached_rows], [r["loss"] for r in plain_rows],
                               rtol=1e-4)
    meta = json.loads((tmp_path / "cached" / "adapter" / "raylora.json").read_text())["data"]
    manifest = json.loads(open(os.path.join(meta["cache_uri"], "manifest.json")).read())
    assert len(manifest["files"]) == 13 and manifest["file_rows"] == [1] * 13
    assert meta["buckets"]["batches_per_epoch"] == {"64x64": 5, "80x48": 5, "48x80": 5, "128x32": 1}
    # the cache stores each image's bucketed latent: per file, its rows per bucket id
    sizes = meta["buckets"]["sizes"]
    counted = {}
    for per_file in manifest["file_buckets"]:
        for b, n in per_file.items():
            counted[sizes[int(b)]] = counted.get(sizes[int(b)], 0) + n
    assert counted == {"64x64": 4, "80x48": 4, "48x80": 4, "128x32": 1}
    assert meta["buckets"]["rows"] == counted
    assert math.isfinite(cached["metrics"]["train_loss_last"])


def test_memory_estimate_uses_the_largest_bucket(tiny, demo_data, tmp_path):
    from raylora import memory

    model = tiny("sdxl")

    def cfg(**data):
        return validate({"model": {"pretrained": model},
                         "data": {"uri": demo_data, "center_crop": True, **data},
                         "output": {"uri": str(tmp_path)}})

    bucketed = cfg(resolution=[64, 128], bucketing=True, bucket_step=16)
    assert memory.config_args(bucketed)["resolution"] == (128, 128)  # most pixels: 128²
    est = memory.from_config(bucketed)
    assert est.total == memory.from_config(cfg(resolution=128)).total
    assert est.total > memory.from_config(cfg(resolution=64)).total
    assert "sdxl 128x128 px" in est.table()
    # a non-square bucket's batch has its height and width
    assert memory.from_config(bucketed, resolution=(128, 32)).activations < est.activations


# --- 4. epoch counts: partial copies, held-out split, latent cache (no Ray) --------------

def write_shapes(path, sizes: list[tuple[int, int]], prefix: str, seed: int) -> None:
    """A parquet file of noise PNGs of ``sizes`` (w, h), captioned ``{prefix} {i}``."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, images = np.random.default_rng(seed), []
    for w, h in sizes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        images.append(buf.getvalue())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": images, "text": [f"{prefix} {i}" for i in range(len(sizes))]}),
                   path)


def epoch_buckets(data, plan, epoch: int, cached: bool = False) -> list[tuple[str, int]]:
    """``(key, bucket)`` of each training row epoch ``epoch`` reads, through the read stage's
    own functions (read_units, pass_items, _part_tables/_unit_tables, KeepSplit), no Ray."""
    from raylora.data import source as src
    from raylora.data.buckets import bucket_set, image_size
    from raylora.data.plan import pass_items, read_units
    from raylora.data.split import KeepSplit
    from raylora.storage import Storage

    store, sections, buckets, out = Storage(), data.source_sections(), bucket_set(data), []
    for item in pass_items(read_units(data, plan, store, 8, cached), 5, epoch, True):
        s = plan.sources[item["k"]]
        section = sections[s.index]
        tables = src._part_tables(item, section, cached, store) if item["kind"] == "parquet" \
            else src._unit_tables(item, section, s.format, s.files, store)
        for t in tables:
            if cached:  # a cache's rows: their bucket, a key of the file and the row
                out += [(f"{item['uri']}#{r}", int(b)) for r, b in
                        zip(t["row"].to_pylist(), t["bucket"].to_pylist())]
                continue
            rows = src._as_source(t, section, int(item["source"])).to_pydict()
            if data.validation_split:
                kept = KeepSplit(data.validation_split)({k: np.array(v, dtype=object)
                                                         for k, v in rows.items()})
                rows = {k: v.tolist() for k, v in kept.items()}
            out += [(k, buckets.assign(*image_size(i), s.index))
                    for k, i in zip(rows["key"], rows["image"])]
    return out


def train_epoch(reads: list[tuple[str, int]], steps: dict[int, int], batch: int, epoch: int):
    """Times each row trains in the epoch (bucket_batches on the schedule of ``steps``)."""
    from collections import Counter

    block = {"epoch": np.full(len(reads), epoch, np.int32),
             "bucket": np.array([b for _, b in reads], np.int32),
             "key": np.array([k for k, _ in reads], dtype=object)}
    trained = Counter()
    for _, b in bucket_batches([block], batch, lambda e: schedule(steps, 3, e), lambda e: e):
        trained.update(b["key"].tolist())
    return trained


@pytest.fixture(scope="module")
def weighted_shapes(tmp_path_factory):
    """Source a: 30 images in two files, landscape, portrait and square in a seeded order;
    source b: 10 squares. Weights 1:2 make epochs of 40: a's rows count 4/9 times each,
    b's 8/3 times: both draw partial copies."""
    root = tmp_path_factory.mktemp("weighted")
    kinds = [(96, 48), (48, 96), (64, 64)]
    order = np.random.default_rng(4).integers(0, 3, 30)
    write_shapes(root / "a" / "0.parquet", [kinds[k] for k in order[:14]], "a", 1)
    write_shapes(root / "a" / "1.parquet", [kinds[k] for k in order[14:]], "a", 2)
    write_shapes(root / "b" / "0.parquet", [(64, 64)] * 10, "b", 3)
    return str(root)


def weighted_section(root: str, **more):
    from raylora.config import DataSection

    return DataSection(sources=[{"uri": f"{root}/a", "weight": 1}, {"uri": f"{root}/b", "weight": 2}],
                       resolution=64, bucketing=True, bucket_step=16, **more)


def test_a_fractional_weight_brings_each_bucket_its_planned_rows_every_epoch(weighted_shapes):
    """A partial copy drawn over a source's rows whatever their bucket brought a bucket 5
    rows one epoch and 7 the next while the schedule, planned from 6.0, stayed fixed:
    rows trained twice, others read and skipped. Drawn per bucket, every epoch reads each
    bucket exactly its planned rows (a different subset each epoch), for one worker and
    for each of two under data.sharding=files."""
    from collections import Counter

    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    data = weighted_section(weighted_shapes)
    plan = plan_data(data, Storage())
    assert [round(s.mult, 4) for s in plan.sources] == [0.4444, 2.6667]
    planned = plan.bucket_rows()
    steps, subsets = epoch_steps([planned], 2), set()
    for epoch in range(6):
        reads = epoch_buckets(data, plan, epoch)
        assert dict(Counter(b for _, b in reads)) == planned
        assert len(reads) == plan.rows
        subsets.add(tuple(sorted(k for k, _ in reads if "/a/" in k)))
        trained, read = train_epoch(reads, steps, 2, epoch), Counter(k for k, _ in reads)
        assert all(trained[k] <= read[k] for k in trained)  # none trained more than read
        assert sum(read.values()) - sum(trained.values()) == sum(n % 2 for n in planned.values())
    assert len(subsets) > 3  # the partial copy is drawn anew each epoch
    for rank in range(2):
        mine = plan.for_rank(rank, 2)
        for epoch in range(3):
            assert dict(Counter(b for _, b in epoch_buckets(data, mine, epoch))) == mine.bucket_rows()


def test_integer_multipliers_and_runs_without_buckets_read_as_before(weighted_shapes):
    """Whole copies need no bucket per row: the plan keeps none, and the read items are
    the affine draws over the whole group they were."""
    from raylora.config import DataSection
    from raylora.data.plan import pass_items, plan_data, read_units
    from raylora.storage import Storage

    root = weighted_shapes
    whole = plan_data(DataSection(sources=[{"uri": f"{root}/a", "repeats": 2}, {"uri": f"{root}/b"}],
                                  resolution=64, bucketing=True, bucket_step=16), Storage())
    assert [s.row_buckets for s in whole.sources] == [None, None]
    assert whole.rows == 2 * 30 + 10 and sum(whole.bucket_rows().values()) == 70
    plain = weighted_section(root).model_copy(update={"bucketing": False})
    items = pass_items(read_units(plain, plan_data(plain, Storage()), Storage(), 8), 5, 0, True)
    partial = [it for it in items if it["keep"] >= 0]
    assert partial and all(it["a"] >= 1 and it["mask"] == b"" for it in partial)


def test_a_latent_cache_draws_its_partial_copies_per_bucket_too(weighted_shapes, tmp_path, monkeypatch):
    """Over a bucketed latent cache (its files' ``bucket`` column, the manifest's counts per
    file) a fractional weight reads each bucket its planned rows every epoch as well."""
    from collections import Counter

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylora import launch
    from raylora.data import cache

    ids = [np.random.default_rng(7).integers(0, 3, 30), np.zeros(10, int)]
    files = []
    for k, b in enumerate(ids):  # a cache part per source: its rows' buckets
        files.append(str(tmp_path / f"part-{k}.parquet"))
        pq.write_table(pa.table({"bucket": pa.array(b, pa.int32()), "row": np.arange(len(b))}), files[-1])
    entry = cache.CacheEntry(str(tmp_path), files, [30, 10], False, sources=[0, 1], repeats=[1, 1],
                             buckets=[{str(v): int(n) for v, n in zip(*np.unique(b, return_counts=True))}
                                      for b in ids])
    monkeypatch.setattr(cache, "ensure_cache", lambda *a, **k: entry)
    cfg = validate({"model": {"pretrained": str(tmp_path / "model")}, "output": {"uri": str(tmp_path)},
                    "data": {"sources": [{"uri": f"{weighted_shapes}/a", "weight": 1},
                                         {"uri": f"{weighted_shapes}/b", "weight": 2}],
                             "resolution": 64, "bucketing": True, "bucket_step": 16,
                             "center_crop": True, "cache": "latents"},
                    "train": {"batch_size": 2}})
    p = launch.apply_cache(cfg, launch._arithmetic(cfg, "m", entry.plan(cfg.data), [], []))
    planned = p.data.bucket_rows()
    assert sum(p.bucket_steps.values()) == sum(n // 2 for n in planned.values())
    for epoch in range(4):
        assert dict(Counter(b for _, b in epoch_buckets(cfg.data, p.data, epoch, cached=True))) == planned


def test_held_out_rows_are_counted_per_bucket(tmp_path):
    """data.validation_split with buckets (one worker): the hash holds out 10 of one
    bucket's 40 rows and 11 of another's, not 20 % of each; the schedule planned 8 batches
    of 4 in every bucket from 32 expected rows, and trained 6 rows twice. Counted row by
    row, each bucket trains its full batches of its training rows, each row at most once."""
    from collections import Counter

    from raylora.launch import _arithmetic
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    shapes = [(96, 48), (48, 96), (64, 64)]
    write_shapes(tmp_path / "d" / "0.parquet", [shapes[i % 3] for i in range(120)], "img", 0)
    cfg = validate({"model": {"pretrained": str(tmp_path / "model")}, "output": {"uri": str(tmp_path)},
                    "data": {"uri": str(tmp_path / "d"), "resolution": 64, "bucketing": True,
                             "bucket_step": 16, "validation_split": 0.2},
                    "train": {"batch_size": 4, "num_epochs": 2}})
    plan = plan_data(cfg.data, Storage())
    p = _arithmetic(cfg, "m", plan, [], [])
    reads = epoch_buckets(cfg.data, plan, 0)
    per_bucket = Counter(b for _, b in reads)
    assert sorted(per_bucket.values()) != [24] * 3  # the hash's luck: not 20 % of each
    assert p.bucket_steps == {b: n // 4 for b, n in per_bucket.items()}
    assert p.max_steps == 2 * sum(n // 4 for n in per_bucket.values())
    trained = train_epoch(reads, p.bucket_steps, 4, 0)
    assert max(trained.values()) == 1
    assert len(reads) - sum(trained.values()) == sum(n % 4 for n in per_bucket.values())


def test_a_caption_folder_with_a_fractional_weight_reads_its_planned_buckets(weighted_shapes, tmp_path):
    """The same for a caption folder's read units (runs of images, kohya repeats 5): its
    images count 75/2/65 × 5 times each, and each epoch reads every bucket its plan."""
    from collections import Counter

    from raylora.config import DataSection
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    folder = write_mixed_folder(tmp_path / "data")
    data = DataSection(sources=[{"uri": folder, "weight": 1}, {"uri": f"{weighted_shapes}/b", "weight": 1}],
                       resolution=64, bucketing=True, bucket_step=16)
    plan = plan_data(data, Storage())
    assert [round(m, 4) for m in plan.sources[0].groups()] == [2.8846]
    for epoch in range(4):
        reads = epoch_buckets(data, plan, epoch)
        assert dict(Counter(b for _, b in reads)) == plan.bucket_rows() and len(reads) == plan.rows
