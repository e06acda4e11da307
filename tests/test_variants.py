"""lora.variant: DoRA, LoKr and LoHa on the tiny SD model.

Each variant learns an overfit batch; DoRA's diffusers file loads in the stock pipeline and
changes its image; LoKr/LoHa's LyCORIS file is read by LyCORIS' own kohya loader into a
fresh UNet that then computes what the trained one does, and its key names are the ones
ComfyUI reads (tests/data/lycoris); the peft folder loads with PeftModel. One real Ray run
of LoKr checks the published folder, model card and raylora.json.
"""

import json
import os

import pytest
import torch

from raylora.config import ConfigError, validate

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = json.load(open(os.path.join(HERE, "data", "lycoris", "keys.json")))


# LyCORIS' factors start further from a useful update than LoRA's (LoKr's w1 and LoHa's
# w2_a at zero multiply a small product): a higher rate, as LyCORIS' guides advise.
LR = {"dora": 2e-2, "lokr": 5e-2, "loha": 5e-2}
STEPS = 15


def _cfg(model, data, out, variant):
    return validate({
        "model": {"pretrained": model}, "data": {"uri": data, "resolution": 64, "center_crop": True},
        "lora": {"rank": 4, "variant": variant}, "output": {"uri": str(out)},
        "train": {"learning_rate": LR[variant], "max_steps": STEPS, "batch_size": 2, "seed": 0},
    })


@pytest.fixture(scope="module")
def trained(tiny_model, demo_data, tmp_path_factory):
    """variant → (run, loss before, loss after, adapter folder) after STEPS overfit steps."""
    from inproc import _fresh_accelerator, demo_batch, overfit
    from raylora.model.lora import save_adapter
    from raylora.train.setup import build_run

    batch = demo_batch("sd", tiny_model, demo_data)
    out = {}
    for variant in ("dora", "lokr", "loha"):
        root = tmp_path_factory.mktemp(variant)
        cfg = _cfg(tiny_model, demo_data, root / "out", variant)
        run = build_run(cfg, _fresh_accelerator(1), STEPS, rank=0)
        before, after = overfit(run, batch, STEPS)
        folder = str(root / "adapter")
        save_adapter(run.accelerator.unwrap_model(run.model), folder, run.family)
        out[variant] = (run, before, after, folder)
    return out


def _unet_out(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 32, 32, generator=g)
    e = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([500]), e).sample


@pytest.mark.parametrize("variant", ["dora", "lokr", "loha"])
def test_each_variant_learns_an_overfit_batch(trained, variant):
    run, before, after, _ = trained[variant]
    print(f"{variant}: held-out loss {before:.4f} -> {after:.4f}")
    assert after < 0.97 * before, (before, after)
    names = [n for n, p in run.model.named_parameters() if p.requires_grad]
    marker = {"dora": "lora_magnitude_vector", "lokr": "lokr_w", "loha": "hada_w"}[variant]
    assert names and any(marker in n for n in names)


def test_dora_loads_in_the_stock_pipeline_and_changes_the_image(trained, tiny_model):
    from stock import stock_image_change

    run, _, _, folder = trained["dora"]
    assert os.listdir(folder) == ["pytorch_lora_weights.safetensors"]
    # The stock pipeline's UNet with the file equals the trained UNet.
    from diffusers import UNet2DConditionModel

    stock = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**{**StableDiffusionPipeline.from_pretrained(tiny_model).components,
                                      "unet": stock})
    pipe.load_lora_weights(folder)
    trained_unet = run.accelerator.unwrap_model(run.model)
    assert torch.allclose(_unet_out(pipe.unet), _unet_out(trained_unet), atol=1e-5)
    assert stock_image_change("sd", tiny_model, folder) > 1e-3


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_dora_text_encoders_load_in_the_stock_pipeline_and_start_a_run_as_trained(
        tiny, demo_data, tmp_path, family):
    """DoRA with lora.train_text_encoder: the stock pipeline's text encoders, with the file
    loaded, compute what the trained ones do, and so does a run started from the file.
    Before: diffusers hands text-encoder LoRA to transformers' load_adapter, which read no
    magnitude spelled as peft writes it and kept the base weight norms (SD: 0.84 off)."""
    from diffusers import DiffusionPipeline

    from inproc import _fresh_accelerator, demo_batch, overfit
    from raylora.model.lora import save_adapter
    from raylora.train.setup import build_run

    model = tiny(family)
    tree = {"model": {"pretrained": model}, "output": {"uri": str(tmp_path / "out")},
            "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
            "lora": {"rank": 4, "variant": "dora", "train_text_encoder": True},
            "train": {"learning_rate": 5e-2, "max_steps": 4, "batch_size": 2, "seed": 0}}
    run = build_run(validate(tree), _fresh_accelerator(1), 4, rank=0)
    overfit(run, demo_batch(family, model, demo_data), 4)
    folder = str(tmp_path / "adapter")
    save_adapter(run.accelerator.unwrap_model(run.model), folder, run.family,
                 run.trained_text_encoders)
    ids = torch.randint(0, 100, (1, 77), generator=torch.Generator().manual_seed(0))

    def out(te):
        te.eval()
        with torch.no_grad():
            return te(ids)[0]

    trained = {name: out(te) for name, te in run.trained_text_encoders.items()}
    assert len(trained) == {"sd": 1, "sdxl": 2}[family]
    base = DiffusionPipeline.from_pretrained(model)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.load_lora_weights(folder)
    tree["lora"]["init_from"] = folder
    started = build_run(validate(tree), _fresh_accelerator(1), 4, rank=0)
    for name, want in trained.items():
        assert (want - out(getattr(base, name))).abs().max() > 1e-2, name  # it trained
        torch.testing.assert_close(out(getattr(pipe, name)), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out(started.trained_text_encoders[name]), want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["lokr", "loha"])
