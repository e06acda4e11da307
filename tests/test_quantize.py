"""Issue #21 without FSDP: a quantized frozen base (model.quantize) trains LoRA whose adapter
the unquantized stock pipeline loads; gradient checkpointing changes no number in any
family; the quantized layers' sizes (what a memory estimate reads). One process, no Ray."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raylora.config import ConfigError, validate
from raylora.model.quantize import Float8Linear, quantize_module, quantized_linear_bytes

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of
MIN = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}


def _cfg(model, demo_data, tmp_path, model_keys=None, train=None):
    return validate({"model": {"pretrained": model, "max_sequence_length": 32, **(model_keys or {})},
                     "data": {"uri": demo_data, "resolution": 64},
                     "lora": {"rank": 8},
                     "train": {"learning_rate": 1e-2, "seed": 0, **(train or {})},
                     "output": {"uri": str(tmp_path / "o")}})


def _stored_bytes(*modules) -> int:
    """Parameters and buffers of ``modules``, bitsandbytes' statistics beside the quantized
    weights included: absmax per block (+ its own), code table and offset for 4-bit, an
    fp32 scale per row for 8-bit."""
    import bitsandbytes as bnb

    out = sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
    for m in (x for module in modules for x in module.modules()):
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            out += sum(t.numel() * t.element_size() for t in (qs.absmax, qs.state2.absmax, qs.code, qs.offset))
        elif isinstance(m, bnb.nn.Linear8bitLt):
            out += 4 * m.weight.SCB.numel()
    return out


# ---------------------------------------------------------------- quantized base


@pytest.mark.parametrize("family, kind", [("sd", "nf4"), ("flux", "nf4"), ("sd", "int8")])
def test_quantized_base_trains_and_the_stock_pipeline_loads_the_adapter(tiny, family, kind,
                                                                         demo_data, tmp_path):
    import bitsandbytes as bnb
    from inproc import _fresh_accelerator, demo_batch, overfit
    from peft.tuners.lora import bnb as peft_bnb
    from safetensors.torch import load_file
    from stock import stock_image_change

    from raylora.model.lora import save_diffusers_adapter
    from raylora.train.setup import build_run

    model = tiny(family)
    cfg = _cfg(model, demo_data, tmp_path, {"quantize": kind, "quantize_text_encoders": kind})
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 25, rank=0)
    denoiser = accel.unwrap_model(run.model)
    qcls, lora_cls = ((bnb.nn.Linear4bit, peft_bnb.Linear4bit) if kind == "nf4"
                      else (bnb.nn.Linear8bitLt, peft_bnb.Linear8bitLt))
    # every linear of the denoiser and the text encoders is quantized but those the model
    # keeps in fp32 (T5's wo); LoRA sits on top
    for m in [denoiser, *run.parts.text_encoders]:
        keep = tuple(getattr(m, "_keep_in_fp32_modules", None) or ())
        plain = [n for n, x in m.named_modules()
                 if type(x) is nn.Linear and "lora_" not in n and not n.endswith(keep or ("-",))]
        assert not plain, (type(m).__name__, plain[:3])
        assert sum(isinstance(x, qcls) for x in m.modules()) > 0
    loras = [x for x in denoiser.modules() if isinstance(x, lora_cls)]
    assert loras and all(isinstance(x.get_base_layer(), qcls) for x in loras)
    assert all(p.dtype == torch.float32 for p in run.params)

    before, after = overfit(run, demo_batch(family, model, demo_data), 25)
    assert after < 0.95 * before, (before, after)

    adapter = tmp_path / "adapter"
    save_diffusers_adapter(denoiser, str(adapter), run.family)
    sd = load_file(str(adapter / "pytorch_lora_weights.safetensors"))
    # a normal adapter: only LoRA matrices in fp32, no quantization state
    ends = (".lora.down.weight", ".lora.up.weight", ".lora_A.weight", ".lora_B.weight")
    assert sd and all(k.endswith(ends) for k in sd), [k for k in sd if not k.endswith(ends)][:5]
    assert {v.dtype for v in sd.values()} == {torch.float32}

    def plain(pipe):  # the stock pipeline is plain: no quantized layer anywhere
        assert not any("bitsandbytes" in type(m).__module__
                       for m in pipe.components[run.family.denoiser].modules())

    assert stock_image_change(family, model, adapter, check_pipe=plain) > 1e-3


def test_fp8_layer_trains_lora_and_saves_the_one_byte_weight_for_backward():
    """fp8 (GPU-only in the config) is device-independent code: checked here on CPU at the
    layer level — values, gradient through the dequantized weight, peft on top."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    model.load_state_dict(ref.state_dict())
    model.requires_grad_(False)
    assert quantize_module(model, "fp8", torch.float32, "cpu") == 2
    q = model[0]
    assert isinstance(q, Float8Linear) and q.weight.dtype == torch.uint8
    # frozen parameters, not buffers (DDP broadcasts buffers every step)
    assert not list(model.buffers()) and not any(p.requires_grad for p in model.parameters())
    rel = (q.dequantized() - ref[0].weight).abs().max() / ref[0].weight.abs().max()
    assert 0 < rel < 0.07  # e4m3: 3 mantissa bits
    x = torch.randn(8, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    # backward keeps the uint8 weights, never a dequantized full-precision copy
    assert not any(t.shape in ((96, 64), (32, 96)) and t.is_floating_point() for t in saved)
    assert sum(t.dtype == torch.uint8 for t in saved) == 2
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref(xr).sum().backward()  # the input gradient goes through the dequantized weights
    assert (x.grad - xr.grad).abs().max() < 0.1 * xr.grad.abs().max()

    # a zero row and a row of tiny weights: finite in every compute dtype (fp16 rounded their
    # scale to 0 and the rows to 0/0 = NaN)
    tiny = nn.Linear(16, 4)
    with torch.no_grad():
        tiny.weight[1].zero_()
        tiny.weight[2].mul_(1e-5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = Float8Linear(tiny, dtype, "cpu").dequantized().float()
        assert torch.isfinite(w).all() and float(w[1].abs().max()) == 0.0, dtype
        assert float((w[2] - tiny.weight[2]).abs().max()) <= 0.07 * float(tiny.weight[2].abs().max())

    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights="gaussian"), model)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 4 and all(p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-2)
    target = torch.randn(8, 32)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x.detach()), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]


