"""``raylora train|sample|tiny-model|demo-data``."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _train(args) -> int:
    from raylora.config import load_config
    from raylora.launch import run

    cfg = load_config(args.config, args.overrides)
    summary = run(cfg)
    m = summary["metrics"]
    print(
        f"raylora: trained {m['steps']} steps, loss {m['train_loss_first']:.5f} → "
        f"{m['train_loss_last']:.5f}, {m['images_seen']} images in {m['wall_seconds']:.1f}s"
    )
    print(f"raylora: adapter      {summary['adapter']}")
    print(f"raylora: loss curve   {summary['loss_png']}")
    print(f"raylora: step metrics {summary['metrics_jsonl']}")
    return 0


def _validate(args) -> int:
    from raylora.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _sample(args) -> int:
    from raylora.sample import sample

    out = sample(
        args.model, args.adapter, args.prompt, args.out,
        seed=args.seed, steps=args.steps, guidance_scale=args.guidance_scale, size=args.size,
    )
    print(f"raylora: sample image {out}")
    return 0


def _tiny_model(args) -> int:
    from raylora.model.tiny import build_tiny_sd

    print(f"raylora: tiny model   {build_tiny_sd(args.dest, seed=args.seed)}")
    return 0


def _demo_data(args) -> int:
    from raylora.data.demo import write_parquet_shards

    paths = write_parquet_shards(args.dest, n=args.num, num_shards=args.shards, size=args.size)
    print(f"raylora: demo data    {args.dest} ({args.num} images in {len(paths)} shards)")
    return 0


def _shards_build(args) -> int:
    import ray

    from raylora.data.shards import build_shards
    from raylora.launch import init_ray
    from raylora.storage import Storage

    started = init_ray()
    try:
        m = build_shards(
            args.src, args.dest, args.format, args.shard_size, Storage(args.endpoint_url, args.region)
        )
    finally:
        if started:
            ray.shutdown()
    print(f"raylora: {m['count']} samples in {len(m['shards'])} {m['format']} shards "
          f"({m['bytes']} bytes) → {args.dest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raylora", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="fine-tune a LoRA adapter with Ray Train")
    t.add_argument("config", help="job YAML")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.learning_rate=2e-4")
    t.set_defaults(fn=_train)

    v = sub.add_parser("validate", help="check a config and print it resolved")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.set_defaults(fn=_validate)

    s = sub.add_parser("sample", help="generate an image with base model + adapter")
    s.add_argument("--model", required=True, help="base model: hub id or diffusers folder")
    s.add_argument("--adapter", required=True, help="folder with pytorch_lora_weights.safetensors")
    s.add_argument("--prompt", required=True)
    s.add_argument("--out", required=True, help="output PNG")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=int, default=25)
    s.add_argument("--guidance-scale", type=float, default=7.5)
    s.add_argument("--size", type=int, default=None, help="pixels; default: the model's size")
    s.set_defaults(fn=_sample)

    m = sub.add_parser("tiny-model", help="write a tiny random SD-1.x pipeline (offline)")
    m.add_argument("dest")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=_tiny_model)

    sh = sub.add_parser("shards", help="shard tools")
    shsub = sh.add_subparsers(dest="shards_cmd", required=True)
    b = shsub.add_parser("build", help="image folder → parquet or WebDataset shards on any URI")
    b.add_argument("src", help="folder (or URI) of images with metadata.jsonl or .txt captions")
    b.add_argument("dest", help="where the shards and manifest.json go (path, s3://, gs://)")
    b.add_argument("--format", choices=["parquet", "webdataset"], default="parquet")
    b.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    b.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    b.add_argument("--region", default=None)
    b.set_defaults(fn=_shards_build)

    d = sub.add_parser("demo-data", help="write procedurally drawn image-caption parquet shards")
    d.add_argument("dest")
    d.add_argument("--num", type=int, default=96)
    d.add_argument("--shards", type=int, default=2)
    d.add_argument("--size", type=int, default=64)
    d.set_defaults(fn=_demo_data)
    return p


def main(argv: list[str] | None = None) -> int:
    from raylora.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="[raylora] %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"raylora: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        # Bad input named by URI/path: one line, not a stack trace.
        print(f"raylora: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
