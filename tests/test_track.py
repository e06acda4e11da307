"""Trackers write what was logged, where it was asked, readable by the tools' own formats.

The files are read back without TensorBoard or a wandb server: TensorBoard event files and
wandb's offline ``.wandb`` log are both length-prefixed, checksummed protobuf records, and
both readers below verify every checksum.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from raylora.config import TrackingSection
from raylora.storage import Storage
from raylora.track import Tracker, open_tracker, scalars

LOSSES = [0.75, 0.5, 0.25]
LRS = [1e-4, 2e-4, 3e-4]
COLORS = [(255, 0, 0), (0, 0, 255)]
FAKE_WANDB_KEY = "rAyLoRaFakeWandbKey0001doNotLeak" + "0" * 8


def log_run(tracker: Tracker) -> None:
    """Three steps of loss/lr (in numpy, torch and float flavours, plus values that must be
    skipped) and two 16x16 solid images at step 2."""
    for step in range(3):
        tracker.log(step, {
            "loss": torch.tensor(LOSSES[step]) if step == 1 else LOSSES[step],
            "lr": np.float64(LRS[step]),
            "note": "text is skipped",
            "grad_norm": None,
        })
    tracker.log_images(2, "samples", [Image.new("RGB", (16, 16), c) for c in COLORS],
                       ["a red square", "a blue square"])
    tracker.close()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfevents(path: str) -> list:
    """Events of one TFRecord file: uint64 length, masked crc32c of it, payload, its crc."""
    from tensorboardX.proto.event_pb2 import Event

    with open(path, "rb") as f:
        data = f.read()
    pos, events = 0, []
    while pos < len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        payload = data[pos + 12:pos + 12 + n]
        (payload_crc,) = struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])
        assert header_crc == masked_crc(header) and payload_crc == masked_crc(payload)
        events.append(Event.FromString(payload))
        pos += 16 + n
    return events


def read_wandb_log(path: str) -> list:
    with open(path, "rb") as f:
        return read_wandb_log_bytes(f.read())


def read_wandb_log_bytes(data: bytes) -> list:
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log framing (32 KiB
    blocks; per chunk crc32(type + data), uint16 length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto.wandb_internal_pb2 import Record

    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block tails too short for a header are padding
            pos += block - pos % block
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad chunk at {pos}"
        buf += chunk
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST
            records.append(Record.FromString(buf))
            buf = b""
    return records


def check_tensorboard_events(paths: list[str]) -> None:
    events = [e for p in paths for e in read_tfevents(p)]
    got: dict[str, list] = {}
    images, texts = [], []
    for e in events:
        for v in e.summary.value:
            if v.HasField("simple_value"):
                got.setdefault(v.tag, []).append((e.step, v.simple_value))
            elif v.HasField("image"):
                images.append((e.step, v.tag, v.image.height, v.image.width, v.image.encoded_image_string))
            elif v.HasField("tensor"):  # add_text
                texts.append((e.step, v.tag, v.tensor.string_val[0].decode()))
    assert set(got) == {"loss", "lr"}  # "note" and None were skipped
    assert [s for s, _ in got["loss"]] == [0, 1, 2] and [s for s, _ in got["lr"]] == [0, 1, 2]
    assert [v for _, v in got["loss"]] == pytest.approx(LOSSES, rel=1e-6)
    assert [v for _, v in got["lr"]] == pytest.approx(LRS, rel=1e-6)
    assert [i[:4] for i in sorted(images)] == [(2, "samples/0", 16, 16), (2, "samples/1", 16, 16)]
    for (_, _, _, _, png), color in zip(sorted(images), COLORS):
        assert Image.open(io.BytesIO(png)).convert("RGB").getpixel((8, 8)) == color
    # tensorboardX files text under "<tag>/text_summary".
    assert texts == [(2, "samples/captions/text_summary", "0: a red square\n\n1: a blue square")]


def test_tensorboard_event_files_hold_the_logged_values(tmp_path):
    out = tmp_path / "out"
    tracker = open_tracker(TrackingSection(backend="tensorboard"), str(out), {"a": 1})
    log_run(tracker)
    paths = glob.glob(str(out / "tracking" / "tensorboard" / "events.out.tfevents.*"))
    assert len(paths) == 1
    check_tensorboard_events(paths)
    tracker.close()  # a second close is harmless


def test_wandb_offline_run_records_metrics_images_and_no_secret(tmp_path, monkeypatch):
    # conftest leaves WANDB_MODE=disabled; setting it here too shows the config's mode wins.
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    out = tmp_path / "runs" / "my-run"
    tracking = TrackingSection(backend="wandb", wandb_mode="offline", project="proj")
    log_run(open_tracker(tracking, str(out), {"train": {"learning_rate": 1e-3}}))

    run_dirs = glob.glob(str(out / "tracking" / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    # wandb 0.31 offline writes no files/wandb-summary.json or config.yaml: the run lives
    # in the binary .wandb log that `wandb sync` uploads, so that is what is checked.
    (log_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    records = read_wandb_log(log_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("proj", "my-run")  # name defaults to the dir
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["train"] == {"learning_rate": 1e-3}

    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key or [i.key]): json.loads(i.value_json) for i in r.history.item})
    assert [row["_step"] for row in rows] == [0, 1, 2]
    assert [row["loss"] for row in rows] == pytest.approx(LOSSES, rel=1e-6)  # torch → 0.5
    assert [row["lr"] for row in rows] == pytest.approx(LRS, rel=1e-12)
    assert not any("note" in row or "grad_norm" in row for row in rows)
    assert rows[2]["samples/captions"] == ["a red square", "a blue square"]
    assert (rows[2]["samples/width"], rows[2]["samples/height"]) == (16, 16)

    summary: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({"/".join(u.nested_key or [u.key]): json.loads(u.value_json)
                            for u in r.summary.update})
    assert summary["loss"] == pytest.approx(LOSSES[-1]) and summary["_step"] == 2

    pngs = sorted(glob.glob(os.path.join(run_dir, "files", "media", "images", "samples_2_*.png")))
    assert len(pngs) == 2
    assert sorted(Image.open(p).convert("RGB").getpixel((8, 8)) for p in pngs) == sorted(COLORS)

    written = [p for p in glob.glob(str(out / "**" / "*"), recursive=True) if os.path.isfile(p)]
    assert log_file in written
    for path in written:
        with open(path, "rb") as f:
            assert FAKE_WANDB_KEY.encode() not in f.read(), path


def test_none_backend_does_nothing(tmp_path):
    out = tmp_path / "out"
    tracker = open_tracker(TrackingSection(), str(out), {})
    assert type(tracker) is Tracker
    log_run(tracker)
    tracker.sync()
    assert not out.exists()


def test_scalars_keeps_numbers_of_every_flavour_and_drops_the_rest():
    got = scalars({
        "f": 0.5, "i": 3, "np": np.float32(0.25), "t": torch.tensor(2.0), "t1": torch.tensor([4.0]),
        "nan": float("nan"), "inf": np.float64("inf"),
        "none": None, "s": "x", "vec": torch.tensor([1.0, 2.0]), "list": [1.0], "d": {"a": 1},
    })
    assert set(got) == {"f", "i", "np", "t", "t1", "nan", "inf"}
    assert all(type(v) is float for v in got.values())
    assert (got["f"], got["i"], got["np"], got["t"], got["t1"]) == (0.5, 3.0, 0.25, 2.0, 4.0)
    assert math.isnan(got["nan"]) and got["inf"] == math.inf


def test_mismatched_captions_are_refused(tmp_path):
    tracker = open_tracker(TrackingSection(backend="tensorboard"), str(tmp_path / "out"), {})
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        tracker.log_images(0, "s", [Image.new("RGB", (4, 4))] * 2, ["one"])
    tracker.close()


@pytest.fixture
def bucket(moto_endpoint, monkeypatch):
    """A bucket on the session's S3 server, with fake credentials for this test only."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00002")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rAyLoRa/FakeSecret+0002/doNotLeak")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket="raylora-track")
    return "raylora-track"


