import pytest
import torch
from diffusers import UNet2DConditionModel

from raylora.config import LoraSection
from raylora.model.lora import WEIGHT_NAME, add_lora, digest, load_lora_state_dict, lora_state_dict
from raylora.model.lora import save_diffusers_adapter
from raylora.model.families.sd import SD


@pytest.fixture
def unet(tiny_model):
    return UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet", torch_dtype=torch.bfloat16)


def _expected_lora_numel(unet, targets, rank):
    n = 0
    for name, mod in unet.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name.endswith(t) for t in targets):
            n += rank * mod.in_features + mod.out_features * rank
    return n


def test_only_lora_params_trainable_with_expected_count(unet):
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    expected = _expected_lora_numel(unet, targets, rank=4)
    params = add_lora(unet, LoraSection(rank=4, target_modules=targets))
    trainable = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    assert expected > 0
    assert sum(p.numel() for p in params) == expected
    assert all("lora_" in n for n in trainable)
    # LoRA master weights fp32 even though the base is bf16.
    assert {p.dtype for p in params} == {torch.float32}
    frozen = [p for n, p in unet.named_parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    # B starts at zero: the fresh adapter is a no-op.
    assert all(float(p.detach().abs().sum()) == 0 for n, p in trainable.items() if "lora_B" in n)


def test_rank_and_targets_change_the_count(unet):
    expected = _expected_lora_numel(unet, ["to_q", "to_v"], 2)
    params = add_lora(unet, LoraSection(rank=2, target_modules=["to_q", "to_v"]))
    assert 0 < sum(p.numel() for p in params) == expected


def test_bad_target_named(unet):
    with pytest.raises(ValueError, match="target_modules"):
        add_lora(unet, LoraSection(target_modules=["no_such_layer"]))


def test_state_round_trip_and_diffusers_file(unet, tmp_path):
    from safetensors import safe_open

    add_lora(unet, LoraSection(rank=4, alpha=8, dropout=0.3), SD.lora_targets)
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.01)
    sd = lora_state_dict(unet)
    before = digest(sd)
    load_lora_state_dict(unet, {k: torch.zeros_like(v) for k, v in sd.items()})
    assert digest(lora_state_dict(unet)) != before
    load_lora_state_dict(unet, sd)
    assert digest(lora_state_dict(unet)) == before

    save_diffusers_adapter(unet, str(tmp_path), SD)
    with safe_open(str(tmp_path / WEIGHT_NAME), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert keys and all(k.startswith("unet.") for k in keys)
    assert any(".lora.down.weight" in k or "lora_A" in k for k in keys)
    assert len(keys) == len(sd)
    import json

    lora_meta = json.loads(meta["lora_adapter_metadata"])
    assert lora_meta["unet.lora_alpha"] == 8.0 and lora_meta["unet.r"] == 4
    # dropout is the run's, not the adapter's: a loader building layers from the metadata
    # would otherwise drop part of the LoRA at inference (its new layers in train mode)
    assert lora_meta["unet.lora_dropout"] == 0.0


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_an_sd_adapter_on_attention_and_other_layers_loads_whole_in_the_stock_pipeline(
        tiny_model, tmp_path, variant):
    """diffusers renames only attention layers to its legacy keys (proj_in keeps peft's
    lora_A), and its loader takes the file's style from the first key: proj_in sorts first,
    so the attention layers were left out (DoRA: left on the meta device) without an error.
    The file has one style; the stock pipeline's UNet is the trained one."""
    from diffusers import StableDiffusionPipeline
    from safetensors import safe_open

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    add_lora(unet, LoraSection(rank=4, alpha=4, variant=variant), ("to_q", "to_k", "to_v", "to_out.0", "proj_in"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    save_diffusers_adapter(unet, str(tmp_path), SD)
    with safe_open(str(tmp_path / WEIGHT_NAME), "pt") as f:
        assert not [k for k in f.keys() if ".lora_A." in k or ".lora_B." in k]
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    pipe.load_lora_weights(str(tmp_path))
    x, e = torch.randn(1, 4, 8, 8), torch.randn(1, 77, unet.config.cross_attention_dim)
    unet.eval()
    with torch.no_grad():
        want, got = unet(x, 500, e).sample, pipe.unet(x, 500, e).sample
        base = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")(x, 500, e).sample
    assert (want - base).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_raylora_sample_draws_the_same_image_for_a_seed_from_an_adapter_that_asks_for_dropout(
        tiny_model, tmp_path):
    """An adapter written before the metadata said ``lora_dropout: 0`` (here: rewritten to
    0.3): the stock loader builds its layers with dropout, in train mode, and the same seed
    draws two pictures; ``raylora sample`` puts the pipeline in eval and draws one."""
    import json

    import numpy as np
    from PIL import Image
    from safetensors import safe_open
    from safetensors.torch import save_file
    from stock import stock_pipeline

    from raylora.sample import sample

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    add_lora(unet, LoraSection(rank=4), SD.lora_targets)
    with torch.no_grad():
        for p in unet.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    save_diffusers_adapter(unet, str(tmp_path / "a"), SD)
    path = str(tmp_path / "a" / WEIGHT_NAME)
    with safe_open(path, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    lora_meta = json.loads(meta["lora_adapter_metadata"]) | {"unet.lora_dropout": 0.3}
    save_file(tensors, path, metadata=meta | {"lora_adapter_metadata": json.dumps(lora_meta)})

    pipe = stock_pipeline("sd", tiny_model)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "a"))

    def stock():
        out = pipe("a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                   generator=torch.Generator().manual_seed(0))
        return out.images[0]

    assert np.abs(stock() - stock()).max() > 1e-3  # the file does ask for dropout

    shots = [np.asarray(Image.open(sample(tiny_model, str(tmp_path / "a"), "a red circle",
                                          str(tmp_path / f"s{i}.png"), steps=2, size=64)))
             for i in range(2)]
    assert np.array_equal(*shots)


def test_an_overridden_prediction_type_is_what_previews_sample_and_the_card_sample_with(tiny_model, tmp_path):
    """train.prediction_type v_prediction on an ε model (as diffusers' scripts' --prediction_type):
    the preview pipeline, raylora sample (from the adapter's raylora.json) and the model
    card's snippet sample v; without the override, the folder's own ε."""
    import json

    from raylora.checkpoint.export import _usage
    from raylora.config import validate
    from raylora.sample import load_pipeline
    from raylora.train import preview as pv

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    assert pv.build_pipeline(tiny_model, SD, unet).scheduler.config.prediction_type == "epsilon"
    pipe = pv.build_pipeline(tiny_model, SD, unet, prediction_type="v_prediction")
    assert pipe.scheduler.config.prediction_type == "v_prediction"

    add_lora(unet, LoraSection(rank=2), SD.lora_targets)
    save_diffusers_adapter(unet, str(tmp_path / "a"), SD)
    pipe, _ = load_pipeline(tiny_model, str(tmp_path / "a"))
    assert pipe.scheduler.config.prediction_type == "epsilon"
    (tmp_path / "a" / "raylora.json").write_text(json.dumps({"config": {"train": {"prediction_type": "v_prediction"}}}))
    pipe, _ = load_pipeline(tiny_model, str(tmp_path / "a"))
    assert pipe.scheduler.config.prediction_type == "v_prediction"

    def card(**train):
        return _usage(validate({"model": {"pretrained": "org/sd", "variant": "fp16"}, "data": {"uri": "d"},
                                "output": {"uri": "o"}, "train": train}), SD)

    assert 'pipe = StableDiffusionPipeline.from_pretrained("org/sd", variant="fp16")\n' \
           'pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, ' \
           'prediction_type="v_prediction")  # as trained\n' in card(prediction_type="v_prediction")
    assert "prediction_type" not in card()
    # the hub commit the run trained, not main (which may have moved since)
    cfg = validate({"model": {"pretrained": "org/sd"}, "data": {"uri": "d"}, "output": {"uri": "o"}})
    assert ('pipe = StableDiffusionPipeline.from_pretrained("org/sd", revision="0123abcd")\n'
            in _usage(cfg, SD, "0123abcd"))
    local = validate({"model": {"pretrained": "/models/sd"}, "data": {"uri": "d"}, "output": {"uri": "o"}})
    assert "revision" not in _usage(local, SD, "v-2026-12-06")  # a stored folder's version


def test_an_fp16_preview_decodes_with_the_fp32_vae_in_fp32(tiny_model):
    """Under fp16 the run keeps a force_upcast VAE (SDXL's) in fp32 because its activations
    overflow fp16; the preview's autocast ran its convs in fp16 anyway (NaN, black
    previews on GPUs). The denoiser still runs under the autocast; bf16 is left to it."""
    import torch

    from raylora.train import preview as pv

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    pipe = pv.build_pipeline(tiny_model, SD, unet)
    seen = {}
    hooks = [pipe.vae.decoder.conv_out.register_forward_hook(
                 lambda m, i, o: seen.__setitem__("vae", o.dtype)),
             unet.conv_in.register_forward_hook(lambda m, i, o: seen.__setitem__("unet", o.dtype))]
    for dtype, vae in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        (image,) = pv.render(pipe, SD, ["a red circle"], 0, 2, SD.guidance_kwargs(), 32,
                             autocast=lambda: torch.autocast("cpu", dtype=dtype))
        assert seen == {"unet": dtype, "vae": vae} and image.size == (32, 32)
    for h in hooks:
        h.remove()
    assert "decode" not in pipe.vae.__dict__  # the class's method again after the render
