"""Driver side of ``raylora train``: preflight, Ray, TorchTrainer, export.

Everything that can be checked without Ray is checked first (``plan``), so a typo in a
path costs a second, not a cluster start.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, dataclass

from raylora import storage
from raylora.config import ConfigError, RayLoraConfig

log = logging.getLogger("raylora")

TRAIN_RUN_NAME = "train"


@dataclass
class Plan:
    """What preflight learned: passed to every worker."""

    model_path: str
    shard_files: list[str]
    total_rows: int
    rows_per_worker: int
    updates_per_epoch: int
    max_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def plan(cfg: RayLoraConfig) -> Plan:
    """Check model, data and step arithmetic; raise one ConfigError with every problem."""
    from raylora.data.source import check_columns, count_rows, shard_files
    from raylora.model.load import check_local_model, resolve_model_path, vae_scale_factor

    problems: list[str] = []
    model_path = resolve_model_path(cfg.model)
    if os.path.isabs(model_path):
        try:
            check_local_model(model_path)
            factor = vae_scale_factor(model_path)
            if cfg.data.resolution % factor:
                problems.append(
                    f"data.resolution: {cfg.data.resolution} is not divisible by the VAE's "
                    f"downsampling factor {factor}"
                )
        except (FileNotFoundError, KeyError, ValueError) as exc:
            problems.append(str(exc))
    elif cfg.data.resolution % 8:
        problems.append(f"data.resolution: {cfg.data.resolution} is not divisible by 8")

    files: list[str] = []
    total = 0
    try:
        files = shard_files(cfg.data)
        check_columns(cfg.data, files)
        total = count_rows(files)
    except (FileNotFoundError, NotImplementedError, ValueError, OSError) as exc:
        problems.append(f"data.uri: {exc}")

    t, world = cfg.train, cfg.scaling.num_workers
    rows_per_worker = total // world
    updates = rows_per_worker // t.batch_size // t.gradient_accumulation_steps
    if files and updates == 0:
        problems.append(
            f"data.uri: {total} rows split over {world} workers is less than one optimizer "
            f"step (train.batch_size={t.batch_size} × "
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} per worker)"
        )
    if problems:
        raise ConfigError(problems)
    max_steps = t.max_steps or t.num_epochs * updates
    return Plan(model_path, files, total, rows_per_worker, updates, max_steps)


def init_ray(cfg: RayLoraConfig) -> bool:
    """Join ``RAY_ADDRESS`` if set, else start an embedded local Ray. Returns True when this
    call started Ray (so the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return False
    need = cfg.scaling.num_workers * cfg.scaling.cpus_per_worker
    # Logical CPUs: training workers hold theirs for the whole run, so Ray Data's readers
    # and preprocess actors need room beside them even on a 2-core laptop.
    num_cpus = max(os.cpu_count() or 1, int(need + 0.999) + 2)
    ray.init(num_cpus=num_cpus, dashboard_host="127.0.0.1", log_to_driver=True)
    return True


def resolve_paths(cfg: RayLoraConfig) -> RayLoraConfig:
    """Local paths made absolute on the driver: Ray workers run in another directory."""
    from raylora.model.load import resolve_model_path

    cfg = cfg.model_copy(deep=True)
    cfg.model.pretrained = resolve_model_path(cfg.model)
    uris = cfg.data.uri
    cfg.data.uri = (
        storage.normalize(uris) if isinstance(uris, str) else [storage.normalize(u) for u in uris]
    )
    cfg.output.uri = storage.normalize(cfg.output.uri)
    return cfg


def run(cfg: RayLoraConfig) -> dict:
    """Train, then export the adapter to ``{output.uri}/adapter``. Returns a summary dict."""
    from raylora.checkpoint.export import export_run

    cfg = resolve_paths(cfg)
    p = plan(cfg)
    started = init_ray(cfg)
    try:
        result = _fit(cfg, p)
        if result.checkpoint is None:
            raise RuntimeError("training finished without a checkpoint to export")
        with result.checkpoint.as_directory() as ckpt_dir:
            return export_run(ckpt_dir, cfg, result.metrics, p.to_dict())
    finally:
        if started:
            import ray

            ray.shutdown()


def _fit(cfg: RayLoraConfig, p: Plan):
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylora.data.source import build_dataset
    from raylora.worker import train_loop_per_worker

    import ray.data

    # Ray Data's and the worker's progress bars are for people watching a terminal; in
    # job logs and CI they are thousands of lines of carriage returns.
    interactive = sys.stdout.isatty()
    ray.data.DataContext.get_current().enable_progress_bars = interactive
    ds = build_dataset(
        cfg.data,
        p.shard_files,
        tokenizer_path=p.model_path,
        seed=cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.train.seed,
        num_preprocess_actors=max(1, cfg.scaling.num_workers),
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.to_dict(), "plan": p.to_dict(), "progress_bar": interactive
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            # Same storage_path + name = Ray Train V2 resumes from the latest checkpoint.
            name=TRAIN_RUN_NAME,
            storage_path=storage.normalize(cfg.output.uri),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
        ),
        datasets={"train": ds},
    )
    return trainer.fit()


def checkpoint_root(cfg: RayLoraConfig) -> str:
    return storage.join(cfg.output.uri, TRAIN_RUN_NAME)
