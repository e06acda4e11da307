"""Training objectives: which timestep, how an image is noised (the forward process), what
the denoiser should predict and how each sample's error is weighted. No models, no Ray.

Two objectives, chosen by the model's scheduler config (``train.prediction_type`` overrides):

- ``DDPM``: integer steps t in [0, T), x_t = sqrt(ᾱ_t)·x₀ + sqrt(1−ᾱ_t)·ε, target ε or v;
  min-SNR-γ weighting and noise offset (SD 1.x/2.x, SDXL).
- ``FlowMatching``: rectified flow, σ in (0, 1), x_σ = (1−σ)·x₀ + σ·ε, target ε − x₀
  (Flux, SD3, Qwen-Image, Z-Image, Wan). σ is drawn from a density (uniform, logit-normal, mode,
  cosmap) and shifted toward noise, statically (``shift``) or by image size (Flux's
  ``base_shift``/``max_shift``); the loss can be weighted by σ (``sigma_sqrt``, ``cosmap``,
  ``x0``). Both compute the forward process in fp32 and round the noisy input once.

Training and the held-out evaluation both call ``noised`` (the forward process exists once).
The denoiser gets ``Noised.timestep``: the int64 DDPM step, or σ as a float; each model
family scales σ to what its model takes. Shapes: latents/noise ``[B, C, h, w]``, per-sample
tensors ``[B]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from raylora.train.loss import (
    diffusion_target,
    min_snr_weights,
    offset_noise,
    sample_timesteps,
    snr,
)

DENSITIES = ("uniform", "logit_normal", "mode", "cosmap")
EDM = "edm"  # scheduler_objective_kind of an EDM model, which raylora refuses
BETA_KEYS = ("beta_start", "beta_end", "beta_schedule", "trained_betas")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap", "x0")


def draw_noise(latents: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped like ``latents``, from torch's global RNG.

    Not randn_like: it keeps the input's memory layout, and CPU randn draws a different
    sequence into a channels-last tensor (what the VAE's conv emits) than into a contiguous
    one (what a cached batch is), so cached and uncached runs would diverge."""
    return torch.randn(latents.shape, device=latents.device, dtype=latents.dtype)


@dataclass
class Noised:
    """One noised batch: what the denoiser sees and what it should output."""

    noisy: torch.Tensor  # [B, C, h, w], the latents' dtype
    timestep: torch.Tensor  # [B]: int64 step (DDPM) or float σ (flow matching)
    target: torch.Tensor  # [B, C, h, w]
    weights: torch.Tensor | None = None  # [B] loss weights; None = plain mean


class DDPM:
    """ε / v-prediction on a diffusers DDPM-style scheduler (its ᾱ_t table and its own
    ``add_noise`` / ``get_velocity``, so the schedule is the one the model was trained on)."""

    kind = "ddpm"

    def __init__(self, scheduler, prediction_type: str, snr_gamma: float | None = None,
                 noise_offset: float = 0.0):
        self.scheduler = scheduler
        self.prediction_type = prediction_type
        self.snr_gamma = snr_gamma
        self.noise_offset = noise_offset
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)

    def sample_timesteps(self, latents: torch.Tensor) -> torch.Tensor:
        """Uniform integer steps ``[B]`` from torch's global RNG."""
        return sample_timesteps(latents.shape[0], self.num_train_timesteps, latents.device)

    def eval_timesteps(self, k: int, latents: torch.Tensor) -> torch.Tensor:
        """K fixed steps at the centres of K equal slices of [0, T): (i + 0.5)·T/K."""
        ts = [int((i + 0.5) * self.num_train_timesteps / k) for i in range(k)]
        return torch.tensor(ts, dtype=torch.long, device=latents.device)

    def offset(self, noise: torch.Tensor) -> torch.Tensor:
        """Training noise: with the noise offset added. It draws after the timesteps
        (diffusers' scripts draw it before them): the same distribution, another order of
        draws, so a seed does not give diffusers' exact noise."""
        return offset_noise(noise, self.noise_offset)

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
               weighted: bool = True) -> Noised:
        """The noisy input in the latents' dtype; the target fp32 (the loss is fp32)."""
        # In fp32 whatever the latents' dtype: diffusers casts ᾱ_t to the samples' dtype,
        # and in bf16 ᾱ rounds to 1.0 at t=0,1 (the input was the clean latents, no noise)
        # and puts a dozen more steps' noise level 5-23 % off the schedule.
        x0, eps = latents.float(), noise.float()
        noisy = self.scheduler.add_noise(x0, eps, t).to(latents.dtype)
        target = diffusion_target(self.scheduler, x0, eps, t, self.prediction_type)
        weights = None
        if weighted and self.snr_gamma is not None:
            weights = min_snr_weights(snr(self.scheduler, t), self.snr_gamma, self.prediction_type)
        return Noised(noisy, t, target, weights)


