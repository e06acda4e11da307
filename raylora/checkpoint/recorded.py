"""The checkpoints Ray Train recorded for a run, read on the driver before a run starts.

Ray Train V2 keeps its record in ``{run}/checkpoint_manager_snapshot.json``: the checkpoints
it kept and the latest one, which a run with the same storage path and name resumes from.
The snapshot is Ray's internal format: a snapshot that does not read as expected is left to
Ray (nothing deleted, nothing refused).

A run that trains on an output.uri holds ``{output.uri}/lease.json`` while it lives
(``held_lease``): a second run there would delete the first's checkpoints in flight
(``drop_unrecorded``) and both would die, leaving a record no rerun could start from.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from raylora import storage
from raylora.checkpoint.state import EMA_FILE, FILES_FILE, IncompleteCheckpoint, missing_files
from raylora.config import ConfigError

log = logging.getLogger("raylora")

SNAPSHOT = "checkpoint_manager_snapshot.json"
# Recorded settings a rerun may change with a warning: the same base model moved (a
# bucket copied to another, a local mirror) is a legitimate resume a refusal would block
# for good; another base model of the same family loads too, and is what the warning names.
# model.revision: a hub model's commit or a stored folder's version (the run's pin,
# raylora.launch.Plan.model_commit): the repo pushed to, or the folder uploaded again,
# since the checkpoint; resuming on the new weights may be meant.
NOTED = {
    "model.pretrained": "right if it is the same model moved; otherwise give this run its "
                        "own output.uri",
    "model.revision": "on the model as it is now: it changed since the checkpoint (a hub "
                      "repo: set model.revision to the checkpoint's commit to resume on the "
                      "weights it trained with)",
}


def _snapshot(store, run_uri: str) -> dict | None:
    uri = storage.join(run_uri, SNAPSHOT)
    if not store.exists(uri):
        return None
    try:
        snap = json.loads(store.read_bytes(uri))
    except ValueError:
        return None
    return snap if isinstance(snap, dict) else None


def drop_unrecorded(store, run_uri: str) -> list[str]:
    """Delete checkpoint folders Ray Train wrote but never recorded; returns their URIs.

    A process stopped after a checkpoint's upload but before Ray registered it (SIGTERM,
    a lost driver) leaves a complete-looking folder that no run will resume from or count
    against ``checkpoint.num_to_keep``: it would stay in the bucket for good. Called before
    a run starts, when nothing else writes there (the run holds ``held_lease``; a Tune
    trial's folder is its own). Recorded folders deleted by hand are forgotten first
    (``forget_deleted``).
    """
    import pyarrow.fs as pafs

    fs, path = store.fs(run_uri)
    listed = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    folders = {i.base_name for i in listed if i.type == pafs.FileType.Directory}
    if not store.exists(storage.join(run_uri, SNAPSHOT)):
        # no record at all: Ray starts afresh, and a folder from a run stopped during its
        # first checkpoint is one nothing resumes from or counts
        recorded = set()
    else:
        try:
            recorded = {r["checkpoint_dir_name"]
                        for r in forget_deleted(store, run_uri, folders)["checkpoint_results"]}
        except (KeyError, TypeError):
            return []
    dropped = []
    for info in listed:
        if (info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_")
                and info.base_name not in recorded):
            storage.delete_tree(fs, info.path)
            dropped.append(storage.join(run_uri, info.base_name))
    if dropped:
        log.warning("removed %d checkpoint folder(s) that an interrupted run wrote but Ray "
                    "never recorded: %s", len(dropped), ", ".join(dropped))
    return dropped


def forget_deleted(store, run_uri: str, folders: set[str]) -> dict | None:
    """Ray's snapshot of ``run_uri`` without the kept checkpoints whose folders are gone
    (``folders``: the names listed there), written back when any were. Ray refuses to
    start on a snapshot naming a folder that is not there ("corrupted run directory"),
    and kept checkpoints older than the latest are the ones people delete to free space
    (each ``checkpoint_*/adapter/`` is usable alone): nothing resumes from them, so they
    are forgotten, with a warning. A gone latest one is left for ``check_latest`` to
    refuse; a snapshot that does not read as expected is returned as it is, untouched."""
    snap = _snapshot(store, run_uri)
    try:
        results, indices = snap["checkpoint_results"], snap["checkpoint_report_indices"]
        latest = snap["latest_checkpoint_result"]["checkpoint_dir_name"]
        names = [r["checkpoint_dir_name"] for r in results]
        pending = {r["checkpoint_dir_name"] for r in snap.get("pending_training_results") or []}
    except (KeyError, TypeError):
        return snap
    gone = [n for n in names if n not in folders and n != latest]
    if (not gone or len(indices) != len(names) or pending & set(gone)
            or not all(isinstance(n, str) for n in names)):
        return snap
    # checkpoint_report_indices runs beside checkpoint_results, entry for entry
    kept = [i for i, n in enumerate(names) if n not in gone]
    snap = {**snap, "checkpoint_results": [results[i] for i in kept],
            "checkpoint_report_indices": [indices[i] for i in kept]}
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        if isinstance(snap.get(key), list):
            snap[key] = [n for n in snap[key] if n not in gone]
    store.write_bytes(storage.join(run_uri, SNAPSHOT), json.dumps(snap).encode())
    log.warning("forgot %d kept checkpoint(s) whose folders were deleted (Ray would refuse to "
                "start on a record naming them; the run resumes from the latest, %s): %s",
                len(gone), storage.join(run_uri, latest),
                ", ".join(storage.join(run_uri, n) for n in gone))
    return snap


def latest_metrics(store, run_uri: str) -> dict | None:
    """The metrics Ray recorded with the run's latest checkpoint (its loop state: step,
    epoch, batches_in_epoch, ...), None when there is none or the record does not read."""
    try:
        metrics = (_snapshot(store, run_uri) or {})["latest_checkpoint_result"]["metrics"]
    except (KeyError, TypeError):
        return None
    return metrics if isinstance(metrics, dict) else None


def finished_metrics(store, run_uri: str, max_steps: int) -> dict | None:
    """The metrics Ray recorded with the run's latest checkpoint when that is a finished
    run's final one (its step ``max_steps``, the final report's replica digests, no stop):
    run again, the run has nothing to train and exports that checkpoint again. None
    otherwise (then a restored run at ``max_steps`` reports its final checkpoint itself)."""
    metrics = latest_metrics(store, run_uri)
    final = (metrics is not None and metrics.get("step") == max_steps
             and "replica_lora_digests" in metrics and not metrics.get("stopped"))
    return metrics if final else None


def check_latest(store, run_uri: str, trained: dict | None = None) -> str | None:
    """The URI of the checkpoint a run at ``run_uri`` would resume from (None: it starts
    afresh, or Ray's record is unreadable). Raises ``IncompleteCheckpoint`` naming the
    files it lacks of its ``checkpoint_files.json`` (one listing and one small read), so a
    resume that would fail on the workers fails here, before a cluster is started.
    ``trained`` (``state.trained_settings`` of the rerun): a checkpoint that recorded
    other values is refused, naming each key, before a cluster starts: another rank or
    family fails on every worker once the model is up; another alpha, or the other Wan
    2.2 expert, would continue (or, finished, re-export) the LoRA silently changed. Another
    ``model.pretrained`` (``NOTED``) is logged as a warning instead. A key one side lacks
    (a checkpoint from before raylora recorded it) is not compared; ``CHECKED`` keys are
    compared with the checkpoint's files and step instead, whatever raylora wrote it."""
    try:
        latest = (_snapshot(store, run_uri) or {})["latest_checkpoint_result"]
        name = latest["checkpoint_dir_name"]
    except (KeyError, TypeError):
        return None
    uri = storage.join(run_uri, name)
    fs, path = store.fs(uri)
    try:
        present = storage.listed_sizes(fs, path)
    except OSError as exc:
        raise OSError(f"{uri}: cannot list the checkpoint to resume from: {exc}") from None
    if not present:
        raise IncompleteCheckpoint(uri, ["every file (the folder is empty or gone)"])
    problems = []
    if FILES_FILE in present:  # absent: written before raylora recorded its files
        recorded = json.loads(store.read_bytes(storage.join(uri, FILES_FILE)))
        missing = missing_files(recorded, present)
        if missing:
            raise IncompleteCheckpoint(uri, missing)
        # "trained" absent: written before raylora recorded it; a bare "expert": before
        # it recorded more than model.expert
        was = {k if "." in k else f"model.{k}": v for k, v in (recorded.get("trained") or {}).items()}
        now = {k: v for k, v in (trained or {}).items() if k not in CHECKED}
        family = now.get("model.family") or was.get("model.family")
        changed = [k for k in now if k in was
                   and not _same(k, _resolved(k, now[k], family), _resolved(k, was[k], family))]
        for k in (k for k in changed if k in NOTED):
            log.warning("%s: this run has %s, but the checkpoint this output.uri resumes from "
                        "(%s) was trained with %s; resuming (%s)", k, _shown(now[k]), uri,
                        _shown(was[k]), NOTED[k])
        differ = [k for k in changed if k not in NOTED]
        if differ:
            def settings(values):
                return ", ".join(f"{k}={_shown(values[k])}" for k in differ)

            problems.append(
                f"{', '.join(differ)}: this run has {settings(now)}, but the checkpoint this "
                f"output.uri resumes from ({uri}) trained {settings(was)}; set "
                f"{'it' if len(differ) == 1 else 'them'} back to resume that run, or give this "
                "one its own output.uri")
    problems += _unresumable(trained or {}, present, latest.get("metrics"), uri)
    if problems:
        raise ValueError("\n".join(problems))
    return uri


# Settings of a rerun (state.trained_settings) checked against the checkpoint itself, not
# its record: what its files hold, where Ray's record says it stopped.
CHECKED = ("train.ema_decay", "train.max_steps")


def _unresumable(now: dict, present: dict, metrics, uri: str) -> list[str]:
    """EMA switched on or off (the workers refused the one, ignored the other: the resumed
    run published the raw weights where it had published the EMA), and a train.max_steps
    below the checkpoint's step (the run ended at once and exported the checkpoint's
    adapter under a model card naming the lower count)."""
    problems = []
    end = ", or give this one its own output.uri"
    if "train.ema_decay" in now and bool(now["train.ema_decay"]) != (EMA_FILE in present):
        problems.append(
            f"train.ema_decay: this run has train.ema_decay={_shown(now['train.ema_decay'])}, "
            f"but the checkpoint this output.uri resumes from ({uri}) was written with EMA "
            + (f"off (no {EMA_FILE}); unset it to resume that run" if now["train.ema_decay"] else
               f"on ({EMA_FILE}; its adapter is the EMA); set it to resume that run") + end)
    step = metrics.get("step") if isinstance(metrics, dict) else None
    if now.get("train.max_steps") is not None and isinstance(step, int) and now["train.max_steps"] < step:
        problems.append(
            f"train.max_steps: this run has train.max_steps={now['train.max_steps']}, but the "
            f"checkpoint this output.uri resumes from ({uri}) is at step {step}; raise it to "
            f"continue that run (each checkpoint's adapter/ folder holds that step's adapter){end}")
    return problems


def _resolved(key: str, value, family: str | None):
    """``lora.target_modules: null`` as the family's default list, so a rerun that writes
    the default out is the same LoRA (it was refused as another). A family whose default
    names modules by block index has it with ``*`` for the index (``named_lora_targets``),
    which no list a config writes equals: compared as another LoRA, as before."""
    if key != "lora.target_modules" or value is not None or not family:
        return value
    from raylora.model import families

    try:
        return list(families.get(family).named_lora_targets())
    except ValueError:  # an unknown family name: compared as is
        return value


def _same(key: str, a, b) -> bool:
    # Target module lists name a set of modules (peft matches each name on its own): the
    # same names in another order are the same LoRA.
    if key.endswith("target_modules") and isinstance(a, list) and isinstance(b, list):
        return set(a) == set(b)
    return a == b


def _shown(value) -> str:
    """A setting as the config spells it (lists as YAML flow lists, None as null)."""
    return "null" if value is None else json.dumps(value) if isinstance(value, list) else str(value)


# The lease of the run that trains on an output.uri (``held_lease``): renewed every
# LEASE_RENEW_S while the run lives; one not renewed for LEASE_STALE_S is a killed
# driver's (kill -9, a lost node), which the next run takes over.
LEASE = "lease.json"
LEASE_RENEW_S = 60.0
LEASE_STALE_S = 3 * LEASE_RENEW_S
# From writing a lease to reading it back. Object stores have no create-if-absent: two
# runs started together both find none and both write theirs; the one whose write came
# first reads the other's back and is refused.
LEASE_SETTLE_S = 1.0
# This process, in the leases it writes: host and pid alone are not one process (two
# containers on the host network share a host name, and their pids can be the same).
_PROCESS = uuid.uuid4().hex


def _proc_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field); None
    when no such process is running here (a zombie, killed but not yet reaped by its
    parent, is not), or this is not Linux."""
    stat = _proc_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # (the command name may hold spaces)
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _seen_pids() -> dict:
    """Where this process's pid means something: this boot of this machine, this pid
    namespace. A lease written under the same ones names a process this one can look up."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return {}
    boot = _proc_text("/proc/sys/kernel/random/boot_id")
    return {"boot": boot, "pid_ns": ns} if boot else {}


