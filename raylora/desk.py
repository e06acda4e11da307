"""The run's one small actor on the driver's node: where the workers and the driver meet.

Three things pass between a run's workers and its driver outside ``ray.train.report``
(a barrier across all workers, kept for checkpoints and evaluations):

- the rows that preprocessing rejected (``raylora.data.badrecords.Tally``),
- each step's progress row from rank 0 (``raylora.progress.Board``),
- the driver's stop request and a search's parked trials (``raylora.stop.Requests``).

Each is plain Python. They live in one named actor per run (``Desk``), started by the run
preamble (``raylora.launch.prepared``) and stopped at its end. An actor is a process (a
Ray worker: about 1.5 CPU-seconds to start and 100+ MB resident here): three actors per
run were three of each on the driver's node, for a few dozen small calls a second.
"""

from __future__ import annotations

import uuid

from raylora.data.badrecords import Tally
from raylora.progress import Board
from raylora.stop import Requests

# Named actors are looked up per namespace; the driver's is anonymous, so one is fixed.
NAMESPACE = "raylora"

# Held here: a (non-detached) actor dies with its last handle, name or not.
_HELD: dict = {}


class Desk(Tally, Board, Requests):
    """The three parts' methods in one class (their names do not overlap: checked in
    tests/test_desk.py); plain Python, made an actor by ``start``."""

    def __init__(self) -> None:
        Tally.__init__(self)
        Board.__init__(self)
        Requests.__init__(self)


def on_driver_node():
    """Scheduling for the desk: the driver's node, whose loss ends the run anyway. Left to
    Ray it can land on a worker node, and losing that node (which an elastic run, or
    failure.max_failures, is meant to survive) would kill it and fail every restart."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start() -> str:
    """A fresh desk (0 CPUs: it only keeps lists and counters); its name, which the workers
    look it up by (``Plan.bad_records``, ``WorkerSpec.progress_board`` and
    ``stop_requests`` all carry it). Needs Ray."""
    import ray

    name = f"raylora-run-{uuid.uuid4().hex[:12]}"
    _HELD[name] = ray.remote(num_cpus=0)(Desk).options(
        name=name, namespace=NAMESPACE, get_if_exists=True,
        scheduling_strategy=on_driver_node()).remote()
    return name


def handle(name: str):
    """The desk called ``name`` (``ValueError`` when there is none)."""
    import ray

    return _HELD.get(name) or ray.get_actor(name, namespace=NAMESPACE)


def stop(name: str | None) -> None:
    """Ends the desk ``start`` made (nothing when there is none, or Ray is gone)."""
    import ray

    actor = _HELD.pop(name, None)
    if actor is not None and ray.is_initialized():
        ray.kill(actor)
