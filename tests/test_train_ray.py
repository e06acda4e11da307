"""Integration on a real local Ray: 2 DDP workers, export, stock-diffusers load, resume."""

import json
import logging
import os

import pytest

from raylora.config import validate
from stock import stock_load

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def first_run(ray_local, tiny_model, demo_data, tmp_path_factory):
    from raylora.launch import run

    out = tmp_path_factory.mktemp("run") / "out"
    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True, "random_flip": True},
        "train": {"batch_size": 2, "max_steps": 6, "learning_rate": 1e-3, "seed": 7, "ema_decay": 0.95},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 2, "num_to_keep": 2},
        "output": {"uri": str(out)},
    }
    before = {a.actor_id for a in _actors()}
    summary = run(validate(tree))
    _STARTED["first_run"] = [a for a in _actors() if a.actor_id not in before]
    return tree, summary


_STARTED: dict[str, list] = {}  # the actors a fixture's run started, Ray Train's too


def _actors() -> list:
    """The actors on this cluster, dead ones too."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, detail=True, limit=10_000)


def test_two_ddp_workers_train_and_stay_in_sync(first_run):
    tree, summary = first_run
    # One driver-side actor per run (raylora.desk), on the driver's node, gone after it.
    import ray

    desks = [a for a in _STARTED["first_run"] if a.ray_namespace == "raylora"]
    assert [(a.class_name, a.state) for a in desks] == [("Desk", "DEAD")], desks
    assert desks[0].name.startswith("raylora-run-")
    assert desks[0].node_id == ray.get_runtime_context().get_node_id()
    m = summary["metrics"]
    assert m["steps"] == 6
    assert m["images_seen"] == 6 * 2 * 2  # steps × batch × workers
    assert len(m["replica_lora_digests"]) == 2
    assert m["replicas_in_sync"] is True
    assert m["train_loss_first"] > 0 and m["train_loss_last"] > 0
    assert m["resumed_from_step"] is None


def test_an_embedded_ray_runs_no_preemption_watcher(first_run):
    """No node of a Ray this process started can be preempted: the run started Ray Train's
    controller, workers and placement-group cleaner, and no PreemptionWatcher. Nor a
    DatasetManager: Ray Train is given no datasets (launch._trainer_class)."""
    started = sorted(a.class_name for a in _STARTED["first_run"])
    assert {"TrainController", "RayTrainWorker", "PlacementGroupCleaner"} <= set(started), started
    assert started.count("RayTrainWorker") == 2
    assert "PreemptionWatcher" not in started, started
    assert "DatasetManager" not in started, started


def test_export_layout_and_metadata(first_run):
    tree, summary = first_run
    out = tree["output"]["uri"]
    adapter = os.path.join(out, "adapter")
    assert sorted(os.listdir(adapter)) == ["README.md", "manifest.json", "pytorch_lora_weights.safetensors", "raylora.json"]
    meta = json.load(open(os.path.join(adapter, "raylora.json")))
    assert set(meta["config"]) == {
        "model", "data", "lora", "train", "scaling", "checkpoint", "failure", "storage", "validation",
        "export", "tracking",
        "output", "tune",
    }
    # No held-out data configured: no held-out loss, and it says so.
    assert meta["metrics"]["eval_loss_last"] is None and meta["data"]["heldout_rows"] == 0
    assert meta["data"]["heldout"] == "none"
    assert meta["config"]["train"]["learning_rate"] == 1e-3
    for key in ("train_loss_first", "train_loss_last", "steps", "images_seen", "wall_seconds"):
        assert meta["metrics"][key] is not None, key
    assert meta["data"]["rows"] == 32 and meta["data"]["files"] == 2
    card = open(os.path.join(adapter, "README.md")).read()
    # a local base: no base_model key (the hub refuses a path there); the heading names it
    assert "base_model:" not in card and "| LoRA rank / alpha / dropout | 4 / 4 / 0 |" in card
    assert "# LoRA adapter for /" in card
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["lr"] == pytest.approx(1e-3) and r["loss"] > 0 for r in rows)
    with open(os.path.join(out, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # num_to_keep=2 of the checkpoints at steps 2, 4, 6; each holds every rank's RNG.
    root = os.path.join(out, "train")
    ckpts = sorted(
        d for d in os.listdir(root) if d.startswith("checkpoint_") and os.path.isdir(os.path.join(root, d))
    )
    assert len(ckpts) == 2
    latest = os.path.join(out, "train", ckpts[-1])
    assert {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt", "lora.safetensors", "adapter"} <= set(os.listdir(latest))


def test_adapter_loads_in_stock_diffusers_and_changes_unet(first_run, tiny_model, tmp_path):
    tree, summary = first_run
    res = stock_load(tiny_model, summary["adapter"], tmp_path)
    assert res["raylora_imported"] is False
    assert len(res["adapters"]) == 1
    assert res["finite"] is True
    assert res["max_abs_diff"] > 1e-5, res


def test_second_run_resumes_from_stored_checkpoint(first_run, caplog):
    """Raising max_steps continues the run: from step 6, on through two epoch boundaries
    (8 batches per worker per epoch), both workers fed by one data stream split once.
    The settings the workers recorded are the driver's (no model.pretrained warning)."""
    from raylora.launch import run

    tree, first = first_run
    first_rows = [json.loads(line) for line in open(os.path.join(tree["output"]["uri"], "metrics.jsonl"))]
    tree = {**tree, "train": {**tree["train"], "max_steps": 20}}
    with caplog.at_level(logging.INFO, logger="raylora"):
        summary = run(validate(tree))
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if m.startswith("resuming from ")]
    assert not [m for m in said if "was trained with" in m]
    m = summary["metrics"]
    assert m["resumed_from_step"] == 6
    assert m["steps"] == 20
    assert m["images_seen"] == 20 * 2 * 2
    assert m["train_loss_first"] == first["metrics"]["train_loss_first"]
    assert m["replicas_in_sync"] is True
    rows = [json.loads(line) for line in open(os.path.join(tree["output"]["uri"], "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert [r["epoch"] for r in rows] == [0] * 8 + [1] * 8 + [2] * 4
    # Steps 1-6 come from the checkpoint, not from training again.
    assert rows[:6] == first_rows
    # The EMA (train.ema_decay) came back with it: 6 updates restored + 14 new.
    from safetensors.torch import load_file

    train_dir = os.path.join(tree["output"]["uri"], "train")
    latest = sorted(d for d in os.listdir(train_dir) if d.startswith("checkpoint_2"))[-1]
    assert int(load_file(os.path.join(train_dir, latest, "ema.safetensors"))["num_updates"]) == 20


def test_a_resume_from_an_incomplete_checkpoint_stops_before_ray(first_run, tmp_path, capsys, monkeypatch):
    """Every checkpoint records its files (checkpoint_files.json). One lost from the
    checkpoint a rerun resumes from (an upload from before raylora checked them, a hand
    deletion) makes ``raylora train`` exit 2 naming it, before Ray is started, and the
    run's files stay as they were."""
    import shutil

    import yaml

    from raylora import launch
    from raylora.cli import main
    from raylora.storage import local_sizes

    tree, _ = first_run
    out = tmp_path / "out"
    shutil.copytree(tree["output"]["uri"], out)
    latest = out / "train" / sorted(d for d in os.listdir(out / "train") if d.startswith("checkpoint_2"))[-1]
    record = json.loads((latest / "checkpoint_files.json").read_text())
    assert record["other_ranks"] == ["rng_rank1.pt"]
    assert {"lora.safetensors", "ema.safetensors", "trainer_state.pt", "history.jsonl", "rng_rank0.pt",
            "adapter/pytorch_lora_weights.safetensors"} <= set(record["rank0"])
    (latest / "rng_rank1.pt").unlink()
    before = local_sizes(str(out))

    def no_ray(*_):
        raise AssertionError("Ray was started before the checkpoint was checked")

    monkeypatch.setattr(launch, "init_ray", no_ray)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**tree, "output": {"uri": str(out)}}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"raylora: error: checkpoint {latest} is incomplete: rng_rank1.pt (missing)." in err
    assert local_sizes(str(out)) == before
    # `raylora submit` makes the same check here, before it reaches any cluster (none
    # listens at this address: a submission would fail with exit 1, not 2).
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")
    assert main(["submit", str(path), "--working-dir", str(tmp_path)]) == 2
    assert f"raylora: error: checkpoint {latest} is incomplete: rng_rank1.pt (missing)." in capsys.readouterr().err
    assert local_sizes(str(out)) == before


def test_a_finished_run_run_again_exports_its_final_checkpoint_without_ray(first_run, tmp_path,
                                                                           monkeypatch):
    """A retried job or a rerun script: the run has nothing to train. Through Ray the
    restored run reported its final checkpoint a second time, and num_to_keep (2) then
    deleted the other one kept; now nothing starts and the checkpoints stay."""
    import shutil

    from raylora import launch
    from raylora.checkpoint.recorded import SNAPSHOT
    from raylora.storage import local_sizes

    tree, _ = first_run
    out = tmp_path / "out"
    shutil.copytree(tree["output"]["uri"], out)
    latest = json.loads((out / "train" / SNAPSHOT).read_text())["latest_checkpoint_result"]
    steps = latest["metrics"]["step"]  # 6, or 20 after the resume test
    adapter = (out / "adapter" / "pytorch_lora_weights.safetensors").read_bytes()
    (out / "adapter" / "pytorch_lora_weights.safetensors").unlink()  # written again below
    # The record of the data as it trained, here made to differ from what a plan of the
    # data now gives, as a cached run's does (its files and rows are its cache entry's)
    # and a run's whose data changed after it trained: the rerun wrote the raw data's
    # files, rows and fingerprint beside the cache_uri for the same weights.
    meta_file = out / "adapter" / "raylora.json"
    written = json.loads(meta_file.read_text())
    written["data"].update(files=7, rows=99, fingerprint="trained-fingerprint",
                           cache_uri="/caches/entry")
    meta_file.write_text(json.dumps(written))
    before = written["data"]
    checkpoints = local_sizes(str(out / "train"))

    def no_ray(*_):
        raise AssertionError("Ray was started to export a finished run again")

    monkeypatch.setattr(launch, "init_ray", no_ray)
    summary = launch.run(validate({**tree, "train": {**tree["train"], "max_steps": steps},
                                   "output": {"uri": str(out)}}))
    assert summary["metrics"]["steps"] == steps and summary["metrics"]["replicas_in_sync"] is True
    assert local_sizes(str(out / "train")) == checkpoints
    assert (out / "adapter" / "pytorch_lora_weights.safetensors").read_bytes() == adapter
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    assert meta["metrics"]["steps"] == steps and isinstance(meta["metrics"]["steps"], int)
    # What the training run counted of its data stays: the rerun reads no data (it wrote
    # rows_decoded None, and a DreamBooth run's class_images went missing).
    assert before["rows_decoded"] > 0
    assert meta["data"]["rows_decoded"] == summary["rows_decoded"] == before["rows_decoded"]
    # and per source (it became null)
    assert [s["rows_decoded"] for s in before["sources"]] == [before["rows_decoded"]]
    assert [s["rows_decoded"] for s in meta["data"]["sources"]] == [before["rows_decoded"]]
    assert meta["data"]["bad_records"] == before["bad_records"]
    assert {k: meta["data"][k] for k in ("files", "rows", "fingerprint", "cache_uri", "sources")} == {
        k: before[k] for k in ("files", "rows", "fingerprint", "cache_uri", "sources")}
    # Run again with another learning rate: the weights were not trained with it, so
    # their card and raylora.json must not say so (they did); nothing is written.
    from raylora.config import ConfigError

    files = local_sizes(str(out))
    with pytest.raises(ConfigError) as exc:
        launch.run(validate({**tree, "train": {**tree["train"], "max_steps": steps,
                                                "learning_rate": 5e-4},
                             "output": {"uri": str(out)}}))
    assert exc.value.problems == [
        f"train.learning_rate: this output.uri's run finished at step {steps} trained with "
        "train.learning_rate=0.001; this run has train.learning_rate=0.0005, and exporting "
        "again would publish those weights under these settings. Set them back to export it "
        "again, raise train.max_steps to train on, or give this run its own output.uri"]
    assert local_sizes(str(out)) == files


def test_a_stop_asked_on_the_last_step_lets_the_run_finish(ray_local, tiny_model, demo_data, tmp_path,
                                                           caplog, monkeypatch):
    """The driver's SIGTERM hook (what `raylora stop` and a pod's TERM reach) fires while
    the run's only step trains: the last step never stops, so the run finishes and
    exports, and the driver says no stop was needed instead of leaving its promise.
    A SIGTERM as the export starts lets it finish (it interrupted it: a finished run with
    no adapter until a rerun), and progress.json then says the run finished, where
    `raylora status` and `raylora stop` read it."""
    import json
    import logging
    import signal
    import threading
    import time

    from raylora import launch, progress
    from raylora.checkpoint import export

    real_export = export.export_run

    def export_after_a_sigterm(*args, **kwargs):  # a real SIGTERM, as the export starts
        os.kill(os.getpid(), signal.SIGTERM)
        return real_export(*args, **kwargs)

    monkeypatch.setattr(export, "export_run", export_after_a_sigterm)

    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 1},
        "output": {"uri": str(tmp_path / "out")},
    }
    asked = []

    def sigterm_when_fitting():
        deadline = time.monotonic() + 300
        while not launch.SIGTERM_HOOKS and time.monotonic() < deadline:
            time.sleep(0.01)
        asked.append(launch.SIGTERM_HOOKS[-1]())

    t = threading.Thread(target=sigterm_when_fitting, daemon=True)
    t.start()
    sigint = signal.getsignal(signal.SIGINT)
    sigterm = signal.signal(signal.SIGTERM, launch._raise_interrupt)  # as the CLI's
    try:
        with caplog.at_level(logging.WARNING):
            summary = launch.run(validate(tree))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    t.join(timeout=10)
    # The fit ran off the main thread (launch.fit_interruptibly): Ray Train installed no
    # SIGINT handler of its own, so Ctrl-C and the stop timeout still reach this one.
    assert signal.getsignal(signal.SIGINT) is sigint
    assert asked == [True]
    assert "stopped" not in summary and summary["metrics"]["steps"] == 1
    assert os.path.exists(tmp_path / "out" / "adapter" / "pytorch_lora_weights.safetensors")
    said = [r.getMessage() for r in caplog.records if "SIGTERM" in r.getMessage()]
    assert said[0].startswith("SIGTERM: asking the workers to checkpoint and stop at their next step")
    assert said[1:] == [
        "SIGTERM came after the last step had started: the run finished normally, no stop was needed",
        "SIGTERM: the run has trained its last step; writing its adapter first (send it again to interrupt)"]
    assert launch.SIGTERM_HOOKS == []
    row = json.loads((tmp_path / "out" / progress.PROGRESS_FILE).read_text())
    assert row["finished"] is True and (row["step"], row["total"]) == (1, 1)
    assert row["line"] == (f"raylora: the run finished: trained 1 step, loss "
                           f"{summary['metrics']['train_loss_first']:.5f} → "
                           f"{summary['metrics']['train_loss_last']:.5f}; adapter {summary['adapter']}")


