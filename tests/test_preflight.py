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
    assert ("No single change, nor a pair, fits. Try more of these together (the config "
            "takes no scaling.strategy=fsdp with model.quantize=nf4; no "
            "model.quantize_text_encoders=nf4 with data.cache=latents): scaling.strategy=fsdp with "
            "more scaling.num_workers, model.quantize=nf4, train.gradient_checkpointing=true, a "
            "smaller train.batch_size, model.quantize_text_encoders=nf4, data.cache=latents; or "
            "a larger GPU.") in text
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


def test_the_last_resort_names_no_lever_the_config_already_uses(job):
    """The "No single change" list named every lever whatever the config used (repro:
    cached latents, nf4, gradient checkpointing, batch 1 were all named to a config that
    had them). Now: only levers it does not use yet and takes, the previews and the text
    encoders' quantization among them; with none left, a larger GPU alone."""
    from raylora.preflight import GpuSize, report

    tree, _, _ = job
    every = {**tree, "model": {**tree["model"], "quantize": "nf4"},
             "data": {**tree["data"], "cache": "latents", "random_flip": False},
             "train": {**tree["train"], "batch_size": 1, "gradient_checkpointing": True},
             "validation": {"prompts": ["a cat"]}}
    cfg = validate(every)
    est = memory.from_config(cfg)
    tiny_gpu = GpuSize(est.total / memory.GIB / 1000, "scaling.gpu_memory_gb")
    text, fits, advice = report(est, tiny_gpu, cfg)
    assert fits is False and advice == []
    assert text.splitlines()[-1] == (
        "No single change, nor a pair, fits. Try more of these together (the config takes no "
        "validation.prompts=[] with model.quantize_text_encoders=nf4): scaling.strategy=fsdp "
        "with more scaling.num_workers and model.quantize=none, validation.prompts=[] (no "
        "previews while training), model.quantize_text_encoders=nf4; or a larger GPU.")
    # an 8-bit optimizer (no FSDP) and nf4 text encoders (no previews: they would load for
    # nothing): nothing left
    done = validate({**every, "model": {**every["model"], "quantize_text_encoders": "nf4"},
                     "train": {**every["train"], "optimizer": "adamw8bit"}})
    text, _, _ = report(memory.from_config(done), tiny_gpu, done)
    assert text.splitlines()[-1] == ("No single change, nor a pair, fits, and the config has no "
                                     "other setting that lowers the estimate: a larger GPU.")


def test_advice_from_a_quantized_base_names_fsdp_with_the_base_unquantized(tmp_path):
    """FSDP refuses a quantized base, so a run on nf4 was never told that FSDP would fit
    (Flux.1 [dev], nf4, cached latents, checkpointing, on 10 GiB: the last resort said
    "model.quantize=nf4, ..." it had; FSDP x8 unquantized without previews fits in 8.6
    GiB). The FSDP option from a quantized base drops the quantization. Flux.1 [dev]'s
    configs at 256 px: 7.78 GiB on nf4, 6.05 GiB on 8 unquantized FSDP shards."""
    from raylora.preflight import config_accepts

    path = memory.write_config_folder(str(tmp_path / "flux-dev"))
    cfg = validate({"model": {"pretrained": path, "quantize": "nf4"}, "output": {"uri": str(tmp_path / "o")},
                    "data": {"uri": str(tmp_path), "resolution": 256, "cache": "latents",
                             "random_flip": False, "center_crop": True},
                    "train": {"batch_size": 1, "gradient_checkpointing": True, "mixed_precision": "bf16"},
                    "scaling": {"num_workers": 1, "use_gpu": True}})
    est = memory.from_config(cfg)
    sharded = memory.from_config(cfg, strategy="fsdp", world_size=8, quantize="none")
    assert sharded.peak < est.peak
    assert est.advice(sharded.peak / memory.GIB, config_accepts(cfg)) == [
        "scaling.strategy=fsdp scaling.num_workers=8 model.quantize=none (the global batch x8, the "
        f"learning rate too with train.scale_lr): {memory.size(sharded.peak)}"]


