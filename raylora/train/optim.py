"""The optimizer and learning-rate schedule of a run. No Ray.

AdamW's implementation is picked by device: on CUDA the fused kernel (one launch updates
every LoRA tensor; the for-each variant still launches a handful of kernels per group of
tensors, and the per-tensor loop one per tensor per op, which for a few hundred small
LoRA matrices is a visible slice of a short step); elsewhere the for-each variant.
"""

from __future__ import annotations

import torch

from raylora.config import RayLoraConfig


def adamw_impl(device) -> dict:
    """AdamW's implementation keyword for parameters that will live on ``device``."""
    if torch.device(device).type == "cuda":
        return {"fused": True}
    # CPU has a fused AdamW too, but it is not what the for-each path is tested against
    # here, and on CPU the optimizer is not where the step's time goes.
    return {"foreach": True}


def build_optimizer(cfg: RayLoraConfig, params, world_size: int,
                    text_encoder_params=(), device=None) -> torch.optim.Optimizer:
    """AdamW over the UNet LoRA (``params``) and, in a second parameter group with
    ``lora.text_encoder_lr``, the text-encoder LoRA. ``device``: where the parameters will
    be trained (the accelerator's device: the model is moved there only after the
    optimizer is built); None: where the first parameter is now."""
    t = cfg.train
    scale = t.gradient_accumulation_steps * t.batch_size * world_size if t.scale_lr else 1
    lr = t.learning_rate * scale
    kwargs = dict(
        lr=lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
    )
    params = list(params)
    te = set(map(id, text_encoder_params))
    groups = [{"params": [p for p in params if id(p) not in te]}]
    if te:
        te_lr = (cfg.lora.text_encoder_lr or t.learning_rate) * scale
        groups.append({"params": list(text_encoder_params), "lr": te_lr})
    if t.optimizer == "adamw8bit":
        # Optimizer state in 8 bits: ~75% less optimizer memory (config refuses it off CUDA).
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, **kwargs)
    if device is None:
        device = params[0].device if params else "cpu"
    return torch.optim.AdamW(groups, **kwargs, **adamw_impl(device))


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
