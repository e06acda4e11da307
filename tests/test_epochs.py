"""#22 item 4: every epoch of a run from one Ray Data pipeline (raylora.data.source:
build_dataset over passes, pass_batches, EpochStream; raylora.worker._epoch_batches)."""

import io

import numpy as np
import pytest

from raylora.data.source import EpochStream, pass_batches


def blocks(passes, rows: int, cut: int):
    """Rows 0..rows-1 of each pass, in blocks of ``cut`` rows."""
    for e in passes:
        for s in range(0, rows, cut):
            ids = np.arange(s, min(s + cut, rows))
            yield {"id": ids, "epoch": np.full(len(ids), e, np.int32)}


def batches(stream):
    return [(e, b["id"].tolist()) for e, b in stream]


@pytest.mark.parametrize("buffer_rows", [0, 4, 64])
def test_each_pass_is_shuffled_on_its_own_whatever_the_block_cuts(buffer_rows):
    seed = lambda e: 100 + e  # noqa: E731
    got = batches(pass_batches(blocks(range(3), 10, 3), 3, buffer_rows, seed))
    # The same rows cut into other blocks give the same batches...
    assert got == batches(pass_batches(blocks(range(3), 10, 7), 3, buffer_rows, seed))
    # ...and a stream that starts at pass 1 (a resumed run) repeats passes 1 and 2.
    assert [b for b in got if b[0] >= 1] == batches(pass_batches(blocks(range(1, 3), 10, 5), 3,
                                                                 buffer_rows, seed))
    for e in range(3):
        ids = [i for p, b in got if p == e for i in b]
        assert len(ids) == 9 and len(set(ids)) == 9  # 3 batches; the 10th row is dropped
    orders = [[i for p, b in got if p == e for i in b] for e in range(3)]
    if buffer_rows:
        assert orders[0] != orders[1] != orders[2]  # a new order every pass
    else:
        assert orders == [list(range(9))] * 3


def test_a_pass_the_buffer_holds_whole_is_shuffled_without_waiting_for_the_next():
    taken = []

    def source():
        for block in blocks(range(2), 8, 4):
            taken.append(int(block["epoch"][0]))
            yield block

    it = pass_batches(source(), 2, 256, lambda e: e, pass_rows=8)
    e, first = next(it)
    assert e == 0 and taken == [0, 0]  # the whole first pass, none of the second
    assert sorted(first["id"].tolist() + [i for _, b in [next(it) for _ in range(3)]
                                          for i in b["id"].tolist()]) == list(range(8))


def opener(rows: int, opened: list):
    def open_stream(epoch):
        opened.append(epoch)
        return pass_batches(blocks(range(epoch, epoch + 3), rows, 4), 2, 4, lambda e: e)
    return open_stream


def test_epoch_stream_runs_on_across_epochs_and_reopens_only_when_it_must():
    opened = []
    per_pass = EpochStream(opener(10, opened), batches_per_epoch=4, per_pass=True)
    epochs = [[b["id"].tolist() for b in per_pass(e)] for e in range(5)]
    assert opened == [0, 3]  # passes 0-2 from the first stream, then 3-5
    for ep in epochs:  # 5 batches per pass, capped at 4; each row at most once
        ids = [i for b in ep for i in b]
        assert len(ep) == 4 and len(set(ids)) == 8
    # A resumed run asks for epoch 1 first: a new stream repeats it exactly.
    again = EpochStream(opener(10, opened), batches_per_epoch=4, per_pass=True)
    assert [b["id"].tolist() for b in again(1)] == epochs[1]
    assert opened[-1] == 1
    for s in (per_pass, again):
        s.close()

    opened.clear()
    counted = EpochStream(opener(10, opened), batches_per_epoch=3, per_pass=False,
                          convert=lambda b: {"id": b["id"] * 10}, prefetch=2)
    first = counted(0)
    assert [b["id"].tolist() for b in [next(first)]] == [[i * 10 for i in epochs[0][0]]]
    # An epoch left early (max_steps) does not spill into the next one: batch 4 of the
    # stream starts epoch 1.
    assert len(list(counted(1))) == 3 and len(list(counted(2))) == 3
    assert opened == [0]
    counted.close()


