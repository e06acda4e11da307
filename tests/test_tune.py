"""Held-out metric, held-out split, lr-find maths, Tune plumbing; then a real search and a
real lr-find on local Ray."""

from __future__ import annotations

import csv
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import yaml

from raylora.config import ConfigError, validate
from raylora.data.preprocess import Preprocess, StageSpec
from raylora.data.source import plan_data
from raylora.data.split import KeepSplit, held_out_mask, read_heldout_rows, row_fraction
from raylora.train import lr_find
from raylora.train.evaluate import heldout_loss, prepare_heldout
from stock import stock_image_change

# Its Ray is sized for exactly two trials at a time (ray_local below).
pytestmark = pytest.mark.own_ray

# ---------------------------------------------------------------- held-out split


def test_split_is_by_content_and_holds_out_the_fraction():
    rng = np.random.default_rng(0)
    images = [rng.bytes(64) for _ in range(4000)]
    captions = [f"caption {i}" for i in range(4000)]
    mask = held_out_mask(images, captions, 0.1)
    assert abs(mask.mean() - 0.1) < 0.015
    # Order does not matter: the same rows are held out after a shuffle.
    perm = rng.permutation(4000)
    mask2 = held_out_mask([images[i] for i in perm], [captions[i] for i in perm], 0.1)
    assert np.array_equal(mask2, mask[perm])
    # A Hugging Face {bytes, path} struct is the same row as its bytes.
    assert row_fraction({"bytes": images[0], "path": "x.png"}, captions[0]) == row_fraction(images[0], captions[0])
    # Training and held-out stages partition a batch.
    batch = {"image": np.array(images[:200], dtype=object), "text": np.array(captions[:200], dtype=object)}
    train, held = KeepSplit(0.1)(batch), KeepSplit(0.1, heldout=True)(batch)
    assert len(train["image"]) + len(held["image"]) == 200
    assert set(held["text"]) == {c for c, m in zip(captions[:200], mask[:200]) if m}


def test_heldout_rows_are_the_first_held_out_in_file_order(demo_data):
    cfg = validate({
        "model": {"pretrained": "m"}, "output": {"uri": "o"},
        "data": {"uri": demo_data, "validation_split": 0.25, "validation_max_samples": 5},
    })
    store = cfg.storage.client()
    dp = plan_data(cfg.data, store)
    rows = read_heldout_rows(cfg.data, dp, store, 0.25)
    assert len(rows) == 5
    assert all(row_fraction(r["image"], r["text"]) < 0.25 for r in rows)
    assert read_heldout_rows(cfg.data, dp, store, 0.25) == rows
    # Without a split (data.validation_uri): simply the first rows.
    first = read_heldout_rows(cfg.data, dp, store, None)
    assert len(first) == 5 and first != rows


# ---------------------------------------------------------------- held-out metric


@pytest.fixture(scope="module")
def tiny_parts(tiny_model, demo_data):
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora
    from raylora.train.setup import frozen_parts

    cfg = validate({
        "model": {"pretrained": tiny_model}, "output": {"uri": "o"},
        "data": {"uri": demo_data, "resolution": 64, "validation_split": 0.3,
                 "validation_max_samples": 6},
    })
    store = cfg.storage.client()
    dp = plan_data(cfg.data, store)
    rows = read_heldout_rows(cfg.data, dp, store, 0.3)
    batch = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))({
        "image": np.array([r["image"] for r in rows], dtype=object),
        "text": np.array([r["text"] for r in rows], dtype=object),
    })
    torch.manual_seed(0)
    comps = load_components(cfg.model, torch.float32, store)
    add_lora(comps.denoiser, cfg.lora, comps.family.lora_targets)
    parts = frozen_parts(cfg, comps, "cpu", torch.float32)
    return comps.denoiser, parts, torch.from_numpy(batch["pixel_values"]), torch.from_numpy(batch["input_ids"])


def test_eval_timesteps_are_slice_centres():
    from diffusers import DDPMScheduler

    from raylora.train.objective import DDPM

    obj = DDPM(DDPMScheduler(num_train_timesteps=1000), "epsilon")
    x = torch.zeros(1, 4, 8, 8)
    assert obj.eval_timesteps(4, x).tolist() == [125, 375, 625, 875]
    assert obj.eval_timesteps(1, x).tolist() == [500]


def test_heldout_loss_is_deterministic_split_invariant_and_sees_the_adapter(tiny_parts):
    unet, parts, px, ids = tiny_parts
    unet.train()
    a = prepare_heldout(parts, {"pixel_values": px, "input_ids": ids}, num_timesteps=3, seed=5, batch_size=4)
    b = prepare_heldout(parts, {"pixel_values": px, "input_ids": ids}, num_timesteps=3, seed=5, batch_size=4)
    assert len(a) == 6 * 3
    assert torch.equal(a.noisy, b.noisy) and torch.equal(a.target, b.target)
    assert torch.equal(a.text["prompt_embeds"], b.text["prompt_embeds"])
    assert a.timesteps.tolist() == [166, 500, 833] * 6

    first = heldout_loss(unet, a, torch.float32, batch_size=4)
    again = heldout_loss(unet, b, torch.float32, batch_size=4)
    assert first == again  # bit for bit: same adapter, same number
    assert 0.5 < first < 5.0
    # Other batch sizes run other kernels: equal to float rounding, not bit for bit.
    c = prepare_heldout(parts, {"pixel_values": px, "input_ids": ids}, num_timesteps=3, seed=5, batch_size=2)
    assert heldout_loss(unet, c, torch.float32, batch_size=3) == pytest.approx(first, rel=1e-5)

    # Two "ranks", each summing its share, then summed: the same mean.
    parts_sums = []

    def gather(total):
        parts_sums.append(total.clone())
        return total

    for r in range(2):
        heldout_loss(unet, a, torch.float32, batch_size=4, rank=r, world=2, all_reduce_sum=gather)
    total = parts_sums[0] + parts_sums[1]
    assert total[1] == 18
    # Each rank runs its own batch compositions: fp32 rounding, as for other batch sizes.
    assert float(total[0] / total[1]) == pytest.approx(first, rel=1e-6)

    # A different noise seed is a different (fixed) draw; a changed adapter a different loss.
    other_seed = heldout_loss(unet, prepare_heldout(parts, {"pixel_values": px, "input_ids": ids}, 3, seed=6), torch.float32)
    assert other_seed != first
    saved = {n: p.detach().clone() for n, p in unet.named_parameters() if "lora_B" in n}
    try:
        g = torch.Generator().manual_seed(1)
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.data = torch.randn(p.shape, generator=g)
        changed = heldout_loss(unet, a, torch.float32, batch_size=4)
    finally:
        for n, p in unet.named_parameters():
            if n in saved:
                p.data = saved[n]
    assert abs(changed - first) > 1e-4
    assert heldout_loss(unet, a, torch.float32, batch_size=4) == first
    assert unet.training  # put back in training mode after evaluating


def test_loop_evaluates_at_base_cadence_and_end(base_config, tiny_model):
    """evaluate() runs before step 1, every eval_every steps and at the end; evaluations
    between checkpoints are reported through on_eval."""
    from accelerate import Accelerator

    from raylora.train.loop import LoopHooks, LoopSettings, run_loop
    from raylora.train.setup import build_run

    cfg = validate(base_config)
    accel = Accelerator(cpu=True)
    run = build_run(cfg, accel, 5, rank=0)
    stage = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))
    rng = np.random.default_rng(0)
    imgs = [_png(rng) for _ in range(4)]
    out = stage({"image": np.array(imgs, dtype=object), "text": np.array(["a"] * 4, dtype=object)})
    batch = {"pixel_values": torch.from_numpy(out["pixel_values"][:2]),
             "input_ids": torch.from_numpy(out["input_ids"][:2])}
    calls, evals, ckpts = [], [], []

    def evaluate():
        calls.append(run.state.global_step)
        return 1.0 + 0.1 * len(calls)

    run_loop(run, LoopSettings(max_steps=5, images_per_step=2, checkpoint_every=4, eval_every=2),
             LoopHooks(lambda e: [batch] * 3, on_checkpoint=lambda s, f: ckpts.append(s.global_step),
                       evaluate=evaluate, on_eval=lambda s: evals.append(s.global_step)))
    assert calls == [0, 2, 4, 5]
    assert evals == [2] and ckpts == [4, 5]
    st = run.state
    assert st.eval_loss_base == pytest.approx(1.1)
    # The base evaluation counts: here it stays the best (1.1 at step 0).
    assert (st.eval_loss_last, st.eval_loss_best, st.eval_loss_best_step) == (pytest.approx(1.4), pytest.approx(1.1), 0)
    assert [r.get("eval_loss") for r in st.history] == [None, pytest.approx(1.2), None, pytest.approx(1.3), pytest.approx(1.4)]


def _png(rng) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# ---------------------------------------------------------------- lr-find maths


def test_lr_schedule_and_suggestion_on_a_known_curve():
    assert lr_find.lr_at(0, 50, 1e-6, 1.0) == pytest.approx(1e-6)
    assert lr_find.lr_at(49, 50, 1e-6, 1.0) == pytest.approx(1.0)
    assert lr_find.lr_at(25, 51, 1e-6, 1.0) == pytest.approx(1e-3)

    # Loss falls until lr=1e-3, then rises steeply: the test stops, the suggestion is 1e-4.
    def step(lr):
        x = math.log10(lr) + 3
        return 1.0 + 0.05 * x * x if x < 0 else 1.0 + 40 * x**3

    rows = lr_find.range_test(step, 1e-6, 1.0, 61, smoothing=0.5)
    assert rows[-1]["stopped"] and "10x" in rows[-1]["stopped"]
    assert rows[-1]["smoothed_loss"] > 10 * rows[0]["smoothed_loss"]
    assert len(rows) < 61
    s = lr_find.suggest_lr(rows)
    assert 0.5e-4 < s["suggested_lr"] < 2e-4 and not s["clamped"]

    nan_rows = lr_find.range_test(lambda lr: float("nan") if lr > 1e-2 else 1.0, 1e-4, 1.0, 9)
    assert nan_rows[-1]["stopped"] == "loss is not finite" and nan_rows[-1]["lr"] > 1e-2
    # A minimum at the very first lr: clamped to the range tried, and said so.
    s = lr_find.suggest_lr(lr_find.range_test(lambda lr: 1 + lr, 1e-3, 1e-1, 5))
    assert s["suggested_lr"] == pytest.approx(1e-3) and s["clamped"]


