"""``raylora tune``: a Ray Tune search where every trial is a multi-worker TorchTrainer.

The Ray Train V2 pattern: Tune runs ``_trial`` (a plain function) once per sampled config;
``_trial`` builds that trial's TorchTrainer (the same one ``raylora train`` runs) with
``TuneReportCallback``, which forwards every ``ray.train.report`` of rank 0 to Tune. ASHA
sees the held-out loss at every evaluation (``time_attr="step"``) and stops losing trials.

Storage under ``output.uri``::

    tune/                       Tune's experiment state and per-trial result logs
    tune/search.json            the resolved config the search started with (a rerun of
                                the same command resumes the search; another config is refused)
    tune/trials/trial_<id>/     each trial's Ray Train run (checkpoints; diverged.json when
                                it ended on NaN/inf, so a rerun does not train it again)
    tune/results.csv|json       one row per trial: sampled values, metrics, steps, status
    best/adapter/               the best trial's adapter, same contract as ``raylora train``
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
from collections.abc import Callable

from raylora import progress, storage
from raylora.config import (DEFAULT_SAMPLES, RayLoraConfig, TuneSection, differences, trial_tree,
                            validate)
from raylora.launch import Plan, Setup, build_trainer, check_bad_records, pin, plan, prepared, replan

log = logging.getLogger("raylora.tune")

TUNE_DIR = "tune"
TRIALS_DIR = "trials"
BEST_DIR = "best"
TRIAL_DRIVER_CPU = 0.01
# Under tune/: the resolved config a search started with, checked when it is resumed.
SEARCH_FILE = "search.json"
# In a trial's run folder: the error its run diverged with (a rerun does not train it again).
DIVERGED_FILE = "diverged.json"
# Config sections a resumed search may change: they do not change what a trial trains.
RESUME_MAY_CHANGE = ("storage", "failure")
# Trials that change the step arithmetic get it checked for every bounding value up front.
ARITHMETIC_KEYS = (
    "train.batch_size", "train.gradient_accumulation_steps", "train.max_steps", "train.num_epochs",
)


def param_space(tn: TuneSection) -> dict:
    """Config dims → Tune's search space, keyed by the dotted config key."""
    from ray import tune

    space = {}
    for key, dim in tn.search_space.items():
        kind, v = dim.kind, dim.values
        if tn.expanded(dim):  # every value once, in order (TuneSection.every_combination)
            space[key] = tune.grid_search(dim.options)
        elif kind == "loguniform":
            space[key] = tune.loguniform(v[0], v[1])
        elif kind == "uniform":
            space[key] = tune.uniform(v[0], v[1])
        elif kind == "randint":  # [lo, hi): dim.values are the bounds trials take, lo and hi - 1
            space[key] = tune.randint(*dim.randint)
        else:
            space[key] = tune.choice(v)
    return space


def search_algorithm(tn: TuneSection, seed: int, max_concurrent: int):
    from ray.tune.search import BasicVariantGenerator

    if tn.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=seed)
    if tn.search_alg == "hyperopt":
        from ray.tune.search.hyperopt import HyperOptSearch

        return HyperOptSearch(random_state_seed=seed)
    # Grid dims expand in order, sampled dims draw from one seeded stream: the same
    # command proposes the same trials.
    return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)


def trial_resources(cfg: RayLoraConfig) -> dict[str, float]:
    """What one trial holds while it runs: its training workers plus Ray Data's preprocess
    tasks (0.5 CPU each) and about one CPU of readers. The trial's driver function itself
    holds nothing: it only waits on its TorchTrainer."""
    s = cfg.scaling
    tasks = s.max_workers  # preprocess tasks at once: one per worker (launch.build_trainer)
    res = {"CPU": s.max_workers * s.cpus_per_worker + 0.5 * tasks + 1.0}
    if s.use_gpu:
        res["GPU"] = float(s.max_workers)
    return res


def trial_cpus_per_worker(cfg: RayLoraConfig, nodes: list[dict], concurrency: int) -> float:
    """The ``scaling.cpus_per_worker`` a trial's workers ask for: what
    ``launch.fit_worker_cpus`` gives one run on a trial's share of the cluster (each of
    ``nodes``' CPUs ÷ the ``concurrency`` trials that run at once), so that its workers can
    be placed and leave Ray Data its CPUs. ``cfg``: the config as asked. The trials got the
    request as asked before, which a small cluster cannot place where ``raylora train``
    lowers it (check_cluster_fits): their workers waited forever. When a share cannot hold
    a trial's workers at all, the whole cluster's answer: the trials beyond what fits wait
    for a running one to end, as they did."""
    from raylora.config import ConfigError
    from raylora.data.source import data_stage_cpus
    from raylora.launch import fit_worker_cpus, stage_task_cpus

    s = cfg.scaling
    if s.autoscaling:  # the cluster grows to the request (as check_cluster_fits keeps it)
        return s.cpus_per_worker
    data, task = data_stage_cpus(cfg.data, s.min_workers), stage_task_cpus(cfg.data)
    if concurrency > 1:
        share = [{**n, "CPU": n.get("CPU", 0.0) / concurrency} for n in nodes]
        try:
            return fit_worker_cpus(share, s, s.min_workers, data, task)
        except ConfigError:
            pass
    return fit_worker_cpus(nodes, s, s.min_workers, data, task)


