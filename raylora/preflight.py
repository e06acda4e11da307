"""The memory preflight of ``raylora train``/``tune`` and ``raylora plan`` (issue #21).

Before any worker starts, one worker's per-GPU bytes are estimated (``raylora.memory``: a
meta-device training step, no weights read) and compared with the GPU it will get; a run
that cannot fit is refused with the estimate and the keys that would make it fit, instead
of failing with a CUDA out-of-memory error minutes into the run.

The GPU's size comes from ``scaling.gpu_memory_gb``, else from the GPUs the workers will
use: this machine's (an embedded Ray runs the workers here) or, on a cluster, the
``accelerator_type:*`` resource Ray gives each GPU node, for the names that have one size.
Unknown: no check, and one log line that says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from raylora.config import ConfigError, RayLoraConfig

log = logging.getLogger("raylora")

GIB = 1024**3  # raylora.memory's, which imports torch: this module is on every CLI path

# Memory as nvidia-smi shows it (MiB), by the name Ray's accelerator_type resource gives
# the GPU. Names that cover several sizes are left out (A100: 40 or 80 GB; V100: 16 or
# 32 GB): no check is better than a wrong one. "H100" covers the 94 GB H100 NVL too: its
# 80 GB siblings' figure is the safe one. A100-40G/-80G are labels users add themselves.
KNOWN_GPU_MIB = {
    "H100": 81559, "H200": 143771, "A100-80G": 81920, "A100-40G": 40960,
    "L40S": 46068, "L4": 23034, "A10G": 23028, "T4": 15360,
}
# `raylora plan`'s exit status when the run does not fit (2 is a config problem). The
# same status when `raylora train` refuses a run for it.
EXIT_DOES_NOT_FIT = 3


@dataclass
class GpuSize:
    """One worker's GPU memory in GiB (None: unknown), and where the figure came from."""

    gib: float | None
    source: str


class DoesNotFit(ConfigError):
    """The run's estimate does not fit its GPU: the message is the estimate table, the
    GPU size and the changes that would fit, each re-estimated."""

    def __init__(self, report: str, advice: list[str]):
        keys = "; ".join(advice) or "no single change (nor a pair) fits"
        super().__init__([f"memory: the estimate does not fit the GPU ({keys})"])
        self.advice = advice
        self.args = (report,)  # str(exc): the whole report, which the CLI prints


def on_cluster(cfg: RayLoraConfig, remote: bool = False) -> bool:
    """Whether the GPU size must be read from a Ray cluster (joined, not this machine's):
    no ``scaling.gpu_memory_gb``, GPU workers, and ``remote`` (``raylora submit``: the
    job runs on ``--address``'s cluster, whatever this shell's RAY_ADDRESS says),
    ``RAY_ADDRESS`` set or Ray running."""
    import ray

    s = cfg.scaling
    return (s.gpu_memory_gb is None and s.use_gpu
            and (remote or bool(os.environ.get("RAY_ADDRESS") or ray.is_initialized())))


def gpu_size(cfg: RayLoraConfig, cluster: bool = False) -> GpuSize:
    """The memory of one worker's GPU: ``scaling.gpu_memory_gb``, else the cluster's GPU
    nodes (``cluster``, Ray connected) or this machine's GPUs; CPU runs have none."""
    s = cfg.scaling
    if s.gpu_memory_gb is not None:
        return GpuSize(s.gpu_memory_gb, "scaling.gpu_memory_gb")
    if not s.use_gpu:
        return GpuSize(None, "scaling.use_gpu is false")
    return _cluster_gpu() if cluster else _local_gpu()


def _local_gpu() -> GpuSize:
    # Device properties come from the CUDA runtime without creating a context on the GPU
    # the workers are about to use.
    import torch

    if not torch.cuda.is_available():
        return GpuSize(None, "no GPU on this machine")
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    small = min(props, key=lambda p: p.total_memory)
    return GpuSize(small.total_memory / GIB, f"detected: {small.name}")


