"""``train.compile``: the denoiser compiled in place (``compile_denoiser``) computes what the
eager one computes, loss and LoRA gradients, through raylora's own step; keeps its parameter
and state-dict names (DDP, adapter export and resume depend on them); has no graph break
(the peft LoRA layers included) and compiles nothing after the first step of a shape.
Real inductor compile on CPU (needs a C++ compiler) for the regional mode every run uses, on
the UNet and the Flux.1 blocks; the other families' blocks through dynamo and AOTAutograd
with the eager backend (``INDUCTOR``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from inproc import lora_step_setup

from raylora.config import LoraSection, validate
from raylora.model import families
from raylora.model.lora import add_lora, lora_state_dict
from raylora.train.compile import UNET_RESNET_BLOCKS, compile_denoiser, repeated_blocks

from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of


# Families whose blocks the regional test compiles with inductor: SD's UNet blocks (resnets,
# cross-attention transformers) and Flux.1's double- and single-stream DiT blocks. The rest
# go through dynamo's capture (graph breaks, guards, recompiles: what raylora controls) and
# AOTAutograd's forward/backward split with backend="aot_eager": inductor's C++ code
# generation costs 40-70 s per family on 2 cores with a cold cache (measured: flux 66 s,
# lumina2 67 s, wan 40 s; 5-11 s warm), and its cache misses in every fresh clone (its keys
# hold the venv's include paths), ~15 min of a CI run for all families.
INDUCTOR = ("sd", "flux")


def same_step_as_eager(eager, compiled, parts, eager_params, compiled_params, batch, step):
    """One step's loss and LoRA gradients of ``compiled`` equal ``eager``'s (same seed);
    returns (compiled's grads, eager's)."""
    ref_loss, ref_grads = _loss_and_grads(eager, parts, eager_params, batch, seed=step)
    loss, grads = _loss_and_grads(compiled, parts, compiled_params, batch, seed=step)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    assert len(grads) == len(ref_grads) > 0
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
    return grads, ref_grads


def _loss_and_grads(model, parts, params, batch, seed: int):
    from raylora.train.step import compute_loss

    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # the same noise and timesteps for the eager and compiled model
    loss = compute_loss(model, parts, batch)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in params]


@torch.no_grad()
def _nonzero_adapter(model) -> None:
    """lora_B off zero (peft starts it there), so lora_A gets gradients too."""
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.02)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_regional_compile_matches_eager_without_breaks_or_recompiles(tiny, demo_data, tmp_path,
                                                                      family_name):
    comps, eager_params, parts, batch = lora_step_setup(tiny(family_name), demo_data,
                                                        str(tmp_path / "o"))
    fam, eager = comps.family, comps.denoiser
    _nonzero_adapter(eager)

    compiled = copy.deepcopy(eager)
    compiled_params = [p for p in compiled.parameters() if p.requires_grad]
    torch._dynamo.reset()
    counters.clear()
    # The blocks training compiles (setup.build_run passes the family's); fullgraph: a
    # graph break anywhere in a block, a peft LoRA layer included, is an error.
    backend = "inductor" if family_name in INDUCTOR else "aot_eager"
    names = compile_denoiser(compiled, "regional", fam.repeated_blocks, fullgraph=True, backend=backend)
    assert names and all(compiled.get_submodule(n)._compiled_call_impl is not None for n in names)
    assert {type(compiled.get_submodule(n)).__name__ for n in names} == set(fam.repeated_blocks)

    opt = torch.optim.SGD(compiled_params, lr=1e-2)
    graphs = None
    for step in range(3):
        grads, ref_grads = same_step_as_eager(eager, compiled, parts, eager_params,
                                              compiled_params, batch, step)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        if step == 0:
            graphs = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
            assert graphs[0] >= 1  # it really ran through dynamo (and inductor: INDUCTOR)
        else:  # later steps of the same shape compile nothing
            assert (counters["stats"]["unique_graphs"], counters["frames"]["total"]) == graphs
        # Both take the same optimizer step, so later steps run on changed weights.
        opt.step()
        with torch.no_grad():
            for p, g in zip(eager_params, ref_grads):
                p -= 1e-2 * g
    assert sum(counters["graph_break"].values()) == 0

    # Nothing renamed (no "_orig_mod."): checkpoints, resume and DDP see the same module.
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert list(lora_state_dict(compiled)) == list(lora_state_dict(eager))


CAPTIONS = ["a dog", "a red dog on the grass", "a small red dog sitting on a green lawn",
            "a small red dog sitting on a green lawn under a tall old tree", "two cats on a sofa"]


@pytest.mark.parametrize("family_name", [f for f in FAMILIES if families.get(f).cuts_captions
                                         and not families.get(f).reference_required])
def test_captions_of_new_lengths_compile_nothing_after_the_second(tiny, family_name):
    """A language-model caption is as long as its batch's longest, so the blocks of these
    families see a new text length nearly every batch. Compiled as training compiles them
    (``compile_options``: automatic dynamic shapes), the second length compiles once more,
    symbolic, and later lengths compile nothing; each step's loss and LoRA gradients are the
    eager model's. With static shapes (Qwen-Image) every length compiled the blocks again."""
    from test_families import _raylora_batch

    from raylora.train.compile import compile_options

    model = tiny(family_name)
    comps, _ = _raylora_batch(model, family_name, CAPTIONS[:1])
    fam, eager = comps.family, comps.denoiser
    torch.manual_seed(0)
    params = add_lora(eager, LoraSection(rank=4), fam.default_lora_targets(eager))
    _nonzero_adapter(eager)
    conds = []
    for caption in CAPTIONS:  # the caption beside a short one: as long as the caption
        with torch.no_grad():
            conds.append(fam.encode_text(comps.text_encoders,
                                         _raylora_batch(model, family_name, [caption, "x"])[1]))
    lengths = [c["prompt_embeds"].shape[1] for c in conds]
    assert len(set(lengths)) == len(CAPTIONS), lengths
    latents = fam.encode_pixels(comps.vae, torch.zeros(1, 3, 64, 64))
    noisy = torch.randn(2, latents.shape[1] // 2, *latents.shape[2:])
    t = torch.full((2,), 0.5)

    def step(model, cond, params):
        for p in params:
            p.grad = None
        out = fam.denoise(model, noisy, t, cond, guidance=1.0)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in params]

    def compiled_steps(options, n=len(conds)):
        net = copy.deepcopy(eager)
        net_params = [p for p in net.parameters() if p.requires_grad]
        torch._dynamo.reset()
        counters.clear()
        compile_denoiser(net, "regional", fam.repeated_blocks, fullgraph=True,
                         backend="aot_eager", **options)
        graphs = []
        for cond in conds[:n]:
            out, grads = step(net, cond, net_params)
            ref, ref_grads = step(eager, cond, params)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
            graphs.append(counters["stats"]["unique_graphs"])
        assert sum(counters["graph_break"].values()) == 0
        return graphs

    graphs = compiled_steps(compile_options(fam))
    assert graphs[0] >= 1 and graphs[2:] == [graphs[1]] * (len(CAPTIONS) - 2), graphs
    if family_name == "qwenimage":
        # Static shapes: more graphs at each new length (a fifth would pass dynamo's
        # recompile limit for this tiny model's two blocks: then fullgraph raises)
        static = compiled_steps({}, 4)
        assert static[0] < static[1] < static[2] < static[3], static


