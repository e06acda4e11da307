"""The shard-format registry: every format picks its files out of a listing, counts its
rows, reads them in the same shape by either reader (plain, and Ray Data), and names
where a bad sample is the same way, as ``{key}: {reason}``."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from raylora.config import DataSection
from raylora.data import formats
from raylora.data.shards import build_shards, collect_items, write_shard
from raylora.data.source import plan_data
from raylora.storage import Storage

N = 6
BAD = 2  # the sample whose image bytes are not an image


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[dict[str, str], list[str]]:
    """The same 6 captioned images (one of them broken) in every format, with a stray file
    beside each, and the captions in source order."""
    from raylora.data.demo import write_imagefolder

    root = tmp_path_factory.mktemp("formats")
    src = write_imagefolder(root / "imagefolder", n=N, size=16, seed=3)
    (src / f"img_{BAD:05d}.png").write_bytes(b"this is no image")
    txt = write_imagefolder(root / "captionfolder", n=N, size=16, seed=3, captions="txt")
    (txt / f"img_{BAD:05d}.png").write_bytes(b"this is no image")
    store = Storage()
    items = collect_items(store, str(src))
    uris = {"imagefolder": str(src), "captionfolder": str(txt)}
    for fmt in formats.writable_formats():
        dest = str(root / fmt)
        write_shard(store, dest, fmt, 0, items[:4])
        write_shard(store, dest, fmt, 1, items[4:])
        uris[fmt] = dest
    for uri in uris.values():
        (root / uri / "notes.json").write_text("{}")  # stray: no format reads it
    return uris, [it["text"] for it in items]


def test_registry_matches_the_config_choices():
    choices = typing.get_args(DataSection.model_fields["format"].annotation)
    assert [c for c in choices if c != "auto"] == list(formats.FORMATS)
    assert formats.writable_formats() == ["parquet", "webdataset"]


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_each_format_lists_counts_and_reads_rows(shards, fmt):
    uris, texts = shards
    plan = plan_data(DataSection(uri=uris[fmt]), Storage())
    assert plan.format == fmt  # detected, with the stray file beside the shards
    assert not any(f.endswith("notes.json") for f in plan.files)
    # imagefolder: images + metadata.jsonl; captionfolder: the images (captions beside them)
    assert len(plan.files) == {"imagefolder": N + 1, "captionfolder": N}.get(fmt, 2)
    assert plan.rows == N
    assert plan.file_rows == {"imagefolder": None, "captionfolder": [1] * N}.get(fmt, [4, 2])
    rows = list(formats.get_format(fmt).iter_rows(DataSection(uri=uris[fmt]), plan.files, Storage()))
    assert [r["text"] for r in rows] == texts  # file order
    assert all(isinstance(r["image"], bytes) and r["image"] for r in rows)
    keys = [r["key"] for r in rows]
    assert len(set(keys)) == N
    # A key names the file the sample is in (for imagefolder: the image itself).
    assert all(any(k == f or k.startswith(f + "#") for f in plan.files) for k in keys)


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_units_cover_the_rows_in_order(shards, fmt):
    """The latent cache reads a format in units (raylora.data.cache): together they are
    every row once, in source order."""
    uris, texts = shards
    data = DataSection(uri=uris[fmt])
    plan = plan_data(data, Storage())
    entry = formats.get_format(fmt).units(data, plan.files, Storage(), 4)
    assert len(entry) == 2  # two shard files, or 6 images / imagefolder rows in runs of 4
    got = [r["text"] for u in entry
           for r in formats.get_format(fmt).iter_unit(data, plan.files, Storage(), *u)]
    assert got == texts


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_a_bad_sample_is_reported_at_its_key(shards, tiny_model, fmt):
    from raylora.data.preprocess import Preprocess, StageSpec

    uris, texts = shards
    data = DataSection(uri=uris[fmt])
    plan = plan_data(data, Storage())
    rows = list(formats.get_format(fmt).iter_rows(data, plan.files, Storage()))
    sent = []
    stage = Preprocess(StageSpec(tiny_model, 16, center_crop=True, random_flip=False))
    stage.reporter.send = lambda ok, bad, examples: sent.append((ok, dict(bad), examples))
    out = stage({k: np.array([r[k] for r in rows], dtype=object) for k in ("key", "image", "text")})
    assert out["pixel_values"].shape == (N - 1, 3, 16, 16)
    ((ok, bad, examples),) = sent
    assert (ok, bad) == (N - 1, {"not_an_image": 1})
    (example,) = examples["not_an_image"]
    assert example.startswith(rows[BAD]["key"] + ": not_an_image")
    assert {"parquet": ".parquet#2", "webdataset": ".tar#000000002",
            "imagefolder": f"img_{BAD:05d}.png", "captionfolder": f"img_{BAD:05d}.png"}[fmt] in example


@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz"])
def test_gzipped_webdataset_shards_are_read_as_their_tars(shards, tmp_path, suffix):
    """`tar czf` shards: detected as webdataset (an img2dataset parquet beside one still its
    metadata, not a parquet shard), counted by reading them (no manifest), and read by the
    plain reader and by Ray Data's row function (``_tar_rows``) as the same tars unzipped."""
    import gzip
    import pathlib

    from raylora.data.formats.webdataset import _tar_rows

    uris, texts = shards
    wds = formats.get_format("webdataset")
    folder = tmp_path / "gz"
    folder.mkdir()
    for tar in sorted(pathlib.Path(uris["webdataset"]).glob("*.tar")):
        (folder / (tar.name[: -len(".tar")] + suffix)).write_bytes(gzip.compress(tar.read_bytes()))
    (folder / "shard-00000.parquet").write_bytes(b"img2dataset's per-sample metadata")
    data = DataSection(uri=str(folder))
    plan = plan_data(data, Storage())
    assert plan.format == "webdataset"
    assert [f.rsplit("/", 1)[1] for f in plan.files] == [f"shard-0000{i}{suffix}" for i in (0, 1)]
    assert (plan.rows, plan.file_rows) == (N, [4, 2])
    rows = list(wds.iter_rows(data, plan.files, Storage()))
    plain = DataSection(uri=uris["webdataset"])
    tars = list(wds.iter_rows(plain, plan_data(plain, Storage()).files, Storage()))
    assert [r["text"] for r in rows] == texts
    assert [r["image"] for r in rows] == [r["image"] for r in tars]
    assert [r["key"].split("#")[1] for r in rows] == [r["key"].split("#")[1] for r in tars]
    staged = [r for f in plan.files
              for r in _tar_rows({"path": f, "bytes": pathlib.Path(f).read_bytes()}, {})]
    assert [(r["key"], r["text"], r["image"]) for r in staged] == \
        [(r["key"], r["text"], r["image"]) for r in rows]


