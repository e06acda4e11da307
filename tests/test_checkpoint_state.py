import json
import os
import shutil
import tempfile

import pytest
import torch

from raylora.checkpoint.state import (
    FILES_FILE,
    IncompleteCheckpoint,
    LoopState,
    load_state,
    save_main_state,
    save_rank_state,
)


def test_state_round_trip(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    loop = LoopState(global_step=3, epoch=1, batches_in_epoch=2, images_seen=24,
                     train_loss_first=0.9, train_loss_last=0.5, wall_seconds=1.5,
                     history=[{"step": i, "loss": 1.0 / i} for i in range(1, 4)])
    lora = {"w": torch.randn(3, 4)}
    torch.manual_seed(123)
    save_rank_state(str(tmp_path), rank=1)
    expected_draw = torch.rand(5)
    save_main_state(str(tmp_path), lora_sd=lora, optimizer_sd=opt.state_dict(),
                    scheduler_sd=sched.state_dict(), scaler_sd=None, loop=loop)

    r = load_state(str(tmp_path), rank=1)
    assert torch.equal(r.lora_sd["w"], lora["w"])
    assert r.loop == loop
    assert r.scaler_sd is None

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 5))
    opt2.load_state_dict(r.optimizer_sd)
    sched2.load_state_dict(r.scheduler_sd)
    for p1, p2 in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(p1["exp_avg"], p2["exp_avg"]) and torch.equal(p1["step"], p2["step"])
    assert sched2.get_last_lr() == sched.get_last_lr()

    torch.manual_seed(999)
    from raylora.checkpoint.state import restore_rng

    restore_rng(r.rng)
    assert torch.equal(torch.rand(5), expected_draw)
    # A rank without its own RNG file gets None rather than another rank's stream.
    assert load_state(str(tmp_path), rank=0).rng is None


def test_unrecorded_checkpoint_folders_are_dropped_before_a_run(tmp_path):
    """A folder Ray wrote but never recorded (stopped between upload and registration) is
    removed; recorded ones, other files, and everything under an unreadable snapshot stay."""
    from raylora.checkpoint.recorded import drop_unrecorded as drop_unrecorded_checkpoints
    from raylora.storage import Storage

    run = tmp_path / "train"
    for name in ("checkpoint_a", "checkpoint_b", "checkpoint_orphan", "other"):
        (run / name).mkdir(parents=True)
        (run / name / "lora.safetensors").write_bytes(b"x")
    snap = run / "checkpoint_manager_snapshot.json"
    snap.write_text(json.dumps({"checkpoint_results": [
        {"checkpoint_dir_name": "checkpoint_a", "metrics": {"step": 4}},
        {"checkpoint_dir_name": "checkpoint_b", "metrics": {"step": 8}}]}))
    assert drop_unrecorded_checkpoints(Storage(), str(tmp_path / "fresh")) == []
    assert drop_unrecorded_checkpoints(Storage(), str(run)) == [str(run / "checkpoint_orphan")]
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint_a", "checkpoint_b", "checkpoint_manager_snapshot.json", "other"]

    (run / "checkpoint_orphan").mkdir()
    snap.write_text(json.dumps({"format": "changed"}))
    assert drop_unrecorded_checkpoints(Storage(), str(run)) == []
    assert (run / "checkpoint_orphan").is_dir()
    # no snapshot yet: a run stopped during its first checkpoint; its folder went on living
    first = tmp_path / "first"
    (first / "checkpoint_2026").mkdir(parents=True)
    (first / "metrics.jsonl").write_text("")
    assert drop_unrecorded_checkpoints(Storage(), str(first)) == [str(first / "checkpoint_2026")]
    assert [p.name for p in first.iterdir()] == ["metrics.jsonl"]


def _two_rank_checkpoint(directory) -> dict[str, int]:
    """What two ranks of an EMA run leave in one merged checkpoint folder (rank 1's files
    in it as Ray merges them); returns its files and sizes."""
    from raylora.storage import local_sizes

    os.makedirs(directory)
    save_rank_state(str(directory), rank=0)
    os.makedirs(directory / "fsdp")
    (directory / "fsdp" / "__0_0.distcp").write_bytes(b"rank 0 shard")
    loop = LoopState(global_step=4, world_size=2, history=[{"step": i, "loss": 0.5} for i in (1, 2, 3, 4)])
    save_main_state(str(directory), lora_sd={"w": torch.ones(3, 4)}, optimizer_sd={}, scheduler_sd={},
                    scaler_sd=None, loop=loop, ema_sd={"w": torch.ones(3, 4)},
                    other_ranks_files=["fsdp/__0_0.distcp", "fsdp/__1_0.distcp"])
    # Rank 1's directory, merged in by Ray after rank 0 wrote its record.
    save_rank_state(str(directory), rank=1)
    (directory / "fsdp" / "__1_0.distcp").write_bytes(b"rank 1 shard")
    return local_sizes(str(directory))


