"""Counting the rows ``raylora.data.decode`` rejected, across every preprocessing task.

The run's desk (raylora.desk, a small named Ray actor) holds the counts (rows kept, rows
dropped per reason, a few example locations per reason). Preprocess tasks send their per-batch tallies without
waiting; the rank-0 training worker reads the totals to stop a run whose bad fraction is
over ``data.max_bad_fraction``; the driver reads them once more for ``raylora.json``.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("raylora.data")

EXAMPLES_PER_REASON = 3


class BadDataError(ValueError):
    """Too much of the data is unusable: training on the rest would silently be training on
    a different dataset."""

    # A restart from the latest checkpoint reads the same data again (raylora.entry).
    restart_repeats = True


class Tally:
    """Counts, mergeable; plain Python (part of the run's actor, raylora.desk)."""

    def __init__(self) -> None:
        self.ok = 0
        self.bad: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.by_source: Counter = Counter()  # rows kept per data.sources index

    def add(self, ok: int, bad: dict[str, int], examples: dict[str, list[str]],
            by_source: dict[int, int] | None = None) -> None:
        self.ok += ok
        self.bad.update(bad)
        self.by_source.update(by_source or {})
        for reason, where in examples.items():
            kept = self.examples.setdefault(reason, [])
            kept.extend(where[: EXAMPLES_PER_REASON - len(kept)])

    def add_summary(self, summary: dict) -> None:
        """Adds another tally's ``summary()`` (a latent cache entry's recorded counts)."""
        self.add(summary["rows_ok"], summary["bad_records"], summary["bad_examples"],
                 {int(k): v for k, v in summary.get("rows_ok_by_source", {}).items()})

    def summary(self) -> dict:
        total = self.ok + sum(self.bad.values())
        return {
            "rows_ok": self.ok,
            "bad_records": dict(sorted(self.bad.items())),
            "bad_examples": {k: list(v) for k, v in sorted(self.examples.items())},
            "bad_fraction": (sum(self.bad.values()) / total) if total else 0.0,
            "rows_seen": total,
            "rows_ok_by_source": {str(k): v for k, v in sorted(self.by_source.items())},
        }


def min_rows_to_judge(total_rows: int) -> int:
    """Rows read before the workers judge the bad fraction: enough for it to mean something
    (the driver judges every row read once more at the end)."""
    return max(1, min(200, total_rows))


def verdict(summary: dict, max_fraction: float, min_rows: int) -> str | None:
    """The error message when too much is bad, judged once ``min_rows`` rows were seen."""
    if summary["rows_seen"] < max(1, min_rows) or summary["bad_fraction"] <= max_fraction:
        return None
    n_bad = sum(summary["bad_records"].values())
    parts = []
    for reason, count in summary["bad_records"].items():
        ex = summary["bad_examples"].get(reason, [])
        parts.append(f"{reason}={count}" + (f" (e.g. {'; '.join(ex)})" if ex else ""))
    return (
        f"data.max_bad_fraction: {n_bad} of {summary['rows_seen']} rows read so far "
        f"({summary['bad_fraction']:.1%}) are unusable, over the limit of {max_fraction:.1%}: "
        + ", ".join(parts)
        + ". Fix or remove those samples, or raise data.max_bad_fraction."
    )


def record(name: str | None, summary: dict) -> None:
    """Adds ``summary`` (``Tally.summary``: a latent cache's build counts) to the counter
    ``name``, waited for: the driver judges the totals next. Nothing without a counter."""
    if not name:
        return
    import ray

    from raylora.desk import handle

    ray.get(handle(name).add_summary.remote(summary))


def read_counter(name: str | None) -> dict | None:
    """The totals so far, or None when there is no counter (no run, or not started)."""
    if not name:
        return None
    import ray

    from raylora.desk import handle

    try:
        return ray.get(handle(name).summary.remote())
    except ValueError:  # no actor by that name
        return None


class Reporter:
    """Used inside Preprocess: forwards tallies to the counter without blocking."""

    def __init__(self, name: str | None):
        self.name = name
        self._actor = None

    def send(self, ok: int, bad: dict[str, int], examples: dict[str, list[str]],
             by_source: dict[int, int] | None = None) -> None:
        if bad:
            log.warning("dropped %d bad row(s): %s", sum(bad.values()), dict(bad))
        if not self.name:
            return
        from raylora.desk import handle

        if self._actor is None:
            self._actor = handle(self.name)
        self._actor.add.remote(ok, dict(bad), examples, by_source)


class Counting(Reporter):
    """A Reporter that keeps the counts (``tally``) instead of sending them: the latent
    cache's build hands each unit's back with its parts, and the entry records them, so a
    rerun that reuses the entry (and decodes nothing) is judged on them as the build was."""

    def __init__(self) -> None:
        super().__init__(None)
        self.tally = Tally()

    def send(self, ok: int, bad: dict[str, int], examples: dict[str, list[str]],
             by_source: dict[int, int] | None = None) -> None:
        super().send(ok, bad, examples, by_source)
        self.tally.add(ok, bad, examples, by_source)
