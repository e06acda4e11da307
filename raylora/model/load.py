"""Load the frozen base model components with ``from_pretrained(path, subfolder=...)``.

The same code path serves a hub id (``stable-diffusion-v1-5/stable-diffusion-v1-5``) and a
local diffusers folder, so the tiny test model exercises what users run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch

from raylora import storage
from raylora.config import ModelSection
from raylora.model import families
from raylora.model.families.base import Family, import_class
from raylora.storage import Storage

log = logging.getLogger("raylora")

@dataclass
class Components:
    """The frozen base a worker trains on. ``vae``/``text_encoders`` are empty when the
    batches come from the latent cache."""

    family: type[Family]
    tokenizers: list[Any]
    text_encoders: list[torch.nn.Module]
    vae: torch.nn.Module | None
    denoiser: torch.nn.Module  # UNet or transformer
    scheduler_config: dict  # the pipeline's scheduler config: what the objective follows
    # normalised latents = (z − shift) · scale (floats, or per-channel lists); known from the
    # VAE's config without loading it
    latent_shift: Any = 0.0
    latent_scale: Any = 0.18215
    path: str = ""  # the local (materialized) model folder, or the hub id
    # The pipeline component ``denoiser`` is, and the σ it trains on: one expert's (Wan
    # 2.2 A14B, model.expert), else the family's denoiser over all of σ.
    component: str = ""
    sigma_range: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self):
        self.component = self.component or self.family.denoiser


def resolve_family(model: ModelSection, index: dict | None) -> type[Family]:
    """The family of ``model_index.json`` (``index``); a configured ``model.family`` that
    disagrees is a config error. No index (a hub id not checked offline): the configured
    family, else SD."""
    if index is None:
        return families.get("sd" if model.family == "auto" else model.family)
    found = families.detect(index, f"model.pretrained: {model.pretrained}")
    if model.family not in ("auto", found.name):
        raise ValueError(
            f"model.family: {model.family} but {model.pretrained} is a {found.name} pipeline "
            f"({index.get('_class_name')}); use model.family={found.name} or auto"
        )
    return found


def resolve_model_path(model: ModelSection) -> str:
    """Local folder → absolute path; storage URI as is; anything else is a hub id."""
    p = os.path.expanduser(model.pretrained)
    # every file: URI is a local path (file:/a/b, Hadoop's and Spark's, has no "://"; it
    # was taken for a hub id), as storage reads it for data.uri and output.uri
    if p.startswith("file:"):
        return storage.local_path(p)
    if "://" in p:
        return p
    # a relative path that is here (a folder, or a single-file checkpoint that
    # check_model names as one) is not a hub id
    if os.path.exists(p) or p.startswith((".", "/", "~")):
        return storage.local_path(p)
    return model.pretrained


def single_file_message(key: str, path: str) -> str:
    return (f"{key}: {path}: a file, not a diffusers folder (model_index.json and a folder "
            "per component). A single-file checkpoint (.safetensors, .ckpt) becomes one with "
            "diffusers: the family's pipeline class .from_single_file(it), then "
            ".save_pretrained(folder)")


def is_hub_id(path: str) -> bool:
    return "://" not in path and not os.path.isabs(path)


def check_model(path: str, store: Storage, revision: str | None = None,
                variant: str | None = None, key: str = "model.pretrained",
                weights: bool = True) -> dict:
    """Problems with a diffusers folder (local or stored) or hub repo (``is_hub_id``, at
    ``revision``: ``raylora.model.hub``), found before any worker starts: its family,
    component folders, weights in each one raylora loads (``weights_problem``) and, with
    ``variant`` (``model.variant``), that variant's weights in each component that has
    weights. ``key``: the setting that named ``path``, for errors (``--model``).
    ``weights=False``: the weights are not looked for (``raylora plan`` reads configs only,
    and sizes a model from a folder of its configs).

    Returns ``{"index": model_index.json, "family": Family, "vae_factor": int,
    "scheduler_config": dict, "commit": str | None}`` (``commit``: the hub commit read; for
    a folder in object storage the version of its files listed (``stored_version``), which
    ``RayLoraConfig.at_commit`` pins as a hub commit is; None for a local folder); raises
    FileNotFoundError (or ValueError for an unsupported pipeline, a config that does not
    parse, a ``model_index.json`` without a component's ``[library, class]``;
    PermissionError for a gated repo) naming the path, ``hub.Unreachable`` when a hub
    repo can be read neither from the hub nor from this machine's cache.
    """
    if is_hub_id(path):
        from raylora.model import hub

        if path.count("/") != 1:  # a relative path that is not there ("runs/demo/modle")
            raise FileNotFoundError(f"{key}: {path}: no such folder here, and not "
                                    "a hub id (owner/name)")
        repo = hub.Repo(path, revision)
        files = repo.files  # None: offline, the cache has no list
        sizes, read_bytes = repo.sizes or {}, repo.read_bytes
        # no ranged read of a hub file here: its .safetensors headers are not checked
        what, damaged = "repo", None
    else:
        info = store.info(path)
        if info.type.name == "NotFound":
            raise FileNotFoundError(f"{key}: {path}: no such directory")
        if info.type.name == "File":  # a single-file checkpoint, as model sites share them
            raise FileNotFoundError(single_file_message(key, path))
        found = stored_files(path, store)
        files = set(found)

        def read_bytes(name: str) -> bytes:
            return store.read_bytes(storage.join(path, name))

        def damaged(name: str, size: int) -> str | None:  # two small reads, not the weights
            def read() -> str | None:
                with store.open_input(storage.join(path, name)) as f:
                    return safetensors_problem(size, f)

            return read() if storage.is_local(path) else storage.retried_read(read)

        sizes = {name: i.size for name, i in found.items()}

        what, repo = "folder", None
        # In object storage: the version of its files the run trains (materialize).
        version = None if storage.is_local(path) else stored_version(path, found)
    if files is not None and "model_index.json" not in files:
        raise FileNotFoundError(
            f"{key}: {path}: not a diffusers {what} (no model_index.json)"
        )
    parsed: dict[str, dict] = {}  # each config read once (a request each in storage or the hub)

    def read(name: str) -> dict:
        if name not in parsed:
            parsed[name] = parsed_json(read_bytes(name), f"{key}: {path.rstrip('/')}/{name}")
        return parsed[name]

    index = read("model_index.json")
    family = families.detect(index, f"{key}: {path}")
    # and every expert the index names (Wan 2.2 A14B's transformer_2)
    experts = [c for c in family.experts.values() if index.get(c) not in (None, [None, None])]
    components = list(dict.fromkeys([*family.components(), *experts]))
    tokenizers = {t.tokenizer for t in family.text}
    if files is not None:
        present = {f.split("/", 1)[0] for f in files if "/" in f}
        missing = [c for c in components if c not in present]
        if missing:
            raise FileNotFoundError(
                f"{key}: {path}: missing component folder(s) of a {family.name} "
                f"pipeline: {', '.join(missing)}"
            )
    index_problem(index, components, tokenizers, family.name,
                  f"{key}: {path.rstrip('/')}/model_index.json")
    if files is not None:
        # The scheduler and tokenizers are configs; the rest are loaded from weights.
        configs_only = {"scheduler", *tokenizers}
        # Each config the plan and the workers parse (the VAE's and the scheduler's below):
        # a damaged one named here, not by a worker's traceback after the cluster started.
        for c in components:
            name = (f"{c}/tokenizer_config.json" if c in tokenizers else
                    "scheduler/scheduler_config.json" if c == "scheduler" else f"{c}/config.json")
            if name in files:
                read(name)
        index_config_problem(index, components, configs_only, parsed,
                             f"{key}: {path.rstrip('/')}")
        weighted = [c for c in components if c not in configs_only]
        hollow = hollow_weights(sizes, weighted, read_bytes, damaged) if weights else {}
        if weights:
            weights_problem(path, files, weighted, hollow, key)
        if variant:
            variant_problem(path, files - set(hollow), components, variant)
    vae = read("vae/config.json")
    scheduler = read("scheduler/scheduler_config.json")
    return {"index": index, "family": family, "vae_factor": family.vae_factor(vae),
            "scheduler_config": scheduler, "commit": repo.commit if repo else version,
            "files": files}


def parsed_json(data: bytes, what: str) -> dict:
    """A config file's JSON object; ValueError naming ``what`` (the key and the file) when
    it is not one: ``json``'s own message names only a line and column."""
    if not data.strip():
        raise ValueError(f"{what}: empty, not JSON")
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON ({exc.msg}: line {exc.lineno} column "
                         f"{exc.colno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "true or false",
                type(None): "null"}.get(type(value), "a number")
        raise ValueError(f"{what}: {kind}, not a JSON object")
    return value