def test_lr_find_refuses_an_optimizer_that_reads_no_lr_and_says_what_scale_lr_divides_by(base_config):
    from raylora.entry import LrFindSettings
    from raylora.launch import _lr_find_config

    sweep = LrFindSettings(start_lr=1e-6, end_lr=1.0, num_steps=10, smoothing=0.9, diverge_factor=10)
    tree = {**base_config, "train": {**base_config["train"], "optimizer": "adafactor",
                                     "adafactor": {"relative_step": True}}}
    with pytest.raises(ConfigError, match=r"train\.adafactor\.relative_step: lr-find sweeps the "
                                          r"learning rate, which Adafactor with relative_step=true "
                                          r"does not use"):
        _lr_find_config(validate(tree), sweep)
    tree["train"]["adafactor"] = {"relative_step": False}
    swept = _lr_find_config(validate(tree), sweep)
    assert swept.train.learning_rate == 1e-6 and not swept.train.scale_lr

    # a schedule's or optimizer's own keys that the training config may set: not refused
    # because the sweep's schedule is constant
    for train, lora in (({"lr_scheduler": "cosine_with_restarts", "lr_num_cycles": 3}, {}),
                        ({"lr_scheduler": "polynomial", "lr_power": 2.0}, {}),
                        ({"optimizer": "prodigy", "learning_rate": 1.0},
                         {"train_text_encoder": True, "text_encoder_lr": 1.0})):
        tree = {**base_config, "train": {**base_config["train"], **train},
                "lora": {**base_config.get("lora", {}), **lora},
                "tracking": {"backend": "wandb", "project": "p", "run_name": "r"}}
        swept = _lr_find_config(validate(tree), sweep)
        assert (swept.train.lr_scheduler, swept.train.lr_num_cycles, swept.train.lr_power,
                swept.lora.text_encoder_lr) == ("constant", 1, 1.0, None)
        # it opens no tracker: an online wandb's missing key is not asked for
        assert swept.tracking.backend == "none"

    t = validate(base_config).train
    assert lr_find.scale_lr_divisor(t) == 1
    t = validate({**base_config, "train": {**base_config["train"], "scale_lr": True,
                                           "gradient_accumulation_steps": 4}}).train
    assert lr_find.scale_lr_divisor(t) == 2 * 4


# ---------------------------------------------------------------- Tune plumbing


def test_search_space_and_concurrency():
    from ray import tune as rtune

    from raylora.tune import expected_trials, max_concurrency, param_space, trial_resources

    tree = {
        "model": {"pretrained": "m"}, "output": {"uri": "o"},
        "data": {"uri": "d", "validation_split": 0.1},
        "scaling": {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 4},
        "tune": {"search_space": {
            "train.learning_rate": {"loguniform": [1e-5, 1e-3]},
            "lora.rank": {"choice": [4, 8, 16]},
            "lora.alpha": {"grid": [4, 8]},
        }, "num_samples": 3},
    }
    cfg = validate(tree)
    space = param_space(cfg.tune)
    assert isinstance(space["train.learning_rate"], rtune.search.sample.Float)
    assert space["train.learning_rate"].lower == 1e-5 and space["train.learning_rate"].upper == 1e-3
    assert space["lora.rank"].categories == [4, 8, 16]
    assert space["lora.alpha"] == {"grid_search": [4, 8]}
    assert expected_trials(cfg.tune) == 6
    assert trial_resources(cfg) == {"CPU": 2 * 4 + 0.5 * 2 + 1.0, "GPU": 2.0}
    # 8 GPUs / 2 per trial = 4, CPUs allow 64 // 10 = 6: GPUs bound it.
    assert max_concurrency(cfg, {"CPU": 64, "GPU": 8}, 6) == 4
    assert max_concurrency(cfg, {"CPU": 25, "GPU": 8}, 6) == 2
    assert max_concurrency(cfg, {"CPU": 4, "GPU": 1}, 6) == 1  # never 0
    assert max_concurrency(cfg, {"CPU": 640, "GPU": 80}, 6) == 6  # never more than trials
    tree["tune"]["max_concurrent_trials"] = 3
    assert max_concurrency(validate(tree), {"CPU": 64, "GPU": 8}, 6) == 3

    tree["tune"]["search_alg"] = "grid"
    tree["tune"]["search_space"].pop("train.learning_rate")
    tree["tune"]["num_samples"] = 1
    assert param_space(validate(tree).tune)["lora.rank"] == {"grid_search": [4, 8, 16]}


def test_a_grid_with_nothing_sampled_runs_each_point_once():
    """Ray Tune repeats a grid num_samples times; with nothing sampled every repeat is the
    same config and seed, so the default is one run of the grid and more is refused unless
    the seed is searched too."""
    from raylora.tune import expected_trials

    tree = {"model": {"pretrained": "m"}, "output": {"uri": "o"},
            "data": {"uri": "d", "validation_split": 0.1},
            "tune": {"search_space": {"lora.rank": {"grid": [4, 8, 16]},
                                      "lora.alpha": {"choice": [4, 8]}}}}
    # A choice under random search of finite values alone: every combination once
    # (test_a_search_of_finite_choices_runs_each_combination_once), 3 × 2.
    assert expected_trials(validate(tree).tune) == 6
    tree["tune"]["search_alg"] = "grid"  # choice is a grid now: 3 × 2 points, each once
    assert expected_trials(validate(tree).tune) == 6
    tree["tune"]["num_samples"] = 4
    with pytest.raises(ConfigError) as err:
        validate(tree)
    assert any(p.startswith("tune.num_samples: 4 runs each grid point 4 times")
               for p in err.value.problems)
    tree["tune"]["search_space"]["train.seed"] = {"grid": [0, 1]}
    assert expected_trials(validate(tree).tune) == 4 * 12


def test_a_recorded_search_config_is_compared_as_this_version_reads_it():
    """Resuming a search compares its recorded config with today's: a key an older raylora
    did not have is its default then, so it differs only where it is set now; a key added
    to the search space is a change either way."""
    from raylora.config import differences as _differences
    from raylora.tune import _as_read_now

    tree = {"model": {"pretrained": "m"}, "output": {"uri": "o"},
            "data": {"uri": "d", "validation_split": 0.1},
            "tune": {"search_space": {"train.learning_rate": {"choice": [1e-4, 1e-3]}}}}
    now = validate(tree).to_dict()
    old = json.loads(json.dumps(now))
    del old["train"]["groupnorm_fp32"]  # as a raylora before that key recorded it
    assert _differences(old, now) == [("train.groupnorm_fp32", None, False)]
    assert _differences(_as_read_now(old), _as_read_now(now)) == []
    # an older raylora wrote the default it used: 8 draws of the 2 values, where this one
    # runs each value once by default (1 grid run)
    old["tune"]["num_samples"] = 8
    assert _differences(_as_read_now(old), _as_read_now(now)) == []
    assert _as_read_now(old)["tune"]["num_samples"] == 1
    tree["train"] = {"groupnorm_fp32": True, "mixed_precision": "bf16"}  # (read under bf16 only)
    tree["tune"]["search_space"]["lora.rank"] = {"choice": [4, 8]}
    tree["tune"]["num_samples"] = 3  # 3 draws of the 4 combinations
    assert [k for k, _, _ in _differences(_as_read_now(old),
                                          _as_read_now(validate(tree).to_dict()))] == [
        "train.groupnorm_fp32", "train.mixed_precision", "tune.num_samples",
        "tune.search_space.lora.rank"]
    assert _as_read_now({"train": {"no_such_key": 1}}) == {"train": {"no_such_key": 1}}


def test_tune_config_errors_name_the_key():
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"}, "data": {"uri": "d"}}
    with pytest.raises(ConfigError) as ei:
        validate({**base, "tune": {"search_space": {
            "lora.rnk": {"choice": [4]},
            "lora.rank": {"choice": [0, 4]},
            "train.batch_size": {"uniform": [1, 8]},
            "scaling.num_workers": {"choice": [1, 2]},
            "model.pretrained": {"choice": ["org/a", "org/b"]},
        }}})
    msg = str(ei.value)
    assert "tune.metric: eval_loss needs held-out data" in msg
    assert "tune.search_space.lora.rnk: not a config value" in msg
    assert "tune.search_space.lora.rank=0: lora.rank:" in msg
    assert ("tune.search_space.train.batch_size: uniform samples fractional values and "
            "train.batch_size takes whole numbers; use randint or choice") in msg
    # whole bounds and a whole midpoint ([4, 16]: 10) too; loguniform alike
    for kind, bounds in (("uniform", [4, 16]), ("loguniform", [4, 64])):
        with pytest.raises(ConfigError, match=rf"tune.search_space.lora.rank: {kind} samples "
                                              r"fractional values and lora.rank takes whole numbers"):
            validate({**base, "tune": {"search_space": {"lora.rank": {kind: bounds}}}})
    assert validate({**base, "tune": {"metric": "train_loss", "search_space": {
        "lora.rank": {"randint": [4, 16]}}}}).tune.search_space["lora.rank"].kind == "randint"
    # raised in a trial, a ConfigError reaches the driver pickled: its problems intact
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError(["a.b: bad", "c: worse"], "x.yaml")))
    assert err.problems == ["a.b: bad", "c: worse"] and str(err).startswith("2 config problem(s) in x.yaml:")
    assert "tune.search_space.scaling.num_workers: scaling.* cannot be searched" in msg
    # a trial of another base would get the planned one's family, tokenizers and commit
    assert ("tune.search_space.model.pretrained: every trial trains the model the search "
            "planned once") in msg
    with pytest.raises(ConfigError, match=r"tune.search_space.x.y: loguniform: bounds"):
        validate({**base, "tune": {"search_space": {"x.y": {"loguniform": [0, 1]}}}})
    with pytest.raises(ConfigError, match="validation.every_n_steps: needs validation.prompts or held-out data"):
        validate({**base, "validation": {"every_n_steps": 5}})
    assert validate({**base, "validation": {"every_n_steps": 5, "prompts": ["a"]}}).validation.prompts == ["a"]
    with pytest.raises(ConfigError, match="data.validation_split: cannot be combined with data.sharding=files"):
        validate({**base, "data": {"uri": "d", "validation_split": 0.1, "sharding": "files"}})


def test_tune_preflight_checks_every_batch_size_against_the_data(base_config):
    from raylora.tune import preflight

    tree = {**base_config, "data": {**base_config["data"], "validation_split": 0.2}}
    tree["tune"] = {"search_space": {"train.batch_size": {"choice": [2, 64]}}}
    with pytest.raises(ConfigError, match=r"tune.search_space.train.batch_size=64: data.uri: .*less than one batch"):
        preflight(validate(tree))


