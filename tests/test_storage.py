import os

import pytest

from raylora.storage import Storage, braces, filesystem, normalize


def test_local_uris_normalize_to_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize("runs/x") == str(tmp_path / "runs" / "x")
    assert normalize(f"file://{tmp_path}/a") == str(tmp_path / "a")
    assert normalize("s3://bucket/prefix/") == "s3://bucket/prefix"
    with pytest.raises(ValueError, match="ftp://h/x: unsupported URI scheme"):
        filesystem("ftp://h/x")
    # file: URIs as other tools write them (Hadoop/Spark's file:/, Path.as_uri()'s %20),
    # read as pyarrow and Ray read them: a prefix strip wrote into ./file:/... and out%20B
    spaced = tmp_path / "out B"
    assert normalize(spaced.as_uri()) == str(spaced)
    assert normalize(f"file:{tmp_path}/a") == str(tmp_path / "a")
    assert normalize(f"file://localhost{tmp_path}/a") == str(tmp_path / "a")
    with pytest.raises(ValueError, match="not on host 'otherhost'"):
        normalize("file://otherhost/data")


def test_odd_uris_are_named_by_the_config_and_the_write_check(tmp_path):
    from raylora.config import ConfigError, validate

    with pytest.raises(ConfigError) as exc:
        validate({"model": {"pretrained": "m"}, "data": {"uri": ["d", "file://nas/pets"]},
                  "output": {"uri": "file://runs/x"}})
    assert exc.value.problems == [
        "data.uri[1]: file://nas/pets: a file:// URI names a path on this machine "
        "(file:///abs/path), not on host 'nas'",
        "output.uri: file://runs/x: a file:// URI names a path on this machine "
        "(file:///abs/path), not on host 'runs'"]
    st = Storage()
    # pyarrow raised ArrowInvalid ("Empty path component") naming no key
    assert st.write_problem("s3://bkt/runs//exp") == (
        "s3://bkt/runs//exp: an empty path segment (//); write the prefix with single slashes")
    assert st.write_problem("s3:///x") == "s3:///x: no bucket (scheme://bucket/prefix)"


def test_a_folder_whose_name_holds_brackets_is_that_folder(tmp_path):
    """'[' spells a glob class; a name that is there with one is read as named (it matched
    nothing as a glob)."""
    folder = tmp_path / "photos [2023]"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"x")
    assert Storage().expand(str(folder)) == [str(folder / "a.png")]
    assert Storage().expand(str(folder / "a.png")) == [str(folder / "a.png")]
    (tmp_path / "p1").mkdir()
    (tmp_path / "p1" / "b.png").write_bytes(b"x")
    assert Storage().expand(str(tmp_path / "p[0-9]" / "*.png")) == [str(tmp_path / "p1" / "b.png")]
    # A glob inside such a folder: "[2023]" as a class matched nothing, or "photos 2/" beside it.
    (tmp_path / "photos 2").mkdir()
    (tmp_path / "photos 2" / "z.png").write_bytes(b"x")
    (folder / "sub").mkdir()
    (folder / "sub" / "c.png").write_bytes(b"x")
    assert Storage().expand(str(folder / "*.png")) == [str(folder / "a.png")]
    assert Storage().expand(str(folder / "**" / "*.png")) == [str(folder / "a.png"), str(folder / "sub" / "c.png")]
    assert Storage().expand(str(tmp_path / "photos [0-9]" / "*.png")) == [str(tmp_path / "photos 2" / "z.png")]
    # ... and the data's root is that folder too (an output.uri beside it is not "inside
    # the data"; a kohya N_name folder's repeats do not hang on brackets)
    from raylora.data.formats.captionfolder import data_roots

    assert data_roots(str(folder / "*.png")) == data_roots(str(folder)) == [str(folder)]
    assert data_roots(str(tmp_path / "photos [0-9]" / "*.png")) == [str(tmp_path)]
    # told by files known to be the data's, nothing is asked (an s3:// URI here asked AWS)
    uri = "s3://b/photos [2023]/*.png"
    assert data_roots(uri, beneath=["s3://b/photos [2023]/sub/a.png"]) == ["s3://b/photos [2023]"]
    assert data_roots("s3://b/photos [0-9]/*.png", beneath=["s3://b/photos 2/a.png"]) == ["s3://b"]


def test_expand_dir_glob_list_and_hidden_files(tmp_path):
    for name in ("a.parquet", "b.parquet", "_manifest.json", ".hidden.parquet", "sub/c.parquet"):
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x")
    st = Storage()
    found = st.expand(str(tmp_path), (".parquet",))
    assert [os.path.relpath(f, tmp_path) for f in found] == ["a.parquet", "b.parquet", "sub/c.parquet"]
    assert st.expand(str(tmp_path / "*.parquet")) == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/none: no such file"):
        st.expand([str(tmp_path / "a.parquet"), str(tmp_path / "none")])


