"""`cluster/local-up.sh` + the real `ray job submit` CLI + `cluster/local-down.sh`; a
driver joining a two-node cluster through RAY_ADDRESS, with its storage settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

from localhead import REPO, files_holding, local_head


@pytest.fixture
def local_cluster(request):
    """A head (+ optional worker node) from the repo's scripts (tests/localhead.py): its
    param is local-up.sh's arguments, and ``"online"`` among them makes its nodes ask a
    hub (``local_head(online=True)``)."""
    args = list(getattr(request, "param", []))
    with local_head([a for a in args if a != "online"], online="online" in args) as c:
        yield c


@pytest.mark.parametrize("local_cluster", [["--cpus", "2"]], indirect=True)
def test_demo_job_via_ray_job_submit_on_a_two_cpu_head(local_cluster, tiny_model, demo_data, tmp_path):
    """The README's path on a 2-core box: cluster/local-up.sh at its default size (one CPU
    per core; given explicitly, so any machine tests a 2-CPU head), a model and data as
    `raylora tiny-model` and `raylora demo-data` write them (the same builders), and the
    `ray job submit` line local-up.sh prints, run as printed from the repo (its paths
    pointed at them, 3 steps). Its 2 workers of 1 CPU would hold both CPUs and leave Ray
    Data's preprocess tasks pending forever; the driver halves their request instead. The
    head was started from a PATH without the venv (tests/localhead.py): the job's `python`
    is the venv's because local-up.sh put it first, and the job built no pip environment."""
    import glob
    import shlex

    c = local_cluster
    assert f"export RAY_ADDRESS={c['address']}" in c["stdout"]
    ray = c["env"]["RAY_BIN"]
    line = [ln for ln in c["stdout"].splitlines() if ln.startswith(f"{ray} job submit ")]
    assert len(line) == 1, c["stdout"]
    argv = shlex.split(line[0])
    assert argv[argv.index("--runtime-env") + 1] == "jobs/runtime_env.local.yaml"
    out = tmp_path / "output"
    paths = {"model.pretrained": tiny_model, "data.uri": demo_data, "output.uri": out}
    for i, arg in enumerate(argv):
        key = arg.split("=", 1)[0]
        if key in paths:
            argv[i] = f"{key}={paths.pop(key)}"
    assert not paths, f"local-up.sh's line names no {sorted(paths)}: {line[0]}"
    argv[3:3] = ["--submission-id", "raylora-demo"]  # after `ray job submit`
    argv += ["train.max_steps=3", "train.lr_warmup_steps=0", "checkpoint.every_n_steps=3"]
    # runs/ is git-ignored and not shipped with the working dir: the paths are absolute.
    submit = subprocess.run(argv, capture_output=True, text=True, env=c["env"], timeout=600, cwd=REPO)
    log = submit.stdout + submit.stderr
    assert submit.returncode == 0, log[-4000:]
    status = subprocess.run([ray, "job", "status", "--address", c["dashboard"], "raylora-demo"],
                            capture_output=True, text=True, env=c["env"], timeout=60)
    assert "job 'raylora-demo' succeeded" in (status.stdout + status.stderr).lower()
    assert "scaling.cpus_per_worker: 1 → 0.5" in log
    assert "trained 3 steps" in log
    meta = json.load(open(out / "adapter" / "raylora.json"))
    assert meta["config"]["scaling"]["cpus_per_worker"] == 0.5
    assert meta["metrics"]["steps"] == 3 and meta["metrics"]["replicas_in_sync"]
    assert (out / "adapter" / "pytorch_lora_weights.safetensors").stat().st_size > 1000
    # Ray keeps a job's pip environment under its session's runtime_resources/pip.
    assert glob.glob(os.path.join(c["state"], "tmp", "session_*", "runtime_resources", "pip", "*")) == []
    # A `ray job stop` of this plain submit SIGKILLs the driver after the stop wait the
    # head's job supervisors inherit from the raylet: 150 s, not Ray's 3 s, so the run's
    # clean stop can write its checkpoint (raylora submit sets it per job instead).
    import psutil

    raylets = [p for p in psutil.process_iter(["name", "cmdline"])
               if p.info["name"] == "raylet" and any(c["state"] in a for a in p.info["cmdline"] or [])]
    assert raylets and all(p.environ().get("RAY_JOB_STOP_WAIT_TIME_S") == "150" for p in raylets)


