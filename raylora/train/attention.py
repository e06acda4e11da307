"""``train.sdpa_backend``: which scaled-dot-product-attention kernel each attention layer runs.

PyTorch picks an SDPA kernel per call from one fixed priority list, whatever the shape, and
the fastest kernel depends on the shape (head size, sequence lengths, a mask) and the GPU.
``auto`` (on CUDA) records the attention calls of one eager forward on the first training
batch, times every candidate kernel forward + backward on each distinct call, and pins each
attention layer to its fastest, with the other kernels that ran its shapes after it as
fallbacks (an evaluation or preview batch of another size still finds a kernel). A kernel
name pins that kernel alone and is checked on the first batch: a layer it cannot run is an
error naming the layer. cuDNN is a candidate only for families that allow it
(``Family.cudnn_sdpa``): its attention crashed the Flux step on an H100 with an illegal
memory access, which a timing loop cannot catch and survive.

Pinning wraps a layer's ``forward`` in ``sdpa_kernel(..., set_priority=True)``. torch.compile
traces that context without a graph break, and dynamo guards on the wrapped ``forward``, so a
block compiled before the pin (the step-0 evaluation) recompiles instead of running unpinned.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


@dataclass(frozen=True)
class Call:
    """One SDPA call, as much of it as decides which kernels can run it and how fast."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    mask: tuple[int, ...] | None = None
    mask_dtype: torch.dtype | None = None
    causal: bool = False
    gqa: bool = False
    autocast: torch.dtype | None = None  # the region's autocast dtype, None: none

    def describe(self) -> str:
        mask = f", mask {list(self.mask)}" if self.mask else ""
        return f"q {list(self.q)} k {list(self.k)} {str(self.dtype).replace('torch.', '')}{mask}"

    def inputs(self, device) -> tuple[torch.Tensor, ...]:
        # A generator of its own: the training run's random stream stays where it was.
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(s, device=device, dtype=self.dtype, generator=gen, requires_grad=True)
                   for s in (self.q, self.k, self.v))
        mask = None
        if self.mask is not None:  # an all-visible mask: kernels differ by mask support, not values
            mask = (torch.ones(self.mask, device=device, dtype=torch.bool)
                    if self.mask_dtype == torch.bool else
                    torch.zeros(self.mask, device=device, dtype=self.mask_dtype))
        return q, k, v, mask

    def run(self, q, k, v, mask) -> torch.Tensor:
        ctx = (torch.autocast(q.device.type, dtype=self.autocast) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                                  enable_gqa=self.gqa)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _call_of(args, kwargs) -> Call:
    a = {**dict(zip(_SDPA_ARGS, args)), **kwargs}  # callers pass either (diffusers: both)
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    device = q.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return Call(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
                None if mask is None else tuple(mask.shape), None if mask is None else mask.dtype,
                bool(a.get("is_causal", False)), bool(a.get("enable_gqa", False)), autocast)


