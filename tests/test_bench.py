"""The bench's own arithmetic (bench/common.py): the GPU's peak and the FLOPs an MFU
divides by. Timings themselves are bench work, run on a GPU (bench/RESULTS.md)."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from common import model_flops_counter, peak_flops  # noqa: E402


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H800 PCIe", 756.0), ("NVIDIA L40", 181.05),
    ("NVIDIA L40S", 362.1), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 70.0)])
def test_peak_flops_is_the_longest_name_the_device_has(name, tflops):
    """First match in list order gave an L40 the L4's peak (MFU x1.5) and an H200 NVL or
    H800 PCIe the SXM part's (MFU x0.84, x0.76)."""
    assert peak_flops(name, None) == pytest.approx(tflops * 1e12)
    assert peak_flops("Some GPU", None) is None and peak_flops("NVIDIA L4", 100.0) == 1e14


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_model_flops_count_attention_backward_as_twice_its_forward(device):
    """One attention layer (SD1.5's first level: 8 heads, 1024 tokens, head 40): forward
    2 matmuls, backward 4 (dQ, dK, dV and the scores' gradient), whatever kernel runs. The
    CPU flash kernel had no formula (counted 0) and torch's fused-kernel formula counts
    the recomputed scores (2.5x), so the bench's MFU read 3-5 % high on GPUs."""
    b, h, s, d = 1, 8, 1024, 40
    forward = 2 * (2 * b * h * s * s * d)
    q, k, v = (torch.randn(b, h, s, d, device=device, requires_grad=True) for _ in range(3))
    with model_flops_counter() as counter:
        out = F.scaled_dot_product_attention(q, k, v)
        counted_forward = counter.get_total_flops()
        out.sum().backward()
    assert counted_forward == forward
    assert counter.get_total_flops() == 3 * forward
    # the fused GPU kernels' backward ops, as they are counted on a CUDA run
    from torch.utils.flop_counter import sdpa_backward_flop

    shaped = [torch.empty(b, h, s, d, device="meta") for _ in range(4)]  # grad_out, q, k, v
    for op in ("flash", "efficient", "cudnn"):
        fused = getattr(torch.ops.aten, f"_scaled_dot_product_{op}_attention_backward")
        assert counter.flop_registry[fused](*shaped) == 2 * forward, op
    assert sdpa_backward_flop(*[t.shape for t in shaped]) == 2.5 * forward  # torch's own