def test_a_webdataset_txt_caption_is_stripped_as_a_caption_folders_is(tmp_path):
    """`echo "a red dog" > 00000.txt` ends the caption in a newline: a token of its own to
    the Qwen and Gemma text encoders, where the caption folder's .txt was stripped."""
    import io
    import tarfile

    from PIL import Image

    from raylora.data.formats.webdataset import iter_tar_samples

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 90, 160)).save(buf, "PNG")
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for name, payload in (("00000.png", buf.getvalue()), ("00000.txt", b"a red dog\n"),
                              ("00001.png", buf.getvalue()), ("00001.txt", b"\xef\xbb\xbf two  words \r\n")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    shard.seek(0)
    assert [r["text"] for r in iter_tar_samples(shard, "s.tar")] == ["a red dog", "two  words"]


def test_ray_reader_gives_the_plain_readers_rows(shards, ray_local):
    from raylora.data.source import read_rows

    uris, texts = shards
    for fmt in formats.FORMATS:
        data = DataSection(uri=uris[fmt])
        plan = plan_data(data, Storage())
        plain = {r["key"]: r["text"] for r in formats.get_format(fmt).iter_rows(data, plan.files, Storage())}
        got = read_rows(data, plan, Storage(), seed=0).take_all()
        assert {"key", "image", "text"} <= set(got[0]), fmt
        assert {r["key"]: r["text"] for r in got} == plain, fmt


def test_formats_without_a_writer_are_refused(shards, tmp_path):
    uris, _ = shards
    with pytest.raises(ValueError, match="imagefolder shards cannot be written"):
        write_shard(Storage(), str(tmp_path), "imagefolder", 0, [])
    with pytest.raises(ValueError, match="--format: 'imagefolder' is not parquet or webdataset"):
        build_shards(uris["imagefolder"], str(tmp_path / "out"), "imagefolder", 2)
    with pytest.raises(ValueError, match="data.format: 'csv' is not one of parquet, webdataset"):
        formats.get_format("csv")


def write_kohya(root, captions: dict[str, str | bytes | None]) -> str:
    """A caption folder of demo images, one per name in ``captions`` (relative path, no
    extension) with its caption file's text, or no caption file for None."""
    from raylora.data.demo import make_samples

    for (name, caption), (png, _) in zip(captions.items(), make_samples(len(captions), size=16)):
        path = root / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
        if caption is not None:
            data = caption if isinstance(caption, bytes) else caption.encode()
            (root / f"{name}.txt").write_bytes(data)
    return str(root)


KOHYA = {"10_mychar/a": "mychar smiling\n", "10_mychar/b": "mychar, red hair",
         "10_mychar/c": None, "f": "a cat", "photos/d": "a dog", "photos/e": "a bird"}


def epoch_reads(data: DataSection, plan, shuffle: bool, epoch: int = 0) -> list[str]:
    """The keys an epoch reads, read unit by unit as the Ray read stage does (no Ray;
    registry formats only)."""

    from raylora.data.plan import pass_items, read_units, unit_keep

    keys, sections = [], data.source_sections()
    for item in pass_items(read_units(data, plan, Storage(), 4), 0, epoch, shuffle):
        s = plan.sources[item["k"]]
        keys += [r["key"] for r in formats.get_format(s.format).iter_unit(
            sections[s.index], s.files, Storage(), item["index"], item["start"], item["stop"],
            unit_keep(item))]
    return keys


def test_caption_folder_kohya_repeats_and_class_tokens(tmp_path):
    """A first-level N_name folder counts its images N times per epoch, and name is the
    caption of its images without a caption file; an epoch reads exactly the planned rows,
    split exactly over workers dealt images (data.sharding=files)."""
    root = write_kohya(tmp_path / "kohya", KOHYA)
    data = DataSection(uri=root)
    plan = plan_data(data, Storage())
    assert plan.format == "captionfolder"
    assert [f.rsplit("/", 2)[-2:] for f in plan.files] == [
        ["10_mychar", "a.png"], ["10_mychar", "b.png"], ["10_mychar", "c.png"],
        ["kohya", "f.png"], ["photos", "d.png"], ["photos", "e.png"]]
    assert plan.sources[0].repeats == [10, 10, 10, 1, 1, 1]
    assert plan.rows == 3 * 10 + 3  # rows an epoch reads
    (summary,) = plan.summary()
    assert (summary["rows"], summary["rows_per_epoch"]) == (6, 33)
    assert summary["rows_by_repeats"] == {"1": 3, "10": 3}
    rows = list(formats.get_format("captionfolder").iter_rows(data, plan.files, Storage()))
    assert [r["text"] for r in rows] == ["mychar smiling", "mychar, red hair", "mychar",
                                        "a cat", "a dog", "a bird"]
    # Caption files are part of the data (fingerprints follow them); c.png has none.
    assert sorted(c.rsplit("/", 1)[1] for c in plan.content_files() if c.endswith(".txt")) == [
        "a.txt", "b.txt", "d.txt", "e.txt", "f.txt"]
    for shuffle in (False, True):
        reads = epoch_reads(data, plan, shuffle)
        assert len(reads) == plan.rows
        counts = {k.rsplit("/", 1)[1]: reads.count(k) for k in set(reads)}
        assert counts == {"a.png": 10, "b.png": 10, "c.png": 10, "f.png": 1, "d.png": 1, "e.png": 1}
    in_order = epoch_reads(data, plan, False)
    assert in_order[:6] == [r["key"] for r in rows]  # copy after copy: every image first
    assert epoch_reads(data, plan, True, 1) != epoch_reads(data, plan, True, 0)
    # sharding=files deals the images' copies out, in turn: each worker reads a, b and c
    # 5 times; f and e go to worker 0, d to worker 1. Dealt whole (a, c, d to worker 0;
    # b, f, e to worker 1) they gave 21 and 12 reads, and the epoch (the fewest) left 9 of
    # its 33 reads out.
    shares = [plan.for_rank(r, 2) for r in range(2)]
    assert [p.rows for p in shares] == [17, 16]
    reads = [epoch_reads(data, p, False) for p in shares]
    assert [{k.rsplit("/", 1)[1]: r.count(k) for k in set(r)} for r in reads] == [
        {"a.png": 5, "b.png": 5, "c.png": 5, "f.png": 1, "e.png": 1},
        {"a.png": 5, "b.png": 5, "c.png": 5, "d.png": 1}]
    # three workers: 11 each, every copy read once over them
    thirds = [epoch_reads(data, plan.for_rank(r, 3), False) for r in range(3)]
    assert [len(r) for r in thirds] == [11, 11, 11]
    assert sorted(sum(thirds, [])) == sorted(epoch_reads(data, plan, False))


def test_kohya_folder_captions_of_another_extension_are_refused_not_replaced(tmp_path):
    """kohya's default caption extension is .caption; with data.caption_extension .txt the
    images of a 10_ohwx dog/ folder all trained on "ohwx dog", their captions unread and
    nothing said (the same folder outside N_name was refused). Now refused, naming the
    extension to set; with it, the captions are read."""
    from PIL import Image

    folder = tmp_path / "kohya" / "10_ohwx dog"
    folder.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (16, 16)).save(folder / f"img{i}.png")
        (folder / f"img{i}.caption").write_text(f"ohwx dog, photo {i}")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=str(tmp_path / "kohya")), Storage())
    assert str(exc.value) == (
        f"3 image(s) in kohya N_name folders have no .txt caption but a .caption file beside "
        f"them (e.g. {folder}/img0.caption), unread: they would train on their folder's class "
        "tokens. Set data.caption_extension: .caption (kohya's --caption_extension), or remove "
        "those files to train on the class tokens")
    data = DataSection(uri=str(tmp_path / "kohya"), caption_extension=".caption")
    plan = plan_data(data, Storage())
    rows = list(formats.get_format("captionfolder").iter_rows(data, plan.files, Storage()))
    assert [r["text"] for r in rows] == [f"ohwx dog, photo {i}" for i in range(3)]


def test_detection_order_of_image_folders():
    imgs = ["/d/a.png", "/d/a.txt", "/d/b.jpg", "/d/b.txt"]
    assert formats.detect_format(imgs) == "captionfolder"
    assert formats.detect_format(imgs + ["/d/metadata.jsonl"]) == "imagefolder"
    assert formats.detect_format(imgs + ["/d/metadata.csv"]) == "imagefolder"  # as HF's reads
    assert formats.detect_format(imgs + ["/d/labels.csv"]) == "captionfolder"  # only that name
    assert formats.detect_format(["/d/10_x/a.png"]) == "captionfolder"  # class tokens only
    assert formats.detect_format(imgs + ["/d/s.parquet"]) == "parquet"
    assert formats.detect_format(imgs + ["/d/s.tar"]) == "webdataset"
    with pytest.raises(ValueError, match="images with metadata.jsonl/.csv or images with .txt captions"):
        formats.detect_format(["/d/notes.md"])


def test_an_imagefolder_with_metadata_csv_reads_as_the_jsonl_one(tmp_path):
    """Hugging Face's imagefolder reads metadata.csv as it reads metadata.jsonl (a header
    with file_name and the caption column). Before: the folder was a caption folder whose
    every image had no caption, refused."""
    import csv
    import json

    from raylora.data.demo import write_imagefolder

    src = write_imagefolder(tmp_path / "csv", n=4, size=16, seed=3)
    meta = [json.loads(line) for line in (src / "metadata.jsonl").read_text().splitlines()]
    (src / "metadata.jsonl").unlink()
    meta[1]["text"] = 'a "quoted" caption, with a comma\nand a second line'
    with open(src / "sub.csv", "w") as f:  # not metadata: only that name is
        f.write("x\n")
    with open(src / "metadata.csv", "w", newline="", encoding="utf-8-sig") as f:  # Excel's BOM
        w = csv.DictWriter(f, ["file_name", "text", "score"])
        w.writeheader()
        w.writerows({**m, "score": 1} for m in meta)
    store = Storage()
    plan = plan_data(DataSection(uri=str(src)), store)
    assert plan.format == "imagefolder" and plan.rows == 4
    assert sorted(f.rsplit("/", 1)[1] for f in plan.files)[-2:] == ["img_00003.png", "metadata.csv"]
    rows = list(formats.get_format("imagefolder").iter_rows(DataSection(uri=str(src)), plan.files, store))
    assert [r["text"] for r in rows] == [m["text"] for m in meta]
    assert [r["key"] for r in rows] == [str(src / m["file_name"]) for m in meta]
    with open(src / "metadata.csv", "w") as f:
        f.write("name,text\nimg_00000.png,x\n")
    with pytest.raises(ValueError, match=r"metadata.csv: no file_name column \(its header: \['name', 'text'\]\)"):
        plan_data(DataSection(uri=str(src)), store)


