"""Benchmark 4, a whole short run, epoch boundaries included: images/s of a real
``raylora train`` run (Ray Data + Ray Train, one worker) against a diffusers-example-style
PyTorch loop on the same model, rows, batch and steps, measured in the same run.

    .venv/bin/python bench/epochs.py [--images 32] [--epochs 4] [--batch-size 2]
                                     [--sharding stream|files] [--repeats 1]

The torch loop is what diffusers' ``train_text_to_image.py`` does: a ``DataLoader``
(shuffle, no worker processes, its default) over the rows in memory, decoding and
transforming each batch in the training process (raylora's own ``Preprocess``: the same
decode, resize, random crop, flip and tokenizer), then raylora's training step through
``run_loop``, the same step the worker runs. It runs before and after the Ray run; their
mean is the baseline (drift on a shared machine moves both); ``--repeats`` alternates
more runs.

Both sides are timed from the loop's start (model built) to its last step: the raylora
figure includes its data pipeline's start-up and every epoch boundary, which is what a
short LoRA run of a few hundred images pays. Per epoch, the first step's time (from the
previous epoch's last step) is shown as a multiple of the median step within epochs: a
pipeline restarted every epoch shows there.
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

STAMPS = os.path.join(tempfile.mkdtemp(prefix="rl-bench-stamps-", dir="/tmp"), "stamps.json")


def stamped_worker(loop_config: dict) -> None:
    """raylora's own per-worker function, with the time of every optimizer step written to
    ``STAMPS`` (the worker runs on this machine)."""
    import torch

    from raylora import worker

    stamps = []
    on_step = worker._Reporter.on_step

    def timed(self, row):
        stamps.append(time.perf_counter())
        on_step(self, row)

    worker._Reporter.on_step = timed
    try:
        worker.train_loop_per_worker(loop_config)
    finally:
        with open(STAMPS, "w") as f:
            json.dump({"stamps": stamps, "threads": torch.get_num_threads()}, f)


def raylora_side(tree: dict) -> dict:
    """A real ``raylora train`` run (launch.run) with the worker function above, into a
    new output folder (the same one would resume the finished run)."""
    from raylora import entry
    from raylora.config import validate
    from raylora.launch import run

    out = tree["output"]["uri"]
    tree = {**tree, "output": {"uri": tempfile.mkdtemp(prefix="run-", dir=out)}}
    original = entry.train_loop_per_worker
    entry.train_loop_per_worker = stamped_worker  # what launch.build_trainer picks up
    try:
        t0 = time.perf_counter()
        summary = run(validate(tree))
        total = time.perf_counter() - t0
    finally:
        entry.train_loop_per_worker = original
    with open(STAMPS) as f:
        got = json.load(f)
    rows = [json.loads(x) for x in open(summary["metrics_jsonl"])]
    return {"stamps": got["stamps"], "epochs": [r["epoch"] for r in rows],
            "wall": summary["metrics"]["wall_seconds"], "threads": got["threads"],
            "run_s": total}


def read_rows(files: list[str]) -> list[tuple[bytes, str]]:
    import pyarrow.parquet as pq

    rows = []
    for f in files:
        t = pq.read_table(f, columns=["image", "text"]).to_pydict()
        rows += list(zip(t["image"], t["text"]))
    return rows


def torch_side(tree: dict, rows: list, threads: int) -> dict:
    """The diffusers-style loop: DataLoader → transforms in-process → raylora's step."""
    import numpy as np
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from raylora.config import validate
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.train.loop import LoopHooks, LoopSettings, run_loop
    from raylora.train.setup import build_run

    torch.set_num_threads(threads)
    cfg = validate(tree)
    d, t = cfg.data, cfg.train
    pre = Preprocess(StageSpec(cfg.model.pretrained, d.resolution, center_crop=d.center_crop,
                     random_flip=d.random_flip, seed=t.seed))

    def collate(batch):
        out = pre({"image": np.array([r[0] for r in batch], dtype=object),
                   "text": np.array([r[1] for r in batch], dtype=object)})
        return {k: torch.from_numpy(v) for k, v in out.items()}

    gen = torch.Generator().manual_seed(t.seed)
    loader = DataLoader(rows, batch_size=t.batch_size, shuffle=True, drop_last=True,
                        collate_fn=collate, generator=gen, num_workers=0)
    run = build_run(cfg, Accelerator(cpu=True), t.max_steps, rank=0)
    stamps, epochs = [], []

    def on_step(row):
        stamps.append(time.perf_counter())
        epochs.append(row["epoch"])

    settings = LoopSettings(max_steps=t.max_steps, images_per_step=t.batch_size,
                            checkpoint_every=t.max_steps + 1, max_grad_norm=t.max_grad_norm)
    state = run_loop(run, settings, LoopHooks(lambda epoch: loader, on_step=on_step))
    return {"stamps": stamps, "epochs": epochs, "wall": state.wall_seconds}


