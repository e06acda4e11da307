"""#23 item 3: `raylora submit | status | logs | stop | list` through Ray's Job Submission
SDK against a real local head (cluster/local-up.sh: token auth on), one head for the module.
A clean stop leaves a checkpoint at the step it stopped at; submitting the same config again
resumes from it and finishes the run."""

from __future__ import annotations

import glob
import json
import os
import re
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
    overrides = [f"model.pretrained={tiny_model}", f"data.uri={data}", f"output.uri={out}",
                 f"train.max_steps={MAX_STEPS}", "train.batch_size=2", "train.lr_warmup_steps=0",
                 "train.log_every_n_steps=1", "checkpoint.every_n_steps=100"]
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

    # The same config again resumes from that checkpoint and finishes; logs -f follows it.
    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-resume"]) == 0
    capsys.readouterr()
    assert main(["logs", "-f", "rl-resume"]) == 0
    text = capsys.readouterr().out
    assert f"resumed from step {stopped_at}" in text and f"trained {MAX_STEPS} steps" in text
    wait_for(lambda: jobs.status("rl-resume")[0] == "SUCCEEDED", 60, "SUCCEEDED")
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    assert meta["metrics"]["resumed_from_step"] == stopped_at
    assert meta["metrics"]["steps"] == MAX_STEPS

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
