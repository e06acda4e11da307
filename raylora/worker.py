"""Per-worker train function for Ray Train: restore → build → loop → sink.

Ray appears only here: the dataset shard, the checkpoint to resume from, and
``ray.train.report``. Everything else is the plain-PyTorch code in ``raylora.train``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import pyarrow.fs
import torch

import ray
import ray.train
from ray.train import CheckpointUploadMode

from raylora.checkpoint.state import POSITION_KEYS, LoopState, load_state
from raylora.config import RayLoraConfig
from raylora.entry import WorkerSpec
from raylora.launch import Plan
from raylora.progress import carried, every_n_steps
from raylora.storage import complete_upload
from raylora.train.loop import LoopHooks, LoopSettings, run_loop, sample_hashes

# Not imported here: raylora.train.setup, raylora.model.lora and raylora.train.fsdp (peft,
# transformers, bitsandbytes, FSDP: ~7 s of one core on a 2-core box). The worker imports
# them when it builds the model, after it started its data stream, so that the stream's
# first batches (the pass board's and Ray Data's processes starting, shards read, images
# decoded) are on their way meanwhile (test_epochs.py: test_a_worker_opens_its_data_stream_...).

log = logging.getLogger("raylora.worker")


def _setup_logging() -> None:
    from raylora.train.compile import log as compile_log  # the compile cache's loads and saves

    for logger in (log, compile_log):
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[raylora] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def _finite_or_inf(x: float | None) -> float | None:
    """Reported losses: a diverged (NaN/inf) value becomes +inf, which Tune's schedulers and
    searchers rank last and JSON can carry."""
    return x if x is None or math.isfinite(x) else float("inf")


def interval_mean(history: list[dict], since: int, key: str = "loss") -> float | None:
    """The mean ``key`` of the optimizer steps after step ``since``: what a report says of
    training since the one before it (one step's loss is one batch's, too noisy for Tune to
    rank trials by). Over ``LoopState.history`` rows, whose losses the loop has already
    read back: no device sync. A step skipped for NaN/inf is left out, unless it is the
    last one: then +inf, the run is diverging (as the held-out loss says). None: no step
    after ``since``."""
    window = []
    for row in reversed(history):
        if row["step"] <= since:
            break
        window.append(row[key])
    if not window:
        return None
    if not math.isfinite(window[0]):
        return float("inf")
    finite = [v for v in window if math.isfinite(v)]
    return sum(finite) / len(finite)


def checkpoint_before(step: int, every: int) -> int:
    """The periodic checkpoint's step before ``step`` (0: none)."""
    return max(step - 1, 0) // every * every


def _stage_kwargs(purpose: str, spec: WorkerSpec) -> dict:
    """A preprocess stage of this worker's own (raylora.data.preprocess.stage_kwargs)."""
    from raylora.data.preprocess import stage_kwargs

    cfg = spec.config
    return stage_kwargs(purpose, cfg.data, model_path=spec.plan.model_path, family=spec.plan.family,
                        storage=cfg.storage, max_sequence_length=cfg.model.max_sequence_length,
                        tokenizer_specs=spec.tokenizer_specs, revision=cfg.model.revision,
                        system_prompt=cfg.model.system_prompt,
                        heldout_resolution=cfg.eval_resolution())


def _heldout_batch(spec: WorkerSpec) -> dict[str, torch.Tensor]:
    """The held-out rows as one batch: already encoded by the driver (latent cache, a dict
    of arrays), or raw ``{image, text}`` rows preprocessed here (centre crop, no flip)."""
    import numpy as np

    from raylora.data.formats import control_names
    from raylora.data.preprocess import Preprocess, StageSpec

    heldout = spec.plan.worker_heldout()
    if isinstance(heldout, dict):
        from raylora.data.cache import from_column

        batch = {k: from_column(v) for k, v in heldout.items()}
    else:
        # Buckets or not: one square size (cfg.eval_resolution), so they batch together.
        pre = Preprocess(StageSpec(**_stage_kwargs("heldout", spec)))
        batch = {k: torch.from_numpy(v) for k, v in pre(
            {k: np.array([r.get(k) for r in heldout], dtype=object)
             for k in ("image", "text", *control_names(spec.config.data))}).items()}
    _check_heldout_kept(spec, next(iter(batch.values())).shape[0])
    return batch


