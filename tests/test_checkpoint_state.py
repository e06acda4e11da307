import torch

from raylora.checkpoint.state import LoopState, load_state, save_main_state, save_rank_state


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
    import json

    from raylora.launch import drop_unrecorded_checkpoints
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
