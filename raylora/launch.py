"""Driver side of ``raylora train``: preflight, Ray, TorchTrainer, export.

Everything that can be checked without Ray is checked first (``plan``), so a typo in a
path costs a second, not a cluster start.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from raylora import desk, preflight, stop, storage
from raylora.config import ConfigError, RayLoraConfig, validate

if TYPE_CHECKING:
    from raylora.data.plan import DataPlan

log = logging.getLogger("raylora")

TRAIN_RUN_NAME = "train"


@dataclass
class Plan:
    """What preflight learned: passed to every worker."""

    model_path: str
    data_format: str
    shard_files: list[str]
    total_rows: int
    rows_per_worker: int
    updates_per_epoch: int
    max_steps: int
    file_rows: list[int] | None = None
    # data.sharding=files: micro-batches per worker per epoch (the smallest worker's), so
    # every worker runs the same number of DDP steps.
    batches_per_epoch: int | None = None
    heldout_rows: int = 0
    data_rows: int = 0  # rows in the shard files, before any held-out split
    # The held-out rows themselves ({image: bytes, text}); sent to workers, never exported.
    heldout: list[dict] = field(default_factory=list, repr=False)
    family: str = "sd"  # raylora.model.families name
    objective: str | None = None  # epsilon | v_prediction | flow_matching (None: hub id, unread)
    # A hub model: the commit the driver read (model.revision resolved); a folder in object
    # storage: the version of its files listed (raylora.model.load.stored_version). What
    # everything that loads the model loads (RayLoraConfig.at_commit); None: a local
    # folder, or unread.
    model_commit: str | None = None
    # lora.init_from values on the hub (hf://, as written; a Tune search's too) → the same
    # at the commit the driver checked, which every worker loads (raylora.model.hub.pinned).
    pins: dict[str, str] = field(default_factory=dict)
    # data.cache=latents: the cache entry the shard files belong to, and the held-out rows
    # encoded by the same stages ({column: array}), so workers need no encoders at all.
    cache_uri: str | None = None
    cache_reused: bool | None = None
    heldout_encoded: dict | None = field(default=None, repr=False)
    # Name of the run's desk actor (raylora.desk: it counts the bad records, and carries the
    # progress rows and stop requests), once started.
    bad_records: str | None = None
    # The data plan the counts above come from (sources, repeats): what workers read.
    data: DataPlan | None = field(default=None, repr=False)
    # data.bucketing: the buckets' (width, height) by id, and each bucket's micro-batches
    # per epoch per worker (the same on every worker; raylora.data.buckets.schedule).
    bucket_sizes: list[tuple[int, int]] | None = None
    bucket_steps: dict[int, int] | None = None
    # Prior preservation: the class rows ({image: bytes, text}) every worker pairs its
    # batches with, and what raylora.json says of them (raylora.data.classgen).
    class_rows: list[dict] | None = field(default=None, repr=False)
    class_images: dict | None = None
    # ...with data.cache=latents, those rows encoded instead ({column: array}, a repeated
    # column folded: raylora.data.prior.fold_repeats; by the cache's stages,
    # raylora.data.cache.encode_for_workers; class_rows then empty): workers hold no
    # encoders then.
    class_encoded: dict | None = field(default=None, repr=False)
    # data.caption_dropout with data.cache=latents: the family's empty prompt encoded
    # ({caption column: 1 row}, raylora.data.cache.encode_for_workers), which
    # workers swap in for the dropped rows' captions.
    empty_encoded: dict | None = field(default=None, repr=False)
    # A Tune search whose trials read other data (data.* searched): each such data section
    # (its JSON, raylora.tune.data_key) → the plan of a config with it, made before Ray
    # starts (raylora.tune.preflight); a trial's own plan is ``replan`` over it.
    data_variants: dict[str, Plan] = field(default_factory=dict, repr=False)
    # What the family's checks (``family_problems``) judge a config by, kept so that a
    # search's trials are judged as the base was (raylora.tune.preflight) without
    # reading the model again: the latent grid (VAE downsampling × patch size) and the
    # objective its scheduler config names (None: not read).
    latent_grid: int = 8
    native_objective: str | None = None

    def to_dict(self) -> dict:
        d = asdict(replace(self, data_variants={}))
        d.pop("data_variants")
        d.pop("heldout")
        d.pop("heldout_encoded")
        d.pop("class_rows")
        d.pop("class_encoded")
        d.pop("empty_encoded")
        d.pop("data")
        d.pop("latent_grid")
        d.pop("native_objective")
        d["sources"] = self.data_plan().summary()
        d["content_files"] = self.data_plan().content_files()
        d.pop("bucket_sizes")
        d.pop("bucket_steps")
        if self.bucket_steps is not None:
            d["buckets"] = self.bucket_summary()
        return d

    def bucket_name(self, bucket: int) -> str:
        w, h = self.bucket_sizes[bucket]
        return f"{w}x{h}"

    def bucket_summary(self) -> dict:
        """raylora.json ``buckets``: distinct rows per bucket ``WxH`` (the histogram), and
        each bucket's micro-batches per worker per epoch."""
        hist = self.data_plan().bucket_histogram()
        return {"rows": {self.bucket_name(b): n for b, n in hist.items()},
                "batches_per_epoch": {self.bucket_name(b): n
                                      for b, n in sorted(self.bucket_steps.items())},
                # By id: what metrics.jsonl's per-step "bucket" numbers name.
                "sizes": [self.bucket_name(b) for b in range(len(self.bucket_sizes))]}

    def data_plan(self) -> DataPlan:
        """The data every worker reads a share of."""
        from raylora.data.plan import DataPlan

        if self.data is not None:
            return self.data
        return DataPlan(self.data_format, self.shard_files, self.data_rows, self.file_rows)

    def worker_heldout(self):
        """What workers evaluate: encoded tensors (cache) or raw rows."""
        return self.heldout_encoded if self.heldout_encoded is not None else self.heldout


def resolve_paths(cfg: RayLoraConfig) -> RayLoraConfig:
    """Local paths made absolute on the driver: Ray workers run in another directory."""
    from raylora.model.load import resolve_model_path

    cfg = cfg.model_copy(deep=True)
    cfg.model.pretrained = resolve_model_path(cfg.model)
    d = cfg.data
    classes = d.class_sources if isinstance(d.class_sources, list) else []
    for section in [d, *(d.sources or []), *classes]:
        section.uri = _place(section.uri)
        if getattr(section, "control_uri", None) is not None:  # read by the workers
            section.control_uri = _place(section.control_uri)
    if isinstance(d.class_sources, str):
        d.class_sources = storage.normalize(d.class_sources)
    d.validation_uri, d.cache_uri = _place(d.validation_uri), _place(d.cache_uri)
    if d.class_generation.uri is not None:
        d.class_generation.uri = storage.normalize(d.class_generation.uri)
    cfg.output.uri = storage.normalize(cfg.output.uri)
    if cfg.train.compile_cache_uri:
        cfg.train.compile_cache_uri = storage.normalize(cfg.train.compile_cache_uri)
    if cfg.lora.init_from:
        cfg.lora.init_from = storage.normalize(cfg.lora.init_from)
    # read by rank 0 for its previews, in the run's directory
    cfg.validation.control_images = [_place(c) for c in cfg.validation.control_images]
    for key, dim in (cfg.tune.search_space if cfg.tune else {}).items():
        if key in SEARCHED_PLACES and dim.kind in ("choice", "grid"):
            setattr(dim, dim.kind, [_place(v) for v in getattr(dim, dim.kind)])
    return cfg


# Search keys whose values name places (a list of sources: each one's uri and control_uri).
# A relative one was checked and planned on the driver, then read by each trial in Ray
# Tune's trial directory and by its workers in theirs, where it named nothing or another
# folder: made absolute here as the base config's are.
SEARCHED_PLACES = ("data.uri", "data.control_uri", "data.validation_uri", "data.cache_uri",
                   "data.sources", "data.class_sources", "data.class_generation.uri",
                   "lora.init_from", "train.compile_cache_uri")


def _place(value):
    """A place made absolute (``storage.normalize``): a URI, a list of them, or a section
    of a list of sources as a search value gives it (its uri and control_uri); None stays."""
    if isinstance(value, str):
        return storage.normalize(value)
    if isinstance(value, list):
        return [_place(v) for v in value]
    if isinstance(value, dict):  # one of data.sources' or data.class_sources' sections
        return {k: _place(v) if k in ("uri", "control_uri") else v for k, v in value.items()}
    return value  # None: an unset place, or lora.init_from's "no adapter"


def _inside_data(cfg: RayLoraConfig, places: dict[str, str | None]) -> list[str]:
    """The places a run writes that lie inside the data it reads: the next run (a resume,
    the same command) read the previews, loss.png and cached parts written there as
    training rows, without a word."""
    from raylora.data.formats.captionfolder import root_holding

    d, store = cfg.data, cfg.storage.client()
    reads = [(f"data.sources[{i}].uri" if d.sources is not None else "data.uri", s.uri)
             for i, s in enumerate(d.source_sections())]
    if d.validation_uri is not None:
        reads.append(("data.validation_uri", d.validation_uri))
    problems = []
    for key, uri in places.items():
        if not uri:
            continue
        for data_key, data_uri in reads:
            inside = root_holding(data_uri, storage.normalize(uri), store)
            if inside:
                problems.append(f"{key}: {uri} is inside {data_key} ({inside}): what the run "
                                "writes there would be read as training data by the next run; "
                                "put it beside the data")
                break
    return problems


def write_problems(cfg: RayLoraConfig, store: storage.Storage) -> list[str]:
    """``key: why`` for each place the run writes to that cannot be written
    (``Storage.write_problem``): the output, the latent and compile caches when set apart
    from it, and where prior preservation generates class images when that is not under
    the output (``classgen.generated_place``). The workers (and the generation actors)
    write them much later, after the run has spent its start."""
    from raylora.data.classgen import generated_place, generation_may_write, holds_generated

    places = {"output.uri": cfg.output.uri, "train.compile_cache_uri": cfg.train.compile_cache_uri}
    if cfg.data.cache == "latents":
        places["data.cache_uri"] = cfg.data.cache_uri
    problems, writable = [], {}
    for key, uri in places.items():
        if uri and (problem := store.write_problem(uri)):
            problems.append(f"{key}: {problem}")
        else:  # named once: a place that cannot be written is not also "inside the data"
            writable[key] = uri
    # Prior preservation's generated class images, where not under output.uri: else the
    # generation actors found out, each after loading the pipeline.
    if generation_may_write(cfg):
        key, root = generated_place(cfg, store)
        if key == "data.class_generation.uri":
            problem = store.write_problem(root)
            # One that cannot be written may hold the very images the run wants (a shared,
            # read-only set): ensure_class_images checks the folder it would write to
            if problem and not holds_generated(root, store):
                problems.append(f"{key}: the missing class images are generated into "
                                f"{root}, but {problem}")
            else:
                writable[key] = root
        elif key == "data.class_sources":  # its raylora-generated (generated_place probed it)
            writable[key] = root
    return problems + _inside_data(cfg, writable)


