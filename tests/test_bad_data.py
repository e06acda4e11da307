"""#7: bad samples never crash a job. The validating decode, row by row, and a Ray run over
a shard that mixes good samples (in every image mode) with each kind of bad one."""

import glob
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raylora.config import ConfigError, validate
from raylora.data.decode import BadRecord, decode_caption, decode_row, open_image, to_rgb
from raylora.data.formats import decode_text

OPTS = dict(max_pixels=50_000, min_size=32, small_images="skip", keep_empty_captions=False,
            background=(10, 20, 30))


@pytest.fixture(autouse=True)
def _pil_bomb_bound_restored():
    """decode_row sets PIL's process-wide bomb bound to data.max_image_pixels (right for a
    Ray worker, which decodes for one run); the bounds these tests set (80 000 px) must not
    reach later test modules, whose 800x600 images PIL would then refuse."""
    before = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = before


def png(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def rgb(size=64, seed=0) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(a, "RGB")


def reason(image, caption="a caption", **over) -> str:
    with pytest.raises(BadRecord) as exc:
        decode_row(image, caption, **{**OPTS, **over})
    return exc.value.reason


def test_each_bad_kind_gets_its_reason():
    good = png(rgb())
    assert reason(b"") == "empty_image"
    assert reason(None) == "empty_image"
    assert reason({"bytes": None, "path": "x.png"}) == "empty_image"
    assert reason(b"certainly not an image") == "not_an_image"
    # The details say what the value was (PIL's own names a BytesIO object).
    with pytest.raises(BadRecord, match=r"^not_an_image: no image format PIL reads starts b'certainl'$"):
        open_image(b"certainly not an image", 50_000)
    with pytest.raises(BadRecord, match=r"^empty_image: no bytes, only the path 'x.png'$"):
        open_image({"bytes": None, "path": "x.png"}, 50_000)
    assert reason(good[: len(good) // 2]) == "corrupt_image"  # truncated
    # damaged where PIL reads the header (an interrupted download): Image.open itself
    # raised OSError ("could not create decoder object", "Truncated File Read"), which
    # escaped the stage and stopped the run naming no file
    webp, jpeg = png(rgb(), "WEBP"), png(rgb(), "JPEG")
    for cut in (webp[:len(webp) // 2], webp[:40], jpeg[:200]):
        assert reason(cut) == "corrupt_image"
    assert reason(png(rgb(300))) == "too_many_pixels"  # 90 000 px > 50 000
    assert reason(png(rgb(16))) == "too_small"
    assert reason(good, None) == "missing_caption"
    assert reason(good, "   ") == "missing_caption"
    assert reason(good, b"\xff\xfe caption") == "caption_not_utf8"
    assert reason(good, decode_text(b"caf\xe9")) == "caption_not_utf8"  # a tar's .txt
    # A byte-order mark (a caption saved by Notepad) is not part of the caption.
    assert decode_text("\ufeffohwx, a man".encode("utf-8")) == "ohwx, a man"
    assert decode_text("a \ufeff in the middle".encode("utf-8")) == "a \ufeff in the middle"


def test_limits_are_configurable_and_never_off():
    big = png(rgb(300))
    img, text = decode_row(big, "x", **{**OPTS, "max_pixels": 100_000})
    assert img.size == (300, 300) and text == "x"
    # PIL's own bomb check follows the configured bound (here: lowered below the image).
    assert Image.MAX_IMAGE_PIXELS == 100_000
    with pytest.raises(BadRecord, match="too_many_pixels"):
        open_image(big, 80_000)
    small, _ = decode_row(png(rgb(16)), "x", **{**OPTS, "small_images": "upscale"})
    assert small.size == (16, 16)  # kept; the resize upscales it like any other image
    with pytest.raises(ValueError, match="data.max_image_pixels"):
        validate({"data": {"uri": "d", "max_image_pixels": 0}, "model": {"pretrained": "m"},
                  "output": {"uri": "o"}})


def test_captions():
    assert decode_caption("a cat", keep_empty=False) == "a cat"
    assert decode_caption("caf\u00e9".encode(), keep_empty=False) == "caf\u00e9"
    assert decode_caption(None, keep_empty=True) == ""  # caption dropout on: the empty prompt
    assert decode_text(b"plain") == "plain"


def test_modes_convert_to_the_right_rgb():
    bg = (10, 20, 30)
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 0)  # fully transparent red: the background
    rgba[0, 1] = (0, 0, 255, 255)  # opaque blue
    rgba[1, 0] = (200, 100, 0, 128)  # half: a blend
    out = np.asarray(to_rgb(Image.fromarray(rgba, "RGBA"), bg))
    assert tuple(out[0, 0]) == bg and tuple(out[0, 1]) == (0, 0, 255)
    np.testing.assert_allclose(out[1, 0], [(200 * 128 + 10 * 127) / 255, (100 * 128 + 20 * 127) / 255,
                                           (30 * 127) / 255], atol=1.01)
    la = np.asarray(to_rgb(Image.fromarray(np.array([[[90, 0], [90, 255]]], np.uint8), "LA"), bg))
    assert tuple(la[0, 0]) == bg and tuple(la[0, 1]) == (90, 90, 90)
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    p.info["transparency"] = 0
    p = Image.open(io.BytesIO(png(p)))  # through a file, as data arrives
    assert p.mode == "P"
    pout = np.asarray(to_rgb(p, bg))
    assert tuple(pout[0, 0]) == bg and tuple(pout[0, 1]) == (0, 255, 0)
    i16 = Image.fromarray(np.array([[0, 32896, 65535]], np.uint16))
    i16 = Image.open(io.BytesIO(png(i16)))
    assert i16.mode in ("I;16", "I")
    assert np.asarray(to_rgb(i16))[0, :, 0].tolist() == [0, 128, 255]  # scaled, not clipped
    cmyk = Image.new("CMYK", (2, 1))
    cmyk.putpixel((0, 0), (0, 0, 0, 0))
    cmyk.putpixel((1, 0), (0, 255, 255, 0))
    cout = np.asarray(to_rgb(cmyk))
    assert tuple(cout[0, 0]) == (255, 255, 255) and tuple(cout[0, 1]) == (255, 0, 0)
    grey = np.asarray(to_rgb(Image.new("L", (1, 1), 77)))
    assert tuple(grey[0, 0]) == (77, 77, 77)


def test_each_input_of_an_edit_row_is_judged():
    """data.control_images: a row's control images, one per input, each decoded and
    resized to its image's size; a row lacking any of them is missing_control (before
    any is decoded: a broken input 1 beside a missing input 2 is still missing_control),
    one that does not decode or is over the pixel bound bad_control; with several
    inputs the message names the input, with one it reads as it always did."""
    from raylora.data.decode import open_masked_row

    opts = {k: v for k, v in OPTS.items() if k != "background"}
    image, small = png(rgb(64, 1)), png(rgb(32, 2))

    def judged(controls) -> str:
        with pytest.raises(BadRecord) as exc:
            open_masked_row(image, "a", None, masks=False, controls=controls, **opts)
        return str(exc.value)

    _, _, _, (first, second) = open_masked_row(image, "a", None, masks=False,
                                               controls=[png(rgb(64, 3)), small], **opts)
    assert first.size == second.size == (64, 64)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(rgb(64, 3)))
    np.testing.assert_array_equal(np.asarray(second),
                                  np.asarray(rgb(32, 2).resize((64, 64), Image.Resampling.BILINEAR)))
    assert open_masked_row(image, "a", None, masks=False, **opts)[3] is None  # off
    assert judged([None]) == ("missing_control: no KEY.control.<ext> beside the image, or an "
                              "empty data.control_column cell")
    assert judged([b"junk"]).startswith("bad_control: control image: not_an_image")
    assert judged([small, b""]) == (
        "missing_control: input 2: no KEY.control_2.<ext> beside the image (or in "
        "data.control_uri's folder 2), or an empty cell in data.control_column's column 2")
    assert judged([b"junk", small, None]).startswith("missing_control: input 3: no KEY.control_3.<ext>")
    assert judged([small, b"junk"]).startswith("bad_control: control image (input 2): not_an_image")
    assert judged([small, png(rgb(300, 4))]).startswith(
        "bad_control: control image (input 2): too_many_pixels")


def mixed_shard(path) -> tuple[int, dict]:
    """12 good rows (5 RGB + 7 other modes) and 8 bad ones, captions as UTF-8 bytes."""
    good = [png(rgb(64, s)) for s in range(5)]
    a = np.random.default_rng(9).integers(0, 256, (64, 64, 4), dtype=np.uint8)
    good += [
        png(Image.fromarray(a, "RGBA")),
        png(Image.fromarray(a[..., :2].copy(), "LA")),
        png(rgb(64, 7).convert("P", palette=Image.Palette.ADAPTIVE)),
        png(Image.fromarray(a[..., :3].copy(), "RGB").convert("CMYK"), "JPEG"),
        png(Image.fromarray((a[..., 0].astype(np.uint16) * 257))),  # 16-bit greyscale
        png(Image.fromarray(a[..., 1].copy(), "L")),
        png(rgb(96, 8), "JPEG"),
    ]
    rows = [(g, f"good image {i}".encode()) for i, g in enumerate(good)]
    whole = png(rgb(64, 11))
    bad = {
        "empty_image": [(b"", b"empty file")],
        "not_an_image": [(b"<html>not found</html>", b"an error page")],
        "corrupt_image": [(whole[: len(whole) // 2], b"cut in half")],
        "too_many_pixels": [(png(rgb(300, 12)), b"a bomb, for this config")],
        "too_small": [(png(rgb(16, 13)), b"a thumbnail")],
        "missing_caption": [(png(rgb(64, 14)), None), (png(rgb(64, 15)), b"  ")],
        "caption_not_utf8": [(png(rgb(64, 16)), b"caf\xe9 latin-1")],
    }
    # Interleaved, so bad rows sit between good ones in every batch.
    all_bad = [r for rs in bad.values() for r in rs]
    mixed = []
    for i, r in enumerate(rows):
        mixed.append(r)
        if i < len(all_bad):
            mixed.append(all_bad[i])
    table = pa.table({"image": pa.array([r[0] for r in mixed], pa.binary()),
                      "text": pa.array([r[1] for r in mixed], pa.binary())})
    pq.write_table(table, path)
    return len(rows), {k: len(v) for k, v in bad.items()}


@pytest.mark.integration
def test_a_run_trains_on_exactly_the_good_rows_and_reports_the_bad(ray_local, tiny_model, tmp_path):
    from raylora.data.badrecords import BadDataError
    from raylora.launch import run

    data = tmp_path / "data"
    data.mkdir()
    n_good, expected = mixed_shard(data / "part-00000.parquet")
    assert (n_good, sum(expected.values())) == (12, 8)

    def tree(name, max_failures=0, **data_over):
        return {
            "model": {"pretrained": tiny_model},
            "data": {"uri": str(data), "resolution": 64, "center_crop": True, "sharding": "files",
                     "shuffle_buffer_size": 0, "max_image_pixels": 50_000, "min_size": 32,
                     **data_over},
            # Exactly one epoch of the 12 good rows.
            "train": {"batch_size": 2, "max_steps": 6, "learning_rate": 1e-3, "seed": 1},
            "checkpoint": {"every_n_steps": 6},
            "failure": {"max_failures": max_failures},
            "output": {"uri": str(tmp_path / name)},
        }

    summary = run(validate(tree("ok", max_bad_fraction=0.5)))
    history = [json.loads(x) for x in open(tmp_path / "ok" / "metrics.jsonl")]
    # 6 batches of 2 within epoch 0: all 12 good rows decoded, and nothing else did.
    assert [r["epoch"] for r in history] == [0] * 6
    assert all(np.isfinite(r["loss"]) for r in history)
    meta = json.loads((tmp_path / "ok" / "adapter" / "raylora.json").read_text())
    assert meta["data"]["rows_decoded"] == 12
    assert meta["data"]["bad_records"] == expected
    assert summary["metrics"]["bad_records"] == 8
    examples = meta["data"]["bad_examples"]
    assert set(examples) == set(expected)
    assert all("part-00000.parquet" in e for ex in examples.values() for e in ex)

    # Over the limit (default 5%): the run stops, saying why and where. At once, though
    # failure.max_failures allows restarts: a restart would read the same rows again (it
    # did, each time: 24 of 60 rows read with max_failures=2 before raylora.entry.EndOnRepeated).
    with pytest.raises(BadDataError) as exc:
        run(validate(tree("strict", max_failures=2)))
    msg = str(exc.value)
    assert "data.max_bad_fraction" in msg and "8 of 20 rows" in msg
    assert "too_many_pixels=1" in msg and "missing_caption=2" in msg and "part-00000.parquet" in msg
    assert not (tmp_path / "strict" / "adapter").exists()
    # That line is all a user sees of it: no rank printed its traceback first (raylora.quiet;
    # Ray Train logged "Error in training function" and the stack on each rank).
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    printed = [p for p in glob.glob(os.path.join(logs, "**", "*"), recursive=True)
               if os.path.isfile(p) and "BadDataError" in (t := open(p, errors="replace").read())
               and "Error in training function" in t]
    assert printed == []

    # lr-find reads through the same decode and refuses the same data, counting the same.
    from raylora.launch import run_lr_find

    with pytest.raises(BadDataError) as exc:
        run_lr_find(validate(tree("lrfind")), num_steps=6)
    assert "8 of 20 rows" in str(exc.value) and "caption_not_utf8=1" in str(exc.value)
    assert not (tmp_path / "lrfind" / "lr_find.csv").exists()


def test_a_reused_cache_entry_is_judged_on_what_its_build_decoded(ray_local, tiny_model, tmp_path,
                                                                  caplog):
    """A rerun reusing a complete latent-cache entry decodes nothing, so
    data.max_bad_fraction judged nothing: a first run was refused (6 of 16 rows unusable)
    and the next, on another output.uri, trained, its raylora.json saying bad_records {}.
    The entry records its build's counts (test_sdxl_cache: record_build); a run reusing it
    gets them as the build's run does: the same verdict, before training (launch.run
    judges right after apply_cache), and the same counts for raylora.json. An entry from
    before they were recorded: no verdict, and no counts (not "0 rows decoded")."""
    from raylora import desk, launch, storage
    from raylora.data.badrecords import BadDataError, verdict
    from raylora.data.cache import MANIFEST, cache_root, fingerprint
    from raylora.data.demo import make_samples
    from raylora.data.plan import plan_data

    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(
        [{"image": img if i % 8 < 5 else b"not an image", "text": text}
         for i, (img, text) in enumerate(make_samples(16, size=32, seed=3))]),
        tmp_path / "data" / "part-00000.parquet")
    shard = f"{tmp_path}/data/part-00000.parquet"
    counts = {"rows_ok": 10, "bad_records": {"not_an_image": 6}, "bad_fraction": 6 / 16,
              "rows_seen": 16, "rows_ok_by_source": {"0": 10},
              "bad_examples": {"not_an_image": [
                  f"{shard}#{i}: not_an_image: no image format PIL reads starts b'not an i'"
                  for i in (5, 6, 7)]}}

    def judged(max_bad_fraction: float, recorded: dict | None):
        """check_bad_records after apply_cache reused the entry (its manifest as a build
        writes it, with ``recorded`` counts or none)."""
        cfg = validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "o")},
                        "data": {"uri": str(tmp_path / "data"), "resolution": 32,
                                 "center_crop": True, "cache": "latents",
                                 "cache_uri": str(tmp_path / "cache"),
                                 "max_bad_fraction": max_bad_fraction},
                        "train": {"batch_size": 2}})
        store = cfg.storage.client()
        data = plan_data(cfg.data, store)
        uri = storage.join(cache_root(cfg), fingerprint(cfg, "sd", tiny_model, data, store))
        os.makedirs(uri, exist_ok=True)
        with open(os.path.join(uri, MANIFEST), "w") as f:
            json.dump({"version": 2, "family": "sd", "files": ["parts/part-000000-0000.parquet"],
                       "file_rows": [10], "file_sources": [0], "file_repeats": [1],
                       **({"decode_counts": recorded} if recorded else {})}, f)
        p = launch._arithmetic(cfg, tiny_model, data, [], [])
        p.family, p.bad_records = "sd", desk.start()
        try:
            p = launch.apply_cache(cfg, p)
            assert p.cache_reused is True and p.total_rows == 10
            return launch.check_bad_records(cfg, p)
        finally:
            desk.stop(p.bad_records)

    with pytest.raises(BadDataError) as exc:
        judged(0.05, counts)
    assert str(exc.value) == verdict(counts, 0.05, 1)
    assert str(exc.value).startswith("data.max_bad_fraction: 6 of 16 rows read so far (37.5%) "
                                     f"are unusable, over the limit of 5.0%: not_an_image=6 (e.g. {shard}#5: ")
    # under the limit: what raylora.json gets, as from the run that built the entry
    assert judged(0.5, counts) == {"bad_records_counts": {"not_an_image": 6},
                                   "bad_examples": counts["bad_examples"], "rows_decoded": 10,
                                   "rows_decoded_by_source": {"0": 10}}
    # an entry that recorded none: unknown, said so, nothing judged or recorded
    with caplog.at_level("WARNING", logger="raylora"):
        assert judged(0.05, None) == {}
    assert "built before cache entries recorded the rows their build decoded" in caplog.text


def test_an_error_a_restart_would_repeat_ends_the_run_and_reaches_the_cli_as_itself():
    """raylora.entry.EndOnRepeated, as the controller calls it with the workers' errors
    (the Ray run above shows the controller ending the run on it)."""
    import pickle

    import ray.train
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from raylora.data.badrecords import BadDataError
    from raylora.entry import EndOnRepeated, RepeatedError
    from raylora.launch import _repeated
    from raylora.train.loop import DataEndedError, NonFiniteLossError

    def wrapped(error):  # what a worker's error is when the controller polls it
        return UserExceptionWithTraceback(error, "Traceback ...")

    callback = EndOnRepeated()
    # Any other error: Ray Train's failure policy decides (restarts, failure.max_failures).
    callback.after_exception(None, {0: wrapped(RuntimeError("a peer went away")),
                                    1: wrapped(OSError("connection reset"))})
    for error in (BadDataError("data.max_bad_fraction: 8 of 20 rows"),
                  NonFiniteLossError("loss or gradients were NaN/inf for 5 optimizer steps"),
                  DataEndedError("epoch 0: the data stream ended before the run did")):
        with pytest.raises(ray.train.ControllerError) as exc:
            # rank 1's error is the collateral one; rank 0's says why
            callback.after_exception(None, {1: wrapped(RuntimeError("gloo: connection closed")),
                                            0: wrapped(error)})
        # It crosses from the controller to the driver pickled.
        ended = pickle.loads(pickle.dumps(exc.value))
        cause = ended.controller_failure
        assert isinstance(cause, RepeatedError) and isinstance(cause, ValueError)  # CLI: one line
        assert str(cause) == (f"rank 0: {type(error).__name__}: {error} (not retried: restarting "
                              "the workers would repeat it; failure.max_failures is for lost workers)")
        # raylora.tune tells a diverged trial by the class name in the trial's error.
        assert type(error).__name__ in str(ended)
        assert _repeated(ended) is cause
    other = ray.train.ControllerError(RuntimeError("the controller failed"))
    assert _repeated(other) is other


def heldout_folder(path, captions: list, corrupt: tuple = ()) -> str:
    """A validation folder: one parquet of 64 px squares, one per caption (``corrupt``:
    the indices whose image is cut in half)."""
    os.makedirs(path, exist_ok=True)
    images = [png(rgb(64, 20 + i)) for i in range(len(captions))]
    images = [b[: len(b) // 2] if i in corrupt else b for i, b in enumerate(images)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()),
                             "text": pa.array(captions, pa.string())}), f"{path}/v.parquet")
    return str(path)


