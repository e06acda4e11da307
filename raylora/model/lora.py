"""LoRA adapter: inject with peft, extract in the diffusers layout, save loadably.

What is written is exactly what the family's stock pipeline ``load_lora_weights(dir)`` reads
(``StableDiffusionPipeline``, ``FluxPipeline``, ...): ``pytorch_lora_weights.safetensors``
with ``unet.``/``transformer.``-prefixed diffusers keys (plus ``text_encoder.``/
``text_encoder_2.`` keys when text encoders are trained too) and the peft configs (rank,
alpha, targets) in the safetensors metadata.

In raylora's own state dicts (checkpoints, digests) denoiser keys carry no prefix (peft's
layout) and text-encoder keys are prefixed with their pipeline component name.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from raylora.config import LoraSection

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
log = logging.getLogger("raylora")


def peft_config(lora: LoraSection, targets):
    """The peft config of ``lora.variant``. Every variant starts as an exact no-op (LoRA's
    and DoRA's B, LoKr's w1, LoHa's w2_a at zero), so step 0 is the base model."""
    from peft import LoHaConfig, LoKrConfig

    if lora.variant == "lokr":
        return LoKrConfig(r=lora.rank, alpha=lora.effective_alpha, target_modules=list(targets),
                          decompose_both=lora.decompose_both, decompose_factor=lora.factor)
    if lora.variant == "loha":
        return LoHaConfig(r=lora.rank, alpha=lora.effective_alpha, target_modules=list(targets))
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.effective_alpha,
        lora_dropout=lora.dropout,
        # B starts at zero, A Gaussian: the adapter begins as an exact no-op, as in
        # diffusers' training scripts.
        init_lora_weights="gaussian",
        target_modules=list(targets),
        # DoRA's magnitude starts at the column norms of the base weight it wraps.
        use_dora=lora.variant == "dora",
    )


def _fp32_trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA parameters, made fp32 even when the base is fp16/bf16: an optimizer stepping
    half-precision master weights loses small updates, and fp16 grads make GradScaler
    raise "Attempting to unscale FP16 gradients"."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def add_lora(model: torch.nn.Module, lora: LoraSection, default_targets=()) -> list[torch.nn.Parameter]:
    """Attach a LoRA adapter to the frozen denoiser on ``lora.target_modules`` (default: the
    family's ``default_targets``); returns the trainable parameters."""
    targets = lora.target_modules or list(default_targets)
    model.requires_grad_(False)
    if unmatched := _unmatched(model, lora.target_modules or ()):
        raise ValueError(f"lora.target_modules: {unmatched} match no layer of the denoiser"
                         + _names_hint(model))
    try:
        model.add_adapter(peft_config(lora, targets))
    except ValueError as exc:
        raise ValueError(f"lora.target_modules: {targets}: {exc}{_names_hint(model)}") from None
    params = _fp32_trainable(model)
    if not params:
        raise ValueError(f"lora.target_modules: {targets} matched no module in the denoiser"
                         + _names_hint(model))
    return params


def _unmatched(model: torch.nn.Module, targets) -> list[str]:
    """The ``targets`` that match no module of ``model`` as peft matches a list (the whole
    name, or its last dotted parts). peft refuses a list only when none matches: one
    mistyped name among several (to_kk) would train a smaller adapter without a word."""
    names = [n for n, _ in model.named_modules()]
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]


def _names_hint(model: torch.nn.Module, whose: str = "its", most: int = 24) -> str:
    """``model``'s names that a target can match, for an error message: its linear and
    conv layers' last name parts ("to_out.0" for a layer in a list)."""
    names = set()
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    shown = sorted(names)
    more = f", ... ({len(shown)} in all)" if len(shown) > most else ""
    return f" ({whose} linear and conv layers: {', '.join(shown[:most])}{more})" if shown else ""