def test_lycoris_file_is_read_by_lycoris_into_the_trained_weights(trained, tiny_model, variant):
    """LyCORIS' own kohya loader (lycoris-lora, what sd-scripts uses) builds its modules
    from the file's names and merges them into a fresh UNet: that UNet then computes what
    the peft-trained one does."""
    from diffusers import UNet2DConditionModel
    from lycoris.kohya import LycorisNetworkKohya as Net
    from lycoris.kohya import create_network_from_weights
    from safetensors.torch import load_file

    run, _, _, folder = trained[variant]
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors",
                                          "lycoris.safetensors"]
    sd = load_file(os.path.join(folder, "lycoris.safetensors"))
    modules = {k.split(".")[0] for k in sd}
    assert all(k.startswith(KEYS["unet_prefix"]) and k.split(".")[1] in KEYS[variant] for k in sd)
    assert all(f"{m}.alpha" in sd for m in modules)
    fresh = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    base = _unet_out(fresh)
    # The network's constructor first builds its sd-scripts default targets over the whole
    # UNet (names that repeat on a diffusers UNet); the file's modules come after, so the
    # defaults are emptied for this call.
    saved = (Net.UNET_TARGET_REPLACE_MODULE, Net.UNET_TARGET_REPLACE_NAME)
    Net.UNET_TARGET_REPLACE_MODULE, Net.UNET_TARGET_REPLACE_NAME = [], []
    try:
        network, weights = create_network_from_weights(1.0, None, None, None, fresh, weights_sd=sd)
    finally:
        Net.UNET_TARGET_REPLACE_MODULE, Net.UNET_TARGET_REPLACE_NAME = saved
    layers = [n for n, m in run.model.named_modules() if hasattr(m, "lokr_w1" if variant == "lokr" else "hada_w1_a")]
    assert len(network.unet_loras) == len(modules) == len(layers) == 32  # every one found its layer
    network.merge_to(None, fresh, weights, torch.float32, "cpu")
    want = _unet_out(run.accelerator.unwrap_model(run.model))
    got = _unet_out(fresh)
    assert (want - base).abs().max() > 1e-3
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("variant", ["lokr", "loha"])
def test_peft_folder_loads_with_peft(trained, tiny_model, variant):
    from diffusers import UNet2DConditionModel
    from peft import PeftModel

    run, _, _, folder = trained[variant]
    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert config["peft_type"] == variant.upper() and config["r"] == 4
    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    loaded = PeftModel.from_pretrained(unet, folder).merge_and_unload()
    want = _unet_out(run.accelerator.unwrap_model(run.model))
    assert torch.allclose(_unet_out(loaded), want, atol=1e-5)


