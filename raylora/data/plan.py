"""What the driver learns about the data before any worker starts (``plan_data``), and
what one pass over it, an epoch, reads (``read_units``, ``pass_items``). No Ray here.

A plan is the files of one or more sources (``data.uri``, or each of ``data.sources``).
Each row counts m times per epoch, its multiplicity: a caption folder's kohya ``N_name``
folders make it N (``ShardFormat.repeats``), times the source's multiplier: its
``repeats``, or what its ``weight`` asks for (``apply_shares``). An epoch reads each read
unit (a registry unit, ``ShardFormat.units``, or a parquet part) floor(m) times, copy
after copy (every unit once, then those that count twice once more, ...: the copies of a
row are far apart even where an epoch is read in file order, ``data.sharding=files``),
and, for a fractional m, a partial copy: of the n rows that share a multiplicity, the
round(frac(m) × n) rows whose positions a seeded affine permutation maps below that count
(``keep_rows``), a different set every epoch, decided row by row without a list of them.
With data.bucketing the partial copy is drawn bucket by bucket instead
(``row_buckets``, ``_bucket_tables``): round(frac(m) × n_b) of each bucket's n_b rows,
so that every epoch brings each bucket the rows the bucket schedule planned for it (a
draw over the whole group brought some buckets more and others fewer, trained twice or
skipped).
Stream sharding shuffles each epoch's items as well. Counts are exact: ``DataPlan.rows``
is what an epoch reads (before bad rows and a held-out split are dropped), and
``for_rank`` gives each worker's exact share under ``data.sharding=files`` (each worker's
partial copies are drawn from its own rows).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.fs as pafs

from raylora.data.captions import with_prefix
from raylora.data.formats import IMAGE_EXTS, control_infix, control_names, detect_format, get_format
from raylora.data.formats.base import control_candidates
from raylora.hubfs import planned_commit
from raylora.storage import Storage

if TYPE_CHECKING:
    from raylora.config import DataSection


class DataProblems(ValueError):
    """Problems of several sources, one ``"data.sources[i].uri: ..."`` line each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def copies(m: float, n: int) -> tuple[int, int]:
    """(whole copies, rows of the partial copy) an epoch reads of ``n`` rows that count
    ``m`` times each."""
    whole = int(m)
    return whole, int((m - whole) * n + 0.5)


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
    mult: float = 1.0  # the source's multiplier: its repeats, or what its weight asks for
    # data.bucketing: usable rows per bucket id, per file (a format without rows per file,
    # imagefolder: one entry, the whole source's); None without buckets. Held-out rows
    # (data.validation_split) are not counted: training never sees them.
    bucket_counts: list[dict[int, int]] | None = None
    # data.bucketing where a multiplicity is fractional: each row's bucket id, the
    # source's rows in file order (-1: a row no bucket trains, held out or one the decode
    # drops), so that a partial copy is drawn per bucket (``_bucket_tables``); else None.
    row_buckets: np.ndarray | None = None
    # Per file, the place data.sharding=files deals it by (worker deals[i] mod world); None:
    # its own place over every source. A latent cache's part gets the place of the source
    # file its rows came from: a shard file cut into parts of 256 rows left its last part,
    # and the next file's, to the next worker (two files of 300 rows: 512 and 88 rows a
    # worker, the epoch cut to 88), where the uncached run gives each worker a file.
    deals: list[int] | None = None

    def file_repeats(self) -> list[int]:
        return self.repeats or [1] * len(self.files)

    def file_mults(self) -> list[float]:
        """Times each file's rows count per epoch."""
        return [self.mult * r for r in self.file_repeats()]

    def groups(self) -> dict[float, int]:
        """Rows per multiplicity, in order of first appearance (one for a source without
        per-file rows)."""
        if self.file_rows is None:
            return {self.mult: self.rows}
        out: dict[float, int] = {}
        for m, n in zip(self.file_mults(), self.file_rows):
            out[m] = out.get(m, 0) + n
        return out

    def epoch_rows(self) -> int:
        """Rows an epoch reads from this source (a partial copy drawn per bucket rounds
        per bucket)."""
        return sum(w * n + k for m, strata in self.strata().items() for n in strata.values()
                   for w, k in [copies(m, n)])

    def file_buckets(self) -> list[np.ndarray]:
        """``row_buckets`` per file (a source without rows per file: one list)."""
        if self.file_rows is None:
            return [self.row_buckets]
        return np.split(self.row_buckets, np.cumsum(self.file_rows)[:-1])

    def group_buckets(self) -> dict[float, np.ndarray]:
        """``row_buckets`` by multiplicity: each group's rows' bucket ids in the order of
        their places in the group (its files in file order)."""
        mults = self.file_mults() if self.file_rows is not None else [self.mult]
        parts: dict[float, list[np.ndarray]] = {}
        for m, ids in zip(mults, self.file_buckets()):
            parts.setdefault(m, []).append(ids)
        return {m: np.concatenate(p) for m, p in parts.items()}

    def strata(self) -> dict[float, dict[int, int]]:
        """Rows per multiplicity and, within it, per set a partial copy is drawn from: per
        bucket id (-1: rows no bucket trains) where ``row_buckets`` says, else one set."""
        if self.row_buckets is None:
            return {m: {0: n} for m, n in self.groups().items()}
        out = {}
        for m, ids in self.group_buckets().items():
            vals, n = np.unique(ids, return_counts=True)
            out[m] = dict(zip(vals.tolist(), n.tolist()))
        return out

    def natural_rows(self) -> int:
        """Rows an epoch would read with the source's multiplier at 1 (folder repeats only)."""
        return replace(self, mult=1.0).epoch_rows()

    def subset(self, indices: list[int]) -> SourceFiles:
        def pick(xs):
            return None if xs is None else [xs[i] for i in indices]

        rows = pick(self.file_rows)
        ids = self.row_buckets  # a source without rows per file (imagefolder): one list
        if ids is not None and rows is not None:
            ids = np.concatenate([self.file_buckets()[i] for i in indices] or [ids[:0]])
        return replace(self, files=pick(self.files), rows=sum(rows or []), file_rows=rows,
                       repeats=pick(self.repeats), bucket_counts=pick(self.bucket_counts),
                       row_buckets=ids, deals=pick(self.deals))

    def bucket_rows(self) -> dict[int, int]:
        """Rows per bucket an epoch brings: of each multiplicity's n_b rows of a bucket,
        whole copies and the partial copy drawn from that bucket (``copies(m, n_b)``)."""
        groups: dict[float, dict[int, int]] = {}
        mults = self.file_mults() if self.file_rows is not None else [self.mult]
        for m, counts in zip(mults, self.bucket_counts or []):
            group = groups.setdefault(m, {})
            for b, n in counts.items():
                group[b] = group.get(b, 0) + n
        out: dict[int, int] = {}
        for m, group in groups.items():
            for b, n in group.items():
                whole, take = copies(m, n)
                out[b] = out.get(b, 0) + whole * n + take
        return out

    def fractional(self) -> bool:
        """Whether some of its rows count a fractional number of times (a partial copy)."""
        return any(m != int(m) for m in self.groups())


