"""Benchmark 1, ingest: images/s of raylora's data pipeline (Ray Data: read, validating
decode, resize, crop, flip, tokenize, batch) against a plain PyTorch DataLoader doing the
same transforms on the same shards with the same number of CPU workers, from local
parquet and from an S3-compatible server on loopback (moto).

    .venv/bin/python bench/ingest.py [--images 1536] [--workers 2] [--epochs 5]

Epoch 1 includes start-up (process spawn, imports, tokenizer); the throughput compared is
that of the later epochs (their images over the time from the end of epoch 1 to the last
batch), with the first-batch latencies (epoch 1, and the mean of the later epochs: what a
pipeline restarted per epoch would pay again) shown beside it. raylora's side is what a
worker runs: one dataset of every epoch's pass, executed once, so it works on later epochs
while epoch 1 is read: an input whose later epochs take less time than the start-up is
too small to measure a steady rate, and the table says so.
The DataLoader keeps its workers between epochs (persistent_workers), its best case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, record, table  # noqa: E402
from fixtures import photo_shards, tiny_model  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def epochs(make_iter, n_epochs: int, images: int, clock=time.perf_counter) -> dict:
    """Time each epoch of ``make_iter(epoch)``, an epoch's batches; count the images.
    ``images_per_s``: the images of epochs 2.. over the time from the end of epoch 1 to the
    last batch (one epoch alone: epoch 1's). ``steady`` is false when that time is shorter
    than epoch 1's wait for its first batch (the start-up): a pipeline across epochs can
    have made those batches while epoch 1 was read, and the figure is a buffer's."""
    times, ends, firsts, counted = [], [], [], []
    for e in range(n_epochs):
        t0 = clock()
        n = 0
        for batch in make_iter(e):
            if n == 0:
                firsts.append(clock() - t0)
            n += batch["pixel_values"].shape[0]
        ends.append(clock())
        times.append(ends[-1] - t0)
        counted.append(n)
    window, timed = (ends[-1] - ends[0], sum(counted[1:])) if n_epochs > 1 else (times[0], counted[0])
    return {
        "first_batch_s": firsts[0],
        "later_first_batch_s": statistics.mean(firsts[1:] or firsts),
        "epoch1_s": times[0],
        "steady_window_s": window,
        "images_per_s": timed / window if window > 0 else float("inf"),
        "steady": n_epochs > 1 and window >= firsts[0],
        "epochs": n_epochs,
        "images": counted[-1],
    }


def steady_warning(side: str, source: str, r: dict) -> str | None:
    """A line for the output when ``r`` (epochs()) is no steady rate; None when it is."""
    if r["steady"]:
        return None
    if r["epochs"] == 1:
        return (f"WARNING: {side}, {source}: one epoch, its start-up included: no steady rate; "
                "use --epochs 2 or more")
    return (f"WARNING: {side}, {source}: epochs 2+ took {r['steady_window_s']:.3g} s, less than "
            f"the {r['first_batch_s']:.3g} s start-up: too small to measure a steady rate (its "
            "batches may have been made during epoch 1); use more --images or --epochs")


def pre_kwargs(model: str, resolution: int) -> dict:
    return dict(tokenizer_path=model, resolution=resolution, center_crop=True, random_flip=True,
                image_column="image", caption_column="text", seed=0)


def raylora_side(uri: str, model: str, args) -> dict:
    """What a worker does: one dataset of every epoch's pass, one execution, batches
    per pass (no local shuffle, as the DataLoader's order is fixed too)."""
    import torch

    from raylora.config import validate
    from raylora.data.source import EpochStream, build_dataset, pass_batches, plan_data

    cfg = validate({
        "model": {"pretrained": model},
        "data": {"uri": uri, "resolution": args.resolution, "center_crop": True, "random_flip": True},
        "train": {"batch_size": args.batch_size},
        "output": {"uri": tempfile.mkdtemp()},
    })
    store = cfg.storage.client()
    dp = plan_data(cfg.data, store)
    ds = build_dataset(cfg.data, dp, store, model_path=model, seed=0,
                       num_preprocess_tasks=args.workers, epochs=args.epochs)

    def open_stream(epoch: int):
        blocks = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=4)
        return pass_batches(blocks, args.batch_size, 0, seed=lambda e: e)

    stream = EpochStream(open_stream, dp.rows // args.batch_size, per_pass=True,
                         convert=lambda b: {k: torch.from_numpy(v) for k, v in b.items()})
    try:
        return epochs(stream, args.epochs, args.images)
    finally:
        stream.close()


