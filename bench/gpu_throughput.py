"""Benchmark 4, GPU throughput: images/s/GPU and model FLOP utilisation (MFU) of raylora's
training step on the SD 1.5 architecture at 512x512 and SDXL at 1024x1024, built from
their public config values with random weights (no download), bf16, SDPA attention, LoRA
rank 16 on the attention projections; with and without cached latents, with and without
``torch.compile``; against the same step written the way diffusers' example script writes
it (per-step VAE and text encoding, no cache, no compile), measured in the same run.

    .venv/bin/python bench/gpu_throughput.py                      # SD 1.5 + SDXL, batch 1-16
    .venv/bin/python bench/gpu_throughput.py --models sd15 --batch-sizes 8 --no-compile
    .venv/bin/python bench/gpu_throughput.py --smoke              # tiny shapes, CPU ok

FLOPs are counted once per (model, batch, cached) with ``torch.utils.flop_counter`` over
one full step (forward, backward; the encoders' forward when not cached) and divided by
the measured step time and the GPU's peak dense bf16 FLOP/s (table below, or
``--peak-tflops``). A batch size that does not fit is recorded as OOM and skipped.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import machine, record, table  # noqa: E402

# Peak dense (no sparsity) bf16 tensor FLOP/s from the vendors' datasheets, matched
# against torch.cuda.get_device_name in order (first match wins).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("H800", 989.4), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1),
    ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
]

# diffusers / transformers config values of the public checkpoints
# (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-xl-base-1.0).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
    addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
              projection_dim=768)
CLIP_BIG_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120,
                  num_hidden_layers=32, num_attention_heads=20, max_position_embeddings=77,
                  hidden_act="gelu", projection_dim=1280)

# --smoke: the same block types at toy widths, to check the script end to end on a CPU.
SMOKE = {
    "unet": dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8),
    "sd15_blocks": dict(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=4),
    "sdxl_blocks": dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                        transformer_layers_per_block=(1, 1), attention_head_dim=(2, 4),
                        cross_attention_dim=64, projection_class_embeddings_input_dim=6 * 256 + 32),
    "vae": dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8),
    "clip": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 projection_dim=32, vocab_size=1000),
}
MODELS = {"sd15": (512, SD15_UNET, 0.18215), "sdxl": (1024, SDXL_UNET, 0.13025)}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def peak_flops(device_name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def build(model: str, device, dtype, smoke: bool):
    """Random-weight UNet, VAE and text encoder(s) of the architecture; frozen, on device."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    res, unet_cfg, scale = MODELS[model]
    unet_cfg, vae_cfg = dict(unet_cfg), dict(VAE)
    clips = [CLIP_L] if model == "sd15" else [CLIP_L, CLIP_BIG_G]
    if smoke:
        res = 64
        unet_cfg.update(SMOKE["unet"], **SMOKE[f"{model}_blocks"], sample_size=res // 2)
        if model == "sd15":
            unet_cfg["cross_attention_dim"] = 32
        vae_cfg.update(SMOKE["vae"])
        clips = [{**c, **SMOKE["clip"]} for c in clips]
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_cfg)
    vae = AutoencoderKL(**vae_cfg, scaling_factor=scale)
    encoders = [CLIPTextModel(CLIPTextConfig(**clips[0]))]
    if model == "sdxl":
        encoders.append(CLIPTextModelWithProjection(CLIPTextConfig(**clips[1])))
    for m in [unet, vae, *encoders]:
        m.requires_grad_(False)
        m.to(device, dtype)
    return res, unet, vae, encoders, DDPMScheduler(), scale