@dataclass
class DataPlan:
    """The run's data as the driver planned it; ``rows``: what one epoch reads."""

    format: str  # of every source ("mix": sources of different formats)
    files: list[str]
    rows: int
    file_rows: list[int] | None = None  # rows per file, where known (not imagefolder)
    sources: list[SourceFiles] = field(default_factory=list)
    # The rows are training rows already, a held-out split dropped (a latent cache's: it
    # encodes the training rows alone), so the step arithmetic must not scale them again.
    heldout_dropped: bool = False

    def __post_init__(self):
        if not self.sources:  # given files alone (a latent cache's): one source, read once
            self.sources = [SourceFiles(0, self.format, list(self.files), self.rows,
                                        self.file_rows)]

    @classmethod
    def of(cls, sources: list[SourceFiles], heldout_dropped: bool = False) -> DataPlan:
        formats = {s.format for s in sources}
        known = all(s.file_rows is not None for s in sources)
        return cls(formats.pop() if len(formats) == 1 else "mix",
                   [f for s in sources for f in s.files],
                   sum(s.epoch_rows() for s in sources),
                   [n for s in sources for n in s.file_rows] if known else None,
                   list(sources), heldout_dropped)

    def content_files(self) -> list[str]:
        """Every file the rows are read from (a fingerprint over them changes with the data)."""
        return self.files + [c for s in self.sources for c in s.companions]

    def for_rank(self, rank: int, world: int) -> DataPlan:
        """The files of one worker under ``data.sharding=files``: file i (counted over
        every source) goes to worker i mod world; a file with a deal place
        (``SourceFiles.deals``: a latent cache's part) to worker place mod world.

        Where files repeat (a kohya ``N_name`` folder, a source's ``repeats``), their
        copies are dealt, not the files: the copies of every file in place order, copy j of
        them to worker j mod world, and a worker reads a file as many times as it got
        copies of it. Dealt whole, ``10_a/`` of 3 images beside ``1_b/`` of 3 gave two
        workers 21 and 12 reads an epoch, and the epoch (the fewest) left 9 of its 33 reads
        out; dealt as copies they get 17 and 16. A cached part (its deal place its source
        file's) gets that file's copies, as the uncached run reads them."""
        places = [s.deals if s.deals is not None else range(start, start + len(s.files))
                  for s, start in zip(self.sources, np.cumsum([0] + [len(s.files) for s in self.sources]))]
        if all(r == 1 for s in self.sources for r in s.file_repeats()):
            subsets = [s.subset([i for i, d in enumerate(p) if d % world == rank])
                       for s, p in zip(self.sources, places)]
        else:
            subsets = self._copies_for_rank(rank, world, places)
        return DataPlan.of([s for s in subsets if s.files] or subsets[:1], self.heldout_dropped)

    def _copies_for_rank(self, rank: int, world: int, places: list) -> list[SourceFiles]:
        """``for_rank`` where files repeat: each source's files with the copies of them
        that fall to ``rank``, as ``repeats`` (a file none of whose copies do: left out)."""
        places = [[int(d) for d in p] for p in places]  # numpy ints from cumsum, or deals
        copies_of: dict[int, int] = {}  # deal place → its copies (its files' repeats)
        for s, p in zip(self.sources, places):
            for d, r in zip(p, s.file_repeats()):
                copies_of[d] = r
        first, at = {}, 0  # deal place → the place of its first copy among all copies
        for d in sorted(copies_of):
            first[d], at = at, at + copies_of[d]
        out = []
        for s, p in zip(self.sources, places):
            mine = [len(range(first[d] + (rank - first[d]) % world, first[d] + copies_of[d], world))
                    for d in p]
            keep = [i for i, k in enumerate(mine) if k]
            sub = s.subset(keep)
            out.append(replace(sub, repeats=[mine[i] for i in keep]) if keep else sub)
        return out

    def bucket_rows(self) -> dict[int, int]:
        """Rows per bucket an epoch brings, over every source (data.bucketing)."""
        out: dict[int, int] = {}
        for s in self.sources:
            for b, n in s.bucket_rows().items():
                out[b] = out.get(b, 0) + n
        return out

    def bucket_histogram(self) -> dict[int, int]:
        """Distinct usable rows per bucket id (the sources' images, repeats not counted)."""
        out: dict[int, int] = {}
        for s in self.sources:
            for counts in s.bucket_counts or []:
                for b, n in counts.items():
                    out[b] = out.get(b, 0) + n
        return dict(sorted(out.items()))

    def summary(self) -> list[dict]:
        """Per source, for ``raylora.json``: files, distinct rows, rows per epoch (and its
        share of the epoch, and the source's multiplier), and how many rows count how many
        times where a caption folder's folders say so."""
        out = []
        for s in self.sources:
            entry = {"source": s.index, "uri": s.uri, "format": s.format, "files": len(s.files),
                     "rows": s.rows, "rows_per_epoch": s.epoch_rows(),
                     "share": round(s.epoch_rows() / self.rows, 6) if self.rows else 0.0,
                     "multiplier": s.mult}
            if s.files and (commit := planned_commit(s.files[0])):  # a hub dataset's
                entry["commit"] = commit
            if s.repeats:
                counts = Counter()
                for r, n in zip(s.repeats, s.file_rows):
                    counts[r] += n
                entry["rows_by_repeats"] = {str(r): n for r, n in sorted(counts.items())}
            out.append(entry)
        return out


