"""Final checkpoint → published adapter, metrics and loss curve.

Output layout under ``output.uri``::

    adapter/pytorch_lora_weights.safetensors   stock diffusers ``load_lora_weights(dir)``
    adapter/README.md                          model card
    adapter/raylora.json                       {"config", "metrics", "data", ...}
    metrics.jsonl                              one row per optimizer step
    loss.png                                   the loss curve
    train/checkpoint_*                         Ray Train checkpoints (resumable state)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version

import pyarrow.fs as pafs

from raylora import storage
from raylora.storage import Storage
from raylora.checkpoint.state import ADAPTER_DIR, HISTORY_FILE
from raylora.config import RayLoraConfig
from raylora.model.lora import LYCORIS_FILE, PEFT_CONFIG, PEFT_WEIGHTS, WEIGHT_NAME

log = logging.getLogger("raylora.export")

RUN_META = "raylora.json"  # an adapter folder's config, metrics, data and versions
MANIFEST = "manifest.json"  # the adapter folder's files and sizes, written last: complete

SUMMARY_KEYS = (
    "train_loss_first",
    "train_loss_last",
    "steps",
    "images_seen",
    "wall_seconds",
    "epoch",
    "resumed_from_step",
    "eval_loss_base",
    "eval_loss_last",
    "eval_loss_best",
    "eval_loss_best_step",
    "nonfinite_steps",
    "encoders_on_worker",
    "denoiser_param_bytes_per_rank",  # per worker: the whole denoiser (ddp) or its shard (fsdp)
)


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def data_fingerprint(files: list[str], store: Storage) -> str:
    """sha256 over shard names, sizes and mtimes: changes when the data changes.

    Sizes and mtimes come from one listing per folder (``Storage.beside``): a request per
    file took minutes at every start for an object-store dataset of 100k images. A file the
    listing does not name as such is asked about on its own (same values)."""
    h = hashlib.sha256()
    listed = store.beside(files) if len(files) > 1 else {}
    for f in files:
        info = listed.get(f)
        if info is None or info.type != pafs.FileType.File:
            info = store.info(f)
        mtime = int(info.mtime.timestamp()) if info.mtime else 0
        h.update(f"{f}:{info.size}:{mtime}\n".encode())
    return h.hexdigest()[:16]


def _heldout_source(cfg: RayLoraConfig) -> str:
    d = cfg.data
    # a size of its own only when set: cards of runs measured at data.resolution read as before
    at = "" if cfg.validation.resolution is None else f", at validation.resolution={cfg.validation.resolution}"
    if d.validation_uri is not None:
        return f"data.validation_uri={d.validation_uri}{at}"
    if d.validation_split:
        return f"data.validation_split={d.validation_split:g} of the training rows{at}"
    return "none"


def summarize_metrics(reported: dict) -> dict:
    m = {k: reported.get(k) for k in SUMMARY_KEYS}
    m["steps"] = reported.get("global_step", reported.get("step"))
    digests = reported.get("replica_lora_digests") or []
    m["replica_lora_digests"] = digests
    m["replicas_in_sync"] = bool(digests) and len(set(digests)) == 1
    m["worker_nodes"] = reported.get("worker_nodes") or []
    buckets = reported.get("replica_bucket_digests")
    if buckets:  # data.bucketing: each rank's per-step buckets, digested
        m["replica_bucket_digests"] = buckets
        m["buckets_in_sync"] = len(set(buckets)) == 1
    return m


def _sources(plan: dict) -> list[dict]:
    """The plan's per-source entries with ``rows_decoded``: the source's rows that passed
    the validating decode during the run (read-ahead included; with the latent cache, the
    rows encoded when this run built it; None when nothing was decoded)."""
    decoded = plan.get("rows_decoded_by_source") or {}
    return [{**s, "rows_decoded": decoded.get(str(s["source"]), 0) if decoded else None}
            for s in plan.get("sources", [])]


def _sources_table(sources: list[dict]) -> str:
    """The model card's lines for a mix of several sources ("" for one)."""
    if len(sources) < 2:
        return ""
    rows = "".join(f"| {table_cell(s['uri'])} | {s['rows']} | {s['rows_per_epoch']} | {s['share']:.1%} |\n"
                   for s in sources)
    return f"\n| source | rows | rows per epoch | share |\n|---|---|---|---|\n{rows}"


