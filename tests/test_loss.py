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