def test_tensorboard_to_s3_syncs_at_checkpoints_and_uploads_on_close(bucket, moto_endpoint, tmp_path):
    store = Storage(endpoint_url=moto_endpoint)
    uri = f"s3://{bucket}/runs/run1"
    tracker = open_tracker(TrackingSection(backend="tensorboard"), uri, {}, store)
    local = tracker.local_dir
    tracker.log(0, {"loss": 1.0})
    assert store.list_files(uri) == []  # nothing is uploaded until a sync
    tracker.sync()  # as at a checkpoint
    (event_uri,) = store.list_files(uri)
    assert event_uri.startswith(f"{uri}/tracking/tensorboard/events.out.tfevents.")
    synced = tmp_path / "synced.tfevents"
    synced.write_bytes(store.read_bytes(event_uri))
    assert [(e.step, v.simple_value) for e in read_tfevents(str(synced)) for v in e.summary.value] == [
        (0, 1.0)]

    tracker.log(1, {"loss": 0.5})
    tracker.close()
    assert not os.path.exists(local)  # the temp dir goes once uploaded
    assert store.list_files(uri) == [event_uri]
    final = tmp_path / "final.tfevents"
    final.write_bytes(store.read_bytes(event_uri))
    assert [(e.step, v.simple_value) for e in read_tfevents(str(final)) for v in e.summary.value] == [
        (0, 1.0), (1, 0.5)]