def index_problem(index: dict, components: list[str], tokenizers: set[str], family: str,
                  what: str) -> None:
    """Raise ValueError naming ``what`` (``model_index.json``) when a component raylora
    loads has no ``[library, class]`` pair there, or (other than a tokenizer, which
    ``AutoTokenizer`` loads by its own config) names a class this environment lacks: each
    failed in the plan's or every worker's load, as a traceback, after the folder passed."""
    for c in components:
        entry = index.get(c)
        if entry is None:
            raise ValueError(f'{what} has no "{c}" entry (the [library, class] pair a '
                             f"{family} pipeline needs)")
        if not (isinstance(entry, list) and len(entry) >= 2
                and all(isinstance(x, str) and x for x in entry[:2])):
            raise ValueError(f'{what}: "{c}" is {json.dumps(entry)}, not the [library, class] '
                             f"pair a {family} pipeline needs")
        if c in tokenizers:
            continue
        library, name = entry[:2]
        try:
            import_class(library, name)
        except ImportError:
            raise ValueError(f'{what}: "{c}" is a {library} class, and {library} is not '
                             "installed here") from None
        except AttributeError:
            raise ValueError(f'{what}: "{c}" is {library}.{name}, which the {library} '
                             "installed here does not have (saved by a newer version?)") from None


