"""peft LoKr / LoHa weights → the LyCORIS file ComfyUI, Forge and LyCORIS' own kohya loader
read: ``lora_unet_<module path, "." → "_">.<tensor>`` plus an ``alpha`` scalar per module.

peft chose LyCORIS' tensor names (``lokr_w1``, ``lokr_w2_a``, ``hada_w1_a``, ...) and shapes,
so only the module prefix and the scale differ:

* LoHa: ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b) · alpha/r in both: alpha is written as is.
* LoKr: peft scales kron(w1, w2) by alpha/r always; LyCORIS and ComfyUI scale by alpha/r
  only when a factor is a low-rank pair and by 1 when both are full matrices (its "full
  matrix mode", where alpha is meaningless). For that case the scale is folded into w2.
"""

from __future__ import annotations

import torch

UNET_PREFIX = "lora_unet_"
LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")


def _modules(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft keys ``<module>.<tensor>`` grouped by module path."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        module, _, tensor = key.rpartition(".")
        if tensor not in LOKR + LOHA:
            raise ValueError(f"{key}: not a LoKr/LoHa tensor (LyCORIS export is for "
                             "lora.variant lokr and loha)")
        out.setdefault(module, {})[tensor] = value
    return out


def lycoris_state_dict(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """``sd``: peft-layout denoiser tensors (``get_peft_model_state_dict``); ``config``: its
    peft LoKrConfig / LoHaConfig (r, alpha). Returns the LyCORIS file's tensors."""
    r, alpha = config.r, float(config.alpha)
    out = {}
    for module, tensors in _modules(sd).items():
        name = UNET_PREFIX + module.replace(".", "_")
        tensors = dict(tensors)
        module_alpha = alpha
        if "lokr_w1" in tensors and "lokr_w2" in tensors:
            tensors["lokr_w2"] = tensors["lokr_w2"] * (alpha / r)
            module_alpha = float(r)  # ignored by the loaders in this mode; kept for tools
        for tensor, value in tensors.items():
            out[f"{name}.{tensor}"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(module_alpha)
    return out
