"""The model-family and objective seams, for every family: detection, the flow-matching
sampler's statistics, a run that learns (held-out loss at fixed σ/t and noise drops on an
overfit batch) and an adapter that the family's stock diffusers pipeline loads and that
changes its output. One process, no Ray (the 2-worker Ray runs are test_families_cluster.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from raylora.model import families
from raylora.train.objective import (
    DynamicShift,
    FlowMatching,
    flow_loss_weights,
    flow_shift_from_scheduler,
    sample_density,
    scheduler_objective_kind,
    shift_sigmas,
)
from raylora.train.loss import denoising_loss

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of

# Those whose stock pipeline samples text to image; one that samples only from an input image
# (Qwen-Image-Edit) is compared with its pipeline's sampling in test_edit.py
# (test_denoise_with_an_input_image_is_the_stock_pipeline_call).
TEXT_TO_IMAGE = [f for f in FAMILIES if not families.get(f).reference_required]


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize("family", FAMILIES)
def test_detected_from_model_index_class_name(tiny, family):
    index = json.load(open(os.path.join(tiny(family), "model_index.json")))
    assert families.detect(index).name == family


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_card_names_every_layer_the_default_targets(tiny, family, tmp_path):
    """The card's "target modules" row, without the denoiser at hand, covers what the
    family's default attaches to (Flux.2 [klein]'s single blocks' attn.to_out, named by
    index, were missing from it)."""
    import fnmatch

    from raylora.checkpoint.export import model_card
    from raylora.config import validate
    from raylora.memory import meta_components

    fam = families.get(family)
    denoiser = getattr(meta_components(tiny(family), torch.float32), "denoiser")
    named = fam.named_lora_targets()
    assert all(any(fnmatch.fnmatch(t, n) for n in named) for t in fam.default_lora_targets(denoiser))
    cfg = validate({"model": {"pretrained": tiny(family)}, "data": {"uri": str(tmp_path)},
                    "output": {"uri": str(tmp_path / "out")}})
    assert f"| target modules | {', '.join(named)} |" in model_card(cfg, {}, {"family": family})


def test_the_model_card_names_the_trigger_words_and_the_text_encoder_lora(tmp_path):
    """The hub shows front matter's instance_prompt as the trigger words (diffusers' LoRA
    scripts write it); the call leads with the word every caption led with; text-encoder
    LoRA is a row of its own. Before, the card named neither."""
    import yaml

    from raylora.checkpoint.export import model_card
    from raylora.config import validate

    cfg = validate({"model": {"pretrained": "some/model"}, "output": {"uri": "o"},
                    "data": {"caption_prefix": "ohwx,", "sources": [
                        {"uri": "a"}, {"uri": "b", "caption_prefix": "sks"}, {"uri": "c"}]},
                    "lora": {"train_text_encoder": True, "text_encoder_lr": 5e-5}})
    card = model_card(cfg, {}, {"family": "sdxl"})
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["instance_prompt"] == "ohwx, sks" and front["base_model"] == "some/model"
    assert 'image = pipe(prompt="ohwx, your prompt"' in card
    assert "Trigger word(s), first in every caption: `ohwx`, `sks`." in card
    assert ("| text-encoder LoRA (text_encoder, text_encoder_2) | q_proj, k_proj, v_proj, "
            "out_proj, learning rate 5e-05 |") in card
    plain = model_card(validate({"model": {"pretrained": "/models/sd15"}, "data": {"uri": "d"},
                                 "output": {"uri": "o"}}), {}, {"family": "sd"})
    assert "instance_prompt" not in plain and "Trigger" not in plain and "text-encoder LoRA" not in plain
    # base_model only for a hub model: the hub refuses an upload whose card names a path
    assert "base_model" not in yaml.safe_load(plain.split("---\n")[1])
    for given, want in (("hf://org/sd@v1", "org/sd"), ("s3://b/sd15", None), ("org/sd", "org/sd")):
        card = model_card(validate({"model": {"pretrained": given}, "data": {"uri": "d"},
                                    "output": {"uri": "o"}}), {}, {"family": "sd"})
        assert yaml.safe_load(card.split("---\n")[1]).get("base_model") == want, given
    assert 'image = pipe(prompt="your prompt"' in plain


def test_the_model_cards_trigger_word_is_quoted_for_python_and_yaml():
    """A trigger word with a double quote broke the card's call (a SyntaxError); one with
    an emoji went into the front matter as JSON's ASCII escapes, which YAML (and the hub's
    ModelCard) read back as two lone surrogates."""
    import ast
    import re

    from huggingface_hub import ModelCard

    from raylora.checkpoint.export import model_card
    from raylora.config import validate

    for word in ('say "hi"', "🐱cat", "back\\slash", "nb\u00a0sp\u0085x\u2028y"):
        for edit in (False, True):
            cfg = validate({"model": {"pretrained": "org/sd"}, "output": {"uri": "o"},
                            "data": {"uri": "d", "caption_prefix": word, **(
                                {"control_images": True} if edit else {})}})
            card = model_card(cfg, {}, {"family": "sd"})
            assert ModelCard(card).data.instance_prompt == word
            code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
            prompts = [ast.literal_eval(k.value) for node in ast.walk(ast.parse(code))
                       if isinstance(node, ast.Call) for k in node.keywords if k.arg == "prompt"]
            assert prompts == [f"{word}, {'your edit' if edit else 'your prompt'}"]
    assert 'instance_prompt: "🐱cat"' in model_card(validate({
        "model": {"pretrained": "org/sd"}, "output": {"uri": "o"},
        "data": {"uri": "d", "caption_prefix": "🐱cat"}}), {}, {"family": "sd"})


def test_the_model_cards_markdown_and_python_hold_whatever_the_names_hold():
    """A trigger word with a backtick ended its code span and broke the card's line; a
    base folder with a ``"`` broke the snippet's Python; a base in object storage was
    named in ``from_pretrained``, which cannot read it; a source URI with ``|`` split the
    sources table's row; and the raylora link went to https://github.com/."""
    import ast
    import re

    from raylora.checkpoint.export import model_card
    from raylora.config import validate

    def card(pretrained, **data):
        cfg = validate({"model": {"pretrained": pretrained}, "output": {"uri": "o"}, "data": data})
        return model_card(cfg, {}, {"family": "sd", "sources": [
            {"uri": "s3://b/a|b", "rows": 3, "rows_per_epoch": 3, "share": 0.5},
            {"uri": "c", "rows": 3, "rows_per_epoch": 3, "share": 0.5}]})

    def base_arg(text):
        code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
        call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
                    and getattr(n.func, "attr", "") == "from_pretrained")
        return ast.literal_eval(call.args[0]), code

    text = card('/models/say "hi"', uri="d", caption_prefix="a`b")
    assert base_arg(text)[0] == '/models/say "hi"'
    assert "Trigger word(s), first in every caption: ``a`b``." in text
    assert "| s3://b/a\\|b | 3 | 3 | 50.0% |" in text
    assert "github.com/)" not in text and "trained with raylora on Ray Train" in text
    assert "Trigger word(s), first in every caption: `x`." in card("/m", uri="d", caption_prefix="x")
    assert "Trigger word(s), first in every caption: `` `ohwx ``." in card("/m", uri="d", caption_prefix="`ohwx")
    name, code = base_arg(card("s3://bucket/models/sd15", uri="d"))
    assert name == "path/to/a/copy/of/the/base"
    assert "# a local copy of s3://bucket/models/sd15: diffusers reads a folder or a hub id" in code


def test_the_model_cards_resolution_is_every_sources():
    """With bucketing, each source may set its resolution(s): the card showed
    data.resolution (512) for sources trained at 1024 and at 768 and 1024."""
    from raylora.checkpoint.export import model_card
    from raylora.config import validate

    def row(data):
        cfg = validate({"model": {"pretrained": "org/sdxl"}, "output": {"uri": "o"}, "data": data})
        card = model_card(cfg, {}, {"family": "sdxl"})
        return next(line for line in card.splitlines() if line.startswith("| resolution"))

    assert row({"bucketing": True, "sources": [{"uri": "a", "resolution": 1024},
                                               {"uri": "b", "resolution": [768, 1024]}]}) == (
        "| resolution, center crop, random flip | [768, 1024] (aspect buckets, step 64), "
        "False, False |")
    assert row({"bucketing": True, "resolution": [512, 768], "sources": [
        {"uri": "a"}, {"uri": "b", "resolution": 1024}]}).startswith(
        "| resolution, center crop, random flip | [512, 768, 1024] (aspect buckets")
    assert row({"uri": "a", "resolution": 640}) == (
        "| resolution, center crop, random flip | 640, False, False |")


def test_the_model_card_names_the_optimizer_and_the_settings_it_read():
    """The card showed AdamW's betas and decay for every run: a Prodigy or Adafactor
    adapter read as an AdamW one, with settings it never used."""
    from raylora.checkpoint.export import model_card
    from raylora.config import validate

    def card(**train):
        cfg = validate({"model": {"pretrained": "/m"}, "data": {"uri": "d"},
                        "output": {"uri": "o"}, "train": train})
        return model_card(cfg, {}, {"family": "sd"})

    adamw = card()
    assert "| optimizer | adamw |" in adamw and "| betas, weight decay, eps | 0.9/0.999, 0.01, 1e-08 |" in adamw
    relative = card(optimizer="adafactor", adafactor={"relative_step": True})
    assert ("| optimizer | adafactor (relative_step True, scale_parameter False, warmup_init "
            "False, clip_threshold 1, decay_rate -0.8, beta1 None, weight_decay 0, "
            "eps 1e-30/0.001) |") in relative
    assert "betas" not in relative and "learning rate (scale_lr)" not in relative
    assert "| learning rate | Adafactor's own relative step size |" in relative
    assert "base quantized" not in adamw
    cfg = validate({"model": {"pretrained": "/m", "quantize": "nf4"}, "data": {"uri": "d"},
                    "output": {"uri": "o"}})
    assert ("| base quantized while training (model.quantize, quantize_text_encoders) | nf4, none |"
            in model_card(cfg, {}, {"family": "sd"}))
    prodigy = card(optimizer="prodigy", learning_rate=1.0, prodigy={"d_coef": 0.5})
    assert "| optimizer | prodigy (d_coef 0.5, d0 1e-06," in prodigy
    assert "| learning rate (scale_lr) | 1 (False) |" in prodigy and "| betas, weight" in prodigy


