"""The console script as users call it (no Ray needed for these paths)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

RAYLORA = [sys.executable, "-m", "raylora"]


def _run(args, **kw):
    return subprocess.run(RAYLORA + args, capture_output=True, text=True, **{"timeout": 300, **kw})


def test_validate_prints_resolved_config_with_overrides(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}))
    p = _run(["validate", str(cfg), "lora.target_modules=[to_q,to_v]", "train.learning_rate=2e-4"])
    assert p.returncode == 0, p.stderr
    tree = json.loads(p.stdout)
    assert tree["lora"]["target_modules"] == ["to_q", "to_v"]
    assert tree["train"]["learning_rate"] == 2e-4


@pytest.mark.parametrize("argv, usage", [
    (["validate", "job.yaml", "--bogus"], "usage: raylora validate "),
    (["train", "job.yaml", "train.batch_size=2", "--bogus"], "usage: raylora train "),
    (["shards", "build", "src", "dest", "--bogus"], "usage: raylora shards build "),
])
def test_a_stray_argument_is_shown_with_its_commands_usage(argv, usage, capsys):
    from raylora.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    # the command's options, not the list of fifteen commands, answer what went wrong
    assert err.startswith(usage), err
    assert err.rstrip().endswith(f"error: unrecognized arguments: {argv[-1]}")


def test_bad_config_exits_2_before_ray_with_every_problem(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}))
    p = _run(["train", str(cfg), "lora.rank=-1", "train.bogus=1"])
    assert p.returncode == 2
    assert "lora.rank" in p.stderr and "train.bogus: unknown key" in p.stderr
    assert "2 config problem(s)" in p.stderr
    assert "Started a local Ray instance" not in p.stderr + p.stdout


def test_missing_model_and_data_and_an_unwritable_output_named_before_ray(tmp_path):
    cfg = tmp_path / "job.yaml"
    (tmp_path / "runs").write_text("a file where the output's parent folder would go")
    out = tmp_path / "runs" / "out"
    cfg.write_text(yaml.safe_dump({
        "model": {"pretrained": str(tmp_path / "no-model")},
        "data": {"uri": str(tmp_path / "no-data")},
        "output": {"uri": str(out)},
        # Root passes os.access there, yet nothing can be made in /proc: the check writes.
        "train": {"compile": "regional", "compile_cache_uri": "/proc/raylora-compile-cache"},
    }))
    p = _run(["train", str(cfg)])
    assert p.returncode == 2, p.stderr
    assert "4 config problem(s)" in p.stderr
    assert any(f"train.compile_cache_uri: /proc/raylora-compile-cache: {why} /proc" in p.stderr
               for why in ("cannot write in", "no permission to write in")), p.stderr
    assert f"model.pretrained: {tmp_path / 'no-model'}: no such directory" in p.stderr
    assert f"data.uri: {tmp_path / 'no-data'}: no such file or directory" in p.stderr
    assert f"output.uri: {out}: {tmp_path / 'runs'} is a file, not a folder" in p.stderr
    assert "Started a local Ray instance" not in p.stderr + p.stdout
    # a writable output is not created by the check: a run refused later leaves no folder
    cfg.write_text(yaml.safe_dump({"model": {"pretrained": str(tmp_path / "no-model")},
                                   "data": {"uri": str(tmp_path / "no-data")},
                                   "output": {"uri": str(tmp_path / "new" / "out")}}))
    p = _run(["train", str(cfg)])
    assert p.returncode == 2 and "2 config problem(s)" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "new")
    assert not [f for f in os.listdir(tmp_path) if "write-check" in f]  # the probe is gone


def test_data_with_no_usable_sampled_row_is_refused_before_ray(tmp_path, tiny_model):
    """16 rows of bytes that are no image: before, Ray started, the model loaded and both
    workers printed stack traces before the bad-fraction error (exit 2 after 47 s)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"image": [b"notanimage-%d" % i for i in range(16)],
                             "text": ["a red circle"] * 16}), tmp_path / "data" / "part-0.parquet")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"pretrained": tiny_model},
                                   "data": {"uri": str(tmp_path / "data")},
                                   "output": {"uri": str(tmp_path / "out")}}))
    p = _run(["train", str(cfg)])
    assert p.returncode == 2, p.stderr
    assert "1 config problem(s)" in p.stderr
    assert (f"data.uri: {tmp_path / 'data'}: none of the 16 rows read to check it is usable "
            f"(not_an_image=16; e.g. {tmp_path / 'data' / 'part-0.parquet'}#0: not_an_image: "
            "no image format PIL reads starts b'notanima'): the run would drop every such row. "
            "Check data.image_column") in p.stderr, p.stderr
    assert "Started a local Ray instance" not in p.stderr + p.stdout
    assert not (tmp_path / "out").exists()