def test_config_and_worker_refuse_what_cannot_run(tiny_model, tmp_path):
    with pytest.raises(ConfigError) as exc:
        validate({**MIN, "model": {"pretrained": "m", "quantize": "fp8",
                                   "quantize_text_encoders": "fp8"}})
    msg = str(exc.value)
    assert "model.quantize: fp8 is for GPUs (scaling.use_gpu is false)" in msg
    assert "model.quantize_text_encoders: fp8 is for GPUs" in msg
    assert validate({**MIN, "model": {"pretrained": "m", "quantize": "fp8"},
                     "scaling": {"use_gpu": True}}).model.quantize == "fp8"
    with pytest.raises(ConfigError, match="model.quantize: Input should be"):
        validate({**MIN, "model": {"pretrained": "m", "quantize": "int4"}})
    cached = {"model": {"pretrained": "m", "quantize_text_encoders": "nf4"},
              "data": {"uri": "d", "cache": "latents", "center_crop": True}}
    with pytest.raises(ConfigError, match="model.quantize_text_encoders: has no effect with "
                                          "data.cache=latents, no validation.prompts and no "
                                          "data.class_prompt"):
        validate({**MIN, **cached})
    # with previews it quantizes what they load (test_a_cached_run_previews_with_...), and
    # with class images to generate, what the generation loads (test_prior)
    assert validate({**MIN, **cached, "validation": {"prompts": ["a"]}}).model.quantize_text_encoders == "nf4"
    assert validate({**MIN, **cached, "data": {**cached["data"], "class_prompt": "a dog"}}
                    ).model.quantize_text_encoders == "nf4"
    # a config validated for a GPU that lands on a CPU worker: refused before loading
    from raylora.model.load import load_components

    cfg = validate({**MIN, "model": {"pretrained": tiny_model, "quantize": "fp8"},
                    "scaling": {"use_gpu": True}})
    with pytest.raises(ValueError, match=r"model.quantize: fp8 is for GPUs \(this worker trains on cpu\)"):
        load_components(cfg.model, torch.float32, device="cpu")


