"""Exponential moving average of the LoRA weights. No Ray.

decay_n = min(ema_decay, (1 + n) / (10 + n)) for the n-th update, 0 for the first, which
copies the weights (diffusers' ``EMAModel.get_decay`` without ``use_ema_warmup``): early on, when the weights move fast from their zero start, the average follows
them closely instead of dragging the initial no-op adapter along for thousands of steps.
The shadow weights are fp32 whatever the training precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def ema_decay_at(n: int, max_decay: float) -> float:
    """Decay used by the n-th update (0-based): the first keeps nothing of the initial
    weights, as ``EMAModel`` does."""
    return 0.0 if n == 0 else min(max_decay, (1 + n) / (10 + n))


class LoraEMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.decay = decay
        self.num_updates = 0
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter], where: torch.Tensor | None = None) -> float:
        """shadow ← d·shadow + (1−d)·param; returns d.

        ``where`` (a bool tensor, e.g. "this step's loss is finite") gates the update on
        the device, without reading the flag back. A gated-off update leaves the shadow
        as it was but still advances the warmup count."""
        d = ema_decay_at(self.num_updates, self.decay)
        w = 1 - d if where is None else where.to(self.shadow[0].device, torch.float32) * (1 - d)
        for s, p in zip(self.shadow, params):
            s.lerp_(p.detach().float(), w)
        self.num_updates += 1
        return d

    @contextmanager
    def swapped_in(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """The EMA weights in ``params`` for the duration (export, evaluation)."""
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for s, p in zip(self.shadow, params):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for v, p in zip(saved, params):
                    p.copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"shadow.{i}": s for i, s in enumerate(self.shadow)}
        sd["num_updates"] = torch.tensor(self.num_updates)
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if len(sd) - 1 != len(self.shadow):
            raise ValueError(f"EMA state has {len(sd) - 1} tensors, the adapter {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            s.copy_(sd[f"shadow.{i}"])
        self.num_updates = int(sd["num_updates"])
