"""``lora.init_from``: a run's LoRA starts as an existing adapter instead of as a no-op.

The adapter is read the way the family's stock pipeline reads it (``lora_state_dict`` +
``load_lora_adapter``, or peft's for a peft folder), so any format that pipeline's
``load_lora_weights`` takes works: raylora's and diffusers' scripts' files, kohya/ComfyUI
files the pipeline converts, peft folders (LoKr/LoHa). It is loaded beside the run's own
adapter under a scratch name, and every layer's weights are copied into the run's adapter;
the factor that carries the scale (LoRA's B) is rescaled by the file's scale over the
run's (``lora.alpha / lora.rank``), so at step 0 the denoiser computes what the stock
pipeline with that file loaded computes, whatever ``lora.alpha`` the run trains with.

Before Ray starts, ``checked`` reads the file's header only (names, shapes, a peft
folder's config): a missing file, another rank, another variant, or text-encoder layers
a run that does not train the text encoders would drop.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
import warnings

import torch

from raylora import storage
from raylora.config import RayLoraConfig
from raylora.model import hub, load
from raylora.model.load import stored_version
from raylora.model.lora import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    WEIGHT_NAME,
    one_key_style,
    text_encoder_magnitudes,
)
from raylora.storage import Storage

log = logging.getLogger("raylora.lora_init")

# A stored adapter pinned to the files the plan listed: "{uri}#version={version}" (the
# digest raylora.model.load.stored_version makes of their names, sizes and times).
VERSION = "#version="
SCRATCH = "raylora_init"  # the loaded adapter's name while its weights are copied over
KEY = "lora.init_from"
# Text-encoder layers: diffusers' component prefixes and kohya's lora_te_/lora_te1_/...
TEXT_PREFIXES = ("text_encoder", "lora_te")
DOWN = ("lora_A.weight", "lora_down.weight", "lora.down.weight")
MAGNITUDE = ("lora_magnitude_vector", "dora_scale")
# peft's layer kinds → raylora's lora.variant
PEFT_VARIANTS = {"LORA": "lora", "LOKR": "lokr", "LOHA": "loha"}
# Per variant: the factor that carries the adapter's scale (the delta is linear in it).
SCALED = {"lora": ("lora_B",), "dora": ("lora_B",), "lokr": ("lokr_w1", "lokr_w1_a"),
          "loha": ("hada_w1_a",)}


def locate(uri: str, store: Storage) -> tuple[str, str]:
    """(kind, the file with the weights): ``"diffusers"`` for a ``.safetensors`` file or a
    folder with ``pytorch_lora_weights.safetensors``, ``"peft"`` for a folder with
    ``adapter_config.json``. ``FileNotFoundError``/``ValueError`` name what is missing."""
    import pyarrow.fs as pafs

    info = store.info(uri)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{uri}: not found")
    if info.type == pafs.FileType.File:
        if not uri.endswith(".safetensors"):
            raise ValueError(f"{uri}: not a .safetensors file")
        return "diffusers", uri
    for kind, name in (("diffusers", WEIGHT_NAME), ("peft", PEFT_CONFIG)):
        if store.exists(storage.join(uri, name)):
            return kind, storage.join(uri, name if kind == "diffusers" else PEFT_WEIGHTS)
    raise ValueError(f"{uri}: has no {WEIGHT_NAME} (a diffusers LoRA) or {PEFT_CONFIG} (a peft "
                     "adapter folder); name the folder raylora wrote (output.uri/adapter) or "
                     "a .safetensors file")


def read_header(uri: str, store: Storage) -> dict[str, list[int]]:
    """Tensor name → shape, from a safetensors file's header (its first bytes only; read
    again if throttled: an 8-byte GET is one the AWS SDK does not retry, retried_read)."""
    return storage.retried_read(lambda: _header(uri, store))


def _header(uri: str, store: Storage) -> dict[str, list[int]]:
    with store.open_input(uri) as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{uri}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError(f"{uri}: not a safetensors file")
        try:
            entries = json.loads(f.read(size))
        except ValueError:
            raise ValueError(f"{uri}: not a safetensors file (unreadable header)") from None
    return {k: v["shape"] for k, v in entries.items() if k != "__metadata__"}


def checked(cfg: RayLoraConfig, store: Storage) -> tuple[list[str], str | None]:
    """(what makes ``lora.init_from`` unusable for this run, one line each (none if
    unset); the URI the workers load: an ``hf://`` adapter at the commit read here
    (``hub.pinned``: ``raylora.launch.Plan.pins``), one in object storage at the version
    of its files listed here (``VERSION``), a local one as written).
    Reads the header and a peft folder's config; the layer names are matched with the
    denoiser's on the worker (``load_init``), where the model is. (A search of its rank or
    variant is refused with the config: ``raylora.config``'s tune checks.)"""
    uri = cfg.lora.init_from
    if not uri:
        return [], None
    where = loads = uri
    try:
        if uri.startswith(hub.SCHEME):  # downloaded into the hub cache, read there
            where, store = hub.fetch(uri, KEY), Storage()
            loads = hub.pinned(uri, where, KEY)
        kind, weights = locate(where, store)
        if not storage.is_local(uri) and not uri.startswith(hub.SCHEME):
            loads = f"{uri}{VERSION}{stored_version(uri, stored_files(uri, store))}"
        shapes = read_header(weights, store)
        out = (_peft_problems(json.loads(store.read_bytes(storage.join(where, PEFT_CONFIG))), cfg, uri)
               if kind == "peft" else _file_problems(shapes, cfg, uri))
    except (FileNotFoundError, ValueError, OSError) as exc:
        why = str(exc).replace(where, uri) if where != uri else str(exc)  # the cache's path: the URI
        return [why if why.startswith(KEY) else f"{KEY}: {why}"], uri
    text = [k for k in shapes if k.startswith(TEXT_PREFIXES)]
    if text and not cfg.lora.train_text_encoder:
        out.append(f"{KEY}: {uri} has text-encoder LoRA layers ({text[0]}, ...), which this run "
                   "would drop; set lora.train_text_encoder: true to train them on")
    return out, loads


