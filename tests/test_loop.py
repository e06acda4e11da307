"""The training loop in one process (no Ray): steps, accumulation, checkpoints, exact resume."""

import re

import numpy as np
import pytest
import torch

from raylora.checkpoint.state import load_state
from raylora.config import ConfigError, validate
from raylora.train.loop import LoopHooks, LoopSettings, run_loop
from raylora.train.setup import build_run

from inproc import _fresh_accelerator, _train


def test_accumulation_checkpoints_and_exact_resume(base_config, batches, tmp_path):
    base_config["train"].update(
        gradient_accumulation_steps=2, lr_scheduler="cosine", lr_warmup_steps=2, max_steps=6,
        ema_decay=0.9,
    )
    base_config["checkpoint"]["every_n_steps"] = 2
    cfg = validate(base_config)

    straight, saved = _train(cfg, batches, 6, str(tmp_path / "a"))
    assert saved == [(2, False), (4, False), (6, True)]
    st = straight.state
    # 6 optimizer steps × 2 micro-batches = 12 micro-batches over 8-batch epochs.
    assert (st.global_step, st.epoch, st.batches_in_epoch) == (6, 1, 4)
    assert st.images_seen == 6 * 2 * 2
    assert [r["step"] for r in st.history] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) for r in st.history)
    lrs = [r["lr"] for r in st.history]
    assert lrs[0] == pytest.approx(cfg.train.learning_rate / 2)  # warmup 1/2
    assert lrs[1] == pytest.approx(cfg.train.learning_rate)  # warmup done
    assert lrs[-1] < lrs[2]  # cosine decays
    final = straight.lora_state()
    assert any(float(v.abs().max()) > 0 for k, v in final.items() if "lora_B" in k)

    # Stop after the step-2 checkpoint (mid-epoch), resume in a "new process", finish.
    restored = load_state(str(tmp_path / "a" / "step_2"), rank=0)
    assert restored.loop.global_step == 2 and restored.loop.batches_in_epoch == 4
    resumed, saved_b = _train(cfg, batches, 6, str(tmp_path / "b"), restored=restored)
    assert saved_b == [(4, False), (6, True)]
    assert resumed.state.resumed_from_step == 2
    for k, v in final.items():
        torch.testing.assert_close(resumed.lora_state()[k], v, rtol=1e-5, atol=1e-7)
    assert [r["loss"] for r in resumed.state.history] == pytest.approx(
        [r["loss"] for r in st.history], rel=1e-5
    )
    # The EMA resumes too (its shadow and update count are in the checkpoint)...
    assert straight.ema.num_updates == resumed.ema.num_updates == 6
    for a, b in zip(straight.ema.shadow, resumed.ema.shadow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # ...and the published adapter is the EMA, while lora.safetensors keeps the raw weights.
    from diffusers.utils import convert_state_dict_to_diffusers
    from safetensors.torch import load_file

    final_dir = tmp_path / "a" / "step_6"
    adapter = load_file(str(final_dir / "adapter" / "pytorch_lora_weights.safetensors"))
    with straight.ema.swapped_in(straight.params):
        ema_sd = convert_state_dict_to_diffusers(straight.lora_state())
    for k, v in ema_sd.items():
        torch.testing.assert_close(adapter["unet." + k], v)
    raw = load_file(str(final_dir / "lora.safetensors"))
    for k, v in final.items():
        torch.testing.assert_close(raw[k], v)
    assert any(not torch.equal(adapter["unet." + k], convert_state_dict_to_diffusers(final)[k])
               for k in ema_sd if "up" in k)


def test_a_resume_takes_the_configs_learning_rate_and_another_worker_counts_schedule(
        base_config, batches, tmp_path):
    """README: a resume may change the learning rate (and the NaN advice says to lower it):
    the resumed steps run at the new rate on the restored schedule, with the new weight
    decay, the Adam moments kept. A checkpoint of 2 workers resumed on 1 (not elastic:
    FSDP's DCP reshards, a rerun may change scaling.num_workers) goes on at the schedule's
    position in optimizer steps; unconverted, a linear schedule sat at its end (lr 0)."""
    base_config["train"].update(lr_scheduler="linear", max_steps=6, learning_rate=1e-3)
    cfg = validate(base_config)
    straight, _ = _train(cfg, batches, 6, str(tmp_path / "a"))
    lrs = [r["lr"] for r in straight.state.history]  # each step's, after its schedule step
    assert lrs == pytest.approx([1e-3 * k / 6 for k in (5, 4, 3, 2, 1, 0)])
    ckpt = str(tmp_path / "a" / "step_2")

    lower = validate({**base_config, "train": {**base_config["train"], "learning_rate": 4e-4,
                                               "adam_weight_decay": 0.05}})
    resumed, _ = _train(lower, batches, 6, str(tmp_path / "b"), restored=load_state(ckpt, rank=0))
    assert [r["lr"] for r in resumed.state.history] == pytest.approx(lrs[:2] + [4e-4 * k / 6 for k in (3, 2, 1, 0)])
    groups = resumed.optimizer.param_groups
    assert [(g["initial_lr"], g["weight_decay"]) for g in groups] == [(4e-4, 0.05)]
    assert resumed.lr_scheduler.scheduler.base_lrs == [4e-4]
    assert resumed.optimizer.optimizer.state  # the moments came back

    # What 2 workers write at step 2: the schedule stepped twice per optimizer step
    # (Accelerate steps it once per process), the same 4 micro-batches as 2 per worker.
    two = load_state(ckpt, rank=0)
    two.scheduler_sd["last_epoch"] *= 2
    two.scheduler_sd["_step_count"] = two.scheduler_sd["last_epoch"] + 1
    two.loop.world_size, two.loop.batches_in_epoch = 2, two.loop.batches_in_epoch // 2
    one, _ = _train(cfg, batches, 6, str(tmp_path / "c"), restored=two)
    assert [r["lr"] for r in one.state.history] == pytest.approx(lrs)
    # The same global micro-batches skipped: steps 3-6 train what the straight run's did.
    assert [r["loss"] for r in one.state.history] == pytest.approx(
        [r["loss"] for r in straight.state.history], rel=1e-5)


def test_only_lora_weights_change(base_config, batches, tmp_path):
    cfg = validate(base_config)
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 2, rank=0)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    run_loop(run, LoopSettings(max_steps=2, images_per_step=2, checkpoint_every=100),
             LoopHooks(lambda e: batches))
    changed = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in changed if "lora_B" in n}


