"""``train.compile``: the UNet compiled in place computes what the eager UNet computes,
forward and LoRA gradients, and keeps its parameter and state-dict names (DDP, adapter
export and resume depend on them). Real inductor compile on CPU (needs a C++ compiler)."""

from __future__ import annotations

import copy

import torch
from diffusers import UNet2DConditionModel

from raylora.config import LoraSection
from raylora.model.lora import add_lora, lora_state_dict
from raylora.train.setup import compile_unet


def _loss_and_grads(unet, params, latents, t, text, target):
    for p in params:
        p.grad = None
    out = unet(latents, t, encoder_hidden_states=text).sample
    loss = torch.nn.functional.mse_loss(out.float(), target)
    loss.backward()
    return out.detach(), loss.detach(), [p.grad.detach().clone() for p in params]


def test_compiled_unet_matches_eager_and_keeps_its_names(tiny_model):
    import torch._dynamo

    torch.manual_seed(0)
    eager = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    eager_params = add_lora(eager, LoraSection(rank=4))
    with torch.no_grad():  # a non-zero adapter, so LoRA's B gradients are not all equal
        for n, p in eager.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    compiled = copy.deepcopy(eager)
    compiled_params = [p for p in compiled.parameters() if p.requires_grad]
    torch._dynamo.reset()
    compile_unet(compiled)

    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 32, 32, generator=g)
    t = torch.tensor([10, 500])
    text = torch.randn(2, 77, 32, generator=g)
    target = torch.randn(2, 4, 32, 32, generator=g)
    ref = _loss_and_grads(eager, eager_params, latents, t, text, target)
    for _ in range(2):  # the second call runs the cached graph
        got = _loss_and_grads(compiled, compiled_params, latents, t, text, target)
        assert torch.allclose(got[0], ref[0], atol=1e-4, rtol=1e-4)
        assert abs(float(got[1]) - float(ref[1])) < 1e-5 * max(1.0, float(ref[1]))
        assert len(got[2]) == len(ref[2]) > 0
        for a, b in zip(got[2], ref[2]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-3)

    # It really ran through dynamo/inductor, and nothing was renamed (no "_orig_mod.").
    assert compiled._compiled_call_impl is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert list(lora_state_dict(compiled)) == list(lora_state_dict(eager))
