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
    data_format: str
    shard_files: list[str]
    total_rows: int
    rows_per_worker: int
    updates_per_epoch: int
    max_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


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


def plan(cfg: RayLoraConfig) -> Plan:
    """Check model, data and step arithmetic; raise one ConfigError with every problem."""
    from raylora.data.source import plan_data
    from raylora.model.load import check_model, is_hub_id

    problems: list[str] = []
    store = cfg.storage.client()
    model_path = cfg.model.pretrained
    factor = 8
    if not is_hub_id(model_path):
        try:
            factor = check_model(model_path, store)["vae_scale_factor"]
        except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
            problems.append(str(exc) if str(exc).startswith("model.") else f"model.pretrained: {exc}")
    if cfg.data.resolution % factor:
        problems.append(
            f"data.resolution: {cfg.data.resolution} is not divisible by the VAE's "
            f"downsampling factor {factor}"
        )

    data = None
    try:
        data = plan_data(cfg.data, store)
    except (FileNotFoundError, ValueError, OSError) as exc:
        problems.append(f"data.uri: {exc}")

    t, world = cfg.train, cfg.scaling.num_workers
    total = data.rows if data else 0
    rows_per_worker = total // world
    updates = rows_per_worker // t.batch_size // t.gradient_accumulation_steps
    if data and updates == 0:
        problems.append(
            f"data.uri: {total} rows split over {world} workers is less than one optimizer "
            f"step (train.batch_size={t.batch_size} × "
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} per worker)"
        )
    if problems:
        raise ConfigError(problems)
    max_steps = t.max_steps or t.num_epochs * updates
    return Plan(model_path, data.format, data.files, total, rows_per_worker, updates, max_steps)


def init_ray(need_cpus: float = 0) -> bool:
    """Join ``RAY_ADDRESS`` if set, else start an embedded local Ray. Returns True when this
    call started Ray (so the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        # A cluster started without our storage settings still needs them in every worker
        # and Ray Data task: forward them as this job's environment (never logged by us).
        env = storage.forwarded_env()
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env} if env else None)
        return False
    # Logical CPUs: training workers hold theirs for the whole run, so Ray Data's readers
    # and preprocess actors need room beside them even on a 2-core laptop. Workers of an
    # embedded Ray inherit this process's environment, storage variables included.
    num_cpus = max(os.cpu_count() or 1, int(need_cpus + 0.999) + 2)
    ray.init(num_cpus=num_cpus, dashboard_host="127.0.0.1")
    return True


def run(cfg: RayLoraConfig) -> dict:
    """Train, then export the adapter to ``{output.uri}/adapter``. Returns a summary dict."""
    from raylora.checkpoint.export import export_run

    cfg = resolve_paths(cfg)
    p = plan(cfg)
    started = init_ray(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker)
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
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylora.data.source import DataPlan, build_dataset
    from raylora.worker import train_loop_per_worker

    store = cfg.storage.client()
    # Ray Data's and the worker's progress bars are for people watching a terminal; in
    # job logs and CI they are thousands of lines of carriage returns.
    interactive = sys.stdout.isatty()
    ray.data.DataContext.get_current().enable_progress_bars = interactive
    seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.train.seed
    ds = build_dataset(
        cfg.data,
        DataPlan(p.data_format, p.shard_files, p.total_rows),
        store,
        model_path=p.model_path,
        seed=seed,
        num_preprocess_actors=max(1, cfg.scaling.num_workers),
    )
    ckpt_fs, ckpt_path = store.fs(cfg.output.uri)
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
            storage_path=ckpt_path,
            storage_filesystem=ckpt_fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
        ),
        datasets={"train": ds},
    )
    return trainer.fit()
