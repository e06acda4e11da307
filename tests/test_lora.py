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

    add_lora(unet, LoraSection(rank=4, alpha=8), SD.lora_targets)
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