def _job(tmp_path, search: bool):
    """A valid job YAML (model and data need not exist), with a 2-value search or none."""
    tree = {"model": {"pretrained": str(tmp_path / "m")}, "data": {"uri": str(tmp_path / "d")},
            "output": {"uri": str(tmp_path / "out")}}
    if search:
        tree["tune"] = {"search_space": {"train.learning_rate": {"grid": [1e-4, 1e-3]}},
                        "metric": "train_loss"}
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    return cfg


def test_train_refuses_a_search_config_and_tune_null_trains_its_base(tmp_path):
    cfg = _job(tmp_path, search=True)
    p = _run(["train", str(cfg)])
    assert p.returncode == 2, p.stderr
    assert (f"1 config problem(s) in {cfg}:\n  - tune: this config is a search; run it with "
            "`raylora tune`, or add the override tune=null to train its base config once") in p.stderr
    p = _run(["validate", str(cfg), "tune=null"])
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["tune"] is None


@pytest.mark.parametrize("cmd, runner, said", [
    ("train", "raylora.launch.run",
     "; run the same command again to resume from the latest checkpoint"),
    ("tune", "raylora.tune.run_tune",
     "; run the same command again to resume the search (each unfinished trial from its latest checkpoint)"),
    ("lr-find", "raylora.launch.run_lr_find", ""),  # keeps no checkpoints: a rerun starts over
])
def test_an_interrupt_says_what_running_the_command_again_does(cmd, runner, said, tmp_path,
                                                              monkeypatch, capsys):
    from raylora.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(runner, interrupted)
    cfg = _job(tmp_path, search=cmd == "tune")
    assert main([cmd, str(cfg)]) == 130
    assert capsys.readouterr().err == f"raylora: interrupted{said}\n"


@pytest.mark.parametrize("divisor", [1, 6])
def test_lr_find_prints_the_suggestion_and_with_scale_lr_the_learning_rate_to_set(
        divisor, tmp_path, monkeypatch, capsys):
    """The printing only (the sweep itself runs on Ray in test_tune)."""
    from raylora.cli import main

    found = {"steps_run": 12, "stopped": None, "min_smoothed_loss": 0.5, "lr_at_min_loss": 3e-3,
             "suggested_lr": 3e-4, "clamped": False, "learning_rate": 3e-4 / divisor,
             "scale_lr_divisor": divisor, "csv": "/o/lr_find.csv", "png": "/o/lr_find.png"}
    monkeypatch.setattr("raylora.launch.run_lr_find", lambda *a, **k: found)
    assert main(["lr-find", str(_job(tmp_path, search=False))]) == 0
    out = capsys.readouterr().out
    assert "raylora: suggested lr 0.0003\n" in out
    said = ("raylora: train.scale_lr is on and lr-find swept the unscaled lr: set train.learning_rate "
            "5e-05 (the suggestion / batch_size × gradient_accumulation_steps = 6); a run then "
            "trains at workers × 0.0003")
    assert (said in out) == (divisor == 6)


def test_an_os_error_is_one_line_and_its_stack_trace_is_for_verbose(tmp_path):
    (tmp_path / "f").write_text("")
    target = tmp_path / "f" / "data"
    p = _run(["demo-data", str(target)])
    assert p.returncode == 1
    assert f"raylora: error: [Errno 20] Not a directory: '{target}' (--verbose shows where)" in p.stderr
    assert "Traceback" not in p.stderr
    p = _run(["demo-data", str(target), "--verbose"])
    assert p.returncode == 1 and "Traceback" in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"NotADirectoryError: [Errno 20] Not a directory: '{target}'"


