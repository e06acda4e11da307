"""The training loop: epochs → micro-batches → optimizer steps → checkpoints. No Ray.

The loop owns the data position (epoch, micro-batches consumed) so a resumed run skips
what it already trained on. Where batches come from and where checkpoints go are
callables passed in, which is all ``worker.py`` adds on top.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch

from raylora.checkpoint.state import LoopState
from raylora.train.step import FrozenParts, train_micro_step


class NonFiniteLossError(RuntimeError):
    """Training kept producing NaN/inf: stopping beats burning hours on a dead run."""


def run_loop(
    *,
    accelerator,
    model: torch.nn.Module,
    parts: FrozenParts,
    optimizer,
    lr_scheduler,
    params: list[torch.nn.Parameter],
    state: LoopState,
    max_steps: int,
    max_grad_norm: float,
    images_per_step: int,
    checkpoint_every: int,
    epoch_batches: Callable[[int], Iterable[dict]],
    on_checkpoint: Callable[[LoopState, bool], None],
    on_step: Callable[[dict], None] = lambda row: None,
    evaluate: Callable[[], float] | None = None,
    eval_every: int | None = None,
    on_eval: Callable[[LoopState], None] = lambda state: None,
    ema=None,
    preview: Callable[[int], None] | None = None,
    sample_ids: Callable[[dict], list[str]] | None = None,
    max_nonfinite_steps: int = 5,
    nonfinite_advice: str = "",
) -> LoopState:
    """Train until ``state.global_step == max_steps``; returns the final state.

    ``on_checkpoint(state, final)`` is called on every rank at the same steps (Ray's report
    is a barrier), and always once with ``final=True`` at the end.

    With ``evaluate`` (the held-out loss), it runs before the first step, every
    ``eval_every`` steps (default: at every checkpoint) and at the end; its value is in
    ``state`` and the step's history row before ``on_checkpoint``, and ``on_eval(state)``
    reports evaluations that fall between checkpoints. ``preview(step)`` (validation
    images) runs at the same steps, including before the first step of a fresh run.
    """
    last_ckpt_step = -1
    nonfinite_in_a_row = 0
    step_samples: list[str] = []
    if evaluate is not None and state.global_step == 0 and state.eval_loss_base is None:
        # Also the "latest" value until the first periodic evaluation, so every report
        # (e.g. a checkpoint before it) carries a held-out loss for Tune to compare.
        state.eval_loss_base = evaluate()
        state.record_eval(state.eval_loss_base)
    if preview is not None and state.global_step == 0:
        preview(0)
    t_start = time.perf_counter()
    wall_before = state.wall_seconds
    while state.global_step < max_steps:
        micro_losses: list[torch.Tensor] = []
        t_step = time.perf_counter()
        skip = state.batches_in_epoch
        exhausted, trained = True, False
        for i, batch in enumerate(epoch_batches(state.epoch)):
            if i < skip:  # resumed mid-epoch: these micro-batches were already trained on
                continue
            trained = True
            if sample_ids is not None:
                step_samples += sample_ids(batch)
            micro_losses.append(
                train_micro_step(
                    accelerator, model, parts, optimizer, lr_scheduler, params, batch, max_grad_norm
                )
            )
            state.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            state.global_step += 1
            state.images_seen += images_per_step
            # Mean over micro-batches and workers: the loss of the global batch (NaN on
            # every rank when the step was skipped for non-finite values).
            loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean").item()
            micro_losses = []
            if math.isfinite(loss):
                nonfinite_in_a_row = 0
                if ema is not None:
                    ema.update(params)
            else:
                state.nonfinite_steps += 1
                nonfinite_in_a_row += 1
                if nonfinite_in_a_row >= max_nonfinite_steps:
                    raise NonFiniteLossError(
                        f"loss or gradients were NaN/inf for {nonfinite_in_a_row} optimizer "
                        f"steps in a row (steps {state.global_step - nonfinite_in_a_row + 1}-"
                        f"{state.global_step}; those steps were skipped). {nonfinite_advice}".rstrip()
                    )
            now = time.perf_counter()
            row = {
                "step": state.global_step,
                "epoch": state.epoch,
                "loss": loss,
                "lr": lr_scheduler.get_last_lr()[0],
                "images_per_s": images_per_step / max(now - t_step, 1e-9),
            }
            if sample_ids is not None:
                row["samples"], step_samples = step_samples, []
            t_step = now
            if state.train_loss_first is None:
                state.train_loss_first = loss
            state.train_loss_last = loss
            state.history.append(row)
            state.wall_seconds = wall_before + (now - t_start)
            on_step(row)
            final = state.global_step >= max_steps
            ckpt = state.global_step % checkpoint_every == 0 or final
            due = final or (state.global_step % eval_every == 0 if eval_every else ckpt)
            if due and preview is not None:
                preview(state.global_step)
            if due and evaluate is not None:
                row["eval_loss"] = evaluate()
                state.record_eval(row["eval_loss"])
                if not ckpt:
                    on_eval(state)
            if ckpt:
                on_checkpoint(state, final)
                last_ckpt_step = state.global_step
            if state.global_step >= max_steps:
                exhausted = False
                break
        if exhausted and not trained and skip == 0:
            raise RuntimeError(
                f"epoch {state.epoch} gave this worker no batches: the data shard is empty"
            )
        if exhausted:
            state.epoch += 1
            state.batches_in_epoch = 0
    if last_ckpt_step != state.global_step:
        # Restored from a checkpoint that was already at max_steps: report it again so the
        # run still ends with a final checkpoint and final metrics.
        on_checkpoint(state, True)
    return state


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
            h.update(batch[k][i].detach().cpu().contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    return out