def _gone(held: dict) -> bool:
    """The lease's run is known dead: written on this host, this boot and pid namespace (a
    container on the host network has its own), and its pid runs no process, or another
    one (started at another time). Such a run (kill -9, the OOM killer) is taken over at
    once, not ``LEASE_STALE_S`` later; anything else waits for its lease to go stale."""
    here, pid = _seen_pids(), held.get("pid")
    if (not here or held.get("host") != socket.gethostname() or not isinstance(pid, int)
            or pid <= 0 or any(held.get(k) != v for k, v in here.items())
            or not held.get("pid_start")):
        return False
    return _pid_start(pid) != held["pid_start"]


def check_lease(store, output_uri: str, now: float | None = None) -> dict | None:
    """The lease found at ``output_uri`` when a run may start there: None (there is none),
    this process's own, or a stale or unreadable one, which the run takes over. Raises
    ConfigError naming output.uri and the run holding it when another process renewed it
    within ``LEASE_STALE_S``. Read-only: ``raylora submit`` checks with it too."""
    uri = storage.join(output_uri, LEASE)
    held = _read_lease(store, uri)
    if held is None or _mine(held):
        return held
    age = _age(held, time.time() if now is None else now)
    # (a clock ahead of ours: a negative age, live)
    if age is not None and age < LEASE_STALE_S and not _gone(held):
        raise ConfigError([_in_use(output_uri, uri, held, age)])
    return held


