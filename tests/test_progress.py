"""Driver progress and quiet logs (issue #23 items 1-2): what `raylora train` prints when
its stdout is a log file, not a terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from raylora import quiet
from raylora.progress import Stats, every_n_steps, summary_lines

STEP_LINE = re.compile(r"^raylora: step (\d+)/(\d+) \((\d+)%\) epoch \d+ loss [\d.]+ lr [\d.e-]+ "
                       r"[\d.]+ img/s ETA [\d:?]+$")


def test_every_n_steps_defaults_to_a_tenth_of_the_run():
    assert every_n_steps(None, 600) == 60
    assert every_n_steps(None, 4) == 1
    assert every_n_steps(25, 600) == 25


def test_stats_smooth_loss_and_eta_from_rate_seen():
    s = Stats(total=10)
    s.update({"step": 1, "epoch": 0, "loss": 1.0, "lr": 1e-3, "images_per_s": 8.0}, now=100.0)
    s.update({"step": 3, "epoch": 0, "loss": 2.0, "lr": 1e-3, "images_per_s": 8.0}, now=104.0)
    assert s.loss == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)
    assert s.min_loss == 1.0
    assert s.eta_s() == pytest.approx(14.0)  # 2 steps per 4 s, 7 steps left
    s.update({"step": 4, "epoch": 1, "loss": float("nan"), "lr": 1e-3, "images_per_s": 8.0}, now=106.0)
    assert s.min_loss == 1.0 and s.loss == pytest.approx(1.1)  # a skipped step changes neither
    assert s.line().startswith("raylora: step 4/10 (40%) epoch 1 loss 1.1000 lr 0.001 8.0 img/s ETA 0:")


def test_the_eta_of_rows_read_back_in_groups_counts_from_the_first_groups_last_row():
    """Rows come ten at a time (train.readback_every_n_steps: 10), all timed at their poll:
    steps 1-9 anchored at 0 s made the first ETA 0:00 and the next ones half the truth."""
    s = Stats(total=1000)
    etas = []
    for group in range(4):  # 0.5 s per step, a group every 5 s
        for step in range(10 * group + 1, 10 * group + 11):
            s.update({"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "images_per_s": 8.0},
                     now=100.0 + 5.0 * group)
        etas.append(s.eta_s())
    assert etas[0] is None  # one group: no rate yet ("?"), not 0:00
    assert etas[1:] == [pytest.approx(0.5 * (1000 - step)) for step in (20, 30, 40)]


def test_a_resumed_runs_line_goes_on_with_the_smoothed_loss_of_the_straight_run():
    """A rerun resumed at step 4 printed step 5's raw loss as its smoothed loss: the rank-0
    worker now sends the restored history's smoothing (``carried``) before its first step."""
    import io

    from raylora.progress import ProgressPrinter, carried

    losses = [1.0, 0.5, float("nan"), 2.0, 0.25, 0.75]
    rows = [{"step": i + 1, "epoch": 0, "loss": x, "lr": 1e-3, "images_per_s": 4.0}
            for i, x in enumerate(losses)]

    def printed(feed):
        out = io.StringIO()
        printer = ProgressPrinter(None, 6, every_steps=1, every_s=1e9, stream=out, tty=False)
        for row in feed:
            printer._consume(row, 100.0 + row.get("step", 0))
        # (up to the ETA: a resumed driver has seen one step, no rate yet)
        return [ln.split(" ETA ")[0] for ln in out.getvalue().splitlines()
                if ln.startswith("raylora: step 5/")]

    straight = printed(rows)
    resumed = printed([{"carried": carried(rows[:4]), "total": 6}, *rows[4:]])
    assert straight == resumed and len(straight) == 1
    ema = 0.9 * (0.9 * 1.0 + 0.1 * 0.5) + 0.1 * 2.0  # the NaN step skipped
    assert f"loss {0.9 * ema + 0.1 * 0.25:.4f}" in resumed[0]
    assert carried(rows[:4]) == {"loss": pytest.approx(ema), "min_loss": 0.5}
    # Under the same driver (workers restarted), the line keeps the smoothing it has.
    s = Stats(total=6)
    s.update(rows[0], 1.0)
    s.carry({"loss": 9.0, "min_loss": 9.0})
    assert (s.loss, s.min_loss) == (1.0, 1.0)


