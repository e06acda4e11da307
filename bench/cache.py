"""Benchmark 3, cached latents: time per epoch with ``data.cache: latents`` against
encoding every step (VAE + text encoder on the worker), same data, model and seed.

    .venv/bin/python bench/cache.py [--images 32] [--epochs 3] [--resolution 128]

Each side is a real ``raylora train`` run (embedded Ray, one worker). An epoch's time is
the sum of its step times from ``metrics.jsonl`` (each step's time includes waiting for
data); epoch 1 (start-up) is left out. The cached config runs twice on one cache_uri: the
first run builds the cache, the second reuses it; the difference in wall time is what
building cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, record, table  # noqa: E402
from fixtures import photo_shards, tiny_model  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def epoch_seconds(metrics_path: str, batch_size: int) -> dict[int, float]:
    per: dict[int, float] = {}
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            if "images_per_s" in row:
                per[row["epoch"]] = per.get(row["epoch"], 0.0) + batch_size / row["images_per_s"]
    return per


def train(cfg_tree: dict) -> tuple[float, dict]:
    from raylora.config import validate
    from raylora.launch import run

    t0 = time.perf_counter()
    summary = run(validate(cfg_tree))
    return time.perf_counter() - t0, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=128)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="rl-bench-", dir="/tmp")
    model = tiny_model(os.path.join(work, "model"))
    data = os.path.join(work, "shards")
    photo_shards(data, args.images, 4)
    steps = args.epochs * (args.images // args.batch_size)

    def tree(name: str, cache: bool) -> dict:
        return {
            "model": {"pretrained": model},
            "data": {"uri": data, "resolution": args.resolution, "center_crop": True,
                     "random_flip": False, "cache": "latents" if cache else "none",
                     **({"cache_uri": os.path.join(work, "cache")} if cache else {})},
            "train": {"batch_size": args.batch_size, "max_steps": steps, "learning_rate": 1e-4,
                      "log_every_n_steps": 1000},
            "scaling": {"num_workers": 1},
            "checkpoint": {"every_n_steps": steps},
            "output": {"uri": os.path.join(work, name)},
        }

    import ray

    from raylora.launch import start_local_ray

    start_local_ray(num_cpus=4)
    try:
        wall = {}
        wall["uncached"], _ = train(tree("uncached", False))
        wall["cached (build)"], _ = train(tree("cached-build", True))
        wall["cached (reuse)"], _ = train(tree("cached-reuse", True))
    finally:
        ray.shutdown()
    for name, reused in (("cached-build", False), ("cached-reuse", True)):
        with open(os.path.join(work, name, "adapter", "raylora.json")) as f:
            data = json.load(f)["data"]
        if data["cache_reused"] is not reused:
            raise SystemExit(f"{name}: cache_reused is {data['cache_reused']}, expected {reused}")

    rows = []
    for name, out in (("uncached", "uncached"), ("cached (reuse)", "cached-reuse")):
        per = epoch_seconds(os.path.join(work, out, "metrics.jsonl"), args.batch_size)
        later = [per[e] for e in sorted(per)[1:]]
        rows.append({"run": name, "epoch s (mean of epochs 2+)": statistics.mean(later),
                     "epoch 1 s": per[min(per)], "run wall s": wall[name]})
    speedup = rows[0]["epoch s (mean of epochs 2+)"] / rows[1]["epoch s (mean of epochs 2+)"]
    rows.append({"run": "speed-up per epoch (uncached / cached)", "epoch s (mean of epochs 2+)": round(speedup, 2)})
    rows.append({"run": "cache build (build run wall - reuse run wall)",
                 "run wall s": wall["cached (build)"] - wall["cached (reuse)"]})
    record("Cached latents vs encoding every step", machine(), table(rows, [
        "run", "epoch s (mean of epochs 2+)", "epoch 1 s", "run wall s"]), [
        f"Tiny random SD-1.x model, {args.images} JPEG images 768x512 -> {args.resolution}px, "
        f"batch {args.batch_size}, 1 CPU worker, {args.epochs} epochs ({steps} steps).",
        "Command: `.venv/bin/python bench/cache.py " + " ".join(sys.argv[1:]) + "`",
    ])


if __name__ == "__main__":
    main()