def test_a_stop_not_done_within_its_timeout_interrupts_the_driver(ray_local):
    """failure.stop_timeout_s after the driver's SIGTERM, with the run not yet stopped, the
    driver is interrupted (KeyboardInterrupt here; in a search, Tune's own SIGINT handler)
    and ``expired`` says so: a search's summary tells an interrupted search from a stopped one."""
    import signal
    import time

    from raylora import desk, stop

    hooks = []
    # Python's own handler, whatever ran before: Ray Train V2's fit() called on the main
    # thread installs its SIGINT handler (abort the controller) and leaves it there
    # (raylora's runs fit in a helper thread: launch.fit_interruptibly).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    name = desk.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with stop.driver_requests(name, 1.0, hooks) as s:
                t0 = time.monotonic()
                assert hooks[-1]() is True  # the first SIGTERM: a stop is asked for
                while time.monotonic() - t0 < 30:  # as fit()'s ray.get, it sees the interrupt
                    time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, previous)
        desk.stop(name)
    assert 1.0 <= time.monotonic() - t0 < 30
    assert s.signalled and s.expired and hooks == []


def test_sample_command_renders_with_adapter(first_run, tiny_model, tmp_path):
    tree, summary = first_run
    out = tmp_path / "sample.png"
    from raylora.cli import main

    # In this process: `python -m raylora` itself runs in test_faults and test_progress.
    assert main(["sample", "--model", tiny_model, "--adapter", summary["adapter"],
                 "--prompt", "a red circle", "--out", str(out), "--steps", "3"]) == 0
    from PIL import Image

    img = Image.open(out)
    assert img.size == (64, 64) and img.mode == "RGB"


