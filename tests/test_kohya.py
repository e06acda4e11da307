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
from safetensors.torch import load_file, save_file

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


def _randomize_b(*modules) -> None:
    """Non-zero LoRA up weights (peft starts them at zero)."""
    g = torch.Generator().manual_seed(3)
    for m in modules:
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.data = 0.05 * torch.randn(p.shape, generator=g)


def _write_adapter(model: str, dest: str, text_encoders: bool = False):
    """A diffusers adapter of the pipeline folder ``model`` at ``dest``, rank 4, alpha 8,
    non-zero up weights, on the family's default targets (and, with ``text_encoders``, its
    loadable CLIP encoders). Returns the family."""
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora, add_text_encoder_lora, save_diffusers_adapter

    cfg = validate({"model": {"pretrained": model}, "data": {"uri": "d"}, "output": {"uri": "o"},
                    "lora": {"rank": 4, "alpha": 8}})
    comps = load_components(cfg.model, torch.float32, cfg.storage.client())
    fam = comps.family
    tes = {t.encoder: e for t, e in zip(fam.text, comps.text_encoders)
           if text_encoders and t.encoder in fam.text_encoder_lora()}
    add_lora(comps.denoiser, cfg.lora, fam.lora_targets)
    if tes:
        add_text_encoder_lora(tes, cfg.lora)
    _randomize_b(comps.denoiser, *tes.values())
    save_diffusers_adapter(comps.denoiser, dest, fam, tes)
    return fam


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """A diffusers adapter with rank 4, alpha 8 and non-zero up weights."""
    d = tmp_path_factory.mktemp("adapter") / "adapter"
    _write_adapter(tiny_model, str(d))
    return str(d)


def test_kohya_layout_alpha_and_exact_round_trip(adapter, tmp_path):
    src = os.path.join(adapter, "pytorch_lora_weights.safetensors")
    dest = str(tmp_path / "adapter_kohya.safetensors")
    meta = export_kohya(src, dest, "tiny", SD)
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "8")
    diff_sd = load_file(src)
    # the base model's version as sd-scripts writes it: A1111/Forge list a LoRA beside a
    # checkpoint of its version only (no ss_base_model_version: "SD1", an SDXL LoRA hidden)
    assert (meta["ss_base_model_version"], meta["ss_v2"]) == ("sd_v1", "False")
    to_k = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora.down.weight"
    assert SD.kohya_version({to_k: torch.zeros(4, 1024)}) == {"ss_base_model_version": "sd_v2",
                                                               "ss_v2": "True"}
    assert SD.kohya_version({to_k: torch.zeros(4, 768)})["ss_base_model_version"] == "sd_v1"
    # targets without to_k (e.g. [to_q, to_v]): the value projection's width tells, else a
    # text-encoder LoRA's attention (OpenCLIP ViT-H 1024 wide); SD 2 either way
    to_v = to_k.replace(".to_k.", ".to_v.").replace("lora.down", "lora_A")
    assert SD.kohya_version({to_v: torch.zeros(4, 1024)})["ss_v2"] == "True"
    te = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    fc2 = "text_encoder.text_model.encoder.layers.0.mlp.fc2.lora_A.weight"  # 4096 wide in
    q = to_k.replace(".attn2.to_k.", ".attn2.to_q.")
    assert SD.kohya_version({q: torch.zeros(4, 640), te: torch.zeros(4, 1024),
                             fc2: torch.zeros(4, 4096)})["ss_v2"] == "True"
    assert SD.kohya_version({q: torch.zeros(4, 640), te: torch.zeros(4, 768)})["ss_v2"] == "False"
    from raylora.model.families.sdxl import SDXL

    assert SDXL.kohya_version(diff_sd)["ss_base_model_version"] == "sdxl_base_v1-0"
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
    with pytest.raises(ConfigError, match=r"export.formats\[1\]"):
        validate({**base, "export": {"formats": ["diffusers", "onnx"]}})


# ---- DiT families: Flux (BFL layout) and SD3 (SAI MMDiT layout) --------------------------

DIT = ["flux", "sd3"]
NPROBE = 3  # effective weights are compared as ΔW @ X for random X [in, NPROBE]


def _probe(n: int) -> torch.Tensor:
    return torch.randn(n, NPROBE, generator=torch.Generator().manual_seed(n), dtype=torch.float64)