def test_imagefolder_lines_whose_image_is_gone_are_left_out_or_refused_before_ray(
        tmp_path, base_config, caplog):
    """An image deleted and its metadata line kept: the line is left out (as Hugging Face's
    imagefolder leaves it), counted out of the plan and named in a warning; more such
    lines than data.max_bad_fraction refuse the run in planning, naming data.uri, the
    metadata file and the images. Before: counted in, then FileNotFoundError in a worker."""
    from raylora.config import ConfigError, validate
    from raylora.data.demo import write_imagefolder
    from raylora.launch import plan, resolve_paths

    src = write_imagefolder(tmp_path / "gone", n=8, size=16, seed=3)
    (src / "img_00003.png").unlink()
    store = Storage()
    data = DataSection(uri=str(src), max_bad_fraction=0.2)
    with caplog.at_level("WARNING", logger="raylora.data"):
        p = plan_data(data, store)
    assert p.format == "imagefolder" and p.rows == 7
    assert f"1 of 8 lines of {src}/metadata.jsonl name an image that is not in the folder " \
           "(e.g. 'img_00003.png'): those lines are left out" in caplog.text
    fmt = formats.get_format("imagefolder")
    keys = [r["key"].rsplit("/", 1)[1] for r in fmt.iter_rows(data, p.files, store)]
    assert keys == [f"img_{i:05d}.png" for i in (0, 1, 2, 4, 5, 6, 7)]
    in_order = [r["key"] for r in fmt.iter_rows(data, p.files, store)]
    assert [r["key"] for i, a, b in fmt.units(data, p.files, store, 4)
            for r in fmt.iter_unit(data, p.files, store, i, a, b)] == in_order
    assert [r["key"] for r in fmt.sample_rows(data, p.files, store, 7)] == in_order

    for i in (1, 5):
        (src / f"img_{i:05d}.png").unlink()
    base_config["data"]["uri"] = str(src)
    with pytest.raises(ConfigError) as exc:
        plan(resolve_paths(validate(base_config)))
    (problem,) = exc.value.problems
    assert problem.startswith(f"data.uri: 3 of 8 lines of {src}/metadata.jsonl name an image "
                              "that is not in the folder (e.g. 'img_00001.png', 'img_00003.png', "
                              "'img_00005.png'); 37.5% of the rows, over data.max_bad_fraction=0.05")


def test_imagefolder_metadata_as_hugging_face_reads_it(tmp_path, base_config):
    """A caption column no metadata line has trained every row on the empty caption (no
    word with caption dropout on): refused naming the keys the lines have. metadata.jsonl
    beside metadata.csv read every image twice: refused, as HF does. A caption holding
    U+2028 (json.dumps(ensure_ascii=False) leaves it) split its line; a Windows-made
    file_name "sub\\a.png" was not found: both read as HF reads them."""
    import json

    from raylora.config import ConfigError, validate
    from raylora.data.demo import write_imagefolder
    from raylora.launch import plan, resolve_paths

    src = write_imagefolder(tmp_path / "if", n=4, size=16, seed=3)
    lines = [json.loads(x) for x in (src / "metadata.jsonl").read_text().splitlines()]
    (src / "sub").mkdir()
    (src / "img_00003.png").rename(src / "sub" / "img_00003.png")
    lines[3]["file_name"] = "sub\\img_00003.png"
    lines[1]["text"] = "a red circle\u2028on blue"
    write = lambda rows, key="text": (src / "metadata.jsonl").write_text(  # noqa: E731
        "".join(json.dumps({"file_name": r["file_name"], key: r["text"]}, ensure_ascii=False) + "\n"
                for r in rows))
    write(lines)
    store, fmt = Storage(), formats.get_format("imagefolder")
    p = plan_data(DataSection(uri=str(src)), store)
    assert p.rows == 4
    texts = {r["key"].rsplit("/", 1)[1]: r["text"] for r in fmt.iter_rows(DataSection(uri=str(src)), p.files, store)}
    assert texts["img_00001.png"] == "a red circle\u2028on blue" and texts["img_00003.png"] == lines[3]["text"]

    write(lines, key="caption")
    base_config["data"] = {**base_config["data"], "uri": str(src), "caption_dropout": 0.1}
    with pytest.raises(ConfigError) as exc:
        plan(resolve_paths(validate(base_config)))
    assert exc.value.problems == [f"data.caption_column: 'text' is in no line of {src}/metadata.jsonl "
                                  "(its keys: caption, file_name)"]
    assert plan_data(DataSection(uri=str(src), caption_column="caption"), store).rows == 4

    (src / "metadata.csv").write_text("file_name,caption\nimg_00000.png,x\n")
    with pytest.raises(ValueError, match=rf"{src}: both metadata.jsonl and metadata.csv; keep one"):
        plan_data(DataSection(uri=str(src), caption_column="caption"), store)


def test_missing_captions_are_refused_up_front_or_counted(tmp_path, tiny_model, base_config):
    """Images without a caption file (outside an N_name folder) are missing_caption rows,
    as in every format; more of them than data.max_bad_fraction stops preflight, naming
    them and the keys that change it."""
    from raylora.config import ConfigError, validate
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.launch import plan, resolve_paths

    root = write_kohya(tmp_path / "some", {"a": "a cat", "b": None, "c": None, "d": None})
    base_config["data"]["uri"] = root
    with pytest.raises(ConfigError) as exc:
        plan(resolve_paths(validate(base_config)))
    (problem,) = exc.value.problems
    assert problem.startswith(f"data.uri: 3 of 4 images have no caption: no .txt file beside "
                              f"them and not in a kohya N_name folder (e.g. {root}/b.png")
    assert "75.0% of the reads, over data.max_bad_fraction=0.05" in problem
    assert "data.caption_dropout > 0" in problem
    # Allowed: the rows come without a caption, and the validating decode counts them.
    data = DataSection(uri=root, max_bad_fraction=0.8)
    p = plan_data(data, Storage())
    rows = list(formats.get_format(p.format).iter_rows(data, p.files, Storage()))
    assert [r["text"] for r in rows] == ["a cat", None, None, None]
    sent = []
    stage = Preprocess(StageSpec(tiny_model, 16, center_crop=True, random_flip=False))
    stage.reporter.send = lambda ok, bad, examples: sent.append((ok, dict(bad)))
    stage({k: np.array([r[k] for r in rows], dtype=object) for k in ("key", "image", "text")})
    assert sent == [(1, {"missing_caption": 3})]
    # With caption dropout they train on the empty prompt, as other formats' blank captions.
    assert plan_data(DataSection(uri=root, caption_dropout=0.1), Storage()).rows == 4
    # ...but not a folder where no image has one: every row would train unconditioned, with
    # caption dropout on without a word (captions in .caption files, the extension not set)
    none = write_kohya(tmp_path / "none", {"a": None, "b": None})
    (tmp_path / "none" / "a.caption").write_text("a cat")
    with pytest.raises(ValueError, match=r"2 of 2 images have no caption: .*: none has a caption "
                                         r"\(data.caption_extension is .txt; other files here end in .caption\)"):
        plan_data(DataSection(uri=none, caption_dropout=0.1), Storage())
    assert plan_data(DataSection(uri=none, caption_extension=".caption", max_bad_fraction=0.5),
                     Storage()).rows == 2


