"""Per-worker train function for Ray Train: restore → build → loop → sink.

Ray appears only here: the dataset shard, the checkpoint to resume from, and
``ray.train.report``. Everything else is the plain-PyTorch code in ``raylora.train``.
"""

from __future__ import annotations

import itertools
import logging
import tempfile

import ray
import ray.train
from ray.train import CheckpointUploadMode

from raylora.checkpoint.state import LoopState, load_state
from raylora.config import RayLoraConfig
from raylora.model.lora import digest
from raylora.train.loop import run_loop
from raylora.train.setup import build_run, write_checkpoint

log = logging.getLogger("raylora.worker")


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[raylora] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def train_loop_per_worker(loop_config: dict) -> None:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    _setup_logging()
    cfg = RayLoraConfig.model_validate(loop_config["config"])
    plan = loop_config["plan"]
    max_steps = plan["max_steps"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    t = cfg.train

    # Accelerate picks up the torch.distributed process group that Ray Train created.
    accelerator = Accelerator(
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        cpu=not cfg.scaling.use_gpu,
    )
    restored = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            restored = load_state(d, rank)
    run = build_run(cfg, accelerator, max_steps, rank, restored)
    if restored is not None and rank == 0:
        log.info("resumed from step %d (epoch %d)", run.state.global_step, run.state.epoch)

    by_files = cfg.data.sharding == "files"
    shard = ray.train.get_dataset_shard(f"train_{rank}" if by_files else "train")
    data_seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else t.seed

    def epoch_batches(epoch: int):
        batches = shard.iter_torch_batches(
            batch_size=t.batch_size,
            drop_last=True,
            local_shuffle_buffer_size=cfg.data.shuffle_buffer_size or None,
            local_shuffle_seed=data_seed + 7919 * epoch + rank,
            device=accelerator.device,
        )
        # With per-worker files, workers hold different row counts: all stop at the
        # smallest one's batch count so their DDP steps line up.
        return itertools.islice(batches, plan["batches_per_epoch"]) if by_files else batches

    bar = None
    if rank == 0 and loop_config.get("progress_bar"):
        # tqdm_ray draws this bar on the driver's terminal, not in the worker's log.
        from ray.experimental.tqdm_ray import tqdm

        bar = tqdm(total=max_steps, desc="raylora train")
        bar.update(run.state.global_step)

    def on_step(row: dict) -> None:
        if bar is not None:
            bar.update(1)
        if rank == 0 and row["step"] % t.log_every_n_steps == 0:
            log.info(
                "step %d/%d loss %.5f lr %.3g images/s %.1f",
                row["step"], max_steps, row["loss"], row["lr"], row["images_per_s"],
            )

    def on_checkpoint(st: LoopState, final: bool) -> None:
        metrics = {
            "step": st.global_step,
            "epoch": st.epoch,
            "train_loss": st.train_loss_last,
            "lr": run.lr_scheduler.get_last_lr()[0],
        }
        d = tempfile.mkdtemp(prefix="raylora-ckpt-")
        sd = write_checkpoint(d, run, rank)
        if final:
            # Every rank's adapter digest: equal digests prove the DDP replicas stayed
            # bit-identical; the driver records them in raylora.json.
            metrics["replica_lora_digests"] = gather_object([digest(sd)])
            metrics["worker_nodes"] = gather_object([ray.get_runtime_context().get_node_id()])
            metrics.update(st.scalars())
        # Every rank passes its directory: Ray merges them into one checkpoint (rank 0
        # writes the model and optimizer, each rank its own RNG state). Intermediate
        # checkpoints upload in the background so accelerators do not wait on storage;
        # Ray deletes the local copy once uploaded, and records a checkpoint as the
        # latest only after its upload completed. The final one is synchronous so the
        # driver can export it as soon as fit() returns.
        mode = CheckpointUploadMode.SYNC if final else CheckpointUploadMode.ASYNC
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(d),
            checkpoint_upload_mode=mode,
            delete_local_checkpoint_after_upload=True,
        )

    run_loop(
        accelerator=accelerator,
        unet=run.unet,
        parts=run.parts,
        optimizer=run.optimizer,
        lr_scheduler=run.lr_scheduler,
        params=run.params,
        state=run.state,
        max_steps=max_steps,
        max_grad_norm=t.max_grad_norm,
        images_per_step=t.batch_size * t.gradient_accumulation_steps * world,
        checkpoint_every=cfg.checkpoint.every_n_steps,
        epoch_batches=epoch_batches,
        on_checkpoint=on_checkpoint,
        on_step=on_step,
    )
    if bar is not None:
        bar.close()
