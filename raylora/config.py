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
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

QUANTIZE_KINDS = ("none", "nf4", "int8", "fp8")
# data.control_inputs' bound: Qwen-Image-Edit-Plus is trained on up to 3 inputs, Flux.2's
# pipelines take up to 10 references; past a few every step's sequence is mostly inputs.
MAX_CONTROL_INPUTS = 4
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "prodigy", "adafactor")

LR_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
)
# Every seed key: 0 <= seed < 2**32. numpy's SeedSequence (the data order, rank and epoch
# seeds) refuses a negative one, and numpy's legacy RandomState (Optuna's sampler, seeded
# with tune.seed or train.seed) takes 32 bits; torch.manual_seed takes 64, so the seeds
# derived from one (seed + 1000 × rank + step in raylora.train.setup, seed + i for previews
# and class images) stay far inside it. Either failed in the workers, after the model loaded.
SEED_LIMIT = 2**32


class ConfigError(ValueError):
    """A config problem found before any resources were spent.

    ``problems`` holds one ``"dotted.key: message"`` line per problem.
    """

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems, self.source = list(problems), source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} config problem(s){where}:\n{lines}")

    def __reduce__(self):
        # Raised in a Tune trial, it crosses to the driver pickled: rebuilt from its
        # message alone it became one "problem" per character.
        return type(self), (self.problems, self.source)


class _Section(BaseModel):
    # Unknown keys are almost always typos (`learning_rat`); silently ignoring them trains
    # with the default and wastes a cluster run.
    # inf/nan (YAML's .inf, .nan) are no setting: they only showed as non-finite losses
    # once the model had loaded.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v: Any, info) -> Any:
        # YAML reads yes/no/on/off as booleans and pydantic's lax mode took them as 1 and
        # 0: `noise_offset: on` trained with an offset of 1.0, `lora.rank=true` at rank 1.
        kind = _number_kind(cls.model_fields[info.field_name].annotation)
        if kind and (v is True or v is False):
            raise ValueError(f"{kind}, not {v!r} (YAML reads true/false, yes/no and on/off "
                             "as booleans)")
        if kind and isinstance(v, (list, tuple)) and any(x is True or x is False for x in v):
            raise ValueError(f"{list(v)!r}: numbers, not booleans (YAML reads true/false, "
                             "yes/no and on/off as booleans)")
        return v


@functools.cache
def _number_kind(annotation: Any) -> str | None:
    """What a field takes whose type is an int or a float (or a list or tuple of them) and
    no bool, which pydantic would read a boolean as: "an integer" or "a number"; else None."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) \
        or typing.get_origin(annotation) is typing.Union else (annotation,)
    if any(m is bool or m is Any for m in members):
        return None
    for m in members:
        if typing.get_origin(m) in (list, tuple):
            m = next((a for a in typing.get_args(m) if a in (int, float)), None)
        if m in (int, float):
            return "an integer" if m is int else "a number"
    return None


def hub_model(uri: str, revision: str | None, keys=("model.pretrained", "model.revision")
              ) -> tuple[str, str | None]:
    """(``model.pretrained``, ``model.revision``) of ``hf://owner/name[@revision]`` (as
    ``lora.init_from`` names a hub adapter): the hub id and its revision; anything else
    as given. ``keys``: the two settings' names, for errors."""
    from raylora.model import hub

    if not uri.startswith(hub.SCHEME):
        return uri, revision
    whole = (f"{keys[0]}: {uri}: not hf://owner/name[@revision] (a hub model is a whole repo: "
             "owner/name, or its folder downloaded)")
    try:
        repo, named, path = hub.split_uri(uri, keys[0])
    except ValueError:
        raise ValueError(whole) from None
    if path:
        raise ValueError(whole)
    if named and revision not in (None, named):
        raise ValueError(f"{keys[0]}: {uri} names revision {named}, {keys[1]} {revision}; "
                         "give one")
    return repo, named or revision


class ModelSection(_Section):
    pretrained: str = Field(
        description="Hugging Face hub id (owner/name, or hf://owner/name[@revision]: the id "
        "and model.revision), a local diffusers folder (with model_index.json) or a storage URI."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit). A "
                                 "folder has none: one in object storage is trained as its "
                                 "files are listed when the run starts.")
    variant: str | None = Field(None, description="Weight variant, e.g. 'fp16'.")
    family: str = Field(
        "auto",
        description="auto: from model_index.json's _class_name. Or a family name: sd (SD "
        "1.x/2.x), sdxl, flux (Flux.1 dev/schnell), fluxkontext (Flux.1 Kontext), chroma, "
        "sd3 (SD3/3.5), qwenimage, qwenimageedit (Qwen-Image-Edit-2509/2511), qwenimage21, "
        "zimage, lumina2 (Lumina-Image 2.0), sana (Sana 1.0/1.5), flux2klein (Flux.2 [klein]), flux2 (Flux.2 "
        "[dev]), wan (Wan 2.1/2.2); it must match the model.",
    )
    expert: Literal["high_noise", "low_noise"] | None = Field(
        None,
        description="A pipeline of experts (Wan 2.2 A14B: transformer samples σ ≥ "
        "boundary_ratio, transformer_2 below it): the one this run trains, on the σ of its "
        "range only. high_noise: transformer; low_noise: transformer_2, whose adapter loads "
        "with load_lora_weights(..., load_into_transformer_2=True). Required for such a "
        "pipeline, refused for any other; train both experts as two runs.",
    )
    max_sequence_length: int | None = Field(
        None, gt=0, le=4096,
        description="Tokens per caption for the long-context text encoder (T5 of Flux/SD3, "
        "Qwen-Image's, Z-Image's and Flux.2's LLMs, Wan's UMT5). Default: the pipeline's "
        "(Flux.1-dev 512, schnell use 256; SD3 256; Qwen-Image 512; Z-Image and Flux.2 "
        "[klein]/[dev] 512, the chat template (and [dev]'s system message) included; Wan 512; "
        "Lumina-Image 2.0 256, its system prompt included; Sana 300 after its instruction; "
        "Chroma 512; Qwen-Image-Edit 1024, the template and the image slot included). "
        "Refused for SD and SDXL, whose CLIP encoders read 77 tokens.",
    )
    system_prompt: str | None = Field(
        None,
        description="The system prompt the pipeline writes before every caption "
        "(Lumina2Pipeline's system_prompt: '<system prompt> <Prompt Start> <caption>'), as "
        "diffusers' Lumina2 script's --system_prompt; SanaPipeline's complex human "
        "instruction (its complex_human_instruction lines joined by newlines; '' for none, "
        "as diffusers' Sana script trains by default): training captions, previews, class "
        "images, the model card's example and `raylora sample` use it. Default: the "
        "pipeline's own. Refused for a family without one.",
    )

    @model_validator(mode="before")
    @classmethod
    def _hub_uri(cls, data):
        if isinstance(data, dict) and isinstance(data.get("pretrained"), str):
            repo, revision = hub_model(data["pretrained"], data.get("revision"))
            if repo != data["pretrained"]:
                return {**data, "pretrained": repo, "revision": revision}
        return data

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        from raylora.model import families

        if v != "auto" and v not in families.names():
            raise ValueError(f"unknown family {v!r} (auto or one of: {', '.join(families.names())})")
        return v
    attention: Literal["sdpa", "eager"] = Field(
        "sdpa",
        description="sdpa: torch scaled_dot_product_attention (flash / memory-efficient "
        "kernels where the GPU has them). eager: the plain matmul-softmax processor.",
    )
    quantize: Literal[QUANTIZE_KINDS] = Field(  # type: ignore[valid-type]
        "none",
        description="Store the frozen denoiser's linear layers quantized (QLoRA): nf4 "
        "(bitsandbytes 4-bit NormalFloat, ~0.52 bytes/weight), int8 (bitsandbytes LLM.int8, ~1 "
        "byte), fp8 (float8_e4m3 weights with per-row scales, ~1 byte; GPU only), none. LoRA "
        "trains on top in full precision; the adapter is a normal one that the unquantized "
        "pipeline loads. Every nn.Linear (AdaLN modulation and timestep/patch embedders too, not "
        "a model's _keep_in_fp32_modules); convolutions, norms and nn.Embedding stay in the "
        "training dtype.",
    )
    quantize_text_encoders: Literal[QUANTIZE_KINDS] = Field(  # type: ignore[valid-type]
        "none",
        description="The same for the text encoders the workers load (T5-XXL, Qwen2.5-VL: "
        "most of a Flux/Qwen-Image job's frozen bytes). With data.cache=latents workers load "
        "them only to render validation.prompts (the cache stage encodes at full precision), "
        "so it applies to previews alone, and needs them.",
    )


def _caption_extension(v: str | None) -> str | None:
    if v is not None and (not v.startswith(".") or len(v) < 2 or "/" in v):
        raise ValueError(f"{v!r}: an extension with its dot, e.g. .txt or .caption")
    return v


class SourceSection(_Section):
    """One dataset of ``data.sources``, mixed with the others into every epoch. Keys left
    unset take the ``data`` key of the same name."""

    uri: str | list[str] = Field(description="Files, directory, glob or a list of those, "
                                 "as data.uri.")
    format: Literal["auto", "parquet", "webdataset", "imagefolder", "captionfolder"] | None = None
    image_column: str | None = None
    caption_column: str | None = None
    caption_extension: str | None = None
    weight: float | None = Field(
        None, gt=0, description="This source's share of every epoch: weight / (sum of the "
        "weights) of the epoch's samples, the epoch being as long as all sources' rows "
        "(repeats counted). Rows are repeated, or a seeded subset taken, to fill it. Give "
        "every source a weight, or none.",
    )
    repeats: int | None = Field(
        None, ge=1, description="Times each row counts per epoch (default 1; a caption "
        "folder's N_name repeats multiply it). Not with weight.",
    )
    mask_column: str | None = None
    control_column: str | list[str] | None = None
    control_uri: str | list[str] | None = None
    caption_prefix: str | None = Field(None, description="This source's trigger word(s).")
    caption_dropout: float | None = Field(None, ge=0.0, lt=1.0)
    shuffle_tags: bool | None = None
    keep_tokens: int | None = Field(None, ge=0)
    resolution: int | list[int] | None = Field(
        None, description="With data.bucketing: the resolution(s) this source's images "
        "bucket at (default data.resolution). Refused without bucketing.",
    )

    @field_validator("caption_extension")
    @classmethod
    def _extension(cls, v: str | None) -> str | None:
        return _caption_extension(v)

    @field_validator("resolution", mode="before")
    @classmethod
    def _resolution(cls, v: Any) -> Any:
        return None if v is None else _resolution_value(v)


def _resolution_value(v: Any) -> int | list[int]:
    """An int (``512``, ``"512"``) or a list of them, with one message for anything else
    (not one per member of the union)."""
    def one(x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, (int, str)) or not str(x).strip().isdigit():
            raise ValueError(f"{x!r}: a resolution in pixels (an integer), or a list of them")
        return int(x)
    return [one(x) for x in v] if isinstance(v, (list, tuple)) else one(v)


class ClassSourceSection(_Section):
    """One set of class images for prior preservation (``data.class_sources``)."""

    uri: str | list[str] = Field(description="Files, directory, glob or a list of those, "
                                 "as data.uri.")
    prompt: str | None = Field(None, description="Caption of this source's images that have "
                               "none (default data.class_prompt).")
    format: Literal["auto", "parquet", "webdataset", "imagefolder", "captionfolder"] | None = None
    image_column: str | None = None
    caption_column: str | None = None
    caption_extension: str | None = None

    @field_validator("caption_extension")
    @classmethod
    def _extension(cls, v: str | None) -> str | None:
        return _caption_extension(v)


class ClassGenerationSection(_Section):
    """How the class images that ``data.class_sources`` lacks are generated with the base
    model (its stock pipeline, bf16 on GPUs), before training. Diffusers' DreamBooth
    scripts generate the same way; these keys name the images' folder, so a rerun with
    the same ones reuses them."""

    uri: str | None = Field(
        None, description="Root of the generated images ({uri}/{key}/NNNNN.png + .txt, key: a "
        "hash of model, prompt, seed, resolution, steps and guidance, not the count: image i is "
        "drawn from seed + i, so a run wanting more tops the folder up). Default: "
        "{data.class_sources}/raylora-generated when data.class_sources is one URI, else "
        "{output.uri}/class_images.",
    )
    num_inference_steps: int = Field(30, gt=0, le=1000, description="Sampler steps per image.")
    guidance_scale: float | None = Field(
        None, ge=0.0, description="Classifier-free guidance scale; default the family's "
        "(SD/SDXL 7.5, SD3 7.0, Flux.1 3.5, Flux.1 Kontext 2.5, Qwen-Image 4.0).",
    )
    seed: int = Field(0, ge=0, lt=SEED_LIMIT,
                      description="Image i is drawn with generator seed seed + i.")
    batch_size: int = Field(4, gt=0, le=64, description="Images per pipeline call.")


# What a source may set for itself (unset: the data key of the same name).
SOURCE_KEYS = ("format", "image_column", "caption_column", "mask_column", "control_column",
               "control_uri", "caption_extension",
               "caption_prefix", "caption_dropout", "shuffle_tags", "keep_tokens", "resolution")