@pytest.mark.parametrize("kind", ["nf4", "int8", "fp8"])
def test_sizes_for_a_memory_estimate(tiny, kind):
    """The memory preflight's weight bytes (raylora.memory.weight_bytes on a meta-device
    model, reading quantize's own list of layers and storage sizes) = the bytes of the
    model quantize_module swapped, bitsandbytes' statistics beside the weights included."""
    from diffusers import UNet2DConditionModel

    from raylora.memory import weight_bytes

    model = UNet2DConditionModel.from_pretrained(tiny("sd"), subfolder="unet")
    with torch.device("meta"):
        meta = UNet2DConditionModel.from_config(model.config)
    meta.requires_grad_(False)  # frozen, as raylora loads it (trainable tensors are LoRA's)
    full = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(meta) == full
    linear = [m for m in meta.modules() if type(m) is nn.Linear]
    assert quantize_module(model, kind, torch.float32, "cpu") == len(linear) > 0
    got = _stored_bytes(model)
    est = weight_bytes(meta, kind)
    assert est == got < full
    # the linears' weights are what shrinks
    assert full - est == sum(
        m.weight.numel() * 4 - quantized_linear_bytes(m.weight.shape, kind, torch.float32) for m in linear)
    assert quantized_linear_bytes((3072, 3072), "fp8", torch.bfloat16) == 3072 * 3072 + 3072 * 2
    assert quantized_linear_bytes((3072, 3072), "int8") == 3072 * 3072 + 3072 * 4
    assert quantized_linear_bytes((3072, 3072), "nf4") / 3072**2 == pytest.approx(0.5157, abs=1e-3)


# ---------------------------------------------------------------- gradient checkpointing


def _loss_and_grads(run, batch):
    """Loss and LoRA gradients (None: no gradient) of one fixed step. LoRA B starts at zero
    (the adapter is a no-op); it is made non-zero so that A's gradients, which flow
    through B, are compared too."""
    from raylora.train.step import compute_loss

    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in run.params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    torch.manual_seed(123)
    loss = compute_loss(run.model, run.parts, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in run.params]


def _same_step(plain, checkpointed):
    (l0, g0), (l1, g1) = plain, checkpointed
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert [g is None for g in g1] == [g is None for g in g0]
    assert sum(float(g.abs().sum()) for g in g0 if g is not None) > 0
    for a, b in zip(g1, g0):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_same_loss_and_lora_grads(tiny, family, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch

    from raylora.train.setup import build_run

    model = tiny(family)
    batch = demo_batch(family, model, demo_data)
    out, calls = {}, {}
    for ckpt in (False, True):
        cfg = _cfg(model, demo_data, tmp_path, train={"gradient_checkpointing": ckpt})
        accel = _fresh_accelerator(1)
        run = build_run(cfg, accel, 4, rank=0)
        # Calls of each repeated block's sub-modules during the step: a recomputed block
        # runs them again in backward (diffusers' switch, or the family's own wrapping).
        blocks = [m for m in accel.unwrap_model(run.model).modules()
                  if type(m).__name__ in run.parts.family.repeated_blocks]
        counts = [0] * len(blocks)
        for i, block in enumerate(blocks):
            for child in block.children():
                child.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        out[ckpt] = _loss_and_grads(run, batch)
        calls[ckpt] = counts
        assert all(g is not None for g in out[ckpt][1])  # every LoRA matrix of the denoiser
    # every block was recomputed once, in full
    assert calls[False] and min(calls[False]) > 0
    assert calls[True] == [2 * n for n in calls[False]]
    _same_step(out[False], out[True])


def test_gradient_checkpointing_of_a_trained_text_encoder(tiny_model, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch

    from raylora.train.setup import build_run

    batch = demo_batch("sd", tiny_model, demo_data)
    out = {}
    for ckpt in (False, True):
        cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": demo_data, "resolution": 64},
                        "lora": {"train_text_encoder": True},
                        "train": {"gradient_checkpointing": ckpt, "seed": 0},
                        "output": {"uri": str(tmp_path / "o")}})
        run = build_run(cfg, _fresh_accelerator(1), 4, rank=0)
        assert run.trained_text_encoders["text_encoder"].is_gradient_checkpointing is ckpt
        out[ckpt] = _loss_and_grads(run, batch)
        te = {id(p) for p in run.parts.text_encoder_params}
        assert sum(g is not None for p, g in zip(run.params, out[ckpt][1]) if id(p) in te) > 0
    _same_step(out[False], out[True])