@dataclass(frozen=True)
class DynamicShift:
    """Resolution-dependent shift (Flux): μ linear in the image's token count between
    (base_seq_len, base_shift) and (max_seq_len, max_shift); σ' = e^μ / (e^μ + 1/σ − 1)."""

    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096

    def mu(self, seq_len: int) -> float:
        m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return self.base_shift + m * (seq_len - self.base_seq_len)


def sample_density(kind: str, n: int, device=None, logit_mean: float = 0.0,
                   logit_std: float = 1.0, mode_scale: float = 1.29,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """u in (0, 1) ``[n]`` fp32 from the timestep density (SD3 paper, §3.1):
    uniform; logit_normal: sigmoid(N(mean, std)); mode: 1 − u − s·(cos²(πu/2) − 1 + u);
    cosmap: 1 − 1/(tan(πu/2) + 1)."""
    if kind not in DENSITIES:
        raise ValueError(f"train.flow.timestep_sampling: unknown density {kind!r} (one of {DENSITIES})")
    if kind == "logit_normal":
        z = torch.randn(n, generator=generator, device=device) * logit_std + logit_mean
        return torch.sigmoid(z)
    return density_of_uniform(kind, torch.rand(n, generator=generator, device=device), logit_mean,
                              logit_std, mode_scale)


def density_of_uniform(kind: str, v: torch.Tensor, logit_mean: float = 0.0, logit_std: float = 1.0,
                       mode_scale: float = 1.29) -> torch.Tensor:
    """The density's u as a monotone function of a uniform ``v`` in (0, 1) (logit_normal:
    its inverse CDF, sigmoid(mean + std·Φ⁻¹(v))): what ``sample_density`` draws, written so
    that a slice of v is the density truncated to a slice of u."""
    if kind == "uniform":
        return v
    if kind == "logit_normal":
        return torch.sigmoid(torch.special.ndtri(v) * logit_std + logit_mean)
    if kind == "mode":
        return 1 - v - mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    return 1 - 1 / (torch.tan(math.pi * v / 2) + 1)  # cosmap


def invert_monotone(f, target: float, iters: int = 60) -> float:
    """v in [0, 1] with ``f(v) = target`` for a monotone ``f`` (rising or falling) of floats,
    by bisection (2⁻⁶⁰: exact in fp32 and for the doubles ``f`` takes)."""
    lo, hi = 0.0, 1.0
    rising = f(1.0) >= f(0.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def shift_sigmas(sigma: torch.Tensor, shift: float = 1.0, mu: float | None = None) -> torch.Tensor:
    """Move σ toward noise: static ``shift`` s: s·σ / (1 + (s−1)·σ); or, with ``mu`` (the
    dynamic shift), e^μ / (e^μ + 1/σ − 1). Both are the identity at σ=0 and σ=1."""
    if mu is not None:
        return math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))
    return shift * sigma / (1 + (shift - 1) * sigma)


def flow_loss_weights(kind: str, sigma: torch.Tensor) -> torch.Tensor | None:
    """Per-sample weights ``[B]`` (diffusers' ``compute_loss_weighting_for_sd3``):
    sigma_sqrt: σ⁻²; cosmap: 2 / (π·(1 − 2σ + 2σ²)); none: None (plain mean).

    x0: σ², the loss of diffusers' SD3 scripts under their default ``--precondition_outputs
    1``: they compare the clean latents the prediction implies, x_σ − σ·v, with x₀, and
    x_σ − σ·v − x₀ = σ·((ε − x₀) − v), so that loss is the velocity loss weighted σ²."""
    if kind == "none":
        return None
    if kind == "sigma_sqrt":
        return sigma.float() ** -2.0
    if kind == "x0":
        return sigma.float() ** 2
    if kind == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma.float() + 2 * sigma.float() ** 2))
    raise ValueError(f"train.flow.loss_weighting: unknown weighting {kind!r} (one of {WEIGHTINGS})")