class _Recorder(TorchFunctionMode):
    """Collects the SDPA calls of a forward under the innermost module that made them."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.stack: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name: self.stack.append(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _leave(self, module, args, output) -> None:
        self.stack.pop()  # returns None: a forward hook's return value replaces the output

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.stack:
            call = _call_of(args, kwargs)
            if call not in self.calls[self.stack[-1]]:
                self.calls[self.stack[-1]].append(call)
        return func(*args, **kwargs)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def record_calls(model: torch.nn.Module, forward: Callable[[], object]) -> dict[str, list[Call]]:
    """``{layer name: its distinct SDPA calls}`` during ``forward()`` (which runs ``model``):
    eagerly, without autograd, and without moving any random number generator, so the run
    that follows draws exactly what it would have drawn without this."""
    rec = _Recorder(model)
    device = next(model.parameters()).device
    fork = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork), torch.no_grad(), \
                torch.compiler.set_stance("force_eager"), rec:
            forward()
    finally:
        rec.close()
    return dict(rec.calls)


def time_call(call: Call, backend: str, device, iters: int = 5) -> float | None:
    """Seconds for one forward + backward of ``call`` on ``backend``; None if that kernel
    cannot run it (shape, dtype, mask or device)."""
    q, k, v, mask = call.inputs(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def once():
        call.run(q, k, v, mask).sum().backward()

    try:
        with sdpa_kernel([BACKENDS[backend]]):
            once()  # warm-up: kernel selection, workspace allocation
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            sync()
    except RuntimeError:  # "No available kernel" and friends
        return None
    return (time.perf_counter() - t0) / max(iters, 1)


@dataclass
class AttentionPlan:
    """Per layer, the kernels in the order they are tried (the first is the chosen one), and
    the timings that chose them (empty when a kernel name was configured)."""

    layers: dict[str, list[str]]
    timings: dict[Call, dict[str, float | None]]

    def pin(self, model: torch.nn.Module) -> None:
        for name, backends in self.layers.items():
            pin_layer(model.get_submodule(name), [BACKENDS[b] for b in backends])

    def summary(self) -> list[str]:
        """One line per distinct call: each candidate's milliseconds and the pick."""
        lines = []
        for call, times in self.timings.items():
            ran = {b: t for b, t in times.items() if t is not None}
            pick = min(ran, key=ran.get) if ran else "-"
            ms = ", ".join(f"{b} {t * 1e3:.3g} ms" if t is not None else f"{b} n/a"
                           for b, t in times.items())
            lines.append(f"{call.describe()}: {ms} -> {pick}")
        return lines


def pin_layer(module: torch.nn.Module, backends: list[SDPBackend]) -> None:
    """Run ``module``'s SDPA calls on ``backends``, tried in that order."""
    inner = module.forward

    def forward(*args, **kwargs):
        with sdpa_kernel(backends, set_priority=True):
            return inner(*args, **kwargs)

    module.forward = forward


def use_family_backends(family) -> None:
    """PyTorch's own per-call choice, less cuDNN's attention on CUDA for a family that does
    not allow it (``Family.cudnn_sdpa``): what every training step and the benches run.
    Process-wide, as PyTorch's switch is."""
    if torch.cuda.is_available() and not family.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)


def candidates(device, cudnn_allowed: bool) -> list[str]:
    """The kernels ``auto`` times on ``device``'s type."""
    if torch.device(device).type != "cuda":
        return ["flash", "math"]  # CPU: the only two SDPA kernels PyTorch has there
    return ["flash", "cudnn", "efficient"] if cudnn_allowed else ["flash", "efficient"]


def plan(calls: dict[str, list[Call]], mode: str, device, names: Iterable[str],
         iters: int = 5) -> AttentionPlan:
    """Each layer's kernels: ``mode`` a kernel name (checked against every call), or
    ``auto`` with ``names`` the candidates, timed once per distinct call."""
    if mode != "auto":
        for layer, layer_calls in calls.items():
            for call in layer_calls:
                if time_call(call, mode, device, iters=0) is None:
                    raise ValueError(
                        f"train.sdpa_backend={mode}: that kernel cannot run the attention of "
                        f"{layer} ({call.describe()}) on {torch.device(device).type}; use "
                        f"auto or default")
        return AttentionPlan({layer: [mode] for layer in calls}, {})
    names = list(names)
    timings = {call: {b: time_call(call, b, device, iters) for b in names}
               for layer_calls in calls.values() for call in layer_calls}
    layers = {}
    for layer, layer_calls in calls.items():
        ran = [b for b in names if all(timings[c][b] is not None for c in layer_calls)]
        ran.sort(key=lambda b: sum(timings[c][b] for c in layer_calls))
        # math last: it runs every shape, so an unforeseen one still finds a kernel
        layers[layer] = ran + ([] if "math" in ran else ["math"])
    return AttentionPlan(layers, timings)
