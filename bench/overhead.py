"""Benchmark 2, distribution overhead: optimizer steps/s of raylora's training step under
Ray Train with one worker, against the same step in a bare PyTorch loop without Ray: same
model, same batches already in memory, same number of torch threads.

    .venv/bin/python bench/overhead.py [--steps 60] [--warmup 10] [--resolution 64]

Both sides run raylora's ``build_run`` + ``run_loop`` (the worker's loop). The Ray side
also does what raylora's worker does every step: judge the bad-record counter (one call to
its actor). Steps/s is timed between step ``warmup`` and the last step, so process start,
model load and the final report are outside it. The bare loop runs before and after the
Ray run; their mean is the baseline (drift on a shared machine moves both).
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
from fixtures import tiny_model  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def timed_steps(cfg_dict: dict, batches: list, steps: int, warmup: int, threads: int,
                per_step=None) -> float:
    """Steps/s of ``run_loop`` over in-memory batches, between step ``warmup`` and the end."""
    import torch
    from accelerate import Accelerator

    from raylora.config import RayLoraConfig
    from raylora.train.loop import LoopHooks, LoopSettings, run_loop
    from raylora.train.setup import build_run

    torch.set_num_threads(threads)
    cfg = RayLoraConfig.model_validate(cfg_dict)
    accel = Accelerator(cpu=True)
    run = build_run(cfg, accel, steps, rank=0)
    stamps = []

    def on_step(row):
        if per_step is not None:
            per_step(row)
        stamps.append(time.perf_counter())

    settings = LoopSettings(max_steps=steps, images_per_step=cfg.train.batch_size,
                            checkpoint_every=steps + 1, max_grad_norm=cfg.train.max_grad_norm)
    run_loop(run, settings, LoopHooks(lambda epoch: batches, on_step=on_step))
    return (len(stamps) - warmup) / (stamps[-1] - stamps[warmup - 1])


def ray_worker(loop_config: dict) -> None:
    """Ray Train's per-worker function: the same timed loop, plus the worker's per-step
    bad-record judgement; reports steps/s."""
    import ray.train

    from raylora.data.badrecords import min_rows_to_judge, read_counter, verdict

    counter = loop_config["counter"]

    def judge(row):
        verdict(read_counter(counter) or {"rows_seen": 0}, 0.05, min_rows_to_judge(10_000))

    rate = timed_steps(loop_config["cfg"], loop_config["batches"], loop_config["steps"],
                       loop_config["warmup"], loop_config["threads"],
                       per_step=judge if loop_config["judge"] else None)
    import tempfile

    # With a (tiny) checkpoint: Ray Train V2's Result keeps the metrics of checkpointed reports.
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "rate.txt"), "w") as f:
        f.write(str(rate))
    ray.train.report({"steps_per_s": rate}, checkpoint=ray.train.Checkpoint.from_directory(d))


def make_batches(model: str, resolution: int, batch_size: int, n: int) -> list:
    import numpy as np
    import torch

    from raylora.data.demo import make_samples
    from raylora.data.preprocess import Preprocess, StageSpec

    stage = Preprocess(StageSpec(model, resolution, center_crop=True, random_flip=False))
    samples = make_samples(n * batch_size, size=resolution, seed=0)
    out = stage({"image": np.array([s[0] for s in samples], dtype=object),
                 "text": np.array([s[1] for s in samples])})
    return [{"pixel_values": torch.from_numpy(out["pixel_values"][i:i + batch_size]),
             "input_ids": torch.from_numpy(out["input_ids"][i:i + batch_size])}
            for i in range(0, n * batch_size, batch_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-judge", action="store_true",
                    help="leave out the per-step bad-record judgement (to measure its share)")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="rl-bench-", dir="/tmp")
    model = tiny_model(os.path.join(work, "model"))
    batches = make_batches(model, args.resolution, args.batch_size, 8)
    cfg = {
        "model": {"pretrained": model},
        "data": {"uri": work, "resolution": args.resolution},
        "train": {"batch_size": args.batch_size, "max_steps": args.steps, "learning_rate": 1e-4},
        "output": {"uri": os.path.join(work, "out")},
    }
    bare = [timed_steps(cfg, batches, args.steps, args.warmup, args.threads)]

    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylora import desk
    from raylora.launch import start_local_ray

    start_local_ray(num_cpus=args.threads + 1)
    try:
        counter = desk.start()  # the run's desk, as raylora's runs have (its counts)
        trainer = TorchTrainer(
            ray_worker,
            train_loop_config={"cfg": cfg, "batches": batches, "steps": args.steps,
                               "warmup": args.warmup, "threads": args.threads, "counter": counter,
                               "judge": not args.no_judge},
            scaling_config=ray.train.ScalingConfig(
                num_workers=1, resources_per_worker={"CPU": args.threads}),
            run_config=ray.train.RunConfig(name="overhead", storage_path=os.path.join(work, "ray")),
        )
        on_ray = trainer.fit().metrics["steps_per_s"]
        desk.stop(counter)
    finally:
        ray.shutdown()
    bare.append(timed_steps(cfg, batches, args.steps, args.warmup, args.threads))

    baseline = statistics.mean(bare)
    rows = [{"bare PyTorch steps/s (before, after)": f"{bare[0]:.3g}, {bare[1]:.3g}",
             "Ray Train 1 worker steps/s": on_ray,
             "ratio Ray/bare": round(on_ray / baseline, 3),
             "step ms bare": 1000 / baseline, "step ms Ray": 1000 / on_ray}]
    record("Distribution overhead: Ray Train (1 worker) vs bare PyTorch loop", machine(),
           table(rows, list(rows[0])), [
               f"Tiny random SD-1.x UNet, {args.resolution}px, batch {args.batch_size}, "
               f"{args.threads} torch threads each side, steps {args.warmup}-{args.steps} timed"
               + (", no per-step bad-record judgement. " if args.no_judge else ". ") +
               "Target: ratio >= 0.95.",
               "Command: `.venv/bin/python bench/overhead.py " + " ".join(sys.argv[1:]) + "`",
           ])


if __name__ == "__main__":
    main()