def _commit_label(cfg: RayLoraConfig) -> str:
    """The card's name for ``model_commit``: a hub commit, or a stored folder's version."""
    from raylora.model.load import is_hub_id

    return "commit" if is_hub_id(cfg.model.pretrained) else "version (its files as listed)"


def _workers(s) -> str:
    """``4``, or an elastic run's ``1-4``."""
    return f"{s.min_workers}-{s.max_workers}" if s.elastic else str(s.num_workers)


def call_args(kwargs: dict) -> str:
    """Keyword arguments as the Python source that follows a call's first argument:
    ``{"a": 1, "b": True}`` → ``", a=1, b=True"`` (the card's and the summary's code)."""
    return "".join(f", {k}={v!r}" for k, v in kwargs.items())


def quoted_args(kwargs: dict[str, str]) -> str:
    """String keyword arguments in double quotes, as the card's and the summary's
    ``from_pretrained`` calls spell them: ``{"variant": "fp16"}`` → ``', variant="fp16"'``."""
    return "".join(f', {k}="{v}"' for k, v in kwargs.items())


def from_pretrained_kwargs(cfg: RayLoraConfig, commit: str | None) -> dict:
    """The base's ``from_pretrained`` arguments beyond its name, as the run loaded it: the
    hub commit it trained on (``main`` may have moved since) and the weight variant."""
    from raylora.model.load import is_hub_id

    kw = {"revision": commit} if commit and is_hub_id(cfg.model.pretrained) else {}
    return kw | ({"variant": cfg.model.variant} if cfg.model.variant else {})


def read_run_meta(folder: str) -> dict:
    """An adapter folder's ``raylora.json`` (``_write_adapter_folder``), {} when it has none."""
    path = os.path.join(folder, RUN_META)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _usage(cfg: RayLoraConfig, family, commit: str | None = None) -> str:
    """How to load this folder: stock ``load_lora_weights`` for lora/dora; peft (and the
    LyCORIS file in ComfyUI / Forge) for lokr/loha, which diffusers' loaders do not read.
    ``commit``: the hub commit of the base the run trained (``model_commit``), which the
    call loads (``main`` may have moved since)."""
    name, note = base_in_code(cfg.model.pretrained)
    pipe = (f'pipe = {family.pipeline}.from_pretrained({name}'
            f'{quoted_args(from_pretrained_kwargs(cfg, commit))})' + (f"  # {note}" if note else ""))
    if cfg.train.prediction_type in ("epsilon", "v_prediction"):
        # the parameterisation the run trained, which may not be the base scheduler's
        pipe += ("\npipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, "
                 f'prediction_type="{cfg.train.prediction_type}")  # as trained')
    # The family's guidance arguments (Qwen-Image guides only with true_cfg_scale and a
    # negative prompt, so a bare pipe("...") would sample it unguided) at the scale the
    # run's previews used: validation.guidance_scale, else the family's default (a
    # guidance-distilled model such as Z-Image-Turbo is validated at 0).
    args = call_args(family.guidance_kwargs(cfg.validation.guidance_scale))
    args += call_args(family.prompt_kwargs(cfg.model.system_prompt))  # as the run trained
    args += call_args(family.length_kwargs(cfg.model.max_sequence_length))  # likewise
    # prompt by name: Flux2KleinPipeline's first parameter is a reference image.
    args += call_args(family.image_call())
    # the trigger word leads the prompt as it led every training caption
    lead = f"{_triggers(cfg)[0]}, " if _triggers(cfg) else ""
    call = f'image = pipe(prompt={quoted(lead + "your prompt")}{args}){family.image_code()}'
    # an edit model (its pipeline may sample only so): the input image the prompt edits
    if cfg.data.control_images or family.reference_required:
        n = cfg.data.control_inputs if cfg.data.control_images else 1
        # several inputs (data.control_inputs): a list, in the order they trained
        image = ('load_image("your input image.png")' if n == 1 else
                 "[" + ", ".join(f'load_image("input {k + 1}.png")' for k in range(n)) + "]")
        call = ('from diffusers.utils import load_image\n'
                f'image = pipe(image={image}, prompt={quoted(lead + "your edit")}{args}){family.image_code()}')
    if cfg.lora.variant in ("lora", "dora"):
        # A pipeline of experts: into the one trained (Wan 2.2's low-noise transformer_2).
        into = call_args(family.lora_load_kwargs(cfg.model.expert))
        others = "".join(
            f"# the {e} expert's adapter too, if a run with model.expert={e} made one:\n"
            f'# pipe.load_lora_weights("path/to/that/folder"{call_args(family.lora_load_kwargs(e))})\n'
            for e in family.experts if cfg.model.expert and e != cfg.model.expert)
        return (f"```python\nfrom diffusers import {family.pipeline}\n{pipe}\n"
                f'pipe.load_lora_weights("path/to/this/folder"{into})\n{others}{call}\n```')
    denoiser = family.trained_component(cfg.model.expert)
    comfy = (f"`{LYCORIS_FILE}` is the LyCORIS file: put it in ComfyUI's `models/loras` (or "
             "Forge / A1111's) and load it as a LoRA.\n\n" if family.lycoris_file else "")
    return (f"{comfy}In Python, the peft folder (`{PEFT_CONFIG}`, `{PEFT_WEIGHTS}`):\n\n"
            f"```python\nfrom diffusers import {family.pipeline}\nfrom peft import PeftModel\n"
            f"{pipe}\npipe.{denoiser} = PeftModel.from_pretrained(pipe.{denoiser}, "
            f'"path/to/this/folder")\n{call}\n```')