def plan_source(section: DataSection, storage: Storage, index: int = 0,
                buckets=None, key=lambda k: f"data.{k}") -> SourceFiles:
    """Resolve one source's URI, detect its format, check what can be checked and count
    its rows (per bucket of ``buckets``, a ``BucketSet``, when given). Raises
    FileNotFoundError / ValueError / OSError naming the URI or file; DataProblems for a
    key besides the URI (``key``: how this source names one, ``data.sources[i].…``)."""
    listing = storage.expand(section.uri)
    fmt = get_format(detect_format(listing) if section.format == "auto" else section.format)
    files = fmt.select(listing)
    if not files:
        raise FileNotFoundError(f"{section.uri}: matched no {fmt.name} files")
    if fmt.name in FOLDER_FORMATS:
        listing = _with_sidecars(section.uri, files, listing, storage)
        if section.format == "auto":
            _not_a_pattern_over_an_imagefolder(section, fmt.name, listing, key)
    fmt.check_listing(section, files, listing)
    repeats = fmt.repeats(section, files)
    controls, lacking = control_files(section, fmt.name, files, listing, storage, key, repeats)
    rows, file_rows = fmt.count_rows(section, files, storage)
    out = SourceFiles(index, fmt.name, files, rows, file_rows, repeats,
                      section.uri, fmt.companions(section, files, listing) + controls)
    if buckets is None:
        return out
    counts, ids = scan_buckets(section, out, storage, buckets, index, lacking)
    return replace(out, bucket_counts=counts, row_buckets=ids)


# The formats whose images are files, found beside (or, data.control_uri, apart from) their
# control images; the shard formats hold theirs inside.
FOLDER_FORMATS = ("captionfolder", "imagefolder")


def _with_sidecars(uri: str | list[str], files: list[str], listing: list[str],
                   storage: Storage) -> list[str]:
    """``listing`` and, where ``uri`` names images rather than folders (a glob such as
    ``DIR/*.png``, a brace list, a file), the files beside those images: their caption
    files, masks and control images, which such a listing holds only where the pattern
    matched them too (``mychar/*.png`` refused every image as having no caption). A
    folder's recursive listing holds them already: no request more."""
    from raylora.storage import skipped

    uris = [uri] if isinstance(uri, str) else list(uri)
    # expand took these: a name that is no folder is a pattern (or a file) it matched
    if all(storage.info(u).type == pafs.FileType.Directory for u in uris):
        return listing
    have = set(listing)
    extra = [u for u, info in storage.beside(files).items()
             if info.type == pafs.FileType.File and u not in have and not skipped(u.rsplit("/", 1)[-1])]
    return listing + sorted(extra)