def target_problems(cfg) -> list[str]:
    """Why ``lora.target_modules`` (and ``lora.text_encoder_target_modules``, when text
    encoders train) would fail on the workers, found on the components built on the meta
    device from their configs alone (``raylora.memory``: no weights read), one line each;
    none when the family's defaults are used. Before Ray starts, a typo costs a second,
    not a cluster's start. A model whose meta build fails is left to the workers' check."""
    lora = cfg.lora
    if not lora.target_modules and not lora.train_text_encoder:
        return []
    from raylora import memory
    from raylora.model.load import resolve_family

    try:
        with memory.configs_folder(cfg) as path:
            index = memory.read_index(path)
            family = resolve_family(cfg.model, index)  # model.family's, else detected

            def meta(name: str) -> torch.nn.Module:
                return family.adapt_component(name, memory.meta_component(
                    path, index, name, torch.float32))

            denoiser = meta(family.trained_component(cfg.model.expert))
            encoders = ({t.encoder: meta(t.encoder) for t in family.text
                         if t.encoder in family.text_encoder_lora()}
                        if lora.train_text_encoder else {})
    except Exception as exc:  # an estimator gap must not stop a run the workers can start
        log.debug("lora targets not checked before Ray: %s", exc)
        return []
    problems = []
    for attach in (lambda: add_lora(denoiser, lora, family.default_lora_targets(denoiser)),
                   lambda: add_text_encoder_lora(encoders, lora)):
        try:
            attach()
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def add_text_encoder_lora(text_encoders: dict[str, torch.nn.Module], lora: LoraSection) -> list[torch.nn.Parameter]:
    """LoRA on the text encoders (pipeline component name → module), as diffusers' scripts
    do with ``--train_text_encoder``; returns their trainable parameters."""
    params = []
    for name, te in text_encoders.items():
        te.requires_grad_(False)
        if unmatched := _unmatched(te, lora.text_encoder_target_modules):
            raise ValueError(f"lora.text_encoder_target_modules: {unmatched} match no layer of "
                             f"{name}" + _names_hint(te, f"{name}'s"))
        try:
            te.add_adapter(peft_config(lora, lora.text_encoder_target_modules))
        except ValueError as exc:
            raise ValueError(f"lora.text_encoder_target_modules: {exc}"
                             + _names_hint(te, f"{name}'s")) from None
        mine = _fp32_trainable(te)
        if not mine:
            raise ValueError(f"lora.text_encoder_target_modules: {lora.text_encoder_target_modules} "
                             f"matched no module in {name}" + _names_hint(te, f"{name}'s"))
        params += mine
    return params


def _snapshot(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    # copy=True: for fp32 CPU tensors .float()/.cpu() are no-ops that would alias the live
    # parameters, and a "snapshot" that keeps changing is no snapshot.
    return {prefix + k: v.detach().to("cpu", torch.float32, copy=True).contiguous() for k, v in sd.items()}


def _peft_lora(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # save_embedding_layers=False: raylora never resizes a vocabulary. peft's "auto" looks
    # for the base's config.json at its name_or_path (a pipeline's folder has none, only its
    # text encoder's subfolder) and then on the hub, and warned at every checkpoint that it
    # found none; with an ``embed_tokens`` among the targets (Qwen2.5-VL's) it would add that
    # whole frozen matrix to every checkpoint.
    return get_peft_model_state_dict(module, save_embedding_layers=False)


def lora_state_dict(model: torch.nn.Module, text_encoders: dict | None = None) -> dict[str, torch.Tensor]:
    """peft-layout LoRA weights (fp32, detached, on CPU): for checkpoints and digests.
    ``text_encoders``: the trained ones by component name; their keys get that prefix."""
    sd = _snapshot(_peft_lora(model))
    for name, te in (text_encoders or {}).items():
        sd.update(_snapshot(_peft_lora(te), name + "."))
    return sd


def _load_into(module: torch.nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    result = set_peft_model_state_dict(module, sd)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"checkpoint LoRA keys do not match the {what}: {unexpected[:5]}")


TEXT_PREFIX = "text_encoder"


def load_lora_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor],
                         text_encoders: dict | None = None) -> None:
    text_encoders = text_encoders or {}
    if any(k.startswith(TEXT_PREFIX) for k in sd) and not text_encoders:
        raise ValueError("the checkpoint has text-encoder LoRA weights; set lora.train_text_encoder: true")
    _load_into(model, {k: v for k, v in sd.items() if not k.startswith(TEXT_PREFIX)}, "denoiser")
    for name, te in text_encoders.items():
        part = {k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(name + ".")}
        if not part:
            raise ValueError(f"the checkpoint has no {name} LoRA weights (lora.train_text_encoder "
                             "was off when it was written)")
        _load_into(te, part, name)


PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
LYCORIS_FILE = "lycoris.safetensors"


def is_peft_folder(directory: str) -> bool:
    """A LoKr/LoHa adapter folder (peft layout) rather than a diffusers LoRA file."""
    import os

    return os.path.exists(os.path.join(directory, PEFT_CONFIG)) and not os.path.exists(
        os.path.join(directory, WEIGHT_NAME))


def save_adapter(model: torch.nn.Module, directory: str, family, text_encoders: dict | None = None,
                 denoiser_sd: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter folder users load: the diffusers file for lora/dora, the peft folder
    (plus the LyCORIS file where the family has one) for lokr/loha."""
    if model.peft_config["default"].peft_type.value in ("LOKR", "LOHA"):
        save_peft_folder(model, directory, family)
    else:
        save_diffusers_adapter(model, directory, family, text_encoders, denoiser_sd)


def save_peft_folder(model: torch.nn.Module, directory: str, family) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` as ``PeftModel.save_pretrained``
    writes them (``PeftModel.from_pretrained(denoiser, directory)`` loads it), and
    ``lycoris.safetensors`` for the families whose LyCORIS names are known."""
    import json
    import os

    from safetensors.torch import save_file

    from raylora.checkpoint.lycoris import lycoris_state_dict

    os.makedirs(directory, exist_ok=True)
    config = model.peft_config["default"]
    sd = _snapshot(_peft_lora(model))
    save_file({"base_model.model." + k: v for k, v in sd.items()},
              os.path.join(directory, PEFT_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, PEFT_CONFIG), "w") as f:
        json.dump(config.to_dict(), f, indent=2, default=sorted)
    if family.lycoris_file:
        save_file(lycoris_state_dict(sd, config), os.path.join(directory, LYCORIS_FILE))


def save_diffusers_adapter(model: torch.nn.Module, directory: str, family,
                           text_encoders: dict | None = None,
                           denoiser_sd: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``pytorch_lora_weights.safetensors`` in the diffusers layout to ``directory``:
    the file the family's stock pipeline ``.load_lora_weights(directory)`` reads, written by
    that pipeline's own ``save_lora_weights``. ``text_encoders``: the trained ones.
    ``denoiser_sd``: the denoiser's LoRA already gathered (peft layout; FSDP shards it)."""
    from diffusers.utils import convert_state_dict_to_diffusers

    layers, meta = {}, {}
    for name, module in [(family.denoiser, model), *(text_encoders or {}).items()]:
        given = denoiser_sd if module is model else None
        sd = _snapshot(given if given is not None else _peft_lora(module))
        if family.legacy_lora_keys:
            sd = convert_state_dict_to_diffusers(sd)
            if module is model:
                # diffusers' table renames attention layers only (proj_in, conv, ff keep
                # peft's lora_A/lora_B), and its loader takes the file's style from its
                # first key: a mixed file lost the attention layers (or, DoRA, failed),
                # silently. One style throughout.
                sd = _down_up(sd)
        layers[name] = sd if module is model else text_encoder_magnitudes(_clip_paths(module, sd))
        # lora_dropout 0: diffusers' loader builds the layers from this metadata, and their
        # new Dropout modules are in train mode inside an eval pipeline: with the run's
        # dropout every image of the stock pipeline would drop a random part of the LoRA.
        meta[name] = module.peft_config["default"].to_dict() | {"lora_dropout": 0.0}
    family.save_adapter(directory, layers, meta)


def _down_up(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up."): v
            for k, v in sd.items()}


def mixed_key_style(keys, prefix: str) -> bool:
    """Whether the ``prefix.`` keys (a legacy-key family's denoiser) mix diffusers'
    ``lora.down``/``lora.up`` with peft's ``lora_A``/``lora_B``: what raylora wrote for SD/SDXL
    runs that targeted more than attention before it wrote one style (save_diffusers_adapter).
    The loaders read such a file wrongly."""
    own = [k for k in keys if k.startswith(prefix + ".")]
    return (any(".lora.down." in k or ".lora.up." in k for k in own)
            and any(".lora_A." in k or ".lora_B." in k for k in own))


def one_key_style(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``sd`` with a mixed-style denoiser (``mixed_key_style``) in ``lora.down``/``lora.up``
    throughout, as raylora writes it now; any other state dict unchanged."""
    if not mixed_key_style(sd, prefix):
        return sd
    ours = {k: v for k, v in sd.items() if k.startswith(prefix + ".")}
    return {**{k: v for k, v in sd.items() if k not in ours}, **_down_up(ours)}


def old_spellings(keys, prefix: str = "unet", legacy: bool = True) -> list[str]:
    """What an earlier raylora's adapter file (its ``keys``; ``prefix``: the family's
    denoiser, ``legacy``: a legacy-key family's) spells as the stock loaders misread it,
    in words; [] when nothing. ``current_spelling`` writes it as raylora does now."""
    found = []
    if legacy and mixed_key_style(keys, prefix):
        found.append(f"two key styles for the {prefix} (lora.down/lora.up and lora_A/lora_B), "
                     "which diffusers' load_lora_weights reads only in part")
    if any(_old_magnitude(k) for k in keys):
        found.append("text-encoder DoRA magnitudes as lora_magnitude_vector, which diffusers' "
                     "load_lora_weights leaves at the base weight norms")
    return found


def _old_magnitude(key: str) -> bool:
    # Text encoders only: the denoiser's magnitudes go through peft's loader, which reads
    # peft's spelling (text_encoder_magnitudes)
    return key.split(".", 1)[0].startswith("text_encoder") and key.endswith("lora_magnitude_vector")


def current_spelling(sd: dict[str, torch.Tensor], prefix: str = "unet",
                     legacy: bool = True) -> dict[str, torch.Tensor]:
    """``sd`` as raylora writes it now (``old_spellings``): a mixed-style denoiser in one
    style (``one_key_style``, ``legacy`` families), text-encoder DoRA magnitudes as
    ``text_encoder_magnitudes`` spells them; any other state dict unchanged."""
    sd = one_key_style(sd, prefix) if legacy else sd
    return {k + ".weight" if _old_magnitude(k) else k: v for k, v in sd.items()}


def current_spelling_file(src: str, dest: str, prefix: str = "unet", legacy: bool = True) -> list[str]:
    """Write the safetensors adapter ``src`` to ``dest`` as ``current_spelling`` spells it,
    its metadata (the peft configs) unchanged. Returns ``old_spellings`` of ``src`` ([]:
    ``dest`` is a copy of the tensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(src, framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    save_file(current_spelling(sd, prefix, legacy), dest, metadata=metadata)
    return old_spellings(sd, prefix, legacy)


def _clip_paths(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIP text encoder's LoRA under ``text_model.``: transformers 5 flattened CLIP's
    modules (``encoder.layers.0...``), and diffusers < 0.42 on transformers 4 reads the
    file's keys against ``text_model.encoder...`` (its plain ``load_lora_weights`` then
    failed on meta tensors; with ``low_cpu_mem_usage=False`` the encoder kept no LoRA).
    diffusers 0.42 takes either spelling, so one file serves both stacks."""
    if hasattr(module, "text_model") or not type(module).__name__.startswith("CLIPText"):
        return sd
    return {k if k.startswith("text_model.") else "text_model." + k: v for k, v in sd.items()}


def text_encoder_magnitudes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A text encoder's LoRA with each DoRA magnitude under ``...lora_magnitude_vector.weight``.
    peft writes ``...lora_magnitude_vector``, which its own loader renames; diffusers hands
    text-encoder LoRA to transformers' ``load_adapter``, which reads only the ``.weight``
    spelling and otherwise keeps the magnitudes at the base weight's norms: the stock
    pipeline's text encoder (and ``raylora sample``'s) was not the trained one."""
    return {k + ".weight" if k.endswith("lora_magnitude_vector") else k: v for k, v in sd.items()}


def digest(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over the LoRA tensors in key order: equal digests = bit-identical replicas."""
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
