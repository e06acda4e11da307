"""Flux.1 Kontext [dev]: Flux.1-dev's transformer, text encoders and VAE, taught to edit. The
input image's latents, packed into 2×2 tokens as the noisy ones are, follow them in the
transformer's sequence, their position ids those of the same grid with the first axis 1
(the noisy tokens' is 0); the prediction is read from the noisy tokens only: Flux.denoise,
given ``reference_latents``. As ``FluxKontextPipeline`` samples and diffusers'
``train_dreambooth_lora_flux_kontext.py`` trains: the input is encoded to its posterior's
mean (the pipeline's ``argmax``), normalised as every Flux latent.

Without data.control_images a run trains it text to image (the pipeline's call without an
``image``), which is Flux.1-dev's step on this checkpoint."""

from __future__ import annotations

from raylora.model.families.flux import Flux


class FluxKontext(Flux):
    name = "fluxkontext"
    class_names = ("FluxKontextPipeline",)
    pipeline = "FluxKontextPipeline"
    reference_image = True
    # FluxKontextPipeline's docstring example and diffusers' docs; the call's default is 3.5
    default_guidance_scale = 2.5
    description = "Flux.1 Kontext dev (image editing: Flux.1 with the input image's tokens)"

    @classmethod
    def size_kwargs(cls, height: int | None, width: int | None) -> dict:
        # FluxKontextPipeline rescales height × width to max_area (1024² by default),
        # aspect kept: the area asked for is what it samples at.
        return {"max_area": height * width} if height and width else {}

    @classmethod
    def reference_kwargs(cls, image, height: int | None, width: int | None) -> dict:
        # The input resized to the output's size, as training pairs it with its target;
        # _auto_resize off: the pipeline would move it to its preferred ~1 MP sizes. No
        # size: the pipeline's own choice (those preferred sizes), as a plain call makes.
        if image is None:
            return {}
        if not (height and width):
            return {"image": image.convert("RGB")}
        return {"image": image.convert("RGB").resize((width, height)), "_auto_resize": False}


FAMILY = FluxKontext