def _lora_deltas(model, adapter: str) -> dict[str, torch.Tensor]:
    """module path → ΔW @ X of every LoRA layer of ``adapter`` (scaling included)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and adapter in mod.lora_A:
            a = mod.lora_A[adapter].weight.detach().flatten(1).double()
            b = mod.lora_B[adapter].weight.detach().flatten(1).double()
            out[name] = mod.scaling[adapter] * b @ (a @ _probe(a.shape[1]))
    return out


def _assert_close(got: dict, want: dict, what: str) -> None:
    """Every non-zero ``want`` delta in ``got`` within 1e-5 relative; anything else ``got``
    has is zero."""
    assert {k for k, v in want.items() if v.abs().max() > 0} <= set(got), what
    for k, v in got.items():
        ref = want.get(k, torch.zeros_like(v))
        err = float((v - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert (err < 1e-5) if ref.abs().max() > 0 else float(v.abs().max()) == 0, (what, k, err)


def _lora_cfg(model_path: str, targets=None):
    lora = {"rank": 4, "alpha": 8}
    if targets:
        lora["target_modules"] = list(targets)
    return validate({"model": {"pretrained": model_path}, "data": {"uri": "d"}, "output": {"uri": "o"},
                     "lora": lora}).lora


def _adapter_and_kohya(model, fam, targets, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """LoRA (rank 4, alpha 8, non-zero up weights) on ``targets`` of ``model`` → its diffusers
    adapter folder (``tmp_path/adapter``) and the tensors of its kohya file (``k.safetensors``)."""
    from raylora.model.lora import add_lora, save_diffusers_adapter

    add_lora(model, _lora_cfg("m", targets), targets)
    _randomize_b(model)
    adapter = str(tmp_path / "adapter")
    save_diffusers_adapter(model, adapter, fam)
    export_kohya(os.path.join(adapter, "pytorch_lora_weights.safetensors"), str(tmp_path / "k.safetensors"),
                 "tiny", fam)
    return adapter, load_file(str(tmp_path / "k.safetensors"))


@pytest.fixture(scope="module", params=DIT)
def dit_adapter(request, tiny, tmp_path_factory):
    """(family, adapter folder): LoRA on the tiny model's transformer and its loadable CLIP
    encoders (``_write_adapter``)."""
    d = tmp_path_factory.mktemp(f"{request.param}-adapter") / "adapter"
    return _write_adapter(tiny(request.param), str(d), text_encoders=True), str(d)


def test_dit_kohya_layout(dit_adapter, tmp_path):
    """Reference-checkpoint module names, fused q/k/v (and Flux's linear1) as one block-
    structured LoRA with alpha × parts, CLIP encoders as lora_te1_/lora_te2_."""
    fam, adapter = dit_adapter
    src = os.path.join(adapter, "pytorch_lora_weights.safetensors")
    dest = str(tmp_path / "k.safetensors")
    meta = export_kohya(src, dest, "tiny", fam)
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "8")
    assert meta["ss_network_module"] == {"flux": "networks.lora_flux", "sd3": "networks.lora_sd3"}[fam.name]
    k = load_file(dest)
    d = {key.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B."): v
         for key, v in load_file(src).items()}
    modules = {key.split(".")[0] for key in k}
    assert all(m.startswith(("lora_unet_", "lora_te1_", "lora_te2_")) for m in modules)
    assert all({f"{m}.lora_down.weight", f"{m}.lora_up.weight", f"{m}.alpha"} <= set(k) for m in modules)
    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    if fam.name == "flux":
        qkv, parts = "lora_unet_double_blocks_0_img_attn_qkv", "transformer.transformer_blocks.0.attn.to_{}"
        fused = "lora_unet_single_blocks_1_linear1"
        names = {qkv, fused, "lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_txt_attn_qkv",
                 "lora_unet_double_blocks_0_txt_attn_proj", "lora_unet_double_blocks_0_img_mlp_0",
                 "lora_unet_double_blocks_0_img_mlp_2", "lora_unet_double_blocks_0_txt_mlp_0",
                 "lora_unet_double_blocks_0_txt_mlp_2", "lora_unet_single_blocks_0_linear1", te}
        assert {m for m in modules if not m.startswith("lora_te1_")} == names - {te}
        # linear1: q, k, v trained, the MLP part zero; rank 4·4, alpha 4·8, rows 3·32 + 4·32
        assert k[f"{fused}.lora_down.weight"].shape == (16, 32) and k[f"{fused}.lora_up.weight"].shape == (224, 16)
        assert float(k[f"{fused}.alpha"]) == 32.0
        assert not k[f"{fused}.lora_up.weight"][96:].any() and not k[f"{fused}.lora_down.weight"][12:].any()
    else:
        qkv, parts = "lora_unet_joint_blocks_0_x_block_attn_qkv", "transformer.transformer_blocks.0.attn.to_{}"
        names = {qkv, "lora_unet_joint_blocks_0_x_block_attn_proj", "lora_unet_joint_blocks_0_context_block_attn_qkv",
                 "lora_unet_joint_blocks_0_context_block_attn_proj", "lora_unet_joint_blocks_1_x_block_attn_qkv",
                 "lora_unet_joint_blocks_1_x_block_attn_proj", "lora_unet_joint_blocks_1_context_block_attn_qkv"}
        # (the last block's context stream is pre-only: no attention output projection)
        assert {m for m in modules if m.startswith("lora_unet_")} == names
        assert f"{te.replace('te1', 'te2')}.lora_down.weight" in k
    assert f"{te}.lora_down.weight" in k and float(k[f"{te}.alpha"]) == 8.0
    # qkv: the three downs stacked, the three ups on the block diagonal, alpha 3·8
    assert torch.equal(k[f"{qkv}.lora_down.weight"], torch.cat([d[parts.format(p) + ".lora_A.weight"] for p in "qkv"]))
    assert torch.equal(k[f"{qkv}.lora_up.weight"], torch.block_diag(*[d[parts.format(p) + ".lora_B.weight"] for p in "qkv"]))
    assert float(k[f"{qkv}.alpha"]) == 24.0


def _flux_skeleton():
    """A Flux.1 transformer at full width (3072; diffusers' kohya-Flux loader and its BFL
    single-file converter assume it) with one block of each kind and the tiny pipeline's
    text widths. Weights left uninitialised: only the LoRA on top is compared."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=64,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    return m.to_empty(device="cpu")


def _chroma_skeleton():
    """A Chroma transformer at Flux.1's width (its single-file converter assumes 3072), one
    block of each kind, one approximator layer; weights uninitialised, as ``_flux_skeleton``."""
    from diffusers import ChromaTransformer2DModel

    with torch.device("meta"):
        m = ChromaTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=64,
                                     axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
                                     approximator_hidden_dim=32, approximator_layers=1)
    return m.to_empty(device="cpu")