def test_tiny_model_and_demo_data_commands(tmp_path):
    p = _run(["tiny-model", str(tmp_path / "m")])
    assert p.returncode == 0, p.stderr
    index = json.load(open(tmp_path / "m" / "model_index.json"))
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    weights = (tmp_path / "m" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    p = _run(["tiny-model", str(tmp_path / "m"), "--family", "sdxl"])  # not over a model
    assert p.returncode == 2 and f"{tmp_path / 'm'}: not empty; tiny-model writes a new folder" in p.stderr
    assert (tmp_path / "m" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == weights
    p = _run(["demo-data", str(tmp_path / "d"), "--num", "10", "--shards", "3"])
    assert p.returncode == 0, p.stderr
    import pyarrow.parquet as pq

    shards = sorted((tmp_path / "d").glob("*.parquet"))
    assert len(shards) == 3
    assert sum(pq.read_metadata(s).num_rows for s in shards) == 10
    # 0 shards wrote a manifest of 96 images and no data; 5 shards of 3 images, 2 empty ones
    from raylora.cli import main

    for num, shards in (("96", "0"), ("3", "5")):
        assert main(["demo-data", str(tmp_path / "e"), "--num", num, "--shards", shards]) == 2
    assert not (tmp_path / "e").exists()


def test_sample_names_a_model_or_adapter_path_that_is_not_there(tmp_path, capsys):
    """Before, such a path went to the loaders as a hub id, and the message was the hub
    client's ("Repo id must be in the form ...")."""
    from raylora.cli import main

    rest = ["--prompt", "p", "--out", str(tmp_path / "s.png")]
    assert main(["sample", "--model", str(tmp_path / "no-model"), "--adapter", "owner/lora", *rest]) == 2
    assert (f"raylora: error: --model: {tmp_path / 'no-model'}: no such file or folder here, "
            "and not a hub id (owner/name)") in capsys.readouterr().err
    missing = tmp_path / "runs" / "out" / "adapter"
    assert main(["sample", "--model", str(tmp_path), "--adapter", str(missing), *rest]) == 2
    assert f"raylora: error: --adapter: {missing}: no such file or folder here" in capsys.readouterr().err
    assert not (tmp_path / "s.png").exists()
    # The call's own arguments, before anything loads (a folder that is no model here)
    model = ["sample", "--model", str(tmp_path), "--adapter", str(missing), "--prompt", "p"]
    blocked = tmp_path / "file"
    blocked.write_text("")
    for args, want in (
            (["--out", str(tmp_path / "s")], f"--out: {tmp_path / 's'}: name an image file"),
            (["--out", str(blocked / "s.png")], f"--out: cannot write in {blocked}"),
            (["--out", str(tmp_path / "s.png"), "--steps", "0"], "--steps: 0; at least 1")):
        assert main([*model, *args]) == 2
        assert f"raylora: error: {want}" in capsys.readouterr().err


def test_sample_names_a_single_file_model_and_an_adapter_folder_without_weights(tiny_model, tmp_path,
                                                                                capsys):
    from raylora.cli import main

    run = tmp_path / "run"  # a run's output.uri given as the adapter
    (run / "adapter").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    single = tmp_path / "sd15.safetensors"
    single.write_bytes(b"\0" * 64)
    rest = ["--prompt", "p", "--out", str(tmp_path / "s.png")]
    assert main(["sample", "--model", str(single), "--adapter", str(run / "adapter"), *rest]) == 2
    assert (f"raylora: error: --model: {single}: a file, not a diffusers folder "
            "(model_index.json and a folder per component)") in capsys.readouterr().err
    assert main(["sample", "--model", tiny_model, "--adapter", str(run), *rest]) == 2
    assert (f"raylora: error: --adapter: {run}: no LoRA weights in it (no .safetensors file, no "
            f"adapter_config.json); a run's output folder holds its adapter in {run / 'adapter'}"
            ) in capsys.readouterr().err
    assert not (tmp_path / "s.png").exists()


def test_sample_refuses_a_size_off_the_latent_grid_before_the_pipeline_loads(tiny_model, tmp_path,
                                                                            capsys, monkeypatch):
    import json

    from diffusers import DiffusionPipeline

    from raylora.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "pytorch_lora_weights.safetensors").write_bytes(b"")  # not read: refused before
    vae = json.loads(open(f"{tiny_model}/vae/config.json").read())
    multiple = 2 ** (len(vae["block_out_channels"]) - 1)  # SD: patch 1
    loaded = []
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", lambda *a, **k: loaded.append(a))
    args = ["sample", "--model", tiny_model, "--adapter", str(adapter), "--prompt", "p",
            "--out", str(tmp_path / "s.png"), "--size", str(8 * multiple + 1)]
    assert main(args) == 2
    assert (f"raylora: error: --size: {8 * multiple + 1} is not a multiple of {multiple} (the sd "
            f"latent grid: VAE downsampling × patch size), e.g. {8 * multiple}") in capsys.readouterr().err
    assert loaded == [] and not (tmp_path / "s.png").exists()


@pytest.fixture(scope="module")
def sd_adapter(tiny_model, tmp_path_factory) -> str:
    """A LoRA of the tiny SD model's unet with random (nonzero) up weights: it changes the
    image the pipeline draws."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model)
    torch.manual_seed(0)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    out = tmp_path_factory.mktemp("sd-adapter")
    StableDiffusionPipeline.save_lora_weights(str(out), get_peft_model_state_dict(pipe.unet))
    return str(out)


def _pixels(path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path))


def test_sample_draws_without_the_safety_checker_as_previews_do(tiny_model, sd_adapter, tmp_path):
    """SD 1.x's repos list a safety checker: `raylora sample` loaded it (1.2 GB downloaded
    for SD 1.5) and drew black where it flagged the image, while previews and class images
    of the same adapter are drawn without it. Here a checker that flags every image: the
    sample is the one the folder without a checker gives."""
    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    from raylora.sample import load_pipeline, sample

    checker = StableDiffusionSafetyChecker(CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                         num_hidden_layers=1, vocab_size=1000),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                           num_hidden_layers=1, image_size=32, patch_size=4),
        projection_dim=32))
    with torch.no_grad():
        checker.concept_embeds_weights.fill_(-10.0)  # every image is over every threshold
    extractor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    stock = StableDiffusionPipeline.from_pretrained(tiny_model)
    folder = tmp_path / "with-checker"
    StableDiffusionPipeline(**{k: v for k, v in stock.components.items()
                               if k not in ("safety_checker", "feature_extractor")},
                            safety_checker=checker, feature_extractor=extractor,
                            requires_safety_checker=True).save_pretrained(folder)
    flagged = checker(images=np.ones((1, 64, 64, 3), np.float32),
                      clip_input=extractor(np.ones((64, 64, 3)), return_tensors="pt").pixel_values)
    assert flagged[1] == [True] and flagged[0].max() == 0  # what it does to a white image

    assert load_pipeline(str(folder), sd_adapter)[0].safety_checker is None
    call = dict(adapter=sd_adapter, prompt="a photo", steps=2, size=64)
    got = _pixels(sample(str(folder), out=str(tmp_path / "checked.png"), **call))
    want = _pixels(sample(tiny_model, out=str(tmp_path / "plain.png"), **call))
    assert want.max() > 0 and np.array_equal(got, want)


def test_sample_a_model_in_object_storage(tiny_model, sd_adapter, moto_endpoint, tmp_path,
                                          monkeypatch, capsys):
    """`raylora sample --model s3://...` went to DiffusionPipeline as a hub id: a
    huggingface.co connection error. The folder is checked where it is, as a run's plan
    checks it (nothing downloaded for one that cannot load), then copied to this node as a
    training worker's copy is (RAYLORA_CACHE), and draws the local folder's image."""
    import glob
    import shutil

    import boto3
    import numpy as np

    from raylora.cli import main
    from raylora.storage import Storage

    cache = tmp_path / "cache"
    for k, v in (("AWS_ENDPOINT_URL", moto_endpoint), ("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00031"),
                 ("AWS_SECRET_ACCESS_KEY", "fake/secret"), ("AWS_REGION", "us-east-1"),
                 ("RAYLORA_CACHE", str(cache))):
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket="raylora-sample")
    store = Storage()
    pointed = tmp_path / "lfs"  # a clone without git-lfs, uploaded
    shutil.copytree(tiny_model, pointed)
    (pointed / "unet" / "diffusion_pytorch_model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 3438167536\n")
    store.upload_dir(str(pointed), "s3://raylora-sample/lfs")
    store.upload_dir(tiny_model, "s3://raylora-sample/tiny")
    call = ["--adapter", sd_adapter, "--prompt", "a photo", "--steps", "2", "--size", "64"]
    assert main(["sample", "--model", "s3://raylora-sample/lfs", *call,
                 "--out", str(tmp_path / "lfs.png")]) == 2
    assert ("raylora: error: --model: s3://raylora-sample/lfs: no weights in "
            "s3://raylora-sample/lfs/unet (diffusion_pytorch_model.safetensors is a git-lfs "
            "pointer, not the weights); pushed or copied from a clone without git-lfs "
            "(`git lfs pull` there fetches them)") in capsys.readouterr().err
    assert not cache.exists()
    assert main(["sample", "--model", "s3://raylora-sample/tiny", *call,
                 "--out", str(tmp_path / "s3.png")]) == 0
    assert main(["sample", "--model", tiny_model, *call, "--out", str(tmp_path / "local.png")]) == 0
    got, want = _pixels(tmp_path / "s3.png"), _pixels(tmp_path / "local.png")
    assert want.max() > 0 and np.array_equal(got, want)
    assert len(glob.glob(f"{cache}/models/*/.complete")) == 1


def _no_base_model(monkeypatch) -> list:
    """The calls that would load the base model (minutes for a big one), recorded instead."""
    import raylora.model.load

    loaded = []
    monkeypatch.setattr(raylora.model.load, "load_pipeline_as_trained",
                        lambda *a, **k: loaded.append(a))
    return loaded


def test_sample_refuses_an_adapter_file_its_pipeline_does_not_read(tiny, tiny_model, tmp_path,
                                                                   capsys, monkeypatch, caplog):
    """raylora's kohya file of an SD3 adapter (SAI's names, for ComfyUI): the stock pipeline
    converts none of its keys and sampled the base model with a warning raylora's quiet
    logging hid, and a success line. Refused before the base model loads, as lora.init_from
    refuses it; the export says so too. An adapter none of which reaches the denoiser is
    refused after the load."""
    import torch
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from raylora.checkpoint.kohya import export_kohya
    from raylora.cli import main
    from raylora.model import families
    from raylora.sample import load_adapter

    model = tiny("sd3")
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    torch.manual_seed(0)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                            target_modules=["to_q", "to_k", "to_v"]))
    folder = tmp_path / "adapter"
    StableDiffusion3Pipeline.save_lora_weights(
        str(folder), transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    kohya = tmp_path / "adapter_kohya.safetensors"
    with caplog.at_level("WARNING", logger="raylora"):
        export_kohya(str(folder / "pytorch_lora_weights.safetensors"), str(kohya), model,
                     families.get("sd3"))
    assert [r.getMessage() for r in caplog.records if r.name == "raylora"] == [f"kohya file: {kohya}: 6 of its 6 tensors are not LoRA layers of a "
                    "StableDiffusion3Pipeline component (transformer, text_encoder, "
                    "text_encoder_2), e.g. lora_unet_joint_blocks_0_x_block_attn_qkv.alpha: not "
                    "a format that pipeline converts. The file is for ComfyUI and kohya-style "
                    "tools (the reference checkpoint's names); in diffusers, raylora sample and "
                    "lora.init_from, load the adapter folder"]

    loaded = _no_base_model(monkeypatch)
    rest = ["--prompt", "p", "--out", str(tmp_path / "s.png"), "--steps", "1"]
    capsys.readouterr()
    assert main(["sample", "--model", model, "--adapter", str(kohya), *rest]) == 2
    assert capsys.readouterr().err.endswith(
        f"raylora: error: --adapter: {kohya}: 6 of its 6 tensors are not LoRA layers of a "
        "StableDiffusion3Pipeline component (transformer, text_encoder, text_encoder_2), e.g. "
        "lora_unet_joint_blocks_0_x_block_attn_qkv.alpha: not a format that pipeline converts; "
        "the adapter folder raylora writes (diffusers format, output.uri/adapter) loads\n")
    assert loaded == [] and not (tmp_path / "s.png").exists()

    # text-encoder layers only: the UNet got none (the stock loader: a warning)
    sd_fam = families.get("sd")
    sd_pipe = sd_fam.load_pipeline(tiny_model)
    sd_pipe.text_encoder.add_adapter(LoraConfig(r=4, init_lora_weights="gaussian",
                                                target_modules=["q_proj", "v_proj"]))
    te_only = tmp_path / "te_only"
    sd_fam.pipeline_class().save_lora_weights(
        str(te_only), text_encoder_lora_layers=get_peft_model_state_dict(sd_pipe.text_encoder))
    with pytest.raises(ValueError) as exc:
        load_adapter(sd_fam.load_pipeline(tiny_model), sd_fam, str(te_only))
    assert str(exc.value) == (f"--adapter: {te_only}: no LoRA layer of it loaded into the "
                              "StableDiffusionPipeline's unet; the adapter folder raylora writes "
                              "(diffusers format, output.uri/adapter) loads")


def test_sample_an_adapter_in_object_storage_or_named_by_a_file_uri(
        tiny_model, sd_adapter, moto_endpoint, tmp_path, monkeypatch, capsys):
    """`--adapter s3://...` (or hf://...) reached diffusers as a hub id: "Repo id must be in
    the form ...", after the base model had loaded. It is copied here first, as
    lora.init_from's is, and draws the local folder's image; one that is not there, or a
    hub one this machine cannot read, is named before the model loads. `--model file:/abs`
    was "no such file or folder here" and `file:///abs` a URI for load_config: both the
    folder."""
    import boto3
    import numpy as np

    from raylora.cli import main
    from raylora.storage import Storage

    for k, v in (("AWS_ENDPOINT_URL", moto_endpoint), ("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00032"),
                 ("AWS_SECRET_ACCESS_KEY", "fake/secret"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket="raylora-adapters")
    Storage().upload_dir(sd_adapter, "s3://raylora-adapters/run/adapter")
    call = ["--prompt", "a photo", "--steps", "2", "--size", "64"]
    assert main(["sample", "--model", tiny_model, "--adapter", sd_adapter, *call,
                 "--out", str(tmp_path / "local.png")]) == 0
    want = _pixels(tmp_path / "local.png")
    for i, (model, adapter) in enumerate((
            (tiny_model, "s3://raylora-adapters/run/adapter"),
            (tiny_model, "s3://raylora-adapters/run/adapter/pytorch_lora_weights.safetensors"),
            (f"file:{tiny_model}", f"file://{sd_adapter}"),
            (f"file://{tiny_model}", sd_adapter))):
        out = tmp_path / f"{i}.png"
        assert main(["sample", "--model", model, "--adapter", adapter, *call, "--out", str(out)]) == 0, (
            model, adapter, capsys.readouterr().err)
        assert np.array_equal(_pixels(out), want), (model, adapter)
    assert want.max() > 0

    loaded = _no_base_model(monkeypatch)
    capsys.readouterr()
    for adapter, code, want in (
            ("s3://raylora-adapters/nothing", 2,
             "raylora: error: --adapter: s3://raylora-adapters/nothing: not found\n"),
            ("s3://raylora-adapters/run", 2,
             "raylora: error: --adapter: s3://raylora-adapters/run: has no "
             "pytorch_lora_weights.safetensors (a diffusers LoRA) or adapter_config.json (a peft "
             "adapter folder); name the folder raylora wrote (output.uri/adapter) or a "
             ".safetensors file\n"),
            ("hf://someone/some-lora", 1, "raylora: error: --adapter: hf://someone/some-lora: "
             "the hub could not be read here")):
        assert main(["sample", "--model", tiny_model, "--adapter", adapter, *call,
                     "--out", str(tmp_path / "x.png")]) == code, adapter
        assert want in capsys.readouterr().err, adapter
    assert loaded == [] and not (tmp_path / "x.png").exists()


def test_sample_an_adapter_on_the_hub(online, hub, tiny_model, sd_adapter, tmp_path, capsys):
    """`--adapter hf://owner/name/path` is downloaded as lora.init_from's is (only its
    .safetensors and .json files) and draws the local folder's image."""
    import shutil

    import numpy as np

    from raylora.cli import main

    repo = tmp_path / "repo"
    shutil.copytree(sd_adapter, repo / "style")
    (repo / "sample.png").write_bytes(b"not an adapter file")
    hub.add("org/sd-lora-sample", str(repo))
    call = ["--prompt", "a photo", "--steps", "2", "--size", "64", "--model", tiny_model]
    assert main(["sample", "--adapter", sd_adapter, *call, "--out", str(tmp_path / "local.png")]) == 0
    assert main(["sample", "--adapter", "hf://org/sd-lora-sample/style", *call,
                 "--out", str(tmp_path / "hub.png")]) == 0, capsys.readouterr().err
    want = _pixels(tmp_path / "local.png")
    assert want.max() > 0 and np.array_equal(_pixels(tmp_path / "hub.png"), want)
    assert main(["sample", "--adapter", "hf://org/no-such-lora", *call,
                 "--out", str(tmp_path / "x.png")]) == 2
    assert ("raylora: error: --adapter: hf://org/no-such-lora: no such model repo on the hub"
            in capsys.readouterr().err)


