"""The memory preflight's worked example: per-GPU estimates for Flux.1-dev LoRA training
(raylora.memory), from a weights-free folder of the model's configs, on any machine (no
GPU, no download; each new step profile runs one meta-device training step, ~15-30 s).

    python bench/flux_meta.py                    # 1024 px, batch 1, r16, bf16, cached latents
    python bench/flux_meta.py --uncached --batch-size 2 --gpu-gb 24

Prints one table per setting: DDP on 1 GPU; FSDP on 2/4/8 GPUs; NF4 base; each with and
without gradient checkpointing; then a summary and what would make it fit ``--gpu-gb``.
Nothing is written to bench/RESULTS.md: these are estimates, not measurements.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raylora import memory  # noqa: E402

SETTINGS = [
    ("DDP, 1 GPU", dict(strategy="ddp", world_size=1)),
    ("FSDP, 2 GPUs", dict(strategy="fsdp", world_size=2)),
    ("FSDP, 4 GPUs", dict(strategy="fsdp", world_size=4)),
    ("FSDP, 8 GPUs", dict(strategy="fsdp", world_size=8)),
    ("NF4 base, DDP, 1 GPU", dict(strategy="ddp", world_size=1, quantize="nf4")),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--uncached", action="store_true",
                    help="VAE + CLIP + T5-XXL on every worker (default: data.cache=latents)")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="GPU size for the advice, GiB")
    args = ap.parse_args(argv)
    folder = memory.write_config_folder(tempfile.mkdtemp(prefix="flux-dev-configs-"))
    common = dict(batch_size=args.batch_size, resolution=args.resolution, lora_rank=args.rank,
                  mixed_precision="bf16", cached_latents=not args.uncached)
    summary = []
    for gc in (False, True):
        for name, kw in SETTINGS:
            t = time.time()
            e = memory.estimate(folder, **common, **kw, gradient_checkpointing=gc)
            title = f"{name}, gradient checkpointing {'on' if gc else 'off'}"
            print(f"### {title}  ({time.time() - t:.0f} s)\n\n```\n{e.table()}\n```\n", flush=True)
            summary.append((title, e))
    print("### Summary (GiB per GPU)\n")
    print("| setting | weights | activations | total | fits 24 | fits 48 | fits 80 |")
    print("|---|---|---|---|---|---|---|")
    for title, e in summary:
        fits = " | ".join("yes" if e.fits(g) else "no" for g in (24, 48, 80))
        print(f"| {title} | {sum(e.weights.values()) / memory.GIB:.2f} | "
              f"{e.activations / memory.GIB:.2f} | {e.gib():.2f} | {fits} |")
    base = summary[0][1]
    print(f"\n### What makes DDP on 1 GPU (no checkpointing) fit {args.gpu_gb:g} GiB\n")
    for line in base.advice(args.gpu_gb) or ["(fits as it is)" if base.fits(args.gpu_gb) else "(nothing tried fits)"]:
        print(f"- {line}")


if __name__ == "__main__":
    main()