def test_cached_latents_workers_hold_no_encoder(tiny_model, demo_data, tmp_path):
    """Frozen text encoders are not kept once their outputs are cached: with
    data.cache=latents a worker never loads the VAE or a text encoder."""
    from inproc import _fresh_accelerator

    from raylora.train.setup import build_run

    cfg = validate({"model": {"pretrained": tiny_model},
                    "data": {"uri": demo_data, "resolution": 64, "cache": "latents", "center_crop": True},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 4, rank=0)
    assert run.parts.vae is None and run.parts.text_encoders == []


def test_raylora_sample_loads_the_encoders_as_training_holds_them(tiny, tmp_path):
    """raylora sample: Flux.2 [dev]'s pipeline with Mistral's language model alone (the
    image equal, pixel for pixel, to the stock pipeline's with the whole
    Mistral3ForConditionalGeneration and the same adapter), and with
    --quantize-text-encoders nf4 its linears in 4 bits (another image)."""
    import bitsandbytes as bnb
    import numpy as np
    from diffusers import Flux2Transformer2DModel

    from raylora.config import LoraSection
    from raylora.model import families
    from raylora.model.lora import add_lora, save_diffusers_adapter
    from raylora.sample import load_adapter, load_pipeline

    model, fam = tiny("flux2"), families.get("flux2")
    transformer = Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer")
    add_lora(transformer, LoraSection(rank=4), fam.default_lora_targets(transformer))
    torch.manual_seed(0)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    save_diffusers_adapter(transformer, str(tmp_path / "adapter"), fam)

    def image(pipe):
        pipe.set_progress_bar_config(disable=True)
        return np.asarray(fam.images(pipe, prompt="a red circle", num_inference_steps=2, height=32,
                                     width=32, generator=torch.Generator().manual_seed(1))[0], float)

    stock = fam.load_pipeline(model)
    load_adapter(stock, fam, str(tmp_path / "adapter"))
    mine, _ = load_pipeline(model, str(tmp_path / "adapter"))
    small, _ = load_pipeline(model, str(tmp_path / "adapter"), quantize_text_encoders="nf4")
    assert type(stock.text_encoder).__name__ == "Mistral3ForConditionalGeneration"
    assert type(mine.text_encoder).__name__ == type(small.text_encoder).__name__ == "MistralModel"
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in mine.text_encoder.modules())
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in small.text_encoder.modules())
    want = image(stock)
    np.testing.assert_array_equal(image(mine), want)
    assert np.abs(image(small) - want).max() > 0


@pytest.mark.parametrize("kind", ["none", "nf4"])
def test_a_cached_run_previews_with_the_encoders_a_worker_would_hold(tiny, demo_data, tmp_path, kind):
    """With data.cache=latents a worker holds no text encoder; a preview loads them as a
    worker without the cache holds them (adapted by the family, quantized as
    model.quantize_text_encoders says), not as the stock pipeline would: for Flux.2 [dev]
    Mistral 3's 31-layer language model instead of the whole model with its vision tower
    and LM head. Unquantized, the preview is the stock encoder's, pixel for pixel."""
    import bitsandbytes as bnb
    import numpy as np
    from inproc import _fresh_accelerator
    from transformers import MistralModel

    from raylora.memory import estimate
    from raylora.train import preview as pv
    from raylora.train.setup import build_run

    model = tiny("flux2")
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32, "quantize_text_encoders": kind},
                    "data": {"uri": demo_data, "resolution": 64, "cache": "latents", "center_crop": True},
                    "validation": {"prompts": ["a red circle"]}, "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 4, rank=0)
    assert run.parts.vae is None and run.parts.text_encoders == []
    vae, encoders, tokenizers = pv.encoders_for(run.parts, model, cfg.model, "cpu")
    (enc,) = encoders
    assert type(enc) is MistralModel and len(enc.layers) == 31
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in enc.modules()) == (0 if kind == "none" else 31 * 7)
    # what the memory preflight counts for a preview is what was loaded
    loaded = _stored_bytes(enc, vae)
    est = estimate(model, cached_latents=True, previews=True, quantize_text_encoders=kind, lora_rank=8,
                   max_sequence_length=32, resolution=64, mixed_precision="no", device="cpu")
    assert est.preview == loaded

    denoiser = run.accelerator.unwrap_model(run.model)

    def image(*parts):
        pipe = pv.build_pipeline(model, run.family, denoiser, *parts)
        (img,) = pv.render(pipe, run.family, ["a red circle"], 0, 2, run.family.guidance_kwargs(None), 64)
        return pipe, np.asarray(img, dtype=np.float32)

    pipe, ours = image(vae, encoders, tokenizers)
    assert pipe.text_encoder is enc and pipe.vae is vae and ours.shape == (64, 64, 3)
    stock_pipe, stock = image()  # the folder's own: Mistral3ForConditionalGeneration, whole
    whole = stock_pipe.text_encoder
    assert type(whole).__name__ == "Mistral3ForConditionalGeneration"
    assert whole.lm_head.weight.numel() > 0 and whole.model.vision_tower is not None
    if kind == "none":
        np.testing.assert_array_equal(ours, stock)
    else:  # the quantized encoder conditions it, a little differently
        assert 0 < np.abs(ours - stock).max()


