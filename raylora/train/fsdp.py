"""``scaling.strategy: fsdp``: shard a LoRA-wrapped denoiser with FSDP2 (``fully_shard``).

Shard units are the family's repeated blocks (``Family.repeated_blocks``, the same class
names regional compile uses) plus the root, which takes every parameter outside a block
(embeddings, resnets, conv_in/out). Each unit all-gathers its parameters just before its
forward and frees them after (``reshard_after_forward``), so a rank holds ~1/world of the
weights plus one unit's full copy at a time. Under bf16/fp16, what ``from_pretrained``
keeps in fp32 (``_keep_in_fp32_modules``: Wan's time embedder and norms) is a unit of its
own gathered in fp32, and a bare fp32-kept parameter (Wan's ``scale_shift_table``s) is
left out of FSDP, whole on every rank (``_fp32_kept``).

What torch 2.13's FSDP2 allows (``_fsdp_param_group._init_mp_dtypes``): frozen and
trainable parameters may share a unit (the frozen ones get no gradient reduce-scatter),
and only the *trainable* parameters of a unit must share one dtype, so a bf16 frozen base
with fp32 LoRA master weights is accepted. With ``param_dtype`` set, every parameter is
all-gathered in that dtype (bf16 compute) and LoRA gradients are reduced in
``reduce_dtype`` (fp32) into the fp32 shards the optimizer steps (checked over gloo on CPU:
bf16 base + fp32 LoRA + ``param_dtype=bf16`` gives fp32 LoRA grads). ``CPUOffloadPolicy``
needs an accelerator (torch 2.13 raises at the first forward without one).

Loading (``hollow_component``, then ``shard_and_load``): the denoiser is built from its
config with every parameter a zero-byte stand-in (one element expanded to the parameter's
shape) on the rank's device, so peft attaches LoRA to it exactly as to a loaded model (the
same RNG draws, hence the same initial adapter as a DDP run with the same seed). The
stand-ins then become meta tensors, ``fully_shard`` makes meta shards of them, and
``to_empty`` allocates only this rank's shards, into which each rank reads just its rows
of each weight from the safetensors files. No rank ever holds the whole base model.

Checkpoints: ``save_sharded``/``load_sharded`` write/read the trainable parameters and the
optimizer state with ``torch.distributed.checkpoint`` (each rank its own shards, one
``.metadata`` file); DCP reshards on load, so a run saved on N ranks resumes on M.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def shard_denoiser(model: torch.nn.Module, block_classes: tuple[str, ...], *, param_dtype=None,
                   reduce_dtype=torch.float32, reshard_after_forward: bool = True,
                   offload: bool = False) -> list[str]:
    """``fully_shard`` every submodule whose class name is in ``block_classes``, then the
    root, in place (call after ``add_lora``, before building the optimizer: the parameters
    become DTensors). Needs an initialized default process group. Returns the sharded
    module names: the fp32-kept units (``_fp32_kept``) first, then the blocks, the root
    last as "".

    Forward inputs are not cast (``cast_forward_inputs=False``): raylora runs the sharded
    model under autocast, as DDP does, and autocast casts what each op computes in. FSDP's
    default would cast every float input of every unit to ``param_dtype``: the RoPE cos/sin
    and guidance of Flux, Flux.2 and Chroma would reach the blocks in bf16, where DDP and
    the stock pipeline keep them fp32 (Flux's step-0 loss moved by 6e-5)."""
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
    kept_units, kept_bare = _fp32_kept(model, param_dtype)
    kwargs = {"reshard_after_forward": reshard_after_forward,
              "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
              "ignored_params": kept_bare or None}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   cast_forward_inputs=False)
    # Children before parents: a unit takes the parameters of its subtree that no unit
    # inside it took. The fp32-kept units gather in their own dtype (param_dtype None).
    kept = {**kwargs, "mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype,
                                                        cast_forward_inputs=False)}
    for n in kept_units:
        fully_shard(model.get_submodule(n), **kept)
    for n in names:
        fully_shard(model.get_submodule(n), **kwargs)
    fully_shard(model, **kwargs)
    return kept_units + names + [""]


