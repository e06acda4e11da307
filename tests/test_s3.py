"""Object storage end to end against a real S3-compatible server on 127.0.0.1 (moto).

Shards of all three formats in the bucket → training reading s3:// (on one worker, and on
two FSDP workers whose sharded checkpoints go to the bucket and come back from it) →
checkpoints and the adapter in the bucket, also through a proxy that fails and slows
requests. Fake but recognisable credentials are set for the whole module. The CLI run from
a model, data and output all in S3, stopped with SIGTERM and resumed from the bucket (and
checked for leaked secrets), is in test_faults.py.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from raylora.config import validate

# ray_s3 starts its own Ray with the storage settings in its workers' environment.
pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

BUCKET = "raylora-test"
FAKE_KEY_ID = "AKIARAYLORAFAKE00001"
FAKE_SECRET = "rAyLoRa/FakeSecret+0001/doNotLeak"


@pytest.fixture(scope="module")
def s3(moto_endpoint, tmp_path_factory):
    """The session's S3 server with this module's bucket; AWS_* env set for this module."""
    import boto3

    env = {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_REGION": "us-east-1",
        "RAYLORA_CACHE": str(tmp_path_factory.mktemp("cache")),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_s3(s3):
    """Local Ray started *after* the AWS variables are set, so its workers inherit them."""
    import ray

    from raylora.launch import start_local_ray

    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


def upload_dir(client, local: str, prefix: str) -> None:
    for root, _, files in os.walk(local):
        for f in files:
            path = os.path.join(root, f)
            key = f"{prefix}/{os.path.relpath(path, local)}"
            client.upload_file(path, BUCKET, key)


def keys(client, prefix: str) -> list[str]:
    out, token = [], None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        resp = client.list_objects_v2(**kw)
        out += [o["Key"] for o in resp.get("Contents", [])]
        if not resp.get("IsTruncated"):
            return out
        token = resp["NextContinuationToken"]


def download_prefix(client, prefix: str, dest: str) -> list[str]:
    paths = []
    for k in keys(client, prefix):
        if k.endswith("/"):  # directory marker objects that pyarrow creates
            continue
        path = os.path.join(dest, os.path.relpath(k, prefix))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client.download_file(BUCKET, k, path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def shards(s3, ray_s3, tmp_path_factory):
    """The same 24 demo samples in the bucket as parquet (HF struct), WebDataset and an
    imagefolder; the WebDataset shards come from the shard builder."""
    from raylora.data.demo import write_imagefolder, write_parquet_shards
    from raylora.data.shards import build_shards

    root = tmp_path_factory.mktemp("shards")
    write_parquet_shards(root / "pq", n=24, num_shards=3, seed=3, hf_struct=True)
    upload_dir(s3, str(root / "pq"), "data/parquet")
    write_imagefolder(root / "imgs", n=24, seed=3)
    upload_dir(s3, str(root / "imgs"), "data/imagefolder")
    manifest = build_shards(str(root / "imgs"), f"s3://{BUCKET}/data/wds", "webdataset", 10)
    return {"manifest": manifest, "imagefolder": str(root / "imgs")}


def test_storage_lists_globs_and_names_missing_uris(s3, shards):
    from raylora.storage import Storage

    st = Storage()
    files = st.expand(f"s3://{BUCKET}/data/parquet")
    assert [f.rsplit("/", 1)[1] for f in files] == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"
    ]
    assert st.expand(f"s3://{BUCKET}/data/parquet/part-0000[12].parquet") == files[1:]
    assert st.expand([files[0], files[2]]) == [files[0], files[2]]
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/nope: no such file"):
        st.expand(f"s3://{BUCKET}/nope")
    with pytest.raises(FileNotFoundError, match="matched no .tar files"):
        st.expand(f"s3://{BUCKET}/data/parquet", suffixes=(".tar",))


def test_the_data_fingerprint_lists_each_folder_once_and_keeps_its_value(s3):
    """A run's data fingerprint (raylora.json, the latent cache's key) came from one HEAD
    request per file: minutes at every start for 100k objects. It now reads one listing per
    folder, to the same value (a cache keyed on it is found again)."""
    import hashlib

    from raylora.checkpoint.export import data_fingerprint
    from raylora.storage import Storage

    for key in ("fp/a/1.png", "fp/a/1.txt", "fp/a/2.png", "fp/b/3.png"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=key.encode() * 3)
    store = Storage()
    files = store.list_files(f"s3://{BUCKET}/fp")
    assert len(files) == 4
    h = hashlib.sha256()  # the per-file formula
    for f in files:
        info = store.info(f)
        h.update(f"{f}:{info.size}:{int(info.mtime.timestamp())}\n".encode())

    class Listed(Storage):  # a per-file request would fail
        def info(self, uri):
            raise AssertionError(f"one request for {uri}")

    assert data_fingerprint(files, Listed()) == h.hexdigest()[:16]
    s3.put_object(Bucket=BUCKET, Key="fp/b/3.png", Body=b"changed")
    assert data_fingerprint(files, Listed()) != h.hexdigest()[:16]


def test_shard_builder_round_trips_through_s3(s3, shards):
    """Folder → WebDataset shards in S3 → dataset with the same count and captions."""
    from raylora.config import DataSection
    from raylora.data.source import plan_data, read_rows
    from raylora.storage import Storage

    m = shards["manifest"]
    assert m["count"] == 24 and [s["count"] for s in m["shards"]] == [10, 10, 4]
    assert sorted(keys(s3, "data/wds/")) == [
        # the folder marker pyarrow leaves when it deletes the write check's probe object
        "data/wds/", "data/wds/manifest.json", "data/wds/shard-00000.tar", "data/wds/shard-00001.tar",
        "data/wds/shard-00002.tar",
    ]
    expected = sorted(
        json.loads(line)["text"]
        for line in open(os.path.join(shards["imagefolder"], "metadata.jsonl"))
    )
    for fmt, uri in (("webdataset", "data/wds"), ("imagefolder", "data/imagefolder"),
                     ("parquet", "data/parquet")):
        data = DataSection(uri=f"s3://{BUCKET}/{uri}")
        plan = plan_data(data, Storage())
        assert (plan.format, plan.rows) == (fmt, 24)
        rows = read_rows(data, plan, Storage(), seed=0).take_all()
        assert sorted(r["text"] for r in rows) == expected, fmt
        assert all(len(r["image"]["bytes"] if isinstance(r["image"], dict) else r["image"]) > 50
                   for r in rows)


def test_shard_builder_parquet_from_txt_captions(s3, ray_s3, tmp_path):
    import pyarrow.parquet as pq

    from raylora.data.demo import write_imagefolder
    from raylora.data.shards import build_shards

    write_imagefolder(tmp_path / "src", n=7, seed=5, captions="txt")
    m = build_shards(str(tmp_path / "src"), f"s3://{BUCKET}/data/pq-built", "parquet", 3)
    assert m["count"] == 7 and len(m["shards"]) == 3
    paths = download_prefix(s3, "data/pq-built", str(tmp_path / "dl"))
    tables = [pq.read_table(p) for p in sorted(paths) if p.endswith(".parquet")]
    assert sum(t.num_rows for t in tables) == 7
    assert tables[0].column("key").to_pylist() == ["img_00000", "img_00001", "img_00002"]
    assert tables[0].column("text").to_pylist()[0] == (tmp_path / "src" / "img_00000.txt").read_text()


def test_caption_folder_with_kohya_repeats_from_s3(s3, ray_s3, tmp_path):
    """A caption folder in the bucket: captions read beside the images, the image without
    one in 10_mychar takes its class tokens (a missing object, not an error), and one
    epoch of the Ray read stage reads each image as often as its folder says, through a
    store that throttles caption reads with 503 SlowDown, which the AWS SDK does not retry
    on an object smaller than the error (storage.retried_read)."""
    import threading

    from faultproxy import FaultProxy
    from test_formats import KOHYA, write_kohya

    from raylora.config import DataSection
    from raylora.data.formats import get_format
    from raylora.data.source import _read_passes, plan_data
    from raylora.storage import Storage

    upload_dir(s3, write_kohya(tmp_path / "kohya", KOHYA), "data/kohya")
    data = DataSection(uri=f"s3://{BUCKET}/data/kohya")
    plan = plan_data(data, Storage())
    assert (plan.format, plan.rows, plan.sources[0].rows) == ("captionfolder", 33, 6)
    gets, lock = Counter(), threading.Lock()

    def throttle(method: str, path: str, body: bytes) -> bool:
        if method != "GET" or not path.endswith(".txt"):
            return False
        with lock:
            gets[path] += 1
            # One reader: each read gets 503, 503, then its bytes. The read stage's
            # tasks read a caption side by side: only the first GET of each fails there.
            return gets[path] % 3 != 0 if one_reader else gets[path] == 1

    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=throttle) as proxy:
        store, one_reader = Storage(endpoint_url=proxy.url), True
        texts = [r["text"] for r in get_format(plan.format).iter_rows(data, plan.files, store)]
        assert texts == ["mychar smiling", "mychar, red hair", "mychar", "a cat", "a dog", "a bird"]
        assert sorted(gets.values()) == [3] * 5 and proxy.failed["GET"] == 10  # 5 captions
        gets.clear()
        one_reader = False
        rows = _read_passes(data, plan, store, seed=0, passes=range(2), shuffle=True).take_all()
    assert len(gets) == 5 and proxy.failed["GET"] == 10 + 5, gets
    assert len(rows) == 2 * 33
    by_key = {}
    for r in rows:
        by_key.setdefault(r["key"].rsplit("/", 1)[1], set()).add(r["text"])
    assert by_key["c.png"] == {"mychar"}
    counts = Counter(r["key"].rsplit("/", 1)[1] for r in rows if r["epoch"] == 1)
    assert counts == {"a.png": 10, "b.png": 10, "c.png": 10, "d.png": 1, "e.png": 1, "f.png": 1}


def test_training_reads_webdataset_and_imagefolder_from_s3(s3, ray_s3, shards, tiny_model):
    """One epoch of a mix of the WebDataset and the imagefolder shards in the bucket (the
    parquet ones train in the other tests here): Ray Data reads and decodes all 24 rows of
    each from the bucket, a worker trains on them, and the run's checkpoints and adapter land
    in the bucket."""
    from raylora.launch import run

    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"sources": [{"uri": f"s3://{BUCKET}/data/wds"}, {"uri": f"s3://{BUCKET}/data/imagefolder"}],
                 "resolution": 64, "center_crop": True},
        "train": {"batch_size": 4, "num_epochs": 1, "learning_rate": 1e-3},
        "checkpoint": {"every_n_steps": 6},
        "output": {"uri": f"s3://{BUCKET}/runs/formats"},
    }
    summary = run(validate(tree))
    m = summary["metrics"]
    assert (m["steps"], m["images_seen"], m["replicas_in_sync"]) == (12, 48, True)
    stored = keys(s3, "runs/formats/")
    assert "runs/formats/adapter/pytorch_lora_weights.safetensors" in stored
    assert "runs/formats/adapter/manifest.json" in stored
    assert any(k.endswith("/lora.safetensors") for k in stored)  # a checkpoint in the bucket
    meta = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/formats/adapter/raylora.json")["Body"].read())
    assert meta["data"]["rows"] == 48
    sources = meta["data"]["sources"]
    assert [(s["format"], s["rows"]) for s in sources] == [("webdataset", 24), ("imagefolder", 24)]
    # every row of each passed the decode (more: the stream reads ahead into later epochs)
    assert all(s["rows_decoded"] >= 24 for s in sources), sources


def test_a_run_started_from_an_adapter_in_the_bucket_evaluates_as_that_adapter_did(
        s3, ray_s3, shards, tiny_model):
    """lora.init_from an s3:// adapter folder, on 2 FSDP workers at another lora.alpha:
    its held-out loss before a step (eval_loss_base) is the held-out loss the run that
    wrote the adapter (one worker, unsharded) ended with, on the same held-out rows and
    noise; then it trains on from there."""
    from raylora.launch import run

    def tree(name, steps, **more):
        return {
            "model": {"pretrained": tiny_model},
            "data": {"uri": f"s3://{BUCKET}/data/parquet", "resolution": 64, "center_crop": True,
                     "validation_split": 0.25},
            "train": {"batch_size": 2, "max_steps": steps, "learning_rate": 1e-2, "seed": 3},
            "validation": {"every_n_steps": 2},
            "scaling": more.pop("scaling", {}),
            "output": {"uri": f"s3://{BUCKET}/runs/{name}"},
            **more,
        }

    first = run(validate(tree("init-a", 4)))["metrics"]
    assert first["eval_loss_last"] != first["eval_loss_base"]  # the adapter moved
    adapter = f"s3://{BUCKET}/runs/init-a/adapter"
    then = run(validate(tree("init-b", 2, lora={"init_from": adapter, "alpha": 1.0},
                             scaling={"num_workers": 2, "strategy": "fsdp"})))["metrics"]
    assert then["eval_loss_base"] == pytest.approx(first["eval_loss_last"], rel=1e-5)
    assert then["eval_loss_base"] != pytest.approx(first["eval_loss_base"], rel=1e-3)
    assert then["steps"] == 2 and then["eval_loss_last"] != then["eval_loss_base"]
    meta = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/init-b/adapter/raylora.json")["Body"].read())
    assert meta["config"]["lora"]["init_from"] == adapter
    # What every worker started from: the adapter's files as the plan listed them.
    from raylora.model import lora_init
    from raylora.storage import Storage

    pinned = f"{adapter}#version={lora_init.stored_version(adapter, lora_init.stored_files(adapter, Storage()))}"
    assert meta["data"]["init_from"] == pinned
    card = s3.get_object(Bucket=BUCKET, Key="runs/init-b/adapter/README.md")["Body"].read().decode()
    assert f"| started from (lora.init_from) | {pinned} |" in card
    assert f"| held-out loss: start (lora.init_from) → last (best at step) | {then['eval_loss_base']:.5f}" in card


def test_every_worker_starts_from_the_version_of_a_stored_adapter_its_plan_listed(
        s3, tiny_model, demo_data, tmp_path):
    """lora.init_from in the bucket is pinned, like a hub adapter's commit, to the version
    of its files the plan listed: a worker that finds it written again since stops saying
    so rather than start from other weights than the others; a new plan pins the new one.
    A single .safetensors file is pinned the same way."""
    import time

    import torch
    from test_lora_init import _build, _cfg, _deltas, _random_adapter

    from raylora.model import lora_init
    from raylora.model.lora import WEIGHT_NAME
    from raylora.storage import Storage
    from raylora.train.setup import build_run

    uri, file = f"s3://{BUCKET}/adapters/pinned", f"s3://{BUCKET}/adapters/pinned/{WEIGHT_NAME}"
    for seed in (0, 1):
        _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a")), str(tmp_path / f"v{seed}"), seed)

    def planned(init_from: str) -> str:
        """checked() through a store that answers each object's first GET with a 503 (the
        safetensors header's is 8 bytes: one the AWS SDK does not retry)."""
        from faultproxy import FaultProxy

        seen = Counter()

        def throttle(method: str, path: str, body: bytes) -> bool:
            seen[method, path] += 1
            return method == "GET" and "list-type" not in path and seen[method, path] == 1

        cfg = _cfg(tiny_model, demo_data, tmp_path / "o", init_from=init_from)
        with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=throttle) as proxy:
            problems, loads = lora_init.checked(cfg, Storage(endpoint_url=proxy.url))
        assert problems == [] and proxy.failed["GET"] >= 1
        return loads

    def started(init_from: str, loads: str) -> dict:
        from inproc import _fresh_accelerator

        cfg = _cfg(tiny_model, demo_data, tmp_path / "b", init_from=init_from)
        run = build_run(cfg, _fresh_accelerator(1), 2, rank=0, pins={init_from: loads})
        return _deltas(run.accelerator.unwrap_model(run.model), "default")

    Storage().upload_dir(str(tmp_path / "v0"), uri)
    first = Storage().info(file).mtime_ns
    loads, loads_file = planned(uri), planned(file)
    listing = lora_init.stored_files(uri, Storage())
    assert sorted(listing) == sorted(os.listdir(tmp_path / "v0"))
    assert loads == f"{uri}#version={lora_init.stored_version(uri, listing)}"
    assert loads_file == f"{file}#version={lora_init.stored_version(file, {'': Storage().info(file)})}"
    assert loads_file.rpartition("=")[2] != loads.rpartition("=")[2]
    v0 = started(uri, loads)
    assert all(float(d.abs().max()) > 0 for d in v0.values())  # the adapter, not no-ops
    while time.time_ns() // 10**9 == first // 10**9:  # a store's times count seconds
        time.sleep(0.05)
    Storage().upload_dir(str(tmp_path / "v1"), uri)  # written again after the plan
    for pinned, where in ((uri, loads), (file, loads_file)):
        with pytest.raises(RuntimeError) as exc:
            started(pinned, where)
        version = where.rpartition("=")[2]
        now = lora_init.stored_version(pinned, lora_init.stored_files(pinned, Storage()))
        assert str(exc.value) == (
            f"lora.init_from: {pinned}: its files changed since this run's plan listed them "
            f"(version {version}, now {now}: written again?); run again to start from the new files")
    again = planned(uri)
    assert again != loads
    v1 = started(uri, again)
    assert v1.keys() == v0.keys() and all(not torch.equal(v1[k], v0[k]) for k in v0)
    assert started(file, planned(file)).keys() == v0.keys()


