"""Load an adapter with stock diffusers: in a fresh process that never imports raylora
(``stock_load``), or in this one (``stock_image_change``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# LoRA modules per component: in the adapter file, and wrapped in the pipeline after the
# load (a loader that silently skips keys leaves the second count short). ``into``, where
# defined: file component → the pipeline component it was loaded into (a Wan 2.2 expert's
# "transformer" keys into transformer_2).
COUNT_LOADED = r"""
from safetensors import safe_open
import os
file = adapter if adapter.endswith(".safetensors") else os.path.join(adapter, "pytorch_lora_weights.safetensors")
ENDS = (".lora.down.weight", ".lora.up.weight", ".lora_A.weight", ".lora_B.weight",
        ".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight",
        ".lora_magnitude_vector", ".lora.magnitude_vector")  # DoRA's per-output magnitude
in_file = {}
with safe_open(file, "pt") as f:
    for k in f.keys():
        comp, rest = k.split(".", 1)
        in_file.setdefault(comp, set()).add(next(rest[:-len(e)] for e in ENDS if rest.endswith(e)))
into = globals().get("into") or {}
lora_modules = {c: [len(names), sum(1 for _, m in getattr(pipe, into.get(c, c)).named_modules()
                                   if hasattr(m, "lora_A") and len(m.lora_A))]
                for c, names in in_file.items()}
"""


# What the stock pipeline is handed in place of a component this machine cannot build:
# QwenImage21Pipeline's Qwen3VLProcessor needs torchvision (its video processor), which has
# no CPU build here. Text to image reads captions alone through it; a caption-only subclass
# around the folder's own tokenizer does that (as raylora's qwenimage21.caption_processor,
# written again here: these scripts never import raylora).
#
# QwenImageEditPlusPipeline's Qwen2VLProcessor likewise: it reads images too, which the
# folder's image processor (its PIL backend) does without torchvision; each <|image_pad|>
# is widened to its image's tokens as the processor does (raylora's
# qwenimageedit.edit_processor).
STOCK_COMPONENTS = r"""
def stock_components(pipeline, model):
    if pipeline == "QwenImageEditPlusPipeline":
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor
        from transformers.feature_extraction_utils import BatchFeature
        class EditProcessor(Qwen2VLProcessor):
            def __init__(self, tokenizer, image_processor):
                self.tokenizer, self.image_processor, self.chat_template = tokenizer, image_processor, None
            def __call__(self, text=None, images=None, videos=None, return_tensors=None, **kw):
                assert videos is None
                out, texts = {}, list(text)
                if images is not None:
                    out.update(self.image_processor(images=images, return_tensors=return_tensors))
                    counts = iter(int(g.prod()) // self.image_processor.merge_size ** 2
                                  for g in out["image_grid_thw"])
                    for i, t in enumerate(texts):
                        while "<|image_pad|>" in t:
                            t = t.replace("<|image_pad|>", "<|IMG|>" * next(counts), 1)
                        texts[i] = t.replace("<|IMG|>", "<|image_pad|>")
                out.update(self.tokenizer(texts, return_tensors=return_tensors, **kw))
                return BatchFeature(out, tensor_type=return_tensors)
        return {"processor": EditProcessor(AutoTokenizer.from_pretrained(model, subfolder="processor"),
                                           Qwen2VLImageProcessorPil.from_pretrained(model, subfolder="processor"))}
    if pipeline != "QwenImage21Pipeline":
        return {}
    from transformers import AutoTokenizer, Qwen3VLProcessor
    class CaptionProcessor(Qwen3VLProcessor):
        def __init__(self, tokenizer):
            self.tokenizer, self.chat_template = tokenizer, tokenizer.chat_template
        def __call__(self, text=None, images=None, videos=None, **kw):
            assert images is None and videos is None
            return self.tokenizer(text, **kw)
        def apply_chat_template(self, conversation, **kw):
            return [self.tokenizer.apply_chat_template(conversation, **kw)]
    return {"processor": CaptionProcessor(AutoTokenizer.from_pretrained(model, subfolder="processor"))}
"""


STOCK_LOAD = r"""
import json, sys, torch
from diffusers import StableDiffusionPipeline
model, adapter = sys.argv[1], sys.argv[2]
pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 4, 32, 32, generator=g)
t = torch.tensor([500])
ids = pipe.tokenizer(["a red circle on a blue background"], padding="max_length",
                     max_length=pipe.tokenizer.model_max_length, return_tensors="pt").input_ids