def analyse(side: dict, images_per_step: int) -> dict:
    """Whole-run img/s; each epoch's first step against the median step inside epochs."""
    stamps, epochs = side["stamps"], side["epochs"]
    start = stamps[-1] - side["wall"]  # the loop's start (wall_seconds ends at the last step)
    times = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    firsts = [i for i in range(len(epochs)) if i == 0 or epochs[i] != epochs[i - 1]]
    steady = statistics.median(times[i] for i in range(len(times)) if i not in firsts)
    later = [times[i] / steady for i in firsts[1:]]
    return {
        "img_s": len(stamps) * images_per_step / side["wall"],
        "wall": side["wall"],
        "steady_ms": 1000 * steady,
        "first_step_s": times[0],
        "stall_max": max(later) if later else None,
        "stall_mean": statistics.mean(later) if later else None,
        "stalls": [round(x, 1) for x in later],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--sharding", choices=["stream", "files"], default="stream")
    ap.add_argument("--repeats", type=int, default=1, help="raylora runs (torch runs: one more)")
    ap.add_argument("--no-record", action="store_true", help="print only, no RESULTS.md entry")
    args = ap.parse_args()

    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="rl-bench-", dir="/tmp")
    model = tiny_model(os.path.join(work, "model"))
    files = photo_shards(os.path.join(work, "shards"), args.images, 2)
    steps = args.epochs * (args.images // args.batch_size)
    os.makedirs(os.path.join(work, "out"))
    tree = {
        "model": {"pretrained": model},
        "data": {"uri": os.path.join(work, "shards"), "resolution": args.resolution,
                 "center_crop": False, "random_flip": True, "sharding": args.sharding},
        "train": {"batch_size": args.batch_size, "max_steps": steps, "learning_rate": 1e-4,
                  "log_every_n_steps": 10_000},
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": steps},
        "output": {"uri": os.path.join(work, "out")},
    }
    rows = read_rows(files)
    threads = 1  # what Ray gives a worker of scaling.cpus_per_worker=1 (OMP_NUM_THREADS)
    # torch, raylora, torch, raylora, ..., torch: each raylora run against the torch runs
    # either side of it (a busy machine drifts).
    bare = [torch_side(tree, rows, threads)]
    on_ray = []
    for _ in range(args.repeats):
        on_ray.append(raylora_side(tree))
        bare.append(torch_side(tree, rows, threads))
    load_after = os.getloadavg()

    ours = [analyse(r, args.batch_size) for r in on_ray]
    base = [analyse(b, args.batch_size) for b in bare]
    ratios = [o["img_s"] / (steps * args.batch_size / statistics.mean([b0["wall"], b1["wall"]]))
              for o, b0, b1 in zip(ours, base, base[1:])]

    def row(side: str, r: dict) -> dict:
        return {"side": side, "img/s whole run": r["img_s"], "loop s": r["wall"],
                "median step ms": r["steady_ms"], "epoch 1 first step s": r["first_step_s"],
                "later epochs' first step / median (max, mean)":
                    f"{r['stall_max']:.1f}, {r['stall_mean']:.1f}"}

    table_rows = [
        *[row(f"raylora (Ray Data + Ray Train, 1 worker), run {i + 1}", r) for i, r in enumerate(ours)],
        *[row(f"diffusers-style torch loop, run {i + 1}", b) for i, b in enumerate(base)],
        {"side": "ratio raylora / torch loop (each raylora run against the torch runs either "
                 "side of it: their mean loop time)",
         "img/s whole run": ", ".join(f"{x:.2f}" for x in ratios)},
    ]
    for o, r in zip(ours, on_ray):
        print(f"raylora per-epoch first step / median step: {o['stalls']}; worker torch threads "
              f"{r['threads']} (torch loop {threads}); raylora train wall {r['run_s']:.1f} s")
    notes = [
        f"Tiny random SD-1.x model, {args.images} JPEG images 768x512 in 2 parquet shards -> "
        f"{args.resolution}px (random crop, flip), batch {args.batch_size}, {args.epochs} "
        f"epochs ({steps} steps), data.sharding={args.sharding}, default shuffle buffer; "
        f"1 torch thread each side. Targets: ratio >= 0.95, first step of an epoch <= 2x the "
        "median step.",
        f"Load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {', '.join(f'{x:.2f}' for x in load_after)}"
        + (" (above the core count: machine shared with other jobs)"
           if max(load_before[0], load_after[0]) > (os.cpu_count() or 1) else ""),
        "Command: `.venv/bin/python bench/epochs.py " + " ".join(sys.argv[1:]) + "`",
    ]
    columns = list(table_rows[0])
    if args.no_record:
        print(table(table_rows, columns))
        print("\n".join(notes))
    else:
        record("Whole short run across epochs: raylora vs diffusers-style torch loop", machine(),
               table(table_rows, columns), notes)


if __name__ == "__main__":
    main()