def test_tune_preflight_judges_each_searched_value_by_the_models_family(base_config):
    """A searched value the family's checks refuse (off the latent grid, a setting the
    family does not take) is named before Ray, as `raylora train` names it in a config:
    a searched validation.resolution off the grid was first refused by a trial's workers."""
    from raylora.tune import preflight

    tree = {**base_config, "data": {**base_config["data"], "validation_split": 0.2},
            "tune": {"metric": "train_loss", "search_space": {
                "validation.resolution": {"grid": [32, 33]},
                "model.system_prompt": {"choice": [None, "Describe the image."]}}}}
    with pytest.raises(ConfigError) as exc:
        preflight(validate(tree))
    assert exc.value.problems == [
        "tune.search_space.validation.resolution=33: validation.resolution: 33 is not a multiple "
        "of 2 (the sd latent grid: VAE downsampling × patch size)",
        "tune.search_space.model.system_prompt='Describe the image.': model.system_prompt: sd "
        "(StableDiffusionPipeline) takes no system prompt; leave it unset"]
    tree["tune"]["search_space"] = {"validation.resolution": {"grid": [32, 34]}}
    assert preflight(validate(tree)).latent_grid == 2


def test_a_searched_step_budget_is_each_trials_own_and_asha_stops_none_before_it(base_config, tmp_path):
    """train.max_steps searched over [2, 8] with base 4: ASHA's max_t is the longest budget
    (8: before, the base's 4 cut the 8-step trial and called it completed), each trial is
    complete at its own budget (before, the 2-step trial was "stopped early" and never the
    best), and a tune.max_t below the longest budget is refused before Ray. The exported
    checkpoint's metrics are those of the report that carried it."""
    import pandas as pd
    from ray.tune import Result

    from raylora.tune import checkpoint_metrics, longest_budget, preflight, results_table, step_budget

    tree = {**base_config, "tune": {"metric": "train_loss", "scheduler": "asha",
                                    "search_space": {"train.max_steps": {"grid": [2, 8]}}}}
    cfg = validate(tree)
    base = preflight(cfg)
    assert base.max_steps == 4 and longest_budget(cfg, base) == 8
    budget = lambda params: step_budget(cfg.to_dict(), params, base)  # noqa: E731
    assert [budget({"train.max_steps": n}) for n in (2, 8)] == [2, 8] and budget({}) == 4
    # epochs and batch size searched together: the longest trial is their combination
    # (most epochs at the smallest batch), not either alone
    both = validate({**base_config, "train": {**base_config["train"], "max_steps": None},
                     "tune": {"metric": "train_loss", "search_space": {
                         "train.num_epochs": {"choice": [1, 4]}, "train.batch_size": {"choice": [1, 4]}}}})
    b = preflight(both)
    alone = max(step_budget(both.to_dict(), {k: v}, b) for k, v in
                (("train.num_epochs", 4), ("train.batch_size", 1)))
    longest = step_budget(both.to_dict(), {"train.num_epochs": 4, "train.batch_size": 1}, b)
    assert longest_budget(both, b) == longest > alone

    def result(trial, max_steps, steps, ckpt_at):
        reports = [{"step": s, "train_loss": 1.0 / s, "trial_id": trial,
                    **({"checkpoint_path": f"/c/{trial}/{s}", "train_loss_last": 1.0 / s}
                       if s in ckpt_at else {})} for s in range(1, steps + 1)]
        config = {"train.max_steps": max_steps}
        return Result(metrics={**reports[-1], "config": config}, checkpoint=None, error=None,
                      path=f"/t/{trial}", metrics_dataframe=pd.DataFrame(reports))

    grid = [result("a", 2, 2, {2}), result("b", 8, 8, {4, 8}), result("c", 8, 5, {4})]
    rows = results_table(grid, cfg.tune, budget)
    assert [(r["trial_id"], r["steps"], r["status"]) for r in rows] == [
        ("a", 2, "completed"), ("b", 8, "completed"), ("c", 5, "stopped_early")]
    # c stopped at step 5 after its checkpoint at 4: exported with step 4's report
    assert rows[2]["checkpoint_path"] == "/c/c/4"
    at = checkpoint_metrics(grid[2], "/c/c/4")
    assert at["step"] == 4 and at["train_loss_last"] == 0.25
    assert checkpoint_metrics(grid[0], "/elsewhere") == grid[0].metrics

    for max_t, refused in ((6, True), (8, False)):
        tree["tune"]["max_t"] = max_t
        if refused:
            with pytest.raises(ConfigError, match=r"tune.max_t: 6 is below the step budget of the "
                                                  r"longest trial \(8\): ASHA would stop trials at step 6"):
                preflight(validate(tree))
        else:
            assert preflight(validate(tree)).max_steps == 4


def test_tune_preflight_checks_every_adapter_a_search_starts_from(base_config, tiny_model,
                                                                  demo_data, tmp_path):
    """A search of lora.init_from: each adapter is checked as the base config's is, before
    Ray; one that cannot start a run failed its trial on the worker."""
    from test_lora_init import _build, _cfg, _random_adapter

    from raylora.tune import preflight

    good, missing = tmp_path / "good", tmp_path / "missing"
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a")), str(good))
    tree = {**base_config, "lora": {"rank": 4}, "data": {**base_config["data"], "validation_split": 0.2}}
    tree["tune"] = {"search_space": {"lora.init_from": {"choice": [str(good), str(missing)]}}}
    with pytest.raises(ConfigError) as exc:
        preflight(validate(tree))
    assert exc.value.problems == [f"tune.search_space.lora.init_from={str(missing)!r}: "
                                  f"lora.init_from: {missing}: not found"]
    tree["tune"]["search_space"]["lora.init_from"]["choice"] = [str(good)]
    assert preflight(validate(tree)).max_steps == base_config["train"]["max_steps"]


def test_trials_ask_for_the_cpus_per_worker_their_share_of_the_cluster_places():
    """`raylora tune` gave its trials scaling.cpus_per_worker as asked where `raylora train`
    lowers it (check_cluster_fits): on a 2-CPU Ray, 2 workers of 1 CPU never started and the
    search waited forever. A trial's workers now ask for what fit_worker_cpus gives one run
    on a trial's share of the cluster; the search is still sized by the request."""
    from raylora.tune import max_concurrency, trial_config, trial_cpus_per_worker, trial_resources

    def cfg(**scaling):
        return validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                         "scaling": {"num_workers": 2, **scaling},
                         "tune": {"metric": "train_loss", "search_space": {
                             "train.learning_rate": {"grid": [1e-4, 1e-3, 1e-2, 1e-1]}}}})

    two = cfg()
    # The hang: one trial at a time on 2 CPUs, half a CPU per worker as raylora train runs.
    assert max_concurrency(two, {"CPU": 2}, 1) == 1
    assert trial_cpus_per_worker(two, [{"CPU": 2}], 1) == 0.5
    # Room for the request: kept, alone or two trials side by side (8 CPUs, 4 per trial).
    assert trial_resources(two) == {"CPU": 4.0}
    assert trial_cpus_per_worker(two, [{"CPU": 8}], max_concurrency(two, {"CPU": 8}, 4)) == 1.0
    # tune.max_concurrent_trials 4 on those 8 CPUs: 2 CPUs a trial, 0.5 per worker.
    assert trial_cpus_per_worker(two, [{"CPU": 8}], 4) == 0.5
    # A share too small for any request: the one-trial answer (the others wait their turn).
    files = validate({"model": {"pretrained": "m"}, "output": {"uri": "o"},
                      "data": {"uri": "d", "sharding": "files"}, "scaling": {"num_workers": 2}})
    assert trial_cpus_per_worker(files, [{"CPU": 3}], 2) == 0.5
    # A cluster that grows to the request keeps it, as check_cluster_fits does.
    assert trial_cpus_per_worker(cfg(autoscaling=True), [{"CPU": 2}], 1) == 1.0
    trials = trial_config(two, 0.5)
    assert trials.scaling.cpus_per_worker == 0.5 and two.scaling.cpus_per_worker == 1.0
    assert trials.to_dict() == {**two.to_dict(), "scaling": {**two.to_dict()["scaling"],
                                                             "cpus_per_worker": 0.5}}


def test_a_checkpoints_metrics_keep_their_integers():
    """Ray's metrics frame (pd.json_normalize of result.json) holds a key that some reports
    lack as floats: the best trial's raylora.json and card said "steps": 4.0 and
    "optimizer steps | 4.0". The metrics come back as the trial reported them."""
    import pandas as pd
    from ray.tune import Result

    from raylora.checkpoint.export import summarize_metrics
    from raylora.tune import checkpoint_metrics

    r1 = {"step": 4, "epoch": 0, "train_loss": 0.5, "lr": 1e-4, "world_size": 1,
          "checkpoint_path": "/c/4", "trial_id": "t1"}
    final = {"global_step": 8, "images_seen": 16, "eval_loss_best_step": 8, "nonfinite_steps": 0,
             "train_loss_last": 0.3, "batch_size": 2}
    r2 = {**r1, "step": 8, "checkpoint_path": "/c/8", "train_loss": 0.25, **final}
    r3 = {**r1, "step": 9, "checkpoint_path": None, "train_loss": 0.75, "images_seen": 18}

    def result(*reports):
        return Result(metrics=reports[-1], checkpoint=None, error=None, path="/t/t1",
                      metrics_dataframe=pd.json_normalize(list(reports), sep="/"))

    m = summarize_metrics(checkpoint_metrics(result(r1, r2), "/c/8"))
    assert {k: (m[k], type(m[k])) for k in ("steps", "images_seen", "eval_loss_best_step",
                                            "nonfinite_steps")} == {
        "steps": (8, int), "images_seen": (16, int), "eval_loss_best_step": (8, int),
        "nonfinite_steps": (0, int)}
    # An earlier checkpoint (a trial reporting after it): from the frame, retyped by the
    # last report; a float metric that happens to be whole stays a float.
    at = checkpoint_metrics(result(r1, r2, r3), "/c/8")
    assert (at["images_seen"], type(at["images_seen"])) == (16, int)
    assert (at["step"], at["train_loss"], type(at["lr"])) == (8, 0.25, float)
    from raylora.tune import as_reported

    assert (as_reported(4.0, 9), type(as_reported(4.0, 9))) == (4, int)
    assert type(as_reported(1.0, 0.75)) is float and as_reported(4.5, 9) == 4.5
    assert as_reported(1.0, True) == 1.0 and type(as_reported(1.0, True)) is float