def test_heldout_rows_are_the_first_usable_ones_and_all_are_evaluated(base_config, tmp_path):
    """The driver reads the first data.validation_max_samples rows the held-out stage
    keeps: a blank caption or a corrupt image does not take a slot, the plan's count (what
    the model card and raylora.json say were evaluated) is what the worker's batch holds."""
    from dataclasses import replace

    from raylora import worker
    from raylora.entry import WorkerSpec
    from raylora.launch import plan, resolve_paths

    held = heldout_folder(tmp_path / "held", ["a square 0", "", "a square 2", "  ", "a square 4",
                                              "a square 5"], corrupt=(2,))
    for most, texts in ((2, ["a square 0", "a square 4"]), (64, ["a square 0", "a square 4",
                                                                 "a square 5"])):
        cfg = resolve_paths(validate({**base_config, "data": {
            **base_config["data"], "validation_uri": held, "validation_max_samples": most,
            "caption_dropout": 0.1}}))  # dropout keeps blank training captions, not held-out
        p = plan(cfg)
        assert p.heldout_rows == len(texts) and [r["text"] for r in p.heldout] == texts
        batch = worker._heldout_batch(WorkerSpec(cfg, p))
        assert batch["pixel_values"].shape == (len(texts), 3, 64, 64)
        assert batch["input_ids"].shape[0] == len(texts)
    # A row the worker's stage drops after all (a node whose decoders differ): refused, named
    blank = {"image": p.heldout[0]["image"], "text": " "}
    with pytest.raises(ValueError) as exc:
        worker._heldout_batch(WorkerSpec(cfg, replace(p, heldout=[*p.heldout, blank],
                                                      heldout_rows=4)))
    assert str(exc.value) == ("data.validation_uri: 1 of the 4 held-out rows read on the driver "
                              "could not be decoded on this worker (row 3: missing_caption); "
                              "replace them")