def test_an_error_in_the_stream_reaches_the_loop():
    def broken(epoch):
        yield from pass_batches(blocks([epoch], 4, 4), 2, 0, lambda e: e)
        raise OSError("shard gone")

    stream = EpochStream(broken, batches_per_epoch=5, per_pass=False)
    with pytest.raises(OSError, match="shard gone"):
        list(stream(0))
    stream.close()


ROWS = 24


@pytest.fixture(scope="module")
def color_shards(tmp_path_factory):
    """24 rows, each a plain colour of its own (its identity under any crop or flip),
    80x64 so that the random crop has 9 places; two parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    root = tmp_path_factory.mktemp("colors")
    for f in range(2):
        images, texts = [], []
        for i in range(f * ROWS // 2, (f + 1) * ROWS // 2):
            buf = io.BytesIO()
            Image.new("RGB", (80, 64), (10 * i, 255 - 10 * i, 7 * i)).save(buf, format="PNG")
            images.append(buf.getvalue())
            texts.append(f"colour {i}")
        pq.write_table(pa.table({"image": images, "text": texts}), root / f"part-{f}.parquet")
    return str(root)


@pytest.mark.integration
@pytest.mark.parametrize("sharding", ["files", "stream"])
def test_one_pipeline_serves_every_epoch_each_row_once_with_new_draws(
        ray_local, tiny_model, color_shards, tmp_path, monkeypatch, sharding):
    """A worker's data for 3 epochs: the dataset is built once and iterated once (a
    pipeline restarted every epoch builds or iterates it per epoch); every row is in every
    epoch exactly once; the random crops differ between epochs. Under files, a stream
    opened at epoch 1 (a resumed run) repeats the straight run's epoch 1 exactly."""
    import ray.data
    import torch

    from raylora import worker
    from raylora.config import validate
    from raylora.data import source
    from raylora.launch import plan, resolve_paths

    cfg = resolve_paths(validate({
        "model": {"pretrained": tiny_model},
        "data": {"uri": color_shards, "resolution": 32, "center_crop": False,
                 "random_flip": True, "sharding": sharding, "shuffle_buffer_size": 8},
        "train": {"batch_size": 4, "num_epochs": 3, "seed": 3},
        "output": {"uri": str(tmp_path / "out")},
    }))
    spec = worker.WorkerSpec(cfg, plan(cfg))
    builds, iterations, depth = [], [], []
    build = source.build_dataset
    monkeypatch.setattr(source, "build_dataset",
                        lambda *a, **k: builds.append(k["epoch"]) or build(*a, **k))

    def counted(original):
        def iterate(self, *a, **k):  # an iteration started (not one inside another)
            iterations.extend([name] * (not depth))
            depth.append(1)
            try:
                return original(self, *a, **k)
            finally:
                depth.pop()
        name = original.__qualname__
        return iterate

    for cls in (ray.data.Dataset, ray.data.DataIterator):
        for name in ("iter_batches", "iter_torch_batches", "iter_rows", "take_all"):
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, counted(getattr(cls, name)))

    def read(stream, epoch):
        got = list(stream(epoch))
        assert all(b["pixel_values"].dtype == torch.uint8 for b in got)
        return {k: torch.cat([b[k] for b in got]).numpy() for k in ("pixel_values", "crop_top_left")}

    stream = worker._epoch_batches(spec, 0, 1, torch.device("cpu"))
    epochs = [read(stream, e) for e in range(3)]
    stream.close()
    assert builds == [0] and len(iterations) == 1 and stream.opened == 1

    for e in epochs:
        pixels = e["pixel_values"]
        assert pixels.shape == (ROWS, 3, 32, 32)
        assert (pixels == pixels[:, :, :1, :1]).all()  # plain colours: crops and flips keep them
        ids = sorted((pixels[:, 0, 0, 0].astype(int) + 2) // 10)  # red = 10 * row (PNG exact)
        assert ids == list(range(ROWS))  # every row exactly once
    crops = [dict(zip((e["pixel_values"][:, 0, 0, 0].astype(int) + 2) // 10,
                      map(tuple, e["crop_top_left"]))) for e in epochs]
    assert len({c for crop in crops for c in crop.values()}) > 3  # random crops...
    for a, b in ((0, 1), (1, 2)):  # ...drawn anew every epoch
        assert sum(crops[a][i] != crops[b][i] for i in range(ROWS)) >= ROWS // 3

    if sharding == "files":
        resumed = worker._epoch_batches(spec, 0, 1, torch.device("cpu"))
        again = read(resumed, 1)
        resumed.close()
        assert builds == [0, 1]
        for k in again:
            np.testing.assert_array_equal(again[k], epochs[1][k])
        # Two workers, one file each: each draws its own crops. With one seed the i-th
        # row of both was cropped (and its caption dropped) alike.
        two = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": 2})})
        spec2, draws = worker.WorkerSpec(two, plan(two)), []
        for rank in (0, 1):
            ranked = worker._epoch_batches(spec2, rank, 2, torch.device("cpu"))
            got = read(ranked, 0)
            ranked.close()
            # each row's crop by its place in its file (rows 0-11 in one, 12-23 in the other)
            ids = (got["pixel_values"][:, 0, 0, 0].astype(int) + 2) // 10
            draws.append({int(i) % (ROWS // 2): tuple(c) for i, c in zip(ids, got["crop_top_left"])})
        assert sorted(draws[0]) == sorted(draws[1]) == list(range(ROWS // 2))
        assert sum(draws[0][i] != draws[1][i] for i in range(ROWS // 2)) >= ROWS // 6


def test_pass_blocks_chains_passes_and_starts_the_next_one_before_the_last_batches():
    """Several stream workers take each pass from a dataset of its own (pass_blocks): the
    batches are those of one stream of all passes; the next pass's blocks are asked for
    (its execution started) before the current pass's last batches are drawn; the stream
    ends where a pass is missing, and closing it stops a next pass already started."""
    import threading

    from raylora.data.source import pass_blocks

    started, closed = {}, []

    def blocks_of(p):
        if p >= 3:
            return None

        def gen():
            started[p] = threading.Event()
            started[p].set()
            try:
                yield from blocks([p], 10, 4)
            finally:
                closed.append(p)
        return gen()

    seed = lambda e: 100 + e  # noqa: E731
    chained = pass_batches(pass_blocks(0, blocks_of, ahead=1), 3, 64, seed)
    got = []
    for e, b in chained:
        if e == 0 and not got:  # pass 0's first batch: drawn once its last block is here...
            assert started[1].wait(5)  # ...and pass 1 was started before it
        got.append((e, b["id"].tolist()))
    assert got == batches(pass_batches(blocks(range(3), 10, 4), 3, 64, seed))
    assert [e for e, _ in got] == [0] * 3 + [1] * 3 + [2] * 3  # 3 batches a pass; 1 row dropped

    # Closed in pass 0 (after pass 1 was started): pass 1's blocks are closed too.
    closed.clear()
    it = pass_batches(pass_blocks(0, blocks_of, ahead=1), 3, 64, seed)
    next(it)
    it.close()
    assert started[1].wait(5) and sorted(closed) == [0, 1]


def test_pass_splits_hand_each_worker_its_part_of_every_pass_once():
    """PassSplits (the stream workers' board): a pass is split once, whichever worker asks
    first, the next one ahead (up to the run's planned last pass), each worker gets its
    own part, and a pass is let go once every worker took its part; a pass past the plan
    is split when asked for; a worker asking twice is an error, not a hang."""
    from raylora.data.passes import PassSplits

    made = []

    class Dataset:
        def __init__(self, p):
            made.append(p)
            self.p = p

        def streaming_split(self, n, equal):
            assert equal and n == 2
            return [f"pass {self.p} rank {r}" for r in range(n)]

    board = PassSplits(Dataset, world=2, last=2)
    assert board.part(0, 1) == "pass 0 rank 1" and made == [0, 1]  # pass 1 ahead
    assert board.part(0, 0) == "pass 0 rank 0" and made == [0, 1]
    assert board.part(1, 0) == "pass 1 rank 0" and made == [0, 1, 2]
    assert sorted(board._splits) == [1, 2]  # pass 0: every worker has its part
    assert board.part(2, 0) == "pass 2 rank 0" and made == [0, 1, 2]  # 2: the last planned
    assert [board.part(p, 1) for p in (1, 2)] == ["pass 1 rank 1", "pass 2 rank 1"]
    assert board.part(3, 1) == "pass 3 rank 1" and made == [0, 1, 2, 3]  # past the plan
    with pytest.raises(RuntimeError, match="worker 1 asked for pass 3 twice"):
        board.part(3, 1)


@pytest.fixture(scope="module")
def uneven_shards(tmp_path_factory):
    """32 rows of plain colours (red = 8 × row) in files of 20, 6 and 6 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    root, first = tmp_path_factory.mktemp("uneven"), 0
    for f, n in enumerate((20, 6, 6)):
        images = []
        for i in range(first, first + n):
            buf = io.BytesIO()
            Image.new("RGB", (40, 32), (8 * i, 255 - 8 * i, 5 * i)).save(buf, format="PNG")
            images.append(buf.getvalue())
        pq.write_table(pa.table({"image": images, "text": [f"colour {i}" for i in range(first, first + n)]}),
                       root / f"part-{f}.parquet")
        first += n
    return str(root)


@pytest.mark.integration
def test_stream_workers_each_train_their_share_of_every_pass(
        ray_local, tiny_model, uneven_shards, tmp_path, monkeypatch):
    """data.sharding=stream, 2 workers, files of 20, 6 and 6 rows: every epoch each worker
    trains 8 batches of 2 (its 16 rows of the pass) and the two together train each of the
    32 rows exactly once. One dataset of all passes split once was evened out only at its
    end: a worker took rows of the next pass into an epoch (8 rows twice, 8 never in the
    first). The two ranks run in threads here, the broadcast between them faked."""
    import threading

    import torch

    from raylora import worker
    from raylora.config import validate
    from raylora.launch import plan, resolve_paths

    cfg = resolve_paths(validate({
        "model": {"pretrained": tiny_model},
        "data": {"uri": uneven_shards, "resolution": 32, "center_crop": True,
                 "shuffle_buffer_size": 8},
        "train": {"batch_size": 2, "num_epochs": 3, "seed": 3},
        "scaling": {"num_workers": 2},
        "output": {"uri": str(tmp_path / "out")},
    }))
    assert cfg.data.sharding == "stream"
    spec = worker.WorkerSpec(cfg, plan(cfg))
    assert worker._micro_batches_per_epoch(spec) == 8

    me, board, meet = threading.local(), {}, threading.Barrier(2, timeout=120)

    def broadcast(objs, src):  # rank 0's list to rank 1, as torch.distributed would
        if me.rank == src:
            board["objs"] = objs[0]
        meet.wait()
        objs[0] = board["objs"]
        meet.wait()

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    trained, errors = {}, []

    def rank_loop(rank):
        me.rank = rank
        try:
            stream = worker._epoch_batches(spec, rank, 2, torch.device("cpu"))
            stream.start(0)
            try:
                trained[rank] = [[int(i) for b in stream(e)
                                  for i in (b["pixel_values"][:, 0, 0, 0].int() + 3) // 8]
                                 for e in range(3)]
            finally:
                stream.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            meet.abort()

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not errors, errors
    for e in range(3):
        mine = [trained[r][e] for r in (0, 1)]
        assert [len(m) for m in mine] == [16, 16]  # 8 batches of 2 on each worker
        assert sorted(mine[0] + mine[1]) == list(range(32)), e  # every row once


@pytest.mark.integration
def test_one_stream_worker_s_epoch_is_one_pass_when_the_split_keeps_more_rows(
        ray_local, tiny_model, uneven_shards, tmp_path):
    """One worker, data.validation_split 0.15 of the 32 rows: 27 training rows expected
    (13 batches of 2 planned an epoch) but the hash keeps 30 (15 batches a pass). Each
    epoch is the planned 13 batches of its own pass, no row twice; counted across passes,
    epoch 1 began with the 2 batches left of pass 0 and trained rows twice."""
    import torch

    from raylora import worker
    from raylora.config import validate
    from raylora.launch import plan, resolve_paths

    cfg = resolve_paths(validate({
        "model": {"pretrained": tiny_model},
        "data": {"uri": uneven_shards, "resolution": 32, "center_crop": True,
                 "shuffle_buffer_size": 8, "validation_split": 0.15},
        "train": {"batch_size": 2, "num_epochs": 3, "seed": 3},
        "output": {"uri": str(tmp_path / "out")},
    }))
    spec = worker.WorkerSpec(cfg, plan(cfg))
    assert worker._micro_batches_per_epoch(spec) == 13
    stream = worker._epoch_batches(spec, 0, 1, torch.device("cpu"))
    try:
        epochs = [[int(i) for b in stream(e) for i in (b["pixel_values"][:, 0, 0, 0].int() + 3) // 8]
                  for e in range(3)]
    finally:
        stream.close()
    for ids in epochs:
        assert len(ids) == 26 and len(set(ids)) == 26
    assert len({i for ids in epochs for i in ids}) <= 30  # the training rows alone


def test_the_pass_board_actor_process_imports_no_training_stack(base_config):
    """Ray starts the board (raylora.data.passes.PassSplits) in a process of its own, which
    imports what its class and the pickled dataset maker come from: Ray Data and raylora's
    data modules, not torch, peft or diffusers (raylora.worker took ~11 CPU-s to import,
    on the path to every multi-worker run's first step)."""
    import subprocess
    import sys

    from ray import cloudpickle

    from raylora import launch
    from raylora.config import validate
    from raylora.data.passes import PassDataset, PassSplits

    cfg = validate(base_config)
    p = launch.plan(cfg, heldout=False)
    make = PassDataset(cfg.data, p.data_plan(), cfg.storage.client(), p.model_path, 7, 2,
                       p.family, p.bad_records, None, None, False)
    blob = cloudpickle.dumps((PassSplits, make))
    child = ("import pickle, sys; cls, make = pickle.loads(sys.stdin.buffer.read()); "
             "assert cls.__module__ == 'raylora.data.passes' and make.plan.rows == 32, make; "
             "print(sorted(m for m in ('torch', 'peft', 'diffusers', 'transformers', "
             "'raylora.worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", child], input=blob, capture_output=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "[]"


def test_a_worker_opens_its_data_stream_before_importing_the_training_stack(base_config):
    """raylora.worker, and a worker's data stream made ready to start, import no peft,
    transformers, bitsandbytes, diffusers or FSDP: the stream starts (its board and Ray
    Data's processes, the first shards read) while the worker imports those for the model
    (~7 s of one core on 2 cores; measured at 2 workers, the first batch had waited 12.5 s
    after the model was built). Building the run imports them."""
    import subprocess
    import sys

    from ray import cloudpickle

    from raylora import launch
    from raylora.config import validate
    from raylora.entry import WorkerSpec

    cfg = validate(base_config)
    blob = cloudpickle.dumps(WorkerSpec(cfg, launch.plan(cfg, heldout=False)))
    heavy = ("peft", "transformers", "bitsandbytes", "diffusers", "torch.distributed.fsdp")
    child = ("import pickle, sys, torch; spec = pickle.loads(sys.stdin.buffer.read()); "
             "from raylora import worker; "
             "stream = worker._epoch_batches(spec, 0, 1, torch.device('cpu')); "
             f"print(sorted(m for m in {heavy!r} if m in sys.modules)); "
             "from raylora.train.setup import build_run; "
             f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", child], input=blob, capture_output=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    before, after = out.stdout.decode().strip().splitlines()[-2:]
    assert before == "[]", before
    assert {"peft", "transformers", "bitsandbytes", "torch.distributed.fsdp"} <= set(eval(after)), after