def test_a_rerun_with_the_other_expert_is_refused_before_it_resumes(tmp_path):
    """The checkpoint records which Wan 2.2 expert its LoRA is for; a rerun at the same
    output.uri with another ``model.expert`` (the two share an architecture, so the LoRA
    would load) is refused by the driver's check, naming the key and the checkpoint.
    Checkpoints from before the record resume as they did. (The record is written here as
    raylora did before it kept more: a bare "expert".)"""
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage

    run = tmp_path / "train"
    ckpt = run / "checkpoint_a"
    ckpt.mkdir(parents=True)
    loop = LoopState(global_step=2, world_size=1)
    save_rank_state(str(ckpt), rank=0)
    save_main_state(str(ckpt), lora_sd={"w": torch.ones(2)}, optimizer_sd={}, scheduler_sd={},
                    scaler_sd=None, loop=loop, trained={"expert": "low_noise"})
    assert json.loads((ckpt / FILES_FILE).read_text())["trained"] == {"expert": "low_noise"}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_a"}}))
    assert check_latest(Storage(), str(run), trained={"model.expert": "low_noise"}) == str(ckpt)
    for other in ("high_noise", None):
        with pytest.raises(ValueError) as exc:
            check_latest(Storage(), str(run), trained={"model.expert": other})
        assert str(exc.value) == (
            f"model.expert: this run has model.expert={other or 'null'}, but the checkpoint this "
            f"output.uri resumes from ({ckpt}) trained model.expert=low_noise; set it back to "
            "resume that run, or give this one its own output.uri")
    record = json.loads((ckpt / FILES_FILE).read_text())
    del record["trained"]
    (ckpt / FILES_FILE).write_text(json.dumps(record))
    assert check_latest(Storage(), str(run), trained={"model.expert": "high_noise"}) == str(ckpt)


def _latest_checkpoint_of(tmp_path, trained: dict):
    """(run folder, checkpoint): a run whose latest checkpoint (step 2, one rank)
    recorded ``trained`` (state.trained_settings), as Ray's snapshot names it."""
    run = tmp_path / "train"
    ckpt = run / "checkpoint_a"
    ckpt.mkdir(parents=True)
    save_rank_state(str(ckpt), rank=0)
    save_main_state(str(ckpt), lora_sd={"w": torch.ones(2)}, optimizer_sd={}, scheduler_sd={},
                    scaler_sd=None, loop=LoopState(global_step=2, world_size=1), trained=trained)
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_a"}}))
    return run, ckpt


def test_a_rerun_with_other_lora_settings_is_refused_naming_each(tmp_path, caplog):
    """trained_settings: what a checkpoint's LoRA state is for, by config key; check_latest
    names every key a rerun changed. Settings that leave the state loadable as it was
    (learning rate, steps, dropout) are not among them; a key a checkpoint did not record
    (older raylora: a bare "expert") is compared under its config name or not at all.
    Another model.pretrained (the model moved, or another base) resumes with a warning."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.checkpoint.state import trained_settings
    from raylora.config import validate
    from raylora.storage import Storage

    def cfg(lora=None, train=None):
        return validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                         "lora": {"rank": 16, **(lora or {})}, "train": train or {}})

    was = trained_settings(cfg({"target_modules": ["to_q", "to_v"]}), "flux")
    assert was == {"model.family": "flux", "model.expert": None, "lora.variant": "lora", "lora.rank": 16,
                   "lora.alpha": 16, "lora.target_modules": ["to_q", "to_v"],
                   "lora.train_text_encoder": False, "lora.init_from": None, "model.pretrained": "m",
                   "model.revision": None, "train.optimizer": "adamw", "train.ema_decay": None,
                   "train.max_steps": None}
    # train.max_steps: compared with the checkpoint's step, not the record (see below)
    assert trained_settings(cfg({"target_modules": ["to_q", "to_v"], "dropout": 0.1, "alpha": 16.0},
                                {"learning_rate": 1e-3, "max_steps": 9}), "flux") == {
        **was, "train.max_steps": 9}
    assert trained_settings(cfg({"init_from": "s3://b/a"}), "flux")["lora.init_from"] == "s3://b/a"
    lokr = trained_settings(cfg({"variant": "lokr", "factor": 4}), "sd")
    assert (lokr["lora.factor"], lokr["lora.decompose_both"]) == (4, False)
    run, ckpt = _latest_checkpoint_of(tmp_path, was)
    assert check_latest(Storage(), str(run), trained=was) == str(ckpt)
    assert "model.pretrained" not in caplog.text
    with caplog.at_level("WARNING", logger="raylora"):
        assert check_latest(Storage(), str(run), trained={**was, "model.pretrained": "s3://b/m"}) == str(ckpt)
    assert ("model.pretrained: this run has s3://b/m, but the checkpoint this output.uri resumes "
            f"from ({ckpt}) was trained with m; resuming") in caplog.text
    now = trained_settings(cfg({"target_modules": ["to_q"], "rank": 32}), "sd")
    with pytest.raises(ValueError) as exc:
        check_latest(Storage(), str(run), trained=now)
    assert str(exc.value) == (
        "model.family, lora.rank, lora.alpha, lora.target_modules: this run has model.family=sd, "
        'lora.rank=32, lora.alpha=32, lora.target_modules=["to_q"], but the checkpoint this '
        f"output.uri resumes from ({ckpt}) trained model.family=flux, lora.rank=16, lora.alpha=16, "
        'lora.target_modules=["to_q", "to_v"]; set them back to resume that run, or give this '
        "one its own output.uri")
    # a record from before raylora kept more than the expert
    record = json.loads((ckpt / FILES_FILE).read_text())
    record["trained"] = {"expert": None}
    (ckpt / FILES_FILE).write_text(json.dumps(record))
    assert check_latest(Storage(), str(run), trained=now) == str(ckpt)
    with pytest.raises(ValueError, match="^model.expert: this run has model.expert=low_noise, but"):
        check_latest(Storage(), str(run), trained={**now, "model.expert": "low_noise"})


def test_a_checkpoint_records_its_files_and_a_lost_one_is_named(tmp_path):
    """``checkpoint_files.json`` holds rank 0's files with their sizes and the other ranks'
    by name; a file missing or short after that is named by ``load_state`` (workers) and
    ``check_latest`` (driver, before a cluster starts), never read as a setting."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage, local_sizes

    run = tmp_path / "train"
    ckpt = run / "checkpoint_b"
    files = _two_rank_checkpoint(ckpt)
    record = json.loads((ckpt / FILES_FILE).read_text())
    assert set(record["rank0"]) == {"rng_rank0.pt", "fsdp/__0_0.distcp", "lora.safetensors",
                                    "ema.safetensors", "trainer_state.pt", "history.jsonl"}
    assert all(record["rank0"][name] == files[name] for name in record["rank0"])
    # Rank 0's shard is listed once, with its size; rank 1's files by name.
    assert record["other_ranks"] == ["fsdp/__1_0.distcp", "rng_rank1.pt"]

    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "checkpoint_results": [{"checkpoint_dir_name": "checkpoint_b"}],
        "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_b"}}))
    assert check_latest(Storage(), str(run)) == str(ckpt)
    assert check_latest(Storage(), str(tmp_path / "fresh")) is None
    r = load_state(str(ckpt), rank=1)
    assert r.loop.global_step == 4 and len(r.loop.history) == 4 and r.ema_sd is not None and r.rng is not None

    lora = (ckpt / "lora.safetensors").read_bytes()
    (ckpt / "lora.safetensors").write_bytes(lora[:100])
    (ckpt / "history.jsonl").unlink()
    (ckpt / "rng_rank1.pt").unlink()
    (ckpt / "ema.safetensors").unlink()
    want = ["ema.safetensors (missing)", "history.jsonl (missing)",
            f"lora.safetensors (100 of {len(lora)} bytes)", "rng_rank1.pt (missing)"]
    with pytest.raises(IncompleteCheckpoint) as exc:
        load_state(str(ckpt), rank=0, where="s3://b/out/train/checkpoint_b")
    assert exc.value.missing == want
    assert str(exc.value).startswith("checkpoint s3://b/out/train/checkpoint_b is incomplete: "
                                     "ema.safetensors (missing), history.jsonl (missing), lora.")
    with pytest.raises(IncompleteCheckpoint) as exc:
        check_latest(Storage(), str(run))
    assert exc.value.missing == want and str(ckpt) in str(exc.value)
    # Nothing was changed by looking: the remaining files are as they were.
    left = local_sizes(str(ckpt))
    assert left == {k: (100 if k == "lora.safetensors" else v) for k, v in files.items()
                    if k not in ("history.jsonl", "rng_rank1.pt", "ema.safetensors")}

    # A checkpoint written before the record existed resumes as it did: no history is none yet.
    (ckpt / FILES_FILE).unlink()
    (ckpt / "lora.safetensors").write_bytes(lora)
    assert load_state(str(ckpt), rank=0).loop.history == []
    assert check_latest(Storage(), str(run)) == str(ckpt)
    # The latest checkpoint's folder gone altogether: named too.
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    with pytest.raises(IncompleteCheckpoint, match="every file"):
        check_latest(Storage(), str(run))


