"""Benchmark: a model folder downloaded from an S3-compatible store, raylora's
``Storage.download_dir`` (parts of ``DOWNLOAD_PART`` read side by side) against what it
replaced, ``pyarrow.fs.copy_files`` (each file one stream of 1 MiB ranged GETs), in the
same run, through the same store.

    .venv/bin/python bench/download.py [--mib 256] [--latency-ms 20] [--repeats 2]

The store is moto's server on loopback behind tests/faultproxy.py, which holds every
request ``--latency-ms`` before forwarding it: the wait for a first byte that a real
object store adds to each request (loopback has none, so without it both sides measure
moto's Python). So the ratio says what the number of requests in a row costs at that
latency, not what a given S3 region delivers: bandwidth here is two cores copying bytes
through two Python servers. Each side runs ``--repeats`` times, alternating.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine, moto_bucket, record, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the folder's big file")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    with moto_bucket("bench") as (endpoint, s3):
        run(args, endpoint, s3)


def run(args, endpoint: str, s3) -> None:
    import pyarrow.fs as pafs

    from faultproxy import FaultProxy
    from raylora import storage
    from raylora.storage import Storage

    # A DiT folder in miniature: one big weights file, a smaller one, small configs.
    folder = {"transformer/diffusion_pytorch_model.safetensors": args.mib * 2**20,
              "vae/diffusion_pytorch_model.safetensors": max(1, args.mib // 8) * 2**20,
              "transformer/config.json": 2000, "vae/config.json": 800, "model_index.json": 600}
    for key, size in folder.items():
        s3.put_object(Bucket="bench", Key=f"model/{key}", Body=os.urandom(size))
    total = sum(folder.values())

    gets: list[int] = []

    def count(method: str, path: str, body: bytes) -> bool:
        if method == "GET" and "list-type" not in path:
            gets[-1] += 1
        return False

    def copy_files(proxy_url: str, dest: str) -> None:
        fs, path = Storage(endpoint_url=proxy_url).fs("s3://bench/model")
        os.makedirs(dest, exist_ok=True)
        pafs.copy_files(path, dest, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())

    def download_dir(proxy_url: str, dest: str) -> None:
        Storage(endpoint_url=proxy_url).download_dir("s3://bench/model", dest)

    sides = {"pyarrow copy_files (before)": copy_files, "raylora download_dir": download_dir}
    times: dict[str, list[float]] = {k: [] for k in sides}
    requests: dict[str, int] = {}
    tmp = tempfile.mkdtemp(prefix="raylora-bench-dl-")
    try:
        with FaultProxy(endpoint, slow_every=1, delay=args.latency_ms / 1000, fail_if=count) as proxy:
            for _ in range(args.repeats):
                for name, fn in sides.items():
                    dest = os.path.join(tmp, "copy")
                    shutil.rmtree(dest, ignore_errors=True)
                    gets.append(0)
                    t0 = time.perf_counter()
                    fn(proxy.url, dest)
                    times[name].append(time.perf_counter() - t0)
                    requests[name] = gets[-1]
                    got = sum(os.path.getsize(os.path.join(dest, k)) for k in folder)
                    assert got == total, (name, got, total)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = statistics.mean(times["pyarrow copy_files (before)"])
    rows = [{"side": name, "GET requests": requests[name], "seconds (mean)": statistics.mean(t),
             "MiB/s": total / 2**20 / statistics.mean(t), "speedup vs before": base / statistics.mean(t)}
            for name, t in times.items()]
    record(f"Model folder download from S3: download_dir vs copy_files ({total / 2**20:.0f} MiB, "
           f"{args.latency_ms:g} ms per request)", machine(),
           table(rows, ["side", "GET requests", "seconds (mean)", "MiB/s", "speedup vs before"]),
           notes=[f"moto server on loopback behind tests/faultproxy.py holding each request "
                  f"{args.latency_ms:g} ms (a simulated first-byte wait, not a measured S3 "
                  f"region); DOWNLOAD_PART {storage.DOWNLOAD_PART // 2**20} MiB, "
                  f"DOWNLOAD_THREADS {storage.DOWNLOAD_THREADS}; {args.repeats} runs per side, "
                  "alternating"])


if __name__ == "__main__":
    main()
