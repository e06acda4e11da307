"""The training loop driven in one process (no Ray), for tests that need a real run."""

import os

import numpy as np
import torch

from raylora.train.loop import LoopHooks, LoopSettings, run_loop
from raylora.train.setup import attention_planner, build_run, write_checkpoint


def _fresh_accelerator(accum: int, mixed_precision: str = "no"):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=accum, mixed_precision=mixed_precision)


def _train(cfg, batches, max_steps, ckpt_root, restored=None, stop_at=None):
    """Run the loop; checkpoints go to ckpt_root/step_N. Returns (run, steps checkpointed)."""
    # Autocast as the worker's Accelerator sets it (raylora.worker._accelerator).
    accel = _fresh_accelerator(cfg.train.gradient_accumulation_steps, cfg.train.mixed_precision)
    run = build_run(cfg, accel, max_steps, rank=0, restored=restored)
    saved = []

    def epoch_batches(epoch):
        order = np.random.default_rng(epoch).permutation(len(batches))
        return [batches[i] for i in order]

    def on_checkpoint(state, final):
        d = os.path.join(ckpt_root, f"step_{state.global_step}")
        os.makedirs(d, exist_ok=True)
        write_checkpoint(d, run, rank=0)
        saved.append((state.global_step, final))

    settings = LoopSettings.from_config(cfg, max_steps if stop_at is None else stop_at, 1)
    # first_batch as the worker sets it: train.sdpa_backend's probe and pin
    run_loop(run, settings, LoopHooks(epoch_batches, on_checkpoint=on_checkpoint,
                                      first_batch=attention_planner(cfg, run) or (lambda b: None)))
    return run, saved


def demo_batch(family: str, model: str, demo_data: str, n: int = 2) -> dict:
    """The first ``n`` demo rows through raylora's preprocessing for ``family``: a raw batch
    (pixels, token ids; 32 tokens for the long-context encoders) as tensors."""
    import pyarrow.parquet as pq

    from raylora.data.preprocess import Preprocess, StageSpec

    stage = Preprocess(StageSpec(model, 64, center_crop=True, random_flip=False, family=family,
                       max_sequence_length=32))
    table = pq.read_table(os.path.join(demo_data, "part-00000.parquet")).slice(0, n)
    out = stage({"image": np.array(table["image"].to_pylist(), dtype=object),
                 "text": np.array(table["text"].to_pylist(), dtype=object)})
    return {k: torch.from_numpy(v) for k, v in out.items()}


def lora_step_setup(model: str, demo_data: str, out_uri: str):
    """``model`` (a tiny pipeline folder) loaded fp32 with a rank-4 LoRA on the family's
    targets (seeded), two cached demo rows, and the frozen parts without the encoders (the
    step runs the denoiser alone): ``(comps, LoRA params, parts, batch)``."""
    from dataclasses import replace

    from raylora.config import validate
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora
    from raylora.train.setup import frozen_parts

    cfg = validate({"model": {"pretrained": model, "max_sequence_length": 32},
                    "data": {"uri": demo_data, "resolution": 64}, "lora": {"rank": 4},
                    "output": {"uri": out_uri}})
    comps = load_components(cfg.model, torch.float32)
    torch.manual_seed(0)
    params = add_lora(comps.denoiser, cfg.lora, comps.family.default_lora_targets(comps.denoiser))
    batch = cached_demo_batch(comps.family, comps, model, demo_data)
    parts = replace(frozen_parts(cfg, comps, "cpu", torch.float32), vae=None, text_encoders=[])
    return comps, params, parts, batch


def cached_demo_batch(family, comps, model: str, demo_data: str, n: int = 2) -> dict:
    """Two demo rows through raylora's preprocessing and the family's encoders: what the
    latent cache would hold, so the step runs the denoiser alone."""
    from raylora.train.encode import batch_condition, vae_posterior

    raw = demo_batch(family.name, model, demo_data, n)
    with torch.no_grad():
        batch = {"latent_params": vae_posterior(family, comps.vae, raw["pixel_values"])}
        batch.update(batch_condition(family, comps.text_encoders, raw))
    return batch


def overfit(run, batch: dict, steps: int, each_step=None) -> tuple[float, float]:
    """The held-out loss of ``batch`` (4 fixed timesteps) before and after ``steps``
    micro-steps on that batch alone; every step's loss must be finite. ``each_step()`` runs
    after each step (e.g. to read the learning rate)."""
    from raylora.train.evaluate import heldout_loss, prepare_heldout
    from raylora.train.step import train_micro_step

    held = prepare_heldout(run.parts, batch, num_timesteps=4, seed=0)
    before = heldout_loss(run.model, held, torch.float32)
    for _ in range(steps):
        loss = train_micro_step(run.accelerator, run.model, run.parts, run.optimizer,
                                run.lr_scheduler, run.params, batch, 1.0)
        assert torch.isfinite(loss)
        if each_step is not None:
            each_step()
    return before, heldout_loss(run.model, held, torch.float32)