# ---- bench/gpu_dit.py's grid under a time limit, on the CPU (--smoke: toy widths) ----------

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _dit_rows(results) -> dict[str, list[str]]:
    """The recorded table's rows by model and mode: ``{"zimage regional": [cells]}``."""
    rows = [line.strip("|").split(" | ") for line in open(results).read().splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    return {f"{r[0].strip()} {r[3].strip()}": [c.strip() for c in r] for r in rows}


def test_dit_time_limit_stops_the_running_case_and_records_the_others_not_run(tmp_path, monkeypatch):
    """gpu_dit.py had no time limit and recorded only after its last case: a device call
    stopped at its limit kept no row. Now the case running at the limit is stopped and the
    table recorded (to RESULTS.md; here a temporary one), the later cases marked not run,
    each row also in --jsonl as it comes."""
    import json
    import time

    import common
    import gpu_dit

    results, rows = tmp_path / "RESULTS.md", tmp_path / "rows.jsonl"
    monkeypatch.setattr(common, "RESULTS", str(results))
    t0 = time.monotonic()
    # 7 s, 5 of them kept to record (gpu_dit.RECORD_S): 2 s for the first case (too few to
    # import torch), then the time is up
    gpu_dit.main(["--smoke", "--models", "flux,sd35m", "--modes", "none",
                  "--time-limit", "7", "--jsonl", str(rows)])
    assert time.monotonic() - t0 < 7 + 15
    table = _dit_rows(results)
    assert table["flux none"][4] == "stopped: --time-limit"
    assert table["sd35m none"][4] == "not run: --time-limit"
    assert [(r["model"], r["img/s"]) for r in map(json.loads, rows.read_text().splitlines())] == [
        ("flux", "stopped: --time-limit"), ("sd35m", "not run: --time-limit")]
    assert "--time-limit 7 s for the grid" in results.read_text()


def test_dit_rows_before_the_time_limit_keep_their_numbers_and_compiled_rows_their_mfu(
        tmp_path, monkeypatch):
    """The finished rows are recorded with their numbers beside the not-run ones; a
    compiled-only grid (the captions step: --modes regional) counts its FLOPs on an eager
    step before compiling (it had no TFLOP/step or MFU), and --vary-captions 1,2 puts the
    one-length row beside the two-length one in the same table. TORCH_COMPILE_DISABLE keeps
    the regional cases eager on this CPU (the code path is the compiled one's)."""
    import time

    import common
    import gpu_dit

    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(common, "RESULTS", str(results))
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")  # the children inherit it
    offset, ran, real = [0.0], [], gpu_dit.case_in_child

    def two_then_time_is_up(*args, **kwargs):
        ran.append(args[2:6])  # model, batch, lengths, mode
        row = real(*args, **kwargs)
        if len(ran) == 2:
            offset[0] = 1e6
        return row

    monkeypatch.setattr(gpu_dit, "case_in_child", two_then_time_is_up)
    monkeypatch.setattr(gpu_dit, "clock", lambda: time.monotonic() + offset[0], raising=False)
    gpu_dit.main(["--smoke", "--models", "zimage,lumina2", "--modes", "regional",
                  "--vary-captions", "1,2", "--peak-tflops", "1", "--time-limit", "600"])
    assert ran == [("zimage", 1, 1, "regional"), ("zimage", 1, 2, "regional")]
    table = _dit_rows(results)
    assert sorted(table) == ["lumina2 2 caption lengths regional", "lumina2 regional",
                             "zimage 2 caption lengths regional", "zimage regional"]
    for key in ("zimage regional", "zimage 2 caption lengths regional"):
        model, res, batch, mode, img_s, step_ms, tflop, mfu, *_ = table[key]
        assert (res, batch) == ("64", "1") and float(img_s) > 0
        # MFU = FLOPs / step time / peak (1 TFLOP/s here), from the table's own cells
        assert float(tflop) > 0
        assert float(mfu) == pytest.approx(100 * float(tflop) / (float(step_ms) / 1000), rel=0.02)
    # the two-length row's FLOPs are the mean over a full and a 40-token shorter caption
    assert float(table["zimage 2 caption lengths regional"][6]) < float(table["zimage regional"][6])
    assert table["lumina2 regional"][4] == table["lumina2 2 caption lengths regional"][4] == \
        "not run: --time-limit"


def test_dit_grid_refuses_bad_values_before_any_case_and_repeats_no_case():
    """Every bad value named at once, before a case's process starts; a family of one
    caption length (flux) gets one row, not one per --vary-captions count."""
    import gpu_dit

    args = gpu_dit.parser().parse_args(["--models", "flux,zimage", "--batch-sizes", "1",
                                        "--modes", "regional", "--vary-captions", "1,4"])
    assert gpu_dit.check_grid(args) == [("flux", 1, 1, "regional"), ("zimage", 1, 1, "regional"),
                                        ("zimage", 1, 4, "regional")]
    args = gpu_dit.parser().parse_args(["--models", "flux,fluxx", "--modes", "none,fast",
                                        "--vary-captions", "0", "--time-limit", "3"])
    with pytest.raises(SystemExit) as e:
        gpu_dit.check_grid(args)
    assert all(s in str(e.value) for s in ("--models: unknown 'fluxx'", "--modes: unknown 'fast'",
                                            "--vary-captions: 0", "--time-limit 3"))


# ---- bench/gpu_session.sh with a stand-in python ------------------------------------------

FAKE_PY = """#!/bin/bash
echo "$*" >> "$CALLS"
[ "$1" = -m ] && exit 0  # the wheels' pip install
echo "## a table of $1" >> bench/RESULTS.md
exit ${FAKE_RC:-0}
"""


def _session(tmp_path, step, venv: bool, **env):
    """bench/gpu_session.sh ``step`` in a copy of bench/ with a python that records its
    arguments and appends a table to RESULTS.md (``FAKE_RC``: its exit status)."""
    import shutil
    import stat
    import subprocess

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(os.path.join(BENCH, "gpu_session.sh"), repo / "bench")
    (repo / "bench" / "RESULTS.md").write_text("# Results\n")
    fake = tmp_path / ("repo/.venv/bin/python" if venv else "python")
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(FAKE_PY)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT", "TIME_LIMIT")}
    if not venv:
        base["PYTHON"] = str(fake)
    proc = subprocess.run(["bash", "bench/gpu_session.sh", step], cwd=repo, capture_output=True,
                          text=True, timeout=60, env={**base, "CALLS": str(calls), **env})
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, lines, (repo / "bench" / "RESULTS.md").read_text()


def test_session_smoke_runs_the_venv_python_and_leaves_results_as_they_were(tmp_path):
    """`bash bench/gpu_session.sh smoke` ran python3 (no torch here), not the repo's .venv."""
    proc, calls, results = _session(tmp_path, "smoke", venv=True)
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0] for c in calls] == ["bench/gpu_throughput.py", "bench/gpu_loop_check.py",
                                             "bench/gpu_dit.py"]
    assert results == "# Results\n"


