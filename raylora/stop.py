"""A clean stop at a step boundary: `raylora stop`, and SIGTERM (spot notice, pod deletion).

Two ways a stop is asked for, one way it happens:

- **A stop request** (the driver got SIGTERM: `raylora stop` → the Job SDK's ``stop_job``,
  or ``kill`` of `raylora train`): the driver tells the run's small named actor
  (``Requests``, part of raylora.desk); rank 0 polls it without waiting. The run ends
  after a checkpoint; the same command resumes from it.
- **A preemption** (a training worker process got SIGTERM): the worker's handler sets a
  flag. After the checkpoint the workers raise ``Preempted``, a worker failure, so Ray
  Train restarts them from that checkpoint (``failure.max_failures``), elsewhere if the
  node goes; with no restarts left the run fails and the same command resumes it.

A third thing is not a stop: **a preemption notice**. Ray drains a node that is about to
go (autoscaler v2 on a spot reclaim, ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION``), and Ray Train's PreemptionWatcher tells the workers of
that run. The ranks agree on it like on a stop code, write one checkpoint at that step and
train on: at the notice's deadline, or when the node goes, Ray Train restarts the workers
from the latest checkpoint without that node, and at most the steps since the notice are
trained again. Ray counts that restart against ``failure.max_preemption_failures`` when it
records the node's death as a preemption (GCS does for a drained node gone after its
deadline), else against ``max_failures`` (a node killed before its deadline; seen here).
A rank whose training fails while it holds a notice (the survivors' collective, when the
node goes) holds that error back past the deadline (``hold_error_for_notice``): seen first,
it would fail the run as an ordinary failure.

Either way every rank must decide at the same step: a step is a DDP collective, and
``ray.train.report`` (the checkpoint) a barrier. ``StopWatch.check`` is called by every
rank after every optimizer step and all-reduces (MAX) each rank's local code, so one
SIGTERMed worker stops them all at the same step, preemption winning over a request.

What SIGTERM does to a Ray Train worker (checked with Ray 2.60, tests/test_faults.py):
the worker is an actor process whose main thread runs Ray's task loop; Ray installs a
SIGTERM handler there (``Worker.main_loop``'s ``sigterm_handler``: ``SystemExit``, the
process dies without a checkpoint). The train function runs in another thread (Train
V2's ``TrainingThread``), where ``signal.signal`` is refused, so ``install_sigterm`` runs
on the main thread through the worker actor's own ``execute`` method (a sync actor:
its tasks run on the main thread, idle while training runs). Python runs the handler
promptly although that thread sits in Ray's C++ loop (Ray checks signals there). Ours
only sets a flag; Ray's is called after ``failure.stop_timeout_s`` if no step boundary
came (a hung collective), or on a second SIGTERM, so termination stays bounded.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("raylora.stop")

NONE, REQUESTED, PREEMPTED = 0, 1, 2
REASONS = {REQUESTED: "stop requested", PREEMPTED: "SIGTERM (preemption)"}
DRIVER_SIGTERM = "SIGTERM to the driver"  # why the driver asks its workers to stop
# Rank 0 asks the driver's actor at most this often (a step may take milliseconds).
POLL_S = 0.25


class Preempted(RuntimeError):
    """Raised by every worker after the checkpoint of a SIGTERM stop: Ray Train restarts
    the workers from it (a worker failure), or the run fails and a rerun resumes."""


class Requests:
    """The driver's stop request (plain Python; part of the run's actor, raylora.desk), and
    for a search, the trials that will train no further in this run (raylora.tune_stop)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.parked: dict[str, int | None] = {}
        self.released = False

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason

    def requested(self) -> str | None:
        return self.reason

    def park(self, trial_id: str, step: int | None) -> None:
        """A search's trial stopped at ``step`` with a checkpoint (None: before it trained)."""
        self.parked[trial_id] = step

    def parked_trials(self) -> dict[str, int | None]:
        return dict(self.parked)

    def release(self) -> None:
        """The search's state is being saved with the parked trials unfinished: they may end."""
        self.released = True

    def is_released(self) -> bool:
        return self.released


def interrupt_main() -> None:
    """Interrupt the driver's main thread, from another thread. Through SIGINT's handler:
    KeyboardInterrupt (a run's fit waits in a helper thread: launch.fit_interruptibly), or
    during a search Tune's own, which ends its loop and saves the search's state
    (raylora.tune_stop). A process started with SIGINT ignored (a shell's background job
    without job control, nohup) has no handler there, and ``_thread.interrupt_main`` then
    does nothing: the run went on and stopped later, or never. Then through SIGTERM's,
    which is ``launch._raise_interrupt`` whenever a driver was asked to stop: asked again,
    it raises KeyboardInterrupt."""
    import _thread

    handled = callable(signal.getsignal(signal.SIGINT))
    _thread.interrupt_main(signal.SIGINT if handled else signal.SIGTERM)