def test_caption_files_not_utf8_and_other_extensions(tmp_path, tiny_model):
    from raylora.data.preprocess import Preprocess, StageSpec

    root = write_kohya(tmp_path / "enc", {"a": b"caf\xe9 au lait", "b": "fine"})
    (tmp_path / "enc" / "a.caption").write_text("from the .caption file")
    data = DataSection(uri=root)
    rows = list(formats.get_format("captionfolder").iter_rows(data, plan_data(data, Storage()).files,
                                                              Storage()))
    sent = []
    stage = Preprocess(StageSpec(tiny_model, 16, center_crop=True, random_flip=False))
    stage.reporter.send = lambda ok, bad, examples: sent.append((ok, dict(bad), examples))
    stage({k: np.array([r[k] for r in rows], dtype=object) for k in ("key", "image", "text")})
    ((ok, bad, examples),) = sent
    assert (ok, bad) == (1, {"caption_not_utf8": 1})
    assert examples["caption_not_utf8"][0].startswith(f"{root}/a.png: caption_not_utf8")
    # data.caption_extension: kohya's other habit; b has no .caption file.
    data = DataSection(uri=root, caption_extension=".caption", max_bad_fraction=0.5)
    rows = list(formats.get_format("captionfolder").iter_rows(data, plan_data(data, Storage()).files,
                                                              Storage()))
    assert [r["text"] for r in rows] == ["from the .caption file", None]


def test_kohya_folder_with_zero_repeats_is_refused(tmp_path):
    root = write_kohya(tmp_path / "z", {"0_nothing/a": "a cat", "b": "a dog"})
    with pytest.raises(ValueError, match=r"z/0_nothing: a kohya folder name N_name needs N >= 1"):
        plan_data(DataSection(uri=root), Storage())
    # Only first-level folders name repeats: deeper ones, and the data root itself, do not.
    root = write_kohya(tmp_path / "3_root", {"x/2_deep/a": "a cat", "b": "a dog"})
    assert plan_data(DataSection(uri=root), Storage()).rows == 2


# ---------------------------------------------------------------- masks (data.masked_loss)


def test_masks_reach_training_rows_through_ray_data(ray_local, tiny_model, tmp_path):
    """A mix of a parquet source (mask column, one null cell) and a caption folder (one
    sidecar): every training row's loss_mask is the mask its image was drawn from (each
    image's pixels are its mask; unmasked images are white), after random crops and flips.
    The rest of the masked-loss tests: test_masked_loss.py (in-process)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from raylora.config import validate
    from raylora.data.source import build_dataset

    def png(img):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    rng = np.random.default_rng(2)

    def pattern(w=24, h=20):
        return rng.integers(0, 256, (h, w), dtype=np.uint8)

    masks = [pattern() for _ in range(3)]
    white = np.full((20, 24), 255, np.uint8)
    as_rgb = lambda a: png(Image.fromarray(a, "L").convert("RGB"))  # noqa: E731
    pq.write_table(pa.table({"image": [as_rgb(m) for m in masks[:2]] + [as_rgb(white)],
                             "text": ["a", "b", "c"],
                             "mask": pa.array([png(Image.fromarray(m, "L")) for m in masks[:2]]
                                              + [None], pa.binary())}),
                   str(tmp_path / "p.parquet"))
    folder = tmp_path / "folder"
    folder.mkdir()
    for stem, a, mask in (("m", masks[2], masks[2]), ("u", white, None)):
        (folder / f"{stem}.png").write_bytes(as_rgb(a))
        (folder / f"{stem}.txt").write_text(stem)
        if mask is not None:
            (folder / f"{stem}.mask.png").write_bytes(png(Image.fromarray(mask, "L")))
    data = validate({"model": {"pretrained": tiny_model}, "output": {"uri": "unused"},
                     "data": {"sources": [{"uri": str(tmp_path / "p.parquet")},
                                          {"uri": str(folder)}],
                              "resolution": 16, "random_flip": True, "masked_loss": True}}).data
    plan = plan_data(data, Storage())
    rows = build_dataset(data, plan, Storage(), model_path=tiny_model, seed=1).take_all()
    assert len(rows) == 5
    for r in rows:
        assert r["loss_mask"].shape == (1, 16, 16) and r["loss_mask"].dtype == np.uint8
        np.testing.assert_array_equal(r["loss_mask"][0], r["pixel_values"][0])
    assert sum(int((r["loss_mask"] == 255).all()) for r in rows) == 2  # the unmasked two


def test_a_masked_run_through_ray_learns_nothing_where_every_mask_is_black(ray_local, tiny_model, tmp_path):
    """The whole path of data.masked_loss through ``raylora train`` (Ray Data → worker →
    step → export): every row's mask is black (weight 0) but one row's, which is unreadable
    (a counted bad_mask row). If the masks reached the loss, it is exactly 0 at every step
    and the exported adapter's up-projections are still their initial zeros; a mask lost
    on the way gives a positive loss and a trained adapter (masked_loss off: loss ≈ 1.02)."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from safetensors.torch import load_file

    from raylora.config import validate
    from raylora.launch import run

    def png(img):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    rng = np.random.default_rng(3)
    images = [png(Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8), "RGB")) for _ in range(9)]
    black = png(Image.new("L", (24, 24), 0))
    pq.write_table(pa.table({"image": images, "text": [f"row {i}" for i in range(9)],
                             "mask": [black] * 8 + [b"not a png"]}), str(tmp_path / "p.parquet"))
    out = tmp_path / "out"
    summary = run(validate({
        "model": {"pretrained": tiny_model},
        "data": {"uri": str(tmp_path / "p.parquet"), "resolution": 16, "masked_loss": True,
                 "max_bad_fraction": 0.5},
        "train": {"batch_size": 2, "max_steps": 3, "learning_rate": 1e-2, "seed": 5},
        "scaling": {"num_workers": 1},
        "output": {"uri": str(out)}}))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == [0.0, 0.0, 0.0]
    meta = json.load(open(out / "adapter" / "raylora.json"))
    assert meta["data"]["bad_records"]["bad_mask"] >= 1
    weights = load_file(str(out / "adapter" / "pytorch_lora_weights.safetensors"))
    ups = [v for k, v in weights.items() if "lora_B" in k or "lora.up" in k]
    assert ups and all(not v.any() for v in ups)
    assert summary["metrics"]["steps"] == 3


