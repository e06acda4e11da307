"""Validation images: fixed prompts, fixed seed, the adapter being trained. No Ray.

Rank 0 builds the family's stock diffusers pipeline around the denoiser it trains (LoRA layers live
inside it, so no weights are copied), renders every prompt with the same seed each time,
and frees the pipeline again, so the training GPU holds it only while rendering. With the
latent cache the worker has no VAE or text encoder; they are loaded for the render, as
training would load them (``encoders_for``), and dropped after it.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager, nullcontext
from collections.abc import Iterator

import torch
from PIL import Image

from raylora import quiet
from raylora.train.modes import evaluating


def make_grid(images: list[Image.Image], cols: int | None = None) -> Image.Image:
    """Images (same size) in rows of ``cols`` (default: a near-square grid)."""
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return grid


def grid_with_inputs(images: list[Image.Image], inputs=()) -> tuple[list[Image.Image], int | None]:
    """(images, columns) of a preview grid: the rendered images as they are, or with an
    edit model's inputs (validation.control_images) each beside what it became: rows of
    (input, edit), or (input 1, input 2, ..., edit) for several, the inputs at the edit's
    size."""
    if not inputs:
        return list(images), None
    out = []
    for src, img in zip(inputs, images):
        out += [x.resize(img.size) for x in (src if isinstance(src, list) else [src])] + [img]
    return out, len(out) // len(images)


def encoders_for(parts, model_path: str, model, device) -> tuple:
    """(VAE, text encoders, tokenizers) a preview renders with: the worker's own
    (``parts``: ``FrozenParts``), or, with cached latents, where the worker holds none,
    loaded as a worker would hold them (``raylora.model.load.load_encoders``: adapted by the
    family, quantized as ``model.quantize_text_encoders`` says), not as the stock
    pipeline loads them: Flux.2 [dev]'s would be the whole 24B Mistral 3, vision tower and
    LM head included, at full precision. The memory preflight sizes these
    (``raylora.memory``, ``Estimate.preview``)."""
    if parts.vae is not None:
        return parts.vae, parts.text_encoders, ()
    from raylora.model.load import load_encoders, read_index

    tokenizers, encoders, vae = load_encoders(model_path, parts.family, parts.weight_dtype,
                                              read_index(model, model_path), model, device)
    return vae, encoders, tokenizers


def build_pipeline(model_path: str, family, model, vae=None, text_encoders=(), tokenizers=(),
                   dtype: torch.dtype = torch.float32, device="cpu", expert: str | None = None,
                   revision: str | None = None, prediction_type: str | None = None):
    """The family's stock pipeline sharing the trained ``model`` (and whatever encoders are
    already loaded); the rest is loaded from ``model_path``. ``expert``: ``model.expert``
    (a pipeline of experts samples with the trained one alone, ``Family.pipeline_with``).
    ``revision``: a hub model's, ``model.revision`` (the run's pinned commit).
    ``prediction_type``: ``train.prediction_type`` (``with_prediction_type``)."""
    from raylora.model.load import encoder_kwargs

    kw = family.pipeline_with(model, expert) | encoder_kwargs(family, vae, text_encoders, tokenizers)
    # Before the load: its "Loading pipeline components" bar printed at every preview.
    quiet.diffusers_bars_off()
    pipe = family.load_pipeline(model_path, dtype=dtype, revision=revision, **kw)
    pipe.set_progress_bar_config(disable=True)
    return with_prediction_type(pipe, prediction_type).to(device)


def with_prediction_type(pipe, prediction_type: str | None):
    """``pipe`` sampling the parameterisation its adapter trained (``train.prediction_type``:
    an ε model trained to predict v, or back): its scheduler rebuilt from its config with
    that ``prediction_type``, as diffusers' training scripts register it on theirs. None,
    flow matching or the scheduler's own: unchanged."""
    if prediction_type in ("epsilon", "v_prediction") and \
            pipe.scheduler.config.get("prediction_type") != prediction_type:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config,
                                                          prediction_type=prediction_type)
    return pipe


def denoiser_of(pipe) -> torch.nn.Module:
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def read_control_images(uris: list, store, data=None) -> list:
    """validation.control_images as training reads a control image, RGB: each preview
    prompt's input image, or its list of them (data.control_inputs > 1) as a list.
    ``data``: the run's data section (data.max_image_pixels, data.background_color; None:
    their defaults). ``open_control_images``, then ``rgb_control_images``."""
    background = None if data is None else tuple(data.background_color)
    return rgb_control_images(open_control_images(uris, store, data), background)