def test_flux_folder_is_never_sdxl(tiny):
    # A Flux folder has text_encoder_2 / tokenizer_2 like SDXL; only _class_name decides.
    index = json.load(open(os.path.join(tiny("flux"), "model_index.json")))
    assert "text_encoder_2" in index
    assert families.detect(index).name == "flux"
    from raylora.model.load import check_model
    from raylora.storage import Storage

    info = check_model(tiny("flux"), Storage())
    assert info["family"].name == "flux" and info["scheduler_config"]["use_dynamic_shifting"]


def test_unknown_pipeline_is_named_with_the_supported_ones():
    with pytest.raises(ValueError) as exc:
        families.detect({"_class_name": "CogView4Pipeline"})
    msg = str(exc.value)
    assert "CogView4Pipeline" in msg
    for name, cls in [("flux", "FluxPipeline"), ("sd3", "StableDiffusion3Pipeline"),
                      ("qwenimage", "QwenImagePipeline"), ("sdxl", "StableDiffusionXLPipeline"),
                      ("wan", "WanPipeline")]:
        assert f"{name}: {cls}" in msg


def test_model_expert_is_required_by_a_pipeline_of_experts_and_refused_by_any_other(tiny, demo_data,
                                                                                   tmp_path, capsys):
    """Wan 2.2 A14B samples with ``transformer`` for σ ≥ ``boundary_ratio`` and
    ``transformer_2`` below it; a run trains the one ``model.expert`` names. The check every
    run makes before its workers start names the key and the folder: no expert for such a
    folder, an expert for a one-denoiser folder (Wan 2.1, SD), and a folder whose
    ``model_index.json`` names an expert it lacks. The two experts' runs share a latent
    cache entry."""
    import shutil

    from raylora.cli import main
    from raylora.config import ConfigError, validate
    from raylora.data.cache import fingerprint
    from raylora.data.plan import plan_data
    from raylora.launch import plan
    from raylora.storage import Storage

    two = tiny("wan", experts=True)

    def config(model: str, expert=None):
        return validate({"model": {"pretrained": model, "expert": expert}, "output": {"uri": str(tmp_path)},
                         "data": {"uri": demo_data, "resolution": 64, "cache": "latents",
                                  "center_crop": True}})

    def problems(model: str, expert=None) -> str:
        cfg = config(model, expert)
        try:
            plan(cfg, heldout=False)
        except ConfigError as exc:
            said = str(exc)
        else:
            said = ""
        # `raylora plan`, the pre-submit check, refuses what train refuses (it said "fits")
        job = tmp_path / "job.yaml"
        job.write_text(json.dumps(json.loads(cfg.model_dump_json(exclude_defaults=True))))
        capsys.readouterr()
        code = main(["plan", str(job), "scaling.gpu_memory_gb=80"])
        err = capsys.readouterr().err
        assert code == (2 if said else 0), (said, err)
        if "missing component" not in err:  # which plan stops at before the family's checks
            assert all(ln in err for ln in said.splitlines() if "model.expert" in ln), (said, err)
        return said

    assert problems(two, "low_noise") == problems(two, "high_noise") == ""
    low, high = config(two, "low_noise"), config(two, "high_noise")
    store = Storage()
    assert (fingerprint(low, "wan", two, plan_data(low.data, store), store)
            == fingerprint(high, "wan", two, plan_data(high.data, store), store))
    assert (f"model.expert: model.pretrained: {two} is a Wan 2.2 pipeline with two experts, "
            "transformer for σ ≥ boundary_ratio 0.875 (high-noise steps) and transformer_2 below "
            "it; a run trains one: set model.expert to high_noise or low_noise") in problems(two)
    assert (f"model.expert: low_noise: model.pretrained: {tiny('wan')} is a Wan pipeline with one "
            "transformer") in problems(tiny("wan"), "low_noise")
    assert ("model.expert: high_noise: sd pipelines have one denoiser; leave it unset"
            in problems(tiny("sd"), "high_noise"))
    lacking = tmp_path / "wan22-lacking"
    shutil.copytree(two, lacking, ignore=shutil.ignore_patterns("transformer_2"))
    assert (f"model.pretrained: {lacking}: missing component folder(s) of a wan pipeline: "
            "transformer_2") in problems(str(lacking), "low_noise")
    with pytest.raises(ValueError, match="model.expert"):
        validate({"model": {"pretrained": two, "expert": "middle"}, "data": {"uri": "d"},
                  "output": {"uri": "o"}})


def test_wan_one_timestep_per_sample_is_wan22_ti2vs_per_token_timesteps_of_a_text_prompt(tiny):
    """WanPipeline with ``expand_timesteps`` (Wan 2.2 TI2V-5B) passes a timestep per latent
    token, σ·1000 wherever no image conditions the frame, so for text-to-image all equal;
    the family passes one per sample. The transformer gives the same output for both."""
    from diffusers import WanTransformer3DModel

    tr = WanTransformer3DModel.from_pretrained(tiny("wan"), subfolder="transformer")
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 16, 1, 32, 32, generator=g), torch.randn(2, 32, 64, generator=g)
    t = torch.tensor([700.5, 120.25])
    with torch.no_grad():
        one = tr(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        per_token = tr(hidden_states=x, timestep=t[:, None].expand(2, 16 * 16),
                       encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(one, per_token, rtol=1e-5, atol=1e-5)
    assert one.abs().max() > 0.1


def test_family_config_checks_name_the_key(tiny, demo_data, tmp_path):
    from raylora.config import ConfigError, validate
    from raylora.launch import plan

    cfg = validate({"model": {"pretrained": tiny("flux")}, "output": {"uri": str(tmp_path)},
                    "data": {"uri": demo_data, "resolution": 66},
                    "train": {"snr_gamma": 5.0, "noise_offset": 0.1},
                    "lora": {"train_text_encoder": False}, "export": {"formats": ["diffusers", "kohya"]}})
    with pytest.raises(ConfigError) as exc:
        plan(cfg)
    msg = str(exc.value)
    assert "data.resolution: 66 is not a multiple of 4 (the flux latent grid" in msg
    assert "train.snr_gamma: min-SNR weighting is for DDPM models" in msg
    assert "train.noise_offset:" in msg
    assert "export.formats" not in msg  # flux has a kohya layout
    # a family module that maps no kohya layout (every one raylora ships has one)
    from raylora.launch import family_problems
    from raylora.model.families.qwenimage import QwenImage

    class Unmapped(QwenImage):
        name, kohya_export = "unmapped", False

    assert not [p for p in family_problems(cfg, QwenImage, 2, None) if p.startswith("export.formats")]
    assert "export.formats: kohya export is not available for unmapped yet; export diffusers only" in \
        family_problems(cfg, Unmapped, 2, None)
    # train.flow on a DDPM model: nothing reads it (was accepted); unknown objective: not judged
    from raylora.model.families.sd import SD

    flowed = validate({"model": {"pretrained": "m"}, "output": {"uri": "o"}, "data": {"uri": "d"},
                       "train": {"flow": {"shift": 3.0, "logit_std": 1.0}}})
    assert [p for p in family_problems(flowed, SD, 8, "epsilon") if "train.flow" in p] == [
        "train.flow.shift: applies to flow matching; sd trains with epsilon (DDPM), which "
        "reads no train.flow key; drop it"]
    assert not [p for p in family_problems(flowed, SD, 8, None) if "train.flow" in p]
    assert not [p for p in family_problems(flowed, QwenImage, 2, "flow_matching") if "train.flow" in p]
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "prediction_type": "epsilon", "snr_gamma": None, "noise_offset": 0.0})})
    with pytest.raises(ConfigError, match="train.prediction_type: epsilon does not fit flux"):
        plan(cfg)
    # cuDNN attention crashed the Flux step on an H100; eager attention calls no SDPA kernel
    flux_cudnn = cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "prediction_type": None, "sdpa_backend": "cudnn"})})
    with pytest.raises(ConfigError, match="train.sdpa_backend: cudnn is off for flux"):
        plan(flux_cudnn)
    sd_eager = flux_cudnn.model_copy(update={
        "model": cfg.model.model_copy(update={"pretrained": tiny("sd"), "attention": "eager"}),
        "data": cfg.data.model_copy(update={"resolution": 64}),
        "train": flux_cudnn.train.model_copy(update={"sdpa_backend": "flash"})})
    with pytest.raises(ConfigError, match="train.sdpa_backend: flash picks an SDPA kernel; model.attention=eager"):
        plan(sd_eager)
    # CUDA graphs need fixed shapes: a language-model caption's length changes every batch
    graphs = validate({"model": {"pretrained": tiny("flux")}, "data": {"uri": demo_data},
                       "train": {"cuda_graphs": True, "compile": "regional"},
                       "scaling": {"use_gpu": True}, "output": {"uri": str(tmp_path)}})
    refused = [p for f in FAMILIES for p in family_problems(graphs, families.get(f), 1, None)
               if p.startswith("train.cuda_graphs")]
    assert len(refused) == len(TRIMMED) and all(
        any(p.startswith(f"train.cuda_graphs: {f}'s caption embedding") for p in refused) for f in TRIMMED)
    with pytest.raises(ValueError, match="model.family"):
        validate({"model": {"pretrained": "x", "family": "cogview4"}, "data": {"uri": "d"},
                  "output": {"uri": "o"}})


# ---------------------------------------------------------------- flow-matching sampler


def test_logit_normal_density_has_the_asked_mean_and_std():
    g = torch.Generator().manual_seed(0)
    u = sample_density("logit_normal", 200_000, logit_mean=0.5, logit_std=0.8, generator=g)
    z = torch.logit(u.double())
    assert float(z.mean()) == pytest.approx(0.5, abs=0.01)
    assert float(z.std()) == pytest.approx(0.8, abs=0.01)
    assert 0 < float(u.min()) and float(u.max()) < 1