def _fp32_kept(model: torch.nn.Module, param_dtype) -> tuple[list[str], set[torch.nn.Parameter]]:
    """What ``from_pretrained`` keeps in fp32 under a lower dtype (the class's
    ``_keep_in_fp32_modules``: Wan's time embedder, norms and ``scale_shift_table``s),
    which DDP computes with in fp32 and one ``param_dtype`` for a whole unit would gather
    in bf16 (Wan's adapter 3.5 % off after 3 steps). Returns the outermost such modules
    holding a frozen fp32 parameter, each to be its own unit gathered in fp32, and the
    frozen fp32 parameters matched outside them (``scale_shift_table`` is a bare parameter
    of the block and the root; FSDP2 has one dtype per unit and no unit for a parameter),
    which FSDP ignores: whole and fp32 on every rank (6 x dim values per block). Nothing
    when ``param_dtype`` is None or fp32."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if param_dtype in (None, torch.float32) or not keep:
        return [], set()

    def held(m: torch.nn.Module) -> bool:
        return any(not p.requires_grad and p.dtype == torch.float32 for p in m.parameters())

    units: list[str] = []
    for n, m in model.named_modules():
        # diffusers matches any part of a parameter's dotted name; the module's own name
        # here, so time_embedder.linear_1 goes with time_embedder's unit
        if (n and n.rsplit(".", 1)[-1] in keep and held(m)
                and not any(n.startswith(u + ".") for u in units)):
            units.append(n)
    inside = {id(p) for u in units for p in model.get_submodule(u).parameters()}
    bare = {p for n, p in model.named_parameters()
            if id(p) not in inside and not p.requires_grad and p.dtype == torch.float32
            and keep & set(n.split("."))}
    return units, bare


def _peft_key(name: str) -> str:
    # peft's get_peft_model_state_dict drops the adapter name: "to_q.lora_A.default.weight"
    # -> "to_q.lora_A.weight".
    return name.replace(".default.", ".")


def full_lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters gathered to full fp32 CPU tensors, keyed as
    ``peft.get_peft_model_state_dict`` keys an unsharded model. A collective: every rank
    calls it and every rank gets the whole dict (LoRA is small; the digests of raylora.json
    and the adapter written by rank 0 come from the same gathered tensors)."""
    sd = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=False, ignore_frozen_params=True))
    return {_peft_key(k): v.detach().to("cpu", torch.float32, copy=True)
            for k, v in sd.items() if "lora_" in k}


def component_folder(path: str, component: str, revision=None, variant: str | None = None) -> str:
    """The local folder of one pipeline component: in a local model folder, else the hub
    snapshot of what ``_WeightFiles`` reads of it for ``variant``: ``config.json`` and the
    one safetensors file, or the index and the shards it names. Not the whole folder: a
    UNet's on the hub also holds .bin, fp16 and non-EMA copies (SD 1.5's: ~17 GB for the
    3.4 GB read)."""
    if os.path.isdir(path):
        return os.path.join(path, component)
    from diffusers.utils import _add_variant
    from huggingface_hub import snapshot_download

    from raylora.model.hub import _call

    def download(revision, patterns):
        # the driver's errors (raylora.model.hub): named by model.pretrained, a mirror's
        # password left out, no chain (httpx's quotes the URL whole in the worker's
        # traceback, which Ray logs)
        return _call(snapshot_download, path, revision, path, revision=revision,
                     allow_patterns=patterns)

    single, index = (f"{component}/{_add_variant(n, variant)}" for n in
                     ("diffusion_pytorch_model.safetensors",
                      "diffusion_pytorch_model.safetensors.index.json"))
    # A pattern matches only the files there are: whether the index is, the listing says.
    root = download(revision, [f"{component}/config.json", index])
    if os.path.exists(os.path.join(root, index)):  # sharded: the index names the shards
        with open(os.path.join(root, index)) as f:
            weights = [f"{component}/{s}" for s in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        weights = [single]
    # the commit the first call resolved (its snapshot folder's name), not the branch again
    download(os.path.basename(root), weights)
    return os.path.join(root, component)


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


def shard_files(directory: str) -> list[str]:
    """The files of the DCP checkpoint ``save_sharded`` wrote (every rank's, as named by
    the ``.metadata`` rank 0 wrote into ``directory``), relative to ``directory``."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    return sorted({info.relative_path for info in meta.storage_data.values()} | {".metadata"})


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


# ---- building the denoiser without its weights ------------------------------------------


def _stand_in(p: torch.Tensor, device) -> torch.nn.Parameter:
    # One element expanded to the full shape: the parameter's shape, dtype and device at no
    # memory cost. Nothing reads its values: the real ones are copied into the shards.
    one = torch.empty((1,) * p.dim(), dtype=p.dtype, device=device)
    return torch.nn.Parameter(one.expand(p.shape), requires_grad=False)


def hollow_component(model_path: str, index: dict, component: str, dtype: torch.dtype,
                     device, revision=None) -> torch.nn.Module:
    """``component`` of the pipeline built from its config as ``from_pretrained(torch_dtype=
    dtype)`` would give it (fp32-kept modules included), with stand-in parameters on
    ``device`` (see the module docstring) and its buffers real. Frozen, eval mode."""
    from raylora.memory import meta_component

    # Buffers (timestep frequencies, position ids) are computed in __init__ and not all are
    # in the weights file: built for real; parameters on meta, then stand-ins.
    model = meta_component(model_path, index, component, dtype, real_buffers=True,
                           revision=revision)
    done: dict[int, torch.nn.Parameter] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:  # tied parameters stay tied
                m._parameters[name] = done.setdefault(id(p), _stand_in(p, device))
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    return model


class _WeightFiles:
    """A diffusers component folder's safetensors weights (one file, or shards listed in
    ``*.safetensors.index.json``), read a slice at a time."""

    def __init__(self, folder: str, variant: str | None = None):
        from diffusers.utils import _add_variant

        # diffusers' names: the variant before the last suffix, so a sharded fp16 UNet's
        # index is diffusion_pytorch_model.safetensors.index.fp16.json
        single, index = (os.path.join(folder, _add_variant(n, variant)) for n in
                         ("diffusion_pytorch_model.safetensors",
                          "diffusion_pytorch_model.safetensors.index.json"))
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.file_of = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(
                f"{folder}: no {os.path.basename(single)} (nor {os.path.basename(index)}): scaling.strategy=fsdp "
                "reads each rank's shard straight from safetensors weights")
        self._open: dict = {}

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        path = self.file_of[key]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        part = self._open[path].get_slice(key)
        return part[start:stop] if part.get_shape() else part[:]


def _rows_of(p: DTensor) -> tuple[int, int]:
    """The dim-0 rows of the full parameter that this rank's local shard holds."""
    if any(not isinstance(pl, Shard) or pl.dim != 0 for pl in p.placements):
        raise ValueError(f"unexpected FSDP placement {p.placements}")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] if shape else 0, (offset[0] + shape[0]) if shape else 0


