import torch
from diffusers import DDPMScheduler

from raylora.train.loss import denoising_loss, diffusion_target, sample_timesteps


def _sched(pred="epsilon"):
    return DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", prediction_type=pred
    )


def test_epsilon_target_is_the_noise():
    s = _sched()
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    assert torch.equal(diffusion_target(s, x0, noise, t, "epsilon"), noise)


def test_v_prediction_target_matches_closed_form_and_scheduler():
    s = _sched("v_prediction")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([0, 499, 999])
    v = diffusion_target(s, x0, noise, t, "v_prediction")
    ab = s.alphas_cumprod[t].view(-1, 1, 1, 1)
    expected = ab.sqrt() * noise - (1 - ab).sqrt() * x0
    torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, s.get_velocity(x0, noise, t))


def test_add_noise_is_the_forward_process():
    s = _sched()
    x0, noise = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    t = torch.tensor([5, 700])
    ab = s.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(s.add_noise(x0, noise, t), ab.sqrt() * x0 + (1 - ab).sqrt() * noise)


def test_unknown_prediction_type_named():
    import pytest

    with pytest.raises(ValueError, match="train.prediction_type"):
        diffusion_target(_sched(), torch.zeros(1), torch.zeros(1), torch.zeros(1), "sample")


def test_denoising_loss_is_fp32_mse():
    pred = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    target = torch.tensor([[0.0, 2.0], [1.0, 4.0]])
    loss = denoising_loss(pred, target)
    assert loss.dtype == torch.float32
    assert loss.item() == (1.0 + 0 + 4.0 + 0) / 4