def test_mode_and_cosmap_densities_stay_in_the_unit_interval_and_differ_from_uniform():
    g = torch.Generator().manual_seed(1)
    uniform = sample_density("uniform", 100_000, generator=g)
    assert float(uniform.mean()) == pytest.approx(0.5, abs=0.01)
    for kind in ("mode", "cosmap"):
        u = sample_density(kind, 100_000, generator=torch.Generator().manual_seed(2))
        assert 0 <= float(u.min()) and float(u.max()) <= 1
    # cosmap = 1 − 1/(tan(πu/2)+1): its median is at u=0.5 → 0.5, its mean above it
    cos = sample_density("cosmap", 100_000, generator=torch.Generator().manual_seed(3))
    assert float(cos.median()) == pytest.approx(0.5, abs=0.01)
    with pytest.raises(ValueError, match="train.flow.timestep_sampling"):
        sample_density("beta", 4)


def test_static_and_dynamic_shift():
    s = torch.tensor([0.1, 0.5, 0.9])
    # SD3's shift 3: 3σ / (1 + 2σ)
    torch.testing.assert_close(shift_sigmas(s, 3.0), torch.tensor([0.3 / 1.2, 1.5 / 2.0, 2.7 / 2.8]))
    torch.testing.assert_close(shift_sigmas(s, 1.0), s)
    # Flux: μ = 0.5 at 256 image tokens, 1.15 at 4096 (a 1024 px image), linear between
    d = DynamicShift(0.5, 1.15, 256, 4096)
    assert d.mu(256) == pytest.approx(0.5) and d.mu(4096) == pytest.approx(1.15)
    assert d.mu(2176) == pytest.approx(0.825)
    got = shift_sigmas(torch.tensor([0.5]), mu=1.15)
    assert float(got) == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 1))
    # the sampled σ: 128×128 latents (1024 px Flux) → 64×64 = 4096 tokens → μ 1.15, σ shifted up
    obj = FlowMatching("uniform", dynamic=d)
    torch.manual_seed(0)
    sig = obj.sample_timesteps(torch.zeros(1, 16, 128, 128).expand(50_000, -1, -1, -1))
    assert float(sig.median()) == pytest.approx(float(shift_sigmas(torch.tensor([0.5]), mu=1.15)), abs=0.01)
    # scheduler config → shift
    assert flow_shift_from_scheduler({"shift": 3.0}) == (3.0, None)
    shift, dyn = flow_shift_from_scheduler({"use_dynamic_shifting": True, "base_shift": 0.5,
                                            "max_shift": 0.9, "max_image_seq_len": 8192})
    assert shift == 1.0 and dyn == DynamicShift(0.5, 0.9, 256, 8192)
    # Wan ships UniPC sampling flow sigmas with a static flow_shift: flow matching, shifted
    wan = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
           "use_flow_sigmas": True, "flow_shift": 5.0}
    assert scheduler_objective_kind(wan) == "flow_matching"
    assert flow_shift_from_scheduler(wan) == (5.0, None)
    # the same solver on a DDPM model (its default ε) is not
    assert scheduler_objective_kind({"_class_name": "UniPCMultistepScheduler"}) == "epsilon"
    assert flow_shift_from_scheduler({"_class_name": "UniPCMultistepScheduler"}) == (1.0, None)


@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode", "cosmap"])
def test_an_experts_sigma_range_truncates_the_density_and_shift(density):
    """A Wan 2.2 expert trains on σ in its range only, drawn from the run's density and
    shift truncated to it: the same distribution as draws over all of σ that happen to
    fall in the range (quantiles within 0.01), not the range squeezed onto (0, 1). Static
    and dynamic shift; the held-out evaluation's fixed σ lie in the range too."""
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    latents = torch.zeros(1, 16, 64, 64).expand(50_000, -1, -1, -1)
    for shift in ({"shift": 3.0}, {"dynamic": DynamicShift()}):
        full = FlowMatching(density, **shift)
        torch.manual_seed(0)
        everywhere = full.sample_timesteps(latents)
        for lo, hi in ((0.0, 0.875), (0.875, 1.0)):
            part = FlowMatching(density, sigma_range=(lo, hi), **shift)
            torch.manual_seed(1)
            sig = part.sample_timesteps(latents)
            assert sig.shape == (50_000,) and sig.dtype == torch.float32
            assert lo <= float(sig.min()) and float(sig.max()) <= hi, (shift, lo, hi)
            kept = everywhere[(everywhere >= lo) & (everywhere <= hi)]
            gap = (torch.quantile(kept, q) - torch.quantile(sig, q)).abs().max()
            assert float(gap) < 0.01, (shift, lo, hi, float(gap))
            ev = part.eval_timesteps(4, latents[:1])
            assert bool(((ev > lo) & (ev < hi)).all()) and bool((ev.diff() > 0).all())
    # no range: the draw is the one the objective always made
    torch.manual_seed(2)
    a = FlowMatching(density, shift=3.0).sample_timesteps(latents[:8])
    torch.manual_seed(2)
    torch.testing.assert_close(a, shift_sigmas(sample_density(density, 8).clamp(1e-5, 1 - 1e-5), 3.0))
    with pytest.raises(ValueError, match="sigma_range"):
        FlowMatching(density, sigma_range=(0.9, 0.2))


def test_flow_forward_process_target_and_weights():
    x, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    sig = torch.tensor([0.0, 0.5, 1.0])
    n = FlowMatching(weighting="cosmap").noised(x, eps, sig)
    torch.testing.assert_close(n.noisy[0], x[0])
    torch.testing.assert_close(n.noisy[2], eps[2])
    torch.testing.assert_close(n.noisy[1], 0.5 * x[1] + 0.5 * eps[1])
    torch.testing.assert_close(n.target, eps - x)
    torch.testing.assert_close(n.weights, 2 / (math.pi * (1 - 2 * sig + 2 * sig**2)))
    torch.testing.assert_close(flow_loss_weights("sigma_sqrt", torch.tensor([0.5])), torch.tensor([4.0]))
    assert flow_loss_weights("none", sig) is None
    # x0: the loss diffusers' SD3 scripts train by default (--precondition_outputs 1),
    # x_σ − σ·pred against x₀, is the velocity loss weighted σ²
    pred = torch.randn(3, 4, 2, 2)
    sig = torch.tensor([0.1, 0.5, 0.9])
    n = FlowMatching(weighting="x0").noised(x, eps, sig)
    s = sig.view(-1, 1, 1, 1)
    diffusers = ((n.noisy - s * pred - x) ** 2).mean()
    torch.testing.assert_close(denoising_loss(pred, n.target, n.weights), diffusers)