def test_num_epochs_resumed_on_more_workers_ends_at_the_epochs_end(ray_local, tiny_model, demo_data, tmp_path):
    """train.num_epochs: 1 over 32 rows, stopped after 6 steps on 1 worker (12 rows), then
    resumed on 2: 5 steps of 4 rows more, to step 11, where the epoch ends. Planned from
    step 0 at 2 workers it stopped at step 8, 12 of the epoch's rows untrained."""
    from raylora.launch import run

    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 6, "learning_rate": 1e-3},  # a stop at step 6
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": 6},
        "output": {"uri": str(tmp_path / "out")},
    }
    run(validate(tree))
    tree["train"] = {"batch_size": 2, "num_epochs": 1, "learning_rate": 1e-3}
    tree["scaling"] = {"num_workers": 2}
    m = run(validate(tree))["metrics"]
    assert (m["resumed_from_step"], m["steps"], m["images_seen"]) == (6, 11, 32)
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [(r["step"], r["epoch"], r["world_size"]) for r in rows] == (
        [(s, 0, 1) for s in range(1, 7)] + [(s, 0, 2) for s in range(7, 12)])
    # Epoch 0's 32 rows, each once: 6 steps of 1 × 2, 5 of 2 × 2.
    assert sum(r["world_size"] * 2 for r in rows) == 32


