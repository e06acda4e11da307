"""``train.sdpa_backend`` (raylora.train.attention), on CPU, whose two SDPA kernels (flash and
math) are what these tests choose between: a real forward's attention calls are recorded per
layer for every family without moving the RNG the step draws from; each candidate kernel is
timed on them and the fastest leads; a pinned layer runs its kernel (seen in the profiler),
eagerly and compiled, with the loss unchanged; a kernel that cannot run a layer is an error
naming it; the loop hands the probe its first batch before anything else runs the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from inproc import _fresh_accelerator, lora_step_setup

from raylora.config import validate
from raylora.train import attention
from raylora.train.step import compute_loss

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


@pytest.fixture(scope="module")
def setups(tiny, demo_data, tmp_path_factory):
    """family → (LoRA-wrapped denoiser, frozen parts without encoders, a cached batch of 2)."""
    built = {}

    def get(name: str):
        if name not in built:
            comps, _, parts, batch = lora_step_setup(tiny(name), demo_data,
                                                     str(tmp_path_factory.mktemp("o")))
            built[name] = (comps.denoiser, parts, batch)
        return built[name]

    return get


def _loss(model, parts, batch, seed: int = 7) -> torch.Tensor:
    torch.manual_seed(seed)
    return compute_loss(model, parts, batch).detach()


def _kernels(fn) -> set[str]:
    """The SDPA kernels (and batched matmuls) ``fn()`` ran."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events() if e.name in (FLASH, MATH, "aten::bmm")}


def _attention_layers(model) -> set[str]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    # Sana's self-attention is linear (SanaLinearAttnProcessor2_0: ReLU features and two
    # matmuls, no softmax): no SDPA call, no kernel to pick; its cross-attention is SDPA.
    return {n for n, m in model.named_modules() if isinstance(m, (Attention, AttentionModuleMixin))
            and "LinearAttn" not in type(m.processor).__name__}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_attention_layer_is_recorded_timed_and_pinned(setups, family):
    denoiser, parts, batch = setups(family)
    model = copy.deepcopy(denoiser)
    default = _loss(model, parts, batch)

    torch.manual_seed(3)
    calls = attention.record_calls(model, lambda: compute_loss(model, parts, batch))
    after_recording = compute_loss(model, parts, batch).detach()  # draws on from seed 3
    assert torch.equal(after_recording, _loss(model, parts, batch, seed=3))  # RNG untouched

    assert set(calls) == _attention_layers(model)
    for layer_calls in calls.values():
        assert layer_calls and all(c.q[0] == 2 and c.dtype == torch.float32 for c in layer_calls)
    if family == "qwenimage":  # the caption mask reaches SDPA
        assert all(c.mask is not None for cs in calls.values() for c in cs)

    auto = attention.plan(calls, "auto", "cpu", attention.candidates("cpu", False), iters=2)
    assert set(auto.timings) == {c for cs in calls.values() for c in cs}
    for layer, order in auto.layers.items():
        assert sorted(order) == ["flash", "math"]
        times = {b: sum(auto.timings[c][b] for c in calls[layer]) for b in order}
        assert order[0] == min(times, key=times.get) and all(t > 0 for t in times.values())
    assert len(auto.summary()) == len(auto.timings)
    # a kernel not timed still backs every layer up: math runs any shape
    flash_only = attention.plan(calls, "auto", "cpu", ["flash"], iters=1)
    assert set(map(tuple, flash_only.layers.values())) == {("flash", "math")}

    for kernel, other in (("math", FLASH), ("flash", MATH)):
        pinned = copy.deepcopy(denoiser)
        attention.plan(calls, kernel, "cpu", ()).pin(pinned)
        ran = _kernels(lambda: _loss(pinned, parts, batch))
        assert (MATH if kernel == "math" else FLASH) in ran and other not in ran
        torch.testing.assert_close(_loss(pinned, parts, batch), default, rtol=1e-4, atol=1e-6)


def test_a_kernel_that_cannot_run_a_layer_is_named(setups):
    denoiser, parts, batch = setups("sd")
    calls = attention.record_calls(denoiser, lambda: compute_loss(denoiser, parts, batch))
    with pytest.raises(ValueError, match=r"train.sdpa_backend=efficient: .* of (down|mid|up)_blocks\."):
        attention.plan(calls, "efficient", "cpu", ())


def test_a_pin_reaches_blocks_compiled_before_it(setups):
    """The step-0 evaluation may compile the blocks before the first batch's probe pins
    them: the pinned forward is guarded, so they recompile with the pin (no graph break).
    AOT autograd without inductor, whose graph shows the traced kernel: inductor's own
    attention pattern pass fuses CPU math attention back into the flash kernel."""
    import torch._dynamo

    from raylora.train.compile import compile_denoiser

    denoiser, parts, batch = setups("flux")
    calls = attention.record_calls(denoiser, lambda: compute_loss(denoiser, parts, batch))
    eager_math = copy.deepcopy(denoiser)
    attention.plan(calls, "math", "cpu", ()).pin(eager_math)
    model = copy.deepcopy(denoiser)
    torch._dynamo.reset()
    counters.clear()
    compile_denoiser(model, "regional", parts.family.repeated_blocks, fullgraph=True,
                     backend="aot_eager")
    _loss(model, parts, batch)  # compiles, PyTorch's default kernel (flash on CPU)
    assert FLASH in _kernels(lambda: _loss(model, parts, batch))
    attention.plan(calls, "math", "cpu", ()).pin(model)
    _loss(model, parts, batch)  # recompiles
    ran = _kernels(lambda: _loss(model, parts, batch))
    assert FLASH not in ran and "aten::bmm" in ran  # math attention, traced as matmuls
    assert not counters["graph_break"]
    torch.testing.assert_close(_loss(model, parts, batch), _loss(eager_math, parts, batch),
                               rtol=1e-4, atol=1e-6)


def test_planner_only_where_a_choice_is_made(base_config):
    from raylora.train.setup import attention_planner, build_run

    run = build_run(validate(base_config), _fresh_accelerator(1), 2, rank=0)
    for mode, wanted in (("default", False), ("auto", False), ("math", True)):
        base_config["train"]["sdpa_backend"] = mode  # auto: timed on CUDA only
        assert (attention_planner(validate(base_config), run) is not None) == wanted, mode