# ---------------------------------------------------------------- training and stock load


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_learns_and_its_stock_pipeline_loads_the_adapter(tiny, family, demo_data, tmp_path):
    from inproc import _fresh_accelerator, demo_batch, overfit
    from safetensors.torch import load_file
    from stock import stock_image_change

    from raylora.config import validate
    from raylora.model.lora import save_diffusers_adapter
    from raylora.train.setup import build_run

    model = tiny(family)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64},
                    "lora": {"rank": 8}, "train": {"learning_rate": 1e-2, "seed": 0},
                    "output": {"uri": str(tmp_path / "o")}})
    accel = _fresh_accelerator(1)
    run = build_run(cfg, accel, 30, rank=0)
    assert run.family.name == family
    assert run.parts.objective.kind == ("ddpm" if family in ("sd", "sdxl") else "flow")
    before, after = overfit(run, demo_batch(family, model, demo_data), 30)
    assert after < 0.95 * before, (before, after)

    adapter = tmp_path / "adapter"
    save_diffusers_adapter(accel.unwrap_model(run.model), str(adapter), run.family)
    keys = load_file(str(adapter / "pytorch_lora_weights.safetensors")).keys()
    assert keys and {k.split(".")[0] for k in keys} == {run.family.denoiser}

    # The family's stock pipeline, with nothing of raylora's, loads it and its image changes.
    assert stock_image_change(family, model, adapter) > 1e-3

    # raylora sample (a pipeline that samples only from an input image gets one)
    from PIL import Image

    from raylora.sample import sample

    image = None
    if run.family.reference_required:
        image = str(tmp_path / "input.png")
        Image.new("RGB", (64, 64), (200, 10, 10)).save(image)
    png = sample(model, str(adapter), "a red circle", str(tmp_path / "sample.png"), steps=2, size=64,
                 image=[image] if image else None)
    assert Image.open(png).size == (64, 64)


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_a_wan22_expert_trains_its_own_transformer_on_its_sigmas_and_loads_into_it(tiny, expert,
                                                                                   demo_data, tmp_path):
    """``model.expert`` picks the transformer a run trains (its weights, not the other
    expert's) and the σ it sees; the adapter is saved as the stock loader saves any Wan
    adapter (``transformer.`` keys) and loads into that expert only, high_noise by default
    and low_noise with ``load_into_transformer_2``, changing the stock pipeline's image.
    A preview samples with the trained expert alone."""
    from diffusers import WanTransformer3DModel
    from inproc import _fresh_accelerator, demo_batch, overfit
    from safetensors.torch import load_file
    from stock import stock_image_change

    from raylora.config import validate
    from raylora.model.lora import save_diffusers_adapter
    from raylora.train import preview as pv
    from raylora.train.setup import build_run

    model = tiny("wan", experts=True)
    component, (lo, hi) = {"high_noise": ("transformer", (0.875, 1.0)),
                           "low_noise": ("transformer_2", (0.0, 0.875))}[expert]
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32, "expert": expert},
                    "data": {"uri": demo_data, "resolution": 64},
                    "lora": {"rank": 8}, "train": {"learning_rate": 1e-2, "seed": 0},
                    "output": {"uri": str(tmp_path / "o")}})
    run = build_run(cfg, _fresh_accelerator(1), 30, rank=0)
    trained = run.accelerator.unwrap_model(run.model)
    for name, other in (("transformer", "transformer_2"), ("transformer_2", "transformer")):
        ref = WanTransformer3DModel.from_pretrained(model, subfolder=name).patch_embedding.weight
        same = torch.equal(trained.patch_embedding.weight, ref)
        assert same == (name == component), (name, component)
    torch.manual_seed(0)
    sig = run.parts.objective.sample_timesteps(torch.zeros(1, 16, 32, 32).expand(4096, -1, -1, -1))
    assert lo <= float(sig.min()) and float(sig.max()) <= hi
    before, after = overfit(run, demo_batch("wan", model, demo_data), 30)
    assert after < 0.95 * before, (before, after)

    adapter = tmp_path / "adapter"
    save_diffusers_adapter(trained, str(adapter), run.family)
    keys = load_file(str(adapter / "pytorch_lora_weights.safetensors")).keys()
    assert keys and {k.split(".")[0] for k in keys} == {"transformer"}
    assert run.family.lora_load_kwargs(expert) == ({"load_into_transformer_2": True}
                                                   if expert == "low_noise" else {})
    assert stock_image_change("wan", model, adapter, expert=expert) > 1e-3

    # raylora sample: the expert from raylora.json (none in this bare folder) or --expert
    import shutil

    from raylora.sample import load_pipeline, sample

    with pytest.raises(ValueError, match=f"--expert: --model {model} is a Wan 2.2 pipeline with two experts"):
        sample(model, str(adapter), "a red circle", str(tmp_path / "s.png"), steps=2, size=32)
    png = sample(model, str(adapter), "a red circle", str(tmp_path / "s.png"), steps=2, size=32,
                 expert=expert)
    assert os.path.getsize(png) > 0
    # One adapter per expert, each folder's raylora.json naming its expert (the other one
    # here: this adapter's weights, which fit either transformer): each into its own.
    other_expert = {"high_noise": "low_noise", "low_noise": "high_noise"}[expert]
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    for folder, e in ((adapter, expert), (other, other_expert)):
        (folder / "raylora.json").write_text(json.dumps({"config": {"model": {"expert": e}}}))
    pipe, _ = load_pipeline(model, [str(adapter), str(other)])
    assert [sum(hasattr(m, "lora_A") for _, m in getattr(pipe, c).named_modules()) > 0
            for c in ("transformer", "transformer_2")] == [True, True]
    with pytest.raises(ValueError, match="--adapter: .* train the same denoiser"):
        load_pipeline(model, [str(adapter), str(adapter)])
    # Two bare folders (no raylora.json) for a one-transformer Wan: said so, before loading
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(adapter / "pytorch_lora_weights.safetensors", bare)
    one = tiny("wan")
    with pytest.raises(ValueError, match=f"--adapter: 2 given, but --model {one} has one denoiser "
                                         r"\(transformer\); give one --adapter"):
        load_pipeline(one, [str(bare), str(bare)])
    with pytest.raises(ValueError, match="--expert: names the expert of one --adapter"):
        load_pipeline(model, [str(adapter), str(other)], expert=expert)

    pipe = pv.build_pipeline(model, run.family, trained, expert=expert)
    assert pipe.transformer is trained and pipe.transformer_2 is None
    image = pv.render(pipe, run.family, ["a red circle"], 0, 2, run.family.guidance_kwargs(), 32)[0]
    assert image.size == (32, 32)


# ---------------------------------------------------------------- guidance at sampling


@pytest.mark.parametrize("family", FAMILIES)
def test_guidance_kwargs_are_arguments_of_the_stock_pipeline_call(family):
    """What sampling, previews and class images pass for guidance: parameters of the
    family's stock ``__call__``, carrying the resolved scale (and, for Qwen-Image, one
    negative prompt per prompt)."""
    import inspect

    fam = families.get(family)
    params = inspect.signature(fam.pipeline_class().__call__).parameters
    for scale, batch in ((None, 1), (5.0, 3), (1.0, 2)):
        kw = fam.guidance_kwargs(scale, batch=batch)
        assert set(kw) <= set(params), (family, kw)
        want = fam.default_guidance_scale if scale is None else scale
        if family in QWEN:
            # true CFG needs scale > 1 and a negative prompt; at 1 there is none to encode.
            neg = {"negative_prompt": [" "] * batch} if want > 1 else {}
            assert kw == {"true_cfg_scale": want, **neg}
        elif family == "sdxl":  # the empty prompt, not its pipeline's all-zero default
            assert kw == {"guidance_scale": want, "negative_prompt": [""] * batch}
        else:
            assert kw == {"guidance_scale": want}
    # The adapter's model card shows the same call (a bare pipe("...") leaves Qwen unguided).
    import ast

    from raylora.checkpoint.export import _usage
    from raylora.config import validate

    # At the scale the run validated with, else the family's.
    for scale in (None, 0.0, 2.0):
        card = _usage(validate({"model": {"pretrained": "some/model"}, "data": {"uri": "d"},
                                "output": {"uri": "o"}, "validation": {"guidance_scale": scale}}), fam)
        line = next(x for x in card.splitlines() if x.startswith("image = pipe("))
        # pipe(...) in pipe(...).images[0] (a video pipeline's pipe(...).frames[0][0])
        call = next(n for n in ast.walk(ast.parse(line)) if isinstance(n, ast.Call))
        kw = {k.arg: k.value if k.arg == "image" else ast.literal_eval(k.value) for k in call.keywords}
        # the prompt by name: Flux2KleinPipeline's first positional parameter is an image;
        # a pipeline that samples only from an input image is shown with one
        prompt = "your edit" if fam.reference_required else "your prompt"
        assert not call.args and kw.pop("prompt") == prompt and "prompt" in params
        if fam.reference_required:
            assert ast.unparse(kw.pop("image")) == "load_image('your input image.png')" and "image" in params
        assert kw == {**fam.guidance_kwargs(scale), **fam.image_call()} and set(kw) <= set(params)
        assert line.endswith(")" + fam.image_code())


def test_qwenimage_guidance_kwargs_run_a_second_transformer_pass_per_step(tiny):
    """The stock QwenImagePipeline, through the preview renderer: the seam's call runs the
    conditional and the negative-prompt pass each step; ``guidance_scale`` alone (the call
    every family used to get) and a scale of 1 run one pass, without guidance."""
    import numpy as np
    from diffusers import QwenImagePipeline

    from raylora.train import preview as pv

    pipe = QwenImagePipeline.from_pretrained(tiny("qwenimage"))
    pipe.set_progress_bar_config(disable=True)
    rows: list[int] = []  # batch rows of each transformer call
    pipe.transformer.register_forward_pre_hook(
        lambda mod, args, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    fam, steps = families.get("qwenimage"), 3

    def passes(guidance: dict):
        rows.clear()
        image = pv.render(pipe, fam, ["a red circle"], 0, steps, guidance, 32)[0]
        return list(rows), np.asarray(image, dtype=np.float32)

    guided, img_guided = passes(fam.guidance_kwargs())
    plain, img_plain = passes({"guidance_scale": fam.default_guidance_scale})
    one, img_one = passes(fam.guidance_kwargs(1.0))
    assert guided == [1] * (2 * steps)
    assert plain == one == [1] * steps
    assert img_guided.shape == (32, 32, 3)
    np.testing.assert_array_equal(img_plain, img_one)  # both unguided, same seed
    assert np.abs(img_guided - img_plain).max() > 0  # the negative pass changes the picture


# ---------------------------------------------------------------- conditioning


def _text_length(family: str) -> int:
    """Tokens per caption for the long-context encoders: 32, or what the family's tiny
    model needs for a caption to fit after its template (tests/stock.py's PIPELINES)."""
    from stock import PIPELINES

    # QwenImage21Pipeline takes no max_sequence_length (it keeps every token): 64 holds
    # these captions whole after its system turn.
    return {"qwenimage21": 64}.get(family) or PIPELINES[family][1].get("max_sequence_length", 32)


def _pipeline_conditioning(family: str, pipe, captions: list[str]) -> dict:
    """What the stock pipeline conditions its denoiser on for ``captions`` (no guidance,
    ``_text_length`` tokens for the long-context encoders), named as raylora's ``Cond``."""
    kw = {"max_sequence_length": _text_length(family)}
    if family == "sd":
        return {"prompt_embeds": pipe.encode_prompt(captions, "cpu", 1, do_classifier_free_guidance=False)[0]}
    if family == "sdxl":
        e, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
        return {"prompt_embeds": e, "pooled_prompt_embeds": pooled}
    if family in ("flux", "fluxkontext"):
        e, pooled, _ = pipe.encode_prompt(captions, None, **kw)
        return {"prompt_embeds": e, "pooled_prompt_embeds": pooled}
    if family == "chroma":  # T5 with its mask; the transformer's mask keeps the first pad
        e, _, mask, *_ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, **kw)
        return {"prompt_embeds": e, "prompt_embeds_mask": mask}
    if family == "sd3":
        e, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False, **kw)
        return {"prompt_embeds": e, "pooled_prompt_embeds": pooled}
    if family == "qwenimage":
        e, mask = pipe.encode_prompt(captions, **kw)
        return {"prompt_embeds": e, "prompt_embeds_mask": mask}
    if family == "qwenimageedit":  # without an input image: the edit template, no picture
        e, mask = pipe.encode_prompt(captions, image=None, **kw)
        return {"prompt_embeds": e, "prompt_embeds_mask": mask}
    if family == "qwenimage21":  # every token kept: no max_sequence_length; no mask when all valid
        e, mask, _ = pipe.encode_prompt(captions)
        return {"prompt_embeds": e, "prompt_embeds_mask": mask}
    if family in ("flux2klein", "flux2"):  # 3 layers side by side, every padding position kept
        e, _ = pipe.encode_prompt(captions, **kw)
        return {"prompt_embeds": e}
    if family == "zimage":  # each caption's own tokens, at its own length
        e, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, **kw)
        return {"prompt_embeds": e}
    if family == "wan":  # UMT5's last hidden state, zero past each caption
        e, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, **kw)
        return {"prompt_embeds": e}
    if family in ("lumina2", "sana"):
        # Gemma's states at every padded position; the transformer keeps each row's first
        # mask-sum tokens alone (what raylora keeps: up to the longest caption, zero past
        # each). Sana: its __call__'s default instruction (encode_prompt's own default is
        # none), of which <bos> and its last token stay before the caption.
        if family == "sana":
            from raylora.model.families.sana import INSTRUCTION

            kw["complex_human_instruction"] = INSTRUCTION.split("\n")
        e, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, **kw)
        n = int(mask.sum(1).max())
        e, mask = e[:, :n], mask[:, :n]
        return {"prompt_embeds": e * mask.unsqueeze(-1).to(e.dtype), "prompt_embeds_mask": mask}
    raise AssertionError(f"no stock conditioning call for {family}: add one here")