def test_a_stored_adapter_is_downloaded_without_its_hidden_folders(s3, tmp_path):
    """lora.init_from in a bucket, uploaded from a git clone: its ``.git/`` (a second copy
    of the weights) and ``hf download``'s ``.cache/`` were downloaded by every worker,
    though its version left them out. Now the download is the files the version counts,
    as a stored model's is; a hidden file of the adapter's own stays."""
    from raylora.model import lora_init
    from raylora.storage import Storage, local_sizes

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "pytorch_lora_weights.safetensors").write_bytes(os.urandom(4096))
    (adapter / "README.md").write_text("card")
    (adapter / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    uri, prefix = f"s3://{BUCKET}/adapters/cloned", "adapters/cloned"
    upload_dir(s3, str(adapter), prefix)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.git/lfs/objects/ab/cd/abcd", Body=os.urandom(4096))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.cache/huggingface/download/x.metadata", Body=b"x")
    own = local_sizes(str(adapter))
    assert {k: v.size for k, v in lora_init.stored_files(uri, Storage()).items()} == own
    local = lora_init.download(uri, Storage(), str(tmp_path / "down"))
    assert local_sizes(local) == own


def test_publish_replaces_the_adapter_and_removes_a_killed_publishs_staging_copy(s3, tmp_path):
    from raylora.storage import Storage

    src = tmp_path / "adapter"
    src.mkdir()
    (src / "w.safetensors").write_bytes(b"new weights")
    (src / "manifest.json").write_text("{}")
    for key in ("pub/adapter/w.safetensors", "pub/adapter/old.json",  # the previous adapter
                "pub/adapter.staging-0123abcd/w.safetensors",  # a killed publish's staging
                "pub/adapter.staging-keep/w.safetensors", "pub/adapter-v1/w.safetensors"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"old")
    Storage().publish_dir(str(src), f"s3://{BUCKET}/pub/adapter")
    assert sorted(k for k in keys(s3, "pub/") if not k.endswith("/")) == [
        "pub/adapter-v1/w.safetensors", "pub/adapter.staging-keep/w.safetensors",
        "pub/adapter/manifest.json", "pub/adapter/w.safetensors"]
    assert s3.get_object(Bucket=BUCKET, Key="pub/adapter/w.safetensors")["Body"].read() == b"new weights"