BASE_COPY = "path/to/a/copy/of/the/base"


def base_in_code(pretrained: str) -> tuple[str, str]:
    """The base as the card's and the summary's ``from_pretrained`` call names it: a hub
    id or a folder, quoted (a path may hold a ``"``); and what to say beside it, for a
    base in object storage (``s3://``, ``gs://``...), which diffusers cannot read: the call
    names a local copy, the note the URI the run trained."""
    from raylora.storage import is_local, local_path, masked

    if is_local(pretrained):
        return quoted(local_path(pretrained) if pretrained.startswith("file:") else pretrained), ""
    return quoted(BASE_COPY), f"a local copy of {masked(pretrained)}: diffusers reads a folder or a hub id"


def code_span(text: str) -> str:
    """``text`` as a Markdown code span whatever backticks it holds (CommonMark: a fence
    one backtick longer than its longest run, a space inside where it starts or ends with
    one): a trigger word with a backtick ended the span and broke the card's line."""
    import re

    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table_cell(text: str) -> str:
    """``text`` in a Markdown table's cell: a ``|`` (a source URI's) escaped, which else
    split the row."""
    return str(text).replace("|", "\\|")


def quoted(text: str) -> str:
    """``text`` in double quotes as both Python and YAML read it back: JSON's escapes (both
    share them), printable non-ASCII as it is. ``json.dumps``' default writes an emoji as a
    surrogate pair (``\\ud83d\\udc31``), which YAML reads as two lone surrogates; what
    YAML does not allow unescaped (C1 controls, U+2028) is escaped."""
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                   else f"\\U{ord(c):08x}" for c in json.dumps(text, ensure_ascii=False))


def _resolutions(cfg: RayLoraConfig) -> str:
    """The resolution(s) the run trained at: every source's (data.sources' own with
    bucketing), ``1024`` or ``[768, 1024]``; data.resolution alone misses a source's own."""
    res = sorted({r for sec in cfg.data.source_sections() for r in sec.resolutions()})
    return str(res[0]) if len(res) == 1 else str(res)


def _triggers(cfg: RayLoraConfig) -> list[str]:
    """The sources' trigger words (data.caption_prefix, each source's own), each once, in
    the config's order."""
    out = []
    for section in cfg.data.source_sections():
        word = section.caption_prefix.strip().rstrip(",").strip()
        if word and word not in out:
            out.append(word)
    return out


def hub_model_id(pretrained: str) -> str | None:
    """The hub id ``owner/name`` of a model.pretrained that names one (``hf://owner/name@rev``
    too); None for a folder or a storage URI."""
    import re

    from raylora.model.load import is_hub_id

    name = pretrained.removeprefix("hf://").split("@", 1)[0]
    hub = is_hub_id(name) and not name.startswith((".", "~"))
    return name if hub and re.fullmatch(r"[\w.-]+/[\w.-]+", name) else None


def _front_matter_base(cfg: RayLoraConfig) -> str:
    """``base_model``: a hub model's id (``hub_model_id``). The hub refuses a card whose
    base_model is no model id (a folder, an s3:// URI) when it is uploaded: the key is left
    out then; the card's heading and call name the path."""
    name = hub_model_id(cfg.model.pretrained)
    return f"base_model: {name}\n" if name else ""