def _check_heldout_kept(spec: WorkerSpec, kept: int) -> None:
    """The driver read only rows the held-out stage keeps (raylora.data.split), and the
    model card reports that many as evaluated: a row dropped here (a node whose decoders
    differ) would make that count wrong, or leave nothing to score. Refused, naming them."""
    from raylora.data.split import heldout_row_problem

    read = spec.plan.heldout_rows
    if kept == read:
        return
    d = spec.config.data
    key = "data.validation_uri" if d.validation_uri is not None else "data.validation_split"
    rows = spec.plan.heldout if isinstance(spec.plan.heldout, list) else []  # cached: columns
    bad = [f"row {i}: {problem}" for i, r in enumerate(rows)
           if (problem := heldout_row_problem(r, d))]
    raise ValueError(f"{key}: {read - kept} of the {read} held-out rows read on the driver "
                     f"could not be decoded on this worker ({'; '.join(bad) or 'see the logs'}); "
                     "replace them")


def _heldout_evaluator(spec: WorkerSpec, run, rank: int, world: int):
    """Encode the held-out rows once and return ``evaluate() -> float`` (same value on
    every rank)."""
    from raylora.train.evaluate import encode_heldout_text, heldout_loss, prepare_heldout

    cfg = spec.config
    v, acc = cfg.validation, run.accelerator
    held = prepare_heldout(
        run.parts, _heldout_batch(spec), v.num_timesteps, v.seed,
        batch_size=cfg.train.batch_size, device=acc.device,
    )
    model = acc.unwrap_model(run.model)

    def evaluate() -> float:
        # With EMA on, the EMA weights are what gets exported, so they are what is scored.
        with acc.autocast(), (run.ema.swapped_in(run.params) if run.ema is not None else nullcontext()):
            encode_heldout_text(run.parts, held, cfg.train.batch_size)
            return heldout_loss(
                model, held, run.parts.weight_dtype, batch_size=cfg.train.batch_size, rank=rank,
                world=world, all_reduce_sum=lambda x: acc.reduce(x, reduction="sum"),
                lockstep=run.sharded,
            )

    return evaluate


def _previewer(spec: WorkerSpec, run, tracker, rank: int):
    """``preview(step)``: rank 0 renders ``validation.prompts`` into
    ``{output.uri}/validation/step_NNNNNN.png`` and the tracker (EMA weights when on).
    Under FSDP every rank renders the same images in lockstep (each denoiser call gathers
    the shards) and rank 0 writes them."""
    import io

    from raylora import storage
    from raylora.model.load import materialize
    from raylora.train import preview as pv

    cfg = spec.config
    v, acc = cfg.validation, run.accelerator
    store = cfg.storage.client()
    model_path = materialize(spec.plan.model_path, store, cfg.model.revision)
    model = acc.unwrap_model(run.model)
    # None: the family's default; the run's system prompt (model.system_prompt), if set
    guidance = {**run.family.guidance_kwargs(v.guidance_scale),
                **run.family.prompt_kwargs(cfg.model.system_prompt),
                **run.family.length_kwargs(cfg.model.max_sequence_length)}
    controls = pv.read_control_images(v.control_images, store, cfg.data)  # read once, rendered each time

    def render() -> list:
        # The pipeline and the encoders loaded for it (cached latents) go when this returns.
        vae, encoders, tokenizers = pv.encoders_for(run.parts, model_path, cfg.model, acc.device)
        pipe = pv.build_pipeline(
            model_path, run.family, model, vae, encoders, tokenizers,
            dtype=run.parts.weight_dtype, device=acc.device, expert=cfg.model.expert,
            revision=cfg.model.revision, prediction_type=cfg.train.prediction_type,
        )
        return pv.render(pipe, run.family, v.prompts, v.seed, v.num_inference_steps, guidance,
                         cfg.eval_resolution(), autocast=acc.autocast, control_images=controls)

    def preview(step: int) -> None:
        with run.ema.swapped_in(run.params) if run.ema is not None else nullcontext():
            images = render()
            pv.free_memory()
        if rank != 0:
            return
        buf = io.BytesIO()
        pv.make_grid(*pv.grid_with_inputs(images, controls)).save(buf, format="PNG")
        uri = storage.join(cfg.output.uri, "validation", f"step_{step:06d}.png")
        store.write_bytes(uri, buf.getvalue())
        tracker.log_images(step, "validation", images, list(v.prompts))
        log.info("step %d validation images → %s", step, uri)

    return preview


def _accelerator(cfg: RayLoraConfig):
    """Accelerate picks up the torch.distributed process group that Ray Train created."""
    from accelerate import Accelerator

    return Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        cpu=not cfg.scaling.use_gpu,
    )


# Batches the data path keeps ready beyond the one being trained on (tensors already on
# the accelerator), and Ray Data's own read-ahead of blocks.
PREFETCH_BATCHES = 4