def _not_a_pattern_over_an_imagefolder(section: DataSection, fmt: str, listing: list[str],
                                       key) -> None:
    """A pattern over an imagefolder's images (``DIR/*.png``) matched images only: it was
    detected as a caption folder and refused as "4 of 4 images have no caption" while
    their captions were in the ``metadata.jsonl`` beside them. An imagefolder is read whole
    (its metadata names its images): the folder is the URI to give."""
    from raylora.data.formats.imagefolder import is_metadata

    metas = [u for u in listing if is_metadata(u)]
    if fmt == "captionfolder" and metas:
        folder = metas[0].rsplit("/", 1)[0]
        raise ValueError(f"{key('uri')}: {section.uri}: the images it matches are a Hugging Face "
                         f"imagefolder's ({metas[0]} beside them holds their captions), which is "
                         f"read whole: give its folder, {folder}")


def control_files(section: DataSection, fmt: str, files: list[str], listing: list[str],
                  storage: Storage, key=lambda k: f"data.{k}",
                  repeats: list[int] | None = None) -> tuple[list[str], set[str]]:
    """data.control_images of a folder format: (the control images its rows read (sidecars
    in ``listing``, or data.control_uri's folders, listed here), every input's (input 1's,
    then input 2's, ...), for the fingerprint; the images lacking any input's, which the
    bucket scan counts in no bucket). Refused up front: data.control_uri with shards, a
    folder of it inside the data's folder, or empty; images without a control image (any
    one input's) above data.max_bad_fraction of the reads (``repeats``: times each file is
    read an epoch, ``ShardFormat.repeats``; fewer: logged, they are dropped as
    missing_control)."""
    if not section.control_images:
        return [], set()
    if section.control_uri and fmt not in FOLDER_FORMATS:
        raise DataProblems([f"{key('control_uri')}: {section.control_uri}: {fmt} shards hold "
                            "their own control images (KEY.control.<ext> members, "
                            "data.control_column); leave it unset"])
    if fmt not in FOLDER_FORMATS:
        return [], set()
    folders = section.control_folders()
    listed = [_control_listing(section, storage, key, folder) for folder in folders or []]
    if problems := [p for _, p in listed if p]:  # every folder's, at once
        raise DataProblems(problems)
    wheres = [w for w, _ in listed] if folders else [listing] * section.control_inputs
    # Each image with the times an epoch reads it (a kohya N_name folder's N): the run's
    # data.max_bad_fraction counts rows read, and judged per image a folder of 10 reads
    # each passed here and then stopped the run (check_listing weighs captions so too).
    reads = dict(zip(files, repeats or [1] * len(files)))
    images = {f: reads[f] for f in files if f.lower().endswith(IMAGE_EXTS)}
    found, lacking = [], set()
    for i, where in enumerate(wheres):
        got, missing = _find_controls(section, list(images), where, i)
        found += got
        lacking.update(missing)
        if missing:
            problems += _judge_missing(section, key, i, folders, images, missing)
    if not problems and section.control_inputs > 1:
        problems += _judge_lacking(section, key, images, lacking)
    if problems:
        raise DataProblems(problems)
    return found, lacking


def _control_listing(section: DataSection, storage: Storage, key,
                     folder: str) -> tuple[list[str], str | None]:
    """(the files of one data.control_uri folder, None), or ([], why it cannot serve:
    inside the data, or empty)."""
    from raylora.data.formats.captionfolder import root_holding
    from raylora.storage import normalize

    root = normalize(folder).rstrip("/")
    inside = root_holding(section.uri, root, storage)
    if inside:
        return [], (f"{key('control_uri')}: {folder} is inside {key('uri')} ({inside}): "
                    "its images would train as targets")
    where = storage.list_files(root)
    return where, None if where else f"{key('control_uri')}: {folder}: no files"


def _find_controls(section: DataSection, images: list[str], where: list[str],
                   i: int) -> tuple[list[str], list[str]]:
    """(input ``i``'s control images of ``images`` found in the listing ``where``, the
    images without one)."""
    present, found, missing = set(where), [], []
    for f in images:
        u = next((u for u in control_candidates(section, f, i) if u in present), None)
        (found if u else missing).append(u or f)
    return found, missing


def _read_share(images: dict[str, int], some) -> float:
    """The share of an epoch's reads of ``images`` (image → reads) that ``some`` make."""
    total = sum(images.values())
    return sum(images[f] for f in some) / total if total else 0.0


def _judge_missing(section: DataSection, key, i: int, folders: list[str] | None,
                   images: dict[str, int], missing: list[str]) -> list[str]:
    """Input ``i``'s missing control images (of ``images``, each with its reads an epoch):
    the problem when their reads are over data.max_bad_fraction, else logged (they are
    dropped as missing_control)."""
    import logging

    place = f"none in {folders[i]}" if folders else f"no KEY{control_infix(i)}.<ext> beside them"
    which = f"input {i + 1}'s " if section.control_inputs > 1 else ""
    what = (f"{len(missing)} of {len(images)} images have no {which}control image ({place}; "
            f"e.g. {', '.join(missing[:3])})")
    share = _read_share(images, missing)
    if share > section.max_bad_fraction:
        return [f"{key('control_images')}: {what}; {share:.1%} of the reads, over "
                f"data.max_bad_fraction={section.max_bad_fraction:g}"]
    logging.getLogger("raylora.data").warning("%s: they are dropped as missing_control", what)
    return []


