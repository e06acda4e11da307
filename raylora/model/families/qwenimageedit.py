"""Qwen-Image-Edit-2509 / -2511 (``QwenImageEditPlusPipeline``): Qwen-Image's MMDiT, VAE and
Qwen2.5-VL encoder, trained on (input, edited) pairs (``data.control_images``). The input
image reaches the model twice, as the pipeline samples:

* through the text encoder: the caption follows "Picture 1: " and the image's vision tokens
  ("Picture 2: ", ... for data.control_inputs > 1) in the edit chat template (whose first 64 tokens are dropped), the image resized to
  384² px of area at its aspect ratio and read by Qwen2.5-VL's vision tower;
* through the VAE: its 2×2-packed latents follow the noisy tokens in the transformer's
  sequence, each image with its own rope grid (``img_shapes``); the prediction is the
  noisy tokens'.

A text-to-image batch (no control images: the family tests' shared batches) is encoded as
``encode_prompt(image=None)`` encodes one: the template without the picture."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from raylora.config import MAX_CONTROL_INPUTS, control_values
from raylora.model.families.base import (Cond, TextInput, inputs_at, llm_conditioning, pack_2x2,
                                         references, unpack_2x2)
from raylora.model.families.qwenimage import QwenImage

# QwenImageEditPlusPipeline.prompt_template_encode (its start index: DROP) with the prompt
# of one input image before the caption (_get_qwen_prompt_embeds' img_prompt_template)
SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, "
          "size, texture, objects, background), then explain how the user's text instruction "
          "should alter or modify the image. Generate a new image that meets the user's "
          "requirements while maintaining consistency with the original input where "
          "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
DROP = 64


def template(inputs: int) -> str:
    """The caption template of a sample with ``inputs`` input images: "Picture 1: ...",
    "Picture 2: ...", ... before the caption, each with one image slot that ``encode_text``
    widens to that image's vision tokens."""
    return SYSTEM.format("".join(PICTURE.format(k + 1) for k in range(inputs)) + "{}")


TEMPLATE = template(1)


def pipeline_module():
    """diffusers' ``pipeline_qwenimage_edit_plus``: its ``calculate_dimensions``, the area
    its vision tower reads an input at (``CONDITION_IMAGE_SIZE``, 384²) and its VAE input
    area (``VAE_IMAGE_SIZE``). Imported when used: every family module is imported to
    detect a folder's family."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    return pipeline_qwenimage_edit_plus


def condition_size(h: int, w: int) -> tuple[int, int]:
    """(width, height) the pipeline resizes an ``h`` × ``w`` input to for its vision tower."""
    module = pipeline_module()
    return module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, w / h)


@functools.cache
def vision_processor(patch: int, temporal: int, merge: int):
    """Qwen2.5-VL's image processor for an encoder's patching (PIL backend: no torchvision),
    built once per patching: for a text encoder loaded without its folder's processor."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge)


def condition_images(control: torch.Tensor) -> list:
    """uint8 ``[B, 3, H, W]`` input images → what the pipeline hands its processor: each
    resized (Lanczos, as ``VaeImageProcessor.resize``) to ``condition_size``."""
    from PIL import Image

    size = condition_size(*control.shape[-2:])
    return [Image.fromarray(x.permute(1, 2, 0).cpu().numpy()).resize(size, Image.Resampling.LANCZOS)
            for x in control]