def dataloader_side(uri: str, model: str, args) -> dict:
    from torch.utils.data import DataLoader
    from torch_baseline import ParquetShards

    from raylora.storage import Storage

    files = Storage().expand(uri)
    loader = DataLoader(
        ParquetShards(files, uri, pre_kwargs(model, args.resolution)),
        batch_size=args.batch_size, drop_last=True, num_workers=args.workers,
        persistent_workers=True, multiprocessing_context="spawn", prefetch_factor=4,
    )
    return epochs(lambda epoch: iter(loader), args.epochs, args.images)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1536)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="CPU workers on each side")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="rl-bench-", dir="/tmp")
    model = tiny_model(os.path.join(work, "model"))
    local = os.path.join(work, "shards")
    photo_shards(local, args.images, args.shards)
    sources = [("local parquet", local)]

    server = None
    if not args.no_s3:
        import boto3
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        # Before ray.init: the embedded Ray's workers inherit these.
        os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="raylora-bench")
        for f in sorted(os.listdir(local)):
            s3.upload_file(os.path.join(local, f), "raylora-bench", f"shards/{f}")
        sources.append(("S3 (moto, loopback)", "s3://raylora-bench/shards"))

    # The baseline first: its workers are spawned before Ray's threads exist.
    base = {name: dataloader_side(uri, model, args) for name, uri in sources}

    import ray

    from raylora.launch import start_local_ray

    # Logical CPUs for Ray Data's read tasks beside the preprocess tasks; the processes
    # share the same physical cores as the DataLoader's did.
    start_local_ray(num_cpus=args.workers + 2)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        ours = {name: raylora_side(uri, model, args) for name, uri in sources}
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()

    rows, warnings = [], []
    for name, _ in sources:
        r, b = ours[name], base[name]
        warnings += [w for w in (steady_warning("raylora", name, r), steady_warning("DataLoader", name, b))
                     if w]
        rows.append({
            "source": name,
            "raylora img/s": r["images_per_s"], "DataLoader img/s": b["images_per_s"],
            "ratio raylora/DataLoader": round(r["images_per_s"] / b["images_per_s"], 2),
            "raylora 1st batch s": r["first_batch_s"], "DataLoader 1st batch s": b["first_batch_s"],
            "raylora 1st batch s, epochs 2+": r["later_first_batch_s"],
            "DataLoader 1st batch s, epochs 2+": b["later_first_batch_s"],
            "raylora epoch 1 s": r["epoch1_s"], "DataLoader epoch 1 s": b["epoch1_s"],
            "steady rate": "yes" if r["steady"] and b["steady"] else "NO: " + " and ".join(
                side for side, x in (("raylora", r), ("DataLoader", b)) if not x["steady"]) + " too small",
        })
    for w in warnings:
        print(w, flush=True)
    cols = list(rows[0])
    record("Ingest: raylora data pipeline vs torch DataLoader", machine(), table(rows, cols), [
        f"{args.images} JPEG images 768x512 in {args.shards} parquet shards -> {args.resolution}px, "
        f"batch {args.batch_size}, {args.workers} workers each side, {args.epochs} epochs "
        "(img/s: epochs 2+, their images over the time from the end of epoch 1 to the last batch). "
        "Target: ratio >= 1.0.",
        *(["steady rate NO: " + "; ".join(w.removeprefix("WARNING: ") for w in warnings)
           + ". Such a row's img/s and ratio are no measurement."] if warnings else []),
        "Command: `.venv/bin/python bench/ingest.py " + " ".join(sys.argv[1:]) + "`",
    ])


if __name__ == "__main__":
    main()