def plan(cfg: RayLoraConfig, heldout: bool = True) -> Plan:
    """Check model, data, the places the run writes to (``write_problems``) and step
    arithmetic; raise one ConfigError with every problem.
    ``heldout=False`` skips reading the held-out rows (a run that never evaluates)."""
    from raylora.data.plan import plan_data, sample_problems, unread_caption_extension
    from raylora.model import lora_init
    from raylora.model import families, hub
    from raylora.model.lora import target_problems
    from raylora.model.load import check_model, fsdp_weights_problem, is_hub_id, resolve_family
    from raylora.train.objective import scheduler_objective_kind

    problems: list[str] = []
    store = cfg.storage.client()
    model_path = cfg.model.pretrained
    family, factor, scheduler, commit = resolve_family(cfg.model, None), 8, None, None
    readable = False  # the model's configs were read: its layers can be checked here
    try:
        info = check_model(model_path, store, cfg.model.revision, cfg.model.variant)
        family, factor = resolve_family(cfg.model, info["index"]), info["vae_factor"]
        scheduler, commit = info["scheduler_config"], info["commit"]
        if commit and is_hub_id(model_path):
            log.info("model.pretrained: %s: training its commit %s (%s)", model_path, commit,
                     cfg.model.revision or "main")
        elif commit:  # in object storage: what each node downloads, or stops (materialize)
            log.info("model.pretrained: %s: training its files as listed now (version %s)",
                     model_path, commit)
        if family.experts:  # whether this folder has them; a family without: family_problems
            family.sigma_range(info["index"], cfg.model.expert, f"model.pretrained: {model_path}")
        readable = True
        if cfg.scaling.strategy == "fsdp" and info["files"] is not None:
            problems += filter(None, [fsdp_weights_problem(
                model_path, info["files"], family.trained_component(cfg.model.expert), cfg.model.variant)])
    except hub.Unreachable as exc:
        # A hub id nothing is known of here: the workers may still reach the hub. The
        # family is the one thing the run cannot guess (SD's settings for a Flux repo).
        if cfg.model.family == "auto":
            problems.append(f"{exc}; set model.family ({', '.join(families.names())}) to "
                            "start without reading it here")
        else:
            log.warning("%s; its family (%s) and components are not checked before the "
                        "workers load it", exc, cfg.model.family)
    except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
        problems.append(str(exc) if str(exc).startswith("model.") else f"model.pretrained: {exc}")
    if cfg.model.revision and not is_hub_id(model_path):
        # A folder has no revisions; in object storage the run pins the version it lists.
        problems.append(f"model.revision: {cfg.model.revision}: model.pretrained {model_path} "
                        "is a folder, not a hub repo; only a hub model has revisions")
    native = scheduler_objective_kind(scheduler) if scheduler else None
    problems += family_problems(cfg, family, factor * family.patch, native, scheduler)
    if cfg.validation.control_images:  # a few preview inputs: read now, not at the first preview
        from raylora.train.preview import read_control_images

        try:
            read_control_images(cfg.validation.control_images, store, cfg.data)
        except ValueError as exc:
            problems.append(str(exc))
    problems += write_problems(cfg, store)
    if readable:
        problems += target_problems(cfg.at_commit(commit))
    init_problems, init_loads = lora_init.checked(cfg, store)
    problems += init_problems
    objective = cfg.train.prediction_type or native

    data = None
    try:
        data = plan_data(cfg.data, store)
    except (FileNotFoundError, ValueError, OSError) as exc:
        # Sources' problems name their keys (data.sources[i].uri), one line each.
        problems += getattr(exc, "problems", None) or [f"data.uri: {exc}"]
    else:
        problems += sample_problems(cfg.data, data, store)
        problems += filter(None, [unread_caption_extension(cfg.data, data)])
    rows, problem = _plan_heldout(cfg, data, store) if heldout else ([], None)
    if problem:
        problems.append(problem)

    if data is None:
        raise ConfigError(problems)
    p = _arithmetic(cfg, model_path, data, rows, problems)
    p.family, p.objective, p.model_commit = family.name, objective, commit
    p.latent_grid, p.native_objective = factor * family.patch, native
    p.pins = pin(cfg.lora.init_from, init_loads)
    return p


def pin(uri: str | None, loads: str | None) -> dict[str, str]:
    """``Plan.pins``' entry for ``lora.init_from`` ``uri`` that workers load as ``loads``
    (``raylora.model.lora_init.checked``), logged."""
    if not uri or not loads or loads == uri:
        return {}
    log.info("lora.init_from: %s: starting from %s", uri, loads)
    return {uri: loads}


def family_problems(cfg: RayLoraConfig, family, multiple: int, native: str | None,
                    scheduler: dict | None = None) -> list[str]:
    """Settings that do not apply to this model family, named by key. ``native``: the
    objective its scheduler config names (None: not read, a hub id); ``scheduler``: that
    config, where the caller has it (its problem then names the scheduler class, and a
    config without a β table is refused too, not only an EDM one)."""
    from raylora.train.objective import EDM, schedule_problem

    t, out = cfg.train, []
    # First: a model whose noise schedule raylora cannot train is refused whatever is set.
    if problem := schedule_problem(scheduler, native):
        out.append(problem)
    grid = f"(the {family.name} latent grid: VAE downsampling × patch size)"
    d = cfg.data
    given = [("data.resolution", d.resolutions())] + [
        (f"data.sources[{i}].resolution", s.resolution if isinstance(s.resolution, list)
         else [s.resolution]) for i, s in enumerate(d.sources or []) if s.resolution is not None]
    if cfg.validation.resolution is not None:
        given.append(("validation.resolution", [cfg.validation.resolution]))
    for key, values in given:
        off = [r for r in values if r % multiple]
        if off:
            out.append(f"{key}: {', '.join(map(str, off))} is not a multiple of {multiple} {grid}")
    if d.bucketing and d.bucket_step % multiple:
        out.append(f"data.bucket_step: {d.bucket_step} is not a multiple of {multiple} {grid}, "
                   f"which bucket sides must be (e.g. {math.lcm(64, multiple)})")
    flow = (t.prediction_type or native) == "flow_matching"
    if native and t.prediction_type and (t.prediction_type == "flow_matching") != (native == "flow_matching"):
        out.append(f"train.prediction_type: {t.prediction_type} does not fit {family.name}, "
                   f"whose scheduler trains with {native}")
    if flow and t.snr_gamma is not None:
        out.append("train.snr_gamma: min-SNR weighting is for DDPM models; "
                   f"{family.name} trains with flow matching (see train.flow.loss_weighting)")
    if flow and t.noise_offset:
        out.append(f"train.noise_offset: applies to DDPM models; {family.name} trains with "
                   "flow matching")
    kind = t.prediction_type or native
    if kind not in (None, EDM) and not flow:
        from raylora.config import FlowSection

        changed = [k for k, v in t.flow if v != FlowSection.model_fields[k].default]
        if changed:
            out.append(f"train.flow.{changed[0]}: applies to flow matching; {family.name} "
                       f"trains with {kind} (DDPM), which reads no train.flow key; drop it")
    if cfg.model.system_prompt is not None and family.system_prompt is None:
        out.append(f"model.system_prompt: {family.name} ({family.pipeline}) takes no system "
                   "prompt; leave it unset")
    msl, limit = cfg.model.max_sequence_length, family.max_sequence_limit
    searched = cfg.tune is not None and "model.max_sequence_length" in cfg.tune.search_space
    if (msl or searched) and not any(text.long_context for text in family.text):
        # CLIP's position embeddings stop at 77 tokens: the key only sizes a long-context
        # encoder's captions (T5, an LLM), so it was dropped without a word.
        n = len(family.text)
        key = "tune.search_space.model.max_sequence_length" if searched else "model.max_sequence_length"
        encoders = "CLIP text encoder reads" if n == 1 else f"{n} CLIP text encoders read"
        out.append(f"{key}: {family.name} ({family.pipeline}) has no long-context text encoder "
                   f"to set it for: its {encoders} 77 tokens of each caption; leave it unset")
    elif msl and limit and msl > limit:
        out.append(f"model.max_sequence_length: {msl} is more than {family.pipeline} accepts "
                   f"({limit}): the adapter could not be sampled as it trained")
    if cfg.model.expert and not family.experts:
        out.append(f"model.expert: {cfg.model.expert}: {family.name} pipelines have one denoiser; "
                   "leave it unset")
    if cfg.model.attention != "sdpa" and family.denoiser != "unet":
        out.append(f"model.attention: {cfg.model.attention} is for UNet families; "
                   f"{family.name} uses sdpa")
    if cfg.model.attention != "sdpa" and t.sdpa_backend not in ("auto", "default"):
        out.append(f"train.sdpa_backend: {t.sdpa_backend} picks an SDPA kernel; "
                   f"model.attention={cfg.model.attention} does not call SDPA")
    if t.cuda_graphs and family.cuts_captions:
        out.append(f"train.cuda_graphs: {family.name}'s caption embedding is as long as each "
                   "batch's longest caption, so the step's shapes change from batch to batch and "
                   "each new length would record a CUDA graph of its own; leave it off (the "
                   "compiled blocks take every length without recompiling)")
    if t.sdpa_backend == "cudnn" and not family.cudnn_sdpa:
        out.append(f"train.sdpa_backend: cudnn is off for {family.name} (its cuDNN attention "
                   "crashed on an H100); use auto, flash or efficient")
    if family.caption_reads_images and cached_caption_dropout(cfg):
        out.append(f"data.caption_dropout: cannot be used with data.cache=latents for "
                   f"{family.name}: its caption embedding reads the input image, and the "
                   "cache encodes the empty prompt once; set it to 0 or data.cache=none")
    if "kohya" in cfg.export.formats and not family.kohya_export:
        out.append(f"export.formats: kohya export is not available for {family.name} yet; "
                   "export diffusers only")
    if cfg.data.control_images and not family.reference_image:
        from raylora.model import families

        takes = ", ".join(n for n in families.names() if families.get(n).reference_image)
        out.append(f"data.control_images: {family.name} ({family.pipeline}) takes no input "
                   f"image; image-edit pairs train a family that does ({takes})")
    elif cfg.data.references() > family.max_references:
        from raylora.model import families

        takes = ", ".join(n for n in families.names() if families.get(n).max_references > 1)
        out.append(f"data.control_inputs: {cfg.data.control_inputs} input images a sample, but "
                   f"{family.pipeline} takes {family.max_references}; several inputs train "
                   f"{takes}")
    side = cfg.eval_resolution()
    if cfg.validation.control_images and side < family.min_reference_side:
        key = "data.resolution" if cfg.validation.resolution is None else "validation.resolution"
        out.append(f"validation.control_images: {family.pipeline} takes no input image under "
                   f"{family.min_reference_side} px a side, and previews render at "
                   f"{key} {side} px; raise it or drop validation.control_images")
    if family.reference_required and not cfg.data.control_images:
        out.append(f"data.control_images: {family.name} ({family.pipeline}) edits an input "
                   "image and samples only from one: train it on image-edit pairs "
                   "(data.control_images: true)")
    elif family.reference_required and cfg.validation.prompts and not cfg.validation.control_images:
        out.append(f"validation.control_images: {family.pipeline} samples only from an input "
                   "image: give one per validation.prompts entry")
    if cfg.lora.train_text_encoder and not family.text_encoder_lora():
        out.append(f"lora.train_text_encoder: {family.pipeline} loads no text-encoder LoRA")
    return out


