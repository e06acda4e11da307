"""What the driver learns about the data before any worker starts (``plan_data``), and
what one pass over it, an epoch, reads (``read_units``, ``pass_items``). No Ray here.

A plan is the files of one source (``data.uri``). A row counts once per epoch unless the
data says otherwise: a caption folder's kohya ``N_name`` folders count their images N
times (``ShardFormat.repeats``). An epoch reads each read unit (a registry unit,
``ShardFormat.units``, or a parquet part) as many times as its rows count, copy after
copy: every unit once, then the units that count twice once more, and so on, so that
the copies of a row are far apart even where an epoch is read in file order
(``data.sharding=files``); stream sharding shuffles each epoch's units as well. Counts
are exact: ``DataPlan.rows`` is what an epoch reads (before bad rows and a held-out
split are dropped), and ``for_rank`` gives each worker's exact share under
``data.sharding=files``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from raylora.data.formats import detect_format, get_format
from raylora.storage import Storage

if TYPE_CHECKING:
    from raylora.config import DataSection


@dataclass
class SourceFiles:
    """One source's files, as the driver found them."""

    index: int  # the source's place in the config (0: data.uri)
    format: str
    files: list[str]
    rows: int  # distinct rows
    file_rows: list[int] | None = None  # rows per file, where known
    repeats: list[int] | None = None  # times each file's rows count per epoch (None: once)
    uri: str | list[str] = ""
    companions: list[str] = field(default_factory=list)  # e.g. caption files, for fingerprints

    def file_repeats(self) -> list[int]:
        return self.repeats or [1] * len(self.files)

    def epoch_rows(self) -> int:
        """Rows an epoch reads from this source."""
        if self.repeats is None:
            return self.rows
        return sum(r * n for r, n in zip(self.repeats, self.file_rows))

    def subset(self, indices: list[int]) -> SourceFiles:
        def pick(xs):
            return None if xs is None else [xs[i] for i in indices]

        rows = pick(self.file_rows)
        return replace(self, files=pick(self.files), rows=sum(rows or []), file_rows=rows,
                       repeats=pick(self.repeats))


@dataclass
class DataPlan:
    """The run's data as the driver planned it; ``rows``: what one epoch reads."""

    format: str  # of every source ("mix": sources of different formats)
    files: list[str]
    rows: int
    file_rows: list[int] | None = None  # rows per file, where known (not imagefolder)
    sources: list[SourceFiles] = field(default_factory=list)

    def __post_init__(self):
        if not self.sources:  # given files alone (a latent cache's): one source, read once
            self.sources = [SourceFiles(0, self.format, list(self.files), self.rows,
                                        self.file_rows)]

    @classmethod
    def of(cls, sources: list[SourceFiles]) -> DataPlan:
        formats = {s.format for s in sources}
        known = all(s.file_rows is not None for s in sources)
        return cls(formats.pop() if len(formats) == 1 else "mix",
                   [f for s in sources for f in s.files],
                   sum(s.epoch_rows() for s in sources),
                   [n for s in sources for n in s.file_rows] if known else None,
                   list(sources))

    def content_files(self) -> list[str]:
        """Every file the rows are read from (a fingerprint over them changes with the data)."""
        return self.files + [c for s in self.sources for c in s.companions]

    def for_rank(self, rank: int, world: int) -> DataPlan:
        """The files of one worker under ``data.sharding=files``: file i (counted over
        every source) goes to worker i mod world."""
        subsets, start = [], 0
        for s in self.sources:
            subsets.append(s.subset([i for i in range(len(s.files)) if (start + i) % world == rank]))
            start += len(s.files)
        return DataPlan.of([s for s in subsets if s.files] or subsets[:1])

    def summary(self) -> list[dict]:
        """Per source, for ``raylora.json``: files, distinct rows, rows per epoch, and how
        many rows count how many times (where any counts more than once)."""
        out = []
        for s in self.sources:
            entry = {"source": s.index, "uri": s.uri, "format": s.format, "files": len(s.files),
                     "rows": s.rows, "rows_per_epoch": s.epoch_rows()}
            if s.repeats:
                counts = Counter()
                for r, n in zip(s.repeats, s.file_rows):
                    counts[r] += n
                entry["rows_by_repeats"] = {str(r): n for r, n in sorted(counts.items())}
            out.append(entry)
        return out


def plan_source(section: DataSection, storage: Storage, index: int = 0) -> SourceFiles:
    """Resolve one source's URI, detect its format, check what can be checked and count
    its rows. Raises FileNotFoundError / ValueError / OSError naming the URI or file."""
    listing = storage.expand(section.uri)
    fmt = get_format(detect_format(listing) if section.format == "auto" else section.format)
    files = fmt.select(listing)
    if not files:
        raise FileNotFoundError(f"{section.uri}: matched no {fmt.name} files")
    fmt.check_listing(section, files, listing)
    rows, file_rows = fmt.count_rows(section, files, storage)
    return SourceFiles(index, fmt.name, files, rows, file_rows, fmt.repeats(section, files),
                       section.uri, fmt.companions(section, files, listing))


def plan_data(data: DataSection, storage: Storage) -> DataPlan:
    """The plan of ``data.uri``. Raises FileNotFoundError / ValueError / OSError naming the
    URI or file at fault."""
    return DataPlan.of([plan_source(data, storage)])


def iter_plan_rows(data: DataSection, plan: DataPlan, storage: Storage):
    """Every distinct row ``{key, image, text}`` of the plan, in source and file order,
    without Ray (held-out rows are read this way on the driver)."""
    for s in plan.sources:
        yield from get_format(s.format).iter_rows(data, s.files, storage)


def read_units(data: DataSection, plan: DataPlan, storage: Storage, unit_rows: int,
               cached: bool = False) -> list[dict]:
    """Every read unit of the plan once, in source order: ``k`` (the source's place in
    ``plan.sources``), ``repeats``, and where it is: ``kind`` ``parquet`` (parquet files
    and a latent cache's, in parts of about ``unit_rows`` rows: ``uri``, ``part``,
    ``parts``) or ``unit`` (a registry unit: ``index``, ``start``, ``stop``)."""
    from raylora.data.parquet_parts import parquet_parts

    out = []
    for k, s in enumerate(plan.sources):
        reps = s.file_repeats()
        base = {"k": k, "source": s.index, "uri": "", "part": 0, "parts": 0,
                "index": 0, "start": 0, "stop": 0}
        if cached or s.format == "parquet":
            for i, f in enumerate(s.files):
                rows = None if s.file_rows is None else [s.file_rows[i]]
                out += [{**base, "kind": "parquet", **p, "repeats": reps[i]}
                        for p in parquet_parts([f], rows, unit_rows)]
        else:
            units = get_format(s.format).units(data, s.files, storage, unit_rows)
            out += [{**base, "kind": "unit", "index": i, "start": a, "stop": b,
                     "repeats": reps[i]} for i, a, b in units]
    return out


def pass_items(units: list[dict], seed: int, epoch: int, shuffle: bool) -> list[dict]:
    """What epoch ``epoch`` reads: each unit as many times as its rows count, copy after
    copy; ``shuffle``: in an order drawn from the seed and the epoch alone, else in that
    order."""
    copies = max((u["repeats"] for u in units), default=1)
    items = [u for c in range(copies) for u in units if u["repeats"] > c]
    order = np.random.default_rng([seed, epoch]).permutation(len(items)) if shuffle \
        else range(len(items))
    return [{"epoch": epoch, **items[i]} for i in order]
