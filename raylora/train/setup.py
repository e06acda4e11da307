"""Build everything one worker trains with, restore it, and write it to a checkpoint.

No Ray: ``worker.py`` calls these with Ray's checkpoint directory and dataset shard, and
tests call them directly to check resume exactness in a single process.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from raylora.checkpoint.state import (
    ADAPTER_DIR,
    SHARDED_DIR,
    LoopState,
    RestoredState,
    ResumeRefused,
    restore_rng,
    save_main_state,
    save_rank_state,
    trained_settings,
)
from raylora.config import RayLoraConfig
from raylora.model.families.base import Family
from raylora.model.load import load_components
from raylora.model.lora import add_lora, add_text_encoder_lora, load_lora_state_dict, lora_state_dict
from raylora.model.lora import save_adapter
from raylora.train import attention
from raylora.train.norms import groupnorms_in_weight_dtype, in_weight_dtype
from raylora.train.ema import LoraEMA
from raylora.train.compile import CompileCache, cache_key, compile_denoiser, compile_options
from raylora.train.compile import log as compile_log
from raylora.train.objective import (
    DDPM,
    FlowMatching,
    flow_shift_from_scheduler,
    schedule_problem,
    scheduler_objective_kind,
)
from raylora.train.fsdp import (
    component_folder,
    full_lora_state_dict,
    load_sharded,
    save_sharded,
    shard_and_load,
    shard_files,
)
from raylora.train.optim import build_lr_scheduler, build_optimizer
from raylora.train.step import FrozenParts

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TrainingRun:
    accelerator: object
    model: torch.nn.Module  # the denoiser, prepared (DDP-wrapped when distributed)
    parts: FrozenParts
    optimizer: object
    lr_scheduler: object
    params: list[torch.nn.Parameter]  # denoiser LoRA, then text-encoder LoRA when trained
    state: LoopState
    ema: LoraEMA | None = None
    # text encoders that train LoRA, by pipeline component name
    trained_text_encoders: dict[str, torch.nn.Module] = field(default_factory=dict)
    sharded: bool = False  # scaling.strategy=fsdp: model and optimizer state are shards
    # train.compile_cache_uri: the compiled code loaded at build; the worker saves it.
    compile_cache: CompileCache | None = None
    # What the LoRA state is for (checkpoint.state.trained_settings): into every checkpoint
    trained: dict = field(default_factory=dict)

    @property
    def family(self) -> type[Family]:
        return self.parts.family

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The whole LoRA (fp32, CPU). Under FSDP a collective: every rank must call it."""
        if self.sharded:
            return full_lora_state_dict(self.model)
        return lora_state_dict(self.accelerator.unwrap_model(self.model), self.trained_text_encoders)


def build_objective(cfg: RayLoraConfig, family: type[Family], scheduler_config: dict,
                    sigma_range: tuple[float, float] = (0.0, 1.0)):
    """DDPM (ε / v) or flow matching, as the model's scheduler config says unless
    ``train.prediction_type`` overrides it (launch.plan checks the combination).
    ``sigma_range``: the trained expert's (``Components.sigma_range``; flow matching only)."""
    t, f = cfg.train, cfg.train.flow
    # launch.family_problems refuses it before Ray; this is for a caller that did not plan
    if problem := schedule_problem(scheduler_config):
        raise ValueError(problem)
    kind = t.prediction_type or scheduler_objective_kind(scheduler_config)
    if kind == "flow_matching":
        shift, dynamic = (flow_shift_from_scheduler(scheduler_config) if f.shift == "auto"
                          else (float(f.shift), None))
        return FlowMatching(f.timestep_sampling, f.logit_mean, f.logit_std, f.mode_scale, shift,
                            dynamic, f.loss_weighting, seq_len=family.image_seq_len,
                            sigma_range=sigma_range)
    if sigma_range != (0.0, 1.0):  # experts exist only in flow-matching pipelines
        raise ValueError(f"model.expert: a σ range needs flow matching, not {kind}")
    from diffusers import DDPMScheduler

    # The DDPM forward process whatever sampler the pipeline ships (PNDM, Euler, ...):
    # the same betas, as diffusers' scripts build it.
    return DDPM(DDPMScheduler.from_config(scheduler_config), kind, t.snr_gamma, t.noise_offset)


