"""LoRA adapter: inject with peft, extract in the diffusers layout, save loadably.

What is written is exactly what stock ``StableDiffusionPipeline.load_lora_weights(dir)``
reads: ``pytorch_lora_weights.safetensors`` with ``unet.``-prefixed diffusers keys (plus
``text_encoder.``/``text_encoder_2.`` keys when the text encoders are trained too) and the
peft configs (rank, alpha, targets) in the safetensors metadata.

In raylora's own state dicts (checkpoints, digests) UNet keys carry no prefix (peft's
layout) and text-encoder keys are prefixed with their pipeline component name.
"""

from __future__ import annotations

import hashlib

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from raylora.config import LoraSection

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2")


def peft_config(lora: LoraSection, text_encoder: bool = False) -> LoraConfig:
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.effective_alpha,
        lora_dropout=lora.dropout,
        # B starts at zero, A Gaussian: the adapter begins as an exact no-op, as in
        # diffusers' training scripts.
        init_lora_weights="gaussian",
        target_modules=list(lora.text_encoder_target_modules if text_encoder else lora.target_modules),
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


def add_text_encoder_lora(text_encoders: list[torch.nn.Module], lora: LoraSection) -> list[torch.nn.Parameter]:
    """LoRA on the text encoder(s), as diffusers' scripts do with ``--train_text_encoder``
    (fp32 LoRA parameters, see ``add_lora``); returns their trainable parameters."""
    params = []
    for name, te in zip(TEXT_ENCODER_NAMES, text_encoders):
        te.requires_grad_(False)
        try:
            te.add_adapter(peft_config(lora, text_encoder=True))
        except ValueError as exc:
            raise ValueError(f"lora.text_encoder_target_modules: {exc}") from None
        mine = [p for p in te.parameters() if p.requires_grad]
        if not mine:
            raise ValueError(f"lora.text_encoder_target_modules: {lora.text_encoder_target_modules} "
                             f"matched no module in {name}")
        for p in mine:
            p.data = p.data.float()
        params += mine
    return params


def _snapshot(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    # copy=True: for fp32 CPU tensors .float()/.cpu() are no-ops that would alias the live
    # parameters, and a "snapshot" that keeps changing is no snapshot.
    return {prefix + k: v.detach().to("cpu", torch.float32, copy=True).contiguous() for k, v in sd.items()}


def lora_state_dict(unet: torch.nn.Module, text_encoders=()) -> dict[str, torch.Tensor]:
    """peft-layout LoRA weights (fp32, detached, on CPU): for checkpoints and digests.
    ``text_encoders``: the trained ones, their keys prefixed ``text_encoder[_2].``."""
    sd = _snapshot(get_peft_model_state_dict(unet))
    for name, te in zip(TEXT_ENCODER_NAMES, text_encoders):
        sd.update(_snapshot(get_peft_model_state_dict(te), name + "."))
    return sd


def _load_into(module: torch.nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    result = set_peft_model_state_dict(module, sd)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"checkpoint LoRA keys do not match the {what}: {unexpected[:5]}")


def load_lora_state_dict(unet: torch.nn.Module, sd: dict[str, torch.Tensor], text_encoders=()) -> None:
    prefixes = tuple(n + "." for n in TEXT_ENCODER_NAMES)
    if any(k.startswith(prefixes) for k in sd) and not text_encoders:
        raise ValueError("the checkpoint has text-encoder LoRA weights; set lora.train_text_encoder: true")
    _load_into(unet, {k: v for k, v in sd.items() if not k.startswith(prefixes)}, "UNet")
    for name, te in zip(TEXT_ENCODER_NAMES, text_encoders):
        part = {k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(name + ".")}
        if not part:
            raise ValueError(f"the checkpoint has no {name} LoRA weights (lora.train_text_encoder "
                             "was off when it was written)")
        _load_into(te, part, name)


def save_diffusers_adapter(unet: torch.nn.Module, directory: str, family: str = "sd",
                           text_encoders=()) -> None:
    """Write ``pytorch_lora_weights.safetensors`` in the diffusers layout to ``directory``:
    the file stock ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline``
    ``.load_lora_weights(directory)`` reads. ``text_encoders``: the trained ones."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers

    pipeline = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    kwargs = {}
    for name, te in zip(TEXT_ENCODER_NAMES, text_encoders):
        kwargs[f"{name}_lora_layers"] = convert_state_dict_to_diffusers(
            _snapshot(get_peft_model_state_dict(te)))
        kwargs[f"{name}_lora_adapter_metadata"] = te.peft_config["default"].to_dict()
    pipeline.save_lora_weights(
        save_directory=directory,
        unet_lora_layers=convert_state_dict_to_diffusers(_snapshot(get_peft_model_state_dict(unet))),
        safe_serialization=True,
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        **kwargs,
    )


def digest(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over the LoRA tensors in key order: equal digests = bit-identical replicas."""
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
