"""Training progress on the driver: a live line on a terminal, plain lines in a log.

The numbers are made on the rank-0 worker, in another process (often another node).
``ray.train.report`` would carry them but is a barrier across all workers and is kept
for checkpoints and evaluations; Ray Train's callbacks run on its controller, not here.
So rank 0 sends each step's row to the run's small named actor (raylora.desk) without
waiting (``Board.push.remote``), and a thread on the driver polls it twice a second.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

POLL_S = 0.5
# Under output.uri: the latest progress line, for `raylora status` (raylora.jobs).
PROGRESS_FILE = "progress.json"
# Its last line once the adapter is written (``finished_row``): how `raylora stop` tells a
# job stopped as its driver exited from one stopped with steps left.
FINISHED = "the run finished"
# Smoothing of the printed loss and img/s: one step's loss is mostly timestep noise.
EMA = 0.9


class Board:
    """Step rows in arrival order; plain Python (part of the run's actor, raylora.desk)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def push(self, row: dict) -> None:
        self.rows.append(row)

    def since(self, n: int) -> list[dict]:
        return self.rows[n:]


def every_n_steps(log_every_n_steps: int | None, total: int) -> int:
    """``train.log_every_n_steps``, else a tenth of the run."""
    return log_every_n_steps or max(1, total // 10)


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclass
class Stats:
    """What the lines show, updated from each step row."""

    total: int
    step: int = 0
    epoch: int = 0
    loss: float | None = None  # smoothed
    min_loss: float | None = None
    lr: float = 0.0
    images_per_s: float | None = None  # smoothed
    first: tuple[int, float] | None = None  # (step, time) of the first row seen
    last_t: float = field(default_factory=time.monotonic)

    def take_loss(self, loss: float) -> None:
        if math.isfinite(loss):  # a skipped (non-finite) step changes neither
            self.loss = loss if self.loss is None else EMA * self.loss + (1 - EMA) * loss
            self.min_loss = loss if self.min_loss is None else min(self.min_loss, loss)

    def update(self, row: dict, now: float) -> None:
        self.take_loss(row["loss"])
        ips = row["images_per_s"]
        self.images_per_s = ips if self.images_per_s is None else EMA * self.images_per_s + (1 - EMA) * ips
        self.step, self.epoch, self.lr, self.last_t = row["step"], row["epoch"], row["lr"], now
        # The anchor is the last row of the first poll: rows come in read-back groups
        # (train.readback_every_n_steps), all with this poll's time, and steps 1-9 of a
        # group of 10 timed at 0 s put the first ETA at 0:00 and the next ones at half.
        if self.first is None or now == self.first[1]:
            self.first = (self.step, now)

    def carry(self, carried: dict) -> None:
        """A resumed run's smoothed loss, as the straight run's driver had it at the
        checkpoint (``carried``), so the line goes on where it left off instead of
        starting again from one step's noise. Only into a driver that has seen no row:
        a restart under the same driver keeps its own."""
        if self.loss is None:
            self.loss, self.min_loss = carried.get("loss"), carried.get("min_loss")

    def eta_s(self) -> float | None:
        """From the rate since the first row this driver saw (a resumed run starts late)."""
        if self.first is None or self.step <= self.first[0]:
            return None
        rate = (self.step - self.first[0]) / max(self.last_t - self.first[1], 1e-9)
        return (self.total - self.step) / rate

    def fields(self) -> str:
        loss = "n/a" if self.loss is None else f"{self.loss:.4f}"
        ips = "n/a" if self.images_per_s is None else f"{self.images_per_s:.1f}"
        eta = self.eta_s()
        return (f"epoch {self.epoch} loss {loss} lr {self.lr:.3g} {ips} img/s "
                f"ETA {'?' if eta is None else _eta(eta)}")

    def line(self, label: str | None = None) -> str:
        """``label``: a search's trial, named before the step."""
        pct = 100 * self.step // max(self.total, 1)
        who = f"{label} " if label else ""
        return f"raylora: {who}step {self.step}/{self.total} ({pct}%) {self.fields()}"


def carried(history: list[dict]) -> dict:
    """What ``Stats.carry`` takes, from a restored run's history rows (``LoopState.history``).
    img/s is left out: it is this attempt's rate (another node, a warm cache), not the
    earlier one's."""
    stats = Stats(total=0)
    for row in history:
        if row.get("loss") is not None:
            stats.take_loss(row["loss"])
    return {"loss": stats.loss, "min_loss": stats.min_loss}


@dataclass
class _Track:
    """One run's line: its stats and when it was last printed (the clock starts at its
    first step: model loading is not a silence to fill)."""

    stats: Stats
    label: str | None = None  # a search's trial; None: the one run of `raylora train`
    printed_step: int | None = None
    printed_t: float | None = None
    ended: int | None = None  # a search's trial: the step its results are from
    said_end: bool = False

    def line(self) -> str:
        return self.stats.line(self.label)

    @property
    def stopped_early(self) -> bool:
        return self.ended is not None and self.ended < self.stats.total

    def end_line(self) -> str:
        return (f"raylora: {self.label} stopped early at step {self.ended}/{self.stats.total} "
                "by the search's scheduler (its results are that step's)")


class ProgressPrinter:
    """Polls the board from a thread: a tqdm line on a TTY, else one plain line every
    ``every_steps`` steps or ``every_s`` seconds, whichever comes first, and the last step.
    ``labelled`` (a search): rows carry a ``label`` (their trial) and their run's
    ``total``, and each label gets lines of its own, always plain (one bar cannot show
    several runs)."""

    def __init__(self, board, total: int, every_steps: int, every_s: float,
                 stream=None, tty: bool | None = None, sink=None, labelled: bool = False):
        self.board, self.stream, self.sink = board, stream or sys.stdout, sink
        self.tty = (self.stream.isatty() if tty is None else tty) and not labelled
        self.total, self.every_steps, self.every_s = total, every_steps, every_s
        self.tracks: dict[str | None, _Track] = {}
        self._seen = 0
        self._size = None  # (workers, accumulation) of the latest step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raylora-progress", daemon=True)
        self._bar = None

    def start(self) -> ProgressPrinter:
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc="raylora train", file=self.stream,
                             dynamic_ncols=True, disable=False)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and show what arrived last (each run's final step)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()
        if self._bar is not None:
            self._bar.close()
        for track in self.tracks.values():
            if track.stopped_early:
                self._say_end(track)
                continue
            if track.stats.step and track.printed_step != track.stats.step:
                if self._bar is not None and track.label is None:
                    self._record(track)
                else:
                    self._print(track)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._poll()
            except Exception:  # the board is gone (run failed): fit() reports why
                return

    def _poll(self) -> None:
        import ray

        rows = ray.get(self.board.since.remote(self._seen), timeout=30)
        self._seen += len(rows)
        for row in rows:
            self._consume(row, time.monotonic())

    def _track(self, row: dict) -> _Track:
        label = row.get("label")
        if label not in self.tracks:
            self.tracks[label] = _Track(Stats(row.get("total") or self.total), label)
        track = self.tracks[label]
        if row.get("total"):  # (a trial's own budget; its end may have come first)
            track.stats.total = row["total"]
        return track

    def _consume(self, row: dict, now: float) -> None:
        track = self._track(row)
        if "carried" in row:  # a resumed run's smoothing state, before its first step
            track.stats.carry(row["carried"])
            return
        if "ended" in row:  # the search's driver: the step a trial's results are from
            self._end(track, int(row["ended"]))
            return
        if track.ended is not None and row.get("step", 0) > track.ended:
            return  # the steps of a stopped trial's workers before Tune's stop reached them
        self._note_size(row)
        stats = track.stats
        stats.update(row, now)
        if track.printed_t is None:
            track.printed_t = now
        due = (stats.step % self.every_steps == 0 or stats.step >= stats.total
               or now - track.printed_t >= self.every_s)
        if self._bar is not None and track.label is None:
            self._bar.update(stats.step - self._bar.n)
            self._bar.set_postfix_str(stats.fields(), refresh=False)
            if due:
                self._record(track)
        elif due:
            self._print(track)
        if track.ended is not None and stats.step >= track.ended:
            self._say_end(track)

    def _end(self, track: _Track, step: int) -> None:
        """A trial ended at ``step``. One the scheduler stopped early (ASHA) has its
        workers train on until Tune's stop reaches them, and its lines went on past the
        step its results are from (step 19/30 for results of step 15): it gets a line
        that says where it stopped, and no more. (Said once its rows reach that step, as
        ``_consume`` says it: the end may overtake them, and until a row has come the
        trial's own budget, ``total``, is not known either.)"""
        track.ended = step
        if track.stats.step >= step:
            self._say_end(track)

    def _say_end(self, track: _Track) -> None:
        if not track.stopped_early or track.said_end:
            return
        track.said_end = True
        print(track.end_line(), file=self.stream, flush=True)
        track.printed_step, track.printed_t = track.stats.step, time.monotonic()
        self._sink({"step": track.ended, "total": track.stats.total, "loss": None, "eta_s": None,
                    "line": track.end_line(), "time": time.time(), "label": track.label})

    def _note_size(self, row: dict) -> None:
        """A line when the workers' number changed (an elastic run resized; a restart at
        the same size is not one)."""
        size = (row.get("world_size"), row.get("accumulation"))
        if size[0] is None or row.get("label") is not None or size == self._size:
            return
        if self._size is not None:
            line = (f"raylora: resized to {size[0]} worker(s), gradient accumulation {size[1]} "
                    f"(was {self._size[0]} × {self._size[1]}), from step {row['step']}")
            print(line, file=self.stream, flush=True)
        self._size = size

    def _print(self, track: _Track) -> None:
        print(track.line(), file=self.stream, flush=True)
        self._record(track)

    def _record(self, track: _Track) -> None:
        """The line is due: hand it to ``sink`` (progress.json) too."""
        stats = track.stats
        track.printed_step, track.printed_t = stats.step, time.monotonic()
        self._sink({"step": stats.step, "total": stats.total, "loss": stats.loss,
                    "eta_s": stats.eta_s(), "line": track.line(), "time": time.time(),
                    "label": track.label})

    def _sink(self, row: dict) -> None:
        if self.sink is not None:
            try:
                self.sink(row)
            except Exception as exc:  # a storage hiccup must not stop the progress line
                print(f"raylora: progress.json not written: {exc}", file=sys.stderr)


def bucket_line(b: dict) -> str:
    """data.bucketing: rows per bucket (WxH), most rows first, and how many train."""
    rows = sorted(b["rows"].items(), key=lambda kv: (-kv[1], kv[0]))
    trained = len(b["batches_per_epoch"])
    return (f"raylora: buckets      {', '.join(f'{k} {n}' for k, n in rows)} rows "
            f"({trained} of {len(rows)} fill a batch)")


def class_images_line(c: dict) -> str:
    """Prior preservation: the class images used, how many the user gave, how many the
    run generated (this run, or an earlier one whose folder it reused) and that folder
    (``ClassImages.summary``)."""
    n, given, now = c["class_images"], c["class_images_given"], c["class_images_generated"]
    if not c.get("class_images_uri"):  # the given ones were enough: nothing generated
        return f"raylora: class images {n} ({given} given)"
    made = n - given
    how = (f"{made} generated now" if now == made else f"{made} generated earlier" if not now
           else f"{made} generated, {now} of them now")
    return f"raylora: class images {n} ({given} given, {how}) in {c['class_images_uri']}"


def summary_lines(s: dict) -> list[str]:
    """The end-of-run summary from ``launch.run``'s result."""
    from raylora.checkpoint.export import BASE_COPY, base_in_code, call_args, quoted, quoted_args
    from raylora.storage import is_local

    m = s["metrics"]
    wall = m.get("wall_seconds") or 0.0
    ips = m["images_seen"] / wall if wall else 0.0
    lo = s.get("train_loss_min")
    base, note = base_in_code(s["base_model"])
    lines = [
        f"raylora: trained {m['steps']} steps, {m['images_seen']} images in {wall:.1f}s "
        f"({ips:.1f} img/s); loss {m['train_loss_first']:.5f} → {m['train_loss_last']:.5f}"
        + ("" if lo is None else f" (min {lo:.5f})"),
        f"raylora: adapter      {s['adapter']}",
    ]
    if s.get("kohya"):
        lines.append(f"raylora: kohya file   {s['kohya']}")
    lines += [
        f"raylora: checkpoints  {s['checkpoints']}",
        f"raylora: loss curve   {s['loss_png']}",
        f"raylora: step metrics {s['metrics_jsonl']}",
        *([bucket_line(s["buckets"])] if s.get("buckets") else []),
        *([class_images_line(s["class_images"])] if s.get("class_images") else []),
        f"raylora: bad samples  {m.get('bad_records', 0)}"
        + (f" (of {s['rows_decoded'] + m.get('bad_records', 0)} rows read)"
           if s.get("rows_decoded") is not None else ""),
        f"raylora: use it       pipe = {s['pipeline']}.from_pretrained({base}"
        f"{quoted_args(s.get('base_kwargs') or {})}); "
        + (f"pipe.load_lora_weights({quoted(s['adapter'])}{call_args(s.get('load_kwargs') or {})})"
           if s.get("variant", "lora") in ("lora", "dora")
           else f"pipe.{s['denoiser']} = PeftModel.from_pretrained(pipe.{s['denoiser']}, {quoted(s['adapter'])})"),
    ]
    if note:  # a base in object storage: the call names a local copy of it
        lines.append(f"raylora:              ({BASE_COPY}: {note})")
    if not is_local(s["adapter"]):
        lines.append("raylora:              (diffusers and peft read a local folder: copy the "
                     "adapter folder down first)")
    return lines


@contextmanager
def watch(desk: str, total: int, log_every_n_steps: int | None, log_every_n_seconds: float,
          sink=None, labelled: bool = False):
    """Around ``fit()``: the printer reading the board of the run's desk (raylora.desk,
    by name, as the workers get it: ``WorkerSpec.progress_board``); ``sink(dict)`` gets
    each line due (``write_progress``); ``labelled``: a search's trials share the board
    (``ProgressPrinter``). Needs Ray."""
    from raylora.desk import handle

    printer = ProgressPrinter(handle(desk), total, every_n_steps(log_every_n_steps, total),
                              log_every_n_seconds, sink=sink, labelled=labelled).start()
    try:
        yield
    finally:
        try:
            printer.stop()
        except Exception:  # a failed run's error matters, not its last progress line
            pass


def finished_row(summary: dict) -> dict:
    """progress.json's last row: the run trained its steps and its adapter is written
    (``launch.run``'s summary)."""
    m = summary["metrics"]
    n = m["steps"]
    line = (f"raylora: {FINISHED}: trained {n} step{'' if n == 1 else 's'}, loss {m['train_loss_first']:.5f} → "
            f"{m['train_loss_last']:.5f}; adapter {summary['adapter']}")
    return {"step": n, "total": n, "loss": m["train_loss_last"], "eta_s": 0,
            "finished": True, "line": line, "time": time.time()}


def write_progress(store, output_uri: str):
    """A ``sink`` for ``watch``: the line as ``{output_uri}/progress.json`` (replaced)."""
    import json

    from raylora import storage

    uri = storage.join(output_uri, PROGRESS_FILE)
    return lambda row: store.write_bytes(uri, json.dumps(row).encode())


def write_search_progress(store, output_uri: str):
    """A ``sink`` for a search's ``watch``: every trial's latest line, as
    ``{output_uri}/progress.json`` ``{"trials": {label: row}}`` (replaced)."""
    latest: dict[str, dict] = {}
    write = write_progress(store, output_uri)

    def sink(row: dict) -> None:
        latest[row["label"]] = row
        write({"trials": latest})

    return sink
