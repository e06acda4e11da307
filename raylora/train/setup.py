"""Build everything one worker trains with, restore it, and write it to a checkpoint.

No Ray: ``worker.py`` calls these with Ray's checkpoint directory and dataset shard, and
tests call them directly to check resume exactness in a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from raylora.checkpoint.state import (
    ADAPTER_DIR,
    LoopState,
    RestoredState,
    restore_rng,
    save_main_state,
    save_rank_state,
)
from raylora.config import RayLoraConfig
from raylora.model.load import load_components
from raylora.model.lora import add_lora, add_text_encoder_lora, load_lora_state_dict, lora_state_dict
from raylora.model.lora import save_diffusers_adapter
from raylora.train.ema import LoraEMA
from raylora.train.optim import build_lr_scheduler, build_optimizer
from raylora.train.step import FrozenParts

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TrainingRun:
    accelerator: object
    unet: torch.nn.Module  # prepared (DDP-wrapped when distributed)
    parts: FrozenParts
    optimizer: object
    lr_scheduler: object
    params: list[torch.nn.Parameter]  # UNet LoRA, then text-encoder LoRA when trained
    state: LoopState
    ema: LoraEMA | None = None
    family: str = "sd"

    @property
    def trained_text_encoders(self) -> list[torch.nn.Module]:
        return self.parts.text_encoders if self.parts.text_encoder_params else []

    def lora_state(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.accelerator.unwrap_model(self.unet), self.trained_text_encoders)


def compile_unet(unet: torch.nn.Module) -> None:
    """``torch.compile`` the UNet's forward in place (``Module.compile``): the module, its
    parameters and state-dict keys stay what they were, so DDP, LoRA saving and resume are
    unchanged. Static shapes: every training batch has the same shape (drop_last)."""
    unet.compile(dynamic=False)


def build_run(
    cfg: RayLoraConfig,
    accelerator,
    max_steps: int,
    rank: int,
    restored: RestoredState | None = None,
) -> TrainingRun:
    """Frozen base + fresh or restored LoRA, optimizer, schedule, RNG, loop state."""
    from accelerate.utils import set_seed

    t = cfg.train
    weight_dtype = DTYPES[t.mixed_precision]
    # Same seed on every rank for the adapter's initial weights...
    set_seed(t.seed)
    # Cached latents: the cache holds what the VAE and text encoders would compute.
    comps = load_components(
        cfg.model, weight_dtype, cfg.storage.client(), encoders=cfg.data.cache != "latents"
    )
    params = add_lora(comps.unet, cfg.lora)
    te_params = add_text_encoder_lora(comps.text_encoders, cfg.lora) if cfg.lora.train_text_encoder else []
    if t.gradient_checkpointing:
        comps.unet.enable_gradient_checkpointing()
    if cfg.compile_mode != "none":
        compile_unet(comps.unet)
    for m in [comps.vae, *comps.text_encoders]:
        if m is not None:
            m.to(accelerator.device)
    prediction_type = t.prediction_type or comps.noise_scheduler.config.prediction_type
    parts = FrozenParts(
        comps.vae, comps.text_encoders, comps.noise_scheduler, weight_dtype, prediction_type,
        snr_gamma=t.snr_gamma, noise_offset=t.noise_offset, latent_scale=comps.latent_scale,
        resolution=cfg.data.resolution, text_encoder_params=te_params,
    )
    if restored is not None:
        load_lora_state_dict(comps.unet, restored.lora_sd, comps.text_encoders if te_params else ())

    optimizer = build_optimizer(cfg, params, accelerator.num_processes, te_params,
                                device=accelerator.device)
    lr_scheduler = build_lr_scheduler(cfg, optimizer, max_steps, accelerator.num_processes)
    unet, optimizer, lr_scheduler = accelerator.prepare(comps.unet, optimizer, lr_scheduler)

    state = LoopState()
    if restored is not None:
        optimizer.load_state_dict(restored.optimizer_sd)
        lr_scheduler.scheduler.load_state_dict(restored.scheduler_sd)
        if accelerator.scaler is not None and restored.scaler_sd:
            accelerator.scaler.load_state_dict(restored.scaler_sd)
        state = restored.loop
        state.resumed_from_step = state.global_step
        if restored.rng is not None:
            restore_rng(restored.rng)
        else:  # world size changed: no saved stream for this rank; seeded fresh one
            torch.manual_seed(t.seed + 1000 * rank + state.global_step)
    else:
        # ...and a different noise/timestep stream per rank, so workers do not draw
        # identical noise for their different images.
        torch.manual_seed(t.seed + 1000 * rank)
    ema = None
    if t.ema_decay:
        ema = LoraEMA(params + te_params, t.ema_decay)
        if restored is not None and restored.ema_sd is not None:
            ema.load_state_dict(restored.ema_sd)
        elif restored is not None and state.global_step:
            raise ValueError(
                "train.ema_decay: the checkpoint to resume from has no EMA state (EMA was "
                "off when it was written); resume without EMA or start a new output.uri"
            )
    unet.train()
    for te in comps.text_encoders if te_params else ():
        te.train()  # LoRA dropout on, as for the UNet
    return TrainingRun(
        accelerator, unet, parts, optimizer, lr_scheduler, params + te_params, state, ema,
        comps.family,
    )


def nonfinite_advice(cfg: RayLoraConfig) -> str:
    """The likely causes of a run stuck on NaN/inf, for the error that stops it."""
    t = cfg.train
    hints = []
    if t.mixed_precision == "fp16":
        hints.append("fp16 overflow is the usual cause: try train.mixed_precision=bf16")
    hints.append(f"lower train.learning_rate (now {t.learning_rate:g})")
    if t.max_grad_norm > 10:
        hints.append(f"clip harder (train.max_grad_norm now {t.max_grad_norm:g})")
    return "Likely causes: " + "; ".join(hints) + "; or broken input images."


def write_checkpoint(directory: str, run: TrainingRun, rank: int) -> dict[str, torch.Tensor]:
    """Write this rank's share of a checkpoint into ``directory``; returns the LoRA state."""
    sd = run.lora_state()
    save_rank_state(directory, rank)
    if rank == 0:
        unet = run.accelerator.unwrap_model(run.unet)
        if run.ema is not None:
            # The published adapter is the EMA; lora.safetensors keeps the raw weights.
            with run.ema.swapped_in(run.params):
                save_diffusers_adapter(unet, os.path.join(directory, ADAPTER_DIR), run.family,
                                       run.trained_text_encoders)
        else:
            save_diffusers_adapter(unet, os.path.join(directory, ADAPTER_DIR), run.family,
                                   run.trained_text_encoders)
        scaler = run.accelerator.scaler
        save_main_state(
            directory,
            lora_sd=sd,
            optimizer_sd=run.optimizer.state_dict(),
            scheduler_sd=run.lr_scheduler.scheduler.state_dict(),
            scaler_sd=scaler.state_dict() if scaler is not None else None,
            loop=run.state,
            ema_sd=run.ema.state_dict() if run.ema is not None else None,
        )
    return sd
