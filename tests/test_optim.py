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


# ---------------------------------------------------------------- resuming with other settings

class _Prepared:
    """What accelerator.prepare returns, as setup._restore uses it."""

    def __init__(self, optimizer=None, scheduler=None):
        self.optimizer, self.scheduler = optimizer, scheduler

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)


def _resume(train: dict, saved: dict, max_steps: int = 6, device="cpu"):
    """setup._restore of ``saved`` (``_checkpoint``) into the optimizer and schedule that
    ``train`` builds: (params, optimizer, schedule)."""
    from types import SimpleNamespace

    from raylora.checkpoint.state import RestoredState
    from raylora.train.setup import _restore

    cfg = validate({**MIN, "train": train})
    params = _params()
    with torch.no_grad():
        for p, q in zip(params, saved["params"]):
            p.copy_(q)
    opt = build_optimizer(cfg, params, world_size=1, device=device)
    sched = build_lr_scheduler(cfg, opt, max_steps=max_steps, num_processes=1)
    loop = saved["loop"]
    loop.batch_size = cfg.train.batch_size
    restored = RestoredState(lora_sd={}, optimizer_sd=saved["optimizer"], scheduler_sd=saved["schedule"],
                             scaler_sd=None, loop=loop, rng=None)
    _restore(cfg, SimpleNamespace(num_processes=1, scaler=None), restored, _Prepared(opt),
             _Prepared(scheduler=sched), 0, None, max_steps)
    return params, opt, sched


def _checkpoint(train: dict, n: int = 3, device="cpu") -> dict:
    """``n`` steps of the optimizer ``train`` builds, saved as a checkpoint holds them."""
    import copy

    from raylora.checkpoint.state import LoopState

    cfg = validate({**MIN, "train": train})
    params = _params()
    opt = build_optimizer(cfg, params, world_size=1, device=device)
    sched = build_lr_scheduler(cfg, opt, max_steps=6, num_processes=1)
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
    return {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(opt.state_dict()),
            "schedule": sched.state_dict(), "loop": LoopState(global_step=n, world_size=1)}


PRODIGY = {"optimizer": "prodigy", "learning_rate": 1.0}


@pytest.mark.parametrize("was, now, expected", [
    (PRODIGY, {**PRODIGY, "prodigy": {"use_bias_correction": True, "safeguard_warmup": True,
                                      "decouple": False, "d_coef": 2.0, "beta3": 0.9}},
     {"use_bias_correction": True, "safeguard_warmup": True, "decouple": False, "d_coef": 2.0,
      "beta3": 0.9}),
    ({"optimizer": "adafactor", "learning_rate": 1e-3},
     {"optimizer": "adafactor", "learning_rate": 1e-3,
      "adafactor": {"scale_parameter": True, "clip_threshold": 0.5, "decay_rate": -0.5}},
     {"scale_parameter": True, "clip_threshold": 0.5, "decay_rate": -0.5, "lr": 1e-3}),
    ({"optimizer": "adafactor", "learning_rate": 1e-3},
     {"optimizer": "adafactor", "adafactor": {"relative_step": True, "warmup_init": True}},
     {"relative_step": True, "warmup_init": True}),
    ({"learning_rate": 1e-3},
     {"learning_rate": 5e-4, "adam_beta1": 0.8, "adam_epsilon": 1e-6, "adam_weight_decay": 0.5},
     {"lr": 5e-4, "betas": (0.8, 0.999), "eps": 1e-6, "weight_decay": 0.5}),
])
def test_a_resume_takes_the_optimizer_settings_from_the_config(was, now, expected):
    """train.prodigy, train.adafactor and train.adam_* changed on resume are what the
    optimizer steps with; its own state (Prodigy's d and step count, the moments) is the
    checkpoint's. (Before, only the learning rates and Adam's hyperparameters were taken:
    Prodigy's and Adafactor's switches stayed as saved.)"""
    saved = _checkpoint(was)
    _, opt, _ = _resume(now, saved)
    g = opt.param_groups[0]
    assert {k: g[k] for k in expected} == expected
    old = saved["optimizer"]["param_groups"][0]
    for k in ("d", "d_max", "d_numerator", "k"):
        assert g.get(k) == old.get(k)
    if "d" in old:  # Prodigy's estimate: not what a fresh build starts from
        assert old["k"] == 3 and old["d_numerator"] != 0
    state = saved["optimizer"]["state"][0]
    assert all(torch.equal(opt.state[opt.param_groups[0]["params"][0]][k], v)
               for k, v in state.items() if torch.is_tensor(v))


def test_adafactor_relative_step_switched_off_on_resume_steps_at_the_config_lr():
    """A run started with train.adafactor.relative_step (step size min(1e-2, 1/√t)),
    resumed without it at train.learning_rate 1e-4: the resumed steps move the weights
    exactly as steps 4-6 of a run that never used it (Adafactor's second moments do not
    depend on the step size), not at the 1e-2 the checkpoint's groups said (87× what
    metrics.jsonl logged)."""
    now = {"optimizer": "adafactor", "learning_rate": 1e-4}
    params, opt, sched = _resume(now, _checkpoint({"optimizer": "adafactor",
                                                   "adafactor": {"relative_step": True}}))
    assert sched.get_last_lr() == [1e-4]
    start = [p.detach().clone() for p in params]
    moved = [b - a for a, b in zip(start, _steps_from(opt, params, 3))]
    ref = _checkpoint(now, n=3)
    ref_params, ref_opt, _ = _resume(now, ref)
    ref_moved = [b - a for a, b in zip(ref["params"], _steps_from(ref_opt, ref_params, 3))]
    assert 1e-5 < max(float(m.abs().max()) for m in moved) < 1e-3  # relative: ~3e-2
    for a, b in zip(moved, ref_moved):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # fp32 rounding of weights ~1