def test_stock_flux_pipeline_loads_the_kohya_file_to_the_same_weights(tiny, tmp_path):
    """diffusers' own kohya-Flux converter (FluxPipeline.load_lora_weights) reads the file to
    the same effective weights as the diffusers adapter, in every transformer block and the
    CLIP encoder (its single-block split needs Flux.1's real width, hence the skeleton)."""
    from diffusers import FluxPipeline

    from raylora.model.families.flux import Flux
    from raylora.model.lora import add_lora, add_text_encoder_lora, save_diffusers_adapter

    model = tiny("flux")
    lora = _lora_cfg(model)
    src = FluxPipeline.from_pretrained(model, transformer=_flux_skeleton())
    add_lora(src.transformer, lora, Flux.lora_targets)
    add_text_encoder_lora({"text_encoder": src.text_encoder}, lora)
    _randomize_b(src.transformer, src.text_encoder)
    adapter = tmp_path / "adapter"
    save_diffusers_adapter(src.transformer, str(adapter), Flux, {"text_encoder": src.text_encoder})
    export_kohya(str(adapter / "pytorch_lora_weights.safetensors"), str(tmp_path / "k.safetensors"), "tiny", Flux)

    pipe = FluxPipeline.from_pretrained(model, transformer=_flux_skeleton())
    pipe.load_lora_weights(str(adapter), adapter_name="diffusers")
    pipe.load_lora_weights(str(tmp_path), weight_name="k.safetensors", adapter_name="kohya")
    for part in ("transformer", "text_encoder"):
        want = _lora_deltas(getattr(src, part), "default")
        assert len(want) == {"transformer": 15, "text_encoder": 8}[part]
        _assert_close(_lora_deltas(getattr(pipe, part), "diffusers"), want, f"{part}: diffusers adapter")
        kohya = _lora_deltas(getattr(pipe, part), "kohya")
        _assert_close(kohya, want, f"{part}: kohya file")


class _Reference(dict):
    """A reference (BFL / SAI) checkpoint holding what ComfyUI adds to each weight from a kohya
    file: ΔW @ X with ΔW = up · down · alpha / rank, under the key ``lora_unet_`` + path with
    ``_`` names (how ComfyUI matches them). diffusers' single-file converter pops dotted keys:
    they are looked up by that name; the keys it pops that the file does not patch (biases,
    norms, untargeted weights) come back as zeros, and ``keys`` are the block names the
    converter counts."""

    def __init__(self, kohya: dict, keys: list[str]):
        super().__init__({k: None for k in keys})
        self.delta, self.used = {}, set()
        for key, down in kohya.items():
            if key.endswith(".lora_down.weight"):
                m = key.split(".")[0]
                down = down.flatten(1).double()
                up = kohya[f"{m}.lora_up.weight"].flatten(1).double()
                self.delta[m] = up @ (down @ _probe(down.shape[1])) * float(kohya[f"{m}.alpha"]) / down.shape[0]

    def pop(self, key, *default):
        flat = "lora_unet_" + key.removesuffix(".weight").replace(".", "_")
        if key.endswith(".weight") and flat in self.delta:
            self.used.add(flat)
            return self.delta[flat]
        return torch.zeros(21504, NPROBE, dtype=torch.float64)  # splits as Flux's linear1, chunks by 2 and 3

    __getitem__ = pop