def _file_problems(shapes: dict[str, list[int]], cfg: RayLoraConfig, uri: str) -> list[str]:
    lora = cfg.lora
    if any(".lokr_" in k or ".hada_" in k or "lokr_w" in k or "hada_w" in k for k in shapes):
        return [f"{KEY}: {uri} is a LoKr/LoHa file; give the peft folder raylora writes for "
                "lora.variant lokr/loha (output.uri/adapter, with adapter_config.json)"]
    if lora.variant in ("lokr", "loha"):
        return [f"{KEY}: {uri} is a LoRA file; lora.variant {lora.variant} starts from a "
                f"{lora.variant} peft folder (adapter_config.json)"]
    downs = {k: s[0] for k, s in shapes.items() if k.endswith(DOWN) and len(s) >= 2}
    if not downs:
        return [f"{KEY}: {uri} has no LoRA layers (no {', '.join(DOWN)} tensors)"]
    out = []
    # the ranks the run may have, as the worker's loader reads the file (_rank_fits)
    fits = set.intersection(*(_rank_fits(k, r) for k, r in downs.items()))
    if not fits:
        written = ", ".join(map(str, sorted(set(downs.values()))))
        out.append(f"{KEY}: {uri} has layers of ranks {written}; a run trains one lora.rank")
    elif lora.rank not in fits:
        ranks = " or ".join(map(str, sorted(fits)))
        why = "" if len(fits) == 1 else (" (its layers are all fused kohya modules, which load "
                                         "as parts of either rank)")
        out.append(f"{KEY}: {uri} has rank {ranks}{why}, this run lora.rank={lora.rank}; set "
                   f"lora.rank={ranks} to start from it")
    dora = any(m in k for k in shapes for m in MAGNITUDE)
    if dora != (lora.variant == "dora"):
        want = "dora" if dora else "lora"
        out.append(f"{KEY}: {uri} is a {want.upper()} adapter, this run lora.variant="
                   f"{lora.variant}; set lora.variant={want}")
    return out


