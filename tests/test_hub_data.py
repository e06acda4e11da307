"""Hugging Face dataset repos as data (``data.uri: hf://datasets/owner/name``,
``raylora.hubfs``): listed, planned and read from a hub on 127.0.0.1 (tests/hubemu.py) as
huggingface_hub reads the real one, at the commit the plan read; a gated, unknown or
misspelt repo named before anything starts."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raylora.config import ConfigError, DataSection, validate
from raylora.data import formats
from raylora.data.source import plan_data
from raylora.storage import Storage

TOKEN = "hf_RayLoraHubData0001doNotLeak"


def write_repo(root, captions: list[list[str]]) -> str:
    """A dataset repo as ``datasets.push_to_hub`` writes one: ``data/train-*.parquet`` with
    an Image column (``{bytes, path}``) and ``text``, one file per list of captions, and a
    dataset card."""
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for i, texts in enumerate(captions):
        cells = []
        for j, _ in enumerate(texts):
            buf = io.BytesIO()
            Image.fromarray(np.full((16, 16, 3), 40 * j, np.uint8)).save(buf, "PNG")
            cells.append({"bytes": buf.getvalue(), "path": f"{j}.png"})
        table = pa.table({"image": pa.array(cells, image), "text": texts})
        pq.write_table(table, os.path.join(root, "data", f"train-{i:05d}-of-{len(captions):05d}.parquet"))
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write("---\nlicense: mit\n---\n# pets\n")
    return str(root)


def texts(plan, store) -> list[str]:
    return [r["text"] for r in formats.get_format(plan.format).iter_rows(
        DataSection(uri="x"), plan.files, store)]


def test_a_hub_dataset_is_planned_and_read_at_the_commit_its_plan_read(online, hub, tmp_path):
    from hubemu import commit

    v0 = write_repo(tmp_path / "v0", [["a cat", "a dog", "a fox"], ["an owl", "a bee", "a rat"]])
    v1 = write_repo(tmp_path / "v1", [["new 0", "new 1", "new 2", "new 3"]])
    hub.add("org/pets", v0, kind="dataset")
    first = commit("datasets/org/pets", 0)
    store = Storage()
    plan = plan_data(DataSection(uri="hf://datasets/org/pets"), store)
    assert plan.format == "parquet" and plan.rows == 6 and plan.file_rows == [3, 3]
    assert plan.files == [f"hf://datasets/org/pets@{first}/data/train-{i:05d}-of-00002.parquet"
                          for i in range(2)]  # the card beside them is not data
    hub.add("org/pets", v1, version=1, kind="dataset")  # pushed after the plan
    # The files the plan named are the commit it read: what every worker reads.
    assert texts(plan, Storage()) == ["a cat", "a dog", "a fox", "an owl", "a bee", "a rat"]
    again = plan_data(DataSection(uri="hf://datasets/org/pets/data"), Storage())
    assert again.rows == 4 and again.files == [
        f"hf://datasets/org/pets@{commit('datasets/org/pets', 1)}/data/train-00000-of-00001.parquet"]
    assert texts(again, Storage()) == ["new 0", "new 1", "new 2", "new 3"]
    pinned = plan_data(DataSection(uri=f"hf://datasets/org/pets@{first}"), Storage())
    assert pinned.files == plan.files
    # raylora.json's data.sources names the commit trained on
    assert [s["commit"] for s in plan.summary()] == [first]
    # A branch with a slash, as huggingface_hub writes it (the viewer's parquet copies)
    hub.add("org/pets", v1, version=2, branch="refs/convert/parquet", kind="dataset")
    converted = plan_data(DataSection(uri="hf://datasets/org/pets@refs%2Fconvert%2Fparquet"), Storage())
    assert converted.rows == 4 and commit("datasets/org/pets", 2) in converted.files[0]
    # A file is downloaded once per machine (the hub cache), not per read: a second
    # process's reads of a commit's files ask the hub nothing more.
    hub.seen.clear()
    assert texts(plan, Storage()) == texts(pinned, Storage())
    assert [p for _, p, _ in hub.seen if "/resolve/" in p] == []


def test_hub_files_named_by_their_branch_are_read_at_the_commit_planned(online, hub, tmp_path):
    """A data.uri naming one file of a repo (or a list, or a brace list of them) kept the
    name as written, at no commit: raylora.json named none, the data's fingerprint did not
    change with a push, and every worker read whatever main was when it started (3 rows
    planned, 5 read). Each is named at the commit the plan read, as a folder's files are."""
    from hubemu import commit

    from raylora.checkpoint.export import data_fingerprint

    name = "data/train-00000-of-00002.parquet"
    hub.add("org/onefile", write_repo(tmp_path / "v0", [["a cat", "a dog", "a fox"], ["an owl"]]),
            kind="dataset")
    first = commit("datasets/org/onefile", 0)
    one = plan_data(DataSection(uri=f"hf://datasets/org/onefile/{name}"), Storage())
    assert one.rows == 3 and one.files == [f"hf://datasets/org/onefile@{first}/{name}"]
    assert [s["commit"] for s in one.summary()] == [first]
    listed = plan_data(DataSection(uri=[f"hf://datasets/org/onefile/data/train-0000{i}-of-00002.parquet"
                                        for i in range(2)]), Storage())
    spelled = plan_data(DataSection(uri="hf://datasets/org/onefile/data/train-{00000..00001}-of-00002.parquet"),
                        Storage())
    assert listed.files == spelled.files == [
        f"hf://datasets/org/onefile@{first}/data/train-0000{i}-of-00002.parquet" for i in range(2)]
    # pushed after the plan: same file names and sizes, other rows
    hub.add("org/onefile", write_repo(tmp_path / "v1", [["a cow", "a pig", "a hen"], ["an elk"]]),
            version=1, kind="dataset")
    assert texts(one, Storage()) == ["a cat", "a dog", "a fox"]  # a worker: the planned commit
    assert texts(spelled, Storage()) == ["a cat", "a dog", "a fox", "an owl"]
    again = plan_data(DataSection(uri=f"hf://datasets/org/onefile/{name}"), Storage())
    assert again.files == [f"hf://datasets/org/onefile@{commit('datasets/org/onefile', 1)}/{name}"]
    assert texts(again, Storage()) == ["a cow", "a pig", "a hen"]
    assert data_fingerprint(again.files, Storage()) != data_fingerprint(one.files, Storage())


