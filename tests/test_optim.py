"""``build_optimizer``: AdamW's implementation by device (fused on CUDA, for-each
elsewhere), the same update whichever is picked, the learning rates of its groups."""

from __future__ import annotations

import pytest
import torch

from raylora.config import validate
from raylora.train.optim import build_lr_scheduler, build_optimizer

MIN = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 4, generator=g)),
            torch.nn.Parameter(torch.randn(4, 16, generator=g))]


def _steps(opt, params, n=3):
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("device, fused, foreach", [
    ("cuda", True, False), (torch.device("cuda", 0), True, False),
    ("cpu", False, True), (torch.device("cpu"), False, True),
])
def test_adamw_is_fused_on_cuda_and_foreach_elsewhere(device, fused, foreach):
    # The parameters may still be on the CPU (the model moves at accelerator.prepare):
    # the choice follows the device they will train on.
    opt = build_optimizer(validate(MIN), _params(), world_size=1, device=device)
    assert type(opt) is torch.optim.AdamW
    assert bool(opt.defaults["fused"]) is fused
    assert bool(opt.defaults["foreach"]) is foreach
    assert all(bool(g["fused"]) is fused for g in opt.param_groups)


def test_device_defaults_to_where_the_parameters_are():
    opt = build_optimizer(validate(MIN), _params(), world_size=1)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_every_choice_makes_the_plain_adamw_update():
    """The fused kernel (CPU has one too) and the for-each path step exactly as the
    per-tensor loop with the config's hyperparameters does."""
    cfg = validate({**MIN, "train": {"learning_rate": 3e-2, "adam_weight_decay": 0.1}})
    ref_params = _params()
    ref = _steps(torch.optim.AdamW(ref_params, lr=3e-2, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.1, foreach=False, fused=False), ref_params)
    assert (ref[0] - _params()[0]).abs().max() > 1e-2  # the steps moved the weights
    for device in ("cpu", "cuda"):  # "cuda": the fused kernel, run here on CPU tensors
        params = _params()
        got = _steps(build_optimizer(cfg, params, world_size=1, device=device), params)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_group_learning_rates_with_scale_lr_and_text_encoder():
    cfg = validate({**MIN, "train": {"learning_rate": 1e-4, "scale_lr": True, "batch_size": 2,
                                     "gradient_accumulation_steps": 3},
                    "lora": {"text_encoder_lr": 5e-5, "train_text_encoder": True}})
    unet, te = _params(0), _params(1)
    opt = build_optimizer(cfg, unet + te, world_size=4, text_encoder_params=te, device="cpu")
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4 * 2 * 3 * 4)
    assert opt.param_groups[1]["lr"] == pytest.approx(5e-5 * 2 * 3 * 4)
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(p) for p in te}


def test_lr_scheduler_counts_in_process_steps():
    cfg = validate({**MIN, "train": {"learning_rate": 1e-3, "lr_scheduler": "linear",
                                     "lr_warmup_steps": 2}})
    params = _params()
    opt = build_optimizer(cfg, params, world_size=2)
    sched = build_lr_scheduler(cfg, opt, max_steps=10, num_processes=2)
    lrs = []
    for _ in range(4):  # 4 process steps = warm-up (2 optimizer steps × 2 processes)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 1e-3 / 4, 1e-3 / 2, 3e-3 / 4])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