def test_wandb_offline_to_s3_uploads_the_run_dir_once(bucket, moto_endpoint, monkeypatch):
    """Only the run's own dir goes up: wandb/ also holds a `latest-run` symlink to it, which
    a plain directory copy would follow and upload twice."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = Storage(endpoint_url=moto_endpoint)
    uri = f"s3://{bucket}/runs/wb"
    tracking = TrackingSection(backend="wandb", wandb_mode="offline")
    tracker = open_tracker(tracking, uri, {}, store)
    log_run(tracker)
    assert not os.path.exists(tracker.local_dir)

    names = [f[len(uri) + 1:] for f in store.list_files(uri)]
    # Besides the run's dir only the run id a restarted run reads back (written at once).
    names.remove("tracking/wandb-run-id")
    run_dirs = {n.split("/")[2] for n in names}
    assert len(run_dirs) == 1 and run_dirs.pop().startswith("offline-run-")
    assert all(n.startswith("tracking/wandb/offline-run-") for n in names), names
    run_id = store.read_bytes(f"{uri}/tracking/wandb-run-id").decode()
    assert names[0].split("/")[2].endswith(f"-{run_id}")
    (log_name,) = [n for n in names if n.endswith(".wandb")]
    assert len([n for n in names if "/files/media/images/samples_2_" in n]) == 2
    records = read_wandb_log_bytes(store.read_bytes(f"{uri}/{log_name}"))
    losses = [json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "history"
              for i in r.history.item if list(i.nested_key) == ["loss"]]
    assert losses == pytest.approx(LOSSES)


def test_wandb_online_without_a_key_is_a_config_problem_before_ray(tmp_path, monkeypatch,
                                                                  tiny_model, demo_data):
    """Found where wandb looks (asked of wandb): none, a key in the environment, the
    ~/.netrc entry `wandb login` writes. Offline and the other backends need none."""
    from raylora.track import tracking_problem

    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no settings key
    online = TrackingSection(backend="wandb", project="proj")
    assert tracking_problem(online) == (
        "tracking.backend: wandb finds no API key for https://api.wandb.ai here: set "
        "WANDB_API_KEY (it reaches the workers as a secret) or run `wandb login`, or set "
        "tracking.wandb_mode: offline and `wandb sync` the run afterwards")
    assert tracking_problem(TrackingSection(backend="wandb", wandb_mode="offline")) is None
    assert tracking_problem(TrackingSection(backend="tensorboard")) is None
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    assert tracking_problem(online) is None
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_WANDB_KEY}\n")
    netrc.chmod(0o600)
    assert tracking_problem(online) is None
    # A run on an embedded Ray (its workers read this machine's keys): refused before it
    # starts. Joining a cluster (RAY_ADDRESS), whose nodes may hold a key of their own: not.
    from raylora import launch
    from raylora.config import ConfigError, validate

    netrc.unlink()
    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: pytest.fail("Ray was started"))
    tree = {"model": {"pretrained": tiny_model}, "data": {"uri": demo_data, "resolution": 64},
            "output": {"uri": str(tmp_path / "out")}, "tracking": {"backend": "wandb"}}
    with pytest.raises(ConfigError) as exc:
        with launch.prepared(validate(tree), launch.TRAIN):
            pass
    assert exc.value.problems == [tracking_problem(online)]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(pytest.fail.Exception, match="Ray was started"):
        with launch.prepared(validate(tree), launch.TRAIN):
            pass
    assert not (tmp_path / "out").exists()


def wandb_runs(out) -> list[tuple[str, str, list[tuple[int, float]]]]:
    """(dir name, run id, [(step, loss)]) of each offline run dir under ``out``, oldest first."""
    runs = []
    for run_dir in sorted(glob.glob(str(out / "tracking" / "wandb" / "offline-run-*"))):
        (log_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
        records = read_wandb_log(log_file)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                for r in records if r.WhichOneof("record_type") == "history"]
        runs.append((os.path.basename(run_dir), run.run_id,
                     [(row["_step"], row["loss"]) for row in rows if "loss" in row]))
    return runs


def test_wandb_restarted_run_logs_into_the_same_run(tmp_path, monkeypatch):
    """A second start on the same output (a rerun, Ray Train's restart) opens the wandb run
    of the first (same id: `wandb sync` puts both dirs into one run, in order); another
    output gets a run of its own."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = TrackingSection(backend="wandb", wandb_mode="offline")
    out = tmp_path / "my-run"
    for start, last in ((0, 10), (8, 15)):  # killed after step 10, resumed from step 8
        tracker = open_tracker(tracking, str(out), {}, start_step=start)
        for step in range(start + 1, last + 1):
            tracker.log(step, {"loss": 1.0 / step})
        tracker.close()
    run_id = (out / "tracking" / "wandb-run-id").read_text()
    assert len(run_id) == 8
    (first, first_id, first_loss), (second, second_id, second_loss) = wandb_runs(out)
    # wandb names the dirs offline-run-<time>-<id>, "-1" added when the time is the same.
    assert first_id == second_id == run_id and f"-{run_id}" in first and f"-{run_id}" in second
    assert first_loss == [(s, pytest.approx(1.0 / s)) for s in range(1, 11)]
    assert second_loss == [(s, pytest.approx(1.0 / s)) for s in range(9, 16)]

    other = open_tracker(tracking, str(tmp_path / "other"), {})
    other.close()
    assert (tmp_path / "other" / "tracking" / "wandb-run-id").read_text() not in ("", run_id)
    # tracking.project "team/project": the team is wandb's entity (a "/" in a project
    # name is refused by wandb, once the run opens)
    team = open_tracker(TrackingSection(backend="wandb", wandb_mode="offline",
                                        project="my-team/sd15"), str(tmp_path / "team"), {})
    assert (team._run.entity, team._run.project) == ("my-team", "sd15")
    team.close()


def test_tensorboard_resumed_run_replaces_the_steps_it_trains_again(tmp_path):
    """A run resumed from its step-8 checkpoint after logging up to step 10 writes a second
    event file in the same logdir (one TensorBoard run) that starts with a SessionLog START
    at step 9: TensorBoard then drops the first file's steps 9 and 10 (as it does for
    SummaryWriter(purge_step=9)), so the curve has each step once, the resumed values."""
    from tensorboardX.proto.event_pb2 import SessionLog

    out = tmp_path / "out"
    tracking = TrackingSection(backend="tensorboard")
    for start, last, value in ((0, 10, 1.0), (8, 12, 2.0)):
        tracker = open_tracker(tracking, str(out), {}, start_step=start)
        for step in range(start + 1, last + 1):
            tracker.log(step, {"loss": value})
        tracker.close()
    paths = sorted(glob.glob(str(out / "tracking" / "tensorboard" / "events.out.tfevents.*")))
    assert len(paths) == 2 and paths[1].endswith(".from8")
    starts = [e.step for e in read_tfevents(paths[1])
              if e.HasField("session_log") and e.session_log.status == SessionLog.START]
    assert starts == [9]
    # TensorBoard's rule (EventAccumulator, file_version 2): files in name order, and a
    # SessionLog START at step s drops the points seen so far at steps >= s.
    points: dict[int, float] = {}
    for path in paths:
        for e in read_tfevents(path):
            if e.HasField("session_log") and e.session_log.status == SessionLog.START:
                points = {s: v for s, v in points.items() if s < e.step}
            for v in e.summary.value:
                if v.tag == "loss":
                    points[e.step] = v.simple_value
    assert points == {**{s: 1.0 for s in range(1, 9)}, **{s: 2.0 for s in range(9, 13)}}


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wandb_server_unreachable_logs_offline_with_a_warning(tmp_path, monkeypatch, caplog):
    """Online wandb whose server does not answer: a warning naming wandb (never the key),
    and the run's metrics go to an offline run with the output's id, for `wandb sync`."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    port = _closed_port()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")  # wandb's default wait is 90 s
    # wandb keeps the settings of an earlier test's session (its host included) in-process.
    wandb.teardown()
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="raylora.track"):
        tracker = open_tracker(TrackingSection(backend="wandb", project="proj"), str(out), {})
    for step in (1, 2):
        tracker.log(step, {"loss": 1.0 / step})
    tracker.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "raylora.track"]
    assert warning.startswith("tracking: wandb could not start online (CommError: ")
    assert "logging offline to " in warning and FAKE_WANDB_KEY not in warning
    ((_, run_id, losses),) = wandb_runs(out)
    assert run_id == (out / "tracking" / "wandb-run-id").read_text()
    assert losses == [(1, 1.0), (2, 0.5)]
    # The online attempt went to the closed port (not a host kept from an earlier test).
    (online_log,) = glob.glob(str(out / "tracking" / "wandb" / "run-*" / "logs" / "debug-internal.*"))
    with open(online_log) as f:
        assert f"127.0.0.1:{port}" in f.read()


def test_tracker_failures_are_warnings_not_errors(tmp_path, monkeypatch, caplog):
    """A backend that cannot start at all becomes the none tracker; a log call failing
    mid-run stops the logging to wandb, keeps what was logged, and close() still works."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = TrackingSection(backend="wandb", wandb_mode="offline")
    with caplog.at_level("WARNING", logger="raylora.track"):
        with monkeypatch.context() as m:
            m.setattr(wandb, "init", lambda **kw: (_ for _ in ()).throw(OSError("disk full")))
            tracker = open_tracker(tracking, str(tmp_path / "a"), {})
        assert type(tracker) is Tracker
        assert [r.getMessage() for r in caplog.records if r.name == "raylora.track"] == [
            "tracking: wandb could not start (OSError: disk full); training goes on without "
            "it (metrics.jsonl keeps every step)"]
        caplog.clear()

        out = tmp_path / "b"
        tracker = open_tracker(tracking, str(out), {})
        tracker.log(1, {"loss": 1.0})
        real_log = tracker._run.log
        tracker._run.log = lambda *a, **k: (_ for _ in ()).throw(BrokenPipeError("service gone"))
        tracker.log(2, {"loss": 0.5})
        tracker._run.log = real_log  # the service is back: nothing more is sent anyway
        tracker.log(3, {"loss": 0.25})
        tracker.close()
    assert [r.getMessage() for r in caplog.records if r.name == "raylora.track"] == [
        "tracking: wandb log failed (BrokenPipeError: service gone); nothing more goes to "
        "wandb in this run (metrics.jsonl keeps every step)"]
    ((_, _, losses),) = wandb_runs(out)
    assert losses == [(1, 1.0)]


def test_step0_heldout_loss_reaches_the_tracker(base_config, tmp_path):
    """The loop hands the step-0 evaluation (eval_loss_base) to on_base_eval, and the
    worker's reporter logs it as eval_loss at step 0, before the later evaluations."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from raylora.config import validate
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.train.loop import LoopHooks, LoopSettings, run_loop
    from raylora.train.setup import build_run
    from raylora.worker import _Reporter

    cfg = validate({**base_config, "tracking": {"backend": "tensorboard"}})
    run = build_run(cfg, Accelerator(cpu=True), 4, rank=0)
    stage = Preprocess(StageSpec(cfg.model.pretrained, 64, center_crop=True, random_flip=False))
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(2):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
        pngs.append(buf.getvalue())
    rows = stage({"image": np.array(pngs, dtype=object), "text": np.array(["a"] * 2, dtype=object)})
    batch = {"pixel_values": torch.from_numpy(rows["pixel_values"]),
             "input_ids": torch.from_numpy(rows["input_ids"])}
    spec = SimpleNamespace(config=cfg, plan=SimpleNamespace(max_steps=4), progress_board=None)
    reporter = _Reporter(spec, run, rank=0)
    losses = iter([1.5, 1.25, 1.125])

    def log_eval(state):  # on_eval and on_checkpoint without their Ray reports
        reporter.tracker.log(state.global_step, {"eval_loss": state.eval_loss_last})

    run_loop(run, LoopSettings(max_steps=4, images_per_step=2, checkpoint_every=4, eval_every=2),
             LoopHooks(lambda e: [batch] * 4, evaluate=lambda: next(losses),
                       on_base_eval=reporter.on_base_eval, on_eval=log_eval,
                       on_checkpoint=lambda s, final: log_eval(s)))
    reporter.close()
    assert run.state.eval_loss_base == 1.5
    (path,) = glob.glob(str(tmp_path / "out" / "tracking" / "tensorboard" / "events.out.*"))
    got = [(e.step, v.simple_value) for e in read_tfevents(path) for v in e.summary.value
           if v.tag == "eval_loss"]
    assert got == [(0, 1.5), (2, 1.25), (4, 1.125)]


@pytest.mark.integration
def test_training_tracks_the_step0_heldout_loss_and_resumes_its_tensorboard_run(
        ray_local, base_config, tmp_path):
    """Through the Ray Train worker: the held-out loss before the first step is eval_loss at
    step 0; a rerun that trains on from the step-2 checkpoint writes a second event file
    in the same logdir, marked to replace what the first run logged after step 2."""
    from tensorboardX.proto.event_pb2 import SessionLog

    from raylora.config import validate
    from raylora.launch import run

    out = tmp_path / "out"
    tree = {**base_config, "data": {**base_config["data"], "validation_split": 0.25},
            "tracking": {"backend": "tensorboard"}, "output": {"uri": str(out)}}
    for max_steps in (2, 4):
        run(validate({**tree, "train": {**tree["train"], "max_steps": max_steps}}))
    metrics = json.loads((out / "adapter" / "raylora.json").read_text())["metrics"]
    paths = sorted(glob.glob(str(out / "tracking" / "tensorboard" / "events.out.tfevents.*")))
    assert len(paths) == 2 and paths[1].endswith(".from2")
    first, second = (read_tfevents(p) for p in paths)
    evals = [[(e.step, v.simple_value) for e in events for v in e.summary.value
              if v.tag == "eval_loss"] for events in (first, second)]
    assert [s for s, _ in evals[0]] == [0, 2] and [s for s, _ in evals[1]] == [4]
    assert evals[0][0][1] == pytest.approx(metrics["eval_loss_base"], rel=1e-6)
    assert evals[1][0][1] == pytest.approx(metrics["eval_loss_last"], rel=1e-6)
    assert [e.step for e in second if e.HasField("session_log")
            and e.session_log.status == SessionLog.START] == [3]
    assert [e.step for e in second for v in e.summary.value if v.tag == "loss"] == [3, 4]


def test_a_failed_trainings_wandb_run_ends_failed(tmp_path, monkeypatch):
    """close(failed=True) (the worker's loop raised: NaN steps, a lost peer) ends the wandb
    run with exit code 1, as wandb marks a crashed script's run failed; a training that
    ended normally exits 0. finish() with no code recorded 0 for both."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = TrackingSection(backend="wandb", wandb_mode="offline")
    codes = {}
    for name, failed in (("ok", False), ("nan", True)):
        tracker = open_tracker(tracking, str(tmp_path / name), {})
        tracker.log(1, {"loss": 1.0})
        tracker.close(failed=failed)
        (log_file,) = glob.glob(str(tmp_path / name / "tracking" / "wandb" / "offline-run-*" / "run-*.wandb"))
        codes[name] = [r.exit.exit_code for r in read_wandb_log(log_file)
                       if r.WhichOneof("record_type") == "exit"]
    assert codes == {"ok": [0], "nan": [1]}


def tensorboard_points(paths: list[str], tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard's EventAccumulator (file_version 2) keeps
    them: files in name order, every point kept (two at one step are both drawn), and a
    SessionLog START at step s drops the points read so far at steps >= s."""
    from tensorboardX.proto.event_pb2 import SessionLog

    points = []
    for path in sorted(paths):
        for e in read_tfevents(path):
            if e.HasField("session_log") and e.session_log.status == SessionLog.START:
                points = [(s, v) for s, v in points if s < e.step]
            points += [(e.step, v.simple_value) for v in e.summary.value if v.tag == tag]
    return points


def test_tensorboard_restart_from_scratch_replaces_the_first_attempts_points(tmp_path, monkeypatch):
    """A run that fails before its first checkpoint is restarted by Ray Train from step 0
    on the same logdir: the second attempt's file starts with a SessionLog START at step 0,
    so TensorBoard draws its points alone (the two attempts' steps were interleaved), and
    both files stay even when the two starts fall in one second (the name's time is whole
    seconds; the second file truncated the first)."""
    from types import SimpleNamespace

    from tensorboardX import event_file_writer
    from tensorboardX.proto.event_pb2 import SessionLog

    # The event file's name takes its time from here: both starts in the same second.
    monkeypatch.setattr(event_file_writer, "time", SimpleNamespace(time=lambda: 1_800_000_000.25))
    out = tmp_path / "out"
    for last, value in ((6, 1.0), (8, 2.0)):  # the base eval at step 0, then steps
        tracker = open_tracker(TrackingSection(backend="tensorboard"), str(out), {}, start_step=0)
        for step in range(last + 1):
            tracker.log(step, {"loss": value})
        tracker.close()
    paths = sorted(glob.glob(str(out / "tracking" / "tensorboard" / "events.out.tfevents.*")))
    assert len(paths) == 2
    assert all(os.path.basename(p).startswith("events.out.tfevents.1800000000.") for p in paths)
    assert [tensorboard_points([p], "loss") for p in paths] == [
        [(s, 1.0) for s in range(7)], [(s, 2.0) for s in range(9)]]  # in the order written
    starts = [[e.step for e in read_tfevents(p)
               if e.HasField("session_log") and e.session_log.status == SessionLog.START]
              for p in paths]
    assert starts == [[0], [0]]
    assert tensorboard_points(paths, "loss") == [(s, 2.0) for s in range(9)]


def test_a_preview_pipeline_loads_without_diffusers_bar_unless_verbose(tiny_model, monkeypatch,
                                                                       capsys):
    """build_pipeline (every validation preview) printed diffusers' "Loading pipeline
    components" bar, quiet or not: the bar is diffusers' process-wide switch, and it was
    turned off for the pipeline after loading it. --verbose (RAYLORA_VERBOSE) keeps it."""
    from diffusers import UNet2DConditionModel
    from diffusers.utils import logging as dlog

    from raylora.model.families.sd import SD
    from raylora.quiet import VERBOSE_ENV
    from raylora.train import preview as pv

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    was = dlog.is_progress_bar_enabled()
    try:
        printed = {}
        for verbose in (False, True):
            if verbose:
                monkeypatch.setenv(VERBOSE_ENV, "1")
            else:
                monkeypatch.delenv(VERBOSE_ENV, raising=False)
            dlog.enable_progress_bar()  # as a fresh worker process has it
            capsys.readouterr()
            pv.build_pipeline(tiny_model, SD, unet)
            printed[verbose] = "Loading pipeline components" in capsys.readouterr().err
    finally:
        (dlog.enable_progress_bar if was else dlog.disable_progress_bar)()
    assert printed == {False: False, True: True}