with torch.no_grad():
    enc = pipe.text_encoder(ids)[0]
    before = pipe.unet(x, t, enc).sample
    pipe.load_lora_weights(adapter)
    after = pipe.unet(x, t, enc).sample
""" + COUNT_LOADED + r"""
print(json.dumps({
    "lora_modules": lora_modules,
    "raylora_imported": any(m.split(".")[0] == "raylora" for m in sys.modules),
    "adapters": pipe.get_active_adapters(),
    "max_abs_diff": float((after - before).abs().max()),
    "finite": bool(torch.isfinite(after).all()),
}))
"""


# Every other family: the whole stock pipeline named on the command line (SDXL's two
# encoders and size/crop ids, Flux's packed latents and guidance, SD3's three encoders,
# Qwen-Image's VLM encoder) renders the same seed before and after loading the adapter.
STOCK_LOAD_PIPELINE = r"""
import json, sys, torch
import diffusers
model, adapter, pipeline, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
""" + STOCK_COMPONENTS + r"""
pipe = getattr(diffusers, pipeline).from_pretrained(model, **stock_components(pipeline, model))
pipe.set_progress_bar_config(disable=True)
def render():
    out = pipe(prompt="a red circle on a blue background", num_inference_steps=2, height=64,
               width=64, generator=torch.Generator().manual_seed(0), output_type="pt", **extra)
    return out.frames if hasattr(out, "frames") else out.images  # a video pipeline's frames
with torch.no_grad():
    before = render()
    pipe.load_lora_weights(adapter)
    after = render()
""" + COUNT_LOADED + r"""
print(json.dumps({
    "lora_modules": lora_modules,
    "raylora_imported": any(m.split(".")[0] == "raylora" for m in sys.modules),
    "adapters": pipe.get_active_adapters(),
    "max_abs_diff": float((after - before).abs().max()),
    "finite": bool(torch.isfinite(after).all()),
    "pipeline": type(pipe).__name__,
}))
"""


# The stock pipeline of each family and the call arguments its tiny models need (a short
# text context; SDXL's stock guidance).
PIPELINES = {
    "sd": ("StableDiffusionPipeline", {}),
    "sdxl": ("StableDiffusionXLPipeline", {"guidance_scale": 5.0}),
    "flux": ("FluxPipeline", {"max_sequence_length": 32}),
    # it samples at max_area (1024² by default) whatever height × width say: the tiny's 64²
    "fluxkontext": ("FluxKontextPipeline", {"max_sequence_length": 32, "max_area": 64 * 64}),
    "chroma": ("ChromaPipeline", {"max_sequence_length": 32}),
    "sd3": ("StableDiffusion3Pipeline", {"max_sequence_length": 32}),
    "qwenimage": ("QwenImagePipeline", {"max_sequence_length": 32}),
    "zimage": ("ZImagePipeline", {"max_sequence_length": 32}),
    # its system prompt alone is 25 of the tiny tokenizer's tokens
    "lumina2": ("Lumina2Pipeline", {"max_sequence_length": 64}),
    # it bins sizes to its fixed ones (512² for the tiny) unless told not to (Sana.size_kwargs)
    "sana": ("SanaPipeline", {"max_sequence_length": 32, "use_resolution_binning": False}),
    "flux2klein": ("Flux2KleinPipeline", {"max_sequence_length": 32}),
    # its system message alone is 31 of the tiny tokenizer's tokens
    "flux2": ("Flux2Pipeline", {"max_sequence_length": 64}),
    "wan": ("WanPipeline", {"max_sequence_length": 32, "num_frames": 1}),
    # It keeps every caption token (no max_sequence_length). Its KV cache (on by default)
    # makes every step after the first a decode of the image tokens alone, which agrees
    # with the whole pass to rounding: raylora trains the whole pass, which this compares.
    "qwenimage21": ("QwenImage21Pipeline", {"use_kv_cache": False}),
    # It samples only from an input image (stock_image_change hands it edit_input's). It
    # truncates no caption (the argument is only checked); raylora's 64 tokens after the
    # system prefix hold the picture's prompt and these captions whole.
    "qwenimageedit": ("QwenImageEditPlusPipeline", {"max_sequence_length": 64}),
}


def edit_input(pipeline: str, height: int, width: int):
    """(call arguments, a context factory) for the stock ``pipeline`` to render at ``height``
    × ``width``: none for a text-to-image pipeline; for QwenImageEditPlusPipeline, which
    samples only from an input image, a fixed image and its VAE input area set to the
    output's for the call (raylora's ``qwenimageedit.input_area``, as its previews sample:
    the pipeline encodes the input at 1024² px of area otherwise, about two minutes for the
    tiny VAE on a CPU)."""
    import contextlib
    import functools

    import numpy as np
    from PIL import Image

    if pipeline != "QwenImageEditPlusPipeline":
        return {}, contextlib.nullcontext
    from raylora.model.families.qwenimageedit import input_area

    rgb = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return {"image": Image.fromarray(rgb)}, functools.partial(input_area, height, width)


def stock_pipeline(family: str, model: str):
    """The family's stock pipeline ``from_pretrained(model)`` (with ``STOCK_COMPONENTS``)."""
    import diffusers

    scope: dict = {}
    exec(STOCK_COMPONENTS, scope)
    pipeline = PIPELINES[family][0]
    return getattr(diffusers, pipeline).from_pretrained(model, **scope["stock_components"](pipeline, model))