def _raylora_batch(model: str, family: str, captions: list[str], size=(64, 64), references: int = 0):
    """(components, batch): ``captions`` through raylora's tokenizers (the fast backend the
    preprocess stage rebuilds, with the family's template for samples of ``references``
    input images and ``_text_length`` tokens for the long-context encoders) and SDXL's size
    columns of an uncropped image of ``size`` (h, w) px, as a worker gets them."""
    from raylora.config import validate
    from raylora.data.tokenize import CaptionTokenizer, load_specs
    from raylora.model.load import load_components
    from raylora.storage import Storage

    length = _text_length(family)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": length},
                    "data": {"uri": "d"}, "output": {"uri": "o"}})
    comps = load_components(cfg.model, torch.float32)
    n = len(captions)
    size = torch.tensor([list(size)] * n)
    batch = {"original_size": size, "target_size": size, "crop_top_left": torch.zeros_like(size)}
    for spec in load_specs(model, family, Storage(), length, references=references):
        ids, mask = CaptionTokenizer(spec).encode(captions)
        batch[spec.ids_key] = torch.from_numpy(ids)
        if spec.mask_key:
            batch[spec.mask_key] = torch.from_numpy(mask)
    return comps, batch


@pytest.mark.parametrize("family", FAMILIES)
def test_training_conditions_the_denoiser_as_the_stock_pipeline_does(tiny, family):
    """Captions through raylora's tokenizers and the family's ``encode_text`` give the
    tensors the stock pipeline's ``encode_prompt`` gives at inference: an adapter trained
    on other conditioning would be trained for inputs it never sees."""

    from stock import stock_pipeline

    model = tiny(family)
    # two lengths; the third as scraped captions come (WanPipeline cleans prompts first;
    # Flux2Pipeline deletes "[IMG]", a control token of its tokenizer)
    captions = ["a red circle", "a small blue square on the green grass",
                " a  blue\nsquare &amp; a red [IMG]circle "]
    comps, batch = _raylora_batch(model, family, captions)
    pipe = stock_pipeline(family, model)
    with torch.no_grad():
        ours = comps.family.encode_text(comps.text_encoders, batch)
        theirs = _pipeline_conditioning(family, pipe, list(captions))
    if family == "zimage":  # a list of (L_i, D): compare each caption's unpadded rows
        mask = ours.pop("prompt_embeds_mask").bool()
        ours["prompt_embeds"] = [e[m] for e, m in zip(ours["prompt_embeds"], mask)]
        assert [len(e) for e in theirs["prompt_embeds"]] == mask.sum(1).tolist()
        ours, theirs = ({f"prompt_embeds.{i}": e for i, e in enumerate(d["prompt_embeds"])}
                        for d in (ours, theirs))
    for key, want in theirs.items():
        got = ours[key]
        assert got.shape == want.shape, (key, got.shape, want.shape)
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6, msg=key)
    assert set(ours) - set(theirs) <= {"time_ids"}  # SDXL's come from the image, not the text


def test_flux2_checkpoint_whose_tokenizer_is_a_pixtral_processor_needs_no_torchvision(tiny, tmp_path):
    """FLUX.2-dev ships its tokenizer folder as a PixtralProcessor (the Mistral tokenizer
    and an image processor), which transformers 5 builds only with torchvision; the tiny
    model saves the tokenizer alone. Laid out as the release is, the folder still gives
    raylora the same tokenizer specs, and ``load_pipeline`` (previews, class images,
    ``raylora sample``) the same caption embeddings as the stock pipeline of the tiny."""
    import importlib.util
    import shutil

    from diffusers import Flux2Pipeline

    from raylora.data.tokenize import load_specs
    from raylora.model.load import check_model
    from raylora.storage import Storage

    src, dst = tiny("flux2"), tmp_path / "flux2-processor"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (dst / "model_index.json").write_text(json.dumps(index))
    (dst / "tokenizer" / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 1,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    (dst / "tokenizer" / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "patch_size": 8, "size": {"longest_edge": 32}}))
    if importlib.util.find_spec("torchvision") is None:  # the layout is the processor's
        # (diffusers 0.42 gets transformers' placeholder for the class: "cannot be loaded")
        with pytest.raises((ImportError, ValueError), match="[Pp]ixtral"):
            Flux2Pipeline.from_pretrained(str(dst))

    fam = families.get("flux2")
    assert check_model(str(dst), Storage())["family"] is fam
    assert [repr(s) for s in load_specs(str(dst), "flux2", Storage(), 64)] == \
        [repr(s) for s in load_specs(src, "flux2", Storage(), 64)]
    captions = ["a red circle", "a small blue square on the green grass"]
    ours = fam.load_pipeline(str(dst))
    with torch.no_grad():
        got, _ = ours.encode_prompt(captions, max_sequence_length=64)
        want, _ = Flux2Pipeline.from_pretrained(src).encode_prompt(captions, max_sequence_length=64)
    assert got.shape == (2, 64, 48)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_qwenimage21_reads_captions_without_torchvision_and_encodes_images_as_rgba(tiny):
    """Qwen-Image 2.1's folder names a Qwen3VLProcessor, whose video processor transformers 5
    builds only with torchvision: raylora reads its tokenizer, and hands the stock pipeline
    a caption-only processor around it, whose system turn is the one the family drops. Its
    VAE reads RGBA (the pipeline converts an image to RGBA before encoding it): the family's
    normalised latents of RGB pixels are the pipeline's of that image, opaque."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen3VLProcessor

    from raylora.model.families.qwenimage21 import TEMPLATE, system_turn
    from raylora.train.encode import vae_posterior

    model, fam = tiny("qwenimage21"), families.get("qwenimage21")
    assert json.load(open(os.path.join(model, "model_index.json")))["processor"] == \
        ["transformers", "Qwen3VLProcessor"]
    pipe = fam.load_pipeline(model)
    assert isinstance(pipe.processor, Qwen3VLProcessor)
    ids = pipe.processor.tokenizer([TEMPLATE.format("a red circle")], return_tensors="pt").input_ids
    assert system_turn(ids) == pipe._drop_idx > 3
    with pytest.raises(ValueError, match="captions alone"):
        pipe.processor(text=["x"], images=[Image.new("RGB", (32, 32))])

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    rgba = pipe.image_processor.preprocess(image.convert("RGBA"), width=64, height=64).unsqueeze(2)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        want = pipe._encode_vae_image(rgba, None)[:, :, 0]  # the posterior mean, normalised
        params = vae_posterior(fam, pipe.vae, pixels)
    mean = params[:, : params.shape[1] // 2]
    shift, scale = (torch.tensor(v).view(1, -1, 1, 1) for v in fam.latent_stats(pipe.vae.config))
    assert want.shape == (1, 16, 4, 4)
    torch.testing.assert_close((mean - shift) * scale, want, rtol=1e-5, atol=1e-5)


def test_model_system_prompt_is_lumina2s_system_prompt_in_training_cards_caches_and_sampling(
        tiny, demo_data, tmp_path):
    """model.system_prompt (Lumina-Image 2.0; diffusers' script's --system_prompt): captions
    tokenized behind it give the conditioning the stock pipeline's
    ``encode_prompt(system_prompt=...)`` gives, and a dropped caption stays bare; the model
    card's call, the class images' key and the latent cache's fingerprint carry it (the
    cache's, model.max_sequence_length too); ``raylora sample`` reads it from the adapter's
    raylora.json. A family without a system prompt refuses it, naming the key."""
    from stock import stock_pipeline

    from raylora.checkpoint.export import _usage
    from raylora.config import ModelSection, validate
    from raylora.data.cache import fingerprint
    from raylora.data.classgen import generation_key
    from raylora.data.plan import plan_data
    from raylora.data.tokenize import CaptionTokenizer, load_specs
    from raylora.launch import family_problems
    from raylora.model.load import load_components
    from raylora.sample import sample, trained_system_prompt
    from raylora.storage import Storage

    system, store = "Draw {it} well.", Storage()  # braces: a template's own, kept as text
    model, fam = tiny("lumina2"), families.get("lumina2")
    captions = ["a red circle", "a small blue square on the green grass"]
    (spec,) = load_specs(model, "lumina2", store, 64, system_prompt=system)
    (default,) = load_specs(model, "lumina2", store, 64)
    ids, mask = (torch.from_numpy(a) for a in CaptionTokenizer(spec).encode(captions + [""]))
    comps = load_components(ModelSection(pretrained=model), torch.float32)
    pipe = stock_pipeline("lumina2", model)
    with torch.no_grad():
        ours = fam.encode_text(comps.text_encoders, {"input_ids": ids[:2], "attention_mask": mask[:2]})
        e, m, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                        max_sequence_length=64, system_prompt=system)
    n = int(m.sum(1).max())
    assert n < 64 and ours["prompt_embeds_mask"].tolist() == m[:, :n].tolist()
    torch.testing.assert_close(ours["prompt_embeds"], e[:, :n] * m[:, :n, None], rtol=1e-5, atol=1e-6)
    assert pipe.tokenizer.decode(ids[0][:n], skip_special_tokens=True).startswith("Draw {it} well. <Prompt Start>")
    bare = CaptionTokenizer(default).encode([""])[0][0]
    assert ids[2].tolist() == bare.tolist() and mask[2].sum() == 1  # "" bare, whatever the prompt
    assert (CaptionTokenizer(default).encode(captions)[0] != ids[:2].numpy()).any()

    def cfg(**model_keys):
        return validate({"model": {"pretrained": model, **model_keys}, "data": {"uri": demo_data},
                         "output": {"uri": str(tmp_path / "o")}})

    plan = plan_data(cfg().data, store)
    card = _usage(cfg(system_prompt=system), fam)
    assert f"system_prompt={system!r}" in card and "system_prompt" not in _usage(cfg(), fam)
    prints = {fingerprint(cfg(**k), "lumina2", model, plan, store)
              for k in ({}, {"system_prompt": system}, {"max_sequence_length": 64})}
    assert len(prints) == 3
    class_cfg = {"data": {"uri": demo_data, "class_prompt": "a shape"}}
    keys = {generation_key(validate({**class_cfg, "model": {"pretrained": model, **k},
                                     "output": {"uri": "o"}}), "lumina2", model, store)
            for k in ({}, {"system_prompt": system})}
    assert len(keys) == 2

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "raylora.json").write_text(json.dumps({"config": {"model": {"system_prompt": system}}}))
    assert trained_system_prompt([str(tmp_path), str(tmp_path / "adapter")]) == system
    assert fam.prompt_kwargs(None) == {} and fam.prompt_kwargs(system) == {"system_prompt": system}
    assert families.get("zimage").prompt_kwargs(system) == {}
    assert not [p for p in family_problems(cfg(system_prompt=system), fam, 16, "flow_matching")
                if p.startswith("model.system_prompt")]
    assert "model.system_prompt: sd (StableDiffusionPipeline) takes no system prompt; leave it unset" in \
        family_problems(cfg(system_prompt=system), families.get("sd"), 8, "epsilon")
    with pytest.raises(ValueError, match=r"^--system-prompt: sd \(StableDiffusionPipeline\) takes no"):
        sample(tiny("sd"), str(tmp_path / "adapter"), "p", str(tmp_path / "x.png"), system_prompt=system)


@pytest.mark.parametrize("name, takes, limit", [
    ("flux", True, 512), ("chroma", True, 512), ("sd3", True, 512), ("lumina2", True, 512),
    ("qwenimage", True, 1024), ("qwenimage21", False, None), ("wan", True, None),
    ("sd", False, None)])
def test_model_max_sequence_length_reaches_sampling_and_stays_within_the_pipelines_bound(
        name, takes, limit, tmp_path):
    """A run that sets model.max_sequence_length trained on captions of that length: its
    previews, ``raylora sample`` and the card's call pass it to the stock pipeline (whose
    default is the family's). A length the pipeline refuses is refused before the run."""
    from raylora.checkpoint.export import _usage
    from raylora.config import validate
    from raylora.launch import family_problems

    fam = families.get(name)
    assert fam.length_kwargs(None) == {}
    assert fam.length_kwargs(256) == ({"max_sequence_length": 256} if takes else {})

    def cfg(n):
        return validate({"model": {"pretrained": "m", "max_sequence_length": n},
                         "data": {"uri": "d"}, "output": {"uri": str(tmp_path)}})

    assert ("max_sequence_length=256" in _usage(cfg(256), fam)) == takes
    problems = [p for p in family_problems(cfg(2048), fam, 1, None)
                if p.startswith("model.max_sequence_length")]
    assert problems == (
        # CLIP alone: the key sized nothing, and was dropped without a word
        ["model.max_sequence_length: sd (StableDiffusionPipeline) has no long-context text "
         "encoder to set it for: its CLIP text encoder reads 77 tokens of each caption; leave "
         "it unset"] if name == "sd" else [] if limit is None else [
        f"model.max_sequence_length: 2048 is more than {fam.pipeline} accepts ({limit}): "
        "the adapter could not be sampled as it trained"])
    if limit:
        assert not [p for p in family_problems(cfg(limit), fam, 1, None)
                    if p.startswith("model.max_sequence_length")]