def open_control_images(uris: list, store, data=None) -> list:
    """validation.control_images decoded by training's decode (``raylora.data.decode.
    open_image``: upright, data.max_image_pixels checked from the header), each in its own
    mode: alpha and 16 bits kept for ``rgb_control_images``. PIL's convert("RGB") here
    put a cut-out over black, not data.background_color, and clipped 16-bit inputs: the
    previews showed the adapter inputs it never trained on. ``data``: as
    ``read_control_images``. A ValueError names the URI."""
    from raylora.config import DataSection
    from raylora.data.decode import open_image

    max_pixels = (data or DataSection()).max_image_pixels

    def read(uri: str) -> Image.Image:
        try:
            return open_image(store.read_bytes(uri), max_pixels)
        except FileNotFoundError:
            raise ValueError(f"validation.control_images: {uri}: no such file") from None
        except (OSError, ValueError) as exc:  # BadRecord is a ValueError ("not_an_image: ...")
            raise ValueError(f"validation.control_images: {uri}: {exc}") from None

    return [[read(u) for u in uri] if isinstance(uri, list) else read(uri) for uri in uris]


def rgb_control_images(images: list, background: tuple[int, int, int] | None = None) -> list:
    """``open_control_images``' images (lists kept) RGB as training makes a control image
    (``raylora.data.decode.to_rgb``): transparency over ``background`` (data.background_
    color; None: its default), 16-bit scaled to 8 bits."""
    from raylora.data.decode import to_rgb

    def rgb(img: Image.Image) -> Image.Image:
        return to_rgb(img) if background is None else to_rgb(img, tuple(background))

    return [[rgb(x) for x in img] if isinstance(img, list) else rgb(img) for img in images]


@torch.no_grad()
def render(pipe, family, prompts: list[str], seed: int, steps: int, guidance: dict,
           resolution: int, autocast=None, control_images=()) -> list[Image.Image]:
    """One image per prompt; image i uses generator seed ``seed + i`` on the CPU, so the
    same adapter gives the same picture on any device and at any step. ``guidance``: the
    ``family``'s ``guidance_kwargs`` (one prompt per call), as its pipeline takes them.
    ``control_images``: an edit model's input image (or list of them) for each prompt
    (none: text to image)."""
    # every module of the pipeline, the text encoders a run trains included: their LoRA
    # dropout on would make the same weights draw another picture at each preview
    with evaluating([denoiser_of(pipe), *pipe.components.values()]), fp32_vae_in_fp32(pipe):
        images = []
        for i, prompt in enumerate(prompts):
            with autocast() if autocast is not None else nullcontext():
                # prompt by name: Flux2KleinPipeline's first is an image
                control = control_images[i] if control_images else None
                images.append(family.images(
                    pipe, prompt=prompt, num_inference_steps=steps, **guidance,
                    height=resolution, width=resolution,
                    **family.reference_kwargs(control, resolution, resolution),
                    generator=torch.Generator().manual_seed(seed + i),
                )[0])
        return images


@contextmanager
def fp32_vae_in_fp32(pipe) -> Iterator[None]:
    """A VAE held in fp32 encodes and decodes in fp32 under an fp16 autocast. The run keeps
    a ``force_upcast`` VAE (SDXL's) in fp32 under fp16, and the pipeline upcasts one to
    decode, because in fp16 its activations overflow; but autocast runs every conv in
    fp16 whatever the weights' dtype, so fp16 previews came out NaN (black). bf16 has the
    range: left to autocast."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(vae, "decode"):
        yield
        return
    names = [n for n in ("encode", "decode") if hasattr(vae, n)]
    own = {n: vae.__dict__[n] for n in names if n in vae.__dict__}  # set on the instance

    def fp32(a):
        return a.float() if torch.is_tensor(a) and a.is_floating_point() else a

    def outside(call):
        def run(*args, **kwargs):
            weight = next(vae.parameters())
            kind = weight.device.type
            if weight.dtype == torch.float32 and torch.is_autocast_enabled(kind) \
                    and torch.get_autocast_dtype(kind) == torch.float16:
                # the latents come in the denoiser's fp16: fp32 convs need fp32 inputs
                with torch.autocast(kind, enabled=False):
                    return call(*map(fp32, args), **{k: fp32(v) for k, v in kwargs.items()})
            return call(*args, **kwargs)
        return run

    for name in names:
        setattr(vae, name, outside(getattr(vae, name)))
    try:
        yield
    finally:
        for name in names:
            if name in own:
                setattr(vae, name, own[name])
            else:
                delattr(vae, name)  # the class's method again


def free_memory() -> None:
    """After the caller dropped its pipeline: collect it and return cached GPU memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
