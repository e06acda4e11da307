"""LoRA adapter: inject with peft, extract in the diffusers layout, save loadably.

What is written is exactly what stock ``StableDiffusionPipeline.load_lora_weights(dir)``
reads: ``pytorch_lora_weights.safetensors`` with ``unet.``-prefixed diffusers keys and the
peft config (rank, alpha, targets) in the safetensors metadata.
"""

from __future__ import annotations

import hashlib

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from raylora.config import LoraSection

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def peft_config(lora: LoraSection) -> LoraConfig:
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.effective_alpha,
        lora_dropout=lora.dropout,
        # B starts at zero, A Gaussian: the adapter begins as an exact no-op, as in
        # diffusers' training scripts.
        init_lora_weights="gaussian",
        target_modules=list(lora.target_modules),
    )


def add_lora(unet: torch.nn.Module, lora: LoraSection) -> list[torch.nn.Parameter]:
    """Attach a LoRA adapter to a frozen UNet; returns the trainable parameters.

    The LoRA parameters are fp32 even when the base is fp16/bf16: an optimizer stepping
    half-precision master weights loses small updates, and fp16 grads make GradScaler
    raise "Attempting to unscale FP16 gradients".
    """
    unet.requires_grad_(False)
    try:
        unet.add_adapter(peft_config(lora))
    except ValueError as exc:
        raise ValueError(f"lora.target_modules: {lora.target_modules}: {exc}") from None
    params = [p for p in unet.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"lora.target_modules: {lora.target_modules} matched no module in the UNet"
        )
    for p in params:
        p.data = p.data.float()
    return params


def lora_state_dict(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """peft-layout LoRA weights (fp32, detached, on CPU): for checkpoints and digests."""
    sd = get_peft_model_state_dict(unet)
    # copy=True: for fp32 CPU tensors .float()/.cpu() are no-ops that would alias the live
    # parameters, and a "snapshot" that keeps changing is no snapshot.
    return {k: v.detach().to("cpu", torch.float32, copy=True).contiguous() for k, v in sd.items()}


def load_lora_state_dict(unet: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    result = set_peft_model_state_dict(unet, sd)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"checkpoint LoRA keys do not match the model: {unexpected[:5]}")


def save_diffusers_adapter(unet: torch.nn.Module, directory: str, family: str = "sd") -> None:
    """Write ``pytorch_lora_weights.safetensors`` in the diffusers layout to ``directory``:
    the file stock ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline``
    ``.load_lora_weights(directory)`` reads."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers

    pipeline = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    layers = convert_state_dict_to_diffusers(lora_state_dict(unet))
    pipeline.save_lora_weights(
        save_directory=directory,
        unet_lora_layers=layers,
        safe_serialization=True,
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
    )


def digest(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over the LoRA tensors in key order: equal digests = bit-identical replicas."""
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