def test_keys_with_hash_or_question_mark_are_published_and_read_as_named(s3, tmp_path):
    """URL syntax ended a key at '#' or '?': publishing to .../exp#2/adapter replaced all of
    .../exp (another run's adapter, a dataset), and a listed "photo #2.png" was read as
    "photo ". Both are the keys they name now; a camera's _MG_ photo is listed too."""
    from raylora.storage import Storage

    for key in ("hash/exp/adapter/w.safetensors", "hash/exp/data/part-0.parquet"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"other run")
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "w.safetensors").write_bytes(b"new weights")
    store = Storage()
    assert store.publish_dir(str(src), f"s3://{BUCKET}/hash/exp#2/adapter") == f"s3://{BUCKET}/hash/exp#2/adapter"
    assert sorted(k for k in keys(s3, "hash/") if not k.endswith("/")) == [
        "hash/exp#2/adapter/w.safetensors",
        "hash/exp/adapter/w.safetensors", "hash/exp/data/part-0.parquet"]
    for name in ("photo #2.png", "what?.png", "_MG_0001.png", "_SUCCESS"):
        s3.put_object(Bucket=BUCKET, Key=f"hash/pics/{name}", Body=name.encode())
    listed = store.expand(f"s3://{BUCKET}/hash/pics/")
    assert [u.rsplit("/", 1)[1] for u in listed] == ["_MG_0001.png", "photo #2.png", "what?.png"]
    assert [store.read_bytes(u) for u in listed] == [b"_MG_0001.png", b"photo #2.png", b"what?.png"]