def test_a_repo_of_splits_trains_its_train_split_as_datasets_loads_it(online, hub, tmp_path):
    """A repo as push_to_hub writes one with three splits: every split's rows were
    trained on, the test and validation rows too. The repo itself trains its train split
    (as ``datasets.load_dataset`` takes it); a folder or glob given is read whole; splits
    without a train split are refused naming them."""
    import shutil

    from raylora.hubfs import split_of

    root = write_repo(tmp_path / "s", [["a cat", "a dog"], ["an owl"]])
    for split, text in (("test", "held out"), ("validation", "tuning")):
        shutil.copy(os.path.join(root, "data", "train-00000-of-00002.parquet"),
                    os.path.join(root, "data", f"{split}-00000-of-00001.parquet"))
        pq.write_table(pq.read_table(os.path.join(root, "data", f"{split}-00000-of-00001.parquet"))
                       .set_column(1, "text", pa.array([text] * 2)),
                       os.path.join(root, "data", f"{split}-00000-of-00001.parquet"))
    hub.add("org/splits", root, kind="dataset")
    store = Storage()
    plan = plan_data(DataSection(uri="hf://datasets/org/splits"), store)
    assert plan.rows == 3 and texts(plan, store) == ["a cat", "a dog", "an owl"]
    whole = plan_data(DataSection(uri="hf://datasets/org/splits/data"), store)
    assert whole.rows == 7 and sorted(set(texts(whole, store))) == ["a cat", "a dog", "an owl", "held out", "tuning"]
    held = plan_data(DataSection(uri="hf://datasets/org/splits/data/test-*.parquet"), store)
    assert texts(held, store) == ["held out", "held out"]

    os.remove(os.path.join(root, "data", "train-00000-of-00002.parquet"))
    os.remove(os.path.join(root, "data", "train-00001-of-00002.parquet"))
    hub.add("org/nosplit", root, kind="dataset")
    with pytest.raises(ValueError, match=r"hf://datasets/org/nosplit: its files name the splits test, "
                                         r"validation and no train split"):
        plan_data(DataSection(uri="hf://datasets/org/nosplit"), store)
    # an image folder's metadata outside the split folders stays (datasets gives it to each)
    from raylora.hubfs import train_split

    root = "hf://datasets/o/n@" + "c" * 40
    assert train_split("hf://datasets/o/n", [f"{root}/metadata.jsonl", f"{root}/train/a.png",
                                             f"{root}/test/b.png"]) == [f"{root}/metadata.jsonl",
                                                                        f"{root}/train/a.png"]
    # names as datasets reads them: a split word between separators, or a folder
    assert [split_of(p) for p in ("data/train-00000-of-00001.parquet", "train/cat.png", "valid.csv",
                                  "dev_01.tar", "images/interval_3.png", "README.md",
                                  "data/evaluation.parquet")] == [
        "train", "train", "validation", "validation", None, None, "test"]