def _cluster_gpu() -> GpuSize:
    import ray

    names = set()
    for node in ray.nodes():
        res = node.get("Resources", {})
        if node.get("Alive") and res.get("GPU"):
            types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            names.add(types[0] if len(types) == 1 else None)
    if not names:
        return GpuSize(None, "no GPU node in the cluster yet")
    unknown = names - set(KNOWN_GPU_MIB)
    if unknown:
        named = ", ".join(sorted(n or "unnamed" for n in unknown))
        return GpuSize(None, f"the cluster's GPU type {named} has no single known size")
    small = min(names, key=KNOWN_GPU_MIB.get)
    return GpuSize(KNOWN_GPU_MIB[small] / 1024, f"detected: {small} (Ray accelerator_type)")


def config_accepts(cfg: RayLoraConfig, settings: dict | None = None, searched: Iterable[str] = ()):
    """``overrides → bool``: whether ``cfg`` with these ``key=value`` overrides validates
    and, with ``settings`` (an estimate's: the model's family, latent grid and native
    objective), passes the family's checks that `raylora train` runs before Ray
    (``launch.family_problems``): the memory advice names no change that would then be
    refused. ``searched``: keys a Tune search sets per trial (and ``cfg.tune``'s), for
    which a fixed value is no advice; an override of one is refused."""
    from raylora.config import apply_overrides, validate

    tree = cfg.to_dict()
    searched = set(searched) | set(cfg.tune.search_space if cfg.tune is not None else ())
    family = None
    if settings and settings.get("grid"):
        from raylora.model import families

        family = families.get(settings["family"])

    def overlaps(key: str) -> bool:  # the key, or a section holding it, or a key under it
        return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in searched)

    def accepts(overrides: list[str]) -> bool:
        if any(overlaps(o.split("=", 1)[0].strip()) for o in overrides):
            return False
        try:
            changed = validate(apply_overrides(tree, overrides))
        except ConfigError:
            return False
        if family is None:
            return True
        from raylora.launch import family_problems

        return not family_problems(changed, family, settings["grid"], settings["objective"])

    return accepts


def report(est, gpu: GpuSize, cfg: RayLoraConfig | None = None,
           searched: Iterable[str] = ()) -> tuple[str, bool | None, list[str]]:
    """(text, fits, advice): the estimate table, the GPU and whether it fits (None: no GPU
    size known), and the changes that would fit, each re-estimated (with ``cfg``, the run's
    config: only changes it accepts, ``config_accepts``; ``searched``: a Tune search's keys,
    which no advice sets)."""
    from raylora.memory import size

    lines = [est.table()]
    if gpu.gib is None:
        lines.append(f"GPU: unknown ({gpu.source}): not checked; give scaling.gpu_memory_gb=<GiB>")
        return "\n".join(lines), None, []
    fits = est.fits(gpu.gib)
    head = f"GPU: {size(gpu.gib * GIB)} ({gpu.source}): "
    if fits:
        lines.append(head + f"fits, {size(gpu.gib * GIB - est.peak)} to spare")
        return "\n".join(lines), True, []
    accepts = None if cfg is None else config_accepts(cfg, est.settings, searched)
    advice = est.advice(gpu.gib, accepts)
    lines.append(head + f"does NOT fit ({size(est.peak)} needed)")
    if advice:
        lines.append("These would fit (each re-estimated; key=value, as overrides or in the YAML):")
        lines += [f"  {a}" for a in advice]
    else:
        levers = _levers(est, accepts)
        takes = accepts or (lambda overrides: True)
        # Advice tried each lever alone and in pairs (FSDP up to 8 workers): what is left is
        # more workers, or three or more levers the config takes together.
        more = any(o[0].startswith("scaling.") for o, _ in levers) or any(
            takes(levers[i][0] + levers[j][0] + levers[k][0])
            for i in range(len(levers)) for j in range(i + 1, len(levers)) for k in range(j + 1, len(levers)))
        if not more:
            lines.append("No single change, nor a pair, fits, and the config has no other "
                         "setting that lowers the estimate: a larger GPU.")
        else:
            # the pairs the config refuses together (fsdp takes no quantized base)
            clash = [f"{' '.join(o1)} with {' '.join(o2)}" for i, (o1, _) in enumerate(levers)
                     for o2, _ in levers[i + 1:] if not takes(o1 + o2)]
            lines.append("No single change, nor a pair, fits. Try more of these together"
                         + (f" (the config takes no {'; no '.join(clash)})" if clash else "")
                         + f": {', '.join(w for _, w in levers)}; or a larger GPU.")
    return "\n".join(lines), False, advice


