"""#7: clear errors before resources are spent. Each message names the key, file or URI."""

import os
import shutil
import time

import pytest

from raylora.config import ConfigError, validate


def tree(**sections) -> dict:
    base = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


@pytest.mark.parametrize("sections, expected", [
    ({"train": {"mixed_precision": "fp16"}}, "train.mixed_precision: fp16 needs a GPU"),
    ({"train": {"optimizer": "paged_adamw8bit"}}, "train.optimizer: paged_adamw8bit (bitsandbytes) needs CUDA"),
    ({"lora": {"rank": 0}}, "lora.rank:"),
    ({"lora": {"rank": -4}}, "lora.rank:"),
    ({"train": {"batch_size": "two"}}, "train.batch_size:"),
    ({"train": {"learning_rate": "fast"}}, "train.learning_rate:"),
    ({"train": {"lr": 1e-4}}, "train.lr: unknown key"),
    ({"data": {"max_image_pixels": 0}}, "data.max_image_pixels:"),
    ({"data": {"background_color": [0, 0, 300]}}, "data.background_color:"),
    ({"data": {"max_bad_fraction": 1.5}}, "data.max_bad_fraction:"),
    ({"data": {"cache": "latents"}, "lora": {"train_text_encoder": True}},
     "lora.train_text_encoder: cannot be used with data.cache=latents"),
    ({"scaling": {"num_workers": 0}}, "scaling.num_workers:"),
    ({"lora": {"text_encoder_lr": 1e-5}},
     "lora.text_encoder_lr: set, but lora.train_text_encoder is false (the text encoders stay frozen)"),
    ({"lora": {"text_encoder_target_modules": ["q_proj"]}},
     "lora.text_encoder_target_modules: set, but lora.train_text_encoder is false"),
])
def test_each_config_error_names_its_key(sections, expected):
    with pytest.raises(ConfigError) as exc:
        validate(tree(**sections))
    assert expected in str(exc.value)


def test_all_problems_in_one_message():
    with pytest.raises(ConfigError) as exc:
        validate(tree(train={"mixed_precision": "fp16", "optimizer": "paged_adamw8bit", "batch_size": "x"},
                      lora={"rank": 0}))
    keys = {p.split(":")[0] for p in exc.value.problems}
    assert {"train.mixed_precision", "train.optimizer", "train.batch_size", "lora.rank"} <= keys


def test_model_and_data_problems_found_before_any_worker(tiny_model, demo_data, tmp_path):
    from raylora.launch import plan

    broken = tmp_path / "no-unet"
    shutil.copytree(tiny_model, broken)
    shutil.rmtree(broken / "unet")
    cfg = validate({"model": {"pretrained": str(broken)},
                    "data": {"uri": str(tmp_path / "nothing-here" / "*.parquet"), "resolution": 65},
                    "output": {"uri": str(tmp_path / "out")}})
    with pytest.raises(ConfigError) as exc:
        plan(cfg)
    msg = str(exc.value)
    assert f"model.pretrained: {broken}: missing component folder(s) of a sd pipeline: unet" in msg
    assert "data.uri:" in msg and "nothing-here" in msg
    # The tiny VAE halves the image once: 65 px cannot be encoded.
    cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": demo_data, "resolution": 65},
                    "output": {"uri": str(tmp_path / "out")}})
    with pytest.raises(ConfigError, match=r"data.resolution: 65 is not a multiple of 2 \(the sd latent grid"):
        plan(cfg)