def test_a_trial_stopped_early_says_where_and_prints_no_step_past_it():
    """A trial ASHA stopped at step 15 printed `step 19/30`: its workers train on until
    Tune's stop reaches them. The search's driver now sends the step each completed
    trial's results are from (``tune_stop.TrialEnds``), and the line says it stopped."""
    import io

    from raylora.progress import ProgressPrinter

    out, sunk = io.StringIO(), []
    printer = ProgressPrinter(None, 30, every_steps=5, every_s=1e9, stream=out, tty=False,
                              sink=sunk.append, labelled=True)

    def row(label, step, total=30):
        return {"label": label, "total": total, "step": step, "epoch": 0, "loss": 0.5,
                "lr": 1e-4, "images_per_s": 2.0}

    feed = [row("trial_a", s) for s in range(1, 18)] + [row("trial_b", s) for s in range(1, 31)]
    feed += [{"label": "trial_a", "ended": 15}, {"label": "trial_b", "ended": 30},
             row("trial_a", 18), row("trial_a", 19), row("trial_a", 20)]
    # An end that overtakes the trial's rows: said once they give its own budget (trial_c
    # ran all of its 5 steps; trial_d, stopped at 2 of its 8, trained on to 4).
    feed += [{"label": "trial_c", "ended": 5}, *(row("trial_c", s, 5) for s in range(1, 6))]
    feed += [{"label": "trial_d", "ended": 2}, *(row("trial_d", s, 8) for s in range(1, 5))]
    # ... or overtakes some of them: said after the step it names (trial_e, stopped at 5)
    feed += [*(row("trial_e", s, 8) for s in range(1, 4)), {"label": "trial_e", "ended": 5},
             *(row("trial_e", s, 8) for s in range(4, 8))]
    for i, r in enumerate(feed):
        printer._consume(r, 100.0 + i)
    printer._poll = lambda: None  # (the board: nothing more on it)
    printer.start().stop()  # each run's last line, as at the search's end
    lines = out.getvalue().splitlines()
    steps_a = [int(ln.split()[3].split("/")[0]) for ln in lines if ln.startswith("raylora: trial_a step")]
    assert steps_a == [5, 10, 15]  # nothing past 17, the last row before the end was known
    assert lines.count("raylora: trial_a stopped early at step 15/30 by the search's scheduler "
                       "(its results are that step's)") == 1
    # a trial that ran its budget: its lines as before, no "stopped early"
    assert [ln.split()[3] for ln in lines if ln.startswith("raylora: trial_b")] == [
        "5/30", "10/30", "15/30", "20/30", "25/30", "30/30"]
    assert not any("trial_b stopped" in ln for ln in lines)
    assert [ln.split()[3] for ln in lines if ln.startswith("raylora: trial_c")] == ["5/5"]
    assert [ln for ln in lines if ln.startswith("raylora: trial_d")] == [
        "raylora: trial_d stopped early at step 2/8 by the search's scheduler (its results are "
        "that step's)"]
    assert [ln.split(" epoch ")[0] for ln in lines if ln.startswith("raylora: trial_e")] == [
        "raylora: trial_e step 5/8 (62%)",
        "raylora: trial_e stopped early at step 5/8 by the search's scheduler (its results are "
        "that step's)"]
    # `raylora status` (progress.json) shows the same for the stopped trial
    assert [r["line"] for r in sunk if r["label"] == "trial_a"][-1].endswith("(its results are that step's)")


def test_summary_names_adapter_checkpoints_and_how_to_load():
    lines = summary_lines({
        "metrics": {"steps": 60, "images_seen": 480, "wall_seconds": 48.0, "train_loss_first": 1.2,
                    "train_loss_last": 1.0, "bad_records": 2},
        "train_loss_min": 0.9, "adapter": "/o/adapter", "checkpoints": "/o/train",
        "loss_png": "/o/loss.png", "metrics_jsonl": "/o/metrics.jsonl", "rows_decoded": 478,
        "pipeline": "StableDiffusionPipeline", "base_model": "/m",
    })
    text = "\n".join(lines)
    assert "60 steps, 480 images in 48.0s (10.0 img/s)" in text
    assert "loss 1.20000 → 1.00000 (min 0.90000)" in text
    assert "raylora: checkpoints  /o/train" in text
    assert "raylora: bad samples  2 (of 480 rows read)" in text
    assert ('pipe = StableDiffusionPipeline.from_pretrained("/m"); '
            'pipe.load_lora_weights("/o/adapter")') in text