def _passes_needed(spec: WorkerSpec, epoch: int, per_epoch: int, world: int) -> int:
    """Passes over the data from ``epoch`` on that the rest of the run trains on (an epoch
    is one pass). The stream runs ahead (its next pass is read while an epoch ends), so
    passes past the end would be read for nothing. One worker under ``stream`` with a
    held-out split gets one more: a split holding out more than its expected share makes
    epochs shorter than planned, and the run trains into one more pass (a stream that runs
    out reopens, at the cost of a pipeline start)."""
    t, data = spec.config.train, spec.config.data
    left = max(1, spec.plan.max_steps * t.gradient_accumulation_steps - epoch * per_epoch)
    passes = -(-left // per_epoch)
    if data.sharding == "stream" and world == 1 and data.validation_split:
        return passes + 1
    return passes


def rank_seed(seed: int, rank: int) -> int:
    """``data.sharding=files``: the seed of rank ``rank``'s reads and preprocessing draws
    (crops, flips, caption dropout). With one seed for all, every worker's i-th row drew
    alike, so a global batch at batch size 1 had every caption dropped or none. A
    function of the seed and the rank: a resumed run draws as the straight one did."""
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def _epoch_batches(spec: WorkerSpec, rank: int, world: int, device):
    """``epoch -> iterable of batches`` over this worker's data (``EpochStream``), an epoch
    being one pass over the data. ``data.sharding=files``: each worker builds one dataset
    of its own files over the passes the run needs; ``stream``: one worker builds one
    dataset of all of them, several take each pass from a dataset of its own that rank 0
    splits over them (raylora.data.passes). Pass ``e``'s read order and preprocessing draws
    depend on the seed and ``e`` alone (raylora.data.source.build_dataset), so under
    ``files`` the stream a resumed run opens at its epoch repeats the straight run's."""
    from raylora.data.captions import cut_captions, drop_cached_captions
    from raylora.data.prior import paired
    from raylora.model import families
    from raylora.data.passes import PassDataset, pass_board, pass_part
    from raylora.data.source import (DataPlan, EpochStream, global_share, pass_batches,
                                     pass_blocks)
    from raylora.launch import cached_caption_dropout

    cfg, plan = spec.config, spec.plan
    t, data = cfg.train, cfg.data
    by_files = data.sharding == "files"
    # scaling.num_workers: [min, max]: every worker reads all of the data in the one
    # seeded order and takes its share of each global batch (global_share).
    elastic = cfg.scaling.elastic
    data_seed = data.shuffle_seed if data.shuffle_seed is not None else t.seed
    store = cfg.storage.client()
    per_epoch = _micro_batches_per_epoch(spec)
    # This worker's rows in a pass (an estimate with a held-out split): a smaller pass
    # need not wait for the next one to be shuffled whole (pass_batches).
    everything = plan.data_plan()
    mine = everything if elastic else everything.for_rank(rank, world)
    pass_rows = mine.rows if by_files else plan.rows_per_worker

    # files: the worker's own preprocessing draws (an elastic run reads one order everywhere)
    draws_seed = rank_seed(data_seed, rank) if by_files and not elastic else data_seed

    def maker(data_plan: DataPlan, tasks: int) -> PassDataset:
        return PassDataset(data, data_plan, store, plan.model_path, draws_seed, tasks,
                           plan.family, plan.bad_records, spec.tokenizer_specs,
                           spec.config.model.revision, spec.progress_bar)

    # Prior preservation: class samples appended to every batch (raylora.data.prior), in
    # the prefetch thread like the rest of the stream.
    # Elastic: per-batch draws (cached caption dropout, class rows) keyed on the batch's
    # place in the whole pass, with no rank, so a step draws alike at any size.
    deal = (world, rank) if elastic else None
    classes = (_class_batches(spec, 0 if elastic else rank, data_seed)
               if plan.class_rows or plan.class_encoded is not None else None)
    last = _passes_needed(spec, 0, per_epoch, world) - 1  # the run's planned last pass
    # A PassDataset, not a closure here: the board actor's process would import this module.
    board = pass_board(maker(everything, world), rank, world, last) \
        if not by_files and world > 1 else None

    def blocks(epoch: int):
        if board is not None:
            # Past the planned passes (epochs shorter than planned) each is opened when
            # the loop asks for it, not read ahead for nothing at the run's end.
            return pass_blocks(epoch, lambda p: pass_part(board, p, rank, PREFETCH_BATCHES)
                               if p == epoch or p <= last else None, PREFETCH_BATCHES)
        # files, or one worker: nothing to split (no coordinator actor to start, 1-2 s)
        ds = maker(mine if by_files else everything, 1)(
            epoch, _passes_needed(spec, epoch, per_epoch, world))
        return ds.iter_batches(batch_size=None, batch_format="numpy",
                               prefetch_batches=PREFETCH_BATCHES)

    def open_stream(epoch: int):
        rows = blocks(epoch)
        # Elastic: one shuffle for all workers (the global order), not one per rank.
        seed = lambda e: data_seed + 7919 * e + (0 if elastic else rank)  # noqa: E731
        if plan.bucket_steps is not None:  # one worker, or files (config): no pass_blocks
            return _cut(_dropped(_bucketed(rows, plan, t.batch_size, data_seed, seed)))
        batches = pass_batches(rows, t.batch_size, data.shuffle_buffer_size, seed=seed,
                               pass_rows=pass_rows)
        if elastic:
            batches = global_share(batches, rank, world)
        batches = _dropped(batches)  # before the class rows are added: those keep theirs
        return _cut(batches if classes is None else paired(batches, classes, deal))

    def _cut(batches):
        """Cached language-model captions as long as the batch's longest (cut_captions)."""
        if not families.get(plan.family).cuts_captions:
            return batches
        return ((epoch, cut_captions(batch)) for epoch, batch in batches)

    def _dropped(batches):
        """data.caption_dropout over cached rows (uncached rows were dropped as they were
        preprocessed)."""
        if plan.empty_encoded is None:
            if cached_caption_dropout(cfg):
                # A trial's own rate (a search over a source's caption_dropout, say): the
                # driver encoded no empty prompt for it. Not silently trained without.
                raise ValueError("data.caption_dropout: this trial drops cached captions but "
                                 "the run's plan holds no empty prompt; set caption_dropout in "
                                 "data (or search data.caption_dropout), not per source")
            return batches
        return drop_cached_captions(batches, plan.empty_encoded, cached_caption_dropout(cfg),
                                    data_seed, 0 if elastic else rank, deal)

    return EpochStream(open_stream, per_epoch, per_pass=True, convert=_to_device(device),
                       prefetch=PREFETCH_BATCHES)


def _micro_batches_per_epoch(spec: WorkerSpec) -> int:
    """The same on every worker so that their DDP steps line up: under files the smallest
    worker's count (the others drop the rest of each pass); elastic: the epoch's
    optimizer steps × this size's accumulation."""
    cfg, plan = spec.config, spec.plan
    if cfg.scaling.elastic:
        return plan.updates_per_epoch * cfg.train.gradient_accumulation_steps
    if cfg.data.sharding == "files":
        return plan.batches_per_epoch
    return plan.rows_per_worker // cfg.train.batch_size


def _to_device(device):
    """numpy batch → tensors on ``device``, run in the prefetch thread. On CUDA pinned +
    non_blocking: the copy is queued behind the running step instead of this thread
    waiting for it (a pageable copy blocks until the GPU is done with everything queued
    before it); torch keeps the pinned buffer until the copy ran."""
    from raylora.data.cache import from_column  # cached bf16 columns arrive as uint16
    from raylora.train.objective import to_device

    return lambda batch: {k: to_device(from_column(v), device) for k, v in batch.items()}


def _class_batches(spec: WorkerSpec, rank: int, seed: int):
    """This worker's class samples (prior preservation), preprocessed as the instance
    images are, without caption dropout or prefixes (class prompts are used as given);
    with the latent cache, encoded so by the driver."""
    from raylora.data.prior import ClassBatches, EncodedClassBatches
    from raylora.data.preprocess import Preprocess, StageSpec

    if spec.plan.class_encoded is not None:
        return EncodedClassBatches(spec.plan.class_encoded, seed, rank)
    stage = Preprocess(StageSpec(**_stage_kwargs("class", spec)))
    return ClassBatches(spec.plan.class_rows, stage, seed, rank)


def _bucketed(blocks, plan: Plan, batch_size: int, data_seed: int, seed):
    """data.bucketing: ``(pass, batch)`` in the bucket order every rank computes alike from
    the plan, the seed and the pass (``raylora.data.buckets``); ``seed(pass)``: this
    rank's draws within a bucket."""
    from raylora.data.buckets import bucket_batches, schedule

    return bucket_batches(blocks, batch_size, seed=seed,
                          plan=lambda e: schedule(plan.bucket_steps, data_seed, e))


class _Reporter:
    """Rank-aware sinks of one training run: log lines, tracker, the driver's progress
    board, Ray reports (metrics and checkpoints)."""

    def __init__(self, spec: WorkerSpec, run, rank: int, stop_watch=None):
        from raylora.track import Tracker, open_tracker

        cfg = spec.config
        self.spec, self.run, self.rank, self.stop_watch = spec, run, rank, stop_watch
        self.max_steps = spec.plan.max_steps
        # Rank 0 talks to the tracker; the other ranks' Tracker() does nothing. The restored
        # step lets a resumed run's tracker drop what the earlier attempt logged after it.
        self.tracker = open_tracker(cfg.tracking, cfg.output.uri, cfg.to_dict(),
                                    cfg.storage.client(), start_step=run.state.global_step) \
            if rank == 0 else Tracker()
        self.board = None
        if rank == 0 and spec.progress_board:
            from raylora.desk import handle

            self.board = handle(spec.progress_board)
            if run.state.history:  # resumed: the printed loss goes on from the checkpoint's
                self.board.push.remote({"carried": carried(run.state.history),
                                        "label": spec.progress_label, "total": self.max_steps})
        self.log_every = every_n_steps(cfg.train.log_every_n_steps, self.max_steps)
        self._compiled_saved = False
        # (previous report's step, this one's): the steps a report's train_loss averages.
        # A restored run's step was reported; a run restored at its final checkpoint
        # reports it again, over the steps since the checkpoint before it.
        step = run.state.global_step
        self._reported = (checkpoint_before(step, cfg.checkpoint.every_n_steps), step)

    def close(self, failed: bool = False) -> None:
        self.tracker.close(failed)

    def save_compiled(self) -> None:
        """Rank 0 keeps what it compiled (train.compile_cache_uri) once it has something
        new: at the first loss read-back (the training graphs; step 1 on CPU, 10 on GPU:
        train.readback_every_n_steps) and at checkpoints (the held-out evaluation's and
        previews' no-grad variants), before a preemption can take it."""
        if self.rank == 0 and self.run.compile_cache is not None:
            self.run.compile_cache.save()

    def on_step(self, row: dict) -> None:
        from raylora.data.badrecords import BadDataError, min_rows_to_judge, read_counter, verdict

        cfg, plan = self.spec.config, self.spec.plan
        if not self._compiled_saved:
            self._compiled_saved = True
            self.save_compiled()
        if self.rank == 0 and plan.bad_records:
            # Rows were read (by the preprocess tasks) for this step: judge the totals now,
            # not after hours of training on a fraction of the data.
            message = verdict(read_counter(plan.bad_records) or {"rows_seen": 0},
                              cfg.data.max_bad_fraction, min_rows_to_judge(plan.total_rows))
            if message:
                raise BadDataError(message)
        self.tracker.log(row["step"], {k: v for k, v in row.items() if k not in ("step", "samples")})
        if self.board is not None:
            # Not waited for: the driver prints it (raylora.progress).
            keys = ("step", "epoch", "loss", "lr", "images_per_s", "world_size", "accumulation")
            self.board.push.remote({**{k: row[k] for k in keys},
                                    "label": self.spec.progress_label, "total": self.max_steps})
        elif self.rank == 0 and row["step"] % self.log_every == 0:  # no driver watching
            log.info("step %d/%d loss %.5f lr %.3g images/s %.1f",
                     row["step"], self.max_steps, row["loss"], row["lr"], row["images_per_s"])

    def metrics(self, st: LoopState) -> dict:
        # A run whose last step was skipped for NaN/inf is diverging: its held-out loss is
        # reported as inf even though the skip left the (evaluated) weights finite, so
        # Tune ranks it last instead of scoring the weights from before the blow-up.
        diverging = bool(st.history) and not math.isfinite(st.history[-1]["loss"])
        if st.global_step != self._reported[1]:  # (a second report of a step: the same window)
            self._reported = (self._reported[1], st.global_step)
        return {
            "step": st.global_step,
            "epoch": st.epoch,
            # The mean since the previous report (tune.metric train_loss ranks trials by
            # it); train_loss_last, the last step's, is in the final report's scalars.
            "train_loss": interval_mean(st.history, self._reported[0]),
            "eval_loss": float("inf") if diverging and st.eval_loss_last is not None
            else _finite_or_inf(st.eval_loss_last),
            "eval_loss_best": st.eval_loss_best,
            "lr": self.run.lr_scheduler.get_last_lr()[0],
            "world_size": self.run.accelerator.num_processes,  # elastic: this report's size
        } | self._prior_terms(st) | self._stopped() | self._noticed(st)

    def _prior_terms(self, st: LoopState) -> dict:
        """Prior preservation: the instance and class (prior) loss terms, over the steps
        train_loss is (their weighted sum is it)."""
        last = st.history[-1] if st.history else {}
        return {f"train_{k}": interval_mean(st.history, self._reported[0], k)
                for k in ("loss_instance", "loss_prior") if k in last}

    def _stopped(self) -> dict:
        """Why the run ends at this checkpoint short of max_steps (raylora.stop), if it does."""
        reason = self.stop_watch.reason if self.stop_watch is not None else None
        return {"stopped": reason} if reason else {}

    def _noticed(self, st: LoopState) -> dict:
        """A preemption notice's checkpoint (raylora.stop): the nodes going, as far as this
        rank was told (every rank has the key: they agreed on the step, not the notice)."""
        w = self.stop_watch
        if w is None or w.noticed_step != st.global_step:
            return {}
        info = w.notice()
        return {"preemption_notice": info.preempted_node_ids if info is not None else []}

    def _log_eval(self, st: LoopState) -> None:
        self.tracker.log(st.global_step, {"eval_loss": st.eval_loss_last})
        if self.rank == 0:
            log.info("step %d held-out loss %.5f", st.global_step, st.eval_loss_last)

    def on_base_eval(self, st: LoopState) -> None:
        # The tracker's eval_loss curve starts at step 0 (the base model or init_from).
        # No Ray report: every report already carries it until the first periodic one.
        self._log_eval(st)

    def on_eval(self, st: LoopState) -> None:
        self._log_eval(st)
        # Metrics only (a barrier like every report): Tune's schedulers see each evaluation.
        ray.train.report(self.metrics(st))

    def on_checkpoint(self, st: LoopState, final: bool) -> None:
        from accelerate.utils import gather_object

        from raylora.model.lora import digest
        from raylora.train.fsdp import param_bytes_per_rank
        from raylora.train.setup import write_checkpoint

        metrics = self.metrics(st)
        if st.history and "eval_loss" in st.history[-1]:
            self._log_eval(st)
        self.tracker.sync()
        self.save_compiled()
        d = tempfile.mkdtemp(prefix="raylora-ckpt-")
        sd = write_checkpoint(d, self.run, self.rank)
        # Where every checkpoint is in the run, as its trainer_state.pt holds it: what the
        # driver plans a rerun's remaining epochs from (launch.resumed_plan) before Ray
        # starts. Only the final one carried it: a stopped num_epochs run resumed on another
        # batch size planned from step 0 (3 steps done, 6 planned, epoch 0 left unfinished).
        metrics.update({k: getattr(st, k) for k in POSITION_KEYS})  # (scalars() copies the history)
        if final:
            # Every rank's adapter digest: equal digests prove the DDP replicas stayed
            # bit-identical; the driver records them in raylora.json.
            metrics["replica_lora_digests"] = gather_object([digest(sd)])
            if self.spec.plan.bucket_steps is not None:
                from raylora.data.buckets import sequence_digest

                # A digest of each rank's bucket per step: equal digests prove the ranks
                # never trained different buckets at one step.
                metrics["replica_bucket_digests"] = gather_object(
                    [sequence_digest([r.get("bucket") for r in st.history])])
            metrics["worker_nodes"] = gather_object([ray.get_runtime_context().get_node_id()])
            metrics.update(st.scalars())
            # False under the latent cache: the workers never loaded the VAE/text encoders.
            metrics["encoders_on_worker"] = self.run.parts.vae is not None
            metrics["denoiser_param_bytes_per_rank"] = gather_object(
                [param_bytes_per_rank(self.run.accelerator.unwrap_model(self.run.model))])
        # Every rank passes its directory: Ray merges them into one checkpoint (rank 0
        # writes the model and optimizer, each rank its own RNG state). Intermediate
        # checkpoints upload in the background so accelerators do not wait on storage;
        # Ray deletes the local copy once uploaded, and records a checkpoint as the
        # latest only after its upload completed. The final one is synchronous so the
        # driver can export it as soon as fit() returns.
        # A stop's or a preemption notice's checkpoint too: the process may be gone soon after.
        mode = CheckpointUploadMode.SYNC if final or metrics.keys() & {"stopped", "preemption_notice"} \
            else CheckpointUploadMode.ASYNC
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(d),
            checkpoint_upload_mode=mode,
            delete_local_checkpoint_after_upload=True,
            checkpoint_upload_fn=upload_checkpoint,
        )