@pytest.mark.parametrize("pattern,spelled", [
    ("s/{00..02}.tar", ["s/00.tar", "s/01.tar", "s/02.tar"]),  # webdataset's shard lists
    ("s/{8..11}.tar", ["s/8.tar", "s/9.tar", "s/10.tar", "s/11.tar"]),  # no padding asked
    ("s/{0..20..10}", ["s/0", "s/10", "s/20"]),
    ("s/{2..0}", ["s/2", "s/1", "s/0"]),
    ("{a,b}/{1..2}", ["a/1", "a/2", "b/1", "b/2"]),
    ("{a,{b,c}}x", ["ax", "bx", "cx"]),
    ("a{,b}", ["a", "ab"]),
    ("a{}b{x}c{", ["a{}b{x}c{"]),  # neither a list nor a range: as written
])
def test_braces_spell_what_webdataset_shard_lists_spell(pattern, spelled):
    assert braces(pattern) == spelled


def test_expand_a_brace_list_finds_each_uri_and_names_the_missing(tmp_path):
    for name in [f"wds/{i:05d}.tar" for i in range(12)] + ["a/x.parquet", "b/y.parquet"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    st = Storage()
    found = st.expand(str(tmp_path / "wds" / "{00000..00011}.tar"))
    assert found == [str(tmp_path / "wds" / f"{i:05d}.tar") for i in range(12)]
    # Before: one URI named "{00000..00011}.tar", no such file.
    assert st.expand(str(tmp_path / "{a,b}")) == [str(tmp_path / "a/x.parquet"), str(tmp_path / "b/y.parquet")]
    assert st.expand(str(tmp_path / "{a/*.parquet,b}")) == [str(tmp_path / "a/x.parquet"),
                                                            str(tmp_path / "b/y.parquet")]
    pattern = str(tmp_path / "wds" / "{00010..00015}.tar")
    with pytest.raises(FileNotFoundError) as err:
        st.expand(pattern)
    missing = ", ".join(str(tmp_path / "wds" / f"{i:05d}.tar") for i in (12, 13, 14))
    assert str(err.value) == f"{pattern}: no such file or directory: {missing} (and 1 more)"


def test_publish_dir_replaces_atomically_and_leaves_no_temporaries(tmp_path):
    st = Storage()
    src1, src2 = tmp_path / "s1", tmp_path / "s2"
    for src, text in ((src1, "one"), (src2, "two")):
        src.mkdir()
        (src / "w.safetensors").write_text(text)
    dest = tmp_path / "out" / "adapter"
    st.publish_dir(str(src1), str(dest))
    assert (dest / "w.safetensors").read_text() == "one"
    # What publishes killed midway leave (a temporary copy; the old copy moved aside just
    # before the swap) goes with the next publish; other siblings stay.
    for left in (".adapter.tmp-0123abcd", ".adapter.old-89abcdef"):
        (tmp_path / "out" / left).mkdir()
        (tmp_path / "out" / left / "w.safetensors").write_text("stale")
    (tmp_path / "out" / "adapter-v1").mkdir()
    (tmp_path / "out" / ".adapter.tmp-notours").write_text("x")
    st.publish_dir(str(src2), str(dest))
    assert (dest / "w.safetensors").read_text() == "two"
    assert sorted(os.listdir(tmp_path / "out")) == [".adapter.tmp-notours", "adapter", "adapter-v1"]


def test_local_write_bytes_replaces_whole_files_and_a_failed_write_keeps_the_old_one(tmp_path):
    st = Storage()
    uri = str(tmp_path / "gen" / "00000.png")  # the folder is created
    st.write_bytes(uri, b"first image")
    st.write_bytes(uri, b"second")
    assert open(uri, "rb").read() == b"second"
    # A write that fails once the file is open (here: data that is not bytes, refused by
    # write()): the previous bytes stay whole, and no temporary is left beside them.
    with pytest.raises(TypeError):
        st.write_bytes(uri, "not bytes")
    assert open(uri, "rb").read() == b"second"
    assert os.listdir(tmp_path / "gen") == ["00000.png"]
    # Nothing there before: a failed write leaves nothing, not an empty file.
    with pytest.raises(TypeError):
        st.write_bytes(str(tmp_path / "gen" / "manifest.json"), {"count": 3})
    assert os.listdir(tmp_path / "gen") == ["00000.png"]
    assert st.read_bytes(f"file://{uri}") == b"second"


@pytest.mark.parametrize("sizes", [True, False])
def test_complete_upload_uploads_missing_and_short_files_again(tmp_path, caplog, sizes):
    """What an upload left out is uploaded again: missing files always, short ones unless
    only presence is checked (a tracker's logs, which grow while they are copied). Files
    of other writers at the destination stay."""
    import logging

    import pyarrow.fs as pafs

    from raylora.storage import complete_upload

    src, dest = tmp_path / "src", tmp_path / "dest"
    files = {"whole.bin": b"w" * 100, "short.bin": b"s" * 100, "sub/missing.bin": b"m" * 50}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    dest.mkdir()
    (dest / "whole.bin").write_bytes(files["whole.bin"])
    (dest / "short.bin").write_bytes(b"s" * 10)
    (dest / "rank1.bin").write_bytes(b"another writer's")
    with caplog.at_level(logging.WARNING, logger="raylora.storage"):
        again = complete_upload(str(src), pafs.LocalFileSystem(), str(dest) + "/", sizes=sizes)
    assert again == (["short.bin", "sub/missing.bin"] if sizes else ["sub/missing.bin"])
    assert (dest / "sub/missing.bin").read_bytes() == files["sub/missing.bin"]
    assert (dest / "short.bin").read_bytes() == (files["short.bin"] if sizes else b"s" * 10)
    assert (dest / "rank1.bin").read_bytes() == b"another writer's"
    assert f"{len(again)} file(s) missing or short" in caplog.text
    assert complete_upload(str(src), pafs.LocalFileSystem(), str(dest), sizes=sizes) == []


@pytest.mark.parametrize("uri, path", [
    ("s3://runs/exp#2/adapter", "runs/exp#2/adapter"), ("gs://runs/a?b/adapter/", "runs/a?b/adapter"),
    ("s3a://r/team-a/#7", "r/team-a/#7"), ("s3://b", "b"), ("hf://datasets/o/n", "datasets/o/n")])
def test_an_object_store_key_keeps_what_url_syntax_would_cut(uri, path):
    """'#' and '?' may be part of an S3 or GCS key ("photo #2.png"): URL syntax ended the
    path at them, so s3://runs/exp#2/adapter was runs/exp (publishing an adapter there
    replaced that whole folder; a listed "photo #2.png" was read as "photo ")."""
    from raylora.storage import fs_path

    assert fs_path(uri) == path


def test_listings_leave_out_hidden_files_and_job_markers_not_camera_photos():
    """A leading "_" is a camera's (_MG_1234.JPG, _DSC1234.JPG): those were left out of
    every listing, with Spark's _SUCCESS."""
    from raylora.storage import skipped

    assert [n for n in ["_MG_1234.JPG", "_MG_1234.txt", "_DSC0001.jpg", "a.png", "_SUCCESS",
                        "_metadata", "_common_metadata", ".DS_Store", ".hidden.png", "__pycache__",
                        "_committed_123", "_started_123", "_manifest.json", "_stats.json",
                        "_part-0.crc"] if not skipped(n)] == [
        "_MG_1234.JPG", "_MG_1234.txt", "_DSC0001.jpg", "a.png"]


def test_files_in_hidden_folders_are_left_out_of_every_listing(tmp_path):
    """Only a file's own name was judged: a notebook's .ipynb_checkpoints copies, a file
    manager's .thumbnails and __pycache__ or __MACOSX files trained. Hidden folders below
    the data's root are left out (as Hugging Face datasets does); the root's own folders
    are not judged, and a folder named outright (or by a pattern's fixed part) is read."""
    root = tmp_path / ".cache" / "data"  # data kept under a hidden folder is still data
    for name in ("a.parquet", "sub/b.parquet", ".ipynb_checkpoints/a-checkpoint.parquet",
                 ".thumbnails/t.parquet", "__pycache__/c.parquet", "__MACOSX/sub/b.parquet",
                 "sub/.git/x.parquet", "_MG_0001/d.parquet"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    st = Storage()
    rel = lambda found: [os.path.relpath(f, root) for f in found]  # noqa: E731
    kept = ["_MG_0001/d.parquet", "a.parquet", "sub/b.parquet"]
    assert rel(st.expand(str(root))) == kept
    assert rel(st.expand(str(root / "**.parquet"))) == kept
    assert rel(st.expand(str(root / "*" / "*.parquet"))) == ["_MG_0001/d.parquet", "sub/b.parquet"]
    assert rel(st.expand(str(root / ".thumbnails"))) == [".thumbnails/t.parquet"]
    assert rel(st.expand(str(root / "sub" / ".git" / "*.parquet"))) == ["sub/.git/x.parquet"]
    assert rel(st.expand(str(root / "{sub,.thumbnails}"))) == [".thumbnails/t.parquet", "sub/b.parquet"]
    from raylora.storage import hidden_folder

    assert rel(st.data_files(str(root))) == kept  # raylora shards build's listing
    assert hidden_folder("s3://b/data", "s3://b/data/x/.ipynb_checkpoints/a.png")
    assert not hidden_folder("s3://b/.data", "s3://b/.data/x/a.png")
    assert not hidden_folder("/", "/a/b.png") and hidden_folder("/", "/.a/b.png")


def test_a_globstar_folder_is_zero_or_more_folders(tmp_path):
    """``DIR/**/*.png`` left out the images directly in DIR (``**/`` was one folder or
    more); Python's glob(recursive=True) and fsspec match zero or more, as here. A bare
    ``**`` still crosses folders (``**.parquet`` above)."""
    import glob

    from raylora.storage import _glob_regex

    for name in ("top1.png", "top2.png", "sub/a.png", "sub/deeper/b.png", "sub/c.txt",
                 ".thumbs/t.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    st = Storage()
    rel = lambda found: [os.path.relpath(f, tmp_path) for f in found]  # noqa: E731
    pngs = ["sub/a.png", "sub/deeper/b.png", "top1.png", "top2.png"]
    assert rel(st.expand(str(tmp_path / "**" / "*.png"))) == pngs
    assert sorted(rel(glob.glob(str(tmp_path / "**" / "*.png"), recursive=True))) == pngs
    assert rel(st.expand(str(tmp_path / "sub" / "**" / "*.png"))) == ["sub/a.png", "sub/deeper/b.png"]
    assert rel(st.expand(str(tmp_path / "**"))) == sorted(pngs + ["sub/c.txt"])
    assert rel(st.expand(str(tmp_path / "**" / "deeper" / "*.png"))) == ["sub/deeper/b.png"]
    assert [bool(_glob_regex(p).fullmatch(s)) for p, s in (
        ("d/**/*.png", "d/a.png"), ("d/**/*.png", "d/x/y/a.png"), ("d/**/*.png", "da.png"),
        ("d/**.png", "d/x/a.png"), ("d/x**/a", "d/xy/a"), ("d/x**/a", "d/a"))] == [
        True, True, False, True, True, False]


@pytest.mark.parametrize("form", ["file://{}", "file:{}", "file://localhost{}", "as_uri"])
def test_every_file_uri_form_names_a_local_model(tiny_model, form):
    """README's file: URIs work for model.pretrained as for data.uri and output.uri:
    ``file:/abs/path`` (Hadoop's and Spark's, no "://") was refused as "no such folder
    here, and not a hub id"."""
    from pathlib import Path

    from raylora.config import ModelSection
    from raylora.model.load import check_model, resolve_model_path

    uri = Path(tiny_model).as_uri() if form == "as_uri" else form.format(tiny_model)
    path = resolve_model_path(ModelSection(pretrained=uri))
    assert path == tiny_model
    assert check_model(path, Storage(), weights=False)["family"].name == "sd"
    with pytest.raises(ValueError, match="not on host 'nas'"):
        resolve_model_path(ModelSection(pretrained="file://nas/models/sd"))


@pytest.mark.parametrize("given,named", [("env", "AWS_ENDPOINT_URL"),
                                         ("arg", "storage.endpoint_url")])
def test_an_endpoint_without_a_scheme_is_named_by_where_it_came_from(monkeypatch, given, named):
    """The config's storage.endpoint_url wins over AWS_ENDPOINT_URL, so a bad one is named
    as the config's key, not as an environment variable the user never set."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "minio.internal:9000" if given == "env" else "http://ok:1")
    with pytest.raises(ValueError) as exc:
        filesystem("s3://bkt/x", endpoint_url="minio.internal:9000" if given == "arg" else None)
    assert str(exc.value) == (f"{named}: 'minio.internal:9000' is not an http:// or https:// URL "
                              "(e.g. http://minio.internal:9000)")


def test_an_endpoint_with_a_password_is_refused_without_repeating_it(monkeypatch):
    """storage.endpoint_url: http://user:pass@minio:9000 was accepted, printed back by
    `raylora validate`, and failed at the first request with "Could not resolve hostname"
    (pyarrow reads user:pass@minio as the host)."""
    from raylora.config import ConfigError, validate

    with pytest.raises(ConfigError) as exc:
        validate({"model": {"pretrained": "m"}, "data": {"uri": "s3://b/d"}, "output": {"uri": "o"},
                  "storage": {"endpoint_url": "http://minio:S3CRET@minio.internal:9000"}})
    assert exc.value.problems == [
        "storage.endpoint_url: http://***@minio.internal:9000: a user or password in the URL "
        "is not read; give the keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"]
    with pytest.raises(ValueError) as exc:  # the same in the environment
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:S3CRET@minio.internal:9000")
        filesystem("s3://b/x")
    assert str(exc.value) == ("AWS_ENDPOINT_URL: http://***@minio.internal:9000: a user or "
                              "password in the URL is not read; give the keys as "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
