"""#23 item 3: `raylora submit | status | logs | stop | list` through Ray's Job Submission
SDK against a real local head (cluster/local-up.sh: token auth on), one head for the module.
A clean stop leaves a checkpoint at the step it stopped at; submitting the same config again
resumes from it and finishes the run."""

from __future__ import annotations

import json
import os
import time

import pytest

from killer import registered_step
from localhead import REPO, local_head
from raylora.cli import main

pytestmark = pytest.mark.integration

MAX_STEPS = 40


@pytest.fixture(scope="module")
def head():
    with local_head(["--cpus", "4"]) as c:
        yield c


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_submit_status_stop_then_resubmit_resumes_and_finishes(
    head, tiny_model, demo_data, tmp_path, capsys, monkeypatch
):
    from raylora import jobs

    monkeypatch.setenv("RAY_ADDRESS", head["dashboard"])
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", head["token"])
    # A credential the job must get as env, never in its command line.
    secret = "rAyLoRa/SubmitSecret+0023"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIARAYLORASUBMIT023")
    out = tmp_path / "out"
    overrides = [f"model.pretrained={tiny_model}", f"data.uri={demo_data}", f"output.uri={out}",
                 f"train.max_steps={MAX_STEPS}", "train.batch_size=2", "train.lr_warmup_steps=0",
                 "train.log_every_n_steps=1", "checkpoint.every_n_steps=100"]
    config = os.path.join(REPO, "jobs", "configs", "tiny-local.yaml")

    # A config error is refused here, before anything is sent.
    assert main(["submit", config, *overrides, "train.batch_size=0", "--working-dir", REPO]) == 2
    assert "train.batch_size" in capsys.readouterr().err

    assert main(["submit", config, *overrides, "--working-dir", REPO, "--job-id", "rl-stop"]) == 0
    assert capsys.readouterr().out.strip() == "rl-stop"
    info = jobs.client(None).get_job_info("rl-stop")
    assert secret not in info.entrypoint
    assert info.entrypoint.startswith("python -m raylora train jobs/configs/tiny-local.yaml")

    # Running, with the run's own progress line once it has taken a few steps.
    _wait(lambda: (jobs.status("rl-stop")[1] or "").startswith("step ")
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
    _wait(lambda: jobs.status("rl-resume")[0] == "SUCCEEDED", 60, "SUCCEEDED")
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    assert meta["metrics"]["resumed_from_step"] == stopped_at
    assert meta["metrics"]["steps"] == MAX_STEPS

    assert main(["list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["rl-stop", "STOPPED", "tiny-local.yaml"] in rows
    assert ["rl-resume", "SUCCEEDED", "tiny-local.yaml"] in rows
    assert all(r[0] in ("rl-stop", "rl-resume") for r in rows)  # local-up's probe jobs: not ours