def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: a copy from pageable memory to a
    GPU waits for the stream (every step's σ stalled the host until the previous step's
    backward and optimizer were done); from pinned memory it is queued behind them, and
    torch keeps the pinned buffer until the copy ran. Also the batches' copy
    (raylora.worker._to_device)."""
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class FlowMatching:
    """Rectified flow: x_σ = (1−σ)·x₀ + σ·ε, target ε − x₀ (the velocity toward noise).

    ``sigma_range`` (lo, hi): σ only in [lo, hi], for one expert of a pipeline that
    denoises each σ range with its own model (Wan 2.2 A14B: ``transformer`` for σ ≥
    boundary_ratio, ``transformer_2`` below). Drawn from the same density and shift
    truncated to the range (not squeezed into it): the expert sees the σ it would have
    seen in a run over all of σ, in the same proportions."""

    kind = "flow"
    # σ is kept inside [EPS, 1−EPS]: σ=0 is a clean image (nothing to learn, and the
    # sigma_sqrt weight is infinite), and the dynamic shift divides by σ.
    EPS = 1e-5

    def __init__(self, density: str = "logit_normal", logit_mean: float = 0.0,
                 logit_std: float = 1.0, mode_scale: float = 1.29, shift: float = 1.0,
                 dynamic: DynamicShift | None = None, weighting: str = "none",
                 seq_len=None, sigma_range: tuple[float, float] = (0.0, 1.0)):
        self.density, self.weighting = density, weighting
        self.logit_mean, self.logit_std, self.mode_scale = logit_mean, logit_std, mode_scale
        self.shift, self.dynamic = shift, dynamic
        # latents → image token count, for the dynamic shift (the family's patching)
        self.seq_len = seq_len or (lambda shape: (shape[-2] // 2) * (shape[-1] // 2))
        lo, hi = (float(x) for x in sigma_range)
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"sigma_range: {sigma_range} is not a range within [0, 1]")
        self.sigma_range = (lo, hi)
        self._bounds: dict = {}  # (density, token count) → the slice of v that gives the range

    def shifted(self, u: torch.Tensor, latents_shape) -> torch.Tensor:
        u = u.clamp(self.EPS, 1 - self.EPS)
        mu = self.dynamic.mu(self.seq_len(latents_shape)) if self.dynamic else None
        return shift_sigmas(u, self.shift, mu)

    @property
    def truncated(self) -> bool:
        return self.sigma_range != (0.0, 1.0)

    def _slice(self, density: str, latents_shape) -> tuple[float, float]:
        """(v_lo, v_hi): the uniform v whose σ (density, then shift) falls in the range.
        Per image size under a dynamic shift; bisection once per size."""
        key = (density, self.seq_len(latents_shape) if self.dynamic else None)
        if key not in self._bounds:
            def sigma(v: float) -> float:
                u = density_of_uniform(density, torch.tensor([v], dtype=torch.float64),
                                       self.logit_mean, self.logit_std, self.mode_scale)
                return float(self.shifted(u, latents_shape))

            a, b = (invert_monotone(sigma, s) for s in self.sigma_range)
            self._bounds[key] = (min(a, b), max(a, b))
        return self._bounds[key]

    def sample_timesteps(self, latents: torch.Tensor) -> torch.Tensor:
        """σ ``[B]`` fp32 from torch's global RNG (drawn on the CPU, so every device and
        rank draws the same numbers from the same seed), shifted."""
        n = latents.shape[0]
        if self.truncated:
            lo, hi = self._slice(self.density, latents.shape)
            u = density_of_uniform(self.density, lo + (hi - lo) * torch.rand(n, dtype=torch.float64),
                                   self.logit_mean, self.logit_std, self.mode_scale)
            sigma = self.shifted(u, latents.shape).float()
            # bisection's last ulp: the range's own ends are kept exactly
            return to_device(sigma.clamp(*self.sigma_range), latents.device)
        u = sample_density(self.density, n, None, self.logit_mean, self.logit_std, self.mode_scale)
        return to_device(self.shifted(u, latents.shape), latents.device)

    def eval_timesteps(self, k: int, latents: torch.Tensor) -> torch.Tensor:
        """K fixed σ: the centres of K equal slices of (0, 1) (of the part of it that
        ``sigma_range`` keeps), shifted as in training."""
        lo, hi = self._slice("uniform", latents.shape) if self.truncated else (0.0, 1.0)
        u = lo + (hi - lo) * (torch.arange(k, dtype=torch.float32) + 0.5) / k
        return to_device(self.shifted(u, latents.shape), latents.device)

    def offset(self, noise: torch.Tensor) -> torch.Tensor:
        return noise

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
               weighted: bool = True) -> Noised:
        """The noisy input in the latents' dtype; the target fp32 (the loss is fp32)."""
        # In fp32 whatever the latents' dtype, as DDPM.noised: σ rounded to bf16 is up to
        # 2⁻⁹ off, so toward σ = 1 the clean latents' share 1 − σ was far off the σ the
        # denoiser is told (σ = 0.995: 0.0039 for 0.005), where the SD3/Flux shifts put
        # many of their steps.
        x0, eps = latents.float(), noise.float()
        s = sigma.float().view(-1, *([1] * (latents.dim() - 1)))
        noisy = ((1 - s) * x0 + s * eps).to(latents.dtype)
        weights = flow_loss_weights(self.weighting, sigma) if weighted else None
        return Noised(noisy, sigma, eps - x0, weights)


