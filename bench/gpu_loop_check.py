"""A whole training run with ``train.cuda_graphs`` (#24), checked against the same run
without it: what the throughput bench does not cover (it times ``train_micro_step`` alone).

The step ran with CUDA graphs on an H200 (bench/RESULTS.md, 2026-11-26); a run adds what
can go wrong around replayed graphs: the loss read back every N steps, the EMA, held-out
evaluation and preview images (the compiled blocks in eval mode under no_grad, between
training steps, the EMA's weights copied into the parameters the graphs read), checkpoints
and a resume. This runs raylora's loop as each worker runs it, without Ray (``build_run``
+ ``run_loop`` + ``write_checkpoint``; the GPU machine has no Ray), on a tiny random model
of the family (no download), bf16, cached-latent-free raw batches of one shape, and
records per run pair: the largest difference of the per-step losses, the held-out
losses, the final LoRA weights and the preview pixels, and whether the resumed run ends
where the straight one did.

    python3 bench/gpu_loop_check.py --family sdxl --steps 24     # on a GPU
    .venv/bin/python bench/gpu_loop_check.py --smoke             # CPU: eager vs regional only

Runs: ``eager`` (train.compile none), ``regional``, ``regional+cg`` (train.cuda_graphs; GPU
only) and ``regional+cg resumed`` (from the straight cg run's checkpoint at half-way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # raylora

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import machine, record, table  # noqa: E402
from gpu_throughput import raw_batch  # noqa: E402

RES = 64


def raw_batches(family: str, model_path: str, n: int, b: int) -> list[dict]:
    """``n`` fixed raw batches of one shape (the throughput bench's, each from its own
    seed), as raylora's preprocessing hands them to the step."""
    with open(os.path.join(model_path, "text_encoder", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    arch = "sdxl" if family == "sdxl" else "sd15"
    return [raw_batch(arch, b, RES, vocab, "cpu", seed=i) for i in range(n)]


def config(model_path: str, out: str, compile_mode: str, cuda_graphs: bool, gpu: bool,
           steps: int, every: int):
    from raylora.config import validate

    return validate({
        "model": {"pretrained": model_path},
        "data": {"uri": model_path, "resolution": RES},
        # Dropout's masks would differ between eager and compiled code (and perhaps
        # between graphs and no graphs): off, so a difference is the code's, not the RNG's.
        "lora": {"rank": 8, "dropout": 0.0},
        "train": {"batch_size": 2, "max_steps": steps, "learning_rate": 1e-3, "seed": 0,
                  "mixed_precision": "bf16" if gpu else "no", "compile": compile_mode,
                  "cuda_graphs": cuda_graphs, "ema_decay": 0.9, "readback_every_n_steps": 4},
        "validation": {"every_n_steps": every, "prompts": ["a red square"],
                       "num_inference_steps": 4},
        "checkpoint": {"every_n_steps": every},
        "scaling": {"num_workers": 1, "use_gpu": gpu},
        "output": {"uri": out},
    })


def fresh_accelerator(gpu: bool, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=not gpu, mixed_precision=precision)


def train(cfg, batches, steps: int, ckpt_root: str, gpu: bool, restored=None) -> dict:
    """One run of the loop with the worker's hooks (held-out loss, previews, checkpoints);
    what it produced."""
    import torch._dynamo

    from raylora.train import preview as pv
    from raylora.train.evaluate import heldout_loss, prepare_heldout
    from raylora.train.loop import LoopHooks, LoopSettings, run_loop
    from raylora.train.setup import build_run, write_checkpoint

    torch._dynamo.reset()  # each run compiles its own graphs, as a fresh worker does
    accel = fresh_accelerator(gpu, cfg.train.mixed_precision)
    run = build_run(cfg, accel, steps, rank=0, restored=restored)
    dev = accel.device
    heldout = prepare_heldout(run.parts, batches[0], num_timesteps=2, seed=0, device=dev)
    model = accel.unwrap_model(run.model)
    got = {"losses": [], "eval": [], "previews": []}

    def epoch_batches(epoch):
        return [{k: v.to(dev) for k, v in b.items()} for b in batches]

    def evaluate():
        with run.ema.swapped_in(run.params):
            loss = heldout_loss(run.model, heldout, run.parts.weight_dtype)
        got["eval"].append(loss)
        return loss

    def preview(step):
        with run.ema.swapped_in(run.params):
            pipe = pv.build_pipeline(cfg.model.pretrained, run.family, model, run.parts.vae,
                                     run.parts.text_encoders, dtype=run.parts.weight_dtype,
                                     device=dev)
            images = pv.render(pipe, run.family, cfg.validation.prompts, 0,
                               cfg.validation.num_inference_steps,
                               run.family.guidance_kwargs(None), RES, autocast=accel.autocast)
        got["previews"].append(np.stack([np.asarray(i, dtype=np.float32) for i in images]))

    def on_checkpoint(state, final):
        d = os.path.join(ckpt_root, f"step_{state.global_step}")
        os.makedirs(d, exist_ok=True)
        write_checkpoint(d, run, rank=0)

    settings = LoopSettings.from_config(cfg, steps, 1, device=dev.type)
    t0 = time.perf_counter()
    run_loop(run, settings, LoopHooks(
        epoch_batches, on_checkpoint=on_checkpoint, evaluate=evaluate, preview=preview,
        on_step=lambda row: got["losses"].append(row["loss"])))
    got["wall_s"] = time.perf_counter() - t0
    got["lora"] = run.lora_state()
    got["start"] = steps - len(got["losses"])
    return got


def compare(name: str, a: dict, b: dict) -> dict:
    """Largest differences between run ``a`` and run ``b`` over the steps both ran."""
    off = b["start"] - a["start"]  # b resumed: its first loss is a's step `off`
    la, lb = np.array(a["losses"][off:]), np.array(b["losses"])
    ea, eb = a["eval"][-len(b["eval"]):], b["eval"]
    pa, pb = a["previews"][-len(b["previews"]):], b["previews"]
    lora = max((a["lora"][k].float() - b["lora"][k].float()).abs().max().item() for k in a["lora"])
    scale = max(v.float().abs().max().item() for v in a["lora"].values())
    return {"runs": name, "steps": len(lb),
            "max abs d loss": float(np.abs(la - lb).max()),
            "max abs d eval loss": float(np.abs(np.array(ea) - np.array(eb)).max()),
            "max abs d LoRA": lora, "LoRA max": scale,
            "max abs d preview (0-255)": float(max(np.abs(x - y).max() for x, y in zip(pa, pb))),
            "wall s (b)": round(b["wall_s"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="sd", choices=["sd", "sdxl"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script (not recorded)")
    args = ap.parse_args()
    from raylora.checkpoint.state import load_state
    from raylora.model.tiny import build_tiny

    gpu = torch.cuda.is_available() and not args.smoke
    every = max(2, args.steps // 4)
    root = tempfile.mkdtemp(prefix="gpu-loop-")
    model_path = str(build_tiny(os.path.join(root, "model"), args.family))
    batches = raw_batches(args.family, model_path, n=4, b=2)
    runs, failed = {}, {}

    def attempt(name, cfg, **kw):
        """A run that raises (a replayed graph's output read after it was overwritten is
        an error torch raises) is recorded as failed, not lost with the rest."""
        try:
            runs[name] = train(cfg, batches, args.steps, os.path.join(root, name, "ckpt"), gpu, **kw)
            print(f"{name}: {args.steps} steps in {runs[name]['wall_s']:.1f} s, last loss "
                  f"{runs[name]['losses'][-1]:.4f}", flush=True)
        except Exception as exc:
            traceback.print_exc()
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

    plan = [("eager", "none", False), ("regional", "regional", False)]
    if gpu:
        plan.append(("regional+cg", "regional", True))
    for name, mode, cg in plan:
        attempt(name, config(model_path, os.path.join(root, name), mode, cg, gpu, args.steps, every))
    last = plan[-1][0]
    half = (args.steps // 2) // every * every or every
    if last in runs:
        restored = load_state(os.path.join(root, last, "ckpt", f"step_{half}"), rank=0)
        attempt("resumed", config(model_path, os.path.join(root, "resumed"), plan[-1][1],
                                  plan[-1][2], gpu, args.steps, every), restored=restored)
    pairs = [("eager", "regional", "eager vs regional")]
    if gpu:
        pairs.append(("regional", "regional+cg", "regional vs regional+cg"))
    pairs.append((last, "resumed", f"{last} vs {last} resumed at step {half}"))
    rows = []
    for a, b, label in pairs:
        if a in runs and b in runs:
            rows.append(compare(label, runs[a], runs[b]))
        else:
            rows.append({"runs": label, "steps": "failed: " + "; ".join(
                f"{n}: {failed.get(n, 'not run')}" for n in (a, b) if n not in runs)})
    cols = ["runs", "steps", "max abs d loss", "max abs d eval loss", "max abs d LoRA",
            "LoRA max", "max abs d preview (0-255)", "wall s (b)"]
    print(table(rows, cols))
    if args.smoke:
        return
    env = machine()
    record(f"Whole run with CUDA graphs: raylora's loop, {args.family} (tiny), "
           f"{args.steps} steps", env, table(rows, cols), notes=[
               f"Tiny random {args.family} (raylora.model.tiny), {RES} px raw batches of 2 "
               "(4 fixed batches, one shape), LoRA r8 (no dropout), EMA 0.9, loss read "
               f"back every 4 steps, held-out loss, one preview and a checkpoint every {every} "
               "steps, bf16; raylora's loop without Ray (build_run + run_loop + "
               "write_checkpoint), each run compiling afresh (torch._dynamo.reset).",
               "Columns compare the second run with the first over the steps both ran; "
               "`LoRA max` is the first run's largest LoRA weight, for scale."])


if __name__ == "__main__":
    main()