def test_advice_names_no_change_the_family_refuses(tiny, tmp_path):
    """Qwen-Image-Edit with caption dropout, uncached: advice named data.cache=latents,
    which `raylora plan`/`train` then refused (the family's check: its caption embedding
    reads the input image). ``config_accepts`` with the estimate's settings runs the
    family's checks too."""
    from raylora.preflight import GpuSize, config_accepts, report

    tree = {"model": {"pretrained": tiny("qwenimageedit")},
            "data": {"uri": str(tmp_path), "resolution": 64, "control_images": True,
                     "caption_dropout": 0.1, "random_flip": False, "center_crop": True},
            "lora": {"target_modules": None}, "train": {"batch_size": 1},
            "output": {"uri": str(tmp_path / "out")}}
    cfg = validate(tree)
    est = memory.from_config(cfg)
    cached = memory.from_config(cfg, cached_latents=True)
    text, fits, advice = report(est, GpuSize(cached.peak / memory.GIB, "scaling.gpu_memory_gb"), cfg)
    assert fits is False and "data.cache=latents" not in text, text
    assert config_accepts(cfg)(["data.cache=latents"])  # validate alone takes it
    assert not config_accepts(cfg, est.settings)(["data.cache=latents"])
    assert config_accepts(cfg, est.settings)(["train.gradient_checkpointing=true"])


def test_a_search_is_sized_at_its_largest_values_together(job):
    """batch {2, 8} x resolution {64, 128}: each value alone fitted, the trial at batch 8
    and 128 px (4x the activations of either) was never sized, and the advice for a trial
    named train.batch_size, which the search overrides. Now the largest values of the keys
    that only grow memory are sized together, with each combination of the other searched
    keys that change the estimate; no advice sets a searched key."""
    from raylora.tune import trial_variants

    tree, _, _ = job
    # trials at several sizes are compared at one (validation.resolution)
    heldout = {**tree, "data": {**tree["data"], "validation_split": 0.1}, "validation": {"resolution": 64}}
    space = {"train.batch_size": {"choice": [2, 8]}, "data.resolution": {"choice": [64, 128]},
             "train.learning_rate": {"loguniform": [1e-5, 1e-3]}}
    cfg = validate({**heldout, "tune": {"num_samples": 1, "metric": "eval_loss", "search_space": space}})
    variants = trial_variants(cfg)
    assert [label for label, _ in variants] == [
        "tune.search_space.train.batch_size=2", "tune.search_space.train.batch_size=8",
        "tune.search_space.data.resolution=64", "tune.search_space.data.resolution=128",
        "tune.search_space.train.learning_rate=1e-05", "tune.search_space.train.learning_rate=0.001",
        "tune.search_space: train.batch_size=8, data.resolution=128"]
    both = variants[-1][1]
    assert (both.train.batch_size, both.data.resolution) == (8, 128)
    alone = max(memory.from_config(c).peak for _, c in variants[:-1])
    combined = memory.from_config(both).peak
    assert combined > 2 * alone
    gpu = (alone + combined) / 2 / memory.GIB
    with pytest.raises(DoesNotFit, match=r"memory preflight for tune.search_space: train.batch_size=8, "
                                         r"data.resolution=128: ") as err:
        check_memory(cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"gpu_memory_gb": gpu})}),
                     variants=variants)
    assert err.value.advice and not any(a.startswith(("train.batch_size", "data.resolution"))
                                        for a in err.value.advice), err.value.advice
    assert any(a.startswith("train.gradient_checkpointing=true") for a in err.value.advice)
    # a categorical key that changes the estimate: each of its values beside the largest
    # of the others
    space["train.gradient_checkpointing"] = {"choice": [False, True]}
    cfg = validate({**heldout, "tune": {"num_samples": 1, "metric": "eval_loss", "search_space": space}})
    assert [label for label, _ in trial_variants(cfg)][-2:] == [
        "tune.search_space: train.batch_size=8, data.resolution=128, train.gradient_checkpointing=False",
        "tune.search_space: train.batch_size=8, data.resolution=128, train.gradient_checkpointing=True"]