def test_a_randint_dimension_is_bounded_by_the_values_trials_take(base_config):
    """`randint: [lo, hi]` draws lo..hi-1 in Ray Tune: the checks, ASHA's max_t and the
    memory preflight take hi - 1 for its top. `train.max_steps: {randint: [2, 5]}` set max_t
    5 and refused tune.max_t 4; `validation.num_timesteps: {randint: [1, 101]}` (1..100, all
    valid) was refused for 101."""
    import numpy as np

    from raylora.tune import longest_budget, param_space, preflight, trial_variants

    tree = {**base_config, "tune": {"metric": "train_loss", "num_samples": 2, "search_space": {
        "train.max_steps": {"randint": [2, 5]}}}}
    cfg = validate(tree)
    dim = cfg.tune.search_space["train.max_steps"]
    assert dim.values == [2, 4]
    # (num_samples unset: each of its 3 values once, test_a_search_of_finite_choices_...)
    assert param_space(validate({**tree, "tune": {**tree["tune"], "num_samples": None}}).tune) == {
        "train.max_steps": {"grid_search": [2, 3, 4]}}
    domain = param_space(cfg.tune)["train.max_steps"]
    assert (domain.lower, domain.upper) == (2, 5)  # Tune's own [2, 5)
    assert set(domain.sample(size=300, random_state=np.random.default_rng(0))) == {2, 3, 4}
    assert longest_budget(cfg, preflight(cfg)) == 4
    assert [label for label, _ in trial_variants(cfg)] == [
        "tune.search_space.train.max_steps=2", "tune.search_space.train.max_steps=4"]
    tree["tune"]["max_t"] = 4
    assert preflight(validate(tree)).max_steps == 4
    tree["tune"]["max_t"] = 3
    with pytest.raises(ConfigError, match=r"tune.max_t: 3 is below the step budget of the longest "
                                          r"trial \(4\)"):
        preflight(validate(tree))
    # (held-out data: the loss whose timesteps validation.num_timesteps sets)
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"},
            "data": {"uri": "d", "validation_split": 0.1}}
    steps = lambda bounds: {**base, "tune": {"metric": "train_loss", "search_space": {  # noqa: E731
        "validation.num_timesteps": {"randint": bounds}}}}
    assert validate(steps([1, 101])).tune.search_space["validation.num_timesteps"].values == [1, 100]
    with pytest.raises(ConfigError) as err:
        validate(steps([1, 102]))
    assert [p.split(":")[0] for p in err.value.problems] == [
        "tune.search_space.validation.num_timesteps=101"]
    assert validate(steps([3, 4])).tune.search_space["validation.num_timesteps"].values == [3]


def test_a_diverged_trial_is_not_trained_again_when_its_search_runs_again(tmp_path, monkeypatch):
    """Tune restores errored trials to run again (a lost node); a trial whose run diverged
    (NonFiniteLossError) loaded, resumed and diverged again at every rerun of a finished
    search. Its run folder now records the error, and a restored trial ends with it at
    once, untrained: the table still says diverged. Other errors are tried again."""
    from types import SimpleNamespace

    import ray.tune
    import ray.tune.integration.ray_train

    from raylora import tune as rt

    trial_id = ["t_00001"]
    monkeypatch.setattr(ray.tune.integration.ray_train, "TuneReportCallback", lambda: None)
    monkeypatch.setattr(ray.tune, "get_context",
                        lambda: SimpleNamespace(get_trial_id=lambda: trial_id[0]))
    monkeypatch.setattr(rt, "replan", lambda cfg, plan: plan)
    built, errors = [], {}

    class Trainer:
        def __init__(self, name):
            self.name = name

        def fit(self):
            raise errors[self.name]

    monkeypatch.setattr(rt, "build_trainer",
                        lambda cfg, p, uri, name, **kw: built.append(name) or Trainer(name))
    base = validate({"model": {"pretrained": "m"}, "data": {"uri": "d"},
                     "output": {"uri": str(tmp_path)}}).to_dict()
    trials = tmp_path / "tune" / "trials"

    def run():
        rt._trial({"train.learning_rate": 1e8}, base_tree=base, base_plan=None, trials_uri=str(trials))

    nan = RuntimeError("Training failed due to controller error:\nrank 0: NonFiniteLossError: "
                       "loss or gradients were NaN/inf for 1 optimizer steps in a row")
    errors["trial_t_00001"] = nan
    with pytest.raises(RuntimeError) as first:
        run()
    assert first.value is nan and built == ["trial_t_00001"]
    with pytest.raises(Exception) as again:  # the search run again: Tune restores it
        run()
    assert built == ["trial_t_00001"]  # no trainer, no workers
    record = json.loads((trials / "trial_t_00001" / rt.DIVERGED_FILE).read_text())
    assert record == {"error": str(nan)}
    assert isinstance(again.value, rt.DivergedBefore) and rt.diverged(again.value)
    assert str(again.value) == (str(nan) + "\n(this trial diverged in an earlier run of the "
                                "search; not trained again)")
    # The results table says diverged for it, as it did the first time.
    from ray.tune import Result

    rows = rt.results_table([Result(metrics={"trial_id": "t_00001", "config": {
                                        "train.learning_rate": 1e8}}, checkpoint=None,
                                    error=again.value, path="/t", metrics_dataframe=None)],
                            validate({**base, "tune": {"metric": "train_loss", "search_space": {
                                "train.learning_rate": {"grid": [1e8]}}}}).tune, lambda p: 4)
    assert (rows[0]["status"], rows[0]["diverged"]) == ("diverged", True)

    # A lost node is another error: no record, and the trial trains again when restored.
    trial_id[0] = "t_00002"
    errors["trial_t_00002"] = RuntimeError("The actor died unexpectedly before finishing this task.")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="actor died"):
            run()
    assert built == ["trial_t_00001", "trial_t_00002", "trial_t_00002"]
    assert not (trials / "trial_t_00002" / rt.DIVERGED_FILE).exists()


def _trial_plans(monkeypatch, base_tree: dict, base_plan, trials_uri: str, *params: dict) -> list:
    """The plan ``_trial`` hands each trial's TorchTrainer (its workers read its data plan),
    for each of ``params``; no Ray."""
    from types import SimpleNamespace

    import ray.tune
    import ray.tune.integration.ray_train

    from raylora import tune as rt

    plans, ids = [], iter(range(len(params)))
    monkeypatch.setattr(ray.tune.integration.ray_train, "TuneReportCallback", lambda: None)
    monkeypatch.setattr(ray.tune, "get_context",
                        lambda: SimpleNamespace(get_trial_id=lambda: f"t_{next(ids):05d}"))
    monkeypatch.setattr(rt, "build_trainer", lambda cfg, p, uri, name, **kw: plans.append(p) or
                        SimpleNamespace(fit=lambda: SimpleNamespace(metrics={})))
    for values in params:
        rt._trial(values, base_tree=base_tree, base_plan=base_plan, trials_uri=trials_uri)
    return plans


def test_a_search_of_data_uri_trains_each_trial_on_its_own_rows(base_config, demo_data, tmp_path,
                                                                 monkeypatch):
    """Each trial of a data.uri search read the base's shards: its plan kept the base's
    files, rows (32) and steps (16) where its own folder has 6 rows, 3 steps an epoch. Each
    data section is now planned before Ray, as `raylora train` plans it (a missing folder
    is refused there, named by its value), and a trial trains on its own; a drawn value of
    a range plans its own data in the trial. Its step budget, the results table's status,
    ASHA's max_t and the exported raylora.json follow its data."""
    import pandas as pd
    from ray.tune import Result

    from raylora import tune as rt
    from raylora.data.demo import write_parquet_shards
    from raylora.launch import plan, resolve_paths

    small, held = tmp_path / "small", tmp_path / "held"
    write_parquet_shards(small, n=6, num_shards=1, size=64, seed=5)
    write_parquet_shards(held, n=4, num_shards=1, size=64, seed=6)
    # every trial measured on one held-out set (test_a_search_of_the_data_...)
    tree = {**base_config, "data": {**base_config["data"], "validation_uri": str(held)},
            "train": {**base_config["train"], "max_steps": None, "num_epochs": 1},
            "tune": {"metric": "eval_loss", "search_space": {
                "data.uri": {"choice": [demo_data, str(small)]}}}}
    cfg = resolve_paths(validate(tree))
    base = rt.preflight(cfg)
    assert (base.data_rows, base.max_steps) == (32, 16)
    base_tree = cfg.to_dict()
    monkeypatch.setattr(rt, "plan", lambda c, **kw: pytest.fail("a trial planned data the "
                                                                  "driver had planned"))
    own, same = _trial_plans(monkeypatch, base_tree, base, str(tmp_path / "trials"),
                             {"data.uri": str(small)}, {"data.uri": demo_data})
    assert (own.shard_files, own.data_rows, own.total_rows, own.max_steps) == (
        [str(small / "part-00000.parquet")], 6, 6, 3)
    assert own.data_plan().files == [str(small / "part-00000.parquet")]
    assert (same.data_rows, same.max_steps, len(same.shard_files)) == (32, 16, 2)
    assert own.bad_records == base.bad_records and own.family == "sd"
    assert len(base.data_variants) == 1  # the small folder's, planned before Ray

    budget = lambda params: rt.step_budget(base_tree, params, base)  # noqa: E731
    assert [budget({"data.uri": u}) for u in (str(small), demo_data)] == [3, 16]
    assert rt.longest_budget(cfg, base) == 16
    # The 6-row trial ran its 3 steps: completed (it was "stopped_early" against 16).
    done = Result(metrics={"step": 3, "eval_loss": 0.5, "trial_id": "t_small",
                           "checkpoint_path": str(tmp_path / "ckpt"),
                           "config": {"data.uri": str(small)}},
                  checkpoint=None, error=None, path="/t/t_small",
                  metrics_dataframe=pd.DataFrame([{"step": 3, "eval_loss": 0.5,
                                                   "checkpoint_path": str(tmp_path / "ckpt")}]))
    [row] = rt.results_table([done], cfg.tune, budget)
    assert (row["steps"], row["status"]) == (3, "completed")
    # Its export records the data it trained on.
    (tmp_path / "ckpt").mkdir()
    exported = {}
    import raylora.checkpoint.export

    monkeypatch.setattr(raylora.checkpoint.export, "export_run",
                        lambda d, c, m, p, extra: exported.update(p) or {"adapter": "a"})
    rt.export_best(row, [done], cfg, base, str(tmp_path / "out"))
    assert (exported["data_rows"], exported["max_steps"], exported["shard_files"]) == (
        6, 3, [str(small / "part-00000.parquet")])

    # A drawn value of a range: its trial plans its own data, as `raylora train` would.
    monkeypatch.setattr(rt, "plan", plan)
    tree["data"] = base_config["data"]
    tree["tune"] = {"metric": "train_loss",
                    "search_space": {"data.validation_split": {"uniform": [0.1, 0.3]}}}
    cfg = resolve_paths(validate(tree))
    base = rt.preflight(cfg)
    assert len(base.data_variants) == 2  # its two ends, checked before Ray
    [drawn] = _trial_plans(monkeypatch, cfg.to_dict(), base, str(tmp_path / "trials2"),
                           {"data.validation_split": 0.2})
    alone = plan(validate(trial_tree_of(cfg, {"data.validation_split": 0.2})))
    assert (drawn.total_rows, drawn.heldout_rows, drawn.max_steps) == (
        alone.total_rows, alone.heldout_rows, alone.max_steps) == (26, alone.heldout_rows, 13)
    assert drawn.heldout_rows > 0

    # A value the driver cannot plan is refused before Ray, named by its value.
    tree["data"] = {**base_config["data"], "validation_uri": str(held)}
    tree["tune"] = {"search_space": {"data.uri": {"choice": [demo_data, str(tmp_path / "missing")]}}}
    with pytest.raises(ConfigError) as err:
        rt.preflight(resolve_paths(validate(tree)))
    assert [p.split(": ")[:2] for p in err.value.problems] == [
        [f"tune.search_space.data.uri={str(tmp_path / 'missing')!r}", "data.uri"]]


