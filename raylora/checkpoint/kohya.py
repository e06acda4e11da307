"""Diffusers LoRA layout ⇄ the kohya-ss / ComfyUI / A1111 single-file layout.

diffusers writes ``unet.<module path>.lora.down.weight`` (+ ``lora.up``) and keeps alpha in
the file's metadata; kohya-style tools expect ``lora_unet_<module path with _>.lora_down
.weight`` (+ ``lora_up``) and one ``.alpha`` scalar per module, with scale = alpha / rank.
For SD 1.x/2.x the module paths are the diffusers UNet's own (as sd-scripts names them),
which ComfyUI and A1111 map onto their UNets; text-encoder LoRA becomes ``lora_te_``
(SDXL: ``lora_te1_``/``lora_te2_``) + the transformers module path. No torch code runs on load: safetensors only.

The DiT families are named after the modules of their reference checkpoints (BFL's Flux.1
and Flux.2, SAI's MMDiT, Tongyi's Z-Image, Wan-AI's Wan; Qwen-Image's is in diffusers'
layout), as sd-scripts' ``lora_flux.py`` / ``lora_sd3.py`` and musubi-tuner write them and
ComfyUI reads them (``lora_unet_`` + the checkpoint's module path, "." → "_", which ComfyUI
matches against every weight of the model it loaded). There one linear may hold what
diffusers splits (``qkv`` = ``to_q``, ``to_k``, ``to_v``; Flux's single-block ``linear1`` =
those + ``proj_mlp``): its LoRA is block-structured, down = the parts' downs stacked (rank
k·r), up = their ups block-diagonal, alpha = k·alpha so alpha / rank keeps the parts' scale.
diffusers' own kohya-Flux, Flux.2 and Z-Image loaders split exactly this structure back.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger("raylora")

PREFIX = "unet."
KOHYA_PREFIX = "lora_unet_"
KOHYA_FILE = "adapter_kohya.safetensors"
_SUFFIXES = {
    ".lora.down.weight": ".lora_down.weight", ".lora.up.weight": ".lora_up.weight",
    # diffusers writes text-encoder LoRA in its older per-layer layout
    ".lora_linear_layer.down.weight": ".lora_down.weight",
    ".lora_linear_layer.up.weight": ".lora_up.weight",
    # peft's names, as diffusers' own training scripts save them
    ".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight",
}


def _kohya_module(kohya_prefix: str, path: str) -> str:
    """kohya name of a module. sd-scripts names CLIP modules from ``text_model.``, which
    transformers 5's CLIPTextModel no longer has in its module paths: put it back."""
    if kohya_prefix != KOHYA_PREFIX and not path.startswith("text_model."):
        path = "text_model." + path
    return kohya_prefix + path.replace(".", "_")


def _split_key(key: str) -> tuple[str, str]:
    """``<component>.<module>.lora.down.weight`` → (``<component>.<module>``, kohya leaf)."""
    suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"{key}: not a lora.down/lora.up weight")
    return key[: -len(suffix)], _SUFFIXES[suffix]