def test_gradient_checkpointing_gives_the_same_step(base_config, batches):
    """Recomputing activations in backward changes memory, not the maths."""
    from raylora.train.step import train_micro_step

    results = []
    for gc in (False, True):
        cfg = validate({**base_config, "train": {**base_config["train"], "gradient_checkpointing": gc}})
        accel = _fresh_accelerator(1)
        run = build_run(cfg, accel, 2, rank=0)
        assert run.model.is_gradient_checkpointing is gc
        loss = train_micro_step(accel, run.model, run.parts, run.optimizer, run.lr_scheduler,
                                run.params, batches[0], 1.0)
        results.append((float(loss), run.lora_state()))
    (l0, sd0), (l1, sd1) = results
    assert l0 == pytest.approx(l1, rel=1e-6)
    changed = [k for k in sd0 if "lora_B" in k and float(sd0[k].abs().max()) > 0]
    assert changed
    for k in sd0:
        torch.testing.assert_close(sd0[k], sd1[k], rtol=1e-5, atol=1e-7)


def test_ema_update_matches_the_formula_with_warmup():
    from raylora.train.ema import LoraEMA, ema_decay_at

    # diffusers' EMAModel (no use_ema_warmup): 0 at its first step, then (1+n)/(10+n)
    from diffusers.training_utils import EMAModel

    ref = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=0.999)
    assert [ema_decay_at(n, 0.999) for n in (0, 1, 10)] == pytest.approx(
        [ref.get_decay(k + 1) for k in (0, 1, 10)])
    assert [ema_decay_at(n, 0.999) for n in (0, 1, 10)] == pytest.approx([0.0, 2 / 11, 11 / 20])
    assert ema_decay_at(10_000, 0.999) == 0.999
    p = torch.nn.Parameter(torch.zeros(3))
    ema = LoraEMA([p], 0.5)
    expected = torch.zeros(3)
    for n, value in enumerate([1.0, 2.0, 4.0]):
        p.data.fill_(value)
        d = ema.update([p])
        assert d == pytest.approx(min(0.5, (1 + n) / (10 + n)) if n else 0.0)
        expected = d * expected + (1 - d) * value
        torch.testing.assert_close(ema.shadow[0], expected)
    with ema.swapped_in([p]):
        torch.testing.assert_close(p.data, expected)
    assert torch.equal(p.data, torch.full((3,), 4.0))
    again = LoraEMA([p], 0.5)
    again.load_state_dict(ema.state_dict())
    assert again.num_updates == 3 and torch.equal(again.shadow[0], ema.shadow[0])