def _unet(levels: int = 2, **kw):
    from diffusers import UNet2DConditionModel

    chans = (8, 16, 24, 32)[:levels]
    return UNet2DConditionModel(
        sample_size=16, block_out_channels=chans, layers_per_block=2, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=16, attention_head_dim=4, **kw)


def test_every_block_of_an_sd15_layout_unet_is_compiled():
    """SD 1.5's 4-level UNet has more kinds of ResnetBlock2D (channels, size, shortcut,
    requires_grad of the input) than dynamo's default recompile_limit (8): without raising
    it, the blocks past the eighth kind would silently run eagerly."""
    torch.manual_seed(0)
    unet = _unet(levels=4)
    add_lora(unet, LoraSection(rank=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch._dynamo.reset()
    counters.clear()
    # backend="eager": dynamo's capture and caching only; inductor is not what is tested.
    names = compile_denoiser(unet, "regional", repeated_blocks(unet) + UNET_RESNET_BLOCKS,
                             backend="eager")
    resnets = [n for n in names if type(unet.get_submodule(n)).__name__ == "ResnetBlock2D"]
    assert len(resnets) == 22
    x, t, text = torch.randn(2, 4, 16, 16), torch.tensor([1, 500]), torch.randn(2, 7, 16)
    unet(x, t, text).sample.mean().backward()
    assert not counters["unimplemented"]  # where a recompile limit hit is recorded
    assert counters["frames"]["ok"] == counters["frames"]["total"]
    # one graph per kind of block: more than the default limit of 8 resnet kinds alone
    assert counters["stats"]["unique_graphs"] > 8 + 2


def test_full_compile_keeps_names_and_output():
    """``full``: the whole model compiled in place (aot_eager: the capture and the
    forward/backward split, without inductor's minutes of CPU code generation)."""
    torch.manual_seed(0)
    eager = _unet()
    params = add_lora(eager, LoraSection(rank=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    assert compile_denoiser(compiled, "full", backend="aot_eager") == [""]
    assert compiled._compiled_call_impl is not None
    x, t, text = torch.randn(2, 4, 16, 16), torch.tensor([1, 500]), torch.randn(2, 7, 16)
    ref = eager(x, t, text).sample
    ref.square().mean().backward()
    out = compiled(x, t, text).sample
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for a, b in zip([p for p in compiled.parameters() if p.requires_grad], params):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_modes_and_default_blocks():
    from diffusers import SD3Transformer2DModel

    unet = _unet()
    assert compile_denoiser(unet, "none") == [] and unet._compiled_call_impl is None
    with pytest.raises(ValueError, match="compile mode 'fast'"):
        compile_denoiser(unet, "fast")
    with pytest.raises(ValueError, match="no \\['FluxTransformerBlock'\\]"):
        compile_denoiser(unet, "regional", ["FluxTransformerBlock"])
    # torch.compile's own mode passes through (the bench's CUDA-graph and autotune rows).
    assert compile_denoiser(unet, "full", mode="reduce-overhead") == [""]
    assert unet._compiled_call_impl is not None
    # UNets: diffusers' _repeated_blocks (resnets only when asked for); SD3 declares none.
    assert repeated_blocks(unet) == ("BasicTransformerBlock",)
    sd3 = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)
    assert repeated_blocks(sd3) == ("JointTransformerBlock",)


def test_channels_last_changes_the_layout_not_the_step(base_config, batches, tmp_path):
    """train.channels_last: the UNet's conv weights are stored NHWC; the losses, the LoRA
    weights trained and the adapter's keys are those of the default layout."""
    from inproc import _train

    runs = {}
    for layout in (False, True):
        base_config["train"]["channels_last"] = layout
        runs[layout], _ = _train(validate(base_config), batches, 2, str(tmp_path / str(layout)))
    convs = {n: p for n, p in runs[True].model.named_parameters()
             if p.dim() == 4 and p.shape[1] > 1 and p.shape[2] > 1}
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last)
                         and not p.is_contiguous() for p in convs.values())
    assert all(p.is_contiguous() for n, p in runs[False].model.named_parameters() if n in convs)
    assert [r["loss"] for r in runs[True].state.history] == pytest.approx(
        [r["loss"] for r in runs[False].state.history], rel=1e-5)
    plain, nhwc = (lora_state_dict(runs[k].model) for k in (False, True))
    assert plain.keys() == nhwc.keys()
    # NHWC convolutions sum in another order, so gradients differ by rounding; AdamW's
    # m/sqrt(v) turns that into a relative difference wherever a gradient is near zero.
    # So the weights are compared in units of the step (lr), not of their own size: 1% of
    # one step. (A CI run saw 3.7e-6 on one element of 256 after 4 steps.) lora_B starts
    # at zero, so its size is what training moved it.
    atol = base_config["train"]["learning_rate"] / 100
    assert max(float(v.abs().max()) for k, v in plain.items() if "lora_B" in k) > 100 * atol
    for k in plain:
        torch.testing.assert_close(nhwc[k], plain[k], rtol=1e-4, atol=atol)


def test_bf16_groupnorms_run_in_bf16_unless_groupnorm_fp32(base_config, batches, tmp_path):
    """train.mixed_precision bf16 (CPU autocast here, as the worker's Accelerator sets it):
    every GroupNorm of the UNet runs outside autocast on a bf16 input, or under autocast
    (CUDA's policy runs it in fp32; CPU's has no rule for it) with train.groupnorm_fp32.
    Parameters and adapter keys are the same, and the two runs' losses agree to bf16's
    rounding. Without bf16 nothing changes."""
    from torch.overrides import TorchFunctionMode

    from inproc import _train

    from raylora.train.norms import GroupNormInWeightDtype

    class GroupNormCalls(TorchFunctionMode):  # (autocast on?, input dtype) of each call
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.group_norm:
                self.calls.append((torch.is_autocast_enabled("cpu"), args[0].dtype))
            return func(*args, **(kwargs or {}))

    base_config["train"].update(mixed_precision="bf16", max_steps=3)
    runs, calls = {}, {}
    for fp32 in (False, True):
        base_config["train"]["groupnorm_fp32"] = fp32
        runs[fp32], _ = _train(validate(base_config), batches, 3, str(tmp_path / str(fp32)))
        norms = [m for m in runs[fp32].model.modules() if isinstance(m, torch.nn.GroupNorm)]
        assert sum(type(m) is GroupNormInWeightDtype for m in norms) == (0 if fp32 else len(norms))
        with torch.autocast("cpu", dtype=torch.bfloat16), GroupNormCalls() as mode:
            runs[fp32].model(torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 7, 32))
        calls[fp32] = mode.calls
        assert len(calls[fp32]) == len(norms) > 4
    assert set(calls[False]) == {(False, torch.bfloat16)}
    assert {on for on, _ in calls[True]} == {True}
    assert [n for n, _ in runs[False].model.named_parameters()] == \
        [n for n, _ in runs[True].model.named_parameters()]
    assert lora_state_dict(runs[False].model).keys() == lora_state_dict(runs[True].model).keys()
    bf16, fp32 = ([r["loss"] for r in runs[k].state.history] for k in (False, True))
    assert len(bf16) == 3 and bf16 == pytest.approx(fp32, rel=0.05)

    base_config["train"].update(mixed_precision="no", groupnorm_fp32=False, max_steps=1)
    plain, _ = _train(validate(base_config), batches, 1, str(tmp_path / "no"))
    assert not any(type(m) is GroupNormInWeightDtype for m in plain.model.modules())


