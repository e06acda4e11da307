"""Dataset mixes without Ray: caption prefixes, tag shuffling and dropout per source, and
what an epoch of weighted or repeated sources reads (raylora.data.plan, .captions)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from raylora.config import DataSection
from raylora.data.captions import CaptionPolicy, apply_policies, shuffle_tags, with_prefix
from raylora.data.formats import NOT_UTF8
from raylora.data.plan import DataProblems, plan_data
from raylora.storage import Storage
from test_formats import epoch_reads, write_kohya


def test_prefix_is_the_first_tag_and_never_captions_a_captionless_row():
    assert with_prefix("sks", "a dog") == "sks, a dog"
    assert with_prefix("ohwx man, ", "a photo") == "ohwx man, a photo"  # no ", ,"
    assert with_prefix("", "a dog") == "a dog"
    assert with_prefix("sks", None) is None and with_prefix("sks", "  ") == "  "
    assert with_prefix("sks", NOT_UTF8 + "caf\xe9") == NOT_UTF8 + "caf\xe9"  # still refused


def test_tag_shuffle_keeps_the_first_keep_tokens_tags():
    rng = np.random.default_rng(0)
    caption = "sks, red hair, smiling, outdoors, , night"
    seen = Counter()
    for _ in range(300):
        tags = shuffle_tags(caption, 1, rng).split(", ")
        assert tags[0] == "sks"
        assert sorted(tags[1:]) == ["night", "outdoors", "red hair", "smiling"]  # blank dropped
        seen[tags[1]] += 1
    assert set(seen) == {"night", "outdoors", "red hair", "smiling"}
    assert min(seen.values()) > 40  # each about a quarter of 300
    assert shuffle_tags("one tag only", 0, rng) == "one tag only"
    two = [shuffle_tags(caption, 2, rng).split(", ")[:2] for _ in range(20)]
    assert all(t == ["sks", "red hair"] for t in two)


def test_tag_shuffle_keeps_a_sources_trigger_words_first_whatever_keep_tokens():
    """A caption_prefix's tags are the trigger (the card says: first in every caption):
    shuffled with keep_tokens 0, it led only about 1 caption in 5. Kept: max(keep_tokens,
    the prefix's tags), per source."""
    from raylora.data.captions import caption_policies

    data = DataSection(shuffle_tags=True, caption_prefix="ohwx", sources=[
        {"uri": "a"}, {"uri": "b", "caption_prefix": "sks, blue man,"},
        {"uri": "c", "caption_prefix": "zz", "keep_tokens": 3}, {"uri": "d", "caption_prefix": ""}])
    pols = caption_policies(data)
    assert [p.keep_tokens for p in pols] == [1, 2, 3, 0]
    rng = np.random.default_rng(0)
    tail = "a man, red shirt, smiling, outdoors"
    for _ in range(200):
        a, b, c, d = apply_policies([with_prefix(s.caption_prefix, tail)
                                     for s in data.source_sections()], list(pols), rng)
        assert a.startswith("ohwx, ") and b.startswith("sks, blue man, ")
        assert c.startswith("zz, a man, red shirt, ")
        assert sorted(a.split(", ")[1:]) == sorted(tail.split(", "))
    seen = Counter(apply_policies([with_prefix("ohwx", tail)], list(pols[:1]), rng)[0]
                   .split(", ")[1] for _ in range(400))
    assert len(seen) == 4 and min(seen.values()) > 60  # the rest still shuffled


def test_dropout_and_shuffle_follow_each_rows_policy():
    captions = [f"tag{i}, b, c, d" for i in range(400)]
    # One policy for every row draws exactly what a single data.caption_dropout drew.
    got = apply_policies(captions, [CaptionPolicy(0.3)] * 400, np.random.default_rng(5))
    drop = np.random.default_rng(5).random(400) < 0.3
    assert got == ["" if d else c for c, d in zip(captions, drop)]
    # Per source: only the rows of the source with dropout / shuffling get them.
    pols = [CaptionPolicy(0.0), CaptionPolicy(0.5, shuffle_tags=True, keep_tokens=1)] * 200
    got = apply_policies(captions, pols, np.random.default_rng(1))
    assert got[0::2] == captions[0::2]
    second = got[1::2]
    assert 70 < sum(g == "" for g in second) < 130
    kept = [g for g in second if g]
    assert all(g.startswith("tag") and sorted(g.split(", ")[1:]) == ["b", "c", "d"] for g in kept)
    assert any(g.split(", ")[1:] != ["b", "c", "d"] for g in kept)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> tuple[str, str]:
    """16 parquet rows in 2 files, and a caption folder of 8 images."""
    from raylora.data.demo import write_parquet_shards

    root = tmp_path_factory.mktemp("mix")
    write_parquet_shards(root / "pq", n=16, num_shards=2, size=16, seed=2)
    folder = write_kohya(root / "folder", {f"img{i}": f"a thing, number {i}" for i in range(8)})
    return str(root / "pq"), folder


def test_weights_are_shares_of_an_epoch_as_long_as_all_rows(two_sources):
    """Weights 3:1 over 16 + 8 rows: an epoch of 24 reads 18 parquet rows (each once, 2 of
    them twice) and 6 of the 8 images, a different 6 every epoch; exact per epoch, and
    per worker under data.sharding=files."""
    pq, folder = two_sources
    data = DataSection(sources=[{"uri": pq, "weight": 3, "caption_prefix": "sks"},
                                {"uri": folder, "weight": 1}])
    plan = plan_data(data, Storage())
    assert plan.format == "mix" and plan.rows == 24
    a, b = plan.summary()
    assert (a["rows"], a["rows_per_epoch"], a["share"], a["multiplier"]) == (16, 18, 0.75, 1.125)
    assert (b["rows"], b["rows_per_epoch"], b["share"], b["multiplier"]) == (8, 6, 0.25, 0.75)
    # The caption folder's epochs, read unit by unit as the read stage does:
    from raylora.data.plan import DataPlan

    picks = [epoch_reads(data, DataPlan.of(plan.sources[1:]), True, e) for e in range(40)]
    assert all(len(p) == 6 == len(set(p)) for p in picks)
    assert len({tuple(sorted(p)) for p in picks}) > 10  # a new subset most epochs
    counts = Counter(k for p in picks for k in p)
    assert len(counts) == 8 and min(counts.values()) >= 20 and max(counts.values()) <= 40
    # sharding=files: each worker's partial copies come from its own rows, counts exact.
    for world in (2, 3):
        shares = [plan.for_rank(r, world) for r in range(world)]
        assert sum(len(s.files) for s in shares) == len(plan.files)
        for share in shares:
            folder_part = [s for s in share.sources if s.index == 1]
            if folder_part:
                assert len(epoch_reads(data, DataPlan.of(folder_part), False)) == \
                    folder_part[0].epoch_rows()


def test_repeats_count_rows_and_errors_name_the_source(two_sources, tmp_path):
    pq, folder = two_sources
    plan = plan_data(DataSection(sources=[{"uri": pq, "repeats": 2}, {"uri": folder}]), Storage())
    assert plan.rows == 2 * 16 + 8
    assert [s["rows_per_epoch"] for s in plan.summary()] == [32, 8]
    with pytest.raises(DataProblems) as exc:
        plan_data(DataSection(sources=[{"uri": pq}, {"uri": str(tmp_path / "nope")},
                                       {"uri": folder, "format": "parquet"}]), Storage())
    assert exc.value.problems == [
        f"data.sources[1].uri: {tmp_path}/nope: no such file or directory",
        f"data.sources[2].uri: {folder}: matched no parquet files"]


def test_latent_cache_encodes_each_source_with_its_prefix(two_sources, tiny_model, tmp_path):
    """The cache stage reads each source with its own keys and prefix (encoded into the
    cached text embeddings), writes each unit's part with its source, and training over
    the cache gets the sources' shares back; the fingerprint follows the prefix."""
    import pyarrow.parquet as pq_

    from raylora.config import validate
    from raylora.data.cache import CacheEntry, EncodeFiles, _stage_kwargs, _work_items, fingerprint

    pq, folder = two_sources

    def config(prefix: str):
        return validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path)},
                         "data": {"center_crop": True, "cache": "latents", "resolution": 32,
                                  "sources": [{"uri": pq, "weight": 3, "caption_prefix": prefix},
                                              {"uri": folder, "weight": 1}]}})

    cfg, store = config("sks"), Storage()
    plan = plan_data(cfg.data, store)
    items = _work_items(cfg, plan, store, 256)
    # A unit per parquet shard; the caption folder's 8 images one each (a folder is cut
    # into up to CAPTIONFOLDER_MIN_PARTS parts, for data.sharding=files to deal them out).
    folder_units = [(1, 1, i) for i in range(8)]
    assert [(it["k"], it["source"], it["index"]) for it in items] == [(0, 0, 0), (0, 0, 1), *folder_units]
    pre, enc = _stage_kwargs(cfg, tiny_model, "sd", store)
    parts = str(tmp_path / "parts")
    stage = EncodeFiles(cfg.data.model_dump(), [s.format for s in plan.sources],
                        [s.files for s in plan.sources], parts, pre, enc, 256, 8)
    assert all(r["text"].startswith("sks, a ") and r["source"] == 0 for r in stage._rows(0, 0, 0, 0, -1))
    assert all(r["text"].startswith("a thing, number") for r in stage._rows(1, 1, 0, 0, 8))
    written = stage({k: np.array([it[k] for it in items]) for k in
                     ("item", "k", "source", "index", "start", "stop")})
    assert list(written["rows"]) == [8, 8] + [1] * 8
    files = [f"{parts}/{n}" for n in written["name"]]
    assert pq_.read_table(files[0]).num_rows == 8
    entry = CacheEntry(str(tmp_path), files, [8, 8] + [1] * 8, False, sources=[0, 0] + [1] * 8,
                       repeats=[1] * 10)
    cached = entry.plan(cfg.data)
    assert cached.rows == 24 and [s["share"] for s in cached.summary()] == [0.75, 0.25]
    assert fingerprint(cfg, "sd", tiny_model, plan, store) != \
        fingerprint(config("ohwx"), "sd", tiny_model, plan, store)