def test_nonfinite_steps_are_skipped_counted_and_abort_when_repeated(base_config, batches):
    """A NaN in the batch (here: NaN pixels) makes the loss NaN: that optimizer step is
    skipped, so the weights do not move, and counted; too many in a row stop the run."""
    from raylora.train.loop import NonFiniteLossError
    from raylora.train.setup import nonfinite_advice

    poisoned = {**batches[1], "pixel_values": torch.full(batches[1]["pixel_values"].shape, float("nan"))}
    cfg = validate(base_config)
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 4, rank=0)
    snapshots = []
    run_loop(run, LoopSettings(max_steps=4, images_per_step=2, checkpoint_every=100),
             LoopHooks(lambda e: [batches[0], poisoned, batches[2], batches[3]],
                       on_step=lambda row: snapshots.append([p.detach().clone() for p in run.params])))
    st = run.state
    assert st.global_step == 4 and st.nonfinite_steps == 1
    losses = [r["loss"] for r in st.history]
    assert np.isnan(losses[1]) and all(np.isfinite(losses[i]) for i in (0, 2, 3))
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1]))  # step 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))  # step 3 trained
    assert all(torch.isfinite(p).all() for p in run.params)

    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 6, rank=0)
    advice = nonfinite_advice(cfg)
    with pytest.raises(NonFiniteLossError, match=r"NaN/inf for 3 optimizer steps in a row \(steps 2-4") as ei:
        run_loop(run, LoopSettings(max_steps=6, images_per_step=2, checkpoint_every=100,
                                   max_nonfinite_steps=3, nonfinite_advice=advice),
                 LoopHooks(lambda e: [batches[0]] + [poisoned] * 5))
    assert "lower train.learning_rate (now 0.001)" in str(ei.value)
    fp16 = validate({**base_config, "train": {**base_config["train"], "mixed_precision": "fp16"},
                     "scaling": {"use_gpu": True}})
    assert "fp16 overflow" in nonfinite_advice(fp16)


def test_an_fp16_overflow_skip_is_the_scalers_calibration_not_a_nonfinite_step(base_config, batches):
    """fp16: GradScaler skips a step whose scaled gradients overflow and halves its scale
    (and tries a larger scale every 2000 clean steps). The loss was finite: the row keeps
    it and the run goes on; a scale that starts far too high overflowed 5 steps in a row,
    which was reported as NaN and stopped the run. Accelerate builds the scaler on CUDA
    only, so the same GradScaler is attached to the CPU Accelerator here."""
    cfg = validate(base_config)
    accel = _fresh_accelerator(1, "fp16")
    accel.scaler, accel.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40), True
    run = build_run(cfg, accel, 8, rank=0)
    scales, snapshots = [], []
    run_loop(run, LoopSettings(max_steps=8, images_per_step=2, checkpoint_every=100,
                               max_nonfinite_steps=3, readback_every=1),
             LoopHooks(lambda e: batches[:8], on_step=lambda row: (
                 scales.append(accel.scaler.get_scale()),
                 snapshots.append([p.detach().clone() for p in run.params]))))
    st = run.state
    losses = [r["loss"] for r in st.history]
    assert st.global_step == 8 and st.nonfinite_steps == 0 and all(np.isfinite(losses))
    assert scales == [2.0 ** (39 - i) for i in range(8)]  # 8 overflows in a row, each skipped
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[-1]))