def test_summary_reports_the_class_images():
    """README: the run summary reports class_images (used, given, generated now, folder) as
    raylora.json does; the printed summary had no line for them."""
    base = {
        "metrics": {"steps": 2, "images_seen": 4, "wall_seconds": 2.0, "train_loss_first": 1.0,
                    "train_loss_last": 1.0},
        "adapter": "/o/adapter", "checkpoints": "/o/train", "loss_png": "/o/loss.png",
        "metrics_jsonl": "/o/metrics.jsonl", "pipeline": "StableDiffusionPipeline", "base_model": "/m",
    }

    def line(given, generated, uri, used=6):
        c = {"class_images": used, "class_images_given": given, "class_images_generated": generated,
             "class_images_uri": uri}
        return [ln for ln in summary_lines({**base, "class_images": c}) if "class images" in ln]

    # (ClassImages.summary of a run that generated 2 of its 6 into the folder)
    assert line(4, 2, "/dogs/raylora-generated/dc2d") == [
        "raylora: class images 6 (4 given, 2 generated now) in /dogs/raylora-generated/dc2d"]
    assert line(4, 0, "/o/class_images/ab") == [  # an earlier run's folder, reused
        "raylora: class images 6 (4 given, 2 generated earlier) in /o/class_images/ab"]
    assert line(3, 1, "/o/class_images/ab") == [  # an interrupted build completed
        "raylora: class images 6 (3 given, 3 generated, 1 of them now) in /o/class_images/ab"]
    assert line(6, 0, None) == ["raylora: class images 6 (6 given)"]
    assert [ln for ln in summary_lines(base) if "class" in ln] == []  # no prior preservation


def test_summary_loads_the_base_at_the_commit_and_variant_the_run_trained():
    """The "use it" line loads the hub commit the run trained (``main`` may have moved)
    and the weight variant it read, as the model card does."""
    from raylora.checkpoint.export import from_pretrained_kwargs
    from raylora.config import RayLoraConfig

    def cfg(pretrained, variant=None):
        return RayLoraConfig.model_validate({
            "model": {"pretrained": pretrained, "variant": variant},
            "data": {"uri": "/d"}, "output": {"uri": "/o"}})

    kw = from_pretrained_kwargs(cfg("org/sd", "fp16"), "0123abcd")
    assert kw == {"revision": "0123abcd", "variant": "fp16"}
    assert from_pretrained_kwargs(cfg("/local/sd"), "0123abcd") == {}  # a folder: no revision
    lines = summary_lines({
        "metrics": {"steps": 1, "images_seen": 1, "wall_seconds": 1.0, "train_loss_first": 1.0,
                    "train_loss_last": 1.0},
        "adapter": "/o/adapter", "checkpoints": "/o/train", "loss_png": "/o/loss.png",
        "metrics_jsonl": "/o/metrics.jsonl", "pipeline": "StableDiffusionPipeline",
        "base_model": "org/sd", "base_kwargs": kw,
    })
    assert ('pipe = StableDiffusionPipeline.from_pretrained("org/sd", revision="0123abcd", '
            'variant="fp16"); pipe.load_lora_weights("/o/adapter")') in "\n".join(lines)