def test_a_search_of_the_data_ranks_trials_on_one_heldout_set():
    """A data.uri search ranked trials by losses measured on different images: train_loss
    on each trial's own training images, eval_loss on the rows data.validation_split held
    out of each trial's own data. Both are refused, naming the key; eval_loss with
    data.validation_uri (one held-out set for every trial) searches it."""
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"}}
    for key, values in (("data.uri", ["d1", "d2"]),
                        ("data.sources", [[{"uri": "d1"}], [{"uri": "d1"}, {"uri": "d2"}]])):
        data = {"sources": [{"uri": "d1"}]} if key == "data.sources" else {"uri": "d1"}
        space = {key: {"choice": values}}
        for held, metric, why in (
                ({}, "train_loss", "so tune.metric train_loss ranks trials by how easily their "
                                   "images denoise, not by what they learned; use tune.metric: "
                                   "eval_loss with data.validation_uri"),
                ({"validation_split": 0.1}, "train_loss", "so tune.metric train_loss ranks"),
                ({"validation_split": 0.1}, "eval_loss",
                 "and data.validation_split holds each trial's rows out of them, so "
                 "tune.metric eval_loss would rank trials by different held-out images; set "
                 "data.validation_uri")):
            with pytest.raises(ConfigError) as err:
                validate({**base, "data": {**data, **held},
                          "tune": {"metric": metric, "search_space": space}})
            mine = [p for p in err.value.problems if p.startswith(f"tune.search_space.{key}:")]
            assert len(mine) == 1 and why in mine[0], (key, metric, err.value.problems)
            assert mine[0].startswith(f"tune.search_space.{key}: trains each trial on the images "
                                      f"of its own {key}, ")
        cfg = validate({**base, "data": {**data, "validation_uri": "h"},
                        "tune": {"metric": "eval_loss", "search_space": space}})
        assert cfg.tune.search_space[key].choice == values


def test_a_search_of_the_training_size_ranks_trials_at_one_size():
    """A data.resolution search ranked trials by losses at different sizes: train_loss at
    each trial's own, eval_loss at each trial's largest data.resolution (the same noise
    level hides less of a larger image). Both are refused, naming the key and the sizes;
    eval_loss with validation.resolution (every trial measured at one size) searches it,
    and so does a data.sources search whose sources train at one size. validation.resolution
    itself is not searched with eval_loss: it sets how the loss is measured."""
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"}}
    held = {"uri": "d1", "resolution": 64, "validation_uri": "h", "bucketing": True}
    sized = [[{"uri": "d1"}], [{"uri": "d1", "resolution": 128}]]
    for data, key, values in (({"uri": "d1", "resolution": 64}, "data.resolution", [64, 128]),
                              ({**held, "uri": None, "sources": sized[0]}, "data.sources", sized)):
        space = {key: {"grid": values}}
        for metric, val, why in (
                ("train_loss", {}, "so tune.metric train_loss ranks them by their size as much "
                                   "as by what they learned; use tune.metric: eval_loss with "
                                   "validation.resolution"),
                ("eval_loss", {}, "and each trial's held-out loss (eval_loss) is measured at "
                                  "its largest data.resolution, so the search would rank them "
                                  "by their size as much as by what they learned; set "
                                  "validation.resolution")):
            with pytest.raises(ConfigError) as err:
                validate({**base, "data": {**held, **data}, "validation": val,
                          "tune": {"metric": metric, "search_space": space}})
            mine = [p for p in err.value.problems if p.startswith(f"tune.search_space.{key}: trains "
                                                                  "trials at different sizes (64, 128 px), ")]
            assert len(mine) == 1 and why in mine[0], (key, metric, err.value.problems)
        cfg = validate({**base, "data": {**held, **data}, "validation": {"resolution": 96},
                        "tune": {"metric": "eval_loss", "search_space": space}})
        assert cfg.eval_resolution() == 96
    one_size = [[{"uri": "d1"}], [{"uri": "d1"}, {"uri": "d2", "resolution": 64}]]
    cfg = validate({**base, "data": {**held, "uri": None, "sources": one_size[0]},
                    "tune": {"metric": "eval_loss", "search_space": {"data.sources": {"grid": one_size}}}})
    assert cfg.eval_resolution() == 64
    with pytest.raises(ConfigError, match=r"tune.search_space.validation.resolution: sets the size "
                                          r"the held-out loss \(eval_loss\) is measured at"):
        validate({**base, "data": held, "tune": {
            "metric": "eval_loss", "search_space": {"validation.resolution": {"grid": [64, 128]}}}})


def test_places_a_search_names_are_made_absolute_as_the_base_configs(tmp_path, monkeypatch):
    """`choice: [a, b]` of data.uri was checked and planned on the driver, then read by each
    trial in Ray Tune's trial directory and by its workers in theirs, where `b` named
    nothing (or another folder), and `a`, the base's own folder, was planned again as
    another. A search value that names a place is made absolute as the base's are;
    remote URIs and None stay, other keys' values are untouched."""
    from raylora import tune as rt
    from raylora.launch import resolve_paths

    monkeypatch.chdir(tmp_path)
    here = str(tmp_path)
    tree = {"model": {"pretrained": "/m"}, "data": {"uri": "a", "validation_uri": "h"},
            "output": {"uri": "o"},
            "tune": {"search_space": {
                "data.uri": {"choice": ["a", ["./b", "s3://bucket/c/"]]},
                "lora.init_from": {"grid": [None, "adapters/x", "hf://user/repo"]},
                "train.learning_rate": {"choice": [1e-4, 2e-4]}}}}
    cfg = resolve_paths(validate(tree))
    space = cfg.tune.search_space
    assert cfg.data.uri == f"{here}/a"
    assert space["data.uri"].choice == [f"{here}/a", [f"{here}/b", "s3://bucket/c"]]
    assert space["lora.init_from"].grid == [None, f"{here}/adapters/x", "hf://user/repo"]
    assert space["train.learning_rate"].choice == [1e-4, 2e-4]
    assert resolve_paths(cfg).tune.search_space == space  # once is enough
    # the base's own folder is the base's data, not a variant to plan
    assert rt.trial_tree(cfg.to_dict(), {"data.uri": space["data.uri"].choice[0]})["data"] == \
        cfg.to_dict()["data"]
    sources = {**tree, "data": {"sources": [{"uri": "a"}], "validation_uri": "h"},
               "tune": {"search_space": {"data.sources": {"grid": [
                   [{"uri": "a", "weight": 2}], [{"uri": "a"}, {"uri": "gs://b/d/", "caption_prefix": "ohwx"}]]}}}}
    grid = resolve_paths(validate(sources)).tune.search_space["data.sources"].grid
    assert grid == [[{"uri": f"{here}/a", "weight": 2}],
                    [{"uri": f"{here}/a"}, {"uri": "gs://b/d", "caption_prefix": "ohwx"}]]


def trial_tree_of(cfg, params: dict) -> dict:
    from raylora.config import trial_tree

    return trial_tree(cfg.to_dict(), params)


def test_a_search_of_a_bucketed_resolution_plans_each_trials_buckets(base_config, tmp_path,
                                                                     monkeypatch):
    """data.bucketing with data.resolution searched: a trial at 128 px was handed the bucket
    ids the base's scan gave at 64 px ({0, 4, 5}), and its workers, finding no row of
    bucket 4 at 128 px, failed. Each resolution's buckets are now scanned at it, as
    `raylora train` scans them."""
    from PIL import Image

    from raylora import tune as rt
    from raylora.launch import plan, resolve_paths

    folder = tmp_path / "aspect"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(128, 128)] * 4 + [(192, 96)] * 4 + [(96, 192)] * 4):
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"i{i:02d}.png")
        (folder / f"i{i:02d}.txt").write_text(f"a picture number {i}")
    tree = {**base_config, "data": {"uri": str(folder), "resolution": 64, "bucketing": True,
                                    "bucket_step": 16},
            "train": {**base_config["train"], "max_steps": None, "num_epochs": 1},
            # every trial's held-out loss at one size, on one held-out set
            "validation": {"resolution": 128},
            "tune": {"metric": "eval_loss",
                     "search_space": {"data.resolution": {"grid": [64, 128]}}}}
    tree["data"]["validation_uri"] = str(folder)
    cfg = resolve_paths(validate(tree))
    base = rt.preflight(cfg)
    at64, at128 = _trial_plans(monkeypatch, cfg.to_dict(), base, str(tmp_path / "trials"),
                               {"data.resolution": 64}, {"data.resolution": 128})
    assert at64.data_plan().bucket_histogram() == {0: 4, 4: 4, 5: 4}
    assert at128.data_plan().bucket_histogram() == {0: 4, 5: 4, 11: 4}
    assert at128.bucket_summary()["rows"] == {"128x128": 4, "80x176": 4, "176x80": 4}
    assert (at128.bucket_steps, at128.max_steps) == ({0: 2, 5: 2, 11: 2}, 6)
    alone = plan(validate(trial_tree_of(cfg, {"data.resolution": 128})))
    assert at128.bucket_summary() == alone.bucket_summary()


