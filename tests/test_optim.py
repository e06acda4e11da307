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


# ---------------------------------------------------------------- the other optimizers

OTHERS = {  # train.* of each optimizer for an overfit run
    "adamw8bit": {"optimizer": "adamw8bit", "learning_rate": 1e-2},
    # d0 above its 1e-6 default: d grows from it, and this run is 20 steps short
    "prodigy": {"optimizer": "prodigy", "learning_rate": 1.0, "prodigy": {"d0": 1e-4}},
    "adafactor": {"optimizer": "adafactor", "learning_rate": 1e-2},
    "adafactor-relative": {"optimizer": "adafactor", "adafactor": {"relative_step": True}},
}
# rank 128: the tiny model's LoRA matrices reach bitsandbytes' 4096-element minimum for 8-bit state
RANK = {"adamw8bit": 128}


@pytest.mark.parametrize("name", list(OTHERS))
def test_each_optimizer_reduces_the_loss_of_an_overfit_batch(name, tiny_model, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch, overfit

    from raylora.train.setup import build_run

    cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": demo_data, "resolution": 64},
                    "lora": {"rank": RANK.get(name, 8)}, "train": {"seed": 0, **OTHERS[name]},
                    "output": {"uri": str(tmp_path / "o")}})
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 20, rank=0)
    opt = run.optimizer.optimizer
    expected = {"adamw8bit": "AdamW8bit", "prodigy": "Prodigy"}.get(name, "Adafactor")
    assert type(opt).__name__ == expected
    lrs = []
    before, after = overfit(run, demo_batch("sd", tiny_model, demo_data), 20,
                            each_step=lambda: lrs.append(run.lr_scheduler.get_last_lr()[0]))
    assert after < 0.95 * before, (name, before, after)
    if name == "adamw8bit":
        assert all(opt.state[p]["state1"].dtype == torch.uint8 for p in run.params)
    assert all(type(lr) is float for lr in lrs)  # metrics.jsonl rows are JSON
    if name == "adafactor-relative":  # the logged lr is the step size Adafactor used:
        assert lrs == pytest.approx([1e-2] * 20)  # min(1e-2, 1/sqrt(step))


def test_adamw8bit_keeps_8bit_state_on_cpu():
    cfg = validate({**MIN, "train": {"optimizer": "adamw8bit", "learning_rate": 1e-2}})
    big = [torch.nn.Parameter(torch.randn(128, 64))]  # ≥ 4096 elements: 8-bit state
    opt = build_optimizer(cfg, big, world_size=1, device="cpu")
    before = big[0].detach().clone()
    _steps(opt, big, 2)
    state = opt.state[big[0]]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    assert (big[0] - before).abs().max() > 1e-3


def _state_bytes(opt) -> int:
    # bitsandbytes' 256-entry code books (qmap) are per-optimizer constants, left out
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and not k.startswith("qmap"))


@pytest.mark.parametrize("train", [
    {"optimizer": "adamw"}, {"optimizer": "adamw8bit"}, {"optimizer": "prodigy"},
    {"optimizer": "prodigy", "prodigy": {"slice_p": 11}}, {"optimizer": "adafactor"},
    {"optimizer": "adafactor", "adafactor": {"beta1": 0.9}},
])
def test_state_bytes_estimate_matches_the_optimizer(train):
    """The memory preflight's optimizer term, read from the config as the preflight reads
    it, = the state of the optimizer build_optimizer makes from the same config."""
    from raylora.memory import optimizer_args, optimizer_state_bytes

    cfg = validate({**MIN, "train": train})
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(128, 64), (8, 4), (64,), (3072, 16)]]
    opt = build_optimizer(cfg, params, world_size=1, device="cpu")
    _steps(opt, params, 2)
    args = optimizer_args(cfg.train)
    shapes = [p.shape for p in params]
    assert optimizer_state_bytes(args.pop("optimizer"), shapes, **args) == _state_bytes(opt)


@pytest.mark.parametrize("name", ["adamw8bit", "prodigy", "adafactor", "adafactor-relative"])
def test_resume_from_a_checkpoint_continues_exactly(name, tmp_path):
    """Optimizer (and its lr schedule) state through the checkpoint files (loaded with
    weights_only=True): 3 steps + save + load + 3 steps = 6 steps straight."""
    from raylora.checkpoint.state import LoopState, load_state, save_main_state

    cfg = validate({**MIN, "train": {"seed": 0, **OTHERS[name]},
                    "lora": {"train_text_encoder": True}})

    def fresh():
        params = _params(0) + [torch.nn.Parameter(torch.randn(64, 80, generator=torch.Generator().manual_seed(5)))]
        opt = build_optimizer(cfg, params, world_size=1, text_encoder_params=params[2:], device="cpu")
        return params, opt, build_lr_scheduler(cfg, opt, max_steps=6, num_processes=1)

    def steps(params, opt, sched, start, n):
        for i in range(start, start + n):
            g = torch.Generator().manual_seed(100 + i)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            sched.step()

    ref_p, ref_o, ref_s = fresh()
    steps(ref_p, ref_o, ref_s, 0, 6)
    params, opt, sched = fresh()
    steps(params, opt, sched, 0, 3)
    save_main_state(str(tmp_path), lora_sd={"w": torch.zeros(1)}, optimizer_sd=opt.state_dict(),
                    scheduler_sd=sched.state_dict(), scaler_sd=None, loop=LoopState())
    restored = load_state(str(tmp_path), rank=0)
    params2, opt2, sched2 = fresh()
    with torch.no_grad():
        for p, q in zip(params2, params):
            p.copy_(q)
    opt2.load_state_dict(restored.optimizer_sd)
    sched2.load_state_dict(restored.scheduler_sd)
    steps(params2, opt2, sched2, 3, 3)
    moved = max(float((a - b).abs().max().detach()) for a, b in zip(params2, _params(0)))
    assert moved > 1e-4
    for a, b in zip(params2, ref_p):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in ref_o.param_groups]


