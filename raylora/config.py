"""One typed config for a raylora job.

A job is one YAML file plus dotted command-line overrides
(``train.learning_rate=2e-4 lora.target_modules=[to_q,to_v]``). Everything is checked
before Ray starts, and every problem is reported in one message that names the key, so a
user fixes a config in one round trip instead of one error per cluster launch.

Defaults follow diffusers' ``train_text_to_image_lora.py`` (AdamW 0.9/0.999, weight decay
1e-2, eps 1e-8, rank 4, lr 1e-4, constant schedule, grad clipping at 1.0).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

LR_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
)


class ConfigError(ValueError):
    """A config problem found before any resources were spent.

    ``problems`` holds one ``"dotted.key: message"`` line per problem.
    """

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} config problem(s){where}:\n{lines}")


class _Section(BaseModel):
    # Unknown keys are almost always typos (`learning_rat`); silently ignoring them trains
    # with the default and wastes a cluster run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    pretrained: str = Field(
        description="Hugging Face hub id, or a local diffusers folder (with model_index.json)."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    variant: str | None = Field(None, description="Weight variant, e.g. 'fp16'.")


class DataSection(_Section):
    uri: str | list[str] = Field(
        description="Shard file, directory, glob, or a list of those; any storage URI."
    )
    format: Literal["auto", "parquet", "webdataset", "imagefolder"] = Field(
        "auto", description="auto: detected from the files the URI matches."
    )
    image_column: str = "image"
    caption_column: str = "text"
    resolution: int = Field(512, gt=0, description="Square training size in pixels.")
    center_crop: bool = Field(False, description="Center crop (True) or random crop (False).")
    random_flip: bool = Field(False, description="Random horizontal flip with p=0.5.")
    shuffle_seed: int | None = Field(
        None, description="Seed of the per-epoch file shuffle; defaults to train.seed."
    )
    shuffle_buffer_size: int = Field(
        256, ge=0, description="Rows in each worker's local shuffle buffer (0 = off)."
    )
    sharding: Literal["stream", "files"] = Field(
        "stream",
        description=(
            "stream: one dataset split dynamically across workers (fastest). files: each "
            "worker reads its own shard files (file i → worker i mod N), in order, so which "
            "rows a worker sees does not depend on timing or cluster shape (reproducible "
            "runs; needs at least N shard files, parquet or webdataset)."
        ),
    )


class LoraSection(_Section):
    rank: int = Field(4, gt=0)
    alpha: float | None = Field(None, gt=0, description="LoRA alpha; defaults to rank (scale 1).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["to_k", "to_q", "to_v", "to_out.0"],
        description="UNet module names that get LoRA layers (attention projections).",
    )

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one module name")
        return v

    @property
    def effective_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)


class TrainSection(_Section):
    learning_rate: float = Field(1e-4, gt=0)
    scale_lr: bool = Field(
        False, description="Multiply lr by accumulation steps × batch size × workers."
    )
    lr_scheduler: Literal[LR_SCHEDULERS] = "constant"  # type: ignore[valid-type]
    lr_warmup_steps: int = Field(0, ge=0, description="Warmup, in optimizer steps.")
    lr_num_cycles: int = Field(1, ge=1, description="Cycles for cosine_with_restarts.")
    lr_power: float = Field(1.0, gt=0, description="Power for the polynomial schedule.")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_weight_decay: float = Field(1e-2, ge=0)
    adam_epsilon: float = Field(1e-8, gt=0)
    batch_size: int = Field(4, gt=0, description="Per worker, per micro-step.")
    gradient_accumulation_steps: int = Field(1, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_steps: int | None = Field(
        None, gt=0, description="Optimizer steps; overrides num_epochs when set."
    )
    num_epochs: int = Field(1, gt=0)
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    seed: int = 42
    log_every_n_steps: int = Field(1, gt=0, description="Print a log line every N steps.")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="Defaults to the model's scheduler config."
    )


class ScalingSection(_Section):
    num_workers: int = Field(1, gt=0, description="Training workers (one per GPU).")
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How workers are placed on nodes (Ray placement group strategy)."
    )


class CheckpointSection(_Section):
    every_n_steps: int = Field(500, gt=0, description="Checkpoint cadence in optimizer steps.")
    num_to_keep: int | None = Field(2, gt=0, description="Checkpoints kept in storage.")


class StorageSection(_Section):
    """Object-store settings. Credentials come only from the environment (AWS_* variables)."""

    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, Ceph, ...); default AWS_ENDPOINT_URL."
    )
    region: str | None = Field(None, description="Default: AWS_REGION, else us-east-1.")

    def client(self):
        from raylora.storage import Storage

        return Storage(self.endpoint_url, self.region)


class OutputSection(_Section):
    uri: str = Field(description="Where checkpoints, metrics and the final adapter go.")


class RayLoraConfig(_Section):
    model: ModelSection
    data: DataSection
    lora: LoraSection = Field(default_factory=LoraSection)
    train: TrainSection = Field(default_factory=TrainSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    output: OutputSection

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, same tree as the YAML."""
        return self.model_dump(mode="json")


def _cross_checks(cfg: RayLoraConfig) -> list[str]:
    """Combinations that are each valid alone but cannot run together."""
    problems = []
    if cfg.train.mixed_precision == "fp16" and not cfg.scaling.use_gpu:
        problems.append(
            "train.mixed_precision: fp16 needs a GPU (scaling.use_gpu is false); use bf16 or no"
        )
    if cfg.train.lr_warmup_steps and cfg.train.max_steps:
        if cfg.train.lr_warmup_steps > cfg.train.max_steps:
            problems.append(
                f"train.lr_warmup_steps: {cfg.train.lr_warmup_steps} is more than "
                f"train.max_steps ({cfg.train.max_steps})"
            )
    return problems


def _format_pydantic(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            out.append(f"{key}: unknown key")
        elif e["type"] == "missing":
            out.append(f"{key}: required key is missing")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            out.append(f"{key}: {e['msg']}{shown}")
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` → (["a","b","c"], VALUE parsed as a YAML scalar or flow list)."""
    if "=" not in item:
        raise ConfigError([f"{item}: override must look like key.path=value"])
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError([f"{item}: override key is empty or malformed"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([f"{key}: cannot parse override value {raw!r}: {exc}"]) from None
    return key.split("."), value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    problems = []
    for item in overrides:
        try:
            path, value = parse_override(item)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        node = tree
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"{'.'.join(path[: i + 1])}: is a value, not a section")
                break
            node = child
        else:
            node[path[-1]] = value
    if problems:
        raise ConfigError(problems)
    return tree


def validate(tree: Any, source: str | None = None) -> RayLoraConfig:
    """Validate a raw config tree; raise one ConfigError listing every problem."""
    if not isinstance(tree, dict):
        raise ConfigError(["<root>: the config must be a mapping of sections"], source)
    try:
        cfg = RayLoraConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_pydantic(exc), source) from None
    problems = _cross_checks(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RayLoraConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read config file ({exc.strerror})"]) from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    tree = apply_overrides(tree, overrides or [])
    return validate(tree, source=str(path))
