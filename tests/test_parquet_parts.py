"""raylora's parquet reader: files cut into parts of row groups, each row read once per
epoch, a new seeded part order every epoch (shuffle) or file order (sharding=files)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylora.data.parquet_parts import parquet_parts, read_parquet_parts, row_groups_of_part
from raylora.storage import Storage


def test_each_row_group_lands_in_exactly_one_part_in_order():
    groups = [7] * 7 + [1]  # 50 rows
    for parts in (1, 2, 3, 4, 7, 8, 50):
        got = [row_groups_of_part(groups, k, parts) for k in range(parts)]
        flat = [g for part in got for g in part]
        assert flat == list(range(len(groups))), parts
    # Four parts of 12.5 rows: groups start at rows 0, 7, 14, ... 49.
    assert [row_groups_of_part(groups, k, 4) for k in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # One row group larger than a share: the first part reads it, the others are empty.
    assert [row_groups_of_part([100], k, 3) for k in range(3)] == [[0], [], []]
    assert row_groups_of_part([], 0, 1) == []


def test_parts_per_file_follow_row_counts():
    parts = parquet_parts(["a", "b", "c"], [50, 20, 0], unit_rows=16)
    assert [(p["uri"], p["part"], p["parts"]) for p in parts] == (
        [("a", k, 4) for k in range(4)] + [("b", 0, 2), ("b", 1, 2), ("c", 0, 1)]
    )
    # Counts unknown (or not one per file): one part per file, never a dropped file.
    assert [p["uri"] for p in parquet_parts(["a", "b"], None, 16)] == ["a", "b"]
    assert [p["uri"] for p in parquet_parts(["a", "b"], [], 16)] == ["a", "b"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three files of 50, 20 and 3 rows in row groups of 7: keys k000..k072 in file order."""
    root = tmp_path_factory.mktemp("pq")
    files, rows, start = [], [], 0
    for i, n in enumerate((50, 20, 3)):
        keys = [f"k{start + j:03d}" for j in range(n)]
        path = root / f"part-{i}.parquet"
        pq.write_table(pa.table({"img": [k.encode() for k in keys], "cap": keys}), path,
                       row_group_size=7)
        files.append(str(path))
        rows.append(n)
        start += n
    return files, rows


def _epochs(ds, n):
    return [[r["text"] for r in ds.iter_rows()] for _ in range(n)]


def test_every_row_once_per_epoch_in_a_new_seeded_order(ray_local, shards):
    import ray

    files, rows = shards
    everything = [f"k{i:03d}" for i in range(73)]
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # order = part order, to compare epochs

    def build(seed, shuffle):
        return read_parquet_parts(files, rows, Storage(), seed, shuffle,
                                  columns=["img", "cap"], renames={"img": "image", "cap": "text"},
                                  unit_rows=16)

    try:
        first = _epochs(build(3, True), 3)
        again = _epochs(build(3, True), 2)
        ordered = _epochs(build(3, False), 2)
        table = build(3, False).take(2)
    finally:
        ctx.execution_options.preserve_order = False
    for epoch in first:
        assert sorted(epoch) == everything
    assert first[0] != first[1] != first[2]  # a new part order every epoch
    assert again == first[:2]  # the same seed gives the same orders, epoch by epoch
    assert ordered == [everything, everything]  # no shuffle: file order, every epoch
    assert set(table[0]) == {"image", "text", "path"}
    assert table[0]["path"] == files[0] and table[0]["image"] == b"k000"


def test_files_mode_gives_each_epoch_new_flips_and_a_rebuilt_epoch_the_same(
        ray_local, tiny_model, demo_data):
    """sharding=files: a worker rebuilds its dataset every epoch (raylora.worker). The
    rows come in file order every time; the flips are drawn anew per epoch (the demo
    images are square, so the crop has one place and the flip is the only draw), and a
    rebuilt epoch, as a resumed run makes, has exactly the draws it had."""
    import numpy as np
    import ray

    from raylora.config import validate
    from raylora.data.source import build_dataset, plan_data

    data = validate({"model": {"pretrained": tiny_model}, "output": {"uri": "unused"},
                     "data": {"uri": demo_data, "resolution": 32, "center_crop": False,
                              "random_flip": True, "sharding": "files"}}).data
    plan = plan_data(data, Storage()).for_rank(0, 1)

    def epoch(e):
        ds = build_dataset(data, plan, Storage(), model_path=tiny_model, seed=5, epoch=e)
        assert ds.context.execution_options.preserve_order
        rows = ds.take_all()
        return (np.stack([r["pixel_values"] for r in rows]),
                np.stack([r["input_ids"] for r in rows]))

    (p0, ids0), (p1, ids1), (p1b, ids1b) = epoch(0), epoch(1), epoch(1)
    assert not ray.data.DataContext.get_current().execution_options.preserve_order
    assert p0.shape == (32, 3, 32, 32) and p0.dtype == np.uint8
    assert (ids0 == ids1).all() and (ids1 == ids1b).all()  # same rows, same order
    assert (p1 == p1b).all()  # the rebuilt epoch repeats its draws exactly
    mirrored = (p1 == p0[..., ::-1]).all(axis=(1, 2, 3))
    same = (p1 == p0).all(axis=(1, 2, 3))
    assert (mirrored | same).all()  # epochs differ by flips only
    flipped = mirrored & ~same
    assert 6 <= flipped.sum() <= 26, flipped.sum()  # about half the rows flip the other way