def index_config_problem(index: dict, components: list[str], configs_only: set[str],
                         parsed: dict[str, dict], where: str) -> None:
    """Raise ValueError when ``model_index.json`` names a diffusers model class for a
    component whose ``config.json`` (in ``parsed``) was saved by another class: the
    index's class is what is built, from the other class's settings, which failed as a
    TypeError deep in its ``__init__`` (``'NoneType' and 'int'``) in the plan or on every
    worker. ``where``: the key and the folder, for the message."""
    for c in components:
        config = parsed.get(f"{c}/config.json")
        if c in configs_only or config is None or index[c][0] != "diffusers":
            continue  # transformers configs name architectures, not the class loaded
        saved = config.get("_class_name")
        if isinstance(saved, str) and saved != index[c][1]:
            raise ValueError(f'{where}/model_index.json names "{c}" as {index[c][1]}, but '
                             f"{c}/config.json was saved by {saved}: the index and that "
                             "folder are from different models")


WEIGHT_SUFFIXES = (".safetensors", ".bin")
# What a clone without git-lfs (or `GIT_LFS_SKIP_SMUDGE=1`) leaves in place of each large
# file: ~130 bytes of text starting with this line.
LFS_POINTER = b"version https://git-lfs"
_POINTER_MAX_BYTES = 1024
EMPTY, POINTER = "empty", "a git-lfs pointer, not the weights"
# The safetensors library's own bound on a header; a larger length is not a header.
_SAFETENSORS_HEADER_MAX = 100_000_000


def hollow_weights(sizes: dict[str, int], components: list[str],
                   read_bytes: Callable[[str], bytes],
                   damaged: Callable[[str, int], str | None] | None = None) -> dict[str, str]:
    """Weight files of ``components`` that hold no weights, or not all of theirs: name →
    why (``EMPTY``, ``POINTER``, or a damaged ``.safetensors``: ``safetensors_problem``).
    ``sizes``: a folder's or hub repo's files (``stored_files``, ``hub.Repo.sizes``);
    ``read_bytes``: a file's bytes by name. Only files under 1 KiB are read whole (a
    pointer is ~130 bytes; no real weights are that small): a folder in object storage or
    a hub repo costs one small read per such file, usually none. ``damaged``: why a
    ``.safetensors`` file (name, size) would not load, from its header
    (``safetensors_problem``), or None: not checked."""
    hollow = {}
    for name, size in sizes.items():
        if name.split("/", 1)[0] not in components or not name.endswith(WEIGHT_SUFFIXES):
            continue
        if size == 0:
            hollow[name] = EMPTY
        elif size < _POINTER_MAX_BYTES and read_bytes(name).startswith(LFS_POINTER):
            hollow[name] = POINTER
        elif damaged is not None and name.endswith(".safetensors"):
            if why := damaged(name, size):
                hollow[name] = why
    return hollow