def test_upload_dir_uploads_again_a_file_that_pyarrow_dropped(s3, tmp_path, caplog):
    """One file's part upload fails with an error the SDK does not retry (403). pyarrow's
    copy_files, which Ray Train uploads checkpoints with, returns normally without that
    file (the warning says so: it is logged only for files missing after the copy), and
    upload_dir uploads it again. The same happens to a 503 SlowDown once the SDK's
    S3_ATTEMPTS are spent, at the cost of its backoff (about 25 s here). A file the store
    refuses for good is an error naming it."""
    import logging

    from faultproxy import FaultProxy, failing_puts

    from raylora.storage import Storage

    files = {"a.bin": os.urandom(3000), "history.jsonl": b'{"step": 1}\n' * 50,
             "sub/state.pt": os.urandom(2000)}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    once = failing_puts(lambda k: k == "/raylora-test/upload/checked/history.jsonl", 1, status=403)
    always = failing_puts(lambda k: k == "/raylora-test/upload/refused/history.jsonl", 99, status=403)
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=lambda m, p, b: once(m, p) or always(m, p)) as proxy:
        store = Storage(endpoint_url=proxy.url)
        with caplog.at_level(logging.WARNING, logger="raylora.storage"):
            store.upload_dir(str(tmp_path), f"s3://{BUCKET}/upload/checked")
            with pytest.raises(OSError, match="upload/refused/history.jsonl"):
                store.upload_dir(str(tmp_path), f"s3://{BUCKET}/upload/refused")
    for rel, data in files.items():
        assert s3.get_object(Bucket=BUCKET, Key=f"upload/checked/{rel}")["Body"].read() == data
    assert [p.split("?")[0] for p in proxy.failed_paths] == [
        "/raylora-test/upload/checked/history.jsonl"] + ["/raylora-test/upload/refused/history.jsonl"] * 2
    warned = [r.getMessage() for r in caplog.records if "uploading them again" in r.getMessage()]
    assert warned == [f"s3://{BUCKET}/upload/{d}: 1 file(s) missing or short after the upload, "
                      "uploading them again: history.jsonl" for d in ("checked", "refused")]


def test_a_refused_checkpoint_record_fails_the_run_and_a_rerun_resumes_from_the_one_before(
        s3, ray_s3, shards, tiny_model, caplog):
    """Ray Train's controller writes its record of the checkpoints
    (checkpoint_manager_snapshot.json) after each upload; Ray does not retry a controller
    error. The store refuses the upload of the record that names the second checkpoint
    (step 4): the run fails naming the key, the record still names only the first
    checkpoint, and the same config run again drops the unrecorded folder and resumes from
    the first checkpoint to the end. Two FSDP workers: each checkpoint is DCP shards from
    both ranks in the bucket, and the rerun's ranks read them back from it."""
    import logging

    from faultproxy import FaultProxy

    from raylora.launch import run

    run_key = "runs/record/train"

    def checkpoints() -> set[str]:
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run_key}/checkpoint_2").get("Contents", [])
        return {o["Key"].split("/")[3] for o in listed}

    def refuse_second_record(method: str, path: str, body: bytes):
        """403 to the upload of a record that names step 4's checkpoint."""
        record = path.split("?", 1)[0] == f"/{BUCKET}/{run_key}/checkpoint_manager_snapshot.json"
        return 403 if record and method == "PUT" and re.search(rb'"step":\s*4\b', body) else False

    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": f"s3://{BUCKET}/data/parquet", "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-3},
        "scaling": {"num_workers": 2, "strategy": "fsdp"},
        "checkpoint": {"every_n_steps": 2, "num_to_keep": 3},
        "output": {"uri": f"s3://{BUCKET}/runs/record"},
    }
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=refuse_second_record) as proxy:
        with pytest.raises(Exception, match="checkpoint_manager_snapshot.json"):
            run(validate({**tree, "storage": {"endpoint_url": proxy.url}}))
    assert proxy.failed["PUT"] >= 1
    assert len(checkpoints()) == 2
    record = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{run_key}/checkpoint_manager_snapshot.json")["Body"].read())
    assert [r["metrics"]["step"] for r in record["checkpoint_results"]] == [2]
    first = record["latest_checkpoint_result"]["checkpoint_dir_name"]

    with caplog.at_level(logging.WARNING, logger="raylora"):
        summary = run(validate(tree))
    assert summary["metrics"]["resumed_from_step"] == 2 and summary["metrics"]["steps"] == 4
    assert any("removed 1 checkpoint folder(s)" in r.getMessage() for r in caplog.records)
    record = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{run_key}/checkpoint_manager_snapshot.json")["Body"].read())
    assert [r["metrics"]["step"] for r in record["checkpoint_results"]] == [2, 4]
    assert checkpoints() == {r["checkpoint_dir_name"] for r in record["checkpoint_results"]} and first in checkpoints()
    for name in checkpoints():
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run_key}/{name}/fsdp/").get("Contents", [])
        # ("": the folder's marker object, which pyarrow writes)
        assert {o["Key"].rsplit("/", 1)[1] for o in listed} - {""} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    # The resumed steps trained on from step 2's shards: steps 3 and 4 are logged once each.
    rows = [json.loads(x) for x in s3.get_object(Bucket=BUCKET, Key="runs/record/metrics.jsonl")["Body"].iter_lines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)