@pytest.mark.parametrize("variant", ["dora", "lokr", "loha"])
def test_a_run_started_from_a_variant_adapter_computes_what_the_trained_one_did(
        trained, tiny_model, demo_data, tmp_path, variant):
    """lora.init_from with the folder each variant publishes (DoRA's diffusers file, the
    LoKr/LoHa peft folder), at another lora.alpha: the new run's UNet computes what the
    trained one does before a step; a LoRA run cannot start from them."""
    from inproc import _fresh_accelerator
    from raylora.launch import plan
    from raylora.train.setup import build_run

    run, _, _, folder = trained[variant]
    tree = _cfg(tiny_model, demo_data, tmp_path / "out", variant).model_dump()
    tree["lora"].update(init_from=folder, alpha=1.0)
    started = build_run(validate(tree), _fresh_accelerator(1), STEPS, rank=0)
    want = _unet_out(run.accelerator.unwrap_model(run.model))
    from diffusers import UNet2DConditionModel

    base = _unet_out(UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet"))
    assert (want - base).abs().max() > 1e-3  # the trained adapter is not a no-op
    got = _unet_out(started.accelerator.unwrap_model(started.model))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tree["lora"].update(variant="lora")
    with pytest.raises(ConfigError) as exc:
        plan(validate(tree))
    (line,) = exc.value.problems
    assert line.startswith(f"lora.init_from: {folder}") and "lora.variant" in line


@pytest.mark.parametrize("variant", ["dora", "lokr", "loha"])
def test_raylora_export_kohya_refuses_a_variant_adapter_naming_it(trained, variant, tmp_path, capsys):
    """``raylora export --format kohya`` on a DoRA folder or a LoKr/LoHa folder: exit 2 with
    the variant and the file a user loads instead, and no kohya file written."""
    from raylora.cli import main

    _, _, _, folder = trained[variant]
    dest = tmp_path / "k.safetensors"
    assert main(["export", "--format", "kohya", folder, "--family", "sd", "--out", str(dest)]) == 2
    err = capsys.readouterr().err
    if variant == "dora":
        assert "pytorch_lora_weights.safetensors: a DoRA adapter (unet." in err
        assert "lora_magnitude_vector" in err and "load the diffusers folder instead" in err
    else:
        assert f"{folder}: a LoKr/LoHa adapter; its lycoris.safetensors already is" in err
    assert not dest.exists()


def test_lycoris_names_match_real_files():
    """raylora's names for the SD 1.5 modules in the vendored real keys are those keys."""
    from peft import LoHaConfig, LoKrConfig

    from raylora.checkpoint.lycoris import lycoris_state_dict

    real = set(KEYS["real_keys"])
    t = torch.zeros(2, 2)
    loha = {f"down_blocks.0.attentions.0.proj_in.{n}": t for n in KEYS["loha"][:4]}
    lokr = {f"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.{n}": t
            for n in ("lokr_w1", "lokr_w2")}
    names = set(lycoris_state_dict(loha, LoHaConfig(r=2, alpha=2))) | set(
        lycoris_state_dict(lokr, LoKrConfig(r=2, alpha=2)))
    assert real <= names


def test_lokr_full_matrices_fold_peft_scale_as_lycoris_expects():
    """Both LoKr factors full: LyCORIS/ComfyUI apply scale 1, peft alpha/r: folded into w2."""
    from peft import LoKrConfig

    from raylora.checkpoint.lycoris import lycoris_state_dict

    w1, w2 = torch.ones(2, 2), torch.full((3, 3), 2.0)
    out = lycoris_state_dict({"m.lokr_w1": w1, "m.lokr_w2": w2}, LoKrConfig(r=4, alpha=2))
    assert torch.equal(out["lora_unet_m.lokr_w2"], w2 * 0.5) and float(out["lora_unet_m.alpha"]) == 4.0
    pair = lycoris_state_dict({"m.lokr_w1": w1, "m.lokr_w2_a": torch.ones(3, 4),
                               "m.lokr_w2_b": torch.ones(4, 3)}, LoKrConfig(r=4, alpha=2))
    assert float(pair["lora_unet_m.alpha"]) == 2.0 and torch.equal(pair["lora_unet_m.lokr_w1"], w1)


def test_variant_keys_are_checked_up_front():
    base = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}
    cases = {
        "lora.factor": {"lora": {"factor": 4}},
        "lora.decompose_both": {"lora": {"variant": "loha", "decompose_both": True}},
        "lora.variant: dora is not supported with scaling.strategy=fsdp":
            {"lora": {"variant": "dora"}, "scaling": {"strategy": "fsdp"}},
        "lora.train_text_encoder": {"lora": {"variant": "lokr", "train_text_encoder": True}},
        "export.formats: kohya": {"lora": {"variant": "loha"}, "export": {"formats": ["diffusers", "kohya"]}},
        "lora.variant: lokr with model.quantize=nf4": {"lora": {"variant": "lokr"}, "model": {"quantize": "nf4"}},
    }
    for expected, extra in cases.items():
        tree = json.loads(json.dumps(base))
        for k, v in extra.items():
            tree.setdefault(k, {}).update(v)
        with pytest.raises(ConfigError) as err:
            validate(tree)
        assert expected in str(err.value), (expected, str(err.value))
    with pytest.raises(ConfigError, match="lora.factor: 0"):
        validate({**base, "lora": {"variant": "lokr", "factor": 0}})
    with pytest.raises(ConfigError, match="lora.variant"):
        validate({**base, "lora": {"variant": "oft"}})