def trial_config(cfg: RayLoraConfig, cpus_per_worker: float) -> RayLoraConfig:
    """``cfg`` with the ``scaling.cpus_per_worker`` its trials' workers ask for."""
    return cfg.model_copy(update={"scaling": cfg.scaling.model_copy(
        update={"cpus_per_worker": cpus_per_worker})})


def max_concurrency(cfg: RayLoraConfig, cluster: dict[str, float], num_trials: int) -> int:
    """Trials that fit side by side: cluster resources ÷ resources per trial (≥ 1)."""
    if cfg.tune.max_concurrent_trials:
        return cfg.tune.max_concurrent_trials
    need = trial_resources(cfg)
    fits = min(int(cluster.get(k, 0.0) // v) for k, v in need.items() if v > 0)
    return max(1, min(fits, num_trials))


def expected_trials(tn: TuneSection) -> int:
    grid = 1
    for dim in tn.search_space.values():
        if tn.expanded(dim):
            grid *= len(dim.options)
    return tn.samples * grid


# The most data sections of a search planned before Ray starts as every combination of
# its data.* values (each plan lists, and with data.bucketing scans, the data); beyond,
# each value alone is planned there, and a trial of another combination plans its own.
MAX_DATA_PLANS = 16


def data_key(data: dict) -> str:
    """A config's data section (``to_dict()["data"]``) as the key of ``Plan.data_variants``."""
    return json.dumps(data, sort_keys=True)


def data_params(tn: TuneSection) -> list[dict]:
    """The values of the search's data.* dimensions whose data sections are planned before
    Ray starts: every combination when each dimension has a few options (a grid, a choice,
    a randint's integers; at most ``MAX_DATA_PLANS`` together), else each bounding value
    alone (every option, both ends of a range)."""
    import itertools

    space = {k: d for k, d in tn.search_space.items() if k.startswith("data.")}
    options = {k: d.options for k, d in space.items()}
    if not space:
        return []
    if all(v is not None for v in options.values()) and \
            math.prod(len(v) for v in options.values()) <= MAX_DATA_PLANS:
        return [dict(zip(options, vs)) for vs in itertools.product(*options.values())]
    return [{k: v} for k, d in space.items() for v in d.values]


def _label(params: dict) -> str:
    """How a problem names the trial of ``params``, as the memory preflight does."""
    if len(params) == 1:
        [(k, v)] = params.items()
        return f"tune.search_space.{k}={v!r}"
    return "tune.search_space: " + ", ".join(f"{k}={v!r}" for k, v in params.items())


def plan_data_variants(cfg: RayLoraConfig, base: Plan) -> tuple[list[dict], list[str]]:
    """``base.data_variants``: each data section of ``data_params`` other than the base's,
    planned as ``raylora train`` plans a config with it (files, rows, the sample check,
    buckets at its resolution, held-out rows, the step arithmetic). Replanned from the
    base's data, a trial of another data.uri read the base's shards, and one of another
    resolution the base's bucket ids (its workers found no row of a bucket, and failed).
    Returns the values of each section planned, and the problems, named by the values."""
    from raylora.config import ConfigError

    tree, planned, problems = cfg.to_dict(), [], []
    for params in data_params(cfg.tune):
        try:
            trial = validate(trial_tree(tree, params))
            key = data_key(trial.to_dict()["data"])
            if key != data_key(tree["data"]) and key not in base.data_variants:
                base.data_variants[key] = plan(trial)
            planned.append(params)
        except ConfigError as exc:
            problems.extend(f"{_label(params)}: {p}" for p in exc.problems)
    return planned, problems


def trial_plan(trial: RayLoraConfig, base_tree: dict, base_plan: Plan) -> Plan:
    """The plan a trial of config ``trial`` trains with: the base plan with the step
    arithmetic redone (``replan``) when it reads the base's data (``base_tree["data"]``);
    else over its own data, planned before Ray (``Plan.data_variants``), or here as
    ``raylora train`` plans it when a range of a data.* key drew its value."""
    data = trial.to_dict()["data"]
    if data == base_tree["data"]:
        return replan(trial, base_plan)
    own = base_plan.data_variants.get(data_key(data))
    if own is None:
        log.info("tune: planning the data this trial's values of data.* keys give")
        own = plan(trial)
    return replan(trial, base_plan, data=own)


def samples_note(tn: TuneSection) -> str | None:
    """What the driver says when the default num_samples gave way to the number of
    distinct trials (TuneSection.samples), else None."""
    draws, drawn = tn.draws, [k for k, d in tn.search_space.items() if not tn.listed(d)]
    if tn.num_samples is not None or not drawn or draws is None or draws >= DEFAULT_SAMPLES \
            or not tn.repeats_identical:
        return None
    how = ("each runs once" if tn.every_combination
           else f"num_samples {tn.samples} instead of {DEFAULT_SAMPLES}")
    return (f"{', '.join(drawn)} take {draws} distinct combination(s) and train.seed is not "
            f"searched: {how} (more draws would repeat trials)")


def preflight(cfg: RayLoraConfig) -> Plan:
    """Base plan (model, data, held-out rows), the plan of each data section a search of
    data.* keys gives (``plan_data_variants``), and the step arithmetic of every bounding
    value of the dims that change it over each of those data, so a trial never fails on a
    batch size that is larger than its data; and every adapter a search of
    ``lora.init_from`` starts from, checked as the base's is
    (``raylora.model.lora_init.checked``)."""
    from raylora.config import ConfigError
    from raylora.model import lora_init

    base = plan(cfg)
    datas, problems = plan_data_variants(cfg, base)
    tree = cfg.to_dict()
    for key, dim in cfg.tune.search_space.items():
        if key not in ARITHMETIC_KEYS and key != lora_init.KEY:
            continue
        for value in dim.values:
            if key == lora_init.KEY:
                try:
                    trial = validate(trial_tree(tree, {key: value}))
                    found, loads = lora_init.checked(trial, trial.storage.client())
                    problems.extend(f"tune.search_space.{key}={value!r}: {p}" for p in found)
                    base.pins |= pin(trial.lora.init_from, loads)
                except ConfigError as exc:
                    problems.extend(f"tune.search_space.{key}={value!r}: {p}" for p in exc.problems)
                continue
            for data in [{}, *datas]:  # against the base's data and each searched one
                params = {**data, key: value}
                try:
                    trial_plan(validate(trial_tree(tree, params)), tree, base)
                except ConfigError as exc:
                    problems.extend(f"{_label(params)}: {p}" for p in exc.problems)
    problems += family_problems_of_trials(cfg, base)
    tn = cfg.tune
    if not problems and tn.scheduler == "asha" and tn.max_t is not None:
        longest = longest_budget(cfg, base)
        if tn.max_t < longest:
            # ASHA stops a trial that reaches max_t: every trial would end there, its
            # schedule unfinished and its final checkpoint unwritten, and none complete.
            problems.append(f"tune.max_t: {tn.max_t} is below the step budget of the longest "
                            f"trial ({longest}): ASHA would stop trials at step {tn.max_t}, "
                            "before their schedules end and without their final checkpoints; "
                            "leave tune.max_t unset (the longest budget) or lower train.max_steps")
    if problems:
        raise ConfigError(problems)
    return base


def family_problems_of_trials(cfg: RayLoraConfig, base: Plan) -> list[str]:
    """What the model family's checks (``launch.family_problems``: latent grid, objective,
    pipeline) refuse in a trial that one searched value gives, as `raylora train` refuses
    it in a config, named by that value. The base passed them (``plan``); so did the
    values of data.* keys, each planned whole (``plan_data_variants``), and
    ``lora.init_from``'s, checked as adapters. Before this, a searched
    ``validation.resolution`` off the grid was first refused by a trial's workers."""
    from raylora.config import ConfigError
    from raylora.launch import family_problems
    from raylora.model import families, lora_init

    family, tree, out = families.get(base.family), cfg.to_dict(), []
    for key, dim in cfg.tune.search_space.items():
        if key.startswith("data.") or key == lora_init.KEY:
            continue
        for value in dim.values:
            try:
                trial = validate(trial_tree(tree, {key: value}))
            except ConfigError:  # config.py refused the value alone already
                continue
            out += [f"{_label({key: value})}: {p}" for p in
                    family_problems(trial, family, base.latent_grid, base.native_objective)]
    return out


def step_budget(base_tree: dict, params: dict, base_plan: Plan) -> int:
    """The optimizer steps of the trial that samples ``params`` (its ``train.max_steps``, or
    its epochs at its batch size over its data): the base plan's unless it searches the
    step arithmetic or the data (``trial_plan``)."""
    if not any(k in ARITHMETIC_KEYS or k.startswith("data.") for k in params):
        return base_plan.max_steps
    trial = validate(trial_tree(base_tree, params))
    if trial.train.max_steps:  # its length, whatever its data
        return trial.train.max_steps
    return trial_plan(trial, base_tree, base_plan).max_steps


def longest_budget(cfg: RayLoraConfig, base_plan: Plan) -> int:
    """The most steps any trial runs: ASHA's default ``max_t``, so that no trial is cut
    before its own end. Over every combination of the step arithmetic's bounding values
    (the longest trial is the most epochs at the smallest batch, not either alone), on the
    base's data and each data section planned for the search (``data_params``)."""
    import itertools

    tree = cfg.to_dict()
    dims = {k: d.values for k, d in cfg.tune.search_space.items() if k in ARITHMETIC_KEYS}
    return max([base_plan.max_steps, *(
        step_budget(tree, {**data, **dict(zip(dims, combo))}, base_plan)
        for data in [{}, *data_params(cfg.tune)] for combo in itertools.product(*dims.values()))])


# Search keys whose larger values never need less memory: the trial that samples the
# largest of each is the search's largest, and is sized as one (each alone, batch 8 and
# 128 px fitted where the trial of both did not).
MEMORY_GROWS = ("train.batch_size", "data.resolution", "lora.rank", "model.max_sequence_length",
                "train.gradient_accumulation_steps", "lora.dropout")
# The most combinations of the other searched keys that change the estimate sized together
# (each is a meta-device step: tens of seconds for a 12B model); beyond, each value alone
# beside the growing keys' largest.
MAX_COMBINATIONS = 8


def trial_variants(cfg: RayLoraConfig) -> list[tuple[str, RayLoraConfig]]:
    """What the memory preflight checks besides the base: each bounding value of each
    search dimension (every option, both ends of a range) applied alone to the base config,
    labelled by it; and, where two or more dimensions change the estimate, the trials that
    combine them: the largest values of ``MEMORY_GROWS`` keys with every combination of the
    other such dimensions' values (up to ``MAX_COMBINATIONS``, else each value alone).
    Dimensions that do not change the estimate (the learning rate) cost nothing there."""
    import itertools

    from raylora import memory
    from raylora.config import ConfigError

    tree = cfg.to_dict()
    alone = [(key, value, validate(trial_tree(tree, {key: value})))
             for key, dim in cfg.tune.search_space.items() for value in dim.values]
    out = [(f"tune.search_space.{key}={value!r}", c) for key, value, c in alone]
    base = memory.config_args(cfg)
    sized = list(dict.fromkeys(key for key, _, c in alone if memory.config_args(c) != base))
    if len(sized) < 2:
        return out
    space = cfg.tune.search_space

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    largest = {k: max(space[k].values) for k in sized
               if k in MEMORY_GROWS and all(number(v) for v in space[k].values)}
    others = [k for k in sized if k not in largest]
    if math.prod(len(space[k].values) for k in others) <= MAX_COMBINATIONS:
        combos = [dict(zip(others, vs)) for vs in itertools.product(*(space[k].values for k in others))]
    else:
        combos = [{k: v} for k in others for v in space[k].values]
    for combo in combos:
        params = {**largest, **combo}
        if len(params) < 2:
            continue  # one value alone: sized above
        params = {k: params[k] for k in space if k in params}  # the search's order
        try:
            c = validate(trial_tree(tree, params))
        except ConfigError:
            continue  # a combination the config refuses: that trial fails on it, not on memory
        out.append(("tune.search_space: " + ", ".join(f"{k}={v!r}" for k, v in params.items()), c))
    return out


def _trial(params: dict, *, base_tree: dict, base_plan: Plan, trials_uri: str,
           progress_board: str | None = None, stop_requests: str | None = None) -> None:
    """One Tune trial (runs in Tune's trial actor): the sampled values applied to the base
    config, then a full TorchTrainer run reporting to Tune; its rank 0 sends its steps to
    the search's ``progress_board``, labelled with its name. A stop of the search
    (``stop_requests``) stops its run at a step, and the trial parks (raylora.tune_stop)."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raylora import tune_stop
    from raylora.checkpoint.recorded import check_latest, drop_unrecorded

    trial_id = tune.get_context().get_trial_id()
    if tune_stop.asked(stop_requests):  # Tune started it after the search was asked to stop
        tune_stop.park(stop_requests, trial_id, None)
    name = f"trial_{trial_id}"
    run_uri = storage.join(trials_uri, name)
    tree = trial_tree(base_tree, params)
    # What the run writes under output.uri besides its checkpoints (previews in
    # validation/, the tracker's files and run name) is this trial's own: the trials
    # overwrote each other's preview images and shared one TensorBoard run.
    tree["output"]["uri"] = run_uri
    # tracking.run_name set: every trial's wandb run had that one name. Unset, the name is
    # output.uri's last part, the trial's already.
    if tree["tracking"].get("run_name"):
        tree["tracking"]["run_name"] = f"{tree['tracking']['run_name']}/{name}"
    trial_cfg = validate(tree)
    p = trial_plan(trial_cfg, base_tree, base_plan)
    store = trial_cfg.storage.client()
    # Tune restores an errored trial to run again (resume_errored: a lost node), a
    # diverged one too: it loaded, resumed and diverged again at every rerun of the search.
    if (error := recorded_divergence(store, run_uri)) is not None:
        raise DivergedBefore(error)
    # A trial of a resumed search resumes its own run as ``raylora train`` does: folders an
    # interruption left unrecorded go, and the checkpoint it resumes from must be whole.
    drop_unrecorded(store, run_uri)
    check_latest(store, run_uri)
    trainer = build_trainer(trial_cfg, p, trials_uri, name, callbacks=[TuneReportCallback()],
                            progress_board=progress_board, progress_label=name,
                            stop_requests=stop_requests)
    try:
        result = trainer.fit()
    except Exception as exc:
        if diverged(exc):
            store.write_bytes(storage.join(run_uri, DIVERGED_FILE),
                              json.dumps({"error": str(exc)}, indent=1).encode())
        raise
    if stop_requests and (result.metrics or {}).get("stopped"):
        tune_stop.park(stop_requests, trial_id, int(result.metrics["step"]))


class DivergedBefore(RuntimeError):
    """A trial whose run already ended by divergence (NonFiniteLossError: its record
    ``DIVERGED_FILE``), restored by a rerun of its search: it ends again, untrained, with
    that error, so the search's table and best adapter are what they were."""

    def __init__(self, error: str):
        super().__init__(f"{error}\n(this trial diverged in an earlier run of the search; "
                         "not trained again)")


def diverged(error) -> bool:
    """The run ended itself on NaN/inf steps in a row (NonFiniteLossError, named in the
    error Ray Train or Tune wraps it in): training it again repeats it."""
    from raylora.train.loop import NonFiniteLossError

    return error is not None and NonFiniteLossError.__name__ in str(error)


def recorded_divergence(store, run_uri: str) -> str | None:
    """The error a trial's run at ``run_uri`` diverged with (``DIVERGED_FILE``), None when
    it did not."""
    record = storage.join(run_uri, DIVERGED_FILE)
    if not store.exists(record):
        return None
    return json.loads(store.read_bytes(record))["error"]


def run_tune(cfg: RayLoraConfig) -> dict:
    """Run the search; write the results table; export the best adapter. Returns a summary;
    a search stopped by SIGTERM (raylora.tune_stop) writes no results and says so."""
    import ray

    from raylora import tune_stop
    from raylora.launch import SIGTERM_HOOKS
    from raylora.stop import DRIVER_SIGTERM

    # One desk (raylora.desk) for the search: every trial's bad rows count in it, every
    # trial sends its rows to it, and one stop request reaches them all. One latent cache
    # for every trial, built (or found) before the first one starts.
    with prepared(cfg, search_setup()) as r:
        # The search is sized by the config as asked (trial_resources: concurrency, and
        # the config search.json keeps for a rerun), not by the cpus_per_worker that
        # check_cluster_fits may have lowered for one run on this cluster.
        cfg, base_plan = r.resolved, r.plan
        tn = cfg.tune
        out = storage.normalize(cfg.output.uri)
        n_trials = expected_trials(tn)
        concurrency = max_concurrency(cfg, ray.cluster_resources(), n_trials)
        log.info(
            "tune: %d trial(s), up to %d at a time (%s per trial), metric %s",
            n_trials, concurrency, trial_resources(cfg), tn.metric,
        )
        if (note := samples_note(tn)) is not None:
            log.info("tune: %s", note)
        # The trials' workers ask for what they can be placed with, beside each other.
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        trials = trial_config(cfg, trial_cpus_per_worker(cfg, nodes, concurrency))
        if trials.scaling.cpus_per_worker != r.cfg.scaling.cpus_per_worker:
            log.warning("tune: scaling.cpus_per_worker: %g → %g in each trial: %d trials at a "
                        "time, each with its share of the cluster's %g CPUs and room for Ray "
                        "Data; give the cluster more CPUs or set tune.max_concurrent_trials "
                        "lower to keep the request", cfg.scaling.cpus_per_worker,
                        trials.scaling.cpus_per_worker, concurrency,
                        sum(n.get("CPU", 0) for n in nodes))
        if not r.resume:
            cfg.storage.client().write_bytes(storage.join(out, TUNE_DIR, SEARCH_FILE),
                                             json.dumps({"config": cfg.to_dict()}, indent=1).encode())
        # A line per trial every train.log_every_n_steps steps or log_every_n_seconds
        # (Tune's own table shows only what trials report, at evaluations).
        t = cfg.train
        # Each trial's latest line is also kept for `raylora status` (progress.json).
        sink = progress.write_search_progress(cfg.storage.client(), out)
        # The search's desk (raylora.desk: started by `prepared`) holds the trials' rows
        # and the stop request, as for one run.
        desk = base_plan.bad_records
        with (progress.watch(desk, base_plan.max_steps, t.log_every_n_steps, t.log_every_n_seconds,
                             sink=sink, labelled=True),
              tune_stop.search_requests(desk, cfg.failure.stop_timeout_s, SIGTERM_HOOKS) as stops):
            with _credentials_kept_from_trial_env_vars():
                grid = _tuner(cfg, base_plan, out, concurrency, resume=r.resume, board=desk,
                              stop_requests=stops.stop.name, trials=trials).fit()
        tree = cfg.to_dict()
        budget = lambda params: step_budget(tree, params, base_plan)  # noqa: E731
        if stops.stopped:
            return {"stopped": DRIVER_SIGTERM, "expired": stops.stop.expired,
                    "timeout_s": cfg.failure.stop_timeout_s, "parked": stops.parked,
                    "max_steps": parked_budgets(grid, stops.parked, tn, budget),
                    "search": storage.join(out, TUNE_DIR)}
        if stops.interrupted:
            # Ctrl-C, through Tune's own handler: its results are not the search's (nor is
            # an adapter of them the best, and a checkpoint in flight may be half there).
            # Interrupted, exit 130, as a run; the same command resumes the search. (Before
            # the line below: a Ctrl-C after a SIGTERM is no search that finished normally.)
            raise KeyboardInterrupt("search interrupted")
        if stops.stop.signalled:
            log.warning("SIGTERM came after the last trial's last step had started: the search "
                        "finished normally, no stop was needed")
        # Raises when too much of what was read was bad; the counts are the whole search's.
        bad = check_bad_records(cfg, base_plan)
        rows = results_table(grid, tn, budget)
        summary = write_results(rows, cfg, cfg.storage.client(), out)
        best = pick_best(rows)
        if best is not None:
            summary["best"] = best
            summary["best_adapter"] = export_best(best, grid, trials, base_plan, out, bad)
        return summary


@contextlib.contextmanager
def _credentials_kept_from_trial_env_vars():
    """Tune copies the driver's AWS keys into every trial actor's runtime_env ``env_vars``
    (``ray.tune.execution.class_cache.ENV_VARS_TO_PROPAGATE``), which the runtime-env agent
    writes to its log on every node: the keys raylora keeps out of env_vars
    (``launch.job_runtime_env``) were there in plain text, once per trial. For the search
    the credentials leave that list; the trials get them as every worker of the job does,
    from its ``worker_process_setup_hook``."""
    from ray.tune.execution import class_cache

    # (AWS_SECURITY_TOKEN too: Tune's list has the session token's legacy name)
    kept = {v for v in class_cache.ENV_VARS_TO_PROPAGATE
            if v.startswith("AWS_") or v in storage.SECRET_ENV_VARS}
    class_cache.ENV_VARS_TO_PROPAGATE -= kept  # (a set: every reader sees the change)
    try:
        yield
    finally:
        class_cache.ENV_VARS_TO_PROPAGATE |= kept


def search_setup() -> Setup:
    """`raylora tune`'s preamble (launch.prepared; `raylora submit` checks with it too): an
    embedded Ray sized for one trial, the plan of every bounding batch (``preflight``),
    the memory preflight of every bounding value, and a search already under output.uri
    resumed (``search_to_resume``: Prepared.resume)."""
    return Setup(need_cpus=lambda c: trial_resources(c)["CPU"], make_plan=preflight,
                 variants=trial_variants, resume=search_to_resume)


def search_to_resume(cfg: RayLoraConfig, _plan=None) -> bool:
    """True when ``{output.uri}/tune`` holds a search Tune can restore (an interrupted one,
    or a finished one, which then trains nothing and is reported again). Raises ConfigError
    when that search was started with another config (``SEARCH_FILE``): Tune restores its
    own search space, scheduler and sampler, so a changed value would be ignored for some
    trials and used by others; only ``storage`` and ``failure`` may change."""
    from ray import tune

    from raylora.config import ConfigError

    store = cfg.storage.client()
    where = storage.join(cfg.output.uri, TUNE_DIR)
    fs, path = store.fs(where)
    if not tune.Tuner.can_restore(path, storage_filesystem=fs):
        return False
    record = storage.join(where, SEARCH_FILE)
    if store.exists(record):  # absent: a search started before raylora recorded its config
        started = _as_read_now(json.loads(store.read_bytes(record))["config"])
        changed = [f"{key}: {old!r} then, {new!r} now"
                   for key, old, new in differences(started, _as_read_now(cfg.to_dict()))
                   if key.split(".")[0] not in RESUME_MAY_CHANGE]
        if changed:
            raise ConfigError([f"output.uri: {where} holds a search started with another config; "
                               "run it with that config to resume it, or use a new output.uri. "
                               f"Changed: {'; '.join(changed)}"])
    log.info("tune: resuming the search in %s: finished trials stay as they ended, the others "
             "continue from their latest checkpoints", where)
    return True


def _as_read_now(tree: dict) -> dict:
    """A recorded config as this raylora reads it: the keys added since an older raylora
    recorded it get their defaults, so only values set differently count as changes (a
    key the user adds, to tune.search_space say, still does), and ``tune.num_samples``
    is the number in effect (an older raylora wrote its default 8). A record this version
    cannot read is compared as it is."""
    from pydantic import ValidationError

    from raylora.config import RayLoraConfig

    try:
        read = RayLoraConfig.model_validate(tree)
    except ValidationError:
        return tree
    now = read.to_dict()
    if read.tune is not None:
        tn = read.tune
        if tn.num_samples == DEFAULT_SAMPLES and tn.sampled and tn.repeats_identical \
                and tn.draws is not None and tn.draws < DEFAULT_SAMPLES:
            # An older raylora's default: it drew 8 trials of fewer combinations, where
            # this one runs each once (TuneSection.every_combination).
            tn = tn.model_copy(update={"num_samples": None})
        now["tune"]["num_samples"] = tn.samples
    return now


def _scheduler(tn: TuneSection, max_steps: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if tn.scheduler != "asha":
        return FIFOScheduler()
    max_t = tn.max_t or max_steps
    return ASHAScheduler(time_attr="step", max_t=max_t, grace_period=min(tn.grace_period, max_t),
                         reduction_factor=tn.reduction_factor)


def _tuner(cfg: RayLoraConfig, base_plan: Plan, out: str, concurrency: int, resume: bool = False,
           board: str | None = None, stop_requests: str | None = None,
           trials: RayLoraConfig | None = None):
    """The search: ``_trial`` per sampled config, experiment state under ``out/tune``;
    ``resume``: the interrupted search there, continued; ``board``: the search's desk
    (raylora.desk) the trials send their steps to; ``stop_requests``: the same desk, for
    the driver's stop request (raylora.tune_stop); ``trials``: the config the trials start
    from (``trial_config``; default ``cfg``)."""
    from ray import tune

    from raylora.tune_stop import EndWhenParked, TrialEnds

    tn = cfg.tune
    seed = tn.seed if tn.seed is not None else cfg.train.seed
    fs, path = cfg.storage.client().fs(out)
    trials_uri = storage.join(out, TUNE_DIR, TRIALS_DIR)
    # Large inputs (held-out images) travel once through the object store.
    trainable = tune.with_resources(
        tune.with_parameters(_trial, base_tree=(trials or cfg).to_dict(), base_plan=base_plan,
                             trials_uri=trials_uri, progress_board=board,
                             stop_requests=stop_requests),
        # Tune refuses an empty request; a sliver of a CPU places the trial's driver
        # anywhere without taking a core from training or data.
        {"CPU": TRIAL_DRIVER_CPU},
    )
    if resume:
        # Finished and early-stopped trials stay as they ended; unfinished and errored ones
        # run again, and each one's TorchTrainer resumes from its own latest checkpoint
        # (its run name is its trial id, which Tune keeps); a diverged one ends at once
        # (``DivergedBefore``). Scheduler and search state are Tune's own, restored with
        # the experiment.
        return tune.Tuner.restore(f"{path}/{TUNE_DIR}", trainable, resume_unfinished=True,
                                  resume_errored=True, storage_filesystem=fs)
    return tune.Tuner(
        trainable,
        param_space=param_space(tn),
        tune_config=tune.TuneConfig(
            metric=tn.metric,
            mode="min",
            num_samples=tn.samples,
            scheduler=_scheduler(tn, longest_budget(cfg, base_plan)),
            search_alg=search_algorithm(tn, seed, concurrency),
            # The built-in generator limits itself (given above); Tune wraps the
            # others in a ConcurrencyLimiter.
            max_concurrent_trials=None if tn.search_alg in ("random", "grid") else concurrency,
        ),
        # A resumed search gets its callbacks back from the saved state, not from here.
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=path, storage_filesystem=fs,
                                  verbose=1, callbacks=[EndWhenParked(), TrialEnds()]),
    )


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def results_table(grid, tn: TuneSection, budget: Callable[[dict], int]) -> list[dict]:
    """One row per trial, in trial order. ``budget(params)``: the steps of the trial that
    sampled ``params`` (``step_budget``): a trial that searched ``train.max_steps`` is
    complete at its own."""
    metric = tn.metric
    rows = []
    for result in grid:
        m = result.metrics or {}
        max_steps = budget({k: result.config[k] for k in tn.search_space if k in result.config})
        df = result.metrics_dataframe
        history = df.to_dict("records") if df is not None else []
        values = [_finite(r.get(metric)) for r in history]
        values = [v for v in values if v is not None]
        ckpts = [r.get("checkpoint_path") for r in history if isinstance(r.get("checkpoint_path"), str)]
        steps = int(m.get("step") or 0)
        last = m.get(metric)
        nonfinite_abort = diverged(result.error)
        if nonfinite_abort:
            status = "diverged"  # the trial stopped itself: NaN/inf steps in a row
        elif result.error is not None:
            status = "error"
        elif last is not None and _finite(last) is None:
            status = "diverged" if steps >= max_steps else "stopped_early"
        elif steps < max_steps:
            status = "stopped_early"
        else:
            status = "completed"
        row = {"trial_id": m.get("trial_id") or os.path.basename(result.path)}
        row.update({k: result.config.get(k) for k in tn.search_space})
        row.update({
            f"final_{metric}": _finite(last),
            f"best_{metric}": min(values) if values else None,
            "steps": steps,
            "status": status,
            "stopped_early": status == "stopped_early",
            # The last reported metric was NaN/inf: the run blew up (table shows no final).
            "diverged": nonfinite_abort or (last is not None and _finite(last) is None),
            "checkpoint_path": ckpts[-1] if ckpts else None,
            # A resumed search: the step this trial's run last resumed from (None: it ran
            # from step 0 in one go).
            "resumed_from_step": m.get("resumed_from_step"),
            "error": None if result.error is None else str(result.error).splitlines()[0][:300],
        })
        rows.append(row)
    return rows


def parked_budgets(grid, parked: dict[str, int | None], tn: TuneSection,
                   budget: Callable[[dict], int]) -> dict[str, int]:
    """Each trial of a stopped search that stopped at a step (``parked``: trial id → step,
    None where it never trained) → its own step budget (``budget(params)``: ``step_budget``),
    for "stopped at step 6/40"; a search of train.max_steps said /200, the base's, for every
    trial. A trial whose values Tune has not recorded is left out (its line says no total)."""
    from raylora.config import ConfigError

    out = {}
    for result in grid:
        trial_id, config = (result.metrics or {}).get("trial_id"), result.config
        if parked.get(trial_id) is not None and config is not None:
            try:
                out[trial_id] = budget({k: config[k] for k in tn.search_space if k in config})
            except ConfigError:  # its data no longer plans: the stop is still said
                pass
    return out


def pick_best(rows: list[dict]) -> dict | None:
    """Lowest final metric among trials that ran their full budget (a stopped trial's
    metric is from fewer steps, not comparable); any trial with a checkpoint otherwise."""
    key = next(k for k in rows[0] if k.startswith("final_")) if rows else None
    for pool in (
        [r for r in rows if r["status"] == "completed"],
        [r for r in rows if r["checkpoint_path"]],
    ):
        pool = [r for r in pool if r[key] is not None and r["checkpoint_path"]]
        if pool:
            return min(pool, key=lambda r: r[key])
    return None


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no trials)"
    cols = [c for c in rows[0] if c not in ("checkpoint_path", "error", "stopped_early", "diverged")]

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    table = [cols] + [[cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in table)


def write_results(rows: list[dict], cfg: RayLoraConfig, store, out: str) -> dict:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    csv_uri = storage.join(out, TUNE_DIR, "results.csv")
    json_uri = storage.join(out, TUNE_DIR, "results.json")
    store.write_bytes(csv_uri, buf.getvalue().encode())
    doc = {"metric": cfg.tune.metric, "mode": "min", "search": cfg.tune.model_dump(mode="json"), "trials": rows}
    store.write_bytes(json_uri, json.dumps(doc, indent=2).encode())
    return {"rows": rows, "results_csv": csv_uri, "results_json": json_uri, "table": format_table(rows)}


def checkpoint_metrics(result, checkpoint_path: str) -> dict:
    """The metrics of ``result``'s report that carried ``checkpoint_path``, not of its last
    report: a trial stopped early reported steps after its latest checkpoint, so the card
    and raylora.json of that checkpoint's adapter named another step and no losses. The
    trial's last metrics when no report names it."""
    last = result.metrics or {}
    if last.get("checkpoint_path") == checkpoint_path:  # as reported, not through the frame
        return result.metrics
    df = result.metrics_dataframe
    history = df.to_dict("records") if df is not None else []
    at = next((r for r in reversed(history) if r.get("checkpoint_path") == checkpoint_path), None)
    if at is None:
        return result.metrics
    # a column another report had and this one lacks is NaN in the frame
    return {k: as_reported(v, last.get(k)) for k, v in at.items()
            if not (isinstance(v, float) and math.isnan(v))}


def as_reported(value, like):
    """A value of Tune's metrics frame, typed as the trial reported it: a column with gaps
    (a key some reports lack) is float in pandas, so ``step`` and ``images_seen`` came back
    as 4.0 and the exported raylora.json and card said "4.0 steps". ``like``: the same
    key's value in the trial's last report (reported as is), None when it has none."""
    if isinstance(value, float) and isinstance(like, int) and not isinstance(like, bool) \
            and value.is_integer():
        return int(value)
    return value


def export_best(best: dict, grid, cfg: RayLoraConfig, base_plan: Plan, out: str,
                bad: dict | None = None) -> str:
    """The best trial's last checkpoint → ``{output.uri}/best/`` (adapter, card, metrics).
    ``cfg``: the config the trials started from (``trial_config``: the cpus_per_worker
    they trained with, as ``raylora train`` records its own). ``bad``: the search's
    bad-record counts (every trial's reads) for ``raylora.json``."""
    import ray.train

    from raylora.checkpoint.export import export_run

    result = next(r for r in grid if (r.metrics or {}).get("trial_id") == best["trial_id"])
    params = {k: result.config[k] for k in cfg.tune.search_space}
    metrics = checkpoint_metrics(result, best["checkpoint_path"])
    tree = trial_tree(cfg.to_dict(), params)
    tree["output"]["uri"] = storage.join(out, BEST_DIR)
    trial_cfg = validate(tree)
    fs, _ = cfg.storage.client().fs(out)
    ckpt = ray.train.Checkpoint(best["checkpoint_path"], filesystem=fs)
    extra = {"tune": {"trial_id": best["trial_id"], "params": params, "metric": cfg.tune.metric}}
    with ckpt.as_directory() as d:
        summary = export_run(d, trial_cfg, metrics, {
            **trial_plan(trial_cfg, cfg.to_dict(), base_plan).to_dict(), **(bad or {})}, extra)
    return summary["adapter"]