def _readbacks(monkeypatch) -> list[int]:
    """How many steps each read-back of the loss brought home (a spy on the loop's one
    device → host transfer of losses)."""
    from raylora.train import loop

    sizes, real = [], loop._read_back

    def spy(run, settings, progress, hooks):
        if progress.pending:
            sizes.append(len(progress.pending))
        real(run, settings, progress, hooks)

    monkeypatch.setattr(loop, "_read_back", spy)
    return sizes


def test_loss_read_back_every_n_steps_keeps_rows_weights_and_ema(base_config, batches, monkeypatch):
    """#24 item 2: losses read back every 3 steps instead of every step: the same rows (in
    step order, to on_step too), the same weights and EMA; fewer transfers."""
    base_config["train"].update(max_steps=7, ema_decay=0.9)
    cfg = validate(base_config)
    sizes = _readbacks(monkeypatch)
    result = {}
    for every in (1, 3):
        run = build_run(cfg, _fresh_accelerator(1), 7, rank=0)
        seen = []
        settings = LoopSettings(max_steps=7, images_per_step=2, checkpoint_every=5,
                                readback_every=every)
        run_loop(run, settings, LoopHooks(lambda e: batches, on_step=lambda r: seen.append(dict(r))))
        result[every] = (run, seen)
    # every 1: 7 transfers of one step; every 3: at steps 3, 5 (checkpoint), 6, 7 (final).
    assert sizes == [1] * 7 + [3, 2, 1, 1]
    (one, seen1), (three, seen3) = result[1], result[3]
    assert [r["step"] for r in seen3] == list(range(1, 8))
    for a, b in zip(seen1, seen3):
        assert (a["step"], a["epoch"], a["lr"]) == (b["step"], b["epoch"], b["lr"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and b["images_per_s"] > 0
    assert [r["loss"] for r in three.state.history] == [r["loss"] for r in seen3]
    assert three.state.train_loss_last == seen3[-1]["loss"]
    for p, q in zip(one.params, three.params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    assert one.ema.num_updates == three.ema.num_updates == 7
    for p, q in zip(one.ema.shadow, three.ema.shadow):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-host-check", "fused-on-device"])
def test_nonfinite_step_skipped_with_deferred_readback(base_config, batches, fused):
    """A NaN step is skipped whether the host checks the gradient norm (for-each AdamW) or
    the fused AdamW skips on the device from a found_inf flag (no readback); with losses
    read back every 4 steps it is still counted, the EMA ignores it, and repeated NaN
    steps still abort, naming the steps."""
    from raylora.train.loop import NonFiniteLossError

    poisoned = {**batches[1], "pixel_values": torch.full(batches[1]["pixel_values"].shape, float("nan"))}
    base_config["train"]["ema_decay"] = 0.9
    cfg = validate(base_config)

    def fresh(steps):
        run = build_run(cfg, _fresh_accelerator(1), steps, rank=0)
        inner = run.optimizer.optimizer
        assert isinstance(inner, torch.optim.AdamW)
        if fused:  # CPU has the fused kernel too; raylora uses it on CUDA
            for g in inner.param_groups:
                g["fused"], g["foreach"] = True, False
        return run, inner

    run, inner = fresh(4)
    seen = []
    settings = LoopSettings(max_steps=4, images_per_step=2, checkpoint_every=100, readback_every=4)

    def on_step(row):
        seen.append(row["step"])

    snapshots = []

    def after_each_step():  # called right after every optimizer step, before any readback
        snapshots.append([p.detach().clone() for p in run.params])
        return 0

    run_loop(run, settings, LoopHooks(lambda e: [batches[0], poisoned, batches[2], batches[3]],
                                      on_step=on_step, should_stop=after_each_step))
    st = run.state
    assert seen == [1, 2, 3, 4] and st.nonfinite_steps == 1
    losses = [r["loss"] for r in st.history]
    assert np.isnan(losses[1]) and all(np.isfinite(losses[i]) for i in (0, 2, 3))
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1]))  # step 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))  # step 3 trained
    # Three updates, not four: Adam's own step count shows the skip too.
    assert {int(inner.state[p]["step"]) for p in run.params} == {3}
    assert all(torch.isfinite(p).all() for p in run.params)
    assert all(torch.isfinite(s).all() for s in run.ema.shadow)
    assert getattr(inner, "found_inf", None) is None  # not left for a later step()

    run, _ = fresh(6)
    with pytest.raises(NonFiniteLossError, match=r"NaN/inf for 3 optimizer steps in a row \(steps 2-4"):
        run_loop(run, LoopSettings(max_steps=6, images_per_step=2, checkpoint_every=100,
                                   max_nonfinite_steps=3, readback_every=4),
                 LoopHooks(lambda e: [batches[0]] + [poisoned] * 5))