def _front_matter_triggers(cfg: RayLoraConfig) -> str:
    """``instance_prompt``, the key the Hugging Face hub shows as the trigger words (and
    diffusers' LoRA scripts write): one source's, or every source's, comma-joined."""
    words = _triggers(cfg)
    return f"instance_prompt: {quoted(', '.join(words))}\n" if words else ""


def _text_encoder_row(cfg: RayLoraConfig, family) -> str:
    lo = cfg.lora
    if not lo.train_text_encoder:
        return ""
    lr = lo.text_encoder_lr if lo.text_encoder_lr is not None else cfg.train.learning_rate
    return (f"| text-encoder LoRA ({', '.join(family.text_encoder_lora())}) | "
            f"{', '.join(lo.text_encoder_target_modules)}, learning rate {lr:g} |\n")


def _quantized_row(cfg: RayLoraConfig) -> str:
    """A quantized base (QLoRA): the adapter learned on its rounded weights, which the
    stock pipeline it is loaded into does not have."""
    m = cfg.model
    if m.quantize == "none" and m.quantize_text_encoders == "none":
        return ""
    return (f"| base quantized while training (model.quantize, quantize_text_encoders) | "
            f"{m.quantize}, {m.quantize_text_encoders} |\n")


def _optimizer_rows(t) -> str:
    """The optimizer and the settings it read: AdamW's for the AdamW kinds and Prodigy
    (which takes train.adam_*), train.adafactor.* for Adafactor, whose relative_step mode
    reads no learning rate or schedule."""
    lr = f"| learning rate (scale_lr) | {t.learning_rate:g} ({t.scale_lr}) |\n"
    schedule = f"| LR schedule, warmup | {t.lr_scheduler}, {t.lr_warmup_steps} steps |\n"
    adam = (f"| betas, weight decay, eps | {t.adam_beta1:g}/{t.adam_beta2:g}, "
            f"{t.adam_weight_decay:g}, {t.adam_epsilon:g} |\n")
    if t.optimizer == "prodigy":
        p = t.prodigy
        return (f"| optimizer | prodigy (d_coef {p.d_coef:g}, d0 {p.d0:g}, growth_rate "
                f"{p.growth_rate}, beta3 {p.beta3}, decouple {p.decouple}, use_bias_correction "
                f"{p.use_bias_correction}, safeguard_warmup {p.safeguard_warmup}, slice_p "
                f"{p.slice_p}) |\n" + lr + schedule + adam)
    if t.optimizer == "adafactor":
        a = t.adafactor
        row = (f"| optimizer | adafactor (relative_step {a.relative_step}, scale_parameter "
               f"{a.scale_parameter}, warmup_init {a.warmup_init}, clip_threshold "
               f"{a.clip_threshold:g}, decay_rate {a.decay_rate:g}, beta1 {a.beta1}, weight_decay "
               f"{a.weight_decay:g}, eps {a.eps[0]:g}/{a.eps[1]:g}) |\n")
        if a.relative_step:  # its own step size: learning_rate and the schedule unread
            return row + "| learning rate | Adafactor's own relative step size |\n"
        return row + lr + schedule
    return f"| optimizer | {t.optimizer} |\n" + lr + schedule + adam


def _expert(cfg: RayLoraConfig, family) -> str:
    """``, expert `low_noise` (transformer_2)``: the one a pipeline of experts trained."""
    e = cfg.model.expert
    return f", expert `{e}` (`{family.trained_component(e)}`)" if e else ""