def test_train_loss_does_not_rank_a_search_of_what_weights_it():
    """tune.metric train_loss with train.snr_gamma searched ranked trials by their weighting
    (γ 0.01 logged 0.154, γ 100 1.112) and exported γ 0.01 as the best, though its
    held-out loss was worse. Keys that weight the training loss, or set the density of its
    timesteps or its noise, are refused with train_loss and searched with eval_loss; the
    flow shift and the prediction type change the held-out loss too, and are refused
    with either metric."""
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"}, "data": {"uri": "d"}}
    searched = {
        "train.snr_gamma": ({"grid": [0.01, 100.0]}, "training loss by min(SNR, γ)"),
        "train.noise_offset": ({"choice": [0.0, 0.1]}, "adds its offset to the noise"),
        "train.flow.loss_weighting": ({"choice": ["none", "sigma_sqrt"]}, "weights each sample's"),
        "train.flow.timestep_sampling": ({"choice": ["uniform", "mode"]}, "sets the density"),
        "train.flow.logit_mean": ({"uniform": [-1.0, 1.0]}, "sets the density"),
        "train.flow.logit_std": ({"uniform": [0.5, 1.5]}, "sets the density"),
        "train.flow.mode_scale": ({"uniform": [0.5, 1.5]}, "sets the density"),
        "train.prior_loss_weight": ({"choice": [0.5, 1.0]}, "weighs the class images' loss"),
        "data.masked_loss": ({"choice": [False, True]}, "leaves each image's masked-out part out"),
    }
    prior = {"class_prompt": "a dog"}
    for key, (dim, why) in searched.items():
        data = {**base["data"], **(prior if key == "train.prior_loss_weight" else {})}
        train = {"flow": {"timestep_sampling": "mode"}} if key.endswith("mode_scale") else {}
        with pytest.raises(ConfigError) as err:
            validate({**base, "data": data, "train": train,
                      "tune": {"metric": "train_loss", "search_space": {key: dim}}})
        assert [p for p in err.value.problems if p.startswith(f"tune.search_space.{key}:")] == [
            f"tune.search_space.{key}: {rt_scales()[key]}, so tune.metric train_loss ranks trials "
            "by that, not by what they learned; use tune.metric: eval_loss (the held-out loss: "
            "unweighted, at fixed timesteps and noise) with data.validation_split or "
            "data.validation_uri"], key
        assert why in rt_scales()[key]
        held = {**data, "validation_split": 0.1}
        assert key in validate({**base, "data": held, "train": train,
                                "tune": {"search_space": {key: dim}}}).tune.search_space
    # Without prior preservation the weight weighs nothing (refused as such, alone).
    with pytest.raises(ConfigError) as err:
        validate({**base, "tune": {"metric": "train_loss", "search_space": {
            "train.prior_loss_weight": {"choice": [0.5, 1.0]}}}})
    assert all("prior preservation is off" in p for p in err.value.problems)
    for key, dim in (("train.flow.shift", {"choice": [1.0, 3.0]}),
                     ("train.prediction_type", {"choice": ["epsilon", "v_prediction"]})):
        for metric in ("train_loss", "eval_loss"):
            with pytest.raises(ConfigError, match=rf"tune.search_space.{key}: .* so no tune.metric "
                                                  "compares trials that differ in it; set "):
                validate({**base, "data": {"uri": "d", "validation_split": 0.1},
                          "tune": {"metric": metric, "search_space": {key: dim}}})
    # How the held-out loss is measured (its timesteps, its noise): eval_loss trials scored
    # by different measurements; train_loss does not read them.
    held = {"uri": "d", "validation_split": 0.1}
    for key, dim, what in (("validation.num_timesteps", {"choice": [1, 8]}, "sets the timesteps"),
                           ("validation.seed", {"choice": [0, 1]}, "draws the noise")):
        with pytest.raises(ConfigError) as err:
            validate({**base, "data": held, "tune": {"metric": "eval_loss", "search_space": {key: dim}}})
        assert [p for p in err.value.problems if p.startswith(f"tune.search_space.{key}:")] == [
            f"tune.search_space.{key}: {what} {'at which ' if 'timesteps' in what else ''}the "
            f"held-out loss (eval_loss) is measured{' with' if 'noise' in what else ''}, so "
            "tune.metric eval_loss would rank trials by how each was measured, not by what it "
            f"learned; set {key} once for every trial"], key
        assert key in validate({**base, "data": held, "tune": {
            "metric": "train_loss", "search_space": {key: dim}}}).tune.search_space
    for key, dim in (("data.validation_split", {"choice": [0.1, 0.2]}),
                     ("data.validation_max_samples", {"choice": [4, 8]})):
        with pytest.raises(ConfigError, match=rf"tune.search_space.{key}: chooses .*held-out rows "
                                              "the held-out loss \\(eval_loss\\) is measured on, so "
                                              "tune.metric eval_loss would rank trials by how each "
                                              "was measured"):
            validate({**base, "data": held, "tune": {"metric": "eval_loss", "search_space": {key: dim}}})


def rt_scales() -> dict:
    from raylora.config import TRAIN_LOSS_SCALES

    return TRAIN_LOSS_SCALES


def test_a_search_of_finite_choices_runs_each_combination_once():
    """`{choice: [8, 16]}` with the default num_samples (8) ran 8 trials, each value 4
    times with one train.seed: identical trials, where a grid with repeats is refused.
    Random search over choices (and randints) alone now runs each combination once, as a
    grid; more samples than combinations are refused; fewer are drawn; a searched
    train.seed, or a float range, keeps the draws."""
    from collections import Counter

    import numpy as np
    from ray.tune.search.sample import _BackwardsCompatibleNumpyRng
    from ray.tune.search.variant_generator import generate_variants

    from raylora import tune as rt
    from raylora.config import TuneSection
    from raylora.tune import expected_trials, param_space

    tree = {"model": {"pretrained": "m"}, "output": {"uri": "o"}, "data": {"uri": "d"},
            "train": {"seed": 42}}

    def tn(space, **kw):
        tune = {"metric": "train_loss", "search_space": space, **kw}
        return validate({**tree, "tune": tune}).tune

    def trials(t):  # what Tune's generator proposes, samples × grid
        rng = _BackwardsCompatibleNumpyRng(np.random.default_rng(42))
        return [tuple(v[k] for k in t.search_space) for _ in range(t.samples)
                for _, v in generate_variants(param_space(t), random_state=rng)]

    rank = {"lora.rank": {"choice": [8, 16]}}
    t = tn(rank)
    assert (t.samples, expected_trials(t), Counter(trials(t))) == (1, 2, {(8,): 1, (16,): 1})
    assert rt.samples_note(t) == ("lora.rank take 2 distinct combination(s) and train.seed is not "
                               "searched: each runs once (more draws would repeat trials)")
    assert Counter(trials(tn(rank, num_samples=2))) == {(8,): 1, (16,): 1}
    # with a grid: every (alpha, rank) pair once; a randint's integers too
    both = tn({**rank, "lora.alpha": {"grid": [4, 8]}, "lora.dropout": {"choice": [0.0]}})
    assert sorted(trials(both)) == [(8, 4, 0.0), (8, 8, 0.0), (16, 4, 0.0), (16, 8, 0.0)]
    assert sorted(trials(tn({"lora.rank": {"randint": [4, 7]}}))) == [(4,), (5,), (6,)]
    with pytest.raises(ConfigError) as err:
        tn(rank, num_samples=8)
    assert err.value.problems == [
        "tune.num_samples: 8 draws of lora.rank, which take 2 distinct combination(s), repeat "
        "trials with the same train.seed (identical trials); set at most 2 (2 under random "
        "search: each combination once), or search train.seed too ({grid: [0, 1, 2]})"]
    one = tn(rank, num_samples=1)
    assert (one.samples, len(trials(one)), rt.samples_note(one)) == (1, 1, None)
    # 9 combinations: the default 8 are drawn, as before
    nine = tn({"lora.rank": {"choice": [4, 8, 16]}, "lora.alpha": {"choice": [4, 8, 16]}})
    assert (nine.samples, expected_trials(nine)) == (8, 8)
    # a searched seed, or a float range: draws differ
    assert tn({**rank, "train.seed": {"choice": [0, 1]}}).samples == 8
    assert tn({**rank, "train.learning_rate": {"loguniform": [1e-5, 1e-3]}}).samples == 8
    # optuna and hyperopt draw: the default is capped at the combinations
    capped = TuneSection.model_validate({"search_space": rank, "search_alg": "optuna"})
    assert (capped.samples, capped.every_combination) == (2, False)
    assert rt.samples_note(capped) == ("lora.rank take 2 distinct combination(s) and train.seed is "
                                    "not searched: num_samples 2 instead of 8 (more draws "
                                    "would repeat trials)")


def test_a_stopped_search_names_each_trials_own_step_budget(base_config, capsys):
    """After a stop, a search of train.max_steps over [40, 200] said "stopped at step 6/200"
    for the trial of 40 steps: every trial was shown the base's budget."""
    from ray.tune import Result

    from raylora import tune as rt
    from raylora.cli import _say_search_stopped

    tree = {**base_config, "train": {**base_config["train"], "max_steps": 200},
            "tune": {"metric": "train_loss", "scheduler": "fifo",
                     "search_space": {"train.max_steps": {"grid": [40, 200]}}}}
    cfg = validate(tree)
    base = rt.preflight(cfg)

    def result(trial, steps):
        return Result(metrics={"trial_id": trial, "step": 6, "config": {"train.max_steps": steps}},
                      checkpoint=None, error=None, path=f"/t/{trial}")

    parked = {"a_00000": 6, "a_00001": 7, "a_00002": None}
    _say_search_stopped({"stopped": "SIGTERM to the driver", "expired": False, "timeout_s": 120,
                         "parked": parked, "max_steps": {"a_00000": 40, "a_00001": 200},
                         "search": "/o/tune"})
    err = capsys.readouterr().err
    assert ("raylora:   trial_a_00000 stopped at step 6/40 with a checkpoint\n"
            "raylora:   trial_a_00001 stopped at step 7/200 with a checkpoint\n"
            "raylora:   trial_a_00002 did not start\n") in err
    # run_tune's budgets: each parked trial's own, from its values (step_budget)
    grid = [result("a_00000", 40), result("a_00001", 200), result("a_00002", 40)]
    assert rt.parked_budgets(grid, parked, cfg.tune,
                             lambda p: rt.step_budget(cfg.to_dict(), p, base)) == {
        "a_00000": 40, "a_00001": 200}


# ---------------------------------------------------------------- on Ray

# 2 workers per trial where the machine has the cores for two trials side by side.
WORKERS = 2 if (os.cpu_count() or 1) >= 4 else 1


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from raylora.launch import start_local_ray
    from raylora.tune import trial_resources

    per_trial = trial_resources(validate({
        "model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"},
        "scaling": {"num_workers": WORKERS},
    }))["CPU"]
    start_local_ray(num_cpus=int(2 * per_trial))  # room for exactly two trials at a time
    yield
    ray.shutdown()