def test_a_stopped_num_epochs_run_resumed_on_another_batch_size_ends_at_the_epochs_end(
        ray_local, tiny_model, demo_data, tmp_path):
    """A run stopped (SIGTERM: its stop checkpoint) and resumed with another batch size
    plans its remaining steps from where it stopped. Only a final checkpoint's metrics
    held the loop's position: the rerun planned from step 0 (stopped at step 3 of 12,
    it trained 6 steps and called epoch 0 done with 6 of its rows untrained)."""
    import threading
    import time

    from raylora import launch

    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True, "sharding": "files"},
        "train": {"batch_size": 2, "num_epochs": 1, "learning_rate": 1e-3},
        "checkpoint": {"every_n_steps": 100},
        "output": {"uri": str(tmp_path / "out")},
    }

    def stop_when_fitting():
        deadline = time.monotonic() + 300
        while not launch.SIGTERM_HOOKS and time.monotonic() < deadline:
            time.sleep(0.01)
        launch.SIGTERM_HOOKS[-1]()

    t = threading.Thread(target=stop_when_fitting, daemon=True)
    t.start()
    first = launch.run(validate(tree))
    t.join(timeout=10)
    assert first.get("stopped"), first
    stopped = first["step"]
    assert 1 <= stopped < 16, stopped
    # 32 rows: 2 a step before, 1 a step now; the epoch's other 32 - 2s rows, one a step.
    tree["train"] = {**tree["train"], "batch_size": 1}
    m = launch.run(validate(tree))["metrics"]
    assert (m["resumed_from_step"], m["steps"], m["images_seen"]) == (stopped, 32 - stopped, 32)
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 33 - stopped)) and {r["epoch"] for r in rows} == {0}