def model_card(cfg: RayLoraConfig, metrics: dict, data: dict) -> str:
    from raylora.model import families

    t, lo = cfg.train, cfg.lora
    family = families.get(data.get("family", "sd"))
    targets = lo.target_modules or list(family.named_lora_targets())
    loss_first = metrics.get("train_loss_first")
    loss_last = metrics.get("train_loss_last")
    fmt = lambda x: "n/a" if x is None else f"{x:.5f}"  # noqa: E731
    return f"""---
{_front_matter_base(cfg)}{_front_matter_triggers(cfg)}library_name: diffusers
license: other
tags:
- text-to-image
- diffusers
- lora
- raylora
inference: true
---

# LoRA adapter for {cfg.model.pretrained}

A {family.description} LoRA (family `{family.name}`{_expert(cfg, family)}, objective
`{data.get("objective")}`), trained with raylora on Ray Train
({_workers(cfg.scaling)} worker(s), {"GPU" if cfg.scaling.use_gpu else "CPU"}, mixed
precision `{t.mixed_precision}`).

## Use

{_usage(cfg, family, data.get("model_commit"))}

## Training

| | |
|---|---|
{f"| base model {_commit_label(cfg)} | {data['model_commit']} |{chr(10)}" if data.get("model_commit") else ""}| adapter variant | {lo.variant}{f" (factor {lo.factor}, decompose_both {lo.decompose_both})" if lo.variant == "lokr" else ""} |
| LoRA rank / alpha / dropout | {lo.rank} / {lo.effective_alpha:g} / {lo.dropout:g} |
{f"| started from (lora.init_from) | {data.get('init_from') or lo.init_from} |{chr(10)}" if lo.init_from else ""}| target modules | {", ".join(targets)} |
{_text_encoder_row(cfg, family)}{_quantized_row(cfg)}{_optimizer_rows(t)}| batch per worker × accumulation × workers | {t.batch_size} × {t.gradient_accumulation_steps} × {cfg.scaling.max_workers}{f" (elastic {_workers(cfg.scaling)}: the same global batch {cfg.global_batch()} at every size)" if cfg.scaling.elastic else ""} |
| max grad norm | {t.max_grad_norm:g} |
| resolution, center crop, random flip | {_resolutions(cfg)}{f" (aspect buckets, step {cfg.data.bucket_step})" if cfg.data.bucketing else ""}, {cfg.data.center_crop}, {cfg.data.random_flip} |
| seed | {t.seed} |
| optimizer steps | {metrics.get("steps")} |
| images seen | {metrics.get("images_seen")} |

## Data

{data.get("rows")} image-caption rows per epoch (repeats counted) in {data.get("files")} file(s), fingerprint `{data.get("fingerprint")}`;
{data.get("heldout_rows")} held-out rows evaluated ({data.get("heldout")}).
{f"Trigger word(s), first in every caption: {', '.join(code_span(w) for w in _triggers(cfg))}.{chr(10)}" if _triggers(cfg) else ""}{_sources_table(data.get("sources", []))}
## Results

| metric | value |
|---|---|
| train loss, first step | {fmt(loss_first)} |
| train loss, last step | {fmt(loss_last)} |
| held-out loss: {"start (lora.init_from)" if lo.init_from else "base model"} → last (best at step) | {fmt(metrics.get("eval_loss_base"))} → {fmt(metrics.get("eval_loss_last"))} ({fmt(metrics.get("eval_loss_best"))} at {metrics.get("eval_loss_best_step")}) |
| wall time (s) | {metrics.get("wall_seconds") or 0:.1f} |
"""