def test_session_smoke_failing_leaves_results_as_they_were(tmp_path):
    """A smoke command failing under set -e skipped the restore: its table stayed in
    RESULTS.md. The restore is an EXIT trap now."""
    proc, calls, results = _session(tmp_path, "smoke", venv=False, FAKE_RC="1")
    assert proc.returncode == 1 and len(calls) == 1
    assert results == "# Results\n"


@pytest.mark.parametrize("step", ["dits", "dits2", "dits3", "wan", "flux2", "captions"])
def test_session_dit_steps_pass_a_time_limit_and_bring_results_back_when_they_fail(tmp_path, step):
    """The DiT steps ran gpu_dit.py with no time limit inside a 600 s device call; now they
    get the gpu_throughput steps' 540 s (from the script's start) and a --jsonl in $OUT, and
    RESULTS.md reaches $OUT even when the step fails. Each step's command line is one
    gpu_dit.py accepts (the models known); the captions step has its one-length rows."""
    import gpu_dit

    out = tmp_path / "out"
    out.mkdir()
    proc, calls, _ = _session(tmp_path, step, venv=False, OUT=str(out), FAKE_RC="3",
                              WHEELS=str(tmp_path))
    assert proc.returncode == 3
    assert (out / "RESULTS.md").read_text() == "# Results\n## a table of bench/gpu_dit.py\n"
    assert calls[0].startswith("-m pip install") and calls[1].startswith("bench/gpu_dit.py ")
    args = gpu_dit.parser().parse_args(calls[1].split()[1:])
    assert 500 < args.time_limit <= 540
    assert args.jsonl == str(out / "dit-rows.jsonl")
    cases = gpu_dit.check_grid(args)  # refuses an unknown model or mode
    assert cases
    if step == "captions":
        assert {n for _, _, n, _ in cases} == {1, 4} and {m for *_, m in cases} == {"regional"}


# ---- bench/ingest.py's steady rate ------------------------------------------------------


def _epochs(first_s: float, per_batch_s: list[float]):
    """ingest.epochs over a fake clock: 4 batches of 16 images an epoch, epoch 1's first after
    ``first_s``; ``per_batch_s[e]``: each other batch's wait in epoch e."""
    import ingest

    now = [0.0]

    def make_iter(e):
        for i in range(4):
            now[0] += first_s if (e, i) == (0, 0) else per_batch_s[e]
            yield {"pixel_values": torch.zeros(16, 3, 2, 2)}

    return ingest, ingest.epochs(make_iter, len(per_batch_s), 64, clock=lambda: now[0])


def test_ingest_rate_is_later_epochs_images_over_their_time_and_flags_a_buffered_one():
    """At --images 64 --epochs 2 raylora's one pipeline across epochs had made epoch 2's
    batches during epoch 1 (ratio 127 against the DataLoader): epochs 2+ taking less time
    than the start-up is now marked no steady rate, with a warning line."""
    ingest, r = _epochs(first_s=4.0, per_batch_s=[0.01, 0.001])
    assert r["steady_window_s"] == pytest.approx(0.004)
    assert r["images_per_s"] == pytest.approx(64 / 0.004)
    assert r["steady"] is False
    warning = ingest.steady_warning("raylora", "local parquet", r)
    assert warning.startswith("WARNING: raylora, local parquet: epochs 2+ took 0.004 s, less than the 4 s")
    # steady: 3 later epochs of 4 batches, 0.1 s each; the same figure as the mean epoch gave
    ingest, r = _epochs(first_s=1.0, per_batch_s=[0.1, 0.1, 0.1, 0.1])
    assert r["steady"] is True and ingest.steady_warning("raylora", "s3", r) is None
    assert r["images_per_s"] == pytest.approx(3 * 64 / 1.2) == pytest.approx(64 / 0.4)
    assert r["epoch1_s"] == pytest.approx(1.3) and r["first_batch_s"] == pytest.approx(1.0)