@functools.cache
def _fused() -> list[tuple[re.Pattern, int]]:
    from raylora.checkpoint.kohya import fused_names
    from raylora.model import families

    # Each family whose converter loads fused kohya modules (Family.kohya_fused_load):
    # BFL's qkv, Flux.1's linear1, Z-Image's attention.qkv (several diffusers layers in one)
    return [f for name in families.names() if families.get(name).kohya_fused_load
            for f in fused_names(families.get(name).kohya_rules)]


def _rank_fits(key: str, rank: int) -> set[int]:
    """The run's lora.rank(s) the layer whose down is ``key``, of rank ``rank``, loads into:
    its own, and for a fused kohya module of k parts (``Family.kohya_fused_load``)
    rank / k. Only the header is read here, not whether its up is block-diagonal: the
    worker's shape check (``_take_over``) catches the rank the loader did not split to."""
    module = key.split(".", 1)[0]  # kohya: lora_unet_<module>.lora_down.weight
    return {rank} | {rank // k for pattern, k in _fused()
                     if rank % k == 0 and pattern.fullmatch(module)}


def _peft_problems(config: dict, cfg: RayLoraConfig, uri: str) -> list[str]:
    variant = PEFT_VARIANTS.get(config.get("peft_type"))
    if variant == "lora" and config.get("use_dora"):
        variant = "dora"
    if variant is None:
        return [f"{KEY}: {uri}: peft_type {config.get('peft_type')} is not LoRA, DoRA, LoKr or LoHa"]
    given = {"lora.variant": variant, "lora.rank": config.get("r")}
    if variant == "lokr":
        given.update({"lora.decompose_both": config.get("decompose_both", False),
                      "lora.factor": config.get("decompose_factor", -1)})
    differ = {k: v for k, v in given.items() if v != _value(cfg, k)}
    if not differ:
        return []
    return [f"{KEY}: {uri} was trained with {', '.join(f'{k}={v}' for k, v in differ.items())}, "
            f"this run has {', '.join(f'{k}={_value(cfg, k)}' for k in differ)}; set "
            f"{'them' if len(differ) > 1 else 'it'} to start from it"]


def _value(cfg: RayLoraConfig, key: str):
    return getattr(cfg.lora, key.split(".")[1])


def stored_files(uri: str, store: Storage) -> dict:
    """Relative name → ``FileInfo`` of an adapter in object storage: a folder's files, or
    ``{"": info}`` for a file; its version is ``stored_version``'s, as a stored model's."""
    import pyarrow.fs as pafs

    info = store.info(uri)
    return {"": info} if info.type == pafs.FileType.File else load.stored_files(uri, store)


def start_from(loads: str, store: Storage, family, denoiser: torch.nn.Module,
               text_encoders: dict[str, torch.nn.Module]) -> dict[str, dict[str, int]]:
    """``load_init`` of the adapter ``loads`` names (``checked``'s answer), downloaded into
    a temporary folder (not the node's model cache, which is keyed by URI: an adapter
    rewritten in place, as a rerun rewrites output.uri/adapter, must not be read stale).

    One in object storage is read only while its files are the version the plan listed,
    so no two workers start from two writes of it (FSDP shards whatever each rank loaded)."""
    import tempfile

    uri, _, version = loads.partition(VERSION)
    if uri.startswith(hub.SCHEME):  # into this node's hub cache (HF_TOKEN: forwarded)
        return load_init(uri, hub.fetch(uri, KEY), family, denoiser, text_encoders)
    if storage.is_local(uri):
        return load_init(uri, storage.local_path(uri), family, denoiser, text_encoders)

    def listed(when: str) -> dict:
        found = stored_files(uri, store)
        if version and (now := stored_version(uri, found)) != version:
            raise RuntimeError(
                f"{KEY}: {uri}: its files changed {when} (version {version}, now {now}: "
                "written again?); run again to start from the new files")
        return found

    with tempfile.TemporaryDirectory(prefix="raylora-init-") as tmp:
        local = download(uri, store, tmp, listed("since this run's plan listed them"))
        listed("while this worker downloaded them")
        return load_init(uri, local, family, denoiser, text_encoders)