def upload_checkpoint(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
    """Ray Train's own upload of this rank's checkpoint directory, then a check that every
    file arrived (``storage.complete_upload``: Ray's pyarrow copy can drop a file on S3
    and return normally, and Ray would record the checkpoint without it). An error here
    fails the report, so Ray never records an incomplete checkpoint as the latest."""
    persisted = ray.train.get_context().get_storage().persist_current_checkpoint(checkpoint, dir_name)
    complete_upload(checkpoint.path, persisted.filesystem, persisted.path, what=f"checkpoint {dir_name}")
    return persisted


@contextmanager
def rank_copy(checkpoint: ray.train.Checkpoint, rank: int):
    """A local folder holding ``checkpoint`` for rank ``rank`` to read: the checkpoint's own
    folder when it is on local disk, otherwise a download of its own, removed afterwards.

    Not ``checkpoint.as_directory()`` for a remote one: its folder is shared by the ranks on
    a node, and a rank that arrives after another's download has finished downloads it again
    into that folder, rewriting files the first rank is reading (a CI run's rank failed with
    "PytorchStreamReader failed reading file"; Ray 2.60's ``to_directory`` only waits for a
    download still in progress)."""
    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        yield checkpoint.path
        return
    d = tempfile.mkdtemp(prefix=f"raylora-restore-rank{rank}-")
    try:
        yield checkpoint.to_directory(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _restored(rank: int):
    """This rank's state in Ray's latest checkpoint (a RestoredState), None if none; and a
    scratch folder to remove once the model is built, None if none (``restore_rank``)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None, None
    return restore_rank(checkpoint, rank)


def restore_rank(checkpoint: ray.train.Checkpoint, rank: int):
    """Rank ``rank``'s state in ``checkpoint`` and the scratch folder holding part of it.

    FSDP shards (LoRA + optimizer state, small) are read after the model is built and
    sharded. A local checkpoint's are read where they are. A remote one's download is gone
    by then, so they are moved into a scratch folder of this rank's, which the caller
    removes once they are read (before, every FSDP resume left one in the temp dir, for local
    checkpoints as a needless copy)."""
    with rank_copy(checkpoint, rank) as d:
        state = load_state(d, rank, where=checkpoint.path)
        if state.sharded_dir is None or d == checkpoint.path:
            return state, None
        scratch = tempfile.mkdtemp(prefix=f"raylora-restore-shards-rank{rank}-")
        keep = os.path.join(scratch, "fsdp")
        # Moved out of the download, which is removed next: a rename in one temp dir, not a
        # second copy of every shard.
        shutil.move(state.sharded_dir, keep)
        state.sharded_dir = keep
        return state, scratch


def _build(spec: WorkerSpec, accelerator, restored, rank: int, max_steps: int):
    """The training run, resumed from ``restored`` when there is one."""
    from raylora.train.setup import build_run

    run = build_run(spec.config, accelerator, max_steps, rank, restored, pins=spec.plan.pins)
    if restored is not None and rank == 0:
        log.info("resumed from step %d (epoch %d)", run.state.global_step, run.state.epoch)
    if spec.config.scaling.elastic and rank == 0:
        log.info("elastic: %d worker(s), gradient accumulation %d (global batch %d)",
                 accelerator.num_processes, spec.config.train.gradient_accumulation_steps,
                 spec.config.global_batch())
    return run


def _stop_watch(spec: WorkerSpec, rank: int, world: int, device):
    """The run's stop decision (raylora.stop): SIGTERM to this process and the driver's
    stop requests, agreed by all ranks at each step."""
    from raylora.stop import StopWatch, install_sigterm, ray_preemption_notice

    timeout = spec.config.failure.stop_timeout_s
    if not install_sigterm(timeout):
        log.warning("rank %d: SIGTERM handler not installed: a SIGTERM kills this worker "
                    "without a checkpoint", rank)
    return StopWatch(rank, world, spec.stop_requests, device, notice=ray_preemption_notice)


def _notice_checkpoint(watch, rank: int):
    """LoopHooks.checkpoint_now: a checkpoint at the step the ranks agreed on a preemption
    notice (raylora.stop); rank 0 says which node goes and by when."""
    import time

    from raylora.stop import notice_nodes

    def now(step: int) -> bool:
        if not watch.take_notice(step):  # the checkpoint's metrics say why (_Reporter._noticed)
            return False
        if rank == 0:
            info = watch.notice()  # None: another rank was told first
            what = "a node of this run goes" if info is None else "node {} goes, {}".format(
                notice_nodes(info),
                f"in {info.deadline_ms / 1000 - time.time():.0f} s" if info.deadline_ms
                else "no deadline given")
            log.warning("step %d: preemption notice (%s): checkpointing at this step, training "
                        "goes on; Ray Train restarts the workers from it without that node",
                        step, what)
        return True

    return now


def _after_stop(reporter: _Reporter, state: LoopState) -> None:
    """The loop ended at a stop's checkpoint: a request returns (the run ends), a SIGTERM
    raises so Ray Train restarts the workers from that checkpoint."""
    from raylora.stop import PREEMPTED, Preempted

    watch = reporter.stop_watch
    if watch is None or not watch.code:
        return
    if reporter.rank == 0:
        log.info("step %d: %s: checkpoint written, stopping", state.global_step, watch.reason)
    if watch.code == PREEMPTED:
        # Ray Train's reports queue holds one: this metrics-only report (a barrier, like
        # every report) returns once the controller took the checkpoint's, so the failure
        # below cannot overtake its registration.
        ray.train.report(reporter.metrics(state))
        raise Preempted(f"step {state.global_step}: a worker got SIGTERM; resume from the "
                        "checkpoint just written")


def train_loop_per_worker(loop_config: dict) -> None:
    _setup_logging()
    spec = WorkerSpec.of(loop_config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Elastic: this worker group's size (Ray Train chose it) sets the accumulation.
    spec = replace(spec, config=spec.config.at_world(world))
    cfg, plan = spec.config, spec.plan
    accelerator = _accelerator(cfg)
    restored, scratch = _restored(rank)
    epoch_batches = reporter = None
    failed = False
    try:
        # The data stream starts before the model is loaded, and before the modules that
        # load it are imported: its first batches (processes started, shards read, images
        # decoded) are on their way while those are.
        epoch_batches = _epoch_batches(spec, rank, world, accelerator.device)
        epoch_batches.start(restored.loop.epoch if restored is not None else 0)
        try:
            run = _build(spec, accelerator, restored, rank, plan.max_steps)
        finally:
            _remove_scratch(scratch)  # its shards are read into the model and optimizer
        from raylora.train.setup import attention_planner, nonfinite_advice

        watch = _stop_watch(spec, rank, world, accelerator.device)
        reporter = _Reporter(spec, run, rank, watch)
        hooks = LoopHooks(
            should_stop=watch.check,
            checkpoint_now=_notice_checkpoint(watch, rank),
            epoch_batches=epoch_batches,
            on_checkpoint=reporter.on_checkpoint,
            on_step=reporter.on_step,
            on_eval=reporter.on_eval,
            on_base_eval=reporter.on_base_eval,
            evaluate=_heldout_evaluator(spec, run, rank, world) if plan.heldout_rows else None,
            preview=_previewer(spec, run, reporter.tracker, rank)
            if cfg.validation.prompts and (rank == 0 or run.sharded) else None,
            # Elastic: every rank's (gathered into rank 0's row: LoopSettings.gather_samples).
            sample_ids=sample_hashes if cfg.train.record_samples
            and (rank == 0 or cfg.scaling.elastic) else None,
            first_batch=attention_planner(cfg, run, log.info) or (lambda batch: None),
        )
        settings = LoopSettings.from_config(cfg, plan.max_steps, world, nonfinite_advice(cfg),
                                            accelerator.device.type)
        state = run_loop(run, settings, hooks)
        _after_stop(reporter, state)
    except BaseException:
        failed = True  # the tracker's run ends failed (wandb recorded a NaN stop as a success)
        raise
    finally:
        _remove_scratch(scratch)  # also when the data stream failed before the model was built
        if epoch_batches is not None:
            epoch_batches.close()  # ends the data stream's execution (it runs ahead)
        # Also when the loop stops on NaN/inf: what was logged so far is kept.
        if reporter is not None:
            reporter.close(failed)


def _remove_scratch(scratch: str | None) -> None:
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def lr_find_per_worker(loop_config: dict) -> None:
    """``raylora lr-find`` on one worker: the range test of ``raylora.train.lr_find`` over
    the real data pipeline, model and optimizer; rows reported once at the end."""
    from raylora.train.lr_find import range_test
    from raylora.train.setup import build_run
    from raylora.train.step import train_micro_step

    _setup_logging()
    spec = WorkerSpec.of(loop_config)
    cfg, lf = spec.config, spec.lr_find
    t = cfg.train
    accelerator = _accelerator(cfg)
    epoch_batches = _epoch_batches(spec, 0, 1, accelerator.device)
    epoch_batches.start(0)  # while the model loads
    try:
        run = build_run(cfg, accelerator, lf.num_steps, rank=0, pins=spec.plan.pins)
    except BaseException:
        epoch_batches.close()
        raise
    stream = itertools.chain.from_iterable(map(epoch_batches, itertools.count()))

    def step(lr: float) -> float:
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for _ in range(t.gradient_accumulation_steps):
            losses.append(train_micro_step(
                accelerator, run.model, run.parts, run.optimizer, None, run.params,
                next(stream), t.max_grad_norm,
            ))
        loss = float(torch.stack(losses).mean())
        log.info("lr %.3g loss %.5f", lr, loss)
        return loss

    try:
        rows = range_test(step, lf.start_lr, lf.end_lr, lf.num_steps, smoothing=lf.smoothing,
                          diverge_factor=lf.diverge_factor)
    finally:
        epoch_batches.close()
    if run.compile_cache is not None:
        run.compile_cache.save()
    # Rows travel as a checkpoint file: a run's Result carries the metrics and files of
    # its latest checkpoint only.
    d = tempfile.mkdtemp(prefix="raylora-lrfind-")
    with open(f"{d}/lr_find.json", "w") as f:
        json.dump(rows, f)
    ray.train.report({"steps_run": len(rows)}, checkpoint=ray.train.Checkpoint.from_directory(d),
                     checkpoint_upload_fn=upload_checkpoint)