class DataSection(_Section):
    # Set on the copies that read DreamBooth class sources (raylora.data.classgen): their
    # images take a prompt where they have no caption, so the checks that refuse a folder
    # without captions, or a caption column no row has, do not apply to them.
    _captions_optional: bool = PrivateAttr(False)

    @property
    def captions_optional(self) -> bool:
        return self._captions_optional

    def as_class_source(self) -> DataSection:
        out = self.model_copy()
        out._captions_optional = True
        return out

    uri: str | list[str] | None = Field(
        None, description="Shard file, directory, glob, or a list of those; any storage URI or "
        "hf://datasets/owner/name[@revision][/path]; WebDataset's brace lists too "
        "({00000..00999}.tar, {a,b}/). Or data.sources, not both."
    )
    sources: list[SourceSection] | None = Field(
        None, description="Several datasets mixed into every epoch, each {uri, weight | "
        "repeats, caption_prefix, caption_dropout, shuffle_tags, keep_tokens, resolution, format, "
        "image_column, caption_column, mask_column, control_column, control_uri, "
        "caption_extension}; instead of data.uri.",
    )
    format: Literal["auto", "parquet", "webdataset", "imagefolder", "captionfolder"] = Field(
        "auto", description="auto: detected from the files the URI matches (images with a "
        "metadata.jsonl or metadata.csv: imagefolder; images without one: captionfolder; "
        "img2dataset's metadata .parquet beside its tars or shard folders is not a shard)."
    )
    image_column: str = "image"
    caption_column: str = "text"
    masked_loss: bool = Field(
        False, description="Weight the loss by a per-sample mask (0: this pixel teaches "
        "nothing, 1: full weight): a sidecar KEY.mask.png beside the image (WebDataset, "
        "imagefolder, captionfolder), the parquet column data.mask_column, else the image's "
        "alpha channel; a sample with none trains unmasked. The mask is cropped, resized "
        "and flipped with its image, averaged over each latent pixel, and multiplies the "
        "squared error before the mean (as kohya). Held-out loss stays unmasked.",
    )
    mask_column: str = Field(
        "mask", description="parquet, data.masked_loss: the column of encoded mask images "
        "(greyscale, the image's size); a shard without it, or a null cell, trains unmasked.",
    )
    control_images: bool = Field(
        False, description="Image-edit training, for a family whose denoiser takes a "
        "reference image (fluxkontext, flux2klein, flux2, qwenimageedit): every sample's "
        "control image, the edit's input, from a sidecar KEY.control.<image extension> beside "
        "the image (WebDataset, imagefolder, captionfolder), data.control_uri's folder, or the "
        "parquet column data.control_column. It is resized to its "
        "target's size, cropped and flipped with it, and its latents (the VAE posterior's "
        "mean, as the pipeline encodes its input image) go to the denoiser beside the noisy "
        "ones. A sample without one is a missing_control bad record. Off: the family trains "
        "text to image.",
    )
    control_inputs: int = Field(
        1, ge=1, le=MAX_CONTROL_INPUTS, description="data.control_images: input images per sample, "
        "for a family whose pipeline takes several (flux2klein, flux2, qwenimageedit: "
        "Qwen-Image-Edit-Plus's Picture 1, Picture 2, ...). Input k ≥ 2 is the sidecar "
        "KEY.control_k.<ext>, the k-th folder of data.control_uri, or the k-th column of "
        "data.control_column (default {control_column}_k). Every sample has all of them "
        "(a missing one: missing_control), each resized to its target's size.",
    )
    control_column: str | list[str] = Field(
        "control_image", description="parquet, data.control_images: the column of encoded "
        "control images (bytes or a datasets {bytes, path} struct), as diffusers' Kontext "
        "script's --cond_image_column; with data.control_inputs > 1 one column per input "
        "(a list), or the first input's, the others being {column}_2, {column}_3, ...",
    )
    control_uri: str | list[str] | None = Field(
        None, description="captionfolder, imagefolder, data.control_images: a folder of the "
        "control images instead of sidecars, each under its image's path relative to "
        "data.uri, with any image extension (ai-toolkit's control_path): {data.uri}/a/cat.jpg "
        "→ {control_uri}/a/cat.png. Not inside data.uri. With data.control_inputs > 1, a list "
        "of that many folders, input k's in the k-th.",
    )
    caption_extension: str = Field(
        ".txt", description="captionfolder: the extension of the caption file beside each "
        "image (cat.png + cat.txt); kohya's caption_extension.",
    )
    resolution: int | list[int] = Field(
        512, description="Square training size in pixels. With data.bucketing: the bucket "
        "set's resolution (buckets of about resolution² pixels), or a list of several "
        "([512, 768, 1024]; each image trains at the largest whose area it covers).",
    )
    bucketing: bool = Field(
        False, description="Aspect-ratio buckets: each image is resized to cover, and "
        "cropped to, the bucket of its resolution nearest its aspect ratio; every batch "
        "holds one bucket, the same on every worker at each step. Each bucket's rows that "
        "do not fill a batch are left out of the epoch (as kohya). Needs data.sharding="
        "files with several workers.",
    )
    bucket_step: int = Field(
        64, gt=0, description="data.bucketing: bucket sides are multiples of this (pixels); "
        "a multiple of the model's latent grid (8 for SD/SDXL, 16 for Flux/SD3/Qwen-Image/Z-Image/"
        "Flux.2/Wan 2.1, 32 for Wan 2.2 TI2V-5B).",
    )
    center_crop: bool = Field(False, description="Center crop (True) or random crop (False).")
    random_flip: bool = Field(False, description="Random horizontal flip with p=0.5.")
    shuffle_seed: int | None = Field(
        None, ge=0, lt=SEED_LIMIT,
        description="Seed of the per-epoch file shuffle; defaults to train.seed."
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
            "runs; needs at least N shard files, parquet or webdataset, or N images of a "
            "captionfolder)."
        ),
    )
    caption_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Probability of training on the empty prompt instead."
    )
    caption_prefix: str = Field(
        "", description="Trigger word(s) put before every caption as its first "
        "comma-separated tag ('sks' + 'a dog' → 'sks, a dog'); a row without a caption "
        "stays without one.",
    )
    shuffle_tags: bool = Field(
        False, description="Shuffle each caption's comma-separated tags on every read "
        "(kohya's shuffle_caption), all but the first data.keep_tokens.",
    )
    keep_tokens: int = Field(
        0, ge=0, description="Tags kept in place at the front when shuffling; a "
        "caption_prefix's tags (the trigger words) always are (at least as many as it has).",
    )
    max_image_pixels: int = Field(
        178_956_970, gt=0,
        description="Images with more pixels (width × height, read from the header) are "
        "dropped as decompression bombs (PIL's own limit is set to this; never disabled).",
    )
    min_size: int = Field(0, ge=0, description="Shorter side below this is 'too small' (0: off).")
    small_images: Literal["skip", "upscale"] = Field(
        "skip", description="Images below data.min_size: drop them, or upscale them as usual."
    )
    background_color: tuple[int, int, int] = Field(
        (255, 255, 255), description="RGB that transparent pixels are composited over."
    )
    max_bad_fraction: float = Field(
        0.05, ge=0.0, le=1.0,
        description="The run stops when more than this fraction of the rows read is unusable "
        "(corrupt, not an image, too large/small, no caption); below it, those rows are "
        "dropped and counted per reason in raylora.json (data.bad_records).",
    )
    validation_split: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "Fraction of rows held out of training for the held-out loss. A row is held out "
            "when a hash of its image bytes and caption falls below this fraction: the same "
            "rows in every run, trial and epoch, whatever the file order or worker count."
        ),
    )
    validation_uri: str | list[str] | None = Field(
        None, description="Separate held-out shards (same format rules as data.uri)."
    )
    validation_max_samples: int = Field(
        64,
        gt=0,
        le=4096,
        description="Held-out rows evaluated: the first N in file order (each worker keeps "
        "their latents in memory).",
    )
    class_sources: str | list[ClassSourceSection] | None = Field(
        None, description="Prior preservation (DreamBooth): class images, a URI (file, "
        "directory, glob) or a list of {uri, prompt, format, ...}. Each training batch gets "
        "as many class samples as instance samples; their loss is weighted by "
        "train.prior_loss_weight. Images without a caption take their prompt (default "
        "data.class_prompt). Set this or data.class_prompt (or both) to turn it on.",
    )
    class_prompt: str | None = Field(
        None, description="Prior preservation: the class prompt ('a photo of a dog'), for "
        "generating the class images data.class_sources lacks and for its images without "
        "a caption.",
    )
    num_class_images: int = Field(
        100, gt=0, description="Prior preservation: class images to train with (as "
        "diffusers); fewer in data.class_sources are generated with data.class_prompt.",
    )
    class_generation: ClassGenerationSection = Field(
        default_factory=lambda: ClassGenerationSection(),
        description="How missing class images are generated (data.class_prompt).",
    )

    @property
    def prior_preservation(self) -> bool:
        return self.class_sources is not None or self.class_prompt is not None

    @field_validator("caption_extension")
    @classmethod
    def _extension(cls, v: str) -> str:
        return _caption_extension(v)

    @field_validator("resolution", mode="before")
    @classmethod
    def _resolution(cls, v: Any) -> Any:
        return _resolution_value(v)

    @field_validator("background_color")
    @classmethod
    def _rgb(cls, v: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(not 0 <= c <= 255 for c in v):
            raise ValueError(f"{list(v)}: each channel must be 0-255")
        return v

    def resolutions(self) -> list[int]:
        """``data.resolution`` as a sorted list."""
        r = self.resolution
        return sorted(set(r)) if isinstance(r, list) else [r]

    def max_resolution(self) -> int:
        """The largest resolution of any source: held-out rows and previews use it (square)."""
        return max(r for sec in self.source_sections() for r in sec.resolutions())

    def decode_kwargs(self) -> dict:
        """What ``Preprocess`` needs to validate rows (see ``raylora.data.decode``)."""
        return dict(max_image_pixels=self.max_image_pixels, min_size=self.min_size,
                    small_images=self.small_images, background_color=tuple(self.background_color))

    def source_sections(self) -> list[DataSection]:
        """The section each source is read with: this one (``data.uri``), or per entry of
        ``data.sources`` this one with the entry's uri and the keys it sets."""
        if self.sources is None:
            return [self]
        return [self.model_copy(update={
            **{k: getattr(s, k) for k in SOURCE_KEYS if getattr(s, k) is not None},
            "uri": s.uri, "sources": None}) for s in self.sources]

    def references(self) -> int:
        """Input images per sample: data.control_inputs with data.control_images, else 0."""
        return self.control_inputs if self.control_images else 0

    def control_columns(self) -> list[str]:
        """data.control_column per input (data.control_inputs of them): a list as given, or
        the first input's column and ``{column}_2``, ``{column}_3``, ... for the others."""
        c = self.control_column
        return list(c) if isinstance(c, list) else [control_key(c, i) for i in range(self.control_inputs)]

    def control_folders(self) -> list[str] | None:
        """data.control_uri per input (a folder each), None for sidecars."""
        u = self.control_uri
        return None if u is None else list(u) if isinstance(u, list) else [u]

    def source_key(self, index: int, key: str) -> str:
        """How an error names a source's key: ``data.uri`` or ``data.sources[i].uri``."""
        return f"data.{key}" if self.sources is None else f"data.sources[{index}].{key}"

    cache: Literal["none", "latents"] = Field(
        "none",
        description="latents: encode every image with the VAE and every caption with the text "
        "encoder(s) once, in a Ray Data stage, into parquet shards under data.cache_uri; "
        "training workers then load neither. Needs a deterministic view of each image "
        "(data.center_crop=true, data.random_flip=false, no data.shuffle_tags); "
        "data.caption_dropout swaps in the empty prompt's embedding, encoded once.",
    )
    cache_uri: str | None = Field(
        None,
        description="Root of the latent cache (any storage URI); default {output.uri}/cache. "
        "Entries are keyed by a fingerprint of model, resolution, crop policy and data, so "
        "reruns and Tune trials reuse them.",
    )


class LoraSection(_Section):
    variant: Literal["lora", "dora", "lokr", "loha"] = Field(
        "lora",
        description="lora: low-rank B·A (diffusers layout). dora: LoRA with a learned "
        "per-output magnitude (DoRA; diffusers layout, stock load_lora_weights loads it). lokr: "
        "Kronecker-product factors (LyCORIS LoKr); loha: Hadamard product of two low-rank "
        "pairs (LyCORIS LoHa): both written as a peft folder plus, for sd/sdxl, a LyCORIS "
        "file ComfyUI / Forge load.",
    )
    rank: int = Field(4, gt=0)
    alpha: float | None = Field(None, gt=0, description="LoRA alpha; defaults to rank (scale 1).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    factor: int = Field(
        -1, description="lokr: the Kronecker split of each dimension (LyCORIS factor): -1 the "
        "most balanced split, else the smaller factor where it divides the dimension; where "
        "it does not, a bound: the most balanced split whose smaller factor is at most it "
        "(peft's and LyCORIS' rule: 3 on a 64-wide layer splits 2 × 32)."
    )
    decompose_both: bool = Field(
        False, description="lokr: also factor the small Kronecker matrix into a rank-r pair "
        "(LyCORIS decompose_both)."
    )
    target_modules: list[str] | None = Field(
        None,
        description="Denoiser module names that get LoRA layers. Default: the family's (SD/"
        "SDXL/Qwen-Image/Z-Image/Wan: attention projections; Flux, SD3: attention projections "
        "of both streams (and Flux's feed-forwards); Flux.2: attention and the single blocks' "
        "fused input and output projections; as diffusers' LoRA scripts).",
    )
    train_text_encoder: bool = Field(
        False, description="Also train LoRA on the text encoders the stock pipeline loads "
        "LoRA into (sd: CLIP; sdxl, sd3: both CLIPs; flux: CLIP-L; qwenimage: none)."
    )
    text_encoder_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj"],
        description="Text-encoder module names that get LoRA layers (CLIP attention).",
    )
    text_encoder_lr: float | None = Field(
        None, gt=0, description="Learning rate of the text-encoder LoRA; default train.learning_rate."
    )
    init_from: str | None = Field(
        None,
        description="Start from this adapter instead of a no-op: a folder raylora wrote "
        "(output.uri/adapter), a diffusers LoRA folder or any .safetensors LoRA file the "
        "family's stock pipeline load_lora_weights reads (kohya/ComfyUI files included), or a "
        "peft folder (lokr/loha); local, a storage URI, or on the hub: hf://owner/name"
        "[@revision][/path] (a folder or a .safetensors file). Its rank and variant must be this "
        "run's; lora.alpha may differ (its B is rescaled so step 0 equals the stock pipeline "
        "with that adapter loaded). A rerun that resumes a checkpoint ignores it.",
    )

    @field_validator("target_modules", "text_encoder_target_modules")
    @classmethod
    def _non_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("needs at least one module name")
        return v

    @property
    def effective_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)