def _judge_lacking(section: DataSection, key, images: dict[str, int],
                   lacking: set[str]) -> list[str]:
    """The images lacking any one of several inputs: each input's share may be under
    data.max_bad_fraction while together they drop more (every such row is dropped)."""
    share = _read_share(images, lacking)
    if share <= section.max_bad_fraction:
        return []
    return [f"{key('control_images')}: {len(lacking)} of {len(images)} images lack at least "
            f"one of their {section.control_inputs} control images (e.g. "
            f"{', '.join(sorted(lacking)[:3])}); {share:.1%} of the reads, over "
            f"data.max_bad_fraction={section.max_bad_fraction:g}"]


def scan_buckets(section: DataSection, s: SourceFiles, storage: Storage, buckets,
                 index: int, lacking: set[str] = frozenset(),
                 ) -> tuple[list[dict[int, int]], np.ndarray]:
    """(training rows per bucket of each of a source's files, each row's bucket id in file
    order: ``SourceFiles.row_buckets``), from the images' headers (every image is read
    once, on the driver: what kohya's and SimpleTuner's bucket caches do too). A held-out
    row (data.validation_split) is counted in no bucket: the split is a hash of the row,
    so it holds out more of one bucket than of another, and a schedule that scaled every
    bucket by the split trained rows twice or skipped them. Nor is a row without a control
    image (data.control_images; ``lacking``: a folder's images ``control_files`` found
    none for): the workers drop it, and a bucket counted with it planned batches they
    could not fill (a bucket of such rows alone stopped the run mid-epoch)."""
    from raylora.data.buckets import bucket_counts, scan_rows

    fmt = get_format(s.format)
    # Headers are all a scan reads of an image: no sidecar masks, and no folder's control
    # images (a GET each; ``lacking`` says which are missing). A shard row's come with it:
    # a tar is read whole anyway; a parquet's control column is read beside its images.
    shard_controls = section.control_images and s.format not in FOLDER_FORMATS
    section = section.model_copy(update={"masked_loss": False, "control_images": shard_controls})
    keep = dict(min_size=section.min_size, skip_small=section.small_images == "skip",
                keep_empty=section.caption_dropout > 0, max_pixels=section.max_image_pixels,
                split=section.validation_split, prefix=section.caption_prefix or "",
                controls=control_names(section), lacking=lacking)
    if s.file_rows is None:  # one row list for the whole source
        ids = scan_rows(fmt.iter_rows(section, s.files, storage), buckets, index, **keep)
        return [bucket_counts(ids)], ids
    per_file = []
    for i, n in enumerate(s.file_rows):
        ids = scan_rows(fmt.iter_unit(section, s.files, storage, i, 0, n), buckets, index, **keep)
        # as many ids as the rows counted (a shard short of its manifest's count: -1s)
        per_file.append(np.pad(ids[:n], (0, n - len(ids[:n])), constant_values=-1))
    ids = np.concatenate(per_file) if per_file else np.zeros(0, np.int16)
    return [bucket_counts(f) for f in per_file], ids


def plan_data(data: DataSection, storage: Storage) -> DataPlan:
    """The plan of ``data.uri``, or of every source of ``data.sources`` with its
    multiplier. Raises FileNotFoundError / ValueError / OSError naming the URI or file at
    fault; for sources, DataProblems naming each source's key."""
    from raylora.data.buckets import bucket_set

    sources, problems, buckets = [], [], bucket_set(data)
    for i, section in enumerate(data.source_sections()):
        try:
            sources.append(plan_source(section, storage, i, buckets,
                                       key=lambda k, i=i: _source_key(data, i, k)))
        except DataProblems as exc:  # named by their own keys
            if data.sources is None:
                raise
            problems += exc.problems
        except (FileNotFoundError, ValueError, OSError) as exc:
            if data.sources is None:
                raise
            problems.append(f"{data.source_key(i, 'uri')}: {exc}")
    if data.sources is not None:
        problems += [f"{data.source_key(s.index, 'uri')}: {s.uri}: no rows"
                     for s in sources if not s.natural_rows()]
    problems += _unread_caption_extension(data, sources)
    if problems:
        raise DataProblems(problems)
    # Each row's bucket is kept only where a partial copy is drawn per bucket.
    return DataPlan.of([s if s.fractional() else replace(s, row_buckets=None)
                        for s in apply_shares(data, sources)])


def _unread_caption_extension(data: DataSection, sources: list[SourceFiles]) -> list[str]:
    """A source's own caption_extension set where its data is no caption folder: parquet
    or WebDataset data take their captions from a column or a member, and a kohya user's
    ``.caption`` setting did nothing, without a word. (``data.caption_extension`` itself
    may be for the held-out or class images: ``unread_caption_extension``.)"""
    return [f"{data.source_key(s.index, 'caption_extension')}: set, but {s.uri} is {s.format} "
            "data: only caption folders read it; drop it"
            for s in sources if data.sources is not None
            and data.sources[s.index].caption_extension is not None and s.format != "captionfolder"]