def is_edm(scheduler_config: dict[str, Any]) -> bool:
    """An EDM (Karras et al. 2022) scheduler: EDMEuler, EDMDPMSolverMultistep (Playground
    v2.5), or any config with EDM's σ_data. Its model takes σ-parameterised inputs
    (c_noise = ¼ ln σ, σ in [σ_min, σ_max]), not DDPM's integer steps on a β table."""
    return "EDM" in str(scheduler_config.get("_class_name", "")) or "sigma_data" in scheduler_config


def scheduler_objective_kind(scheduler_config: dict[str, Any]) -> str:
    """What the model was trained with, from its scheduler config: flow matching for the
    FlowMatch* schedulers and for a multistep solver set to ``flow_prediction`` (Wan ships
    UniPC that way), ``edm`` for an EDM scheduler (which raylora does not train: see
    ``schedule_problem``), else the config's ``prediction_type`` (ε by default)."""
    if "FlowMatch" in str(scheduler_config.get("_class_name", "")):
        return "flow_matching"
    if scheduler_config.get("prediction_type") == "flow_prediction":
        return "flow_matching"
    if is_edm(scheduler_config):  # before prediction_type: Playground v2.5's says epsilon
        return EDM
    return scheduler_config.get("prediction_type") or "epsilon"


def schedule_problem(scheduler_config: dict[str, Any] | None, native: str | None = None) -> str | None:
    """Why raylora cannot train with this model's noise schedule, or None when it can.
    ``native``: ``scheduler_objective_kind``'s answer, for a caller without the config.

    DDPM training builds ``DDPMScheduler`` from the config, so an EDM config, or one with
    no β key (every diffusers DDPM-family scheduler saves them), would get DDPMScheduler's
    default linear 1e-4..0.02 β table: a schedule the model never saw, trained silently."""
    config = scheduler_config or {}
    if is_edm(config) or (scheduler_config is None and native == EDM):
        name = config.get("_class_name")
        return (f"model.pretrained: its scheduler{f' ({name})' if name else ''} is an EDM one "
                "(σ-parameterised, as Playground v2.5's): raylora trains DDPM (ε / "
                "v-prediction) and flow-matching models and does not do EDM training yet")
    if scheduler_config is None or scheduler_objective_kind(config) == "flow_matching":
        return None
    if not any(k in config for k in BETA_KEYS):
        name = config.get("_class_name") or "no _class_name"
        return (f"model.pretrained: its scheduler config ({name}) has none of "
                f"{', '.join(BETA_KEYS)}: the noise schedule the model was trained with is "
                "unknown, and DDPMScheduler's default β table would be a guess; add the "
                "model's β keys to scheduler/scheduler_config.json")
    return None


def flow_shift_from_scheduler(scheduler_config: dict[str, Any]) -> tuple[float, DynamicShift | None]:
    """The shift the model's own sampler applies: dynamic when ``use_dynamic_shifting``
    (Flux, Qwen-Image), else the static ``shift`` (SD3: 3.0), or a multistep solver's
    ``flow_shift`` when it samples ``use_flow_sigmas`` (Wan's UniPC: 3.0 or 5.0)."""
    if scheduler_config.get("use_dynamic_shifting"):
        defaults = DynamicShift()
        return 1.0, DynamicShift(
            float(scheduler_config.get("base_shift", defaults.base_shift)),
            float(scheduler_config.get("max_shift", defaults.max_shift)),
            int(scheduler_config.get("base_image_seq_len", defaults.base_seq_len)),
            int(scheduler_config.get("max_image_seq_len", defaults.max_seq_len)),
        )
    if "shift" not in scheduler_config and scheduler_config.get("use_flow_sigmas"):
        return float(scheduler_config.get("flow_shift", 1.0)), None
    return float(scheduler_config.get("shift", 1.0)), None