def test_a_local_output_that_a_node_does_not_see_is_refused_before_training(ray_local, tmp_path,
                                                                            monkeypatch):
    """A local output.uri on a cluster of several nodes: Ray Train stopped the run at its
    first checkpoint upload ("Check that all nodes in the cluster have read/write access"),
    after checkpoint.every_n_steps steps. Now a marker left there is looked for on every
    node by a task pinned to it, and a node that does not see it refuses the run."""
    import ray

    from raylora import launch
    from raylora.config import ConfigError

    nodes = [n for n in ray.nodes() if n["Alive"]]
    here = f"{nodes[0]['NodeManagerAddress']} (node {nodes[0]['NodeID'][:12]})"
    (tmp_path / "marker").write_text("")
    assert launch.nodes_not_seeing(str(tmp_path / "marker"), nodes) == []
    lost = launch.nodes_not_seeing(str(tmp_path / "absent"), nodes)
    assert lost == [here] and len(nodes) == 1
    out = str(tmp_path / "out")
    problems, warnings = launch.unshared_places({"output.uri": out}, {"output.uri": lost}, 2)
    assert warnings == [] and problems == [
        f"output.uri: {out} is a local folder that 1 of the cluster's 2 nodes do not see "
        f"({here}): every node's workers write their checkpoints there, and Ray Train stops "
        "the run at its first checkpoint upload (checkpoint.every_n_steps steps in, their "
        "training lost) unless all nodes can read and write it. Use object storage (s3://, "
        "gs://) or a folder every node mounts (NFS)"]
    # A compile cache one node keeps: its workers compile cold, the run goes on.
    _, warnings = launch.unshared_places({"train.compile_cache_uri": out},
                                         {"train.compile_cache_uri": lost}, 2)
    assert warnings[0].endswith("do not see (" + here + "): workers there do not find what "
                                "was compiled before and compile cold")
    # The check itself on two nodes (the second one seen by a stub): the marker goes into
    # output.uri's nearest folder, is asked about, and is gone after; one node alone is
    # not asked at all.
    cfg = validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": out}})
    asked = []

    def not_seeing(path, alive):
        asked.append((os.path.dirname(path), os.path.exists(path), len(alive)))
        return lost

    monkeypatch.setattr(launch, "nodes_not_seeing", not_seeing)
    launch.check_shared_places(cfg)
    assert asked == []
    monkeypatch.setattr(ray, "nodes", lambda: nodes + [{**nodes[0], "NodeID": "f" * 56}])
    with pytest.raises(ConfigError) as exc:
        launch.check_shared_places(cfg)
    assert exc.value.problems == problems
    assert asked == [(str(tmp_path), True, 2)] and sorted(os.listdir(tmp_path)) == ["marker"]
    # Prior preservation: the class images' generated folder is asked about too (actors on
    # any node generate into it), here data.class_sources' raylora-generated.
    classes = tmp_path / "dogs"
    classes.mkdir()
    asked.clear()
    with pytest.raises(ConfigError) as exc:
        launch.check_shared_places(validate({
            "model": {"pretrained": "m"}, "output": {"uri": out},
            "data": {"uri": "d", "class_prompt": "a dog", "class_sources": str(classes)}}))
    assert [p.split(":")[0] for p in exc.value.problems] == ["output.uri", "data.class_sources"]
    assert sorted(d for d, _, _ in asked) == sorted([str(tmp_path), str(classes)])