def vision_tokens(control_shape, vision_config) -> int:
    """Image tokens the encoder reads for one input of ``control_shape`` (``[..., H, W]``):
    the processor's grid over the condition size (``smart_resize``), merged 2×2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    cw, ch = condition_size(*control_shape[-2:])
    p = vision_config.patch_size * vision_config.spatial_merge_size
    rh, rw = smart_resize(ch, cw, factor=p)
    return (rh // vision_config.patch_size) * (rw // vision_config.patch_size) // vision_config.spatial_merge_size ** 2


def splice(ids: torch.Tensor, mask: torch.Tensor, at: int, span: int, fill: torch.Tensor | None):
    """Token columns with ``ids[:, at:at + span]`` replaced by the columns ``fill``
    (``[k]``; None: removed), the mask ones there."""
    head, tail = ids[:, :at], ids[:, at + span:]
    if fill is None:
        return torch.cat([head, tail], 1), torch.cat([mask[:, :at], mask[:, at + span:]], 1)
    b = ids.shape[0]
    new = fill.to(ids.device).expand(b, -1)
    return (torch.cat([head, new, tail], 1),
            torch.cat([mask[:, :at], torch.ones_like(new, dtype=mask.dtype), mask[:, at + span:]], 1))


class QwenImageEdit(QwenImage):
    name = "qwenimageedit"
    class_names = ("QwenImageEditPlusPipeline",)
    pipeline = "QwenImageEditPlusPipeline"
    # Tokens per caption: the pipeline truncates nothing (its tokenizer_max_length, 1024,
    # is a bound raylora pads to, model.max_sequence_length sets it), the template and one
    # image slot (expanded to the image's tokens in encode_text) included.
    text = (TextInput("text_encoder", "tokenizer", "input_ids", max_length=1024,
                      template=TEMPLATE, mask_key="attention_mask", long_context=True, drop=DROP),)
    reference_image = True
    encoder_extras = ("processor",)  # its image processor sizes the text encoder's inputs
    caption_reads_images = True  # Qwen2.5-VL reads the input image with the caption
    # QwenImageEditPlusPipeline samples only from an input image (it reads its size first)
    reference_required = True
    # Its image list: "Picture k" in the prompt, input k's latents after input k-1's
    max_references = MAX_CONTROL_INPUTS
    description = "Qwen-Image-Edit-2509/2511 (Qwen-Image on edit pairs, Qwen2.5-VL reads the input)"

    @classmethod
    def load_pipeline(cls, path: str, **kw):
        # The processor goes in as the pipeline is built: the folder's is a
        # Qwen2VLProcessor, which transformers 5 builds only with torchvision (its video
        # processor); edit_processor reads the same files without it.
        kw.setdefault("processor", edit_processor(path, kw.get("revision")))
        return cls.pipeline_class().from_pretrained(path, **kw)

    @classmethod
    def load_component(cls, path: str, index: dict, component: str, dtype=None, **kw):
        module = super().load_component(path, index, component, dtype, **kw)
        if component == "text_encoder" and "processor" in index:
            # The pipeline reads its input images with the folder's image processor (its
            # mean, std, pixel bounds), and so does training: one built from the vision
            # tower's patching alone has the defaults, which a fine-tune's folder may not.
            module.raylora_image_processor = folder_image_processor(path, kw.get("revision"))
        return module

    @classmethod
    def reference_kwargs(cls, image, height: int | None, width: int | None) -> dict:
        # Each input resized to the output's size, as training pairs it with its target:
        # kept at its own aspect (input_area only matches the area), a 2:1 input beside a
        # square output reached the VAE and the text encoder at an aspect training never
        # gave them. No size: the pipeline's own choice.
        return inputs_at(image, height, width)

    @classmethod
    def texts(cls, references: int = 0, system_prompt: str | None = None) -> tuple[TextInput, ...]:
        # One picture in the template when a batch may have none: a text-only batch has it
        # taken out again (encode_text), as encode_prompt(image=None) encodes none.
        return cls.text if references <= 1 else (dataclasses.replace(cls.text[0], template=template(references)),)

    @classmethod
    def images(cls, pipe, **call) -> list:
        # The pipeline VAE-encodes its input at 1024² px of area whatever the output's size;
        # raylora trains it at the target's size, and samples (previews, raylora sample) so.
        with input_area(call.get("height"), call.get("width")):
            return super().images(pipe, **call)

    @classmethod
    def encode_text(cls, encoders, batch) -> Cond:
        (te,) = encoders
        vc = te.config.vision_config
        ids, mask = batch["input_ids"], batch["attention_mask"]
        controls = control_values(batch, "control_values")  # in input order (data.control_inputs)
        pad = torch.tensor([te.config.image_token_id])
        # Where the pictures' slots are (the template puts them at the same places in every
        # caption, before it) and where the last picture ends; none for ids without them (a
        # memory estimate's: meta or all zeros).
        slots = [] if ids.is_meta else (ids[0] == te.config.image_token_id).nonzero()[:, 0].tolist()
        ends = [] if ids.is_meta else (ids[0] == te.config.vision_end_token_id).nonzero()[:, 0].tolist()
        if not controls:  # text to image: the template without the pictures
            ids, mask = splice(ids, mask, DROP, ends[-1] + 1 - DROP if ends else 0, None)
            return llm_conditioning(te, {"input_ids": ids, "attention_mask": mask}, layer=-1, drop=DROP)
        if not slots or controls[0].is_meta:
            # A memory estimate: the caption as long as with the images' tokens.
            n = vision_tokens(controls[0].shape, vc)
            ids, mask = splice(ids, mask, DROP, 1, pad.repeat(n * len(controls)))
            return llm_conditioning(te, {"input_ids": ids, "attention_mask": mask}, layer=-1, drop=DROP)
        if len(slots) != len(controls):
            raise ValueError(f"qwenimageedit: captions tokenized with {len(slots)} picture(s) for "
                             f"{len(controls)} input image(s) a sample (data.control_inputs)")
        processor = getattr(te, "raylora_image_processor", None)
        if processor is None:
            processor = vision_processor(vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
        # Row by row, each row's pictures in order: the order the encoder fills the slots in.
        images = [x for row in zip(*(condition_images(c) for c in controls)) for x in row]
        vision = processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]
        # A batch's inputs share their size (their targets' bucket), so every picture slot
        # widens alike. The count is the processor's: its pixel bounds may resize.
        counts = (grid.prod(-1) // vc.spatial_merge_size ** 2).tolist()
        n = counts[0]
        if counts != [n] * len(counts):
            raise RuntimeError(f"qwenimageedit: vision tokens {counts} for inputs of "
                               f"{tuple(controls[0].shape[-2:])} px: one count expected")
        for at in reversed(slots):  # from the last, so the earlier slots stay where they are
            ids, mask = splice(ids, mask, at, 1, pad.repeat(n))
        dtype = next(te.parameters()).dtype
        return llm_conditioning(te, {"input_ids": ids, "attention_mask": mask}, layer=-1, drop=DROP,
                                pixel_values=vision["pixel_values"].to(ids.device, dtype),
                                image_grid_thw=grid.to(ids.device))

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, **extra) -> torch.Tensor:
        b, _, h, w = noisy.shape
        tokens, shapes = pack_2x2(noisy), [(1, h // 2, w // 2)]
        for ref in references(cond):  # each input's tokens after the noisy ones, a grid each
            tokens = torch.cat([tokens, pack_2x2(ref.to(noisy.dtype))], dim=1)
            shapes.append((1, ref.shape[-2] // 2, ref.shape[-1] // 2))
        out = model(hidden_states=tokens, encoder_hidden_states=cond["prompt_embeds"],
                    encoder_hidden_states_mask=cond["prompt_embeds_mask"],
                    timestep=t.to(noisy.dtype), img_shapes=[shapes] * b, return_dict=False)[0]
        return unpack_2x2(out[:, : (h // 2) * (w // 2)], h, w)


@contextlib.contextmanager
def input_area(height: int | None, width: int | None):
    """The pipeline's VAE input area (``VAE_IMAGE_SIZE``, a module constant) set to
    ``height`` × ``width`` for the block; unchanged when either is None."""
    module = pipeline_module()
    if height is None or width is None:
        yield
        return
    before = module.VAE_IMAGE_SIZE
    module.VAE_IMAGE_SIZE = height * width
    try:
        yield
    finally:
        module.VAE_IMAGE_SIZE = before


def edit_processor(path: str, revision: str | None = None):
    """The folder's ``processor`` (tokenizer + Qwen2-VL image processor) as a
    ``Qwen2VLProcessor`` for images and captions, built without its video processor (which
    needs torchvision in transformers 5). Its call is the processor's for a batch of
    texts and images: each ``<|image_pad|>`` widened to its image's tokens, in order."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.feature_extraction_utils import BatchFeature

    class EditProcessor(Qwen2VLProcessor):
        def __init__(self, tokenizer, image_processor):  # not ProcessorMixin's: no video
            self.tokenizer, self.image_processor = tokenizer, image_processor
            self.chat_template = getattr(tokenizer, "chat_template", None)

        def __call__(self, text=None, images=None, videos=None, **kw):
            if videos is not None:
                raise ValueError("qwenimageedit: raylora's processor reads images, not videos")
            texts, out = [text] if isinstance(text, str) else list(text), {}
            return_tensors = kw.pop("return_tensors", None)
            if images is not None:
                vision = self.image_processor(images=images, return_tensors=return_tensors)
                out.update(vision)
                merge = self.image_processor.merge_size ** 2
                counts = iter([int(g.prod()) // merge for g in vision["image_grid_thw"]])
                slot = "<|image_pad|>"
                texts = ["".join(part + (slot * next(counts) if i < t.count(slot) else "")
                                 for i, part in enumerate(t.split(slot))) for t in texts]
            out.update(self.tokenizer(texts, return_tensors=return_tensors, **kw))
            return BatchFeature(out, tensor_type=return_tensors)

    tok = AutoTokenizer.from_pretrained(path, subfolder="processor", revision=revision)
    return EditProcessor(tok, folder_image_processor(path, revision))


def folder_image_processor(path: str, revision: str | None = None):
    """The image processor of the folder's ``processor`` (Qwen2-VL's, its PIL backend: the
    default one needs torchvision in transformers 5)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor", revision=revision)


FAMILY = QwenImageEdit