def unread_caption_extension(data: DataSection, plan: DataPlan) -> str | None:
    """``data.caption_extension`` set while the training data (``plan``) holds no caption
    folder and nothing else it could be for is set (``data.validation_uri``,
    ``data.class_sources``, each planned apart): a problem line, else None."""
    from raylora.config import DataSection as Section

    if (data.caption_extension == Section.model_fields["caption_extension"].default
            or data.validation_uri or data.class_sources
            or any(s.format == "captionfolder" for s in plan.sources)):
        return None
    formats = ", ".join(sorted({s.format for s in plan.sources}))
    return (f"data.caption_extension: set, but {formats} data has no caption files: only "
            "caption folders read it; drop it")


def _source_key(data: DataSection, i: int, key: str) -> str:
    """How a problem of source ``i`` names ``key``: its own (``data.sources[i].uri``), or,
    for a key only ``data`` has or one the source leaves to ``data``, that key and the
    source (``data.control_images (data.sources[1])``)."""
    from raylora.config import SOURCE_KEYS

    if data.sources is None or key == "uri" or (key in SOURCE_KEYS and getattr(data.sources[i], key) is not None):
        return data.source_key(i, key)
    return f"data.{key} (data.sources[{i}])"


# Rows of each source the driver decodes before anything starts (``sample_problems``).
SAMPLE_ROWS = 16


def sample_problems(data: DataSection, plan: DataPlan, storage: Storage) -> list[str]:
    """One line per source none of whose sampled rows (about ``SAMPLE_ROWS``, spread over
    its files: ``ShardFormat.sample_rows``) decodes as the run's preprocess decodes it
    (``raylora.data.decode``): every image in a format PIL does not read, every caption
    empty, every image under data.min_size with ``small_images: skip``... The run would
    drop each row it read, and found it only after Ray had started, the model had loaded
    and the workers had read a batch: stack traces, then the data.max_bad_fraction error.

    A source with some good rows among those sampled passes: the run judges its bad
    fraction on every row it reads (data.max_bad_fraction). So does every source when
    data.max_bad_fraction is 0.5 or more: a mostly-bad sample is then what the config
    expects. Read errors are problems too: the run would fail on them."""
    from raylora.data.decode import row_problem

    if data.max_bad_fraction >= 0.5:
        return []
    sections, problems = data.source_sections(), []
    for s in plan.sources:
        section, key = sections[s.index], data.source_key(s.index, "uri")
        bad, seen, examples = Counter(), 0, {}
        try:
            for row in get_format(s.format).sample_rows(section, s.files, storage, SAMPLE_ROWS):
                seen += 1
                problem = row_problem(row, masks=section.masked_loss, mask=row.get("mask"),
                                      max_pixels=section.max_image_pixels,
                                      min_size=section.min_size, small_images=section.small_images,
                                      keep_empty_captions=section.caption_dropout > 0,
                                      controls=control_names(section) if section.control_images
                                      else None)
                if problem is not None:
                    bad[problem.reason] += 1
                    if problem.reason not in examples:
                        examples[problem.reason] = f"{row['key']}: {problem}"[:200]
        except OSError as exc:
            problems.append(f"{key}: {s.uri}: reading rows to check them: {exc}")
            continue
        if seen and sum(bad.values()) == seen:
            counts = ", ".join(f"{r}={n}" for r, n in bad.most_common())
            problems.append(
                f"{key}: {s.uri}: none of the {seen} rows read to check it is usable "
                f"({counts}; e.g. {'; '.join(examples.values())}): the run would drop every "
                "such row. " + ". ".join(SAMPLE_HINTS[r] for r in bad) + ".")
    return problems


# What to look at, per reason the sampled rows were bad for (raylora.data.decode).
SAMPLE_HINTS = {
    "empty_image": "Check data.image_column, or that the files hold image bytes",
    "not_an_image": "Check data.image_column, and that the images are in a format this "
                    "machine's PIL reads (python -m PIL.report lists them; HEIC needs a plugin)",
    "corrupt_image": "Check that the images were copied whole",
    "too_many_pixels": "Raise data.max_image_pixels if these images are wanted",
    "too_small": "Lower data.min_size, or set data.small_images: upscale",
    "missing_caption": "Check data.caption_column (or the caption files), or set "
                       "data.caption_dropout > 0 to train them on the empty prompt",
    "caption_not_utf8": "Re-encode the captions as UTF-8",
    "bad_mask": "Check the loss masks (greyscale, the image's size), or turn data.masked_loss off",
    "missing_control": "Put each image's control image beside it as KEY.control.<ext> (parquet: "
                       "check data.control_column), or turn data.control_images off; with "
                       "data.control_inputs > 1 input k's is KEY.control_k.<ext>, the k-th "
                       "folder of data.control_uri or the k-th of data.control_column's columns",
    "bad_control": "Check that the control images were copied whole and are in a format PIL reads",
}