def test_each_rank_reads_a_remote_checkpoint_from_its_own_download(tmp_path):
    """Two ranks on one node restore the same remote checkpoint, the second after the
    first's download: the second never rewrites the files the first is reading (Ray's shared
    ``as_directory`` folder does, and a CI rank read a torn ``trainer_state``)."""
    import pyarrow.fs
    from ray.train import Checkpoint

    from raylora.worker import rank_copy

    src = tmp_path / "bucket" / "checkpoint_000001"
    src.mkdir(parents=True)
    lora = {"w": torch.randn(3, 4)}
    opt = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    save_rank_state(str(src), rank=0)
    save_rank_state(str(src), rank=1)
    save_main_state(str(src), lora_sd=lora, optimizer_sd=opt.state_dict(), scheduler_sd={},
                    scaler_sd=None, loop=LoopState(global_step=7))
    # Not a LocalFileSystem, so Ray treats it as remote storage (as it does s3 and gs).
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), pyarrow.fs.LocalFileSystem())
    checkpoint = Checkpoint("checkpoint_000001", filesystem=remote)

    with rank_copy(checkpoint, 0) as first:
        files = sorted(os.listdir(first))
        before = {f: os.stat(os.path.join(first, f)).st_mtime_ns for f in files}
        with rank_copy(checkpoint, 1) as second:
            assert second != first
            assert load_state(second, rank=1).loop.global_step == 7
        after = {f: os.stat(os.path.join(first, f)).st_mtime_ns for f in files}
        assert after == before
        assert torch.equal(load_state(first, rank=0).lora_sd["w"], lora["w"])
    assert not os.path.exists(first) and not os.path.exists(second)
    # A checkpoint on local disk is read where it is, not copied.
    with rank_copy(Checkpoint(str(src)), 0) as d:
        assert d == str(src)
    assert src.exists()


