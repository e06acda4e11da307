"""``scaling.strategy: fsdp``: shard a LoRA-wrapped denoiser with FSDP2 (``fully_shard``).

Shard units are the family's repeated blocks (``Family.repeated_blocks``, the same class
names regional compile uses) plus the root, which takes every parameter outside a block
(embeddings, resnets, conv_in/out). Each unit all-gathers its parameters just before its
forward and frees them after (``reshard_after_forward``), so a rank holds ~1/world of the
weights plus one unit's full copy at a time.

What torch 2.13's FSDP2 allows (``_fsdp_param_group._init_mp_dtypes``): frozen and
trainable parameters may share a unit (the frozen ones get no gradient reduce-scatter),
and only the *trainable* parameters of a unit must share one dtype, so a bf16 frozen base
with fp32 LoRA master weights is accepted. With ``param_dtype`` set, every parameter is
all-gathered in that dtype (bf16 compute) and LoRA gradients are reduced in
``reduce_dtype`` (fp32) into the fp32 shards the optimizer steps (checked over gloo on CPU:
bf16 base + fp32 LoRA + ``param_dtype=bf16`` gives fp32 LoRA grads). ``CPUOffloadPolicy``
needs an accelerator (torch 2.13 raises at the first forward without one).

Checkpoints: ``save_sharded``/``load_sharded`` write/read the trainable parameters and the
optimizer state with ``torch.distributed.checkpoint`` (each rank its own shards, one
``.metadata`` file); DCP reshards on load, so a run saved on N ranks resumes on M.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_denoiser(model: torch.nn.Module, block_classes: tuple[str, ...], *, param_dtype=None,
                   reduce_dtype=torch.float32, reshard_after_forward: bool = True,
                   offload: bool = False) -> list[str]:
    """``fully_shard`` every submodule whose class name is in ``block_classes``, then the
    root, in place (call after ``add_lora``, before building the optimizer: the parameters
    become DTensors). Needs an initialized default process group. Returns the sharded
    module names, blocks first, root last as ""."""
    if offload and not torch.accelerator.is_available():
        # CPUOffloadPolicy copies shards to the accelerator for compute; torch raises
        # "Cannot access accelerator device" only at the first forward without one.
        raise ValueError("fsdp offload moves the frozen base to CPU between uses of a GPU: "
                         "it needs an accelerator, none is available")
    blocks = tuple(block_classes)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no shard units (block classes) given")
    # Collected before sharding: fully_shard renames each class to FSDP<name>.
    names = [n for n, m in model.named_modules() if n and type(m).__name__ in blocks]
    if not names:
        raise ValueError(f"fsdp: no {list(blocks)} in {type(model).__name__}")
    kwargs = {"reshard_after_forward": reshard_after_forward,
              "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for n in names:
        fully_shard(model.get_submodule(n), **kwargs)
    fully_shard(model, **kwargs)
    return names + [""]


def _peft_key(name: str) -> str:
    # peft's get_peft_model_state_dict drops the adapter name: "to_q.lora_A.default.weight"
    # -> "to_q.lora_A.weight".
    return name.replace(".default.", ".")


def full_lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters gathered to full fp32 CPU tensors, keyed as
    ``peft.get_peft_model_state_dict`` keys an unsharded model. A collective: every rank
    calls it; rank 0 gets the dict, the others an empty one."""
    sd = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {_peft_key(k): v.detach().float().cpu() for k, v in sd.items() if "lora_" in k}


def param_bytes_per_rank(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds: a DTensor's local shard, else the whole
    tensor. Excludes the transient all-gathered copies during forward/backward."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


_CKPT_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def save_sharded(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable parameters and the optimizer state to ``directory`` with DCP:
    every rank writes its own shards (a collective; all ranks call it)."""
    msd, osd = get_state_dict(model, optimizer, options=_CKPT_OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(directory))


def load_sharded(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what ``save_sharded`` wrote into ``model``/``optimizer`` in place, on any world
    size (DCP reads each rank's slice of the saved shards)."""
    msd, osd = get_state_dict(model, optimizer, options=_CKPT_OPTIONS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(directory))
    # dcp.load has already refused a checkpoint lacking one of these trainable keys; the
    # frozen base is not in the checkpoint, so the module load must not be strict.
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