def _steps_from(opt, params, start, n=3):
    """Steps ``start``.. of ``_checkpoint``'s gradient sequence."""
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def test_adafactor_relative_step_switched_on_on_resume_sets_its_own_step_size():
    """The other way: the relative step size (1e-2 at these steps) and metrics.jsonl's lr
    say so; before, the checkpoint's groups kept an external lr that the relative-step
    schedule set to 0, and training stopped."""
    params, opt, sched = _resume({"optimizer": "adafactor", "adafactor": {"relative_step": True}},
                                 _checkpoint({"optimizer": "adafactor", "learning_rate": 1e-3}))
    g = opt.param_groups[0]
    assert g["relative_step"] is True and "initial_lr" not in g
    start = [p.detach().clone() for p in params]
    for i in range(3, 5):
        end = _steps_from(opt, params, i, 1)
        sched.step()
        assert sched.get_last_lr() == pytest.approx([1e-2])
    assert max(float((a - b).abs().max()) for a, b in zip(end, start)) > 5e-3


@pytest.mark.parametrize("was_device, now_device, fused, foreach", [
    ("cuda", "cpu", False, True), ("cpu", "cuda", True, False)])
def test_adamw_implementation_follows_the_device_a_run_resumes_on(was_device, now_device, fused,
                                                                  foreach):
    """fused/foreach are where the run trains now, not where the checkpoint was written
    ("cuda": the fused flag, run here on CPU tensors). Before, a checkpoint from a GPU run
    asked a CPU resume for the fused kernel."""
    params, opt, _ = _resume({}, _checkpoint({}, device=was_device), device=now_device)
    assert [(bool(g["fused"]), bool(g["foreach"])) for g in opt.param_groups] == [(fused, foreach)]
    straight = _checkpoint({}, n=4, device=now_device)["params"]
    for a, b in zip(_steps_from(opt, params, 3, 1), straight):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_what_an_optimizer_changes_in_its_groups_is_kept_as_its_state():
    """Every parameter-group value an optimizer changes or adds while stepping is in
    setup.GROUP_STATE_KEYS (a resume keeps it); everything else a resume takes from the
    config. A library version that keeps more state in its groups fails here."""
    from raylora.train.setup import GROUP_STATE_KEYS

    for train in [{}, {"optimizer": "adamw8bit"}, PRODIGY, {"optimizer": "adafactor"},
                  {"optimizer": "adafactor", "adafactor": {"relative_step": True}}]:
        cfg = validate({**MIN, "train": train})
        params = _params()
        opt = build_optimizer(cfg, params, world_size=1, device="cpu")
        sched = build_lr_scheduler(cfg, opt, max_steps=6, num_processes=1)
        before = [dict(g) for g in opt.param_groups]
        for i in range(3):
            _steps_from(opt, params, i, 1)
            sched.step()
        changed = {k for g, b in zip(opt.param_groups, before) for k in g
                   if k not in b or (k != "params" and g[k] != b[k])}
        assert changed <= set(GROUP_STATE_KEYS), (train, changed - set(GROUP_STATE_KEYS))


@pytest.mark.parametrize("was, now, key, message", [
    ({}, PRODIGY, "train.optimizer",
     "train.optimizer: this run has train.optimizer=prodigy, but the checkpoint to resume from "
     "holds adamw optimizer state; set it back to resume that run, or give this one its own output.uri"),
    (PRODIGY, {}, "train.optimizer", "this run has train.optimizer=adamw, but the checkpoint to "
     "resume from holds prodigy optimizer state"),
    ({}, {"optimizer": "adamw8bit"}, "train.optimizer", "holds adamw optimizer state"),
    ({"optimizer": "adamw8bit"}, {}, "train.optimizer", "holds adamw8bit optimizer state"),
    ({}, {"optimizer": "adafactor"}, "train.optimizer", "holds adamw optimizer state"),
    (PRODIGY, {**PRODIGY, "prodigy": {"slice_p": 2}}, "train.prodigy.slice_p",
     "train.prodigy.slice_p: this run has train.prodigy.slice_p=2, but the checkpoint to resume "
     "from was written with 1"),
    (PRODIGY, {**PRODIGY, "prodigy": {"d0": 1e-4}}, "train.prodigy.d0", "written with 1e-06"),
])
def test_a_resume_of_state_another_optimizer_made_is_refused_naming_the_key(was, now, key, message):
    """Checkpoints that do not record train.optimizer (the driver refuses a change by the
    record) and Tune trials: the worker refuses, naming the key, and Ray Train does not
    retry it (restart_repeats). Before: a KeyError inside the library at the first step,
    or (prodigy→adamw) Prodigy's moments stepped as AdamW's."""
    with pytest.raises(ValueError) as exc:
        _resume(now, _checkpoint(was))
    assert str(exc.value).startswith(f"{key}: ") and message in str(exc.value)
    assert exc.value.restart_repeats is True
