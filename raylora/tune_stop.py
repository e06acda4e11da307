"""A clean stop of a search: `raylora stop`, or SIGTERM to the `raylora tune` driver.

One run stops at a step with a checkpoint (raylora.stop). A search is many runs, and Tune
tells only two kinds of trial apart on a resume: one whose function returned is finished
and never runs again; one whose actor was still running is unfinished and resumes. So:

- the driver's first SIGTERM asks every trial's workers to stop, through the same
  ``Requests`` actor a run uses (each trial's TorchTrainer gets its name);
- a trial whose run stopped, or that starts after the request, does not return yet: it
  *parks* (tells the actor at which step, then waits), so Tune still counts it as running;
- once every running trial is parked, ``EndWhenParked`` ends Tune's loop the way Ctrl-C
  does (Tune's own SIGINT handler) and releases them: Tune saves the experiment state one
  last time, with the parked trials unfinished, and stops their actors. The same command
  then resumes each one from its stop's checkpoint and starts the ones that never ran.

A second SIGTERM, or ``failure.stop_timeout_s`` without every trial parked, interrupts
as before: each running trial then resumes from its latest periodic checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray
from ray import tune

from raylora.desk import handle
from raylora.stop import POLL_S, DriverStop, driver_requests

log = logging.getLogger("raylora.tune")


@dataclass
class SearchStop:
    """What ``search_requests`` yields; after the block, ``parked`` holds each parked
    trial's step (None: it did not train in this run) and ``stopped`` says whether the
    search was stopped before it finished."""

    stop: DriverStop
    ended: bool = False
    parked: dict[str, int | None] = field(default_factory=dict)
    asked_at: float = 0.0
    # trials not finished (running, pending, paused) at the end of Tune's last step
    # (EndWhenParked); None: no step ran
    unfinished: int | None = None

    @property
    def stopped(self) -> bool:
        return self.ended or self.stop.expired

    @property
    def interrupted(self) -> bool:
        """Tune's loop ended before its trials did: Ctrl-C (Tune's own SIGINT handler saves
        the search and returns from ``fit()`` with no error, and its result grid shows the
        trials it stopped as terminated). Its last step still saw them running or pending.
        (Tune makes a search's trials pending well ahead of running them, so a search
        interrupted between one trial's end and the next one's start shows one pending.
        The number of trials is not compared with ``expected_trials``: a searcher may end
        with fewer, and a finished search must not read as interrupted on every rerun.)"""
        return bool(self.unfinished)


# The search this driver process runs. Tune pickles its callbacks into the search's state
# (tuner.pkl) and a resumed search gets them back from there, so the callback holds
# nothing and finds the search here.
_ACTIVE: list[SearchStop] = []


@contextmanager
def search_requests(desk: str, timeout_s: float, sigterm_hooks: list):
    """Around a search's ``fit()``: ``raylora.stop.driver_requests`` for all of its trials.
    Also puts back the SIGINT handler from before: Tune's ``fit()`` installs its own and
    leaves it there unless a signal came, and then a later run in this process (a library
    caller's) would not be interrupted by Ctrl-C or its stop timeout."""
    sigint = signal.getsignal(signal.SIGINT)
    with driver_requests(desk, timeout_s, sigterm_hooks) as stop:
        search = SearchStop(stop)
        _ACTIVE.append(search)
        try:
            yield search
            if stop.signalled:
                search.parked = ray.get(stop.actor.parked_trials.remote())
        finally:
            _ACTIVE.remove(search)
            if sigint is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, sigint)


class EndWhenParked(tune.Callback):
    """Ends Tune's loop once a stop was asked and every running trial is parked; counts,
    at each step's end, the trials not finished (``SearchStop.interrupted``). Runs in
    the driver's main thread, between Tune's steps (so the signal reaches Tune's handler
    there). A class at module level: Tune restores it by name from a saved search."""

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        search = _ACTIVE[-1] if _ACTIVE else None
        if search is None:
            return
        search.unfinished = sum(t.status not in ("TERMINATED", "ERROR") for t in trials)
        if not search.stop.signalled or search.ended:
            return
        if time.monotonic() - search.asked_at < POLL_S:
            return
        search.asked_at = time.monotonic()
        parked = ray.get(search.stop.actor.parked_trials.remote())
        running = {t.trial_id for t in trials if t.status == "RUNNING"}
        if running <= parked.keys():
            search.ended = True
            log.info("tune: every running trial has stopped (%s); saving the search",
                     ", ".join(describe(t, parked[t]) for t in sorted(running))
                     or "none was running")
            signal.raise_signal(signal.SIGINT)
            # Tune's handler has run: its loop ends after this call, before it looks at any
            # trial again, and saves the state with these trials running. Ending their
            # functions now lets Tune stop their actors at once (a parked one holds its
            # actor's only task, and Tune waits 10 s before it kills such an actor).
            search.stop.actor.release.remote()


class TrialEnds(tune.Callback):
    """Tells the search's progress lines (raylora.progress, through the desk's board) the
    step each completed trial's results are from: a trial the scheduler stopped early
    trains on until Tune's stop reaches its workers, and its line went on past that step.
    Tune calls this for a trial that finished or that its scheduler stopped, not for the
    trials a Ctrl-C or a stop leaves unfinished. A class at module level, holding nothing:
    see ``EndWhenParked``."""

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        search = _ACTIVE[-1] if _ACTIVE else None
        step = (trial.last_result or {}).get("step")
        if search is not None and step is not None:
            search.stop.actor.push.remote({"label": f"trial_{trial.trial_id}", "ended": int(step)})


def asked(stop_requests: str | None) -> bool:
    """In a trial: whether the search was asked to stop."""
    if not stop_requests:
        return False
    return bool(ray.get(handle(stop_requests).requested.remote()))


def describe(trial_id: str, step: int | None, max_steps: int | None = None) -> str:
    """A parked trial, as the driver says it."""
    if step is None:
        return f"trial_{trial_id} did not start"
    of = f"/{max_steps}" if max_steps else ""
    return f"trial_{trial_id} stopped at step {step}{of} with a checkpoint"


def park(stop_requests: str, trial_id: str, step: int | None) -> None:
    """In a trial: tell the driver this trial trains no further in this run (stopped at
    ``step`` with a checkpoint; None: before it trained), then wait until the driver has
    ended Tune's loop (``EndWhenParked``). Returning earlier would make the trial finished
    in the saved search, and a resumed search would not run it again."""
    actor = handle(stop_requests)
    ray.get(actor.park.remote(trial_id, step))
    while not ray.get(actor.is_released.remote()):
        time.sleep(POLL_S)