class FlowSection(_Section):
    """Rectified-flow training (the objective of Flux, SD3, Qwen-Image, Z-Image, Flux.2
    and Wan): how σ is drawn, shifted and weighted. Names and defaults as in diffusers' and
    SimpleTuner's scripts."""

    timestep_sampling: Literal["uniform", "logit_normal", "mode", "cosmap"] = Field(
        "logit_normal",
        description="Density of σ before the shift: logit_normal (SD3 paper's best, the "
        "common default), uniform, mode (mode_scale), cosmap.",
    )
    logit_mean: float = Field(
        0.0, description="logit_normal: mean of the normal, σ = sigmoid(N(mean, std)) (the SD3 "
        "paper's sign: > 0 draws nearer noise). diffusers' scripts index a descending "
        "timestep table with it, so their --logit_mean 1 is logit_mean -1 here.")
    logit_std: float = Field(1.0, gt=0, description="logit_normal: std of the normal.")
    mode_scale: float = Field(1.29, description="mode: the scale s of the mode density.")
    shift: float | Literal["auto"] = Field(
        "auto",
        description="auto: the model's scheduler config (Flux, Qwen-Image: resolution-"
        "dependent dynamic shift from base_shift/max_shift; SD3: its static shift 3.0). A "
        "number: that static shift for every image size (1.0 = none).",
    )
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap", "x0"] = Field(
        "none", description="Per-sample loss weight by σ (diffusers' weighting_scheme); x0: "
        "σ², the loss on the clean latents the prediction implies, as diffusers' SD3 "
        "scripts train by default (--precondition_outputs 1)."
    )
    guidance: float = Field(
        1.0, ge=0,
        description="The guidance-embedding input of guidance-distilled models during training "
        "(Flux.1-dev, Flux.2 [dev]; ignored by models without one). 1.0 as SimpleTuner/"
        "ai-toolkit; diffusers' Flux.1 and Flux.2 scripts use 3.5.",
    )

    @field_validator("shift")
    @classmethod
    def _positive_shift(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError("must be > 0 (1.0 = no shift) or auto")
        return v


class ProdigySection(_Section):
    """Prodigy (prodigyopt): Adam whose step size d is estimated on the fly; lr is a
    multiplier of d, so leave train.learning_rate at 1.0. Betas, eps and weight decay are
    train.adam_*. Names and defaults as prodigyopt's."""

    d_coef: float = Field(1.0, gt=0, description="Scales the estimated d (0.5-2 typical): "
                          "the preferred way to tune Prodigy.")
    d0: float = Field(1e-6, gt=0, description="Initial d estimate.")
    growth_rate: float | None = Field(None, gt=1.0, description="Largest factor d may "
                                      "grow by per step (None: unlimited; ~1.02 acts as a "
                                      "warmup).")
    beta3: float | None = Field(None, ge=0, lt=1, description="EMA coefficient of the d "
                                "estimate; None: sqrt(adam_beta2).")
    decouple: bool = Field(True, description="AdamW-style decoupled weight decay.")
    use_bias_correction: bool = Field(False, description="Adam's bias correction (often "
                                      "recommended for diffusion LoRA).")
    safeguard_warmup: bool = Field(False, description="Leave lr out of the d estimate's "
                                   "denominator: safer with an lr warmup.")
    slice_p: int = Field(1, ge=1, description="Estimate d from every p-th element (less "
                         "memory; ~11 is reasonable).")


class AdafactorSection(_Section):
    """transformers.optimization.Adafactor. Defaults here are the external-lr mode
    (train.learning_rate and the lr schedule apply); transformers' own defaults are
    relative_step=true, scale_parameter=true."""

    relative_step: bool = Field(
        False, description="Adafactor computes its own step size min(1e-2, 1/sqrt(step)) "
        "(x parameter RMS with scale_parameter): train.learning_rate is then not used "
        "(transformers takes lr=None) and the lr schedule must be constant, without warmup.",
    )
    scale_parameter: bool = Field(False, description="Scale the step by the parameter's RMS.")
    warmup_init: bool = Field(False, description="Warm the relative step up from 1e-6·step "
                              "(needs relative_step).")
    clip_threshold: float = Field(1.0, gt=0, description="Clip the update's RMS at this.")
    decay_rate: float = Field(-0.8, lt=0, description="Exponent of the second-moment decay.")
    beta1: float | None = Field(None, ge=0, lt=1, description="First moment (None: none, "
                                "the memory-light default).")
    weight_decay: float = Field(0.0, ge=0)
    eps: tuple[float, float] = Field((1e-30, 1e-3), description="Regularisation of the "
                                     "squared gradient and of the parameter scale.")


class TrainSection(_Section):
    learning_rate: float = Field(1e-4, gt=0)
    scale_lr: bool = Field(
        False, description="Multiply lr by accumulation steps × batch size × workers."
    )
    lr_scheduler: Literal[LR_SCHEDULERS] = "constant"  # type: ignore[valid-type]
    lr_warmup_steps: int = Field(
        0, ge=0, description="Warmup, in optimizer steps (not with constant: it has none).")
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
    seed: int = Field(42, ge=0, lt=SEED_LIMIT)
    log_every_n_steps: int | None = Field(
        None, gt=0, description="Progress: a plain line every N steps when the output is "
        "not a terminal (a job log, CI); default a tenth of the run.",
    )
    log_every_n_seconds: float = Field(
        30.0, gt=0, description="Progress: also a line when this long passed since the last.",
    )
    readback_every_n_steps: int | None = Field(
        None, gt=0, description="The loss stays on the device for N steps, then is read "
        "back in one transfer: a per-step read makes the CPU wait for the GPU every step. "
        "NaN/inf steps are still skipped at once; counting them (train.max_nonfinite_steps), "
        "metrics rows and progress lines follow every N steps. Default 10 on GPU, 1 on CPU.",
    )
    record_samples: bool = Field(
        False, description="metrics.jsonl rows list a content hash of every sample rank 0 "
        "trained on in that step (an elastic run: every worker's, in the global order): an "
        "audit of data order, e.g. across a resume.",
    )
    prediction_type: Literal["epsilon", "v_prediction", "flow_matching"] | None = Field(
        None, description="The objective. Default: the model's scheduler config (flow "
        "matching for FlowMatch* schedulers: Flux, SD3, Qwen-Image, Z-Image, Flux.2; "
        "and for a flow_prediction solver: Wan's UniPC; else its prediction_type).",
    )
    flow: FlowSection = Field(default_factory=lambda: FlowSection(),
                              description="Flow-matching settings (Flux, SD3, Qwen-Image, Z-Image, "
                              "Flux.2, Wan).")
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "adamw",
        description="adamw: torch AdamW. adamw8bit: bitsandbytes 8-bit AdamW (state ~2 "
        "bytes/param instead of 8; CPU or GPU). paged_adamw8bit: the same with its state in "
        "CUDA unified memory, paged to the CPU under pressure (GPU only). prodigy: "
        "learning-rate-free Adam (train.prodigy; set train.learning_rate: 1.0). adafactor: "
        "factored second moments, ~no state for matrices (train.adafactor).",
    )
    prodigy: ProdigySection = Field(default_factory=lambda: ProdigySection(),
                                    description="Prodigy's keys (train.optimizer=prodigy).")
    adafactor: AdafactorSection = Field(default_factory=lambda: AdafactorSection(),
                                        description="Adafactor's keys (train.optimizer=adafactor).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute the denoiser's block activations in backward (and the "
        "trained text encoders' layers): less memory, ~20-30% slower. Every family."
    )
    compile: Literal["auto", "none", "regional", "full"] = Field(
        "auto",
        description="regional: torch.compile each repeated block of the denoiser (the family's "
        "transformer blocks, as diffusers' compile_repeated_blocks): compiles in under a minute, "
        "reused by every block of a kind. full: the whole denoiser (slowest to compile). none: eager. "
        "auto: regional with scaling.use_gpu, none on CPU. Compiled in place, so checkpoint "
        "keys do not change; on CPU it needs a C++ compiler.",
    )
    compile_cache_uri: str | None = Field(
        None,
        description="Where the compiled code is kept between runs (any storage URI, e.g. "
        "s3://bucket/compile-cache): torch.compile's portable caches (inductor and AOTAutograd "
        "graphs, Triton kernels, autotuning results), one object per torch version, device, "
        "model, LoRA, batch shape and compile mode. A run on a fresh machine (a restarted "
        "worker, a new pod, a resubmitted job, later Tune trials) loads them instead of "
        "compiling cold; rank 0 writes them at the first loss read-back and at checkpoints. The "
        "objects are code the workers run: use storage only your jobs write. Default: off.",
    )
    sdpa_backend: Literal["auto", "default", "flash", "cudnn", "efficient", "math"] = Field(
        "default",
        description="The scaled-dot-product-attention kernel of the denoiser's attention "
        "layers. default: PyTorch's own choice per call. auto: on GPUs, the first batch's "
        "attention calls are timed on each kernel (forward + backward) and every layer runs "
        "its fastest (PyTorch's choice on CPU); not the default until a GPU run has measured "
        "it. flash / cudnn / efficient / math: that kernel in every layer (an error on the "
        "first batch names a layer it cannot run). Needs model.attention=sdpa; cuDNN only "
        "where the family allows it (not Flux: it crashed).",
    )
    channels_last: bool | None = Field(
        None, description="The denoiser's convolution weights in channels-last memory format "
        "(the layout cuDNN's NHWC convolution kernels read; a UNet's resnets). Default: the "
        "family's choice (off for every family until it is measured to help).",
    )
    groupnorm_fp32: bool = Field(
        False, description="Under train.mixed_precision bf16, run the denoiser's GroupNorms "
        "in fp32 as autocast does (true), instead of in bf16 (the default: no casts of each "
        "activation to fp32 and back around them; SD 1.5 @512 batch 64 on an H200: 1.07x "
        "step, 17% less peak memory). fp16 and no: autocast's behaviour either way. The DiT "
        "families have no GroupNorm in the denoiser.",
    )
    cuda_graphs: bool = Field(
        False, description="Run the compiled blocks as CUDA graphs (torch.compile's "
        "reduce-overhead mode): one launch per block instead of one per kernel, for steps "
        "where the GPU waits on Python. SDXL @1024 batch 8 on an H200: 1.21x regional alone "
        "(GPU busy 58% -> 97%); SD 1.5 @512 batch 64, already 98% busy: no change. Needs a "
        "GPU, train.compile regional or full, one micro-batch per optimizer step and fixed "
        "shapes. A whole run (EMA, previews, checkpoints, resume) matched the run without it "
        "on an H200; opt-in, as only host-bound steps gain.",
    )
    ema_decay: float | None = Field(
        None, gt=0, lt=1,
        description="EMA of the LoRA weights (e.g. 0.999, with warmup); the exported adapter "
        "is the EMA, the checkpoint keeps both.",
    )
    max_nonfinite_steps: int = Field(
        5, gt=0, description="Stop after this many NaN/inf optimizer steps in a row (each is skipped)."
    )
    snr_gamma: float | None = Field(
        None, gt=0, description="Min-SNR-γ loss weighting (5.0 is the paper's value); off by default."
    )
    noise_offset: float = Field(
        0.0, ge=0, description="Noise offset (e.g. 0.05-0.1): learn overall brightness shifts."
    )
    prior_loss_weight: float = Field(
        1.0, ge=0, description="Prior preservation (data.class_sources / data.class_prompt): "
        "loss = instance MSE + prior_loss_weight × class MSE (diffusers' DreamBooth).",
    )


    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _no_is_not_false(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `no` (train.mixed_precision=no on the command line) as false.
        return "no" if v is False else v

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_bool(cls, v: Any) -> Any:
        # Configs written before the modes existed said `compile: true/false`.
        return {True: "regional", False: "none"}.get(v, v) if isinstance(v, bool) else v


class FsdpSection(_Section):
    """``scaling.strategy: fsdp`` (PyTorch FSDP2): how the denoiser's shards behave."""

    reshard_after_forward: bool = Field(
        True, description="Free each block's gathered weights after its forward and gather them "
        "again for backward (less memory, one more all-gather per block); false keeps them "
        "until backward.",
    )
    offload: bool = Field(
        False, description="Keep the frozen base's shards in CPU memory between uses "
        "(FSDP2 CPUOffloadPolicy; GPUs only).",
    )


class ScalingSection(_Section):
    num_workers: int | tuple[int, int] = Field(
        1, description="Training workers (one per GPU); [min, max]: elastic, Ray Train starts "
        "with what the cluster holds (at least min), grows to max as nodes appear and goes on "
        "with fewer when one is lost. train.gradient_accumulation_steps is then the accumulation "
        "at max workers: the global batch (train.batch_size × accumulation × workers) stays the "
        "same at every size.",
    )
    resize_check_s: float = Field(
        60.0, gt=0, description="Elastic runs: how often Ray Train looks for room to grow "
        "(ScalingConfig.elastic_resize_monitor_interval_s); a resize restarts the workers from "
        "the latest checkpoint.",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every worker holds the whole model (data parallel). fsdp: the "
        "denoiser's weights, LoRA and optimizer state are sharded over the workers (FSDP2, "
        "one shard unit per transformer/resnet block), for models that do not fit one GPU.",
    )
    fsdp: FsdpSection = Field(default_factory=FsdpSection)
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one worker's GPU, for the preflight memory check "
        "(default: detected on the driver's GPU when it has one, else no check).",
    )
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How workers are placed on nodes (Ray placement group strategy)."
    )
    autoscaling: bool = Field(
        False, description="The cluster adds nodes on demand (e.g. KubeRay's autoscaler): skip "
        "the check that the workers fit on the nodes there are now.",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_range(cls, v: Any) -> Any:
        # YAML and --set give a list; one worker count or a [min, max] pair.
        if isinstance(v, list):
            if len(v) != 2:
                raise ValueError(f"give one number of workers or [min, max], not {v}")
            v = tuple(v)
        if isinstance(v, tuple):
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in v):
                raise ValueError(f"[min, max] must be whole numbers, not {list(v)}")
            lo, hi = v
            if lo < 1 or lo > hi:
                raise ValueError(f"[min, max] needs 1 <= min <= max, not {list(v)}")
        elif isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"must be at least 1, not {v}")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if self.elastic else self.num_workers

    def world_sizes(self) -> range:
        """Every number of workers the run may train with."""
        return range(self.min_workers, self.max_workers + 1)