def test_a_gated_unknown_or_misspelt_hub_dataset_is_named(online, hub, tmp_path, monkeypatch,
                                                          tiny_model):
    from raylora.launch import plan as launch_plan

    hub.add("org/private-pets", write_repo(tmp_path / "p", [["a cat", "a dog"]]), token=TOKEN,
            kind="dataset")
    hub.add("org/pets2", write_repo(tmp_path / "q", [["a cat", "a dog"]]), kind="dataset")

    def problems(uri: str, **over) -> list[str]:
        cfg = validate({"model": {"pretrained": tiny_model},
                        "data": {"uri": uri, "resolution": 64},
                        "train": {"batch_size": 1, "max_steps": 2},
                        "output": {"uri": str(tmp_path / "out")}, **over})
        with pytest.raises(ConfigError) as err:
            launch_plan(cfg)
        return err.value.problems

    assert problems("hf://datasets/org/private-pets") == [
        "data.uri: hf://datasets/org/private-pets is a gated repo and no Hugging Face token is "
        "set: accept its terms on the hub, then set HF_TOKEN (or run `hf auth login`) to a "
        "token with access"]
    assert problems("hf://datasets/org/nope") == [
        "data.uri: hf://datasets/org/nope: no such dataset repo on the hub (or a private one "
        "this machine's token may not read: set HF_TOKEN)"]
    assert problems("hf://datasets/org/pets2@v9") == [
        "data.uri: hf://datasets/org/pets2: v9: no such revision of org/pets2"]
    assert problems("hf://datasets/org/pets2/images") == [
        "data.uri: hf://datasets/org/pets2/images: no such file or directory"]
    assert problems("hf://org/pets2") == [
        "data.uri: hf://org/pets2: not hf://datasets/owner/name[@revision][/path] (a hub model "
        "is model.pretrained: owner/name)"]
    out = problems("hf://datasets/org/pets2",
                   **{"output": {"uri": "hf://datasets/org/pets2/runs"}})
    assert len(out) == 1 and out[0].startswith("output.uri: hf://datasets/org/pets2/runs") \
        and "read here, not written" in out[0], out
    # With the token it reads, and the token is what the hub was sent.
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.seen.clear()
    plan = plan_data(DataSection(uri="hf://datasets/org/private-pets"), Storage())
    assert plan.rows == 2
    sent = {t for _, p, t in hub.seen if "/resolve/" in p}
    assert sent == {TOKEN}


def test_a_hub_caption_folder_keeps_its_kohya_folders_and_subfolders(online, hub, tmp_path):
    """A hub listing names files at a commit (hf://datasets/o/n@<sha>/...), the data root
    the user wrote names none: kohya ``N_name`` folders (repeats, class tokens for an image
    without a caption) and the path below the root (data.control_uri) were lost on the hub
    and kept locally."""
    from raylora.data.formats.base import control_candidates

    src = tmp_path / "repo"
    (src / "10_ohwx cat").mkdir(parents=True)
    for name, caption in (("c1", "ohwx cat on a sofa"), ("c2", None)):
        Image.new("RGB", (8, 8)).save(src / "10_ohwx cat" / f"{name}.png")
        if caption:
            (src / "10_ohwx cat" / f"{name}.txt").write_text(caption)
    Image.new("RGB", (8, 8)).save(src / "other.png")
    (src / "other.txt").write_text("something else")
    hub.add("me/kohya", str(src), kind="dataset")

    def read(uri: str):
        data = DataSection(uri=uri, format="captionfolder")
        plan = plan_data(data, Storage())
        rows = formats.get_format(plan.format).iter_rows(data, plan.files, Storage())
        return plan, sorted(r["text"] for r in rows)

    local, local_texts = read(str(src))
    on_hub, hub_texts = read("hf://datasets/me/kohya")
    assert local.sources[0].repeats == on_hub.sources[0].repeats == [10, 10, 1]
    assert local.sources[0].epoch_rows() == on_hub.sources[0].epoch_rows() == 21
    assert hub_texts == local_texts == ["ohwx cat", "ohwx cat on a sofa", "something else"]
    # raylora shards build of the repo: the keys and class tokens a local folder gives
    from raylora.data.shards import collect_items

    assert [(i["key"], i["text"]) for i in collect_items(Storage(), "hf://datasets/me/kohya")] == [
        (i["key"], i["text"]) for i in collect_items(Storage(), str(src))] == [
        ("10_ohwx cat/c1", "ohwx cat on a sofa"), ("10_ohwx cat/c2", "ohwx cat"),
        ("other", "something else")]
    data = DataSection(uri="hf://datasets/me/kohya", format="captionfolder",
                       control_uri=str(tmp_path / "inputs"))
    assert control_candidates(data, on_hub.files[0])[0] == str(tmp_path / "inputs" / "10_ohwx cat" / "c1.png")