def test_a_filesystem_ray_copies_to_another_process_keeps_its_retries(s3):
    """Ray pickles the S3 filesystem it is given to its controller, workers and read tasks.
    pyarrow's own pickling drops the retry strategy (arrow's default: 3 attempts); raylora's
    copy keeps S3_ATTEMPTS: the 4th attempt at an object whose first 3 part uploads were
    refused with 503 succeeds in the unpickled copy as in the original."""
    import pickle

    import pyarrow.fs as pafs
    from faultproxy import FaultProxy, failing_puts

    from raylora.storage import S3_ATTEMPTS, Storage

    assert S3_ATTEMPTS > 4
    refused = failing_puts(lambda k: k.startswith("/raylora-test/pickled/"), 3)
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=refused) as proxy:
        fs, path = Storage(endpoint_url=proxy.url).fs(f"s3://{BUCKET}/pickled")
        plain = pafs.S3FileSystem(**fs.kwargs)  # the same filesystem, pyarrow's own class
        for name, copy in (("original", fs), ("unpickled", pickle.loads(pickle.dumps(fs))),
                           ("plain", pickle.loads(pickle.dumps(plain)))):
            try:
                with copy.open_output_stream(f"{path}/{name}") as out:
                    out.write(name.encode())
            except OSError as exc:
                assert name == "plain" and "SLOW_DOWN" in str(exc), exc  # arrow's 3 attempts
            else:
                assert name != "plain", "arrow's default retried more than 3 times"
    assert type(pickle.loads(pickle.dumps(fs))) is type(fs)
    assert {k.rsplit("/", 1)[1]: n for k, n in refused.counts.items()} == {
        "original": 4, "unpickled": 4, "plain": 3}
    for name in ("original", "unpickled"):
        assert s3.get_object(Bucket=BUCKET, Key=f"pickled/{name}")["Body"].read() == name.encode()
    assert proxy.failed["PUT"] == 9


def test_a_place_the_run_cannot_write_is_named_before_ray_starts(s3, shards, tiny_model, tmp_path,
                                                                 monkeypatch, capsys):
    """The output and the latent cache are written by the workers, long after the start: a
    bucket that does not exist, or a store that refuses the write or the delete, is named
    by its key when the run is planned. A writable place keeps nothing of the check."""
    import yaml
    from faultproxy import FaultProxy

    from raylora import launch
    from raylora.cli import main
    from raylora.storage import Storage

    store = Storage()
    assert store.write_problem(f"s3://{BUCKET}/writable/out") is None
    assert [k for k in keys(s3, "writable/") if not k.endswith("/")] == []
    assert store.write_problem("s3://raylora-no-such-bucket/out").startswith(
        "s3://raylora-no-such-bucket/out: cannot write there: ")

    def refuse(method: str):
        return lambda m, p, b: 403 if m == method and "/.raylora-write-check-" in p else False

    for method, said in (("PUT", "cannot write there: "), ("DELETE", "can write but not delete there")):
        with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=refuse(method)) as proxy:
            problem = Storage(endpoint_url=proxy.url).write_problem(f"s3://{BUCKET}/refused")
        assert problem.startswith(f"s3://{BUCKET}/refused: {said}") and "ACCESS_DENIED" in problem, problem
        assert proxy.failed[method] == 1
    left = [k for k in keys(s3, "refused/") if not k.endswith("/")]  # the refused delete's probe
    assert len(left) == 1 and f"(left s3://{BUCKET}/{left[0]})" in problem

    def no_ray(*_):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(launch, "init_ray", no_ray)
    (tmp_path / "cache").write_text("a file where the cache folder would go")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"pretrained": tiny_model},
        "data": {"uri": f"s3://{BUCKET}/data/parquet", "resolution": 64, "center_crop": True,
                 "cache": "latents", "cache_uri": str(tmp_path / "cache" / "latents")},
        "output": {"uri": "s3://raylora-no-such-bucket/out"},
    }))
    assert main(["train", str(job)]) == 2
    err = capsys.readouterr().err
    assert "2 config problem(s)" in err
    assert "  - output.uri: s3://raylora-no-such-bucket/out: cannot write there: " in err
    assert f"  - data.cache_uri: {tmp_path / 'cache' / 'latents'}: {tmp_path / 'cache'} is a file, not a folder" in err


UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


def _upload_unet(s3, tiny_model: str, tmp_path, prefix: str, delta: float) -> None:
    """The tiny model's UNet with ``delta`` added to every weight, uploaded over
    ``{prefix}/unet``: same names and size, other values."""
    import time

    from safetensors.torch import load_file, save_file

    changed = tmp_path / "unet.safetensors"
    save_file({k: v + delta for k, v in load_file(f"{tiny_model}/{UNET_WEIGHTS}").items()}, changed)
    time.sleep(1.1)  # S3's last-modified is kept to the second
    s3.upload_file(str(changed), BUCKET, f"{prefix}/{UNET_WEIGHTS}")


def test_a_model_uploaded_again_under_its_uri_is_downloaded_again(s3, tiny_model, tmp_path):
    """A node kept its first download of ``model.pretrained: s3://...`` for good: a model
    uploaded again under the same URI (fixed weights, another precision) was trained on
    from the node's old copy, silently. The node's copy is per version of the folder (its
    listing); a folder that changes while it downloads is refused, not copied half-old."""
    import torch
    from safetensors.torch import load_file

    from raylora.model.load import materialize
    from raylora.storage import Storage

    uri, weights = f"s3://{BUCKET}/models/reuploaded", UNET_WEIGHTS
    stock = load_file(f"{tiny_model}/{weights}")["conv_in.weight"]
    store = Storage()
    store.upload_dir(tiny_model, uri)
    first = materialize(uri, store)
    assert materialize(uri, store) == first  # unchanged: the node's copy, not downloaded again
    torch.testing.assert_close(load_file(f"{first}/{weights}")["conv_in.weight"], stock)

    def upload_changed(delta: float) -> None:
        _upload_unet(s3, tiny_model, tmp_path, "models/reuploaded", delta)

    upload_changed(1)
    second = materialize(uri, store)
    assert second != first
    torch.testing.assert_close(load_file(f"{second}/{weights}")["conv_in.weight"], stock + 1)
    assert os.path.exists(f"{first}/.complete")  # the old copy is left to a run still reading it

    class UploadedMeanwhile(Storage):  # another upload lands while this node downloads
        def download_dir(self, uri, local_dir, keep=None):
            super().download_dir(uri, local_dir, keep)
            upload_changed(2)

    upload_changed(3)
    with pytest.raises(RuntimeError, match=f"model.pretrained: {uri}: its files changed while "
                                           "this node downloaded them; run again once the upload is done"):
        materialize(uri, UploadedMeanwhile())
    third = materialize(uri, store)  # once it stays put: the last upload
    torch.testing.assert_close(load_file(f"{third}/{weights}")["conv_in.weight"], stock + 2)
    with pytest.raises(FileNotFoundError, match="model.pretrained: s3://raylora-test/models/none: no files there"):
        materialize(f"s3://{BUCKET}/models/none", store)