def frozen_parts(cfg: RayLoraConfig, comps, device, weight_dtype: torch.dtype,
                 te_params=()) -> FrozenParts:
    """What the step needs besides the denoiser; the frozen encoders moved to ``device``."""
    for m in [comps.vae, *comps.text_encoders]:
        if m is not None:
            m.to(device)
    return FrozenParts(
        comps.family, comps.vae, comps.text_encoders,
        build_objective(cfg, comps.family, comps.scheduler_config, comps.sigma_range), weight_dtype,
        latent_shift=comps.latent_shift, latent_scale=comps.latent_scale,
        guidance=cfg.train.flow.guidance, text_encoder_params=list(te_params),
        prior_loss_weight=cfg.train.prior_loss_weight if cfg.data.prior_preservation else None,
        cuda_graphs=cfg.train.cuda_graphs, control_images=cfg.data.control_images,
    )


def _attach_lora(cfg: RayLoraConfig, comps) -> tuple[list, dict, list]:
    """LoRA on the denoiser (and the text encoders the family's pipeline can load LoRA
    into, when trained): (denoiser params, trained encoders by name, their params)."""
    fam = comps.family
    params = add_lora(comps.denoiser, cfg.lora, fam.default_lora_targets(comps.denoiser))
    trained = {}
    if cfg.lora.train_text_encoder:
        names = fam.text_encoder_lora()
        trained = {t.encoder: enc for t, enc in zip(fam.text, comps.text_encoders) if t.encoder in names}
    return params, trained, add_text_encoder_lora(trained, cfg.lora)


def start_from(cfg: RayLoraConfig, comps, trained_te: dict, rank: int,
               pins: dict[str, str]) -> None:
    """``lora.init_from``: the LoRA starts as that adapter (``raylora.model.lora_init``),
    a hub one at the commit the driver checked, one in object storage at the version of
    its files the driver listed (``pins``)."""
    from raylora.model import lora_init

    uri = pins.get(cfg.lora.init_from, cfg.lora.init_from)
    counts = lora_init.start_from(uri, cfg.storage.client(), comps.family, comps.denoiser,
                                  trained_te)
    if rank == 0:
        lora_init.log.info("lora.init_from: %s", "; ".join(
            f"{name}: {c['loaded']} LoRA layers from {uri}"
            + (f", {c['fresh']} not in it start as no-ops" if c["fresh"] else "")
            for name, c in counts.items()))


