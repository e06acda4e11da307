"""One training micro-step and one optimizer step; plain PyTorch + Accelerate, no Ray.

``compute_loss`` is the whole training objective for a batch; ``train_micro_step`` wraps it
in Accelerate's accumulation context, which skips the DDP all-reduce on non-final
micro-steps, unscales and clips before the optimizer step, and steps the optimizer and LR
scheduler only when gradients were synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raylora.config import control_key
from raylora.model.families.base import Cond, Family
from raylora.train.encode import batch_condition, batch_posterior, batch_reference, sample_latents
from raylora.train.loss import combine_prior, denoising_loss, latent_mask, split_pairs
from raylora.train.objective import draw_noise


@dataclass
class FrozenParts:
    """Everything the step needs besides the denoiser.

    ``vae`` and ``text_encoders`` are None/empty when batches come from the latent cache.
    With ``lora.train_text_encoder`` the text encoders carry LoRA and are not frozen after
    all: ``text_encoder_params`` are their trainable parameters (their gradients are
    averaged across ranks here, since only the denoiser is DDP-wrapped).
    """

    family: type[Family]
    vae: torch.nn.Module | None
    text_encoders: list[torch.nn.Module]
    objective: Any  # raylora.train.objective.DDPM | FlowMatching
    weight_dtype: torch.dtype
    latent_shift: Any = 0.0  # normalised latents = (z − shift) · scale (the VAE's config)
    latent_scale: Any = 0.18215
    guidance: float = 1.0  # guidance-embedding input of guidance-distilled models (Flux.1-dev)
    text_encoder_params: list[torch.nn.Parameter] = field(default_factory=list)
    # Prior preservation: batches are instance ‖ class halves, and this weights the class
    # half's loss (train.prior_loss_weight); None: plain batches.
    prior_loss_weight: float | None = None
    # train.cuda_graphs: the compiled blocks replay CUDA graphs; each micro-step is a new
    # generation of their outputs (see train_micro_step).
    cuda_graphs: bool = False
    # data.control_images: every batch brings its samples' input images; one without them
    # is an error, never an edit model trained text to image unnoticed.
    control_images: bool = False


def encode_batch(parts: FrozenParts, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Cond]:
    """A raw or cached batch → latents ``[B,C,h,w]`` (a posterior draw) and conditioning
    (with an edit pair's input latents as ``reference_latents``)."""
    with torch.no_grad():
        params = batch_posterior(parts.family, parts.vae, batch)
        latents = sample_latents(params, parts.latent_shift, parts.latent_scale)
    with torch.set_grad_enabled(bool(parts.text_encoder_params) and torch.is_grad_enabled()):
        cond = batch_condition(parts.family, parts.text_encoders, batch)
    return latents, with_reference(parts, batch, cond)


@torch.no_grad()
def with_reference(parts: FrozenParts, batch: dict[str, torch.Tensor], cond: Cond,
                   what: str = "a batch") -> Cond:
    """``cond`` with the batch's input latents as ``reference_latents`` (an edit pair's,
    data.control_images), as it is for a batch without them; in an edit run such a batch
    (``what``) is an error."""
    refs = {}
    while (ref := batch_reference(parts.family, parts.vae, batch, parts.latent_shift,
                                  parts.latent_scale, index=len(refs))) is not None:
        refs[control_key("reference_latents", len(refs))] = ref
    if refs:
        return Cond(cond, **refs)
    if parts.control_images:
        raise ValueError(f"data.control_images: {what} without control images (columns "
                         f"{sorted(batch)}): its input images were lost on the way")
    return cond


def compute_loss(model: torch.nn.Module, parts: FrozenParts, batch: dict[str, torch.Tensor],
                 terms: dict | None = None):
    """The training objective for one batch; randomness from torch's global RNG.
    ``terms``: filled with the detached ``loss_instance`` and ``loss_prior`` of a
    prior-preservation batch."""
    latents, cond = encode_batch(parts, batch)
    obj = parts.objective
    noise = draw_noise(latents)
    t = obj.sample_timesteps(latents)
    noised = obj.noised(latents, obj.offset(noise), t)
    pred = parts.family.denoise(model, noised.noisy, t, cond, guidance=parts.guidance)
    # data.masked_loss: every family's denoise returns [B, C, h, w] (Flux/Qwen-Image unpack
    # their 2×2 tokens), so the mask lines up with the latents whatever the family.
    mask = batch.get("loss_mask")
    mask = None if mask is None else latent_mask(mask, pred.shape[-2:])
    if parts.prior_loss_weight is None:
        return denoising_loss(pred, noised.target, noised.weights, mask)
    return _prior_loss(parts.prior_loss_weight, terms, pred, noised.target, noised.weights, mask)


def _prior_loss(weight: float, terms: dict | None, *tensors) -> torch.Tensor:
    """DreamBooth: the loss of each half of the batch (``tensors``: prediction, target,
    per-sample weights, loss mask), combined; each term recorded in ``terms``."""
    instance, prior = (denoising_loss(*half) for half in split_pairs(*tensors))
    if terms is not None:
        terms.update(loss_instance=instance.detach(), loss_prior=prior.detach())
    return combine_prior(instance, prior, weight)


def train_micro_step(
    accelerator,
    model: torch.nn.Module,
    parts: FrozenParts,
    optimizer,
    lr_scheduler,
    params: list[torch.nn.Parameter],
    batch: dict[str, torch.Tensor],
    max_grad_norm: float,
    terms: dict | None = None,
) -> torch.Tensor:
    """Forward + backward for one micro-batch (``terms``: see ``compute_loss``); the optimizer steps on the last of each
    accumulation group. Returns the detached loss, NaN when the optimizer step was skipped
    (but for an fp16 GradScaler's overflow skip: its scale is lowered, the loss stands).

    Non-finite gradients skip the optimizer step. Backward always runs (DDP expects it),
    and the check happens after the gradients were all-reduced, so a NaN on any rank, in
    any micro-batch of the group, reaches every rank and all of them skip together. Under
    fp16 the GradScaler makes that call itself (and lowers its scale), so it still steps.
    """
    skip, finite, flagged = False, None, None
    if parts.cuda_graphs:
        # Tells the graph trees that a new step begins: the last step's outputs
        # (activations, gradients: the optimizer has stepped and zero_grad dropped them)
        # are dead, so this replay may write over them (as the bench's +ro rows do).
        torch.compiler.cudagraph_mark_step_begin()
    with accelerator.accumulate(model):
        if hasattr(model, "set_requires_gradient_sync"):
            # FSDP (not DDP-wrapped, so accumulate() cannot skip its sync): reduce-scatter
            # the gradients on the last micro-step of the group only, as DDP all-reduces.
            model.set_requires_gradient_sync(accelerator.sync_gradients)
        loss = compute_loss(model, parts, batch, terms)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            if parts.text_encoder_params and accelerator.num_processes > 1:
                average_gradients(parts.text_encoder_params)
            norm = accelerator.clip_grad_norm_(params, max_grad_norm)
            if hasattr(norm, "full_tensor"):  # a DTensor (FSDP-sharded gradients)
                norm = norm.full_tensor()
            if norm is not None:
                finite = torch.isfinite(torch.as_tensor(norm))
                flagged = _skips_on_device(optimizer, accelerator)
                if flagged is not None:  # the optimizer skips by itself: no host sync
                    flagged.found_inf, flagged.grad_scale = (~finite).float().reshape(()), None
                else:
                    skip = not bool(finite)  # waits for the GPU: every optimizer step
        if not skip or accelerator.scaler is not None:
            optimizer.step()
        if flagged is not None:  # one step's flag: not left for the next caller of step()
            flagged.found_inf = None
        if lr_scheduler is not None:  # None: the caller sets the lr itself (lr-find)
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    if flagged is not None:  # NaN when skipped, decided on the device
        return torch.where(finite, loss, torch.full_like(loss, float("nan")))
    if skip and accelerator.scaler is not None and accelerator.scaler.get_scale() >= 1.0:
        # fp16: the GradScaler skipped an overflow and lowered its scale, its calibration
        # (it tries a larger scale every 2000 clean steps): the loss stands, and the step
        # is not the model's NaN/inf. Gradients still non-finite below scale 1 are.
        return loss
    return torch.full_like(loss, float("nan")) if skip else loss


def _inner(optimizer):
    """The torch optimizer under Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _skips_on_device(optimizer, accelerator):
    """The inner optimizer when it can skip a non-finite step on the device, else None.

    torch's fused Adam/AdamW take a ``found_inf`` flag (the GradScaler protocol): the
    kernel leaves weights, moments and step count alone where it is 1, so the skip needs
    no ``bool(norm)`` readback (a stall of the whole GPU queue each step). Other
    optimizers (for-each AdamW on CPU, 8-bit, Prodigy, Adafactor) are checked on the host;
    under fp16 the GradScaler sets the flag itself.
    """
    inner = _inner(optimizer)
    if accelerator.scaler is not None or not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return None
    return inner if all(g.get("fused") for g in inner.param_groups) else None


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """All-reduce-mean the gradients of parameters outside DDP, as one flat tensor.

    Not DDP for the text encoders: SDXL conditions on encoder 1's penultimate layer, so the
    last layer's LoRA gets no gradient, which DDP (without a costly unused-parameter search)
    treats as an error. A parameter without a gradient has none on every rank, since every
    rank runs the same graph.
    """
    import torch.distributed as dist

    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in with_grad])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in with_grad:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
