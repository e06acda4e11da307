"""kohya / ComfyUI export: key layout, alpha, exact round trip, and stock diffusers loading
the kohya file to the same UNet as the diffusers adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from raylora.checkpoint.kohya import export_kohya, from_kohya
from raylora.model.families.sd import SD
from raylora.config import ConfigError, validate

COMPARE = r"""
import json, sys, torch
from diffusers import StableDiffusionPipeline
model, adapter_dir, kohya_file = sys.argv[1:4]
x = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
out = {}
for name, src in (("diffusers", adapter_dir), ("kohya", kohya_file)):
    pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
    ids = pipe.tokenizer(["a circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        enc = pipe.text_encoder(ids)[0]
        base = pipe.unet(x, torch.tensor([400]), enc).sample
        if name == "kohya":
            d, f = src.rsplit("/", 1)
            pipe.load_lora_weights(d, weight_name=f)
        else:
            pipe.load_lora_weights(src)
        out[name] = pipe.unet(x, torch.tensor([400]), enc).sample
print(json.dumps({"max_diff": float((out["diffusers"] - out["kohya"]).abs().max()),
                  "effect": float((out["kohya"] - base).abs().max()),
                  "raylora": any(m.startswith("raylora") for m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """A diffusers adapter with rank 4, alpha 8 and non-zero up weights."""
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora, save_diffusers_adapter

    cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": "d"}, "output": {"uri": "o"},
                    "lora": {"rank": 4, "alpha": 8}})
    comps = load_components(cfg.model, torch.float32, cfg.storage.client())
    add_lora(comps.denoiser, cfg.lora, comps.family.lora_targets)
    g = torch.Generator().manual_seed(3)
    for n, p in comps.denoiser.named_parameters():
        if "lora_B" in n:
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    d = tmp_path_factory.mktemp("adapter") / "adapter"
    save_diffusers_adapter(comps.denoiser, str(d), comps.family)
    return str(d)


def test_kohya_layout_alpha_and_exact_round_trip(adapter, tmp_path):
    src = os.path.join(adapter, "pytorch_lora_weights.safetensors")
    dest = str(tmp_path / "adapter_kohya.safetensors")
    meta = export_kohya(src, dest, "tiny", SD)
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "8")
    diff_sd = load_file(src)
    with safe_open(dest, framework="pt") as f:
        kohya_sd = {k: f.get_tensor(k) for k in f.keys()}
        assert f.metadata()["ss_network_dim"] == "4"
    modules = sorted({k[len("unet."):-len(".lora.down.weight")] for k in diff_sd if k.endswith(".lora.down.weight")})
    assert len(kohya_sd) == 3 * len(modules) and len(diff_sd) == 2 * len(modules)
    name = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= set(kohya_sd)
    assert all(k.startswith("lora_unet_") for k in kohya_sd)
    assert all(float(v) == 8.0 for k, v in kohya_sd.items() if k.endswith(".alpha"))
    back, alphas = from_kohya(kohya_sd, modules, SD.kohya_names())
    assert set(back) == set(diff_sd)
    for k, v in diff_sd.items():
        assert torch.equal(back[k], v), k
    assert set(alphas.values()) == {8.0}


def test_stock_diffusers_loads_the_kohya_file_to_the_same_unet(adapter, tiny_model, tmp_path):
    dest = str(tmp_path / "adapter_kohya.safetensors")
    export_kohya(os.path.join(adapter, "pytorch_lora_weights.safetensors"), dest, "tiny", SD)
    script = tmp_path / "compare.py"
    script.write_text(COMPARE)
    proc = subprocess.run([sys.executable, str(script), tiny_model, adapter, dest],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["raylora"] is False
    assert res["effect"] > 1e-4  # the adapter changes the UNet...
    assert res["max_diff"] < 1e-5  # ...identically from either file (alpha/rank scale kept)


def test_export_formats_must_keep_diffusers():
    base = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}
    assert validate({**base, "export": {"formats": ["diffusers", "kohya"]}}).export.formats == ["diffusers", "kohya"]
    with pytest.raises(ConfigError, match="export.formats: .*diffusers"):
        validate({**base, "export": {"formats": ["kohya"]}})
    with pytest.raises(ConfigError, match="export.formats.1"):
        validate({**base, "export": {"formats": ["diffusers", "onnx"]}})
