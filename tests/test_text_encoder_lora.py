"""``lora.train_text_encoder``: text-encoder LoRA trains with its own lr, resumes exactly,
and exports to diffusers and kohya files that stock diffusers loads to the same encoder."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from inproc import _train

from raylora.checkpoint.state import load_state
from raylora.config import validate

# Stock diffusers, fresh process: the text encoder's output for one prompt after loading the
# diffusers adapter and after loading the kohya file, and the base output.
STOCK_TE = r"""
import json, sys, torch
from diffusers import StableDiffusionPipeline
model, adapter_dir, kohya_file = sys.argv[1:4]
out = {}
for name in ("base", "diffusers", "kohya"):
    pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
    if name == "diffusers":
        pipe.load_lora_weights(adapter_dir)
    elif name == "kohya":
        d, f = kohya_file.rsplit("/", 1)
        pipe.load_lora_weights(d, weight_name=f)
    ids = pipe.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        out[name] = pipe.text_encoder(ids)[0]
print(json.dumps({
    "raylora": any(m.startswith("raylora") for m in sys.modules),
    "diffusers": out["diffusers"].flatten().tolist(),
    "effect": float((out["diffusers"] - out["base"]).abs().max()),
    "kohya_vs_diffusers": float((out["kohya"] - out["diffusers"]).abs().max()),
}))
"""


def test_text_encoder_lora_trains_resumes_and_exports(base_config, batches, tiny_model, tmp_path):
    from transformers import CLIPTextModel

    from raylora.checkpoint.kohya import export_kohya, from_kohya
    from raylora.model.families.sd import SD

    base_config["lora"] = {"train_text_encoder": True, "text_encoder_lr": 3e-3}
    base_config["train"].update(max_steps=4, learning_rate=2e-3)
    base_config["checkpoint"]["every_n_steps"] = 2
    cfg = validate(base_config)

    straight, saved = _train(cfg, batches, 4, str(tmp_path / "a"))
    assert saved == [(2, False), (4, True)]
    # Two parameter groups: UNet LoRA at train.learning_rate, text-encoder LoRA at its own.
    groups = straight.optimizer.param_groups
    assert [g["lr"] for g in groups] == [pytest.approx(2e-3), pytest.approx(3e-3)]
    te = straight.parts.text_encoders[0]
    te_params = {id(p) for p in straight.parts.text_encoder_params}
    assert {id(p) for p in groups[1]["params"]} == te_params and len(te_params) > 0
    # The encoder's LoRA learned; its base weights did not move.
    final = straight.lora_state()
    te_keys = [k for k in final if k.startswith("text_encoder.")]
    assert len(te_keys) == 2 * 4 * 2  # (A, B) × (q, k, v, out) × 2 tiny layers
    assert all(float(final[k].abs().max()) > 0 for k in te_keys if "lora_B" in k)
    fresh = CLIPTextModel.from_pretrained(tiny_model, subfolder="text_encoder")
    trained = {k.replace(".base_layer", ""): v for k, v in te.state_dict().items() if "lora_" not in k}
    for k, v in fresh.state_dict().items():
        assert torch.equal(trained[k], v), k

    # Exact resume from the step-2 checkpoint, text-encoder LoRA and its optimizer state included.
    restored = load_state(str(tmp_path / "a" / "step_2"), rank=0)
    resumed, _ = _train(cfg, batches, 4, str(tmp_path / "b"), restored=restored)
    for k, v in final.items():
        torch.testing.assert_close(resumed.lora_state()[k], v, rtol=1e-5, atol=1e-7)

    # A checkpoint written without text-encoder LoRA cannot silently drop it on resume.
    base_config["lora"] = {}
    with pytest.raises(ValueError, match="lora.train_text_encoder"):
        _train(validate(base_config), batches, 4, str(tmp_path / "c"), restored=restored)

    # Export: the diffusers file has text_encoder.* keys; the kohya file lora_te_* ones.
    adapter = tmp_path / "a" / "step_4" / "adapter"
    from safetensors.torch import load_file

    diff_sd = load_file(str(adapter / "pytorch_lora_weights.safetensors"))
    assert sum(k.startswith("text_encoder.") for k in diff_sd) == len(te_keys)
    # under text_model., as transformers 4's CLIP names its modules: diffusers before 0.42
    # (on transformers 4) reads nothing else; 0.42 reads both spellings
    assert all(k.startswith("text_encoder.text_model.encoder.layers.")
               for k in diff_sd if k.startswith("text_encoder."))
    kohya = str(tmp_path / "adapter_kohya.safetensors")
    meta = export_kohya(str(adapter / "pytorch_lora_weights.safetensors"), kohya, "tiny", SD)
    assert json.loads(meta["ss_network_args"]) == {"train_text_encoder": True}
    k_sd = load_file(kohya)
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in k_sd
    # "<component>.<module>.lora[_linear_layer].down.weight" → "<component>.<module>"
    modules = sorted({k.rsplit(".", 3)[0] for k in diff_sd if k.endswith("down.weight")})
    back, alphas = from_kohya(k_sd, modules, SD.kohya_names())
    assert set(back) == set(diff_sd) and all(torch.equal(back[k], v) for k, v in diff_sd.items())
    assert set(alphas.values()) == {4.0}

    # Stock diffusers (no raylora) loads both files to the encoder the run trained.
    script = tmp_path / "stock_te.py"
    script.write_text(STOCK_TE)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(script), tiny_model, str(adapter), kohya],
                          capture_output=True, text=True, cwd=work, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["raylora"] is False and res["effect"] > 1e-4
    assert res["kohya_vs_diffusers"] < 1e-5
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    ids = tok(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    te.eval()
    with torch.no_grad():
        ours = te(ids)[0].flatten()
    torch.testing.assert_close(torch.tensor(res["diffusers"]), ours, rtol=1e-4, atol=1e-5)


def test_text_encoder_lora_is_refused_with_the_latent_cache(base_config):
    base_config["lora"] = {"train_text_encoder": True}
    base_config["data"]["cache"] = "latents"
    with pytest.raises(ValueError, match=r"lora\.train_text_encoder: cannot be used with data\.cache=latents"):
        validate(base_config)


# family → the text encoders whose LoRA the stock pipeline loads (CLIPs; never T5 or
# Qwen-Image's VLM, which its loader does not take).
TE_FAMILIES = {"sdxl": ["text_encoder", "text_encoder_2"], "sd3": ["text_encoder", "text_encoder_2"],
               "flux": ["text_encoder"]}


@pytest.mark.parametrize("family", list(TE_FAMILIES))
def test_text_encoder_lora_of_every_family_loads_in_its_stock_pipeline(family, tiny, demo_data, tmp_path):
    """#25 item 4: the CLIP encoders each family's stock pipeline loads LoRA into train it
    (their LoRA moves), and the stock pipeline loads those encoders' LoRA from the file:
    their outputs equal the trained encoders'."""
    from inproc import _fresh_accelerator, demo_batch, overfit
    from stock import stock_pipeline

    from raylora.model.lora import save_diffusers_adapter
    from raylora.train.setup import build_run

    model = tiny(family)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64},
                    "lora": {"rank": 4, "train_text_encoder": True, "dropout": 0.3},
                    "train": {"learning_rate": 1e-2, "seed": 0}, "output": {"uri": str(tmp_path / "o")}})
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 5, rank=0)
    assert sorted(run.trained_text_encoders) == TE_FAMILIES[family]
    overfit(run, demo_batch(family, model, demo_data), 5)

    # A preview mid-run (its text encoders in train mode, LoRA dropout 0.3): the same weights
    # and seed draw the same picture, and training goes on with dropout on.
    import numpy as np

    from raylora.train import preview as pv

    vae, encoders, tokenizers = pv.encoders_for(run.parts, model, cfg.model, "cpu")
    assert encoders == run.parts.text_encoders
    for te in encoders:
        te.train()  # as the step leaves them (setup.build_run)
    pv_pipe = pv.build_pipeline(model, run.family, accel.unwrap_model(run.model), vae,
                                encoders, tokenizers)
    shots = [np.asarray(pv.render(pv_pipe, run.family, ["a red circle"], 0, 2,
                                  run.family.guidance_kwargs(), 64)[0]) for _ in range(2)]
    assert np.array_equal(*shots)
    assert all(te.training for te in encoders) and accel.unwrap_model(run.model).training
    adapter = tmp_path / "adapter"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_diffusers_adapter(accel.unwrap_model(run.model), str(adapter), run.family, run.trained_text_encoders)
    # peft asks for no base config (one warning per encoder per checkpoint when it did)
    assert not [str(w.message) for w in caught if "config file" in str(w.message)]

    pipe = stock_pipeline(family, model)
    ids = torch.randint(0, 100, (1, 77))
    base = {n: getattr(pipe, n)(ids)[0].detach() for n in TE_FAMILIES[family]}
    pipe.load_lora_weights(str(adapter))
    # The file asks for no dropout (the stock loader's new layers are in train mode): the
    # stock pipeline's encoders compute what the trained ones do with dropout off.
    for name, trained in run.trained_text_encoders.items():
        trained.eval()  # the trained encoder as it infers: its LoRA dropout off
        with torch.no_grad():
            want, got = trained(ids)[0], getattr(pipe, name)(ids)[0]
        assert (want - base[name]).abs().max() > 1e-4, name  # the encoder's LoRA trained
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_text_encoder_lora_is_refused_where_the_pipeline_loads_none(tiny, demo_data, tmp_path):
    from raylora.launch import plan

    cfg = validate({"model": {"pretrained": tiny("qwenimage")}, "data": {"uri": demo_data, "resolution": 64},
                    "lora": {"train_text_encoder": True}, "output": {"uri": str(tmp_path / "o")}})
    with pytest.raises(ValueError, match=r"lora\.train_text_encoder: QwenImagePipeline loads no text-encoder LoRA"):
        plan(cfg)
