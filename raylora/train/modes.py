"""Modules in eval mode for a block: previews, held-out loss and their encoders run with
LoRA dropout off (and stay deterministic for a seed), training resumes as it was."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def evaluating(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Every module of ``modules`` in eval mode inside the block; afterwards each is put
    back in the mode it had, so a module the caller froze in eval stays there."""
    # each once (a pipeline's denoiser is among its components too), non-modules skipped
    modules = list({id(m): m for m in modules if isinstance(m, torch.nn.Module)}.values())
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
