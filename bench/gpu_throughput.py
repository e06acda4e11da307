"""Benchmark 4, GPU throughput: images/s/GPU and model FLOP utilisation (MFU) of raylora's
training step on the SD 1.5 architecture at 512x512 and SDXL at 1024x1024, built from
their public config values with random weights (no download), bf16, SDPA attention, LoRA
rank 16 on the attention projections; with and without cached latents, eager and compiled
(``train.compile`` regional / full); against the same step written the way diffusers'
example script writes it (per-step VAE and text encoding, no cache, no compile), measured
in the same run.

    .venv/bin/python bench/gpu_throughput.py                      # default grid (below)
    .venv/bin/python bench/gpu_throughput.py --models sd15 --batch-sizes 32,64 \\
        --variants cached,cached+regional,cached+full
    .venv/bin/python bench/gpu_throughput.py --smoke              # toy widths, CPU ok
    .venv/bin/python bench/gpu_throughput.py --models flux,sd35m --batch-sizes 1,2 \\
        --variants cached,cached+regional                         # the DiT rows

``flux`` (Flux.1-dev) and ``sd35m`` (SD3.5-medium) are the flow-matching DiT rows at 1024 px:
they run bench/gpu_dit.py's step (cached latents + text embeddings, the family seam and the
flow-matching objective); there ``cached`` is eager and ``+regional`` / ``+full`` the compile
mode, and the other tokens do not apply.

A variant is ``+``-joined tokens: ``baseline`` (the diffusers-script step) or raylora's
step, ``cached`` (latent cache: no VAE or text encoder in the step), ``regional`` /
``full`` (``compile_denoiser`` mode; regional compiles the family's repeated blocks, as
training does; ``regional-res``: and the UNet's ResnetBlock2D too), and the
"fast step" switches ``cl`` (channels-last UNet: ``train.channels_last``), ``flash`` /
``cudnn`` / ``efficient`` / ``math`` (that SDPA kernel in every attention layer) and
``sdpa-auto`` (each layer's fastest, timed on the first batch: ``train.sdpa_backend`` as
training runs it), ``gn16`` (the UNet's GroupNorms in bf16, out of autocast's fp32:
``train.groupnorm_fp32`` false, training's default under bf16; a row without it runs
them as ``train.groupnorm_fp32: true`` does), ``mat`` (inductor
``max-autotune-no-cudagraphs``), ``ro``
(``reduce-overhead``: CUDA graphs, as ``train.cuda_graphs`` runs them). ``raylora`` alone
is the uncached eager step.
``warm``: the same row as without it, compiled in a fresh process whose empty inductor
cache is first filled from what that row stored (``train.compile_cache_uri``: a restarted
worker or a new pod); list it after that row.

Every row runs in its own process (no compile, LoRA or allocator state leaks between
rows), with a fresh inductor cache (compile seconds are what a fresh worker pays). Its
first step (compilation happens there) must finish within ``--compile-budget`` seconds,
else the row is recorded as over budget and killed, not waited on. ``compile s`` is that
first step's time minus the steady step time; ``step ms``, ``peak mem GiB`` (allocated) and
``reserved GiB`` (the allocator's reserved peak: it includes a ``+ro`` row's CUDA-graph pool,
recorded before the timed steps) are over the timed steps only.

``--profile N`` runs N more steps under torch.profiler after the timed ones and records the
device's busy share of their wall time (well under 100%: the GPU waits on the host, which
CUDA graphs would remove) and where the kernel time goes, by kind (matmul, attention,
conv, norm, inductor's fused kernels, ...) and the top kernels: what stands between a row
and the MFU target.

FLOPs are counted once per (model, batch, cached) with ``torch.utils.flop_counter`` over
one eager step (forward, backward; the encoders' forward when not cached) and divided by
the measured step time and the GPU's peak dense bf16 FLOP/s (table below, or
``--peak-tflops``). A batch size that does not fit is recorded as OOM.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # raylora

import torch  # noqa: E402

from common import machine, model_flops_counter, peak_flops, record, sync, table  # noqa: E402


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


# Variant tokens (see the module docstring).
TOKENS = {"baseline", "raylora", "cached", "regional", "regional-res", "full", "cl", "flash",
          "cudnn", "efficient", "math", "sdpa-auto", "mat", "ro", "warm", "gn16"}
SDPA_TOKENS = {"flash", "cudnn", "efficient", "math", "sdpa-auto"}
DEFAULT_BATCHES = "sd15=32,64;sdxl=4,8"
DEFAULT_VARIANTS = "baseline,raylora,cached,cached+regional,cached+regional-res,cached+full,regional"


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
    # Built on the device: SDXL's 3.5 B random parameters take far longer to initialise on
    # the host than on the GPU.
    with torch.device(device):
        unet = UNet2DConditionModel(**unet_cfg)
        vae = AutoencoderKL(**vae_cfg, scaling_factor=scale)
        encoders = [CLIPTextModel(CLIPTextConfig(**clips[0]))]
        if model == "sdxl":
            encoders.append(CLIPTextModelWithProjection(CLIPTextConfig(**clips[1])))
    for m in [unet, vae, *encoders]:
        m.requires_grad_(False)
        m.to(device, dtype)
    return res, unet, vae, encoders, DDPMScheduler(), scale


def raw_batch(model: str, b: int, res: int, vocab: int, device, seed: int | None = None) -> dict:
    """Pixels in [-1, 1] and token ids (+ SDXL's size/crop conditioning) for ``b`` images;
    drawn from ``seed`` (default: ``b``)."""
    g = torch.Generator().manual_seed(b if seed is None else seed)
    batch = {"pixel_values": (torch.rand(b, 3, res, res, generator=g) * 2 - 1).to(device),
             "input_ids": torch.randint(0, vocab, (b, 77), generator=g).to(device)}
    if model == "sdxl":
        batch["input_ids_2"] = batch["input_ids"].clone()
        batch["original_size"] = torch.full((b, 2), res, dtype=torch.long, device=device)
        batch["crop_top_left"] = torch.zeros((b, 2), dtype=torch.long, device=device)
        batch["target_size"] = batch["original_size"].clone()
    return batch


def family(model: str):
    from raylora.model import families

    return families.get("sdxl" if model == "sdxl" else "sd")


def cached_batch(model: str, vae, encoders, batch: dict) -> dict:
    """What raylora's latent cache holds for these rows (posterior params + embeddings)."""
    from raylora.train.encode import batch_condition, vae_posterior

    fam = family(model)
    with torch.no_grad():
        out = {"latent_params": vae_posterior(fam, vae, batch["pixel_values"])}
        out.update(batch_condition(fam, encoders, batch))
    return out


def fresh_accelerator(unet):
    from accelerate import Accelerator

    return Accelerator(mixed_precision="bf16" if unet.dtype == torch.bfloat16 else "no",
                       cpu=unet.device.type == "cpu")


def raylora_step(model, unet, vae, encoders, scheduler, scale, res, cached: bool,
                 cuda_graphs: bool = False):
    """raylora's own step through the family seam: ``add_lora`` (fp32 LoRA on a bf16
    base), DDPM ε objective, Accelerate bf16, ``train_micro_step``, AdamW as
    ``build_optimizer`` picks it; cached batches: no encoders. Compiled by the caller,
    after the FLOPs of the eager step are counted."""
    from raylora.config import LoraSection
    from raylora.model.lora import add_lora
    from raylora.train.objective import DDPM
    from raylora.train.optim import adamw_impl
    from raylora.train.step import FrozenParts, compute_loss, train_micro_step

    accel = fresh_accelerator(unet)
    params = add_lora(unet, LoraSection(rank=16, alpha=16, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW(params, lr=1e-4, **adamw_impl(unet.device))
    unet_p, opt = accel.prepare(unet, opt)
    parts = FrozenParts(family(model), None if cached else vae, [] if cached else encoders,
                        DDPM(scheduler, "epsilon"), unet.dtype, latent_scale=scale,
                        cuda_graphs=cuda_graphs)

    def step(batch):
        return train_micro_step(accel, unet_p, parts, opt, None, params, batch, 1.0)

    def forward(batch):  # the loss alone, for train.sdpa_backend's recording pass
        with accel.autocast():
            return compute_loss(unet, parts, batch)

    step.forward = forward
    return step


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

    return step


def count_flops(step, batch) -> int:
    """Model FLOPs of one step (common.model_flops_counter: attention backward 2x forward)."""
    with model_flops_counter() as counter:
        step(batch)
    return counter.get_total_flops()


def pin_attention(tokens: set, unet, forward, cudnn_allowed: bool) -> list[str]:
    """``train.sdpa_backend`` as training runs it (``raylora.train.attention``): the
    variant's kernel in every attention layer, or ``sdpa-auto``'s per-layer timing; no
    token: PyTorch's own choice per call. Returns the timing lines."""
    from raylora.train import attention

    chosen = sorted(tokens & SDPA_TOKENS)
    if not chosen:
        return []
    if len(chosen) > 1:
        raise SystemExit(f"one SDPA token per variant, got {chosen}")
    mode = "auto" if chosen[0] == "sdpa-auto" else chosen[0]
    calls = attention.record_calls(unet, forward)
    plan = attention.plan(calls, mode, unet.device, attention.candidates(unet.device, cudnn_allowed))
    plan.pin(unet)
    return plan.summary()


# ---- one row, in its own process --------------------------------------------------------


# Where a profiled step's device time goes, by kernel name (first match wins): what is
# left of the 40% MFU target after the matmuls is in these shares.
KERNEL_KINDS = [
    ("attn", ("flash", "fmha", "attention", "sdpa", "_attn")),
    ("mm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "addmm", "aten::mm", "aten::bmm", "splitk")),
    ("conv", ("conv", "implicit", "winograd", "fprop", "dgrad", "wgrad")),
    ("norm", ("norm", "welford")),
    ("optim", ("adam", "multi_tensor", "foreach")),
    ("copy", ("memcpy", "memset", "copy", "cat", "transpose")),
    ("fused", ("triton",)),  # inductor's fused pointwise/reduction kernels
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def is_annotation(event) -> bool:
    """A range on the device's timeline, not a kernel: inductor's ``## Call CompiledFxGraph
    <key> ##`` spans a compiled graph's kernels, so counting it counts them twice (the
    2026-11-26 22:19 H200 rows: busy 151-181 %, the spans in "other")."""
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith("## ")


def profile_steps(step, batch, device, steps: int, top: int = 8) -> dict:
    """``steps`` more steps under torch.profiler: the device's busy share of the wall time
    (low: the GPU waits on the host, what CUDA graphs remove), each kernel kind's share of
    the device time, and the ``top`` kernels. On a CPU (``--smoke``) the ops' self CPU time
    stands in for kernel time and busy is not reported."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=cuda) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(batch)
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    if cuda:  # the kernels themselves: an aten op's self device time is its kernels' again
        from torch.autograd import DeviceType

        times = [(e.key, e.self_device_time_total) for e in prof.key_averages()
                 if e.device_type != DeviceType.CPU and e.self_device_time_total > 0
                 and not is_annotation(e)]
    else:
        times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(t for _, t in times) or 1.0
    shares: dict[str, float] = {}
    for name, t in times:
        kind = kernel_kind(name)
        shares[kind] = shares.get(kind, 0.0) + 100 * t / total
    ranked = sorted(times, key=lambda x: -x[1])[:top]
    out = {"busy %": 100 * total / wall_us if cuda else None,
           "kinds %": {k: round(v, 1) for k, v in sorted(shares.items(), key=lambda x: -x[1])},
           "top": [[name[:90], round(100 * t / total, 1)] for name, t in ranked]}
    if cuda:
        try:
            out["copies"] = copy_sources(prof, total, top)
        except Exception as exc:  # a diagnostic: never the reason a measured row is lost
            out["copies"] = [[f"not read: {type(exc).__name__}: {exc}"[:90], 0.0]]
    return out


def copy_sources(prof, total: float, top: int) -> list:
    """The copy kernels' launchers (#24: 15 % of SD 1.5's kernel time, launcher unknown):
    aten's copy ops by input shapes, their kernels' share of the kernel time. A dtype cast
    (``_to_copy``) of an activation-sized tensor points at autocast around the eager ops."""
    from torch.autograd import DeviceType

    rows = [(f"{e.key} {e.input_shapes}", e.self_device_time_total)
            for e in prof.key_averages(group_by_input_shape=True)
            if e.device_type == DeviceType.CPU and e.key in ("aten::copy_", "aten::_to_copy")
            and e.self_device_time_total > 0]
    return [[name[:120], round(100 * t / total, 1)]
            for name, t in sorted(rows, key=lambda x: -x[1])[:top]]


def emit(**event) -> None:
    """A progress event for the parent (one JSON line; other output passes through)."""
    print("@@" + json.dumps(event), flush=True)


class LocalFiles:
    """The two calls CompileCache makes of raylora.storage.Storage, on local files (the GPU
    machine may lack pyarrow, which Storage needs)."""

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)


def run_case(args) -> None:
    """The row ``args.case`` (``model:batch:variant``): events built, first, row."""
    model, b, variant = args.case.split(":", 2)
    b, tokens = int(b), set(variant.split("+"))
    if tokens - TOKENS:
        raise SystemExit(f"unknown variant tokens {sorted(tokens - TOKENS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    from raylora.train.compile import UNET_RESNET_BLOCKS, compile_denoiser

    res, unet, vae, encoders, scheduler, scale = build(model, device, dtype, args.smoke)
    batch = raw_batch(model, b, res, encoders[0].config.vocab_size, device)
    if "baseline" in tokens:
        step = baseline_step(model, unet, vae, encoders, scheduler, scale, res)
    else:
        cached = "cached" in tokens
        if cached:
            batch = cached_batch(model, vae, encoders, batch)
            vae, encoders = None, []  # a cached run's worker never loads them
        if "cl" in tokens:  # as build_run does for train.channels_last
            unet.to(memory_format=torch.channels_last)
        if "gn16" in tokens:
            from raylora.train.norms import groupnorms_in_weight_dtype

            print(f"gn16: {len(groupnorms_in_weight_dtype(unet))} GroupNorms out of autocast", flush=True)
        step = raylora_step(model, unet, vae, encoders, scheduler, scale, res, cached,
                            cuda_graphs="ro" in tokens)
        for line in pin_attention(tokens, unet, lambda: step.forward(batch),
                                  family(model).cudnn_sdpa):
            print(f"attention: {line}", flush=True)
    flops = args.flops or count_flops(step, batch)
    mode = ("full" if "full" in tokens else
            "regional" if tokens & {"regional", "regional-res"} else "none")
    blocks = family(model).repeated_blocks  # what build_run passes
    if "regional-res" in tokens:
        blocks += UNET_RESNET_BLOCKS
    kwargs = ({"mode": "max-autotune-no-cudagraphs"} if "mat" in tokens else
              {"mode": "reduce-overhead"} if "ro" in tokens else {})
    compile_denoiser(unet, mode, blocks, **kwargs)
    # train.compile_cache_uri: the cold row stores its compiled code, its +warm row loads it.
    from raylora.train.compile import CompileCache

    stored = None
    if mode != "none" and args.artifacts:
        cold = "+".join(sorted(tokens - {"warm"}))
        stored = CompileCache(LocalFiles(), os.path.join(args.artifacts, f"{model}-{b}-{cold}.bin"))
    emit(event="built", flops=flops)

    t0 = time.perf_counter()
    # A warm row's compile seconds include reading and unpacking the stored code.
    if "warm" in tokens and not (stored is not None and stored.load()):
        raise RuntimeError("+warm: nothing stored by the row without it (list that one first)")
    step(batch)
    sync(device)
    first = time.perf_counter() - t0
    emit(event="first", **{"first step s": first})
    if stored is not None and "warm" not in tokens:
        stored.save()
    for _ in range(args.warmup - 1):
        step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step(batch)
    sync(device)
    sec = (time.perf_counter() - t0) / args.steps
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    from torch._dynamo.utils import counters

    row = {"res": res, "img/s": b / sec, "step ms": sec * 1000, "flops": flops,
           "graphs": counters["stats"].get("unique_graphs", 0),
           "breaks": sum(counters["graph_break"].values())}
    if mode != "none":
        row["compile s"] = max(first - sec, 0.0)
    if device.type == "cuda":
        row["peak mem GiB"] = torch.cuda.max_memory_allocated() / 2**30
        # CUDA graphs' private pool is allocated while recording (before the reset above)
        # and replays allocate nothing, so the allocated peak leaves it out; reserved counts it.
        row["reserved GiB"] = torch.cuda.max_memory_reserved() / 2**30
        # The caching allocator freeing everything and retrying cudaMalloc: memory pressure
        # that costs time (a suspect for a compiled step slower than the eager one).
        row["alloc retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    if args.profile:
        row.update(profile_steps(step, batch, device, args.profile))
    emit(event="row", row=row)


def case_main(args) -> None:
    try:
        run_case(args)
    except torch.cuda.OutOfMemoryError:
        traceback.print_exc()
        emit(event="error", what="OOM")
        sys.exit(1)
    except Exception as exc:  # the parent records it: one failing case is a result too
        traceback.print_exc()
        emit(event="error", what=f"error: {type(exc).__name__}")
        sys.exit(1)


# ---- the grid, one process per row ------------------------------------------------------


def run_row(args, model: str, b: int, variant: str, flops: int | None, deadline: float) -> dict:
    """Run one row in a child process, with a time limit per phase: building (model, batch,
    FLOP count), the first step (the compile budget) and the timed steps."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", f"{model}:{b}:{variant}",
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.smoke:
        cmd.append("--smoke")
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    if flops:
        cmd += ["--flops", str(flops)]
    if args.artifacts:
        cmd += ["--artifacts", args.artifacts]
    cache = tempfile.mkdtemp(prefix="inductor-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not args.shared_compile_cache:
        env.update(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    row = {"model": model, "batch": b, "variant": variant}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    phases = [("built", args.build_timeout), ("first", args.compile_budget), ("row", args.steps_timeout)]
    phase, limit = phases.pop(0)
    until = min(time.monotonic() + limit, deadline)
    try:
        while True:
            try:
                line = lines.get(timeout=max(until - time.monotonic(), 0))
            except queue.Empty:
                over = "compile" if phase == "first" else phase
                if until >= deadline:
                    row["img/s"] = f"stopped: --time-limit ({over})"
                elif phase == "first":
                    row["img/s"] = f"compile > {args.compile_budget:.0f} s"
                else:
                    row["img/s"] = f"timeout ({over} > {limit:.0f} s)"
                break
            if line is None:
                row.setdefault("img/s", f"error: exit {proc.wait()}")
                break
            if not line.startswith("@@"):
                sys.stdout.write(f"  [{variant}] {line}")
                continue
            event = json.loads(line[2:])
            if event["event"] == "error":
                row["img/s"] = event["what"]
            elif event["event"] == "row":
                row.update(event["row"])
            elif event["event"] == phase:
                row.update({k: v for k, v in event.items() if k != "event"})
                if phases:
                    phase, limit = phases.pop(0)
                    until = min(time.monotonic() + limit, deadline)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(cache, ignore_errors=True)
    return row


def parse_batches(spec: str, models: list[str]) -> dict[str, list[int]]:
    """``32,64`` (every model) or ``sd15=32,64;sdxl=4,8``."""
    if "=" not in spec:
        return {m: [int(x) for x in spec.split(",")] for m in models}
    out = {}
    for part in spec.split(";"):
        m, sizes = part.split("=")
        out[m.strip()] = [int(x) for x in sizes.split(",")]
    return {m: out.get(m, []) for m in models}


DIT_MODELS = ("flux", "sd35m")


def run_dit_rows(args, models: list[str], deadline: float) -> None:
    """The Flux.1-dev / SD3.5-medium rows: bench/gpu_dit.py with this grid's batch sizes,
    compile modes (from the variants) and step counts, within ``--time-limit`` (the
    ``deadline``) and to ``--jsonl`` as the other rows; it records its own table."""
    import gpu_dit

    batches = parse_batches(args.batch_sizes if args.batch_sizes != DEFAULT_BATCHES else "1,2", models)
    modes = []
    for v in args.variants.split(","):
        tokens = set(v.split("+"))
        mode = "full" if "full" in tokens else "regional" if tokens & {"regional", "regional-res"} else "none"
        if mode not in modes and not (args.no_compile and mode != "none"):
            modes.append(mode)
    for model in models:
        if not batches[model]:
            continue
        argv = ["--models", model, "--batch-sizes", ",".join(map(str, batches[model])),
                "--modes", ",".join(modes), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--sdpa", "no-cudnn"]
        if args.peak_tflops:
            argv += ["--peak-tflops", str(args.peak_tflops)]
        if args.smoke:
            argv.append("--smoke")
        if args.time_limit:
            argv += ["--time-limit", f"{max(0.0, deadline - time.monotonic()):.0f}"]
        if args.jsonl:
            argv += ["--jsonl", args.jsonl]
        gpu_dit.main(argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="sd15,sdxl")
    ap.add_argument("--batch-sizes", default=DEFAULT_BATCHES,
                    help="'32,64' for every model, or per model: 'sd15=32,64;sdxl=4,8'")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="comma-separated; each a '+'-joined token set (module docstring)")
    ap.add_argument("--no-compile", action="store_true", help="drop the compiled variants")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing, the first included")
    ap.add_argument("--compile-budget", type=float, default=90.0,
                    help="seconds the first (compiling) step may take before the row is given up")
    ap.add_argument("--build-timeout", type=float, default=300.0)
    ap.add_argument("--steps-timeout", type=float, default=300.0)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole grid: rows not finished by then are recorded as stopped")
    ap.add_argument("--shared-compile-cache", action="store_true",
                    help="let rows reuse each other's inductor/triton cache (warm compile times)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, N steps under torch.profiler: the GPU's busy "
                         "share and where its time goes (per kernel kind, top kernels)")
    ap.add_argument("--jsonl", help="also append each row to this file as it finishes")
    ap.add_argument("--peak-tflops", type=float, help="override the peak bf16 TFLOP/s")
    ap.add_argument("--smoke", action="store_true", help="toy widths, batch 2, 2 steps, CPU ok")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # model:batch:variant, in a child process
    ap.add_argument("--flops", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--artifacts", help=argparse.SUPPRESS)  # the grid's compile-cache folder
    args = ap.parse_args()
    if args.smoke and "--steps" not in sys.argv:
        args.steps, args.warmup = 2, 1
    if args.smoke and "--compile-budget" not in sys.argv:
        args.compile_budget = 900.0  # a 2-core CPU compiles even the toy UNet for minutes
    if args.case:
        return case_main(args)
    models = args.models.split(",")
    dit = [m for m in models if m in DIT_MODELS]
    deadline = time.monotonic() + (args.time_limit or 1e9)  # the DiT rows' time counts too
    if dit:
        run_dit_rows(args, dit, deadline)
        models = [m for m in models if m not in dit]
        if not models:
            return

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on a CPU")
    if args.smoke and args.batch_sizes == DEFAULT_BATCHES:
        args.batch_sizes = "2"
    batches = parse_batches(args.batch_sizes, models)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_flops(name, args.peak_tflops) if cuda else None
    names = {"baseline": "baseline (diffusers script)"}
    variants = args.variants.split(",")
    if args.no_compile:
        variants = [v for v in variants if not set(v.split("+")) & {"regional", "regional-res", "full"}]
    for v in variants:
        if set(v.split("+")) - TOKENS:
            raise SystemExit(f"--variants: unknown tokens in {v!r}: {sorted(set(v.split('+')) - TOKENS)}")
    args.artifacts = tempfile.mkdtemp(prefix="compile-artifacts-")  # cold rows store, +warm load

    rows = []
    for model in models:
        for b in batches[model]:
            flops_by_cached = {}
            for variant in variants:
                cached = "cached" in variant.split("+")
                t0 = time.monotonic()
                if t0 >= deadline:
                    row = {"model": model, "batch": b, "variant": variant,
                           "img/s": "not run: --time-limit"}
                else:
                    # Compiled rows take the eager rows' FLOPs (same model FLOPs).
                    row = run_row(args, model, b, variant, flops_by_cached.get(cached), deadline)
                row["variant"] = names.get(variant, variant)
                if row.get("flops"):
                    flops_by_cached.setdefault(cached, row["flops"])
                if isinstance(row.get("img/s"), float):
                    if row["flops"] and peak:
                        row["MFU %"] = 100 * row["flops"] / (row["step ms"] / 1000) / peak
                    row["TFLOP/step"] = row["flops"] / 1e12 if row["flops"] else None
                row["wall s"] = time.monotonic() - t0
                rows.append(row)
                shown = {k: v for k, v in row.items() if k not in ("flops", "top", "copies")}
                print(shown, flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(shown) + "\n")
            base = next((r for r in rows if r["model"] == model and r["batch"] == b
                         and r["variant"].startswith("baseline") and isinstance(r["img/s"], float)), None)
            for r in rows:
                if base and r["model"] == model and r["batch"] == b and isinstance(r["img/s"], float):
                    r["x baseline"] = round(r["img/s"] / base["img/s"], 2)

    cols = ["model", "res", "batch", "variant", "img/s", "step ms", "TFLOP/step", "MFU %",
            "x baseline", "compile s", "peak mem GiB", "reserved GiB", "alloc retries", "graphs",
            "breaks"]
    if args.profile:
        cols.append("busy %")
    dtype = "bf16" if cuda else "fp32"
    record(f"GPU throughput ({name})" + (" [smoke: toy widths, not a measurement]" if args.smoke else ""),
           machine(), table(rows, cols), [
               "Random-weight SD 1.5 (512px) / SDXL (1024px) architectures, LoRA rank 16 on "
               f"to_q/to_k/to_v/to_out.0, {dtype}, SDPA, AdamW (fused on CUDA); "
               f"{args.warmup} warm-up + {args.steps} timed steps per row, each row in its own "
               "process; one batch reused (data loading is benchmark 1).",
               "compile s: first step minus steady step, " + (
                   "inductor/triton caches shared between rows (warm)" if args.shared_compile_cache
                   else "fresh inductor/triton cache per row (cold)") +
               f"; budget {args.compile_budget:.0f} s. peak mem: allocated, over the timed steps "
               "(a +ro row's CUDA-graph pool is in reserved, not there). graphs/"
               "breaks: dynamo's unique graphs and graph breaks in the row's process.",
               f"MFU against {peak / 1e12:.0f} TFLOP/s peak dense bf16." if peak else
               "MFU: no peak FLOP/s known for this device (use --peak-tflops).",
               "Targets (H100/H200): SD 1.5 cached+compiled >= 40% MFU; SDXL compiled >= eager "
               "and >= 30% MFU; compile <= 90 s per model; >= 1.3x the baseline.",
               *([f"Code: {os.environ['RAYLORA_REV']}"] if os.environ.get("RAYLORA_REV") else []),
               "Command: `.venv/bin/python bench/gpu_throughput.py " + " ".join(sys.argv[1:]) + "`",
               *profile_notes(rows, args.profile),
           ])


def profile_notes(rows: list[dict], steps: int) -> list[str]:
    """``--profile``: per row, the device time by kernel kind and the top kernels."""
    if not steps:
        return []
    out = [f"Profile (--profile {steps}): busy % = the device's kernel time over the wall time "
           "of the profiled steps; kinds and top kernels as shares of the kernel time "
           "(bench/gpu_throughput.py KERNEL_KINDS)."]
    for r in rows:
        if "kinds %" in r:
            kinds = ", ".join(f"{k} {v}" for k, v in r["kinds %"].items())
            top = "; ".join(f"`{n}` {v}" for n, v in r["top"][:5])
            copies = "; ".join(f"`{n}` {v}" for n, v in r.get("copies", [])[:5])
            out.append(f"{r['model']} b{r['batch']} {r['variant']}: {kinds}. Top: {top}"
                       + (f". Copies by launcher: {copies}" if copies else ""))
    return out


if __name__ == "__main__":
    main()