def download(uri: str, store: Storage, tmp: str, files: dict | None = None) -> str:
    """The adapter file or folder ``uri`` in object storage copied into the folder ``tmp``;
    returns the local path (the file by its own name, a folder as ``tmp/adapter``).
    ``files``: its ``stored_files``, if listed already."""
    if "" in (files if files is not None else stored_files(uri, store)):  # a file
        local = os.path.join(tmp, uri.rstrip("/").rsplit("/", 1)[-1])
        with open(local, "wb") as f:
            f.write(store.read_bytes(uri))
    else:
        local = os.path.join(tmp, "adapter")
        # the files its version is made of: not a git clone's .git/ (a second copy of
        # every weight) or hf download's .cache/, as a stored model's download leaves them
        store.download_dir(uri, local, keep=lambda name: load.model_file(uri, name))
    return local


def load_init(uri: str, local: str, family, denoiser: torch.nn.Module,
              text_encoders: dict[str, torch.nn.Module]) -> dict[str, int]:
    """Copy the adapter at ``local`` (``uri`` downloaded: a file or folder, as ``locate``
    says) into the ``"default"`` adapter ``add_lora`` attached to ``denoiser`` and the
    trained ``text_encoders`` (component name → module). Returns layers loaded and layers
    the file does not have (they start as a no-op), per component. Raises ``ValueError``
    naming ``lora.init_from`` for layers the run's adapter lacks."""
    from raylora.model.lora import is_peft_folder

    counts = {}
    with warnings.catch_warnings():  # "Already found a peft_config attribute": the scratch one
        warnings.simplefilter("ignore")
        if os.path.isdir(local) and is_peft_folder(local):
            exact = {family.denoiser: _load_peft(local, denoiser, uri)}
        else:
            exact = _load_diffusers(local, family, denoiser, text_encoders, uri)
        for name, module in [(family.denoiser, denoiser), *text_encoders.items()]:
            counts[name] = _take_over(module, name, uri, exact.get(name, {}))
    return counts


def _load_diffusers(local: str, family, denoiser, text_encoders: dict,
                    uri: str) -> dict[str, dict[str, torch.Tensor]]:
    """The file into the scratch adapter, as the stock pipeline loads it; returns its
    tensors by component, in peft's names where diffusers' converters give them."""
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    cls = family.pipeline_class()
    sd, alphas, metadata = stock_state_dict(local, family, KEY, uri)
    sd = _own_parts(sd, family)
    dropped = sorted({k.split(".")[0] for k in sd} - {family.denoiser, *text_encoders})
    if dropped:
        raise ValueError(f"{KEY}: {uri} has LoRA layers for {', '.join(dropped)}, which this "
                         "run does not train; they would be dropped (lora.train_text_encoder)")
    try:
        # The file's keys name the family's denoiser; a run of one expert loads them into it.
        denoiser.load_lora_adapter(dict(sd), prefix=family.denoiser, network_alphas=alphas,
                                   metadata=_component_meta(metadata, family.denoiser),
                                   adapter_name=SCRATCH)
        # DoRA magnitudes spelled as the text-encoder loader reads them
        # (text_encoder_magnitudes): adapters written before that start as trained too
        te_sd = text_encoder_magnitudes(sd)
        for name, te in text_encoders.items():
            if any(k.startswith(name + ".") for k in sd):
                cls.load_lora_into_text_encoder(
                    dict(te_sd), alphas, te, prefix=name, adapter_name=SCRATCH,
                    metadata=_component_meta(metadata, name))
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ValueError(f"{KEY}: {uri} does not fit this denoiser's LoRA layers "
                         f"(lora.target_modules, model.pretrained): {exc}") from None
    # The same tensors in peft's names, renamed as the two loaders above rename them
    part = _component(sd, family.denoiser)
    out = {family.denoiser: convert_unet_state_dict_to_peft(part)
           if part and not any("lora_A" in k for k in part) else part}
    for name, te in text_encoders.items():
        part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(_component(sd, name)))
        out[name] = part if hasattr(te, "text_model") else {
            k.removeprefix("text_model."): v for k, v in part.items()}
    return out


