"""Diffusers LoRA layout ⇄ the kohya-ss / ComfyUI / A1111 single-file layout.

diffusers writes ``unet.<module path>.lora.down.weight`` (+ ``lora.up``) and keeps alpha in
the file's metadata; kohya-style tools expect ``lora_unet_<module path with _>.lora_down
.weight`` (+ ``lora_up``) and one ``.alpha`` scalar per module, with scale = alpha / rank.
For SD 1.x/2.x the module paths are the diffusers UNet's own (as sd-scripts names them),
which ComfyUI and A1111 map onto their UNets; text-encoder LoRA becomes ``lora_te_``
(SDXL: ``lora_te1_``/``lora_te2_``) + the transformers module path. No torch code runs on load: safetensors only.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "unet."
KOHYA_PREFIX = "lora_unet_"
KOHYA_FILE = "adapter_kohya.safetensors"
_SUFFIXES = {
    ".lora.down.weight": ".lora_down.weight", ".lora.up.weight": ".lora_up.weight",
    # diffusers writes text-encoder LoRA in its older per-layer layout
    ".lora_linear_layer.down.weight": ".lora_down.weight",
    ".lora_linear_layer.up.weight": ".lora_up.weight",
}


def _kohya_module(kohya_prefix: str, path: str) -> str:
    """kohya name of a module. sd-scripts names CLIP modules from ``text_model.``, which
    transformers 5's CLIPTextModel no longer has in its module paths: put it back."""
    if kohya_prefix != KOHYA_PREFIX and not path.startswith("text_model."):
        path = "text_model." + path
    return kohya_prefix + path.replace(".", "_")


def to_kohya(sd: dict[str, torch.Tensor], alpha: float | dict[str, float],
             prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """diffusers LoRA tensors → kohya keys, plus ``<module>.alpha`` for every module.
    ``alpha``: one value, or one per component (``{"unet": 8, "text_encoder": 4}``);
    ``prefixes``: diffusers component prefix → kohya prefix (``Family.kohya_names()``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        src = next((p for p in sorted(prefixes, key=len, reverse=True) if key.startswith(p)), None)
        if src is None:
            raise ValueError(f"{key}: no kohya name for this component (known: {sorted(prefixes)})")
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{key}: not a lora.down/lora.up weight")
        module = _kohya_module(prefixes[src], key[len(src) : -len(suffix)])
        a = alpha[src[:-1]] if isinstance(alpha, dict) else alpha
        out[module + _SUFFIXES[suffix]] = value.contiguous()
        out[module + ".alpha"] = torch.tensor(float(a))
    return out


def from_kohya(sd: dict[str, torch.Tensor], module_names: list[str],
               prefixes: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya tensors → (diffusers tensors, alpha per diffusers module). ``module_names`` are
    the diffusers module paths, UNet ones bare or all with their component prefix (``_`` is
    ambiguous in kohya names, so they are matched, not parsed)."""
    full = [n if n.startswith(tuple(prefixes)) else PREFIX + n for n in module_names]
    by_flat = {}
    for n in full:
        src = next(p for p in sorted(prefixes, key=len, reverse=True) if n.startswith(p))
        by_flat[_kohya_module(prefixes[src], n[len(src):])] = n
    bare = all(not n.startswith(tuple(prefixes)) for n in module_names)
    out, alphas = {}, {}
    for key, value in sd.items():
        flat, _, leaf = key.partition(".")
        module = by_flat[flat]
        if leaf == "alpha":
            alphas[module[len(PREFIX):] if bare else module] = float(value)
        else:
            kind = {"lora_down.weight": "down.weight", "lora_up.weight": "up.weight"}[leaf]
            layer = "lora" if module.startswith(PREFIX) else "lora_linear_layer"
            out[f"{module}.{layer}.{kind}"] = value
    return out, alphas


def export_kohya(diffusers_file: str, dest_file: str, base_model: str, family) -> dict:
    """Write the kohya file for a diffusers adapter file of ``family``; alpha and rank come
    from the adapter metadata diffusers stored (per component). Returns the kohya metadata
    written."""
    with safe_open(diffusers_file, framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
        raw = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    components = sorted({k.split(".", 1)[0] for k in sd})
    ranks, alphas = {}, {}
    for comp in components:
        # diffusers prefixes each peft config key with its component ("unet.r").
        meta = {k.split(".", 1)[1]: v for k, v in raw.items() if k.startswith(comp + ".")}
        if meta.get("use_rslora") or meta.get("rank_pattern") or meta.get("alpha_pattern"):
            raise ValueError(f"{diffusers_file}: rsLoRA or per-module rank/alpha has no kohya equivalent here")
        ranks[comp] = int(meta.get("r") or next(
            v.shape[0] for k, v in sd.items() if k.startswith(comp + ".") and k.endswith("lora.down.weight")))
        alphas[comp] = float(meta.get("lora_alpha") or ranks[comp])
    main = family.denoiser if family.denoiser in ranks else components[0]
    kohya_meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(ranks[main]),
        "ss_network_alpha": f"{alphas[main]:g}",
        "ss_sd_model_name": base_model,
        "raylora_source": "diffusers adapter converted by raylora",
    }
    if any(c.startswith("text_encoder") for c in components):
        kohya_meta["ss_network_args"] = json.dumps({"train_text_encoder": True})
    save_file(family.kohya_state_dict(sd, alphas), dest_file, metadata=kohya_meta)
    return kohya_meta