def test_fsdp_shards_of_a_remote_checkpoint_outlive_its_download_until_the_model_is_built(
        tmp_path, monkeypatch):
    """FSDP shards are read after the model is built, when a remote checkpoint's download is
    gone: ``restore_rank`` keeps them in a scratch folder the worker removes once built. A
    local checkpoint's are read in place, with nothing copied (before: a copy each resume,
    never removed)."""
    import pyarrow.fs
    from ray.train import Checkpoint

    from raylora.worker import restore_rank

    # Its own temp dir: the Ray lane's workers download checkpoints into the shared one.
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    src = tmp_path / "bucket" / "checkpoint_000004"
    _two_rank_checkpoint(src)
    (src / "fsdp" / ".metadata").write_bytes(b"dcp metadata")
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), pyarrow.fs.LocalFileSystem())

    state, scratch = restore_rank(Checkpoint("checkpoint_000004", filesystem=remote), rank=1)
    assert state.loop.global_step == 4
    assert state.sharded_dir == os.path.join(scratch, "fsdp")
    assert sorted(os.listdir(state.sharded_dir)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with open(os.path.join(state.sharded_dir, "__1_0.distcp"), "rb") as f:
        assert f.read() == b"rank 1 shard"
    # The rank's download itself is gone: only the scratch folder is left to remove.
    assert os.listdir(scratch_root) == [os.path.basename(scratch)]
    shutil.rmtree(scratch)

    state, scratch = restore_rank(Checkpoint(str(src)), rank=0)
    assert scratch is None and state.sharded_dir == str(src / "fsdp")
    # Without a DCP checkpoint (no .metadata) there is nothing to keep, remote or not.
    (src / "fsdp" / ".metadata").unlink()
    state, scratch = restore_rank(Checkpoint("checkpoint_000004", filesystem=remote), rank=0)
    assert scratch is None and state.sharded_dir is None
    assert os.listdir(scratch_root) == []  # its download removed as well


def _recorded_run(tmp_path, trained: dict, ema: bool = False, step: int | None = 4):
    """A run folder whose latest checkpoint (Ray's record, at ``step``) recorded ``trained``."""
    run = tmp_path / "train"
    ckpt = run / "checkpoint_a"
    ckpt.mkdir(parents=True)
    save_rank_state(str(ckpt), rank=0)
    save_main_state(str(ckpt), lora_sd={"w": torch.ones(2)}, optimizer_sd={}, scheduler_sd={},
                    scaler_sd=None, loop=LoopState(global_step=step or 0, world_size=1),
                    ema_sd={"w": torch.ones(2)} if ema else None, trained=trained)
    latest = {"checkpoint_dir_name": "checkpoint_a"} | ({"metrics": {"step": step}} if step else {})
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({"latest_checkpoint_result": latest}))
    return run, ckpt


def _settings(train=None, lora=None):
    from raylora.checkpoint.state import trained_settings
    from raylora.config import validate

    return trained_settings(validate({"model": {"pretrained": "m"}, "data": {"uri": "d"},
                                      "output": {"uri": "o"}, "lora": lora or {},
                                      "train": train or {}}), "sd")


def test_a_rerun_with_another_optimizer_is_refused_before_ray(tmp_path):
    """train.optimizer (and Prodigy's slice_p and d0, which shape its state) are in the
    checkpoint's record: another one is refused on the driver, naming the key; before, it
    failed on every worker at the first step (a KeyError inside the library) or resumed
    Prodigy's moments as AdamW's. Other optimizer settings may change."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage

    prodigy = {"optimizer": "prodigy", "learning_rate": 1.0}
    run, ckpt = _recorded_run(tmp_path, _settings(prodigy))
    assert json.loads((ckpt / FILES_FILE).read_text())["trained"]["train.prodigy.slice_p"] == 1
    assert check_latest(Storage(), str(run), trained=_settings(
        {**prodigy, "prodigy": {"use_bias_correction": True, "d_coef": 2.0}})) == str(ckpt)
    with pytest.raises(ValueError) as exc:
        check_latest(Storage(), str(run), trained=_settings({"optimizer": "adamw"}))
    assert str(exc.value) == (
        "train.optimizer: this run has train.optimizer=adamw, but the checkpoint this output.uri "
        f"resumes from ({ckpt}) trained train.optimizer=prodigy; set it back to resume that run, "
        "or give this one its own output.uri")
    with pytest.raises(ValueError, match=r"^train.prodigy.slice_p: this run has train.prodigy.slice_p=4, "):
        check_latest(Storage(), str(run), trained=_settings({**prodigy, "prodigy": {"slice_p": 4}}))


def test_ema_switched_on_or_off_is_refused_before_ray(tmp_path):
    """EMA on or off is read from the checkpoint's files (ema.safetensors), so checkpoints
    from before the record are checked too. Before: EMA switched on failed on every worker
    and Ray Train retried it failure.max_failures times; switched off, the resumed run
    published its raw weights where it had published the EMA. Another decay resumes."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage

    run, ckpt = _recorded_run(tmp_path / "off", _settings())
    with pytest.raises(ValueError) as exc:
        check_latest(Storage(), str(run), trained=_settings({"ema_decay": 0.99}))
    assert str(exc.value) == (
        "train.ema_decay: this run has train.ema_decay=0.99, but the checkpoint this output.uri "
        f"resumes from ({ckpt}) was written with EMA off (no ema.safetensors); unset it to resume "
        "that run, or give this one its own output.uri")
    run, ckpt = _recorded_run(tmp_path / "on", _settings({"ema_decay": 0.99}), ema=True)
    assert check_latest(Storage(), str(run), trained=_settings({"ema_decay": 0.999})) == str(ckpt)
    (ckpt / FILES_FILE).unlink()  # written before raylora recorded anything: the files say
    with pytest.raises(ValueError) as exc:
        check_latest(Storage(), str(run), trained=_settings())
    assert str(exc.value) == (
        "train.ema_decay: this run has train.ema_decay=null, but the checkpoint this output.uri "
        f"resumes from ({ckpt}) was written with EMA on (ema.safetensors; its adapter is the EMA); "
        "set it to resume that run, or give this one its own output.uri")


