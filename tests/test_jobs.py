"""#23 item 3: `raylora submit | status | logs | stop | list` through Ray's Job Submission
SDK against a real local head (cluster/local-up.sh: token auth on), one head for the module.
A clean stop leaves a checkpoint at the step it stopped at; submitting the same config again
resumes from it and finishes the run."""

from __future__ import annotations

import glob
import json
import os
import re
import types
import uuid

import pytest

from killer import registered_step
from localhead import REPO, files_holding, local_head, wait_for
from raylora.cli import main

pytestmark = pytest.mark.integration

MAX_STEPS = 40


@pytest.fixture(scope="module")
def head():
    with local_head(["--cpus", "4"]) as c:
        yield c


def _shards_in_s3(endpoint: str, bucket: str, demo_data: str) -> str:
    """The demo shards uploaded to a new bucket of the S3 server: their URI."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for f in sorted(os.listdir(demo_data)):
        if f.endswith(".parquet"):
            s3.upload_file(os.path.join(demo_data, f), bucket, f"data/{f}")
    return f"s3://{bucket}/data"


def test_submit_status_stop_then_resubmit_resumes_and_finishes(
    head, tiny_model, demo_data, moto_endpoint, tmp_path, capsys, monkeypatch
):
    from raylora import jobs, jobsecrets

    monkeypatch.setenv("RAY_ADDRESS", head["dashboard"])
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", head["token"])
    # The head has no credentials of its own; the jobs read their data from S3 with the
    # submitter's, which must reach the driver and workers and no log, file or dashboard.
    assert not any(k.startswith("AWS_") for k in head["env"] if k != "AWS_CA_BUNDLE")
    # Made here, not written in this file: the job's working dir ships this file.
    secret = "rAyLoRa/Submit+" + uuid.uuid4().hex
    aws = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "AKIARAYLORASUBMIT023",
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}
    # A hub token travels as the S3 key does (the model here is a folder: it is only carried).
    hf_token = "hf_RayLoraSubmit" + uuid.uuid4().hex
    for k, v in {**aws, "HF_TOKEN": hf_token}.items():
        monkeypatch.setenv(k, v)
    data = _shards_in_s3(moto_endpoint, "raylora-submit", demo_data)
    out = tmp_path / "out"
    # One worker (the config has two): what is checked is the job's life, not DDP; a worker
    # started on 2 cores is ~20 s of each job here.
    overrides = [f"model.pretrained={tiny_model}", f"data.uri={data}", f"output.uri={out}",
                 f"train.max_steps={MAX_STEPS}", "train.batch_size=2", "train.lr_warmup_steps=0",
                 "train.log_every_n_steps=1", "checkpoint.every_n_steps=100", "scaling.num_workers=1"]
    config = os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")

    # A config error is refused here, before anything is sent.
    assert main(["submit", config, *overrides, "train.batch_size=0", "--working-dir", REPO]) == 2
    assert "train.batch_size" in capsys.readouterr().err

    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-stop"]) == 0
    assert capsys.readouterr().out.strip() == "rl-stop"
    info = jobs.client(None).get_job_info("rl-stop")
    for hidden in (secret, hf_token):
        assert hidden not in info.entrypoint and hidden not in json.dumps(info.runtime_env)
    assert info.runtime_env["env_vars"]["AWS_ENDPOINT_URL"] == moto_endpoint  # not a secret
    assert info.runtime_env["env_vars"][jobsecrets.ENV] == "1"
    assert [m.startswith("gcs://_ray_pkg_") for m in info.runtime_env["py_modules"]] == [True]
    assert info.entrypoint.startswith("python -m raylora train jobs/configs/tiny-local.yaml")

    # Running, with the run's own progress line once it has taken a few steps.
    wait_for(lambda: (jobs.status("rl-stop")[1] or "").startswith("step ")
             and int(jobs.status("rl-stop")[1].split()[1].split("/")[0]) >= 3, 300, "step 3")
    assert main(["status", "rl-stop"]) == 0
    text = capsys.readouterr().out
    assert "raylora: job rl-stop RUNNING" in text and f"/{MAX_STEPS} " in text and "loss" in text

    assert main(["stop", "rl-stop"]) == 0
    text = capsys.readouterr().out
    assert "raylora: job rl-stop STOPPED" in text, text
    stopped_at = registered_step(out / "train")
    assert 3 <= stopped_at < MAX_STEPS  # a checkpoint written for the stop (periodic: 100)
    snap = json.loads((out / "train" / "checkpoint_manager_snapshot.json").read_text())
    assert snap["checkpoint_results"][-1]["metrics"]["stopped"] == "stop requested"
    assert not (out / "adapter").exists()  # stopped: nothing exported
    assert main(["logs", "rl-stop"]) == 0
    assert f"stopped at step {stopped_at}/{MAX_STEPS}" in capsys.readouterr().out

    # Its id again: refused before the checks and the upload (Ray refused it after them,
    # in 3 tracebacks); a job id the cluster does not know, and `logs -f` of a job that
    # did not succeed, in one line each.
    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-stop"]) == 2
    assert capsys.readouterr().err.startswith(
        "raylora: error: --job-id rl-stop: the cluster already has a job with this id (STOPPED); ")
    for cmd in (["status"], ["logs"], ["stop"]):
        assert main([*cmd, "no-such-job"]) == 2
        assert capsys.readouterr().err == ("raylora: error: no-such-job: no job with this id on the "
                                           "cluster (`raylora list` names raylora's jobs)\n"), cmd
    assert main(["logs", "-f", "rl-stop"]) == 1
    assert capsys.readouterr().err == "raylora: job rl-stop STOPPED\n"

    # The same config again (a new id) resumes from that checkpoint and finishes; logs -f
    # follows it. A --runtime-env file's fields reach the job.
    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-resume",
                 "--runtime-env", os.path.join(REPO, "jobs", "runtime_env.local.yaml")]) == 0
    capsys.readouterr()
    renv = jobs.client(None).get_job_info("rl-resume").runtime_env
    assert renv["env_vars"]["HF_HUB_DISABLE_TELEMETRY"] == "1" and jobsecrets.ENV in renv["env_vars"]
    assert main(["logs", "-f", "rl-resume"]) == 0
    text = capsys.readouterr().out
    assert f"resumed from step {stopped_at}" in text and f"trained {MAX_STEPS} steps" in text
    wait_for(lambda: jobs.status("rl-resume")[0] == "SUCCEEDED", 60, "SUCCEEDED")
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    assert meta["metrics"]["resumed_from_step"] == stopped_at
    assert meta["metrics"]["steps"] == MAX_STEPS
    # Its last progress line says the run finished and where its adapter is; `stop` of it
    # says the same, and had the stop come as its driver exited (Ray records STOPPED),
    # that nothing is left to resume.
    assert main(["status", "rl-resume"]) == 0
    finished = (f"the run finished: trained {MAX_STEPS} steps, loss {meta['metrics']['train_loss_first']:.5f}"
                f" → {meta['metrics']['train_loss_last']:.5f}; adapter {out / 'adapter'}")
    assert capsys.readouterr().out == f"raylora: job rl-resume SUCCEEDED\nraylora: {finished}\n"
    assert main(["stop", "rl-resume"]) == 0
    assert capsys.readouterr().out == f"raylora: job rl-resume SUCCEEDED; {finished}\n"
    line = jobs.status("rl-resume")[1]
    assert jobs.stopped_line("rl-resume", "STOPPED", line) == (
        f"raylora: job rl-resume STOPPED; {finished} (the stop came after that: nothing to resume)")
    assert jobs.stopped_line("rl-stop", "STOPPED", "step 3/6 ...") == "raylora: job rl-stop STOPPED; step 3/6 ..."

    assert main(["list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["rl-stop", "STOPPED", "train", "tiny-local.yaml"] in rows
    assert ["rl-resume", "SUCCEEDED", "train", "tiny-local.yaml"] in rows
    assert all(r[0] in ("rl-stop", "rl-resume") for r in rows)  # local-up's probe jobs: not ours

    # Both drivers read and deleted their credentials file: no file of the cluster (logs,
    # unpacked runtime_env packages) holds the secret.
    assert files_holding(head["state"], secret) == files_holding(head["state"], hf_token) == []
    # Nor does any worker get their package: the driver drops it from the job config its
    # ray.init passes on. The runtime-env agent logs each runtime_env it sets up; the
    # workers' are those with raylora's setup hook, the driver's own has the package.
    pkgs = [jobs.client(None).get_job_info(j).runtime_env["py_modules"][0] for j in ("rl-stop", "rl-resume")]
    pkgs = [p.removeprefix("gcs://").removesuffix(".zip") for p in pkgs]
    (agent_log,) = {os.path.realpath(p) for p in glob.glob(  # session_latest links the one session
        os.path.join(head["state"], "**", "runtime_env_agent.log"), recursive=True)}
    lines = open(agent_log).read().splitlines()
    workers = [line for line in lines if "worker_process_setup_hook" in line]
    assert workers and not [line for line in workers if any(p in line for p in pkgs)]
    assert all(any(p in line for line in lines) for p in pkgs)  # the drivers' envs name them


def test_a_search_config_is_submitted_as_a_search(head, tiny_model, demo_data, moto_endpoint,
                                                  tmp_path, capsys, monkeypatch):
    """A config with a tune: section runs as `raylora tune` on the cluster (before, submit
    ran `raylora train` on it: one run of the base config). Submitting it again with
    another config is refused here, before a job is sent, as `raylora tune` refuses it.
    The trials read their data from S3 with the submitter's keys, which no file of the
    cluster holds (Tune copied them into every trial actor's logged env_vars)."""
    from raylora import jobs

    monkeypatch.setenv("RAY_ADDRESS", head["dashboard"])
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", head["token"])
    secret = "rAyLoRa/Tune+" + uuid.uuid4().hex
    for k, v in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "AKIARAYLORATUNE00024",
                 "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    data = _shards_in_s3(moto_endpoint, "raylora-submit-tune", demo_data)
    out = tmp_path / "out"
    space = json.dumps({"train.learning_rate": {"grid": [1e-3, 5e-4]}})
    overrides = [f"model.pretrained={tiny_model}", f"data.uri={data}", f"output.uri={out}",
                 "train.max_steps=4", "train.batch_size=2", "train.lr_warmup_steps=0",
                 "scaling.num_workers=1", "checkpoint.every_n_steps=4", f"tune.search_space={space}",
                 "tune.num_samples=1", "tune.metric=train_loss", "tune.scheduler=fifo"]
    config = os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")

    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-tune"]) == 0
    capsys.readouterr()
    info = jobs.client(None).get_job_info("rl-tune")
    assert info.entrypoint.startswith("python -m raylora tune jobs/configs/tiny-local.yaml ")
    assert main(["status", "rl-tune"]) == 0
    assert ("raylora: a search (raylora tune): each trial's progress lines and Tune's trial "
            "table are in `raylora logs rl-tune`") in capsys.readouterr().out
    assert main(["logs", "-f", "rl-tune"]) == 0
    text = capsys.readouterr().out
    assert "raylora: best adapter" in text and "Trial status: 2 TERMINATED" in text, text
    assert len(set(re.findall(r"^raylora: (trial_\S+) step \d+/\d+ ", text, re.M))) == 2, text
    wait_for(lambda: jobs.status("rl-tune")[0] == "SUCCEEDED", 60, "SUCCEEDED")
    # Status then shows each trial's last line (the search's progress.json) under the pointer.
    assert main(["status", "rl-tune"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[:2] == ["raylora: job rl-tune SUCCEEDED",
                         "raylora: a search (raylora tune): each trial's progress lines and "
                         "Tune's trial table are in `raylora logs rl-tune`"]
    assert [re.match(r"raylora: (trial_\S+) step (\d+)/4 ", x)[2] for x in shown[2:]] == ["4", "4"]
    doc = json.loads((out / "tune" / "results.json").read_text())
    assert sorted(r["train.learning_rate"] for r in doc["trials"]) == [5e-4, 1e-3]
    assert all(r["status"] == "completed" and r["steps"] == 4 for r in doc["trials"]), doc
    assert (out / "best" / "adapter" / "pytorch_lora_weights.safetensors").exists()
    assert files_holding(head["state"], secret) == []

    assert main(["submit", config, *overrides, "lora.rank=8", "--working-dir", REPO,
                 "--job-id", "rl-tune-changed"]) == 2
    assert "Changed: lora.rank: 4 then, 8 now" in capsys.readouterr().err
    assert "rl-tune-changed" not in [j.submission_id for j in jobs.client(None).list_jobs()]


def test_job_secrets_reach_the_driver_once_and_no_worker(tmp_path, monkeypatch):
    """The driver's side of the credentials package, as Ray lays it out for a submitted
    job's driver: the package's folder on sys.path, its URI in the job config's py_modules
    beside the user's own."""
    from raylora import jobsecrets

    unpacked = tmp_path / "_ray_pkg_0123abcd"
    unpacked.mkdir()
    pkg = jobsecrets.write_package({"AWS_SECRET_ACCESS_KEY": "s3cr3t-0024"}, str(unpacked))
    assert oct(os.stat(os.path.join(pkg, jobsecrets.FILE)).st_mode & 0o777) == "0o600"
    other = "gcs://_ray_pkg_feedbeef.zip"
    config = {"runtime_env": {"py_modules": [other, "gcs://_ray_pkg_0123abcd.zip"],
                              "env_vars": {jobsecrets.ENV: "1"}}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    monkeypatch.setenv(jobsecrets.ENV, "1")
    # The secret load() sets is removed after the test by conftest's _environ_restored.
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.syspath_prepend(str(unpacked))

    jobsecrets.load()
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-0024"
    assert not os.path.exists(os.path.join(pkg, jobsecrets.FILE))
    seen = json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"])
    assert seen["runtime_env"]["py_modules"] == [other]  # the user's package stays
    assert seen["runtime_env"]["env_vars"] == {jobsecrets.ENV: "1"}
    # A second read (the file is gone) is an error that names the package, not a run
    # that fails later on storage without credentials.
    with pytest.raises(SystemExit, match=jobsecrets.PACKAGE):
        jobsecrets.load()


def test_submit_sends_the_paths_it_checked(tmp_path, monkeypatch):
    """`raylora submit jobs/configs/tiny-local.yaml` checked runs/demo/... here, and the job
    resolved the same relative paths in its unpacked working dir, which has no runs/ and no
    weights (it failed there; a relative output or cache went into Ray's temporary copy).
    Every key holding a relative local path goes as an override with the absolute path,
    sections (data.sources, a list of class sources) whole; storage URIs and hub ids as
    they were. Parsed back as the job parses its overrides, they are the checked config."""
    import json

    from raylora.config import apply_overrides, validate
    from raylora.jobs import path_overrides
    from raylora.launch import resolve_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "model").mkdir(parents=True)
    tree = {"model": {"pretrained": "runs/demo/model"},
            "data": {"sources": [{"uri": "runs/demo/data", "weight": 2.0}, {"uri": "s3://b/more", "weight": 1.0}],
                     "cache": "latents", "cache_uri": "runs/cache", "center_crop": True,
                     "validation_uri": "runs/held", "class_prompt": "a dog",
                     "class_sources": [{"uri": "runs/class", "prompt": "a dog"}]},
            "output": {"uri": "out"}, "lora": {"init_from": "hf://org/adapter"}}
    cfg = validate(tree)
    sent = path_overrides(cfg, resolve_paths(cfg))
    assert [o.split("=", 1)[0] for o in sent] == [
        "data.cache_uri", "data.class_sources", "data.sources", "data.validation_uri",
        "model.pretrained", "output.uri"]
    assert f'model.pretrained="{tmp_path}/runs/demo/model"' in sent
    job = validate(apply_overrides(tree, sent))  # what the job's driver reads
    assert job.model.pretrained == f"{tmp_path}/runs/demo/model" and job.output.uri == f"{tmp_path}/out"
    assert [(s.uri, s.weight) for s in job.data.sources] == [(f"{tmp_path}/runs/demo/data", 2.0), ("s3://b/more", 1.0)]
    assert job.data.class_sources[0].uri == f"{tmp_path}/runs/class" and job.data.cache_uri == f"{tmp_path}/runs/cache"
    assert job.lora.init_from == "hf://org/adapter"
    assert path_overrides(job, resolve_paths(job)) == []  # nothing relative left
    assert json.loads(sent[-1].split("=", 1)[1]) == f"{tmp_path}/out"
    # An edit run's preview inputs, read by rank 0 in the run's directory (Ray Train
    # chdirs its workers there): a relative one passed the checks and failed the run.
    edit = validate({"model": {"pretrained": "runs/demo/model"}, "output": {"uri": "out"},
                     "data": {"uri": "d", "control_images": True, "control_inputs": 2},
                     "validation": {"prompts": ["p", "q"], "control_images": [
                         ["in/a.png", "in/b.png"], ["s3://b/x.png", "in/c.png"]]}})
    assert resolve_paths(edit).validation.control_images == [
        [f"{tmp_path}/in/a.png", f"{tmp_path}/in/b.png"], ["s3://b/x.png", f"{tmp_path}/in/c.png"]]
    assert "validation.control_images" in [o.split("=", 1)[0] for o in path_overrides(edit, resolve_paths(edit))]


def test_status_reads_progress_through_the_configs_storage_endpoint(moto_endpoint, monkeypatch):
    """The run's progress.json in an S3-compatible store named only by the config's
    storage.endpoint_url: `status` read it with the AWS_* settings alone, failed, and
    showed no line. The endpoint travels in the job's metadata."""
    import boto3
    from ray.job_submission import JobInfo, JobStatus

    from raylora.jobs import STORAGE, last_progress
    from raylora.storage import Storage

    for k in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIARAYLORASTATUS025")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "status-secret")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket="rl-status")
    line = {"line": "raylora: step 9/40 (22%) loss 1.13"}
    Storage(moto_endpoint).write_bytes("s3://rl-status/run/progress.json", json.dumps(line).encode())

    def info(meta):
        return JobInfo(status=JobStatus.RUNNING, entrypoint="python -m raylora train c.yaml",
                       metadata={"raylora_output": "s3://rl-status/run", **meta})

    assert last_progress(info({STORAGE: json.dumps({"endpoint_url": moto_endpoint})})) == line


def test_status_shows_no_line_another_job_of_the_config_wrote(tmp_path):
    """`raylora stop rl-stop`, then the config submitted again as rl-resume: both read
    {output.uri}/progress.json. The stopped job showed the running one's line, and the new
    one the stopped one's (ETA included) before its own first step."""
    from ray.job_submission import JobInfo, JobStatus

    from raylora.jobs import last_progress

    def info(status, start, end=None):
        return JobInfo(status=status, entrypoint="python -m raylora train c.yaml",
                       metadata={"raylora_output": str(tmp_path)},
                       start_time=int(start * 1000), end_time=None if end is None else int(end * 1000))

    def written(at):
        row = {"line": "raylora: step 9/40", "time": at}
        (tmp_path / "progress.json").write_text(json.dumps(row))
        return row

    stopped, resumed = info(JobStatus.STOPPED, 1000, 1100), info(JobStatus.RUNNING, 1200)
    row = written(1090)
    assert last_progress(stopped) == row and last_progress(resumed) is None
    row = written(1300)
    assert last_progress(stopped) is None and last_progress(resumed) == row


def test_status_of_a_search_shows_no_trial_line_another_job_wrote(tmp_path, monkeypatch, capsys):
    """A search's progress.json is {"trials": {label: row}}, with no top-level time: the
    time check never applied, so a stopped search showed the resuming job's trial lines
    as its own, and the resumed one (before its first step) the stopped one's. Each
    trial's row is judged by its own time; none left: no line."""
    from ray.job_submission import JobInfo, JobStatus

    from raylora import jobs, progress
    from raylora.storage import Storage

    def info(status, start, end=None):
        return JobInfo(status=status, entrypoint="python -m raylora tune c.yaml",
                       metadata={"raylora_output": str(tmp_path), jobs.COMMAND: "tune"},
                       start_time=int(start * 1000), end_time=None if end is None else int(end * 1000))

    def row(label, at, tag):
        return {"label": label, "line": f"raylora: {label} step 3/40 (7%) {tag}", "time": at}

    stopped, resumed = info(JobStatus.STOPPED, 1000, 1100), info(JobStatus.RUNNING, 1200)
    sink = progress.write_search_progress(Storage(), str(tmp_path))  # the stopped search's driver
    sink(row("trial_a", 1050, "OLD-a"))
    sink(row("trial_b", 1090, "OLD-b"))
    assert sorted(jobs.last_progress(stopped)["trials"]) == ["trial_a", "trial_b"]
    assert jobs.last_progress(resumed) is None
    sink = progress.write_search_progress(Storage(), str(tmp_path))  # the resumed search's
    sink(row("trial_a", 1300, "NEW-a"))
    assert jobs.last_progress(stopped) is None
    assert jobs.last_progress(resumed) == {"trials": {"trial_a": row("trial_a", 1300, "NEW-a")}}
    # one file holding both jobs' rows: each row judged by its own time
    (tmp_path / "progress.json").write_text(json.dumps(
        {"trials": {"trial_a": row("trial_a", 1300, "NEW-a"), "trial_b": row("trial_b", 1090, "OLD-b")}}))
    assert list(jobs.last_progress(stopped)["trials"]) == ["trial_b"]
    assert list(jobs.last_progress(resumed)["trials"]) == ["trial_a"]

    monkeypatch.setattr(jobs, "client", lambda address: types.SimpleNamespace(get_job_info=lambda job: stopped))
    assert main(["status", "rl-tune-stopped"]) == 0
    assert capsys.readouterr().out == (
        "raylora: job rl-tune-stopped STOPPED\n"
        "raylora: a search (raylora tune): each trial's progress lines and Tune's trial table are in "
        "`raylora logs rl-tune-stopped`\n"
        "raylora: trial_b step 3/40 (7%) OLD-b\n")


def test_status_says_when_the_progress_file_cannot_be_read_from_here(tmp_path, monkeypatch, capsys):
    """`raylora status` of a job whose output this machine cannot read (a store only the
    cluster reaches, a 403) said "no step yet", after 81-92 s of retries: now it names
    the file and why, in a few seconds, with no credential in the line. A file not there
    yet is still "no step yet"."""
    import time

    from ray.job_submission import JobInfo, JobStatus

    from raylora import jobs

    def status(out: str, meta: dict | None = None) -> str:
        info = JobInfo(status=JobStatus.RUNNING, entrypoint="python -m raylora train c.yaml",
                       metadata={"raylora_output": out, **(meta or {})},
                       start_time=int(time.time() * 1000) - 3_600_000)
        monkeypatch.setattr(jobs, "client", lambda address: types.SimpleNamespace(get_job_info=lambda job: info))
        assert main(["status", "rl-running"]) == 0
        return capsys.readouterr().out

    (tmp_path / "missing").mkdir()
    assert status(str(tmp_path / "missing")) == "raylora: job rl-running RUNNING\nraylora: no step yet\n"
    (tmp_path / "odd" / "progress.json").mkdir(parents=True)  # there, but no file to read
    assert status(str(tmp_path / "odd")) == (
        f"raylora: job rl-running RUNNING\nraylora: {tmp_path}/odd/progress.json is not readable from "
        f"here (Cannot open for reading: path '{tmp_path}/odd/progress.json' is a directory); the run's "
        "progress lines are in `raylora logs rl-running`\n")

    # An endpoint only the cluster reaches (nothing listens on port 9 here)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASTATUSUNREAD0001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "status-unreadable-secret")
    t = time.monotonic()
    out = status("s3://runs/pets-lora", {jobs.STORAGE: json.dumps({"endpoint_url": "http://127.0.0.1:9"})})
    assert time.monotonic() - t < 15
    assert out.startswith("raylora: job rl-running RUNNING\nraylora: s3://runs/pets-lora/progress.json is "
                          "not readable from here (")
    assert "Could not connect" in out and out.endswith("; the run's progress lines are in "
                                                       "`raylora logs rl-running`\n")
    assert "AKIASTATUSUNREAD0001" not in out and "status-unreadable-secret" not in out


# ---- what `raylora submit` ships and sends (no head: a stand-in for the SDK's client) ----

def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_shipping_answers_what_rays_packaging_ships(tmp_path):
    """`Shipping` says of every file what Ray's own packaging of the working dir does with
    it (the zip it uploads: Ray's default excludes, raylora's EXCLUDES, a --runtime-env
    file's excludes, .gitignore and .rayignore at any depth), and names the rule."""
    from ray._private import ray_constants
    from ray._private.runtime_env import packaging

    from raylora.jobs import EXCLUDES, Shipping

    wd = tmp_path / "wd"
    _tree(wd, {"configs/job.yaml": "x", "runs/my-job.yaml": "x", "mydata/a.parquet": "x",
               "mydata/b.parquet": "x", "model/unet/w.safetensors": "x", "model/unet/config.json": "x",
               ".gitignore": "# ours\nprivate/\n", "private/job.yaml": "x",
               "sub/.gitignore": "*.tmp\n", "sub/keep.txt": "x", "sub/deep/a.tmp": "x",
               ".rayignore": "big/\n", "big/x": "x", "scratch/y": "x", "venv/lib/z.py": "x"})
    extra = ["scratch"]
    ship = Shipping(str(wd), extra, "env.yaml")
    zipped = tmp_path / "wd.zip"
    packaging._zip_files(str(wd), ray_constants.get_runtime_env_default_excludes() + EXCLUDES + extra,
                         str(zipped), include_gitignore=True)
    import zipfile

    sent = {n for n in zipfile.ZipFile(zipped).namelist() if not n.endswith("/")}
    files = {str(p.relative_to(wd)) for p in wd.rglob("*") if p.is_file()}
    assert {f for f in files if ship.skipped(str(wd / f)) is None} == sent
    assert sent == {".gitignore", ".rayignore", "configs/job.yaml", "mydata/a.parquet",
                    "mydata/b.parquet", "model/unet/config.json", "sub/.gitignore", "sub/keep.txt"}
    assert ship.skipped(str(wd / "runs" / "my-job.yaml")) == (
        "runs is excluded by 'runs' in raylora submit's excludes (raylora.jobs.EXCLUDES)")
    assert ship.skipped(str(wd / "private" / "job.yaml")) == (
        f"private/job.yaml is excluded by 'private/' in {wd}/.gitignore (line 2)")
    assert ship.skipped(str(wd / "big" / "x")) == f"big/x is excluded by 'big/' in {wd}/.rayignore (line 1)"
    assert ship.skipped(str(wd / "scratch")) == "scratch is excluded by 'scratch' in the excludes of env.yaml"
    # A folder ships whole or it does not: the one file below it that stays names why.
    assert ship.skipped(str(wd / "model")) == (
        "model/unet/w.safetensors is excluded by '*.safetensors' in raylora submit's excludes "
        "(raylora.jobs.EXCLUDES)")
    assert ship.skipped(str(wd / "sub")) == f"sub/deep/a.tmp is excluded by '*.tmp' in {wd}/sub/.gitignore (line 1)"
    assert ship.skipped(str(wd / "mydata")) is None


def test_a_config_the_working_dir_does_not_ship_is_refused_before_anything(tmp_path, monkeypatch, capsys):
    """A config in runs/ (EXCLUDES) or a .gitignore'd folder: submit printed a job id, the
    job failed reading it ("runs/my-job.yaml: cannot read config file"). Refused here,
    naming the config and the rule, before the config's checks and the cluster."""
    from raylora import jobs

    wd = tmp_path / "wd"
    config = open(os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")).read()
    _tree(wd, {"runs/my-job.yaml": config, "private/job.yaml": config, ".gitignore": "private/\n",
               "configs/job.yaml": config})
    monkeypatch.chdir(wd)
    monkeypatch.setattr(jobs, "client", lambda address: pytest.fail("the cluster was asked"))

    with pytest.raises(ValueError) as e:
        jobs.entrypoint("train", "runs/my-job.yaml", [], ".")
    assert str(e.value) == (
        "runs/my-job.yaml: the working dir . is shipped without it (runs is excluded by 'runs' in "
        "raylora submit's excludes (raylora.jobs.EXCLUDES)), so the job could not read it; keep "
        "the config in a folder that is shipped (such as jobs/configs/)")
    assert main(["submit", "private/job.yaml", "--job-id", "rl-private"]) == 2
    err = capsys.readouterr().err
    assert err == (f"raylora: error: private/job.yaml: the working dir . is shipped without it "
                   f"(private/job.yaml is excluded by 'private/' in {wd}/.gitignore (line 1)), so the job could not read "
                   "it; keep the config in a folder that is shipped (such as jobs/configs/)\n")
    assert jobs.entrypoint("train", "configs/job.yaml", ["a=1"], ".") == (
        "python -m raylora train configs/job.yaml a=1")
    with pytest.raises(ValueError, match="must be inside the working dir"):
        jobs.entrypoint("train", str(tmp_path / "elsewhere.yaml"), [], ".")


def test_a_relative_path_the_working_dir_ships_stays_relative(tmp_path, monkeypatch):
    """README: a relative local path the working dir ships "stays relative to it"; what it
    does not ship, what lies outside it and every place the job writes go absolute.
    Before, every relative path went as this machine's absolute path, which a remote head
    (KubeRay) lacks: the job failed after uploading the data it ignored."""
    from raylora.config import apply_overrides, validate
    from raylora.jobs import path_overrides
    from raylora.launch import resolve_paths

    wd = tmp_path / "wd"
    _tree(wd, {"mydata/a.parquet": "x", "more/b.parquet": "x", "runs/held/c.parquet": "x",
               "in/a.png": "x", "in/w.safetensors": "x", "cache/.keep": "x", "private/d.parquet": "x",
               ".gitignore": "private/\n"})
    _tree(tmp_path, {"outside/e.parquet": "x"})
    monkeypatch.chdir(wd)
    tree = {"model": {"pretrained": str(tmp_path / "model")},
            "data": {"sources": [{"uri": "mydata"}, {"uri": "private"}, {"uri": "../outside"},
                                 {"uri": "more/*.parquet"}],
                     "validation_uri": "runs/held", "cache": "latents", "cache_uri": "cache", "center_crop": True,
                     "control_images": True, "control_inputs": 1},
            "validation": {"prompts": ["p", "q"], "control_images": [["in/a.png"], ["in/w.safetensors"]]},
            "output": {"uri": "out"}}
    cfg = validate(tree)
    sent = path_overrides(cfg, resolve_paths(cfg))
    assert [o.split("=", 1)[0] for o in sent] == [
        "data.cache_uri", "data.sources", "data.validation_uri", "output.uri", "validation.control_images"]
    assert f'data.cache_uri="{wd}/cache"' in sent  # written: absolute, though shipped
    assert f'data.validation_uri="{wd}/runs/held"' in sent and f'output.uri="{wd}/out"' in sent
    assert f'validation.control_images=[["in/a.png"], ["{wd}/in/w.safetensors"]]' in sent
    job = validate(apply_overrides(tree, sent))  # what the job's driver reads
    assert [s.uri for s in job.data.sources] == ["mydata", f"{wd}/private", f"{tmp_path}/outside", "more/*.parquet"]

    # Submitted from a folder below the working dir: a shipped path goes as the path from
    # the working dir (the job's cwd), not as typed.
    from raylora.jobs import Shipping

    (wd / "sub").mkdir()
    monkeypatch.chdir(wd / "sub")
    cfg = validate({"model": {"pretrained": str(tmp_path / "model")}, "data": {"uri": "../mydata"},
                    "output": {"uri": str(tmp_path / "o")}})
    assert path_overrides(cfg, resolve_paths(cfg), Shipping(str(wd))) == ['data.uri="./mydata"']


def _runtime_env_file(tmp_path, text: str) -> str:
    path = tmp_path / "env.yaml"
    path.write_text(text)
    return str(path)


def test_runtime_env_file_is_merged_into_what_submit_sends(tmp_path, monkeypatch):
    """`raylora submit --runtime-env FILE` adds a runtime_env file's fields as `ray job
    submit --runtime-env` does (before, submit sent no pip/uv field and had no way to:
    a job on the stock rayproject/ray image could only fail). jobs/runtime_env.yaml loads
    through it; its env_vars go beside submit's own, the credentials stay in their package."""
    from raylora import jobs, jobsecrets
    from raylora.config import validate

    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "AWS_REGION", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-runtime-env")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored hub token
    cfg = validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}})
    extra = jobs.load_runtime_env(os.path.join(REPO, "jobs", "runtime_env.yaml"), REPO)
    assert "torch>=2.6" in extra["pip"]["packages"] and extra["env_vars"] == {"HF_HUB_DISABLE_TELEMETRY": "1"}
    extra["py_modules"] = ["gcs://_ray_pkg_theirs.zip"]
    renv = jobs.runtime_env(cfg, REPO, str(tmp_path), extra, "jobs/runtime_env.yaml")
    assert renv["pip"] == extra["pip"] and renv["working_dir"] == REPO
    assert renv["env_vars"]["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert renv["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(int(cfg.failure.stop_timeout_s) + 30)
    assert renv["env_vars"][jobsecrets.ENV] == "1" and "s3cr3t" not in json.dumps(renv["env_vars"])
    assert renv["py_modules"][0] == "gcs://_ray_pkg_theirs.zip"
    assert renv["py_modules"][1].endswith(jobsecrets.PACKAGE) and len(renv["py_modules"]) == 2
    assert renv["excludes"] == jobs.EXCLUDES

    def refused(text: str) -> str:
        with pytest.raises(ValueError) as e:
            jobs.load_runtime_env(_runtime_env_file(tmp_path, text), str(tmp_path))
        return str(e.value)

    f = str(tmp_path / "env.yaml")
    msg = refused("env_vars:\n  AWS_SECRET_ACCESS_KEY: abc\n")
    assert msg.startswith(f"{f}: env_vars.AWS_SECRET_ACCESS_KEY: looks like a credential, and Ray "
                          "writes a job's env_vars to its log on the head and shows them in `ray job list`")
    assert "apart from env_vars (raylora.jobsecrets): export it here instead" in msg
    assert refused("env_vars:\n  DB_PASSWORD: abc\n").startswith(f"{f}: env_vars.DB_PASSWORD: looks like a credential")
    assert refused("working_dir: /elsewhere\n") == (
        f"{f}: working_dir: raylora submit ships --working-dir ({tmp_path}); remove working_dir "
        "from the file, or pass --working-dir /elsewhere")
    assert refused("pipp: [torch]\n").startswith(f"{f}: pipp: not a runtime_env field Ray knows (")
    assert refused("pip: [torch]\nconda: {dependencies: [x]}\n").startswith(
        f"{f}: The 'pip' field, 'uv' field, and 'conda' field of runtime_env cannot be specified")
    assert refused("- pip\n") == (f"{f}: a runtime_env file is a mapping of runtime_env fields "
                                  "(pip, env_vars, ...), not a list")
    assert refused("worker_process_setup_hook: x.y\n").startswith(f"{f}: worker_process_setup_hook: raylora's")
    # Not a credential: a tokenizer setting. The same working_dir as --working-dir is fine.
    assert jobs.load_runtime_env(_runtime_env_file(tmp_path, f"working_dir: {tmp_path}\nenv_vars:\n"
                                                   "  TOKENIZERS_PARALLELISM: 'false'\n"), str(tmp_path)) == {
        "env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    # A variable submit sets itself, to another value: refused, saying where it comes from.
    clash = jobs.load_runtime_env(_runtime_env_file(tmp_path, "env_vars:\n  RAY_JOB_STOP_WAIT_TIME_S: '5'\n"),
                                  str(tmp_path))
    with pytest.raises(ValueError) as e:
        jobs.runtime_env(cfg, REPO, None, clash, "env.yaml")
    assert str(e.value) == (f"env.yaml: env_vars.RAY_JOB_STOP_WAIT_TIME_S: raylora submit sets it to "
                            f"'{int(cfg.failure.stop_timeout_s) + 30}' (failure.stop_timeout_s + 30: "
                            "change failure.stop_timeout_s); remove it from the file")


def test_runtime_env_takes_key_file_paths_and_switches_not_secrets(tmp_path):
    """A --runtime-env file's paths to key files mounted on the nodes and the hub's switch
    that turns its token off were refused as "looks like a credential": the file is the
    secret, not its path. The secrets themselves, and a token pasted into a path's
    variable, are still refused."""
    from raylora import jobs

    def load(name: str, value: str) -> dict:
        return jobs.load_runtime_env(_runtime_env_file(tmp_path, f"env_vars:\n  {name}: {value!r}\n"),
                                     str(tmp_path))

    fine = {"GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/gcp/key.json",
            "AWS_SHARED_CREDENTIALS_FILE": "/etc/aws/credentials",
            "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks/token",
            "HF_TOKEN_PATH": "~/hf/token", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    for name, value in fine.items():
        assert load(name, value) == {"env_vars": {name: value}}, name
    refused = {"AWS_SECRET_ACCESS_KEY": "abc", "HF_TOKEN": "hf_abc", "DB_PASSWORD": "abc",
               "GITHUB_TOKEN": "ghp_abc", "OPENAI_API_KEY": "sk-abc", "MY_SECRET": "abc",
               "GOOGLE_APPLICATION_CREDENTIALS": '{"private_key": "abc"}',
               "HF_TOKEN_PATH": "hf_pastedtoken", "DB_PASSWORD_FILE": "hunter2"}
    for name, value in refused.items():
        with pytest.raises(ValueError, match=f"env_vars.{name}: looks like a credential"):
            load(name, value)


class _Cluster:
    """The SDK's client as `raylora submit|status|logs|stop` use it, for a cluster that
    has the jobs in ``jobs`` (id → final state)."""

    def __init__(self, jobs: dict[str, str] | None = None):
        self.jobs, self.sent = dict(jobs or {}), None

    def _job(self, job):
        if job not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {job} does not exist.")
        return self.jobs[job]

    def get_job_info(self, job):
        from ray.job_submission import JobInfo, JobStatus

        return JobInfo(status=JobStatus(self._job(job)), entrypoint="python -m raylora train c.yaml",
                       metadata={})

    def get_job_status(self, job):
        from ray.job_submission import JobStatus

        return JobStatus(self._job(job))

    def get_job_logs(self, job):
        return f"log of {self._job(job)}\n"

    def stop_job(self, job):
        return self._job(job) and False

    async def tail_job_logs(self, job):
        yield f"log of {self._job(job)}\n"

    def submit_job(self, **kw):
        self.sent = kw
        return kw.get("submission_id") or "raysubmit_x"


def test_job_commands_answer_in_one_line(monkeypatch, capsys):
    """An unknown job id (status|logs|stop) gave the SDK's traceback ("Request failed with
    status code 404"); now one line, exit 2. `logs -f` of a job that ended FAILED or STOPPED
    exited 0, as if it had succeeded: now 1, and says so."""
    from raylora import jobs

    cluster = _Cluster({"rl-failed": "FAILED", "rl-stopped": "STOPPED", "rl-done": "SUCCEEDED"})
    monkeypatch.setattr(jobs, "client", lambda address: cluster)
    for cmd in (["status"], ["logs"], ["logs", "-f"], ["stop"]):
        assert main([*cmd, "no-such-job"]) == 2, cmd
        assert capsys.readouterr().err == ("raylora: error: no-such-job: no job with this id on the "
                                           "cluster (`raylora list` names raylora's jobs)\n")
    assert main(["logs", "-f", "rl-done"]) == 0
    assert capsys.readouterr().out == "log of SUCCEEDED\n"
    for job, state in (("rl-failed", "FAILED"), ("rl-stopped", "STOPPED")):
        assert main(["logs", "-f", job]) == 1
        seen = capsys.readouterr()
        assert seen.out == f"log of {state}\n" and seen.err == f"raylora: job {job} {state}\n"
    # Any other answer: its last line (a server-side traceback's error), exit 1.
    problem = jobs.sdk_problem(RuntimeError(
        "Request failed with status code 500: Traceback (most recent call last):\n  File x\n"
        "ValueError: Job with submission_id a already exists. Please use a different submission_id.\n.\n."), "a")
    assert problem == ("the cluster's job API answered 500: ValueError: Job with submission_id a "
                       "already exists. Please use a different submission_id", 1)
    assert jobs.sdk_problem(RuntimeError("something else"), "a") is None


def test_submit_refuses_a_taken_job_id_first_and_sends_the_runtime_env(
        tiny_model, demo_data, tmp_path, monkeypatch, capsys):
    """A --job-id the cluster has (README's resume advice reused one) failed after every
    check and the upload with 36 lines and 3 tracebacks: refused first, saying to pass
    another id or omit it and how to resume. A free id: the job is sent with the data the
    working dir ships as a relative path, and a --runtime-env file's pip and env_vars."""
    import shutil

    from raylora import jobs, launch

    wd = tmp_path / "wd"
    shutil.copytree(demo_data, wd / "mydata")
    (wd / "configs").mkdir()
    (wd / "configs" / "job.yaml").write_text(
        open(os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")).read()
        .replace("runs/demo/model", tiny_model).replace("uri: runs/demo/data", "uri: mydata")
        .replace("runs/demo/output", str(tmp_path / "out")))
    env = _runtime_env_file(tmp_path, "pip: [torch>=2.4]\nenv_vars:\n  HF_HUB_DISABLE_TELEMETRY: '1'\n")
    monkeypatch.chdir(wd)
    cluster = _Cluster({"rl-stop": "STOPPED"})
    monkeypatch.setattr(jobs, "client", lambda address: cluster)
    checked = launch.checked
    monkeypatch.setattr(launch, "checked", lambda *a, **k: pytest.fail("checked before the id"))

    args = ["submit", "configs/job.yaml", "train.max_steps=6"]
    assert main([*args, "--job-id", "rl-stop"]) == 2
    assert capsys.readouterr().err == (
        "raylora: error: --job-id rl-stop: the cluster already has a job with this id (STOPPED); a "
        "job id is used once: pass another id or omit --job-id (Ray makes one). To resume that "
        "job's run, submit the same config under a new id: it resumes from the last checkpoint "
        "in its output.uri\n")
    assert cluster.sent is None

    monkeypatch.setattr(launch, "checked", checked)
    assert main([*args, "--runtime-env", env, "--job-id", "rl-resume"]) == 0
    assert capsys.readouterr().out == "rl-resume\n"
    # data.uri: mydata, as written (shipped); model and output: absolute already
    assert cluster.sent["entrypoint"] == "python -m raylora train configs/job.yaml train.max_steps=6"
    renv = cluster.sent["runtime_env"]
    assert renv["pip"] == ["torch>=2.4"] and renv["env_vars"]["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert renv["working_dir"] == str(wd)


def test_submit_sizes_the_job_by_the_clusters_gpus_not_this_machines(
        tiny_model, demo_data, tmp_path, monkeypatch, capsys):
    """`raylora submit --address URL` checked the job's memory against THIS machine's GPU
    (a laptop's small card) and refused it with exit 3, while the same submit with
    RAY_ADDRESS=URL left it to the job's driver, which reads the cluster's GPUs. Both
    now leave it to the cluster; a scaling.gpu_memory_gb that is set is still checked here."""
    from raylora import jobs, preflight
    from raylora.config import load_config

    wd = tmp_path / "wd"
    (wd / "configs").mkdir(parents=True)
    (wd / "configs" / "gpu.yaml").write_text(
        open(os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")).read()
        .replace("runs/demo/model", tiny_model).replace("runs/demo/data", demo_data)
        .replace("runs/demo/output", str(tmp_path / "out")).replace("use_gpu: false", "use_gpu: true"))
    monkeypatch.chdir(wd)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # this machine: a 512 MiB GPU, which the tiny model's ~800 MiB step does not fit
    laptop = preflight.GpuSize(0.5, "detected: Laptop GPU")
    monkeypatch.setattr(preflight, "_local_gpu", lambda: laptop)
    assert preflight.gpu_size(load_config("configs/gpu.yaml", [])) == laptop
    cluster = _Cluster()
    monkeypatch.setattr(jobs, "client", lambda address: cluster)

    address = ["--address", "http://gpu-cluster:8265", "--job-id", "rl-gpu"]
    assert main(["submit", "configs/gpu.yaml", *address]) == 0
    assert capsys.readouterr().out == "rl-gpu\n"
    assert cluster.sent["entrypoint"].startswith("python -m raylora train configs/gpu.yaml")
    cluster.sent = None
    assert main(["submit", "configs/gpu.yaml", "scaling.gpu_memory_gb=0.5", *address]) == preflight.EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert "GPU: 512.0 MiB (scaling.gpu_memory_gb): does NOT fit" in err and cluster.sent is None