def apply_shares(data: DataSection, sources: list[SourceFiles]) -> list[SourceFiles]:
    """Each source with its multiplier from ``data.sources``: its ``repeats`` (default 1),
    or, when the sources have weights, ``weight / Σ weights`` of an epoch as long as all
    the sources' rows (their folder repeats counted) make, divided by its own rows."""
    if data.sources is None:
        return sources
    given = data.sources
    if given[0].weight is None:  # every source has one, or none (config checks)
        return [replace(s, mult=float(given[s.index].repeats or 1)) for s in sources]
    natural = [s.natural_rows() for s in sources]
    epoch, weights = sum(natural), sum(g.weight for g in given)
    return [replace(s, mult=epoch * given[s.index].weight / weights / n)
            for s, n in zip(sources, natural)]


def cached_row_buckets(plan: DataPlan, storage: Storage) -> DataPlan:
    """A latent cache's plan (data.bucketing) with ``row_buckets`` read from its files'
    ``bucket`` column where a source's partial copy is drawn per bucket (the manifest
    keeps each file's counts alone)."""
    import pyarrow.parquet as pq

    def ids(f: str) -> np.ndarray:
        with storage.open_input(f) as fh:
            return pq.ParquetFile(fh).read(columns=["bucket"])["bucket"].to_numpy().astype(np.int16)

    sources = [replace(s, row_buckets=np.concatenate([ids(f) for f in s.files]))
               if s.fractional() and s.bucket_counts is not None else s for s in plan.sources]
    return DataPlan.of(sources, plan.heldout_dropped)


def unmasked(section: DataSection) -> DataSection:
    """``section`` reading rows without their loss masks (no sidecar reads)."""
    return section.model_copy(update={"masked_loss": False}) if section.masked_loss else section


def iter_plan_rows(data: DataSection, plan: DataPlan, storage: Storage):
    """Every distinct row ``{key, image, text}`` of the plan, in source and file order,
    each source's caption prefix applied, without Ray (held-out rows are read this way on
    the driver). No masks: the held-out loss is unmasked."""
    sections = data.source_sections()
    for s in plan.sources:
        section = unmasked(sections[s.index])
        for row in get_format(s.format).iter_rows(section, s.files, storage):
            yield {**row, "text": with_prefix(section.caption_prefix, row["text"])}


def read_units(data: DataSection, plan: DataPlan, storage: Storage, unit_rows: int,
               cached: bool = False) -> list[dict]:
    """Every read unit of the plan once, in source order: ``k`` (the source's place in
    ``plan.sources``), ``source``, where it is: ``kind`` ``parquet`` (parquet files and a
    latent cache's, in parts of about ``unit_rows`` rows: ``uri``, ``part``, ``parts``) or
    ``unit`` (a registry unit: ``index``, ``start``, ``stop``), and how an epoch reads its
    rows (``_copies``)."""
    from raylora.data.parquet_parts import parquet_parts

    sections = data.source_sections()
    out = []
    for k, s in enumerate(plan.sources):
        copies_of = _copies(s)
        base = {"k": k, "source": s.index, "uri": "", "part": 0, "parts": 0,
                "index": 0, "start": 0, "stop": 0}
        if cached or s.format == "parquet":
            for i, f in enumerate(s.files):
                rows = None if s.file_rows is None else [s.file_rows[i]]
                out += [{**base, "kind": "parquet", **p, **copies_of(i, 0)}
                        for p in parquet_parts([f], rows, unit_rows)]
        else:
            units = get_format(s.format).units(sections[s.index], s.files, storage, unit_rows,
                                               s.repeats)
            out += [{**base, "kind": "unit", "index": i, "start": a, "stop": b,
                     **copies_of(i, a, b)} for i, a, b in units]
    return out


def _copies(s: SourceFiles):
    """``(file index, first row in it, row it stops at or -1) → {whole, take, n, group,
    offset}``: the whole copies an epoch reads of a unit there, the rows ``take`` of the
    partial copy of its ``n``-row multiplicity ``group``, and the unit's first row's place
    in the group (a parquet part adds its first row in the file, known once its footer is
    read). A partial copy drawn per bucket (``_bucket_tables``) adds ``_strata``: the
    unit's rows' bucket ids, their places among their bucket's rows of the group, and per
    bucket its rows and its partial copy's (``pass_items`` makes them the epoch's ``mask``)."""
    mults, groups = s.file_mults(), s.groups()
    ids = {m: g for g, m in enumerate(groups)}
    offsets, seen = [], dict.fromkeys(groups, 0)
    for i, m in enumerate(mults):
        offsets.append(seen[m])
        seen[m] += s.file_rows[i] if s.file_rows is not None else 0
    tables = _bucket_tables(s)

    def of(i: int, start: int, stop: int = -1) -> dict:
        m = mults[i]
        whole, take = copies(m, groups[m])
        out = {"whole": whole, "take": take, "n": groups[m], "group": ids[m],
               "offset": offsets[i] + start}
        if m in tables:
            buckets, ranks, sizes = tables[m]
            end = stop if stop >= 0 else s.file_rows[i] if s.file_rows is not None else len(buckets)
            lo, hi = offsets[i] + start, offsets[i] + end
            out["take"] = sum(t for _, t in sizes.values())
            out["_strata"] = (buckets[lo:hi], ranks[lo:hi], sizes)
        return out

    return of


