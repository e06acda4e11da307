"""``train.compile``: ``torch.compile`` the denoiser in place, whole or block by block.

In place (``Module.compile``): the module, its parameters and state-dict keys stay what
they were (no ``_orig_mod.`` prefix), so DDP, LoRA export and resume are unchanged. Static
shapes: every training batch of a run has one shape (drop_last, one resolution), but for
the caption length of a family whose text encoder's output is as long as each batch's
longest caption (``Family.cuts_captions``: Qwen-Image, Z-Image, Lumina 2, Sana). There
each new length compiled every block again (a cold compile per caption length, until
dynamo's recompile limit ran the rest eagerly), so those compile with dynamo's automatic
dynamic shapes (``compile_options``): static first, then once more with the sizes that
changed symbolic, and no compile for any later length.

``CompileCache`` keeps torch.compile's results in storage between runs (``train.
compile_cache_uri``), so a run on a fresh machine loads them instead of compiling cold.

``regional`` compiles each repeated block (diffusers' ``_repeated_blocks``: the transformer
blocks) on its own. The blocks of one class share their compiled code, so a model compiles
a handful of small graphs (one per distinct block shape) instead of one graph of the whole
network, and the code between blocks (embeddings, resnets and up/down sampling of a UNet,
the added conditioning of SDXL) runs eagerly, so nothing there can break or recompile a
graph. A UNet's resnet blocks (``UNET_RESNET_BLOCKS``) are not compiled by default: on an
H100 (bench/RESULTS.md, 2026-11-23) they took SD 1.5's cold compile past 90 s (it has ~15
kinds of ResnetBlock2D, each a forward and a backward graph), while its transformer
blocks alone compiled in 49 s for 1.35x the eager step. (SDXL with its resnet blocks: 93 s,
1.58x eager on that H100; without them 24 s, 1.23x eager on an H200.) Dynamic shapes do
not merge those resnet graphs: torch specialises the sizes back (GroupNorm's and
convolution's shape checks, the backward's compile), so ``dynamic=True`` made the same
graphs, 40 % slower to compile (bench/RESULTS.md, 2026-11-26); ``train.compile_cache_uri``
is the way to pay for them once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections import Counter

import torch

from raylora.model.quantize import settle_int8

log = logging.getLogger("raylora.compile")

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


def compile_options(family, cuda_graphs: bool = False) -> dict:
    """``torch.compile``'s options for ``family``'s denoiser in training: CUDA graphs
    (train.cuda_graphs: reduce-overhead mode); automatic dynamic shapes where the caption
    length varies from batch to batch (``Family.cuts_captions``, see the module docstring),
    else none (``compile_denoiser``'s default)."""
    kw = {"mode": "reduce-overhead"} if cuda_graphs else {}
    if family.cuts_captions:
        kw["dynamic"] = None
    return kw


def compile_denoiser(model: torch.nn.Module, how: str, blocks=None, **compile_kwargs) -> list[str]:
    """Compile ``model`` in place; returns the names of the compiled modules ("" for the
    whole model). ``how``: train.compile's mode (``MODES``). ``blocks``: class names to
    compile in ``regional`` mode (default: ``repeated_blocks(model)``). ``compile_kwargs``
    go to ``torch.compile`` (its own ``mode``, e.g. ``reduce-overhead``, among them)."""
    if how not in MODES:
        raise ValueError(f"compile mode {how!r}: expected one of {MODES}")
    if how == "none":
        return []
    compile_kwargs.setdefault("dynamic", False)
    settle_int8(model)  # else every block recompiles at step 1 (model.quantize: int8)
    if how == "full":
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


# ---- compiled code kept between runs (train.compile_cache_uri) ------------------------------


def device_description(device) -> str:
    """What compiled code depends on besides torch: the GPU model and its compute capability
    (Triton kernels, autotuning choices), or the CPU's architecture."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    return f"{device.type} {platform.machine()}"


def cache_key(graph_inputs: dict, device) -> str:
    """The name of one entry: the torch (and Triton) version, the device and ``graph_inputs``
    (whatever gives the compiled graphs their shapes and code: model, LoRA, batch shape,
    dtype, compile mode). A wrong key costs speed only: torch checks every artifact against
    its own full key when it is looked up, and recompiles what does not match."""
    # The thread count is in torch's own key of CPU code (inductor's C++ kernels are
    # generated for it); Ray sets it per worker from scaling.cpus_per_worker.
    what = {"torch": torch.__version__, "device": device_description(device),
            "threads": torch.get_num_threads(), **graph_inputs}
    try:
        import triton

        what["triton"] = triton.__version__
    except ImportError:
        pass
    blob = json.dumps(what, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _artifacts(blob: bytes) -> dict:
    """Every artifact in a Mega-Cache blob, by (kind, key). Read here, not with torch's
    ``load_cache_artifacts``: a blob holds one section per ``save_cache_artifacts`` call
    (a process that saves twice appends a second "inductor" section) and torch's reader
    keeps only the last section of each kind, dropping what the first save stored."""
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    sections = AppendingByteSerializer.to_list(blob, deserialize_fn=_deserialize_single_cache)
    return {(kind, a.key): a for kind, arts in sections for a in arts}


def _by_kind(artifacts: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for (kind, _), a in artifacts.items():
        out.setdefault(kind, []).append(a)
    return out


def _blob(artifacts: dict) -> bytes:
    """``artifacts`` in torch's own format, one section per kind (what a process that
    saved once writes), so ``torch.compiler.load_cache_artifacts`` reads all of it too."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend(_by_kind(artifacts).items())
    return out.to_bytes()