@dataclass
class DriverStop:
    """What ``driver_requests`` yields: the actor's name (``WorkerSpec.stop_requests``)
    and handle, whether the driver got its SIGTERM, and whether ``timeout_s`` passed
    after it (``expired``: the driver was interrupted)."""

    name: str
    actor: object = None
    signalled: bool = False
    expired: bool = False


@contextmanager
def driver_requests(desk: str, timeout_s: float, sigterm_hooks: list):
    """Around a run's ``fit()`` on the driver: the ``Requests`` of its desk, asked to stop by
    the driver's first SIGTERM (``sigterm_hooks``: what ``launch``'s SIGTERM handler
    calls). A second SIGTERM, or ``timeout_s`` without ``fit()`` returning, interrupts the
    driver as before (KeyboardInterrupt: Ray shut down, no new checkpoint)."""
    from raylora.desk import handle

    actor = handle(desk)
    stop = DriverStop(desk, actor)
    timers: list[threading.Timer] = []

    def expire() -> None:
        stop.expired = True
        log.warning("SIGTERM: not stopped within failure.stop_timeout_s (%gs): interrupting "
                    "the driver", timeout_s)
        interrupt_main()

    def on_sigterm() -> bool:
        if stop.signalled:
            return False  # asked twice: interrupt now
        stop.signalled = True
        actor.request.remote(DRIVER_SIGTERM)
        # Not a promise: a run already past its last step finishes (launch says so then).
        log.warning("SIGTERM: asking the workers to checkpoint and stop at their next step "
                    "(up to %gs; send it again to interrupt now)", timeout_s)
        timers.append(threading.Timer(timeout_s, expire))
        timers[0].daemon = True
        timers[0].start()
        return True

    sigterm_hooks.append(on_sigterm)
    try:
        yield stop
    finally:
        sigterm_hooks.remove(on_sigterm)
        for t in timers:
            t.cancel()


@contextmanager
def exporting(sigterm_hooks: list):
    """Around the export of a run that has trained its last step: a first SIGTERM (a
    `raylora stop` that came as training ended) lets the export finish, so the adapter is
    written whole and there is nothing to resume; a second interrupts it (KeyboardInterrupt,
    as ``launch._raise_interrupt``; the same command exports again). Before, the first one
    interrupted the export: the run had finished, and a rerun was needed to write it."""
    asked: list[bool] = []

    def on_sigterm() -> bool:
        if asked:
            return False
        asked.append(True)
        log.warning("SIGTERM: the run has trained its last step; writing its adapter first "
                    "(send it again to interrupt)")
        return True

    sigterm_hooks.append(on_sigterm)
    try:
        yield
    finally:
        sigterm_hooks.remove(on_sigterm)


# --- worker side -------------------------------------------------------------------

_SIGNALLED = threading.Event()


def _install(timeout_s: float) -> bool:
    """Runs on the worker process's main thread (``install_sigterm``): SIGTERM sets
    ``_SIGNALLED``; Ray's own handler runs on a second SIGTERM or ``timeout_s`` later."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def ray_handler(signum, frame):
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: die as the signal would have killed us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _SIGNALLED.is_set():
            ray_handler(signum, frame)
            return
        _SIGNALLED.set()
        # Bounded: a worker that never reaches a step boundary still dies.
        timer = threading.Timer(timeout_s, lambda: signal.raise_signal(signal.SIGTERM))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def install_sigterm(timeout_s: float) -> bool:
    """From a Ray Train worker's training thread: put ``_install`` on this worker
    process's main thread. False when not in a Ray actor (or not on its main thread)."""
    import ray

    try:
        actor = ray.get_runtime_context().current_actor
    except Exception:  # not inside an actor (a plain task or a test)
        return False
    return bool(ray.get(actor.execute.remote(_install, timeout_s), timeout=60))