@contextmanager
def held_lease(store, output_uri: str) -> Iterator[dict]:
    """Hold ``{output_uri}/lease.json`` for the body: refused (ConfigError) when another
    live run holds it, a stale one taken over with a warning, renewed every
    ``LEASE_RENEW_S`` from a daemon thread, and removed on the way out (a finished run, a
    stop, an error, Ctrl-C). Yields this run's lease record."""
    uri = storage.join(output_uri, LEASE)
    found = check_lease(store, output_uri)
    if found is not None and not _mine(found):
        age = _age(found, time.time())
        if age is not None and age < LEASE_STALE_S:  # (_gone: its process is not running)
            log.warning("%s: taking over the lease of a run whose process is gone (%s; renewed "
                        "%s ago): it was killed", uri, _holder(found), _span(age))
        else:
            log.warning("%s: taking over the lease of a run that stopped renewing it%s (%s): it "
                        "was killed or lost", uri, f" {_span(age)} ago" if age is not None else "",
                        _holder(found))
    now = time.time()
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "renewed": now,
            "process": _PROCESS, "token": uuid.uuid4().hex, **_seen_pids(),
            "pid_start": _pid_start(os.getpid())}
    made = _folders_to_make(output_uri)
    store.write_bytes(uri, json.dumps(mine, indent=1).encode())
    time.sleep(LEASE_SETTLE_S)
    there = _read_lease(store, uri)
    if there is None or there.get("token") != mine["token"]:
        # another run started at this moment, and its lease is the one there
        raise ConfigError([_in_use(output_uri, uri, there or {}, 0.0)])
    stop, lock = threading.Event(), threading.Lock()
    renewer = threading.Thread(target=_renew, args=(store, uri, mine, stop, lock),
                               name="raylora-lease", daemon=True)
    renewer.start()
    try:
        yield mine
    finally:
        stop.set()
        with lock:  # (a renewal under way finishes first: it would write the lease again)
            _release(store, uri, mine["token"])
        # A run refused once Ray is up (or failing to start it) leaves no output folder
        # behind, as Storage.write_problem's probe does not: the lease's own, if still empty.
        for folder in made:
            try:
                os.rmdir(folder)
            except OSError:  # the run wrote there
                break


