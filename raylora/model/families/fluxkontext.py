"""Flux.1 Kontext [dev]: Flux.1-dev's transformer, text encoders and VAE, taught to edit. The
input image's latents, packed into 2×2 tokens as the noisy ones are, follow them in the
transformer's sequence, their position ids those of the same grid with the first axis 1
(the noisy tokens' is 0); the prediction is read from the noisy tokens only. As
``FluxKontextPipeline`` samples and diffusers' ``train_dreambooth_lora_flux_kontext.py``
trains: the input is encoded to its posterior's mean (the pipeline's ``argmax``), normalised
as every Flux latent.

Without data.control_images a run trains it text to image (the pipeline's call without an
``image``), which is Flux.1-dev's step on this checkpoint."""

from __future__ import annotations

import torch

from raylora.model.families.base import Cond, embedded_guidance, grid_ids, pack_2x2, unpack_2x2
from raylora.model.families.flux import Flux


class FluxKontext(Flux):
    name = "fluxkontext"
    class_names = ("FluxKontextPipeline",)
    pipeline = "FluxKontextPipeline"
    reference_image = True
    default_guidance_scale = 2.5  # FluxKontextPipeline's docstring example, diffusers' docs; the call's default is 3.5
    description = "Flux.1 Kontext dev (image editing: Flux.1 with the input image's tokens)"

    @classmethod
    def denoise(cls, model, noisy, t, cond: Cond, guidance: float = 1.0, **extra) -> torch.Tensor:
        ref = cond.get("reference_latents")
        if ref is None:  # text to image: Flux.1's call
            return super().denoise(model, noisy, t, cond, guidance=guidance, **extra)
        b, _, h, w = noisy.shape
        dtype, dev = noisy.dtype, noisy.device
        rh, rw = ref.shape[-2:]
        ref_ids = grid_ids(rh // 2, rw // 2, 3, dev)
        ref_ids[:, 0] = 1  # the pipeline's image_ids: the input image's grid, first axis 1
        ids = torch.cat([grid_ids(h // 2, w // 2, 3, dev), ref_ids])
        tokens = torch.cat([pack_2x2(noisy), pack_2x2(ref.to(dtype))], dim=1)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=dev, dtype=dtype)
        out = model(hidden_states=tokens, timestep=t.to(dtype),
                    guidance=embedded_guidance(model, guidance, b, dev),
                    pooled_projections=cond["pooled_prompt_embeds"],
                    encoder_hidden_states=cond["prompt_embeds"], txt_ids=txt_ids,
                    img_ids=ids.to(dtype), return_dict=False)[0]
        return unpack_2x2(out[:, : (h // 2) * (w // 2)], h, w)

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