def test_a_stored_model_is_downloaded_without_its_hidden_folders(s3, tiny_model, tmp_path):
    """A model folder synced from a git clone holds ``.git/``, whose ``lfs/objects`` is a
    second copy of every weight: each node downloaded it all (twice the bytes), as it did
    ``hf download``'s ``.cache/huggingface/``. The files in hidden folders are left out of
    the download and of the version (what the plan pins and the node's copy is named by),
    as a data listing leaves them out; a hidden file of the model's own stays."""
    from raylora.model.load import check_model, materialize, stored_files, stored_version
    from raylora.storage import Storage, local_sizes

    uri, store, prefix = f"s3://{BUCKET}/models/cloned", Storage(), "models/cloned"
    upload_dir(s3, tiny_model, prefix)
    s3.upload_file(f"{tiny_model}/{UNET_WEIGHTS}", BUCKET, f"{prefix}/.git/lfs/objects/ab/cd/abcd")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.cache/huggingface/download/unet.metadata", Body=b"x")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.gitattributes", Body=b"*.safetensors filter=lfs\n")
    model = local_sizes(tiny_model) | {".gitattributes": 25}
    assert sorted(stored_files(uri, store)) == sorted(model)
    version = stored_version(uri, stored_files(uri, store))
    assert check_model(uri, store)["commit"] == version
    local = materialize(uri, store, version)  # the version the plan pinned: no refusal
    assert os.path.basename(local) == version
    assert local_sizes(local) == model | {".complete": len(uri)}
    # another object in .git (a commit) is no new version of the model
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.git/refs/heads/main", Body=b"0" * 40)
    assert stored_version(uri, stored_files(uri, store)) == version


def test_a_folder_downloads_in_parts_read_side_by_side(s3, tmp_path, monkeypatch):
    """``pyarrow.fs.copy_files`` read a file as 1 MiB ranged GETs one after another: 10,000
    requests in a row for a 10 GB shard. ``download_dir`` reads parts of DOWNLOAD_PART
    bytes concurrently: a file's GETs are its parts, its bytes the object's, through an
    object store that fails every 4th request too, small files' GETs included."""
    import threading

    from faultproxy import FaultProxy

    from raylora import storage
    from raylora.storage import Storage

    part = 2**20
    monkeypatch.setattr(storage, "DOWNLOAD_PART", part)
    files = {"unet/w.safetensors": os.urandom(5 * part + 123), "unet/config.json": b"{}",
             "a/b/exact.bin": os.urandom(2 * part), "empty.txt": b""}
    for rel, data in files.items():
        s3.put_object(Bucket=BUCKET, Key=f"parts/{rel}", Body=data)
    gets, lock = Counter(), threading.Lock()

    def count(method: str, path: str, body: bytes) -> bool:
        if method == "GET" and "list-type" not in path:
            with lock:
                gets[path.split("?")[0].removeprefix(f"/{BUCKET}/parts/")] += 1
        return False

    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=count) as proxy:
        Storage(endpoint_url=proxy.url).download_dir(f"s3://{BUCKET}/parts", str(tmp_path / "a"))
    for rel, data in files.items():
        assert (tmp_path / "a" / rel).read_bytes() == data, rel
    # 6 parts (5 whole, 123 bytes), 1, 2, none for the empty file; copy_files: 6, 1, 2, 1.
    assert gets == {"unet/w.safetensors": 6, "unet/config.json": 1, "a/b/exact.bin": 2}

    # A 503 to the 2-byte file's GET: its XML overflows the range's buffer, which the SDK
    # does not retry ("Failed to flush response stream"; copy_files failed so).
    small = Counter()

    def throttle(method: str, path: str, body: bytes) -> bool:
        if method == "GET" and path.endswith("parts/unet/config.json"):
            small[path] += 1
            return small[path] <= 2
        return False

    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_every=4, fail_if=throttle) as proxy:
        Storage(endpoint_url=proxy.url).download_dir(f"s3://{BUCKET}/parts", str(tmp_path / "b"))
    assert proxy.failed["GET"] >= 3 and sum(small.values()) == 3
    for rel, data in files.items():
        assert (tmp_path / "b" / rel).read_bytes() == data, rel
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/none: no files there"):
        Storage().download_dir(f"s3://{BUCKET}/none", str(tmp_path / "c"))


def test_a_read_refused_or_missing_fails_at_once(s3):
    """Only a throttled or dropped read is tried again (storage.retried_read): an object
    that is not there, or a HEAD the store refuses (403), fails on its first request."""
    from faultproxy import FaultProxy

    from raylora.storage import Storage

    s3.put_object(Bucket=BUCKET, Key="refused/config.json", Body=b'{"a": 1}')
    seen = Counter()

    def refuse(method: str, path: str, body: bytes):
        seen[method, path.split("?")[0].removeprefix(f"/{BUCKET}/")] += 1
        return 403 if path.endswith("refused/config.json") else False

    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_if=refuse) as proxy:
        store = Storage(endpoint_url=proxy.url)
        with pytest.raises(OSError, match="ACCESS_DENIED") as refused:
            store.read_bytes(f"s3://{BUCKET}/refused/config.json")
        with pytest.raises(FileNotFoundError):
            store.read_bytes(f"s3://{BUCKET}/refused/none.json")
    assert not isinstance(refused.value, FileNotFoundError)
    assert seen == {("HEAD", "refused/config.json"): 1, ("HEAD", "refused/none.json"): 1}
    assert Storage().read_bytes(f"s3://{BUCKET}/refused/config.json") == b'{"a": 1}'