def _renew(store, uri: str, mine: dict, stop: threading.Event, lock: threading.Lock) -> None:
    while not stop.wait(LEASE_RENEW_S):
        with lock:
            if stop.is_set():
                return
            try:
                there = _read_lease(store, uri)
                if there is not None and there.get("token") != mine["token"]:
                    # Two runs now write this output.uri, and the other one's start deletes
                    # checkpoints it does not know: this one stops at its next step, with a
                    # checkpoint (raylora's SIGTERM is a clean stop), where it can.
                    log.error("%s: another run took over this run's lease (%s) after it went "
                              "%d s without a renewal: two runs now write to this output.uri; "
                              "stopping this one", uri, _holder(there), LEASE_STALE_S)
                    _stop_this_run()
                    return
                mine["renewed"] = time.time()
                store.write_bytes(uri, json.dumps(mine, indent=1).encode())
            except OSError as exc:  # tried again at the next renewal
                log.warning("%s: could not renew this run's lease (%s); another run may take "
                            "it over %d s after its last renewal", uri, exc, LEASE_STALE_S)


def _stop_this_run() -> None:
    """A clean stop of this run where the CLI handles SIGTERM as one (raylora.launch);
    elsewhere (a notebook's launch.run) the error logged is all: a signal would kill it."""
    import signal

    from raylora import launch

    if launch.INTERRUPT_ON_SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)


