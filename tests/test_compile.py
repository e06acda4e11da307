"""``train.compile``: the denoiser compiled in place (``compile_denoiser``) computes what the
eager one computes, loss and LoRA gradients, through raylora's own step; keeps its parameter
and state-dict names (DDP, adapter export and resume depend on them); has no graph break
(the peft LoRA layers included) and compiles nothing after the first step of a shape.
Real inductor compile on CPU (needs a C++ compiler) for the regional mode every run uses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from inproc import lora_step_setup

from raylora.config import LoraSection, validate
from raylora.model.lora import add_lora, lora_state_dict
from raylora.train.compile import UNET_RESNET_BLOCKS, compile_denoiser, repeated_blocks

FAMILIES = ["sd", "sdxl", "flux", "sd3", "qwenimage"]


def _loss_and_grads(model, parts, params, batch, seed: int):
    from raylora.train.step import compute_loss

    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # the same noise and timesteps for the eager and compiled model
    loss = compute_loss(model, parts, batch)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in params]


@pytest.mark.parametrize("family_name", FAMILIES)
def test_regional_compile_matches_eager_without_breaks_or_recompiles(tiny, demo_data, tmp_path,
                                                                      family_name):
    comps, eager_params, parts, batch = lora_step_setup(tiny(family_name), demo_data,
                                                        str(tmp_path / "o"))
    fam, eager = comps.family, comps.denoiser
    with torch.no_grad():  # a non-zero adapter, so lora_A gets gradients too
        for n, p in eager.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)

    compiled = copy.deepcopy(eager)
    compiled_params = [p for p in compiled.parameters() if p.requires_grad]
    torch._dynamo.reset()
    counters.clear()
    # The blocks training compiles (setup.build_run passes the family's); fullgraph: a
    # graph break anywhere in a block, a peft LoRA layer included, is an error.
    names = compile_denoiser(compiled, "regional", fam.repeated_blocks, fullgraph=True)
    assert names and all(compiled.get_submodule(n)._compiled_call_impl is not None for n in names)
    assert {type(compiled.get_submodule(n)).__name__ for n in names} == set(fam.repeated_blocks)

    opt = torch.optim.SGD(compiled_params, lr=1e-2)
    graphs = None
    for step in range(3):
        ref_loss, ref_grads = _loss_and_grads(eager, parts, eager_params, batch, seed=step)
        loss, grads = _loss_and_grads(compiled, parts, compiled_params, batch, seed=step)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
        assert len(grads) == len(ref_grads) > 0
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        if step == 0:
            graphs = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
            assert graphs[0] >= 1  # it really ran through dynamo/inductor
        else:  # later steps of the same shape compile nothing
            assert (counters["stats"]["unique_graphs"], counters["frames"]["total"]) == graphs
        # Both take the same optimizer step, so later steps run on changed weights.
        opt.step()
        with torch.no_grad():
            for p, g in zip(eager_params, ref_grads):
                p -= 1e-2 * g
    assert sum(counters["graph_break"].values()) == 0

    # Nothing renamed (no "_orig_mod."): checkpoints, resume and DDP see the same module.
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert list(lora_state_dict(compiled)) == list(lora_state_dict(eager))


def _unet(levels: int = 2, **kw):
    from diffusers import UNet2DConditionModel

    chans = (8, 16, 24, 32)[:levels]
    return UNet2DConditionModel(
        sample_size=16, block_out_channels=chans, layers_per_block=2, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=16, attention_head_dim=4, **kw)


def test_every_block_of_an_sd15_layout_unet_is_compiled():
    """SD 1.5's 4-level UNet has more kinds of ResnetBlock2D (channels, size, shortcut,
    requires_grad of the input) than dynamo's default recompile_limit (8): without raising
    it, the blocks past the eighth kind would silently run eagerly."""
    torch.manual_seed(0)
    unet = _unet(levels=4)
    add_lora(unet, LoraSection(rank=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch._dynamo.reset()
    counters.clear()
    # backend="eager": dynamo's capture and caching only; inductor is not what is tested.
    names = compile_denoiser(unet, "regional", repeated_blocks(unet) + UNET_RESNET_BLOCKS,
                             backend="eager")
    resnets = [n for n in names if type(unet.get_submodule(n)).__name__ == "ResnetBlock2D"]
    assert len(resnets) == 22
    x, t, text = torch.randn(2, 4, 16, 16), torch.tensor([1, 500]), torch.randn(2, 7, 16)
    unet(x, t, text).sample.mean().backward()
    assert not counters["unimplemented"]  # where a recompile limit hit is recorded
    assert counters["frames"]["ok"] == counters["frames"]["total"]
    # one graph per kind of block: more than the default limit of 8 resnet kinds alone
    assert counters["stats"]["unique_graphs"] > 8 + 2


def test_full_compile_keeps_names_and_output():
    """``full``: the whole model compiled in place (aot_eager: the capture and the
    forward/backward split, without inductor's minutes of CPU code generation)."""
    torch.manual_seed(0)
    eager = _unet()
    params = add_lora(eager, LoraSection(rank=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    assert compile_denoiser(compiled, "full", backend="aot_eager") == [""]
    assert compiled._compiled_call_impl is not None
    x, t, text = torch.randn(2, 4, 16, 16), torch.tensor([1, 500]), torch.randn(2, 7, 16)
    ref = eager(x, t, text).sample
    ref.square().mean().backward()
    out = compiled(x, t, text).sample
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for a, b in zip([p for p in compiled.parameters() if p.requires_grad], params):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_modes_and_default_blocks():
    from diffusers import SD3Transformer2DModel

    unet = _unet()
    assert compile_denoiser(unet, "none") == [] and unet._compiled_call_impl is None
    with pytest.raises(ValueError, match="compile mode 'fast'"):
        compile_denoiser(unet, "fast")
    with pytest.raises(ValueError, match="no \\['FluxTransformerBlock'\\]"):
        compile_denoiser(unet, "regional", ["FluxTransformerBlock"])
    # UNets: diffusers' _repeated_blocks (resnets only when asked for); SD3 declares none.
    assert repeated_blocks(unet) == ("BasicTransformerBlock",)
    sd3 = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)
    assert repeated_blocks(sd3) == ("JointTransformerBlock",)


def test_channels_last_changes_the_layout_not_the_step(base_config, batches, tmp_path):
    """train.channels_last: the UNet's conv weights are stored NHWC; the losses, the LoRA
    weights trained and the adapter's keys are those of the default layout."""
    from inproc import _train

    runs = {}
    for layout in (False, True):
        base_config["train"]["channels_last"] = layout
        runs[layout], _ = _train(validate(base_config), batches, 2, str(tmp_path / str(layout)))
    convs = {n: p for n, p in runs[True].model.named_parameters()
             if p.dim() == 4 and p.shape[1] > 1 and p.shape[2] > 1}
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last)
                         and not p.is_contiguous() for p in convs.values())
    assert all(p.is_contiguous() for n, p in runs[False].model.named_parameters() if n in convs)
    assert [r["loss"] for r in runs[True].state.history] == pytest.approx(
        [r["loss"] for r in runs[False].state.history], rel=1e-5)
    plain, nhwc = (lora_state_dict(runs[k].model) for k in (False, True))
    assert plain.keys() == nhwc.keys()
    for k in plain:
        torch.testing.assert_close(nhwc[k], plain[k], rtol=1e-4, atol=1e-6)