def stock_load(model: str, adapter: str, workdir, family: str = "sd") -> dict:
    """Run the stock load script from ``workdir`` (an empty directory, so the repo's raylora
    package is not importable by path) and return its JSON line. SD 1.x/2.x compares UNet
    outputs; other families render with their whole stock pipeline (``PIPELINES``)."""
    script = os.path.join(str(workdir), "stock_load.py")
    args = []
    if family != "sd":
        pipeline, extra = PIPELINES[family]
        args = [pipeline, json.dumps(extra)]
    with open(script, "w") as f:
        f.write(STOCK_LOAD if family == "sd" else STOCK_LOAD_PIPELINE)
    proc = subprocess.run(
        [sys.executable, script, model, adapter, *args],
        capture_output=True, text=True, cwd=str(workdir), timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every LoRA module in the file is live in the stock pipeline: [in file, loaded].
    assert res["lora_modules"] and all(a == b > 0 for a, b in res["lora_modules"].values()), res["lora_modules"]
    return res


def stock_image_change(family: str, model: str, adapter, check_pipe=None, expert=None) -> float:
    """In this process: the family's stock pipeline renders the same seed before and after
    ``load_lora_weights(adapter)``; returns the largest pixel change (the image after the
    load must be finite, the adapter active and every LoRA module of the file live in the
    pipeline, as ``stock_load`` checks). ``check_pipe(pipe)`` may inspect the pipeline first.
    ``expert`` (a Wan 2.2 expert): loaded into that expert's transformer with the stock
    loader's own argument, and no other denoiser gets a LoRA module."""
    import numpy as np
    import torch

    extra = PIPELINES[family][1]
    pipe = stock_pipeline(family, model)
    pipe.set_progress_bar_config(disable=True)
    if check_pipe is not None:
        check_pipe(pipe)
    given, area = edit_input(PIPELINES[family][0], 64, 64)
    kw = dict(num_inference_steps=2, height=64, width=64, output_type="np", **extra, **given)

    def image():
        g = torch.Generator().manual_seed(0)
        with area():
            out = pipe(prompt="a red circle", generator=g, **kw)
        # a video pipeline (Wan): the first frame of the first video
        return out.frames[0][0] if hasattr(out, "frames") else out.images[0]

    base = image()
    into = {}
    if expert is None:
        pipe.load_lora_weights(str(adapter))
    else:
        into = {"transformer": {"high_noise": "transformer", "low_noise": "transformer_2"}[expert]}
        pipe.load_lora_weights(str(adapter), load_into_transformer_2=expert == "low_noise")
        other = next(c for c in ("transformer", "transformer_2") if c != into["transformer"])
        assert not any(hasattr(m, "lora_A") for _, m in getattr(pipe, other).named_modules())
    with_lora = image()
    assert np.isfinite(with_lora).all() and pipe.get_active_adapters()
    scope = {"pipe": pipe, "adapter": str(adapter), "into": into}
    exec(COUNT_LOADED, scope)  # the same count the fresh-process script makes
    counts = scope["lora_modules"]
    assert counts and all(a == b > 0 for a, b in counts.values()), counts
    return float(np.abs(with_lora - base).max())