def _file_key(name: str) -> str:
    # peft renames a wrapped layer's weight "to_q.weight" -> "to_q.base_layer.weight".
    return name.replace(".base_layer", "")


def shard_and_load(model: torch.nn.Module, block_classes: tuple[str, ...], folder: str,
                   device, *, variant: str | None = None, **shard_kwargs) -> list[str]:
    """Shard a ``hollow_component`` with LoRA attached (``shard_denoiser``) and fill its
    shards: frozen weights from ``folder``, LoRA and buffers as they were. Returns the
    shard units."""
    with torch.no_grad():
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and not p.requires_grad:
                m._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
    units = shard_denoiser(model, block_classes, **shard_kwargs)
    model.to_empty(device=device)  # this rank's shards only; FSDP re-points them lazily
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in lora:
                start, stop = _rows_of(p)
                p.to_local().copy_(lora[n][start:stop])
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    _load_weights(model, folder, variant)
    return units


def _load_weights(model: torch.nn.Module, folder: str, variant: str | None) -> None:
    """Copy the frozen weights (and persistent buffers) of the sharded ``model`` from
    ``folder``'s safetensors, each rank only the rows of its shards; LoRA is left as it is.
    A weight missing from the files is an error naming it."""
    files = _WeightFiles(folder, variant)
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    missing = [n for n, _ in frozen if _file_key(n) not in files.file_of]
    if missing:
        raise ValueError(f"{folder}: the weights lack {len(missing)} parameter(s) of "
                         f"{type(model).__name__}, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in frozen:  # a dim-0 shard (DTensor), or whole: ignored (_fp32_kept)
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.numel() == 0:
                continue
            rows = _rows_of(p) if isinstance(p, DTensor) else (0, p.shape[0] if p.dim() else 0)
            data = files.rows(_file_key(name), *rows)
            if tuple(data.shape) != tuple(local.shape):
                raise ValueError(f"{folder}: {name} has shape {tuple(data.shape)} in the weights, "
                                 f"{tuple(local.shape)} expected")
            local.copy_(data.to(local.dtype))
        for name, b in model.named_buffers():  # buffers are whole on every rank
            if _file_key(name) in files.file_of:
                b.copy_(files.rows(_file_key(name), 0, b.shape[0] if b.dim() else 0).to(b.dtype))