def ray_preemption_notice():
    """This worker's preemption notice from Ray Train (a ``ray.train.PreemptionInfo``), or
    None. Read from the worker's train context, where Ray Train's PreemptionWatcher puts it
    (``mark_preempt``), not through ``ray.train.get_preemption_info()``: that one is a
    blocking broadcast through a Ray actor at every call, and the ranks already agree
    through ``StopWatch``'s all-reduce. Checked against Ray 2.60 (tests/test_elastic.py)."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


# Ray Train's controller polls its workers every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): a
# rank that waits this long past a notice's deadline is polled twice after it first.
NOTICE_GRACE_S = 5.0
# How long Ray Train waits out a notice that has no deadline (DEFAULT_PREEMPTION_DEADLINE_S).
NOTICE_NO_DEADLINE_S = 120.0


def notice_nodes(info) -> str:
    """A preemption notice's nodes as the logs name them: each id's first 12 characters."""
    return ", ".join(n[:12] for n in info.preempted_node_ids)


def notice_wait_s(info, now_s: float) -> float:
    """How long a rank that failed while holding preemption notice ``info`` (None: none)
    holds its error back: until the notice's deadline plus ``NOTICE_GRACE_S``.

    Why: once a node of the run is drained, Ray Train's controller waits out the notice and
    then restarts the workers as a preemption (``failure.max_preemption_failures``). But a
    worker *error* it sees first, unless it is the preempted node's own actor death, fails the
    run as an ordinary failure (``failure.max_failures``; Ray 2.60's
    ``_handle_preempting_state``). When the node goes, the survivors' next collective fails
    at once ("Connection closed by peer"), often before the controller has seen the node's
    death or its deadline pass: a spot reclaim counted against ``max_failures`` (seen in
    tests/test_elastic.py, ``max_failures: 0``: the run failed). Held back, the error is never
    seen: the controller restarts the workers from the notice's checkpoint at the deadline.
    Bounded by the deadline, and cut short by that restart, which ends this process."""
    if info is None:
        return 0.0
    deadline_s = info.deadline_ms / 1000 if info.deadline_ms else now_s + NOTICE_NO_DEADLINE_S
    return max(0.0, deadline_s + NOTICE_GRACE_S - now_s)


def hold_error_for_notice(error: BaseException, notice=None, now=time.time,
                          sleep=time.sleep) -> float:
    """A worker's training function failed with ``error``: if this rank holds a preemption
    notice, wait ``notice_wait_s`` before the caller re-raises (why: there). Returns the
    seconds waited. A SIGTERM's ``Preempted`` and a notice-less failure raise at once."""
    if isinstance(error, Preempted) or not isinstance(error, Exception):
        return 0.0
    try:
        info = (notice or ray_preemption_notice)()
    except Exception:  # no Ray Train context (a plain process): no notice
        return 0.0
    wait = notice_wait_s(info, now())
    if wait > 0:
        log.warning("%s: %s, while node %s is being preempted: holding this error back %.0f s, "
                    "past the notice's deadline, for Ray Train to restart the workers from the "
                    "notice's checkpoint (a preemption's restart, not a failure's)",
                    type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "",
                    notice_nodes(info), wait)
        sleep(wait)
    return wait


class StopWatch:
    """Every rank calls ``check()`` after every optimizer step, the same number of times:
    the run's agreed stop code (NONE, REQUESTED, PREEMPTED); then ``take_notice()``: True
    at the one step where the ranks agreed on a new preemption notice (``notice()``: this
    rank's, or None).

    The ranks agree through a MAX all-reduce that runs behind the training: each check
    starts one (async) and reads the one the previous check started, so a stop lands one
    step later than it was seen, on every rank alike. On GPUs it goes through a gloo group
    of host tensors: an NCCL reduce of a device tensor read back with ``.item()`` would
    make the host wait for the GPU queue every step."""

    def __init__(self, rank: int, world: int, requests: str | None, device, notice=None):
        self.rank, self.world, self.device = rank, world, device
        self.code = NONE
        self._notice = notice or (lambda: None)
        self._seen: list = []  # the distinct notices this rank was given, in order
        self.notices = self._taken = 0  # notices agreed by all ranks / checkpointed
        self.noticed_step = -1  # the step of the latest notice's checkpoint
        self._group, self._inflight = None, None
        if world > 1 and getattr(device, "type", str(device)) != "cpu":
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # collective: every rank, same order
        self._actor = None
        if rank == 0 and requests:
            from raylora.desk import handle

            self._actor = handle(requests)
        self._pending, self._asked_at = None, 0.0

    def _requested(self) -> bool:
        """Rank 0: the driver's answer, never waited for (one question in flight)."""
        import ray

        if self._actor is None:
            return False
        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return False
            answer, self._pending = ray.get(self._pending), None
            if answer:
                return True
        if time.monotonic() - self._asked_at >= POLL_S:
            self._pending, self._asked_at = self._actor.requested.remote(), time.monotonic()
        return False

    def _local_notices(self) -> int:
        info = self._notice()
        if info is not None and info not in self._seen:
            self._seen.append(info)
        return len(self._seen)

    def check(self) -> int:
        import torch

        local = PREEMPTED if _SIGNALLED.is_set() else REQUESTED if self._requested() else NONE
        notices = self._local_notices()
        if self.world > 1:
            agreed = [NONE, 0]
            if self._inflight is not None:  # the previous step's: long done, no wait
                work, t = self._inflight
                work.wait()
                agreed = t.tolist()  # a host tensor: no device sync
            t = torch.tensor([local, notices], dtype=torch.int32)
            work = torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                                group=self._group, async_op=True)
            self._inflight = (work, t)
            local, notices = agreed
        self.code = max(self.code, local)
        self.notices = max(self.notices, notices)
        return self.code

    def take_notice(self, step: int) -> bool:
        """After ``check()``, on every rank alike: whether a preemption notice not yet
        checkpointed for was agreed (then it is taken, at ``step``: ``noticed_step``)."""
        if self.notices <= self._taken:
            return False
        self._taken, self.noticed_step = self.notices, step
        return True

    def notice(self):
        """The latest preemption notice this rank was given, or None."""
        return self._seen[-1] if self._seen else None

    @property
    def reason(self) -> str | None:
        return REASONS.get(self.code)