def test_several_captions_travel_joined_and_one_is_drawn_per_read():
    """An image's several captions (a parquet list<string> cell, a metadata.jsonl "text":
    [...]) trained as the list's text ("['a', 'b']"), and with a caption_prefix crashed
    (AttributeError on the list). They travel as one string that str() keeps, the prefix
    on each; the stage draws one per read from its generator (diffusers' random.choice)."""
    from raylora.data.captions import SEVERAL, caption_list, joined_captions, pick_caption
    from raylora.data.decode import BadRecord, decode_caption

    two = joined_captions(["a dog", " ", None, "a puppy"])
    assert two == SEVERAL + '["a dog", "a puppy"]' and str(two) == two
    # Ray Data hands a list<string> cell over as a numpy array
    assert caption_list(two) == caption_list(np.array(["a dog", "a puppy"], dtype=object)) == [
        "a dog", "a puppy"]
    assert joined_captions(["only one", ""]) == "only one" and joined_captions([]) == ""
    assert joined_captions("a dog") == "a dog" and joined_captions(None) is None
    assert caption_list("a dog") is None
    # the prefix on each, whether it gets the list or its joined string
    assert with_prefix("sks,", ["a dog", "a puppy"]) == with_prefix("sks", two) == \
        joined_captions(["sks, a dog", "sks, a puppy"])
    assert with_prefix("sks", ["a dog"]) == "sks, a dog" and with_prefix("sks", []) == ""
    # one integer draw per row of several: what a generator of the same seed draws
    rng, ref = np.random.default_rng(3), np.random.default_rng(3)
    got = [decode_caption(two, False, rng) for _ in range(200)]
    assert got == [["a dog", "a puppy"][int(ref.integers(2))] for _ in range(200)]
    assert 70 < got.count("a dog") < 130
    # a row of one caption draws nothing: its crop and dropout draw as they did
    state = rng.bit_generator.state
    assert decode_caption(["just one"], False, rng) == pick_caption("just one", rng) == "just one"
    assert rng.bit_generator.state == state
    # no generator (the driver's sample check): the first; none at all: a missing caption
    assert decode_caption(np.array(["x", "y"], dtype=object), False) == "x"
    assert decode_caption([], True) == ""
    with pytest.raises(BadRecord, match="missing_caption"):
        decode_caption([" ", None], False)