# ---------------------------------------------------------------- train.compile_cache_uri


def _cache_tree(tiny_model, demo_data, tmp_path, **train) -> dict:
    return {"model": {"pretrained": tiny_model},
            "data": {"uri": demo_data, "resolution": 64, "center_crop": True,
                     "random_flip": False},
            "train": {"batch_size": 2, "max_steps": 2, "learning_rate": 1e-3,
                      "compile": "regional", "compile_cache_uri": str(tmp_path / "cc"), **train},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1},
            "checkpoint": {"every_n_steps": 2}, "output": {"uri": str(tmp_path / "out")}}


def test_a_ray_run_stores_its_compiled_code_and_a_fresh_process_compiles_nothing(
        ray_local, tiny_model, demo_data, tmp_path):
    """A Ray Train run with train.compile_cache_uri writes one entry (rank 0, after its
    first step). A new process with an empty local inductor cache, building the same run,
    loads it: every inductor graph and AOTAutograd entry is found, none compiled; the
    loaded code computes what eager computes; and it writes nothing back (nothing new)."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from raylora.launch import run

    tree = _cache_tree(tiny_model, demo_data, tmp_path)
    summary = run(validate(tree))
    assert summary["metrics"]["steps"] == 2
    entries = sorted((tmp_path / "cc").iterdir())
    assert [e.suffix for e in entries] == [".bin"] and entries[0].stat().st_size > 10_000
    mtime = entries[0].stat().st_mtime_ns

    path = tmp_path / "child.yaml"
    path.write_text(yaml.safe_dump(tree))
    fresh = tmp_path / "inductor"
    # One thread, as Ray gives a worker of cpus_per_worker=1: CPU code is compiled per count.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(fresh), TRITON_CACHE_DIR=str(fresh / "t"),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "compile_child.py"),
                           str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] > 0 and out["saved"] == 0
    ind, aot = out["inductor"], out["aot_autograd"]
    # Two kinds of transformer block in the tiny UNet, forward and backward graphs each.
    assert ind.get("fxgraph_cache_hit", 0) >= 4 and ind.get("fxgraph_cache_miss", 0) == 0, ind
    assert aot.get("autograd_cache_hit", 0) >= 2 and aot.get("autograd_cache_miss", 0) == 0, aot
    assert len(out["history"]) == 2 and all(0 < x < 10 for x in out["history"])
    compiled, eager = out["losses"]
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert entries[0].stat().st_mtime_ns == mtime


def test_compile_cache_entry_names_what_shapes_the_graphs(tiny_model, demo_data, tmp_path):
    """One entry per graph-relevant setting: a Tune trial that only changes the learning
    rate, or a run of another checkpoint of the same architecture, shares the entry; a new
    LoRA rank, batch size, resolution, dtype or compile mode does not."""
    import shutil

    from raylora.model.load import load_components
    from raylora.train.compile import cache_key
    from raylora.train.setup import compile_cache_inputs

    base = _cache_tree(tiny_model, demo_data, tmp_path)
    comps = load_components(validate(base).model, torch.float32)
    # The same architecture saved elsewhere (another checkpoint of the model).
    elsewhere = shutil.copytree(tiny_model, tmp_path / "copy")
    moved = load_components(validate({**base, "model": {"pretrained": str(elsewhere)}}).model,
                            torch.float32)

    def key(comps=comps, **changes):
        tree = copy.deepcopy(base)
        for dotted, value in changes.items():
            section, name = dotted.split("__")
            tree.setdefault(section, {})[name] = value
        cfg = validate(tree)
        return cache_key(compile_cache_inputs(cfg, comps), "cpu")

    same = {key(), key(train__learning_rate=3e-4), key(output__uri=str(tmp_path / "other")),
            key(train__max_steps=9), key(train__compile_cache_uri="s3://b/cc"),
            key(moved, model__pretrained=str(elsewhere)), key(scaling__use_gpu=True)}
    assert len(same) == 1
    other = [key(lora__rank=8), key(train__batch_size=4), key(data__resolution=32),
             key(train__mixed_precision="bf16"), key(train__compile="full"),
             key(train__gradient_checkpointing=True),
             key(train__cuda_graphs=True, train__compile="regional", scaling__use_gpu=True),
             key(train__mixed_precision="bf16", train__groupnorm_fp32=True)]
    assert len(set(other) | same) == len(other) + 1


def test_a_missing_or_unreadable_entry_means_a_cold_compile_a_bad_key_an_error(
        tiny_model, demo_data, tmp_path):
    """A missing or foreign entry costs a cold compile, never the run; a URI no worker could
    read, or the key without compiling, is a config error before anything starts."""
    from raylora.config import ConfigError
    from raylora.launch import plan, resolve_paths
    from raylora.storage import Storage
    from raylora.train.compile import CompileCache

    assert CompileCache(Storage(), str(tmp_path / "none.bin")).load() == 0
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not torch's format")
    cache = CompileCache(Storage(), str(junk))
    assert cache.load() == 0 and cache.loaded == 0
    with pytest.raises(ConfigError, match="train.compile_cache_uri: ftp://host/cc: unsupported URI scheme"):
        plan(resolve_paths(validate(_cache_tree(tiny_model, demo_data, tmp_path,
                                                compile_cache_uri="ftp://host/cc"))))
    with pytest.raises(ConfigError, match="train.compile_cache_uri: set, but train.compile is none"):
        validate({"model": {"pretrained": "x"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                  "train": {"compile": "none", "compile_cache_uri": "s3://b/cc"}})
    # auto that resolves to eager (CPU; a DoRA run on GPU) kept nothing, without a word
    for scaling, lora, why in (({}, {}, "scaling.use_gpu is false"),
                               ({"use_gpu": True}, {"variant": "dora"}, "lora.variant dora")):
        with pytest.raises(ConfigError) as exc:
            validate({"model": {"pretrained": "x"}, "data": {"uri": "d"}, "output": {"uri": "o"},
                      "scaling": scaling, "lora": lora, "train": {"compile_cache_uri": "s3://b/cc"}})
        assert exc.value.problems == [
            f"train.compile_cache_uri: set, but train.compile auto compiles nothing for this run "
            f"({why}): nothing is compiled to keep; drop one of them, or set train.compile: regional"]
    validate({"model": {"pretrained": "x"}, "data": {"uri": "d"}, "output": {"uri": "o"},
              "scaling": {"use_gpu": True}, "train": {"compile_cache_uri": "s3://b/cc"}})


def test_runs_sharing_an_entry_keep_each_others_graphs(tmp_path):
    """Runs that differ only in what the entry's name leaves out (held-out evaluation,
    previews) share an entry; each run's save adds to it. Run A saves twice, as a worker
    does (its training graph at the first step, its evaluation graph at a checkpoint), run
    B compiles the training graph and a preview's, and run C, on a fresh machine like the
    others, finds both of its graphs. A save wrote only what its own process compiled or
    used (B dropped A's evaluation graph), and torch's reader of a twice-saved blob keeps
    only the second save (B never saw A's training graph), so C compiled cold.
    Inductor with extern matmuls only: real FX-graph cache artifacts, no C++ to build."""
    from torch._inductor.utils import fresh_cache
    from torch.compiler._cache import CacheArtifactManager

    from raylora.storage import Storage
    from raylora.train.compile import CompileCache

    fns = {"train": lambda x, w: x @ w, "eval": lambda x, w: x @ w.t(),
           "preview": lambda x, w: torch.addmm(w, x, w)}
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    entry = str(tmp_path / "cc" / "entry.bin")

    def run(*saves):
        """One run on a fresh machine: (loaded, [saved at each save], fx hits, fx misses)."""
        torch._dynamo.reset()
        CacheArtifactManager.clear()
        counters.clear()
        with fresh_cache():  # an empty local inductor cache, as on a new machine
            cache = CompileCache(Storage(), entry)
            loaded, saved = cache.load(), []
            for names in saves:
                for n in names:
                    torch.compile(fns[n], dynamic=False)(x, w)
                saved.append(cache.save())
        ind = counters["inductor"]
        return loaded, saved, ind["fxgraph_cache_hit"], ind["fxgraph_cache_miss"]

    try:
        # Each graph is one inductor and one AOTAutograd artifact.
        assert run(["train"], ["eval"]) == (0, [2, 4], 0, 2)
        assert run(["train", "preview"]) == (4, [6], 1, 1)
        assert run(["train", "eval"]) == (6, [0], 2, 0)  # all found, nothing new to write
        # The entry is torch's own format, whole to torch's reader too.
        stored = CacheArtifactManager.deserialize((tmp_path / "cc" / "entry.bin").read_bytes())
        assert {k: len(v) for k, v in stored.items()} == {"inductor": 3, "aot_autograd": 3}
    finally:
        torch._dynamo.reset()
        CacheArtifactManager.clear()