def test_timesteps_uniform_integers_in_range():
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(20000, 1000, "cpu", generator=g)
    assert t.dtype == torch.int64 and t.shape == (20000,)
    assert t.min().item() == 0 and t.max().item() == 999
    # Uniform: each quarter of [0, 1000) gets ~25% of the draws.
    counts = torch.bincount(t // 250, minlength=4).float() / len(t)
    assert torch.all((counts - 0.25).abs() < 0.02), counts


def test_snr_and_min_snr_weights_match_the_closed_form_and_diffusers():
    from diffusers.training_utils import compute_snr

    from raylora.train.loss import min_snr_weights, snr

    s = _sched()
    t = torch.tensor([0, 10, 250, 500, 999])
    ab = s.alphas_cumprod[t].double()
    expected = (ab / (1 - ab)).float()
    torch.testing.assert_close(snr(s, t), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(snr(s, t), compute_snr(s, t).float(), rtol=1e-5, atol=0)
    gamma = 5.0
    e = expected
    torch.testing.assert_close(min_snr_weights(e, gamma, "epsilon"), torch.minimum(e, torch.tensor(gamma)) / e)
    torch.testing.assert_close(min_snr_weights(e, gamma, "v_prediction"), torch.minimum(e, torch.tensor(gamma)) / (e + 1))
    w = min_snr_weights(e, gamma, "epsilon")
    # Low-noise timesteps (SNR > γ) are down-weighted; high-noise ones keep weight 1.
    assert w[0] < 0.01 and w[-1] == 1.0
    # Zero terminal SNR (rescale_betas_zero_snr): SNR 0 at t = T−1, weight 1 (the limit), not 0/0.
    zero = torch.tensor([0.0, 1e-6, 10.0])
    assert min_snr_weights(zero, gamma, "epsilon").tolist() == [1.0, 1.0, 0.5]
    assert min_snr_weights(zero, gamma, "v_prediction")[0] == 0.0


def test_weighted_loss_is_the_mean_of_weighted_per_sample_mse():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    w = torch.tensor([0.5, 1.0, 2.0])
    per = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(denoising_loss(pred, target, w), (per * w).mean())
    torch.testing.assert_close(denoising_loss(pred, target, torch.ones(3)), denoising_loss(pred, target))


def test_noise_offset_adds_a_per_channel_constant():
    from raylora.train.loss import offset_noise

    noise = torch.zeros(2, 4, 8, 8)
    assert offset_noise(noise, 0.0) is noise
    torch.manual_seed(0)
    out = offset_noise(noise, 0.1)
    torch.manual_seed(0)
    shift = torch.randn(2, 4, 1, 1)
    torch.testing.assert_close(out, 0.1 * shift.expand(2, 4, 8, 8))
    assert out[0, 0].unique().numel() == 1  # constant over the spatial dims


# Playground v2.5's scheduler/scheduler_config.json and VAE statistics (an SDXL pipeline,
# EDM-trained, whose VAE latents are normalised per channel)
PLAYGROUND_SCHEDULER = {
    "_class_name": "EDMDPMSolverMultistepScheduler", "_diffusers_version": "0.27.0.dev0",
    "algorithm_type": "dpmsolver++", "dynamic_thresholding_ratio": 0.995, "euler_at_final": False,
    "final_sigmas_type": "zero", "lower_order_final": True, "num_train_timesteps": 1000,
    "prediction_type": "epsilon", "rho": 7.0, "sample_max_value": 1.0, "sigma_data": 0.5,
    "sigma_max": 80.0, "sigma_min": 0.002, "solver_order": 2, "solver_type": "midpoint",
    "thresholding": False}
PLAYGROUND_VAE = {"latents_mean": [-1.6574, 1.886, -1.383, 2.5155],
                  "latents_std": [8.4927, 5.9022, 6.5498, 5.2299], "scaling_factor": 0.5}


def _playground_layout(tiny_sdxl: str, dest) -> str:
    """A copy of the tiny SDXL laid out as Playground v2.5 ships: EDM scheduler, VAE
    latents_mean / latents_std, scaling 0.5."""
    import json
    import shutil

    shutil.copytree(tiny_sdxl, dest)

    def edit(name, change):
        path = dest / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    edit("scheduler/scheduler_config.json", lambda _: PLAYGROUND_SCHEDULER)
    edit("model_index.json", lambda i: {**i, "scheduler": ["diffusers", PLAYGROUND_SCHEDULER["_class_name"]]})
    edit("vae/config.json", lambda v: {**v, **PLAYGROUND_VAE})
    return str(dest)


def test_an_edm_sdxl_is_refused_before_ray_and_real_ddpm_schedulers_are_not(tiny, demo_data, tmp_path):
    """Playground v2.5 is a StableDiffusionXLPipeline (so: sdxl) trained with EDM; DDPM
    training on DDPMScheduler's default β table is not its objective. `raylora plan` and
    `train` (launch.plan) refuse it; the worker's build_objective too."""
    import json
    import re

    import pytest

    from raylora.config import ConfigError, validate
    from raylora.launch import family_problems, plan, resolve_paths
    from raylora.model import families
    from raylora.train.setup import build_objective

    model = _playground_layout(tiny("sdxl"), tmp_path / "pg25")
    cfg = resolve_paths(validate({"model": {"pretrained": model},
                                  "data": {"uri": demo_data, "resolution": 64},
                                  "train": {"max_steps": 2}, "output": {"uri": str(tmp_path / "out")}}))
    with pytest.raises(ConfigError) as err:
        plan(cfg)
    edm = [p for p in err.value.problems if "EDM" in p]
    assert len(edm) == 1, err.value.problems
    # the class is named where launch.plan hands family_problems the scheduler config
    assert re.fullmatch(r"model.pretrained: its scheduler( \(EDMDPMSolverMultistepScheduler\))? is "
                        r"an EDM one \(σ-parameterised, as Playground v2.5's\): raylora trains DDPM "
                        r"\(ε / v-prediction\) and flow-matching models and does not do EDM "
                        r"training yet", edm[0]), edm[0]
    from raylora.train.objective import schedule_problem, scheduler_objective_kind

    assert scheduler_objective_kind(PLAYGROUND_SCHEDULER) == "edm"  # not its "epsilon"
    # with the config at hand, the class is named; a prediction_type override changes nothing
    sdxl = families.get("sdxl")
    for pred in (None, "epsilon", "v_prediction"):
        c = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prediction_type": pred})})
        got = family_problems(c, sdxl, 8, "edm", PLAYGROUND_SCHEDULER)
        assert got[0].startswith("model.pretrained: its scheduler (EDMDPMSolverMultistepScheduler) is an EDM one")
        assert len(got) == 1, got
    with pytest.raises(ValueError, match=r"EDMDPMSolverMultistepScheduler\) is an EDM one"):
        build_objective(cfg, sdxl, PLAYGROUND_SCHEDULER)
    # any EDM scheduler; a DDPM-family config with no β key at all (a β table guessed)
    assert "EDMEulerScheduler" in schedule_problem({"_class_name": "EDMEulerScheduler", "sigma_min": 0.002})
    assert "has none of beta_start, beta_end, beta_schedule, trained_betas" in schedule_problem(
        {"_class_name": "EulerDiscreteScheduler", "prediction_type": "epsilon"})
    # Not refused: the real SD / SDXL samplers' configs (β keys as their repos ship them),
    # the tiny models' (SD's DDPM, SDXL's Euler, Flux's flow matching), a hub id unread.
    real = [{"_class_name": "PNDMScheduler", "beta_start": 0.00085, "beta_end": 0.012,  # SD 1.5
             "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "skip_prk_steps": True},
            {"_class_name": "EulerDiscreteScheduler", "beta_start": 0.00085, "beta_end": 0.012,  # SDXL
             "beta_schedule": "scaled_linear", "interpolation_type": "linear", "timestep_spacing": "leading"},
            {"_class_name": "DDIMScheduler", "beta_start": 0.00085, "beta_end": 0.012,  # SD 2.1
             "beta_schedule": "scaled_linear", "prediction_type": "v_prediction"},
            {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}]  # SD3
    for fam in ("sd", "sdxl", "flux"):
        with open(f"{tiny(fam)}/scheduler/scheduler_config.json") as f:
            real.append(json.load(f))
    assert [schedule_problem(c) for c in real] == [None] * len(real)
    assert schedule_problem(None, None) is None and schedule_problem(None, "epsilon") is None
    assert not [p for p in family_problems(cfg, sdxl, 8, "epsilon", real[1]) if "scheduler" in p]


def test_sdxl_latents_mean_std_normalise_as_the_sdxl_pipeline_decodes(tiny, tmp_path):
    """A VAE with latents_mean / latents_std (Playground v2.5): training latents are
    (z − mean)·scaling/std per channel, which StableDiffusionXLPipeline's decode
    (x·std/scaling + mean) turns back into z; without them, z·scaling as before."""
    import pytest
    from diffusers import AutoencoderKL

    from raylora.model import families
    from raylora.train.encode import sample_latents

    sdxl = families.get("sdxl")
    vae_config = AutoencoderKL.load_config(_playground_layout(tiny("sdxl"), tmp_path / "pg25"),
                                           subfolder="vae")  # as model.load reads it
    shift, scale = sdxl.latent_stats(vae_config)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 8, 8, generator=g) * 6 + 1
    # posterior parameters (mean ‖ logvar) whose mean is z: the cache's and the VAE's layout
    x = sample_latents(torch.cat([z, torch.zeros_like(z)], 1), shift, scale, sample=False)
    mean = torch.tensor(PLAYGROUND_VAE["latents_mean"]).view(1, 4, 1, 1)
    std = torch.tensor(PLAYGROUND_VAE["latents_std"]).view(1, 4, 1, 1)
    # diffusers' train_dreambooth_lora_sdxl.py: (z − mean) · scaling_factor / std
    torch.testing.assert_close(x, (z - mean) * 0.5 / std, rtol=1e-6, atol=1e-6)
    # pipeline_stable_diffusion_xl.py's decode: latents * latents_std / scaling_factor + latents_mean
    torch.testing.assert_close(x * std / 0.5 + mean, z, rtol=1e-5, atol=1e-5)
    assert x.std().item() == pytest.approx(((z - mean) * 0.5 / std).std().item(), rel=1e-5)
    # the pipeline uses both or neither: SD's plain scaling otherwise (SDXL's own VAE)
    assert sdxl.latent_stats({"scaling_factor": 0.13025, "latents_mean": None, "latents_std": None}) == (0.0, 0.13025)
    assert sdxl.latent_stats({"scaling_factor": 0.5, "latents_mean": PLAYGROUND_VAE["latents_mean"]}) == (0.0, 0.5)
    # SD's pipeline decodes with scaling_factor alone, whatever the VAE config holds
    assert families.get("sd").latent_stats({**vae_config}) == (0.0, 0.5)


def test_the_flow_forward_process_under_bf16_is_the_fp32_sigma_rounded_once():
    """bf16 latents: x_σ = (1−σ)·x₀ + σ·ε in fp32, rounded once; not on σ rounded to bf16,
    which toward σ = 1 put the clean latents' share 1 − σ far off the σ the model is told."""
    from raylora.train.objective import FlowMatching

    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.001, 0.3, 0.7, 0.9, 0.97, 0.98, 0.99, 0.995])
    n = len(sigma)
    lat = torch.randn(n, 16, 64, 64, generator=g).to(torch.bfloat16)
    noise = torch.randn(n, 16, 64, 64, generator=g).to(torch.bfloat16)
    out = FlowMatching().noised(lat, noise, sigma)
    assert out.noisy.dtype == torch.bfloat16 and out.target.dtype == torch.float32
    assert out.timestep is sigma
    s, x0, eps = sigma.double().view(-1, 1, 1, 1), lat.double(), noise.double()
    exact = (1 - s) * x0 + s * eps
    terms = (1 - s) * x0.abs() + s * eps.abs()
    assert ((out.noisy.double() - exact).abs() <= exact.abs() * 2**-8 + terms * 2**-21).all()
    # the clean latents' share (least squares on x₀ of what is left after σ·ε) is 1 − σ
    share = ((out.noisy.double() - s * eps) * x0).sum((1, 2, 3)) / (x0 ** 2).sum((1, 2, 3))
    rel = (share / (1 - sigma.double()) - 1).abs()
    assert rel.max().item() < 0.005, (rel.argmax().item(), rel.max().item())  # was 0.24 at 0.995
    torch.testing.assert_close(out.target.double(), eps - x0, rtol=2**-23, atol=0)  # one fp32 rounding