@pytest.mark.integration
def test_search_stops_the_diverging_trial_and_exports_the_best(ray_local, tiny_model, demo_data, tmp_path, capsys):
    from raylora.cli import main

    from raylora.data.demo import write_parquet_shards

    out = tmp_path / "out"
    heldout = tmp_path / "heldout"
    write_parquet_shards(heldout, n=6, num_shards=1, size=64, seed=99)
    job = tmp_path / "tune.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"pretrained": tiny_model},
        # Per-worker shard files read in order: every trial sees the same batches whatever
        # the timing, so which trial ASHA stops is decided by the numbers alone.
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True, "sharding": "files",
                 "validation_uri": str(heldout), "validation_max_samples": 6},
        # No self-abort on NaN steps within the budget: this test is about ASHA stopping it.
        "train": {"batch_size": 2, "max_steps": 8, "seed": 3, "max_nonfinite_steps": 50},
        "validation": {"every_n_steps": 2, "num_timesteps": 2, "prompts": ["a red circle"],
                       "num_inference_steps": 1},
        "scaling": {"num_workers": WORKERS},
        "checkpoint": {"every_n_steps": 4},
        "output": {"uri": str(out)},
        "tune": {
            # Grid order is trial order: the diverging lr (30) starts last, after the two
            # others (running side by side) have set the bar at the first rung.
            "search_space": {
                "train.learning_rate": {"grid": [1e-3, 5e-4, 30.0]},
                "lora.rank": {"choice": [2, 4]},
            },
            "num_samples": 1,
            "grace_period": 2,
            "reduction_factor": 2,
        },
    }))
    assert main(["tune", str(job)]) == 0
    printed = capsys.readouterr().out
    assert "raylora: best adapter" in printed and "final_eval_loss" in printed

    with open(out / "tune" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    doc = json.loads((out / "tune" / "results.json").read_text())
    assert doc["metric"] == "eval_loss" and len(doc["trials"]) == 3
    assert [float(r["train.learning_rate"]) for r in rows] == [1e-3, 5e-4, 30.0]
    assert all(int(r["lora.rank"]) in (2, 4) for r in rows)
    by_lr = {float(r["train.learning_rate"]): r for r in doc["trials"]}
    bad = by_lr[30.0]
    assert bad["status"] == "stopped_early" and bad["stopped_early"] is True
    assert bad["steps"] < 8
    completed = [r for r in doc["trials"] if r["status"] == "completed"]
    assert completed and all(r["steps"] == 8 for r in completed)
    # The driver prints each trial's own progress lines; the completed ones reach step 8.
    seen: dict[str, int] = {}
    for m in re.finditer(r"^raylora: (trial_\S+) step (\d+)/8 \(\d+%\) epoch \d+ loss ", printed,
                         re.M):
        seen[m[1]] = max(seen.get(m[1], 0), int(m[2]))
    assert set(seen) == {f"trial_{r['trial_id']}" for r in doc["trials"]}
    assert all(seen[f"trial_{r['trial_id']}"] == 8 for r in completed)
    # Each stopped one says where (its workers train on until Tune's stop reaches them);
    # ASHA may stop a slower learner at the first rung too.
    said = [ln for ln in printed.splitlines() if " stopped early " in ln]
    assert sorted(said) == sorted(
        f"raylora: trial_{r['trial_id']} stopped early at step {r['steps']}/8 by the search's "
        "scheduler (its results are that step's)"
        for r in doc["trials"] if r["status"] == "stopped_early"), said
    # Diverged (a NaN/inf held-out loss) or simply worse than every finished trial.
    assert bad["diverged"] or all(bad["final_eval_loss"] > r["final_eval_loss"] for r in completed)
    assert not any(r["diverged"] for r in completed)
    assert all(r["error"] is None and r["resumed_from_step"] is None for r in doc["trials"])

    best = min(completed, key=lambda r: r["final_eval_loss"])
    meta = json.loads((out / "best" / "adapter" / "raylora.json").read_text())
    assert meta["tune"]["trial_id"] == best["trial_id"]
    assert meta["config"]["train"]["learning_rate"] == best["train.learning_rate"]
    assert meta["config"]["lora"]["rank"] == best["lora.rank"]
    assert meta["metrics"]["steps"] == 8
    assert meta["metrics"]["eval_loss_last"] == pytest.approx(best["final_eval_loss"], rel=1e-9)
    # Bad-record counts cover the whole search: every trial's reads, none of them bad.
    assert meta["data"]["bad_records"] == {} and meta["metrics"]["bad_records"] == 0
    assert meta["data"]["rows_decoded"] >= 2 * sum(r["steps"] for r in doc["trials"])
    assert {"README.md", "manifest.json", "pytorch_lora_weights.safetensors"} <= set(
        os.listdir(out / "best" / "adapter"))
    # Each trial is its own resumable Ray Train run under tune/trials/, its previews beside
    # its checkpoints (they were all written to {output.uri}/validation, over each other).
    assert sorted(os.listdir(out / "tune" / "trials")) == sorted(f"trial_{r['trial_id']}" for r in rows)
    assert not (out / "validation").exists()
    for r in doc["trials"]:
        shown = sorted(os.listdir(out / "tune" / "trials" / f"trial_{r['trial_id']}" / "validation"))
        assert shown[0] == "step_000000.png" and len(shown) >= 2, (r["trial_id"], shown)

    assert stock_image_change("sd", tiny_model, out / "best" / "adapter") > 1e-6

    # The metric is reproducible outside the run: the best checkpoint's LoRA weights,
    # evaluated here on the same held-out rows, give the number the trial reported.
    again = _recompute_heldout(meta["config"], os.path.join(best["checkpoint_path"], "lora.safetensors"), 6)
    assert again == pytest.approx(best["final_eval_loss"], rel=1e-5)


def _recorded_steps(out) -> dict[str, dict]:
    """Each trial's latest checkpoint that Ray Train recorded: its metrics, by trial folder."""
    return {p.parent.name: json.loads(p.read_text())["latest_checkpoint_result"]["metrics"]
            for p in (out / "tune" / "trials").glob("*/checkpoint_manager_snapshot.json")}


def _search_signalled(tmp_path, tiny_model, demo_data, rates: list, signum):
    """A 40-step search of ``train.learning_rate`` over ``rates`` (each trial side by side,
    checkpoints every 4 steps) whose `raylora tune` driver, joined to this module's Ray, gets
    ``signum`` once a trial has a recorded checkpoint. Returns (out, job, driver, stdout,
    stderr) once the driver has exited."""
    import subprocess
    import sys
    import time

    import ray

    out = tmp_path / "out"
    job = tmp_path / "tune.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 40, "seed": 3},
        "scaling": {"num_workers": WORKERS},
        "checkpoint": {"every_n_steps": 4},
        "output": {"uri": str(out)},
        "tune": {"search_space": {"train.learning_rate": {"grid": rates}}, "num_samples": 1,
                 "metric": "train_loss", "scheduler": "fifo"},
    }))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    driver = subprocess.Popen([sys.executable, "-m", "raylora", "tune", str(job)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not _recorded_steps(out):
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.1)
    driver.send_signal(signum)
    stdout, err = driver.communicate(timeout=120)
    return out, job, driver, stdout, err


@pytest.mark.integration
def test_a_stopped_search_resumes_each_trial_from_its_stop(ray_local, tiny_model, demo_data, tmp_path,
                                                          capsys):
    """`raylora stop` (SIGTERM to the search's driver) stops every running trial at a step with
    a checkpoint of that step, saves the search and says so; the same command resumes each
    trial from that step, and one results table comes at the end. Another config is
    refused before Ray, naming what changed."""
    import signal

    from raylora.cli import main

    # The first driver is stopped once a trial has a recorded checkpoint (step 4 of 40), as
    # `raylora stop` or Kubernetes would stop it. Both trials run side by side.
    out, job, driver, _, err = _search_signalled(tmp_path, tiny_model, demo_data, [1e-3, 5e-4],
                                                 signal.SIGTERM)
    assert driver.returncode == 130, err
    assert f"raylora: search stopped (SIGTERM to the driver); its state is in {out / 'tune'}" in err
    assert "raylora: run the same command again to resume the search" in err
    said = {f"trial_{t}": int(s) for t, s in
            re.findall(r"raylora:   trial_(\w+) stopped at step (\d+)/40 with a checkpoint", err)}
    trials = sorted(p.name for p in (out / "tune" / "trials").iterdir())
    stopped = _recorded_steps(out)
    recorded = {t: m["step"] for t, m in stopped.items()}
    # Every trial that trained stopped at a step of its own, not at a periodic checkpoint,
    # and the checkpoint recorded last is that step's, written for the stop.
    assert said and said == recorded, (said, err)
    assert all(m["stopped"] == "stop requested" for m in stopped.values()), stopped
    assert all(0 < s < 40 for s in said.values())
    assert sorted(said) == trials and len(trials) == 2, err
    assert not (out / "tune" / "results.json").exists()

    changed = main(["tune", str(job), "train.max_steps=30", "lora.rank=8"])
    err = capsys.readouterr().err
    assert changed == 2
    assert f"output.uri: {out / 'tune'} holds a search started with another config" in err
    assert "Changed: lora.rank: 4 then, 8 now; train.max_steps: 40 then, 30 now" in err

    # A search recorded by an older raylora lacks the keys added since: it still resumes.
    from raylora.tune import SEARCH_FILE

    record = out / "tune" / SEARCH_FILE
    doc = json.loads(record.read_text())
    del doc["config"]["train"]["groupnorm_fp32"]
    record.write_text(json.dumps(doc))
    sigint = signal.getsignal(signal.SIGINT)
    assert main(["tune", str(job)]) == 0
    # Tune's fit() left its own SIGINT handler installed; raylora puts this one back.
    assert signal.getsignal(signal.SIGINT) is sigint
    doc = json.loads((out / "tune" / "results.json").read_text())
    assert sorted(f"trial_{r['trial_id']}" for r in doc["trials"]) == trials
    assert sorted(p.name for p in (out / "tune" / "trials").iterdir()) == trials
    assert all(r["status"] == "completed" and r["steps"] == 40 for r in doc["trials"]), doc
    assert {f"trial_{r['trial_id']}": r["resumed_from_step"] for r in doc["trials"]
            if f"trial_{r['trial_id']}" in recorded} == recorded
    with open(out / "tune" / "results.csv") as f:
        assert {r["resumed_from_step"] for r in csv.DictReader(f)} <= {"", *map(str, recorded.values())}
    for t, step in recorded.items():  # Tune's own per-trial log of every report
        [log] = out.glob(f"tune/_trial_{t[len('trial_'):]}_*/result.json")
        resumed = {json.loads(line).get("resumed_from_step") for line in log.read_text().splitlines()}
        assert step in resumed, (t, resumed)
    assert (out / "best" / "adapter" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.integration
def test_ctrl_c_ends_a_search_as_interrupted_with_no_results(ray_local, tiny_model, demo_data, tmp_path):
    """Ctrl-C reaches Tune's own SIGINT handler, which saves the search and returns from
    fit() with no error: raylora then wrote a results table of the unfinished trials and
    exported a "best" adapter (exit 0), or failed on a checkpoint still in flight (exit 2,
    "No such file"). An interrupted search ends as an interrupted run does: exit 130, the
    same command resumes it (as test_a_stopped_search_resumes_each_trial_from_its_stop
    shows), no results."""
    import signal

    out, _, driver, stdout, err = _search_signalled(tmp_path, tiny_model, demo_data, [1e-3],
                                                    signal.SIGINT)
    assert driver.returncode == 130, err[-3000:]
    # (Ray's log lines of the shared cluster may come after it)
    assert ("raylora: interrupted; run the same command again to resume the search (each "
            "unfinished trial from its latest checkpoint)") in err.splitlines(), err[-3000:]
    assert "Error" not in err and "raylora: results" not in stdout, err[-3000:]
    assert "Tuner.restore(" not in err  # Tune's hint of a Python call (raylora.quiet)
    assert not (out / "tune" / "results.json").exists() and not (out / "best").exists()
    assert all(m["step"] < 40 for m in _recorded_steps(out).values())
    assert not (out / "lease.json").exists()  # released: the rerun may start at once


@pytest.mark.integration
def test_two_workers_share_the_heldout_evaluation(ray_local, tiny_model, demo_data, tmp_path):
    """2 DDP workers each evaluate half the held-out items and all-reduce the sums: the run's
    number equals one process evaluating all of them."""
    from raylora.data.demo import write_parquet_shards
    from raylora.launch import run

    heldout = tmp_path / "heldout"
    write_parquet_shards(heldout, n=5, num_shards=1, size=64, seed=98)
    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True,
                 "validation_uri": str(heldout)},
        # Min-SNR weighting, noise offset and the kohya export ride along (#6 knobs).
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-3, "snr_gamma": 5.0,
                  "noise_offset": 0.05},
        "validation": {"every_n_steps": 2, "num_timesteps": 3, "seed": 4},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 4},
        "export": {"formats": ["diffusers", "kohya"]},
        "output": {"uri": str(tmp_path / "out")},
    }
    summary = run(validate(tree))
    assert summary["kohya"] == str(tmp_path / "out" / "adapter_kohya.safetensors")
    assert os.path.getsize(summary["kohya"]) > 0
    m = summary["metrics"]
    rows = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert rows[-1]["eval_loss"] == m["eval_loss_last"]
    assert m["eval_loss_base"] is not None
    assert m["eval_loss_best"] == min([m["eval_loss_base"]] + [r["eval_loss"] for r in rows if "eval_loss" in r])
    ckpts = sorted(d for d in os.listdir(tmp_path / "out" / "train") if d.startswith("checkpoint_2"))
    lora = os.path.join(tmp_path, "out", "train", ckpts[-1], "lora.safetensors")
    meta = json.loads((tmp_path / "out" / "adapter" / "raylora.json").read_text())
    assert meta["data"]["heldout_rows"] == 5
    assert _recompute_heldout(meta["config"], lora, 5) == pytest.approx(m["eval_loss_last"], rel=1e-5)


