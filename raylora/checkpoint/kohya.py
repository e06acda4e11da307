"""Diffusers LoRA layout ⇄ the kohya-ss / ComfyUI / A1111 single-file layout.

diffusers writes ``unet.<module path>.lora.down.weight`` (+ ``lora.up``) and keeps alpha in
the file's metadata; kohya-style tools expect ``lora_unet_<module path with _>.lora_down
.weight`` (+ ``lora_up``) and one ``.alpha`` scalar per module, with scale = alpha / rank.
For SD 1.x/2.x the module paths are the diffusers UNet's own (as sd-scripts names them),
which ComfyUI and A1111 map onto their UNets. No torch code runs on load: safetensors only.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "unet."
KOHYA_PREFIX = "lora_unet_"
KOHYA_FILE = "adapter_kohya.safetensors"
_SUFFIXES = {".lora.down.weight": ".lora_down.weight", ".lora.up.weight": ".lora_up.weight"}


def to_kohya(sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """diffusers UNet LoRA tensors → kohya keys, plus ``<module>.alpha`` for every module."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if not key.startswith(PREFIX):
            raise ValueError(f"{key}: only UNet LoRA weights convert to kohya (prefix {PREFIX!r})")
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{key}: not a lora.down/lora.up weight")
        module = KOHYA_PREFIX + key[len(PREFIX) : -len(suffix)].replace(".", "_")
        out[module + _SUFFIXES[suffix]] = value.contiguous()
        out[module + ".alpha"] = torch.tensor(float(alpha))
    return out


def from_kohya(sd: dict[str, torch.Tensor], module_names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya tensors → (diffusers tensors, alpha per diffusers module). ``module_names`` are
    the diffusers module paths (``_`` is ambiguous in kohya names, so they are matched)."""
    by_flat = {n.replace(".", "_"): n for n in module_names}
    out, alphas = {}, {}
    for key, value in sd.items():
        flat, _, leaf = key[len(KOHYA_PREFIX):].partition(".")
        module = by_flat[flat]
        if leaf == "alpha":
            alphas[module] = float(value)
        else:
            kind = {"lora_down.weight": "lora.down.weight", "lora_up.weight": "lora.up.weight"}[leaf]
            out[f"{PREFIX}{module}.{kind}"] = value
    return out, alphas


def export_kohya(diffusers_file: str, dest_file: str, base_model: str) -> dict:
    """Write the kohya file for a diffusers adapter file; alpha and rank come from the
    adapter metadata diffusers stored. Returns the kohya metadata written."""
    with safe_open(diffusers_file, framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    # diffusers prefixes the peft config keys with the component ("unet.r").
    meta = {k.split(".", 1)[1] if k.startswith(PREFIX) else k: v for k, v in meta.items()}
    if meta.get("use_rslora") or meta.get("rank_pattern") or meta.get("alpha_pattern"):
        raise ValueError(f"{diffusers_file}: rsLoRA or per-module rank/alpha has no kohya equivalent here")
    rank = int(meta.get("r") or next(v.shape[0] for k, v in sd.items() if k.endswith("lora.down.weight")))
    alpha = float(meta.get("lora_alpha") or rank)
    kohya_meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": f"{alpha:g}",
        "ss_sd_model_name": base_model,
        "raylora_source": "diffusers adapter converted by raylora",
    }
    save_file(to_kohya(sd, alpha), dest_file, metadata=kohya_meta)
    return kohya_meta