@pytest.mark.parametrize("local_cluster", [["--worker-node", "--worker-cpus", "2", "online"]],
                         indirect=True)
def test_two_node_spread_from_s3_matches_single_node(
    ray_local, local_cluster, moto_endpoint, hub, tiny_model, demo_data, tmp_path
):
    """Head + a second `ray start --address` node on this machine, both started without
    any AWS_* variables or hub settings, beside this process's own Ray. The driver has them
    and joins through RAY_ADDRESS: STRICT_SPREAD puts one training worker on each node, and
    both load the model from a gated hub repo (tests/hubemu.py: the tiny model), read s3://
    data and write s3:// output (the settings travel as the job's runtime_env; the secrets,
    the S3 key and HF_TOKEN, reach no cluster log). The same job packed onto one node from
    local files (same seed, per-worker shard files) ends with the same adapter."""
    import glob
    import re
    import socket

    import boto3
    from safetensors.torch import load_file

    c = local_cluster
    # This process's Ray holds Ray's fixed dashboard-agent port; local-up.sh's nodes each
    # listen on a free one, and the head took local-up's readiness job through its agent
    # (a head whose agent could not bind its port never took a job, and the second node's
    # agent had no HTTP server).
    with pytest.raises(OSError), socket.socket() as sock:
        sock.bind(("127.0.0.1", 52365))
    agents = glob.glob(os.path.join(c["state"], "tmp", "session_latest", "logs", "dashboard_agent*.log"))
    ports = [int(p) for f in agents
             for p in re.findall(r"Dashboard agent http address: \S+:(\d+)", open(f).read())]
    assert len(ports) == 2 and 52365 not in ports, ports
    assert not any(k.startswith("AWS_") for k in c["env"] if k != "AWS_CA_BUNDLE")
    secret = "rAyLoRa/JoinedClusterSecret+0002"
    aws = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "AKIARAYLORAJOIN0002",
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                      aws_access_key_id=aws["AWS_ACCESS_KEY_ID"], aws_secret_access_key=secret)
    s3.create_bucket(Bucket="raylora-joined")
    for f in sorted(os.listdir(demo_data)):
        if f.endswith(".parquet"):
            s3.upload_file(os.path.join(demo_data, f), "raylora-joined", f"data/{f}")
    token = "hf_RayLoraJoinedCluster0002"
    repo = "org/joined"
    commit = hub.add(repo, tiny_model, token=token)
    hf = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": token}
    # Both runs start from the same adapter: on the hub for the spread run, a folder for the
    # packed one.
    from test_lora_init import _build, _cfg, _random_adapter

    start = tmp_path / "start"
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"])),
                    str(start / "style"))
    start_commit = hub.add("org/joined-lora", str(start))
    logs = []

    def train(strategy: str, model: str, data: str, out: str, init_from: str, extra_env: dict):
        proc = subprocess.run(
            [sys.executable, "-m", "raylora", "train", os.path.join(REPO, "jobs/configs/tiny-local.yaml"),
             f"model.pretrained={model}", f"data.uri={data}", f"output.uri={out}",
             f"lora.init_from={init_from}",
             "train.max_steps=3", "train.batch_size=2", "checkpoint.every_n_steps=3",
             "train.lr_warmup_steps=0", "data.random_flip=false", "data.sharding=files",
             f"scaling.placement_strategy={strategy}"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
            env={**c["env"], **extra_env, "RAY_ADDRESS": c["address"]},
        )
        logs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, logs[-1][-4000:]

    train("STRICT_SPREAD", repo, "s3://raylora-joined/data", "s3://raylora-joined/run",
          "hf://org/joined-lora/style", {**aws, **hf})
    # Every file the driver and both workers asked of the gated repo, with the token (a
    # request without it is refused, and that worker fails), the weights among them.
    asked = [(m, p, t) for m, p, t in hub.seen if p.startswith(f"/{repo}/resolve/")]
    assert {t for _, _, t in asked} == {token}
    # the workers' weights by the commit the driver's plan read (raylora.json names it)
    assert any(m == "GET" and p == f"/{repo}/resolve/{commit}/unet/diffusion_pytorch_model.safetensors"
               for m, p, _ in asked)
    # ...and the adapter's: only the driver asked for main; the workers read the commit
    # it pinned (here from the hub cache the nodes share with the driver on this machine)
    listed = [p for m, p, _ in hub.seen if p.startswith("/api/models/org/joined-lora/revision/")]
    assert listed == ["/api/models/org/joined-lora/revision/main"], listed
    assert f"LoRA layers from hf://org/joined-lora@{start_commit}/style" in logs[-1], logs[-1][-3000:]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="raylora-joined", Prefix="run/")["Contents"]]
    assert any(k.startswith("run/train/checkpoint_") for k in keys)
    spread_dir = tmp_path / "spread"
    spread_dir.mkdir()
    for name in ("raylora.json", "pytorch_lora_weights.safetensors"):
        s3.download_file("raylora-joined", f"run/adapter/{name}", str(spread_dir / name))
    # The packed run reads the same parquet files from a gated dataset repo on the hub
    # (raylora.hubfs): the same rows, so the same adapter. The driver's plan downloads
    # them, with the token, at the commit it read; the workers read that commit's files
    # (here from the hub cache both nodes share with the driver on this machine).
    data_repo = "org/joined-data"
    data_commit = hub.add(data_repo, demo_data, token=token, kind="dataset")
    hub.seen.clear()
    train("STRICT_PACK", tiny_model, f"hf://datasets/{data_repo}", str(tmp_path / "packed"),
          str(start / "style"), hf)
    read = [(m, p, t) for m, p, t in hub.seen if p.startswith(f"/datasets/{data_repo}/resolve/")]
    assert {p.split("/")[5] for _, p, _ in read} == {data_commit}
    assert {t for _, _, t in read} == {token}
    assert {p.rsplit("/", 1)[1] for m, p, _ in read if m == "GET"} == {
        f for f in os.listdir(demo_data) if f.endswith(".parquet")}

    assert json.load(open(spread_dir / "raylora.json"))["data"]["model_commit"] == commit
    card = s3.get_object(Bucket="raylora-joined", Key="run/adapter/README.md")["Body"].read().decode()
    assert f"| base model commit | {commit} |" in card
    assert f"| started from (lora.init_from) | hf://org/joined-lora@{start_commit}/style |" in card
    spread = json.load(open(spread_dir / "raylora.json"))["metrics"]
    packed = json.load(open(tmp_path / "packed" / "adapter" / "raylora.json"))["metrics"]
    spread_w = load_file(spread_dir / "pytorch_lora_weights.safetensors")
    packed_w = load_file(tmp_path / "packed" / "adapter" / "pytorch_lora_weights.safetensors")
    assert len(set(spread["worker_nodes"])) == 2  # one worker per node
    assert len(set(packed["worker_nodes"])) == 1  # both on one node
    assert spread["replicas_in_sync"] and packed["replicas_in_sync"]
    assert spread["steps"] == packed["steps"] == 3
    assert spread["train_loss_last"] == pytest.approx(packed["train_loss_last"], rel=1e-5)
    assert spread_w.keys() == packed_w.keys()
    for k in spread_w:
        assert spread_w[k].abs().max() > 0 or "lora.up" in k
        torch_close = (spread_w[k] - packed_w[k]).abs().max().item()
        assert torch_close <= 1e-6, (k, torch_close)

    assert all(secret not in log and token not in log for log in logs)
    assert files_holding(c["state"], secret, under="/logs/") == []
    assert files_holding(c["state"], token, under="/logs/") == []


def test_local_down_leaves_alone_the_groups_a_dead_cluster_recorded(tmp_path):
    """A cluster that died without local-down.sh (a reboot, an OOM kill, `ray stop`)
    leaves its recorded process-group ids in .ray-local/pgids, and local-up.sh then asks
    for local-down.sh; by then an id may be an unrelated process group's, which it killed.
    A recorded group is signalled only while a process recorded in it runs with the start
    time recorded (no cluster is started here)."""
    state = tmp_path / "state"
    (state / "tmp").mkdir(parents=True)
    (state / "address").write_text("127.0.0.1:6390\n")
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        pgid = os.getpgid(victim.pid)
        (state / "pgids").write_text(
            f"{pgid}\n"  # an old file's line: one id, no proof it is still the cluster's
            f"{pgid} {victim.pid} Mon Jan 5 03:04:05 2026\n")  # the pid's start then: not now
        out = subprocess.run([f"{REPO}/cluster/local-down.sh"], env={**os.environ,
                             "RAYLORA_LOCAL_STATE": str(state)}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"ray cluster in {state} stopped\n"
        assert victim.poll() is None  # still running
        assert not (state / "pgids").exists() and not (state / "address").exists()
    finally:
        victim.kill()
        victim.wait()