def test_validation_resolution_sizes_the_heldout_rows_and_the_previews(base_config, tmp_path):
    """validation.resolution (SimpleTuner's --validation_resolution): the held-out rows are
    scored at that square, cached or not, and the previews render at it, whatever
    data.resolution trains at: a data.resolution search is measured at one size. A size
    off the family's latent grid is refused before Ray, naming the key."""
    import torch
    from inproc import _fresh_accelerator
    from PIL import Image

    from raylora import worker
    from raylora.checkpoint.export import _heldout_source
    from raylora.data.cache import _encode_rows_task, from_column
    from raylora.entry import WorkerSpec
    from raylora.launch import plan, resolve_paths
    from raylora.track import Tracker
    from raylora.train.setup import build_run

    held = heldout_folder(tmp_path / "held", ["a square 0", "a square 1"])
    tree = {**base_config, "data": {**base_config["data"], "validation_uri": held},
            "validation": {"prompts": ["a red circle"], "num_inference_steps": 2}}
    for side in (None, 32):  # the largest data.resolution (64), or validation.resolution
        cfg = resolve_paths(validate({**tree, "validation": {**tree["validation"], "resolution": side}}))
        p = plan(cfg)
        assert cfg.eval_resolution() == (side or 64)
        spec = WorkerSpec(cfg, p)
        assert worker._heldout_batch(spec)["pixel_values"].shape == (2, 3, side or 64, side or 64)
        encoded, _ = _encode_rows_task(cfg.to_dict(), p.family, p.model_path, {"heldout": p.heldout}, [])
        # the tiny VAE halves each side: a posterior's mean and log-variance, 4 channels each
        assert from_column(encoded["heldout"]["latent_params"]).shape == (2, 8, (side or 64) // 2,
                                                                          (side or 64) // 2)
    run = build_run(cfg, _fresh_accelerator(1), 4, rank=0)
    with torch.no_grad():
        worker._previewer(spec, run, Tracker(), 0)(3)
    with Image.open(tmp_path / "out" / "validation" / "step_000003.png") as grid:
        assert grid.size == (32, 32)
    # raylora.json and the model card say at which size the held-out loss was measured
    assert _heldout_source(cfg) == f"data.validation_uri={held}, at validation.resolution=32"
    assert _heldout_source(cfg.model_copy(update={"validation": cfg.validation.model_copy(
        update={"resolution": None})})) == f"data.validation_uri={held}"
    with pytest.raises(ConfigError) as err:
        plan(resolve_paths(validate({**tree, "validation": {"resolution": 33}})))
    assert err.value.problems == [
        "validation.resolution: 33 is not a multiple of 2 (the sd latent grid: VAE downsampling "
        "× patch size)"]


def test_no_usable_heldout_row_is_refused_before_ray_naming_the_key(base_config, tmp_path):
    from raylora.data.plan import plan_data
    from raylora.data.split import read_heldout_rows
    from raylora.launch import plan, resolve_paths
    from raylora.storage import Storage

    held = heldout_folder(tmp_path / "blank", ["", " ", "a square 2"], corrupt=(2,))
    cfg = resolve_paths(validate({**base_config, "data": {**base_config["data"],
                                                          "validation_uri": held}}))
    with pytest.raises(ConfigError) as exc:
        plan(cfg)
    assert exc.value.problems == [
        f"data.validation_uri: {held}: none of the 3 held-out rows is usable (missing_caption=2, "
        f"corrupt_image=1; e.g. {held}/v.parquet#0: missing_caption; {held}/v.parquet#2: "
        "corrupt_image: image file is truncated): there is nothing to evaluate. Caption the "
        "held-out images (data.caption_column, or the caption files): a held-out row is scored "
        "with its caption, never a blank one. Check that the images were copied whole."]
    # data.validation_split: the held-out rows of the training files, judged the same way
    data = validate({**base_config, "data": {"uri": held, "resolution": 64}}).data
    store = Storage()
    with pytest.raises(ValueError, match=r": none of the 3 held-out rows is usable \("):
        read_heldout_rows(data, plan_data(data, store), store, 1.0)


def test_cached_and_uncached_heldout_stages_score_the_same_rows(base_config, tmp_path):
    """The latent cache encodes the held-out rows with the uncached workers' stage: with
    data.caption_dropout a blank held-out caption is dropped on both paths (it once was
    the empty prompt when cached), so both score the same rows to the same loss."""
    import torch

    from raylora import worker
    from raylora.data.cache import _encode_rows_task, from_column
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.entry import WorkerSpec
    from raylora.launch import plan, resolve_paths
    from raylora.model.load import load_components
    from raylora.train.evaluate import heldout_loss, prepare_heldout
    from raylora.train.setup import frozen_parts

    held = heldout_folder(tmp_path / "held", ["a square 0", "", "a square 2", " ", "a square 4"])
    cfg = resolve_paths(validate({**base_config, "data": {
        **base_config["data"], "validation_uri": held, "caption_dropout": 0.1}}))
    p = plan(cfg)
    # every row as read, blank ones too: the stages themselves decide
    rows = [{"image": r["image"], "text": r["text"]}
            for r in pq.read_table(f"{held}/v.parquet").to_pylist()]
    stage = Preprocess(StageSpec(**worker._stage_kwargs("heldout", WorkerSpec(cfg, p))))
    uncached = {k: torch.from_numpy(v) for k, v in stage(
        {k: np.array([r[k] for r in rows], dtype=object) for k in ("image", "text")}).items()}
    encoded, _ = _encode_rows_task(cfg.to_dict(), p.family, p.model_path, {"heldout": rows}, [])
    cached = {k: from_column(v) for k, v in encoded["heldout"].items()}
    assert uncached["pixel_values"].shape[0] == cached["latent_params"].shape[0] == 3
    comps = load_components(cfg.model, torch.float32)
    parts = frozen_parts(cfg, comps, "cpu", torch.float32)
    losses = [heldout_loss(comps.denoiser, prepare_heldout(parts, b, 4, 0), torch.float32)
              for b in (uncached, cached)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
