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
