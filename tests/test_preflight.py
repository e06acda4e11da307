"""The memory preflight (#21 item 6) through the real entry points: ``raylora train``
refuses a run that cannot fit its GPU before Ray starts, naming the keys that would fit;
a fitting run passes; ``raylora plan`` prints the same report with its exit codes; Tune
checks each trial setting; Ray's accelerator type gives the GPU size on a cluster."""

from __future__ import annotations

import logging
import os
import re

import pytest
import yaml

from raylora import memory
from raylora.cli import main
from raylora.config import validate
from raylora.preflight import EXIT_DOES_NOT_FIT, KNOWN_GPU_MIB, DoesNotFit, check_memory, gpu_size

# Checks that a refused run started no Ray, and starts one with a fake GPU.
pytestmark = pytest.mark.own_ray


@pytest.fixture
def job(tiny, demo_data, tmp_path):
    """(tree, yaml path, estimate): the tiny SD model at 64 px, batch 2, on CPU."""
    tree = {"model": {"pretrained": tiny("sd")},
            "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
            "train": {"batch_size": 2, "max_steps": 2, "learning_rate": 1e-3},
            "output": {"uri": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    return tree, str(path), memory.from_config(validate(tree))


def _total_row(est) -> str:
    return rf"\ntotal per GPU +{est.total / 2**20:.2f}\n"  # MiB: a tiny model's table


def test_train_refuses_a_run_that_cannot_fit_before_ray(job, capsys, monkeypatch):
    import ray

    from raylora import launch

    def no_ray(*_):  # run() shuts its Ray down on the way out: is_initialized() cannot tell
        raise AssertionError("Ray was started before the preflight refused the run")

    monkeypatch.setattr(launch, "init_ray", no_ray)
    tree, path, est = job
    budget = 0.9 * est.total / memory.GIB  # the whole step, 10% short
    rc = main(["train", path, f"scaling.gpu_memory_gb={budget}"])
    err = capsys.readouterr().err
    assert rc == EXIT_DOES_NOT_FIT == 3
    assert f"one worker needs ~{memory.size(est.total)} per GPU" in err
    assert "total per GPU" in err and "activations (kept for backward)" in err
    assert f"GPU: {memory.size(budget * memory.GIB)} (scaling.gpu_memory_gb): does NOT fit" in err
    # the keys that would fit, each with its re-estimated total under the budget
    fixes = {line.strip().split(":")[0] for line in err.splitlines() if line.startswith("  train.")}
    assert "train.gradient_checkpointing=true" in fixes
    assert any(f.startswith("train.batch_size=1 ") for f in fixes), err
    assert not ray.is_initialized()  # refused before Ray, so before any GPU was asked for
    # a fitting budget goes on to start Ray: the same spy, now reached
    with pytest.raises(AssertionError, match="Ray was started"):
        main(["train", path, f"scaling.gpu_memory_gb={1.1 * est.total / memory.GIB}"])
    assert not os.path.exists(tree["output"]["uri"])


def test_a_fitting_run_passes_and_logs_its_table(job, caplog):
    tree, _, est = job
    cfg = validate({**tree, "scaling": {"gpu_memory_gb": 1.1 * est.total / memory.GIB}})
    with caplog.at_level(logging.INFO, logger="raylora"):
        check_memory(cfg)
    logged = caplog.text
    assert "memory preflight: fits" in logged and re.search(_total_row(est), logged)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="raylora"):
        check_memory(validate(tree))  # CPU, no gpu_memory_gb: nothing to check against
    assert "not checked, GPU size unknown (scaling.use_gpu is false" in caplog.text


def test_plan_prints_the_report_and_exits_by_fit(job, tmp_path, capsys, monkeypatch):
    import ray

    _, path, est = job
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert re.search(_total_row(est), out)
    assert "GPU: unknown (scaling.use_gpu is false): not checked" in out
    assert main(["plan", path, f"scaling.gpu_memory_gb={2 * est.total / memory.GIB}"]) == 0
    assert f"fits, {memory.size(est.total)} to spare" in capsys.readouterr().out
    assert main(["plan", path, f"scaling.gpu_memory_gb={0.9 * est.total / memory.GIB}"]) == 3
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "  train.gradient_checkpointing=true: " in out
    assert main(["plan", path, "model.pretrained=/nonexistent/model"]) == 2
    assert "model.pretrained: /nonexistent/model: no such directory" in capsys.readouterr().err
    single = tmp_path / "civitai-finetune.safetensors"  # a single-file checkpoint
    single.write_bytes(b"\0" * 64)
    assert main(["plan", path, f"model.pretrained={single}"]) == 2
    assert (f"model.pretrained: {single}: a file, not a diffusers folder (model_index.json "
            "and a folder per component)") in capsys.readouterr().err
    # lora.init_from's problems, as `raylora train` names them before Ray (README): exit 2
    assert main(["plan", path, f"lora.init_from={tmp_path / 'no-adapter'}"]) == 2
    assert f"lora.init_from: {tmp_path / 'no-adapter'}: not found" in capsys.readouterr().err
    # settings this model's family does not take, as `raylora train` refuses them (plan
    # printed a table for them and exited 0)
    assert main(["plan", path, "data.resolution=65", "model.expert=low_noise"]) == 2
    err = capsys.readouterr().err
    assert "data.resolution: 65 is not a multiple of" in err and "model.expert" in err
    # a single-file checkpoint named relative: the same line (it was taken for a hub id:
    # "no such folder here", or a request to the hub for models/civitai-...)
    (tmp_path / "models").mkdir()
    single.rename(tmp_path / "models" / single.name)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", path, f"model.pretrained=models/{single.name}"]) == 2
    assert (f"model.pretrained: {tmp_path / 'models' / single.name}: a file, not a diffusers "
            "folder") in capsys.readouterr().err
    assert not ray.is_initialized()


def test_the_last_resort_advice_names_only_levers_the_config_takes(job):
    from raylora.preflight import GpuSize, report

    tree, _, est = job
    tiny_gpu = GpuSize(est.total / memory.GIB / 1000, "scaling.gpu_memory_gb")
    text, fits, advice = report(est, tiny_gpu, validate(tree))
    assert fits is False and advice == []
    assert ("No single change, nor a pair, fits. Try more of these together (not every pair "
            "combines: fsdp takes no model.quantize): scaling.strategy=fsdp with more "
            "scaling.num_workers, model.quantize=nf4, train.gradient_checkpointing=true, a "
            "smaller train.batch_size, data.cache=latents; or a larger GPU.") in text
    # an 8-bit optimizer: fsdp is refused with it, so not suggested
    eight = validate({**tree, "train": {**tree["train"], "optimizer": "adamw8bit"}})
    text, _, _ = report(memory.from_config(eight), tiny_gpu, eight)
    assert "No single change" in text and "scaling.strategy=fsdp" not in text


def test_tune_checks_each_trial_setting(job, tmp_path, capsys):
    from raylora.tune import trial_variants

    tree, _, est = job
    # fits the base (batch 2); batch 8, one of the values the search can take, does not
    tune = {"num_samples": 1, "metric": "train_loss", "search_space": {"train.batch_size": {"choice": [1, 8]},
                                               "train.learning_rate": {"loguniform": [1e-5, 1e-3]}}}
    cfg = validate({**tree, "tune": tune, "scaling": {"gpu_memory_gb": 1.5 * est.total / memory.GIB}})
    variants = trial_variants(cfg)
    assert [label for label, _ in variants] == [
        "tune.search_space.train.batch_size=1", "tune.search_space.train.batch_size=8",
        "tune.search_space.train.learning_rate=1e-05", "tune.search_space.train.learning_rate=0.001"]
    with pytest.raises(DoesNotFit, match=r"memory preflight for tune.search_space.train.batch_size=8: "):
        check_memory(cfg, variants=variants)
    check_memory(cfg, variants=variants[:1] + variants[2:])  # batch 1 and the lr bounds fit

    # `raylora plan` of the search sizes the same settings: the lr bounds share the base's
    # estimate; batch 8 does not fit, so the plan exits 3 with its table.
    def total(label):
        return memory.size(memory.from_config(dict(variants)[label]).total)

    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["plan", str(path)]) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    lines = out[out.index("search: "):].splitlines()
    assert lines[:3] == [
        "search: 2 trial setting(s) with another estimate",
        f"  tune.search_space.train.batch_size=1: {total('tune.search_space.train.batch_size=1')} per GPU, fits",
        f"  tune.search_space.train.batch_size=8: {total('tune.search_space.train.batch_size=8')} per GPU, "
        "does NOT fit"]
    assert "    GPU: " in out and "does NOT fit (" in out
    assert main(["plan", str(path), 'tune.search_space={"train.batch_size": {"choice": [1, 2]}}']) == 0
    assert "search: 1 trial setting(s) with another estimate" in capsys.readouterr().out


def test_gpu_size_from_config_and_from_rays_accelerator_type(job):
    """A cluster node whose GPUs Ray names L4 (declared here: no GPU on this machine)."""
    import ray

    tree = job[0]
    gpu = {**tree, "scaling": {"use_gpu": True}}
    assert gpu_size(validate({**tree, "scaling": {"gpu_memory_gb": 24}})).gib == 24
    assert gpu_size(validate(tree)).gib is None
    ray.init(num_cpus=1, num_gpus=1, resources={"accelerator_type:L4": 1}, include_dashboard=False)
    try:
        size = gpu_size(validate(gpu), cluster=True)
    finally:
        ray.shutdown()
    assert (size.gib, size.source) == (KNOWN_GPU_MIB["L4"] / 1024, "detected: L4 (Ray accelerator_type)")
    assert round(size.gib, 2) == 22.49