@pytest.mark.parametrize("name", list(OTHERS))
def test_text_encoder_group_for_every_optimizer(name):
    cfg = validate({**MIN, "train": OTHERS[name], "lora": {"train_text_encoder": True}})
    unet, te = _params(0), _params(1)
    opt = build_optimizer(cfg, unet + te, world_size=1, text_encoder_params=te, device="cpu")
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(p) for p in te}
    before = [p.detach().clone() for p in te]
    _steps(opt, unet + te, 3)
    assert all((p - b).abs().max() > 0 for p, b in zip(te, before))


def test_text_encoder_lr_with_adafactor():
    cfg = validate({**MIN, "train": {"optimizer": "adafactor", "learning_rate": 1e-3},
                    "lora": {"train_text_encoder": True, "text_encoder_lr": 5e-4}})
    unet, te = _params(0), _params(1)
    opt = build_optimizer(cfg, unet + te, world_size=1, text_encoder_params=te, device="cpu")
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4]


@pytest.mark.parametrize("train, lora, expected", [
    ({"optimizer": "paged_adamw8bit"}, {},
     "train.optimizer: paged_adamw8bit (bitsandbytes) needs CUDA"),
    ({"optimizer": "sgd"}, {}, "train.optimizer: Input should be"),
    ({"optimizer": "prodigy", "prodigy": {"d_coeff": 2.0}}, {}, "train.prodigy.d_coeff: unknown key"),
    ({"optimizer": "prodigy", "prodigy": {"d_coef": 0}}, {}, "train.prodigy.d_coef: Input should be greater than 0"),
    ({"optimizer": "adafactor", "adafactor": {"relative_steps": True}}, {},
     "train.adafactor.relative_steps: unknown key"),
    ({"optimizer": "adamw", "prodigy": {"d_coef": 2.0}}, {},
     "train.prodigy: set, but train.optimizer is adamw"),
    ({"optimizer": "prodigy", "learning_rate": 1.0}, {"text_encoder_lr": 0.5},
     "lora.text_encoder_lr: prodigy estimates one step size"),
    ({"optimizer": "adafactor", "adafactor": {"warmup_init": True}}, {},
     "train.adafactor.warmup_init: needs train.adafactor.relative_step=true"),
    ({"optimizer": "adafactor", "adafactor": {"relative_step": True}, "lr_scheduler": "cosine"}, {},
     "train.lr_scheduler: Adafactor with train.adafactor.relative_step=true sets its own step size"),
    ({"optimizer": "adafactor", "adafactor": {"relative_step": True}, "lr_warmup_steps": 10}, {},
     "train.lr_warmup_steps: Adafactor with train.adafactor.relative_step=true"),
    ({"optimizer": "adafactor", "adafactor": {"relative_step": True}, "scale_lr": True}, {},
     "train.scale_lr: Adafactor with"),
    ({"optimizer": "adafactor", "adafactor": {"relative_step": True}}, {"text_encoder_lr": 1e-4},
     "lora.text_encoder_lr: Adafactor with"),
])
def test_optimizer_config_errors_name_the_key(train, lora, expected):
    from raylora.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        validate({**MIN, "train": train, "lora": lora})
    assert expected in str(exc.value)


def test_optimizer_configs_that_are_fine():
    assert validate({**MIN, "train": {"optimizer": "adamw8bit"}}).train.optimizer == "adamw8bit"
    assert validate({**MIN, "train": {"optimizer": "paged_adamw8bit"},
                     "scaling": {"use_gpu": True}}).train.optimizer == "paged_adamw8bit"
    cfg = validate({**MIN, "train": {"optimizer": "prodigy", "learning_rate": 1.0,
                                     "prodigy": {"d_coef": 0.5, "growth_rate": 1.02}}})
    # a resolved config (every section dumped, defaults included) validates again: what
    # workers and Tune trials receive
    from raylora.config import RayLoraConfig

    again = validate(cfg.to_dict())
    assert again == cfg == RayLoraConfig.model_validate(cfg.to_dict())
    opt = build_optimizer(cfg, _params(), world_size=1)
    g = opt.param_groups[0]
    assert (g["d_coef"], g["growth_rate"], g["lr"]) == (0.5, 1.02, 1.0)
    with pytest.raises(ValueError, match="train.optimizer: paged_adamw8bit needs CUDA"):
        build_optimizer(validate({**MIN, "train": {"optimizer": "paged_adamw8bit"},
                                  "scaling": {"use_gpu": True}}), _params(), world_size=1, device="cpu")