def test_first_batch_hook_runs_once_before_the_model_does(base_config, batches, tmp_path):
    """#24: train.sdpa_backend's probe gets the first batch before the step-0 evaluation
    (which may compile the model); pinning a kernel leaves the losses as they were; a
    kernel that cannot run the model fails on that batch, before any step or checkpoint."""
    cfg = validate(base_config)
    run = build_run(cfg, _fresh_accelerator(1), 3, rank=0)
    events = []
    hooks = LoopHooks(lambda e: batches,
                      first_batch=lambda b: events.append(("first", b["input_ids"].shape[0])),
                      evaluate=lambda: events.append(("eval",)) or 1.0,
                      on_step=lambda r: events.append(("step", r["step"])))
    run_loop(run, LoopSettings(max_steps=3, images_per_step=2, checkpoint_every=100), hooks)
    assert events == [("first", 2), ("eval",), ("step", 1), ("step", 2), ("step", 3), ("eval",)]

    losses = {}
    for kernel in ("default", "math"):
        base_config["train"]["sdpa_backend"] = kernel
        trained, saved = _train(validate(base_config), batches, 3, str(tmp_path / kernel))
        losses[kernel] = [r["loss"] for r in trained.state.history]
    assert losses["math"] == pytest.approx(losses["default"], rel=1e-4)
    base_config["train"]["sdpa_backend"] = "efficient"  # a CUDA kernel: refused up front on CPU
    with pytest.raises(ConfigError, match="train.sdpa_backend: efficient is a CUDA kernel"):
        validate(base_config)
    cfg = validate({**base_config, "train": {**base_config["train"], "sdpa_backend": "default"}})
    on_cpu = cfg.model_copy(update={"train": cfg.train.model_copy(update={"sdpa_backend": "efficient"})})
    with pytest.raises(ValueError, match="train.sdpa_backend=efficient"):  # the run's own check
        _train(on_cpu, batches, 3, str(tmp_path / "efficient"))
    assert not (tmp_path / "efficient").exists()


def _notices(*infos):
    """A rank's preemption notices, one per StopWatch.check (None: none yet)."""
    it = iter(infos)
    return lambda: next(it, infos[-1] if infos else None)