def test_a_parquet_image_column_of_paths_is_refused_before_reading(tmp_path, shards):
    """A column of file paths (a common export) is named in planning, with what to do,
    instead of every row dropping as empty_image once the run has started; the Hugging
    Face {bytes, path} struct and plain binary pass."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    uris, _ = shards
    paths = tmp_path / "paths"
    paths.mkdir()
    pq.write_table(pa.table({"image": ["imgs/0.png", "imgs/1.png"], "text": ["a", "b"]}),
                   paths / "part-0.parquet")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=str(paths)), Storage())
    assert str(exc.value).startswith(
        f"{paths / 'part-0.parquet'}: data.image_column='image' holds strings (file paths or "
        "URLs?), not encoded images: ")
    assert "data.format captionfolder or imagefolder" in str(exc.value)
    ids = tmp_path / "ids"
    ids.mkdir()
    pq.write_table(pa.table({"img": [1, 2], "text": ["a", "b"]}), ids / "part-0.parquet")
    with pytest.raises(ValueError, match=r"data.image_column='img' holds int64, not encoded"):
        plan_data(DataSection(uri=str(ids), image_column="img"), Storage())
    # an edit dataset's input images as paths (a TypeError from the plan's sample read before)
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="PNG")
    png = buf.getvalue()
    edits = tmp_path / "edits"
    edits.mkdir()
    pq.write_table(pa.table({"image": [png, png], "text": ["a", "b"], "control_image": ["in/0.png", "in/1.png"]}),
                   edits / "part-0.parquet")
    with pytest.raises(ValueError, match=r"data.control_column='control_image' holds strings \(file paths"):
        plan_data(DataSection(uri=str(edits), control_images=True), Storage())
    assert plan_data(DataSection(uri=uris["parquet"]), Storage()).rows == N  # plain binary
    struct = tmp_path / "struct"
    struct.mkdir()
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"image": pa.array([{"bytes": b"x", "path": "0.png"}], hf),
                             "text": ["a"]}), struct / "part-0.parquet")
    assert plan_data(DataSection(uri=str(struct)), Storage()).rows == 1
    # Every shard is checked, not the first alone: a later one with its captions in another
    # column was a bare KeyError: 'text' in the reader, once the run had started.
    pq.write_table(pa.table({"image": pa.array([{"bytes": b"y", "path": "1.png"}], hf),
                             "caption": ["b"]}), struct / "part-1.parquet")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=str(struct)), Storage())
    assert str(exc.value).startswith(f"{struct / 'part-1.parquet'}: column(s) not found: "
                                     "data.caption_column='text'; the shard has ['image', 'caption']")


def _unreadable(root, n: int = 20) -> dict[str, str]:
    """Every format's copy of ``n`` captioned files, none of them an image PIL reads."""
    from raylora.data.demo import write_imagefolder

    uris = {}
    for fmt, captions in (("imagefolder", "metadata"), ("captionfolder", "txt")):
        folder = write_imagefolder(root / fmt, n=n, size=16, seed=5, captions=captions)
        for png in folder.glob("*.png"):
            png.write_bytes(b"this is no image, " + png.name.encode())
        uris[fmt] = str(folder)
    store = Storage()
    items = collect_items(store, uris["imagefolder"])
    for fmt in formats.writable_formats():
        dest = str(root / fmt)
        write_shard(store, dest, fmt, 0, items[: n // 2])
        write_shard(store, dest, fmt, 1, items[n // 2:])
        uris[fmt] = dest
    return uris


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_data_none_of_whose_sampled_rows_decodes_is_refused_in_planning(shards, fmt, tmp_path):
    """Before, such data started Ray, loaded the model, and every worker read its rows
    only to drop each one: stack traces, then the bad-fraction error (47 s for 16 rows)."""
    from raylora.data.plan import SAMPLE_ROWS, sample_problems

    uri = _unreadable(tmp_path)[fmt]
    data = DataSection(uri=uri)
    (line,) = sample_problems(data, plan_data(data, Storage()), Storage())
    # 20 rows in 2 shards (20 images): 16 of them, spread over the files
    assert line.startswith(f"data.uri: {uri}: none of the {SAMPLE_ROWS} rows read to check "
                           f"it is usable (not_an_image={SAMPLE_ROWS}; e.g. {uri}/"), line
    assert ": not_an_image: no image format PIL reads starts b'this is '" in line
    assert line.endswith("(python -m PIL.report lists them; HEIC needs a plugin).")
    # Mostly-bad data is what a config with data.max_bad_fraction >= 0.5 expects.
    loose = DataSection(uri=uri, max_bad_fraction=0.5)
    assert sample_problems(loose, plan_data(loose, Storage()), Storage()) == []
    # One bad sample among good ones (the module's shards) is the run's to judge.
    good = DataSection(uri=shards[0][fmt])
    assert sample_problems(good, plan_data(good, Storage()), Storage()) == []


def _parquet(path, images: list[bytes], captions: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "text": captions}), path)


def test_the_sample_reads_spread_rows_within_its_budget_and_names_sources_and_reasons(tmp_path, monkeypatch):
    from raylora.data.demo import make_samples
    from raylora.data.formats import parquet
    from raylora.data.plan import sample_problems

    def problems(**kw):
        data = DataSection(**kw)
        return sample_problems(data, plan_data(data, Storage()), Storage())

    pngs = [png for png, _ in make_samples(84, size=16, seed=2)]
    # A single file whose first 16 rows are bad: rows spread over its first row group are
    # read (it is read whole anyway), not those 16 alone.
    _parquet(tmp_path / "head" / "a.parquet", [b"junk"] * 16 + pngs, ["a caption"] * 100)
    assert problems(uri=str(tmp_path / "head")) == []
    # A first row group over what is left of the budget is not read at all.
    _parquet(tmp_path / "bad" / "a.parquet", [b"junk"] * 20, ["a caption"] * 20)
    assert problems(uri=str(tmp_path / "bad"))
    monkeypatch.setattr(parquet, "SAMPLE_BYTES", 100)
    assert problems(uri=str(tmp_path / "bad")) == []
    monkeypatch.undo()

    # Each source is judged alone and named by its key.
    lines = problems(sources=[{"uri": str(tmp_path / "head")}, {"uri": str(tmp_path / "bad")}])
    assert [line.split(": ")[0] for line in lines] == ["data.sources[1].uri"]

    # The reasons' own hints, as the run's decode judges them (data.* settings).
    _parquet(tmp_path / "blank" / "a.parquet", pngs[:20], [" "] * 20)
    (line,) = problems(uri=str(tmp_path / "blank"))
    assert "(missing_caption=16;" in line and line.endswith(
        "or set data.caption_dropout > 0 to train them on the empty prompt.")
    assert problems(uri=str(tmp_path / "blank"), caption_dropout=0.1) == []
    _parquet(tmp_path / "small" / "a.parquet", pngs[:20], ["a caption"] * 20)
    (line,) = problems(uri=str(tmp_path / "small"), min_size=32)  # 16 px images
    assert "(too_small=16; e.g. " in line and ": too_small: 16x16 < data.min_size=32)" in line
    assert line.endswith("the run would drop every such row. Lower data.min_size, or set "
                         "data.small_images: upscale.")
    assert problems(uri=str(tmp_path / "small"), min_size=32, small_images="upscale") == []
    # Two reasons: both counted, an example and a hint of each. Rows 0, 7 and 13 of the
    # 16 spread over 100 are junk; the other 13 are 16 px.
    (line,) = problems(uri=str(tmp_path / "head"), min_size=32)
    assert "(too_small=13, not_an_image=3; e.g. " in line and "a.parquet#0: not_an_image" in line
    assert line.endswith("HEIC needs a plugin). Lower data.min_size, or set data.small_images: "
                         "upscale.")


def test_a_tar_is_read_in_large_pieces(tmp_path, monkeypatch):
    """Every read of an object-store file is a ranged GET, and tarfile reads 10 KiB at a
    time: planning 16 tars of 3 MiB in moto took 6224 GETs and 21.7 s (0.27 s now)."""
    import io

    import pyarrow as pa
    from PIL import Image

    from raylora.data.demo import write_imagefolder
    from raylora.data.formats import webdataset

    src = write_imagefolder(tmp_path / "src", n=4, size=16, seed=1)
    for i in range(4):  # ~770 KB each: a 3 MiB tar
        img = np.random.default_rng(i).integers(0, 256, (512, 512, 3), dtype=np.uint8)
        Image.fromarray(img).save(src / f"img_{i:05d}.png")
    store = Storage()
    write_shard(store, str(tmp_path / "wds"), "webdataset", 0, collect_items(store, str(src)))
    reads = []

    class Counting(io.FileIO):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

        def readinto(self, b):
            reads.append(len(b))
            return super().readinto(b)

    monkeypatch.setattr(Storage, "open_input", lambda self, uri: pa.PythonFile(Counting(uri), mode="r"))
    data = DataSection(uri=str(tmp_path / "wds"))
    plan = plan_data(data, store)
    assert plan.rows == 4 and len(plan.files) == 1
    size = (tmp_path / "wds" / "shard-00000.tar").stat().st_size
    assert size > 3 << 20 and len(reads) <= 2, (size, len(reads))  # was one per 10 KiB
    rows = list(webdataset.WebDataset().iter_rows(data, plan.files, store))
    assert len(rows) == 4 and len(reads) <= 4


# What macOS writes beside each file it copies to a volume without resource forks
# (AppleDouble): a ._cat.txt beside cat.txt is not UTF-8 text, nor ._cat.png an image.
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \x00\x02\x00\x00\x00\x09\xff\xfe\x80"


def test_shards_build_lists_the_folder_as_training_does(tmp_path):
    """`raylora shards build` listed every file: a folder copied from a Mac failed on its
    ._cat.txt (not UTF-8), and .hidden.png or a notebook's .ipynb_checkpoints copy went
    into the shards, though training leaves them all out."""
    from PIL import Image

    from raylora.data.shards import checked_items

    src = tmp_path / "src"
    for stem in ("cat", "dog", ".hidden", ".ipynb_checkpoints/cat-checkpoint", "__MACOSX/dog",
                 "sub/.thumbnails/cat", "sub/bird"):
        (src / stem).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(src / f"{stem}.png")
        (src / f"{stem}.txt").write_text(f"a {stem}")
    for name in ("._cat.png", "._cat.txt", "sub/._bird.txt", ".DS_Store"):
        (src / name).write_bytes(APPLE_DOUBLE)
    store = Storage()
    items = checked_items(str(src), str(tmp_path / "out"), "parquet", 10, store)
    assert [(it["key"], it["text"]) for it in items] == [
        ("cat", "a cat"), ("dog", "a dog"), ("sub/bird", "a sub/bird")]
    trained = plan_data(DataSection(uri=str(src)), store).files
    assert sorted(it["uri"] for it in items) == [f for f in trained if f.endswith(".png")]


@pytest.mark.parametrize("name", ["metadata.csv", "metadata.jsonl"])
def test_a_metadata_file_not_in_utf8_is_named_with_the_fix(tmp_path, name):
    """Excel saves a CSV in the Windows code page: the run was refused with "data.uri:
    'utf-8' codec can't decode byte 0xe9 ...", naming neither the file nor the fix."""
    from raylora.data.demo import write_imagefolder

    src = write_imagefolder(tmp_path / "src", n=2, size=16, seed=0)
    (src / "metadata.jsonl").unlink()
    text = ("file_name,text\nimg_00000.png,café\nimg_00001.png,b\n" if name.endswith(".csv") else
            '{"file_name": "img_00000.png", "text": "café"}\n')
    (src / name).write_bytes(text.encode("cp1252"))
    at = text.index("é")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=str(src)), Storage())
    assert str(exc.value) == (f"{src}/{name}: not UTF-8 text (invalid continuation byte at "
                              f"byte {at}); save it as UTF-8")