def enable_gradient_checkpointing(family, denoiser, trained_text_encoders=()) -> None:
    """Recompute activations in backward: the denoiser's blocks (the family's
    ``checkpoint_blocks``: diffusers' own switch, non-reentrant ``torch.utils.checkpoint``,
    so LoRA weights inside a block get gradients though the block's inputs need none) and
    the layers of text encoders that train LoRA (frozen encoders run under no_grad and keep
    no activations anyway)."""
    family.checkpoint_blocks(denoiser)
    for te in trained_text_encoders:
        # transformers >= 5 names it activation checkpointing; reentrant checkpointing
        # would drop the LoRA gradients of layers whose inputs (frozen embeddings) need none.
        enable = getattr(te, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            te.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _restore(cfg: RayLoraConfig, accelerator, restored, optimizer, lr_scheduler, rank: int,
             model, max_steps: int) -> LoopState:
    """Optimizer, schedule, scaler, loop position and RNG from a checkpoint; or a fresh
    state with this rank's own noise/timestep stream. ``ResumeRefused`` (not retried by
    Ray Train: raylora.entry.EndOnRepeated) for a checkpoint this config cannot continue."""
    seed = cfg.train.seed
    if restored is None:
        # A different stream per rank, so workers do not draw identical noise for their
        # different images (the adapter's initial weights were drawn the same everywhere).
        torch.manual_seed(seed + 1000 * rank)
        return LoopState(world_size=accelerator.num_processes, batch_size=cfg.train.batch_size)
    written = "fsdp" if restored.sharded_dir else "ddp"
    if written != cfg.scaling.strategy:
        raise ResumeRefused(
            f"scaling.strategy: the checkpoint to resume from was written with "
            f"scaling.strategy={written}; resume with it, or start a new output.uri")
    # The driver refuses both before Ray starts (recorded.check_latest, launch.resumed_plan):
    # this is a checkpoint it did not read.
    if restored.loop.global_step > max_steps:
        key = "train.max_steps" if cfg.train.max_steps else "train.num_epochs"
        raise ResumeRefused(
            f"{key}: this run trains {max_steps} steps, but the checkpoint to resume from is at "
            f"step {restored.loop.global_step}; raise it to continue that run, or give this one "
            "its own output.uri")
    configured = _configured_hyperparameters(optimizer.optimizer)
    if restored.sharded_dir:  # every rank reads its slice of the saved shards
        load_sharded(restored.sharded_dir, model, optimizer.optimizer)
        _refuse_other_optimizer(optimizer.optimizer.param_groups, configured, cfg.train.optimizer)
        _take_settings(optimizer.optimizer.param_groups, configured)
    else:
        groups = [dict(g) for g in restored.optimizer_sd["param_groups"]]
        _refuse_other_optimizer(groups, configured, cfg.train.optimizer)
        # Before loading: torch puts AdamW's step counts where the loaded groups' fused
        # flag says (a CPU checkpoint resumed fused on CUDA, and the reverse).
        _take_settings(groups, configured)
        optimizer.load_state_dict({**restored.optimizer_sd, "param_groups": groups})
    lr_scheduler.scheduler.load_state_dict(restored.scheduler_sd)
    if accelerator.scaler is not None and restored.scaler_sd:
        accelerator.scaler.load_state_dict(restored.scaler_sd)
    state = restored.loop
    # Any run resumed on another number of workers, elastic or not: the schedule counts
    # optimizer steps × processes. Only an elastic run's data position is exact.
    _resize(state, lr_scheduler.scheduler, accelerator.num_processes, cfg.train.batch_size,
            exact=cfg.scaling.elastic)
    _reconfigure(optimizer.optimizer, lr_scheduler.scheduler)
    state.world_size, state.batch_size = accelerator.num_processes, cfg.train.batch_size
    state.resumed_from_step = state.global_step
    if restored.rng is not None:
        restore_rng(restored.rng)
    else:  # world size changed: no saved stream for this rank; a seeded fresh one
        torch.manual_seed(seed + 1000 * rank + state.global_step)
    return state


def _resize(state: LoopState, scheduler, world: int, batch_size: int, exact: bool = True) -> None:
    """A run resumed on another number of workers or another train.batch_size: the data
    position (``exact``: an elastic run's, see ``LoopState.resize``), and, for the workers,
    the LR schedule, which counts optimizer steps × workers (Accelerate steps it once per
    process: raylora.train.optim.build_lr_scheduler). The schedule's position in optimizer
    steps, and so the learning rate, stay what they were: unconverted, 2 workers'
    checkpoint resumed on 1 ran a linear schedule to its end at once (the rest trained at
    lr 0)."""
    old = state.world_size or world
    if old == world and (state.batch_size or batch_size) == batch_size:
        return
    state.resize(world, batch_size, exact=exact)
    scheduler.last_epoch = scheduler.last_epoch // old * world


# What optimizers keep in their parameter groups besides settings: the schedule's current
# lr, and Prodigy's step-size estimate (d, its running sums, its step count k). Every
# other group key is a setting (train.adam_*, train.prodigy, train.adafactor; AdamW's
# fused/foreach, which follow the device): a resume takes it from this run's build.
# (tests/test_optim.py fails on a key an optimizer adds.)
GROUP_STATE_KEYS = ("params", "lr", "d", "d_max", "d_numerator", "d_denom", "d_hat", "k")
# Settings the saved state depends on, which a resume cannot change: Prodigy keeps its
# state for every slice_p-th element, and scales its running sums by d0 (and grows d only
# while it still equals d0).
SHAPING_KEYS = {"slice_p": "train.prodigy.slice_p", "d0": "train.prodigy.d0"}


def _configured_hyperparameters(optimizer) -> list[dict]:
    """Each parameter group's settings as this run's config built them."""
    return [{k: v for k, v in g.items() if k not in GROUP_STATE_KEYS} for g in optimizer.param_groups]


def _optimizer_kind(group: dict) -> str:
    """Which train.optimizer made a parameter group (by its keys; paged or not alike)."""
    return ("prodigy" if "d_coef" in group else "adafactor" if "relative_step" in group
            else "adamw" if "amsgrad" in group else "adamw8bit")


def _refuse_other_optimizer(saved: list[dict], configured: list[dict], name: str) -> None:
    """A checkpoint's optimizer state another train.optimizer (or Prodigy slice_p, d0) made:
    the driver refuses it by the checkpoint's record; checkpoints written before
    train.optimizer was recorded, and Tune's trials, get here. Loaded, it failed at the first
    step with a KeyError inside the library, or Prodigy's moments served as AdamW's."""
    was, now = _optimizer_kind(saved[0]), _optimizer_kind(configured[0])
    if was != now:
        raise ResumeRefused(
            f"train.optimizer: this run has train.optimizer={name}, but the checkpoint to resume "
            f"from holds {was} optimizer state; set it back to resume that run, or give this "
            "one its own output.uri")
    for k, key in SHAPING_KEYS.items():
        if k in saved[0] and saved[0][k] != configured[0].get(k):
            raise ResumeRefused(
                f"{key}: this run has {key}={configured[0].get(k)}, but the checkpoint to resume "
                f"from was written with {saved[0][k]}; set it back to resume that run, or give "
                "this one its own output.uri")


def _take_settings(groups: list[dict], configured: list[dict]) -> None:
    """A checkpoint's parameter groups (in place) with this run's settings and their own
    state. Before, only the learning rates and Adam's betas, eps and decay were taken: a
    resume kept the checkpoint's Prodigy and Adafactor switches while the config and model
    card named others (relative_step true resumed as false trained at 87× the logged lr)."""
    for group, conf in zip(groups, configured):
        state = {k: group[k] for k in GROUP_STATE_KEYS if k in group}
        group.clear()
        group.update(conf, **state)


def _reconfigure(optimizer, scheduler) -> None:
    """After loading a checkpoint's optimizer and schedule: the config's learning rates
    at the schedule's restored position. README promises a resume may change the learning
    rate; the loaded schedule's base_lrs kept the checkpoint's, so a rerun with a lower
    train.learning_rate (what the NaN advice says to do) trained on at the old one while
    the model card named the new."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or \
            any(g.get("initial_lr") is None for g in optimizer.param_groups):
        return  # Adafactor's relative step: it sets its own step size
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _ema(cfg: RayLoraConfig, params, restored, state: LoopState) -> LoraEMA | None:
    if not cfg.train.ema_decay:
        return None
    ema = LoraEMA(params, cfg.train.ema_decay)
    if restored is not None and restored.ema_sd is not None:
        ema.load_state_dict(restored.ema_sd)
    elif restored is not None and state.global_step:
        raise ResumeRefused(
            "train.ema_decay: the checkpoint to resume from has no EMA state (EMA was "
            "off when it was written); resume without EMA or start a new output.uri"
        )
    return ema


def build_run(
    cfg: RayLoraConfig,
    accelerator,
    max_steps: int,
    rank: int,
    restored: RestoredState | None = None,
    pins: dict[str, str] | None = None,
) -> TrainingRun:
    """Frozen base + fresh or restored LoRA, optimizer, schedule, RNG, loop state.
    ``pins``: ``raylora.launch.Plan.pins`` (the hub adapters' commits the driver read)."""
    from accelerate.utils import set_seed

    t = cfg.train
    fsdp = cfg.scaling.strategy == "fsdp"
    weight_dtype = DTYPES[t.mixed_precision]
    set_seed(t.seed)  # same seed on every rank for the adapter's initial weights
    # Cached latents: the cache holds what the VAE and text encoders would compute.
    comps = load_components(
        cfg.model, weight_dtype, cfg.storage.client(), encoders=cfg.data.cache != "latents",
        device=accelerator.device, hollow_denoiser=fsdp,
    )
    attention.use_family_backends(comps.family)
    params, trained_te, te_params = _attach_lora(cfg, comps)
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(comps.family, comps.denoiser, trained_te.values())
    if comps.family.channels_last if t.channels_last is None else t.channels_last:
        # 4-D tensors only (conv weights): Linear weights and LoRA factors keep their layout.
        comps.denoiser.to(memory_format=torch.channels_last)
    if in_weight_dtype(t.mixed_precision, t.groupnorm_fp32):
        groupnorms_in_weight_dtype(comps.denoiser)
    compile_denoiser(comps.denoiser, cfg.compile_mode, comps.family.repeated_blocks,
                     **compile_options(comps.family, t.cuda_graphs))
    compile_cache = open_compile_cache(cfg, comps, accelerator.device, rank)
    parts = frozen_parts(cfg, comps, accelerator.device, weight_dtype, te_params)
    if restored is not None:
        load_lora_state_dict(comps.denoiser, restored.lora_sd, trained_te)
    elif cfg.lora.init_from:  # before FSDP shards it: every rank loads the whole adapter
        start_from(cfg, comps, trained_te, rank, pins or {})
    if fsdp:  # the LoRA parameters become DTensors (this rank's shards)
        params = shard_denoiser_of(cfg, comps, accelerator, weight_dtype)

    optimizer = build_optimizer(cfg, params, accelerator.num_processes, te_params,
                                device=accelerator.device)
    lr_scheduler = build_lr_scheduler(cfg, optimizer, max_steps, accelerator.num_processes)
    if fsdp:  # not DDP-wrapped: FSDP reduce-scatters the gradients itself
        model = comps.denoiser
        optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    else:
        model, optimizer, lr_scheduler = accelerator.prepare(comps.denoiser, optimizer, lr_scheduler)
    state = _restore(cfg, accelerator, restored, optimizer, lr_scheduler, rank, model, max_steps)
    ema = _ema(cfg, params + te_params, restored, state)
    model.train()
    for te in trained_te.values():
        te.train()  # LoRA dropout on, as for the denoiser
    return TrainingRun(accelerator, model, parts, optimizer, lr_scheduler, params + te_params,
                       state, ema, trained_te, sharded=fsdp, compile_cache=compile_cache,
                       trained=trained_settings(cfg, comps.family.name))


def compile_cache_inputs(cfg: RayLoraConfig, comps) -> dict:
    """What the compiled denoiser's graphs depend on, besides torch and the device (its
    ``cache_key``): the architecture (not the weights: they are graph inputs, so a
    fine-tuned checkpoint of the same architecture shares the entry), LoRA, what shapes a
    micro-batch, precision (the weights' dtype follows it) and the switches that change
    the code. Not the learning rate or anything else a Tune search varies that leaves the
    graphs as they are."""
    t, d = cfg.train, cfg.data
    return {
        "compile": cfg.compile_mode,
        "blocks": list(comps.family.repeated_blocks),
        "family": comps.family.name,
        # Not diffusers' "_name_or_path" (where it was loaded from) or "_diffusers_version"
        # (what saved it): the class and its config values make the architecture.
        "denoiser": [type(comps.denoiser).__name__,
                     {k: v for k, v in comps.denoiser.config.items() if not k.startswith("_")}],
        # Not model.expert: the experts share the architecture "denoiser" holds.
        "model": cfg.model.model_dump(mode="json",
                                      exclude={"pretrained", "revision", "variant", "expert"}),
        "lora": cfg.lora.model_dump(mode="json"),
        "mixed_precision": t.mixed_precision,
        # Prior preservation appends the class rows to every micro-batch.
        "batch": [t.batch_size, d.max_resolution(), d.prior_preservation, d.masked_loss,
                  d.cache == "latents"],
        # CUDA graphs only when on: entries stored before the switch existed keep their name.
        "switches": [t.gradient_checkpointing, t.channels_last, t.sdpa_backend]
        + (["cuda_graphs"] if t.cuda_graphs else [])
        + (["groupnorm_fp32"] if t.groupnorm_fp32 and t.mixed_precision == "bf16" else []),
    }


def open_compile_cache(cfg: RayLoraConfig, comps, device, rank: int) -> CompileCache | None:
    """``train.compile_cache_uri``: this run's entry, loaded into the local caches before
    the first compiled call (every rank compiles the same graphs, so every rank loads)."""
    root = cfg.train.compile_cache_uri
    if not root or cfg.compile_mode == "none":
        return None
    from raylora import storage

    key = cache_key(compile_cache_inputs(cfg, comps), device)
    cache = CompileCache(cfg.storage.client(), storage.join(root, f"{key}.bin"))
    n = cache.load()
    if rank == 0:
        compile_log.info(
            "compile cache: %s", f"{n} artifacts loaded from {cache.uri}" if n
            else f"nothing usable at {cache.uri} yet: compiling cold, then saving there")
    return cache


def shard_denoiser_of(cfg: RayLoraConfig, comps, accelerator, weight_dtype) -> list:
    """``scaling.strategy=fsdp``: shard the LoRA-wrapped hollow denoiser over the ranks,
    read each rank's weights, and return its trainable (DTensor) parameters. Computation
    runs in ``weight_dtype`` (FSDP gathers every parameter in it, LoRA included; autocast
    as under DDP), LoRA gradients are reduced and stepped in fp32."""
    f = cfg.scaling.fsdp
    model = comps.denoiser
    shard_and_load(
        model, comps.family.repeated_blocks, component_folder(comps.path, comps.component,
                                                              cfg.model.revision, cfg.model.variant),
        accelerator.device, variant=cfg.model.variant,
        param_dtype=None if weight_dtype == torch.float32 else weight_dtype,
        reshard_after_forward=f.reshard_after_forward, offload=f.offload)
    if accelerator.native_amp:
        forward = model.forward

        def autocast_forward(*args, **kwargs):
            with accelerator.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    return [p for p in model.parameters() if p.requires_grad]


def nonfinite_advice(cfg: RayLoraConfig) -> str:
    """The likely causes of a run stuck on NaN/inf, for the error that stops it."""
    t = cfg.train
    hints = []
    if t.mixed_precision == "fp16":
        hints.append("fp16 overflow is the usual cause: try train.mixed_precision=bf16")
    hints.append(f"lower train.learning_rate (now {t.learning_rate:g})")
    if t.max_grad_norm > 10:
        hints.append(f"clip harder (train.max_grad_norm now {t.max_grad_norm:g})")
    return "Likely causes: " + "; ".join(hints) + "; or broken input images."


def write_checkpoint(directory: str, run: TrainingRun, rank: int) -> dict[str, torch.Tensor]:
    """Write this rank's share of a checkpoint into ``directory``; returns the LoRA state."""
    sd = run.lora_state()
    save_rank_state(directory, rank)
    if run.sharded:
        # Each rank writes its own shards of the LoRA and its optimizer state into its own
        # directory; Ray merges the ranks' directories into one checkpoint, which is then
        # the whole DCP checkpoint (rank 0's .metadata names every rank's file).
        save_sharded(os.path.join(directory, SHARDED_DIR), run.model, run.optimizer.optimizer)
    if rank == 0:
        model = run.accelerator.unwrap_model(run.model)
        # The published adapter is the EMA; lora.safetensors keeps the raw weights.
        with run.ema.swapped_in(run.params) if run.ema is not None else nullcontext():
            save_adapter(model, os.path.join(directory, ADAPTER_DIR), run.family,
                         run.trained_text_encoders, denoiser_sd=sd if run.sharded else None)
        scaler = run.accelerator.scaler
        save_main_state(
            directory,
            lora_sd=sd,
            optimizer_sd=None if run.sharded else run.optimizer.state_dict(),
            scheduler_sd=run.lr_scheduler.scheduler.state_dict(),
            scaler_sd=scaler.state_dict() if scaler is not None else None,
            loop=run.state,
            ema_sd=run.ema.state_dict() if run.ema is not None else None,
            other_ranks_files=[f"{SHARDED_DIR}/{name}" for name in shard_files(
                os.path.join(directory, SHARDED_DIR))] if run.sharded else [],
            trained=run.trained,
        )
    return sd


def attention_planner(cfg: RayLoraConfig, run: TrainingRun, log=None):
    """``train.sdpa_backend``'s first-batch step (``raylora.train.attention``): record the
    denoiser's attention calls on the batch, pick each layer's kernels, pin them. None when
    PyTorch's own choice stands (``default``; ``auto`` off CUDA). Every rank pins rank 0's
    pick, so the ranks run the same kernels. ``log``: gets the timing lines (rank 0)."""
    from raylora.train.step import compute_loss

    mode, acc = cfg.train.sdpa_backend, run.accelerator
    if mode == "default" or (mode == "auto" and acc.device.type != "cuda"):
        return None
    model = acc.unwrap_model(run.model)  # DDP's forward would prepare a gradient sync

    def first_batch(batch: dict) -> None:
        def forward():
            with acc.autocast():
                compute_loss(model, run.parts, batch)

        calls = attention.record_calls(model, forward)
        names = attention.candidates(acc.device, run.parts.family.cudnn_sdpa)
        plan = attention.plan(calls, mode, acc.device, names)
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            plan.layers = broadcast_object_list([plan.layers])[0]
        plan.pin(model)
        if log is not None and acc.is_main_process:
            for line in plan.summary():
                log(f"attention ({len(calls)} layers): {line}")

    return first_batch