def _bucket_tables(s: SourceFiles) -> dict[float, tuple[np.ndarray, np.ndarray, dict]]:
    """Per fractional multiplicity of a source whose rows' buckets are known: (its rows'
    bucket ids in group order, each row's place among its bucket's rows of the group,
    {bucket id: (rows, rows of the partial copy)}). The partial copy is drawn bucket by
    bucket, round(frac(m) × n_b) of each bucket's n_b rows (``copies``), so an epoch
    brings each bucket exactly the rows ``SourceFiles.bucket_rows`` planned for it."""
    if s.row_buckets is None:
        return {}
    out = {}
    for m, buckets in s.group_buckets().items():
        if m == int(m):
            continue
        ranks, sizes = np.zeros(len(buckets), np.int64), {}
        for b in np.unique(buckets).tolist():
            at = np.flatnonzero(buckets == b)
            ranks[at] = np.arange(len(at))
            sizes[b] = (len(at), copies(m, len(at))[1])
        out[m] = (buckets, ranks, sizes)
    return out


def pass_items(units: list[dict], seed: int, epoch: int, shuffle: bool) -> list[dict]:
    """What epoch ``epoch`` reads: each unit ``whole`` times, copy after copy, then its
    partial copy (``keep`` rows of its group, by the epoch's ``a``, ``b``; ``keep`` -1:
    every row; ``a`` 0: drawn per bucket, the rows whose bits in ``mask`` are set);
    ``shuffle``: in an order drawn from the seed and the epoch alone, else in that
    order."""
    rounds = max((u["whole"] + (u["take"] > 0) for u in units), default=1)
    items, draws = [], {}

    def draw(key: tuple, n: int) -> tuple[int, int]:
        if key not in draws:
            draws[key] = _affine(seed, epoch, *key[:2], n, *key[2:])
        return draws[key]

    for c in range(rounds):
        for u in units:
            plain = {k: v for k, v in u.items() if k != "_strata"}
            if c < u["whole"]:
                items.append({**plain, "keep": -1, "a": 0, "b": 0, "mask": b""})
            elif c == u["whole"] and u["take"] and "_strata" in u:
                buckets, ranks, sizes = u["_strata"]
                keep = np.zeros(len(buckets), dtype=bool)
                for b in np.unique(buckets).tolist():
                    (n, take), at = sizes[b], buckets == b
                    # bucket ids from -1: the draw's key must be non-negative
                    a_, b_ = draw((u["source"], u["group"], b + 1), n)
                    keep[at] = (a_ * ranks[at] + b_) % n < take
                items.append({**plain, "keep": u["take"], "a": 0, "b": 0,
                              "mask": np.packbits(keep).tobytes()})
            elif c == u["whole"] and u["take"]:
                a_, b_ = draw((u["source"], u["group"]), u["n"])
                items.append({**plain, "keep": u["take"], "a": a_, "b": b_, "mask": b""})
    order = np.random.default_rng([seed, epoch]).permutation(len(items)) if shuffle \
        else range(len(items))
    return [{"epoch": epoch, **items[i]} for i in order]


def _affine(seed: int, epoch: int, source: int, group: int, n: int,
            *bucket: int) -> tuple[int, int]:
    """``(a, b)`` of the permutation ``p → (a·p + b) mod n`` of a group's row positions
    (``a`` coprime to ``n``), drawn from the seed, the epoch and the group (and ``bucket``:
    one bucket's rows of the group)."""
    rng = np.random.default_rng([seed, epoch, source, group, *bucket])
    b = int(rng.integers(n))
    a = 1
    while n > 2:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            break
    return a, b


def keep_rows(positions: np.ndarray, item: dict) -> np.ndarray:
    """Which rows at group ``positions`` a read item keeps (all, or its partial copy's)."""
    if int(item["keep"]) < 0:
        return np.ones(len(positions), dtype=bool)
    a, b, n = int(item["a"]), int(item["b"]), int(item["n"])
    if a == 0:  # drawn per bucket: the unit's bits (a mask cut short ends in rows left out)
        bits = np.append(np.unpackbits(np.frombuffer(bytes(item["mask"]), np.uint8)), 0)
        at = positions.astype(np.int64) - int(item["offset"])
        return bits[np.minimum(at, len(bits) - 1)].astype(bool)
    return (a * positions.astype(np.int64) + b) % n < int(item["keep"])


def unit_keep(item: dict):
    """``keep_rows`` as ``ShardFormat.iter_unit`` takes it: by a row's place in the unit
    (None: every row)."""
    if int(item["keep"]) < 0:
        return None
    offset = int(item["offset"])
    return lambda j: bool(keep_rows(np.array([offset + j]), item)[0])
