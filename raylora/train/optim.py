"""The optimizer and learning-rate schedule of a run. No Ray.

``train.optimizer``: torch AdamW, bitsandbytes' 8-bit AdamW (CPU or CUDA) and its paged
variant (CUDA), Prodigy (prodigyopt) or Adafactor (transformers). Each gets the
denoiser's LoRA in one parameter group and, when trained, the text encoders' in a second
with ``lora.text_encoder_lr``; their hyperparameters come from ``train.adam_*``,
``train.prodigy`` and ``train.adafactor``. Their state dicts are what checkpoints hold
(plain tensors and numbers: ``torch.load(weights_only=True)`` reads them back); their
size, for the memory preflight, is ``raylora.memory.optimizer_state_bytes``.

AdamW's implementation is picked by device: on CUDA the fused kernel (one launch updates
every LoRA tensor; the for-each variant still launches a handful of kernels per group of
tensors, and the per-tensor loop one per tensor per op, which for a few hundred small
LoRA matrices is a visible slice of a short step); elsewhere the for-each variant.
"""

from __future__ import annotations

import logging

import torch

from raylora.config import RayLoraConfig

log = logging.getLogger(__name__)


def adamw_impl(device) -> dict:
    """AdamW's implementation keyword for parameters that will live on ``device``."""
    if torch.device(device).type == "cuda":
        return {"fused": True}
    # CPU has a fused AdamW too, but it is not what the for-each path is tested against
    # here, and on CPU the optimizer is not where the step's time goes.
    return {"foreach": True}


def build_optimizer(cfg: RayLoraConfig, params, world_size: int,
                    text_encoder_params=(), device=None) -> torch.optim.Optimizer:
    """``train.optimizer`` over the UNet LoRA (``params``) and, in a second parameter group
    with ``lora.text_encoder_lr``, the text-encoder LoRA. ``device``: where the parameters
    will be trained (the accelerator's device: the model is moved there only after the
    optimizer is built); None: where the first parameter is now."""
    t = cfg.train
    scale = t.gradient_accumulation_steps * t.batch_size * world_size if t.scale_lr else 1
    lr = t.learning_rate * scale
    params = list(params)
    if device is None:
        device = params[0].device if params else "cpu"
    te = set(map(id, text_encoder_params))
    groups = [{"params": [p for p in params if id(p) not in te]}]
    if te:
        te_lr = (cfg.lora.text_encoder_lr or t.learning_rate) * scale
        groups.append({"params": list(text_encoder_params), "lr": te_lr})
    adam = dict(lr=lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                eps=t.adam_epsilon)
    if t.optimizer in ("adamw8bit", "paged_adamw8bit"):
        # Optimizer state in 8 bits: ~75% less optimizer memory. bitsandbytes >= 0.50 runs
        # the 8-bit update on CPU too (0.45-0.49: "same GPU" errors; pyproject's pin); the paged variant needs CUDA unified memory.
        import bitsandbytes as bnb

        if t.optimizer == "paged_adamw8bit":
            if torch.device(device).type != "cuda":
                raise ValueError(f"train.optimizer: paged_adamw8bit needs CUDA (the parameters "
                                 f"train on {device}); use adamw8bit")
            return bnb.optim.PagedAdamW8bit(groups, **adam)
        return bnb.optim.AdamW8bit(groups, **adam)
    if t.optimizer == "prodigy":
        from prodigyopt import Prodigy

        p = t.prodigy
        if lr < 0.1:
            log.warning("train.optimizer=prodigy with train.learning_rate=%g: Prodigy's lr "
                        "multiplies the step size it estimates; 1.0 is the usual value", lr)
        return Prodigy(groups, **adam, beta3=p.beta3, decouple=p.decouple,
                       use_bias_correction=p.use_bias_correction,
                       safeguard_warmup=p.safeguard_warmup, d0=p.d0, d_coef=p.d_coef,
                       growth_rate=float("inf") if p.growth_rate is None else p.growth_rate,
                       slice_p=p.slice_p)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        a = t.adafactor
        if a.relative_step:  # transformers refuses an lr next to relative_step
            for g in groups:
                g.pop("lr", None)
        return Adafactor(groups, lr=None if a.relative_step else lr, eps=tuple(a.eps),
                         clip_threshold=a.clip_threshold, decay_rate=a.decay_rate,
                         beta1=a.beta1, weight_decay=a.weight_decay,
                         scale_parameter=a.scale_parameter, relative_step=a.relative_step,
                         warmup_init=a.warmup_init)
    return torch.optim.AdamW(groups, **adam, **adamw_impl(device))


def build_lr_scheduler(cfg: RayLoraConfig, optimizer, max_steps: int, num_processes: int):
    from diffusers.optimization import get_scheduler

    t = cfg.train
    if t.optimizer == "adafactor" and t.adafactor.relative_step:
        return _adafactor_schedule(optimizer)
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


def _adafactor_schedule(optimizer):
    """Adafactor with relative_step schedules itself; this proxy scheduler reports the step
    size it used (what metrics.jsonl logs as lr), as plain floats."""
    from transformers.optimization import AdafactorSchedule

    class _Schedule(AdafactorSchedule):
        def get_lr(self):
            return [float(lr) for lr in super().get_lr()]

    return _Schedule(optimizer)
