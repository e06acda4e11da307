"""``data.sharding=stream`` on several workers: one dataset per pass over the data, split
over the workers by an actor (``PassSplits``) that rank 0 starts and every rank asks.

Kept apart from ``raylora.worker`` on purpose: Ray starts the actor in a process of its
own, which imports the module its class (and the pickled dataset maker) comes from.
``raylora.worker`` pulls in torch, peft, transformers and diffusers (about 11 CPU-s here,
2026-12-07), none of which splitting a Ray dataset needs; this module and what it calls
import Ray Data and raylora's data modules only (about 2 s). That import was on the path
to every multi-worker run's first step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PassDataset:
    """``(pass, passes) -> the Ray dataset of that many passes from that one on`` (one for
    the board) as the workers build it (raylora.data.source.build_dataset), picklable by
    reference to this module."""

    data: Any  # DataSection
    plan: Any  # DataPlan
    store: Any  # Storage
    model_path: str
    seed: int
    tasks: int
    family: str
    bad_records: str | None
    tokenizer_specs: tuple | None
    revision: str | None
    progress_bar: bool

    def __call__(self, epoch: int, epochs: int = 1):
        from raylora.data.source import build_dataset

        ds = build_dataset(self.data, self.plan, self.store, model_path=self.model_path,
                           seed=self.seed, num_preprocess_tasks=self.tasks, family=self.family,
                           bad_records=self.bad_records, tokenizer_specs=self.tokenizer_specs,
                           revision=self.revision, epoch=epoch, epochs=epochs)
        ds.context.enable_progress_bars = self.progress_bar
        return ds


class PassSplits:
    """Each pass over the data is a dataset of its own, split over the workers with
    ``streaming_split(equal=True)``, so every worker gets the same number of that pass's
    rows (rows // workers, the rest dropped) and trains the same batches of it. One
    dataset of all passes, split once, is evened out only at its end: a worker handed
    more of the first pass's rows took the second pass's early, training rows twice in an
    epoch and others not at all.

    Runs as an actor (``pass_board``) that each worker asks for its part of a pass when
    its stream gets there (``part``), at its own pace: no collective between epochs, and
    the next pass is split ahead (its coordinator actor started) when one is first asked
    for. The parts reach the workers as Ray return values, so Ray counts each worker's
    reference and a pass's coordinator (and the blocks it owns) lives until the last
    worker is done with it; parts pickled out of band (a broadcast) are not counted, and
    the coordinator died under the workers still reading once rank 0 had finished."""

    def __init__(self, make: Callable, world: int, last: int):
        self._make, self._world, self._last = make, world, last
        self._splits: dict = {}  # pass -> its parts, until every worker has taken its own
        self._taken: dict = {}  # pass -> the ranks that took theirs

    def part(self, p: int, rank: int):
        taken = self._taken.setdefault(p, set())
        if rank in taken:  # a second split of it would wait for the others forever
            raise RuntimeError(f"data.sharding=stream: worker {rank} asked for pass {p} twice")
        taken.add(rank)
        parts = self._split(p)
        if len(taken) == self._world:
            del self._splits[p]
        if p + 1 <= self._last and not self._taken.get(p + 1):
            self._split(p + 1)
        return parts[rank]

    def _split(self, p: int):
        if p not in self._splits:
            self._splits[p] = self._make(p).streaming_split(self._world, equal=True)
        return self._splits[p]


def pass_board(make: PassDataset, rank: int, world: int, last: int):
    """The run's ``PassSplits`` actor: rank 0 starts it on its node (where the coordinators
    were made before) and hands the handle to every rank (the actor lives as long as
    rank 0 holds it: the run's stream). Called in the train workers (torch is there)."""
    import ray
    import torch.distributed
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    board = [None]
    if rank == 0:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        board[0] = ray.remote(num_cpus=0)(PassSplits).options(scheduling_strategy=here).remote(
            make, world, last)
    torch.distributed.broadcast_object_list(board, src=0)
    return board[0]


def pass_part(board, p: int, rank: int, prefetch_batches: int):
    """This rank's blocks of pass ``p`` (``PassSplits``)."""
    import ray

    part = ray.get(board.part.remote(p, rank))
    return part.iter_batches(batch_size=None, batch_format="numpy",
                             prefetch_batches=prefetch_batches)
