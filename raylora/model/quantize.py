"""Quantized frozen base (``model.quantize``, ``model.quantize_text_encoders``): QLoRA-style.

Every ``nn.Linear`` of a frozen component is swapped, in place, for a quantized layer:
bitsandbytes' ``Linear4bit`` (nf4) or ``Linear8bitLt`` (int8, LLM.int8 without outlier
columns), or ``Float8Linear`` (fp8: float8_e4m3 weights with a per-output-row scale,
dequantized layer by layer). Convolutions, norms and embeddings keep the training dtype.
peft then wraps the quantized linears with its bitsandbytes-aware LoRA layers, so the
adapter's keys are the usual ``lora_A``/``lora_B`` ones and load into the unquantized
stock pipeline.

Not diffusers' ``BitsAndBytesConfig``: its quantizer refuses to run without CUDA ("No GPU
found"), and this one path serves diffusers and transformers models on CPU and GPU alike.
Each layer is quantized on the device it will train on, one at a time, so the device
never holds the full-precision component.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

NF4_BLOCKSIZE = 64  # bitsandbytes' 4-bit quantization block (one absmax per block)
NF4_BLOCKSIZE2 = 256  # its double quantization: one fp32 absmax per 256 blocks' absmax


class _Float8Matmul(torch.autograd.Function):
    """``x @ (w8 · scale)ᵀ`` that saves the 1-byte weight, not the dequantized one: the
    backward dequantizes again (as bitsandbytes' 4-bit matmul does), so activation memory
    does not grow by a full-precision copy of every layer's weight."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias):
        ctx.save_for_backward(w8, scale)
        w = _dequantize_fp8(w8, scale, x.dtype)
        return nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)

    @staticmethod
    def backward(ctx, grad):
        w8, scale = ctx.saved_tensors
        return grad @ _dequantize_fp8(w8, scale, grad.dtype), None, None, None


