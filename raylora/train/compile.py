"""``train.compile``: ``torch.compile`` the denoiser in place, whole or block by block.

In place (``Module.compile``): the module, its parameters and state-dict keys stay what
they were (no ``_orig_mod.`` prefix), so DDP, LoRA export and resume are unchanged. Static
shapes: every training batch of a run has one shape (drop_last, one resolution).

``regional`` compiles each repeated block (diffusers' ``_repeated_blocks``: the transformer
blocks) on its own. The blocks of one class share their compiled code, so a model compiles
a handful of small graphs (one per distinct block shape) instead of one graph of the whole
network, and the code between blocks (embeddings, resnets and up/down sampling of a UNet,
the added conditioning of SDXL) runs eagerly, so nothing there can break or recompile a
graph. A UNet's resnet blocks (``UNET_RESNET_BLOCKS``) are not compiled by default: on an
H100 (bench/RESULTS.md, 2026-11-23) they took SD 1.5's cold compile past 90 s (it has ~15
kinds of ResnetBlock2D, each a forward and a backward graph), while its transformer
blocks alone compiled in 49 s for 1.35x the eager step. (SDXL with its resnet blocks: 93 s,
1.58x eager; SDXL without them is not measured yet.)
"""

from __future__ import annotations

from collections import Counter

import torch

MODES = ("none", "regional", "full")

# Denoisers whose diffusers class names no ``_repeated_blocks``.
FALLBACK_BLOCKS = {
    "SD3Transformer2DModel": ("JointTransformerBlock",),
}
# A UNet's other repeated block, for callers that pass it (see the module docstring).
UNET_RESNET_BLOCKS = ("ResnetBlock2D",)


def repeated_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The class names ``regional`` compiles in ``model`` by default."""
    name = type(model).__name__
    return tuple(getattr(model, "_repeated_blocks", None) or FALLBACK_BLOCKS.get(name, ()))


def compile_denoiser(model: torch.nn.Module, mode: str, blocks=None, **compile_kwargs) -> list[str]:
    """Compile ``model`` in place; returns the names of the compiled modules ("" for the
    whole model). ``blocks``: class names to compile in ``regional`` mode (default:
    ``repeated_blocks(model)``). ``compile_kwargs`` go to ``torch.compile``."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}: expected one of {MODES}")
    if mode == "none":
        return []
    compile_kwargs.setdefault("dynamic", False)
    if mode == "full":
        model.compile(**compile_kwargs)
        return [""]
    blocks = tuple(blocks) if blocks is not None else repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no repeated blocks known for regional compile")
    names = [n for n, m in model.named_modules() if type(m).__name__ in blocks]
    if not names:
        raise ValueError(f"regional compile: no {list(blocks)} in {type(model).__name__}")
    per_class = Counter(type(model.get_submodule(n)).__name__ for n in names)
    # Dynamo keeps one cache of compiled variants per code object, shared by every block
    # of a class, and a variant is compiled per distinct shape and guarded attribute (SD
    # 1.5's UNet has 15 kinds of ResnetBlock2D), per grad mode and train/eval (previews).
    # Past recompile_limit (8) it silently runs the rest eagerly, so allow every instance
    # its own variant in both modes.
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 2 * max(per_class.values()))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * len(names))
    for n in names:
        model.get_submodule(n).compile(**compile_kwargs)
    return names
