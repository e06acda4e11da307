"""The training loop: epochs → micro-batches → optimizer steps → checkpoints. No Ray.

The loop owns the data position (epoch, micro-batches consumed) so a resumed run skips
what it already trained on. Where batches come from and where checkpoints, metrics and
previews go are the ``LoopHooks`` passed in, which is all ``worker.py`` adds on top.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from raylora.checkpoint.state import LoopState
from raylora.train.step import train_micro_step


class NonFiniteLossError(RuntimeError):
    """Training kept producing NaN/inf: stopping beats burning hours on a dead run."""

    # A restart from the latest checkpoint retakes the same steps (raylora.entry).
    restart_repeats = True


class DataEndedError(RuntimeError):
    """A worker's data ran out before the run's plan said it would (rows dropped as bad,
    an empty shard): a restart reads the same data (raylora.entry)."""

    restart_repeats = True


@dataclass(frozen=True)
class LoopSettings:
    """The numbers the loop runs by (from the config and the plan)."""

    max_steps: int
    images_per_step: int  # batch × accumulation × workers: one optimizer step's images
    checkpoint_every: int
    max_grad_norm: float = 1.0
    # Held-out loss and previews every N steps; None: at every checkpoint. Both also
    # run before the first step of a fresh run and at the end.
    eval_every: int | None = None
    max_nonfinite_steps: int = 5
    nonfinite_advice: str = ""
    # Losses stay on the device for this many steps, then are read back in one transfer:
    # a per-step ``.item()`` makes the host wait for the GPU queue to drain every step.
    readback_every: int = 1
    world_size: int = 1
    accumulation: int = 1  # micro-batches per optimizer step on each worker
    # Elastic runs: a step's row lists every worker's samples (a collective), in the
    # global order, so runs at different sizes can be compared sample for sample.
    gather_samples: bool = False

    @classmethod
    def from_config(cls, cfg, max_steps: int, world_size: int, advice: str = "",
                    device: str = "cpu") -> LoopSettings:
        t = cfg.train
        readback_every = t.readback_every_n_steps or (1 if device == "cpu" else 10)
        return cls(
            max_steps=max_steps,
            images_per_step=t.batch_size * t.gradient_accumulation_steps * world_size,
            checkpoint_every=cfg.checkpoint.every_n_steps, max_grad_norm=t.max_grad_norm,
            eval_every=cfg.validation.every_n_steps, max_nonfinite_steps=t.max_nonfinite_steps,
            nonfinite_advice=advice, readback_every=readback_every, world_size=world_size,
            accumulation=t.gradient_accumulation_steps,
            gather_samples=cfg.scaling.elastic and t.record_samples,
        )


def _no_op(*args) -> None:
    return None


@dataclass
class LoopHooks:
    """Where the loop's data comes from and where its results go.

    ``on_checkpoint(state, final)`` is called on every rank at the same steps (Ray's
    report is a barrier), and always once with ``final=True`` at the end. ``evaluate()``
    (the held-out loss) runs at the evaluation steps; its value is in ``state`` and in the
    step's history row before ``on_checkpoint``, and ``on_eval(state)`` reports the
    evaluations that fall between checkpoints; ``on_base_eval(state)`` gets a fresh run's
    step-0 evaluation (``state.eval_loss_base``), which neither of those sees.
    ``preview(step)`` renders validation images at the same steps. ``sample_ids(batch)``
    names the samples of a batch, kept in each step's row (``train.record_samples``).
    ``first_batch(batch)`` gets the first micro-batch this process trains on, before
    anything runs the model (the step-0 evaluation included): ``train.sdpa_backend`` times
    attention kernels on its shapes.
    """

    epoch_batches: Callable[[int], Iterable[dict]]
    on_checkpoint: Callable[[LoopState, bool], None] = _no_op
    on_step: Callable[[dict], None] = _no_op
    evaluate: Callable[[], float] | None = None
    on_eval: Callable[[LoopState], None] = _no_op
    on_base_eval: Callable[[LoopState], None] = _no_op
    preview: Callable[[int], None] | None = None
    sample_ids: Callable[[dict], list[str]] | None = None
    # After every optimizer step on every rank (a collective: raylora.stop.StopWatch):
    # truthy = checkpoint this step and end the loop (`raylora stop`, SIGTERM).
    should_stop: Callable[[], int] = _no_op
    # Right after should_stop, on every rank, the same answer everywhere: truthy =
    # checkpoint this step and go on (a preemption notice; gets the step number).
    checkpoint_now: Callable[[int], bool] = _no_op
    first_batch: Callable[[dict], None] = _no_op


@dataclass
class _Progress:
    """Within one ``run_loop`` call: what the step being built has seen so far."""

    micro_losses: list[torch.Tensor] = field(default_factory=list)
    # Steps done whose rows wait for their loss (still on the device): (row, local loss
    # and, with prior preservation, loss_instance and loss_prior after it).
    pending: list[tuple[dict, torch.Tensor, tuple[str, ...]]] = field(default_factory=list)
    t_readback: float = field(default_factory=time.perf_counter)
    micro_terms: list[dict] = field(default_factory=list)  # prior preservation's loss terms
    samples: list[str] = field(default_factory=list)
    buckets: list[torch.Tensor] = field(default_factory=list)  # 0-d, read back with the losses
    nonfinite_in_a_row: int = 0
    last_checkpoint: int = -1
    t_start: float = field(default_factory=time.perf_counter)
    wall_before: float = 0.0
    stopped: bool = False  # should_stop() said so: the loop ends after this step's checkpoint
    begun: bool = False  # first_batch and the step-0 evaluation/preview have run


def run_loop(run, settings: LoopSettings, hooks: LoopHooks) -> LoopState:
    """Train ``run`` (a ``raylora.train.setup.TrainingRun``) until its state reaches
    ``settings.max_steps``; returns the final state."""
    state = run.state
    progress = _Progress(wall_before=state.wall_seconds)
    while state.global_step < settings.max_steps and not progress.stopped:
        _run_epoch(run, settings, hooks, progress)
    if progress.last_checkpoint != state.global_step and not progress.stopped:
        # Restored from a checkpoint that was already at max_steps: report it again so the
        # run still ends with a final checkpoint and final metrics.
        hooks.on_checkpoint(state, True)
    return state


def _begin(state: LoopState, hooks: LoopHooks, batch: dict) -> None:
    """Once the first batch is here: ``first_batch``, then a fresh run's step-0 evaluation
    and preview."""
    hooks.first_batch(batch)
    if hooks.evaluate is not None and state.global_step == 0 and state.eval_loss_base is None:
        # Also the "latest" value until the first periodic evaluation, so every report
        # (e.g. a checkpoint before it) carries a held-out loss for Tune to compare.
        state.eval_loss_base = hooks.evaluate()
        state.record_eval(state.eval_loss_base)
        hooks.on_base_eval(state)
    if hooks.preview is not None and state.global_step == 0:
        hooks.preview(0)


def _run_epoch(run, settings: LoopSettings, hooks: LoopHooks, progress: _Progress) -> None:
    """The rest of the current epoch, or up to ``max_steps``."""
    state, acc = run.state, run.accelerator
    skip = state.batches_in_epoch
    trained = False
    for i, batch in enumerate(hooks.epoch_batches(state.epoch)):
        if i < skip:  # resumed mid-epoch: these micro-batches were already trained on
            continue
        trained = True
        if not progress.begun:
            t0 = time.perf_counter()
            _begin(state, hooks, batch)
            # Not training time (it was not when this ran before the first batch came):
            # kept out of the wall clock and the first images/s window.
            spent = time.perf_counter() - t0
            progress.t_start += spent
            progress.t_readback += spent
            progress.begun = True
        if hooks.sample_ids is not None:
            progress.samples += hooks.sample_ids(batch)
        if "bucket" in batch:  # data.bucketing: which bucket each micro-batch came from
            progress.buckets.append(batch["bucket"][0])  # a tensor: int() would sync here
        terms: dict = {}
        progress.micro_losses.append(train_micro_step(
            acc, run.model, run.parts, run.optimizer, run.lr_scheduler, run.params, batch,
            settings.max_grad_norm, terms,
        ))
        if terms:
            progress.micro_terms.append(terms)
        state.batches_in_epoch += 1
        if not acc.sync_gradients:
            continue
        row = _finish_step(run, settings, progress, hooks.sample_ids is not None)
        _after_step(run, settings, hooks, progress, row)
        if state.global_step >= settings.max_steps or progress.stopped:
            return
    if not trained and skip == 0:
        raise DataEndedError(f"epoch {state.epoch} gave this worker no batches: the data shard is empty")
    state.epoch += 1
    state.batches_in_epoch = 0


def _finish_step(run, settings: LoopSettings, progress: _Progress, with_samples: bool) -> dict:
    """An optimizer step just happened: count it and queue its row; the loss (a device
    tensor) is filled in by the next ``_read_back``."""
    state = run.state
    state.global_step += 1
    state.images_seen += settings.images_per_step
    local = torch.stack(progress.micro_losses).mean()
    progress.micro_losses = []
    if run.ema is not None:
        # Skipped (non-finite) steps are NaN on every rank (the skip follows the
        # all-reduced gradient norm): the EMA ignores them, decided on the device.
        run.ema.update(run.params, where=torch.isfinite(local))
    row = {"step": state.global_step, "epoch": state.epoch, "loss": None,
           "lr": run.lr_scheduler.get_last_lr()[0],
           # An elastic run's size at this step (the global batch is the same at every size).
           "world_size": settings.world_size, "accumulation": settings.accumulation}
    values, keys = [local], ()
    if progress.micro_terms:  # prior preservation: loss_instance, loss_prior of the step
        keys = tuple(sorted(progress.micro_terms[0]))
        values += [torch.stack([t[k] for t in progress.micro_terms]).mean() for k in keys]
        row.update(dict.fromkeys(keys))
        progress.micro_terms = []
    if with_samples:
        row["samples"], progress.samples = progress.samples, []
        if settings.gather_samples:
            row["samples"] = _all_ranks_samples(row["samples"], settings.accumulation)
    if progress.buckets:  # the bucket id (one per micro-batch when accumulating)
        row["bucket"], progress.buckets = progress.buckets, []
    progress.pending.append((row, torch.stack(values), keys))
    state.history.append(row)
    return row


def _read_back(run, settings: LoopSettings, progress: _Progress, hooks: LoopHooks) -> None:
    """Every queued step's loss in one transfer (and one all-reduce: the mean over
    workers, the loss of the global batch, NaN on every rank when a step was skipped);
    then the rows are complete and go to ``on_step`` in step order."""
    if not progress.pending:
        return
    rows = [r for r, _, _ in progress.pending]
    keys = progress.pending[0][2]  # the same every step of a run
    local = torch.stack([x for _, x, _ in progress.pending])  # [steps, 1 + terms]
    buckets = [torch.stack(r["bucket"]) for r in rows if "bucket" in r]
    progress.pending = []
    values = run.accelerator.reduce(local, reduction="mean").tolist()
    now = time.perf_counter()
    # Per step, the interval's mean: a step's own duration is unknown without a sync.
    rate = settings.images_per_step * len(rows) / max(now - progress.t_readback, 1e-9)
    progress.t_readback = now
    bucket_ids = iter(torch.cat(buckets).tolist()) if buckets else None
    for row, (loss, *terms) in zip(rows, values):
        row["loss"], row["images_per_s"] = loss, rate
        row.update(zip(keys, terms))
        if "bucket" in row:
            b = [next(bucket_ids) for _ in row["bucket"]]
            row["bucket"] = b[0] if len(b) == 1 else b
        _count_nonfinite(run.state, settings, progress, row)
        hooks.on_step(row)
    state = run.state
    if state.train_loss_first is None:
        state.train_loss_first = rows[0]["loss"]
    state.train_loss_last = rows[-1]["loss"]
    state.wall_seconds = progress.wall_before + (now - progress.t_start)


def _count_nonfinite(state: LoopState, settings: LoopSettings, progress: _Progress,
                     row: dict) -> None:
    if math.isfinite(row["loss"]):
        progress.nonfinite_in_a_row = 0
        return
    state.nonfinite_steps += 1
    progress.nonfinite_in_a_row += 1
    n, last = progress.nonfinite_in_a_row, row["step"]
    if n >= settings.max_nonfinite_steps:
        raise NonFiniteLossError(
            f"loss or gradients were NaN/inf for {n} optimizer steps in a row (steps "
            f"{last - n + 1}-{last}; those steps were skipped). {settings.nonfinite_advice}".rstrip()
        )


def _after_step(run, settings: LoopSettings, hooks: LoopHooks, progress: _Progress,
                row: dict) -> None:
    """Previews, held-out loss and checkpoint when this step is due for them."""
    state = run.state
    step = state.global_step
    final = step >= settings.max_steps
    periodic = step % settings.checkpoint_every == 0 or final
    due = final or (step % settings.eval_every == 0 if settings.eval_every else periodic)
    # Asked on every rank at every step but the last (the same count everywhere). A stop
    # adds a checkpoint, nothing else: no evaluation, so the resumed run's history is
    # the straight run's.
    progress.stopped = not final and bool(hooks.should_stop())
    noticed = not final and bool(hooks.checkpoint_now(step))
    ckpt = periodic or progress.stopped or noticed
    if ckpt or due or step % settings.readback_every == 0:
        # Before anything that reads the state: checkpoints and evaluations see whole rows.
        _read_back(run, settings, progress, hooks)
    t0 = time.perf_counter()
    if due and hooks.preview is not None:
        hooks.preview(step)
    if due and hooks.evaluate is not None:
        row["eval_loss"] = hooks.evaluate()
        state.record_eval(row["eval_loss"])
        if not ckpt:
            hooks.on_eval(state)
    if ckpt:
        hooks.on_checkpoint(state, final)
        progress.last_checkpoint = step
    # Not training: kept out of the next images/s window (a 10 s evaluation made the next
    # step read 0.2 img/s where it trained at 2.2), as the step-0 evaluation is (_begin).
    progress.t_readback += time.perf_counter() - t0


def _all_ranks_samples(mine: list[str], accumulation: int) -> list[str]:
    """Every rank's samples of this step in the global order: micro-batch ``i`` of rank
    ``r`` is global micro-batch ``i × world + r`` (raylora.data.source.global_share)."""
    from accelerate.utils import gather_object

    per_rank = gather_object([mine])
    size = len(mine) // accumulation
    return [s for i in range(accumulation) for theirs in per_rank
            for s in theirs[i * size:(i + 1) * size]]


def sample_hashes(batch: dict[str, torch.Tensor]) -> list[str]:
    """A short content hash per sample of a raw or cached batch (``train.record_samples``):
    equal hashes = the same preprocessed sample, whatever order or process it came from."""
    import hashlib

    keys = sorted(k for k, v in batch.items() if torch.is_tensor(v))
    n = batch[keys[0]].shape[0]
    out = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=6)
        for k in keys:
            # Bytes, whatever the dtype: numpy has no bfloat16 (a bf16 run's cached columns).
            row = batch[k][i].detach().cpu().contiguous().reshape(-1)
            h.update(row.view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out
