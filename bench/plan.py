"""Benchmark: planning a dataset in an S3-compatible store (what the driver reads before
Ray starts to count rows), raylora against what it did before, in the same run, through
the same store.

    .venv/bin/python bench/plan.py [--shards 32] [--mib 8] [--latency-ms 20] [--repeats 2]

Sides:
- webdataset as img2dataset writes it (``00000.tar`` + ``00000.parquet`` + ``00000_stats.json``):
  before, each tar read whole, one after another (``count_tar_samples``, as count_rows did);
  the same folder without its ``_stats.json`` files, the tars read whole 16 at a time; the
  folder as it is, counted from ``_stats.json``.
- parquet shards: before, each footer read one after another; now 16 at a time.

The store is moto's server on loopback behind tests/faultproxy.py, which holds every
request ``--latency-ms`` before forwarding it (a simulated first-byte wait, not a measured
S3 region; bandwidth here is two cores and two Python servers).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine, moto_bucket, record, table  # noqa: E402

SAMPLE_BYTES = 100_000  # an encoded 512px JPEG, about


def tar_bytes(shard: int, samples: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(samples):
            key = f"{shard:05d}{i:04d}"
            for ext, payload in (("jpg", os.urandom(SAMPLE_BYTES)), ("txt", b"a caption"),
                                 ("json", json.dumps({"key": key}).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--mib", type=float, default=8, help="size of each tar")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    with moto_bucket("bench") as (endpoint, s3):
        run(args, endpoint, s3)


def run(args, endpoint: str, s3) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from faultproxy import FaultProxy
    from raylora.config import DataSection
    from raylora.data.formats import base, webdataset
    from raylora.data.source import plan_data
    from raylora.storage import Storage

    samples = max(1, int(args.mib * 2**20 // SAMPLE_BYTES))
    meta = io.BytesIO()
    pq.write_table(pa.table({"key": ["k"], "status": ["success"]}), meta)
    shard_pq = io.BytesIO()
    pq.write_table(pa.table({"image": [os.urandom(SAMPLE_BYTES)] * 64, "text": ["a caption"] * 64}),
                   shard_pq, row_group_size=16)
    for s in range(args.shards):
        name, body = f"{s:05d}", tar_bytes(s, samples)
        stats = json.dumps({"count": samples, "successes": samples}).encode()
        for prefix in ("i2d", "bare"):
            s3.put_object(Bucket="bench", Key=f"{prefix}/{name}.tar", Body=body)
            s3.put_object(Bucket="bench", Key=f"{prefix}/{name}.parquet", Body=meta.getvalue())
        s3.put_object(Bucket="bench", Key=f"i2d/{name}_stats.json", Body=stats)
        s3.put_object(Bucket="bench", Key=f"pq/{name}.parquet", Body=shard_pq.getvalue())

    gets: list[int] = []

    def count(method: str, path: str, body: bytes) -> bool:
        if method in ("GET", "HEAD"):
            gets[-1] += 1
        return False

    def tars_one_by_one(store: Storage) -> int:  # count_rows before: no sidecars, in a row
        files = store.expand("s3://bench/i2d", suffixes=(".tar",))
        n = 0
        for f in files:
            with webdataset._tar_stream(store, f) as fh:
                n += webdataset.count_tar_samples(fh)
        return n

    def footers_one_by_one(store: Storage) -> int:
        n = 0
        for f in store.expand("s3://bench/pq"):
            with store.open_input(f) as fh:
                n += pq.ParquetFile(fh).metadata.num_rows
        return n

    def planned(uri: str):
        return lambda store: plan_data(DataSection(uri=uri), store).rows

    sides = {
        ("webdataset", "before: tars read whole, one after another"): tars_one_by_one,
        ("webdataset", f"tars read whole, {base.PLAN_THREADS} at a time (no _stats.json)"): planned("s3://bench/bare"),
        ("webdataset", "counted from img2dataset's _stats.json"): planned("s3://bench/i2d"),
        ("parquet", "before: footers one after another"): footers_one_by_one,
        ("parquet", f"footers {base.PLAN_THREADS} at a time"): planned("s3://bench/pq"),
    }
    expected = {"webdataset": args.shards * samples, "parquet": args.shards * 64}
    times = {k: [] for k in sides}
    requests = {}
    with FaultProxy(endpoint, slow_every=1, delay=args.latency_ms / 1000, fail_if=count) as proxy:
        for _ in range(args.repeats):
            for key, fn in sides.items():
                store = Storage(endpoint_url=proxy.url)  # no client or listing kept
                gets.append(0)
                t0 = time.perf_counter()
                rows = fn(store)
                times[key].append(time.perf_counter() - t0)
                requests[key] = gets[-1]
                assert rows == expected[key[0]], (key, rows)

    rows = []
    for key, t in times.items():
        base_key = next(k for k in sides if k[0] == key[0])
        rows.append({"data": key[0], "side": key[1], "GET+HEAD requests": requests[key],
                     "seconds (mean)": statistics.mean(t),
                     "speedup vs before": statistics.mean(times[base_key]) / statistics.mean(t)})
    record(f"Planning data in S3: {args.shards} img2dataset tars of {args.mib:g} MiB, "
           f"{args.shards} parquet shards ({args.latency_ms:g} ms per request)", machine(),
           table(rows, ["data", "side", "GET+HEAD requests", "seconds (mean)", "speedup vs before"]),
           notes=[f"moto server on loopback behind tests/faultproxy.py holding each request "
                  f"{args.latency_ms:g} ms (a simulated first-byte wait, not a measured S3 "
                  f"region); {samples} samples of {SAMPLE_BYTES // 1000} kB per tar; "
                  f"{args.repeats} runs per side, alternating; rows checked on every run"])


if __name__ == "__main__":
    main()