def _sd35m_like():
    """A tiny SD3.5-medium-style transformer: qk RMS-norm and a dual-attention (attn2) block."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=4, joint_attention_dim=96,
                                 caption_projection_dim=32, pooled_projection_dim=80, pos_embed_max_size=96,
                                 qk_norm="rms_norm", dual_attention_layers=(0,))


ALL_FLUX = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
            "norm1_context.linear", "proj_mlp", "proj_out", "norm.linear", "x_embedder", "context_embedder",
            "linear_1", "linear_2", "norm_out.linear")
# Chroma: Flux.1's linears without the modulations, guidance and pooled-text embedders, plus
# the approximator's (in_proj, out_proj, each layer's linear_1/2)
ALL_CHROMA = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
              "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
              "x_embedder", "context_embedder", "in_proj", "out_proj", "linear_1", "linear_2")
ALL_SD3 = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
           "norm1_context.linear", "proj_out", "pos_embed.proj", "context_embedder", "linear_1", "linear_2",
           "norm_out.linear")


@pytest.mark.parametrize("family", [*DIT, "chroma"])
def test_kohya_file_patches_the_reference_checkpoint_as_the_adapter_does(family, tmp_path):
    """Every linear LoRA can target (embedders, modulations, final layer, Flux's linear1/2,
    SD3.5's attn2 and patch conv): the kohya file applied to the reference checkpoint as
    ComfyUI applies it, mapped back to diffusers by diffusers' own single-file converter
    (convert_flux/chroma/sd3_transformer_checkpoint_to_diffusers: the (shift, scale) swaps, the
    fused q/k/v/mlp splits), equals the adapter's effective weights."""
    from diffusers.loaders import single_file_utils as sf

    from raylora.model.families import get

    fam = get(family)
    if family == "flux":
        model, targets, convert = _flux_skeleton(), ALL_FLUX, sf.convert_flux_transformer_checkpoint_to_diffusers
        keys = ["double_blocks.0.x", "single_blocks.0.x", "guidance_in.x"]
    elif family == "chroma":
        model, targets = _chroma_skeleton(), ALL_CHROMA
        convert = sf.convert_chroma_transformer_checkpoint_to_diffusers
        keys = ["double_blocks.0.x", "single_blocks.0.x", "distilled_guidance_layer.layers.0.x"]
    else:
        model, targets, convert = _sd35m_like(), ALL_SD3, sf.convert_sd3_transformer_checkpoint_to_diffusers
        keys = ["joint_blocks.0.x", "joint_blocks.1.x", "joint_blocks.0.x_block.attn2.x", "ln_q"]
    _, kohya = _adapter_and_kohya(model, fam, targets, tmp_path)
    if family == "flux":  # diffusers' kohya-Flux loader ignores final_layer alphas: folded in
        assert {float(kohya[f"lora_unet_final_layer_{m}.alpha"]) for m in ("linear", "adaLN_modulation_1")} == {4.0}
    ref = _Reference(kohya, keys)
    back = {k.removesuffix(".weight"): v for k, v in convert(ref).items() if k.endswith(".weight")}
    assert ref.used == set(ref.delta)  # every module of the file is a module of the checkpoint
    want = _lora_deltas(model, "default")
    assert len(want) == {"flux": 30, "chroma": 24, "sd3": 37}[family]
    _assert_close({k: v for k, v in back.items() if k in want or v.abs().max() > 0}, want, family)


# ---- Qwen-Image, Z-Image, Flux.2 [klein], Wan: ComfyUI's names, diffusers' loaders -------

NEWER = ["qwenimage", "zimage", "flux2klein", "flux2", "wan"]


def _identity(checkpoint):
    """Qwen-Image's released transformer is in diffusers' layout: nothing to convert."""
    return dict(checkpoint)


def _single_file_converter(family: str):
    from diffusers.loaders import single_file_utils as sf

    return {"qwenimage": _identity, "zimage": sf.convert_z_image_transformer_checkpoint_to_diffusers,
            "flux2klein": sf.convert_flux2_transformer_checkpoint_to_diffusers,
            "flux2": sf.convert_flux2_transformer_checkpoint_to_diffusers,
            "wan": sf.convert_wan_transformer_to_diffusers}[family]


def _tiny_denoiser(path: str, fam):
    """The pipeline folder's denoiser, loaded as a training worker loads it."""
    with open(os.path.join(path, "model_index.json")) as f:
        return fam.load_component(path, json.load(f), fam.denoiser)


def _dotted(flat: str, convert, weights: set[str] | dict[str, tuple], probe=None) -> str:
    """The reference checkpoint's key for a kohya module name, as ComfyUI matches it
    (``lora_unet_`` + the key with "." → "_"): every way of putting the dots back whose
    conversion by diffusers' single-file converter lands on weights of the diffusers model.
    Several may fit (the converter accepts aliases) only if they become the same diffusers
    keys; returns one of them. ``probe``: the tensor converted (a 6 × 1 zero one by
    default); ``weights`` as a dict of shapes: the converted tensors must have them too (a
    converter that splits at fixed widths, Lumina-Image 2.0's, probed at its real ones)."""
    parts = flat.split("_")
    probe = torch.zeros(6, 1) if probe is None else probe
    found = {}
    for mask in range(2 ** (len(parts) - 1)):
        key = parts[0] + "".join(("." if mask >> i & 1 else "_") + p for i, p in enumerate(parts[1:]))
        try:
            got = {k.removesuffix(".weight"): tuple(v.shape) for k, v in convert({key + ".weight": probe}).items()}
        except (KeyError, ValueError, IndexError, NameError, RuntimeError):  # a converter's own error on a wrong split
            continue
        fits = all(weights.get(k) == sh for k, sh in got.items()) if isinstance(weights, dict) else set(got) <= weights
        if got and fits:
            found[key] = frozenset(got.items())
    assert found and len(set(found.values())) == 1, (flat, found)
    return next(iter(found))


@pytest.mark.parametrize("family", NEWER)
def test_newer_families_kohya_file_patches_comfyui_reference_checkpoint_as_the_adapter_does(
        family, tiny, tmp_path):
    """LoRA on every linear of the tiny denoiser (Wan: its patch convolution too). The kohya
    file, applied to the reference checkpoint by name as ComfyUI applies it (ΔW = up · down ·
    alpha / rank on the weight whose key, "." → "_", is the module's name) and mapped to
    diffusers by diffusers' own single-file converter (Z-Image's and Flux.2's q/k/v splits,
    Flux.2's (shift, scale) swap, Wan's renames), equals the adapter's effective weights."""
    from raylora.model.families import get

    fam = get(family)
    model = _tiny_denoiser(tiny(family), fam)
    kinds = (torch.nn.Linear, torch.nn.Conv3d)
    targets = tuple(n for n, m in model.named_modules() if isinstance(m, kinds))
    _, kohya = _adapter_and_kohya(model, fam, targets, tmp_path)
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_network_module"] == fam.kohya_network
    modules = {k.split(".")[0] for k in kohya}
    assert all(m.startswith("lora_unet_") and {f"{m}.lora_down.weight", f"{m}.lora_up.weight", f"{m}.alpha"} <= set(kohya)
               for m in modules)
    convert = _single_file_converter(family)
    weights = {k.removesuffix(".weight") for k in model.state_dict() if k.endswith(".weight")}
    weights = {k.replace(".base_layer", "") for k in weights if ".lora_" not in k}
    reference = {}
    for m in sorted(modules):
        down = kohya[f"{m}.lora_down.weight"].flatten(1).double()
        up = kohya[f"{m}.lora_up.weight"].flatten(1).double()
        delta = up @ (down @ _probe(down.shape[1])) * float(kohya[f"{m}.alpha"]) / down.shape[0]
        reference[_dotted(m.removeprefix("lora_unet_"), convert, weights) + ".weight"] = delta
    back = {k.removesuffix(".weight"): v for k, v in convert(reference).items()}
    want = _lora_deltas(model, "default")
    assert len(want) == len(targets)
    assert set(back) == set(want)  # every LoRA module is in the file, nothing else
    _assert_close(back, want, family)
    fused = {"zimage": "lora_unet_layers_0_attention_qkv", "flux2klein": "lora_unet_double_blocks_0_img_attn_qkv",
             "flux2": "lora_unet_double_blocks_0_img_attn_qkv"}
    if family in fused:  # q, k, v as one block-structured LoRA: rank 3·4, alpha 3·8
        assert kohya[f"{fused[family]}.lora_down.weight"].shape[0] == 12 and float(kohya[f"{fused[family]}.alpha"]) == 24.0


def _lumina2_reference_names(fam) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """kohya module name → [(diffusers weight, shape), ...] in the order diffusers'
    ``convert_lumina2_to_diffusers`` gives them, for LoRA on every linear of the released
    Lumina-Image 2.0 transformer (its real widths, on the meta device: the converter
    splits the fused q/k/v at 2304 : 768 : 768 rows alone). Each kohya name's dots are put
    back every way; the one whose conversion lands on the model's weights, shapes and all,
    is the reference checkpoint's key (ComfyUI's and sd-scripts' name, "." → "_")."""
    import diffusers
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    with torch.device("meta"):
        net = diffusers.Lumina2Transformer2DModel(cap_feat_dim=2304)
    linears = {n: m for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    weights = {k.removesuffix(".weight"): tuple(v.shape) for k, v in net.state_dict().items()}
    sd = {}
    for n, m in linears.items():
        sd[f"transformer.{n}.lora_A.weight"] = torch.empty(4, m.in_features, device="meta")
        sd[f"transformer.{n}.lora_B.weight"] = torch.empty(m.out_features, 4, device="meta")
    kohya = fam.kohya_state_dict(sd, {"transformer": 8.0})
    names = {}
    for m in sorted({k.split(".")[0] for k in kohya}):
        probe = torch.empty(kohya[f"{m}.lora_up.weight"].shape[0], kohya[f"{m}.lora_down.weight"].shape[1],
                            device="meta")
        key = _dotted(m.removeprefix("lora_unet_"), convert_lumina2_to_diffusers, weights, probe)
        # the converter's order: q, k, v of the fused attention.qkv
        names[m] = [(k.removesuffix(".weight"), tuple(v.shape))
                    for k, v in convert_lumina2_to_diffusers({key + ".weight": probe}).items()]
    assert sorted(k for v in names.values() for k, _ in v) == sorted(linears)  # each once
    return names


def test_lumina2_kohya_file_names_the_released_checkpoints_modules_as_the_adapter_does(tiny, tmp_path):
    """Lumina-Image 2.0's kohya file (sd-scripts' networks.lora_lumina names: "lora_unet_" +
    the released NextDiT module, q/k/v fused into attention.qkv): every module name is a
    module of the released checkpoint that diffusers' own converter maps onto the
    transformer, shapes and all; and on the tiny model (its 3 : 1 query to key/value heads,
    as the released 24 : 8), the file's ΔW split as that converter splits it equals the
    adapter's effective weights on every linear."""
    from raylora.model.families import get

    fam = get("lumina2")
    names = _lumina2_reference_names(fam)
    assert names["lora_unet_layers_0_attention_qkv"] == [
        ("layers.0.attn.to_q", (2304, 2304)), ("layers.0.attn.to_k", (768, 2304)),
        ("layers.0.attn.to_v", (768, 2304))]
    assert [k for k, _ in names["lora_unet_final_layer_adaLN_modulation_1"]] == ["norm_out.linear_1"]
    assert [k for k, _ in names["lora_unet_t_embedder_mlp_0"]] == \
        ["time_caption_embed.timestep_embedder.linear_1"]

    model = _tiny_denoiser(tiny("lumina2"), fam)
    targets = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    _, kohya = _adapter_and_kohya(model, fam, targets, tmp_path)
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_network_module"] == "networks.lora_lumina"
    back = {}
    for m in {k.split(".")[0] for k in kohya}:
        down = kohya[f"{m}.lora_down.weight"].double()
        up = kohya[f"{m}.lora_up.weight"].double()
        delta = up @ (down @ _probe(down.shape[1])) * float(kohya[f"{m}.alpha"]) / down.shape[0]
        parts = names[m]  # the released model's rows per part, scaled to the tiny's
        rows = [sh[0] for _, sh in parts]
        split = [r * delta.shape[0] // sum(rows) for r in rows]
        back.update({k: d for (k, _), d in zip(parts, delta.split(split))})
    want = _lora_deltas(model, "default")
    assert len(want) == len(targets) and set(back) == set(want)
    _assert_close(back, want, "lumina2")
    qkv = "lora_unet_layers_0_attention_qkv"  # rank 3·4, alpha 3·8
    assert kohya[f"{qkv}.lora_down.weight"].shape[0] == 12 and float(kohya[f"{qkv}.alpha"]) == 24.0


def _default_targets(fam, model):
    # Wan: diffusers reads a lora_unet_ Wan file (musubi-tuner's layout) only when it holds
    # every block's self- and cross-attention and FFN
    extra = ("ffn.net.0.proj", "ffn.net.2") if fam.name == "wan" else ()
    return fam.default_lora_targets(model) + extra


@pytest.mark.parametrize("family", NEWER)
def test_stock_pipeline_loads_newer_families_kohya_file_to_the_same_weights(family, tiny, tmp_path):
    """With the family's default targets, the pipeline's own ``load_lora_weights`` reads the
    kohya file (diffusers' converters for these layouts: alpha folded in, fused q/k/v split)
    to the same effective weights as the diffusers adapter."""
    import diffusers

    from raylora.model.families import get

    fam = get(family)
    model = _tiny_denoiser(tiny(family), fam)
    adapter, _ = _adapter_and_kohya(model, fam, _default_targets(fam, model), tmp_path)
    pipe = getattr(diffusers, fam.pipeline).from_pretrained(tiny(family))
    pipe.load_lora_weights(adapter, adapter_name="diffusers")
    pipe.load_lora_weights(str(tmp_path), weight_name="k.safetensors", adapter_name="kohya")
    want = _lora_deltas(model, "default")
    # the tiny models' blocks × their default targets (Klein: 1 double block × q/k/v/out,
    # 2 single blocks × qkv_mlp/out; Z-Image: 2 layers and a noise and a context refiner)
    assert len(want) == {"qwenimage": 2 * 4, "zimage": 4 * 4, "flux2klein": 4 + 2 * 2, "flux2": 4 + 2 * 2,
                         "wan": 2 * 10}[family]
    got = getattr(pipe, fam.denoiser)
    _assert_close(_lora_deltas(got, "diffusers"), want, f"{family}: diffusers adapter")
    _assert_close(_lora_deltas(got, "kohya"), want, f"{family}: kohya file")


def test_a_module_without_a_reference_counterpart_is_named():
    from raylora.model.families.flux import Flux
    from raylora.model.families.sd3 import SD3

    sd = {f"transformer.{m}.lora.{k}.weight": torch.zeros(4, 4) for m in
          ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.norm_q", "pos_embed.proj") for k in ("down", "up")}
    with pytest.raises(ValueError, match=r"transformer\.pos_embed\.proj, transformer\.transformer_blocks\.0\.attn\.norm_q: "
                                         r"no module of flux's reference checkpoint"):
        Flux.kohya_state_dict(sd, {"transformer": 4.0})
    with pytest.raises(ValueError, match=r"transformer\.single_transformer_blocks\.0\.proj_mlp: no module of sd3's"):
        SD3.kohya_state_dict({"transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": torch.zeros(4, 4),
                              "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": torch.zeros(4, 4)},
                             {"transformer": 4.0})


def test_export_command(dit_adapter, tmp_path, capsys):
    """``raylora export --format kohya DIR``: the family from raylora.json, else --family, else
    guessed from the keys when only one family's layout fits them; errors name the file."""
    import shutil

    from raylora.cli import main

    fam, adapter = dit_adapter
    src = os.path.join(adapter, "pytorch_lora_weights.safetensors")
    want = str(tmp_path / "want.safetensors")
    export_kohya(src, want, "", fam)
    folder = tmp_path / "run" / "adapter"
    shutil.copytree(adapter, folder)

    def run(*args):
        rc = main(["export", "--format", "kohya", *map(str, args)])
        out = capsys.readouterr()
        return rc, out.out + out.err

    # Flux: its single blocks; SD3: its CLIP-G encoder (text_encoder_2) fit no other layout
    rc, out = run(folder)
    assert rc == 0 and f"family       {fam.name} (guessed from the adapter keys)" in out
    default = tmp_path / "run" / "adapter_kohya.safetensors"  # beside the folder, as raylora train
    assert f"kohya file   {default}" in out
    assert load_file(str(default)).keys() == load_file(want).keys()
    assert all(torch.equal(v, load_file(want)[k]) for k, v in load_file(str(default)).items())

    # ss_sd_model_name: a hub id as it is; a folder or a bucket's by its last part only, as
    # sd-scripts names a local model (the file is shared: Civitai, A1111 and Forge show it)
    for base, name in (("org/base", "org/base"), ("hf://org/base@v2", "org/base"),
                       ("/home/alice/clientX/models/sd15-ft", "sd15-ft"),
                       ("s3://acme-private/clientX/sd15/", "sd15")):
        (folder / "raylora.json").write_text(json.dumps({"config": {"model": {"pretrained": base}},
                                                         "data": {"family": fam.name}}))
        rc, out = run(folder, "--out", tmp_path / "named.safetensors")
        assert rc == 0 and f"family       {fam.name} (raylora.json)" in out
        with safe_open(str(tmp_path / "named.safetensors"), framework="pt") as f:
            assert f.metadata()["ss_sd_model_name"] == name, base

    if fam.name == "sd3":  # transformer only, on attention: Flux's double blocks fit it too
        with safe_open(src, framework="pt") as f:
            save_file({k: f.get_tensor(k) for k in f.keys() if k.startswith("transformer.")},
                      str(tmp_path / "pytorch_lora_weights.safetensors"), metadata=f.metadata())
        rc, out = run(tmp_path)
        # (Flux.2's double blocks and Qwen-Image's blocks have these attention modules too)
        assert rc == 2 and "fit the kohya layouts of several families (chroma, flux, flux2, flux2klein, fluxkontext, qwenimage, qwenimageedit, sd3); " \
                           "pass --family" in out
        rc, out = run(tmp_path, "--family", "sd3")
        assert rc == 0 and "family       sd3 (--family)" in out

    rc, out = run(folder, "--family", "wan")  # a family whose layout has none of these modules
    want = {"flux": "transformer.transformer_blocks.0.attn.to_q, ",
            "sd3": "text_encoder_2.text_model.encoder.layers.0.self_attn.k_proj.lora_A.weight: no kohya name "
                   "for this component"}[fam.name]
    assert rc == 2 and want in out
    if fam.name == "flux":
        assert "no module of wan's reference checkpoint (the kohya/ComfyUI layout) corresponds" in out
    rc, out = run(folder, "--family", "nope")
    assert rc == 2 and "--family: unknown family 'nope'" in out
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for inside in (folder / "pytorch_lora_weights.safetensors", folder / "k.safetensors"):
        rc, out = run(folder, "--out", inside)  # the folder's own weights: refused
        assert rc == 2 and f"--out: {inside} is inside the adapter folder {folder}" in out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # a folder as --out: one line (was a SafetensorError traceback); a new parent is made
    rc, out = run(folder, "--family", fam.name, "--out", tmp_path)
    assert rc == 2 and f"--out: {tmp_path} is a folder; name the .safetensors file to write" in out
    rc, out = run(folder, "--family", fam.name, "--out", tmp_path / "new" / "dir" / "k.safetensors")
    assert rc == 0 and (tmp_path / "new" / "dir" / "k.safetensors").stat().st_size > 0
    os.remove(folder / "pytorch_lora_weights.safetensors")
    rc, out = run(folder)
    assert rc == 2 and f"{folder}/pytorch_lora_weights.safetensors: not found" in out


def test_an_export_without_kohya_removes_an_earlier_exports_kohya_file(adapter, tiny_model, demo_data, tmp_path):
    """Exporting again to the same output.uri without export.formats kohya left the first
    export's adapter_kohya.safetensors, of other weights, beside the new adapter/; with
    kohya it is this export's."""
    import shutil

    from raylora.checkpoint.export import export_run

    out = tmp_path / "out"
    shards = sorted(str(p) for p in __import__("pathlib").Path(demo_data).glob("*.parquet"))
    plan = {"shard_files": shards, "data_format": "parquet", "total_rows": 8, "family": "sd"}

    def export(formats: list[str], scale: float, steps: int) -> None:
        ckpt = tmp_path / f"ckpt{steps}"
        shutil.copytree(adapter, ckpt / "adapter")
        weights = ckpt / "adapter" / "pytorch_lora_weights.safetensors"
        with safe_open(str(weights), "pt") as f:
            meta, sd = f.metadata(), {k: f.get_tensor(k) * scale for k in f.keys()}
        save_file(sd, str(weights), metadata=meta)
        (ckpt / "history.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                    for s in range(1, steps + 1)))
        cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": demo_data},
                        "output": {"uri": str(out)}, "export": {"formats": formats}})
        export_run(str(ckpt), cfg, {"global_step": steps}, plan)

    export(["diffusers", "kohya"], 1.0, 6)
    first = load_file(str(out / "adapter_kohya.safetensors"))
    with safe_open(str(out / "adapter_kohya.safetensors"), "pt") as f:  # the folder's name only
        assert f.metadata()["ss_sd_model_name"] == os.path.basename(tiny_model) != tiny_model
    export(["diffusers", "kohya"], 3.0, 12)  # with kohya: this export's weights
    second = load_file(str(out / "adapter_kohya.safetensors"))
    key = next(k for k in first if "lora_up" in k)
    torch.testing.assert_close(second[key], 3.0 * first[key])
    # raylora export of the run's adapter/: the run's own file, so replaced (not refused)
    from raylora.checkpoint.kohya import export_folder

    assert export_folder(str(out / "adapter"))[0] == str(out / "adapter_kohya.safetensors")
    assert torch.equal(load_file(str(out / "adapter_kohya.safetensors"))[key], second[key])
    export(["diffusers"], 2.0, 18)
    assert sorted(os.listdir(out)) == ["adapter", "loss.png", "metrics.jsonl"]
    assert json.loads((out / "adapter" / "raylora.json").read_text())["metrics"]["steps"] == 18


def _unet_file(folder, layers: dict[str, tuple[int, int]]) -> None:
    """A diffusers adapter folder without raylora.json: rank-2 LoRA on UNet modules
    (path → (in, out) width), as diffusers' SD/SDXL LoRA scripts save it."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for path, (n_in, n_out) in layers.items():
        sd[f"unet.{path}.lora.down.weight"] = torch.randn(2, n_in, generator=g)
        sd[f"unet.{path}.lora.up.weight"] = torch.randn(n_out, 2, generator=g)
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, "pytorch_lora_weights.safetensors"))


def test_export_names_the_kohya_file_after_the_folder_and_keeps_another_adapters(tmp_path, capsys):
    """``raylora export --format kohya loras/char_a`` then ``loras/char_b`` wrote both to
    loras/adapter_kohya.safetensors: char_b's replaced char_a's without a word. Each is now
    ``<folder>_kohya.safetensors`` (a run's adapter/: adapter_kohya.safetensors); an existing
    default file is replaced only where it is the same adapter's earlier export."""
    from raylora.cli import main

    loras = tmp_path / "loras"
    layers = {"down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k": (768, 320)}
    _unet_file(loras / "char_a", layers)
    with safe_open(str(loras / "char_a" / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        other = {k: 2.0 * f.get_tensor(k) for k in f.keys()}
    for name in ("char_b", "adapter"):  # other weights than char_a's
        os.makedirs(loras / name)
        save_file(other, str(loras / name / "pytorch_lora_weights.safetensors"))

    def export(folder, *args):
        rc = main(["export", "--format", "kohya", str(folder), "--family", "sd", *map(str, args)])
        out = capsys.readouterr()
        return rc, out.out + out.err

    def up(file):  # a lora_up tensor: 2x char_a's in the other adapters' files
        return next(v for k, v in load_file(str(file)).items() if k.endswith(".lora_up.weight"))

    def same(file, ref) -> bool:  # same tensors and metadata (their order in the header varies)
        with safe_open(str(file), framework="pt") as f, safe_open(str(ref), framework="pt") as r:
            return f.metadata() == r.metadata() and f.keys() == r.keys() and all(
                torch.equal(f.get_tensor(k), r.get_tensor(k)) for k in f.keys())

    a_file, b_file = loras / "char_a_kohya.safetensors", loras / "char_b_kohya.safetensors"
    assert export(loras / "char_a") == (0, f"raylora: family       sd (--family)\nraylora: kohya file   {a_file}\n")
    a_bytes = a_file.read_bytes()
    a_ref = tmp_path / "a_ref.safetensors"
    a_ref.write_bytes(a_bytes)
    rc, out = export(loras / "char_b")
    assert rc == 0 and f"raylora: kohya file   {b_file}\n" in out
    assert a_file.read_bytes() == a_bytes  # char_a's file kept
    torch.testing.assert_close(up(b_file), 2.0 * up(a_file))
    rc, out = export(str(loras / "adapter") + "/")  # a run's folder: the name raylora train writes
    assert rc == 0 and f"raylora: kohya file   {loras / 'adapter_kohya.safetensors'}\n" in out
    assert sorted(os.listdir(loras)) == ["adapter", "adapter_kohya.safetensors", "char_a",
                                         "char_a_kohya.safetensors", "char_b", "char_b_kohya.safetensors"]

    # the same adapter again (a re-export, or after raylora train wrote it): replaced
    os.utime(a_file, (0, 0))
    assert export(loras / "char_a")[0] == 0 and a_file.stat().st_mtime > 0
    assert same(a_file, a_ref)
    # another adapter's file (here: char_b's) at char_a's default name: refused, kept
    b_bytes = b_file.read_bytes()
    a_file.write_bytes(b_bytes)
    rc, out = export(loras / "char_a")
    assert rc == 2 and out == (f"raylora: error: {a_file}: exists and is not this export of "
                               f"{loras / 'char_a'} (another adapter's kohya file, or one an "
                               "earlier raylora wrote otherwise?); pass --out FILE to write "
                               "elsewhere (or over it), or remove it\n")
    assert a_file.read_bytes() == b_bytes
    (loras / "junk_kohya.safetensors").write_text("not safetensors")
    _unet_file(loras / "junk", layers)
    assert export(loras / "junk")[0] == 2
    assert (loras / "junk_kohya.safetensors").read_text() == "not safetensors"
    # --out names the file to write: written whatever it holds
    rc, out = export(loras / "char_a", "--out", a_file)
    assert rc == 0 and same(a_file, a_ref)


def test_export_tells_sdxl_from_sd_by_the_adapters_shapes(tmp_path, capsys):
    """SD and SDXL UNets share module names, so without raylora.json an SDXL adapter's keys
    fit SD's kohya layout too: it was exported as SD 1 (ss_base_model_version sd_v1, which
    A1111/Forge hide beside SDXL checkpoints). Its shapes decide (cross-attention key/value
    input 2048 wide, attention blocks of depth > 1); where they cannot, --family is asked for."""
    from raylora.cli import main

    x = "down_blocks.2.attentions.0.transformer_blocks.{}.attn{}.{}"
    cases = {
        # SDXL, on to_k/to_v (text states 2048 wide) / without them (its blocks' depth)
        "sdxl_kv": ({x.format(0, 2, "to_k"): (2048, 1280), x.format(0, 2, "to_v"): (2048, 1280)},
                    "sdxl", "sdxl_base_v1-0"),
        "sdxl_q": ({x.format(b, 1, "to_q"): (1280, 1280) for b in range(3)}, "sdxl", "sdxl_base_v1-0"),
        # SD 1 (CLIP-L 768), SD 2 (OpenCLIP-H 1024), SD 1 without to_k/to_v (its fourth up block)
        "sd1": ({x.format(0, 2, "to_k"): (768, 1280)}, "sd", "sd_v1"),
        "sd2": ({x.format(0, 2, "to_v"): (1024, 1280)}, "sd", "sd_v2"),
        "sd1_q": ({"up_blocks.3.attentions.0.transformer_blocks.0.attn1.to_q": (320, 320)}, "sd", "sd_v1"),
    }
    for name, (layers, family, version) in cases.items():
        _unet_file(tmp_path / name, layers)
        out = tmp_path / f"{name}.safetensors"
        assert main(["export", "--format", "kohya", str(tmp_path / name), "--out", str(out)]) == 0, name
        assert f"family       {family} (guessed from the adapter keys)" in capsys.readouterr().out, name
        with safe_open(str(out), framework="pt") as f:
            assert f.metadata()["ss_base_model_version"] == version, name

    # a tiny UNet: nothing tells SD from SDXL, whose files' labels differ → --family
    _unet_file(tmp_path / "tiny", {"down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k": (64, 64)})
    assert main(["export", "--format", "kohya", str(tmp_path / "tiny"), "--out",
                 str(tmp_path / "t.safetensors")]) == 2
    err = capsys.readouterr().err
    assert ("pytorch_lora_weights.safetensors: its keys fit the kohya layouts of several families "
            "(sd, sdxl) whose files name different base models (sd: sd_v1, sdxl: sdxl_base_v1-0), "
            "and its shapes do not tell which it was trained on; pass --family") in err
    assert not (tmp_path / "t.safetensors").exists()
    assert main(["export", "--format", "kohya", str(tmp_path / "tiny"), "--family", "sdxl", "--out",
                 str(tmp_path / "t.safetensors")]) == 0
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_model_version"] == "sdxl_base_v1-0"