def test_sanas_instruction_is_tokenized_read_and_dropped_as_its_pipeline_does(tiny, demo_data, tmp_path):
    """SanaPipeline writes its complex human instruction before each lower-cased caption,
    pads to the instruction's tokens + max_sequence_length − 2 and keeps <bos> and the last
    max_sequence_length − 1 positions. raylora's tokens are the pipeline's, the dropped
    instruction tokens marked in the mask (the bare "" unmarked); its conditioning equals
    ``encode_prompt`` with the pipeline's default instruction, with model.system_prompt's
    (braces kept as text), and with none (""), which the card's call names as the
    pipeline's ``complex_human_instruction``."""
    from stock import stock_pipeline

    from raylora.checkpoint.export import _usage
    from raylora.config import ModelSection, validate
    from raylora.data import tokenize
    from raylora.data.tokenize import CaptionTokenizer, load_specs
    from raylora.model.families import base
    from raylora.model.families.sana import INSTRUCTION
    from raylora.model.load import load_components
    from raylora.storage import Storage

    model, fam, store = tiny("sana"), families.get("sana"), Storage()
    assert tokenize.DROPPED == base.DROPPED == 2
    captions = ["A Red circle ", "a small blue square on the green grass"]
    pipe = stock_pipeline("sana", model)
    comps = load_components(ModelSection(pretrained=model), torch.float32)
    (default,) = load_specs(model, "sana", store, 32)
    k = len(pipe.tokenizer.encode(INSTRUCTION))
    assert default.dropped == k - 2 > 100 and default.max_length == k + 32 - 2
    ids, mask = CaptionTokenizer(default).encode(captions + [""])
    want = pipe.tokenizer([INSTRUCTION + c.lower().strip() for c in captions], padding="max_length",
                          max_length=default.max_length, truncation=True)
    assert ids[:2].tolist() == want.input_ids
    assert (mask[:2] == 2).sum(1).tolist() == [k - 2] * 2 and (mask[:2, 1:k - 1] == 2).all()
    assert ((mask[:2] > 0).astype(int)).tolist() == want.attention_mask
    assert mask[2].tolist() == [1] + [0] * (default.max_length - 1)  # "" bare: <bos> alone

    system = "Draw {it}: "
    for prompt, lines in ((None, INSTRUCTION.split("\n")), ("", []), (system, [system])):
        (spec,) = load_specs(model, "sana", store, 32, system_prompt=prompt)
        ids, mask = (torch.from_numpy(a) for a in CaptionTokenizer(spec).encode(captions))
        with torch.no_grad():
            ours = fam.encode_text(comps.text_encoders, {"input_ids": ids, "attention_mask": mask})
            e, m, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                            max_sequence_length=32, complex_human_instruction=lines)
        n = int(m.sum(1).max())
        assert n < 32 and ours["prompt_embeds_mask"].tolist() == m[:, :n].tolist(), prompt
        torch.testing.assert_close(ours["prompt_embeds"], e[:, :n] * m[:, :n, None], rtol=1e-5, atol=1e-6)
        assert fam.prompt_kwargs(prompt) == ({} if prompt is None else {"complex_human_instruction": lines})
    assert spec.dropped == len(pipe.tokenizer.encode(system)) - 2 and spec.template == "Draw {{it}}: {}"

    def card(**model_keys):
        return _usage(validate({"model": {"pretrained": model, **model_keys}, "data": {"uri": demo_data},
                                "output": {"uri": str(tmp_path / "o")}}), fam)

    assert f"complex_human_instruction={[system]!r}" in card(system_prompt=system)
    assert "complex_human_instruction=[]" in card(system_prompt="")
    assert "complex_human_instruction" not in card()


# ---------------------------------------------------------------- the denoiser call

# The guidance scale at which each stock pipeline makes one conditional denoiser pass a
# step (no classifier-free guidance): 1.0, except Z-Image's, which guides above 0.
UNGUIDED = {"zimage": 0.0}
QWEN = ("qwenimage", "qwenimage21", "qwenimageedit")  # true CFG with a negative prompt of " "
# Captions encoded by a language model and cut after the batch's longest (llm_conditioning)
TRIMMED = ("qwenimage", "qwenimage21", "qwenimageedit", "zimage", "lumina2", "sana")