def test_a_nodes_copy_of_an_older_version_is_removed_once_no_process_reads_it(
        s3, tiny_model, tmp_path, monkeypatch, caplog):
    """Each upload of a model under its URI left another full copy on every node that
    trained it (tens of GB for Flux), for good. A process that loads a copy holds it in use
    (a shared lock until it exits); a download removes the node's copies of the URI's other
    versions that no process holds, and leaves other models' copies alone."""
    import logging
    import subprocess
    import sys

    from raylora.model.load import materialize
    from raylora.storage import Storage

    uri, other = f"s3://{BUCKET}/models/replaced", f"s3://{BUCKET}/models/untouched"
    for u in (uri, other):
        Storage().upload_dir(tiny_model, u)
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAYLORA_CACHE", str(cache))
    # A run's process on this node reading version 0 (and another model) until it exits.
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom raylora.model.load import materialize\n"
         "from raylora.storage import Storage\n"
         "for u in sys.argv[1:]: print(materialize(u, Storage()), flush=True)\nsys.stdin.read()",
         uri, other], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    v0, kept = reader.stdout.readline().strip(), reader.stdout.readline().strip()
    assert os.path.exists(f"{v0}/.complete") and os.path.exists(f"{kept}/.complete")

    def copies() -> list[str]:
        return sorted(os.listdir(cache / "models"))

    _upload_unet(s3, tiny_model, tmp_path, "models/replaced", 1)
    v1 = materialize(uri, Storage())  # this process now reads version 1
    assert os.path.exists(f"{v0}/.complete")  # the reader still reads it
    reader.stdin.close()
    assert reader.wait(timeout=60) == 0
    _upload_unet(s3, tiny_model, tmp_path, "models/replaced", 2)
    with caplog.at_level(logging.INFO, logger="raylora"):
        v2 = materialize(uri, Storage())
    name = os.path.basename
    # Version 0 is gone, lock files and all; version 1 (held here) and the other model stay.
    assert copies() == sorted(f"{name(c)}{s}" for c in (v1, v2, kept) for s in ("", ".inuse", ".lock"))
    assert [r.getMessage() for r in caplog.records if "removed" in r.getMessage()] == [
        f"model.pretrained: {uri}: removed this node's copy of an older version ({name(v0)}), "
        "which no process here reads"]
    assert all(os.path.exists(f"{c}/.complete") for c in (v1, v2, kept))


def test_every_node_loads_the_version_of_a_stored_model_its_plan_listed(
        s3, tiny_model, demo_data, tmp_path, monkeypatch, caplog):
    """A node's copy was per version, but not the run's: two nodes that downloaded
    ``model.pretrained: s3://...`` on either side of an upload trained two models (DDP
    syncs only the LoRA gradients). The plan records the version it listed, every loader
    gets it as ``model.revision`` (``at_commit``, as a hub commit), and a node loads its
    copy of that version without reading the store, or downloads it if the folder is still
    that version, or stops saying so."""
    import logging

    import torch
    from safetensors.torch import load_file

    from raylora.data.cache import fingerprint
    from raylora.data.classgen import generation_key
    from raylora.config import ConfigError
    from raylora.launch import plan
    from raylora.model.load import load_components, materialize, stored_files, stored_version
    from raylora.storage import Storage

    uri, store = f"s3://{BUCKET}/models/pinned", Storage()
    store.upload_dir(tiny_model, uri)
    stock = load_file(f"{tiny_model}/{UNET_WEIGHTS}")["conv_in.weight"]
    cfg = validate({"model": {"pretrained": uri}, "data": {"uri": demo_data, "resolution": 64},
                    "output": {"uri": str(tmp_path / "out")}})
    with caplog.at_level(logging.INFO, logger="raylora"):
        first = plan(cfg, heldout=False)
    v0 = stored_version(uri, stored_files(uri, store))
    assert first.model_commit == v0 and len(v0) == 16
    assert (f"model.pretrained: {uri}: training its files as listed now (version {v0})"
            in [r.getMessage() for r in caplog.records])
    loads = cfg.at_commit(first.model_commit)
    assert loads.model.revision == v0 and cfg.model.revision is None

    def unet(model, store, node: str) -> torch.Tensor:
        monkeypatch.setenv("RAYLORA_CACHE", str(tmp_path / node))
        return load_components(model, torch.float32, store=store, encoders=False).denoiser.conv_in.weight

    torch.testing.assert_close(unet(loads.model, store, "node-a"), stock)

    def keys(c) -> tuple[str, str]:  # the latent cache's and the class images'
        return (fingerprint(c, "sd", uri, first.data_plan(), store),
                generation_key(c, "sd", uri, store))

    before = keys(loads)
    _upload_unet(s3, tiny_model, tmp_path, "models/pinned", 1)
    # Node a has the plan's version: it loads it even with the store out of reach.
    unreachable = Storage(endpoint_url="http://127.0.0.1:9")
    torch.testing.assert_close(unet(loads.model, unreachable, "node-a"), stock)
    assert materialize(uri, unreachable, v0) == str(tmp_path / "node-a" / "models" / v0)
    # Node b has no copy, and the folder is no longer that version: it stops.
    v1 = stored_version(uri, stored_files(uri, store))
    with pytest.raises(RuntimeError) as e:
        unet(loads.model, store, "node-b")
    assert str(e.value) == (
        f"model.pretrained: {uri}: its files changed since this run's plan listed them "
        f"(version {v0}, now {v1}: uploaded again?) and this node has no copy of the version "
        "the other workers train; run again to train on the new files")
    assert not os.path.exists(tmp_path / "node-b" / "models" / v0)
    # The next run's plan trains the new upload, on both nodes.
    second = plan(cfg, heldout=False)
    assert second.model_commit == v1 != v0
    for node in ("node-a", "node-b"):
        torch.testing.assert_close(unet(cfg.at_commit(v1).model, store, node), stock + 1)
    # The version is not in the latent cache's key: a new UNet leaves it (it hashes the
    # encoders' files), and changes the class images' (every file is hashed).
    after = keys(cfg.at_commit(v1))
    assert after[0] == before[0] and after[1] != before[1]
    # A folder has no revisions to choose: model.revision is refused, not ignored.
    with pytest.raises(ConfigError) as e:
        plan(cfg.at_commit("v1"), heldout=False)
    assert (f"model.revision: v1: model.pretrained {uri} is a folder, not a hub repo; only a "
            "hub model has revisions") in str(e.value)


def test_the_estimate_of_a_model_in_the_bucket_is_the_folders_and_leaves_no_copy(
        s3, tiny_model, tmp_path, monkeypatch):
    """The memory preflight of ``model.pretrained: s3://...`` copies its JSON configs to a
    temporary folder; each estimate (a search: one per distinct trial setting) left one."""
    from raylora import memory
    from raylora.storage import Storage

    uri = f"s3://{BUCKET}/models/estimated"
    Storage().upload_dir(tiny_model, uri)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again

    def cfg(model: str):
        return validate({"model": {"pretrained": model}, "data": {"uri": "d", "resolution": 64},
                         "output": {"uri": "o"}})

    assert memory.from_config(cfg(uri)).total == memory.from_config(cfg(tiny_model)).total
    assert os.listdir(tmp_path) == []