def _dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w8.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Float8Linear(nn.Linear):
    """A frozen linear with float8_e4m3 weights ``[out, in]`` and a scale per output row
    in the compute dtype. Frozen parameters, not buffers: DDP would broadcast buffers
    every step. The weight's bits are kept as uint8, so nothing that reads a model's dtype
    from its first floating parameter (diffusers' ``ModelMixin.dtype``) sees float8."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(device, torch.float32)
        fp8_max = torch.finfo(torch.float8_e4m3fn).max
        # clamped at the compute dtype's smallest normal: below it fp16 (train.
        # mixed_precision=fp16) rounds a row's scale to 0, and a zero or tiny row to 0/0 = NaN
        scale = (w.abs().amax(dim=1, keepdim=True) / fp8_max).clamp(
            min=torch.finfo(compute_dtype).tiny).to(compute_dtype)
        self.weight = _frozen((w / scale.float()).to(torch.float8_e4m3fn).view(torch.uint8))
        self.weight_scale = _frozen(scale)
        self.bias = None
        if linear.bias is not None:
            self.bias = _frozen(linear.bias.detach().to(device))
        # peft creates the LoRA layers in this dtype (not the storage dtype)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else self.compute_dtype
        return _Float8Matmul.apply(x.to(dtype), self.weight, self.weight_scale, self.bias)

    def dequantized(self) -> torch.Tensor:
        return _dequantize_fp8(self.weight, self.weight_scale, self.compute_dtype)


def check_supported(kind: str, key: str, device) -> None:
    """Raise a ValueError naming ``key`` when ``kind`` cannot run on ``device``."""
    if kind == "none":
        return
    device = torch.device(device)
    if kind == "fp8":
        if device.type != "cuda":
            raise ValueError(f"{key}: fp8 is for GPUs (this worker trains on {device}); use "
                             "nf4 or int8")
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"{key}: fp8 needs torch >= 2.1 (float8 dtypes); this is "
                             f"torch {torch.__version__}")
        return
    try:
        importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise ValueError(f"{key}: {kind} needs bitsandbytes ({exc})") from None


def _skipped(name: str, keep: list[str]) -> bool:
    parts = name.split(".")
    return any(k in parts or name.endswith(k) for k in keep)


def quantizable(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(qualified name, layer) of every linear ``quantize_module`` swaps: each plain
    ``nn.Linear`` outside the modules the model keeps in fp32 (``_keep_in_fp32_modules``,
    e.g. T5's ``wo``), and each whose weight another module shares (a tied LM head, as
    Flux.2 [klein]'s Qwen3 has: quantized, it became a 4-bit copy beside the embedding it
    was, more bytes than none, and the estimate counted the shared tensor once, at 4
    bits). A memory estimate reads the same list, so the two cannot disagree."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and not _skipped(name, keep) and owners[id(m.weight)] == 1]


def quantize_module(model: nn.Module, kind: str, compute_dtype: torch.dtype, device) -> int:
    """Swap ``model``'s ``quantizable`` linears for ``kind`` (nf4 | int8 | fp8) quantized
    ones on ``device``, in place. Returns the number of layers quantized. Marks the model
    ``is_loaded_in_4bit``/``8bit``: what peft reads to pick its bitsandbytes LoRA layers.
    Whether ``kind`` may run on ``device`` is ``check_supported``'s call, made before the
    model is loaded."""
    if kind == "none":
        return 0
    swaps = quantizable(model)
    for name, child in swaps:
        parent, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent), child_name, _quantized(child, kind, compute_dtype, device))
    if kind == "nf4":
        model.is_loaded_in_4bit = True
    elif kind == "int8":
        model.is_loaded_in_8bit = True
    model.raylora_quantize = kind
    return len(swaps)


def _quantized(linear: nn.Linear, kind: str, compute_dtype: torch.dtype, device) -> nn.Module:
    if kind == "fp8":
        return Float8Linear(linear, compute_dtype, device)
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if kind == "nf4":
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias,
                              compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                     blocksize=NF4_BLOCKSIZE, module=q)
        # bitsandbytes repacks 4-bit weights in place for its CPU inference kernel the first
        # time a layer runs in eval mode without grad; that kernel rejects layers narrower
        # than a block and the training path does not expect the repacked layout.
        q.support_avx512bf16_for_cpu = False
    elif kind == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias,
                                has_fp16_weights=False, threshold=0.0, device="meta")
        q.weight = bnb.nn.Int8Params(linear.weight.data.cpu(), requires_grad=False,
                                     has_fp16_weights=False)
    else:
        raise ValueError(f"unknown quantization {kind!r}")
    if bias:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return q.to(device)  # bitsandbytes quantizes on this move


def settle_int8(model: nn.Module) -> int:
    """Put ``model``'s int8 layers in the state their first forward leaves them in
    (bitsandbytes' ``Linear8bitLt`` moves the int8 codes and row scales from the weight
    to ``layer.state`` then); returns the number of layers moved. Before torch.compile:
    dynamo guards on ``weight.CB``, so that move at step 0 recompiled every block at
    step 1. Not at quantization: until that first forward, bitsandbytes (and a memory
    count of its statistics) finds them on the weight."""
    n = 0
    for m in model.modules():
        if callable(getattr(m, "init_8bit_state", None)) and getattr(m.weight, "CB", None) is not None:
            m.init_8bit_state()
            n += 1
    return n


# ---- sizes, for a memory estimate (raylora.memory) ---------------------------------------

def quantized_linear_bytes(weight_shape, kind: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Storage of one frozen ``nn.Linear`` weight ``[out, in]`` once ``quantize_module``
    swapped it with ``dtype`` as the compute dtype. nf4: bitsandbytes' packed 4-bit codes +
    double-quantized absmax (a uint8 per block of 64, an fp32 per 256 blocks) + the
    layer's NF4 code table and offset; int8: int8 codes + an fp32 scale per row
    (bitsandbytes' SCB); fp8: float8 codes + a ``dtype`` scale per row (``Float8Linear``)."""
    out_f, in_f = weight_shape
    n = out_f * in_f
    if kind == "nf4":
        blocks = math.ceil(n / NF4_BLOCKSIZE)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_BLOCKSIZE2) + 16 * 4 + 4
    if kind == "int8":
        return n + 4 * out_f
    if kind == "fp8":
        return n + out_f * torch.empty((), dtype=dtype).element_size()
    raise ValueError(f"unknown quantization {kind!r} (one of nf4, int8, fp8)")
