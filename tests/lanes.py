"""`make test`: the suite as two pytest processes side by side, one lane each.

- ray: the ~150 tests that start a Ray (see ``starts_ray`` in conftest.py), in the
  foreground, its most waiting modules first (``WAITING_FIRST`` there). Only one lane
  starts Rays: by default every Ray's dashboard agent listens on the same port (52365).
- free: the other ~1200 (config, loss maths, in-process training, ...), at the lowest CPU
  priority with half the cores' threads, its output kept in a file and printed after.

Why: the Ray tests alone leave the 2 cores here ~20 % idle (Ray processes starting and
waiting on each other, S3 retries' backoff), and the free tests alone need ~500
CPU-seconds. At nice 19 the free lane takes mostly idle CPU, but it still slowed the
CPU-bound Ray tests beside it 1.2-1.7x; beside the most waiting ones it costs the Ray lane
next to nothing (figures in README "Tests").

``LANES=1`` (``make test LANES=1``) or a ``--lane`` of one's own runs one plain pytest.
The exit code is pytest's: the first lane's failure, else 0, or 5 when neither collected
a test (``-k`` can leave one lane empty: that alone is not a failure).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def combined(codes: list[int]) -> int:
    """One exit code for the lanes: a failing lane's, else 5 if none collected a test."""
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


def lane_args(args: list[str], lane: str) -> list[str]:
    """The user's pytest arguments for one lane: a ``--junitxml`` path gets the lane's
    name in it, so the two lanes do not write one file."""
    out = []
    for a in args:
        if a.startswith("--junitxml=") or a.startswith("--junit-xml="):
            key, path = a.split("=", 1)
            stem, ext = os.path.splitext(path)
            a = f"{key}={stem}-{lane}{ext or '.xml'}"
        out.append(a)
    return out + [f"--lane={lane}"]


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", HERE]
    if os.environ.get("LANES", "2") == "1" or any(a.startswith("--lane") for a in argv):
        return subprocess.call(pytest + argv)

    threads = str(max(1, (os.cpu_count() or 2) // 2))
    free_env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with tempfile.NamedTemporaryFile("w+", prefix="raylora-free-lane-", suffix=".log",
                                     delete=False) as log:
        t0 = time.monotonic()
        free = subprocess.Popen(pytest + lane_args(argv, "free"), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=free_env, preexec_fn=lambda: os.nice(19))
        free_done: list[float] = []  # when it ended, though the ray lane may end later
        watcher = threading.Thread(
            target=lambda: (free.wait(), free_done.append(time.monotonic() - t0)), daemon=True)
        watcher.start()
        try:
            print(f"lanes: free lane (pid {free.pid}, nice 19, {threads} thread(s)) writes "
                  f"{log.name}; it is printed after the ray lane below", flush=True)
            ray_code = subprocess.call(pytest + lane_args(argv, "ray"))
            ray_s = time.monotonic() - t0
            watcher.join()
            free_code, free_s = free.returncode, free_done[0]
        finally:
            if free.poll() is None:  # interrupted: the free lane must not outlive us
                free.terminate()
                free.wait()
        log.seek(0)
        print(f"\n{'=' * 30} free lane (output of {shlex.join(free.args[1:])}) {'=' * 30}")
        sys.stdout.write(log.read())
    os.unlink(log.name)
    print(f"lanes: ray exit {ray_code} after {ray_s:.0f} s, free exit {free_code} after "
          f"{free_s:.0f} s", flush=True)
    return combined([ray_code, free_code])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