def test_endpoint_from_config_without_env(s3, shards, monkeypatch):
    """storage.endpoint_url alone (no AWS_ENDPOINT_URL) reaches an S3-compatible store."""
    from raylora.config import StorageSection

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    st = StorageSection(endpoint_url=endpoint).client()
    assert len(st.expand(f"s3://{BUCKET}/data/parquet")) == 3
    assert json.loads(st.read_bytes(f"s3://{BUCKET}/data/wds/manifest.json"))["count"] == 24


def test_a_bracketed_folder_is_the_datas_root_at_the_configs_endpoint(s3, monkeypatch):
    """``s3://b/photos [2023]/*.png`` with data.control_uri and the endpoint in
    storage.endpoint_url alone: whether "photos [2023]" is a folder was asked of a default
    Storage, that is of AWS (31 s to fail here), and the root was taken as the bucket: the
    control image of ``a.png`` was looked for at ``ctrl/photos [2023]/a.png``, by every
    worker for every row. Now the folder is the root, found at the config's endpoint or
    from the files planned."""
    import io

    from PIL import Image

    from raylora.config import DataSection, StorageSection
    from raylora.data.formats.base import control_candidates
    from raylora.data.formats.captionfolder import data_roots, root_holding
    from raylora.data.plan import plan_source

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    st = StorageSection(endpoint_url=endpoint).client()
    folder, ctrl = f"s3://{BUCKET}/brackets/photos [2023]", f"s3://{BUCKET}/brackets/ctrl"
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, format="PNG")
    for name in ("a", "b"):
        s3.put_object(Bucket=BUCKET, Key=f"brackets/photos [2023]/{name}.png", Body=png.getvalue())
        s3.put_object(Bucket=BUCKET, Key=f"brackets/photos [2023]/{name}.txt", Body=b"a cat")
        s3.put_object(Bucket=BUCKET, Key=f"brackets/ctrl/{name}.png", Body=png.getvalue())
    uri = f"{folder}/*.png"
    assert data_roots(uri, store=st) == [folder]
    assert root_holding(uri, f"{folder}/out", st) == folder
    section = DataSection(uri=uri, control_images=True, control_uri=ctrl)
    source = plan_source(section, st)
    assert (source.format, source.rows) == ("captionfolder", 2)
    assert sorted(source.companions)[:2] == [f"{ctrl}/a.png", f"{ctrl}/b.png"]
    # a worker reading a row: told by the row's own file, nothing asked
    assert control_candidates(section, f"{folder}/a.png")[0] == f"{ctrl}/a.png"


def test_training_and_checkpointing_survive_a_faulty_object_store(s3, ray_s3, shards, tiny_model, caplog):
    """Every 5th request through the proxy fails with 503 SlowDown, every 7th is slow:
    data reads, checkpoint uploads and the export are retried (with backoff) and succeed.
    And each checkpoint's history.jsonl has its first upload refused (403): Ray's own
    upload returns without that file (test_upload_dir_uploads_again_a_file_that_pyarrow_
    dropped), and the worker's check uploads it again before Ray records the checkpoint."""
    import logging

    from faultproxy import FaultProxy, failing_puts

    from raylora.launch import run

    refused = failing_puts(lambda k: "/runs/faulty/train/checkpoint_" in k and k.endswith("/history.jsonl"),
                           1, status=403)
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], fail_every=5, slow_every=7, fail_if=refused) as proxy:
        tree = {
            "model": {"pretrained": tiny_model},
            "data": {"uri": f"s3://{BUCKET}/data/parquet", "resolution": 64, "center_crop": True},
            "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-3},
            "checkpoint": {"every_n_steps": 2},
            "storage": {"endpoint_url": proxy.url},
            "output": {"uri": f"s3://{BUCKET}/runs/faulty"},
        }
        summary = run(validate(tree))
    retried = sum(proxy.failed.values())
    logging.getLogger("raylora.test").warning(
        "fault proxy: %d requests, %d failed with 503 and retried (%s), %d slowed",
        proxy.requests, retried, dict(proxy.failed), proxy.slowed)
    assert summary["metrics"]["steps"] == 4
    # Faults hit reads and writes, checkpoint uploads among them, and all were retried.
    assert proxy.failed["GET"] > 0 and proxy.failed["PUT"] > 0 and proxy.slowed > 0
    assert any("/runs/faulty/train/checkpoint_" in p for p in proxy.failed_paths)
    stored = keys(s3, "runs/faulty/")
    assert "runs/faulty/adapter/manifest.json" in stored
    snapshot = json.loads(s3.get_object(
        Bucket=BUCKET, Key="runs/faulty/train/checkpoint_manager_snapshot.json")["Body"].read())
    steps = sorted(r["metrics"]["step"] for r in snapshot["checkpoint_results"])
    assert steps == [2, 4]  # every checkpoint recorded, and each one is complete:
    for r in snapshot["checkpoint_results"]:
        prefix = f"runs/faulty/train/{r['checkpoint_dir_name']}/"
        assert {prefix + "lora.safetensors", prefix + "history.jsonl"} <= set(stored)
        history = s3.get_object(Bucket=BUCKET, Key=prefix + "history.jsonl")["Body"].read().splitlines()
        assert [json.loads(row)["step"] for row in history] == list(range(1, r["metrics"]["step"] + 1))
    # Each checkpoint's history.jsonl was refused once, and the upload after that arrived.
    assert len(refused.counts) == 2 and min(refused.counts.values()) >= 2
    # The checkpoint a rerun resumes from lists its files, all there; one deleted is named.
    from raylora.checkpoint.recorded import check_latest
    from raylora.checkpoint.state import IncompleteCheckpoint
    from raylora.storage import Storage

    latest = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
    run_uri, store = f"s3://{BUCKET}/runs/faulty/train", Storage(os.environ["AWS_ENDPOINT_URL"])
    assert f"runs/faulty/train/{latest}/checkpoint_files.json" in stored
    assert check_latest(store, run_uri) == f"{run_uri}/{latest}"
    s3.delete_object(Bucket=BUCKET, Key=f"runs/faulty/train/{latest}/history.jsonl")
    with pytest.raises(IncompleteCheckpoint, match=f"checkpoint {run_uri}/{latest} is incomplete: "
                                                    r"history.jsonl \(missing\)\."):
        check_latest(store, run_uri)