class ValidationSection(_Section):
    """The held-out denoising loss: the metric Tune optimizes and runs are compared by."""

    every_n_steps: int | None = Field(
        None,
        gt=0,
        description="Evaluate every N optimizer steps (and at the end); default: at every "
        "checkpoint. Needs data.validation_split or data.validation_uri.",
    )
    num_timesteps: int = Field(
        4,
        gt=0,
        le=100,
        description="Fixed timesteps per held-out image, evenly spaced over the schedule.",
    )
    seed: int = Field(0, ge=0, lt=SEED_LIMIT,
                      description="Seed of the fixed evaluation noise and sample images.")
    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts rendered (same seed each time) at every evaluation into a PNG "
        "grid under {output.uri}/validation/step_NNNNNN.png.",
    )
    num_inference_steps: int = Field(20, gt=0, le=1000, description="Sampler steps per image.")
    resolution: int | None = Field(
        None, gt=0, description="The side in pixels of the square the held-out loss is "
        "measured at and the previews render at (SimpleTuner's --validation_resolution). "
        "Default: the largest data.resolution. Set it to search data.resolution: every "
        "trial is then measured at one size.",
    )
    guidance_scale: float | None = Field(
        None, ge=0.0, description="Classifier-free guidance scale; default the family's "
        "(SD/SDXL 7.5, SD3 7.0, Flux.1 3.5, Flux.1 Kontext 2.5, Qwen-Image 4.0).",
    )
    control_images: list[str | list[str]] = Field(
        default_factory=list,
        description="data.control_images: the input image of each of validation.prompts (a "
        "path or storage URI, one per prompt; with data.control_inputs > 1 a list of that "
        "many per prompt), resized to the preview size and given to the "
        "pipeline as its image. Empty: the previews are text to image.",
    )


class TrackingSection(_Section):
    """Experiment tracking besides the always-written metrics.jsonl."""

    backend: Literal["none", "wandb", "tensorboard"] = "none"
    project: str = Field("raylora", description="wandb project; `team/project` logs to "
                         "that team (entity).")
    run_name: str | None = Field(None, description="Default: the last part of output.uri.")

    @field_validator("project")
    @classmethod
    def _wandb_name(cls, v: str) -> str:
        # wandb refuses these characters in a project, only once a worker opens the run
        name = v.split("/", 1)[-1] if v.count("/") == 1 else v
        bad = sorted(set(name) & set("/\\#?%:"))
        if not name.strip() or bad or len(name) > 128:
            raise ValueError(f"{v!r}: a wandb project name (at most 128 characters, none of "
                             "/ \\ # ? % :), or team/project")
        return v
    wandb_mode: Literal["online", "offline"] = Field(
        "online",
        description="offline: write the run locally (no network); `wandb sync` uploads it later.",
    )


class CheckpointSection(_Section):
    every_n_steps: int = Field(500, gt=0, description="Checkpoint cadence in optimizer steps.")
    num_to_keep: int | None = Field(2, gt=0, description="Checkpoints kept in storage.")


class FailureSection(_Section):
    max_failures: int = Field(
        0, ge=-1,
        description="Times a run restarts its workers from the latest checkpoint after a "
        "worker process or node dies (Ray Train FailureConfig; -1: no limit).",
    )
    max_preemption_failures: int = Field(
        -1, ge=-1,
        description="Times a run restarts its workers after a node it ran on was drained "
        "for preemption and went (a spot reclaim; Ray Train FailureConfig; -1: no limit). "
        "The workers checkpoint when the notice comes and train on; these restarts do not "
        "count against max_failures.",
    )
    stop_timeout_s: float = Field(
        120.0, gt=0,
        description="A clean stop (`raylora stop`, SIGTERM to the driver or a worker: spot "
        "notice, pod deletion) finishes the step and writes a checkpoint; a process that "
        "has not stopped this many seconds later is killed. k8s/ sets "
        "terminationGracePeriodSeconds above it; `raylora submit` gives Ray's job stop as long.",
    )


class StorageSection(_Section):
    """Object-store settings. Credentials come only from the environment (AWS_* variables)."""

    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, Ceph, ...); default AWS_ENDPOINT_URL."
    )
    region: str | None = Field(None, description="Default: AWS_REGION, else us-east-1.")

    @field_validator("endpoint_url")
    @classmethod
    def _a_url(cls, v: str | None) -> str | None:
        from raylora.storage import endpoint_problem

        if v is not None and (problem := endpoint_problem(v)):
            raise ValueError(problem)
        return v

    def client(self):
        from raylora.storage import Storage

        return Storage(self.endpoint_url, self.region)


class ExportSection(_Section):
    formats: list[Literal["diffusers", "kohya"]] = Field(
        default_factory=lambda: ["diffusers"],
        description="diffusers: adapter/ (always). kohya: also "
        "adapter_kohya.safetensors (lora_unet_* keys + alpha) for ComfyUI / A1111.",
    )

    @field_validator("formats")
    @classmethod
    def _diffusers_always(cls, v: list[str]) -> list[str]:
        if "diffusers" not in v:
            raise ValueError("the diffusers adapter is always written; list diffusers too")
        return v


class OutputSection(_Section):
    uri: str = Field(description="Where checkpoints, metrics and the final adapter go.")


SPACE_KINDS = ("loguniform", "uniform", "randint", "choice", "grid")


class SearchDim(_Section):
    """One search dimension; exactly one of the fields is set.

    ``{loguniform: [1e-5, 1e-3]}``, ``{uniform: [0, 1]}``, ``{randint: [lo, hi)}``,
    ``{choice: [4, 8, 16]}`` (sampled) or ``{grid: [4, 8, 16]}`` (every value, × num_samples).
    """

    loguniform: tuple[float, float] | None = None
    uniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None
    choice: list[Any] | None = None
    grid: list[Any] | None = None

    @property
    def kind(self) -> str:
        return next(k for k in SPACE_KINDS if getattr(self, k) is not None)

    @property
    def values(self) -> list[Any]:
        """Values that bound the dimension: every option, or both ends of a range. A
        ``randint`` range's upper end is excluded (Ray Tune's ``randint(lo, hi)`` draws
        ``lo..hi-1``): its bounds are ``lo`` and ``hi - 1``, so the checks, ASHA's max_t
        and the memory preflight judge values trials take, not one none does."""
        if self.kind == "randint":
            lo, hi = self.randint
            return [lo, hi - 1] if hi - 1 > lo else [lo]
        return list(getattr(self, self.kind))

    @property
    def options(self) -> list[Any] | None:
        """Every value trials can take: each of a choice or grid, a randint's integers; None
        for a float range."""
        if self.kind == "randint":
            return list(range(*self.randint))
        return None if self.kind in ("uniform", "loguniform") else list(getattr(self, self.kind))

    @model_validator(mode="after")
    def _one_kind(self):
        set_kinds = [k for k in SPACE_KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"give exactly one of {', '.join(SPACE_KINDS)}")
        kind = set_kinds[0]
        if kind in ("loguniform", "uniform", "randint"):
            lo, hi = getattr(self, kind)
            if not lo < hi:
                raise ValueError(f"{kind}: lower bound {lo} must be below upper bound {hi}")
            if kind == "loguniform" and lo <= 0:
                raise ValueError("loguniform: bounds must be > 0")
        elif not getattr(self, kind):
            raise ValueError(f"{kind}: needs at least one value")
        return self


# tune.num_samples when unset and something is drawn.
DEFAULT_SAMPLES = 8


class TuneSection(_Section):
    search_space: dict[str, SearchDim] = Field(
        description="Dotted config key → dimension, e.g. train.learning_rate: "
        "{loguniform: [1e-5, 1e-3]}, lora.rank: {choice: [4, 8, 16]}."
    )
    num_samples: int | None = Field(
        None, gt=0, description="Trials (× the grid size for grid dims). Default 8, or 1 "
        "when every dimension is a grid (nothing sampled: each repeat is the same trial); "
        "when every drawn dimension is a choice or randint (train.seed not searched), at "
        "most their distinct combinations, and random search then runs each once.",
    )
    search_alg: Literal["random", "grid", "optuna", "hyperopt"] = Field(
        "random",
        description="random/grid: built in. optuna/hyperopt: need the package installed.",
    )
    metric: Literal["eval_loss", "train_loss"] = Field(
        "eval_loss", description="Minimized. eval_loss needs a held-out split; train_loss is "
        "the mean training loss over the steps since the trial's previous report."
    )
    scheduler: Literal["asha", "fifo"] = Field("asha", description="asha: early stopping.")
    grace_period: int = Field(
        1, gt=0, description="ASHA: steps every trial runs before it can be stopped."
    )
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: keep 1/factor per rung.")
    max_t: int | None = Field(None, gt=0, description="ASHA: step budget; default max_steps.")
    max_concurrent_trials: int | None = Field(
        None, gt=0, description="Default: cluster resources ÷ resources per trial."
    )
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT,
                             description="Search seed; default train.seed.")

    def listed(self, dim: SearchDim) -> bool:
        """Ray Tune runs every value of ``dim`` as written: a grid, or a choice of grid search."""
        return dim.kind == "grid" or (self.search_alg == "grid" and dim.kind == "choice")

    @property
    def draws(self) -> int | None:
        """Distinct combinations the drawn dimensions (choice, randint) can give, None when
        one is a float range (no two draws alike)."""
        n = 1
        for dim in self.search_space.values():
            if not self.listed(dim):
                if dim.options is None:
                    return None
                n *= len(dim.options)
        return n

    @property
    def repeats_identical(self) -> bool:
        """Every trial is set by its searched values alone: draws of the same combination,
        or repeats of a grid point, train the same trial (train.seed is not searched)."""
        return "train.seed" not in self.search_space

    def expanded(self, dim: SearchDim) -> bool:
        """Tune runs every value of ``dim`` (a grid), rather than drawing from it: a grid, a
        choice of grid search, and under random search a choice or randint whose
        combinations are all the trials asked for (``every_combination``)."""
        return self.listed(dim) or (dim.kind in ("choice", "randint") and self.every_combination)

    @property
    def every_combination(self) -> bool:
        """Random search whose drawn dimensions are all choices or randints, with
        ``num_samples`` unset (and at most DEFAULT_SAMPLES combinations) or equal to their
        number: each combination runs once, as a grid. Drawn, Tune repeated some and left
        others out ({choice: [8, 16]}: 8 draws, each value 4 times with one train.seed)."""
        n = self.draws
        if self.search_alg != "random" or n is None or not self.repeats_identical:
            return False
        if all(self.listed(d) for d in self.search_space.values()):
            return False  # nothing drawn
        return n <= DEFAULT_SAMPLES if self.num_samples is None else self.num_samples == n

    @property
    def sampled(self) -> bool:
        """Some dimension draws its values: a range, or a choice outside grid search."""
        return any(not self.expanded(d) for d in self.search_space.values())

    @property
    def samples(self) -> int:
        """``num_samples`` in effect: Ray Tune runs the whole grid this many times."""
        if not self.sampled:  # nothing drawn: a repeat of the grid is the same trials
            return 1 if self.num_samples is None or self.every_combination else self.num_samples
        if self.num_samples is not None:
            return self.num_samples
        n = self.draws  # optuna, hyperopt: no more draws than distinct trials
        if n is not None and self.repeats_identical:
            return min(DEFAULT_SAMPLES, n)
        return DEFAULT_SAMPLES

    @field_validator("search_space")
    @classmethod
    def _non_empty_space(cls, v: dict) -> dict:
        if not v:
            raise ValueError("needs at least one dimension")
        return v