def plot_loss(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, lw=1, alpha=0.5, label="loss")
    if len(losses) >= 5:
        k = max(2, len(losses) // 10)
        windows = [losses[max(0, i - k + 1) : i + 1] for i in range(len(losses))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({k})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("denoising MSE")
    ax.set_title("raylora training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_data(cfg: RayLoraConfig, plan: dict, store: Storage) -> dict:
    """The ``data`` section of ``raylora.json`` and the model card, from the driver's plan.
    A finished run's re-export (``plan["trained_data"]``) keeps the description of the
    data it trained (files, rows, fingerprint, sources, buckets) as that run wrote it."""
    from raylora.model import families

    files = plan["shard_files"]
    family = families.get(plan.get("family", "sd"))
    trained = plan.get("trained_data") or {}
    return {
        "format": plan["data_format"],
        "files": len(files),
        "rows": plan["total_rows"],
        # Over every file rows come from (a caption folder's captions too).
        "fingerprint": trained.get("fingerprint") or data_fingerprint(plan.get("content_files") or files, store),
        "heldout_rows": plan.get("heldout_rows", 0),
        "heldout": _heldout_source(cfg),
        "family": family.name,
        "pipeline": family.pipeline,
        "adapter_variant": cfg.lora.variant,
        "objective": plan.get("objective"),
        # An edit run (data.control_images): input images a sample brings (data.control_inputs),
        # what its pipeline takes as a list of that length.
        **({"control_inputs": cfg.data.control_inputs} if cfg.data.control_images else {}),
        # A hub model: the commit every worker loaded (model.revision resolved by the plan);
        # a folder in object storage: the version of its files they downloaded.
        **({"model_commit": plan["model_commit"]} if plan.get("model_commit") else {}),
        # lora.init_from on the hub: the commit every worker started from (hf://...@commit);
        # in object storage: the version of its files they read ({uri}#version={version}).
        **({"init_from": pinned} if (pinned := (plan.get("pins") or {}).get(cfg.lora.init_from))
           else {}),
        # data.cache=latents: the entry trained from ("files"/"rows" above are its files).
        "cache_uri": plan.get("cache_uri"),
        "cache_reused": plan.get("cache_reused"),
        # Rows dropped by the validating decode, per reason, with a few locations each, and
        # rows that passed it. Counted per read: a row read in two epochs counts twice.
        "bad_records": plan.get("bad_records_counts", {}),
        "rows_decoded": plan.get("rows_decoded"),
        "bad_examples": plan.get("bad_examples", {}),
        # Per source: files, distinct rows, rows per epoch (repeats and weights counted)
        # and its share, and the rows the validating decode passed (see _sources).
        "sources": _sources(plan),
        # data.bucketing: distinct rows per bucket WxH, batches per worker per epoch, and
        # the sizes by id (metrics.jsonl's per-step "bucket").
        **({"buckets": plan["buckets"]} if plan.get("buckets") else {}),
        # Prior preservation: class images used, given, generated by this run, their folder.
        **({"class_images": plan["class_images"]} if plan.get("class_images") else {}),
    } | trained


def _write_adapter_folder(adapter: str, ckpt_dir: str, cfg: RayLoraConfig, metrics: dict,
                          data: dict, extra: dict | None, family) -> None:
    """Weights, model card and raylora.json into ``adapter``; manifest.json last, so its
    presence means the folder is complete."""
    from safetensors import safe_open

    from raylora.model.lora import current_spelling_file, old_spellings

    # The checkpoint's adapter files: the diffusers file, or the peft folder (+ LyCORIS file).
    shutil.copytree(os.path.join(ckpt_dir, ADAPTER_DIR), adapter)
    weights = os.path.join(adapter, WEIGHT_NAME)
    if os.path.isfile(weights):
        with safe_open(weights, framework="pt") as f:
            old = old_spellings(list(f.keys()), family.denoiser, family.legacy_lora_keys)
        if old:
            # An earlier raylora's checkpoint (a finished run exported again, a Tune
            # search's best trial) spells keys as the stock loader misreads them, silently:
            # published as raylora writes them now, as `raylora export --format diffusers` does
            current_spelling_file(weights, weights + ".new", family.denoiser, family.legacy_lora_keys)
            os.replace(weights + ".new", weights)
            log.warning("%s: written by an earlier raylora with %s; exported as raylora "
                        "writes it now", os.path.join(ckpt_dir, ADAPTER_DIR, WEIGHT_NAME),
                        "; and ".join(old))
    with open(os.path.join(adapter, "README.md"), "w") as f:
        f.write(model_card(cfg, metrics, data))
    meta = {
        "config": cfg.to_dict(),
        "metrics": metrics,
        "data": data,
        "versions": {p: _version(p) for p in ("raylora", "ray", "torch", "diffusers", "peft")},
        **(extra or {}),
    }
    with open(os.path.join(adapter, RUN_META), "w") as f:
        json.dump(meta, f, indent=2)
    _write_manifest(adapter)


def _write_manifest(adapter: str) -> None:
    names = sorted(n for n in os.listdir(adapter) if n != MANIFEST)
    listing = {n: os.path.getsize(os.path.join(adapter, n)) for n in names}
    with open(os.path.join(adapter, MANIFEST), "w") as f:
        json.dump({"files": listing}, f, indent=2)


def rewrite_diffusers_folder(adapter_dir: str, dest: str | None = None) -> tuple[str, list[str]]:
    """``raylora export --format diffusers``: a copy of the adapter folder ``adapter_dir``
    whose weights every diffusers loader reads: an earlier raylora's file written as raylora
    writes it now (``lora.current_spelling``: an SD/SDXL file that mixed key styles in one
    style, text-encoder DoRA magnitudes in the spelling their loader reads), other files as
    they are, the manifest listing the new sizes. ``dest``: default
    ``<adapter_dir>-diffusers`` beside it. Returns (folder written, what was rewritten in
    words: ``lora.old_spellings``, [] for a copy)."""
    from raylora.model.lora import current_spelling_file

    weights = os.path.join(adapter_dir, WEIGHT_NAME)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: not found; {adapter_dir} is not a diffusers "
                                "adapter folder")
    folder = os.path.realpath(adapter_dir)
    dest = dest or folder + "-diffusers"
    real = os.path.realpath(dest)
    if real == folder or real.startswith(folder + os.sep):
        raise ValueError(f"--out: {dest} is inside the adapter folder {adapter_dir}; write "
                         "the copy beside it")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise ValueError(f"--out: {dest} exists and is not an empty folder")
    listed = os.path.isfile(os.path.join(adapter_dir, MANIFEST))
    os.makedirs(os.path.dirname(real), exist_ok=True)
    # Written beside and renamed into place: a failure leaves no half folder at dest.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.tmp-", dir=os.path.dirname(real))
    try:
        for n in os.listdir(adapter_dir):
            if n not in (WEIGHT_NAME, MANIFEST):
                src = os.path.join(adapter_dir, n)
                (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(tmp, n))
        # unet: the legacy-key families' denoiser; no other family's file has its keys
        rewritten = current_spelling_file(weights, os.path.join(tmp, WEIGHT_NAME))
        if listed:
            _write_manifest(tmp)
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, rewritten


def _publish_file(store: Storage, local: str, uri: str) -> str:
    with open(local, "rb") as f:
        store.write_bytes(uri, f.read())
    return uri


def export_run(
    ckpt_dir: str, cfg: RayLoraConfig, reported: dict, plan: dict, extra: dict | None = None
) -> dict:
    """Publish the adapter in ``ckpt_dir`` with its card and metadata under ``output.uri``.
    ``extra`` entries are added to ``raylora.json`` (e.g. the Tune trial it came from)."""
    from raylora.model import families

    store = cfg.storage.client()
    metrics = summarize_metrics(reported)
    data = run_data(cfg, plan, store)
    family = families.get(data["family"])
    metrics["bad_records"] = sum(data["bad_records"].values())
    with open(os.path.join(ckpt_dir, HISTORY_FILE)) as f:
        history = [json.loads(line) for line in f if line.strip()]

    out = storage.normalize(cfg.output.uri)
    with tempfile.TemporaryDirectory(prefix="raylora-export-") as tmp:
        adapter = os.path.join(tmp, ADAPTER_DIR)
        _write_adapter_folder(adapter, ckpt_dir, cfg, metrics, data, extra, family)
        adapter_out = store.publish_dir(adapter, storage.join(out, ADAPTER_DIR))

        from raylora.checkpoint.kohya import KOHYA_FILE, export_kohya

        kohya_out = None
        if "kohya" in cfg.export.formats:
            kfile = os.path.join(tmp, KOHYA_FILE)
            export_kohya(os.path.join(adapter, WEIGHT_NAME), kfile, cfg.model.pretrained, family)
            kohya_out = _publish_file(store, kfile, storage.join(out, KOHYA_FILE))
        elif store.exists(old := storage.join(out, KOHYA_FILE)):
            # an earlier export's, of other weights: beside this adapter a ComfyUI user
            # would load it as this run's
            fs, path = store.fs(old)
            fs.delete_file(path)
            log.info("removed %s: an earlier export's kohya file (this run's export.formats "
                     "has no kohya)", old)

        png = os.path.join(tmp, "loss.png")
        plot_loss(history, png)
        _publish_file(store, png, storage.join(out, "loss.png"))
        store.write_bytes(
            storage.join(out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in history).encode()
        )
    return {
        "adapter": adapter_out,
        "metrics_jsonl": storage.join(out, "metrics.jsonl"),
        "loss_png": storage.join(out, "loss.png"),
        "kohya": kohya_out,
        "metrics": metrics,
        # For the CLI's summary: the lowest step loss and how to load the adapter.
        "train_loss_min": min((r["loss"] for r in history if math.isfinite(r["loss"])), default=None),
        "pipeline": family.pipeline,
        "base_model": cfg.model.pretrained,
        "base_kwargs": from_pretrained_kwargs(cfg, data.get("model_commit")),
        "variant": cfg.lora.variant,
        # the pipeline component the adapter goes into, and the stock loader's argument
        # that puts it there (Wan 2.2's low-noise expert: load_into_transformer_2)
        "denoiser": family.trained_component(cfg.model.expert),
        "load_kwargs": family.lora_load_kwargs(cfg.model.expert),
    }