def test_shards_build_keeps_several_captions_in_a_parquet_list_column(tmp_path):
    """A metadata.jsonl line's list of captions: the parquet shard's text column holds them
    as a list<string> (training draws one per read); a WebDataset's .txt holds one caption,
    so that build is refused before Ray. Before: the joined string was written."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylora.data.demo import write_imagefolder
    from raylora.data.shards import checked_items

    src = write_imagefolder(tmp_path / "src", n=3, size=16, seed=0)
    texts = [["a dog", "a puppy"], "one caption", []]
    (src / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": f"img_{i:05d}.png", "text": t}) + "\n" for i, t in enumerate(texts)))
    store = Storage()
    items = checked_items(str(src), str(tmp_path / "out"), "parquet", 10, store)
    assert [it["text"] for it in items] == [["a dog", "a puppy"], "one caption", ""]
    write_shard(store, str(tmp_path / "out"), "parquet", 0, items)
    table = pq.read_table(tmp_path / "out" / "shard-00000.parquet")
    assert table.schema.field("text").type == pa.list_(pa.string())
    assert table["text"].to_pylist() == [["a dog", "a puppy"], ["one caption"], []]
    from raylora.data.captions import caption_list

    data = DataSection(uri=str(tmp_path / "out"))
    rows = list(formats.get_format("parquet").iter_rows(data, plan_data(data, store).files, store))
    assert [caption_list(r["text"]) or r["text"] for r in rows] == [["a dog", "a puppy"], "one caption", ""]
    with pytest.raises(ValueError) as exc:
        checked_items(str(src), str(tmp_path / "wds"), "webdataset", 10, store)
    assert str(exc.value) == (
        f"{src}: 1 image(s) have several captions in their metadata line (e.g. img_00000); a "
        "webdataset shard holds one caption per image: build --format parquet (a list column, "
        "one caption drawn per read in training)")


def _json_captioned_tar(folder, captions: list) -> str:
    """A WebDataset folder: one tar of a 16 px PNG per entry of ``captions``, each in its
    KEY.json's "caption" (a list: several captions)."""
    import io
    import json
    import tarfile

    from PIL import Image

    folder.mkdir(parents=True)
    with tarfile.open(folder / "shard-00000.tar", "w") as tar:
        for i, caption in enumerate(captions):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (10 * i, 90, 160)).save(buf, "PNG")
            for name, payload in ((f"{i:05d}.png", buf.getvalue()),
                                  (f"{i:05d}.json", json.dumps({"caption": caption}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return str(folder)


def test_a_webdataset_json_list_of_captions_trains_one_a_read_and_is_refused_with_the_cache(
        tmp_path, tiny_model):
    """KEY.json's "caption": [...] went on as a list: Ray Data's read stage (str()) trained
    the list's Python text, and data.cache: latents kept the caption drawn at its build for
    good, where a parquet list column and a metadata.jsonl list are refused. It travels
    joined as theirs do (the same string to the driver's held-out hash as to the read
    stage's), one caption drawn per read; with the cache it is refused in planning for the
    rows the plan's sample check reads, and by any later read that meets one (the held-out
    rows, the bucket scan, the cache's build)."""
    from raylora.data.captions import caption_list, joined_captions
    from raylora.data.preprocess import Preprocess, StageSpec, stage_kwargs
    from raylora.data.source import _unit_tables

    captions = [["a red dog", "a blue cat"], "one caption", ["only this"]]
    uri = _json_captioned_tar(tmp_path / "wds", captions)
    store = Storage()
    data = DataSection(uri=uri, resolution=16, center_crop=True)
    plan = plan_data(data, store)
    wds = formats.get_format("webdataset")
    rows = list(wds.iter_rows(data, plan.files, store))
    assert [r["text"] for r in rows] == [joined_captions(captions[0]), "one caption", "only this"]
    # Ray Data's read stage gets the same strings
    (table,) = _unit_tables({"index": 0, "start": 0, "stop": -1, "keep": -1}, data, "webdataset",
                            plan.files, store)
    assert table["text"].to_pylist() == [r["text"] for r in rows]
    assert caption_list(table["text"][0].as_py()) == captions[0]
    stage = Preprocess(StageSpec(**stage_kwargs("train", data, model_path=tiny_model, family="sd",
                                                storage=store, seed=3)))
    seen = []
    stage.text_columns = lambda caps, f=stage.text_columns: (seen.append(caps[0]), f(caps))[1]
    batch = {"image": np.array([rows[0]["image"]], dtype=object),
             "text": np.array(table["text"].to_pylist()[:1], dtype=object)}
    for _ in range(12):
        stage(batch)
    assert set(seen) == {"a red dog", "a blue cat"}  # one drawn per read

    cached = data.model_copy(update={"cache": "latents"})
    with pytest.raises(ValueError) as exc:
        plan_data(cached, store)
    assert str(exc.value) == (
        f"{uri}/shard-00000.tar#00000: several captions (a list in its .json); data.cache: "
        "latents encodes one caption per image for good: train uncached (data.cache: none, a "
        "caption drawn per read), or keep one caption per image")
    # 20 rows, the 18th of several captions: past the 16 the plan's sample reads
    later = _json_captioned_tar(tmp_path / "later", ["a caption"] * 17 + [["a dog", "a cat"]]
                                + ["a caption"] * 2)
    cached = cached.model_copy(update={"uri": later})
    plan = plan_data(cached, store)
    assert plan.rows == 20
    with pytest.raises(ValueError, match=r"shard-00000\.tar#00017: several captions"):
        list(wds.iter_unit(cached, plan.files, store, 0, 0, -1))  # as the cache's build reads


def _tar_of(path, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_tar_whose_samples_are_apart_is_refused_in_planning(tmp_path, dropout):
    """`tar cf data.tar *.png *.txt` puts every image first and the captions after: each
    caption began a sample of its own, so every image trained on the empty caption (with
    caption dropout on, without a word). Refused where the driver counts the tar, naming
    it, the member and the fix; the reader refuses it too. Grouped, it reads as before."""
    import io

    from PIL import Image

    from raylora.data.formats.webdataset import count_tar_samples, iter_tar_samples

    pngs = []
    for i in range(3):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (40 * i, 90, 160)).save(buf, "PNG")
        pngs.append((f"{i:03d}.png", buf.getvalue()))
    texts = [(f"{i:03d}.txt", f"photo {i}".encode()) for i in range(3)]
    (tmp_path / "apart").mkdir()
    tar = tmp_path / "apart" / "data.tar"
    _tar_of(tar, pngs + texts)
    said = (f"{tar}: 000.txt is apart from the other files of sample '000': the files of a "
            "sample (KEY.jpg, KEY.txt, ...) must be adjacent in a WebDataset tar, as webdataset "
            "reads them. Write it again with them together (`tar --sort=name -cf x.tar -C "
            "FOLDER .`), or build shards from the folder with `raylora shards build`")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=str(tmp_path / "apart"), caption_dropout=dropout), Storage())
    assert str(exc.value) == said
    with pytest.raises(ValueError) as exc:
        list(iter_tar_samples(open(tar, "rb"), str(tar)))
    assert str(exc.value) == said

    (tmp_path / "together").mkdir()
    _tar_of(tmp_path / "together" / "data.tar", [m for pair in zip(pngs, texts) for m in pair])
    assert count_tar_samples(open(tmp_path / "together" / "data.tar", "rb")) == 3
    data = DataSection(uri=str(tmp_path / "together"), caption_dropout=dropout)
    plan = plan_data(data, Storage())
    rows = formats.get_format("webdataset").iter_rows(data, plan.files, Storage())
    assert plan.rows == 3 and [r["text"] for r in rows] == ["photo 0", "photo 1", "photo 2"]


def test_shards_build_warns_about_or_refuses_the_images_it_leaves_out(tmp_path, caplog, capsys):
    """Metadata lines whose image is gone, and caption-folder images without a caption,
    were dropped without a word (9 of 10 images gone: a shard of one), where training
    warns or refuses the folder over data.max_bad_fraction. Now the same: a warning with
    the count and examples, or refused before anything is written."""
    from PIL import Image

    from raylora.data.demo import write_imagefolder
    from raylora.data.shards import checked_items

    store, out = Storage(), tmp_path / "out"
    src = write_imagefolder(tmp_path / "if", n=20, size=8, seed=0)
    (src / "img_00007.png").unlink()  # 1 of 20: 5%, not over the default
    with caplog.at_level("WARNING", logger="raylora.data"):
        items = checked_items(str(src), str(out), "parquet", 10, store)
    assert len(items) == 19
    assert (f"{src}: 1 of 20 lines of {src}/metadata.jsonl name an image that is not in the "
            "folder (e.g. 'img_00007.png'): left out of the shards") in caplog.text
    for i in range(1, 10):
        (src / f"img_{i:05d}.png").unlink(missing_ok=True)
    with pytest.raises(ValueError) as exc:
        checked_items(str(src), str(out), "parquet", 10, store)
    assert str(exc.value) == (
        f"{src}: 9 of 20 lines of {src}/metadata.jsonl name an image that is not in the folder "
        "(e.g. 'img_00001.png', 'img_00002.png', 'img_00003.png'); 45.0% of them, over "
        "--max-bad-fraction=0.05 (default data.max_bad_fraction's, where training refuses the "
        "folder); nothing written. Restore the images or remove their lines")
    assert not out.exists()
    assert len(checked_items(str(src), str(out), "parquet", 10, store, max_bad_fraction=0.5)) == 11
    # the command's bound (refused before Ray starts)
    from raylora.cli import main

    assert main(["shards", "build", str(src), str(out), "--max-bad-fraction", "0.4"]) == 2
    assert "45.0% of them, over --max-bad-fraction=0.4 " in capsys.readouterr().err
    assert not out.exists()

    cf = tmp_path / "cf"
    cf.mkdir()
    for i in range(20):
        Image.new("RGB", (8, 8)).save(cf / f"img{i:02d}.jpg")
        if i >= 5:
            (cf / f"img{i:02d}.txt").write_text(f"caption {i}")
    with pytest.raises(ValueError) as exc:
        checked_items(str(cf), str(out), "webdataset", 10, store)
    assert str(exc.value) == (
        f"{cf}: 5 of 20 images have no caption: no .txt file beside them and not in a kohya "
        f"N_name folder (e.g. {cf}/img00.jpg, {cf}/img01.jpg, {cf}/img02.jpg); 25.0% of them, "
        "over --max-bad-fraction=0.05 (default data.max_bad_fraction's, where training refuses "
        "the folder); nothing written. "
        "Caption them (a .txt beside each) or remove them")
    for i in range(1, 5):
        (cf / f"img{i:02d}.txt").write_text(f"caption {i}")
    caplog.clear()
    with caplog.at_level("WARNING", logger="raylora.data"):
        items = checked_items(str(cf), str(out), "webdataset", 10, store)
    assert [it["key"] for it in items] == [f"img{i:02d}" for i in range(1, 20)]
    assert (f"{cf}: 1 of 20 images have no caption: no .txt file beside them and not in a "
            f"kohya N_name folder (e.g. {cf}/img00.jpg): left out of the shards") in caplog.text


def test_shards_build_keeps_the_dots_of_a_caption_folder_name_in_its_key(tmp_path):
    """IMG_0001.v1.jpg and IMG_0001.v2.jpg both got the key IMG_0001 (the extension was cut
    from a key that was already the stem), cat.png.jpg the key cat."""
    from PIL import Image

    from raylora.data.shards import checked_items

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for stem in ("IMG_0001.v1", "IMG_0001.v2", "cat.png", "sub/a.b"):
        Image.new("RGB", (8, 8)).save(src / f"{stem}.jpg")
        (src / f"{stem}.txt").write_text(f"caption of {stem}")
    items = checked_items(str(src), str(tmp_path / "out"), "parquet", 10, Storage())
    assert [(it["key"], it["text"]) for it in items] == [
        ("IMG_0001.v1", "caption of IMG_0001.v1"), ("IMG_0001.v2", "caption of IMG_0001.v2"),
        ("cat.png", "caption of cat.png"), ("sub/a.b", "caption of sub/a.b")]


def test_a_parquet_build_writes_one_schema_in_every_shard_and_its_manifest(
        tmp_path, ray_local):
    """Each shard task chose its own columns: text list<string> where its images had several
    captions and string elsewhere, a mask or control column only where its images had one,
    and manifest.json said "text": "string". pyarrow (and datasets) refused to read the
    folder as one table. Now every shard has the build's columns (null where an image has
    no sidecar), the manifest names them, and training reads a null as none."""
    import json

    import pyarrow as pa
    import pyarrow.dataset as pds
    import pyarrow.parquet as pq
    from PIL import Image

    from raylora.data.captions import caption_list
    from raylora.data.demo import write_imagefolder

    src = write_imagefolder(tmp_path / "src", n=4, size=8, seed=0)
    texts = [["a dog", "a puppy"], "a cat", "a bird", "a fish"]
    (src / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": f"img_{i:05d}.png", "text": t}) + "\n" for i, t in enumerate(texts)))
    Image.new("L", (8, 8), 255).save(src / "img_00003.mask.png")
    Image.new("RGB", (8, 8), (1, 2, 3)).save(src / "img_00002.control.png")
    out = tmp_path / "out"
    manifest = build_shards(str(src), str(out), "parquet", 2)
    files = sorted(str(f) for f in out.glob("*.parquet"))
    want = pa.schema([("key", pa.string()), ("image", pa.binary()),
                      ("text", pa.list_(pa.string())), ("mask", pa.binary()),
                      ("control_image", pa.binary())])
    assert len(files) == 2 and [pq.read_schema(f) for f in files] == [want, want]
    table = pds.dataset(files, format="parquet").to_table()
    assert table["text"].to_pylist() == [["a dog", "a puppy"], ["a cat"], ["a bird"], ["a fish"]]
    assert [m is not None for m in table["mask"].to_pylist()] == [False, False, False, True]
    assert [c is not None for c in table["control_image"].to_pylist()] == [False, False, True, False]
    assert manifest["schema"] == json.loads((out / "manifest.json").read_text())["schema"] == {
        "key": "string", "image": "binary (encoded image)",
        "text": "list<string> (the image's captions; a read trains one)",
        "mask": "binary (loss mask; null where none)",
        "control_image": "binary (control image; null where none)"}

    data = DataSection(uri=str(out), masked_loss=True, control_images=True)
    plan = plan_data(data, Storage())
    rows = list(formats.get_format("parquet").iter_rows(data, plan.files, Storage()))
    assert plan.rows == 4 and [caption_list(r["text"]) or r["text"] for r in rows] == [
        ["a dog", "a puppy"], "a cat", "a bird", "a fish"]
    assert [r["mask"] is not None for r in rows] == [False, False, False, True]
    assert [r["control"] is not None for r in rows] == [False, False, True, False]


def test_imagefolder_units_parse_the_metadata_once(tmp_path):
    """Every read unit (256 rows) read and parsed the whole metadata.jsonl again: an epoch
    of a 50k-image folder read 196 copies of it. Now once per process for the same listing
    and file; a file written again is read again."""
    import json

    from raylora.data.formats import imagefolder

    def write(caption: str) -> None:
        (tmp_path / "metadata.jsonl").write_text("".join(
            json.dumps({"file_name": f"img_{i:04d}.png", "text": f"{caption} {i}"}) + "\n"
            for i in range(300)))

    write("a red car")
    files = [str(tmp_path / "metadata.jsonl")] + [str(tmp_path / f"img_{i:04d}.png") for i in range(300)]
    store, data, fmt = Storage(), DataSection(uri=str(tmp_path)), formats.get_format("imagefolder")
    reads = []
    real = store.read_bytes
    store.read_bytes = lambda u: reads.append(u) or (real(u) if u.endswith(".jsonl") else b"png")

    def epoch() -> list[str]:
        units = fmt.units(data, files, store, 32)
        assert len(units) == 10
        return [r["text"] for u in units for r in fmt.iter_unit(data, files, store, *u)]

    assert epoch() == [f"a red car {i}" for i in range(300)]
    assert epoch() == [f"a red car {i}" for i in range(300)]
    assert sum(u.endswith(".jsonl") for u in reads) == 1  # was 1 + 10 per epoch
    write("a blue bus")
    assert epoch() == [f"a blue bus {i}" for i in range(300)]
    assert sum(u.endswith(".jsonl") for u in reads) == 2
    assert len(imagefolder._PARSED) <= imagefolder.PARSED_KEPT


def test_a_binary_caption_column_takes_the_caption_prefix(tmp_path):
    """A parquet caption column of bytes with data.caption_prefix: the read stage failed
    (TypeError: startswith on bytes). Decoded as a caption file is; not UTF-8 stays a
    caption_not_utf8 row."""
    import pyarrow as pa

    from raylora.data.captions import with_prefix
    from raylora.data.decode import BadRecord, decode_caption
    from raylora.data.source import _as_source

    table = pa.table({"text": pa.array([b"a dog", b"", None, b"caf\xe9"], pa.binary())})
    out = _as_source(table, DataSection(uri=str(tmp_path), caption_prefix="sks"), 0)
    texts = out["text"].to_pylist()
    assert texts[:3] == ["sks, a dog", "", None]
    with pytest.raises(BadRecord) as exc:
        decode_caption(texts[3], keep_empty=True)
    assert exc.value.reason == "caption_not_utf8"
    assert with_prefix("", b"a dog") == b"a dog"  # no prefix: as it was


def test_demo_data_refuses_a_folder_that_holds_demo_shards(tmp_path):
    """Written again into the same folder with fewer shards, the old parts stayed beside the
    new: the manifest said 4 images and training read 10."""
    import json

    from raylora.data.demo import write_parquet_shards

    dest = tmp_path / "demo"
    write_parquet_shards(dest, n=10, num_shards=3, size=8)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(ValueError) as exc:
        write_parquet_shards(dest, n=4, num_shards=1, size=8)
    assert str(exc.value) == (f"{dest}: already holds 3 demo shard(s) (part-00000.parquet, "
                              "part-00001.parquet, part-00002.parquet); give an empty or new "
                              "folder, or remove them first")
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert json.loads((dest / "_manifest.json").read_text())["count"] == 10
    assert plan_data(DataSection(uri=str(dest)), Storage()).rows == 10


def test_a_caption_with_a_trailing_newline_trains_as_a_caption_files_does(tmp_path):
    """echo "a red fox" > 0.txt; tar cf ... wrote the caption with its newline, and it
    trained as "a red fox\\n" (a caption folder's .txt is read stripped): the LLM text
    encoders (Qwen-Image, Z-Image, Flux.2) tokenize the newline."""
    from raylora.data.decode import decode_row
    from raylora.data.demo import write_imagefolder

    src = write_imagefolder(tmp_path / "src", n=1, size=16, seed=3)
    png = next(src.glob("*.png")).read_bytes()
    tar = tmp_path / "tar"
    tar.mkdir()
    _tar_of(tar / "000000.tar", [("0.png", png), ("0.txt", b"a red fox\n")])
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "0.png").write_bytes(png)
    (folder / "0.txt").write_bytes(b"a red fox\n")
    for uri in (tar, folder):
        data = DataSection(uri=str(uri))
        plan = plan_data(data, Storage())
        [row] = formats.get_format(plan.format).iter_rows(data, plan.files, Storage())
        _, caption = decode_row(row["image"], row["text"], max_pixels=1 << 20, min_size=1,
                                small_images="upscale", keep_empty_captions=False,
                                background=(255, 255, 255))
        assert caption == "a red fox", plan.format


@pytest.mark.parametrize("pattern,rows", [("", 3), ("/**/*.png", 3), ("/*.png", 2), ("/a.png", 1),
                                          ("/{a,b}.png", 2)])
def test_a_glob_or_a_file_over_a_caption_folder_finds_the_captions_beside_its_images(
        tmp_path, pattern, rows):
    """data.uri DIR/*.png (or one image, or a brace list) over a kohya-style folder: its
    listing held only the images, so every one was refused as having no caption file (and
    with caption dropout on, the captions were left out of the data's fingerprint)."""
    from PIL import Image

    root = tmp_path / "chars"
    (root / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        Image.new("RGB", (16, 16)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"caption of {name}")
    plan = plan_data(DataSection(uri=f"{root}{pattern}"), Storage())
    assert (plan.format, plan.rows) == ("captionfolder", rows)
    [source] = plan.sources
    assert sorted(source.companions) == sorted(f[:-4] + ".txt" for f in source.files)


def test_a_glob_over_an_imagefolders_images_is_refused_naming_its_folder(tmp_path):
    """DIR/*.png over a Hugging Face imagefolder matched its images only: detected as a
    caption folder and refused as "4 of 4 images have no caption", their captions being
    in the metadata.jsonl beside them. An imagefolder is read whole: the error names the
    folder to give, which plans as one."""
    import json

    from PIL import Image

    root = tmp_path / "imf"
    root.mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16)).save(root / f"{i}.png")
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"{i}.png", "text": f"cap {i}"}) + "\n" for i in range(3)))
    for pattern in ("/*.png", "/{0,1}.png"):
        with pytest.raises(ValueError) as exc:
            plan_data(DataSection(uri=f"{root}{pattern}"), Storage())
        assert str(exc.value) == (
            f"data.uri: {root}{pattern}: the images it matches are a Hugging Face imagefolder's "
            f"({root}/metadata.jsonl beside them holds their captions), which is read whole: "
            f"give its folder, {root}")
    plan = plan_data(DataSection(uri=str(root)), Storage())
    assert (plan.format, plan.rows) == ("imagefolder", 3)