def test_worker_env_carries_verbose_or_quiet_settings(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    assert quiet.worker_env()["TRANSFORMERS_VERBOSITY"] == "error"
    assert quiet.ray_train_log_level() == "WARNING"
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert quiet.worker_env() == {quiet.VERBOSE_ENV: "1"}
    assert quiet.ray_train_log_level() == "INFO"


def test_a_traceback_is_dropped_only_for_errors_the_driver_prints_as_one_line(monkeypatch, caplog):
    """Ray Train logs "Error in training function" and the traceback on every rank that
    raised (``construct_user_exception_with_traceback``, called here as its worker calls
    it). An error a restart would repeat ends the run and reaches the CLI as one line
    (raylora.entry.EndOnRepeated): its tracebacks go, in quiet mode only; the rest stay."""
    import logging

    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    from raylora.data.badrecords import BadDataError
    from raylora.train.loop import DataEndedError, NonFiniteLossError

    errors = logging.getLogger(quiet.TRAIN_FN_ERROR_LOGGER)
    monkeypatch.setattr(errors, "filters", [])  # what apply() adds goes with the test

    def logged(error: BaseException) -> list[str]:
        caplog.clear()
        try:
            try:
                raise OSError("the read that failed first")
            except OSError:
                raise error  # chained: the last exception is the one that counts
        except BaseException as exc:
            construct_user_exception_with_traceback(exc)
        return [r.getMessage() for r in caplog.records if r.name == quiet.TRAIN_FN_ERROR_LOGGER]

    repeated = [BadDataError("data.max_bad_fraction: 8 of 20 rows\nmissing_caption=2"),
                NonFiniteLossError("loss or gradients were NaN/inf for 5 optimizer steps"),
                DataEndedError("epoch 0: the data stream ended before the run did")]
    others = [RuntimeError("gloo: connection closed"), ValueError("a bug"), KeyboardInterrupt()]
    with caplog.at_level(logging.ERROR):
        monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
        quiet.apply()  # verbose: nothing filtered
        assert [len(logged(e)) for e in repeated + others] == [1] * 6
        monkeypatch.delenv(quiet.VERBOSE_ENV)
        quiet.apply()
        quiet.apply()  # once per process, however often called
        assert len(errors.filters) == 1
        assert [logged(e) for e in repeated] == [[], [], []]
        for e in others:
            (text,) = logged(e)
            assert text.startswith("Error in training function:\n") and "Traceback" in text
            assert text.rstrip().endswith(f"{type(e).__name__}: {e}".rstrip(": "))


def test_raylora_submit_packs_its_working_dir_without_rays_packaging_lines(tmp_path, monkeypatch):
    """Each `raylora submit` printed Ray's job SDK lines: "Directory '.git' is now ignored by
    default when packaging the working directory" (and '.venv': raylora.jobs.EXCLUDES leaves
    both out anyway), "Ignoring upload to cluster for these files: [.gitignore]" (the
    file it reads its rules from). Here Ray's own packing of a working dir, as submit calls
    it, with the upload left out: quiet, it logs nothing; verbose, those lines."""
    import logging

    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.util.debug import reset_log_once

    for d in (".git", ".venv", "raylora"):
        (tmp_path / d).mkdir()
    (tmp_path / ".gitignore").write_text("runs/\n")
    (tmp_path / "raylora" / "x.py").write_text("")
    uploaded, records = [], []

    class Kept(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    def pack() -> list[str]:
        records.clear()
        reset_log_once()  # the default-excludes note is logged once per process
        upload_working_dir_if_needed({"working_dir": str(tmp_path)}, include_gitignore=True,
                                     upload_fn=lambda *a, **k: uploaded.append(a[0]))
        return list(records)

    loggers = [logging.getLogger(n) for n in ("ray._private.runtime_env.packaging",
                                              quiet.WORKING_DIR_LOGGER)]
    for lg in loggers:  # what apply() sets goes with the test
        monkeypatch.setattr(lg, "filters", [])
        monkeypatch.setattr(lg, "level", logging.NOTSET)
    handler = Kept(logging.DEBUG)
    ray_logger = logging.getLogger("ray")
    ray_logger.addHandler(handler)
    monkeypatch.setattr(ray_logger, "level", logging.INFO)
    try:
        monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
        quiet.apply()
        noted = pack()
        assert [m for m in noted if "is now ignored by default" in m] == [
            f"Directory {d!r} is now ignored by default when packaging the working directory. To "
            "disable this behavior, set the `RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES=''` "
            "environment variable." for d in (".git", ".venv")]
        assert any(m.startswith("Ignoring upload to cluster for these files:") for m in noted)
        monkeypatch.delenv(quiet.VERBOSE_ENV)
        quiet.apply()
        assert pack() == [] and uploaded == [str(tmp_path)] * 2
        # Ray's other warnings there still show (an unsafe path in a package, ...)
        assert all(lg.isEnabledFor(logging.WARNING) for lg in loggers)
        loggers[1].warning("Tried to delete nonexistent URI: gcs://x.")
        assert records == ["Tried to delete nonexistent URI: gcs://x."]
        # Ray's job SDK sets INFO on its loggers when imported ("Uploading package
        # gcs://..." at each submit): the job commands' client quiets them again
        from raylora import jobs

        sdk = logging.getLogger("ray.dashboard.modules.dashboard_sdk")
        monkeypatch.setattr(sdk, "level", logging.INFO)  # as its import left it
        with pytest.raises(ValueError, match="127.0.0.1:1"):
            jobs.client("http://127.0.0.1:1")
        assert sdk.level == logging.WARNING
    finally:
        ray_logger.removeHandler(handler)


# Noise that quiet mode exists to remove (Ray Train, Ray Data, bitsandbytes, transformers).
NOISE = ("TrainingReport(", "Checkpoint successfully created", "execution finished",
         "Execution plan of Dataset", "gemm_4bit_forward", "Loading weights",
         "Started a local Ray instance")


@pytest.mark.integration
def test_train_in_a_log_prints_progress_and_summary_quietly(base_config, tmp_path):
    tree = {**base_config, "train": {**base_config["train"], "max_steps": 6, "log_every_n_steps": 2}}
    tree["checkpoint"] = {"every_n_steps": 3}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    env = {k: v for k, v in os.environ.items() if k != quiet.VERBOSE_ENV}
    proc = subprocess.run([sys.executable, "-m", "raylora", "train", str(path)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, out.splitlines()) if m]
    # Every 2nd step, and no carriage-return bar (stdout is a pipe).
    assert steps == [2, 4, 6], out
    assert "\r" not in out
    adapter = str(tmp_path / "out" / "adapter")
    assert f"raylora: adapter      {adapter}" in out
    assert f'pipe.load_lora_weights("{adapter}")' in out
    assert "StableDiffusionPipeline.from_pretrained(" in out
    assert f"raylora: checkpoints  {tmp_path / 'out' / 'train'}" in out
    assert re.search(r"raylora: trained 6 steps, 12 images in [\d.]+s \([\d.]+ img/s\); loss "
                     r"[\d.]+ → [\d.]+ \(min [\d.]+\)", out), out
    assert os.path.isfile(os.path.join(adapter, "pytorch_lora_weights.safetensors"))
    for noise in NOISE:
        assert noise not in out, f"{noise!r} printed:\n{out}"
    # 3 progress + 8 summary lines; the rest is what Ray prints that no knob reaches.
    assert len(out.splitlines()) < 25, out


def test_job_runtime_env_leaves_the_submitted_jobs_env_vars_alone(monkeypatch):
    """Ray refuses ray.init's runtime_env when it sets a variable `ray job submit` set."""
    import json

    from raylora.launch import job_runtime_env

    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {"env_vars": {"TRANSFORMERS_VERBOSITY": "info"}}}))
    env = job_runtime_env()
    assert "TRANSFORMERS_VERBOSITY" not in env["env_vars"]
    assert env["env_vars"]["DIFFUSERS_VERBOSITY"] == "error"
    assert callable(env["worker_process_setup_hook"])


