"""``raylora train|tune|plan|lr-find|validate|sample|export|shards|tiny-model|demo-data``;
``raylora submit|status|logs|stop|list`` (a job on a Ray cluster)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _train(args) -> int:
    from raylora.config import ConfigError, load_config
    from raylora.launch import run
    from raylora.progress import summary_lines

    cfg = load_config(args.config, args.overrides)
    if cfg.tune is not None:  # one run of a search's base config is rarely what was meant
        raise ConfigError(["tune: this config is a search; run it with `raylora tune`, or add "
                           "the override tune=null to train its base config once"], args.config)
    summary = run(cfg)
    if "stopped" in summary:  # raylora.stop: a checkpoint at this step, no adapter yet
        print(f"raylora: stopped at step {summary['step']}/{summary['max_steps']} "
              f"({summary['stopped']}); checkpoint {summary['checkpoint']}", file=sys.stderr)
        print("raylora: run the same command again to resume from it", file=sys.stderr)
        return 130
    print("\n".join(summary_lines(summary)))
    return 0


def _tune(args) -> int:
    from raylora.config import ConfigError, load_config
    from raylora.tune import run_tune

    cfg = load_config(args.config, args.overrides)
    if cfg.tune is None:
        raise ConfigError(["tune: section missing (search_space, num_samples, ...)"], args.config)
    summary = run_tune(cfg)
    if "stopped" in summary:  # raylora.tune_stop: the search's state is saved, no results yet
        _say_search_stopped(summary)
        return 130
    print(summary["table"])
    print(f"raylora: results      {summary['results_csv']}")
    print(f"raylora:              {summary['results_json']}")
    if "best_adapter" in summary:
        b = summary["best"]
        metric = next(k for k in b if k.startswith("final_"))
        print(f"raylora: best trial   {b['trial_id']} ({metric} {b[metric]:.5f})")
        print(f"raylora: best adapter {summary['best_adapter']}")
        return 0
    print("raylora: no trial produced a checkpoint to export", file=sys.stderr)
    return 1


def _say_search_stopped(summary: dict) -> None:
    from raylora.tune_stop import describe

    how = (f"interrupted {summary['timeout_s']:g} s after {summary['stopped']} "
           "(failure.stop_timeout_s)" if summary["expired"] else f"stopped ({summary['stopped']})")
    print(f"raylora: search {how}; its state is in {summary['search']}", file=sys.stderr)
    for trial_id, step in sorted(summary["parked"].items()):
        # each trial's own budget (a search of train.max_steps or of the data changes it)
        print(f"raylora:   {describe(trial_id, step, summary['max_steps'].get(trial_id))}",
              file=sys.stderr)
    if summary["expired"]:
        print("raylora:   any other trial that was running resumes from its latest periodic "
              "checkpoint", file=sys.stderr)
    print("raylora: run the same command again to resume the search", file=sys.stderr)


def _lr_find(args) -> int:
    from raylora.config import load_config
    from raylora.launch import run_lr_find

    cfg = load_config(args.config, args.overrides)
    s = run_lr_find(cfg, args.start_lr, args.end_lr, args.steps)
    note = " (clamped to the lowest lr tried)" if s["clamped"] else ""
    print(f"raylora: lr-find ran {s['steps_run']} steps"
          + (f", stopped: {s['stopped']}" if s["stopped"] else ""))
    print(f"raylora: min smoothed loss {s['min_smoothed_loss']:.5f} at lr {s['lr_at_min_loss']:.3g}")
    print(f"raylora: suggested lr {s['suggested_lr']:.3g}{note}")
    if s["scale_lr_divisor"] != 1:
        print(f"raylora: train.scale_lr is on and lr-find swept the unscaled lr: set "
              f"train.learning_rate {s['learning_rate']:.3g} (the suggestion / batch_size × "
              f"gradient_accumulation_steps = {s['scale_lr_divisor']}); a run then trains at "
              f"workers × {s['suggested_lr']:.3g}")
    print(f"raylora: lr-find table {s['csv']}")
    print(f"raylora: lr-find plot  {s['png']}")
    return 0


def _plan(args) -> int:
    """The memory plan without running anything (no Ray, no weights read): exit 0 when the
    run fits its GPU or no GPU size is known, ``EXIT_DOES_NOT_FIT`` when it does not."""
    from raylora import memory, preflight
    from raylora.config import load_config
    from raylora.launch import resolve_paths
    from raylora.model.load import check_model

    cfg = resolve_paths(load_config(args.config, args.overrides))
    # a missing folder, a gated or unreachable hub repo: one line (the estimate reads it
    # too, a hub repo at the commit read here). Not its weights: the plan reads configs
    # only, and a folder of a big model's configs is how it is sized anywhere (README);
    # `raylora train` checks them.
    info = check_model(cfg.model.pretrained, cfg.storage.client(), cfg.model.revision,
                       cfg.model.variant, weights=False)
    cfg = cfg.at_commit(info["commit"])
    # what `raylora train` refuses before Ray starts (README) of what plan reads: the
    # settings this model's family does not take, and lora.init_from
    from raylora.config import ConfigError
    from raylora.launch import family_problems
    from raylora.model.load import resolve_family
    from raylora.train.objective import scheduler_objective_kind

    family = resolve_family(cfg.model, info["index"])
    problems = family_problems(cfg, family, info["vae_factor"] * family.patch,
                               scheduler_objective_kind(info["scheduler_config"]),
                               info["scheduler_config"])
    if family.experts:  # a Wan 2.2 A14B folder needs model.expert, a one-transformer one refuses it
        try:
            family.sigma_range(info["index"], cfg.model.expert, f"model.pretrained: {cfg.model.pretrained}")
        except ValueError as exc:
            problems.append(str(exc) if str(exc).startswith("model.") else f"model.pretrained: {exc}")
    if cfg.lora.init_from:
        from raylora.model import lora_init

        problems += lora_init.checked(cfg, cfg.storage.client())[0]
    if problems:
        raise ConfigError(problems, args.config)
    # with RAY_ADDRESS, this machine's GPU is not the workers', and Ray is not joined here
    gpu = (preflight.GpuSize(None, "RAY_ADDRESS is set: the workers' GPUs are the cluster's")
           if preflight.on_cluster(cfg) else preflight.gpu_size(cfg))
    text, fits, _ = preflight.report(memory.from_config(cfg), gpu, cfg)
    print(text)
    if cfg.tune is not None:  # a search: each bounding value too, as `raylora tune` checks them
        from raylora.memory import size
        from raylora.tune import trial_variants

        variants = preflight.distinct_settings([("", cfg), *trial_variants(cfg)])[1:]
        print(f"search: {len(variants)} trial setting(s) with another estimate")
        for label, c in variants:
            est = memory.from_config(c)
            # (advice sets no key of the search: a trial would override it)
            vtext, vfits, _ = preflight.report(est, gpu, c, cfg.tune.search_space)
            said = {True: "fits", False: "does NOT fit", None: "not checked"}[vfits]
            print(f"  {label}: {size(est.peak)} per GPU, {said}")
            if vfits is False:
                print("\n".join(f"    {line}" for line in vtext.splitlines()))
                fits = False
    return preflight.EXIT_DOES_NOT_FIT if fits is False else 0


def _validate(args) -> int:
    from raylora.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _sample(args) -> int:
    from raylora.sample import sample

    out = sample(
        args.model, args.adapter, args.prompt, args.out,
        seed=args.seed, steps=args.steps, guidance_scale=args.guidance_scale, size=args.size,
        expert=args.expert, quantize_text_encoders=args.quantize_text_encoders,
        revision=args.revision, image=args.image, system_prompt=args.system_prompt,
        variant=args.variant,
    )
    print(f"raylora: sample image {out}")
    return 0


def _export(args) -> int:
    from raylora.checkpoint.kohya import export_folder

    if args.format == "diffusers":
        from raylora.checkpoint.export import rewrite_diffusers_folder

        dest, rewritten = rewrite_diffusers_folder(args.adapter, args.out)
        print(f"raylora: adapter      {dest} ("
              + ("rewritten as raylora writes it now: " + "; ".join(rewritten) if rewritten
                 else "already as raylora writes it; copied") + ")")
        return 0
    dest, family, how = export_folder(args.adapter, args.out, args.family)
    print(f"raylora: family       {family.name} ({how})")
    print(f"raylora: kohya file   {dest}")
    return 0


def _tiny_model(args) -> int:
    from raylora.model.tiny import build_tiny

    if os.path.isdir(args.dest) and os.listdir(args.dest):
        # Random weights over a model (or another family's components beside its own)
        raise ValueError(f"{args.dest}: not empty; tiny-model writes a new folder (remove it "
                         "or choose another)")
    dest = build_tiny(args.dest, family=args.family, seed=args.seed, schnell=args.schnell,
                      experts=args.experts)
    print(f"raylora: tiny model   {dest}")
    return 0


def _demo_data(args) -> int:
    from raylora.data.demo import write_parquet_shards

    paths = write_parquet_shards(args.dest, n=args.num, num_shards=args.shards, size=args.size)
    print(f"raylora: demo data    {args.dest} ({args.num} images in {len(paths)} shards)")
    return 0


def _shards_build(args) -> int:
    import ray

    from raylora.data.shards import build_shards, checked_items
    from raylora.launch import init_ray
    from raylora.storage import Storage

    store = Storage(args.endpoint_url, args.region)
    bound = {} if args.max_bad_fraction is None else {"max_bad_fraction": args.max_bad_fraction}
    items = checked_items(args.src, args.dest, args.format, args.shard_size, store, **bound)
    started = init_ray()
    try:
        m = build_shards(args.src, args.dest, args.format, args.shard_size, store, items)
    finally:
        if started:
            ray.shutdown()
    print(f"raylora: {m['count']} samples in {len(m['shards'])} {m['format']} shards "
          f"({m['bytes']} bytes) → {args.dest}")
    return 0


def _sdk_errors(fn):
    """A job command whose cluster request failed: one line, not the SDK's traceback
    (RuntimeError "Request failed with status code N: ..."); exit 2 for a job id the
    cluster does not know, 1 for anything else it answered (``jobs.sdk_problem``)."""

    def run(args) -> int:
        from raylora import jobs

        try:
            return fn(args)
        except RuntimeError as exc:
            problem = jobs.sdk_problem(exc, getattr(args, "job", None))
            if problem is None:
                raise
            print(f"raylora: error: {problem[0]}", file=sys.stderr)
            return problem[1]

    return run


def _submit(args) -> int:
    from raylora import jobs

    job = jobs.submit(args.config, args.overrides, args.address, args.working_dir, args.job_id,
                      args.runtime_env)
    print(job)
    return 0


def _status(args) -> int:
    from raylora import jobs

    state, line = jobs.status(args.job, args.address)
    print(f"raylora: job {args.job} {state}")
    print(f"raylora: {line}" if line else "raylora: no step yet")
    return 0


def _logs(args) -> int:
    from raylora import jobs

    if args.follow:
        state = jobs.follow_logs(args.job, args.address, sys.stdout)
        if state == "SUCCEEDED":
            return 0
        # a script's `raylora logs -f JOB && next` must not go on after a failed run
        print(f"raylora: job {args.job} {state}", file=sys.stderr)
        return 1
    sys.stdout.write(jobs.client(args.address).get_job_logs(args.job))
    return 0


def _stop(args) -> int:
    from raylora import jobs

    state = jobs.stop(args.job, args.address, args.timeout)
    _, line = jobs.status(args.job, args.address)
    print(jobs.stopped_line(args.job, state, line))
    return 0 if state in jobs.TERMINAL else 1


def _list(args) -> int:
    from raylora import jobs

    for r in jobs.list_jobs(args.address):
        print(f"{r['job']}  {r['state']:<9}  {r['command']:<5}  {r['config']}")
    return 0


def _job_commands(sub) -> None:
    """submit | status | logs | stop | list: runs on a Ray cluster (raylora.jobs)."""
    sm = sub.add_parser("submit", help="validate a config here, then run it on a Ray cluster "
                        "as a job (prints the job id)")
    sm.add_argument("config", help="job YAML, inside the working dir (in a folder it ships)")
    sm.add_argument("overrides", nargs="*", default=[], help="dotted overrides")
    sm.add_argument("--working-dir", default=".", help="shipped to the cluster (default: .)")
    sm.add_argument("--job-id", default=None, help="submission id, one not used on the cluster "
                    "yet (default: Ray's)")
    sm.add_argument("--runtime-env", default=None, metavar="FILE",
                    help="runtime_env YAML whose fields (pip, uv, conda, env_vars, py_modules, "
                         "excludes, ...) are added to the job's, as `ray job submit "
                         "--runtime-env`: jobs/runtime_env.yaml installs raylora's "
                         "dependencies on a cluster whose image lacks them")
    sm.set_defaults(fn=_sdk_errors(_submit))
    st = sub.add_parser("status", help="a job's state and its run's last progress line")
    st.add_argument("job")
    st.set_defaults(fn=_sdk_errors(_status))
    lg = sub.add_parser("logs", help="a job's log")
    lg.add_argument("job")
    lg.add_argument("--follow", "-f", action="store_true", help="follow until the job ends; "
                    "exit 0 if it SUCCEEDED, 1 if it ended FAILED or STOPPED")
    lg.set_defaults(fn=_sdk_errors(_logs))
    sp = sub.add_parser("stop", help="stop a job cleanly: a checkpoint at the next step (a "
                        "search: of each running trial); submitting the same config again "
                        "(a new --job-id, or none) resumes from it")
    sp.add_argument("job")
    sp.add_argument("--timeout", type=float, default=600, help="seconds to wait for the end")
    sp.set_defaults(fn=_sdk_errors(_stop))
    ls = sub.add_parser("list", help="raylora's jobs on the cluster")
    ls.set_defaults(fn=_sdk_errors(_list))
    for cmd in (sm, st, lg, sp, ls):
        cmd.add_argument("--address", default=None,
                         help="the cluster's dashboard (http://host:8265) or GCS address; "
                              "default RAY_ADDRESS")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raylora", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    _run_commands(sub)
    _adapter_commands(sub)
    shsub = _data_commands(sub)
    _job_commands(sub)
    # On each command, not the top parser: an option given after the command (where
    # people put it) would be reset by the subcommand's default.
    for cmd in [*sub.choices.values(), *shsub.choices.values()]:
        cmd.add_argument("--verbose", "-v", action="store_true",
                         help="show Ray's and the model libraries' routine logs "
                              "(same as RAYLORA_VERBOSE=1)")
        # main() blames a stray argument with the command's usage, not the top one's
        cmd.set_defaults(usage_of=cmd)
    return p


def _run_commands(sub) -> None:
    """train, tune, plan, lr-find: what reads a job YAML and runs (or sizes) it."""
    t = sub.add_parser("train", help="fine-tune a LoRA adapter with Ray Train")
    t.add_argument("config", help="job YAML")
    t.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. train.learning_rate=2e-4")
    t.set_defaults(fn=_train, on_rerun="; run the same command again to resume from the "
                   "latest checkpoint")

    tu = sub.add_parser("tune", help="search hyperparameters with Ray Tune (a `tune:` section)")
    tu.add_argument("config", help="job YAML with a tune: section")
    tu.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. tune.num_samples=16")
    tu.set_defaults(fn=_tune, on_rerun="; run the same command again to resume the search "
                    "(each unfinished trial from its latest checkpoint)")

    pl = sub.add_parser("plan", help="estimate per-GPU memory and check it fits (runs nothing); "
                        "exit 3 when it does not fit")
    pl.add_argument("config", help="job YAML")
    pl.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. scaling.gpu_memory_gb=24")
    pl.set_defaults(fn=_plan)

    lf = sub.add_parser("lr-find", help="learning-rate range test on one worker")
    lf.add_argument("config")
    lf.add_argument("overrides", nargs="*", default=[])
    lf.add_argument("--start-lr", type=float, default=1e-7)
    lf.add_argument("--end-lr", type=float, default=1.0)
    lf.add_argument("--steps", type=int, default=100, help="optimizer steps (at most)")
    lf.set_defaults(fn=_lr_find)


def _family_names() -> list[str]:
    """The family modules' names (= ``model.family`` values), listed as
    ``raylora.model.families`` lists them but without importing them, and so torch, for
    ``--help``."""
    import importlib.util
    import pkgutil

    where = importlib.util.find_spec("raylora.model.families").submodule_search_locations
    return sorted(m.name for m in pkgutil.iter_modules(where) if m.name != "base")


def _adapter_commands(sub) -> None:
    """validate, sample, export, tiny-model: configs, adapters and models on this machine."""
    from raylora.config import QUANTIZE_KINDS  # (pydantic only: --help stays quick)

    v = sub.add_parser("validate", help="check a config and print it resolved")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*", default=[])
    v.set_defaults(fn=_validate)

    s = sub.add_parser("sample", help="generate an image with base model + adapter")
    s.add_argument("--model", required=True, help="base model: hub id or diffusers folder")
    s.add_argument("--revision", default=None,
                   help="a hub model's branch, tag or commit; default: the commit the adapter "
                        "was trained on when its raylora.json names --model as its base, else main")
    s.add_argument("--variant", default=None,
                   help="the model's weights variant (fp16, bf16: *.fp16.safetensors), as "
                        "model.variant; default: the run's when the adapter's raylora.json names "
                        "--model as its base")
    s.add_argument("--adapter", required=True, action="append",
                   help="adapter folder or .safetensors file, local, in object storage (s3://, "
                        "gs://) or hf://owner/name[/path]: pytorch_lora_weights.safetensors "
                        "(lora, dora) or a peft folder (lokr, loha). A pipeline of experts (Wan 2.2 A14B) takes one per "
                        "expert: --adapter HIGH --adapter LOW (each raylora.json names its expert)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--out", required=True, help="output PNG")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=int, default=25)
    s.add_argument("--guidance-scale", type=float, default=None,
                   help="default: the family's (SD/SDXL 7.5, Flux.1-dev 3.5, Flux.1 Kontext 2.5, "
                        "Chroma 5.0, SD3 7.0, Qwen-Image and Qwen-Image-Edit 4.0, Qwen-Image 2.1 "
                        "1.0, Z-Image 5.0, Lumina-Image 2.0 4.0, Sana 4.5, Flux.2 [klein] and "
                        "[dev] 4.0, Wan 5.0; Z-Image-Turbo samples at 0)")
    s.add_argument("--size", type=int, default=None, help="pixels; default: the model's size")
    s.add_argument("--image", action="append", default=None,
                   help="an image-edit model's input image (Flux.1 Kontext, Flux.2, "
                        "Qwen-Image-Edit), a path or storage URI; resized to --size when given, "
                        "else as the pipeline sizes it. Again for each further input (Flux.2, "
                        "Qwen-Image-Edit: Picture 2, ...)")
    s.add_argument("--system-prompt", default=None,
                   help="Lumina-Image 2.0: the system prompt before the prompt (Sana: its "
                        "complex human instruction, '' for none); default: "
                        "model.system_prompt in the adapter folder's raylora.json, else the "
                        "pipeline's own")
    s.add_argument("--expert", choices=["high_noise", "low_noise"], default=None,
                   help="a pipeline of experts (Wan 2.2 A14B): the one the (single) adapter "
                        "trained; default: model.expert in the adapter folder's raylora.json")
    s.add_argument("--quantize-text-encoders", choices=list(QUANTIZE_KINDS),
                   default="none", help="the text encoders' linears quantized, as "
                   "model.quantize_text_encoders does (fp8: GPU only); they are loaded as "
                   "training holds them either way (Flux.2 [dev]: Mistral's language model "
                   "alone)")
    s.set_defaults(fn=_sample)

    e = sub.add_parser("export", help="convert a diffusers adapter folder to another format")
    e.add_argument("adapter", help="folder with pytorch_lora_weights.safetensors (+ raylora.json)")
    e.add_argument("--format", choices=["kohya", "diffusers"], required=True,
                   help="kohya: one kohya-ss / ComfyUI / A1111 .safetensors file. diffusers: "
                        "a copy of the folder that every diffusers loader reads (an SD/SDXL "
                        "adapter of a raylora before 2026-12-06 that targeted more than "
                        "attention mixed two key styles, which load_lora_weights reads only "
                        "in part)")
    e.add_argument("--out", default=None,
                   help="kohya: file to write; default: <folder>_kohya.safetensors beside the "
                        "folder (a run's adapter/: adapter_kohya.safetensors), not replaced when "
                        "it holds another adapter's export. diffusers: a new folder; default: "
                        "<adapter>-diffusers")
    e.add_argument("--family", default=None,
                   help="the adapter's model family (sd, sdxl, flux, sd3, qwenimage, zimage, wan, "
                        "...: every family with kohya export); default: the one raylora.json "
                        "names, else guessed from the keys")
    e.set_defaults(fn=_export)

    m = sub.add_parser("tiny-model", help="write a tiny random diffusers pipeline (offline)")
    m.add_argument("--family", choices=_family_names(), default="sd")
    m.add_argument("--schnell", action="store_true",
                   help="flux: Flux.1-schnell (no guidance embedding, static shift) instead of -dev")
    m.add_argument("--experts", action="store_true",
                   help="wan: Wan 2.2 A14B's layout, a high-noise and a low-noise transformer")
    m.add_argument("dest")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=_tiny_model)


def _data_commands(sub):
    """shards build, demo-data; returns the shards subparsers (they get --verbose too)."""
    sh = sub.add_parser("shards", help="shard tools")
    shsub = sh.add_subparsers(dest="shards_cmd", required=True)
    b = shsub.add_parser("build", help="image folder → parquet or WebDataset shards on any URI")
    b.add_argument("src", help="folder (or URI) of images with metadata.jsonl/.csv or .txt captions")
    b.add_argument("dest", help="where the shards and manifest.json go (path, s3://, gs://)")
    b.add_argument("--format", choices=["parquet", "webdataset"], default="parquet")
    b.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    b.add_argument("--max-bad-fraction", type=float, default=None,
                   help="images left out (a metadata line whose image is gone, an image "
                        "without a caption) over which the build is refused; default "
                        "data.max_bad_fraction's, 0.05")
    b.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    b.add_argument("--region", default=None)
    b.set_defaults(fn=_shards_build)

    d = sub.add_parser("demo-data", help="write procedurally drawn image-caption parquet shards")
    d.add_argument("dest")
    d.add_argument("--num", type=int, default=96)
    d.add_argument("--shards", type=int, default=2)
    d.add_argument("--size", type=int, default=64)
    d.set_defaults(fn=_demo_data)
    return shsub


# Subcommands' path arguments (local or a URI) that a user may write with ~.
PATH_ARGS = ("config", "out", "dest", "src", "model", "adapter", "working_dir", "runtime_env")


def main(argv: list[str] | None = None) -> int:
    import os

    from raylora import quiet
    from raylora.config import ConfigError
    from raylora.preflight import EXIT_DOES_NOT_FIT, DoesNotFit

    parser = build_parser()
    # Overrides may come after options (`lr-find job.yaml --steps 50 train.batch_size=2`);
    # argparse stops collecting a positional list at the first option, so pick them up.
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(r.startswith("-") or "=" not in r for r in rest):
            getattr(args, "usage_of", parser).error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = list(args.overrides) + rest
    # A path option's leading ~ (bash leaves `--out=~/x.png` and a quoted '~/x' as written):
    # the config's paths expand it (storage.local_path), so these do too. `sample --out`
    # wrote ./~/x.png while saying ~/x.png; `demo-data '~/d'` made ./~/d, then wrote to ~/d.
    for name in PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
        elif isinstance(value, list):  # sample --adapter, given once per adapter
            setattr(args, name, [os.path.expanduser(v) if isinstance(v, str) and v.startswith("~")
                                 else v for v in value])
    # This process's signals are handled while it waits in `ray.get` (a run's fit() sits
    # in one), but Ray checks for them there only every this many ms (1000 by default):
    # a SIGTERM then reached the stop handler up to a second late, and fast steps trained
    # on meanwhile. Set before Ray reads its config (ray.init); a user's value wins.
    os.environ.setdefault("RAY_get_check_signal_interval_milliseconds", "100")
    # A job sent by `raylora submit`: its credentials, before anything reads storage.
    from raylora import jobsecrets

    jobsecrets.load()
    if getattr(args, "verbose", False):
        os.environ[quiet.VERBOSE_ENV] = "1"  # Ray workers inherit it (launch.job_runtime_env)
    quiet.apply()  # before the model libraries are imported: they read env vars then
    logging.basicConfig(level=logging.INFO, format="[raylora] %(message)s")
    # SIGTERM (a job scheduler, `kill`, Kubernetes) is handled like Ctrl-C: the `finally`
    # blocks run, so an embedded Ray is shut down. Checkpoints need nothing: Ray Train
    # records one only once it is fully written, and the same command resumes from it.
    from raylora import launch

    launch.INTERRUPT_ON_SIGTERM = True
    launch.interrupt_on_sigterm()
    from raylora.storage import masked

    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"raylora: interrupted{getattr(args, 'on_rerun', '')}", file=sys.stderr)
        return 130
    # (the last line: a URL's password left out, whatever error quoted it: storage.masked)
    except DoesNotFit as exc:
        print(f"raylora: {masked(str(exc))}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except ConfigError as exc:
        print(f"raylora: {masked(str(exc))}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        # Bad input named by URI/path: one line, not a stack trace.
        print(f"raylora: error: {masked(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:
        # Storage that failed mid-way (raylora.storage names the URI in the message): one
        # line too; the stack trace is for a bug report, so only with --verbose.
        if getattr(args, "verbose", False):
            raise
        print(f"raylora: error: {masked(str(exc))} (--verbose shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