def replan(cfg: RayLoraConfig, base: Plan, data: Plan | None = None) -> Plan:
    """``base`` with the step arithmetic redone for ``cfg`` (a Tune trial's batch size,
    accumulation or step budget): no storage access. Over ``base``'s data and held-out
    rows, or ``data``'s: the plan of a config with ``cfg``'s data section (a trial that
    searches data.*: its files, row counts, buckets and held-out rows); model, family,
    desk and class images stay ``base``'s."""
    own = data or base
    return _carry(_arithmetic(cfg, base.model_path, own.data_plan(), own.heldout, []), base)


def _carry(p: Plan, base: Plan, **changes) -> Plan:
    """``p`` (fresh step arithmetic) with what ``base`` learned beyond it: family, cache."""
    keep = {k: getattr(base, k)
            for k in ("family", "objective", "latent_grid", "native_objective", "model_commit",
                      "pins", "cache_uri", "cache_reused",
                      "heldout_encoded", "bad_records", "class_rows", "class_images", "class_encoded",
                      "empty_encoded")}
    return replace(p, **{**keep, **changes})


def apply_cache(cfg: RayLoraConfig, p: Plan) -> Plan:
    """``data.cache=latents``: build or reuse the cache (needs Ray), then plan training over
    its files. Row counts are exact from here on, held-out split included."""
    from raylora.data.cache import ensure_cache
    from raylora.data.plan import cached_row_buckets

    if cfg.data.cache != "latents":
        return p
    store, loads = cfg.storage.client(), cfg.at_commit(p.model_commit)
    entry = ensure_cache(loads, p.family, p.model_path, p.data_plan(), store)
    _count_cached(p.bad_records, entry)
    # The cache holds the training rows alone (its build drops the held-out split): its
    # counts are not scaled by the split again (they were: 74 cached rows planned as 56).
    data = replace(entry.plan(cfg.data), heldout_dropped=True)
    if cfg.data.bucketing:
        data = cached_row_buckets(data, store)
    return _carry(_arithmetic(cfg, p.model_path, data, p.heldout, []), p,
                  cache_uri=entry.uri, cache_reused=entry.reused)


def _count_cached(desk_name: str | None, entry) -> None:
    """The rows the cache's build decoded (``CacheEntry.counts``) into the run's counts,
    whether this run built the entry or reuses it: judged before training (``run``), by
    the workers and in raylora.json as a build's are. A reused entry decodes nothing: its
    bad rows went uncounted, and the data a first run was refused for trained the next."""
    from raylora.data.badrecords import record

    if entry.counts is not None:
        record(desk_name, entry.counts)
    elif entry.reused:  # then check_bad_records records no counts, and judges none
        log.warning("latent cache: %s was built before cache entries recorded the rows their "
                    "build decoded: data.max_bad_fraction is not judged on it, and raylora.json "
                    "gets no counts (delete the entry to build it again)", entry.uri)


def encode_for_workers(cfg: RayLoraConfig, p: Plan) -> Plan:
    """``data.cache=latents``: what the workers would otherwise load encoders for, encoded
    on the cluster in one Ray task, so the text encoders and the VAE load once for all of
    it (a Qwen-Image run loads a 7B text encoder): the held-out rows, prior preservation's
    class rows and caption dropout's empty prompt."""
    from raylora.data.cache import encode_for_workers as encode
    from raylora.model import families

    if cfg.data.cache != "latents":
        return p
    captions = [families.get(p.family).empty_caption] if _drops_cached_captions(cfg) else []
    if not (p.heldout or p.class_rows or captions):
        return p
    heldout, classes, empty = encode(cfg.at_commit(p.model_commit), p.family, p.model_path,
                                     p.heldout, p.class_rows or [], captions)
    return replace(p, heldout_encoded=heldout, class_encoded=classes, empty_encoded=empty,
                   class_rows=[] if classes is not None else p.class_rows)


def cached_caption_dropout(cfg: RayLoraConfig) -> float:
    """data.caption_dropout of a run trained from the latent cache (one rate for every
    source: the config refuses others), else 0."""
    if cfg.data.cache != "latents":
        return 0.0
    return max((s.caption_dropout for s in cfg.data.source_sections()), default=0.0)


def _drops_cached_captions(cfg: RayLoraConfig) -> bool:
    """Whether a cached run (or one of its Tune trials) drops captions."""
    if cfg.data.cache != "latents":
        return False
    searched = cfg.tune.search_space.get("data.caption_dropout") if cfg.tune is not None else None
    return bool(cached_caption_dropout(cfg)) or (searched is not None and any(searched.values))


def apply_class_images(cfg: RayLoraConfig, p: Plan) -> Plan:
    """Prior preservation: the class images read, and the missing ones generated (Ray
    Data, on the cluster) or reused; they travel to the workers in the plan, encoded
    (``encode_for_workers``) where the run trains from the latent cache."""
    from raylora.data.classgen import ensure_class_images

    if not cfg.data.prior_preservation:
        return p
    store, loads = cfg.storage.client(), cfg.at_commit(p.model_commit)
    try:
        found = ensure_class_images(loads, p.family, p.model_path, store)
    except ConfigError:  # its lines name their keys (bad class images, one a line)
        raise
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError([str(exc) if str(exc).startswith("data.") else f"data.class_sources: {exc}"])
    # With the latent cache, encode_for_workers encodes them next.
    return replace(p, class_rows=found.rows, class_images=found.summary())