def safetensors_problem(size: int, f) -> str | None:
    """Why a ``.safetensors`` file of ``size`` bytes (``f``: open, at its start) would not
    load, from its 8-byte header length and its JSON header alone: the tensors' data must
    end where the file does (the loader refuses a file that is shorter or longer). An
    interrupted copy or download leaves a file that lists and opens, and every worker's
    load failed on it after the cluster started."""
    if size < 8:
        return f"truncated: {size} bytes, less than a header"
    length = int.from_bytes(f.read(8), "little")
    if length > _SAFETENSORS_HEADER_MAX:
        return "not a safetensors file: its first 8 bytes are no header length"
    if 8 + length > size:
        return f"truncated: {size:,} bytes, less than its {8 + length:,}-byte header"
    try:
        header = json.loads(f.read(length))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "not a safetensors file: its header does not parse"
    if size < 8 + length + end:
        return f"truncated: {size:,} of the {8 + length + end:,} bytes its header describes"
    if size > 8 + length + end:
        return f"longer than its header describes: {size:,} bytes, not {8 + length + end:,}"
    return None


def weights_problem(path: str, files: set[str], components: list[str], hollow: dict[str, str],
                    key: str = "model.pretrained") -> None:
    """Raise FileNotFoundError naming each component folder of ``components`` with no
    weights file (``.safetensors``/``.bin``, one or a shard, other than those in
    ``hollow``): an upload or download that stopped part way, a clone without git-lfs.
    The plan passed them and every worker's load failed after the cluster started
    ("no file named diffusion_pytorch_model.bin found in directory" the model root).
    Also each folder with a damaged weights file (``safetensors_problem``), whatever else
    it holds."""
    lacking, damaged, pointers = [], [], False
    for c in components:
        names = sorted(f for f in files if f.startswith(f"{c}/") and f.endswith(WEIGHT_SUFFIXES))
        folder = f"{path.rstrip('/')}/{c}"
        # An empty file or a pointer beside real weights is left alone (the loader reads
        # those); a damaged file is not: it may be one shard of several, or what is loaded.
        cut = [n for n in names if n in hollow and hollow[n] not in (EMPTY, POINTER)]
        if cut:
            damaged.append(f"{folder} ({'; '.join(f'{n[len(c) + 1:]} is {hollow[n]}' for n in cut)})")
            continue
        if any(n not in hollow for n in names):
            continue
        if names:
            pointers = pointers or any(hollow[n] == POINTER for n in names)
            why = "; ".join(f"{n[len(c) + 1:]} is {hollow[n]}" for n in names)
            lacking.append(f"{folder} ({why})")
        else:
            lacking.append(f"{folder} (no .safetensors or .bin file)")
    if lacking or damaged:
        here = storage.is_local(path) and not is_hub_id(path)
        hints = []
        if pointers:
            hints.append("a clone without git-lfs: `git lfs pull` in it fetches them" if here else
                         "pushed or copied from a clone without git-lfs (`git lfs pull` there "
                         "fetches them)")
        if damaged or (lacking and not pointers):
            hints.append("an upload or copy that stopped part way? Copy the model again" if here
                         else "an upload that stopped part way?")
        what = ([f"no weights in {', '.join(lacking)}"] if lacking else []) + \
            ([f"damaged weights in {', '.join(damaged)}"] if damaged else [])
        raise FileNotFoundError(f"{key}: {path}: {'; '.join(what)}; {'; '.join(hints)}")


def variant_problem(path: str, files: set[str], components: list[str], variant: str) -> None:
    """Raise ValueError naming ``model.variant`` when a component folder with weights has
    none of that variant (``diffusion_pytorch_model.fp16.safetensors``, ``model.fp16.safetensors``,
    a shard ``model.fp16-00001-of-00002.safetensors``): every worker's load would fail on it
    after the cluster started."""
    lacking = []
    for c in components:
        names = [f.rsplit("/", 1)[-1] for f in files if f.startswith(f"{c}/") and f.endswith(WEIGHT_SUFFIXES)]
        if names and not any(f".{variant}." in n or f".{variant}-" in n for n in names):
            lacking.append(c)
    if lacking:
        raise ValueError(f"model.variant: {variant}: model.pretrained: {path} has no {variant} "
                         f"weights in {', '.join(lacking)} (files named like "
                         f"diffusion_pytorch_model.{variant}.safetensors); leave model.variant "
                         "unset to load the weights it has")