def test_the_ddpm_forward_process_under_bf16_is_the_fp32_schedule_rounded_once():
    """bf16 latents (mixed_precision bf16): the noisy input is the fp32 forward process
    rounded to bf16 once, not one computed on ᾱ rounded to bf16 (1.0 at t=0,1: no noise)."""
    from raylora.train.objective import DDPM

    obj = DDPM(_sched("v_prediction"), "v_prediction")
    g = torch.Generator().manual_seed(0)
    n = obj.num_train_timesteps
    lat = torch.randn(n, 4, 8, 8, generator=g).to(torch.bfloat16)
    noise = torch.randn(n, 4, 8, 8, generator=g).to(torch.bfloat16)
    t = torch.arange(n)
    out = obj.noised(lat, noise, t)
    assert not (out.noisy[:2] == lat[:2]).flatten(1).all(1).any()  # t=0,1: noised (was: clean)
    assert out.noisy.dtype == torch.bfloat16 and out.target.dtype == torch.float32
    ab = obj.scheduler.alphas_cumprod.double().view(-1, 1, 1, 1)
    x0, eps = lat.double(), noise.double()
    exact = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
    # within bf16's rounding of the result (half an ulp: 2⁻⁸ relative at most), after the
    # fp32 sum's own rounding, a few ulps of its terms: where they cancel (|exact| 4e-6
    # from terms near 1) that is larger than the result's half ulp, and how large depends
    # on the CPU's vector code (a clean-clone run on another machine missed by 2.8e-8).
    terms = ab.sqrt() * x0.abs() + (1 - ab).sqrt() * eps.abs()
    assert ((out.noisy.double() - exact).abs() <= exact.abs() * 2**-8 + terms * 2**-21).all()
    # the noise level each step mixed in (least squares on ε) is the schedule's sqrt(1−ᾱ_t)
    coef = ((out.noisy.double() - ab.sqrt() * x0) * eps).sum((1, 2, 3)) / (eps ** 2).sum((1, 2, 3))
    rel = (coef / (1 - ab.flatten()).sqrt() - 1).abs()
    assert rel.max().item() < 0.01, (rel.argmax().item(), rel.max().item())
    # the v target in fp32 from the same fp32 schedule (the loss is fp32)
    v = ab.sqrt() * eps - (1 - ab).sqrt() * x0
    torch.testing.assert_close(out.target.double(), v, rtol=0, atol=2e-6)