def _recompute_heldout(config: dict, lora_file: str, expect_rows: int) -> float:
    """The held-out loss of a stored LoRA state, computed in this process from the config."""
    from safetensors.torch import load_file

    from raylora.launch import plan, resolve_paths
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora, load_lora_state_dict
    from raylora.train.setup import frozen_parts

    cfg = resolve_paths(validate(config))
    p = plan(cfg)
    assert p.heldout_rows == expect_rows
    batch = Preprocess(StageSpec(cfg.model.pretrained, cfg.data.resolution, center_crop=True, random_flip=False))({
        "image": np.array([r["image"] for r in p.heldout], dtype=object),
        "text": np.array([r["text"] for r in p.heldout], dtype=object),
    })
    comps = load_components(cfg.model, torch.float32, cfg.storage.client())
    add_lora(comps.denoiser, cfg.lora, comps.family.lora_targets)
    load_lora_state_dict(comps.denoiser, load_file(lora_file))
    parts = frozen_parts(cfg, comps, "cpu", torch.float32)
    v = cfg.validation
    held = prepare_heldout(parts, {"pixel_values": torch.from_numpy(batch["pixel_values"]),
                                   "input_ids": torch.from_numpy(batch["input_ids"])},
                           v.num_timesteps, v.seed, batch_size=cfg.train.batch_size)
    return heldout_loss(comps.denoiser, held, torch.float32, batch_size=cfg.train.batch_size)


@pytest.mark.integration
def test_lr_find_writes_table_plot_and_a_suggestion_in_range(ray_local, base_config, tmp_path):
    from raylora.launch import run_lr_find

    base_config["output"]["uri"] = str(tmp_path / "lrf")
    # scale_lr on, accumulation 3: the sweep itself runs unscaled; the lr for the config is
    # the suggestion / (batch 2 × accumulation 3)
    base_config["train"].update(scale_lr=True, gradient_accumulation_steps=3)
    s = run_lr_find(validate(base_config), start_lr=1e-5, end_lr=1e3, num_steps=12)
    assert 1e-5 <= s["suggested_lr"] <= 1e3
    assert s["scale_lr_divisor"] == 6 and s["learning_rate"] == pytest.approx(s["suggested_lr"] / 6)
    assert s["suggested_lr"] == pytest.approx(max(s["lr_at_min_loss"] / 10, 1e-5))
    with open(tmp_path / "lrf" / "lr_find.csv") as f:
        rows = list(csv.DictReader(f))
    assert 2 <= len(rows) <= 12 and len(rows) == s["steps_run"]
    # Its rows went through the validating decode and were counted (none bad here).
    assert s["bad_records"] == {} and s["rows_decoded"] >= 2 * s["steps_run"]
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[0] == pytest.approx(1e-5)
    assert all(b / a == pytest.approx((1e3 / 1e-5) ** (1 / 11)) for a, b in zip(lrs, lrs[1:]))
    assert all(math.isfinite(float(r["loss"])) for r in rows[:-1])
    png = (tmp_path / "lrf" / "lr_find.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(tmp_path / "lrf" / "lr_find.png").size == (600, 350)


def test_a_search_keeps_every_aws_credential_out_of_its_trials_env_vars(monkeypatch):
    """Ray Tune copies the driver's AWS keys into each trial actor's runtime_env env_vars
    (logged by the runtime-env agent on every node); within a search none of them is, the
    session token's legacy name AWS_SECURITY_TOKEN included, and Tune's list is as it was
    afterwards. (test_jobs checks a real submitted search's logs.)"""
    from ray.tune.execution.class_cache import ENV_VARS_TO_PROPAGATE, _ActorClassCache
    from ray.tune.registry import get_trainable_cls, register_trainable

    from raylora.tune import _credentials_kept_from_trial_env_vars

    for k, v in {"AWS_ACCESS_KEY_ID": "AKIA0TUNE", "AWS_SECRET_ACCESS_KEY": "s3cret",
                 "AWS_SESSION_TOKEN": "sess", "AWS_SECURITY_TOKEN": "sess"}.items():
        monkeypatch.setenv(k, v)
    before = set(ENV_VARS_TO_PROPAGATE)

    def trial(config):
        pass

    register_trainable("raylora_env_probe", trial)
    with _credentials_kept_from_trial_env_vars():
        remote = _ActorClassCache().get(get_trainable_cls("raylora_env_probe"))
    env = remote._default_options["runtime_env"]["env_vars"]
    assert not [k for k in env if k.startswith("AWS_")], env
    assert set(ENV_VARS_TO_PROPAGATE) == before and "AWS_SECURITY_TOKEN" in before


def test_each_trials_tracker_run_is_named_after_the_trial(tmp_path, monkeypatch):
    """With tracking.run_name set, each trial's wandb run is `{run_name}/trial_<id>`: every
    trial's run had the one name, and the search's runs could not be told apart. Unset,
    it is the trial's own name, as before (the last part of its output.uri)."""
    import glob
    from types import SimpleNamespace

    import ray.tune
    import ray.tune.integration.ray_train

    from raylora import tune as rt
    from raylora.track import open_tracker
    from test_track import read_wandb_log

    monkeypatch.setenv("WANDB_SILENT", "true")
    trial_id = [None]
    monkeypatch.setattr(ray.tune.integration.ray_train, "TuneReportCallback", lambda: None)
    monkeypatch.setattr(ray.tune, "get_context",
                        lambda: SimpleNamespace(get_trial_id=lambda: trial_id[0]))
    monkeypatch.setattr(rt, "replan", lambda cfg, plan: plan)
    names = {}

    class Trainer:
        def __init__(self, cfg):
            self.cfg = cfg

        def fit(self):  # the tracker the trial's rank-0 worker opens (worker._Reporter)
            out = self.cfg.output.uri
            open_tracker(self.cfg.tracking, out, {}).close()
            (log,) = glob.glob(f"{out}/tracking/wandb/offline-run-*/run-*.wandb")
            run = next(r.run for r in read_wandb_log(log) if r.WhichOneof("record_type") == "run")
            names[self.cfg.tracking.run_name, trial_id[0]] = run.display_name
            return SimpleNamespace(metrics={})

    monkeypatch.setattr(rt, "build_trainer", lambda cfg, p, uri, name, **kw: Trainer(cfg))
    for run_name, trials in (("lr-sweep", ("a_00000", "a_00001")), (None, ("b_00000",))):
        out = tmp_path / str(run_name)
        base = validate({"model": {"pretrained": "m"}, "data": {"uri": "d"},
                         "output": {"uri": str(out)},
                         "tracking": {"backend": "wandb", "wandb_mode": "offline",
                                      "run_name": run_name}}).to_dict()
        for trial_id[0] in trials:
            rt._trial({"train.learning_rate": 1e-4}, base_tree=base, base_plan=None,
                      trials_uri=str(out / "tune" / "trials"))
    assert names == {("lr-sweep/trial_a_00000", "a_00000"): "lr-sweep/trial_a_00000",
                     ("lr-sweep/trial_a_00001", "a_00001"): "lr-sweep/trial_a_00001",
                     (None, "b_00000"): "trial_b_00000"}
