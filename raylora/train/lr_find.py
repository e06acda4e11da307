"""Learning-rate range test: the lr grows exponentially each optimizer step, the loss is
smoothed, and the test stops once the loss has blown up. No Ray.

The recipe of Smith (2017, "Cyclical Learning Rates") as popularised by fastai's
``lr_find``: exponential sweep from ``start_lr`` to ``end_lr``, an exponential moving
average of the loss with bias correction, stop when the smoothed loss exceeds
``diverge_factor`` × its starting value (or is not finite), suggest a tenth of the lr at
the minimum smoothed loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_at(i: int, num_steps: int, start_lr: float, end_lr: float) -> float:
    """Step ``i`` of ``num_steps`` (0-based): start·(end/start)^(i/(num_steps-1))."""
    if num_steps <= 1:
        return start_lr
    return start_lr * (end_lr / start_lr) ** (i / (num_steps - 1))


def range_test(
    step: Callable[[float], float],
    start_lr: float,
    end_lr: float,
    num_steps: int,
    smoothing: float = 0.9,
    diverge_factor: float = 10.0,
) -> list[dict]:
    """Run ``step(lr) -> loss`` for up to ``num_steps`` lrs; rows of step, lr, loss,
    smoothed_loss. Stops early (and says so in the last row's ``stopped``) on divergence."""
    rows: list[dict] = []
    avg = 0.0
    first = None
    for i in range(num_steps):
        lr = lr_at(i, num_steps, start_lr, end_lr)
        loss = float(step(lr))
        stopped = None
        if not math.isfinite(loss):
            smoothed = float("inf")
            stopped = "loss is not finite"
        else:
            avg = smoothing * avg + (1 - smoothing) * loss
            smoothed = avg / (1 - smoothing ** (i + 1))  # bias-corrected EMA
            first = smoothed if first is None else first
            if smoothed > diverge_factor * first:
                stopped = f"smoothed loss > {diverge_factor:g}x its start"
        rows.append({"step": i + 1, "lr": lr, "loss": loss, "smoothed_loss": smoothed, "stopped": stopped})
        if stopped:
            break
    return rows


def suggest_lr(rows: list[dict], skip_start: float = 0.1) -> dict:
    """A tenth of the lr at the minimum smoothed loss, ignoring the first ``skip_start``
    of the rows (the moving average has not settled there). Never below the first lr tried."""
    if not rows:
        raise ValueError("no lr-find rows")
    skip = min(int(len(rows) * skip_start), len(rows) - 1)
    finite = [r for r in rows[skip:] if math.isfinite(r["smoothed_loss"])]
    best = min(finite or rows, key=lambda r: r["smoothed_loss"])
    lowest = rows[0]["lr"]
    suggested = max(best["lr"] / 10, lowest)
    return {
        "suggested_lr": suggested,
        "lr_at_min_loss": best["lr"],
        "min_smoothed_loss": best["smoothed_loss"],
        "clamped": suggested != best["lr"] / 10,
        "steps_run": len(rows),
        "stopped": rows[-1]["stopped"],
    }


def scale_lr_divisor(train) -> int:
    """What the suggestion is divided by to become ``train.learning_rate``: lr-find sweeps
    the optimizer's own lr on one worker, unscaled; with ``train.scale_lr`` a run multiplies
    its learning_rate by batch × accumulation × workers, so the one-worker equivalent is the
    suggestion / (batch × accumulation) (and N workers train at N × the suggestion, the
    linear rule scale_lr stands for). 1 without scale_lr."""
    return train.batch_size * train.gradient_accumulation_steps if train.scale_lr else 1


def plot(rows: list[dict], suggestion: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = [r["lr"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(lrs, [r["loss"] for r in rows], lw=1, alpha=0.4, label="loss")
    ax.plot(lrs, [r["smoothed_loss"] for r in rows], lw=2, label="smoothed")
    ax.axvline(suggestion["suggested_lr"], color="k", ls="--", lw=1,
               label=f"suggested {suggestion['suggested_lr']:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("denoising MSE")
    ax.set_title("raylora lr-find")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