def test_a_preemption_notice_checkpoints_once_and_training_goes_on(base_config, batches, caplog):
    """raylora.stop: a notice (Ray Train's PreemptionInfo for this worker) is checkpointed
    at the step it is agreed, once per distinct notice; the loop trains on to max_steps."""
    import logging
    import time

    from ray.train import PreemptionInfo

    from raylora import worker
    from raylora.stop import StopWatch

    a = PreemptionInfo(deadline_ms=int(time.time() * 1000) + 90_000,
                       preempted_node_to_ranks={"0123456789abcdef0123": [0]})
    b = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"0123456789abcdef0123": [0],
                                                                   "fedcba9876543210fedc": [1]})
    watch = StopWatch(0, 1, None, torch.device("cpu"), notice=_notices(None, None, a, a, b))
    cfg = validate(base_config)
    run = build_run(cfg, _fresh_accelerator(1), 6, rank=0)
    saved = []
    hooks = LoopHooks(lambda e: batches, should_stop=watch.check,
                      checkpoint_now=worker._notice_checkpoint(watch, 0),
                      on_checkpoint=lambda st, final: saved.append((st.global_step, final,
                                                                    watch.noticed_step)))
    with caplog.at_level(logging.WARNING, logger="raylora.worker"):
        run_loop(run, LoopSettings(max_steps=6, images_per_step=2, checkpoint_every=100), hooks)
    assert saved == [(3, False, 3), (5, False, 5), (6, True, 5)]
    assert [r["step"] for r in run.state.history] == [1, 2, 3, 4, 5, 6] and watch.code == 0
    said = [r.getMessage() for r in caplog.records if "preemption notice" in r.getMessage()]
    assert len(said) == 2
    assert re.match(r"step 3: preemption notice \(node 0123456789ab goes, in (8\d|90) s\)", said[0])
    assert said[1].startswith("step 5: preemption notice (node 0123456789ab, fedcba987654 goes, "
                              "no deadline given)")


def test_an_error_while_a_notice_is_held_waits_until_past_its_deadline(caplog):
    """raylora.stop.hold_error_for_notice: a rank failing while its run holds a preemption
    notice (the survivors' collective when the drained node goes) holds the error until the
    notice's deadline plus the grace, so Ray Train's controller restarts the workers as a
    preemption before it sees this error; anything else raises at once."""
    import logging

    from ray.train import PreemptionInfo

    from raylora.stop import NOTICE_GRACE_S, NOTICE_NO_DEADLINE_S, Preempted, hold_error_for_notice

    now = 1_800_000_000.0
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:57995. This is typically caused by a remote worker crashing.")

    def notice(deadline_in_s):
        return PreemptionInfo(
            deadline_ms=None if deadline_in_s is None else int((now + deadline_in_s) * 1000),
            preempted_node_to_ranks={"0123456789abcdef0123": [1]})

    def hold(error, info):
        slept = []
        waited = hold_error_for_notice(error, notice=lambda: info, now=lambda: now,
                                       sleep=slept.append)
        assert slept == ([waited] if waited else [])
        return waited

    with caplog.at_level(logging.WARNING, logger="raylora.stop"):
        assert hold(gloo, notice(3)) == pytest.approx(3 + NOTICE_GRACE_S)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "), said
    assert "while node 0123456789ab is being preempted: holding this error back 8 s" in said[0]
    assert hold(gloo, notice(-2)) == pytest.approx(NOTICE_GRACE_S - 2)  # just past: the grace
    assert hold(gloo, notice(-60)) == 0  # long past: Ray Train would have restarted by now
    # No deadline given: Ray Train waits its default from the notice; so does the rank.
    assert hold(gloo, notice(None)) == pytest.approx(NOTICE_NO_DEADLINE_S + NOTICE_GRACE_S)
    # No notice, a SIGTERM's own stop, an interrupt: at once.
    assert hold(gloo, None) == 0
    assert hold(Preempted("step 7: a worker got SIGTERM"), notice(3)) == 0
    assert hold(KeyboardInterrupt(), notice(3)) == 0
    # Outside a Ray Train worker there is no train context to read a notice from.
    assert hold_error_for_notice(gloo, now=lambda: now, sleep=pytest.fail) == 0


def _two_rank_notices(rank: int, world: int, port: int, out: str) -> None:
    import json

    import torch.distributed as dist
    from ray.train import PreemptionInfo

    from raylora.stop import StopWatch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n1": [1]})
    # Only rank 1 is told, at its third check.
    watch = StopWatch(rank, world, None, torch.device("cpu"),
                      notice=_notices(None, None, info) if rank == 1 else _notices(None))
    taken = []
    for step in range(1, 7):
        watch.check()
        taken.append(watch.take_notice(step))
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(taken, f)
    dist.destroy_process_group()