def test_a_weight_variant_the_model_lacks_is_named_before_any_worker(tiny_model, demo_data,
                                                                     tmp_path, monkeypatch):
    """model.variant: fp16 of a folder without fp16 files failed in every worker's load
    ("no file named diffusion_pytorch_model.fp16.safetensors") once the cluster was up.
    A folder that has them plans, and its workers load them."""
    import torch

    from raylora.launch import plan
    from raylora.model.load import load_components

    def cfg(model: str):
        return validate({"model": {"pretrained": model, "variant": "fp16"},
                         "data": {"uri": demo_data, "resolution": 64},
                         "output": {"uri": str(tmp_path / "out")}})

    with pytest.raises(ConfigError) as exc:
        plan(cfg(tiny_model), heldout=False)
    assert exc.value.problems == [
        f"model.variant: fp16: model.pretrained: {tiny_model} has no fp16 weights in unet, vae, "
        "text_encoder (files named like diffusion_pytorch_model.fp16.safetensors); leave "
        "model.variant unset to load the weights it has"]
    half = tmp_path / "fp16"
    shutil.copytree(tiny_model, half)
    for f in half.glob("*/*.safetensors"):  # as save_pretrained(variant="fp16") names them
        f.rename(f.with_name(f.name.replace(".safetensors", ".fp16.safetensors")))
    for f in half.glob("*/*.safetensors.index.json"):
        f.rename(f.with_name(f.name.replace(".index.json", ".index.fp16.json")))
    assert plan(cfg(str(half)), heldout=False).family == "sd"
    comps = load_components(cfg(str(half)).model, torch.float32)
    assert comps.denoiser.conv_in.weight.shape[0] > 0 and comps.vae is not None

    # Class images (prior preservation) and raylora sample load the stock pipeline of the
    # same folder: with its variant too (they looked for diffusion_pytorch_model.bin).
    import json

    from raylora.config import LoraSection
    from raylora.model.families.sd import SD
    from raylora.model.load import load_pipeline_as_trained, read_index
    from raylora.model.lora import add_lora, save_diffusers_adapter
    from raylora.sample import sample

    model = cfg(str(half)).model
    pipe = load_pipeline_as_trained(str(half), SD, torch.float32, read_index(model, str(half)), model)
    torch.testing.assert_close(pipe.unet.conv_in.weight, comps.denoiser.conv_in.weight)
    add_lora(comps.denoiser, LoraSection(rank=2), SD.lora_targets)
    adapter = tmp_path / "adapter"
    save_diffusers_adapter(comps.denoiser, str(adapter), SD)
    (adapter / "raylora.json").write_text(json.dumps(
        {"config": {"model": {"pretrained": str(half), "variant": "fp16"}}}))
    # the variant from the adapter's raylora.json (its run's base is this folder)
    png = sample(str(half), str(adapter), "a red circle", str(tmp_path / "s.png"), steps=1, size=64)
    assert os.path.getsize(png) > 0
    # --model as typed relative (raylora.json names the folder by its absolute path)
    monkeypatch.chdir(tmp_path)
    png = sample("fp16", str(adapter), "a red circle", str(tmp_path / "s2.png"), steps=1, size=64)
    assert os.path.getsize(png) > 0


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_lora_targets_that_match_no_layer_are_named_before_any_worker(family, tiny, demo_data, tmp_path):
    """A typo in lora.target_modules or lora.text_encoder_target_modules failed in every
    worker's peft once the cluster was up, and one among names that match (to_kk beside
    to_q) trained a smaller adapter without a word, as peft refuses only a list that
    matches nothing. The driver attaches the adapter to the model built on the meta device
    from its configs: each is one problem naming the targets that match nothing and the
    names the layers have; targets that all match plan as before; nothing is written."""
    from raylora.launch import plan

    def cfg(**lora):
        return validate({"model": {"pretrained": tiny(family)},
                         "data": {"uri": demo_data, "resolution": 64}, "lora": lora,
                         "output": {"uri": str(tmp_path / "out")}})

    with pytest.raises(ConfigError) as exc:
        plan(cfg(target_modules=["to_q", "to_kk"], train_text_encoder=True,
                 text_encoder_target_modules=["q_proj", "q_prj"]), heldout=False)
    denoiser, text = exc.value.problems
    head = "lora.target_modules: ['to_kk'] match no layer of the denoiser (its linear and conv layers: "
    assert denoiser.startswith(head)
    assert {"to_q", "to_k", "to_v", "to_out.0"} <= set(denoiser[len(head):].rstrip(")").split(", "))
    assert text == ("lora.text_encoder_target_modules: ['q_prj'] match no layer of text_encoder "
                    "(text_encoder's linear and conv layers: fc1, fc2, k_proj, out_proj, q_proj, v_proj)")
    assert plan(cfg(target_modules=["to_q", "to_v"], train_text_encoder=True), heldout=False).family == family
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_unreachable_storage_is_one_line_naming_the_uri_and_never_hangs(tiny_model, tmp_path, monkeypatch,
                                                                       scheme):
    """Nothing listens at the endpoint (port 9). GCS's client would retry for 15 minutes
    by its own default; raylora bounds it (storage.GCS_RETRY_S)."""
    from raylora.launch import plan

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # what gs:// reads
    cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": f"{scheme}://bucket/shards/"},
                    "storage": {"endpoint_url": "http://127.0.0.1:9"},  # what s3:// reads
                    "output": {"uri": str(tmp_path / "out")}})
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        plan(cfg)
    took = time.monotonic() - t0
    assert len(exc.value.problems) == 1
    assert exc.value.problems[0].startswith(f"data.uri: {scheme}://bucket/shards: cannot reach storage")
    assert took < 120  # bounded retries with backoff, then the error (s3 ~15 s, gs ~26 s here)


@pytest.mark.integration
def test_more_workers_than_the_cluster_can_place(ray_local):
    from raylora.launch import check_cluster_fits

    ok = validate(tree(scaling={"num_workers": 4}))
    check_cluster_fits(ok)  # 4 logical CPUs, 1 each
    with pytest.raises(ConfigError) as exc:
        check_cluster_fits(validate(tree(scaling={"num_workers": 3, "cpus_per_worker": 2})))
    assert "scaling.num_workers: 3 workers of 2 CPU each cannot all be placed" in str(exc.value)
    assert "hold at most 2" in str(exc.value)
    with pytest.raises(ConfigError, match=r"scaling.num_workers: 1 workers of 1 CPU \+ 1 GPU each"):
        check_cluster_fits(validate(tree(scaling={"use_gpu": True}, train={"mixed_precision": "bf16"})))
    # A cluster that grows on demand is not judged by the nodes it has now.
    check_cluster_fits(validate(tree(scaling={"num_workers": 64, "autoscaling": True})))