def test_max_steps_below_the_checkpoints_step_is_refused_before_ray(tmp_path):
    """Before: the run ended at once and exported the step-4 adapter with raylora.json
    saying max_steps 2. The step is Ray's record of the checkpoint; the same count (a
    finished run's re-export) and more resume."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage

    run, ckpt = _recorded_run(tmp_path, _settings({"max_steps": 4}), step=4)
    for steps in (4, 10):
        assert check_latest(Storage(), str(run), trained=_settings({"max_steps": steps})) == str(ckpt)
    with pytest.raises(ValueError) as exc:
        check_latest(Storage(), str(run), trained=_settings({"max_steps": 2, "ema_decay": 0.9}))
    assert str(exc.value).split("\n") == [
        "train.ema_decay: this run has train.ema_decay=0.9, but the checkpoint this output.uri "
        f"resumes from ({ckpt}) was written with EMA off (no ema.safetensors); unset it to resume "
        "that run, or give this one its own output.uri",
        "train.max_steps: this run has train.max_steps=2, but the checkpoint this output.uri "
        f"resumes from ({ckpt}) is at step 4; raise it to continue that run (each checkpoint's "
        "adapter/ folder holds that step's adapter), or give this one its own output.uri"]


def test_target_modules_in_another_order_are_the_same_lora(tmp_path):
    from raylora.checkpoint.recorded import check_latest
    from raylora.storage import Storage

    lora = {"target_modules": ["to_q", "to_v"], "train_text_encoder": True,
            "text_encoder_target_modules": ["q_proj", "v_proj"]}
    run, ckpt = _recorded_run(tmp_path, _settings(lora=lora))
    swapped = {**lora, "target_modules": ["to_v", "to_q"],
               "text_encoder_target_modules": ["v_proj", "q_proj"]}
    assert check_latest(Storage(), str(run), trained=_settings(lora=swapped)) == str(ckpt)
    with pytest.raises(ValueError, match=r"^lora.target_modules: this run has lora.target_modules=\["):
        check_latest(Storage(), str(run),
                     trained=_settings(lora={**lora, "target_modules": ["to_q", "to_k"]}))


def test_refusals_while_restoring_are_not_retried_by_ray_train():
    """A refusal a worker raises while restoring repeats on every restart from the same
    checkpoint: it carries restart_repeats, and raylora.entry.EndOnRepeated ends the run
    at it (before: Ray Train retried it failure.max_failures times, without end at -1)."""
    import ray.train
    from types import SimpleNamespace

    from raylora.checkpoint.state import ResumeRefused
    from raylora.config import validate
    from raylora.entry import EndOnRepeated
    from raylora.train.setup import _ema, _restore

    def cfg(**sections):
        return validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                         **sections})

    def refusal(call) -> ResumeRefused:
        with pytest.raises(ResumeRefused) as exc:
            call()
        with pytest.raises(ray.train.ControllerError):
            EndOnRepeated().after_exception(None, {0: exc.value})
        return exc.value

    ckpt = SimpleNamespace(ema_sd=None, sharded_dir=None, loop=LoopState(global_step=6, world_size=2))
    assert str(refusal(lambda: _ema(cfg(train={"ema_decay": 0.99}), [], ckpt, ckpt.loop))).startswith(
        "train.ema_decay: the checkpoint to resume from has no EMA state")
    assert str(refusal(lambda: _restore(cfg(scaling={"strategy": "fsdp"}), None, ckpt, None, None, 0,
                                        None, 10))).startswith("scaling.strategy: ")
    four = cfg(train={"max_steps": 4})
    assert str(refusal(lambda: _restore(four, None, ckpt, None, None, 0, None, 4))) == (
        "train.max_steps: this run trains 4 steps, but the checkpoint to resume from is at step 6; "
        "raise it to continue that run, or give this one its own output.uri")
    assert str(refusal(lambda: _restore(cfg(), None, ckpt, None, None, 0, None, 4))).startswith(
        "train.num_epochs: this run trains 4 steps")
    # an elastic run's data position that another size cannot continue exactly
    assert str(refusal(lambda: LoopState(batches_in_epoch=3, world_size=2, batch_size=1).resize(4))
               ).startswith("scaling.num_workers: the checkpoint's data position")


def test_a_rerun_writing_out_the_default_target_modules_is_the_same_lora(tmp_path):
    """lora.target_modules: null trained the family's default list; a rerun that writes
    that list out (in any order) resumes it, where it was refused as another LoRA."""
    from raylora.checkpoint.recorded import check_latest
    from raylora.checkpoint.state import trained_settings
    from raylora.config import validate
    from raylora.storage import Storage

    def cfg(targets):
        return validate({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                         "lora": {"target_modules": targets}})

    was = trained_settings(cfg(None), "sd")
    run, ckpt = _latest_checkpoint_of(tmp_path, was)
    written = trained_settings(cfg(["to_q", "to_k", "to_v", "to_out.0"]), "sd")
    assert check_latest(Storage(), str(run), trained=written) == str(ckpt)
    with pytest.raises(ValueError, match=r'^lora.target_modules: this run has lora.target_modules='
                                         r'\["to_q"\], but the checkpoint .* trained '
                                         r'lora.target_modules=null;'):
        check_latest(Storage(), str(run), trained=trained_settings(cfg(["to_q"]), "sd"))


def _ray_snapshot(run, steps: list[int], latest: int | None = None) -> dict:
    """A checkpoint folder per step under ``run`` and Ray Train's record of them as Ray
    2.60 writes it (keys and layout of a real run's checkpoint_manager_snapshot.json)."""
    import ray

    results = []
    for step in steps:
        name = f"checkpoint_2026-12-06_19-04-{step:02d}.000000"
        (run / name / "adapter").mkdir(parents=True)
        (run / name / "adapter" / "pytorch_lora_weights.safetensors").write_bytes(b"w")
        results.append({"version": 0, "checkpoint_dir_name": name,
                        "metrics": {"step": step, "epoch": 0, "train_loss": 1.0, "world_size": 1}})
    snap = {"ray_version": ray.__version__, "checkpoint_results": results,
            "checkpoint_report_indices": [i + 1 for i in range(len(steps))],
            "latest_checkpoint_result": results[steps.index(latest or steps[-1])],
            "pending_training_results": [], "pending_validation_specs": [],
            "current_report_index": len(steps) + 1, "validated_checkpoint_dir_names": [],
            "timed_out_validation_checkpoint_dir_names": [],
            "failed_validation_checkpoint_dir_names": []}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snap))
    return snap