# Each image's captions, as a dataset of several captions per image holds them.
LISTED = [["a red square, bright", "a crimson tile"],
          ["a blue square, dark", "an azure tile", "blue"]]


def _listed_data(root) -> tuple[str, str]:
    """LISTED twice: a parquet shard with a list<string> column ``captions``, and an image
    folder whose metadata.jsonl lines have ``"text": [...]``."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq_
    from PIL import Image

    pngs = []
    for i in range(len(LISTED)):
        buf = io.BytesIO()
        Image.new("RGB", (40, 40), (60 * i, 100, 200)).save(buf, "PNG")
        pngs.append(buf.getvalue())
    (root / "pq").mkdir()
    pq_.write_table(pa.table({"image": pngs, "captions": pa.array(LISTED, pa.list_(pa.string()))}),
                    root / "pq" / "part-0.parquet")
    (root / "if").mkdir()
    for i, png in enumerate(pngs):
        (root / "if" / f"{i}.png").write_bytes(png)
    (root / "if" / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": f"{i}.png", "text": c}) + "\n" for i, c in enumerate(LISTED)))
    return str(root / "pq"), str(root / "if")


def test_a_list_caption_column_trains_one_caption_a_read_with_prefix_and_shuffle(
        tmp_path, tiny_model):
    """Through the plain readers (the driver, the cache builder) and the preprocess stage:
    each read tokenizes one of the row's captions, drawn from the stage's seeded
    generator, the prefix on it; tags shuffled after the draw. Before: the list's text
    ("['a red square, bright', 'a crimson tile']"), or an AttributeError with a prefix."""
    from raylora.data.plan import iter_plan_rows
    from raylora.data.preprocess import Preprocess, StageSpec, stage_kwargs

    pq, folder = _listed_data(tmp_path)
    store = Storage()
    prefixed = [[f"ohwx, {c}" for c in cs] for cs in LISTED]
    # What Ray Data's read stage hands the stage for a list<string> column without a prefix
    arrays = np.empty(len(LISTED), dtype=object)
    arrays[:] = [np.array(cs, dtype=object) for cs in LISTED]
    for data, want in ((DataSection(uri=pq, caption_column="captions", caption_prefix="ohwx"), prefixed),
                       (DataSection(uri=folder, caption_prefix="ohwx"), prefixed),
                       (DataSection(uri=pq, caption_column="captions"), LISTED)):
        data = data.model_copy(update={"resolution": 32, "center_crop": True, "random_flip": False})
        rows = list(iter_plan_rows(data, plan_data(data, store), store))
        texts = np.array([r["text"] for r in rows], dtype=object) if data.caption_prefix else arrays
        stage = Preprocess(StageSpec(**stage_kwargs("train", data, model_path=tiny_model,
                                                    family="sd", storage=store, seed=7)))
        seen = []
        stage.text_columns = lambda caps, f=stage.text_columns: (seen.append(list(caps)), f(caps))[1]
        batch = {"image": np.array([r["image"] for r in rows], dtype=object), "text": texts,
                 "key": np.array([r["key"] for r in rows], dtype=object)}
        for _ in range(20):
            assert len(stage(batch)["input_ids"]) == 2
        # centre crop, no flip, no dropout: the caption draws are the generator's only ones
        ref = np.random.default_rng(7)
        assert seen == [[cs[int(ref.integers(len(cs)))] for cs in want] for _ in range(20)]
        assert {c for s in seen for c in s} == {c for cs in want for c in cs}
        from raylora.data.captions import caption_list

        assert [caption_list(r["text"]) for r in rows] == want  # every caption read
    # tag shuffling acts on the drawn caption: the trigger word stays first
    data = DataSection(uri=pq, caption_column="captions", caption_prefix="ohwx", resolution=32,
                       center_crop=True, shuffle_tags=True, keep_tokens=1)
    rows = list(iter_plan_rows(data, plan_data(data, store), store))
    stage = Preprocess(StageSpec(**stage_kwargs("train", data, model_path=tiny_model, family="sd",
                                                storage=store, seed=1)))
    seen = []
    stage.text_columns = lambda caps, f=stage.text_columns: (seen.extend(caps), f(caps))[1]
    for _ in range(20):
        stage({"image": np.array([r["image"] for r in rows], dtype=object),
               "text": np.array([r["text"] for r in rows], dtype=object)})
    tags = {c: sorted(c.split(", ")) for cs in prefixed for c in cs}
    assert all(s.startswith("ohwx, ") and sorted(s.split(", ")) in tags.values() for s in seen)
    assert "ohwx, bright, a red square" in seen  # shuffled, not just drawn


def test_several_captions_with_a_cache_or_a_parquet_split_are_refused_in_planning(tmp_path):
    """A latent cache encodes one caption per image for good; a parquet list column's
    held-out hash sees a list on the driver and a numpy array in Ray Data's read stage.
    Both refused in planning naming data.caption_column. An image folder's joined string
    is the same everywhere: its split holds out the rows the driver holds out."""
    from raylora.data.classgen import read_user_rows
    from raylora.data.split import KeepSplit, read_heldout_rows

    pq, folder = _listed_data(tmp_path)
    store = Storage()
    shard = f"{pq}/part-0.parquet"
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=pq, caption_column="captions", cache="latents"), store)
    assert str(exc.value) == (
        f"{shard}: data.caption_column='captions' holds several captions per image; data.cache: "
        "latents encodes one caption per image for good: train uncached (data.cache: none, a "
        "caption drawn per read), or keep one caption per image")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=pq, caption_column="captions", validation_split=0.5), store)
    assert str(exc.value) == (
        f"{shard}: data.caption_column='captions' holds several captions per image; "
        "data.validation_split cannot hold such rows out consistently: give the held-out rows "
        "as their own files (data.validation_uri)")
    with pytest.raises(ValueError) as exc:
        plan_data(DataSection(uri=folder, cache="latents"), store)
    assert str(exc.value) == (
        f"data.caption_column='text': 2 line(s) of {folder}/metadata.jsonl hold several "
        "captions (e.g. '0.png'); data.cache: latents encodes one caption per image for good: "
        "train uncached (data.cache: none, a caption drawn per read), or keep one caption per "
        "image")
    assert plan_data(DataSection(uri=pq, caption_column="captions"), store).rows == 2
    # an image folder's split: the rows the read stage holds out (its str() column) are
    # the driver's held-out rows
    data = DataSection(uri=folder, caption_prefix="ohwx", validation_split=0.5)
    plan = plan_data(data, store)
    rows = list(read_heldout_rows(data, plan, store, None))
    batch = {"image": np.array([r["image"] for r in rows], dtype=object),
             "text": np.array([str(r["text"]) for r in rows], dtype=object)}
    held = KeepSplit(0.5, heldout=True)(batch)
    driver = read_heldout_rows(data, plan, store, 0.5)
    assert len(driver) == 1 and [r["text"] for r in driver] == list(held["text"])
    # class rows keep every caption (the class stage draws from them per batch)
    class_rows = read_user_rows(DataSection(uri=pq, class_sources=folder, class_prompt="a square"),
                                store, str(tmp_path / "generated"), 10)
    from raylora.data.captions import caption_list

    assert [caption_list(r["text"]) for r in class_rows] == LISTED
