"""Per-GPU memory of one training worker, estimated before any worker starts (issue #21).

Nothing is downloaded or allocated. Every component is built on the meta device from the
model folder's configs (``model_index.json`` + each component's ``config.json``), the LoRA
is attached with raylora's own ``add_lora``, and one real training step runs on meta
tensors at the configured batch size and resolution: ``raylora.train.step.compute_loss``
(VAE encode and text encoding as the worker does them, the family's ``denoise``, the fp32
loss) and its backward. While it runs,

* a ``saved_tensors_hooks`` pack hook sums what autograd keeps for backward (each storage
  once; parameters and buffers are weights, not activations), and
* a dispatch mode follows every tensor the step creates until it is freed: the bytes still
  alive when the forward returns (what backward needs, including the block inputs that
  gradient checkpointing holds outside autograd's saved tensors) and the peak over forward
  and backward (recomputed blocks, activation gradients, LoRA gradients, temporaries).

Meta tensors run no kernels, so two things a GPU does differently are imitated:

* mixed precision: CUDA autocast's cast policy (matmuls, convolutions and SDPA in the
  lower precision; norms, softmax, reductions and losses in fp32), applied per torch
  function, with autocast's cache of the cast trainable weights; under bf16 the
  denoiser's GroupNorms outside it, in bf16, as training runs them (``train.groupnorm_fp32``);
* SDPA: what the flash / memory-efficient kernels keep for backward (q, k, v, output and an
  fp32 logsumexp), not the [L, L] attention matrix of the math path the meta device takes;
  except where training runs that math path (``train.sdpa_backend: math``) or the plain
  matmul-softmax processor (``model.attention: eager``), which keep that matrix too: then
  the meta device's math path is measured as it is.

Static bytes come from shapes: weights per component in the dtype they load in (quantized
linears at their storage size), LoRA parameters (fp32; the run's ``lora`` section: variant,
dropout, targets), their gradients and the optimizer state; then FSDP sharding (gathered
blocks as ``reshard_after_forward`` holds them, gradients unsharded while accumulating) or
DDP's gradient buckets, a CUDA constant and a fragmentation margin (see the constants
below for the figures and where they come from).

Checked (tests/test_memory.py): the meta model has the loaded model's parameters and
buffers in every family; the meta step saves for backward exactly what the same step saves
on a real CPU model (fp32; bf16 within 1%); the whole estimate is within a few % of the
resident-memory growth of a real CPU step. Against bench/RESULTS.md's H100 runs (Flux.1-dev
architecture, 1024 px, r16, bf16, cached latents, eager, fused AdamW), the allocated bytes
estimated here are 53.1 GiB at batch 1 and 83.4 GiB at batch 2 where max_memory_allocated
measured 50.0 and 76.9 GiB: 6-8% high, from the emulated autocast/kernels.

Not modelled: the optimizer step's own temporaries (after backward, when activations are
gone; small for LoRA), EMA copies (``train.ema_decay``: + one fp32 copy of the LoRA),
``torch.compile`` (regional compile changes activations: in bench/RESULTS.md it lowered
Flux's peak from 50 to 45 GiB), the held-out evaluation, CPU offload.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from raylora.config import control_key, control_values
from raylora.model.quantize import quantizable, quantized_linear_bytes
from raylora.train.norms import GroupNormInWeightDtype, groupnorms_in_weight_dtype, in_weight_dtype

GIB = 1024**3
# Outside PyTorch's allocator, per GPU process: the CUDA context with PyTorch's kernels
# loaded (~0.5 GiB on an H100 with CUDA 12: nvidia-smi's figure for a process whose
# torch.cuda.memory_reserved() is 0), cuBLAS / cuDNN / flash-attention workspaces (tens of
# MiB each). An assumption from those general figures, not measured in this repository
# (bench/gpu_dit.py records max_memory_allocated, which excludes it).
CUDA_OVERHEAD_BYTES = GIB * 3 // 4
# NCCL's communicator buffers when there is more than one worker (NCCL_BUFFSIZE 4 MiB per
# channel and peer, several channels): an assumption of the same kind.
NCCL_BYTES = GIB // 4
# PyTorch's caching allocator reserves more than the tensors it hands out (block rounding,
# split segments that cannot be reused for a larger request). 10% over everything the
# allocator serves: an assumption for fixed-shape training loops, where the ratio of
# reserved to allocated memory usually sits at 5-15%.
FRAGMENTATION = 0.10

MIXED_PRECISION = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANTIZE = ("none", "nf4", "int8", "fp8")
STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "prodigy", "adafactor")
VARIANTS = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}  # lora.variant, as written

# bitsandbytes' 8-bit optimizer state: blocks of 256 with an fp32 absmax, and fp32 state
# below 4096 elements (its min_8bit_size default: small LoRA matrices get no saving).
# Quantized weights' storage is raylora.model.quantize's (quantized_linear_bytes).
BNB_OPTIM_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
# The adapter tensors peft starts at zero (the no-op factor of each variant: LoRA's and
# DoRA's B, LoKr's w1 or w1_a, LoHa's w2_b), by the name part of their parameter.
ZERO_INIT = {"lora_B", "lokr_w1", "lokr_w1_a", "hada_w2_b"}


# ---- the model, on the meta device -----------------------------------------------------


def _read_json(path: str, *parts: str) -> dict | None:
    """A JSON file of a local model folder; None if it is not there."""
    p = os.path.join(path, *parts)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


def read_index(model_path: str) -> dict:
    """``model_index.json`` of a local folder or (from the Hugging Face cache) a hub id."""
    index = _read_json(model_path, "model_index.json")
    if index is not None:
        return index
    from diffusers import DiffusionPipeline

    return dict(DiffusionPipeline.load_config(model_path))


def _keep_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """The modules transformers' ``from_pretrained(torch_dtype=dtype)`` leaves in fp32:
    ``_keep_in_fp32_modules`` under fp16 (T5's ``wo``) and ``_keep_in_fp32_modules_strict``
    under fp16/bf16."""
    names = set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not names:
        return
    for name, module in model.named_modules():
        if names & set(name.split(".")):
            module.to(torch.float32)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside the block (a model built there is
    never materialised in fp32 first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _cast_state(model: nn.Module, dtype: torch.dtype, keep: tuple[str, ...]) -> None:
    """Cast the floating tensors of ``model``'s state dict (parameters, persistent buffers)
    to ``dtype``, or fp32 where a name part is in ``keep``, as diffusers' loader does."""
    for prefix, module in model.named_modules():
        tensors = [(n, p, True) for n, p in module._parameters.items() if p is not None]
        tensors += [(n, b, False) for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, t, is_param in tensors:
            if not t.is_floating_point():
                continue
            parts = f"{prefix}.{name}".split(".") if prefix else [name]
            want = torch.float32 if any(k in parts for k in keep) else dtype
            if is_param:
                module._parameters[name] = nn.Parameter(t.to(want), requires_grad=t.requires_grad)
            else:
                module._buffers[name] = t.to(want)


def meta_component(model_path: str, index: dict, component: str, dtype: torch.dtype,
                   real_buffers: bool = False, revision=None) -> nn.Module:
    """``component`` of the pipeline, by the class ``model_index.json`` names, built from
    its config on the meta device in the dtype ``from_pretrained(torch_dtype=dtype)``
    gives it; frozen and in eval mode, as raylora loads it. ``real_buffers``: parameters
    on meta, buffers computed for real on the CPU (raylora.train.fsdp.hollow_component)."""
    from accelerate import init_empty_weights

    from raylora.model.families.base import import_class

    library, name = index[component][:2]
    klass = import_class(library, name)
    empty = init_empty_weights(include_buffers=False) if real_buffers else torch.device("meta")
    if library == "diffusers":
        config = klass.load_config(model_path, subfolder=component, revision=revision)
        # As diffusers' from_pretrained: built under the dtype (buffers a module computes in
        # fp32 on purpose, Wan's rope, stay fp32), then the state dict's tensors cast to it,
        # except those of _keep_in_fp32_modules (Wan's norms and time embedder: fp32 under
        # any dtype).
        with empty, default_dtype(dtype):
            model = klass.from_config(config)
        _cast_state(model, dtype, tuple(klass._keep_in_fp32_modules or ()))
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, subfolder=component, revision=revision)
        # transformers builds under the dtype, as its from_pretrained does: buffers it
        # computes in fp32 on purpose (rotary inv_freq) stay fp32
        with empty:
            model = klass._from_config(config, dtype=dtype)
        _keep_fp32(model, dtype)
    model.requires_grad_(False)
    model.eval()
    return model


def _tokenizer_max(model_path: str, tokenizer: str) -> int:
    """The tokenizer's ``model_max_length`` from its config (77, CLIP's, when absent)."""
    cfg = _read_json(model_path, tokenizer, "tokenizer_config.json") or {}
    n = cfg.get("model_max_length")
    return int(n) if isinstance(n, (int, float)) and n < 1e6 else 77


def meta_components(model_path: str, dtype: torch.dtype):
    """What ``raylora.model.load.load_components`` returns, built on the meta device (VAE
    and text encoders always: a cached-latents estimate still encodes one batch for the
    shapes of what the cache holds); the tokenizers are stand-ins that only know their
    ``model_max_length``."""
    from raylora.model import families
    from raylora.model.families.base import import_class
    from raylora.model.load import Components

    index = read_index(model_path)
    family = families.detect(index, f"model.pretrained: {model_path}")
    scheduler = dict(import_class(*index["scheduler"][:2]).load_config(model_path, subfolder="scheduler"))

    def component(name: str) -> nn.Module:  # as load_components has it: adapted by the family
        return family.adapt_component(name, meta_component(model_path, index, name, dtype))

    vae = component("vae")
    if dtype == torch.float16 and vae.config.get("force_upcast", False):
        vae.to(torch.float32)  # as raylora.model.load.load_vae
    text = [component(t.encoder) for t in family.text]
    tokenizers = [SimpleNamespace(model_max_length=_tokenizer_max(model_path, t.tokenizer))
                  for t in family.text]
    # A pipeline of experts (Wan 2.2 A14B): the first one stands for the one trained; they
    # share one architecture.
    denoiser = component(family.denoiser)
    shift, scale = family.latent_stats(dict(vae.config))
    return Components(family, tokenizers, text, vae, denoiser, scheduler, shift, scale)


# ---- bytes of weights -------------------------------------------------------------------


def _quantized_weights(model: nn.Module, kind: str) -> dict[int, nn.Linear]:
    """The linears ``raylora.model.quantize.quantize_module`` swaps, keyed by the weight's
    id (none for ``kind`` none)."""
    if kind == "none":
        return {}
    return {id(m.weight): m for _, m in quantizable(model)}


def weight_bytes(model: nn.Module, quantize: str = "none", shards: int = 1) -> int:
    """Bytes of ``model``'s parameters and buffers as loaded (each tensor at its own dtype),
    its plain linears quantized as ``quantize``; ``shards``: FSDP's per-rank share (every
    tensor split along dim 0, padded to a multiple of ``shards``). Trainable (LoRA)
    parameters are not weights and are not counted."""
    quantized = _quantized_weights(model, quantize)
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.requires_grad:
            continue
        if id(t) in quantized:
            # one shard's rows of the quantized layout
            out_f, in_f = t.shape
            total += quantized_linear_bytes((math.ceil(out_f / shards), in_f), quantize, t.dtype)
        elif shards > 1 and t.dim():
            total += math.ceil(t.shape[0] / shards) * (t.numel() // t.shape[0]) * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def largest_dequantized_bytes(model: nn.Module, quantize: str, dtype: torch.dtype) -> int:
    """A quantized linear runs on its weight dequantized to the compute dtype, one layer at
    a time (forward, and again in backward): the largest such transient."""
    layers = _quantized_weights(model, quantize).values()
    item = torch.empty((), dtype=dtype).element_size()
    return max((m.weight.numel() * item for m in layers), default=0)


def block_bytes(model: nn.Module, block_names: Sequence[str], quantize: str = "none",
                dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(largest repeated block, everything outside the blocks) in bytes as FSDP all-gathers
    them (see ``_unit_bytes``)."""
    blocks, root = _unit_bytes(model, block_names, quantize, dtype)
    return max(blocks, default=0), root


def _unit_bytes(model: nn.Module, block_names: Sequence[str], quantize: str,
                dtype: torch.dtype) -> tuple[list[int], int]:
    """(each repeated block, everything outside the blocks) in bytes as FSDP all-gathers
    them: frozen weights as stored (quantized linears at their storage size), LoRA
    parameters in the compute ``dtype`` (FSDP2's mixed-precision param dtype)."""
    item = torch.empty((), dtype=dtype).element_size()
    blocks = [m for m in model.modules() if type(m).__name__ in set(block_names)]
    inside = {id(p) for b in blocks for p in [*b.parameters(), *b.buffers()]}
    quantized = _quantized_weights(model, quantize)

    def gathered(module, only=None) -> int:
        n = 0
        for t in [*module.parameters(), *module.buffers()]:
            if only is not None and not only(t):
                continue
            if t.requires_grad:
                n += t.numel() * item
            elif id(t) in quantized:
                n += quantized_linear_bytes(t.shape, quantize, t.dtype)
            else:
                n += t.numel() * t.element_size()
        return n

    return [gathered(b) for b in blocks], gathered(model, lambda t: id(t) not in inside)


# ---- optimizer state ----------------------------------------------------------------------


def optimizer_state_bytes(optimizer: str, shapes: Sequence[Sequence[int]], *,
                          zero_init: Sequence[bool] | None = None, prodigy_slice_p: int = 1,
                          adafactor_beta1: float | None = None) -> int:
    """Bytes of optimizer state for fp32 trainable tensors of ``shapes``, as each library
    allocates it on its first step. ``zero_init``: per tensor, whether it starts at zero
    (LoRA B: Prodigy then keeps a scalar instead of a copy of it).

    adamw (torch): exp_avg, exp_avg_sq (fp32) + a step scalar. adamw8bit /
    paged_adamw8bit (bitsandbytes): two uint8 states + two fp32 absmax per block of 256;
    tensors under 4096 elements keep fp32 states. prodigy (prodigyopt): exp_avg,
    exp_avg_sq, and s and p0 over every ``slice_p``-th element. adafactor (transformers):
    a row and a column second moment per matrix (the full one for vectors), exp_avg only
    with ``beta1``, and a scalar RMS."""
    zero_init = list(zero_init) if zero_init is not None else [False] * len(shapes)
    total = 0
    for shape, zero in zip(shapes, zero_init):
        n = math.prod(shape)
        if optimizer == "adamw":
            total += 8 * n + 4
        elif optimizer in ("adamw8bit", "paged_adamw8bit"):
            if n < BNB_MIN_8BIT_SIZE:
                total += 8 * n
            else:
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_OPTIM_BLOCK)
        elif optimizer == "prodigy":
            sliced = math.ceil(n / prodigy_slice_p)
            total += 4 * (2 * n + sliced + (1 if zero else sliced))
        elif optimizer == "adafactor":
            second = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if len(shape) >= 2 else n
            total += 4 * (second + (n if adafactor_beta1 is not None else 0) + 1)  # + RMS
        else:
            raise ValueError(f"unknown optimizer {optimizer!r} (one of {', '.join(OPTIMIZERS)})")
    return total


# ---- one training step on meta tensors ------------------------------------------------------

# CUDA autocast's cast policies (ATen's autocast_mode.cpp, AT_FORALL_LOWER_PRECISION_FP /
# AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE), by the torch-level function names that
# reach those ATen ops; and CPU autocast's (KERNEL_CPU), for comparing against a real CPU
# step in the tests.
_LOWER = {
    "cuda": {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
             "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
             "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot", "linear",
             "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot",
             "scaled_dot_product_attention"},
    "cpu": {"conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
            "addbmm", "linear", "matmul", "__matmul__", "__rmatmul__", "conv_tbc",
            "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
            "scaled_dot_product_attention"},
}
_FP32 = {
    "cuda": {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
             "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
             "layer_norm", "group_norm", "rms_norm", "norm", "cosine_similarity",
             "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss",
             "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
             "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
             "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
             "dist", "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax",
             "cumprod", "cumsum", "vector_norm", "matrix_norm", "sum"},
    "cpu": {"prod", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "nll_loss",
            "cdist", "binary_cross_entropy_with_logits", "cosine_embedding_loss",
            "hinge_embedding_loss", "poisson_nll_loss", "margin_ranking_loss",
            "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
            "multilabel_margin_loss"},
}
# fp32_set_opt_dtype: left alone when the call gives a dtype
_OPT_DTYPE = {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "vector_norm",
              "matrix_norm", "sum"}
_SCALAR_READS = {"__int__", "__index__", "item", "__bool__", "tolist"}


class _FlashAttention(torch.autograd.Function):
    """SDPA as the fused kernels keep it: output ``[.., Lq, Dv]`` and an fp32 logsumexp
    ``[B, H, Lq]`` from q, k, v; backward saves q, k, v, output, logsumexp (and a mask,
    converted to the inputs' dtype when boolean, as PyTorch's SDPA does) and allocates the
    three input gradients plus flash-attention 2's fp32 dq accumulator."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        # the kernels write [B, L, H, D] and return it as a [B, H, L, D] view
        out = q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del accum
        return dq, dk, dv, None


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    return _FlashAttention.apply(query, key, value, attn_mask)


# Set while a GroupNorm that training runs outside autocast (raylora.train.norms) runs on
# meta tensors, which have no autocast to leave: the rules cast nothing meanwhile.
_OUTSIDE_AUTOCAST: contextvars.ContextVar[bool] = contextvars.ContextVar("outside_autocast", default=False)


class _MetaGroupNorm(GroupNormInWeightDtype):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token = _OUTSIDE_AUTOCAST.set(True)
        try:
            return super().forward(x)
        finally:
            _OUTSIDE_AUTOCAST.reset(token)


def _to_meta(t, index: bool = False):
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0):
        return t
    if index and t.dtype == torch.bool and t.dim() == 1:
        t = t.nonzero().squeeze(-1)  # the positions it selects, read on the host
    return t.to("meta")


def _meets_host(args: tuple, kwargs: dict) -> bool:
    """Whether a call has both a meta tensor and a host tensor (any host tensor, 0-d ones
    too: ``_host_to_meta`` moves ``repeat_interleave``'s repeats whatever their rank).
    Runs on every op of a meta step: a plain walk, not pytree's flatten and map, which
    took a sixth of a Flux.1 [dev] estimate when run on every call."""
    meta = host = False
    todo = [*args, *kwargs.values()]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.is_meta:
                meta = True
            elif x.device.type == "cpu":
                host = True
            if meta and host:
                return True
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return False


def _host_to_meta(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's host tensors (with values) moved to meta, where the call has meta tensors
    too (``_MetaStep``)."""
    if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
            and args[1].device.type == "cpu":
        return (args[0], args[1].to("meta"), *args[2:]), {**kwargs, "output_size": int(args[1].sum())}
    if name in ("__getitem__", "__setitem__"):
        return (args[0], tree_map(lambda t: _to_meta(t, index=True), args[1]), *args[2:]), kwargs
    return tree_map(_to_meta, (args, kwargs))


class _MetaStep(TorchFunctionMode):
    """Torch-function rules for a step on meta tensors: autocast's casts (``autocast``:
    the device whose policy to follow, None: no mixed precision), fused-kernel SDPA
    (``flash``), and answers for integer / boolean scalars read from meta tensors, which
    have no values. The only such reads in a family's step are Qwen-Image's caption
    masks (trimming the padding after the longest caption; transformers checking for
    padding) and Z-Image's caption lengths: every caption is taken to fill its ``scalar``
    tokens. A host tensor that meets a meta one goes to meta (a family that builds a mask
    on the host so that the denoiser's data-dependent layout can be computed: Qwen-Image
    2.1's): a boolean index as the positions it selects, and ``repeat_interleave`` by host
    repeats with the output size they give."""

    def __init__(self, dtype: torch.dtype | None, autocast: str | None, flash: bool,
                 scalar: int | None):
        super().__init__()
        self.dtype, self.autocast, self.flash, self.scalar = dtype, autocast, flash, scalar
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self):
        self.cache.clear()  # autocast's cache lives as long as its region
        return super().__enter__()

    def _cast(self, t, to: torch.dtype, lower_only: bool = False):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype in (to, torch.float64):
            return t
        if lower_only and t.dtype not in (torch.float16, torch.bfloat16):
            return t
        if to != torch.float32 and t.is_leaf and t.requires_grad:
            # autocast casts a trainable leaf once per autocast region and reuses it
            if id(t) not in self.cache:
                self.cache[id(t)] = (t.to(to), t)
            return self.cache[id(t)][0]
        return t.to(to)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _meets_host(args, kwargs):
            args, kwargs = _host_to_meta(name, args, kwargs)
        if name in _SCALAR_READS and self.scalar is not None and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta and not args[0].is_floating_point():
            # a full mask: its length (each caption's, for a list of them), and "all set"
            # (transformers' padding check)
            if name == "tolist":
                return [self.scalar] * args[0].numel()
            return True if name == "__bool__" else self.scalar
        if self.autocast is not None and not _OUTSIDE_AUTOCAST.get():
            if name in _LOWER[self.autocast]:
                args, kwargs = tree_map(lambda t: self._cast(t, self.dtype), (args, kwargs))
            elif name in _FP32[self.autocast] and not (name in _OPT_DTYPE and kwargs.get("dtype")):
                args, kwargs = tree_map(lambda t: self._cast(t, torch.float32, True), (args, kwargs))
        if self.flash and name == "scaled_dot_product_attention":
            return _sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created under this mode that are still referenced: each
    storage counted once, from its first tensor until its last one is freed. ``static``:
    storages that existed before (weights, parameters), never counted."""

    def __init__(self, static: set[int]):
        super().__init__()
        self.static = static
        self.refs: dict[int, list[int]] = {}
        self.now = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key in self.static:
                continue
            entry = self.refs.get(key)
            if entry is None:
                entry = self.refs[key] = [0, t.untyped_storage().nbytes()]
                self.now += entry[1]
                self.peak = max(self.peak, self.now)
            entry[0] += 1
            weakref.finalize(t, self._release, key)
        return out


class _SavedBytes:
    """``saved_tensors_hooks`` that sum the storages autograd saves for backward, each
    once, leaving out ``static`` ones (weights and parameters)."""

    def __init__(self, static: set[int]):
        self.static = static
        self.seen: dict[int, int] = {}
        # alive until the forward ends, so no storage address is reused while counting
        self.keep: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.static and key not in self.seen:
            self.seen[key] = t.untyped_storage().nbytes()
            self.keep.append(t)
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


@dataclass
class StepProfile:
    """Bytes of one training step's tensors (weights and parameters excluded).

    saved: what autograd's saved-tensor hooks see (each storage once); with gradient
    checkpointing only what is saved outside the checkpointed blocks. activations: alive
    when the forward returns, i.e. what backward needs (saved tensors + the inputs that
    checkpointed blocks hold + the loss). peak: the most alive at once over forward and
    backward. grads: the trainable parameters' gradients after backward."""

    saved: int
    activations: int
    peak: int
    grads: int


def _objective(family, scheduler_config: dict):
    """The objective raylora trains with by default (``setup.build_objective`` with the
    config's defaults): flow matching with the pipeline's shift, or DDPM ε / v."""
    from raylora.train.objective import (
        DDPM,
        FlowMatching,
        flow_shift_from_scheduler,
        scheduler_objective_kind,
    )

    kind = scheduler_objective_kind(scheduler_config)
    if kind == "flow_matching":
        shift, dynamic = flow_shift_from_scheduler(scheduler_config)
        return FlowMatching(shift=shift, dynamic=dynamic, seq_len=family.image_seq_len)
    from diffusers import DDPMScheduler

    return DDPM(DDPMScheduler.from_config(scheduler_config), kind)


def raw_batch(comps, batch_size: int, resolution: int | tuple[int, int],
              max_sequence_length: int | None = None, device="meta",
              control_images: int = 0) -> dict[str, torch.Tensor]:
    """A worker's uncached batch for ``comps.family``: uint8 pixels (``resolution``: a
    square's side, or a bucket's ``(width, height)``), token ids of each tokenizer's full
    length (and attention masks), SDXL's size/crop columns (which other families
    ignore); ``control_images``: that many input images' pixels per sample too (an edit
    pair's, data.control_images; True: one)."""
    b = batch_size
    w, h = (resolution, resolution) if isinstance(resolution, int) else resolution
    size = torch.tensor([h, w], device=device).expand(b, 2)
    batch = {"pixel_values": torch.zeros(b, 3, h, w, dtype=torch.uint8, device=device),
             "original_size": size.clone(),
             "crop_top_left": torch.zeros(b, 2, dtype=torch.long, device=device),
             "target_size": size.clone()}
    for i in range(int(control_images)):
        batch[control_key("control_values", i)] = torch.zeros(b, 3, h, w, dtype=torch.uint8, device=device)
    for t, tok in zip(comps.family.text, comps.tokenizers):
        n = t.length(tok.model_max_length, max_sequence_length)
        batch[t.ids_key] = torch.zeros(b, n, dtype=torch.long, device=device)
        if t.mask_key:
            batch[t.mask_key] = torch.ones(b, n, dtype=torch.long, device=device)
    return batch


def cached_batch(comps, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the latent cache feeds a worker for ``batch``: posterior parameters and the
    family's conditioning, encoded here (no grad) and detached."""
    from raylora.train.encode import vae_posterior

    with torch.no_grad(), _MetaStep(None, None, False, _longest(batch)):
        out = {"latent_params": vae_posterior(comps.family, comps.vae, batch["pixel_values"])}
        for i, raw in enumerate(control_values(batch, "control_values")):
            out[control_key("control_params", i)] = vae_posterior(comps.family, comps.vae, raw)
        out.update(comps.family.encode_text(comps.text_encoders, batch))
    return {k: v.detach() for k, v in out.items()}


def _inputs_words(n) -> str:
    """The estimate's header words for ``n`` input images a sample (0/None: none)."""
    n = int(n or 0)
    return "" if not n else ", an input image per sample" if n == 1 else f", {n} input images per sample"


def _longest(batch) -> int:
    """Token columns' length: token ids of a raw batch, caption masks of a cached one
    (Z-Image reads each caption's length from its mask in the step)."""
    return max((v.shape[1] for k, v in batch.items()
                if k.startswith("input_ids") or k.endswith("mask")), default=0)


def attach_lora(comps, rank: int, targets: Sequence[str] | None = None,
                train_text_encoder: bool = False, **lora) -> tuple[list, list]:
    """raylora's adapter on ``comps``: denoiser LoRA (fp32, on ``targets`` or the family's
    defaults) and, with ``train_text_encoder``, the text encoders the stock pipeline loads
    LoRA into. ``lora``: the run's other ``LoraSection`` fields (variant, dropout, factor,
    decompose_both, text_encoder_target_modules): the adapter the worker builds, whose
    parameters and activations depend on them. Returns (denoiser params, text-encoder
    params)."""
    from raylora.config import LoraSection
    from raylora.model.lora import add_lora, add_text_encoder_lora

    fam = comps.family
    section = LoraSection(rank=rank, target_modules=list(targets) if targets else None, **lora)
    params = add_lora(comps.denoiser, section, fam.default_lora_targets(comps.denoiser))
    te_params = []
    if train_text_encoder:
        names = fam.text_encoder_lora()
        trained = {t.encoder: enc for t, enc in zip(fam.text, comps.text_encoders) if t.encoder in names}
        te_params = add_text_encoder_lora(trained, section)
    return params, te_params


def profile_step(comps, batch: dict[str, torch.Tensor], *, mixed_precision: str = "no",
                 gradient_checkpointing: bool = False, autocast_device: str = "cuda",
                 groupnorm_fp32: bool = False, fused_attention: bool = True) -> StepProfile:
    """Run one training step (``compute_loss`` + backward) of ``comps`` (LoRA attached, on
    the denoiser and maybe text encoders) on ``batch`` and measure its tensors' bytes.
    Meta components and batch: the GPU is imitated (``autocast_device``'s autocast policy,
    fused SDPA). Real ones (CPU): the same step and measurement under real
    ``torch.autocast``, which the tests compare against. ``groupnorm_fp32``: as
    ``train.groupnorm_fp32`` (false: under bf16 the denoiser's GroupNorms run in bf16).
    ``fused_attention`` (meta only): SDPA as the fused kernels keep it; false: SDPA's math
    path, whose [B, heads, L, L] attention matrix is kept for backward (eager attention and
    ``train.sdpa_backend: math`` keep the same)."""
    from raylora.train.setup import enable_gradient_checkpointing

    trained = [m for m in comps.text_encoders if any(p.requires_grad for p in m.parameters())]
    if gradient_checkpointing:
        enable_gradient_checkpointing(comps.family, comps.denoiser, trained)
    comps.denoiser.train()
    for m in trained:
        m.train()
    norms = []
    if in_weight_dtype(mixed_precision, groupnorm_fp32):  # as train.setup does
        meta = comps.denoiser.device.type == "meta"
        norms = groupnorms_in_weight_dtype(comps.denoiser, _MetaGroupNorm if meta else GroupNormInWeightDtype)
    try:
        return _measure(comps, batch, mixed_precision, autocast_device, fused_attention)
    finally:
        for m in norms:  # the components are cached: they can be profiled again without it
            m.__class__ = torch.nn.GroupNorm
        if gradient_checkpointing:  # the components can be profiled again without it
            comps.family.checkpoint_blocks(comps.denoiser, enable=False)
            for m in trained:
                (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()


def _measure(comps, batch, mixed_precision: str, autocast_device: str,
             fused_attention: bool = True) -> StepProfile:
    from raylora.train.step import FrozenParts, compute_loss

    fam = comps.family
    dtype = MIXED_PRECISION[mixed_precision]
    modules = [m for m in (comps.denoiser, comps.vae, *comps.text_encoders) if m is not None]
    trainable = [p for m in modules for p in m.parameters() if p.requires_grad]
    te_params = [p for m in comps.text_encoders for p in m.parameters() if p.requires_grad]
    meta = comps.denoiser.device.type == "meta"
    static = {_storage_key(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
    static |= {_storage_key(t) for t in batch.values()}
    parts = FrozenParts(fam, comps.vae, comps.text_encoders, _objective(fam, comps.scheduler_config),
                        dtype, latent_shift=comps.latent_shift, latent_scale=comps.latent_scale,
                        guidance=1.0, text_encoder_params=te_params)
    saved, live = _SavedBytes(static), _LiveBytes(static)
    mixed = mixed_precision != "no"
    if meta:
        rules = _MetaStep(dtype, autocast_device if mixed else None, fused_attention, _longest(batch))
    else:
        rules = torch.autocast(comps.denoiser.device.type, dtype=dtype, enabled=mixed)

    def forward() -> torch.Tensor:
        # Accelerate autocasts the prepared model's forward (the loss is fp32 either way).
        # Only the loss leaves: whatever else stays alive is what backward needs.
        with rules:
            return compute_loss(comps.denoiser, parts, batch)

    with live:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = forward()
        activations = live.now
        saved.keep.clear()  # backward frees what it has used, as it goes
        # Checkpointed blocks are recomputed in backward: on meta tensors under the same
        # rules, so the engine is called directly (Tensor.backward is a torch function,
        # which the rules would run with themselves switched off); real autocast is
        # restored for the recompute by torch.utils.checkpoint itself.
        with rules if meta else contextlib.nullcontext():
            Variable._execution_engine.run_backward(
                (loss,), (torch.ones_like(loss),), False, False, (), True, True)
        del loss
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
    for p in trainable:
        p.grad = None
    return StepProfile(saved.total, activations, live.peak, grads)


# ---- the estimate ---------------------------------------------------------------------------


def size(nbytes: float) -> str:
    """``12.34 GiB``; ``12.3 MiB`` under 1 GiB (tiny test models)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


@dataclass
class Estimate:
    """Per-GPU bytes of one training worker, line by line (see ``table()``).

    ``weights``: frozen components as loaded (per-rank share under FSDP), by pipeline
    component name. ``activations``: alive when the forward returns. ``backward``: the
    further bytes at the step's peak (activation gradients, recomputed blocks,
    temporaries), beyond activations and LoRA gradients. ``gathered``: FSDP's unsharded
    units. ``buckets``: DDP's gradient buckets. ``margin``: the fragmentation margin over
    all of it; ``overhead``: CUDA context, workspaces, NCCL. ``preview``: what a preview
    (``validation.prompts``) loads besides, with cached latents: the text encoders and the
    VAE the workers never loaded, as a worker without the cache holds them (``at_preview``)."""

    weights: dict[str, int]
    lora_params: int
    lora_grads: int
    optimizer: int
    activations: int
    backward: int
    gathered: int = 0
    buckets: int = 0
    dequantize: int = 0
    overhead: int = 0
    margin: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    saved: int = 0  # autograd's saved tensors alone (the hooks' view), for reference
    lora_count: int = 0  # trainable parameters (elements)
    preview: int = 0

    @property
    def allocated(self) -> int:
        """What PyTorch's allocator hands out at the peak (no overhead, no margin)."""
        return (sum(self.weights.values()) + self.lora_params + self.lora_grads + self.optimizer
                + self.activations + self.backward + self.gathered + self.buckets + self.dequantize)

    @property
    def total(self) -> int:
        return self.allocated + self.margin + self.overhead

    @property
    def at_preview(self) -> int:
        """Bytes while a preview samples (0 when it loads nothing new): what stays between
        steps (weights, LoRA and its gradients, optimizer state, FSDP's gathered units) and
        ``preview``, with the fragmentation margin and the CUDA overhead; the sampling
        forward's own activations (no autograd) are not counted."""
        if not self.preview:
            return 0
        kept = (sum(self.weights.values()) + self.lora_params + self.lora_grads + self.optimizer
                + self.gathered + self.preview)
        return kept + int(FRAGMENTATION * kept) + self.overhead

    @property
    def peak(self) -> int:
        """The larger of a training step's ``total`` and ``at_preview``."""
        return max(self.total, self.at_preview)

    def gib(self) -> float:
        return self.peak / GIB

    def fits(self, gpu_gb: float) -> bool:
        """Whether the estimate fits a GPU of ``gpu_gb`` GiB (the figure a card is sold by:
        an "80 GB" H100 holds 79.6 GiB, so leave headroom or give what nvidia-smi shows):
        a training step and, when the run renders previews, a preview."""
        return self.peak <= gpu_gb * GIB

    def lines(self) -> list[tuple[str, int]]:
        """(label, bytes) per line of ``table()``, the total aside."""
        s = self.settings
        mp = {"no": "fp32"}.get(s.get("mixed_precision", "bf16"), s.get("mixed_precision"))
        rows = []
        for name, n in self.weights.items():
            kind = s.get("quantize_text_encoders" if name.startswith("text_encoder") else "quantize", "none")
            if name == "vae":
                kind = "none"
            label = mp if kind == "none" else f"{kind} linears"
            if s.get("strategy") == "fsdp" and name == s.get("denoiser"):
                label += f", 1/{s.get('world_size')} shard"
            rows.append((f"weights: {name} ({label})", n))
        rows += [
            (f"LoRA parameters ({self.lora_count / 1e6:.1f} M, fp32)", self.lora_params),
            ("LoRA gradients (fp32" + (", unsharded while accumulating" if self.lora_grads > self.lora_params
                                        else "") + ")", self.lora_grads),
            (f"optimizer state ({s.get('optimizer', 'adamw')})", self.optimizer),
            ("activations (kept for backward)" + (", checkpointed" if s.get("gradient_checkpointing") else ""),
             self.activations),
            ("backward working memory", self.backward),
        ]
        if self.gathered:
            rows.append(("FSDP all-gathered units" + ("" if s.get("reshard_after_forward", True)
                                                      else ", every block (no reshard after forward)"),
                         self.gathered))
        if self.buckets:
            rows.append(("DDP gradient buckets", self.buckets))
        if self.dequantize:
            rows.append(("dequantized layer (transient)", self.dequantize))
        rows.append((f"allocator fragmentation ({FRAGMENTATION:.0%})", self.margin))
        if self.overhead:
            rows.append(("CUDA context, workspaces" + (", NCCL" if s.get("world_size", 1) > 1 else ""),
                         self.overhead))
        return rows

    def table(self) -> str:
        """A small table in GiB (MiB for a total under 1 GiB: tiny test models), 2
        decimals, with what was estimated above it."""
        s = self.settings
        mp = {"no": "fp32"}.get(s.get("mixed_precision"), s.get("mixed_precision"))
        r = s.get("resolution")
        r = f"{r[0]}x{r[1]}" if isinstance(r, (list, tuple)) else r  # a bucket: width x height
        head = (f"{s.get('family', '?')} {r} px, batch {s.get('batch_size')}, "
                f"{VARIANTS.get(s.get('lora_variant'), 'LoRA')} r{s.get('lora_rank')}, {mp}, {s.get('strategy')} x"
                f"{s.get('world_size')}, quantize {s.get('quantize')}, gradient checkpointing "
                f"{'on' if s.get('gradient_checkpointing') else 'off'}, "
                f"{'cached latents' if s.get('cached_latents') else 'VAE + text encoders on the worker'}"
                f"{_inputs_words(s.get('control_images'))}"
                f"{'' if s.get('fused_attention', True) else ', unfused attention ([L, L] kept)'}")
        rows = self.lines() + [("total per GPU", self.total)]
        after = []
        if self.preview:
            after = [("previews: text encoders + VAE they load", self.preview),
                     ("at a preview (weights, LoRA, optimizer state, these)", self.at_preview)]
        width = max(len(r[0]) for r in rows + after)
        unit, div = ("GiB", GIB) if self.peak >= GIB else ("MiB", 2**20)
        out = [head, f"{'':{width}}    {unit}"]
        for i, (name, n) in enumerate(rows):
            if i == len(rows) - 1:
                out.append("-" * (width + 10))
            out.append(f"{name:{width}}  {n / div:7.2f}")
        out += [f"{name:{width}}  {n / div:7.2f}" for name, n in after]
        return "\n".join(out)

    def advice(self, gpu_gb: float, accepts: Callable[[list[str]], bool] | None = None
               ) -> list[str]:
        """Config changes that would make this fit ``gpu_gb`` GiB, each re-estimated, with
        the new total: ``key=value (...): N GiB`` (MiB under 1 GiB, see ``size``). Empty
        when it fits already, or when no single change (nor a pair of them) does.
        ``accepts``: whether the run's config takes these ``key=value`` overrides
        (``preflight.config_accepts``); a change it refuses is not named (FSDP beside
        ``train.compile: regional``, the cache beside a random crop, ...)."""
        if self.fits(gpu_gb):
            return []
        a = self.settings["args"]
        # (the overrides, the estimate arguments they change, a note for the reader)
        options: list[tuple[list[str], dict, str]] = []
        world = a["world_size"]
        worlds = ([world] if a["strategy"] == "ddp" and world > 1 else []) + [w for w in (2, 4, 8) if w > world]
        # FSDP shards a base it loads unquantized (raylora.config refuses it with a quantized
        # one): from a quantized base, the change is both
        plain = [] if a["quantize"] == "none" else ["model.quantize=none"]
        for w in worlds:
            options.append((["scaling.strategy=fsdp"] + ([f"scaling.num_workers={w}"] if w != world else []) + plain,
                            {"strategy": "fsdp", "world_size": w, **({"quantize": "none"} if plain else {})}, ""))
        if a["strategy"] == "fsdp" and not a["reshard_after_forward"]:
            options.append((["scaling.fsdp.reshard_after_forward=true"], {"reshard_after_forward": True}, ""))
        if a["quantize"] != "nf4":
            options.append((["model.quantize=nf4"], {"quantize": "nf4"}, ""))
        if not a["gradient_checkpointing"]:
            options.append((["train.gradient_checkpointing=true"], {"gradient_checkpointing": True}, ""))
        b = a["batch_size"] // 2
        while b >= 1:  # (the global batch it changes: _batch_note)
            options.append(([f"train.batch_size={b}"], {"batch_size": b}, ""))
            b //= 2
        if self.preview:
            options.append((["validation.prompts=[]"], {"previews": False}, "no previews while training"))
        if a["quantize_text_encoders"] != "nf4" and (self.preview or not a["cached_latents"]):
            options.append((["model.quantize_text_encoders=nf4"], {"quantize_text_encoders": "nf4"}, ""))
        if not a["cached_latents"] and not a["train_text_encoder"]:
            options.append((["data.cache=latents"], {"cached_latents": True}, ""))
        found = _fitting(a, options, gpu_gb, single=True, accepts=accepts)
        if not found:
            found = _fitting(a, options, gpu_gb, single=False, accepts=accepts)
        return found


def _fitting(args: dict, options: list[tuple[list[str], dict, str]], gpu_gb: float, single: bool,
             accepts: Callable[[list[str]], bool] | None = None) -> list[str]:
    """The options (or pairs of them) that fit, one per kind of change: options come
    smallest FSDP world and largest batch first, so the first of a kind that fits is the
    one to name."""
    combos = [[o] for o in options] if single else [
        [o1, o2] for i, o1 in enumerate(options) for o2 in options[i + 1:] if o1[1].keys().isdisjoint(o2[1])]
    out, kinds = [], set()
    for combo in combos:
        change = {k: v for _, c, _ in combo for k, v in c.items()}
        kind = frozenset(change)
        new = {**args, **change}
        if kind in kinds or not _allowed(new):
            continue
        factor, keep = _global_batch(args, new)
        # sized with the more accumulation of the two, so that it holds whether the note's
        # accumulation is taken or not (under FSDP accumulating keeps gradients unsharded)
        e = estimate(**{**new, "gradient_accumulation_steps": max(keep or 0, args["gradient_accumulation_steps"])})
        if not e.fits(gpu_gb):
            continue
        labels = [" ".join(keys) + (f" ({note})" if note else "") for keys, _, note in combo]
        refused = False
        if accepts is not None:
            keys = [k for ks, _, _ in combo for k in ks]
            extra = next((x for x in ([], *SPEED_ONLY) if accepts(keys + x)), None)
            if extra is None:
                continue
            labels += extra
            # the accumulation that keeps the global batch, checked with the change: one
            # the config refuses (train.cuda_graphs takes none) is not offered as the way
            refused = keep is not None and not accepts(keys + extra + [f"train.gradient_accumulation_steps={keep}"])
        if factor != 1:
            labels.append(f"({_batch_note(factor, keep, refused)})")
        out.append(f"{' '.join(labels)}: {size(e.peak)}")
        kinds.add(kind)
    return out


def _global_batch(args: dict, new: dict) -> tuple[Fraction, int | None]:
    """How the change from estimate arguments ``args`` to ``new`` multiplies the global
    batch (train.batch_size × accumulation × workers) at the same accumulation, and the
    accumulation that keeps it (None: no whole number does, or it is unchanged)."""
    factor = Fraction(new["batch_size"] * new["world_size"], args["batch_size"] * args["world_size"])
    keep = args["gradient_accumulation_steps"] / factor
    return factor, int(keep) if factor != 1 and keep.denominator == 1 else None


def _batch_note(factor: Fraction, keep: int | None, refused: bool) -> str:
    """The advice's note on a change of the global batch (``_global_batch``): the
    accumulation that keeps it, else by how much it changes (train.scale_lr scales the
    learning rate with it)."""
    if keep is not None and not refused:
        return f"train.gradient_accumulation_steps={keep} keeps the global batch"
    return (f"the global batch x{factor}, the learning rate too with train.scale_lr"
            + (f"; the config refuses train.gradient_accumulation_steps={keep}" if refused else ""))


# Changes that cost speed, not what is trained: the advice adds one where the config takes
# a change only with it (FSDP runs eager: the shipped Flux.1 job compiles its blocks).
SPEED_ONLY = (["train.compile=none"], ["train.compile=none", "train.compile_cache_uri=null"])


def _allowed(args: dict) -> bool:
    """Whether the config would accept these settings: raylora.config refuses FSDP with a
    quantized base, text-encoder LoRA, another optimizer than AdamW or another
    variant than LoRA, and quantized text encoders that nothing loads
    (cached latents, no previews), so advice never names those combinations. (Without
    the run's config at hand; ``accepts`` checks the rest with it.)"""
    idle = args["cached_latents"] and not args["previews"] and args["quantize_text_encoders"] != "none"
    return not idle and (args["strategy"] != "fsdp"
                         or (args["quantize"] == "none" and not args["train_text_encoder"]
                             and args["optimizer"] == "adamw" and args["lora_variant"] == "lora"))


@functools.lru_cache(maxsize=4)
def _components(model_path: str, mixed_precision: str, lora_rank: int,
                lora_targets: tuple[str, ...] | None, train_text_encoder: bool,
                lora_options: tuple[tuple[str, Any], ...] = ()):
    """Meta components with the LoRA attached: (components, denoiser params, text-encoder
    params). ``lora_options``: ``attach_lora``'s further fields as (key, value) pairs.
    Cached: ``advice`` re-estimates the same model with other settings."""
    comps = meta_components(model_path, MIXED_PRECISION[mixed_precision])
    params, te_params = attach_lora(comps, lora_rank, lora_targets, train_text_encoder,
                                    **dict(lora_options))
    return comps, params, te_params


@functools.lru_cache(maxsize=32)
def _profile(model_path: str, batch_size: int, resolution: int | tuple[int, int], lora_rank: int,
             lora_targets: tuple[str, ...] | None, mixed_precision: str, gradient_checkpointing: bool,
             cached_latents: bool, train_text_encoder: bool, max_sequence_length: int | None,
             autocast_device: str, groupnorm_fp32: bool = False,
             control_images: int = 0, lora_options: tuple[tuple[str, Any], ...] = (),
             fused_attention: bool = True) -> StepProfile:
    """The step's profile; cached, since strategy, quantization and optimizer do not
    change it."""
    comps, _, _ = _components(model_path, mixed_precision, lora_rank, lora_targets, train_text_encoder,
                              lora_options)
    batch = raw_batch(comps, batch_size, resolution, max_sequence_length,
                      control_images=control_images)
    if cached_latents:
        batch = cached_batch(comps, batch)
    run = comps if not cached_latents else replace(comps, vae=None, text_encoders=[])
    return profile_step(run, batch, mixed_precision=mixed_precision,
                        gradient_checkpointing=gradient_checkpointing, autocast_device=autocast_device,
                        groupnorm_fp32=groupnorm_fp32, fused_attention=fused_attention)


def estimate(model_path: str, *, batch_size: int = 1, resolution: int | tuple[int, int] = 1024,
             lora_rank: int = 16,
             lora_targets: Sequence[str] | None = None, mixed_precision: str = "bf16",
             gradient_checkpointing: bool = False, strategy: str = "ddp", world_size: int = 1,
             quantize: str = "none", quantize_text_encoders: str = "none",
             optimizer: str = "adamw", cached_latents: bool = False,
             train_text_encoder: bool = False, max_sequence_length: int | None = None,
             prodigy_slice_p: int = 1, adafactor_beta1: float | None = None,
             device: str = "cuda", samples_per_row: int = 1, groupnorm_fp32: bool = False,
             previews: bool = False, control_images: int = 0, lora_variant: str = "lora",
             lora_dropout: float = 0.0, lora_factor: int = -1, lora_decompose_both: bool = False,
             text_encoder_targets: Sequence[str] | None = None, lora_init_from: bool = False,
             reshard_after_forward: bool = True, gradient_accumulation_steps: int = 1,
             fused_attention: bool = True) -> Estimate:
    """Per-GPU bytes of one raylora training worker for the pipeline folder ``model_path``
    (configs only are read: a folder of ``model_index.json`` and ``config.json`` files is
    enough). ``batch_size``: per worker and micro-step. ``strategy``/``world_size``: ddp or
    fsdp over that many workers. ``quantize``: the frozen denoiser's linears;
    ``quantize_text_encoders``: the text encoders' (with ``cached_latents``, where workers
    load neither VAE nor text encoders: those a preview loads). ``device``: "cuda" adds the CUDA constant
    (and NCCL's with more than one worker); "cpu" leaves both out and follows CPU
    autocast. ``samples_per_row``: 2 with prior preservation, whose micro-batch is
    ``batch_size`` instance samples plus as many class samples. ``groupnorm_fp32``: as
    ``train.groupnorm_fp32``. ``previews``: the run renders ``validation.prompts``.
    ``control_images``: each sample brings that many input images (an edit pair's, True:
    one), whose tokens the denoiser sees beside the noisy ones (data.control_images,
    data.control_inputs). ``lora_*``, ``text_encoder_targets``: the ``lora`` section's
    (``lora_init_from``: whether the adapter starts from one, so that none of its tensors
    starts at zero). ``reshard_after_forward``: ``scaling.fsdp``'s.
    ``gradient_accumulation_steps``: as ``train``'s (more than one micro-step per optimizer
    step keeps FSDP's gradients unsharded between them). ``fused_attention``: the
    denoiser's attention runs a fused SDPA kernel (flash, memory-efficient, cuDNN); false:
    one that keeps the [L, L] attention matrix (model.attention eager, train.sdpa_backend
    math)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    for key, kind in (("quantize", quantize), ("quantize_text_encoders", quantize_text_encoders)):
        if kind not in QUANTIZE:
            raise ValueError(f"{key}: {kind!r} is not one of {', '.join(QUANTIZE)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    args = dict(model_path=model_path, batch_size=batch_size, resolution=resolution,
                lora_rank=lora_rank, lora_targets=lora_targets, mixed_precision=mixed_precision,
                gradient_checkpointing=gradient_checkpointing, strategy=strategy,
                world_size=world_size, quantize=quantize,
                quantize_text_encoders=quantize_text_encoders, optimizer=optimizer,
                cached_latents=cached_latents, train_text_encoder=train_text_encoder,
                max_sequence_length=max_sequence_length, prodigy_slice_p=prodigy_slice_p,
                adafactor_beta1=adafactor_beta1, device=device, samples_per_row=samples_per_row,
                groupnorm_fp32=groupnorm_fp32, previews=previews, control_images=control_images,
                lora_variant=lora_variant, lora_dropout=lora_dropout, lora_factor=lora_factor,
                lora_decompose_both=lora_decompose_both, text_encoder_targets=text_encoder_targets,
                lora_init_from=lora_init_from, reshard_after_forward=reshard_after_forward,
                gradient_accumulation_steps=gradient_accumulation_steps, fused_attention=fused_attention)
    targets = tuple(lora_targets) if lora_targets else None
    # the adapter as the worker builds it: the variant sets its parameters (LoHa two pairs,
    # LoKr Kronecker factors, DoRA a magnitude) and activations (DoRA's second base matmul),
    # dropout keeps a dropped copy of each adapted layer's input for backward
    options = (("variant", lora_variant), ("dropout", lora_dropout), ("factor", lora_factor),
               ("decompose_both", lora_decompose_both))
    if text_encoder_targets:
        options += (("text_encoder_target_modules", tuple(text_encoder_targets)),)
    comps, params, te_params = _components(model_path, mixed_precision, lora_rank, targets,
                                           train_text_encoder, options)
    prof = _profile(model_path, batch_size * samples_per_row, resolution, lora_rank, targets, mixed_precision,
                    gradient_checkpointing, cached_latents, train_text_encoder,
                    max_sequence_length, device, groupnorm_fp32, control_images, options, fused_attention)
    fam = comps.family
    dtype = MIXED_PRECISION[mixed_precision]
    fsdp = strategy == "fsdp"
    w = world_size if fsdp else 1
    den = comps.denoiser
    weights = {fam.denoiser: weight_bytes(den, quantize, shards=w)}
    if not cached_latents:
        for t, enc in zip(fam.text, comps.text_encoders):
            weights[t.encoder] = weight_bytes(enc, quantize_text_encoders)
        weights["vae"] = weight_bytes(comps.vae)
    trainable = params + te_params
    # per rank under FSDP: the denoiser's LoRA is sharded with its blocks (dim 0, padded)
    lora_shapes = [((math.ceil(p.shape[0] / w),) + tuple(p.shape[1:])) for p in params]
    lora_shapes += [tuple(p.shape) for p in te_params]
    lora = sum(math.prod(s) * 4 for s in lora_shapes)
    # Prodigy keeps a scalar for a tensor that starts at zero (each variant's no-op factor),
    # a copy of one that does not: every one of an adapter loaded by lora.init_from
    zero = [not lora_init_from and bool(ZERO_INIT & set(n.split(".")))
            for m in (den, *comps.text_encoders) for n, p in m.named_parameters() if p.requires_grad]
    opt = optimizer_state_bytes(optimizer, lora_shapes, zero_init=zero,
                                prodigy_slice_p=prodigy_slice_p, adafactor_beta1=adafactor_beta1)
    full_grads = prof.grads
    grads = lora  # fp32 like the parameters; sharded like them
    if fsdp and w > 1 and gradient_accumulation_steps > 1:
        # The micro-steps before a group's last run without gradient sync (train.step):
        # FSDP2 then keeps each LoRA gradient unsharded (fp32, its reduce dtype) until the
        # last one's reduce-scatter.
        grads = full_grads
    # The measured step holds every unsharded gradient at its peak; under FSDP each block's
    # is reduce-scattered as backward leaves it, so only the sharded ones remain.
    backward = max(0, prof.peak - prof.activations - full_grads)
    gathered = buckets = 0
    if fsdp and w > 1:
        blocks, root = _unit_bytes(den, fam.repeated_blocks, quantize, dtype)
        # The root unit stays gathered. Resharding after forward: the block computing and
        # the one prefetched; without (scaling.fsdp.reshard_after_forward: false), every
        # block stays gathered from its forward to its backward.
        gathered = root + (2 * max(blocks, default=0) if reshard_after_forward else sum(blocks))
    elif world_size > 1:
        # DDP's buckets copy the denoiser's gradients (Accelerate leaves
        # gradient_as_bucket_view off); trained text encoders are all-reduced outside DDP
        buckets = 4 * sum(p.numel() for p in params)
    dequantize = max(largest_dequantized_bytes(den, quantize, dtype),
                     0 if cached_latents else max((largest_dequantized_bytes(e, quantize_text_encoders, dtype)
                                                   for e in comps.text_encoders), default=0))
    est = Estimate(weights, lora, grads, opt, prof.activations, backward, gathered, buckets, dequantize,
                   saved=prof.saved, lora_count=sum(p.numel() for p in trainable))
    est.margin = int(FRAGMENTATION * est.allocated)
    if previews and cached_latents:
        # A preview builds the stock pipeline around the trained denoiser on every rank
        # with the text encoders and the VAE the cache spared the workers, loaded as a
        # worker without the cache holds them (raylora.train.preview.encoders_for).
        est.preview = weight_bytes(comps.vae) + sum(weight_bytes(e, quantize_text_encoders)
                                                    for e in comps.text_encoders)
    if device == "cuda":
        est.overhead = CUDA_OVERHEAD_BYTES + (NCCL_BYTES if world_size > 1 else 0)
    from raylora.train.objective import scheduler_objective_kind

    # what the family's own checks of a changed config need (preflight.config_accepts:
    # advice names no change that `raylora train` refuses for this model)
    vae_config = _read_json(model_path, "vae", "config.json") or dict(comps.vae.config)
    est.settings = {**args, "family": fam.name, "denoiser": fam.denoiser, "args": args,
                    "grid": fam.vae_factor(vae_config) * fam.patch,
                    "objective": scheduler_objective_kind(comps.scheduler_config)}
    return est


def optimizer_args(train) -> dict:
    """``optimizer_state_bytes``'s settings from a config's ``train`` section."""
    return dict(optimizer=train.optimizer, prodigy_slice_p=train.prodigy.slice_p,
                adafactor_beta1=train.adafactor.beta1)


def config_args(cfg) -> dict:
    """``estimate``'s arguments (the model path aside) for a validated ``RayLoraConfig``:
    two configs with equal arguments have equal estimates."""
    from raylora.data.buckets import bucket_set

    m, t, s, lo, d = cfg.model, cfg.train, cfg.scaling, cfg.lora, cfg.data
    # Buckets: the one with the most pixels is the step that needs the most memory.
    buckets = bucket_set(d)
    return dict(
        batch_size=t.batch_size, resolution=buckets.largest() if buckets else d.resolution,
        lora_rank=lo.rank,
        lora_targets=tuple(lo.target_modules) if lo.target_modules else None,
        mixed_precision=t.mixed_precision, gradient_checkpointing=t.gradient_checkpointing,
        strategy=s.strategy, world_size=s.max_workers, quantize=m.quantize,
        quantize_text_encoders=m.quantize_text_encoders, cached_latents=d.cache == "latents",
        train_text_encoder=lo.train_text_encoder, max_sequence_length=m.max_sequence_length,
        device="cuda" if s.use_gpu else "cpu", samples_per_row=2 if d.prior_preservation else 1,
        groupnorm_fp32=t.groupnorm_fp32, previews=bool(cfg.validation.prompts),
        control_images=d.references(), lora_variant=lo.variant, lora_dropout=lo.dropout,
        lora_factor=lo.factor, lora_decompose_both=lo.decompose_both,
        text_encoder_targets=tuple(lo.text_encoder_target_modules) if lo.train_text_encoder else None,
        lora_init_from=lo.init_from is not None,
        reshard_after_forward=s.fsdp.reshard_after_forward,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        # eager attention and SDPA's math kernel keep each layer's [L, L] attention matrix
        # for backward; the other kernels (default and auto pick flash, memory-efficient or
        # cuDNN where they run) keep q, k, v, the output and a logsumexp
        fused_attention=m.attention == "sdpa" and t.sdpa_backend != "math", **optimizer_args(t))


def from_config(cfg, **changes) -> Estimate:
    """The estimate for a validated ``RayLoraConfig``; ``changes``: ``estimate`` arguments
    to override. A model in object storage has its JSON configs copied to a temporary
    folder first, a hub model's are downloaded at ``model.revision`` (a run's: the commit
    its plan pinned, ``RayLoraConfig.at_commit``); nothing else is read."""
    with configs_folder(cfg, changes.pop("model_path", None)) as path:
        return estimate(path, **{**config_args(cfg), **changes})


@contextlib.contextmanager
def configs_folder(cfg, path: str | None = None):
    """A local folder with the configs of ``path`` (default: ``model.pretrained``), all a
    meta-device model needs: the folder itself, a hub model's configs downloaded at
    ``model.revision``, or the JSON files of one in object storage copied to a temporary
    folder (gone afterwards)."""
    from raylora.model.load import is_hub_id, resolve_model_path

    path = path or resolve_model_path(cfg.model)
    if "://" in path and not path.startswith("file://"):
        with tempfile.TemporaryDirectory(prefix="raylora-configs-") as tmp:
            yield _configs_only(path, cfg.storage.client(), tmp)
        return
    if is_hub_id(path):
        from raylora.model import hub

        path = hub.configs(path, cfg.model.revision)
    yield path


_CONFIG_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json")


def _configs_only(uri: str, store, dest: str) -> str:
    """The JSON files of a stored pipeline folder (model_index.json, each component's
    config.json, the scheduler's and tokenizers' configs) copied into the local folder
    ``dest``; returns it."""
    from raylora import storage

    root = uri.rstrip("/")
    for f in store.list_files(uri):
        rel = f[len(root) + 1:]
        if rel == "model_index.json" or (rel.count("/") == 1 and os.path.basename(rel) in _CONFIG_FILES):
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(dest, rel), "wb") as out:
                out.write(store.read_bytes(storage.join(uri, rel)))
    return dest


# ---- a configs-only Flux.1-dev folder, for worked examples -----------------------------------

# black-forest-labs/FLUX.1-dev: model_index.json and the component configs' architecture
# values (transformer as bench/gpu_dit.py's FLUX_DEV; CLIP ViT-L/14 text; T5 v1.1 XXL
# encoder; the 16-channel VAE; the pipeline's scheduler), with no weights.
FLUX_DEV_CONFIGS = {
    "model_index.json": {
        "_class_name": "FluxPipeline", "_diffusers_version": "0.30.0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]},
    "transformer/config.json": {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
        "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24,
        "num_layers": 19, "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768},
    "vae/config.json": {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True, "in_channels": 3,
        "latent_channels": 16, "latents_mean": None, "latents_std": None, "layers_per_block": 2,
        "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024,
        "scaling_factor": 0.3611, "shift_factor": 0.1159, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "use_post_quant_conv": False, "use_quant_conv": False},
    "text_encoder/config.json": {
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768,
        "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "num_attention_heads": 12,
        "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768, "vocab_size": 49408},
    "text_encoder_2/config.json": {
        "architectures": ["T5EncoderModel"], "model_type": "t5", "d_ff": 10240, "d_kv": 64,
        "d_model": 4096, "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": True, "is_gated_act": True, "layer_norm_epsilon": 1e-06, "num_decoder_layers": 24,
        "num_heads": 64, "num_layers": 24, "relative_attention_max_distance": 128,
        "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 32128},
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True},
    "tokenizer/tokenizer_config.json": {"model_max_length": 77},
    "tokenizer_2/tokenizer_config.json": {"model_max_length": 512},
}


def write_config_folder(dest: str, configs: dict[str, dict] = FLUX_DEV_CONFIGS) -> str:
    """Write a weights-free pipeline folder (``relative path → JSON``) that ``estimate``
    reads; the default is Flux.1-dev. Returns ``dest``."""
    for rel, data in configs.items():
        p = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            json.dump(data, f, indent=1)
    return dest