def test_kept_checkpoints_deleted_by_hand_are_forgotten_and_ray_resumes_the_latest(tmp_path, caplog):
    """An older kept checkpoint folder deleted to free space: Ray refused to start on its
    record ("a checkpoint that does not exist anymore ... corrupted run directory", exit 1,
    inside Ray). Before a run starts it is forgotten from the record, with a warning naming
    it, and Ray's own checkpoint manager then loads the record and resumes the latest. A
    gone latest checkpoint is left for check_latest to refuse."""
    import logging

    from ray.train import CheckpointConfig
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext

    from raylora.checkpoint.recorded import check_latest, drop_unrecorded
    from raylora.storage import Storage

    def ray_loads(root):
        """Ray Train's controller reading the record of ``{root}/train`` (no Ray started)."""
        return CheckpointManager(checkpoint_config=CheckpointConfig(num_to_keep=3),
                                 storage_context=StorageContext(str(root), "train", read_only=True))

    run = tmp_path / "out" / "train"
    snap = _ray_snapshot(run, [2, 4, 6])
    names = [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]]
    shutil.rmtree(run / names[1])  # step 4's: neither the oldest nor the latest
    with pytest.raises(CheckpointManagerInitializationError, match="does not exist anymore"):
        ray_loads(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="raylora"):
        assert drop_unrecorded(Storage(), str(run)) == []
    assert [r.getMessage() for r in caplog.records if "forgot" in r.getMessage()] == [
        f"forgot 1 kept checkpoint(s) whose folders were deleted (Ray would refuse to start on a "
        f"record naming them; the run resumes from the latest, {run / names[2]}): {run / names[1]}"]
    record = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    assert [r["metrics"]["step"] for r in record["checkpoint_results"]] == [2, 6]
    assert record["checkpoint_report_indices"] == [1, 3]  # entry for entry
    assert record["latest_checkpoint_result"] == snap["latest_checkpoint_result"]
    assert {k: v for k, v in record.items() if k not in ("checkpoint_results", "checkpoint_report_indices")} == {
        k: v for k, v in snap.items() if k not in ("checkpoint_results", "checkpoint_report_indices")}
    manager = ray_loads(tmp_path / "out")
    assert manager.latest_checkpoint_result.checkpoint.path == str(run / names[2])
    assert [r.metrics["step"] for r in manager._checkpoint_results] == [2, 6]
    assert check_latest(Storage(), str(run)) == str(run / names[2])
    assert sorted(p.name for p in run.iterdir()) == sorted([names[0], names[2], "checkpoint_manager_snapshot.json"])

    # The latest one gone too: the record is left as it is, and the driver refuses the run.
    shutil.rmtree(run / names[2])
    before = (run / "checkpoint_manager_snapshot.json").read_bytes()
    assert drop_unrecorded(Storage(), str(run)) == []
    assert (run / "checkpoint_manager_snapshot.json").read_bytes() == before
    with pytest.raises(IncompleteCheckpoint, match="every file"):
        check_latest(Storage(), str(run))
    # A record that does not read as Ray's (a pending result naming the gone folder, which
    # Ray would look up): left to Ray.
    other = tmp_path / "pending" / "train"
    snap = _ray_snapshot(other, [2, 4])
    snap["pending_training_results"] = [snap["checkpoint_results"][0]]
    (other / "checkpoint_manager_snapshot.json").write_text(json.dumps(snap))
    shutil.rmtree(other / snap["checkpoint_results"][0]["checkpoint_dir_name"])
    assert drop_unrecorded(Storage(), str(other)) == []
    assert json.loads((other / "checkpoint_manager_snapshot.json").read_text()) == snap


def _foreign_lease(where, age_s: float, token: str = "theirs") -> dict:
    """The lease another process's run (host other-host, pid 4242) renewed ``age_s`` ago."""
    import time

    now = time.time()
    lease = {"host": "other-host", "pid": 4242, "started": now - 3600, "renewed": now - age_s,
             "token": token}
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(lease))
    return lease


