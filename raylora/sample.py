"""Base pipeline + adapter → one image. What a user does after training, in one call."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch

log = logging.getLogger("raylora")


def sample(
    model: str,
    adapter: str | list[str],
    prompt: str,
    out: str,
    seed: int = 0,
    steps: int = 25,
    guidance_scale: float | None = None,
    size: int | None = None,
    expert: str | None = None,
    quantize_text_encoders: str = "none",
    revision: str | None = None,
    image: str | list[str] | None = None,
    system_prompt: str | None = None,
    variant: str | None = None,
) -> str:
    """``guidance_scale``: default the family's (SD 7.5, Flux.1-dev 3.5, ...), passed as the
    family's pipeline takes it (Qwen-Image: true CFG with an empty negative prompt).
    ``adapter``, ``expert``, ``quantize_text_encoders``, ``revision``, ``variant``: see
    ``load_pipeline``.
    ``image``: an edit model's input image (a path or storage URI; Flux.1 Kontext, Flux.2,
    Qwen-Image-Edit), or a list of them in order (Flux.2, Qwen-Image-Edit), resized to
    ``size`` when given, else sized as the pipeline does. ``system_prompt``: a family's
    that takes one (Lumina-Image 2.0, Sana); default the one its run trained with
    (``trained_system_prompt``), else the pipeline's own. Captions are encoded at the
    ``model.max_sequence_length`` the run set, if it set one."""
    from raylora.storage import Storage

    _check_out(out, steps, size)
    control = None
    if isinstance(image, list):  # --image given several times: the inputs in order
        image = image[0] if len(image) == 1 else image or None
    if image is not None:
        from raylora.train.preview import open_control_images

        try:  # decoded now, before anything loads; made RGB once the adapters say how
            control = open_control_images([image], Storage())[0]
        except ValueError as exc:  # "validation.control_images: URI: why" → "--image: URI: why"
            raise ValueError("--image: " + str(exc).split(": ", 1)[1]) from None
    inputs = [] if control is None else control if isinstance(control, list) else [control]
    # the side the pipeline gets them at: --size resizes them (reference_kwargs)
    side = size or min((min(x.size) for x in inputs), default=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 on GPUs: fp16 overflows in Flux/SD3/Qwen-Image transformers.
    # an adapter in storage or on the hub: a copy here while the call reads its raylora.json
    with local_adapters([adapter] if isinstance(adapter, str) else adapter) as adapters:
        pipe, family = load_pipeline(model, adapters, expert,
                                     torch.bfloat16 if device == "cuda" else torch.float32,
                                     quantize_text_encoders, device, revision,
                                     with_image=len(inputs), input_side=side,
                                     system_prompt=system_prompt is not None, variant=variant,
                                     size=size)
        if system_prompt is None:
            system_prompt = trained_system_prompt(adapters)
        # The caption length the run trained at (model.max_sequence_length), if it set one.
        length = trained_config(adapters, "model", "max_sequence_length")
        if control is not None:
            from raylora.train.preview import rgb_control_images

            # as the run made its control images RGB: transparency over its
            # data.background_color (else the default), 16-bit scaled
            control = rgb_control_images(
                [control], trained_config(adapters, "data", "background_color"))[0]
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    # No size: the pipeline's own default (the model's sample size; ZImagePipeline's 1024,
    # as it has no sample-size attribute to derive one from).
    dims = {} if size is None else {"height": size, "width": size}
    # prompt by name: Flux2KleinPipeline's first parameter is a reference image.
    image = family.images(
        pipe,
        prompt=prompt,
        num_inference_steps=steps,
        **family.guidance_kwargs(guidance_scale),
        **family.prompt_kwargs(system_prompt),
        **family.length_kwargs(length),
        **dims,
        **family.reference_kwargs(control, size, size),
        generator=torch.Generator(device="cpu").manual_seed(seed),
    )[0]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    image.save(out)
    return out


@contextlib.contextmanager
def local_adapters(adapters: list[str]):
    """Each ``--adapter`` as a path on this machine, for the call: a ``file:`` URI's path, an
    ``hf://`` one downloaded into the hub cache, one in object storage (``s3://``, ``gs://``)
    into a temporary folder, as ``lora.init_from`` reads them (``raylora.model.lora_init``).
    Before the base model loads: the stock loader took such a URI for a hub id, and said so
    ("Repo id must be in the form ...") only once the base model had loaded. A hub id
    (owner/name) is left to the stock loader."""
    from raylora import storage
    from raylora.model import hub, lora_init

    with tempfile.TemporaryDirectory(prefix="raylora-adapter-") as tmp:
        local = []
        for i, a in enumerate(adapters):
            if storage.is_local(a):
                local.append(storage.local_path(a) if a.startswith("file:") else a)
            elif a.startswith(hub.SCHEME):
                local.append(hub.fetch(a, "--adapter"))
            else:
                store = storage.Storage()
                os.makedirs(where := os.path.join(tmp, str(i)))
                try:  # locate: what is missing, named before anything is copied
                    lora_init.locate(a, store)
                    local.append(lora_init.download(a, store, where))
                except (FileNotFoundError, ValueError) as exc:
                    raise type(exc)(f"--adapter: {exc}") from None
                except OSError as exc:  # storage not reached (its message names the URI)
                    raise OSError(f"--adapter: {exc}") from exc
        yield local


def _check_out(out: str, steps: int, size: int | None) -> None:
    """What the call's arguments must be, checked before the pipeline loads (minutes for
    a big model) rather than after the image was drawn."""
    from PIL import Image

    if steps < 1:
        raise ValueError(f"--steps: {steps}; at least 1")
    if size is not None and size < 8:
        raise ValueError(f"--size: {size}; pixels per side (e.g. 512)")
    ext = os.path.splitext(out)[1].lower()
    if ext not in Image.registered_extensions():
        raise ValueError(f"--out: {out}: name an image file (.png, .jpg, .webp)")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot write in {parent} ({exc.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out: cannot write in {parent}")


def load_pipeline(model: str, adapter: str | list[str], expert: str | None = None,
                  dtype: torch.dtype = torch.float32, quantize_text_encoders: str = "none",
                  device="cpu", revision: str | None = None, with_image: int = 0,
                  input_side: int | None = None, system_prompt: bool = False,
                  variant: str | None = None, size: int | None = None):
    """(the family's stock pipeline of ``model`` with the adapter loaded, the family).
    ``model``: a hub id (or ``hf://`` URI), a local folder, or a folder in object storage
    (checked as a run's plan checks it, then copied to this node as a training worker's
    copy is: ``raylora.model.load.materialize``). No safety checker, as previews draw
    (``load_pipeline_as_trained``).

    A pipeline of experts (Wan 2.2 A14B) samples with every expert; an adapter goes into
    the one it trained: ``expert``, else ``model.expert`` in the adapter folder's
    ``raylora.json``. ``adapter`` may list one adapter per expert (each folder's
    ``raylora.json`` names its expert), e.g. a high-noise and a low-noise run.

    The text encoders and VAE are loaded as a training worker holds them
    (``raylora.model.load.load_pipeline_as_trained``: Flux.2 [dev]'s is Mistral 3's
    language model without its vision tower, LM head and unused layers, 36 GB in bf16
    instead of 48), the encoders' linears quantized on ``device`` as
    ``quantize_text_encoders`` (``model.quantize_text_encoders``' values) says.

    ``revision``: a hub model's; default the commit the adapter was trained on when its
    ``raylora.json`` names ``model`` as its base (``trained_commit``), else main.
    ``variant``: the weights' (``fp16``, as ``model.variant``); default the run's when its
    ``raylora.json`` names ``model`` as its base. The scheduler samples the
    parameterisation the run trained (its ``train.prediction_type``, when it set one).
    ``with_image``: the call gives that many input images (``--image``), refused for a
    family whose pipeline takes none or fewer, or (``input_side``: the smallest side it
    gets them at) smaller than it takes. ``system_prompt``: the call gives one
    (``--system-prompt``), refused for a family whose pipeline takes none. ``size``: the
    image's side (``--size``), refused off the model's latent grid."""
    from diffusers import DiffusionPipeline

    from raylora import quiet, storage
    from raylora.config import ModelSection, hub_model
    from raylora.model import families
    from raylora.model.load import check_model, load_pipeline_as_trained, materialize
    from raylora.storage import Storage
    from raylora.train.preview import with_prediction_type

    model, revision = hub_model(model, revision, keys=("--model", "--revision"))
    if model.startswith("file:"):  # a path (file:/a/b has no "://": not a hub id), as
        model = storage.local_path(model)  # model.pretrained takes it (resolve_model_path)
    adapters = [storage.local_path(a) if a.startswith("file:") else a
                for a in ([adapter] if isinstance(adapter, str) else adapter)]
    for a in adapters:
        if not storage.is_local(a):  # sample() downloads them first (local_adapters)
            raise ValueError(f"--adapter: {a}: load_pipeline takes an adapter on this machine "
                             "or a hub id; raylora.sample.local_adapters copies one here")
    for key, p in [("--model", model), *(("--adapter", a) for a in adapters)]:
        # A path that is not there reached the loaders as a hub id: their message was the
        # hub's ("Repo id must be in the form ..."), after a try at the network.
        if "://" not in p and not os.path.exists(p) and not _hub_id_form(p):
            raise FileNotFoundError(f"{key}: {p}: no such file or folder here, and not a "
                                    "hub id (owner/name)")
    if os.path.isfile(model):
        from raylora.model.load import single_file_message

        raise ValueError(single_file_message("--model", model))
    path = os.path.abspath(model) if os.path.isdir(model) else model
    revision = revision or trained_commit(model, adapters)
    # A folder in object storage (s3://, gs://): checked where it is, as the plan checks a
    # run's (DiffusionPipeline took the URI for a hub id: a huggingface.co connection
    # error), and downloaded once the call's arguments are checked (materialize below).
    stored = check_model(model, Storage(), key="--model") if not storage.is_local(model) else None
    # The family, and the pipeline class that loads the adapter, from model_index.json.
    index = stored["index"] if stored else DiffusionPipeline.load_config(path, revision=revision)
    family = families.detect(index, "--model")
    if system_prompt and family.system_prompt is None:
        raise ValueError(f"--system-prompt: {family.name} ({family.pipeline}) takes no system prompt")
    if size is not None:
        # Off the grid, SD's pipelines raise and Flux's round the size down with a warning:
        # both after the pipeline loaded (minutes for a big model).
        from diffusers import AutoencoderKL  # any VAE's config.json: load_config reads the file

        multiple = family.patch * (stored["vae_factor"] if stored else family.vae_factor(
            AutoencoderKL.load_config(path, subfolder="vae", revision=revision)))
        if size % multiple:
            raise ValueError(f"--size: {size} is not a multiple of {multiple} (the {family.name} "
                             f"latent grid: VAE downsampling × patch size), e.g. "
                             f"{max(multiple, size // multiple * multiple)}")
    if with_image and not family.reference_image:
        raise ValueError(f"--image: {family.name} ({family.pipeline}) takes no input image")
    if int(with_image) > family.max_references:
        raise ValueError(f"--image: {int(with_image)} input images, but {family.pipeline} takes "
                         f"{family.max_references}")
    if with_image and input_side is not None and input_side < family.min_reference_side:
        raise ValueError(f"--image: {family.pipeline} takes no input image under "
                         f"{family.min_reference_side} px a side; this one gets {input_side} px "
                         "(--size, else the image's own)")
    if len(adapters) > 1 and expert is not None:
        raise ValueError("--expert: names the expert of one --adapter; with several, each "
                         "folder's raylora.json does")
    experts = [expert or trained_expert(a) for a in adapters]
    # Refused before the pipeline loads: an expert this pipeline lacks, none for experts,
    # two adapters for one denoiser.
    for a, e in zip(adapters, experts):
        family.sigma_range(index, e, f"--model {model}", key=f"--expert (--adapter {a})"
                           if len(adapters) > 1 else "--expert")
    # (sigma_range let None through: this pipeline has one denoiser)
    if len(adapters) > 1 and None in experts:
        raise ValueError(f"--adapter: {len(adapters)} given, but --model {model} has one denoiser "
                         f"({family.denoiser}); give one --adapter")
    if len(set(experts)) < len(experts):
        raise ValueError(f"--adapter: {', '.join(adapters)} train the same denoiser "
                         f"({', '.join(str(e) for e in experts)}); give one adapter per expert")
    for a in adapters:  # after the call's arguments, before the base model loads
        _check_adapter(a, family)
    quiet.diffusers_bars_off()  # "Loading pipeline components..."
    # raylora.json names a folder by its absolute path (the run resolved it), a hub id as is
    variant = variant or trained_config(adapters, "model", "variant", base=(model, path))
    if stored:  # this node's copy, as a training worker's, of the files just checked
        path = materialize(model, Storage(), stored["commit"])
    section = ModelSection(pretrained=path, revision=revision, variant=variant,
                           quantize_text_encoders=quantize_text_encoders)
    pipe = load_pipeline_as_trained(path, family, dtype, index, section, device)
    for a, e in zip(adapters, experts):
        load_adapter(pipe, family, a, e)
    return with_prediction_type(pipe, trained_config(adapters, "train", "prediction_type")), family


def _check_adapter(adapter: str, family) -> None:
    """A local ``--adapter`` holds what a loader reads (checked before the base model
    loads, minutes for a big one): a peft folder, or the diffusers file (or a
    ``.safetensors`` the stock loader picks, its only one) in a format the family's stock
    pipeline converts (``_stock_state_dict``)."""
    from raylora.model.lora import PEFT_CONFIG, is_peft_folder

    if not os.path.exists(adapter):  # a hub id: read as the stock loader reads it (load_adapter)
        return
    if os.path.isdir(adapter):
        if is_peft_folder(adapter):
            return
        if not any(n.endswith(".safetensors") for n in os.listdir(adapter)):
            inner = os.path.join(adapter, "adapter")
            hint = (f"; a run's output folder holds its adapter in {inner}"
                    if os.path.isdir(inner) else "")
            raise FileNotFoundError(f"--adapter: {adapter}: no LoRA weights in it (no "
                                    f".safetensors file, no {PEFT_CONFIG}){hint}")
    _stock_state_dict(adapter, family)


def trained_commit(model: str, adapters: list[str]) -> str | None:
    """The hub commit of ``model`` the adapters' run loaded (``raylora.json``'s
    ``model_commit``), when a run with ``model`` as its ``model.pretrained`` wrote one of
    them: its base as trained, however the repo's main moved since."""
    from raylora.checkpoint.export import read_run_meta

    from raylora.model.load import is_hub_id

    if not is_hub_id(model):  # a folder's recorded version is no revision it can load at
        return None
    for a in adapters:
        meta = read_run_meta(a)
        if (meta.get("config", {}).get("model", {}).get("pretrained") == model
                and meta.get("data", {}).get("model_commit")):
            return meta["data"]["model_commit"]
    return None


def _hub_id_form(p: str) -> bool:
    """``owner/name``: what the hub reads (a path of two parts is one too, as in
    ``raylora.model.load.check_model``), not ``./x`` or ``~/x``."""
    from raylora.model.load import is_hub_id

    return is_hub_id(p) and p.count("/") == 1 and not p.startswith((".", "~")) and all(p.split("/"))


def trained_config(adapters: list[str], section: str, key: str, base: tuple[str, ...] | None = None):
    """``<section>.<key>`` of the config of the run that wrote one of the adapter folders
    (its ``raylora.json``), the first that set it; with ``base``, only of a run whose
    ``model.pretrained`` was one of ``base`` (a setting of that model, such as its variant)."""
    from raylora.checkpoint.export import read_run_meta

    for a in adapters:
        config = read_run_meta(a).get("config", {})
        if base is not None and config.get("model", {}).get("pretrained") not in base:
            continue
        found = config.get(section, {}).get(key)
        if found is not None:
            return found
    return None


def trained_system_prompt(adapters: list[str]) -> str | None:
    """``model.system_prompt`` of the run that wrote one of the adapter folders, if one set
    it: its captions were trained behind it."""
    return trained_config(adapters, "model", "system_prompt")


def trained_expert(adapter: str) -> str | None:
    """``model.expert`` of the run that wrote the adapter folder (its ``raylora.json``), if
    it says."""
    return trained_config([adapter], "model", "expert")


@contextlib.contextmanager
def _current_spelling(family, adapter: str):
    """``adapter``, or where an earlier raylora's adapter file spells keys as the stock
    loader misreads them (``lora.old_spellings``: an SD/SDXL file that mixed key styles, of
    which the loader takes the style from the first key and drops the other style's layers;
    text-encoder DoRA magnitudes it leaves at the base norms), a copy as raylora writes it
    now, without a word from the loader either way."""
    from safetensors import safe_open

    from raylora.model.lora import WEIGHT_NAME, current_spelling_file, old_spellings

    file = os.path.join(adapter, WEIGHT_NAME) if os.path.isdir(adapter) else adapter
    if file.endswith(".safetensors") and os.path.isfile(file):
        with safe_open(file, framework="pt") as f:
            old = old_spellings(list(f.keys()), family.denoiser, family.legacy_lora_keys)
        if old:
            log.warning("%s: written by an earlier raylora with %s; loaded here as raylora "
                        "writes it now. `raylora export --format diffusers %s` writes a copy "
                        "every loader reads", file, "; and ".join(old), adapter)
            with tempfile.TemporaryDirectory() as tmp:
                current_spelling_file(file, os.path.join(tmp, WEIGHT_NAME), family.denoiser,
                                      family.legacy_lora_keys)
                yield tmp
            return
    yield adapter


def _stock_state_dict(adapter: str, family) -> None:
    """``adapter`` read as the stock pipeline reads it, as ``lora.init_from`` reads it
    (``lora_init.stock_state_dict``): a file whose keys its converters do not turn into
    LoRA layers loaded with a warning raylora's quiet logging hides, and sampled the
    base model (raylora's kohya file of SD3 or Lumina-Image 2.0); one they fail on raised
    the converter's own KeyError (Wan's)."""
    from raylora.model.lora_init import stock_state_dict

    try:
        stock_state_dict(adapter, family, "--adapter", adapter)
    except ValueError as exc:
        raise ValueError(f"{exc}; the adapter folder raylora writes (diffusers format, "
                         "output.uri/adapter) loads") from None


def load_adapter(pipe, family, adapter: str, expert: str | None = None) -> None:
    """A diffusers LoRA/DoRA file through the stock loader (refused, naming ``--adapter``,
    in a format it does not read into the trained denoiser); a LoKr/LoHa peft folder
    (``lora.variant`` lokr/loha, which diffusers' loaders do not read) through peft. Into
    the denoiser ``expert`` names (``model.expert``), else the family's one."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from raylora.model.lora import is_peft_folder

    if os.path.isdir(adapter) and is_peft_folder(adapter):
        from peft import PeftModel

        component = family.trained_component(expert)
        # merge: the pipeline then runs a plain module again (PeftModel's forward wraps
        # the signature the pipeline calls with).
        setattr(pipe, component,
                PeftModel.from_pretrained(getattr(pipe, component), adapter).merge_and_unload())
    else:
        if not os.path.exists(adapter):  # a hub id; load_pipeline's _check_adapter read a
            _stock_state_dict(adapter, family)  # local one before the base model loaded
        component = family.trained_component(expert)
        denoiser = getattr(pipe, component)
        before = set(getattr(denoiser, "peft_config", None) or ())
        with _current_spelling(family, adapter) as readable:
            try:
                pipe.load_lora_weights(readable, **family.lora_load_kwargs(expert))
            except (ValueError, RuntimeError, KeyError) as exc:  # another model's shapes
                raise ValueError(f"--adapter: {adapter}: {family.pipeline}.load_lora_weights: "
                                 f"{type(exc).__name__}: {exc}") from None
        new = set(getattr(denoiser, "peft_config", None) or ()) - before
        if not any(new & set(getattr(m, "scaling", ())) for m in denoiser.modules()
                   if isinstance(m, BaseTunerLayer)):
            # the stock loader's answer was a warning, and the image the base model's
            raise ValueError(f"--adapter: {adapter}: no LoRA layer of it loaded into the "
                             f"{family.pipeline}'s {component}; the adapter folder raylora "
                             "writes (diffusers format, output.uri/adapter) loads")
    # The loader's new layers are in train mode: an adapter written before raylora wrote
    # lora_dropout 0 into its metadata would otherwise sample with the run's dropout on.
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