class CompileCache:
    """torch.compile's portable caches ("Mega-Cache": inductor's FX graphs, AOTAutograd's
    joint graphs, Triton kernels, autotuning results, dynamic-shape decisions) as one object
    at ``uri``.

    ``load()`` before the first compiled call puts them into this process's local caches,
    so dynamo still traces but inductor and AOTAutograd find their outputs instead of
    compiling. ``save()`` adds what this process compiled or found to what is stored, once
    it holds something the stored object lacks (a run on new shapes, or the first run).
    Neither raises: a missing, unreadable or stale entry only means a cold compile.

    The stored object is the union of every run's artifacts: runs that differ only in what
    the entry's name leaves out (held-out evaluation, previews) share it, and torch records
    only the graphs a process compiled or used, so writing one process's artifacts alone
    dropped the graphs another run stored (each run then compiled those cold again).
    Artifacts are kept by torch's own key (the graph, its inputs, torch's config), so the
    union grows only with graphs some run really compiled under this entry's name.

    The object is compiled code (pickled graphs, generated kernels) that ``load()`` makes
    this process run: keep it where only your own jobs write.
    """

    def __init__(self, store, uri: str):
        self.store, self.uri = store, uri
        self._have: frozenset = frozenset()  # (kind, key) of the artifacts stored at uri
        self.loaded = 0

    def _read(self) -> dict | None:
        """The artifacts stored at ``uri``: {} when there are none or this torch cannot
        use them, None when storage could not be read."""
        try:
            blob = self.store.read_bytes(self.uri)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("compile cache: cannot read %s (%s)", self.uri, exc)
            return None
        try:
            return _artifacts(blob)
        except Exception as exc:  # a torch that cannot read the format
            log.warning("compile cache: %s is not usable by torch %s (%s: %s)",
                        self.uri, torch.__version__, type(exc).__name__, exc)
            return {}

    def load(self) -> int:
        """Artifacts loaded (0: none stored yet, or not usable here: a cold compile)."""
        stored = self._read() or {}
        try:
            from torch.compiler._cache import CacheArtifactManager

            CacheArtifactManager.populate_caches(_by_kind(stored))
        except Exception as exc:
            log.warning("compile cache: torch could not load %s (%s: %s); compiling cold",
                        self.uri, type(exc).__name__, exc)
            return 0
        self._have = frozenset(stored)
        self.loaded = len(stored)
        return self.loaded

    def save(self) -> int:
        """Artifacts written (0: nothing the stored object lacks)."""
        try:
            out = torch.compiler.save_cache_artifacts()
            mine = _artifacts(out[0]) if out is not None else {}
        except Exception as exc:
            log.warning("compile cache: torch could not serialise its caches (%s: %s)",
                        type(exc).__name__, exc)
            return 0
        if mine.keys() <= self._have:
            return 0
        # Read again (not kept from load): another run sharing the entry may have added to
        # it since. Unreadable now: write nothing rather than drop what is there.
        stored = self._read()
        if stored is None:
            return 0
        merged = {**stored, **mine}
        blob = _blob(merged)
        try:
            self.store.write_bytes(self.uri, blob)
        except OSError as exc:
            log.warning("compile cache: cannot write %s (%s)", self.uri, exc)
            return 0
        log.info("compile cache: %d artifacts (%d new, %.1f MB) -> %s", len(merged),
                 len(merged.keys() - stored.keys()), len(blob) / 1e6, self.uri)
        self._have = frozenset(merged)
        return len(merged)
