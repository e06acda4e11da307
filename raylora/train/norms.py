"""``train.groupnorm_fp32``: the denoiser's GroupNorms in the weights' dtype under bf16.

Autocast runs ``group_norm`` in fp32: under bf16 each GroupNorm of a UNet's resnets casts
its bf16 activation to fp32 and hands the next op an fp32 tensor, which the convolution
after it casts back. On an H200 those casts were a large part of SD 1.5's copy kernels;
running the GroupNorms in bf16 (CUDA's kernel keeps its mean and variance in fp32) made the
regional-compiled step 1.07x and its peak memory 17 % smaller (bench/RESULTS.md,
2026-11-26 22:19). The DiT families' denoisers have no GroupNorm, so nothing changes there.

The modules change class in place, so their parameters, state-dict keys, hooks and the
compiled blocks that call them stay as they were.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class GroupNormInWeightDtype(torch.nn.GroupNorm):
    """A GroupNorm that runs in its weights' dtype, outside autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype if self.weight is not None else x.dtype
        outside = (torch.autocast(x.device.type, enabled=False)
                   if torch.amp.is_autocast_available(x.device.type)
                   else contextlib.nullcontext())  # meta: no autocast to leave
        with outside:
            return F.group_norm(x.to(dtype), self.num_groups, self.weight, self.bias, self.eps)


def in_weight_dtype(mixed_precision: str, groupnorm_fp32: bool) -> bool:
    """Whether a run with these ``train`` values runs its GroupNorms in the weights'
    dtype: what training does and the memory estimate imitates."""
    return mixed_precision == "bf16" and not groupnorm_fp32


def groupnorms_in_weight_dtype(module: torch.nn.Module,
                               cls: type[GroupNormInWeightDtype] = GroupNormInWeightDtype
                               ) -> list[torch.nn.Module]:
    """Every plain ``nn.GroupNorm`` under ``module`` becomes a ``cls`` (subclasses are left
    alone: their forward is their own). Returns the modules changed; setting their
    ``__class__`` back to ``nn.GroupNorm`` undoes it."""
    changed = [m for m in module.modules() if type(m) is torch.nn.GroupNorm]
    for m in changed:
        m.__class__ = cls
    return changed