def fsdp_weights_problem(path: str, files: set[str], component: str, variant: str | None) -> str | None:
    """The problem, naming ``scaling.strategy``, when ``component`` has no safetensors
    weights of ``variant`` (one file or a sharded index, as diffusers names them): FSDP
    reads each rank's rows straight from them (``train.fsdp._WeightFiles``), and every
    worker would fail on a ``.bin`` after the cluster started."""
    from diffusers.utils import _add_variant

    names = [_add_variant(n, variant) for n in ("diffusion_pytorch_model.safetensors",
                                                 "diffusion_pytorch_model.safetensors.index.json")]
    if any(f"{component}/{n}" in files for n in names):
        return None
    return (f"scaling.strategy: fsdp reads each rank's shard straight from safetensors weights; "
            f"model.pretrained: {path} has neither {component}/{names[0]} nor {component}/{names[1]}")


def cache_root() -> str:
    return os.environ.get("RAYLORA_CACHE") or os.path.expanduser("~/.cache/raylora")


def materialize(path: str, store: Storage, version: str | None = None) -> str:
    """A local path for ``path``: local folders and hub ids unchanged; a storage URI is
    downloaded once per node into the cache, per version of the folder (``stored_version``:
    its files' names, sizes and modification times), so a model uploaded again under the
    same URI is downloaded again, not trained on from the node's old copy.

    ``version``: the one the run's plan listed (``model.revision`` as ``at_commit`` pinned
    it). A node with a copy of it reads nothing from the store; a node without one gets
    the folder only if it is still that version, so two nodes never train on two uploads.

    Every process on the node (training workers, preprocess tasks) calls this; an
    exclusive file lock lets one download while the others wait, and a ``.complete``
    marker written last means a crashed download is never mistaken for a model. A folder
    that changes while it downloads is refused (the copy would mix two uploads).
    """
    if storage.is_local(path) or is_hub_id(path):
        return path
    if version and _use(pinned := _node_copy(version)):
        return pinned
    found = stored_files(path, store)
    if not found:
        raise FileNotFoundError(f"model.pretrained: {path}: no files there")
    listed = stored_version(path, found)
    if version and listed != version:
        raise RuntimeError(
            f"model.pretrained: {path}: its files changed since this run's plan listed them "
            f"(version {version}, now {listed}: uploaded again?) and this node has no copy of "
            "the version the other workers train; run again to train on the new files")
    dest = _node_copy(listed)
    if _use(dest):
        return dest
    done = os.path.join(dest, ".complete")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(done):
                tmp = f"{dest}.partial-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                store.download_dir(path, tmp, keep=lambda name: model_file(path, name))
                if stored_version(path, stored_files(path, store)) != listed:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise RuntimeError(f"model.pretrained: {path}: its files changed while this "
                                       "node downloaded them; run again once the upload is done")
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
                with open(done, "w") as f:
                    f.write(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _use(dest)
    _remove_unused_versions(path, dest)
    return dest


# The node copies this process reads, each with a shared lock on its ``.inuse`` file held
# until the process exits: what tells ``_remove_unused_versions`` to leave a copy alone.
_IN_USE: dict[str, Any] = {}


def _use(dest: str) -> bool:
    """Whether the node copy ``dest`` is complete; if so, this process holds it in use."""
    if dest in _IN_USE:
        return True
    done = os.path.join(dest, ".complete")
    if not os.path.exists(done):
        return False
    held = open(dest + ".inuse", "a")
    fcntl.flock(held, fcntl.LOCK_SH)
    if not os.path.exists(done):  # removed as an unused old version before the lock came
        held.close()
        return False
    _IN_USE[dest] = held
    return True


def _remove_unused_versions(path: str, keep: str) -> None:
    """Delete this node's copies of other versions of ``path`` that no process holds in
    use: a model uploaded again leaves its old copy (tens of GB for Flux) only while a run
    still reads it. The ``.complete`` marker goes first, so no process takes a half-deleted
    copy for whole (``_use`` checks it again under its lock)."""
    import glob

    for done in glob.glob(os.path.join(cache_root(), "models", "*", ".complete")):
        copy = os.path.dirname(done)
        try:
            with open(done) as f:
                if copy == keep or f.read() != path:
                    continue
        except OSError:
            continue
        with open(copy + ".inuse", "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a run on this node still reads it
            os.remove(done)
            shutil.rmtree(copy, ignore_errors=True)
            for lock in (copy + ".lock", copy + ".inuse"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)
        log.info("model.pretrained: %s: removed this node's copy of an older version (%s), "
                 "which no process here reads", path, os.path.basename(copy))


def _node_copy(version: str) -> str:
    return os.path.join(cache_root(), "models", version)


def stored_files(path: str, store: Storage) -> dict[str, Any]:
    """Relative name → ``FileInfo`` of a folder in storage, one listing ({} if empty),
    less the files in its hidden folders (``model_file``)."""
    try:
        found = storage.listed_files(*store.fs(path))
    except FileNotFoundError:  # an S3 prefix without objects, despite allow_not_found
        return {}
    return {name: i for name, i in found.items() if model_file(path, name)}


def model_file(path: str, name: str) -> bool:
    """Whether ``name`` (relative to the stored folder ``path``) is one of its files, not
    one in a hidden folder below it (``storage.hidden_folder``): a folder uploaded from a
    git clone holds ``.git/``, whose ``lfs/objects`` is a second copy of every weight, and
    ``hf download --local-dir`` leaves ``.cache/huggingface/``. What ``materialize``
    downloads and what its version (``stored_version``) is computed from, alike."""
    return not storage.hidden_folder(path, f"{path.rstrip('/')}/{name}")


def stored_version(path: str, found: dict[str, Any]) -> str:
    """A stored folder's version: a digest of its URI and each file's name, size and
    modification time (an object store's last-modified), from ``stored_files``. The plan
    records it (``Plan.model_commit``) and each node's copy is named by it."""
    listing = json.dumps(sorted((name, i.size, i.mtime_ns) for name, i in found.items()))
    return hashlib.sha256(f"{path}\n{listing}".encode()).hexdigest()[:16]


def read_index(model: ModelSection, path: str) -> dict | None:
    """``model_index.json`` of a local (materialized) or hub model; None if unreadable."""
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(path, revision=model.revision))
    except (OSError, ValueError):
        return None


def load_text_encoders(path: str, family: type[Family], weight_dtype: torch.dtype, index: dict,
                       revision=None, variant=None):
    """Tokenizers and frozen text encoders in the family's order, each encoder by the class
    ``model_index.json`` names (SDXL's second is ``CLIPTextModelWithProjection``, whose
    projected pooled output is what the UNet's added conditioning expects)."""
    from transformers import AutoTokenizer

    tokenizers, encoders = [], []
    for t in family.text:
        tokenizers.append(AutoTokenizer.from_pretrained(path, subfolder=t.tokenizer, revision=revision))
        enc = family.load_component(path, index, t.encoder, weight_dtype, revision=revision,
                                    variant=variant)
        enc.requires_grad_(False)
        # Frozen modules stay in eval mode so dropout in the text encoder never fires.
        enc.eval()
        encoders.append(enc)
    return tokenizers, encoders


def load_vae(path: str, family: type[Family], weight_dtype: torch.dtype, index: dict,
             revision=None, variant=None):
    vae = family.load_component(path, index, "vae", weight_dtype, revision=revision, variant=variant)
    if weight_dtype == torch.float16 and vae.config.get("force_upcast", False):
        # SDXL's VAE overflows in fp16 (NaN latents); its config says so. fp32 costs only
        # the encoder pass.
        vae.to(torch.float32)
    vae.requires_grad_(False)
    vae.eval()
    return vae


def load_encoders(path: str, family: type[Family], weight_dtype: torch.dtype, index: dict,
                  model: ModelSection, device=None):
    """(tokenizers, text encoders, VAE) as a worker uses them: each encoder adapted by the
    family (Flux.2 [dev]: Mistral 3's language model alone) and its linears quantized on
    ``device`` as ``model.quantize_text_encoders`` says. Training batches that are not
    cached need them, and so does a preview of a run whose batches are
    (``raylora.train.preview.encoders_for``)."""
    from raylora.model.quantize import quantize_module

    tokenizers, text_encoders = load_text_encoders(path, family, weight_dtype, index, model.revision,
                                                   model.variant)
    vae = load_vae(path, family, weight_dtype, index, model.revision, model.variant)
    for enc in text_encoders:
        quantize_module(enc, model.quantize_text_encoders, weight_dtype, device or "cpu")
    return tokenizers, text_encoders, vae


def encoder_kwargs(family: type[Family], vae=None, text_encoders=(), tokenizers=()) -> dict:
    """The pipeline components, by name, of whatever encoders and tokenizers are given."""
    kw: dict = {} if vae is None else {"vae": vae}
    for t, enc in zip(family.text, text_encoders):
        kw[t.encoder] = enc
    for t, tok in zip(family.text, tokenizers):
        kw[t.tokenizer] = tok
    return kw


def load_pipeline_as_trained(path: str, family: type[Family], weight_dtype: torch.dtype, index: dict,
                             model: ModelSection, device=None, **kw):
    """The family's stock pipeline of the folder ``path`` (on the CPU), its text encoders
    and VAE loaded as a worker holds them (``load_encoders``), not as the stock pipeline
    loads them: Flux.2 [dev]'s would be the whole 24B Mistral 3, vision tower and LM head
    included, at full precision. Class images and ``raylora sample`` render with it; ``kw``
    goes to ``from_pretrained``."""
    tokenizers, encoders, vae = load_encoders(path, family, weight_dtype, index, model, device)
    return family.load_pipeline(path, dtype=weight_dtype, revision=model.revision,
                                **({"variant": model.variant} if model.variant else {}),
                                **encoder_kwargs(family, vae, encoders, tokenizers), **kw)


def load_components(
    model: ModelSection,
    weight_dtype: torch.dtype,
    store: Storage | None = None,
    encoders: bool = True,
    device=None,
    hollow_denoiser: bool = False,
) -> Components:
    """Everything frozen a training worker needs. ``encoders=False`` (cached latents) skips
    the VAE and text encoders: the cache already holds what they would compute.
    ``model.quantize`` / ``model.quantize_text_encoders``: those components' linear layers
    are quantized on ``device`` (default CPU), where the worker will train them.
    ``hollow_denoiser``: the denoiser without its weights, for ``scaling.strategy=fsdp``
    (``raylora.train.fsdp.hollow_component``: each rank reads its shards later)."""
    from raylora.model.quantize import check_supported, quantize_module

    device = device or "cpu"
    # Refused before anything is read: a whole base model is loaded only for a run that can go.
    check_supported(model.quantize, "model.quantize", device)
    # With cached latents too: previews load the text encoders so (load_encoders).
    check_supported(model.quantize_text_encoders, "model.quantize_text_encoders", device)
    path = materialize(resolve_model_path(model), store or Storage(), model.revision)
    index = read_index(model, path)
    if index is None:
        raise FileNotFoundError(f"model.pretrained: {model.pretrained}: no model_index.json")
    family = resolve_family(model, index)
    sigmas = family.sigma_range(index, model.expert, f"model.pretrained: {model.pretrained}")
    component = family.trained_component(model.expert)
    kw: dict[str, Any] = {"revision": model.revision}
    scheduler_config = dict(import_class(*index["scheduler"][:2]).load_config(
        path, subfolder="scheduler", revision=model.revision))
    tokenizers, text_encoders, vae = [], [], None
    if encoders:
        tokenizers, text_encoders, vae = load_encoders(path, family, weight_dtype, index, model, device)
    if hollow_denoiser:
        from raylora.train.fsdp import hollow_component

        denoiser = family.adapt_component(component, hollow_component(
            path, index, component, weight_dtype, device, revision=model.revision))
    else:
        denoiser = family.load_component(path, index, component, weight_dtype,
                                         variant=model.variant, **kw)
    denoiser.requires_grad_(False)
    quantize_module(denoiser, model.quantize, weight_dtype, device)
    family.set_attention(denoiser, model.attention)
    vae_cls = import_class(*index["vae"][:2])
    shift, scale = family.latent_stats(vae_cls.load_config(path, subfolder="vae", revision=model.revision))
    return Components(family, tokenizers, text_encoders, vae, denoiser, scheduler_config, shift,
                      scale, path, component, sigmas)