# ---------------------------------------------------------------- torch.compile


def test_int8_regional_compile_compiles_nothing_after_the_first_step(tiny, demo_data, tmp_path):
    """model.quantize: int8 under train.compile: regional. bitsandbytes' int8 layer moves its
    codes and row scales from the weight to its state in its first forward, and dynamo
    guards on ``weight.CB``: every kind of block compiled again at step 1 (graphs 2 -> 4).
    compile_denoiser puts the layers in that state first: the step's loss and LoRA
    gradients are eager's, and steps 1 and 2 compile nothing."""
    import copy
    from dataclasses import replace

    import bitsandbytes as bnb
    import torch._dynamo
    from inproc import cached_demo_batch
    from test_compile import _nonzero_adapter, same_step_as_eager
    from torch._dynamo.utils import counters

    from raylora.model.load import load_components
    from raylora.model.lora import add_lora
    from raylora.train.compile import compile_denoiser
    from raylora.train.setup import frozen_parts

    model = tiny("sd")
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32, "quantize": "int8"},
                    "data": {"uri": demo_data, "resolution": 64}, "lora": {"rank": 4},
                    "output": {"uri": str(tmp_path / "o")}})
    comps = load_components(cfg.model, torch.float32)
    torch.manual_seed(0)
    eager_params = add_lora(comps.denoiser, cfg.lora, comps.family.default_lora_targets(comps.denoiser))
    batch = cached_demo_batch(comps.family, comps, model, demo_data)
    parts = replace(frozen_parts(cfg, comps, "cpu", torch.float32), vae=None, text_encoders=[])
    eager = comps.denoiser
    _nonzero_adapter(eager)

    compiled = copy.deepcopy(eager)
    compiled_params = [p for p in compiled.parameters() if p.requires_grad]
    int8 = [m for m in compiled.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert int8 and all(m.weight.CB is not None for m in int8)  # as quantize_module leaves them
    torch._dynamo.reset()
    counters.clear()
    compile_denoiser(compiled, "regional", comps.family.repeated_blocks, fullgraph=True,
                     backend="aot_eager")

    graphs = None
    for step in range(3):
        same_step_as_eager(eager, compiled, parts, eager_params, compiled_params, batch, step)
        now = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
        if step == 0:
            graphs = now
            assert graphs[0] == 2  # the tiny UNet's two kinds of transformer block
        else:
            assert now == graphs, f"step {step} compiled again: {now} after {graphs}"
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_a_linear_tied_to_another_module_is_not_quantized():
    """A tied LM head (Flux.2 [klein]'s Qwen3, tie_word_embeddings) shares its weight with
    the embedding: quantizing it broke the tie (a 4-bit copy beside the full embedding,
    more bytes than none) and the memory estimate counted the shared tensor once."""
    from torch import nn

    from raylora.model.quantize import quantizable, quantize_module

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.proj = nn.Linear(32, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight  # tied

    lm = LM()
    assert [name for name, _ in quantizable(lm)] == ["proj"]
    assert quantize_module(lm, "nf4", torch.float32, "cpu") == 1
    assert lm.head.weight is lm.embed.weight and type(lm.head) is nn.Linear