def test_the_use_it_line_names_what_diffusers_can_read():
    """A base in object storage: the call named ``s3://...``, which ``from_pretrained``
    cannot read; it now names a local copy and says which URI to copy. A folder with a
    ``"`` in its name broke the line's Python."""
    import ast

    base = {
        "metrics": {"steps": 1, "images_seen": 1, "wall_seconds": 1.0, "train_loss_first": 1.0,
                    "train_loss_last": 1.0},
        "adapter": '/o/say "hi"/adapter', "checkpoints": "/o/train", "loss_png": "/o/loss.png",
        "metrics_jsonl": "/o/metrics.jsonl", "pipeline": "StableDiffusionPipeline",
    }
    lines = summary_lines({**base, "base_model": "s3://bucket/sd15"})
    use = next(ln for ln in lines if "use it" in ln)
    code = use.split("use it", 1)[1].strip()
    calls = [n for n in ast.walk(ast.parse(code.replace("; ", "\n"))) if isinstance(n, ast.Call)]
    assert [ast.literal_eval(c.args[0]) for c in calls] == [
        "path/to/a/copy/of/the/base", '/o/say "hi"/adapter']
    assert lines[-1] == ("raylora:              (path/to/a/copy/of/the/base: a local copy of "
                         "s3://bucket/sd15: diffusers reads a folder or a hub id)")
    local = summary_lines({**base, "base_model": "/m", "adapter": "s3://out/run/adapter"})
    assert 'from_pretrained("/m"); pipe.load_lora_weights("s3://out/run/adapter")' in "\n".join(local)
    assert local[-1].endswith("copy the adapter folder down first)")
    assert not any("copy" in ln for ln in summary_lines({**base, "base_model": "/m"}))


@pytest.mark.parametrize("client", ["httpx", "httpx2"])
def test_verbose_http_request_lines_mask_a_urls_password(monkeypatch, caplog, client):
    """``--verbose`` shows the HTTP clients' request lines again (the hub client's is
    httpx2): each named a mirror's ``https://user:pass@host`` whole. A real request to a
    server on loopback; the line keeps the host and path, not the password."""
    import importlib
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    quiet.apply()
    http = importlib.import_module(client)
    try:
        with caplog.at_level(logging.INFO, logger=client):
            http.get(f"http://user:s3cr3t-pw@127.0.0.1:{server.server_port}/api/models")
    finally:
        server.shutdown()
        server.server_close()
    lines = [r.getMessage() for r in caplog.records if r.name == client]
    assert len(lines) == 1 and "HTTP Request: GET" in lines[0], lines
    assert f"http://***@127.0.0.1:{server.server_port}/api/models" in lines[0]
    assert "s3cr3t-pw" not in caplog.text