def test_a_live_runs_lease_refuses_a_second_run_a_stale_one_is_taken_over(tmp_path, monkeypatch, caplog):
    """A second run on an output.uri deleted the first's checkpoints in flight and both
    died. The lease: taken and renewed by the run that trains there, refused to another
    process while renewed within LEASE_STALE_S (naming output.uri, the host, the pid and
    how long ago), taken over with a warning once stale (a killed driver), removed when the
    run ends, an error too, but never another run's."""
    import logging
    import os
    import socket
    import time
    from types import SimpleNamespace

    from raylora import launch
    from raylora.checkpoint import recorded

    # A CLI run stops itself (SIGTERM) on losing its lease; this process is pytest's, and an
    # earlier test's raylora.cli.main may have set the CLI's flag.
    monkeypatch.setattr(launch, "INTERRUPT_ON_SIGTERM", False)
    from raylora.config import ConfigError
    from raylora.storage import Storage

    monkeypatch.setattr(recorded, "LEASE_SETTLE_S", 0)
    monkeypatch.setattr(recorded, "LEASE_RENEW_S", 0.05)
    store, out = Storage(), str(tmp_path / "out")
    lease = tmp_path / "out" / "lease.json"

    assert recorded.check_lease(store, out) is None
    with recorded.held_lease(store, out) as mine:
        held = json.loads(lease.read_text())
        assert (held["host"], held["pid"], held["token"]) == (socket.gethostname(), os.getpid(), mine["token"])
        assert recorded.check_lease(store, out)["token"] == mine["token"]  # this process's own
        # Another process with this host name and pid (a container on the host network): another run.
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "lease.json").write_text(json.dumps({**held, "process": "another"}))
        with pytest.raises(ConfigError, match=f"host {socket.gethostname()}, pid {os.getpid()}, started"):
            recorded.check_lease(store, str(tmp_path / "other"))
        deadline = time.time() + 10
        while json.loads(lease.read_text())["renewed"] == held["renewed"] and time.time() < deadline:
            time.sleep(0.02)
        assert json.loads(lease.read_text())["renewed"] > held["renewed"] == held["started"]
    assert not lease.exists()
    with pytest.raises(RuntimeError, match="the run failed"), recorded.held_lease(store, out):
        assert lease.exists()
        raise RuntimeError("the run failed")
    assert not lease.exists()

    # Another process's run, renewed 30 s ago: refused, the lease left as it was.
    theirs = _foreign_lease(lease, 30)
    for attempt in (lambda: recorded.check_lease(store, out),
                    lambda: recorded.held_lease(store, out).__enter__()):
        with pytest.raises(ConfigError) as exc:
            attempt()
        (problem,) = exc.value.problems
        assert problem.startswith(
            f"output.uri: {out} is in use by another run (host other-host, pid 4242, started 60 min "
            f"ago; its lease {lease} was renewed 30 s ago): a second run there deletes the first's "
            "checkpoints in flight and both fail.")
        assert problem.endswith(f"If that run was killed, this one can start once the lease is "
                                f"180 s old (in 150 s), or delete {lease}")
        assert json.loads(lease.read_text()) == theirs

    # Not renewed for LEASE_STALE_S: a killed driver's, taken over with a warning.
    _foreign_lease(lease, recorded.LEASE_STALE_S + 5)
    with caplog.at_level(logging.WARNING, logger="raylora"), recorded.held_lease(store, out) as mine:
        assert json.loads(lease.read_text())["token"] == mine["token"]
        # ... and should another run take it over in turn (this one's renewals stalled),
        # this run's end leaves that one's lease alone
        theirs = _foreign_lease(lease, 0, token="later")
        deadline = time.time() + 10
        while "took over" not in caplog.text and time.time() < deadline:
            time.sleep(0.02)
    assert f"{lease}: taking over the lease of a run that stopped renewing it 185 s ago (host " \
           "other-host, pid 4242, started 60 min ago): it was killed or lost" in caplog.text
    assert f"{lease}: another run took over this run's lease (host other-host, pid 4242" in caplog.text
    assert "two runs now write to this output.uri; stopping this one" in caplog.text  # (a CLI run: SIGTERM)
    assert json.loads(lease.read_text()) == theirs
    # An unreadable lease is no run's: taken over.
    lease.write_text("{half")
    with recorded.held_lease(store, out) as mine:
        assert json.loads(lease.read_text())["token"] == mine["token"]
    assert not lease.exists()

    # Two runs started together both found none and both wrote theirs: the one whose write
    # came first reads the other's back and is refused; the other's lease stays.
    monkeypatch.setattr(recorded, "time", SimpleNamespace(
        time=time.time, sleep=lambda s: _foreign_lease(lease, 0, token="raced")))
    with pytest.raises(ConfigError, match="is in use by another run"), recorded.held_lease(store, out):
        pass
    assert json.loads(lease.read_text())["token"] == "raced"


def test_the_lease_of_a_killed_run_on_this_machine_is_taken_over_at_once(tmp_path, caplog):
    """A driver killed with SIGKILL (the OOM killer, kill -9) left its lease, and a rerun
    on the same machine was refused for LEASE_STALE_S (3 min). Its process is gone and this
    machine can see that: the rerun takes the lease over at once. A live one is refused;
    so is a lease from another host or pid namespace, whose pid means nothing here."""
    import logging
    import signal
    import subprocess
    import sys
    import time

    from raylora.checkpoint import recorded
    from raylora.config import ConfigError
    from raylora.storage import Storage

    store, out = Storage(), str(tmp_path / "out")
    lease = tmp_path / "out" / "lease.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from raylora.checkpoint import recorded\nfrom raylora.storage import Storage\n"
         f"lease = recorded.held_lease(Storage(), {out!r})\nlease.__enter__()\n"
         "print('held', flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = json.loads(lease.read_text())
        assert held["pid"] == holder.pid and held["pid_start"] and held["pid_ns"].startswith("pid:")
        with pytest.raises(ConfigError, match=f"in use by another run .host [^,]+, pid {holder.pid}"):
            recorded.check_lease(store, out)  # alive
        holder.send_signal(signal.SIGKILL)
        deadline = time.time() + 10  # killed, not reaped yet: a zombie is no run
        while recorded._pid_start(holder.pid) is not None and time.time() < deadline:
            time.sleep(0.02)
        assert recorded.check_lease(store, out)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert recorded.check_lease(store, out)["pid"] == holder.pid  # reaped too
    # The same pid, but another process now (a pid reused): that run is gone as well.
    lease.write_text(json.dumps({**held, "pid": os.getpid()}))
    assert recorded.check_lease(store, out)["pid"] == os.getpid()
    # Elsewhere, the pid says nothing: refused until stale, as before.
    for other in ({"host": "other-host"}, {"pid_ns": "pid:[1]"}, {"boot": "another-boot"},
                  {"pid_start": None}):
        lease.write_text(json.dumps({**held, **other}))
        with pytest.raises(ConfigError, match="is in use by another run"):
            recorded.check_lease(store, out)
    lease.write_text(json.dumps(held))
    with caplog.at_level(logging.WARNING, logger="raylora"), recorded.held_lease(store, out) as mine:
        assert json.loads(lease.read_text())["token"] == mine["token"]
    assert f"{lease}: taking over the lease of a run whose process is gone (host " in caplog.text
    assert f"pid {holder.pid}, started " in caplog.text and "): it was killed" in caplog.text
    assert not lease.exists()