def _release(store, uri: str, token: str) -> None:
    try:
        there = _read_lease(store, uri)
        if there is not None and there.get("token") == token:  # (not a run's that took it over)
            fs, path = store.fs(uri)
            fs.delete_file(path)
    except OSError as exc:  # not raised over the run's own outcome
        log.warning("%s: could not remove this run's lease (%s): the next run here is refused "
                    "until it is %d s old, or delete it", uri, exc, LEASE_STALE_S)


def _folders_to_make(output_uri: str) -> list[str]:
    """The local folders that writing under ``output_uri`` creates, deepest first."""
    made, path = [], storage.local_path(output_uri) if storage.is_local(output_uri) else None
    while path and not os.path.lexists(path):
        made.append(path)
        path = os.path.dirname(path)
    return made


def _read_lease(store, uri: str) -> dict | None:
    """The lease record at ``uri``; None when there is none, {} when it does not read."""
    if not store.exists(uri):
        return None
    try:
        held = json.loads(store.read_bytes(uri))
    except FileNotFoundError:  # released since
        return None
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def _mine(held: dict) -> bool:
    return held.get("process") == _PROCESS


def _age(held: dict, now: float) -> float | None:
    renewed = held.get("renewed")
    return now - renewed if isinstance(renewed, (int, float)) else None


def _holder(held: dict) -> str:
    started = held.get("started")
    return (f"host {held.get('host', '?')}, pid {held.get('pid', '?')}"
            + (f", started {_span(time.time() - started)} ago" if isinstance(started, (int, float)) else ""))


def _in_use(output_uri: str, uri: str, held: dict, age: float) -> str:
    return (f"output.uri: {output_uri} is in use by another run ({_holder(held)}; its lease "
            f"{uri} was renewed {_span(age)} ago): a second run there deletes the first's "
            "checkpoints in flight and both fail. Wait for that run to end, stop it (Ctrl-C "
            "or SIGTERM to that process; `raylora stop JOB_ID` for a submitted job), or give "
            "this run its own output.uri. If that run was killed, this one can start once the "
            f"lease is {_span(LEASE_STALE_S)} old (in {_span(max(LEASE_STALE_S - age, 0))}), "
            f"or delete {uri}")


def _span(seconds: float) -> str:
    seconds = max(seconds, 0)
    if seconds < 600:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
