"""Training state ⇄ a checkpoint directory. Plain torch/safetensors, no Ray.

Layout of one checkpoint directory::

    adapter/pytorch_lora_weights.safetensors   diffusers layout (loadable as is;   rank 0
                                               the EMA weights when EMA is on)
    lora.safetensors                           peft layout, fp32, for exact resume rank 0
    ema.safetensors                            EMA shadow weights (train.ema_decay)  rank 0
    trainer_state.pt                           optimizer (DDP), LR scheduler, grad
                                               scaler, step, epoch, data position   rank 0
    fsdp/                                      scaling.strategy=fsdp: the LoRA and   every rank
                                               optimizer state as torch.distributed.checkpoint
                                               shards (__R_0.distcp per rank, .metadata)
    history.jsonl                              one row per optimizer step           rank 0
    rng_rank{R}.pt                             torch CPU (+ CUDA) RNG of rank R     every rank
    checkpoint_files.json                      what the checkpoint holds: rank 0's   rank 0
                                               files with their sizes, the other
                                               ranks' by name (written last)

A checkpoint is checked against ``checkpoint_files.json`` before it is resumed from
(``load_state`` on the workers, ``raylora.checkpoint.recorded`` on the driver): a file lost
on the way to storage is named, not taken for a setting (no ``ema.safetensors`` read as "EMA
was off", no ``fsdp/.metadata`` as "written by DDP", no history as "none yet"). Checkpoints
written before it was recorded are read as they were.

Everything read back is loaded with ``weights_only=True`` / safetensors: a checkpoint in
shared storage is never a way to run code.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load_file, save_file

from raylora.storage import local_sizes

log = logging.getLogger("raylora")

TRAINER_STATE = "trainer_state.pt"
LORA_FILE = "lora.safetensors"
EMA_FILE = "ema.safetensors"
HISTORY_FILE = "history.jsonl"
ADAPTER_DIR = "adapter"
SHARDED_DIR = "fsdp"
FILES_FILE = "checkpoint_files.json"


class ResumeRefused(ValueError):
    """This config cannot resume this checkpoint (a worker's check while restoring): a
    restart of the workers reads the same checkpoint with the same config, so
    ``raylora.entry.EndOnRepeated`` ends the run instead of retrying it
    ``failure.max_failures`` times."""

    restart_repeats = True


# LoopState's keys that say where a run is (and the workers and batch size that counted
# it): reported with every checkpoint, for the driver's plan of a resumed run.
POSITION_KEYS = ("global_step", "epoch", "batches_in_epoch", "images_seen", "world_size", "batch_size")


@dataclass
class LoopState:
    """Where the run is: enough to continue exactly. All plain numbers."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch, per worker
    images_seen: int = 0
    train_loss_first: float | None = None
    train_loss_last: float | None = None
    wall_seconds: float = 0.0
    resumed_from_step: int | None = None
    # Held-out loss (raylora.train.evaluate): before training, latest, best and its step.
    eval_loss_base: float | None = None
    eval_loss_last: float | None = None
    eval_loss_best: float | None = None
    eval_loss_best_step: int | None = None
    nonfinite_steps: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient
    # The workers that wrote this state, and their train.batch_size (None: a checkpoint
    # from before it was recorded; load_state infers the batch size, ``history_batch_size``).
    world_size: int | None = None
    batch_size: int | None = None
    history: list[dict] = field(default_factory=list)

    def resize(self, world: int, batch_size: int | None = None, exact: bool = True) -> None:
        """A run resumed on ``world`` workers of ``batch_size`` (default: as written):
        ``batches_in_epoch`` (per worker) in their micro-batches, carried over as the rows
        of the epoch consumed, ``batches_in_epoch × world × batch``. In an elastic run each
        optimizer step is the same global rows at every size, so that count is exact
        (``exact``). Another run's workers split the data anew: the rows, rounded down to
        whole micro-batches, skip about what was trained. (Counted in micro-batches, a
        batch size doubled on resume skipped half an epoch's position untrained.)"""
        old_w = self.world_size or world
        if self.batch_size is None and self.images_seen and batch_size:
            # A checkpoint from before the batch size was recorded whose history does not
            # tell it (before 2026-11-23): taken for the new one, as it always was (an
            # elastic run resized with the same batch size is right so), and said.
            log.warning("train.batch_size: the checkpoint was written by an earlier raylora "
                        "that did not record its batch size, and its history does not tell it: "
                        "its position in the epoch is taken as counted in batches of %d; if it "
                        "trained with another, resume it with that one", batch_size)
        new_b = batch_size or self.batch_size or 1
        old_b = self.batch_size or new_b
        consumed = self.batches_in_epoch * old_w * old_b
        if consumed % (world * new_b) and exact:
            key = "train.batch_size" if old_b != new_b else "scaling.num_workers"
            raise ResumeRefused(
                f"{key}: the checkpoint's data position ({self.batches_in_epoch} "
                f"micro-batches of {old_b} on each of {old_w} workers) is not a whole number of "
                f"micro-batches of {new_b} on {world} workers")
        self.batches_in_epoch = consumed // (world * new_b)
        self.world_size, self.batch_size = world, new_b

    def record_eval(self, loss: float) -> None:
        self.eval_loss_last = loss
        # NaN never becomes "best" (comparisons with NaN are false).
        if loss == loss and (self.eval_loss_best is None or loss < self.eval_loss_best):
            self.eval_loss_best, self.eval_loss_best_step = loss, self.global_step

    def scalars(self) -> dict:
        d = asdict(self)
        d.pop("history")
        return d


def inferred_batch_size(images_seen: int, micro_batches: int) -> int | None:
    """train.batch_size of a checkpoint written before ``LoopState`` recorded it (raylora
    before 2026-12-06): its ``images_seen`` over the ``micro_batches`` its steps took (each
    step's workers × accumulation, summed), when that is a whole number; else None."""
    if micro_batches <= 0 or images_seen <= 0 or images_seen % micro_batches:
        return None
    return images_seen // micro_batches


def history_batch_size(images_seen: int, global_step: int, history: list[dict]) -> int | None:
    """``inferred_batch_size`` from a checkpoint's history rows, each with the step's
    ``world_size`` and ``accumulation`` (one per step since 2026-11-23; None without them)."""
    if len(history) != global_step or not all(
            isinstance(r.get("world_size"), int) and isinstance(r.get("accumulation"), int)
            for r in history):
        return None
    return inferred_batch_size(images_seen, sum(r["world_size"] * r["accumulation"] for r in history))


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def capture_rng() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rank_state(directory: str, rank: int) -> None:
    torch.save(capture_rng(), os.path.join(directory, rng_file(rank)))


def trained_settings(cfg, family: str) -> dict:
    """What a checkpoint's LoRA state was made for, by config key (``family``: the model's
    resolved ``model.family``). A rerun at the same ``output.uri`` that differs in any of
    them could not load that state (another family, variant, rank or set of modules: a
    shape or key mismatch on every worker, once the cluster and the model are up) or would
    carry on with it silently changed (another alpha; one Wan 2.2 expert's LoRA as the
    other's, the two sharing an architecture). ``recorded.check_latest`` refuses it first.
    ``model.pretrained`` and ``model.revision`` (a hub model's: the commit the run loaded,
    ``RayLoraConfig.at_commit``) are recorded too, but only warned about (``recorded.NOTED``).
    So is the optimizer state: another ``train.optimizer`` finds state of another shape
    (a KeyError inside the library at the first step, or Prodigy's moments taken for
    AdamW's), Prodigy's ``slice_p`` slices its state and ``d0`` scales its running sums.
    ``train.ema_decay`` and ``train.max_steps`` are checked against the checkpoint itself
    (``recorded.CHECKED``: EMA on or off, as its files say; not below its step)."""
    t = cfg.train
    lo = cfg.lora
    out = {"model.family": family, "model.expert": cfg.model.expert, "lora.variant": lo.variant,
           "lora.rank": lo.rank, "lora.alpha": lo.alpha if lo.alpha is not None else lo.rank,
           "lora.target_modules": lo.target_modules, "lora.train_text_encoder": lo.train_text_encoder,
           # what the LoRA started as: a resumed run ignores lora.init_from, so a rerun that
           # names another one would otherwise carry on from the first without a word
           "lora.init_from": lo.init_from, "model.pretrained": cfg.model.pretrained,
           "model.revision": cfg.model.revision, "train.optimizer": t.optimizer,
           "train.ema_decay": t.ema_decay, "train.max_steps": t.max_steps}
    if t.optimizer == "prodigy":
        out |= {"train.prodigy.slice_p": t.prodigy.slice_p, "train.prodigy.d0": t.prodigy.d0}
    if lo.train_text_encoder:
        out["lora.text_encoder_target_modules"] = lo.text_encoder_target_modules
    if lo.variant == "lokr":
        out |= {"lora.factor": lo.factor, "lora.decompose_both": lo.decompose_both}
    return out


def save_main_state(
    directory: str,
    *,
    lora_sd: dict[str, torch.Tensor],
    optimizer_sd: dict | None,  # None: in the sharded checkpoint (SHARDED_DIR)
    scheduler_sd: dict,
    scaler_sd: dict | None,
    loop: LoopState,
    ema_sd: dict[str, torch.Tensor] | None = None,
    other_ranks_files: list[str] = (),
    trained: dict | None = None,
) -> None:
    """Rank 0's part of a checkpoint, after this rank's RNG and shards are in ``directory``
    (``raylora.train.setup.write_checkpoint``). ``other_ranks_files``: what the other ranks
    write into their own directories (Ray merges them into this checkpoint); with
    ``loop.world_size`` ranks' RNG files they go into ``checkpoint_files.json``, and so does
    ``trained`` (``trained_settings``: what the LoRA state is for), which the driver
    compares with a rerun's config before resuming (``recorded.check_latest``)."""
    save_file(lora_sd, os.path.join(directory, LORA_FILE))
    if ema_sd is not None:
        save_file(ema_sd, os.path.join(directory, EMA_FILE))
    torch.save(
        {
            "optimizer": optimizer_sd,
            "lr_scheduler": scheduler_sd,
            "grad_scaler": scaler_sd,
            "loop": loop.scalars(),
        },
        os.path.join(directory, TRAINER_STATE),
    )
    with open(os.path.join(directory, HISTORY_FILE), "w") as f:
        for row in loop.history:
            f.write(json.dumps(row) + "\n")
    mine = local_sizes(directory)
    others = {rng_file(r) for r in range(1, loop.world_size or 1)} | set(other_ranks_files)
    with open(os.path.join(directory, FILES_FILE), "w") as f:
        json.dump({"rank0": mine, "other_ranks": sorted(others - set(mine)),
                   **({"trained": trained} if trained is not None else {})}, f, indent=1,
                  sort_keys=True)


def missing_files(recorded: dict, present: dict[str, int]) -> list[str]:
    """What ``present`` (relative path → size) lacks of a ``checkpoint_files.json``:
    one entry per file, "NAME (missing)" or "NAME (N of M bytes)"."""
    out = [f"{name} (missing)" if name not in present else f"{name} ({present[name]} of {size} bytes)"
           for name, size in sorted(recorded["rank0"].items()) if present.get(name) != size]
    return out + [f"{name} (missing)" for name in recorded["other_ranks"] if name not in present]


class IncompleteCheckpoint(ValueError):
    """A checkpoint lacks files its ``checkpoint_files.json`` lists."""

    def __init__(self, where: str, missing: list[str]):
        super().__init__(
            f"checkpoint {where} is incomplete: {', '.join(missing)}. It is the checkpoint a "
            f"run with this output.uri resumes from; restore the files, or start a new "
            f"output.uri (each checkpoint's adapter/ folder is that step's adapter, loadable as it is)")
        self.missing = missing


def check_complete(directory: str, where: str | None = None) -> bool:
    """Raise ``IncompleteCheckpoint`` when a local checkpoint lacks a file it recorded;
    False for a checkpoint with no record (written before one was kept), True otherwise."""
    path = os.path.join(directory, FILES_FILE)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        recorded = json.load(f)
    missing = missing_files(recorded, local_sizes(directory))
    if missing:
        raise IncompleteCheckpoint(where or directory, missing)
    return True


@dataclass
class RestoredState:
    lora_sd: dict[str, torch.Tensor]
    optimizer_sd: dict
    scheduler_sd: dict
    scaler_sd: dict | None
    loop: LoopState
    rng: dict[str, torch.Tensor] | None
    ema_sd: dict[str, torch.Tensor] | None = None
    # scaling.strategy=fsdp: a local copy of the checkpoint's SHARDED_DIR (the optimizer
    # state lives there, not in optimizer_sd)
    sharded_dir: str | None = None


def load_state(directory: str, rank: int, where: str | None = None) -> RestoredState:
    """Rank ``rank``'s state in the local checkpoint ``directory`` (``where``: its URI, for
    errors); ``IncompleteCheckpoint`` when a file it recorded is missing or short."""
    check_complete(directory, where)
    trainer = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    history = []
    hist_path = os.path.join(directory, HISTORY_FILE)
    if os.path.exists(hist_path):
        with open(hist_path) as f:
            history = [json.loads(line) for line in f if line.strip()]
    loop = LoopState(**trainer["loop"], history=history)
    if "batch_size" not in trainer["loop"]:
        # Written before the batch size was recorded: a resume with another one converts
        # the data position from it (LoopState.resize), not from the new one
        loop.batch_size = history_batch_size(loop.images_seen, loop.global_step, history)
    rng_path = os.path.join(directory, rng_file(rank))
    rng = torch.load(rng_path, weights_only=True) if os.path.exists(rng_path) else None
    return RestoredState(
        lora_sd=load_file(os.path.join(directory, LORA_FILE)),
        optimizer_sd=trainer["optimizer"],
        scheduler_sd=trainer["lr_scheduler"],
        scaler_sd=trainer["grad_scaler"],
        loop=loop,
        rng=rng,
        ema_sd=load_file(ema_path) if os.path.exists(ema_path := os.path.join(directory, EMA_FILE)) else None,
        sharded_dir=sharded if os.path.exists(os.path.join(sharded := os.path.join(directory, SHARDED_DIR),
                                                           ".metadata")) else None,
    )