def test_the_lease_on_object_storage(moto_endpoint, monkeypatch):
    """The lease on S3 (no atomic create: written, then read back): taken, refused to
    another process's live run, released."""
    import time

    import boto3

    from raylora.checkpoint import recorded
    from raylora.config import ConfigError
    from raylora.storage import Storage

    monkeypatch.setattr(recorded, "LEASE_SETTLE_S", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00003")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rAyLoRa/FakeSecret+0003/doNotLeak")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="raylora-lease")
    store, out = Storage(endpoint_url=moto_endpoint), "s3://raylora-lease/runs/a"

    with recorded.held_lease(store, out) as mine:
        held = json.loads(s3.get_object(Bucket="raylora-lease", Key="runs/a/lease.json")["Body"].read())
        assert held["token"] == mine["token"]
    listed = s3.list_objects_v2(Bucket="raylora-lease", Prefix="runs/a/").get("Contents", [])
    assert [o["Key"] for o in listed] == ["runs/a/"]  # (the folder marker pyarrow leaves)
    s3.put_object(Bucket="raylora-lease", Key="runs/a/lease.json", Body=json.dumps(
        {"host": "other-host", "pid": 7, "started": time.time() - 10, "renewed": time.time() - 10}))
    with pytest.raises(ConfigError, match=r"^1 config problem\(s\):\n  - output.uri: s3://raylora-lease/"
                                          r"runs/a is in use by another run \(host other-host, pid 7"):
        recorded.held_lease(store, out).__enter__()


def test_raylora_train_holds_the_lease_and_a_second_run_is_refused_before_ray(base_config, monkeypatch):
    """launch.run takes output.uri's lease before Ray starts and releases it at the end (an
    error too); with another process's live lease there it is refused before anything else
    (no Ray, no re-export, no checkpoint touched); a stale one it takes over."""
    from raylora import launch
    from raylora.checkpoint import recorded
    from raylora.config import ConfigError, validate

    monkeypatch.setattr(recorded, "LEASE_SETTLE_S", 0, raising=False)
    out = base_config["output"]["uri"]
    lease = os.path.join(out, "lease.json")
    seen = []

    def init_ray(need_cpus):  # where Ray would start: the lease is held by then
        seen.append(json.loads(open(lease).read()))
        raise RuntimeError("no Ray in this test")

    monkeypatch.setattr(launch, "init_ray", init_ray)
    with pytest.raises(RuntimeError, match="no Ray in this test"):
        launch.run(validate(base_config))
    assert seen[0]["pid"] == os.getpid()
    assert not os.path.exists(out)  # a run that did not start leaves no output folder behind

    import pathlib

    theirs = _foreign_lease(pathlib.Path(lease), 5)
    with pytest.raises(ConfigError, match=f"output.uri: {out} is in use by another run "
                                          r"\(host other-host, pid 4242"):
        launch.run(validate(base_config))
    assert len(seen) == 1 and json.loads(open(lease).read()) == theirs

    _foreign_lease(pathlib.Path(lease), recorded.LEASE_STALE_S + 1)
    with pytest.raises(RuntimeError, match="no Ray in this test"):
        launch.run(validate(base_config))
    assert seen[1]["pid"] == os.getpid() and not os.path.exists(lease)


def test_a_checkpoint_without_its_batch_size_resumes_at_the_rows_it_trained(tmp_path, caplog):
    """Checkpoints written before LoopState recorded train.batch_size (raylora before
    2026-12-06) took the resuming run's: batch 2 → 4 counted 4 micro-batches of 2 as 4 of
    4 and skipped rows 8-15 of the epoch untrained, silently (the driver's steps to the
    epochs' end too). The old size is images_seen over its steps' workers × accumulation;
    a checkpoint that tells none is refused, naming train.batch_size."""
    import logging

    from raylora.checkpoint.state import TRAINER_STATE
    from raylora.launch import steps_to_epochs_end

    def old_checkpoint(name, history):
        ckpt = tmp_path / name
        ckpt.mkdir()
        loop = LoopState(global_step=4, epoch=0, batches_in_epoch=4, images_seen=8, world_size=1,
                         history=history)
        save_main_state(str(ckpt), lora_sd={"w": torch.ones(2)}, optimizer_sd={}, scheduler_sd={},
                        scaler_sd=None, loop=loop)
        state = torch.load(ckpt / TRAINER_STATE, weights_only=True)
        del state["loop"]["batch_size"]  # as the earlier raylora wrote it
        torch.save(state, ckpt / TRAINER_STATE)
        return load_state(str(ckpt), rank=0).loop

    rows = [{"step": s, "loss": 1.0, "world_size": 1, "accumulation": 1} for s in range(1, 5)]
    loop = old_checkpoint("a", rows)
    assert loop.batch_size == 2
    loop.resize(1, 4)
    assert (loop.batches_in_epoch, loop.batch_size) == (2, 4)  # 8 rows in: 2 batches of 4
    # without the per-step sizes in its history: taken as counted in the new size, as
    # before (an elastic run resized with the same batch size resumes right so), and said
    loop = old_checkpoint("b", [{"step": s, "loss": 1.0} for s in range(1, 5)])
    assert loop.batch_size is None
    with caplog.at_level(logging.WARNING, logger="raylora"):
        loop.resize(1, 4)
    assert (loop.batches_in_epoch, loop.batch_size) == (4, 4)
    assert "did not record its batch size, and its history does not tell it" in caplog.text
    # The driver (train.num_epochs): 16 rows, batch 4 → 4 micro-batches an epoch, 2 epochs;
    # 8 rows in: 6 steps left (counted in the new size: 4, rows 8-15 never trained)
    at = {"global_step": 4, "epoch": 0, "batches_in_epoch": 4, "images_seen": 8, "world_size": 1}
    assert steps_to_epochs_end(2, 4, 1, 1, 4, at) == 6
    # images_seen tells none: counted in this run's batch size, as the workers count it
    assert steps_to_epochs_end(2, 4, 1, 1, 4, {**at, "images_seen": 9}) == 4