def raw_batch(model: str, b: int, res: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(b)
    batch = {"pixel_values": (torch.rand(b, 3, res, res, generator=g) * 2 - 1).to(device),
             "input_ids": torch.randint(0, vocab, (b, 77), generator=g).to(device)}
    if model == "sdxl":
        batch["input_ids_2"] = batch["input_ids"].clone()
        batch["original_size"] = torch.full((b, 2), res, dtype=torch.long, device=device)
        batch["crop_top_left"] = torch.zeros((b, 2), dtype=torch.long, device=device)
    return batch


def cached_batch(vae, encoders, batch: dict, res: int) -> dict:
    """What raylora's latent cache holds for these rows (posterior params + embeddings)."""
    from raylora.train.encode import batch_condition, vae_posterior

    with torch.no_grad():
        out = {"latent_params": vae_posterior(vae, batch["pixel_values"])}
        cond = batch_condition(encoders, batch, res)
    out["prompt_embeds"] = cond.hidden
    if cond.pooled is not None:
        out["pooled_prompt_embeds"], out["time_ids"] = cond.pooled, cond.time_ids
    return out


def fresh_accelerator(unet):
    """Accelerate keeps process-wide state: reset it so each row gets its own precision."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="bf16" if unet.dtype == torch.bfloat16 else "no",
                       cpu=unet.device.type == "cpu")


def raylora_step(model, unet, vae, encoders, scheduler, scale, res, cached: bool, compiled: bool):
    """raylora's own step: ``add_lora`` (fp32 LoRA on a bf16 base), Accelerate bf16,
    ``train_micro_step``; optionally ``compile_unet`` and cached batches (no encoders)."""
    from raylora.config import LoraSection
    from raylora.model.lora import add_lora
    from raylora.train.setup import compile_unet
    from raylora.train.step import FrozenParts, train_micro_step

    accel = fresh_accelerator(unet)
    params = add_lora(unet, LoraSection(rank=16, alpha=16, target_modules=LORA_TARGETS))
    if compiled:
        compile_unet(unet)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=unet.device.type == "cuda")
    unet_p, opt = accel.prepare(unet, opt)
    parts = FrozenParts(None if cached else vae, [] if cached else encoders, scheduler, unet.dtype,
                        "epsilon", latent_scale=scale, resolution=res)

    def step(batch):
        return train_micro_step(accel, unet_p, parts, opt, None, params, batch, 1.0)

    return step, params


def baseline_step(model, unet, vae, encoders, scheduler, scale, res):
    """The step as diffusers' train_text_to_image_lora(_sdxl).py writes it: encode with the
    VAE and text encoder(s) every step, peft LoRA cast to fp32 (``cast_training_params``),
    Accelerate bf16, no cache, no compile."""
    import torch.nn.functional as F
    from peft import LoraConfig

    accel = fresh_accelerator(unet)
    unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian",
                                target_modules=LORA_TARGETS))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.to(torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-4)
    unet_p, opt = accel.prepare(unet, opt)

    def step(batch):
        with accel.accumulate(unet_p):
            latents = vae.encode(batch["pixel_values"].to(vae.dtype)).latent_dist.sample() * scale
            noise = torch.randn_like(latents)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],),
                              device=latents.device).long()
            noisy = scheduler.add_noise(latents, noise, t)
            kwargs = {}
            if model == "sd15":
                hidden = encoders[0](batch["input_ids"], return_dict=False)[0]
            else:
                outs = [enc(batch[k], output_hidden_states=True)
                        for enc, k in zip(encoders, ("input_ids", "input_ids_2"))]
                hidden = torch.cat([o.hidden_states[-2] for o in outs], dim=-1)
                time_ids = torch.cat([batch["original_size"], batch["crop_top_left"],
                                      torch.full_like(batch["original_size"], res)], 1)
                kwargs["added_cond_kwargs"] = {"text_embeds": outs[1][0],
                                               "time_ids": time_ids.to(hidden.dtype)}
            pred = unet_p(noisy, t, hidden, return_dict=False, **kwargs)[0]
            loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
            accel.backward(loss)
            if accel.sync_gradients:
                accel.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
        return loss.detach()

    return step, params


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, batch, device, warmup: int, steps: int) -> float:
    """Seconds per step after ``warmup`` steps (compilation happens there)."""
    for _ in range(warmup):
        step(batch)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(batch)
    sync(device)
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return (time.perf_counter() - t0) / steps


def count_flops(step, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step(batch)
    return counter.get_total_flops()


def run_case(args, model, b, variant, device, dtype, peak) -> dict:
    """One row: a fresh model (LoRA and compile state do not leak between rows)."""
    res, unet, vae, encoders, scheduler, scale = build(model, device, dtype, args.smoke)
    vocab = encoders[0].config.vocab_size
    batch = raw_batch(model, b, res, vocab, device)
    cached = variant in ("cached", "cached+compile")
    compiled = variant in ("compile", "cached+compile")
    if variant == "baseline (diffusers script)":
        step, _ = baseline_step(model, unet, vae, encoders, scheduler, scale, res)
    else:
        if cached:
            batch = cached_batch(vae, encoders, batch, res)
            del vae, encoders  # a cached run's worker never loads them
            vae, encoders = None, []
        step, _ = raylora_step(model, unet, vae, encoders, scheduler, scale, res, cached, compiled)
    flops = None if compiled else count_flops(step, batch)  # eager: same model FLOPs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sec = time_steps(step, batch, device, args.warmup + (2 if compiled else 0), args.steps)
    row = {"model": model, "res": res, "batch": b, "variant": variant,
           "img/s": b / sec, "step ms": sec * 1000, "flops": flops}
    if device.type == "cuda":
        row["peak mem GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="sd15,sdxl")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--variants", default="baseline,raylora,cached,compile,cached+compile",
                    help="baseline = diffusers-script step; raylora = raylora's step, uncached, eager")
    ap.add_argument("--no-compile", action="store_true", help="drop the compiled variants")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, help="override the peak bf16 TFLOP/s")
    ap.add_argument("--smoke", action="store_true", help="toy widths, batch 1-2, 2 steps, CPU ok")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on a CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.batch_sizes, args.steps, args.warmup = "1,2", 2, 1
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = peak_flops(name, args.peak_tflops) if device.type == "cuda" else None
    names = {"baseline": "baseline (diffusers script)"}
    variants = [names.get(v, v) for v in args.variants.split(",")]
    if args.no_compile:
        variants = [v for v in variants if "compile" not in v]

    rows = []
    for model in args.models.split(","):
        for b in map(int, args.batch_sizes.split(",")):
            flops_eager = {}
            for variant in variants:
                try:
                    row = run_case(args, model, b, variant, device, dtype, peak)
                except torch.cuda.OutOfMemoryError:
                    row = {"model": model, "batch": b, "variant": variant, "img/s": "OOM"}
                except Exception as exc:  # record and go on: one failing case is a result too
                    traceback.print_exc()
                    row = {"model": model, "batch": b, "variant": variant,
                           "img/s": f"error: {type(exc).__name__}"}
                finally:
                    gc.collect()  # the failed case's tensors, before the next one allocates
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                cached = "cached" in variant
                if row.get("flops"):
                    flops_eager[cached] = row["flops"]
                if isinstance(row.get("img/s"), float):
                    row["flops"] = row.get("flops") or flops_eager.get(cached)
                    if row["flops"] and peak:
                        row["MFU %"] = 100 * row["flops"] / (row["step ms"] / 1000) / peak
                    row["TFLOP/step"] = row["flops"] / 1e12 if row["flops"] else None
                rows.append(row)
                print({k: v for k, v in row.items() if k != "flops"}, flush=True)
            base = next((r for r in rows if r["model"] == model and r["batch"] == b
                         and r["variant"].startswith("baseline") and isinstance(r["img/s"], float)), None)
            for r in rows:
                if base and r["model"] == model and r["batch"] == b and isinstance(r["img/s"], float):
                    r["x baseline"] = round(r["img/s"] / base["img/s"], 2)

    cols = ["model", "res", "batch", "variant", "img/s", "step ms", "TFLOP/step", "MFU %",
            "x baseline", "peak mem GiB"]
    record(f"GPU throughput ({name})" + (" [smoke: toy widths, not a measurement]" if args.smoke else ""),
           machine(), table(rows, cols), [
               "Random-weight SD 1.5 (512px) / SDXL (1024px) architectures, LoRA rank 16 on "
               f"to_q/to_k/to_v/to_out.0, {'bf16' if dtype == torch.bfloat16 else 'fp32'}, SDPA, "
               f"AdamW; {args.warmup} warm-up + {args.steps} timed steps per row; one batch "
               "reused (data loading is benchmark 1).",
               f"MFU against {peak / 1e12:.0f} TFLOP/s peak dense bf16." if peak else
               "MFU: no peak FLOP/s known for this device (use --peak-tflops).",
               "Targets (H100/H200): >= 40% MFU for the cached UNet step; >= 1.3x the baseline.",
               "Command: `.venv/bin/python bench/gpu_throughput.py " + " ".join(sys.argv[1:]) + "`",
           ])


if __name__ == "__main__":
    main()