def to_kohya(sd: dict[str, torch.Tensor], alpha: float | dict[str, float],
             prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """diffusers LoRA tensors → kohya keys, plus ``<module>.alpha`` for every module.
    ``alpha``: one value, or one per component (``{"unet": 8, "text_encoder": 4}``);
    ``prefixes``: diffusers component prefix → kohya prefix (``Family.kohya_names()``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        src = next((p for p in sorted(prefixes, key=len, reverse=True) if key.startswith(p)), None)
        if src is None:
            raise ValueError(f"{key}: no kohya name for this component (known: {sorted(prefixes)})")
        path, leaf = _split_key(key)
        module = _kohya_module(prefixes[src], path[len(src):])
        a = alpha[src[:-1]] if isinstance(alpha, dict) else alpha
        out[module + leaf] = value.contiguous()
        out[module + ".alpha"] = torch.tensor(float(a))
    return out


@dataclass(frozen=True)
class Rule:
    """A diffusers denoiser module → its module in the reference checkpoint, by kohya name."""

    pattern: str  # regex, full match on the diffusers module path (``transformer_blocks.0.attn.to_q``)
    name: str  # kohya module after ``lora_unet_``; ``{0}``... are the pattern's groups
    slot: int = 0  # which rows of the reference module this is: part ``slot`` of ``sizes``
    sizes: tuple[int, ...] = (1,)  # relative row counts of all the parts (Flux linear1: 1, 1, 1, 4)
    # diffusers' AdaLayerNormContinuous emits (scale, shift), the reference (shift, scale):
    # swap the halves of lora_up when the module is one (output twice its input).
    scale_shift: bool = False
    # Fold alpha / rank into lora_up and write alpha = rank, for readers that ignore alpha on
    # this module (diffusers' kohya-Flux loader on final_layer).
    bake_alpha: bool = False


def fused(prefix: str, parts: tuple[str, ...], name: str, sizes: tuple[int, ...] | None = None) -> tuple[Rule, ...]:
    """Rules for diffusers modules ``prefix + part`` that are one reference module ``name``."""
    sizes = sizes or (1,) * len(parts)
    return tuple(Rule(prefix + re.escape(p), name, i, sizes) for i, p in enumerate(parts))


def fused_names(rules: tuple[Rule, ...]) -> list[tuple[re.Pattern, int]]:
    """(kohya module name pattern, part count) of each module ``rules`` fuse several diffusers
    modules into (``fused``): its LoRA is rank k·r in raylora's files."""
    out = {}
    for rule in rules:
        if len(rule.sizes) > 1:
            # a group may hold a dotted path, written with "_" (to_kohya_reference)
            pattern = "[^.]+".join(map(re.escape, re.split(r"\{\d+\}", rule.name)))
            out[KOHYA_PREFIX + pattern] = len(rule.sizes)
    return [(re.compile(p), k) for p, k in out.items()]


def _lora_block(parts: dict[int, tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...],
                name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' (down, up) → one (down ``[k·r, in]``, up ``[Σ out, k·r]``), zeros for the
    parts the adapter does not train. Part rows are ``sizes`` × one unit."""
    ranks = {d.shape[0] for d, _ in parts.values()}
    units = {u.shape[0] // sizes[i] for i, (_, u) in parts.items()}
    if len(ranks) > 1 or len(units) > 1:
        raise ValueError(f"{name}: its parts have different ranks or widths ({sorted(ranks)}, {sorted(units)})")
    (r,), (unit,) = ranks, units
    down0, up0 = next(iter(parts.values()))
    downs, ups = [], []
    for i, size in enumerate(sizes):
        d, u = parts.get(i, (down0.new_zeros(down0.shape), up0.new_zeros(size * unit, r)))
        downs.append(d)
        ups.append(u)
    return torch.cat(downs), torch.block_diag(*ups)


def to_kohya_reference(sd: dict[str, torch.Tensor], alphas: dict[str, float], denoiser: str,
                       rules: tuple[Rule, ...], prefixes: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    """diffusers LoRA tensors of a DiT family → kohya keys in its reference layout (``rules``
    for the denoiser; text encoders as ``to_kohya`` with ``prefixes``). ``what`` (the family)
    names it in errors. A denoiser module no rule maps is an error naming every such module."""
    comp = denoiser + "."
    out = to_kohya({k: v for k, v in sd.items() if not k.startswith(comp)}, alphas, prefixes)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        if key.startswith(comp):
            path, leaf = _split_key(key)
            tensors.setdefault(path[len(comp):], {})[leaf] = value
    compiled = [(re.compile(r.pattern), r) for r in rules]
    groups: dict[str, tuple[Rule, dict]] = {}
    unmapped = []
    for path, t in tensors.items():
        hit = next(((m, r) for p, r in compiled if (m := p.fullmatch(path))), None)
        if hit is None:
            unmapped.append(comp + path)
            continue
        m, rule = hit
        # a group may hold a dotted path (Z-Image's ``layers.0``): kohya names have no dots
        name = KOHYA_PREFIX + rule.name.format(*m.groups()).replace(".", "_")
        groups.setdefault(name, (rule, {}))[1][rule.slot] = (t[".lora_down.weight"], t[".lora_up.weight"])
    if unmapped:
        raise ValueError(f"{', '.join(sorted(unmapped))}: no module of {what}'s reference "
                         f"checkpoint (the kohya/ComfyUI layout) corresponds; train without these "
                         f"targets to export kohya")
    for name, (rule, parts) in sorted(groups.items()):
        down, up = parts[0] if len(rule.sizes) == 1 else _lora_block(parts, rule.sizes, name)
        alpha = alphas[denoiser] * len(rule.sizes)  # rank k·r: alpha k·a keeps each part's a / r
        if rule.scale_shift and up.shape[0] == 2 * down.shape[1]:
            up = torch.cat(up.chunk(2)[::-1])
        if rule.bake_alpha:
            up, alpha = up * (alpha / down.shape[0]), down.shape[0]
        out[name + ".lora_down.weight"] = down.contiguous()
        out[name + ".lora_up.weight"] = up.contiguous()
        out[name + ".alpha"] = torch.tensor(float(alpha))
    return out


def from_kohya(sd: dict[str, torch.Tensor], module_names: list[str],
               prefixes: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya tensors → (diffusers tensors, alpha per diffusers module). ``module_names`` are
    the diffusers module paths, UNet ones bare or all with their component prefix (``_`` is
    ambiguous in kohya names, so they are matched, not parsed)."""
    full = [n if n.startswith(tuple(prefixes)) else PREFIX + n for n in module_names]
    by_flat = {}
    for n in full:
        src = next(p for p in sorted(prefixes, key=len, reverse=True) if n.startswith(p))
        by_flat[_kohya_module(prefixes[src], n[len(src):])] = n
    bare = all(not n.startswith(tuple(prefixes)) for n in module_names)
    out, alphas = {}, {}
    for key, value in sd.items():
        flat, _, leaf = key.partition(".")
        module = by_flat[flat]
        if leaf == "alpha":
            alphas[module[len(PREFIX):] if bare else module] = float(value)
        else:
            kind = {"lora_down.weight": "down.weight", "lora_up.weight": "up.weight"}[leaf]
            layer = "lora" if module.startswith(PREFIX) else "lora_linear_layer"
            out[f"{module}.{layer}.{kind}"] = value
    return out, alphas


def read_adapter(diffusers_file: str) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, float]]:
    """(tensors, rank per component, alpha per component) of a diffusers adapter file; alpha
    and rank come from the adapter metadata diffusers stored (absent: alpha = rank)."""
    with safe_open(diffusers_file, framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
        raw = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    dora = sorted(k for k in sd if "lora_magnitude_vector" in k)
    if dora:
        # kohya files carry DoRA as ``dora_scale``, but readers disagree on it: LyCORIS (and
        # diffusers) divide an output-axis dora_scale by the adapted weight's row norms as
        # peft trained it, ComfyUI by the base weight's. No one file is right for both.
        raise ValueError(f"{diffusers_file}: a DoRA adapter ({dora[0]}, ...): kohya export is "
                         "for lora.variant=lora (ComfyUI applies a kohya file's DoRA magnitudes "
                         "otherwise than peft trained them); load the diffusers folder instead")
    ranks, alphas = {}, {}
    for comp in sorted({k.split(".", 1)[0] for k in sd}):
        # diffusers prefixes each peft config key with its component ("unet.r").
        meta = {k.split(".", 1)[1]: v for k, v in raw.items() if k.startswith(comp + ".")}
        if meta.get("use_rslora") or meta.get("rank_pattern") or meta.get("alpha_pattern"):
            raise ValueError(f"{diffusers_file}: rsLoRA or per-module rank/alpha has no kohya equivalent here")
        ranks[comp] = int(meta.get("r") or next(
            v.shape[0] for k, v in sd.items() if k.startswith(comp + ".") and _split_key(k)[1] == ".lora_down.weight"))
        alphas[comp] = float(meta.get("lora_alpha") or ranks[comp])
    return sd, ranks, alphas


def export_kohya(diffusers_file: str, dest_file: str, base_model: str, family) -> dict:
    """Write the kohya file for a diffusers adapter file of ``family``. Returns the kohya
    metadata written."""
    tensors, kohya_meta = kohya_contents(diffusers_file, base_model, family)
    _write(dest_file, tensors, kohya_meta, family)
    return kohya_meta


def shared_model_name(base_model: str) -> str:
    """``ss_sd_model_name`` for ``base_model`` (model.pretrained): a hub id as it is, a
    folder or storage URI by its last part (``/home/alice/models/sd15`` → ``sd15``), as
    sd-scripts names a local model. The file is made to be shared (Civitai, A1111 and Forge
    show the field): a home folder or a private bucket's name does not belong in it."""
    from raylora.checkpoint.export import hub_model_id

    return hub_model_id(base_model) or base_model.rstrip("/").rsplit("/", 1)[-1]


def kohya_contents(diffusers_file: str, base_model: str, family) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the kohya file for a diffusers adapter file of ``family``."""
    sd, ranks, alphas = read_adapter(diffusers_file)
    tensors = family.kohya_state_dict(sd, alphas)
    main = family.denoiser if family.denoiser in ranks else sorted(ranks)[0]
    kohya_meta = {
        "ss_network_module": family.kohya_network,
        "ss_network_dim": str(ranks[main]),
        "ss_network_alpha": f"{alphas[main]:g}",
        "ss_sd_model_name": shared_model_name(base_model),
        "raylora_source": "diffusers adapter converted by raylora",
        **family.kohya_version(sd),
    }
    if any(c.startswith("text_encoder") for c in ranks):
        kohya_meta["ss_network_args"] = json.dumps({"train_text_encoder": True})
    return tensors, kohya_meta


def _write(dest_file: str, tensors: dict[str, torch.Tensor], kohya_meta: dict[str, str], family) -> None:
    save_file(tensors, dest_file, metadata=kohya_meta)
    _say_if_stock_cannot_read(dest_file, family)


def _holds(kohya_file: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``kohya_file`` holds exactly ``tensors``: it is an earlier export of the same
    adapter weights (by any raylora version, or the training run's own), whatever its metadata."""
    try:
        with safe_open(kohya_file, framework="pt") as f:
            return set(f.keys()) == tensors.keys() and all(
                torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
    except (OSError, SafetensorError):
        return False


def _say_if_stock_cannot_read(kohya_file: str, family) -> None:
    """A warning where the family's stock diffusers pipeline does not read the file it was
    written for ComfyUI / sd-scripts (SD3's, Lumina-Image 2.0's; Wan's without every
    block's FFN): its ``load_lora_weights`` loaded none of it with a warning, or raised
    from its converter. Read as ``raylora sample`` and ``lora.init_from`` read it."""
    from raylora.model.lora_init import stock_state_dict

    try:
        stock_state_dict(kohya_file, family, "kohya file", kohya_file)
    except ValueError as exc:
        log.warning("%s. The file is for ComfyUI and kohya-style tools (the reference "
                    "checkpoint's names); in diffusers, raylora sample and lora.init_from, "
                    "load the adapter folder", exc)


# Only SDXL's UNet has attention blocks of depth > 1 (2 and 10 transformer blocks deep);
# only SD 1/2's has a fourth down/up block; the cross-attention's key/value read the text
# states: 2048 wide in SDXL (CLIP-L + CLIP-G), 768 / 1024 in SD 1 / SD 2.
_SDXL_DEPTH = re.compile(r"\.transformer_blocks\.[1-9]")
_SD_FOURTH = re.compile(r"^unet\.(down|up)_blocks\.3\.")


def _sd_or_sdxl(sd: dict[str, torch.Tensor]) -> str | None:
    """``"sd"`` or ``"sdxl"`` where the adapter's UNet shapes say which; None where they
    cannot (a tiny or custom UNet, or no layer that differs): their module names are the
    same, so their kohya keys are too, but A1111/Forge list a file by its base model."""
    votes = set()
    for key, value in sd.items():
        if not key.startswith(PREFIX):
            continue
        if _SDXL_DEPTH.search(key):
            votes.add("sdxl")
        if _SD_FOURTH.match(key):
            votes.add("sd")
        if (".attn2.to_k." in key or ".attn2.to_v." in key) and _split_key(key)[1] == ".lora_down.weight":
            votes.add({2048: "sdxl", 768: "sd", 1024: "sd"}.get(value.shape[1], "other"))
    return next(iter(votes)) if len(votes) == 1 and votes != {"other"} else None


def _guess_family(sd: dict[str, torch.Tensor], alphas: dict[str, float], where: str):
    """The family whose kohya layout maps every key of the adapter; several that map it to
    different files, or to the same file labelled for different base models (SD and SDXL
    adapters their shapes do not tell apart), are an error asking for ``--family``."""
    from raylora.model import families

    fits: dict[str, dict[str, torch.Tensor]] = {}
    for name in families.names():
        fam = families.get(name)
        if fam.kohya_export:
            try:
                fits[name] = fam.kohya_state_dict(sd, alphas)
            except (ValueError, KeyError):
                continue
    if not fits:
        raise ValueError(f"{where}: no model family's kohya layout fits its keys; pass --family")
    if {"sd", "sdxl"} <= fits.keys() and (unet := _sd_or_sdxl(sd)):
        fits.pop("sdxl" if unet == "sd" else "sd")
    first = next(iter(fits.values()))
    same = all(v.keys() == first.keys() and all(torch.equal(v[k], first[k]) for k in first)
               for v in fits.values())
    if not same:
        raise ValueError(f"{where}: its keys fit the kohya layouts of several families "
                         f"({', '.join(fits)}); pass --family")
    versions = {name: families.get(name).kohya_version(sd) for name in fits} if len(fits) > 1 else {}
    if len({json.dumps(v, sort_keys=True) for v in versions.values()}) > 1:
        labels = ", ".join(f"{n}: {v.get('ss_base_model_version')}" for n, v in versions.items())
        raise ValueError(f"{where}: its keys fit the kohya layouts of several families "
                         f"({', '.join(fits)}) whose files name different base models ({labels}), "
                         "and its shapes do not tell which it was trained on; pass --family")
    return families.get(next(iter(fits)))


def export_folder(adapter_dir: str, dest: str | None = None, family: str | None = None) -> tuple[str, type, str]:
    """``raylora export --format kohya``: the diffusers adapter folder ``adapter_dir`` (as
    raylora writes it: ``pytorch_lora_weights.safetensors`` + ``raylora.json``) → a kohya
    file, by default ``<folder>_kohya.safetensors`` beside the folder (a run's ``adapter/``:
    ``adapter_kohya.safetensors``, where ``raylora train`` puts it). That default is replaced
    only where it holds this adapter's own earlier export; ``dest`` is written whatever it
    holds. The family: ``family``, else the one ``raylora.json`` names, else the one whose
    layout fits the keys. Returns (file written, family, how the family was found)."""
    from raylora.checkpoint.export import read_run_meta
    from raylora.model import families
    from raylora.model.lora import LYCORIS_FILE, WEIGHT_NAME

    weights = os.path.join(adapter_dir, WEIGHT_NAME)
    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"{adapter_dir}: no such adapter folder")
    if os.path.isfile(os.path.join(adapter_dir, LYCORIS_FILE)) and not os.path.isfile(weights):
        raise ValueError(f"{adapter_dir}: a LoKr/LoHa adapter; its {LYCORIS_FILE} already is "
                         "the file ComfyUI, Forge and A1111 load (kohya export is for lora.variant=lora)")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: not found; {adapter_dir} is not a diffusers adapter folder")
    info = read_run_meta(adapter_dir)
    base_model = str(info.get("config", {}).get("model", {}).get("pretrained", ""))
    how = "--family"
    if family is None and info.get("data", {}).get("family"):
        family, how = info["data"]["family"], "raylora.json"
    if family is None:
        sd, _, alphas = read_adapter(weights)
        fam, how = _guess_family(sd, alphas, weights), "guessed from the adapter keys"
    elif family not in families.names():
        raise ValueError(f"--family: unknown family {family!r} (known: {', '.join(families.names())})")
    else:
        fam = families.get(family)
    if not fam.kohya_export:
        raise ValueError(f"{adapter_dir}: kohya export is not available for {fam.name}")
    named = dest is not None
    # Named after the folder, as --format diffusers names its copy: adapters kept side by
    # side (loras/char_a, loras/char_b) each get their own file, not one they overwrite.
    # A run's adapter/ gives KOHYA_FILE, the name raylora train writes beside it.
    where = os.path.abspath(adapter_dir)
    dest = dest or os.path.join(os.path.dirname(where), f"{os.path.basename(where)}_kohya.safetensors")
    folder = os.path.realpath(adapter_dir)
    if os.path.realpath(dest) == folder or os.path.realpath(dest).startswith(folder + os.sep):
        # The adapter folder is published whole (manifest.json lists its files): a file
        # written into it, its weights above all, breaks what it holds.
        raise ValueError(f"--out: {dest} is inside the adapter folder {adapter_dir}; write the "
                         "kohya file beside it")
    if os.path.isdir(dest):
        raise ValueError(f"--out: {dest} is a folder; name the .safetensors file to write")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot write {dest} ({exc.strerror})") from None
    tensors, kohya_meta = kohya_contents(weights, base_model, fam)
    if not named and os.path.isfile(dest) and not _holds(dest, tensors):
        # Another adapter's file (or this one's from other weights): replacing it silently
        # loses it; --out is how to say which file to write.
        raise ValueError(f"{dest}: exists and is not this export of {adapter_dir} (another "
                         "adapter's kohya file, or one an earlier raylora wrote otherwise?); pass "
                         "--out FILE to write elsewhere (or over it), or remove it")
    _write(dest, tensors, kohya_meta, fam)
    return dest, fam, how