@pytest.mark.integration
def test_a_lokr_run_publishes_the_peft_folder_and_lycoris_file(ray_local, tiny_model, demo_data, tmp_path):
    from raylora.launch import run
    from raylora.sample import sample

    out = tmp_path / "out"
    cfg = validate({
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True, "sharding": "files"},
        "lora": {"variant": "lokr", "rank": 4, "factor": 4},
        "train": {"max_steps": 4, "batch_size": 2, "learning_rate": 1e-3},
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": 4},
        "output": {"uri": str(out)},
    })
    run(cfg)
    adapter = out / "adapter"
    assert sorted(os.listdir(adapter)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                           "lycoris.safetensors", "manifest.json", "raylora.json"]
    meta = json.load(open(adapter / "raylora.json"))
    assert meta["data"]["adapter_variant"] == "lokr" and meta["config"]["lora"]["factor"] == 4
    card = (adapter / "README.md").read_text()
    assert "| adapter variant | lokr (factor 4" in card and "PeftModel.from_pretrained(pipe.unet" in card
    assert json.load(open(adapter / "adapter_config.json"))["decompose_factor"] == 4
    png = sample(tiny_model, str(adapter), "a red circle", str(tmp_path / "s.png"), steps=2, size=64)
    assert os.path.getsize(png) > 0


def test_an_earlier_rayloras_dora_text_encoder_magnitudes_sample_and_export_as_trained(
        tiny_model, demo_data, tmp_path, caplog, capsys):
    """DoRA with lora.train_text_encoder, written by raylora before it spelled the text
    encoders' magnitudes ``...lora_magnitude_vector.weight``: ``raylora sample``, ``raylora
    export --format diffusers`` and an export of such a checkpoint (a finished run run
    again, a Tune search's best) passed peft's spelling on, and the text encoder ran at the
    base weight norms (lora.init_from already read both). Each now gives the trained one."""
    import glob
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from inproc import _fresh_accelerator
    from raylora.checkpoint.export import export_run
    from raylora.cli import main
    from raylora.model import families
    from raylora.model.lora import WEIGHT_NAME, save_adapter
    from raylora.sample import load_adapter
    from raylora.train.setup import build_run

    tree = {"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "run")},
            "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
            "lora": {"rank": 4, "variant": "dora", "train_text_encoder": True},
            "train": {"max_steps": 2, "batch_size": 2, "seed": 0}}
    run = build_run(validate(tree), _fresh_accelerator(1), 2, rank=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in run.params:  # B and the magnitudes away from their start: a trained adapter
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    old = tmp_path / "old"
    save_adapter(run.accelerator.unwrap_model(run.model), str(old), run.family,
                 run.trained_text_encoders)
    path = str(old / WEIGHT_NAME)
    with safe_open(path, "pt") as f:
        sd, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    renamed = {k.removesuffix(".weight") if k.startswith("text_encoder.")
               and k.endswith("lora_magnitude_vector.weight") else k: v for k, v in sd.items()}
    assert sum(k.endswith("lora_magnitude_vector") for k in renamed) > 0
    save_file(renamed, path, metadata=meta)  # as the earlier raylora wrote it

    ids = torch.randint(0, 100, (1, 77), generator=torch.Generator().manual_seed(0))

    def out(te):
        te.eval()
        with torch.no_grad():
            return te(ids)[0]

    trained = out(run.trained_text_encoders["text_encoder"])
    fam = families.get("sd")

    def loaded(folder):
        pipe = fam.load_pipeline(tiny_model)
        pipe.load_lora_weights(str(folder))
        return out(pipe.text_encoder)

    assert (loaded(old) - trained).abs().max() > 1e-3  # the file as the stock loader reads it

    pipe = fam.load_pipeline(tiny_model)
    with caplog.at_level("WARNING", logger="raylora"):
        load_adapter(pipe, fam, str(old))  # raylora sample
    assert "text-encoder DoRA magnitudes as lora_magnitude_vector" in caplog.text
    torch.testing.assert_close(out(pipe.text_encoder), trained, rtol=1e-5, atol=1e-5)

    new = tmp_path / "new"
    assert main(["export", "--format", "diffusers", str(old), "--out", str(new)]) == 0
    torch.testing.assert_close(loaded(new), trained, rtol=1e-5, atol=1e-5)

    ckpt = tmp_path / "ckpt"
    shutil.copytree(old, ckpt / "adapter")
    (ckpt / "history.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n')
    plan = {"shard_files": sorted(glob.glob(os.path.join(demo_data, "*.parquet"))),
            "data_format": "parquet", "total_rows": 8, "family": "sd"}
    export_run(str(ckpt), validate({**tree, "output": {"uri": str(tmp_path / "out")}}),
               {"global_step": 2}, plan)
    published = tmp_path / "out" / "adapter"
    with safe_open(str(published / WEIGHT_NAME), "pt") as f:
        assert sorted(f.keys()) == sorted(sd) and f.metadata() == meta
    torch.testing.assert_close(loaded(published), trained, rtol=1e-5, atol=1e-5)
    listed = json.loads((published / "manifest.json").read_text())["files"]
    assert listed[WEIGHT_NAME] == os.path.getsize(published / WEIGHT_NAME)