def test_every_rank_takes_a_notice_at_the_same_check(tmp_path):
    """Ray Train tells every worker, but not at the same step: the ranks agree through the
    StopWatch's (one step late) MAX all-reduce, so each checkpoints at the same step."""
    import json

    from localhead import free_port
    from ranks import spawn

    spawn(_two_rank_notices, 2, 2, free_port(), str(tmp_path))
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert got[0] == got[1] == [False, False, False, True, False, False]


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_the_stop_timeout_interrupts_the_main_thread_whether_sigint_is_handled_or_not(sigint):
    """raylora.stop.interrupt_main, from the stop timeout's thread: KeyboardInterrupt in the
    main thread through SIGINT's handler, or, in a process started with SIGINT ignored (a
    background job; _thread.interrupt_main alone did nothing there), through the CLI's
    SIGTERM handler, asked a second time."""
    import signal
    import threading
    import time

    from raylora import launch
    from raylora.stop import interrupt_main

    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    asked: list[bool] = []

    def asked_twice() -> bool:
        asked.append(True)
        return False  # what stop.driver_requests' hook says once it was signalled

    signal.signal(signal.SIGINT,
                  signal.default_int_handler if sigint == "handled" else signal.SIG_IGN)
    signal.signal(signal.SIGTERM, launch._raise_interrupt)
    launch.SIGTERM_HOOKS.append(asked_twice)
    timer = threading.Timer(0.05, interrupt_main)
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            timer.start()
            while time.monotonic() - t0 < 10:
                time.sleep(0.01)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()
        launch.SIGTERM_HOOKS.remove(asked_twice)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    assert asked == ([] if sigint == "handled" else [True])


def _reporter(cfg, run, max_steps):
    """The worker's reporter (rank 1: no tracker files) over ``run``, as on a worker."""
    from types import SimpleNamespace

    from raylora.worker import _Reporter

    spec = SimpleNamespace(config=cfg, plan=SimpleNamespace(max_steps=max_steps), progress_board=None)
    return _Reporter(spec, run, rank=1)


def test_a_report_says_the_mean_train_loss_since_the_one_before(base_config, batches, monkeypatch):
    """tune.metric train_loss ranked trials (ASHA, the best one) by the loss of the last step
    before each report: one batch's. A report's train_loss is now the mean over the steps
    since the report before it, from the losses the loop read back anyway (no more
    transfers); the rows and train_loss_last stay each step's own."""
    base_config["train"]["max_steps"] = 7
    cfg = validate(base_config)
    sizes = _readbacks(monkeypatch)
    run = build_run(cfg, _fresh_accelerator(1), 7, rank=0)
    reporter = _reporter(cfg, run, 7)
    reports = []
    settings = LoopSettings(max_steps=7, images_per_step=2, checkpoint_every=5, readback_every=3)
    run_loop(run, settings, LoopHooks(lambda e: batches, on_checkpoint=lambda st, final: reports.append(
        reporter.metrics(st))))
    assert sizes == [3, 2, 1, 1]  # as without the reports: read back at 3, 5, 6, 7
    losses = [r["loss"] for r in run.state.history]
    assert [r["step"] for r in reports] == [5, 7]
    assert reports[0]["train_loss"] == pytest.approx(sum(losses[:5]) / 5, rel=1e-12)
    assert reports[1]["train_loss"] == pytest.approx(sum(losses[5:]) / 2, rel=1e-12)
    assert reports[1]["train_loss"] != losses[-1] == run.state.train_loss_last