def test_a_ray_address_where_no_cluster_answers_is_named_at_once(tmp_path, tiny_model, demo_data):
    """A stale RAY_ADDRESS (the cluster stopped): ray.init retried for minutes before a
    stack trace; now one line naming it, before Ray. Addresses ray.init judges itself
    pass through."""
    import socket

    from localhead import free_port
    from raylora.launch import ray_address_problem

    dead = f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"pretrained": tiny_model}, "data": {"uri": demo_data, "resolution": 64},
        "train": {"max_steps": 2}, "output": {"uri": str(tmp_path / "out")}}))
    p = _run(["train", str(cfg)], env={**os.environ, "RAY_ADDRESS": dead}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert f"raylora: error: RAY_ADDRESS={dead}: no Ray cluster answers there (Connection refused)" in p.stderr
    assert "or unset it to run on a local Ray this command starts" in p.stderr
    assert "Connecting to existing Ray cluster" not in p.stderr + p.stdout
    # The job commands too (the Job SDK resolves a GCS address through the cluster: it
    # waited 40 s, then a stack trace).
    p = _run(["list"], env={**os.environ, "RAY_ADDRESS": dead}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"raylora: error: RAY_ADDRESS={dead}: no Ray cluster answers there"), p.stderr
    p = _run(["status", "some-job", "--address", dead], timeout=120)
    assert p.returncode == 2 and f"--address={dead}: no Ray cluster" in p.stderr, p.stderr
    assert ray_address_problem(f"ray://{dead}").startswith(f"RAY_ADDRESS=ray://{dead}: no Ray")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert ray_address_problem(f"127.0.0.1:{listening.getsockname()[1]}") is None
    assert ray_address_problem("auto") is ray_address_problem("http://127.0.0.1:8265") is None
    # The job commands' dashboard URL is probed too: the SDK's failure was exit 1, after the plan.
    p = _run(["status", "some-job", "--address", f"http://{dead}"], timeout=120)
    assert p.returncode == 2 and f"--address=http://{dead}: no Ray cluster" in p.stderr, p.stderr
    assert ray_address_problem(f"https://user:pw@{dead}/", dashboard=True).startswith(
        f"RAY_ADDRESS=https://***@{dead}/: no Ray cluster answers there")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert ray_address_problem(f"http://127.0.0.1:{listening.getsockname()[1]}",
                                   dashboard=True) is None


def test_shards_build_names_a_bad_source_or_destination_before_ray(tmp_path, capsys, monkeypatch):
    from raylora import launch
    from raylora.cli import main
    from raylora.data.demo import write_imagefolder

    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert main(["shards", "build", str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    assert f"raylora: error: {tmp_path / 'none'}: no files found" in capsys.readouterr().err
    src = write_imagefolder(tmp_path / "imgs", n=2, size=16, seed=0)
    assert main(["shards", "build", str(src), "/proc/raylora-shards"]) == 2
    assert "raylora: error: dest: /proc/raylora-shards: " in capsys.readouterr().err
    assert main(["shards", "build", str(src), str(tmp_path / "out"), "--shard-size", "0"]) == 2
    assert "--shard-size: must be positive, got 0" in capsys.readouterr().err
    # a destination holding shards already (a build before, of another size or format): a
    # reader of the folder would read those beside the new ones; nothing of them is touched
    old = tmp_path / "built"
    old.mkdir()
    (old / "shard-00004.tar").write_bytes(b"old shard")
    assert main(["shards", "build", str(src), str(old)]) == 2
    assert (f"raylora: error: dest: {old} already holds 1 file(s) (e.g. shard-00004.tar); give an "
            "empty or new folder, or remove them first") in capsys.readouterr().err
    assert (old / "shard-00004.tar").read_bytes() == b"old shard"
    # a caption that is not UTF-8: named (a bare UnicodeDecodeError named no file)
    write_imagefolder(tmp_path / "latin", n=1, size=16, seed=0, captions="txt")
    (tmp_path / "latin" / "img_00000.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert main(["shards", "build", str(tmp_path / "latin"), str(tmp_path / "o2")]) == 2
    assert (f"raylora: error: {tmp_path / 'latin' / 'img_00000'}.txt: not UTF-8 text (unexpected "
            "end of data at byte 3); save it as UTF-8") in capsys.readouterr().err


def test_shards_build_reads_a_kohya_folder_as_training_does(tmp_path, caplog):
    """Images without a caption file in a kohya N_name folder train on its class tokens;
    shards build left them out. Its repeats are not carried, and it says so."""
    from PIL import Image

    from raylora.data.shards import collect_items
    from raylora.storage import Storage

    for folder, names in (("10_sks dog", ["a", "b"]), ("1_dog", ["c"]), ("misc", ["d", "e"])):
        (tmp_path / folder).mkdir()
        for n in names:
            Image.new("RGB", (8, 8)).save(tmp_path / folder / f"{n}.png")
    (tmp_path / "10_sks dog" / "b.txt").write_text("sks dog on grass\n")
    (tmp_path / "misc" / "e.txt").write_text("a cat")
    with caplog.at_level("WARNING", logger="raylora.data"):
        items = collect_items(Storage(), str(tmp_path))
    assert [(it["key"], it["text"]) for it in items] == [
        ("10_sks dog/a", "sks dog"), ("10_sks dog/b", "sks dog on grass"), ("1_dog/c", "dog"),
        ("misc/e", "a cat")]
    assert "kohya repeats (10_sks dog) are not carried into shards" in caplog.text
    # a caption of kohya's default extension there: refused, not replaced by the tokens
    (tmp_path / "10_sks dog" / "a.caption").write_text("sks dog, smiling")
    with pytest.raises(ValueError, match=r"10_sks dog/a.caption: a caption file that shards "
                                         r"build does not read \(it reads .txt\)"):
        collect_items(Storage(), str(tmp_path))


def test_plan_sizes_a_folder_of_configs_only(tiny_model, tmp_path, capsys):
    """README's worked example sizes Flux.1-dev from a folder of its configs, "on any
    machine (no GPU, no download)"; `raylora plan` refused such a folder (exit 2: "no
    weights in .../transformer ... Copy the model again"). The plan reads configs only: it
    prints the same table as for the whole folder and exits 0; `raylora train`'s check of
    the weights stays."""
    import re
    import shutil

    from raylora import memory
    from raylora.cli import main
    from raylora.config import load_config
    from raylora.model.load import check_model
    from raylora.storage import Storage

    configs = tmp_path / "configs-only"
    shutil.copytree(tiny_model, configs, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    assert not list(configs.rglob("*.safetensors"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"pretrained": str(configs)},
                                   "output": {"uri": str(tmp_path / "o")}, "lora": {"rank": 4},
                                   "data": {"uri": str(tmp_path), "resolution": 32},
                                   "scaling": {"num_workers": 1, "gpu_memory_gb": 1}}))
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    whole = memory.from_config(load_config(str(job), [f"model.pretrained={tiny_model}"]))
    assert re.search(rf"\ntotal per GPU +{whole.total / 2**20:.2f}\n", out), out  # MiB
    assert f"GPU: 1.00 GiB (scaling.gpu_memory_gb): fits, {memory.size(2**30 - whole.peak)} to spare" in out
    with pytest.raises(FileNotFoundError, match=r"no weights in .*/unet \(no \.safetensors or \.bin file\)"):
        check_model(str(configs), Storage())  # what train runs (launch.plan)


def test_a_path_arguments_tilde_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """bash leaves `--out=~/x.png` and a quoted '~/d' as written: `sample --out` wrote
    ./~/x.png while saying ~/x.png, and `demo-data '~/d'` made an empty ./~/d and failed
    writing ~/d (pyarrow expands ~). Path arguments expand it, as config paths do."""
    from raylora.cli import main

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert main(["demo-data", "~/d", "--num", "2", "--shards", "1"]) == 0
    assert f"raylora: demo data    {home}/d (2 images in 1 shards)" in capsys.readouterr().out
    assert sorted(os.listdir(home / "d")) == ["_manifest.json", "part-00000.parquet"] and os.listdir(cwd) == []


def test_demo_data_names_the_option_that_is_out_of_range(tmp_path, capsys):
    """`demo-data --num 0` blamed --shards ("--shards: 2; between 1 and the number of images
    (0)"), `--size 0` said PIL's "cannot write empty image"; each names its option now, and
    writes nothing."""
    from raylora.cli import main

    for args, said in ((["--num", "0"], "--num: 0; at least 1 image"),
                       (["--size", "0"], "--size: 0; at least 8 pixels")):
        assert main(["demo-data", str(tmp_path / "d"), *args]) == 2
        assert capsys.readouterr().err.strip() == f"raylora: error: {said}"
        assert not (tmp_path / "d").exists()