def test_sdxl_samples_guidance_from_the_empty_prompt_its_dropped_captions_trained_on(tiny):
    """StableDiffusionXLPipeline without a negative prompt guides from all-zero embeddings
    (force_zeros_for_empty_prompt); dropped captions train on the empty prompt's. Sampled
    with the family's guidance arguments, its unconditional branch is what they trained."""
    from stock import stock_pipeline

    fam, model = families.get("sdxl"), tiny("sdxl")
    kwargs = fam.guidance_kwargs(5.0)
    assert kwargs == {"guidance_scale": 5.0, "negative_prompt": [""]}
    comps, batch = _raylora_batch(model, "sdxl", [""])
    pipe = stock_pipeline("sdxl", model)
    with torch.no_grad():
        ours = fam.encode_text(comps.text_encoders, batch)
        _, neg, _, neg_pooled = pipe.encode_prompt("a red square", do_classifier_free_guidance=True,
                                                   negative_prompt=kwargs["negative_prompt"])
        _, zeros, _, _ = pipe.encode_prompt("a red square", do_classifier_free_guidance=True)
    torch.testing.assert_close(neg, ours["prompt_embeds"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(neg_pooled, ours["pooled_prompt_embeds"], rtol=1e-5, atol=1e-6)
    assert not zeros.any() and ours["prompt_embeds"].abs().max() > 0.1  # what it sampled before


@pytest.mark.parametrize("family", FAMILIES)
def test_caption_dropout_trains_on_the_unconditional_prompt_the_family_samples_with(tiny, family):
    """A dropped caption is the prompt raylora's previews and model card give guidance's
    unconditional branch: " " for Qwen-Image (its negative prompt; None would turn its
    guidance off; 2.1's pipeline makes "" into " "), the pipelines' default "" for the rest."""
    import numpy as np
    from PIL import Image

    from raylora.config import DataSection
    from raylora.data.preprocess import Preprocess, StageSpec, stage_kwargs
    from raylora.data.tokenize import CaptionTokenizer, load_specs
    from raylora.storage import Storage

    fam, model = families.get(family), tiny(family)
    negative = fam.guidance_kwargs(5.0).get("negative_prompt", [""])[0]  # guided
    assert fam.empty_caption == negative == (" " if family in QWEN else "")

    from test_bad_data import png

    n, image = 40, png(Image.new("RGB", (32, 32), (200, 10, 10)))
    data = DataSection(uri="/d", resolution=32, center_crop=True, caption_dropout=0.5)
    pre = stage_kwargs("train", data, model_path=model, family=family, storage=Storage(),
                       max_sequence_length=32)
    stage = Preprocess(StageSpec(**pre))
    out = stage({"image": np.array([image] * n, dtype=object),
                 "text": np.array(["a red square"] * n, dtype=object)})
    key = fam.text[-1].ids_key
    spec = [s for s in load_specs(model, family, Storage(), 32) if s.ids_key == key][0]
    (caption, empty, bare), _ = CaptionTokenizer(spec).encode(["a red square", negative, ""])
    dropped = (out[key] == empty).all(axis=1)
    assert 0 < dropped.sum() < n and ((out[key] == caption).all(axis=1) | dropped).all()
    assert (empty != bare).any() == (family in QWEN)  # " " is its own prompt there
    # Lumina2Pipeline and SanaPipeline template the prompt, not their negative prompt: a
    # dropped caption is "" tokenized bare (<bos> alone), not the system prompt or
    # instruction with nothing after it
    templated = CaptionTokenizer(dataclasses.replace(spec, bare_empty=False)).encode([negative])[0][0]
    assert (empty != templated).any() == (not fam.text[-1].template_empty) == (family in ("lumina2", "sana"))

    # data.cache=latents: a dropped row's caption columns are what the cache's encoders give
    # the empty prompt once (caption_columns, which the driver runs for every cached run
    # with caption dropout), as the uncached stage's dropped row encodes; a kept row's are
    # not. Qwen-Image-Edit's caption embedding reads the input image: refused there.
    from raylora.data.cache import EncodeStage, caption_columns
    from raylora.data.captions import PADDED_CAPTIONS, concat_rows

    assert fam.caption_reads_images == (family == "qwenimageedit")
    assert fam.cuts_captions == (family in TRIMMED)  # as the lengths below show
    if fam.caption_reads_images:
        return
    rows = [int(np.flatnonzero(dropped)[0]), int(np.flatnonzero(~dropped)[0])]
    encoder = EncodeStage(model_path=model, family=family, dtype="float32", resolution=32)
    stage_out = encoder({k: v[rows] for k, v in out.items()})
    once = caption_columns(stage, encoder, [negative])
    assert set(once) == set(fam.caption_keys()) == set(fam.cond_keys()) - {"time_ids"}
    for k, v in once.items():
        assert len(v) == 1 and v.dtype == stage_out[k].dtype
        # A language-model caption is cut after the longest of its batch: the empty prompt
        # alone is shorter, and zero-padded where it meets the others (PADDED_CAPTIONS).
        assert (v.shape[1] < stage_out[k].shape[1]) == (k in PADDED_CAPTIONS and fam.cuts_captions)
        both = concat_rows(k, [v, stage_out[k]])
        np.testing.assert_allclose(both[0], both[1], atol=1e-5, rtol=1e-4)
    both = concat_rows("prompt_embeds", [once["prompt_embeds"], stage_out["prompt_embeds"]])
    assert not np.allclose(both[0], both[2], atol=1e-3)


@pytest.mark.parametrize("family", [f for f in TRIMMED if not families.get(f).reference_required])
def test_cached_captions_of_different_lengths_are_padded_to_the_same_prediction(tiny, family):
    """A language-model caption is cut after the longest of the batch it is encoded in, so
    cached rows encoded in different batches differ in length. Where they meet (a cache
    part, a training batch, class rows beside instance rows, the empty prompt of caption
    dropout) they are zero-padded to the longest (``PADDED_CAPTIONS``; before, joining them
    failed: a cached Qwen-Image run over captions of different lengths could not write its
    cache). Padded, a caption gives the denoiser's prediction it gives alone. Qwen-Image
    2.1's transformer puts the image after every text position, padding included
    (diffusers' QwenImage21Rope: a batch shares one layout): its denoise runs the rows of
    each caption length on their own, and a cached batch is cut back to its own longest
    caption (``cut_captions``), as it is encoded uncached."""
    from raylora.data.captions import concat_rows, cut_captions, stack_rows
    import numpy as np

    from raylora.model.families.base import Cond

    fam = families.get(family)
    captions = ["a dog", "a small red dog sitting on a green lawn under a tall old tree"]
    comps, _ = _raylora_batch(tiny(family), family, captions[:1])
    conds = []
    for c in captions:  # each caption encoded in a batch of its own, as two cache chunks
        with torch.no_grad():
            cond = fam.encode_text(comps.text_encoders, _raylora_batch(tiny(family), family, [c])[1])
        conds.append({k: cond[k].numpy() for k in fam.cond_keys()})
    short, long = (c["prompt_embeds"].shape[1] for c in conds)
    assert short < long
    joined = {k: concat_rows(k, [c[k] for c in conds]) for k in conds[0]}  # a cache part
    rows = {k: stack_rows(k, [c[k][0] for c in conds]) for k in conds[0]}  # a training batch
    for k in joined:
        np.testing.assert_array_equal(joined[k], rows[k])
        assert joined[k].shape[1] == long and not joined[k][0, short:].any()
    # The short row alone in a batch, read from the part it shares with the long one: cut,
    # it is the row encoded alone; the pair has nothing to cut.
    alone_row = cut_captions({k: v[:1] for k, v in joined.items()})
    for k in conds[0]:
        np.testing.assert_array_equal(alone_row[k], conds[0][k])
    assert cut_captions(rows) is rows
    params = fam.encode_pixels(comps.vae, torch.zeros(1, 3, 64, 64))
    torch.manual_seed(0)
    noisy = torch.randn(2, params.shape[1] // 2, *params.shape[2:])
    t = torch.full((2,), 0.5)
    net = comps.denoiser
    with torch.no_grad():
        padded = fam.denoise(net, noisy, t, Cond({k: torch.from_numpy(v) for k, v in rows.items()}),
                             guidance=1.0)
        alone = fam.denoise(net, noisy[:1], t[:1], Cond({k: torch.from_numpy(v) for k, v in conds[0].items()}),
                            guidance=1.0)
    torch.testing.assert_close(padded[:1], alone, rtol=1e-4, atol=1e-5)
    if family == "qwenimage21":  # its rows of each length run alone (the rope moves padding)
        with torch.no_grad():
            long_alone = fam.denoise(net, noisy[1:], t[1:], Cond({k: torch.from_numpy(v) for k, v
                                                                  in conds[1].items()}), guidance=1.0)
            swapped = fam.denoise(net, noisy.flip(0), t, Cond({k: torch.from_numpy(v).flip(0)
                                                               for k, v in rows.items()}), guidance=1.0)
        torch.testing.assert_close(padded[1:], long_alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(swapped, padded.flip(0), rtol=1e-4, atol=1e-5)  # order kept


@pytest.mark.parametrize("family", [f for f in TRIMMED if not families.get(f).reference_required])
def test_heldout_rows_of_different_caption_lengths_are_scored_as_each_alone(tiny, family):
    """The held-out rows are encoded in chunks of train.batch_size; a language model's
    chunks differ in length and join zero-padded (before, ``Cond.cat`` failed on them: a
    Qwen-Image, Z-Image, Lumina 2 or Sana run with held-out rows of captions of different
    lengths failed to start). Each evaluation chunk is cut back to its own longest
    caption: a row's held-out loss is the one it has evaluated alone."""
    from dataclasses import replace

    from raylora.config import validate
    from raylora.train.evaluate import heldout_loss, prepare_heldout
    from raylora.train.setup import frozen_parts

    model = tiny(family)
    captions = ["a dog", "a small red dog sitting on a green lawn under a tall old tree", "a cat"]
    comps, batch = _raylora_batch(model, family, captions)
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": _text_length(family)},
                    "data": {"uri": "/d", "resolution": 64}, "output": {"uri": "/o"}})
    parts = frozen_parts(cfg, comps, "cpu", torch.float32)
    torch.manual_seed(0)
    batch["pixel_values"] = torch.rand(len(captions), 3, 64, 64) * 2 - 1
    k = 2
    held = prepare_heldout(parts, batch, num_timesteps=k, seed=0, batch_size=1)
    together = prepare_heldout(parts, batch, num_timesteps=k, seed=0, batch_size=3)
    for key, v in together.text.items():  # chunks of 1 joined = the 3 encoded together
        torch.testing.assert_close(held.text[key], v, rtol=1e-4, atol=1e-5, msg=key)
    assert held.text["prompt_embeds_mask"].sum(1).tolist()[1] == held.text["prompt_embeds"].shape[1]
    net = comps.denoiser.eval()
    first = prepare_heldout(parts, {key: v[:1] for key, v in batch.items()}, num_timesteps=k,
                            seed=0, batch_size=1)  # the same noise: the seed's first draws
    only_first = replace(held, noisy=held.noisy[:k], timesteps=held.timesteps[:k],
                         target=held.target[:k], text_index=held.text_index[:k])
    with torch.no_grad():
        want = heldout_loss(net, first, torch.float32, batch_size=k)
        assert heldout_loss(net, only_first, torch.float32, batch_size=k) == pytest.approx(want, rel=1e-6)


def test_a_cache_part_holds_language_model_captions_of_different_lengths(tiny, tmp_path):
    """The cache's stage over captions whose encode batches differ in length (Qwen-Image,
    encoded 2 rows at a time: the short captions first): the part is written (joining the
    batches failed before), each row zero-padded past its own caption, its mask as long as
    the caption is when encoded alone."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from raylora.config import validate
    from raylora.data.cache import EncodeFiles, _stage_kwargs, _work_items, from_column
    from raylora.data.demo import make_samples
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    family, model = "qwenimage", tiny("qwenimage")
    captions = ["a dog", "a cat", "a small red dog on a green lawn under a tall old tree",
                "a black cat asleep on a sunny windowsill beside a pot of basil"]
    src = tmp_path / "src"
    src.mkdir()
    images = [png for png, _ in make_samples(len(captions), size=32)]
    pq.write_table(pa.table({"image": images, "text": captions}), src / "part-00000.parquet")
    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": str(src), "resolution": 32, "center_crop": True, "cache": "latents"},
                    "output": {"uri": str(tmp_path / "out")}})
    store = Storage()
    plan = plan_data(cfg.data, store)
    pre, enc = _stage_kwargs(cfg, model, family, store)
    items = _work_items(cfg, plan, store, 256)
    stage = EncodeFiles(cfg.data.model_dump(), [s.format for s in plan.sources],
                        [s.files for s in plan.sources], str(tmp_path / "parts"), pre, enc,
                        rows_per_part=256, encode_batch=2)
    out = stage({k: np.array([it[k] for it in items]) for k in items[0]})
    assert list(out["rows"]) == [4]
    ray.data.DataContext.get_current()  # registers the parts' tensor type
    table = pq.read_table(tmp_path / "parts" / out["name"][0])
    emb, mask = (from_column(np.concatenate([c.to_numpy() for c in table[k].chunks])).numpy()
                 for k in ("prompt_embeds", "prompt_embeds_mask"))
    alone = [stage.enc(stage.pre({"image": np.array([i], dtype=object),
                                  "text": np.array([c], dtype=object)})) for i, c in zip(images, captions)]
    lengths = [a["prompt_embeds_mask"].shape[1] for a in alone]
    assert lengths[0] < lengths[2] and emb.shape[1] == mask.shape[1] == max(lengths)
    for row, a, n in zip(range(4), alone, lengths):
        assert mask[row].sum() == a["prompt_embeds_mask"].sum() and not mask[row, n:].any()
        np.testing.assert_allclose(emb[row, :n], a["prompt_embeds"][0], atol=1e-5, rtol=1e-4)
        assert not emb[row, n:].any()


class _Probed(Exception):
    """Raised by the probe hook once it has seen what the family feeds the denoiser."""


def _flat(x) -> torch.Tensor:
    """A denoiser input or output as one vector (Z-Image's are lists of per-image tensors)."""
    return torch.cat([t.flatten() for t in x]) if isinstance(x, (list, tuple)) else x.flatten()


@pytest.mark.parametrize("family", TEXT_TO_IMAGE)
def test_training_calls_the_denoiser_as_the_stock_pipeline_does(tiny, family):
    """The family's ``denoise`` (what the training step calls) gives the denoiser the call
    the stock pipeline makes while sampling: for the latents, step and prompt of each of
    two sampling steps, the denoiser's raw output is the pipeline's. This covers what the
    family owns between latents and model: packing (2×2 tokens, Flux.2's flat tokens,
    Z-Image's lists), position ids, the timestep's scale and direction, guidance input,
    masks and micro-conditioning. The family's latent layout is read by feeding its
    ``denoise`` numbered latents and seeing where each number lands; the pipeline's latents
    are put back into that layout through the same map, and what ``denoise`` returns is
    compared through it with the prediction the pipeline steps its scheduler with. The
    image is taller than wide, so rows and columns swapped in a family's packing, position
    ids or unpacking fail it."""
    from stock import PIPELINES, stock_pipeline

    H, W = 96, 64
    model = tiny(family)
    fam = families.get(family)
    comps, batch = _raylora_batch(model, family, ["a red circle"], size=(H, W))
    pipe = stock_pipeline(family, model)
    pipe.set_progress_bar_config(disable=True)
    net = getattr(pipe, fam.denoiser)
    scale = UNGUIDED.get(family, 1.0)
    seen: list[dict] = []

    def before(mod, args, kwargs):
        seen.append({"x": args[0] if args else kwargs["hidden_states"],
                     "t": args[1] if len(args) > 1 else kwargs.get("timestep")})

    def after(mod, args, kwargs, out):
        seen[-1]["out"] = out[0]

    hooks = [net.register_forward_pre_hook(before, with_kwargs=True),
             net.register_forward_hook(after, with_kwargs=True)]
    stepped: list[torch.Tensor] = []  # the prediction each step hands the scheduler
    step = pipe.scheduler.step

    def record(model_output, *args, **kwargs):
        stepped.append(model_output)
        return step(model_output, *args, **kwargs)

    pipe.scheduler.step = record
    with torch.no_grad():
        pipe(prompt="a red circle", num_inference_steps=2, height=H, width=W, output_type="np",
             generator=torch.Generator().manual_seed(0),
             **{**PIPELINES[family][1], **fam.guidance_kwargs(scale), **fam.size_kwargs(H, W)})
        assert len(seen) == 2, "one unguided denoiser pass per step expected"
        theirs = list(seen)
        flow = scheduler_objective_kind(dict(pipe.scheduler.config)) == "flow_matching"
        cond = fam.encode_text(comps.text_encoders, batch)

        # Where each latent value lands in the denoiser's input, in raylora's layout.
        params = fam.encode_pixels(pipe.vae, torch.zeros(1, 3, H, W))
        shape = (1, params.shape[1] // 2, *params.shape[2:])
        n = math.prod(shape)

        def probe(mod, args, kwargs):
            seen.append({"x": args[0] if args else kwargs["hidden_states"]})
            raise _Probed

        h = net.register_forward_pre_hook(probe, with_kwargs=True, prepend=True)
        with pytest.raises(_Probed):
            fam.denoise(net, torch.arange(n, dtype=torch.float32).view(shape), torch.ones(1), cond,
                        guidance=scale)
        h.remove()
        where = _flat(seen.pop()["x"]).long()
        assert sorted(where.tolist()) == list(range(n))  # every latent value, once

        for i, call in enumerate(theirs):
            x = torch.empty(n)
            x[where] = _flat(call["x"]).float()
            # the objective's step: flow σ of the pipeline's schedule, else its integer step;
            # a multistep solver over flow sigmas (Wan's UniPC, Sana's DPM-Solver++) passes
            # σ·1000 floored to an integer step (Sana's as a float, times its timestep_scale
            # 1.0): its σ
            t = pipe.scheduler.sigmas[i].reshape(1) if flow else call["t"].reshape(1)
            if flow and pipe.scheduler.config.get("use_flow_sigmas"):
                t = call["t"].reshape(1).float() / 1000
            del seen[:]
            pred = fam.denoise(net, x.view(shape), t, cond, guidance=scale)
            ours = seen[0]
            assert torch.equal(_flat(ours["x"]), _flat(call["x"]))
            torch.testing.assert_close(_flat(ours["out"]), _flat(call["out"]), rtol=1e-4, atol=1e-5,
                                       msg=f"step {i}: the denoiser's output differs")
            # ...and what denoise makes of it (unpacked, sliced, negated) is the prediction
            # the pipeline steps its scheduler with, in the latents' layout.
            assert pred.shape == shape
            torch.testing.assert_close(_flat(pred).float()[where], _flat(stepped[i]).float(),
                                       rtol=1e-4, atol=1e-5, msg=f"step {i}: the prediction differs")
    for hk in hooks:
        hk.remove()


# What each stock pipeline hands its transformer for the σ of a step, from its scheduler's
# fp32 timestep σ·1000: the families whose transformer embeds the timestep as given (Flux,
# Flux.2, Qwen-Image and Chroma cast it to the latents' dtype inside the model themselves).
PIPELINE_TIMESTEP = {
    "zimage": lambda sigma, net: (1000 - sigma * 1000) / 1000,  # ZImagePipeline
    "lumina2": lambda sigma, net: 1 - sigma * 1000 / 1000,  # Lumina2Pipeline
    "sd3": lambda sigma, net: sigma * 1000,
    "wan": lambda sigma, net: sigma * 1000,
    "sana": lambda sigma, net: sigma * 1000 * net.config.timestep_scale,  # SanaPipeline
}


@pytest.mark.parametrize("family", list(PIPELINE_TIMESTEP))
def test_bf16_training_gives_the_denoiser_the_stock_pipelines_fp32_timestep(tiny, family):
    """Under bf16 the latents are bf16, the timestep is not: the stock pipeline passes it in
    fp32 and these models embed it so. Cast to bf16, Z-Image's 1 − σ would read σ = 0.001 as
    t = 1 (the clean image) and σ = 0.01 as 0.0117; SD3's σ·1000 = 997 as 996. The bf16
    model runs on it and predicts in bf16."""
    model = tiny(family)
    fam = families.get(family)
    comps, batch = _raylora_batch(model, family, ["a red circle"] * 3, size=(32, 32))
    with open(os.path.join(model, "model_index.json")) as f:
        index = json.load(f)
    net = fam.load_component(model, index, fam.denoiser, torch.bfloat16)
    sigma = torch.tensor([0.001, 0.01, 0.997])  # as the objective draws them: fp32
    with torch.no_grad():
        cond = fam.encode_text(comps.text_encoders, batch)
        cond = type(cond)({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in cond.items()})
        params = fam.encode_pixels(comps.vae, torch.zeros(1, 3, 32, 32))
        noisy = torch.randn(3, params.shape[1] // 2, *params.shape[2:]).to(torch.bfloat16)
        seen = []
        hook = net.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(args[1] if len(args) > 1 else kwargs["timestep"]),
            with_kwargs=True)
        pred = fam.denoise(net, noisy, sigma, cond)
        hook.remove()
    (t,) = seen
    want = PIPELINE_TIMESTEP[family](sigma, net)
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, want, rtol=0, atol=1e-6)
    assert pred.dtype == torch.bfloat16 and pred.shape == noisy.shape
    assert torch.isfinite(pred).all()