def test_the_reported_train_loss_over_skipped_steps_prior_terms_and_a_resume(base_config):
    """Steps skipped for NaN/inf are left out of the mean, but a report whose last step was
    skipped says inf (diverging, ranked last); prior preservation's terms are means over the
    same steps; a second report of a step (a preemption's) says the same; a run resumed at its
    final checkpoint reports it over the steps since the checkpoint before it."""
    from types import SimpleNamespace

    from raylora.checkpoint.state import LoopState

    cfg = validate(base_config)  # checkpoint.every_n_steps 2
    history = [{"step": s, "loss": float(s), "loss_instance": s / 2, "loss_prior": s / 4}
               for s in range(1, 5)]
    state = LoopState(global_step=2, history=history[:2], train_loss_last=2.0)
    run = SimpleNamespace(state=state, lr_scheduler=SimpleNamespace(get_last_lr=lambda: [1e-4]),
                          accelerator=SimpleNamespace(num_processes=1))
    reporter = _reporter(cfg, run, 4)
    first = reporter.metrics(state)
    assert (first["train_loss"], first["train_loss_instance"], first["train_loss_prior"]) == (
        1.5, 0.75, 0.375)
    state.global_step, state.history = 4, history
    assert reporter.metrics(state)["train_loss"] == 3.5 == reporter.metrics(state)["train_loss"]
    resumed = _reporter(cfg, run, 4)  # a new process restored at step 4: steps 3 and 4
    assert resumed.metrics(state)["train_loss"] == 3.5

    from raylora.worker import checkpoint_before, interval_mean

    nan = float("nan")
    rows = [{"step": s, "loss": v} for s, v in enumerate([4.0, 3.0, nan, 1.0, 2.0, nan], start=1)]
    assert interval_mean(rows, 0) == float("inf")
    assert interval_mean(rows[:5], 0) == (4.0 + 3.0 + 1.0 + 2.0) / 4
    assert interval_mean(rows[:5], 3) == 1.5 and interval_mean(rows[:5], 5) is None
    assert [checkpoint_before(s, 4) for s in (0, 1, 4, 8, 10)] == [0, 0, 0, 4, 8]


def test_images_per_s_leaves_out_the_evaluation_before_it(base_config, batches, monkeypatch):
    """The step after a held-out evaluation (or preview, or checkpoint) read its time as
    training: 0.2 img/s where it trained at 2.2. On a clock that moves 1 s a reading and
    100 s an evaluation, every step's window is the same length."""
    import raylora.train.loop as loop

    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    def evaluate():
        clock[0] += 100.0
        return 1.0

    cfg = validate(base_config)
    run = build_run(cfg, _fresh_accelerator(1), 4, rank=0)
    rows = []
    clock[0] = loop.time.perf_counter()  # where the loop's own start times (the real clock) are
    monkeypatch.setattr(loop.time, "perf_counter", tick)
    run_loop(run, LoopSettings(max_steps=4, images_per_step=2, checkpoint_every=100, eval_every=2),
             LoopHooks(lambda e: batches, evaluate=evaluate, on_step=rows.append))
    rates = [r["images_per_s"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(rates) / min(rates) < 2, rates  # step 3: 2 / ~103 s before


def test_a_finished_runs_target_modules_in_another_order_export_again(tmp_path):
    """Rerunning a finished run with lora.target_modules [to_k, to_q, ...] where it trained
    [to_q, to_k, ...], or with the family's default list written out for null, was refused
    ("Set them back to export it again") though the resume check takes both as the same
    LoRA (README: the same names in another order are the same LoRA). Another set, or
    another learning rate, is still named."""
    import json

    from raylora.launch import _changed_since_export, _exported_meta

    def config(**lora):
        return validate({"model": {"pretrained": "m"}, "data": {"uri": "d"},
                         "output": {"uri": str(tmp_path / "out")}, "lora": lora})

    trained = config(target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    (tmp_path / "out" / "adapter").mkdir(parents=True)
    (tmp_path / "out" / "adapter" / "raylora.json").write_text(json.dumps({"config": trained.to_dict()}))
    exported = _exported_meta(trained, trained.storage.client())
    assert _changed_since_export(config(target_modules=["to_k", "to_q", "to_v", "to_out.0"]), exported, "sd") == {}
    assert _changed_since_export(config(target_modules=None), exported, "sd") == {}  # SD's default
    assert _changed_since_export(config(target_modules=["to_q", "to_k"]), exported, "sd") == {
        "lora.target_modules": (["to_q", "to_k", "to_v", "to_out.0"], ["to_q", "to_k"])}
    assert _changed_since_export(config(target_modules=["to_k", "to_q", "to_v", "to_out.0"], rank=8),
                                 exported, "sd") == {"lora.rank": (trained.lora.rank, 8)}
