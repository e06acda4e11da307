"""The checkpoints Ray Train recorded for a run, read on the driver before a run starts.

Ray Train V2 keeps its record in ``{run}/checkpoint_manager_snapshot.json``: the checkpoints
it kept and the latest one, which a run with the same storage path and name resumes from.
The snapshot is Ray's internal format: a snapshot that does not read as expected is left to
Ray (nothing deleted, nothing refused).
"""

from __future__ import annotations

import json
import logging

from raylora import storage
from raylora.checkpoint.state import EMA_FILE, FILES_FILE, IncompleteCheckpoint, missing_files

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
    a run starts, when nothing else writes there.
    """
    import pyarrow.fs as pafs

    if not store.exists(storage.join(run_uri, SNAPSHOT)):
        # no record at all: Ray starts afresh, and a folder from a run stopped during its
        # first checkpoint is one nothing resumes from or counts
        recorded = set()
    else:
        try:
            recorded = {r["checkpoint_dir_name"] for r in (_snapshot(store, run_uri) or {})["checkpoint_results"]}
        except (KeyError, TypeError):
            return []
    fs, path = store.fs(run_uri)
    dropped = []
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if (info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_")
                and info.base_name not in recorded):
            storage.delete_tree(fs, info.path)
            dropped.append(storage.join(run_uri, info.base_name))
    if dropped:
        log.warning("removed %d checkpoint folder(s) that an interrupted run wrote but Ray "
                    "never recorded: %s", len(dropped), ", ".join(dropped))
    return dropped


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
