"""Per-worker train function for Ray Train: restore → build → loop → sink.

Ray appears only here: the dataset shard, the checkpoint to resume from, and
``ray.train.report``. Everything else is the plain-PyTorch code in ``raylora.train``.
"""

from __future__ import annotations

import logging
import os
import tempfile

import ray.train
import torch

from raylora.checkpoint.state import (
    ADAPTER_DIR,
    LoopState,
    load_state,
    restore_rng,
    save_main_state,
    save_rank_state,
)
from raylora.config import RayLoraConfig
from raylora.model.load import load_components
from raylora.model.lora import add_lora, digest, load_lora_state_dict, lora_state_dict
from raylora.model.lora import save_diffusers_adapter
from raylora.train.loop import run_loop
from raylora.train.step import FrozenParts

log = logging.getLogger("raylora.worker")

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_optimizer(cfg: RayLoraConfig, params, world_size: int) -> torch.optim.Optimizer:
    t = cfg.train
    lr = t.learning_rate
    if t.scale_lr:
        lr *= t.gradient_accumulation_steps * t.batch_size * world_size
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
    )


def build_lr_scheduler(cfg: RayLoraConfig, optimizer, max_steps: int, num_processes: int):
    from diffusers.optimization import get_scheduler

    t = cfg.train
    # Accelerate's prepared scheduler steps once per process per optimizer step, so the
    # counts are in optimizer steps × processes, as in diffusers' training scripts.
    return get_scheduler(
        t.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=t.lr_warmup_steps * num_processes,
        num_training_steps=max_steps * num_processes,
        num_cycles=t.lr_num_cycles,
        power=t.lr_power,
    )


def train_loop_per_worker(loop_config: dict) -> None:
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed

    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[raylora] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    cfg = RayLoraConfig.model_validate(loop_config["config"])
    plan = loop_config["plan"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    t = cfg.train

    # Accelerate picks up the torch.distributed process group that Ray Train created.
    accelerator = Accelerator(
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        cpu=not cfg.scaling.use_gpu,
    )
    weight_dtype = DTYPES[t.mixed_precision]

    # Same seed on every rank for the adapter's initial weights...
    set_seed(t.seed)
    comps = load_components(cfg.model, weight_dtype)
    params = add_lora(comps.unet, cfg.lora)
    comps.vae.to(accelerator.device)
    comps.text_encoder.to(accelerator.device)
    prediction_type = t.prediction_type or comps.noise_scheduler.config.prediction_type
    parts = FrozenParts(
        comps.vae, comps.text_encoder, comps.noise_scheduler, weight_dtype, prediction_type
    )

    state = LoopState()
    restored = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            restored = load_state(d, rank)
        load_lora_state_dict(comps.unet, restored.lora_sd)
        state = restored.loop
        state.resumed_from_step = state.global_step

    optimizer = build_optimizer(cfg, params, world)
    lr_scheduler = build_lr_scheduler(cfg, optimizer, plan["max_steps"], accelerator.num_processes)
    unet, optimizer, lr_scheduler = accelerator.prepare(comps.unet, optimizer, lr_scheduler)

    if restored is not None:
        optimizer.load_state_dict(restored.optimizer_sd)
        lr_scheduler.scheduler.load_state_dict(restored.scheduler_sd)
        if accelerator.scaler is not None and restored.scaler_sd:
            accelerator.scaler.load_state_dict(restored.scaler_sd)
        if restored.rng is not None:
            restore_rng(restored.rng)
        else:  # world size changed: fresh but still seeded streams
            torch.manual_seed(t.seed + 1000 * rank + state.global_step)
        if rank == 0:
            log.info("resumed from step %d (epoch %d)", state.global_step, state.epoch)
    else:
        # ...and a different noise/timestep stream per rank, so workers do not draw
        # identical noise for their different images.
        torch.manual_seed(t.seed + 1000 * rank)

    shard = ray.train.get_dataset_shard("train")
    data_seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else t.seed

    def epoch_batches(epoch: int):
        return shard.iter_torch_batches(
            batch_size=t.batch_size,
            drop_last=True,
            local_shuffle_buffer_size=cfg.data.shuffle_buffer_size or None,
            local_shuffle_seed=data_seed + 7919 * epoch + rank,
            device=accelerator.device,
        )

    bar = None
    if rank == 0 and loop_config.get("progress_bar"):
        # tqdm_ray draws this bar on the driver's terminal, not in the worker's log.
        from ray.experimental.tqdm_ray import tqdm

        bar = tqdm(total=plan["max_steps"], desc="raylora train")
        bar.update(state.global_step)

    def on_step(row: dict) -> None:
        if bar is not None:
            bar.update(1)
        if rank == 0 and row["step"] % t.log_every_n_steps == 0:
            log.info(
                "step %d/%d loss %.5f lr %.3g images/s %.1f",
                row["step"], plan["max_steps"], row["loss"], row["lr"], row["images_per_s"],
            )

    def on_checkpoint(st: LoopState, final: bool) -> None:
        metrics = {
            "step": st.global_step,
            "epoch": st.epoch,
            "train_loss": st.train_loss_last,
            "lr": lr_scheduler.get_last_lr()[0],
        }
        raw = accelerator.unwrap_model(unet)
        sd = lora_state_dict(raw)
        if final:
            # Every rank's adapter digest: equal digests prove the DDP replicas stayed
            # bit-identical, which the driver records in raylora.json.
            metrics["replica_lora_digests"] = gather_object([digest(sd)])
            metrics.update(st.scalars())
        with tempfile.TemporaryDirectory(prefix="raylora-ckpt-") as d:
            save_rank_state(d, rank)
            if rank == 0:
                save_diffusers_adapter(raw, os.path.join(d, ADAPTER_DIR))
                scaler = accelerator.scaler.state_dict() if accelerator.scaler else None
                save_main_state(
                    d,
                    lora_sd=sd,
                    optimizer_sd=optimizer.state_dict(),
                    scheduler_sd=lr_scheduler.scheduler.state_dict(),
                    scaler_sd=scaler,
                    loop=st,
                )
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    unet.train()
    run_loop(
        accelerator=accelerator,
        unet=unet,
        parts=parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        params=params,
        state=state,
        max_steps=plan["max_steps"],
        max_grad_norm=t.max_grad_norm,
        images_per_step=t.batch_size * t.gradient_accumulation_steps * world,
        checkpoint_every=cfg.checkpoint.every_n_steps,
        epoch_batches=epoch_batches,
        on_checkpoint=on_checkpoint,
        on_step=on_step,
    )
    if bar is not None:
        bar.close()