def test_a_caption_extension_that_no_caption_folder_reads_is_refused(shards, tmp_path):
    """A kohya user's data.caption_extension: .caption over parquet shards (their captions
    are a column) did nothing, without a word; a source's own setting likewise. Not where
    held-out or class images may be a caption folder that reads it (planned apart)."""
    from raylora.data.plan import DataProblems, unread_caption_extension

    uris, _ = shards
    data = DataSection(uri=uris["parquet"], caption_extension=".caption")
    assert unread_caption_extension(data, plan_data(data, Storage())) == (
        "data.caption_extension: set, but parquet data has no caption files: only caption "
        "folders read it; drop it")
    for other in ({"validation_uri": uris["captionfolder"]}, {"class_prompt": "a dog", "class_sources": uris["captionfolder"]}):
        data = DataSection(uri=uris["parquet"], caption_extension=".caption", **other)
        assert unread_caption_extension(data, plan_data(data, Storage())) is None, other
    data = DataSection(uri=uris["captionfolder"], caption_extension=".txt")
    assert unread_caption_extension(data, plan_data(data, Storage())) is None
    mixed = DataSection(uri=None, caption_extension=".txt", sources=[
        {"uri": uris["webdataset"], "caption_extension": ".caption"}, {"uri": uris["captionfolder"]}])
    with pytest.raises(DataProblems) as exc:
        plan_data(mixed, Storage())
    assert exc.value.problems == [f"data.sources[0].caption_extension: set, but {uris['webdataset']} "
                                  "is webdataset data: only caption folders read it; drop it"]
    # read by the caption folder among the sources: kept
    plan_data(DataSection(uri=None, caption_extension=".txt", sources=[
        {"uri": uris["webdataset"]}, {"uri": uris["captionfolder"]}]), Storage())