def stock_state_dict(local: str, family, key: str, uri: str) -> tuple[dict, dict | None, dict | None]:
    """(tensors, network alphas or None, metadata) of the adapter file or folder ``local``
    as ``family``'s stock pipeline reads it (its ``lora_state_dict``: kohya/ComfyUI names
    converted), every tensor a layer of a component its ``load_lora_weights`` loads.
    ``ValueError`` naming ``key`` and ``uri`` (what the user gave) otherwise: the loader's
    own answer was a warning, hidden by raylora's quiet logging, and the base model alone."""
    try:
        out = family.pipeline_class().lora_state_dict(local, return_lora_metadata=True)
    except Exception as exc:  # a format the pipeline's converters cannot read
        raise ValueError(f"{key}: {uri}: {family.pipeline}'s lora_state_dict cannot read it "
                         f"({type(exc).__name__}: {exc})") from None
    # (state dict, network alphas, metadata), or (state dict, metadata) where a pipeline's
    # formats carry no alphas (SD3, Flux.2, ...)
    sd, metadata = out[0], out[-1]
    alphas = out[1] if len(out) == 3 else None
    if family.legacy_lora_keys:  # an earlier raylora's SD/SDXL file may mix two key styles
        sd = one_key_style(sd, family.denoiser)
    unread = sorted(k for k in sd if k.split(".")[0] not in family.lora_components())
    if unread:  # keys the pipeline passed through unconverted: its load would skip them
        raise ValueError(f"{key}: {uri}: {len(unread)} of its {len(sd)} tensors are not "
                         f"LoRA layers of a {family.pipeline} component "
                         f"({', '.join(family.lora_components())}), e.g. {unread[0]}: not a "
                         "format that pipeline converts")
    return sd, alphas, metadata


def _own_parts(sd: dict[str, torch.Tensor], family) -> dict[str, torch.Tensor]:
    """``sd`` (``stock_state_dict``'s) with the parts of each fused kohya module that the
    family's converter gave the whole rank R = k·r (``kohya_fused_load`` "whole": the same
    down each) cut back to their own r: part ``slot``'s rows of the down and columns of the
    up, where the up's other columns are all zero (raylora's block-diagonal export), so
    that export starts a run of rank r exactly. An up trained whole (sd-scripts'), or a
    diffusers file's layers (each its own down), are left as they are."""
    if family.kohya_fused_load != "whole":
        return sd
    rules = [(re.compile(r.pattern), r) for r in family.kohya_rules if len(r.sizes) > 1]
    prefix, down_leaf, up_leaf = family.denoiser + ".", ".lora_A.weight", ".lora_B.weight"
    # fused module → (its part count, slot → the part's down key)
    modules: dict[str, tuple[int, dict[int, str]]] = {}
    for key in sd:
        if key.startswith(prefix) and key.endswith(down_leaf):
            path = key[len(prefix): -len(down_leaf)]
            for pattern, rule in rules:
                if m := pattern.fullmatch(path):
                    name = rule.name.format(*m.groups())
                    modules.setdefault(name, (len(rule.sizes), {}))[1][rule.slot] = key
                    break
    out = dict(sd)
    for k, parts in modules.values():
        downs = [sd[key] for key in parts.values()]
        if (len(downs) < k or any(not torch.equal(d, downs[0]) for d in downs)
                or downs[0].shape[0] % k):
            continue  # not one fused down given to each part
        r = downs[0].shape[0] // k
        cut = {}
        for slot, key in parts.items():
            up_key = key[: -len(down_leaf)] + up_leaf
            up, own = sd.get(up_key), slice(slot * r, (slot + 1) * r)
            if up is None or up[:, : own.start].any() or up[:, own.stop:].any():
                break
            cut[key], cut[up_key] = sd[key][own].contiguous(), up[:, own].contiguous()
        else:
            out.update(cut)
    return out


def _component(sd: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}


def _component_meta(metadata: dict | None, prefix: str) -> dict | None:
    # lora_state_dict gives every component's config under "<component>."; None when the
    # file has none (then rank and alphas come from the tensors, as the stock loader does)
    if not metadata or not any(k.startswith(prefix + ".") for k in metadata):
        return None
    return metadata


