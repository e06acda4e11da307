"""A local Ray head (+ optional worker node) started and stopped with the repo's own
cluster/local-up.sh and local-down.sh, as the README tells users to: for the tests of
`ray job submit` (test_cluster_local) and `raylora submit | status | stop` (test_jobs)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all bound at once, since a port closed a moment ago is
    free again and may be handed out twice (seen: GCS and dashboard both given 41729,
    which `ray start` refuses)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def wait_for(predicate, timeout: float, what, every: float = 0.5):
    """``predicate()``'s first true value within ``timeout`` s, polled ``every`` s; else an
    AssertionError naming ``what`` (a string, or a function giving one at the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def ray_processes(state: str) -> list[str]:
    """"pid command line" of every process naming ``state`` (a zombie names nothing)."""
    out = subprocess.run(["pgrep", "-af", "--", state], capture_output=True, text=True).stdout
    return [line[:200] for line in out.splitlines()]


def files_holding(root: str, needle: str, under: str = "") -> list[str]:
    """The files below ``root`` (those whose path contains ``under``) that contain
    ``needle``: where a secret must not be."""
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if under in path and os.path.isfile(path):
                with open(path, "rb") as f:
                    if needle.encode() in f.read():
                        found.append(path)
    return found


@contextlib.contextmanager
def local_head(extra: list[str], online: bool = False):
    """cluster/local-up.sh with ``extra`` (plus a free GCS and dashboard port, and 4 CPUs
    unless given) on a fresh state dir. Yields env (with the cluster's auth token, as
    ``source $STATE/env`` gives a client), state dir, GCS address, dashboard URL and
    local-up's stdout. Always runs local-down.sh, checks that no process of the state dir
    is left and removes it, also when the body failed.
    ``online``: the nodes may ask a Hugging Face hub (not offline, as conftest makes the
    tests) but know none: their HF_ENDPOINT is a closed port, so a worker reaches a hub
    only with the settings its driver forwards. Their hub cache is under the state dir."""
    # Short path: Ray's unix sockets must stay under 107 characters.
    state = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    # PATH without the venv, as in a shell that has not activated it: local-up.sh itself
    # must make a job's `python` the venv's (`raylora submit`'s and the demo line's jobs).
    path = [p for p in os.environ["PATH"].split(os.pathsep)
            if os.path.realpath(p) != os.path.realpath(BIN)]
    env = {**os.environ, "RAYLORA_LOCAL_STATE": state, "RAY_BIN": os.path.join(BIN, "ray"),
           "PATH": os.pathsep.join(path)}
    if online:
        env.update(HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9",
                   HF_HOME=os.path.join(state, "hf"))
    env.pop("RAY_ADDRESS", None)
    port, dash = free_ports(2)
    args = ([] if "--cpus" in extra else ["--cpus", "4"]) + list(extra)
    args += ["--port", str(port), "--dashboard-port", str(dash)]
    try:
        up = subprocess.run([os.path.join(REPO, "cluster", "local-up.sh"), *args],
                            capture_output=True, text=True, env=env, timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        client = {**env, "RAY_AUTH_MODE": "token",
                  "RAY_AUTH_TOKEN_PATH": os.path.join(state, "auth_token")}
        yield {"env": client, "state": state, "address": f"127.0.0.1:{port}",
               "dashboard": f"http://127.0.0.1:{dash}", "stdout": up.stdout,
               "token": os.path.join(state, "auth_token")}
    finally:
        down = subprocess.run([os.path.join(REPO, "cluster", "local-down.sh")],
                              capture_output=True, text=True, env=env, timeout=120)
        left = ray_processes(state)
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, down.stderr
        assert left == [], f"Ray processes left behind: {left}"