def _arithmetic(cfg: RayLoraConfig, model_path: str, data, heldout: list[dict], problems: list[str]) -> Plan:
    t, world = cfg.train, cfg.scaling.max_workers
    total = data.rows
    if cfg.data.validation_split and not data.heldout_dropped:
        # Expected training rows; the exact count depends on the hash of every row, which
        # is only known by reading all of them (README: num_epochs). Buckets count them
        # exactly (_bucket_steps), as does the latent cache (heldout_dropped).
        total = round(total * (1 - cfg.data.validation_split))
    rows_per_worker = total // world
    batches_per_epoch = None
    if cfg.scaling.elastic:
        return _elastic_arithmetic(cfg, model_path, data, heldout, problems)
    if cfg.data.sharding == "files":
        if data.file_rows is None:
            problems.append(
                "data.sharding: 'files' needs files whose rows are known up front (parquet, "
                f"webdataset, captionfolder), not {data.format}"
            )
        elif len(data.files) < world:
            problems.append(
                f"data.sharding: 'files' needs at least one shard file per worker "
                f"({len(data.files)} files, scaling.num_workers={world})"
            )
        else:
            rows_per_worker = min(data.for_rank(r, world).rows for r in range(world))
            batches_per_epoch = rows_per_worker // t.batch_size
    steps = _bucket_steps(cfg, data) if cfg.data.bucketing and not problems else None
    if steps is not None:
        batches_per_epoch = sum(steps.values())
        rows_per_worker = batches_per_epoch * t.batch_size
    # micro-batches per worker per epoch (under files or buckets: batches_per_epoch)
    micro = rows_per_worker // t.batch_size
    updates = micro // t.gradient_accumulation_steps
    if steps == {}:
        from raylora.data.buckets import bucket_set

        sizes = bucket_set(cfg.data).sizes
        hist = ", ".join(f"{sizes[b][0]}x{sizes[b][1]} {n}" for b, n in data.bucket_histogram().items())
        problems.append(
            f"data.bucketing: no bucket has a full batch (train.batch_size={t.batch_size}) "
            f"on every one of the {world} workers (images per bucket: {hist or 'none'}); "
            "lower train.batch_size, or use fewer resolutions or a coarser data.bucket_step")
    elif micro == 0:
        # (fewer micro-batches than one accumulation group still train: a group runs on
        # into the next epoch)
        problems.append(
            f"data.{'uri' if cfg.data.sources is None else 'sources'}: {total} rows split "
            f"over {world} workers is less than one batch "
            f"(train.batch_size={t.batch_size} per worker)"
        )
    if problems:
        raise ConfigError(problems)
    # num_epochs: every micro-batch of that many epochs. Accumulation groups run on across
    # an epoch's end, so the steps are the epochs' micro-batches / accumulation, rounded
    # up; num_epochs × full updates per epoch left each epoch's remainder out of the
    # budget (7 micro-batches, accumulation 4: 4 epochs asked, 2.3 trained).
    max_steps = t.max_steps or -(-t.num_epochs * micro // t.gradient_accumulation_steps)
    _check_warmup(cfg, max_steps)
    from raylora.data.buckets import bucket_set

    buckets = bucket_set(cfg.data)
    return Plan(
        model_path, data.format, data.files, total, rows_per_worker, updates, max_steps,
        data.file_rows, batches_per_epoch, len(heldout), data.rows, heldout, data=data,
        bucket_sizes=list(buckets.sizes) if buckets else None, bucket_steps=steps,
    )


def _elastic_arithmetic(cfg: RayLoraConfig, model_path: str, data, heldout: list[dict],
                        problems: list[str]) -> Plan:
    """scaling.num_workers: [min, max]: every worker reads the whole data in one seeded
    order and takes its share of each global batch (worker._epoch_batches), so an epoch
    is the optimizer steps the whole data fills, whatever the number of workers.
    ``batches_per_epoch``: micro-batches per worker per epoch at max workers."""
    t, s = cfg.train, cfg.scaling
    total, batch = data.rows, cfg.global_batch()
    if data.file_rows is None:
        problems.append(
            "data.sharding: 'files' needs files whose rows are known up front (parquet, "
            f"webdataset, captionfolder), not {data.format}")
    updates = total // batch
    if updates == 0 and not problems:
        problems.append(
            f"data.{'uri' if cfg.data.sources is None else 'sources'}: {total} rows are less "
            f"than one optimizer step's global batch of {batch} (train.batch_size={t.batch_size} "
            f"× train.gradient_accumulation_steps={t.gradient_accumulation_steps} × "
            f"{s.max_workers} workers, scaling.num_workers: [{s.min_workers}, {s.max_workers}])")
    if problems:
        raise ConfigError(problems)
    max_steps = t.max_steps or t.num_epochs * updates
    _check_warmup(cfg, max_steps)
    return Plan(
        model_path, data.format, data.files, total, total // s.max_workers, updates,
        max_steps, data.file_rows,
        updates * t.gradient_accumulation_steps, len(heldout), data.rows, heldout, data=data,
    )


def steps_to_epochs_end(num_epochs: int, epoch_micro: int, accumulation: int, world: int,
                        batch_size: int, at: dict) -> int:
    """Optimizer steps a run resumed from a checkpoint at ``at`` (its loop state: ``epoch``,
    ``batches_in_epoch`` per worker, and the ``world_size`` and ``batch_size`` they were
    counted in) takes to the end of epoch ``num_epochs - 1`` on ``world`` workers of
    ``batch_size``, ``epoch_micro`` micro-batches each per epoch, ``accumulation`` per step.
    Negative: the checkpoint is that many whole steps past it.

    The checkpoint's step counts steps of its own size: planned from step 0 at the new one,
    a run stopped after 6 of 16 steps on 1 worker and resumed on 2 (8 an epoch) stopped at
    step 8 with 12 of the epoch's 32 rows untrained, and 2 → 1 ran 4 steps into epoch 1.
    Its position in the epoch carries over in rows, rounded down to the new micro-batches
    (``LoopState.resize``), and a position past the new epoch's end skips the rest of it
    (the loop), as here. A checkpoint from before the batch size was recorded was
    counted in the one ``images_seen`` tells (``state.inferred_batch_size``, at this
    accumulation); in this run's when it tells none."""
    from raylora.checkpoint.state import inferred_batch_size

    old_w, old_b = at.get("world_size") or world, at.get("batch_size")
    if old_b is None and at.get("global_step"):
        old_b = inferred_batch_size(at.get("images_seen") or 0, at["global_step"] * old_w * accumulation)
        # (none told: taken for this run's, as the workers take it: LoopState.resize)
    old_b = old_b or batch_size
    done = min(at["batches_in_epoch"] * old_w * old_b // (world * batch_size), epoch_micro)
    left = (num_epochs - at["epoch"]) * epoch_micro - done
    return -(-left // accumulation)  # an accumulation group runs on past an epoch's end


def resumed_plan(cfg: RayLoraConfig, p: Plan) -> Plan:
    """``p`` for a run that resumes this output.uri's latest checkpoint: with
    train.num_epochs, its ``max_steps`` are the checkpoint's step and the steps to the
    end of the last epoch from where it stopped (``steps_to_epochs_end``), whatever
    number of workers or batch size wrote it. ConfigError, before Ray starts, when the
    checkpoint is past that end. Read from Ray's record of the checkpoint (its metrics
    hold the loop state), which ``_latest_checkpoint`` then checks whole."""
    from raylora.checkpoint.recorded import latest_metrics

    t, s = cfg.train, cfg.scaling
    if t.max_steps:  # the run's length, whatever the checkpoint's position
        return p
    # None: no checkpoint (or Ray's record unreadable: left to Ray)
    at = latest_metrics(cfg.storage.client(), storage.join(cfg.output.uri, TRAIN_RUN_NAME))
    if at is None or not all(isinstance(at.get(k), int)
                             for k in ("global_step", "epoch", "batches_in_epoch")):
        return p  # no checkpoint, or one whose record lacks its loop state
    # Elastic: counted at max workers, whose steps are every size's (the global batch).
    epoch_micro = p.batches_per_epoch or p.rows_per_worker // t.batch_size
    left = steps_to_epochs_end(t.num_epochs, epoch_micro, t.gradient_accumulation_steps,
                               s.max_workers, t.batch_size, at)
    step = at["global_step"]
    if left < 0:
        raise ConfigError([
            f"train.num_epochs: this run trains {t.num_epochs} epoch(s), but the checkpoint "
            f"this output.uri resumes from (step {step}, epoch {at['epoch']}, on "
            f"{at.get('world_size') or s.max_workers} worker(s) of train.batch_size "
            f"{at.get('batch_size') or t.batch_size}) is {-left} step(s) past their end; raise "
            "it to continue that run, or give this one its own output.uri"])
    _check_warmup(cfg, step + left)
    return replace(p, max_steps=step + left)


def _check_warmup(cfg: RayLoraConfig, steps: int) -> None:
    """The warmup against the steps planned from train.num_epochs (config.warmup_problems;
    validate checks a train.max_steps)."""
    from raylora.config import warmup_problems

    if not cfg.train.max_steps:
        problems = warmup_problems(cfg.train, steps, f"train.num_epochs={cfg.train.num_epochs}")
        if problems:
            raise ConfigError(problems)


def _bucket_steps(cfg: RayLoraConfig, data) -> dict[int, int]:
    """data.bucketing: each bucket's micro-batches per worker per epoch: under
    data.sharding=files the smallest worker's full batches of it, else (one worker) the
    full batches of its rows. Exact with a held-out split too: the bucket counts leave
    the held-out rows out, row by row (``raylora.data.plan.scan_buckets``; a latent
    cache holds none), where every bucket scaled by the split was off by the hash's luck."""
    from raylora.data.buckets import epoch_steps

    world = cfg.scaling.max_workers
    if cfg.data.sharding == "files":
        per = [data.for_rank(r, world).bucket_rows() for r in range(world)]
    else:
        per = [{b: n / world for b, n in data.bucket_rows().items()}]
    return epoch_steps(per, cfg.train.batch_size)


def _plan_heldout(cfg: RayLoraConfig, data, store) -> tuple[list[dict], str | None]:
    """Read the evaluation rows on the driver: (rows, problem or None)."""
    from raylora.data.plan import plan_data
    from raylora.data.split import read_heldout_rows

    d = cfg.data
    try:
        if d.validation_uri is not None:
            # Read with the data.* keys (a source's caption keys are its own). Control images
            # (data.control_images) beside the held-out images: data.control_uri mirrors the
            # training folder, whose relative paths are not the held-out folder's.
            vd = d.model_copy(update={"uri": d.validation_uri, "sources": None, "control_uri": None})
            rows = read_heldout_rows(vd, plan_data(vd, store), store, split=None)
            return rows, None if rows else f"data.validation_uri: {d.validation_uri}: no rows"
        if d.validation_split and data is not None:
            rows = read_heldout_rows(d, data, store, d.validation_split)
            if not rows:
                return [], (
                    f"data.validation_split: none of the {data.rows} rows fell in the held-out "
                    f"{d.validation_split:.1%}; raise it or use data.validation_uri"
                )
            return rows, None
    except (FileNotFoundError, ValueError, OSError) as exc:
        key = "data.validation_uri" if d.validation_uri is not None else "data.validation_split"
        return [], f"{key}: {exc}"
    return [], None


# Set by the CLI: this process owns its signals (a library caller keeps its own).
INTERRUPT_ON_SIGTERM = False
# While a run fits: asks it to stop at a step boundary with a checkpoint (raylora.stop);
# False when it was asked already.
SIGTERM_HOOKS: list = []


def _raise_interrupt(signum, frame):
    if SIGTERM_HOOKS and SIGTERM_HOOKS[-1]():
        return
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_sigterm() -> None:
    """SIGTERM → a clean stop of the fitting run (``SIGTERM_HOOKS``), else KeyboardInterrupt
    in the main thread, when the CLI asked for it. Again after
    ``ray.init``, which installs its own SIGTERM handler (log, then die without cleanup)."""
    import signal
    import threading

    if INTERRUPT_ON_SIGTERM and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def ray_address_problem(address: str, key: str = "RAY_ADDRESS", timeout: float = 5.0,
                        dashboard: bool = False) -> str | None:
    """Why nothing can be joined at ``RAY_ADDRESS`` (a GCS ``host:port`` or ``ray://``),
    found in at most ``timeout`` seconds; None when something listens there, or for
    addresses ``ray.init`` judges itself (``auto``, ``http://``: it refuses that one at
    once). Why: with no cluster there (a stale RAY_ADDRESS after ``ray stop``), ray.init
    retried for minutes (over 170 s here, Ray 2.60) before a stack trace.
    ``dashboard``: the Jobs SDK's address, where ``http(s)://host[:port]`` is the
    dashboard and is probed too (the SDK's own failure was exit 1, the GCS one's exit 2)."""
    import socket
    from urllib.parse import urlsplit

    if dashboard and address.startswith(("http://", "https://")):
        url = urlsplit(address)
        try:
            host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        except ValueError:  # a port that is not a number: the SDK names it
            return None
        if not host:
            return None
    elif "://" in address and not address.startswith("ray://"):
        return None
    else:
        host, sep, port = address.removeprefix("ray://").rpartition(":")
        if not sep or not port.isdigit():
            return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        # masked: a dashboard URL may carry a password
        return (f"{key}={storage.masked(address)}: no Ray cluster answers there ({exc.strerror or exc}). "
                f"Start it (ray start --head, cluster/local-up.sh) or point {key} at one")
    return None


def init_ray(need_cpus: float = 0) -> bool:
    """Join ``RAY_ADDRESS`` if set, else start an embedded local Ray. Returns True when this
    call started Ray (so the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        if problem := ray_address_problem(os.environ["RAY_ADDRESS"]):
            raise ValueError(f"{problem}; or unset it to run on a local Ray this command starts")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=job_runtime_env(),
                 logging_level=_ray_log_level())
        interrupt_on_sigterm()
        return False
    # Logical CPUs: training workers hold theirs for the whole run, so Ray Data's readers
    # and preprocess tasks need room beside them even on a 2-core laptop. Workers of an
    # embedded Ray inherit this process's environment, storage variables included.
    num_cpus = max(os.cpu_count() or 1, int(need_cpus + 0.999) + 2)
    start_local_ray(num_cpus)
    interrupt_on_sigterm()
    return True


# Below this a worker's CPU request reserves nothing worth having: the cluster is too small.
MIN_WORKER_CPUS = 0.05


def _fits_on(node: dict, s, cpus_per_worker: float) -> int:
    """How many workers of ``cpus_per_worker`` CPUs (+ 1 GPU) one node's resources hold."""
    k = int(node.get("CPU", 0) / cpus_per_worker + 1e-9)
    return min(k, int(node.get("GPU", 0))) if s.use_gpu else k


def _placeable(nodes: list[dict], s, cpus_per_worker: float) -> int:
    """How many workers of ``cpus_per_worker`` CPUs (+ 1 GPU) the nodes hold under
    ``scaling.placement_strategy``."""
    fits = [_fits_on(r, s, cpus_per_worker) for r in nodes]
    if s.placement_strategy == "STRICT_PACK":
        return max(fits, default=0)
    if s.placement_strategy == "STRICT_SPREAD":
        return sum(1 for f in fits if f > 0)
    return sum(fits)


def _placement(nodes: list[dict], s, cpus_per_worker: float, want: int) -> list[int]:
    """Workers on each of ``nodes`` (in their order) where Ray's placement group puts
    ``want`` of them (fewer where the nodes hold fewer) under
    ``scaling.placement_strategy``: PACK on as few nodes as hold them, each filled before
    the next; SPREAD one a node in turn. Among equals, the node left with the fewest CPUs
    first: Ray scores the nodes for a bundle best fit."""
    fits = [_fits_on(r, s, cpus_per_worker) for r in nodes]

    def left(i: int, k: int) -> float:
        return nodes[i].get("CPU", 0) - k * cpus_per_worker

    on = [0] * len(nodes)
    if s.placement_strategy in ("PACK", "STRICT_PACK"):
        for i in sorted(range(len(nodes)), key=lambda i: (-min(fits[i], want), left(i, min(fits[i], want)))):
            on[i] = min(fits[i], want - sum(on))
            if s.placement_strategy == "STRICT_PACK":
                break
    else:
        most = 1 if s.placement_strategy == "STRICT_SPREAD" else want
        for _ in range(want):
            room = [i for i in range(len(nodes)) if on[i] < min(fits[i], most)]
            if not room:
                break
            i = min(room, key=lambda i: (on[i], left(i, on[i] + 1)))
            on[i] += 1
    return on


def _feeds(nodes: list[dict], s, cpus_per_worker: float, want: int, tasks: int, task: float) -> bool:
    """Whether ``want`` workers placed as Ray places them (``_placement``) leave room for
    ``tasks`` of Ray Data's tasks of ``task`` CPUs. A task runs on one node: CPUs left
    over on several nodes do not add up (two 1-CPU nodes, a worker of 0.75 on each: 0.5
    CPU free in all, no 0.5-CPU task could start, and the run waited forever)."""
    on = _placement(nodes, s, cpus_per_worker, want)
    return sum(int((r.get("CPU", 0) - k * cpus_per_worker) / task + 1e-9)
               for r, k in zip(nodes, on)) >= tasks


def stage_task_cpus(data) -> float:
    """The CPUs one of Ray Data's read/preprocess tasks asks for (``data_stage_cpus``
    counts them in all): it must find them on a single node."""
    from raylora.data.cache import CACHED_READ_CPUS
    from raylora.data.source import STAGE_CPUS

    return CACHED_READ_CPUS if data.cache == "latents" else STAGE_CPUS


def fit_worker_cpus(nodes: list[dict], s, want: int, data_cpus: tuple[float, float],
                    task_cpus: float) -> float:
    """The CPUs to request per training worker on a cluster of ``nodes`` (their Ray
    resources): ``scaling.cpus_per_worker`` when the workers fit and leave Ray Data the
    ``data_cpus[0]`` CPUs it cannot stream without (``source.data_stage_cpus``), in
    tasks of ``task_cpus`` (``stage_task_cpus``) on the nodes as Ray places the workers,
    else less, so that a small cluster (a 2-CPU laptop head with 2 workers) runs instead
    of hanging with every CPU held by workers that wait for data. Ray does not confine a
    worker to its logical CPUs: they decide placement and OMP_NUM_THREADS (the floor, at
    least 1), so a worker of 0.5 CPU computes like one of 1.

    Raises ConfigError, naming the keys, when the workers cannot be placed as asked, or
    when no request leaves the data stage its CPUs."""
    cpus = sum(r.get("CPU", 0) for r in nodes)
    cpw = s.cpus_per_worker
    can = _placeable(nodes, s, cpw)
    if can < want:
        gpus = sum(r.get("GPU", 0) for r in nodes)
        each = f"{cpw:g} CPU" + (" + 1 GPU" if s.use_gpu else "")
        raise ConfigError([
            f"scaling.num_workers: {want} workers of {each} each cannot all be placed "
            f"({s.placement_strategy}): the cluster's {len(nodes)} node(s) with {cpus:g} CPUs and "
            f"{gpus:g} GPUs hold at most {can}. Lower scaling.num_workers or "
            "scaling.cpus_per_worker, or set scaling.autoscaling: true if the cluster grows on demand"
        ])
    least, enough = data_cpus
    fewest = math.ceil(least / task_cpus - 1e-9)  # tasks
    if _feeds(nodes, s, cpw, want, fewest, task_cpus):
        return cpw
    # As much data room as there is worth giving, then the least that streams at all. The
    # cluster's CPUs bound the request (whole hundredths); per node it may take less.
    for room in (min(enough, cpus / 2), least):
        room = max(room, least)
        tasks = max(int(room / task_cpus + 1e-9), fewest)
        top = min(int((cpus - room) / want * 100 + 1e-9), int(cpw * 100 + 1e-9))
        for share in (h / 100 for h in range(top, round(MIN_WORKER_CPUS * 100) - 1, -1)):
            if _placeable(nodes, s, share) >= want and _feeds(nodes, s, share, want, tasks, task_cpus):
                return share
    raise ConfigError([
        f"scaling.cpus_per_worker: the cluster's {cpus:g} CPUs cannot hold {want} training "
        f"worker(s) and Ray Data's read/preprocess tasks beside them, which need at least "
        f"{least:g} CPU for this data.sharding and data.cache, in tasks of {task_cpus:g} CPU "
        f"that each run on one node: at least {want * MIN_WORKER_CPUS + least:g} CPUs in all. "
        "Add CPUs (cluster/local-up.sh --cpus N), lower scaling.num_workers, or set "
        "scaling.autoscaling: true if the cluster grows on demand"
    ])


def fit_elastic_workers(nodes: list[dict], s, data_cpus: Callable[[int], tuple[float, float]],
                        task_cpus: float) -> tuple[float, int]:
    """An elastic run's ``(CPUs per worker, most workers)`` on a cluster of ``nodes``;
    ``data_cpus(n)``: what Ray Data needs beside ``n`` workers (``source.data_stage_cpus``),
    in tasks of ``task_cpus``.

    Ray Train starts an elastic run with as many workers as the nodes hold, up to max, and
    knows nothing of the data stage: fitted for min only, a 2-CPU cluster took 2 of
    [1, 3] workers of 1 CPU, Ray Data got none and no step came (a hang, no error). So:
    the request where what Ray Train places leaves the data stage its CPUs (a node that
    joins later still grows the run); else the most workers that fit, each asking for
    what ``fit_worker_cpus`` gives them, capped there when Ray Train would place more
    (then a node that joins later adds none). ConfigError, as ``fit_worker_cpus`` words
    it for min, when not even min fits."""
    lo, hi = s.min_workers, s.max_workers

    def feeds(cpw: float) -> bool:  # what Ray Train places at cpw leaves the data stage room
        placed = min(hi, _placeable(nodes, s, cpw))
        tasks = math.ceil(data_cpus(placed)[0] / task_cpus - 1e-9)
        return placed >= lo and _feeds(nodes, s, cpw, placed, tasks, task_cpus)

    if feeds(s.cpus_per_worker):
        return s.cpus_per_worker, hi
    for n in range(hi, lo - 1, -1):
        try:
            cpw = fit_worker_cpus(nodes, s, n, data_cpus(n), task_cpus)
        except ConfigError:
            if n > lo:
                continue
            raise  # not even min fits: why, naming the keys
        return cpw, hi if feeds(cpw) else n


def fitted_to(cfg: RayLoraConfig, nodes: list[dict], num_workers: int | None = None) -> RayLoraConfig:
    """``cfg`` fitted to a cluster of ``nodes`` (their Ray resources): ``check_cluster_fits``
    without Ray. ``num_workers``: that many workers (lr-find's 1), elastic or not."""
    from raylora.data.source import data_stage_cpus

    s = cfg.scaling
    cpus = sum(r.get("CPU", 0) for r in nodes)
    most = s.max_workers
    task = stage_task_cpus(cfg.data)
    if s.elastic and num_workers is None:
        cpw, most = fit_elastic_workers(nodes, s, lambda n: data_stage_cpus(cfg.data, n), task)
        want = most
    else:
        want = s.min_workers if num_workers is None else num_workers
        cpw = fit_worker_cpus(nodes, s, want, data_stage_cpus(cfg.data, want), task)
    if cpw != s.cpus_per_worker:
        log.warning(
            "scaling.cpus_per_worker: %g → %g: %d worker(s) of %g CPU would leave Ray Data "
            "too little of the cluster's %g CPUs for reading and preprocessing, in tasks of "
            "%g CPU each on one node (the run would wait forever); give the cluster more CPUs "
            "to keep the request",
            s.cpus_per_worker, cpw, want, s.cpus_per_worker, cpus, task)
    update = {"scaling": s.model_copy(update={"cpus_per_worker": cpw})}
    if most < s.max_workers:
        t = cfg.train
        # The same global batch at the new max (config.at_world: accumulation × max / n
        # divides for every n in the range, validate checked).
        accum = t.gradient_accumulation_steps * s.max_workers // most
        log.warning(
            "scaling.num_workers: [%d, %d] → [%d, %d]: Ray Train would start %d workers of %g "
            "CPU on the cluster's %g CPUs, leaving Ray Data's read/preprocess tasks too little "
            "to run (the run would wait forever); train.gradient_accumulation_steps %d → %d "
            "keeps the global batch (%d). A node that joins later adds no worker: give the "
            "cluster more CPUs, or set scaling.autoscaling: true if it grows on demand",
            s.min_workers, s.max_workers, s.min_workers, most,
            min(s.max_workers, _placeable(nodes, s, cpw)), cpw, cpus,
            t.gradient_accumulation_steps, accum, cfg.global_batch())
        update["scaling"] = update["scaling"].model_copy(update={"num_workers": (s.min_workers, most)})
        update["train"] = t.model_copy(update={"gradient_accumulation_steps": accum})
    if cpw == s.cpus_per_worker and most == s.max_workers:
        return cfg
    return cfg.model_copy(update=update)


def check_cluster_fits(cfg: RayLoraConfig, num_workers: int | None = None) -> RayLoraConfig:
    """Fail before anything starts when the training workers can never all be placed on
    the cluster's nodes, or would leave Ray Data no CPU (Ray would otherwise wait for
    resources forever). Returns ``cfg``, with ``scaling.cpus_per_worker`` lowered, or an
    elastic run's max workers capped, where that is what lets the run go (``fitted_to``)."""
    import ray

    if cfg.scaling.autoscaling:
        return cfg
    return fitted_to(cfg, [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")],
                     num_workers)


# Why each local place a run writes must be one folder that every node sees: what Ray
# Train and Ray Data write on one node, another node reads.
_SHARED_WHY = {
    "output.uri": "every node's workers write their checkpoints there, and Ray Train stops "
                  "the run at its first checkpoint upload (checkpoint.every_n_steps steps in, "
                  "their training lost) unless all nodes can read and write it",
    "data.cache_uri": "Ray Data's tasks write the latent cache's parts on any node, and every "
                      "worker reads them all",
    "data.class_generation.uri": "the class images are generated by actors on any node, and "
                                 "the driver and every worker read them",
    "data.class_sources": "the missing class images are generated into its raylora-generated "
                          "folder by actors on any node, and the driver and every worker read them",
}


def unshared_places(places: dict[str, str], missing: dict[str, list[str]],
                    nodes: int) -> tuple[list[str], list[str]]:
    """``(problems, warnings)``, as ``key: why`` lines, for the local ``places`` (key →
    path) that nodes do not see: ``missing`` (key → the nodes, of the cluster's ``nodes``,
    on which a marker written there was not found: ``nodes_not_seeing``). A compile cache
    one node keeps only leaves the others compiling cold: a warning, not a refusal."""
    problems, warnings = [], []
    for key, lost in missing.items():
        if not lost:
            continue
        line = (f"{key}: {places[key]} is a local folder that {len(lost)} of the cluster's "
                f"{nodes} nodes do not see ({', '.join(lost)})")
        if key in _SHARED_WHY:
            problems.append(f"{line}: {_SHARED_WHY[key]}. Use object storage (s3://, gs://) "
                            "or a folder every node mounts (NFS)")
        else:
            warnings.append(f"{line}: workers there do not find what was compiled before and "
                            "compile cold")
    return problems, warnings


def _sees(path: str) -> bool:
    return os.path.exists(path)


def nodes_not_seeing(path: str, nodes: list[dict]) -> list[str]:
    """The nodes of ``nodes`` (``ray.nodes()`` entries) on which ``path`` does not exist, as
    ``address (node id)``: a 0-CPU task pinned to each asks. One that cannot answer within
    a minute (gone, or still starting) is left out with a warning: the run finds out then."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    sees = ray.remote(num_cpus=0, max_retries=0)(_sees)
    asked = {sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(path): n for n in nodes}
    done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=60)
    lost = []
    for ref, node in asked.items():
        name = f"{node['NodeManagerAddress']} (node {node['NodeID'][:12]})"
        if ref not in done:
            log.warning("%s did not say within a minute whether it sees %s", name, path)
            continue
        try:
            seen = ray.get(ref)
        except ray.exceptions.RayError as exc:  # gone since ray.nodes(), or its worker failed
            log.warning("%s could not look for %s: %s", name, path, exc)
            continue
        if not seen:
            lost.append(name)
    return lost


def check_shared_places(cfg: RayLoraConfig) -> None:
    """On a cluster of several nodes, every local folder the run writes (output.uri; a
    latent or compile cache set apart from it) must be one that all nodes see: a marker
    written into it (its nearest existing folder: nothing is created) is looked for on
    each node. ConfigError naming the key and the nodes that do not see it, before
    training; the run died at its first checkpoint upload. Object storage is not probed."""
    import ray

    from raylora.data.classgen import generated_place, generation_may_write

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < 2:
        return
    places = {"output.uri": cfg.output.uri, "train.compile_cache_uri": cfg.train.compile_cache_uri}
    if cfg.data.cache == "latents":
        places["data.cache_uri"] = cfg.data.cache_uri
    if generation_may_write(cfg):  # the class images' generation actors write there, anywhere
        key, root = generated_place(cfg, cfg.storage.client())
        places.setdefault(key, root)
    places = {k: u for k, u in places.items() if u and storage.is_local(u)}
    if len(alive) < 2 or not places:
        return
    import uuid

    missing = {}
    for key, uri in places.items():
        folder = storage.local_path(uri)
        while not os.path.lexists(folder):
            folder = os.path.dirname(folder)
        marker = os.path.join(folder, f".raylora-node-check-{uuid.uuid4().hex[:8]}")
        try:
            with open(marker, "x"):
                pass
        except OSError:  # not writable: write_problems said so before Ray started
            continue
        try:
            missing[key] = nodes_not_seeing(marker, alive)
        finally:
            os.unlink(marker)
    problems, warnings = unshared_places(places, missing, len(alive))
    for line in warnings:
        log.warning("%s", line)
    if problems:
        raise ConfigError(problems)


def _process_setup_hook(secrets: dict[str, str]):
    def raylora_process_setup() -> None:
        import ray

        from raylora import quiet

        os.environ.update(secrets)
        # Ray's own State API calls in these processes (Train's placement-group cleaner)
        # find their cluster by RAY_ADDRESS, else by looking for one on this machine: with
        # two local Rays there they fail (a 30-line traceback, and no cleanup).
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        quiet.apply()

    return raylora_process_setup


def job_runtime_env() -> dict:
    """This job's runtime_env: what every Ray worker process of the run (Train controller
    and workers, Ray Data tasks, our actors) needs from the driver.

    Storage endpoint and region, and the quiet-logging settings (``raylora.quiet``),
    travel as plain ``env_vars``. Credentials do not: Ray's runtime-env agent writes the
    env_vars of every runtime_env it sets up to its log. They travel in the
    ``worker_process_setup_hook`` instead, a function Ray stores (pickled) in the cluster's
    internal store and runs first in every worker process of this job, where it sets them
    in the environment (the logged runtime_env shows only the hook's reference), then
    quiets the loggers that env vars do not reach.
    """
    from raylora import quiet

    plain, secret = storage.split_secrets(storage.forwarded_env())
    # A variable the submitted job's runtime_env already sets reaches the workers anyway,
    # and Ray refuses a driver runtime_env that sets it again.
    taken = _job_env_vars()
    env_vars = {k: v for k, v in {**plain, **quiet.worker_env()}.items() if k not in taken}
    return {"env_vars": env_vars, "worker_process_setup_hook": _process_setup_hook(secret)}


def _job_env_vars() -> set[str]:
    """The env_vars of the Ray job this driver runs in (``ray job submit --runtime-env``),
    which Ray passes to the driver as JSON."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    return set(((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}))


# Ray Train V2's switch for its per-run PreemptionWatcher actor (read by the controller).
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def start_local_ray(num_cpus: int) -> None:
    """An embedded local Ray with its dashboard on a free loopback port.

    The dashboard is not optional here: Ray Train's placement-group cleaner asks the State
    API whether the train controller is alive, and without this cluster's own dashboard
    that query can reach another Ray on the default port 8265, not find the controller,
    and tear down a healthy run's workers.
    """
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Its workers inherit this process's environment; the runtime_env adds the setup hook.
    # address="local": a new instance even when a `ray start` cluster runs on this machine
    # (without it Ray joins that one, then refuses num_cpus). Joining is RAY_ADDRESS's job.
    runtime_env = job_runtime_env()
    # One machine, started and stopped by this process: none of its nodes can be preempted
    # (drained by a cloud provider or an autoscaler), so Ray Train's preemption watcher, one
    # more actor process per run polling the nodes every 5 s, would watch for nothing. On 2
    # cores that process cost about 2.5 CPU-s of each run. A value the user set is kept.
    if PREEMPTION_WATCHER not in os.environ:
        runtime_env["env_vars"][PREEMPTION_WATCHER] = "0"
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, runtime_env=runtime_env, logging_level=_ray_log_level())


def _ray_log_level() -> int:
    """The driver's ``ray`` logger: its INFO is "Started a local Ray instance" and such."""
    from raylora import quiet

    return logging.INFO if quiet.verbose() else logging.WARNING


@dataclass(frozen=True)
class Setup:
    """What ``raylora train``, ``lr-find`` and ``tune`` ask of the one run preamble
    (``prepared``): the rest of it is the same for all three."""

    need_cpus: Callable[[RayLoraConfig], float]  # what the workers hold: sizes an embedded Ray
    make_plan: Callable[[RayLoraConfig], Plan] = plan
    num_workers: int | None = None  # workers to place (None: scaling.num_workers)
    memory: bool = True  # the memory preflight (lr-find runs without one)
    # (label, config) pairs checked for memory besides the base (tune's bounding values)
    variants: Callable[[RayLoraConfig], list] | None = None
    # What a rerun resumes under output.uri, checked after the plan and before Ray starts
    # (train: its latest checkpoint, whole; tune: the search, same config). It may raise;
    # its answer is Prepared.resume.
    resume: Callable[[RayLoraConfig, Plan], object] | None = None


@dataclass
class Prepared:
    """A run ready to fit: its config (paths resolved, workers fitted to the cluster) and
    plan (the run's desk started, latent cache applied)."""

    cfg: RayLoraConfig
    plan: Plan
    resolved: RayLoraConfig  # before check_cluster_fits: what tune sizes its trials by
    resume: object = None  # Setup.resume's answer
    # The memory preflight is left for the cluster's own GPUs (read once Ray is joined).
    memory_on_cluster: bool = False


def checked(cfg: RayLoraConfig, setup: Setup, remote: bool = False) -> Prepared:
    """Everything a run checks before Ray starts, so a typo or a broken checkpoint costs a
    second: local paths made absolute, model/data/arithmetic planned, what a rerun resumes
    (``Setup.resume``) and the memory preflight where the GPUs are known here. ``prepared``
    runs it first; ``raylora submit`` runs it alone, with the command's own Setup and
    ``remote`` (its workers are the cluster's: this machine's GPU is not theirs)."""
    from raylora.checkpoint.recorded import check_lease

    cfg = resolve_paths(cfg)
    p = setup.make_plan(cfg)  # (output.uri checked writable there: a lease can be read)
    # Another run live on this output.uri: refused here, before this one resumes anything
    # or re-exports (``prepared`` then takes the lease).
    check_lease(cfg.storage.client(), cfg.output.uri)
    resume = setup.resume(cfg, p) if setup.resume is not None else None
    # Decided here, before any Ray starts: on_cluster takes a running Ray as a cue.
    remote = setup.memory and preflight.on_cluster(cfg, remote)
    if setup.memory and not remote:
        preflight.check_memory(cfg, variants=_variants(cfg, setup), commit=p.model_commit)
    return Prepared(cfg, p, cfg, resume, memory_on_cluster=remote)


def _variants(cfg: RayLoraConfig, setup: Setup) -> list:
    return setup.variants(cfg) if setup.variants is not None else []


@contextmanager
def prepared(cfg: RayLoraConfig, setup: Setup, run: Prepared | None = None) -> Iterator[Prepared]:
    """The one preamble of every run: ``checked``, then Ray joined or started (storage
    settings and secrets reach the workers through ``job_runtime_env``, quiet logging),
    the memory preflight on the cluster's own GPUs, the cluster checked to hold the
    workers and, with several nodes, to see the local folders the run writes
    (``check_shared_places``), the run's desk (raylora.desk) and latent cache. The run
    holds output.uri's lease throughout (raylora.checkpoint.recorded.held_lease: a second
    run there is refused). On the way out the desk is stopped, a Ray this call started is
    shut down and the lease is released."""
    from raylora.checkpoint.recorded import held_lease
    from raylora.track import tracking_problem

    run = run or checked(cfg, setup)  # (``run``: ``checked`` already ran)
    cfg = run.cfg
    # An embedded Ray's workers run here, with this machine's environment and files: what
    # they read from them is checked before it starts. A joined cluster's workers have
    # their nodes' own (a key in a pod's secret), not known here.
    if not os.environ.get("RAY_ADDRESS") and (problem := tracking_problem(cfg.tracking)):
        raise ConfigError([problem])
    # Taken before Ray starts and before anything under output.uri is written or deleted
    # (_fit's drop_unrecorded would delete a live run's checkpoints in flight).
    with held_lease(cfg.storage.client(), cfg.output.uri):
        started = init_ray(setup.need_cpus(cfg))
        try:
            if run.memory_on_cluster:  # the workers' GPUs: read once joined, before asking for any
                preflight.check_memory(cfg, cluster=True, variants=_variants(cfg, setup),
                                       commit=run.plan.model_commit)
            run.cfg = check_cluster_fits(cfg, num_workers=setup.num_workers)
            check_shared_places(cfg)
            run.plan = replace(run.plan, bad_records=desk.start())  # the workers get its name
            run.plan = apply_cache(run.cfg, run.plan)
            run.plan = apply_class_images(run.cfg, run.plan)
            run.plan = encode_for_workers(run.cfg, run.plan)
            yield run
        finally:
            desk.stop(run.plan.bad_records)
            if started:
                import ray

                ray.shutdown()


def _train_cpus(cfg: RayLoraConfig) -> float:
    return cfg.scaling.max_workers * cfg.scaling.cpus_per_worker


def _latest_checkpoint(cfg: RayLoraConfig, p: Plan) -> str | None:
    """The checkpoint ``raylora train`` resumes from, checked whole and against this
    run's LoRA settings (raylora.checkpoint.recorded.check_latest); None: it starts afresh."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.checkpoint.state import trained_settings

    latest = check_latest(cfg.storage.client(), storage.join(cfg.output.uri, TRAIN_RUN_NAME),
                          trained=trained_settings(cfg.at_commit(p.model_commit), p.family))
    if latest:
        log.info("resuming from %s (the latest checkpoint of this output.uri)", latest)
    return latest


def _train_plan(cfg: RayLoraConfig) -> Plan:
    return resumed_plan(cfg, plan(cfg))


# `raylora train`
TRAIN = Setup(need_cpus=_train_cpus, make_plan=_train_plan, resume=_latest_checkpoint)


def run(cfg: RayLoraConfig) -> dict:
    """Train, then export the adapter to ``{output.uri}/adapter``. Returns a summary dict."""
    from raylora.checkpoint.export import export_run

    pre = checked(cfg, TRAIN)
    if pre.resume and (again := _exported_again(pre)) is not None:
        return _finished(pre.cfg, again)
    with prepared(cfg, TRAIN, pre) as r:
        cfg, p = r.cfg, r.plan
        if cfg.data.cache == "latents":  # the cache's build decoded every row: judge them now
            check_bad_records(cfg, p)
        result, bad = fit_judging_data(cfg, p, lambda: _fit(cfg, p))
        checkpoints = storage.join(cfg.output.uri, TRAIN_RUN_NAME)
        if result.metrics and result.metrics.get("stopped"):  # raylora.stop: no export
            return {"stopped": result.metrics["stopped"], "step": result.metrics["step"],
                    "max_steps": p.max_steps, "checkpoints": checkpoints,
                    "checkpoint": result.checkpoint.path if result.checkpoint else None}
        if result.checkpoint is None:
            raise RuntimeError("training finished without a checkpoint to export")
        with result.checkpoint.as_directory() as ckpt_dir, stop.exporting(SIGTERM_HOOKS):
            summary = export_run(ckpt_dir, cfg, result.metrics, {**p.to_dict(), **bad})
        return _finished(cfg, {
            **summary, "checkpoints": checkpoints, "rows_decoded": bad.get("rows_decoded"),
            **({"buckets": p.bucket_summary()} if p.bucket_steps is not None else {}),
            **({"class_images": p.class_images} if p.class_images else {})})


def _finished(cfg: RayLoraConfig, summary: dict) -> dict:
    """``summary`` (the adapter written), after telling ``{output.uri}/progress.json`` that
    the run finished, where `raylora status` and `raylora stop` read it: a job's driver
    takes a few seconds more to exit (Ray shuts down), and a stop that comes then leaves
    the job STOPPED although nothing is left to resume."""
    from raylora import progress

    try:
        progress.write_progress(cfg.storage.client(), cfg.output.uri)(progress.finished_row(summary))
    except Exception as exc:  # the adapter is written: a progress line must not fail the run
        log.warning("progress.json not written: %s", exc)
    return summary


def _exported_again(pre: Prepared) -> dict | None:
    """A finished run run again (a retried job, a rerun script): its final checkpoint is
    exported again, with the metrics Ray recorded for it, and nothing starts. Through Ray
    the restored run reported a second final checkpoint, and checkpoint.num_to_keep then
    deleted the oldest one kept. None: the latest checkpoint is not a finished run's."""
    import tempfile

    from raylora.checkpoint.export import export_run
    from raylora.checkpoint.recorded import finished_metrics

    cfg, p = pre.cfg, pre.plan
    store = cfg.storage.client()
    checkpoints = storage.join(cfg.output.uri, TRAIN_RUN_NAME)
    metrics = finished_metrics(store, checkpoints, p.max_steps)
    if metrics is None:
        return None
    exported = _exported_meta(cfg, store)  # raylora.json: read once, for both uses below
    if changed := _changed_since_export(cfg, exported, p.family):
        raise ConfigError([
            f"{', '.join(changed)}: this output.uri's run finished at step {p.max_steps} "
            f"trained with {', '.join(f'{k}={json.dumps(v[0])}' for k, v in changed.items())}; "
            f"this run has {', '.join(f'{k}={json.dumps(v[1])}' for k, v in changed.items())}, "
            "and exporting again would publish those weights under these settings. Set them "
            "back to export it again, raise train.max_steps to train on, or give this run its "
            "own output.uri"])
    log.info("%s: this output.uri's run finished at step %d; exporting that checkpoint again "
             "(nothing to train)", pre.resume, p.max_steps)
    # What only the training run learned of its data (the rows its decode passed and
    # dropped, its latent cache entry, its class images) is in the raylora.json this
    # export replaces, and nothing reads the data again here: carried over, not lost.
    record = p.to_dict() | _trained_data_record(exported)
    if storage.is_local(pre.resume):
        with stop.exporting(SIGTERM_HOOKS):
            summary = export_run(storage.local_path(pre.resume), cfg, metrics, record)
    else:
        with tempfile.TemporaryDirectory(prefix="raylora-final-") as d, stop.exporting(SIGTERM_HOOKS):
            store.download_dir(pre.resume, d)
            summary = export_run(d, cfg, metrics, record)
    return {**summary, "checkpoints": checkpoints, "rows_decoded": record.get("rows_decoded"),
            # (this invocation generated none: its summary line says "earlier")
            **({"class_images": {**record["class_images"], "class_images_generated": 0}}
               if record.get("class_images") else {}),
            **({"buckets": p.bucket_summary()} if p.bucket_steps is not None else {})}


# raylora.json's data keys that only a training run knows → the plan keys export_run
# writes them from.
_TRAINED_DATA = {"cache_uri": "cache_uri", "cache_reused": "cache_reused",
                 "bad_records": "bad_records_counts", "rows_decoded": "rows_decoded",
                 "bad_examples": "bad_examples", "class_images": "class_images"}


# raylora.json's description of the data a run trained (export.run_data), carried over
# whole by a finished run's re-export.
_TRAINED_DESCRIPTION = ("format", "files", "rows", "fingerprint", "heldout_rows", "sources", "buckets")


def _exported_meta(cfg: RayLoraConfig, store) -> dict:
    """The raylora.json a finished run exported into {output.uri}/adapter/; {} when there
    is none, or it does not read."""
    from raylora.checkpoint.export import RUN_META
    from raylora.checkpoint.state import ADAPTER_DIR

    try:
        meta = json.loads(store.read_bytes(storage.join(cfg.output.uri, ADAPTER_DIR, RUN_META)))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _trained_data_record(exported: dict) -> dict:
    """The finished run's record of its data (``_TRAINED_DATA``) from the raylora.json it
    exported (``_exported_meta``), as plan keys; {} when there is none."""
    data = exported.get("data")
    if not isinstance(data, dict):
        return {}
    out = {key: data[k] for k, key in _TRAINED_DATA.items() if data.get(k) is not None}
    # The data as it trained: a cached run's files and rows were its cache entry's, which
    # the rerun's plan (of the raw data) does not read, and data changed since training
    # would give the old weights a new fingerprint.
    if described := {k: data[k] for k in _TRAINED_DESCRIPTION if data.get(k) is not None}:
        out["trained_data"] = described
    # Per source, as export._sources reads them back: by source index (None: not counted)
    decoded = {str(s.get("source")): s["rows_decoded"] for s in data.get("sources") or []
               if isinstance(s, dict) and s.get("rows_decoded") is not None}
    if decoded:
        out["rows_decoded_by_source"] = decoded
    return out


# Keys a finished run may be exported again with another value of: where and how it is
# published, tracked and run, not what trained the weights (the step count is checked by
# finished_metrics; a moved model by check_latest's warning).
_EXPORT_ONLY = ("output.", "export.", "tracking.", "checkpoint.", "failure.", "validation.",
                "storage.", "scaling.", "tune.", "train.max_steps", "train.num_epochs",
                "train.log_every_n_steps", "train.log_every_n_seconds",
                "train.readback_every_n_steps", "train.record_samples", "train.compile",
                "train.compile_cache_uri", "train.sdpa_backend", "train.cuda_graphs",
                "model.pretrained", "model.revision")


def _changed_since_export(cfg: RayLoraConfig, exported: dict, family: str) -> dict[str, tuple]:
    """Training settings of ``cfg`` other than those the finished run's exported adapter
    recorded (its raylora.json, ``_exported_meta``): key → (then, now). A rerun of a finished run with another
    learning rate or data re-published the old weights under a card and raylora.json
    naming the new values. {} when nothing was exported yet (nothing to compare).
    Target modules compare as the resume check compares them (``family``: the model's
    resolved family): the same names in another order, or the family's default list
    written out for null, are the same LoRA (they were refused as another)."""
    from raylora.checkpoint.recorded import _resolved, _same

    then = exported.get("config") or {}

    def flat(tree: dict, at: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out |= flat(v, f"{at}{k}.") if isinstance(v, dict) else {f"{at}{k}": v}
        return out

    old, new = flat(then), flat(cfg.to_dict())
    return {k: (old[k], new[k]) for k in new
            if k in old and not k.startswith(_EXPORT_ONLY)
            and not _same(k, _resolved(k, old[k], family), _resolved(k, new[k], family))}


def check_bad_records(cfg: RayLoraConfig, p: Plan) -> dict:
    """The counts so far as ``raylora.json`` entries; raises ``BadDataError`` when the bad
    fraction is over ``data.max_bad_fraction`` (judged on every row read, at the end)."""
    from raylora.data.badrecords import BadDataError, read_counter, verdict

    summary = read_counter(p.bad_records) or {}
    if not summary:
        return {}
    if cfg.data.cache == "latents" and not summary["rows_seen"]:
        # Nothing counted: a reused cache entry that recorded no counts (_count_cached),
        # where workers decode nothing. Unknown, not "0 rows decoded".
        return {}
    if summary["bad_records"]:
        log.warning("bad records: %s of %d rows read", summary["bad_records"], summary["rows_seen"])
    # Every row read counts here; the workers judge earlier, once enough were read.
    message = verdict(summary, cfg.data.max_bad_fraction, 1)
    if message:
        raise BadDataError(message)
    # "bad_records" in the plan is the desk's name: the counts travel under their own key.
    return {"bad_records_counts": summary["bad_records"], "bad_examples": summary["bad_examples"],
            "rows_decoded": summary["rows_ok"],
            "rows_decoded_by_source": summary.get("rows_ok_by_source", {})}


def fit_judging_data(cfg: RayLoraConfig, p: Plan, fit):
    """``fit()``, then the bad-record verdict on every row it read: ``(result, counts for
    raylora.json)``. When ``fit`` fails, a data verdict (one line naming the bad rows)
    replaces the training error if the data was at fault."""
    try:
        result = fit()
    except Exception:
        check_bad_records(cfg, p)
        raise
    return result, check_bad_records(cfg, p)


def fit_interruptibly(trainer):
    """``trainer.fit()``, with Ctrl-C and the stop timeout (raylora.stop) still raising
    KeyboardInterrupt in this thread: the embedded Ray shut down, exit 130, "interrupted".

    Ray Train V2's ``fit()`` on the main thread installs its own SIGINT handler and keeps
    it: it aborts the run's controller, then exits the process, with code 1 and no word of
    why. Off the main thread it installs none (as in a Tune trial), so the fit runs in a
    helper thread while this one waits where a signal's handler can run."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        try:
            return trainer.fit()
        except Exception as exc:
            raise _repeated(exc) from None
    out: dict = {}

    def fit() -> None:
        try:
            out["result"] = trainer.fit()
        except BaseException as exc:  # re-raised below, in the caller's thread
            out["error"] = exc

    # A daemon: an interrupted driver exits without waiting on the fit's ray.get (the
    # embedded Ray's shutdown, or the driver's exit on a cluster, ends the run).
    helper = threading.Thread(target=fit, name="raylora-fit", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.25)
    if "error" in out:
        raise _repeated(out["error"]) from None
    return out["result"]


def _repeated(error: BaseException) -> BaseException:
    """The worker's error (one line: the CLI prints a ValueError so) when the run ended on
    one that a restart would repeat (``raylora.entry.EndOnRepeated``); else ``error``."""
    from raylora.entry import RepeatedError

    cause = getattr(error, "controller_failure", None)
    return cause if isinstance(cause, RepeatedError) else error


def _fit(cfg: RayLoraConfig, p: Plan):
    from raylora import progress
    from raylora.checkpoint.recorded import drop_unrecorded

    drop_unrecorded(cfg.storage.client(), storage.join(cfg.output.uri, TRAIN_RUN_NAME))
    t = cfg.train
    sink = progress.write_progress(cfg.storage.client(), cfg.output.uri)
    run_desk = p.bad_records  # raylora.desk: progress rows and stop requests go there too
    with (progress.watch(run_desk, p.max_steps, t.log_every_n_steps, t.log_every_n_seconds, sink),
          stop.driver_requests(run_desk, cfg.failure.stop_timeout_s, SIGTERM_HOOKS) as stops):
        trainer = build_trainer(cfg, p, cfg.output.uri, TRAIN_RUN_NAME, progress_board=run_desk,
                                stop_requests=run_desk)
        result = fit_interruptibly(trainer)
    if stops.signalled and not (result.metrics or {}).get("stopped"):
        log.warning("SIGTERM came after the last step had started: the run finished "
                    "normally, no stop was needed")
    return result


def build_trainer(
    cfg: RayLoraConfig,
    p: Plan,
    storage_uri: str,
    name: str,
    callbacks: list | None = None,
    train_fn=None,
    lr_find=None,
    progress_board: str | None = None,
    stop_requests: str | None = None,
    progress_label: str | None = None,
):
    """The TorchTrainer of one run: datasets, workers, storage. ``raylora train`` fits one
    (rank 0 sends step rows to ``progress_board``, raylora.progress); each Tune trial
    builds its own (with ``TuneReportCallback``, its rows labelled ``progress_label``);
    lr-find passes its own per-worker function."""
    import ray.data
    import ray.train

    from raylora import quiet
    from raylora.data.tokenize import load_specs
    # raylora.entry, not raylora.worker: Ray Train's controller imports what is pickled.
    from raylora.entry import EndOnRepeated, WorkerSpec, train_loop_per_worker

    store = cfg.storage.client()
    # Ray Data's per-operator bars are for people watching a terminal, and then only when
    # debugging the data path: raylora.progress draws the run's own line. In job logs and
    # CI they are thousands of lines of carriage returns.
    data_bars = sys.stdout.isatty() and quiet.verbose()
    ray.data.DataContext.get_current().enable_progress_bars = data_bars
    # Workers load the commit the driver read (a hub model), as the tokenizers below are.
    loads = cfg.at_commit(p.model_commit)
    spec = WorkerSpec(loads, p, progress_bar=data_bars, lr_find=lr_find, progress_board=progress_board,
                      stop_requests=stop_requests, progress_label=progress_label)
    # The workers build the run's one dataset themselves (worker._epoch_batches: rank 0
    # splits it, or each worker reads its own files), so Ray Train is given none. The
    # tokenizer is read once, here, for all of them (cached latents need none).
    if cfg.data.cache != "latents":
        spec.tokenizer_specs = load_specs(p.model_path, p.family, store, cfg.model.max_sequence_length,
                                          revision=loads.model.revision, references=cfg.data.references(),
                                          system_prompt=cfg.model.system_prompt)
    ckpt_fs, ckpt_path = store.fs(storage_uri)
    return _trainer_class()(
        train_fn or train_loop_per_worker,
        train_loop_config={"spec": spec},
        scaling_config=_scaling_config(cfg.scaling),
        run_config=ray.train.RunConfig(
            # Same storage_path + name = Ray Train V2 resumes from the latest checkpoint.
            name=name,
            storage_path=ckpt_path,
            storage_filesystem=ckpt_fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            # A dead worker process or node: restart the workers from the latest checkpoint
            # (they restore the exact data position, RNG and optimizer state).
            failure_config=ray.train.FailureConfig(
                max_failures=cfg.failure.max_failures,
                # A drained node's workers checkpoint on the notice (raylora.stop).
                max_preemption_failures=cfg.failure.max_preemption_failures),
            callbacks=[*(callbacks or []), EndOnRepeated()],
            # INFO is a TrainingReport(...) dump per report per worker (raylora.quiet).
            logging_config=ray.train.LoggingConfig(log_level=quiet.ray_train_log_level()),
        ),
    )


@functools.cache
def _trainer_class():
    """TorchTrainer, less the per-run ``DatasetManager`` actor Ray Train starts for the
    datasets it is given: raylora gives it none (``entry.NoDatasetsCallback`` says why).
    Made on first use: ``ray.train.torch`` imports torch, which ``raylora validate`` and
    ``raylora plan`` do not need."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    from raylora.entry import NoDatasetsCallback

    def lean(cb: DatasetsCallback) -> NoDatasetsCallback:
        # the stock callback's own state, whatever its constructor takes in this Ray
        out = NoDatasetsCallback.__new__(NoDatasetsCallback)
        out.__dict__.update(cb.__dict__)
        return out

    class RunTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [lean(cb) if type(cb) is DatasetsCallback else cb for cb in callbacks]

    return RunTrainer


def _scaling_config(s):
    """Ray Train's ScalingConfig; ``num_workers=(min, max)`` is its elastic mode: it
    starts with the workers the cluster holds and, every ``resize_check_s``, restarts
    the group at a new size from the latest checkpoint when that changed (a lost worker
    restarts it at once: a failure, counted against failure.max_failures)."""
    import ray.train

    elastic = {"elastic_resize_monitor_interval_s": s.resize_check_s} if s.elastic else {}
    return ray.train.ScalingConfig(
        num_workers=s.num_workers,
        use_gpu=s.use_gpu,
        resources_per_worker={"CPU": s.cpus_per_worker},
        placement_strategy=s.placement_strategy,
        **elastic,
    )


LR_FIND_RUN_NAME = "lr_find"


def run_lr_find(
    cfg: RayLoraConfig,
    start_lr: float = 1e-7,
    end_lr: float = 1.0,
    num_steps: int = 100,
    smoothing: float = 0.9,
    diverge_factor: float = 10.0,
) -> dict:
    """Learning-rate range test on one worker; writes ``lr_find.csv`` and ``lr_find.png``
    under ``output.uri`` and returns the suggestion."""
    from raylora.train import lr_find
    from raylora.entry import LrFindSettings, lr_find_per_worker

    settings = LrFindSettings(start_lr=start_lr, end_lr=end_lr, num_steps=num_steps,
                              smoothing=smoothing, diverge_factor=diverge_factor)
    divisor = lr_find.scale_lr_divisor(cfg.train)  # the user's config, before the sweep's
    cfg = _lr_find_config(cfg, settings)
    # lr-find never evaluates: the held-out rows are neither read nor sent to the worker
    # (a validation_split still keeps them out of its training data). No memory preflight.
    setup = Setup(need_cpus=lambda c: c.scaling.cpus_per_worker, num_workers=1, memory=False,
                  make_plan=lambda c: plan(c, heldout=False))
    with prepared(cfg, setup) as r:
        cfg, p = r.cfg, r.plan
        trainer = build_trainer(
            cfg, p, cfg.output.uri, LR_FIND_RUN_NAME, train_fn=lr_find_per_worker,
            lr_find=settings,
        )
        # A curve measured on a fraction of the data is refused like a run trained on one.
        result, bad = fit_judging_data(cfg, p, lambda: fit_interruptibly(trainer))
        with result.checkpoint.as_directory() as d, open(os.path.join(d, "lr_find.json")) as f:
            rows = json.load(f)
    suggestion = lr_find.suggest_lr(rows)
    csv_uri, png_uri = _write_lr_find(cfg, rows, suggestion)
    return {**suggestion, "learning_rate": suggestion["suggested_lr"] / divisor,
            "scale_lr_divisor": divisor,
            "settings": asdict(settings), "csv": csv_uri, "png": png_uri, "rows": rows,
            "bad_records": bad.get("bad_records_counts", {}), "rows_decoded": bad.get("rows_decoded")}


def _lr_find_config(cfg: RayLoraConfig, s) -> RayLoraConfig:
    """The config lr-find trains by: one worker, ``s.num_steps`` steps at a constant lr
    (the range test sets it each step). Raises ConfigError for an impossible sweep."""
    problems = []
    if not 0 < s.start_lr < s.end_lr:
        problems.append(f"lr-find: need 0 < start_lr < end_lr (got {s.start_lr:g}, {s.end_lr:g})")
    if s.num_steps < 2:
        problems.append(f"lr-find: num_steps must be at least 2 (got {s.num_steps})")
    if cfg.train.optimizer == "adafactor" and cfg.train.adafactor.relative_step:
        # the sweep sets each step's lr, which this Adafactor never reads: a flat curve
        # and a suggestion of nothing
        problems.append("train.adafactor.relative_step: lr-find sweeps the learning rate, which "
                        "Adafactor with relative_step=true does not use (it sets its own step "
                        "size); set train.adafactor.relative_step=false to find one")
    if problems:
        raise ConfigError(problems)
    tree = cfg.to_dict()
    tree["scaling"]["num_workers"] = 1
    # the schedule's own keys go with it (a constant schedule refuses cycles or a power),
    # and the text encoder's lr too: the sweep sets every group's lr
    # (worker.lr_find_per_worker), and Prodigy refuses a second group's lr once
    # learning_rate is the sweep's
    tree["train"].update(max_steps=s.num_steps, learning_rate=s.start_lr, lr_scheduler="constant",
                         lr_warmup_steps=0, scale_lr=False, lr_num_cycles=1, lr_power=1.0)
    tree["lora"]["text_encoder_lr"] = None
    # the sweep opens no tracker (lr_find_per_worker): an online wandb without a key on
    # this machine is no reason to refuse it
    tree["tracking"] = {"backend": "none"}  # and none of wandb's keys, which none refuses
    tree["scaling"].pop("resize_check_s", None)  # one worker: no elastic run to resize
    return validate(tree)


def _write_lr_find(cfg: RayLoraConfig, rows: list[dict], suggestion: dict) -> tuple[str, str]:
    """``lr_find.csv`` and ``lr_find.png`` under ``output.uri``: their URIs."""
    import csv
    import io
    import tempfile

    from raylora.train import lr_find

    store = cfg.storage.client()
    out = storage.normalize(cfg.output.uri)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["step", "lr", "loss", "smoothed_loss", "stopped"])
    writer.writeheader()
    writer.writerows(rows)
    csv_uri, png_uri = storage.join(out, "lr_find.csv"), storage.join(out, "lr_find.png")
    store.write_bytes(csv_uri, buf.getvalue().encode())
    with tempfile.TemporaryDirectory(prefix="raylora-lrfind-") as tmp:
        png = os.path.join(tmp, "lr_find.png")
        lr_find.plot(rows, suggestion, png)
        with open(png, "rb") as f:
            store.write_bytes(png_uri, f.read())
    return csv_uri, png_uri