def _load_peft(local: str, denoiser, uri: str) -> dict[str, torch.Tensor]:
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = PeftConfig.from_pretrained(local)
    sd = {k.removeprefix("base_model.model."): v
          for k, v in load_file(os.path.join(local, PEFT_WEIGHTS)).items()}
    try:
        inject_adapter_in_model(config, denoiser, adapter_name=SCRATCH)
        result = set_peft_model_state_dict(denoiser, sd, adapter_name=SCRATCH)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ValueError(f"{KEY}: {uri} does not fit this denoiser: {exc}") from None
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{KEY}: {uri}: layers this denoiser lacks: {unexpected[:3]}")
    return sd


@torch.no_grad()
def _take_over(module: torch.nn.Module, name: str, uri: str,
               exact: dict[str, torch.Tensor]) -> dict[str, int]:
    """The scratch adapter's weights → ``"default"``'s, layer by layer (scale carried over),
    then the scratch adapter removed and ``"default"`` active (and trainable) again.
    ``exact``: the file's tensors (peft names, the layer's module name first). peft puts a
    loaded adapter in its base layer's dtype, so over a bf16 base the scratch copy is
    rounded; the file's own value is taken wherever it is the one that was loaded."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]
    # diffusers' text-encoder loader casts the whole encoder to its dtype, the run's LoRA
    # with it: that stays fp32 (raylora.model.lora._fp32_trainable), and the same objects,
    # which the optimizer is built on next
    for _, m in layers:
        for attr in m.adapter_layer_names:
            held = getattr(m, attr)
            for _, p in _tensors(held["default"]) if "default" in held else ():
                if p.is_floating_point() and p.dtype != torch.float32:
                    p.data = p.data.float()
    mine = [(n, m) for n, m in layers if SCRATCH in m.scaling]
    if not mine:
        return {"loaded": 0, "fresh": sum("default" in m.scaling for _, m in layers)}
    lacking = [n for n, m in mine if "default" not in m.scaling]
    if lacking:
        raise ValueError(f"{KEY}: {uri} has LoRA layers on {len(lacking)} module(s) of {name} "
                         f"this run's adapter does not target, e.g. {lacking[:3]}; widen "
                         "lora.target_modules (or lora.text_encoder_target_modules)")
    variant = _variant(module.peft_config["default"])
    for n, m in mine:
        moved = 0
        for attr in m.adapter_layer_names:
            store = getattr(m, attr)
            if SCRATCH not in store:
                continue
            src, dst = _tensors(store[SCRATCH]), _tensors(store["default"])
            if [t.shape for _, t in src] != [t.shape for _, t in dst]:
                raise ValueError(f"{KEY}: {uri}: {n}.{attr} has shape "
                                 f"{tuple(src[0][1].shape)}, this run's {tuple(dst[0][1].shape)} "
                                 "(lora.rank, lora.factor)")
            ratio = (m.scaling[SCRATCH] / m.scaling["default"]) if attr in SCALED[variant] and \
                not moved else 1.0
            moved += attr in SCALED[variant]
            for (pname, s), (_, d) in zip(src, dst):
                keys = [f"{n}.{attr}.{pname}"] + ([f"{n}.{attr}"] if pname == "weight" else [])
                given = next((exact[k] for k in keys if k in exact), None)
                if given is not None and given.shape == s.shape and torch.equal(
                        given.to(s.device, s.dtype), s):
                    s = given
                d.copy_(s.to(d.device, d.dtype) * ratio)
    for _, m in layers:
        if SCRATCH in m.scaling:
            m.delete_adapter(SCRATCH)
        m.set_adapter("default")  # trainable again: the scratch adapter took that over
    module.peft_config.pop(SCRATCH, None)
    return {"loaded": len(mine), "fresh": sum("default" in m.scaling for _, m in layers) - len(mine)}


def _variant(config) -> str:
    kind = PEFT_VARIANTS[config.peft_type.value]
    return "dora" if kind == "lora" and getattr(config, "use_dora", False) else kind


def _tensors(item) -> list[tuple[str, torch.Tensor]]:
    # ModuleDict entries (Linear/Conv: weight, maybe bias) or ParameterDict entries
    if isinstance(item, torch.nn.Module):
        return sorted(item.named_parameters())
    return [("weight", item)]