def _levers(est, accepts) -> list[tuple[list[str], str]]:
    """The settings that lower ``est`` which its config does not use yet and accepts (fsdp
    with an 8-bit optimizer is refused): the last resort's list, when no change nor pair
    of ``Estimate.advice`` fits. The same levers as that advice, where a config that
    already used one was told to use it. (the overrides, the words) each."""
    a = est.settings["args"]
    fsdp = a["strategy"] == "fsdp"
    base = [] if a["quantize"] == "none" else ["model.quantize=none"]  # FSDP loads it unquantized
    candidates = [
        # (applies, the overrides it must accept, the words)
        (True, [f"scaling.num_workers={2 * a['world_size']}"] if fsdp else ["scaling.strategy=fsdp", *base],
         "more scaling.num_workers" if fsdp else
         "scaling.strategy=fsdp with more scaling.num_workers" + (" and model.quantize=none" if base else "")),
        (a["quantize"] != "nf4" and not fsdp, ["model.quantize=nf4"], "model.quantize=nf4"),
        (not a["gradient_checkpointing"], ["train.gradient_checkpointing=true"], "train.gradient_checkpointing=true"),
        (a["batch_size"] > 1, ["train.batch_size=1"], "a smaller train.batch_size"),
        (bool(est.preview), ["validation.prompts=[]"], "validation.prompts=[] (no previews while training)"),
        (a["quantize_text_encoders"] != "nf4" and (bool(est.preview) or not a["cached_latents"]),
         ["model.quantize_text_encoders=nf4"], "model.quantize_text_encoders=nf4"),
        (not a["cached_latents"] and not a["train_text_encoder"], ["data.cache=latents"], "data.cache=latents"),
    ]
    return [(overrides, words) for applies, overrides, words in candidates
            if applies and (accepts is None or accepts(overrides))]


def distinct_settings(configs: list[tuple[str, RayLoraConfig]]) -> list[tuple[str, RayLoraConfig]]:
    """The first (label, config) of each distinct memory estimate: a search dimension that
    does not change the estimate (the learning rate) costs nothing to check."""
    from raylora import memory

    seen, kept = set(), []
    for label, c in configs:
        key = tuple(sorted(memory.config_args(c).items()))
        if key not in seen:
            seen.add(key)
            kept.append((label, c))
    return kept


def check_memory(cfg: RayLoraConfig, cluster: bool = False,
                 variants: list[tuple[str, RayLoraConfig]] = (), commit: str | None = None) -> None:
    """Refuse (``DoesNotFit``) a run whose worker cannot fit its GPU; log the estimate
    table when it fits. ``variants``: further configs of the same run (Tune trials), by a
    label naming what differs; each distinct estimate is checked too. ``commit``: a hub
    model's, as the plan pinned it (``Plan.model_commit``): its configs are the ones read.
    An estimate that fails is logged and the run goes on: the preflight guards, it must
    not block."""
    from raylora import memory
    from raylora.memory import size

    gpu = gpu_size(cfg, cluster)
    if gpu.gib is None:
        log.info("memory preflight: not checked, GPU size unknown (%s; set "
                 "scaling.gpu_memory_gb to check)", gpu.source)
        return
    distinct = distinct_settings([("", cfg), *variants])
    # a trial's keys that the search sets are no advice: it would override them
    searched = list(cfg.tune.search_space) if cfg.tune is not None else []
    for label, c in distinct:
        try:
            est = memory.from_config(c.at_commit(commit))
        except Exception as exc:  # an estimator gap must not stop a run that may fit
            log.warning("memory preflight: not checked, the estimate failed (%s: %s)",
                        type(exc).__name__, exc)
            return
        text, fits, advice = report(est, gpu, c, searched)
        if not fits:
            where = f" for {label}" if label else ""
            raise DoesNotFit(f"memory preflight{where}: one worker needs ~{size(est.peak)} "
                             f"per GPU\n{text}", advice)
        if not label:
            log.info("memory preflight: fits\n%s", text)
    if variants:
        log.info("memory preflight: %d distinct trial setting(s) fit too", len(distinct) - 1)