class RayLoraConfig(_Section):
    model: ModelSection
    data: DataSection
    lora: LoraSection = Field(default_factory=LoraSection)
    train: TrainSection = Field(default_factory=TrainSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    failure: FailureSection = Field(default_factory=FailureSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    export: ExportSection = Field(default_factory=ExportSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    output: OutputSection
    tune: TuneSection | None = Field(None, description="Search space etc. for `raylora tune`.")

    @property
    def has_heldout(self) -> bool:
        return self.data.validation_split > 0 or self.data.validation_uri is not None

    def eval_resolution(self) -> int:
        """The square side held-out rows are scored at and previews render at."""
        return self.validation.resolution or self.data.max_resolution()

    @property
    def compile_mode(self) -> str:
        """``train.compile`` in effect: ``auto`` is regional on GPUs, eager on CPUs (an
        inductor compile on CPU costs more than a short CPU run gains)."""
        c = self.train.compile
        if c == "auto":  # FSDP's hooks inside compiled blocks: not verified yet, so eager
            # Buckets: a graph per bucket shape (static shapes) would pass torch's recompile limit.
            # DoRA, LoHa, LoKr: peft's layers break the graph at every adapter (a torchao
            # check, a random module-dropout branch): a dozen graphs a block, not one.
            return "regional" if self.scaling.use_gpu and self.scaling.strategy == "ddp" \
                and not self.data.bucketing and self.lora.variant == "lora" else "none"
        return c

    def global_batch(self) -> int:
        """Images per optimizer step: train.batch_size × accumulation × workers, taken at
        the most workers (the same at every size of an elastic run)."""
        t = self.train
        return t.batch_size * t.gradient_accumulation_steps * self.scaling.max_workers

    def at_world(self, world: int) -> RayLoraConfig:
        """This config as one worker group of ``world`` workers sees it: an elastic run's
        accumulation for that size (the global batch unchanged), ``num_workers`` fixed."""
        s = self.scaling
        if not s.elastic:
            return self
        accum = self.train.gradient_accumulation_steps * s.max_workers // world
        # (world, world): still elastic (a resume rescales the data position), global
        # batch and at_world unchanged when applied again.
        return self.model_copy(update={
            "train": self.train.model_copy(update={"gradient_accumulation_steps": accum}),
            "scaling": s.model_copy(update={"num_workers": (world, world)}),
        })

    def at_commit(self, commit: str | None) -> RayLoraConfig:
        """This config as the processes that load the model see it: a hub model's
        ``model.revision`` pinned to the commit the driver read (``Plan.model_commit``), so
        every worker, node and encoding task loads the same weights and tokenizers however
        the branch moves meanwhile; a folder in object storage's to the version of its files
        the driver listed (``raylora.model.load.materialize`` downloads that or stops).
        What the run records keeps the revision as written."""
        if commit is None or self.model.revision == commit:
            return self
        return self.model_copy(update={"model": self.model.model_copy(update={"revision": commit})})

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, same tree as the YAML."""
        return self.model_dump(mode="json")


URI_KEYS = re.compile(r"(^|_)uri$|^pretrained$|^init_from$")


def _blank_uris(tree: Any, where: str = "") -> list[str]:
    """Every path or URI given as an empty string: ``output.uri=$OUT`` with OUT unset read
    as the working directory, where the run then wrote (and resumed from) whatever it
    found."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        key = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k
        named = URI_KEYS.search(str(k)) or (isinstance(k, int) and URI_KEYS.search(where.split(".")[-1]))
        if named and isinstance(v, str) and not v.strip():
            out.append(f"{key}: empty; give a path or URI (an unset environment variable?)")
        elif named and isinstance(v, str) and v.startswith("file:"):
            from raylora.storage import local_path

            try:
                local_path(v)
            except ValueError as exc:
                out.append(f"{key}: {exc}")
        elif isinstance(v, (dict, list)) and not (isinstance(k, str) and k == "search_space"):
            out += _blank_uris(v, key)
    return out


def warmup_problems(t: TrainSection, steps: int, named: str) -> list[str]:
    """``train.lr_warmup_steps`` against the run's optimizer ``steps`` (``named``: where
    they come from): a longer warmup never reaches train.learning_rate, and polynomial's
    decay divides by their difference (diffusers' schedule failed at the last step, before
    the final checkpoint). The driver checks the steps a run of num_epochs plans too."""
    w = t.lr_warmup_steps
    if w > steps:
        return [f"train.lr_warmup_steps: {w} is more than the run's {steps} optimizer steps "
                f"({named}): the rate would never reach train.learning_rate"]
    if w and w == steps and t.lr_scheduler == "polynomial":
        return [f"train.lr_warmup_steps: {w}, all of the run's optimizer steps ({named}): "
                "polynomial decays over the steps after warmup and there would be none"]
    return []


def _cross_checks(cfg: RayLoraConfig) -> list[str]:
    """Combinations that are each valid alone but cannot run together."""
    problems = _blank_uris(cfg.to_dict())
    if cfg.train.mixed_precision == "fp16" and not cfg.scaling.use_gpu:
        problems.append(
            "train.mixed_precision: fp16 needs a GPU (scaling.use_gpu is false); use bf16 or no"
        )
    if cfg.train.sdpa_backend in ("cudnn", "efficient") and not cfg.scaling.use_gpu:
        problems.append(
            f"train.sdpa_backend: {cfg.train.sdpa_backend} is a CUDA kernel and "
            "scaling.use_gpu is false (on CPU: default, flash or math)"
        )
    problems += _cuda_graph_checks(cfg)
    problems += _optimizer_checks(cfg)
    problems += _quantize_checks(cfg)
    problems += _fsdp_checks(cfg)
    problems += _variant_checks(cfg)
    problems += _frozen_text_encoder_checks(cfg.lora)
    if cfg.train.max_steps:
        problems += warmup_problems(cfg.train, cfg.train.max_steps, "train.max_steps")
    problems += _schedule_checks(cfg.train)
    problems += _flow_checks(cfg.train)
    d = cfg.data
    problems += _data_checks(d)
    problems += _bucket_checks(d, cfg.scaling.max_workers, cfg.train.compile)
    if cfg.train.compile_cache_uri and cfg.compile_mode == "none":
        # auto resolves to none too (it wrote nothing to the cache, and said nothing)
        why = ("is none" if cfg.train.compile == "none" else
               f"auto compiles nothing for this run ({_auto_eager_reason(cfg)})")
        problems.append(f"train.compile_cache_uri: set, but train.compile {why}: nothing is "
                        "compiled to keep; drop one of them"
                        + ("" if cfg.train.compile == "none" else
                           ", or set train.compile: regional"))
    problems += _prior_checks(d)
    problems += _control_checks(cfg)
    problems += _unread_checks(cfg)
    problems += _elastic_checks(cfg)
    if d.validation_split and d.validation_uri is not None:
        problems.append(
            "data.validation_split: give either data.validation_split or data.validation_uri"
        )
    if d.validation_split and d.sharding == "files":
        problems.append(
            "data.validation_split: cannot be combined with data.sharding=files (every worker "
            "must know its exact row count up front); hold data out with data.validation_uri"
        )
    if cfg.validation.every_n_steps and not (cfg.has_heldout or cfg.validation.prompts):
        problems.append(
            "validation.every_n_steps: needs validation.prompts or held-out data "
            "(data.validation_split or data.validation_uri)"
        )
    if d.cache == "latents":
        # A cached latent is one fixed view of an image; a random crop/flip/dropout would be
        # silently frozen into it, so those are refused instead.
        if d.random_flip:
            problems.append("data.random_flip: cannot be used with data.cache=latents "
                            "(the cache holds one view of each image); set it false")
        if not d.center_crop:
            problems.append("data.center_crop: data.cache=latents needs center_crop=true "
                            "(a random crop would be frozen into the cache)")
        random = []  # the sources' own keys, or data's once for all that take it
        # Caption dropout swaps the empty prompt's embedding into a cached batch's dropped
        # rows at one rate: cached rows do not carry their source.
        rates: dict[str, float] = {}
        for i, sec in enumerate(d.source_sections()):
            rates.setdefault(_caption_key(d, i, "caption_dropout"), sec.caption_dropout)
            if sec.shuffle_tags:
                random.append(f"{_caption_key(d, i, 'shuffle_tags')}: cannot be used with "
                              "data.cache=latents (captions are encoded once, in one tag "
                              "order); set it false")
        if len(set(rates.values())) > 1:
            first = next(k for k, r in rates.items() if r)
            random.append(f"{first}: data.cache=latents drops captions at one rate for every "
                          "source (here " + ", ".join(f"{k}={r}" for k, r in rates.items())
                          + "); give every source the same caption_dropout")
        problems += list(dict.fromkeys(random))
        if cfg.lora.train_text_encoder:
            problems.append("lora.train_text_encoder: cannot be used with data.cache=latents "
                            "(the cache holds the frozen text encoder's embeddings)")
    if cfg.tune is not None:
        problems.extend(_tune_checks(cfg))
    return problems


def _prior_checks(d: DataSection) -> list[str]:
    """Prior preservation's keys and what it cannot be combined with (yet)."""
    if not d.prior_preservation:
        if d.class_generation != ClassGenerationSection():
            return ["data.class_generation: set, but prior preservation is off (set "
                    "data.class_prompt and/or data.class_sources)"]
        return []
    problems = []
    if d.bucketing:
        # Instance and class halves of a batch must have one image size.
        problems.append("data.bucketing: not supported with prior preservation (a batch "
                        "pairs instance and class images of one size); set it false")
    if d.class_prompt is not None and not d.class_prompt.strip():
        problems.append("data.class_prompt: empty; give the class ('a photo of a dog')")
    if d.class_prompt is None and d.class_generation != ClassGenerationSection():
        problems.append("data.class_generation: set, but there is no data.class_prompt to "
                        "generate class images with")
    return problems


def _elastic_checks(cfg: RayLoraConfig) -> list[str]:
    """scaling.num_workers: [min, max]: the global batch must split evenly at every size,
    and the data position must mean the same thing at every size."""
    s, t = cfg.scaling, cfg.train
    if not s.elastic:
        return []
    key = f"scaling.num_workers: [{s.min_workers}, {s.max_workers}]"
    problems = []
    micro = t.gradient_accumulation_steps * s.max_workers  # micro-batches per optimizer step
    uneven = [n for n in s.world_sizes() if micro % n]
    if uneven:
        problems.append(
            f"train.gradient_accumulation_steps: {t.gradient_accumulation_steps} (the accumulation "
            f"at {s.max_workers} workers) × {s.max_workers} = {micro} micro-batches per step does "
            f"not split evenly over {', '.join(map(str, uneven))} worker(s), so the global batch "
            f"would change with the size of {key}; use an accumulation that does, or narrow the range")
    # A world-size-free data position needs one global order every worker can compute:
    # the seeded file order of sharding=files (a dynamically split stream has none).
    if cfg.data.sharding != "files":
        problems.append(f"data.sharding: {key} (elastic) needs data.sharding=files, whose "
                        "seeded order lets every size resume at the same sample")
    if cfg.data.bucketing:
        problems.append(f"data.bucketing: cannot be combined with {key} (elastic): the bucket "
                        "schedule is planned per worker count; use a fixed scaling.num_workers")
    if s.strategy != "ddp":
        problems.append(f"scaling.strategy: {s.strategy} cannot be combined with {key} (elastic): "
                        "elastic resizes are not supported with FSDP's sharded state (a stopped "
                        "FSDP run does resume on another fixed number of workers); use ddp, or a "
                        "fixed scaling.num_workers")
    if cfg.tune is not None:
        problems.append(f"tune: cannot be combined with {key} (elastic); give Tune trials a "
                        "fixed scaling.num_workers")
    return problems


def control_key(base: str, i: int) -> str:
    """The name of input ``i`` (0-based) of a sample's control images under ``base``: the
    first's is ``base`` (``control``, ``control_values``, ``control_params``, ``.control``),
    input k ≥ 2's ``base_k``; one input keeps the names it always had."""
    return base if i == 0 else f"{base}_{i + 1}"


def control_values(values, base: str) -> list:
    """``values[base]``, ``values[base_2]``, ... (``control_key``'s names) in input order,
    up to the first one absent: a batch's or conditioning's inputs, [] when it has none."""
    out = []
    while (v := values.get(control_key(base, len(out)))) is not None:
        out.append(v)
    return out


def _caption_key(d: DataSection, i: int, key: str) -> str:
    """The key that set a source's caption setting: its own, else data's."""
    own = d.sources is not None and getattr(d.sources[i], key) is not None
    return f"data.sources[{i}].{key}" if own else f"data.{key}"


def _resolution_problems(key: str, value: int | list[int], step: int | None) -> list[str]:
    """A resolution (or a list of them): positive, and with bucketing (``step``) a multiple
    of data.bucket_step."""
    values = value if isinstance(value, list) else [value]
    if not values:
        return [f"{key}: an empty list; give one resolution or several"]
    out = [f"{key}: {r} must be positive" for r in values if r <= 0]
    if step and not out:
        out += [f"{key}: {r} is not a multiple of data.bucket_step={step} (a bucket set's "
                "square bucket is resolution × resolution)" for r in values if r % step]
    return out


def _bucket_checks(d: DataSection, workers: int, compile_mode: str) -> list[str]:
    """data.bucketing and the keys it changes (``compile_mode``: train.compile)."""
    if not d.bucketing:
        problems = _resolution_problems("data.resolution", d.resolution, None)
        if isinstance(d.resolution, list):
            problems.append("data.resolution: a list of resolutions needs data.bucketing: true "
                            "(without buckets every image trains at one square size)")
        if d.bucket_step != 64:
            problems.append("data.bucket_step: set, but data.bucketing is false")
        return problems
    problems = _resolution_problems("data.resolution", d.resolution, d.bucket_step)
    if workers > 1 and d.sharding != "files":
        problems.append(
            "data.bucketing: with scaling.num_workers > 1 needs data.sharding=files (each "
            "worker must know its rows per bucket to follow the bucket schedule every worker "
            "shares; a dynamically split stream cannot say)")
    if compile_mode in ("regional", "full"):
        problems.append(f"train.compile: {compile_mode} compiles for one input shape; "
                        "data.bucketing trains several (one per bucket); set it to none or auto")
    return problems


def _unread_checks(cfg: RayLoraConfig) -> list[str]:
    """Keys set for a feature that is off, which nothing reads: a mask_column without
    masked_loss trained unmasked without a word."""
    d, out = cfg.data, []
    for key, on in (("mask_column", "masked_loss"), ("control_column", "control_images")):
        default = DataSection.model_fields[key].default
        if not getattr(d, on):
            for i, sec in enumerate(d.source_sections()):
                if getattr(sec, key) != default:
                    out.append(f"{_caption_key(d, i, key)}: set, but data.{on} is off (nothing "
                               "reads it); turn it on or drop it")
                    break
    if not d.prior_preservation and cfg.train.prior_loss_weight != 1.0:
        out.append("train.prior_loss_weight: set, but prior preservation is off (no "
                   "data.class_prompt or data.class_sources); set them or drop it")
    # validation.guidance_scale is not among them: the model card's example samples with it.
    for key, unused, why, fix in (
            ("data.cache_uri", d.cache != "latents", "data.cache is none (no latent cache)",
             "set data.cache: latents or drop it"),
            ("data.small_images", d.min_size == 0, "data.min_size is 0 (no image is too small)",
             "set data.min_size or drop it"),
            ("data.num_class_images", not d.prior_preservation, "prior preservation is off (no "
             "data.class_prompt or data.class_sources)", "set them or drop it"),
            ("data.validation_max_samples", not cfg.has_heldout, "there is no held-out data",
             "set data.validation_split or data.validation_uri, or drop it"),
            ("scaling.resize_check_s", not cfg.scaling.elastic, "scaling.num_workers is a fixed "
             "count, not an elastic [min, max]", "drop it"),
            ("validation.num_inference_steps", not cfg.validation.prompts, "there are no "
             "validation.prompts to render", "add prompts or drop it"),
            ("validation.num_timesteps", not cfg.has_heldout, "there is no held-out data (its "
             "loss is what it sets the timesteps of)",
             "set data.validation_split or data.validation_uri, or drop it"),
            ("validation.resolution", not cfg.has_heldout and not cfg.validation.prompts,
             "there is neither held-out data nor validation.prompts (the size is theirs)",
             "set one of them or drop it"),
            ("train.groupnorm_fp32", cfg.train.mixed_precision != "bf16", "train.mixed_precision "
             f"is {cfg.train.mixed_precision} (it chooses the GroupNorms' dtype under bf16 only)",
             "drop it"),
            ("data.shuffle_buffer_size", d.bucketing, "data.bucketing deals each bucket's batches "
             "in its own seeded order, with no shuffle buffer", "drop it")):
        section, name = getattr(cfg, key.split(".")[0]), key.split(".")[1]
        if unused and getattr(section, name) != type(section).model_fields[name].default:
            out.append(f"{key}: set, but {why}: nothing reads it; {fix}")
    tn = cfg.tune  # ASHA's keys: a fifo search runs every trial to its end
    if tn is not None and tn.scheduler != "asha":
        out += [f"tune.{key}: set, but tune.scheduler is {tn.scheduler}: only asha reads it "
                "(a fifo search stops no trial early); set tune.scheduler: asha or drop it"
                for key in ("max_t", "grace_period", "reduction_factor")
                if getattr(tn, key) != TuneSection.model_fields[key].default]
    t = cfg.tracking  # wandb's keys: a tensorboard run has no project, mode or name either
    if t.backend != "wandb":
        out += [f"tracking.{key}: set, but tracking.backend is {t.backend}: only wandb reads it; "
                "set tracking.backend: wandb or drop it"
                for key in ("project", "wandb_mode", "run_name")
                if getattr(t, key) != TrackingSection.model_fields[key].default]
    return out


def _control_checks(cfg: RayLoraConfig) -> list[str]:
    """data.control_images (image-edit pairs) against the keys it cannot go with; whether
    the family takes a reference image is checked with the model (raylora.launch)."""
    d, v, out = cfg.data, cfg.validation, []
    if v.control_images and not d.control_images:
        out.append("validation.control_images: previews take an input image only when the run "
                   "trains on them (data.control_images: true)")
    elif v.control_images and len(v.control_images) != len(v.prompts):
        out.append(f"validation.control_images: {len(v.control_images)} image(s) for "
                   f"{len(v.prompts)} validation.prompts; give one per prompt")
    n = d.control_inputs
    for i, entry in enumerate(v.control_images if d.control_images else []):
        got = len(entry) if isinstance(entry, list) else 1
        if got != n:
            out.append(f"validation.control_images[{i}]: {got} input image(s), but "
                       f"data.control_inputs is {n}; give {'a list of ' if n > 1 else ''}{n} per prompt")
            break
    if n > 1 and not d.control_images:
        out.append(f"data.control_inputs: {n}, but data.control_images is off; turn it on or drop it")
    for i, sec in enumerate(d.source_sections() if d.control_images else []):
        cols, folders = sec.control_column, sec.control_folders()
        if isinstance(cols, list) and len(cols) != n:
            out.append(f"{_caption_key(d, i, 'control_column')}: {len(cols)} column(s) for "
                       f"data.control_inputs {n}; give one per input")
        if folders is not None and len(folders) != n:
            out.append(f"{_caption_key(d, i, 'control_uri')}: {len(folders)} folder(s) for "
                       f"data.control_inputs {n}; give {'a list of ' if n > 1 else ''}{n}, input k's in the k-th")
    if not d.control_images:
        for i, sec in enumerate(d.source_sections()):
            if sec.control_uri:
                out.append(f"{_caption_key(d, i, 'control_uri')}: set, but data.control_images "
                           "is off (nothing reads it); turn it on or drop it")
                break
    if d.control_images and d.prior_preservation:
        out.append("data.prior_preservation: class images have no control images; prior "
                   "preservation cannot be combined with data.control_images")
    return out


def _data_checks(d: DataSection) -> list[str]:
    """data.uri or data.sources, and the sources' keys."""
    if (d.uri is None) == (d.sources is None):
        return ["data.uri: give data.uri or data.sources (a list of sources to mix), "
                + ("not both" if d.uri is not None else "neither is set")]
    problems = ["data.sources: needs at least one source"] if d.sources == [] else []
    weighted = any(s.weight is not None for s in d.sources or [])
    for i, s in enumerate(d.sources or []):
        key = f"data.sources[{i}]"
        if s.weight is not None and s.repeats is not None:
            problems.append(f"{key}: give weight or repeats, not both (weight: its share of "
                            "each epoch; repeats: times each of its rows counts)")
        elif weighted and s.weight is None:
            problems.append(f"{key}.weight: missing; give every source a weight (its share "
                            "of each epoch), or none (each counts its rows × repeats)")
        if s.resolution is not None and not d.bucketing:
            problems.append(f"{key}.resolution: a per-source resolution needs "
                            "multi-resolution aspect bucketing (data.bucketing: true); leave "
                            "it unset or turn bucketing "
                            f"on (every source trains at data.resolution={d.resolution})")
        elif s.resolution is not None:
            problems += _resolution_problems(f"{key}.resolution", s.resolution, d.bucket_step)
    sections = d.source_sections()
    if not any(sec.shuffle_tags for sec in sections):
        for i, sec in enumerate(sections):
            if sec.keep_tokens:
                problems.append(f"{_caption_key(d, i, 'keep_tokens')}: has no effect without "
                                "data.shuffle_tags (it keeps the first tags in place when "
                                "shuffling)")
                break
    return problems


def _auto_eager_reason(cfg: RayLoraConfig) -> str:
    """Why ``train.compile: auto`` is eager for ``cfg`` (``RayLoraConfig.compile_mode``)."""
    if not cfg.scaling.use_gpu:
        return "scaling.use_gpu is false"
    if cfg.scaling.strategy != "ddp":
        return f"scaling.strategy {cfg.scaling.strategy}"
    if cfg.data.bucketing:
        return "data.bucketing"
    return f"lora.variant {cfg.lora.variant}"


def _schedule_checks(t) -> list[str]:
    """Schedule settings the chosen train.lr_scheduler does not read: diffusers'
    ``get_scheduler`` drops them without a word (a ``constant`` schedule with 100 warmup
    steps trained at the full rate from step 0, while the model card said "100 steps").
    kohya's sd-scripts refuse the warmup the same way."""
    problems = []
    adafactor_own = t.optimizer == "adafactor" and t.adafactor.relative_step  # checked there
    if t.lr_warmup_steps and t.lr_scheduler == "constant" and not adafactor_own:
        problems.append(f"train.lr_warmup_steps: {t.lr_warmup_steps}, but train.lr_scheduler "
                        "constant has no warmup; use constant_with_warmup, or set 0")
    if t.lr_num_cycles != 1 and t.lr_scheduler != "cosine_with_restarts":
        problems.append(f"train.lr_num_cycles: {t.lr_num_cycles}, but only train.lr_scheduler "
                        f"cosine_with_restarts has cycles (not {t.lr_scheduler}); set 1")
    if t.lr_power != 1.0 and t.lr_scheduler != "polynomial":
        problems.append(f"train.lr_power: {t.lr_power:g}, but only train.lr_scheduler polynomial "
                        f"has a power (not {t.lr_scheduler}); set 1")
    return problems


def _flow_checks(t) -> list[str]:
    """Density settings the chosen train.flow.timestep_sampling does not read: a forgotten
    or mistyped sampling trained another density than the one tuned, without a word."""
    f, defaults = t.flow, FlowSection.model_fields
    readers = {"logit_mean": "logit_normal", "logit_std": "logit_normal", "mode_scale": "mode"}
    return [f"train.flow.{key}: {getattr(f, key):g}, but only train.flow.timestep_sampling "
            f"{kind} reads it (not {f.timestep_sampling}); drop it"
            for key, kind in readers.items()
            if getattr(f, key) != defaults[key].default and f.timestep_sampling != kind]


def _optimizer_checks(cfg: RayLoraConfig) -> list[str]:
    t = cfg.train
    problems = []
    if t.optimizer == "paged_adamw8bit" and not cfg.scaling.use_gpu:
        problems.append(
            "train.optimizer: paged_adamw8bit (bitsandbytes) needs CUDA (its state is paged "
            "CUDA memory; scaling.use_gpu is false); use adamw8bit, which also runs on CPU"
        )
    # A section left at its defaults is fine under any optimizer (a dumped config holds
    # them all); one that was changed for an optimizer not in use is a mistake.
    for name, section in (("prodigy", t.prodigy), ("adafactor", t.adafactor)):
        if t.optimizer != name and section != type(section)():
            problems.append(f"train.{name}: set, but train.optimizer is {t.optimizer} "
                            f"(these keys are for train.optimizer={name})")
    te_lr = cfg.lora.text_encoder_lr
    if t.optimizer == "prodigy" and te_lr is not None and te_lr != t.learning_rate:
        problems.append(
            "lora.text_encoder_lr: prodigy estimates one step size for all parameters and "
            "refuses groups with different learning rates; leave it unset (= train.learning_rate)"
        )
    a = t.adafactor
    if t.optimizer == "adafactor" and a.warmup_init and not a.relative_step:
        problems.append("train.adafactor.warmup_init: needs train.adafactor.relative_step=true")
    if t.optimizer == "adafactor" and a.relative_step:
        why = ("Adafactor with train.adafactor.relative_step=true sets its own step size "
               "(transformers takes lr=None)")
        if t.lr_scheduler != "constant":
            problems.append(f"train.lr_scheduler: {why}; use constant (warmup: "
                            "train.adafactor.warmup_init)")
        if t.lr_warmup_steps:
            problems.append(f"train.lr_warmup_steps: {why}; set 0 (warmup: "
                            "train.adafactor.warmup_init)")
        if t.scale_lr:
            problems.append(f"train.scale_lr: {why}; there is no lr to scale")
        if te_lr is not None:
            problems.append(f"lora.text_encoder_lr: {why}; there is no lr to set")
    return problems


def _quantize_checks(cfg: RayLoraConfig) -> list[str]:
    m = cfg.model
    problems = []
    for key, kind in (("model.quantize", m.quantize), ("model.quantize_text_encoders",
                                                       m.quantize_text_encoders)):
        if kind == "fp8" and not cfg.scaling.use_gpu:
            problems.append(f"{key}: fp8 is for GPUs (scaling.use_gpu is false); on CPU use "
                            "nf4 or int8")
    if (m.quantize_text_encoders != "none" and cfg.data.cache == "latents"
            and not cfg.validation.prompts and cfg.data.class_prompt is None):
        problems.append(
            "model.quantize_text_encoders: has no effect with data.cache=latents, no "
            "validation.prompts and no data.class_prompt (training workers load no text "
            "encoder, the cache stage encodes at full precision, and there are no previews or "
            "class images to generate with one); set none"
        )
    return problems


def _fsdp_checks(cfg: RayLoraConfig) -> list[str]:
    s = cfg.scaling
    if s.strategy != "fsdp":
        if s.fsdp != FsdpSection():
            return ["scaling.fsdp: set, but scaling.strategy is ddp (these keys are for "
                    "scaling.strategy=fsdp)"]
        return []
    problems = []
    if s.fsdp.offload and not s.use_gpu:
        problems.append("scaling.fsdp.offload: moves the frozen base between CPU and GPU; it "
                        "needs a GPU (scaling.use_gpu is false)")
    # Each is a parameter set outside the sharded denoiser (text-encoder LoRA, an EMA copy)
    # or a weight format FSDP2 cannot shard (bitsandbytes' packed 4/8-bit storage).
    if cfg.lora.train_text_encoder:
        problems.append("lora.train_text_encoder: not supported with scaling.strategy=fsdp "
                        "(only the denoiser is sharded); use ddp or train the denoiser alone")
    if cfg.train.ema_decay:
        problems.append("train.ema_decay: not supported with scaling.strategy=fsdp; unset it "
                        "or use ddp")
    if cfg.train.optimizer != "adamw":
        # The others keep per-tensor statistics (8-bit blocks, Prodigy's global d estimate,
        # Adafactor's row/column factors) that are not defined over dim-0 shards.
        problems.append(f"train.optimizer: {cfg.train.optimizer} is not supported with "
                        "scaling.strategy=fsdp (adamw only); the LoRA optimizer state is "
                        "sharded and small, so 8-bit/factored states buy little there")
    if cfg.train.compile in ("regional", "full"):
        problems.append(f"train.compile: {cfg.train.compile} with scaling.strategy=fsdp is "
                        "not supported yet; use none (auto is none under fsdp)")
    if cfg.model.quantize != "none":
        problems.append(f"model.quantize: {cfg.model.quantize} cannot be combined with "
                        "scaling.strategy=fsdp (FSDP2 cannot shard bitsandbytes/float8 packed "
                        "weights); choose one: quantize with ddp, or fsdp with model.quantize=none")
    return problems


def _cuda_graph_checks(cfg: RayLoraConfig) -> list[str]:
    """train.cuda_graphs: where a replayed graph can stand for the step."""
    t = cfg.train
    if not t.cuda_graphs:
        return []
    problems = []
    if not cfg.scaling.use_gpu:
        problems.append("train.cuda_graphs: CUDA graphs need a GPU (scaling.use_gpu is false)")
    if cfg.compile_mode == "none":
        problems.append(f"train.cuda_graphs: the graphs are made by torch.compile, and "
                        f"train.compile is {t.compile} (no compile here); use regional")
    # Each replay writes its outputs over the last one's, the weight gradients among them:
    # a gradient kept across micro-batches to accumulate would be overwritten.
    if t.gradient_accumulation_steps > 1 or cfg.scaling.elastic:
        problems.append("train.cuda_graphs: needs one micro-batch per optimizer step "
                        f"(train.gradient_accumulation_steps is {t.gradient_accumulation_steps}"
                        + (", and an elastic run accumulates when it has fewer workers"
                           if cfg.scaling.elastic else "") + ")")
    return problems


def _frozen_text_encoder_checks(lo: LoraSection) -> list[str]:
    """Text-encoder LoRA keys changed while the text encoders stay frozen: read by nothing,
    so a mistake (a dumped config holds their defaults, which pass)."""
    if lo.train_text_encoder:
        return []
    default = LoraSection.model_fields["text_encoder_target_modules"].default_factory()
    return [f"lora.{key}: set, but lora.train_text_encoder is false (the text encoders stay "
            "frozen); set lora.train_text_encoder=true or leave it unset"
            for key, changed in (("text_encoder_lr", lo.text_encoder_lr is not None),
                                 ("text_encoder_target_modules", lo.text_encoder_target_modules != default))
            if changed]


def _variant_checks(cfg: RayLoraConfig) -> list[str]:
    """lora.variant combinations raylora has not made work (or that cannot be)."""
    lo, problems = cfg.lora, []
    if lo.variant != "lokr":
        for key, default in (("factor", -1), ("decompose_both", False)):
            if getattr(lo, key) != default:
                problems.append(f"lora.{key}: a LoKr key; lora.variant is {lo.variant} "
                                "(set lora.variant=lokr or leave it unset)")
    elif lo.factor == 0 or lo.factor < -1:
        problems.append(f"lora.factor: {lo.factor}; use -1 (balanced) or a positive divisor")
    if lo.variant == "lora":
        return problems
    if cfg.scaling.strategy == "fsdp":
        # DoRA's magnitude starts at the norm of the base weight, which the FSDP loader has
        # not read yet when the adapter is attached (it reads shards after fully_shard).
        problems.append(f"lora.variant: {lo.variant} is not supported with "
                        "scaling.strategy=fsdp (lora only); use ddp")
    if cfg.model.quantize != "none":
        problems.append(f"lora.variant: {lo.variant} with model.quantize={cfg.model.quantize} "
                        "is not supported (peft's LyCORIS layers do not wrap bitsandbytes "
                        "linears, and DoRA on them is untested here); use lora or quantize none")
    if lo.variant in ("lokr", "loha"):
        if lo.train_text_encoder:
            problems.append(f"lora.train_text_encoder: not supported with lora.variant="
                            f"{lo.variant} (stock pipelines load text-encoder LoRA only)")
        if lo.dropout:
            problems.append(f"lora.dropout: a LoRA key; {lo.variant} has no input dropout "
                            "(leave it 0)")
    if "kohya" in cfg.export.formats:
        problems.append(f"export.formats: kohya is for lora.variant=lora; {lo.variant} writes "
                        + ("the diffusers layout only" if lo.variant == "dora" else
                           "its LyCORIS file (ComfyUI) into adapter/ already")
                        + "; remove kohya")
    return problems


# Keys a trial may not change: where results go, how storage is reached, and the resources
# a trial holds (Tune sizes its concurrency from them).
UNTUNABLE = ("tune", "output", "storage", "scaling", "failure")
# The model the plan read once for every trial: its family, tokenizers, hub commit
# (raylora.launch.Plan) would be the base config's in a trial of another.
MODEL_IDENTITY = ("model.pretrained", "model.revision", "model.variant", "model.family")


def differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, a's value, b's value) wherever two config trees differ (a list, such as
    data.sources, is one value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise KeyError(key)
    node[parts[-1]] = value
    return tree


def trial_tree(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The config tree of one trial: base config (no ``tune``) with sampled values set."""
    tree = copy.deepcopy(base)
    tree.pop("tune", None)
    for key, value in params.items():
        tree = set_dotted(tree, key, value)
    return _without_keys_it_leaves_unread(tree, params)


def _without_keys_it_leaves_unread(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's tree without the base's settings that this trial's values leave unread
    (``_unread_checks``): searching ``data.bucketing: [true, false]`` with a
    ``data.shuffle_buffer_size`` that the ``false`` trials read was refused, each ``true``
    trial judged as a config of its own that set a key nothing reads. A searched key
    itself is kept, and so refused where no value of its own reads it; the base config is
    judged whole before any trial (a key that no trial reads is refused there)."""
    try:
        cfg = RayLoraConfig.model_validate(tree)
    except ValidationError:
        return tree  # validate() names what is wrong
    for problem in _unread_checks(cfg):
        key = problem.split(":", 1)[0]
        section, _, name = key.partition(".")
        if key not in params and name.isidentifier() and isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    return tree


# Searched keys that change how a trial's training loss is weighted, or the timesteps and
# noise it is drawn at, and so its size whatever the trial learned (snr_gamma 0.01 logged
# 0.15 where 100 logged 1.11, and won). The held-out loss is measured without them:
# unweighted, unmasked, instance images alone, at fixed timesteps and noise.
TRAIN_LOSS_SCALES = {
    "train.snr_gamma": "weights each sample's training loss by min(SNR, γ)",
    "train.noise_offset": "adds its offset to the noise the training loss is measured against",
    "train.prior_loss_weight": "weighs the class images' loss into the training loss",
    "train.flow.loss_weighting": "weights each sample's training loss by its σ",
    "train.flow.timestep_sampling": "sets the density of the σ the training loss is drawn at",
    "train.flow.logit_mean": "sets the density of the σ the training loss is drawn at",
    "train.flow.logit_std": "sets the density of the σ the training loss is drawn at",
    "train.flow.mode_scale": "sets the density of the σ the training loss is drawn at",
    "data.masked_loss": "leaves each image's masked-out part out of the training loss",
}
# Searched keys that change what both losses measure: the held-out loss is evaluated at
# the trial's shifted σ, against its own target.
LOSS_MEANINGS = {
    "train.flow.shift": "moves the σ at which the training loss and the held-out loss "
                        "(eval_loss, at fixed σ shifted as in training) are measured",
    "train.prediction_type": "sets the target (ε, v or velocity) the training loss and the "
                             "held-out loss (eval_loss) are measured against",
}
# Searched keys that choose the images a trial trains on. Its training loss is measured on
# them (how easy they are to denoise, not what the adapter learned); so is its held-out
# loss when data.validation_split holds rows out of them. One data.validation_uri measures
# every trial on the same images.
DATA_CHOICES = {
    "data.uri": "trains each trial on the images of its own data.uri",
    "data.sources": "trains each trial on the images of its own data.sources",
}


# What sets how the held-out loss is measured, not what the adapter learned: trials that
# differ in it are scored by different measurements (an untrained adapter's eval_loss
# moved 0.6 % with them on the tiny model, as far apart as a short search's trials).
EVAL_LOSS_MEANINGS = {
    "validation.num_timesteps": "sets the timesteps at which the held-out loss (eval_loss) "
                                "is measured",
    "validation.seed": "draws the noise the held-out loss (eval_loss) is measured with",
    # which rows it is measured on (each trial plans its own data: Plan.data_variants)
    "data.validation_split": "chooses the held-out rows the held-out loss (eval_loss) is "
                             "measured on",
    "data.validation_max_samples": "chooses how many held-out rows the held-out loss "
                                   "(eval_loss) is measured on",
    "data.validation_uri": "chooses the held-out rows the held-out loss (eval_loss) is "
                           "measured on",
    "validation.resolution": "sets the size the held-out loss (eval_loss) is measured at",
}


def _searched_sizes(cfg: RayLoraConfig, key: str, dim: SearchDim) -> list[int]:
    """The largest training resolution (what the held-out loss is measured at without
    validation.resolution) that each value of a searched data key gives its trial's
    config; [] for other keys, or where a value's config does not validate (the checks of
    each value name why)."""
    if not key.startswith("data."):
        return []
    base = cfg.to_dict()
    try:
        return sorted({RayLoraConfig.model_validate(set_dotted(base, key, value)).data.max_resolution()
                       for value in dim.values})
    except (ValidationError, KeyError):
        return []


def _metric_problems(cfg: RayLoraConfig) -> list[str]:
    """Searched keys whose values change the size of the loss ``tune.metric`` ranks
    trials by, whatever they learned: the search would pick the trial that measured a
    smaller loss, not the better adapter."""
    tn, problems = cfg.tune, []
    for key in tn.search_space:
        where = f"tune.search_space.{key}"
        if key in LOSS_MEANINGS:
            problems.append(f"{where}: {LOSS_MEANINGS[key]}, so no tune.metric compares trials "
                            f"that differ in it; set {key} and search other keys (compare its "
                            "values by the previews of separate runs: validation.prompts)")
        elif key in DATA_CHOICES and tn.metric == "train_loss":
            problems.append(f"{where}: {DATA_CHOICES[key]}, so tune.metric train_loss ranks "
                            "trials by how easily their images denoise, not by what they "
                            "learned; use tune.metric: eval_loss with data.validation_uri (one "
                            "held-out set every trial is measured on)")
        elif key in DATA_CHOICES and cfg.data.validation_split > 0:
            problems.append(f"{where}: {DATA_CHOICES[key]}, and data.validation_split holds "
                            "each trial's rows out of them, so tune.metric eval_loss would "
                            "rank trials by different held-out images; set "
                            "data.validation_uri (one held-out set every trial is measured "
                            "on) in place of data.validation_split")
        elif tn.metric == "eval_loss" and key in EVAL_LOSS_MEANINGS:
            problems.append(f"{where}: {EVAL_LOSS_MEANINGS[key]}, so tune.metric eval_loss "
                            "would rank trials by how each was measured, not by what it "
                            f"learned; set {key} once for every trial")
        elif tn.metric == "train_loss" and key in TRAIN_LOSS_SCALES and (
                key != "train.prior_loss_weight" or cfg.data.prior_preservation):
            problems.append(f"{where}: {TRAIN_LOSS_SCALES[key]}, so tune.metric train_loss "
                            "ranks trials by that, not by what they learned; use tune.metric: "
                            "eval_loss (the held-out loss: unweighted, at fixed timesteps and "
                            "noise) with data.validation_split or data.validation_uri")
        # A denoising loss at another size is another measurement: the same noise level
        # hides less of a larger image (why Flux and SD3 shift σ by resolution).
        sizes = _searched_sizes(cfg, key, tn.search_space[key])
        if len(sizes) < 2 or (tn.metric == "eval_loss" and cfg.validation.resolution):
            continue
        trains = f"trains trials at different sizes ({', '.join(map(str, sizes))} px)"
        if tn.metric == "train_loss":
            problems.append(f"{where}: {trains}, so tune.metric train_loss ranks them by their "
                            "size as much as by what they learned; use tune.metric: eval_loss "
                            "with validation.resolution (one size every trial's held-out loss "
                            "is measured at)")
        else:
            problems.append(f"{where}: {trains}, and each trial's held-out loss (eval_loss) is "
                            "measured at its largest data.resolution, so the search would rank "
                            "them by their size as much as by what they learned; set "
                            "validation.resolution (one size every trial is measured at)")
    return problems


def _tune_checks(cfg: RayLoraConfig) -> list[str]:
    """Every search dimension must name a real config value, and every value it can take
    (each option, or both ends of a range) must give a valid config."""
    import importlib
    import importlib.util

    tn = cfg.tune
    problems = []
    if tn.metric == "eval_loss" and not cfg.has_heldout:
        problems.append(
            "tune.metric: eval_loss needs held-out data (data.validation_split or "
            "data.validation_uri); or use tune.metric=train_loss"
        )
    if tn.search_alg in ("optuna", "hyperopt"):
        # Imported, not only found: hyperopt 0.2.7 is found but imports pkg_resources, which
        # today's setuptools lacks, and the search then died in Ray saying "HyperOpt must be
        # installed!" of an installed package.
        fix = f"pip install -e '.[{tn.search_alg}]'"
        if importlib.util.find_spec(tn.search_alg) is None:
            problems.append(f"tune.search_alg: {tn.search_alg} is not installed ({fix})")
        else:
            try:
                importlib.import_module(tn.search_alg)
            except ImportError as exc:
                problems.append(f"tune.search_alg: {tn.search_alg} is installed but cannot be "
                                f"imported ({exc}); {fix}")
    if not tn.sampled and tn.samples > 1 and "train.seed" not in tn.search_space:
        # Ray Tune repeats the grid num_samples times; nothing sampled and one train.seed
        # make every repeat the same trial, paid for again.
        problems.append(f"tune.num_samples: {tn.samples} runs each grid point {tn.samples} "
                        "times with the same train.seed (identical trials); set 1, or search "
                        "train.seed too ({grid: [0, 1, 2]})")
    draws = tn.draws
    if tn.sampled and draws is not None and tn.repeats_identical and tn.samples > draws:
        # Every drawn dimension is finite: past its combinations, draws repeat trials.
        drawn = ", ".join(k for k, d in tn.search_space.items() if not tn.expanded(d))
        problems.append(f"tune.num_samples: {tn.samples} draws of {drawn}, which take "
                        f"{draws} distinct combination(s), repeat trials with the same "
                        f"train.seed (identical trials); set at most {draws} ({draws} under "
                        "random search: each combination once), or search train.seed too "
                        "({grid: [0, 1, 2]})")
    problems += _metric_problems(cfg)
    base = cfg.to_dict()
    for key, dim in tn.search_space.items():
        where = f"tune.search_space.{key}"
        if key.split(".")[0] in UNTUNABLE:
            problems.append(f"{where}: {key.split('.')[0]}.* cannot be searched")
            continue
        if cfg.data.cache == "latents" and (key.split(".")[0] in ("model", "data")
                                             or key == "train.mixed_precision"):
            # (the cache holds latents and embeddings in the base config's precision: an
            # fp32 trial trained and was scored on bf16-rounded ones)
            problems.append(f"{where}: with data.cache=latents every trial shares one cache, "
                            "encoded once; model.*, data.* and train.mixed_precision cannot "
                            "be searched")
            continue
        if key in ("data.cache", "data.cache_uri"):
            # (built, or found, once before the first trial, for the base config's data.cache)
            problems.append(f"{where}: the latent cache is built (or found) once for the "
                            "search, as the base config sets it; data.cache and "
                            "data.cache_uri cannot be searched")
            continue
        if key in MODEL_IDENTITY:
            problems.append(f"{where}: every trial trains the model the search planned once "
                            "(its family, tokenizers and hub commit); search one base model "
                            "per raylora tune")
            continue
        # a LoKr folder's Kronecker split is in its tensors' shapes as its rank is
        fixed = ("lora.rank", "lora.variant") + (
            ("lora.factor", "lora.decompose_both") if cfg.lora.variant == "lokr" else ())
        if cfg.lora.init_from and key in fixed:
            problems.append(f"{where}: every trial starts from lora.init_from "
                            f"({cfg.lora.init_from}), whose {key.split('.')[1]} is fixed; "
                            "search other keys")
            continue
        if key.startswith(("data.class_", "data.num_class_images")):
            problems.append(f"{where}: the class images are read (and generated) once for "
                            "every trial; data.class_* and data.num_class_images cannot be "
                            "searched (train.prior_loss_weight can)")
            continue
        if tn.search_alg == "grid" and dim.kind not in ("grid", "choice"):
            problems.append(f"{where}: search_alg grid needs grid or choice values, not {dim.kind}")
        if tn.search_alg in ("optuna", "hyperopt") and dim.kind == "grid":
            problems.append(f"{where}: {tn.search_alg} samples; use choice instead of grid")
        node: Any = base
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError or isinstance(node, dict):
            problems.append(f"{where}: not a config value (unknown key or a whole section)")
            continue
        values = dim.values
        inside = None
        if dim.kind in ("uniform", "loguniform"):
            # A float range over an integer key fails only once a trial samples 2.7: a value
            # inside it that is not whole (the midpoint of [4, 16] is)
            inside = values[0] + (values[1] - values[0]) * 0.3819660112501051
            values.append(inside)
        for value in values:
            try:
                validate(trial_tree(base, {key: value}))
            except ConfigError as exc:
                if value == inside and any("fractional part" in p for p in exc.problems):
                    problems.append(f"{where}: {dim.kind} samples fractional values and {key} "
                                    "takes whole numbers; use randint or choice")
                    continue
                problems.extend(f"{where}={value!r}: {p}" for p in exc.problems)
    return problems


# The member tags pydantic puts in the location of a union's errors (``str``, ``list[str]``,
# ``tuple[int, int]``, ``literal['auto']``, ``function-after[...]``): no config key has
# brackets, quotes or these names, so they are dropped from the key a problem names.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|tuple|set|.*[\[\]'(),].*)$")


def _format_pydantic(err: ValidationError) -> list[str]:
    # One problem per key: a union's members (data.uri as str, then as list[str]) each
    # failed under a key that does not exist (data.uri.list[str]); the first member's
    # error is the problem, the others' messages its alternatives.
    problems: list[tuple[str, dict, list[str]]] = []  # (key, error, alternatives)
    unions: dict[str, list[str]] = {}
    for e in err.errors():
        # data.sources[1].weight: list items by index, as the messages of checks name them.
        raw = list(e["loc"])
        # an unknown key is the user's own, whatever it looks like (`max_steps,` from a
        # typo'd override, `list`): named, not dropped as a union tag
        own = [raw.pop()] if e["type"] == "extra_forbidden" and raw else []
        loc = [p for p in raw if isinstance(p, int) or not _UNION_TAG.match(p)] + own
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        key = key.lstrip(".") or "<root>"
        member = len(loc) < len(e["loc"])
        if member and key in unions:
            unions[key].append(e["msg"].removeprefix("Input should be "))
            continue
        problems.append((key, e, unions.setdefault(key, []) if member else []))
    out = []
    for key, e, alternatives in problems:
        if e["type"] == "extra_forbidden":
            out.append(f"{key}: unknown key")
        elif e["type"] == "missing":
            out.append(f"{key}: required key is missing")
        elif e["type"] == "value_error" and str(e["ctx"]["error"]).startswith(f"{key}."):
            out.append(str(e["ctx"]["error"]))  # a section's check naming its own key
        else:
            got = e.get("input")
            # A check's own ValueError: its message, without pydantic's "Value error, ".
            msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
            msg += "".join(f"; or {a}" for a in alternatives)
            # the check's message names the value already ("unknown family 'x'"; a number
            # only as "not 0", where a bound like "> 0" could read as the value)
            named = repr(got) in msg if isinstance(got, (str, list)) else f"not {got!r}" in msg
            shown = "" if isinstance(got, dict) or named else f" (got {got!r})"
            if isinstance(got, str) and "@" in got:
                from raylora.storage import masked

                if masked(got) != got:  # a URL's password is never repeated (a check names it masked)
                    shown = ""
            if e["type"] == "string_type" and type(got) in (int, float):
                # YAML 1.1 reads an unquoted revision like 0123456 as the octal number 42798:
                # the number alone names nothing the user wrote
                shown += ": YAML read it as a number (digits after a leading 0 as octal); quote it"
            out.append(f"{key}: {msg}{shown}")
    return out


SEARCH_SPACE = ["tune", "search_space"]  # its keys are dotted config keys themselves


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` → (["a","b","c"], VALUE parsed as a YAML scalar or flow list).
    Under ``tune.search_space`` the rest is one key, a dimension's dotted config key:
    ``tune.search_space.lora.rank={choice: [8, 16]}`` → (["tune","search_space","lora.rank"], …);
    ``apply_overrides`` drops a dimension set to null."""
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
    if _drops_a_comment(raw, value):
        # A command line holds no YAML comment: `data.caption_prefix=photo #1` trained on
        # "photo". The text is the value (a number key then names it as not a number).
        value = raw.strip()
    path = key.split(".")
    if path[:2] == SEARCH_SPACE and len(path) > 2:
        return [*SEARCH_SPACE, ".".join(path[2:])], value
    # A list item as the errors name it: data.sources[1].weight → data, sources, 1, weight
    return [p for part in path for p in _indexed(part)], value


def _drops_a_comment(raw: str, value: Any) -> bool:
    """Whether YAML read ``raw`` as ``value`` by dropping a `` #...`` comment from it."""
    cut = re.search(r"\s#", raw)
    if cut is None:
        return False
    try:
        return yaml.safe_load(raw[: cut.start()]) == value
    except yaml.YAMLError:
        return False  # the # is inside a quoted string or a flow list: YAML's own text


def _indexed(part: str) -> list:
    m = re.fullmatch(r"(.+?)((?:\[\d+\])+)", part)
    if not m:
        return [part]
    return [m.group(1), *(int(i) for i in re.findall(r"\d+", m.group(2)))]


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    problems = []
    for item in overrides:
        try:
            path, value = parse_override(item)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        problem = _set(tree, path, value)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    return tree


def _set(tree: dict, path: list, value: Any) -> str | None:
    """``tree`` at ``path`` (keys, and list indices as ints) set to ``value``, sections made
    on the way; the problem, if the path runs through a value or past a list's end."""
    node, section = tree, RayLoraConfig
    for i, part in enumerate(path):
        if isinstance(part, int):
            if not isinstance(node, list) or not 0 <= part < len(node):
                size = f"a list of {len(node)}" if isinstance(node, list) else "not a list"
                return f"{_dotted(path[: i + 1])}: no such item ({_dotted(path[:i])} is {size})"
        elif not isinstance(node, dict):
            return f"{_dotted(path[:i])}: is a value, not a section"
        if i == len(path) - 1:
            break
        section = section and _section_of(section, part)
        # A section given as null (its keys all commented out) is its defaults, as validate
        # reads it; `tune: null` (no search) is as if tune were absent.
        if isinstance(part, str) and (part not in node or (node[part] is None and section)):
            node[part] = {}
        node = node[part]
    if value is None and path[:-1] == SEARCH_SPACE:
        node.pop(path[-1], None)  # `tune.search_space.lora.rank=null`: not searched
    else:
        node[path[-1]] = value
    return None


def _dotted(path: list) -> str:
    """["data", "sources", 1, "weight"] → "data.sources[1].weight"."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _without(tree: dict, locs: list[tuple]) -> dict:
    """A deep copy of ``tree`` with the values at ``locs`` removed: the deepest key or list
    item on each loc's path that is there (a key inside a list item: that key)."""
    import copy

    out = copy.deepcopy(tree)
    # Later list items first, so that removing one does not move the next.
    for loc in sorted(locs, key=lambda loc: [str(p).zfill(8) for p in loc], reverse=True):
        node, last = out, None
        for part in loc:
            if isinstance(node, dict) and part in node:
                last = (node, part)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                last = (node, part)
            else:
                break
            node = node[part]
        if last is not None:
            last[0].pop(last[1])
    return out


def _section_of(model: type[BaseModel], key: Any) -> type[BaseModel] | None:
    """The section class of ``model``'s key ``key``; None for a value or an unknown key."""
    f = model.model_fields.get(key) if isinstance(key, str) else None
    return next((a for a in (f.annotation, *typing.get_args(f.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None) if f else None


def _null_sections(tree: dict, model: type[BaseModel]) -> dict:
    """``tree`` with every section whose keys are all commented out (YAML's null), at any
    depth, as {}: its defaults. Not one that may be null, where null means something
    (`tune: null`: no search)."""
    out = {}
    for k, v in tree.items():
        sub = _section_of(model, k)
        if sub is not None and v is None and type(None) not in typing.get_args(
                model.model_fields[k].annotation):
            v = {}
        elif sub is not None and isinstance(v, dict):
            v = _null_sections(v, sub)
        out[k] = v
    return out


def validate(tree: Any, source: str | None = None) -> RayLoraConfig:
    """Validate a raw config tree; raise one ConfigError listing every problem."""
    if not isinstance(tree, dict):
        raise ConfigError(["<root>: the config must be a mapping of sections"], source)
    tree = _null_sections(tree, RayLoraConfig)
    try:
        cfg = RayLoraConfig.model_validate(tree)
    except ValidationError as exc:
        problems = _format_pydantic(exc)
        # The combinations still get checked, on the tree without its invalid values (they
        # fall back to defaults), so one run of `raylora validate` shows every problem;
        # not for a key already named (a removed value reads as missing there).
        named = {p.split(":", 1)[0] for p in problems}
        try:
            rest = RayLoraConfig.model_validate(_without(tree, [e["loc"] for e in exc.errors()]))
            problems += [p for p in _cross_checks(rest)
                         if p not in problems and p.split(":", 1)[0] not in named]
        except ValidationError:
            pass  # a required value is what is missing: nothing more to learn
        raise ConfigError(problems, source) from None
    problems = _cross_checks(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: YAML keeps the last, so a
    second ``train:`` section silently dropped the first one's settings. Merge keys
    (``<<: *anchor``) merge as YAML says: a key given beside them overrides the merged one."""

    def flatten_mapping(self, node):
        # Judged before the merged pairs are spliced into node.value (where a key given
        # beside `<<` and the merged one look alike); once per node, as a node merged into
        # another is flattened again there.
        if not getattr(node, "_raylora_keys_checked", False):
            node._raylora_keys_checked = True
            self._refuse_twice(node)
        super().flatten_mapping(node)
        # PyYAML 6.0 merges the first pair of each key it meets: a mapping that overrides a
        # key it merged passed the merged value on when merged itself. Each key's last pair
        # (the one given beside `<<`) is the one YAML means.
        last = {(k.tag, k.value): i for i, (k, _) in enumerate(node.value)
                if isinstance(k, yaml.ScalarNode)}
        node.value = [(k, v) for i, (k, v) in enumerate(node.value)
                      if not isinstance(k, yaml.ScalarNode) or last[(k.tag, k.value)] == i]

    def _refuse_twice(self, node):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<` may be given more than once; its keys merge
            key = self.construct_object(key_node)
            if not isinstance(key, typing.Hashable):
                continue  # the base constructor names an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"{key!r} is given twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); YAML would keep only the last",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line


def yaml_text(path: str | Path) -> str:
    """A YAML file's text, as YAML reads a stream: UTF-8 (a byte-order mark dropped), or
    UTF-16 where a mark says so (what PowerShell 5's ``>`` writes); not the locale's
    encoding. ValueError naming the file where it is neither (a cp1252 ``café``: Python's
    "'utf-8' codec can't decode byte 0xe9" named no file). OSError as reading raises it."""
    import codecs

    raw = Path(path).read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return raw.decode("utf-16")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}); "
                         "save it as UTF-8") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RayLoraConfig:
    path = Path(path)
    try:
        text = yaml_text(path)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read config file ({exc.strerror})"]) from None
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    tree = apply_overrides(tree, overrides or [])
    return validate(tree, source=str(path))
