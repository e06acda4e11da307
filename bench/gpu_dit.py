"""Benchmark 5, flow-matching DiTs on one GPU: images/s and MFU of raylora's own training
step (``raylora.train.step.train_micro_step`` through the model-family seam and the
flow-matching objective) on the Flux.1-dev and SD3.5-medium transformer architectures, built
from their public config values with random weights (no download), bf16 base, fp32 LoRA
rank 16 on the family's default targets, cached latents and text embeddings (what
``data.cache=latents`` feeds a worker), fused AdamW; eager and ``train.compile=regional``.

    python bench/gpu_dit.py                       # flux + sd35m at 1024 px, batch 1 and 2
    python bench/gpu_dit.py --models flux --batch-sizes 1 --modes none
    python bench/gpu_dit.py --models zimage       # Z-Image-Turbo's architecture (not in the default)
    python bench/gpu_dit.py --models klein4b      # Flux.2 [klein] 4B's (not in the default)
    python bench/gpu_dit.py --models wan14b       # Wan 2.1 T2V-14B's, one frame (not default)
    python bench/gpu_dit.py --models chroma,qwenimage,qwenedit,qwenedit2
                                                  # Chroma1-HD's; Qwen-Image's 20B, text to
                                                  # image and editing an input (not default)
    python bench/gpu_dit.py --models flux2dev --batch-sizes 1 --gradient-checkpointing
                                                  # Flux.2 [dev]'s 32B (not default)
    python bench/gpu_dit.py --models zimage --modes regional --vary-captions 1,4
                                                  # one caption length and four, side by side
    python bench/gpu_dit.py --smoke               # toy widths on a CPU, checks the script

Model FLOPs are counted once per (model, batch, caption lengths) with
``torch.utils.flop_counter`` over one eager step (a compiled-only case takes that step
before compiling) and divided by the measured step time and the GPU's peak dense bf16
FLOP/s. Compile time is the first compiled step minus a steady step; it is reported on its
own.

``--time-limit S`` bounds the whole grid (a device call has a limit of its own): a case is
started only while time is left, runs at most until then, and the cases not run are
recorded as such; ``--jsonl`` gets each row as it finishes, so a call killed even so keeps
them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import machine, model_flops_counter, peak_flops, record, sync, table  # noqa: E402

# Seconds of --time-limit kept back for what follows the last case: killing a stopped case's
# process group and recording the table.
RECORD_S = 5.0
clock = time.monotonic  # the grid's clock (a test moves it on)

# black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# stabilityai/stable-diffusion-3.5-medium transformer/config.json
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                   pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                   qk_norm="rms_norm")
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (ZImageTransformer2DModel's defaults)
ZIMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840,
                    n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560,
                    axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
# black-forest-labs/FLUX.2-klein-4B transformer/config.json (as published in several public
# configs and diffusers' Flux.2 conversion script's klein-4b entry): 5 double + 20 single blocks
KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                rope_theta=2000, guidance_embeds=False)
# black-forest-labs/FLUX.2-dev transformer/config.json (diffusers' Flux.2 conversion
# script's flux2-dev entry): 8 double + 48 single blocks of 48 heads × 128, Mistral's 3 ×
# 5120-wide hidden states; 32B parameters (64 GB in bf16), the guidance embedding on
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48,
                 attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                 timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                 rope_theta=2000, guidance_embeds=True)
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (WanTransformer3DModel's defaults):
# 40 blocks of 40 heads × 128, UMT5-XXL's 4096-wide text
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
               in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
               num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads")
# lodestones/Chroma1-HD transformer/config.json: ChromaTransformer2DModel's defaults (Flux.1's
# 19 double + 38 single blocks, 24 heads × 128, T5's 4096; the approximator 64 → 5120, 5 layers)
CHROMA_HD = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
                 approximator_hidden_dim=5120, approximator_layers=5)
# Qwen/Qwen-Image transformer/config.json (QwenImageTransformer2DModel's defaults; the
# Edit-2509 checkpoint has the same): 60 blocks of 24 heads × 128, Qwen2.5-VL's 3584
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                  guidance_embeds=False, axes_dims_rope=(16, 56, 56))
QWEN_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0,
                  "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                  "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                  "time_shift_type": "exponential"}
# Alpha-VLLM/Lumina-Image-2.0's transformer: Lumina2Transformer2DModel's defaults (26 joint
# layers + 2 noise and 2 context refiners of 2304 = 24 heads × 96, 8 key/value heads) over
# Gemma 2 2B's 2304-wide hidden states
LUMINA2 = dict(cap_feat_dim=2304)
# Efficient-Large-Model/Sana_1600M_1024px_diffusers' transformer: SanaTransformer2DModel's
# defaults (20 blocks of 70 heads × 32 linear self-attention, 20 cross-attention heads of 112,
# Gemma 2 2B's 2304-wide caption, 32 DC-AE channels at patch 1), written from memory of its
# config.json, not checked against it here
SANA_1600M = dict()
# (family, transformer class, config, latent channels, text tokens, pooled width, the
#  pipelines' scheduler config for the shift). Z-Image takes each caption unpadded: 256
#  tokens stand for a long caption in its chat template.
MODELS_FLUX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                         "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                         "base_image_seq_len": 256, "max_image_seq_len": 4096}
MODELS = {
    "flux": ("flux", "FluxTransformer2DModel", FLUX_DEV, 16, 512, 768, MODELS_FLUX_SCHEDULER),
    "sd35m": ("sd3", "SD3Transformer2DModel", SD35_MEDIUM, 16, 77 + 256, 2048,
              {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}),
    "zimage": ("zimage", "ZImageTransformer2DModel", ZIMAGE_TURBO, 16, 256, None,
               {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}),
    # Klein's latents are the VAE's 32 channels patchified 2×2 (128 per 16 px); the text is
    # always the pipeline's 512 tokens, padding included.
    "klein4b": ("flux2klein", "Flux2Transformer2DModel", KLEIN_4B, 128, 512, None,
                {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                 "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                 "base_image_seq_len": 256, "max_image_seq_len": 4096}),
    # Flux.2 [dev]: Klein's latents, text and scheduler
    "flux2dev": ("flux2", "Flux2Transformer2DModel", FLUX2_DEV, 128, 512, None,
                 {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                  "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                  "base_image_seq_len": 256, "max_image_seq_len": 4096}),
    # Wan's text is always the pipeline's 512 positions (zeros past the caption); its
    # scheduler is UniPC over flow sigmas with a static flow_shift.
    "wan14b": ("wan", "WanTransformer3DModel", WAN_14B, 16, 512, None,
               {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                "use_flow_sigmas": True, "flow_shift": 3.0}),
    # Lumina-Image 2.0: the pipeline's 256 Gemma tokens, its system prompt's included (the
    # shift is the tiny model's static 6.0; a step's cost does not depend on it)
    "lumina2": ("lumina2", "Lumina2Transformer2DModel", LUMINA2, 16, 256, None,
                {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 6.0}),
    # Sana: 300 caption tokens after the instruction (which the conditioning drops), its
    # DPM-Solver's flow_shift; DC-AE latents, 32 px each
    "sana": ("sana", "SanaTransformer2DModel", SANA_1600M, 32, 300, None,
             {"_class_name": "DPMSolverMultistepScheduler", "prediction_type": "flow_prediction",
              "use_flow_sigmas": True, "flow_shift": 3.0}),
    # Chroma: T5's 512 positions, all kept (the mask shows the caption and one pad)
    "chroma": ("chroma", "ChromaTransformer2DModel", CHROMA_HD, 16, 512, None, MODELS_FLUX_SCHEDULER),
    # Qwen-Image: a long caption's 256 tokens after the template; the edit model also the
    # input image's vision tokens (384² px: 196) in its caption, and its latents
    # (REFERENCE) after the noisy tokens: twice the image tokens
    "qwenimage": ("qwenimage", "QwenImageTransformer2DModel", QWEN_IMAGE, 16, 256, None, QWEN_SCHEDULER),
    "qwenedit": ("qwenimageedit", "QwenImageTransformer2DModel", QWEN_IMAGE, 16, 256 + 196 + 8, None,
                 QWEN_SCHEDULER),
    # two inputs a sample (data.control_inputs: 2): "Picture 1", "Picture 2" in the caption,
    # three times the image tokens
    "qwenedit2": ("qwenimageedit", "QwenImageTransformer2DModel", QWEN_IMAGE, 16, 256 + 2 * (196 + 8),
                  None, QWEN_SCHEDULER),
}
# edit models: input images a sample, their latents beside each target's
REFERENCE = {"qwenedit": 1, "qwenedit2": 2}
PIXELS_PER_LATENT = {"klein4b": 16, "flux2dev": 16, "sana": 32}  # the others: 8
SMOKE = {"flux": dict(num_layers=1, num_single_layers=1, attention_head_dim=16,
                      num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                      axes_dims_rope=(4, 6, 6)),
         "sd35m": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                       joint_attention_dim=32, caption_projection_dim=32,
                       pooled_projection_dim=16, dual_attention_layers=(0,), pos_embed_max_size=64),
         "zimage": dict(dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                        cap_feat_dim=32, axes_dims=[4, 6, 6]),
         "sana": dict(num_attention_heads=2, attention_head_dim=16, num_layers=1,
                      num_cross_attention_heads=2, cross_attention_head_dim=16,
                      cross_attention_dim=32, caption_channels=32),
         "lumina2": dict(hidden_size=32, num_layers=1, num_refiner_layers=1, num_attention_heads=2,
                         num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), cap_feat_dim=32),
         "klein4b": dict(num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=2, joint_attention_dim=48,
                         timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
         "flux2dev": dict(num_layers=1, num_single_layers=1, attention_head_dim=16,
                          num_attention_heads=2, joint_attention_dim=48,
                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
         "wan14b": dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32,
                        ffn_dim=64, num_layers=2),
         "chroma": dict(num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                        approximator_hidden_dim=32, approximator_layers=1)}
SMOKE["qwenimage"] = SMOKE["qwenedit"] = SMOKE["qwenedit2"] = dict(num_layers=1, attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def build(model: str, device, dtype, smoke: bool):
    """Random-weight transformer of the architecture, frozen, on ``device`` in ``dtype``
    (built there directly: a 12B model is never materialised in fp32 on the host)."""
    import diffusers

    from raylora.memory import default_dtype

    family, cls, cfg, *_ = MODELS[model]
    cfg = {**cfg, **(SMOKE[model] if smoke else {})}
    torch.manual_seed(0)
    with default_dtype(dtype), torch.device(device):
        net = getattr(diffusers, cls)(**cfg)
    net.requires_grad_(False)
    return net


def cached_batch(model: str, b: int, res: int, net, device) -> dict:
    """What the latent cache holds for ``b`` images: posterior params and embeddings."""
    from raylora.config import control_key
    from raylora.model import families

    family, _, cfg, ch, tokens, pooled, _ = MODELS[model]
    keys = families.get(family).cond_keys()
    g = torch.Generator().manual_seed(b)
    h = res // PIXELS_PER_LATENT.get(model, 8)
    width = next(getattr(net.config, k) for k in ("joint_attention_dim", "text_dim", "caption_channels",
                                                  "cap_feat_dim") if getattr(net.config, k, None))
    batch = {
        "latent_params": torch.randn(b, 2 * ch, h, h, generator=g).to(device),
        "prompt_embeds": torch.randn(b, tokens, width, generator=g).to(device),
    }
    if "pooled_prompt_embeds" in keys:
        batch["pooled_prompt_embeds"] = torch.randn(b, net.config.pooled_projection_dim, generator=g).to(device)
    if "prompt_embeds_mask" in keys:  # every caption fills its tokens
        batch["prompt_embeds_mask"] = torch.ones(b, tokens, dtype=torch.long, device=device)
    for k in range(REFERENCE.get(model, 0)):  # each input image's posterior, at the target's size
        batch[control_key("control_params", k)] = torch.randn(b, 2 * ch, h, h, generator=g).to(device)
    return batch


def raylora_step(model: str, net, mode: str, rank: int, checkpointing: bool = False):
    """raylora's step: family default LoRA targets (fp32), flow-matching objective from the
    pipeline's scheduler config, Accelerate bf16 autocast, fused AdamW. Returns (step, LoRA
    params, compile): ``compile()`` compiles the net in place in ``mode`` (regional: the
    family's repeated blocks), so that a step can be taken eagerly before it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from raylora.config import LoraSection
    from raylora.model import families
    from raylora.model.lora import add_lora
    from raylora.train.compile import compile_denoiser, compile_options
    from raylora.train.objective import FlowMatching, flow_shift_from_scheduler
    from raylora.train.step import FrozenParts, train_micro_step

    fam = families.get(MODELS[model][0])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    cuda = next(net.parameters()).device.type == "cuda"
    accel = Accelerator(mixed_precision="bf16" if cuda else "no", cpu=not cuda)
    params = add_lora(net, LoraSection(rank=rank, alpha=rank), fam.default_lora_targets(net))
    if checkpointing:  # train.gradient_checkpointing, as setup enables it: before the compile
        fam.checkpoint_blocks(net)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    net_p, opt = accel.prepare(net, opt)
    shift, dynamic = flow_shift_from_scheduler(MODELS[model][6])
    parts = FrozenParts(fam, None, [], FlowMatching("logit_normal", shift=shift, dynamic=dynamic,
                                                    seq_len=fam.image_seq_len),
                        next(net.parameters()).dtype, guidance=1.0,
                        control_images=model in REFERENCE)

    def step(batch):
        return train_micro_step(accel, net_p, parts, opt, None, params, batch, 1.0)

    def compile():
        # As training compiles it (automatic dynamic shapes for a language-model caption:
        # the first length compiles static, as in training). In place, so the prepared
        # model's blocks run compiled from the next step on.
        compile_denoiser(net, mode, fam.repeated_blocks, **compile_options(fam))

    return step, sum(p.numel() for p in params), compile


def run_case(args, model, b, mode, lengths, device, dtype) -> dict:
    """One row: ``lengths`` caption lengths (caption_lengths) in ``mode``. Its FLOPs are
    ``args.flops`` (the grid's, from an earlier case of the same shapes) or counted over
    eager steps before the compile: a compiled-only grid has its MFU too."""
    net = build(model, device, dtype, args.smoke)
    n_base = sum(p.numel() for p in net.parameters())
    batch = cached_batch(model, b, args.resolution, net, device)
    step, n_lora, compile = raylora_step(model, net, mode, args.rank, args.gradient_checkpointing)
    batches = caption_lengths(batch, lengths)
    flops = args.flops
    if not flops:  # per step: the mean over the caption lengths the steps cycle through
        counted = []
        for bt in batches:
            with model_flops_counter() as counter:  # attention backward 2x forward
                step(bt)
            counted.append(counter.get_total_flops())
        flops = sum(counted) / len(counted)
    compile()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    step(batch)  # the compile happens here
    sync(device)
    first = time.perf_counter() - t0
    for bt in batches[1:]:  # the second length compiles once more (dynamic shapes), the rest not
        step(bt)
    sync(device)
    later = time.perf_counter() - t0 - first
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):  # every length as often as the others
        loss = step(batches[i % len(batches)])
    sync(device)
    sec = (time.perf_counter() - t0) / args.steps
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    row = {"model": case_label(model, len(batches), args.gradient_checkpointing),
           "res": args.resolution, "batch": b, "compile": mode,
           "img/s": b / sec, "step ms": sec * 1000, "flops": flops,
           "compile s": max(first + later - len(batches) * sec, 0.0) if mode != "none" else None,
           "base params B": n_base / 1e9, "LoRA params M": n_lora / 1e6}
    if device.type == "cuda":
        row["peak mem GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def case_label(model: str, lengths: int, checkpointing: bool) -> str:
    return (model + (" +ckpt" if checkpointing else "")
            + (f" {lengths} caption lengths" if lengths > 1 else ""))


def case_in_child(args, argv: list[str], model: str, b: int, lengths: int, mode: str,
                  flops: float | None, timeout: float, why: str) -> dict:
    """One case in a fresh process: a CUDA fault (an illegal memory access poisons the
    process's CUDA context) or an OOM is that row's result, not every later row's. The
    child's output passes through as it comes, its traceback included. Past ``timeout``
    seconds its process group (inductor's compile workers too) is killed and the row says
    ``why`` it stopped."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--case", f"{model}:{b}:{mode}:{lengths}"]
    if flops:
        cmd += ["--flops", repr(float(flops))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    rows = []

    def pump():
        for line in proc.stdout:
            if line.startswith("@@"):
                rows.append(json.loads(line[2:]))
            else:
                print(f"  [{model} b{b} {mode}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:  # on a timeout, and on SIGTERM (stop_on_sigterm) while the case runs
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    if rows:
        return rows[-1]
    base = {"model": case_label(model, lengths, args.gradient_checkpointing),
            "res": args.resolution, "batch": b, "compile": mode}
    return {**base, "img/s": f"stopped: {why}" if code is None else f"error: exit {code}"}


def caption_lengths(batch: dict, n: int) -> list[dict]:
    """``batch`` and ``n - 1`` more, each with its captions 40 tokens shorter than the one
    before (more than Z-Image's own padding to a multiple of 32; Family.cuts_captions: a language-model caption is as long as its batch's
    longest, so training meets a new length nearly every batch); ``[batch]`` for a family
    of one caption length or n <= 1."""
    if n <= 1 or "prompt_embeds_mask" not in batch:
        return [batch]
    tokens = batch["prompt_embeds"].shape[1]
    if tokens <= 40 * (n - 1):
        raise SystemExit(f"--vary-captions {n}: the captions have {tokens} tokens, too few")
    return [{k: v[:, : tokens - 40 * i] if k in ("prompt_embeds", "prompt_embeds_mask") else v
             for k, v in batch.items()} for i in range(n)]


def one_case(args, model: str, b: int, mode: str, lengths: int, device, dtype) -> dict:
    base = {"model": case_label(model, lengths, args.gradient_checkpointing),
            "res": args.resolution, "batch": b, "compile": mode}
    try:
        return run_case(args, model, b, mode, lengths, device, dtype)
    except torch.cuda.OutOfMemoryError:
        return {**base, "img/s": "OOM"}
    except Exception as exc:  # one failing case is a result too
        traceback.print_exc()
        msg = " ".join(str(exc).split()).replace("|", "/")[:80]  # a table cell
        return {**base, "img/s": f"error: {type(exc).__name__}: {msg}"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux,sd35m")
    ap.add_argument("--batch-sizes", default="1,2")
    ap.add_argument("--modes", default="none,regional", help="train.compile modes to measure")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, help="the peak bf16 TFLOP/s an MFU divides by "
                    "(default: the GPU's, from bench/common.py; on a CPU, none unless given)")
    ap.add_argument("--smoke", action="store_true", help="toy widths, 64 px, CPU ok")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="train.gradient_checkpointing (a 32B transformer's activations at 1024 px "
                         "do not fit beside its 64 GB of weights otherwise)")
    ap.add_argument("--sdpa", default="family", choices=["family", "default", "no-cudnn", "flash"],
                    help="SDPA backends allowed: the family's, as training runs them (cuDNN off "
                         "for the DiTs: it crashed the Flux step), PyTorch's default, no cuDNN, "
                         "flash only")
    ap.add_argument("--vary-captions", default="1", metavar="N[,N...]",
                    help="language-model caption families (qwenimage, zimage, lumina2, sana): "
                         "the steps cycle through N caption lengths, 40 tokens apart, as "
                         "training's batches differ (compile: the dynamic-shape kernels after "
                         "the second length); compile s then covers both compiles. Several: a "
                         "row each (1,4: one length beside four, in the same run)")
    ap.add_argument("--case-timeout", type=float, default=600.0,
                    help="seconds one case's process may run (build, compile, steps)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole grid: no case starts later, one running then is "
                         "stopped, and the table is recorded with the rest marked not run")
    ap.add_argument("--jsonl", help="also append each row to this file as it finishes")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # model:batch:mode:lengths, in a child
    ap.add_argument("--flops", type=float, help=argparse.SUPPRESS)  # the case's, if known
    return ap


def check_grid(args) -> list[tuple[str, int, int, str]]:
    """(model, batch, caption lengths, mode) of every case, in order; a bad value is refused
    here, before any case is started."""
    problems = []
    models = args.models.split(",")
    problems += [f"--models: unknown {m!r} (known: {', '.join(MODELS)})" for m in models
                 if m not in MODELS]
    modes = args.modes.split(",")
    problems += [f"--modes: unknown {m!r} (none, regional, full)" for m in modes
                 if m not in ("none", "regional", "full")]
    try:
        batches = [int(x) for x in args.batch_sizes.split(",")]
        lengths = [int(x) for x in args.vary_captions.split(",")]
    except ValueError as exc:
        raise SystemExit(f"--batch-sizes / --vary-captions: comma-separated integers ({exc})")
    problems += [f"--vary-captions: {n} (at least 1)" for n in lengths if n < 1]
    if args.time_limit is not None and args.time_limit <= RECORD_S:
        problems.append(f"--time-limit {args.time_limit:g}: more than {RECORD_S:g} s (kept to record)")
    if problems:
        raise SystemExit("gpu_dit.py: " + "; ".join(problems))
    from raylora.model import families

    # a family whose captions are padded to one length has one row per batch and mode
    # (caption_lengths would repeat the same case)
    varies = {m: "prompt_embeds_mask" in families.get(MODELS[m][0]).cond_keys() for m in models}
    return [(m, b, n, mode) for m in models for b in batches for n in (lengths if varies[m] else [1])
            for mode in modes]


class Stopped(Exception):
    """SIGTERM (a device call being stopped): record what finished, then exit."""


def stop_on_sigterm(*_):
    raise Stopped


def main(argv: list[str] | None = None) -> None:
    """``argv``: bench/gpu_throughput.py hands its ``--models flux,sd35m`` rows here."""
    args = parser().parse_args(argv)
    child_argv = list(sys.argv[1:] if argv is None else argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on a CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.resolution, args.steps, args.warmup, args.batch_sizes = 64, 2, 1, "1"
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = peak_flops(name, args.peak_tflops) if device.type == "cuda" or args.peak_tflops else None
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.sdpa in ("no-cudnn", "flash"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.sdpa == "flash":
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
    if args.case:
        model, b, mode, lengths = args.case.split(":")
        if args.sdpa == "family":
            from raylora.model import families
            from raylora.train.attention import use_family_backends

            use_family_backends(families.get(MODELS[model][0]))
        row = one_case(args, model, int(b), mode, int(lengths), device, dtype)
        print("@@" + json.dumps(row), flush=True)
        return

    cases = check_grid(args)
    deadline = clock() + (args.time_limit if args.time_limit is not None else float("inf"))
    flops_of = {}  # (model, batch, lengths): the same model FLOPs, eager or compiled
    rows = []
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        for model, b, lengths, mode in cases:
            left = deadline - clock() - RECORD_S
            if left <= 0:
                row = {"model": case_label(model, lengths, args.gradient_checkpointing),
                       "res": args.resolution, "batch": b, "compile": mode,
                       "img/s": "not run: --time-limit"}
            else:
                # each case capped at the time left: the ones before it keep their rows
                why = ("--time-limit" if left < args.case_timeout
                       else f"--case-timeout {args.case_timeout:.0f} s")
                row = case_in_child(args, child_argv, model, b, lengths, mode,
                                    flops_of.get((model, b, lengths)),
                                    timeout=min(left, args.case_timeout), why=why)
            flops = row.get("flops") or flops_of.get((model, b, lengths))
            if isinstance(row.get("img/s"), float):
                flops_of[(model, b, lengths)] = flops
                row["flops"] = flops
                row["TFLOP/step"] = flops / 1e12 if flops else None
                if flops and peak:
                    row["MFU %"] = 100 * flops / (row["step ms"] / 1000) / peak
            rows.append(row)
            shown = {k: v for k, v in row.items() if k != "flops"}
            print(shown, flush=True)
            if args.jsonl:  # a call killed past the time limit still keeps these
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(shown) + "\n")
    except Stopped:  # the case running is stopped (its process group killed), the rest not run
        for i, (model, b, lengths, mode) in enumerate(cases[len(rows):]):
            rows.append({"model": case_label(model, lengths, args.gradient_checkpointing),
                         "res": args.resolution, "batch": b, "compile": mode,
                         "img/s": "stopped: SIGTERM" if i == 0 else "not run: SIGTERM"})
        record_rows(args, child_argv, name, peak, rows)
        raise SystemExit(143)
    finally:
        signal.signal(signal.SIGTERM, previous)
    record_rows(args, child_argv, name, peak, rows)


def record_rows(args, argv: list[str], name: str, peak: float | None, rows: list[dict]) -> None:
    cols = ["model", "res", "batch", "compile", "img/s", "step ms", "TFLOP/step", "MFU %",
            "compile s", "peak mem GiB", "base params B", "LoRA params M"]
    record(f"Flow-matching DiTs ({name})" + (" [smoke: toy widths, not a measurement]" if args.smoke else ""),
           machine(), table(rows, cols), [
               "raylora's train_micro_step through the family seam (flux = Flux.1-dev, sd35m = "
               "SD3.5-medium transformer architectures, random weights), bf16 base, fp32 LoRA rank "
               f"{args.rank} on the family's default targets, flow matching (logit-normal σ, the "
               "pipeline's shift), cached latents + text embeddings, fused AdamW; "
               f"{args.warmup} warm-up + {args.steps} timed steps after the first (compile) step.",
               f"MFU against {peak / 1e12:.0f} TFLOP/s peak dense bf16; model FLOPs counted on an "
               "eager step (a compiled case takes it before compiling)."
               if peak else "MFU: no peak FLOP/s known for this device.",
               "Target (#20): Flux.1-dev r16 at 1024 px >= 35% MFU on H100.",
               f"SDPA backends: {args.sdpa}.",
               *(["+ckpt: gradient checkpointing. Its FLOPs are those executed, the recomputed "
                  "forward included, so its MFU counts recomputation as work (a frozen base's "
                  "backward computes input gradients only: without the recompute the step does "
                  "about 2 forwards' FLOPs, with it about 3)."] if args.gradient_checkpointing else []),
               *([f"N caption lengths (--vary-captions {args.vary_captions}): the steps cycle "
                  "through captions 0, 40, 80, ... tokens shorter than the full length, as "
                  "training meets a new length nearly every batch; compile s covers the "
                  "static compile and the dynamic-shape one at the second length. A row without "
                  "it has one length."]
                 if args.vary_captions != "1" else []),
               *([f"--time-limit {args.time_limit:.0f} s for the grid: a case running then was "
                  "stopped, the later ones not run."] if args.time_limit is not None else []),
               *([f"Code: {os.environ['RAYLORA_REV']}"] if os.environ.get("RAYLORA_REV") else []),
               "Command: `python bench/gpu_dit.py " + " ".join(argv) + "`",
               "Each case in its own process (a CUDA fault is that row's error).",
           ])


if __name__ == "__main__":
    main()
