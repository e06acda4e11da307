"""What every model family shares; each family module overrides what its architecture does
differently. No Ray; diffusers and transformers are imported where they are used, torch at
the top (so importing a family loads torch: ``raylora --help`` lists the family modules
without importing them, raylora.cli._family_names).

A family owns, for its pipeline layout: detection (``model_index.json`` ``_class_name``),
which components are the denoiser (or its experts, each for a σ range), VAE and text
encoders (loaded by the classes the folder's own ``model_index.json`` names, so a user's
checkpoint loads as diffusers would load it), how captions are tokenized, how a batch is
encoded into conditioning, the denoiser call, latent normalisation, default LoRA targets,
repeated blocks (regional compile, FSDP shard units), the stock pipeline class that loads
the adapter and how it is called for still images (``video``: one frame of a video
pipeline), and the kohya/ComfyUI key names.

Conditioning travels as a ``Cond``: named tensors with the batch first, the same names the
latent cache stores as columns (``prompt_embeds``, ``pooled_prompt_embeds``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils.checkpoint

from raylora.config import control_values


@dataclass(frozen=True)
class TextInput:
    """One tokenizer + text encoder pair, in the order the family joins their outputs."""

    encoder: str  # pipeline component, e.g. "text_encoder_2"
    tokenizer: str  # its tokenizer's component, e.g. "tokenizer_2"
    ids_key: str  # batch column of the token ids
    max_length: int | None = None  # None: the tokenizer's model_max_length
    template: str = "{}"  # caption → the text the tokenizer sees
    mask_key: str | None = None  # batch column of the attention mask, when the encoder needs it
    # True: a long-context encoder (T5, an LLM) whose length model.max_sequence_length sets
    long_context: bool = False
    drop: int = 0  # template tokens dropped from the front of the encoder's output
    # The pipeline cleans each prompt before tokenizing it (WanPipeline's prompt_clean:
    # raylora.data.tokenize.clean_prompt)
    clean: bool = False
    # False: the tokenizer adds no special tokens of its own (a chat template that writes
    # them itself, as transformers' processors tokenize one that starts with bos).
    special_tokens: bool = True
    # The side captions are padded on. "right" where the conditioning drops the padding by
    # the mask (raylora's llm_conditioning cuts it after the longest caption); None: the
    # tokenizer's own padding_side, for a pipeline that keeps every padding position
    # (Flux.2), whose transformer then sees the padding where the tokenizer put it.
    padding_side: str | None = "right"
    # Strings the pipeline deletes from every caption before templating it (Flux2Pipeline's
    # format_input: "[IMG]", which Pixtral's processor would count as an image slot).
    remove: tuple[str, ...] = ()
    # False: an empty caption is tokenized as it is, not through ``template``: the pipeline
    # templates the prompt but encodes its empty negative prompt bare (Lumina2Pipeline's
    # system prompt), and a dropped caption (data.caption_dropout) trains that branch.
    template_empty: bool = True
    # The pipeline lower-cases and strips each caption before templating it (SanaPipeline's
    # _text_preprocessing without clean_caption).
    lower: bool = False
    # The template's text before the caption is an instruction the text encoder reads and
    # the conditioning drops but for its first and last token (SanaPipeline's complex human
    # instruction and select_index): the tokenizer counts it (raylora.data.tokenize), every
    # caption gets that many tokens more, and the data stage marks the dropped ones 2 in the
    # attention mask (``instruction_conditioning``).
    instruction: bool = False

    def length(self, tokenizer_max: int, max_sequence_length: int | None = None) -> int:
        """Tokens per caption: the content length (``model.max_sequence_length`` for a
        long-context encoder, else ``max_length``, else the tokenizer's) + the template's."""
        n = max_sequence_length if self.long_context and max_sequence_length else self.max_length
        return (n or tokenizer_max) + self.drop


class Cond(dict):
    """Named conditioning tensors, batch first (``{"prompt_embeds": [B, L, D], ...}``)."""

    def select(self, index: torch.Tensor) -> "Cond":
        return Cond({k: v[index] for k, v in self.items()})

    def to(self, device=None, dtype=None) -> "Cond":
        # Integer tensors (masks) keep their dtype.
        return Cond({k: v.to(device=device, dtype=dtype if v.is_floating_point() else None)
                     for k, v in self.items()})

    @staticmethod
    def cat(conds: list["Cond"]) -> "Cond":
        """One after the other; caption columns of batches encoded apart (a family that
        ``cuts_captions``) zero-padded to the longest, as the cached rows are where they
        meet (``raylora.data.captions.concat_rows``)."""
        from raylora.data.captions import PADDED_CAPTIONS

        def joined(k: str) -> torch.Tensor:
            parts = [c[k] for c in conds]
            if k in PADDED_CAPTIONS and all(p.ndim > 1 for p in parts):
                n = max(p.shape[1] for p in parts)
                parts = [p if p.shape[1] == n else torch.nn.functional.pad(
                    p, (0, 0) * (p.ndim - 2) + (0, n - p.shape[1])) for p in parts]
            return torch.cat(parts)

        return Cond({k: joined(k) for k in conds[0]})

    def cut_captions(self) -> "Cond":
        """``raylora.data.captions.cut_captions`` of these rows: rows selected out of a
        longer padded batch (the held-out rows' evaluation chunks) as they would be encoded
        together. Reads the mask on the host."""
        from raylora.data.captions import cut_captions

        return Cond(cut_captions(self))


def references(cond: Cond) -> list[torch.Tensor]:
    """An edit sample's input latents in order (``reference_latents``,
    ``reference_latents_2``, ...; data.control_inputs of them), [] for text to image. Cond
    holds tensors only (``select``, ``to``, ``cat``), so each input is a key of its own."""
    return control_values(cond, "reference_latents")


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` → ``[B, (h/2)·(w/2), 4C]``: 2×2 patches as tokens (Flux, Qwen-Image)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack_2x2`` for latents of height ``h`` and width ``w``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def inputs_at(image, height: int | None, width: int | None) -> dict:
    """An edit pipeline's ``image`` argument: the input (a list of several: data.control_
    inputs) in RGB, each resized to the output's size when one is given, as training pairs
    an input with its target; without a size, as given (the pipeline's own choice)."""
    if image is None:
        return {}
    images = [x.convert("RGB") for x in (image if isinstance(image, list) else [image])]
    if height and width:
        images = [x.resize((width, height)) for x in images]
    return {"image": images if isinstance(image, list) else images[0]}


def grid_ids(rows: int, cols: int, axes: int, device=None) -> torch.Tensor:
    """Position ids ``[rows·cols, axes]`` (fp32) of a token grid in row-major order: axis 1
    the row, axis 2 the column, every other axis 0 (Flux.1's 3-axis and Flux.2's 4-axis
    image ids). Built on ``device``, where the model runs: no host-to-device copy a step."""
    ids = torch.zeros(rows, cols, axes, device=device)
    ids[..., 1] += torch.arange(rows, device=device)[:, None]
    ids[..., 2] += torch.arange(cols, device=device)[None, :]
    return ids.reshape(-1, axes)


def embedded_guidance(model, guidance: float, batch: int, device) -> torch.Tensor | None:
    """The ``guidance`` input of a guidance-distilled transformer (Flux.1-dev, Flux.2
    [dev]): the scale for each of ``batch`` rows, fp32 as their pipelines pass it; None for
    a model without a guidance embedding (schnell, Klein). DDP wraps the model: its config
    is on the module inside."""
    if not getattr(model, "module", model).config.guidance_embeds:
        return None
    return torch.full((batch,), float(guidance), device=device, dtype=torch.float32)


def per_channel_stats(vae_config: dict) -> tuple[list, list]:
    """(shift, scale) of a video VAE with per-channel ``latents_mean``/``latents_std``
    (Qwen-Image's, Wan's): normalised = (z − mean) / std, as their pipelines' decode undoes."""
    return list(vae_config["latents_mean"]), [1.0 / s for s in vae_config["latents_std"]]


def encode_one_frame(vae, pixels: torch.Tensor) -> torch.Tensor:
    """A video VAE's posterior of a still image as one frame: ``[B, 3, H, W]`` →
    ``[B, 3, 1, H, W]`` → ``[B, 2C, 1, h, w]`` → the frame axis dropped."""
    return vae.encode(pixels.unsqueeze(2)).latent_dist.parameters.squeeze(2)


def language_model(module):
    """A vision-language model's language model (``module.model.language_model``: Mistral 3's,
    Qwen3-VL's), or ``module`` itself when it is not one."""
    return getattr(getattr(module, "model", None), "language_model", module)


def llm_conditioning(encoder, batch: dict[str, torch.Tensor], layer: int, drop: int = 0,
                     **inputs) -> Cond:
    """A causal LM's hidden state ``layer`` over right-padded captions (``input_ids``,
    ``attention_mask``), its first ``drop`` (template) positions dropped, zero past each
    caption: ``prompt_embeds`` [B, L, D] and ``prompt_embeds_mask`` [B, L] (Qwen-Image,
    Z-Image). Cutting the padding after the longest caption changes no hidden state under
    a causal LM and saves encoding up to ~1000 pad tokens per caption. ``inputs``: the
    encoder's other inputs (a vision-language model's ``pixel_values``, Qwen-Image-Edit)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = int(mask.sum(1).max())
    ids, mask = ids[:, :n], mask[:, :n]
    hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                     **inputs).hidden_states[layer]
    mask = mask[:, drop:]
    # The pipelines pad with zeros past each caption: the same here.
    emb = hidden[:, drop:] * mask.unsqueeze(-1).to(hidden.dtype)
    return Cond(prompt_embeds=emb, prompt_embeds_mask=mask.long())


# The attention-mask value of an instruction token the conditioning drops (TextInput.instruction).
DROPPED = 2


def instruction_conditioning(encoder, batch: dict[str, torch.Tensor]) -> Cond:
    """An encoder's last hidden state over right-padded captions behind an instruction
    (``input_ids``; ``attention_mask`` 1 for a token, 0 for padding, ``DROPPED`` for an
    instruction token the conditioning drops), the dropped positions removed and the rest
    kept in order: ``prompt_embeds`` [B, L, D], zero past each caption, and
    ``prompt_embeds_mask`` [B, L] (Sana). The pipeline pads to the instruction's length +
    max_sequence_length and keeps the first token and the last max_sequence_length − 1
    positions; here the padding after the longest caption is cut first, which changes no
    kept hidden state under Gemma's causal attention, and the transformer sees no masked
    position. On meta ids (a memory estimate) nothing is dropped: a few tokens more."""
    ids, marks = batch["input_ids"], batch["attention_mask"]
    attend = (marks > 0).long()
    if not ids.is_meta:
        n = int(attend.sum(1).max())
        ids, marks, attend = ids[:, :n], marks[:, :n], attend[:, :n]
    hidden = encoder(input_ids=ids, attention_mask=attend)[0]
    if not ids.is_meta:
        # A stable sort moves the dropped positions behind the rest, order kept.
        order = torch.sort((marks == DROPPED).int(), dim=1, stable=True).indices
        hidden = hidden.gather(1, order.unsqueeze(-1).expand_as(hidden))
        marks = marks.gather(1, order)
        n = int((marks == 1).sum(1).max())
        hidden, marks = hidden[:, :n], marks[:, :n]
    mask = (marks == 1).long()
    return Cond(prompt_embeds=hidden * mask.unsqueeze(-1).to(hidden.dtype), prompt_embeds_mask=mask)


def checkpointed(forward):
    """``forward`` recomputed in backward when grad is on (non-reentrant, so LoRA weights
    inside get gradients though the block's inputs need none), every argument passed."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def checkpoint_each(blocks, enable: bool = True) -> None:
    """Each of ``blocks`` recomputes its own forward in backward (``enable``), or stops: for
    a model whose own gradient-checkpointing switch skips blocks or drops an input. Set on
    the instances, so module names (LoRA keys), FSDP's and compile's wrapping of the blocks
    stay as they are."""
    for block in blocks:
        if enable:
            block.forward = checkpointed(type(block).forward.__get__(block))
        else:
            block.__dict__.pop("forward", None)


def import_class(library: str, name: str):
    """A class named in ``model_index.json`` (``["diffusers", "AutoencoderKL"]``)."""
    return getattr(importlib.import_module(library), name)


class Family:
    """The SD-style defaults; a family module subclasses and overrides."""

    name: ClassVar[str]
    # model_index.json _class_name values that are this family
    class_names: ClassVar[tuple[str, ...]]
    pipeline: ClassVar[str]  # the stock diffusers pipeline that loads the adapter
    # Its pipeline component / subfolder, and the component its adapter is saved under.
    denoiser: ClassVar[str] = "transformer"
    # A pipeline whose sampling hands σ ranges to different denoisers (Wan 2.2 A14B's
    # experts): ``model.expert`` value → the pipeline component it trains. The stock
    # loaders save every expert's adapter under ``denoiser`` and take the expert at load
    # (``lora_load_kwargs``). Empty: one denoiser, trained over all of σ.
    experts: ClassVar[dict[str, str]] = {}
    text: ClassVar[tuple[TextInput, ...]]
    lora_targets: ClassVar[tuple[str, ...]]  # default lora.target_modules
    text_encoder_lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "out_proj")
    # Repeated blocks: what train.compile=regional compiles, and FSDP's shard units.
    repeated_blocks: ClassVar[tuple[str, ...]]
    patch: ClassVar[int] = 1  # latent pixels per token side (2 for 2×2-patched DiTs)
    default_guidance_scale: ClassVar[float] = 7.5  # sampling's, when the config leaves it unset
    # The prompt of classifier-free guidance's unconditional branch as raylora samples the
    # family (previews, the model card): what data.caption_dropout trains on.
    empty_caption: ClassVar[str] = ""
    # The stock pipeline shrinks an input image (data.control_images) of more pixels than
    # this to about this many, its aspect kept, cut to its latent grid (Flux.2: 1024²):
    # training encodes the input as the pipeline will (``reference_pixels``). None: kept.
    reference_max_area: ClassVar[int | None] = None
    # The most model.max_sequence_length the stock pipeline's call accepts (it raises
    # above it: 512 for T5 pipelines, 1024 for Qwen-Image's); None: it sets no bound.
    max_sequence_limit: ClassVar[int | None] = None
    # Its caption embedding reads the sample's input image too (a vision-language text
    # encoder): a dropped caption's embedding differs per image, so a latent cache, which
    # encodes the empty prompt once, cannot drop captions.
    caption_reads_images: ClassVar[bool] = False
    # encode_text cuts its caption columns (``PADDED_CAPTIONS``) after the longest caption
    # of the batch it encodes (llm_conditioning, instruction_conditioning), so they differ
    # in length from batch to batch. Cached rows, zero-padded to the longest of whatever
    # they were encoded or stacked with, are cut back to their own batch's longest
    # (raylora.data.captions.cut_captions), as the uncached batch would be. False: one
    # length always (a pipeline that keeps every padding position), nothing is cut.
    cuts_captions: ClassVar[bool] = False
    # A video pipeline trained and sampled as single frames (Wan): its call takes
    # num_frames=1 and returns ``.frames`` (a list of frames per prompt) instead of ``.images``.
    video: ClassVar[bool] = False
    # The denoiser takes a reference image beside the noisy latents (an image-edit model:
    # Flux.1 Kontext, Flux.2): data.control_images trains it on (input, edited) pairs, the input's
    # latents arriving in the conditioning as ``reference_latents`` [B, C, h, w], and its
    # pipeline takes the input as ``image``. False: data.control_images is refused.
    reference_image: ClassVar[bool] = False
    # Input images a sample may bring (data.control_inputs): the pipeline's ``image`` as a
    # list, their latents ``reference_latents``, ``reference_latents_2``, ... (``references``).
    # 1 where the pipeline takes one input (Kontext).
    max_references: ClassVar[int] = 1
    # The smallest side the pipeline takes an input image at (Flux.2's image processor:
    # 64 px): previews of validation.control_images at a smaller data.resolution are
    # refused before Ray, not at the first preview.
    min_reference_side: ClassVar[int] = 0
    # The system prompt its pipeline writes before every caption, by default (Lumina2Pipeline's
    # system_prompt); model.system_prompt replaces it (``texts``, ``prompt_kwargs``). None:
    # the pipeline takes none, and model.system_prompt is refused.
    system_prompt: ClassVar[str | None] = None
    # Its pipeline samples only from an input image (Qwen-Image-Edit): data.control_images
    # is required, and validation.control_images with validation.prompts.
    reference_required: ClassVar[bool] = False
    # cuDNN's SDPA kernels: off for the DiTs. On an H100 (torch 2.11, CUDA 13) the Flux.1-dev
    # step failed in backward inside cuDNN's attention graph (illegal memory access;
    # bench/RESULTS.md 2026-11-23); flash / memory-efficient SDPA ran it at 38-40 % MFU.
    cudnn_sdpa: ClassVar[bool] = False
    # train.channels_last's default. Off everywhere until a GPU run shows it helps a family
    # (bench/gpu_throughput.py's `cl` variant measures it).
    channels_last: ClassVar[bool] = False
    kohya_prefix: ClassVar[str] = "lora_unet_"
    # Folders the encoding reads besides components()' encoders and tokenizers
    # (Qwen-Image-Edit's text encoder sees the input images through processor/'s image
    # processor): the latent cache's key hashes them with the encoders' files.
    encoder_extras: ClassVar[tuple[str, ...]] = ()
    # kohya/ComfyUI export: module paths as sd-scripts names them (UNet families); a DiT
    # family sets this with ``kohya_rules``, its keys mapped onto its reference checkpoint's
    # layout (the names ComfyUI matches). A new family module without them is refused.
    kohya_export: ClassVar[bool] = False
    # DiT families: denoiser module → reference-checkpoint module (raylora.checkpoint.kohya.Rule);
    # empty: the denoiser's own module paths (UNet families).
    kohya_rules: ClassVar[tuple] = ()
    kohya_network: ClassVar[str] = "networks.lora"  # ss_network_module: sd-scripts' module
    # lora.init_from of a kohya file: how the stock pipeline's converter loads a fused module
    # (one kohya layer of k diffusers layers, ``kohya_rules``' ``fused``) of rank R:
    # "split" into k layers of rank R / k where its up is block-diagonal (raylora's export:
    # rank k·r by design), else R (sd-scripts trains the fused layer whole); "whole": each
    # part gets the whole rank R, its own rows of the up (raylora.model.lora_init cuts
    # them back to r); None: the converter reads no fused module of this family's.
    kohya_fused_load: ClassVar[str | None] = None
    # lora.variant lokr/loha: also write the LyCORIS file (``lora_unet_`` + the denoiser's
    # module path, "." → "_"), the names LyCORIS' kohya loader and ComfyUI's UNet key map
    # read. Off for the DiTs: their loaders expect reference-checkpoint names with fused
    # q/k/v, and a Kronecker factor of one projection cannot be fused with another's.
    lycoris_file: ClassVar[bool] = False
    description: ClassVar[str] = ""
    # The adapter file's key style, as diffusers' own training script for the family writes
    # it: UNet scripts convert peft's lora_A/lora_B names to the older lora.down/lora.up;
    # the DiT scripts save peft's names unchanged. The stock loader decides from the first
    # key whether to convert, so a file must not mix the two styles.
    legacy_lora_keys: ClassVar[bool] = False

    # ---- detection and loading -------------------------------------------------------

    @classmethod
    def components(cls) -> tuple[str, ...]:
        """Folders a pipeline of this family must have."""
        names = [cls.denoiser, "vae", "scheduler"]
        for t in cls.text:
            names += [t.encoder, t.tokenizer]
        return tuple(dict.fromkeys(names))

    @classmethod
    def lora_components(cls) -> tuple[str, ...]:
        """The components the stock pipeline's ``load_lora_weights`` accepts."""
        return tuple(cls.pipeline_class()._lora_loadable_modules)

    @classmethod
    def text_encoder_lora(cls) -> tuple[str, ...]:
        """Text encoders that can train LoRA and be loaded back by the stock pipeline."""
        return tuple(t.encoder for t in cls.text if t.encoder in cls.lora_components())

    @classmethod
    def default_lora_targets(cls, denoiser) -> tuple[str, ...]:
        """``lora.target_modules``' default for this ``denoiser``: ``lora_targets``. A family
        whose default names modules by block index (peft matches name suffixes) overrides."""
        return cls.lora_targets

    @classmethod
    def named_lora_targets(cls) -> tuple[str, ...]:
        """The default targets as the model card names them, without a denoiser at hand:
        ``default_lora_targets`` with block indices as ``*``."""
        return cls.lora_targets

    @classmethod
    def trained_component(cls, expert: str | None = None) -> str:
        """The pipeline component (folder, pipeline attribute) a run with ``model.expert``
        ``expert`` trains."""
        return cls.experts[expert] if expert else cls.denoiser

    @classmethod
    def sigma_range(cls, index: dict, expert: str | None, where: str,
                    key: str = "model.expert") -> tuple[float, float]:
        """The σ range the trained denoiser samples in this pipeline (``model_index.json``
        ``index``): all of it for one denoiser. Refuses, naming ``key`` and ``where``
        before anything is loaded, an expert for a pipeline without experts, and no expert
        for one with them."""
        if expert is not None:
            raise ValueError(f"{key}: {expert}: {where} is a {cls.name} pipeline with one "
                             f"denoiser ({cls.denoiser}); leave {key} unset")
        return (0.0, 1.0)

    @classmethod
    def lora_load_kwargs(cls, expert: str | None = None) -> dict:
        """What the stock pipeline's ``load_lora_weights`` needs besides the adapter to put
        it into the denoiser that ``expert`` trained."""
        return {}

    @classmethod
    def pipeline_with(cls, model, expert: str | None = None) -> dict:
        """``from_pretrained`` arguments that build the stock pipeline around the trained
        ``model`` for previews (a pipeline of experts: the trained one alone, see Wan)."""
        return {cls.trained_component(expert): model}

    @classmethod
    def pipeline_class(cls):
        import diffusers

        return getattr(diffusers, cls.pipeline)

    @classmethod
    def stock_components(cls, path: str, revision: str | None = None) -> dict:
        """Components raylora hands the stock pipeline in place of the folder's own when it
        loads one itself (previews, class images, ``raylora sample``): none, except where
        the folder's class needs what raylora does not (Flux.2 [dev]'s tokenizer).
        ``revision``: a hub model's (``model.revision``)."""
        return {}

    @classmethod
    def load_pipeline(cls, path: str, **kw):
        """The stock pipeline from the folder ``path``: ``from_pretrained(path, **kw)`` with
        ``stock_components`` in place of the folder's own. (Those are set after loading:
        ``from_pretrained`` refuses a component of another class than the folder names.)

        Without the safety checker SD 1.x/2.x repos list, whoever loads it (previews, class
        images, ``raylora sample``): it would be downloaded (1.2 GB for SD 1.5) and turn the
        images it flags black, so one adapter drew other pictures in each."""
        if "safety_checker" in cls.pipeline_class()._optional_components:
            kw = {"safety_checker": None, "requires_safety_checker": False, **kw}
        own = {k: v for k, v in cls.stock_components(path, kw.get("revision")).items() if k not in kw}
        pipe = cls.pipeline_class().from_pretrained(path, **{k: None for k in own}, **kw)
        if own:
            pipe.register_modules(**own)
        return pipe

    # ---- sampling with the stock pipeline ---------------------------------------------

    @classmethod
    def image_call(cls) -> dict:
        """Call arguments that make the stock pipeline give still images as PIL images."""
        return {"num_frames": 1, "output_type": "pil"} if cls.video else {}

    @classmethod
    def images(cls, pipe, **call) -> list:
        """The stock pipeline ``pipe`` called with ``call`` plus ``image_call()``: one PIL
        image per prompt (a video pipeline's: the first frame of each video)."""
        out = pipe(**call, **cls.image_call(), **cls.size_kwargs(call.get("height"), call.get("width")))
        return [frames[0] for frames in out.frames] if cls.video else list(out.images)

    @classmethod
    def size_kwargs(cls, height: int | None, width: int | None) -> dict:
        """Call arguments besides ``height``/``width`` that make the stock pipeline sample at
        that size (``images`` adds them); most pipelines need none."""
        return {}

    @classmethod
    def reference_kwargs(cls, image, height: int | None, width: int | None) -> dict:
        """The stock pipeline's call arguments that give it ``image`` (a PIL image, a list
        of them for several inputs, or None) as its reference for an output of ``height`` ×
        ``width`` (None: the size the pipeline picks); a family without a reference input
        takes none."""
        if image is None:
            return {}
        raise ValueError(f"{cls.name}: {cls.pipeline} takes no input image")

    @classmethod
    def texts(cls, references: int = 0, system_prompt: str | None = None) -> tuple[TextInput, ...]:
        """``text`` for captions of samples with ``references`` input images (the data
        stage tokenizes them so) behind ``system_prompt`` (model.system_prompt; None: the
        pipeline's own), the last text input's template then ``system_template``'s: a
        family whose template names its inputs (Qwen-Image-Edit's "Picture 1: ...")
        overrides this."""
        if system_prompt is None or cls.system_prompt is None:
            return cls.text
        *rest, last = cls.text
        return (*rest, dataclasses.replace(last, template=cls.system_template(system_prompt)))

    @classmethod
    def system_template(cls, system_prompt: str) -> str:
        """The caption template behind ``system_prompt``, for a family with a system
        prompt (``texts``)."""
        raise NotImplementedError(f"{cls.name} takes no system prompt")

    @classmethod
    def prompt_kwargs(cls, system_prompt: str | None = None) -> dict:
        """The stock pipeline's call arguments for model.system_prompt ``system_prompt``:
        none when it is unset (the pipeline's own), ``system_prompt`` for a family that
        takes one."""
        return {} if system_prompt is None or cls.system_prompt is None else {"system_prompt": system_prompt}

    @classmethod
    def reference_pixels(cls, pixels: torch.Tensor, vae) -> torch.Tensor:
        """Control pixels ``[B,3,H,W]`` (uint8, or float) as the stock pipeline hands its
        input image to the VAE: above ``reference_max_area``, scaled to that area (as
        ``Flux2ImageProcessor._resize_to_target_area``) and centre-cropped to a multiple
        of the latent grid. Trained at 1536² the reference of a Flux.2 edit was a grid the
        pipeline never gives it (it samples that input at 1 MP)."""
        area, (h, w) = cls.reference_max_area, pixels.shape[-2:]
        if area is None or h * w <= area or pixels.is_meta:
            return pixels
        import math

        scale = math.sqrt(area / (h * w))
        nh, nw = int(h * scale), int(w * scale)
        grid = cls.vae_factor(dict(vae.config))
        ch, cw = nh // grid * grid, nw // grid * grid
        out = torch.nn.functional.interpolate(pixels.float(), size=(nh, nw), mode="bicubic",
                                              antialias=True)
        if pixels.dtype == torch.uint8:
            out = out.round().clamp(0, 255).to(torch.uint8)
        top, left = (nh - ch) // 2, (nw - cw) // 2
        return out[..., top:top + ch, left:left + cw]

    @classmethod
    def length_kwargs(cls, max_sequence_length: int | None = None) -> dict:
        """The stock pipeline's call arguments for model.max_sequence_length: a run that
        set it trained on captions of that length (Flux.1-schnell's 256, say), so its
        samples encode them so too; none when unset (the pipeline's default is the
        family's) or when the pipeline's call takes no length."""
        if max_sequence_length is None or not any(t.long_context for t in cls.text):
            return {}
        call = inspect.signature(import_class("diffusers", cls.pipeline).__call__)
        return ({"max_sequence_length": max_sequence_length}
                if "max_sequence_length" in call.parameters else {})

    @classmethod
    def image_code(cls) -> str:
        """How ``images`` reads a call's output, as Python source for a model card: what
        follows ``pipe(...)`` for its first image."""
        return ".frames[0][0]" if cls.video else ".images[0]"

    @classmethod
    def resolve_guidance(cls, scale: float | None) -> float:
        """``scale``, or the family's default when it is None (the config keys' default)."""
        return float(cls.default_guidance_scale if scale is None else scale)

    @classmethod
    def guidance_kwargs(cls, scale: float | None = None, batch: int = 1) -> dict:
        """The stock pipeline's call arguments that guide a call of ``batch`` prompts at
        ``scale`` (None: the family's default). The SD-style pipelines run classifier-free
        guidance from ``guidance_scale`` (Flux.1-dev feeds it to its guidance embedding);
        a family whose pipeline guides through other arguments overrides this."""
        return {"guidance_scale": cls.resolve_guidance(scale)}

    @classmethod
    def load_component(cls, path: str, index: dict, component: str, dtype=None, **kw):
        """``component`` by the class its folder's ``model_index.json`` names."""
        library, class_name = index[component][:2]
        klass = import_class(library, class_name)
        if dtype is not None:
            kw["torch_dtype"] = dtype
        module = klass.from_pretrained(path, subfolder=component, **kw)
        return cls.adapt_component(component, module)

    @classmethod
    def adapt_component(cls, component: str, module):
        """``component`` as loaded → as raylora uses it (Flux.2 [klein] drops the text
        encoder's layers it never reads). Applied to the real and the meta (memory
        preflight) components alike."""
        return module

    @classmethod
    def checkpoint_blocks(cls, denoiser, enable: bool = True) -> None:
        """Recompute the denoiser's block activations in backward (``enable``), or stop:
        diffusers' own switch (non-reentrant ``torch.utils.checkpoint``). A family whose
        model drops an input on that path overrides this."""
        if enable:
            denoiser.enable_gradient_checkpointing()
        else:
            denoiser.disable_gradient_checkpointing()

    @classmethod
    def set_attention(cls, model, kind: str) -> None:
        """``model.attention``. diffusers' transformer attention already runs on
        ``F.scaled_dot_product_attention``; the plain-matmul processor exists for UNets."""
        if kind != "sdpa":
            raise ValueError(f"model.attention: {kind} is for UNet families (sd, sdxl); "
                             f"{cls.name} always uses sdpa")

    # ---- latents ----------------------------------------------------------------------

    @staticmethod
    def latent_stats(vae_config: dict) -> tuple[Any, Any]:
        """(shift, scale) with normalised latents = (z − shift) · scale; floats or
        per-channel lists. ``AutoencoderKL``: its shift_factor (None = 0) and scaling_factor."""
        return float(vae_config.get("shift_factor") or 0.0), float(vae_config.get("scaling_factor", 0.18215))

    @staticmethod
    def vae_factor(vae_config: dict) -> int:
        """Pixels per latent side."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    @staticmethod
    def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
        """pixels ``[B, 3, H, W]`` in [-1, 1] → posterior parameters ``[B, 2C, h, w]``
        (mean ‖ logvar)."""
        return vae.encode(pixels).latent_dist.parameters

    # ---- text -------------------------------------------------------------------------

    @classmethod
    def cond_keys(cls) -> tuple[str, ...]:
        """The conditioning tensors (= latent-cache columns) of this family."""
        return ("prompt_embeds",)

    @classmethod
    def caption_keys(cls) -> tuple[str, ...]:
        """The conditioning tensors that depend on the caption alone (not on the image's
        size or crop): what a dropped caption's embedding replaces in a cached batch."""
        return cls.cond_keys()

    @classmethod
    def encode_text(cls, encoders: list[torch.nn.Module], batch: dict[str, torch.Tensor]) -> Cond:
        """Token ids (and masks) → conditioning. Builds a graph when grad is enabled
        (text-encoder LoRA); frozen callers run it under ``no_grad``."""
        raise NotImplementedError

    @classmethod
    def condition(cls, encoders, batch: dict[str, torch.Tensor]) -> Cond:
        """The conditioning of a raw batch (token ids) or a cached one (embeddings)."""
        keys = cls.cond_keys()
        if all(k in batch for k in keys):
            return Cond({k: batch[k] for k in keys})
        return cls.encode_text(encoders, batch)

    # ---- the denoiser -----------------------------------------------------------------

    @classmethod
    def model_timestep(cls, t: torch.Tensor) -> torch.Tensor:
        """The objective's timestep (int step, or flow σ in (0, 1)) as the model takes it."""
        return t

    @classmethod
    def denoise(cls, model, noisy: torch.Tensor, t: torch.Tensor, cond: Cond, **extra) -> torch.Tensor:
        """The model's prediction for ``noisy`` ``[B, C, h, w]``, same shape."""
        raise NotImplementedError

    @classmethod
    def image_seq_len(cls, latents_shape) -> int:
        """Image tokens the denoiser sees (the dynamic shift depends on it)."""
        return (latents_shape[-2] // cls.patch) * (latents_shape[-1] // cls.patch)

    # ---- adapters ---------------------------------------------------------------------

    @classmethod
    def save_adapter(cls, directory: str, layers: dict[str, dict], metadata: dict[str, dict]) -> None:
        """Write ``pytorch_lora_weights.safetensors`` with the stock pipeline's own saver.
        ``layers``/``metadata``: per component (``transformer``, ``text_encoder``, ...)."""
        kwargs = {f"{c}_lora_layers": sd for c, sd in layers.items()}
        kwargs.update({f"{c}_lora_adapter_metadata": m for c, m in metadata.items()})
        cls.pipeline_class().save_lora_weights(save_directory=directory, safe_serialization=True,
                                               **kwargs)

    @classmethod
    def kohya_state_dict(cls, sd: dict[str, torch.Tensor], alphas: dict[str, float]) -> dict[str, torch.Tensor]:
        """diffusers adapter tensors → kohya/ComfyUI names (see raylora.checkpoint.kohya)."""
        from raylora.checkpoint.kohya import to_kohya, to_kohya_reference

        if cls.kohya_rules:
            return to_kohya_reference(sd, alphas, cls.denoiser, cls.kohya_rules, cls.kohya_names(),
                                      cls.name)
        return to_kohya(sd, alphas, cls.kohya_names())

    @classmethod
    def kohya_version(cls, sd: dict[str, torch.Tensor]) -> dict[str, str]:
        """The base-model metadata sd-scripts writes into a kohya file for this family
        (``ss_base_model_version``, ...), from the adapter's tensors; none where A1111/Forge
        need none to list the file."""
        return {}

    @classmethod
    def kohya_names(cls) -> dict[str, str]:
        """diffusers component prefix → kohya prefix."""
        return {f"{cls.denoiser}.": cls.kohya_prefix, "text_encoder.": "lora_te_"}
