"""``scaling.strategy: fsdp`` below Ray: FSDP2 sharding of a LoRA-wrapped UNet trains what
DDP trains, holds about half the parameters per rank on 2 ranks, and its DCP checkpoint
written by 2 ranks resumes on 1; every family's denoiser built without weights, LoRA
attached, sharded and read shard by shard equals the loaded one; the config refuses what
FSDP cannot do. Real process groups: 2 (and 1) spawned CPU processes over gloo. The Ray
runs are in test_fsdp_ray.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from localhead import free_port
from ranks import spawn

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
STEPS = 3


def _unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, block_out_channels=(8, 16), layers_per_block=2, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4)


def _lora_unet():
    """The same weights in every process: a seeded UNet with LoRA, lora_B made non-zero so
    lora_A gets gradients from the first step."""
    from raylora.config import LoraSection
    from raylora.model.lora import add_lora

    torch.manual_seed(0)
    unet = _unet()
    add_lora(unet, LoraSection(rank=4, target_modules=TARGETS))
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return unet


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(2, 4, 16, 16, generator=g), torch.randint(0, 1000, (2,), generator=g),
            torch.randn(2, 7, 16, generator=g), torch.randn(2, 4, 16, 16, generator=g))


def _train(model, rank: int):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        x, t, text, target = _batch(rank, step)
        out = model(x, t, encoder_hidden_states=text).sample
        torch.nn.functional.mse_loss(out, target).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _init(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _full_exp_avg(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    # Full state dicts land on rank 0 only; the other ranks get {}.
    return {k: v["exp_avg"].clone() for k, v in osd.get("state", {}).items()}


def _two_ranks(rank: int, world: int, port: int, out: str):
    from peft.utils import get_peft_model_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from raylora.config import LoraSection
    from raylora.model.lora import add_lora
    from raylora.train.fsdp import full_lora_state_dict, param_bytes_per_rank, save_sharded, shard_denoiser

    _init(rank, world, port)
    try:
        initial = {k: v.clone() for k, v in get_peft_model_state_dict(_lora_unet()).items()}
        ddp_model = _lora_unet()
        unsharded_bytes = param_bytes_per_rank(ddp_model)
        _train(DistributedDataParallel(ddp_model), rank)
        ddp_sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(ddp_model).items()}

        fsdp_model = _lora_unet()
        names = shard_denoiser(fsdp_model, ("BasicTransformerBlock",))
        sharded_bytes = param_bytes_per_rank(fsdp_model)
        opt = _train(fsdp_model, rank)
        fsdp_sd = full_lora_state_dict(fsdp_model)
        exp_avg = _full_exp_avg(fsdp_model, opt)
        save_sharded(os.path.join(out, "ckpt"), fsdp_model, opt)
        # bf16 frozen base + fp32 LoRA masters in one FSDP unit, bf16 compute: one step.
        torch.manual_seed(0)
        mixed = _unet().to(torch.bfloat16)
        add_lora(mixed, LoraSection(rank=4, target_modules=TARGETS))
        shard_denoiser(mixed, ("BasicTransformerBlock",), param_dtype=torch.bfloat16)
        mixed_opt = torch.optim.AdamW([p for p in mixed.parameters() if p.requires_grad], lr=1e-2)
        x, t, text, target = _batch(rank, 0)
        sample = mixed(x.bfloat16(), t, encoder_hidden_states=text.bfloat16()).sample
        torch.nn.functional.mse_loss(sample.float(), target).backward()
        mixed_grad_dtypes = {p.grad.dtype for p in mixed.parameters() if p.requires_grad}
        mixed_opt.step()
        mixed_sd = full_lora_state_dict(mixed)

        all_bytes = [None] * world
        dist.all_gather_object(all_bytes, sharded_bytes)
        if rank == 0:
            torch.save({"initial": initial, "ddp": ddp_sd, "fsdp": fsdp_sd, "names": names,
                        "unsharded_bytes": unsharded_bytes, "sharded_bytes": all_bytes,
                        "exp_avg": exp_avg, "mixed_grad_dtypes": mixed_grad_dtypes,
                        "mixed": mixed_sd}, os.path.join(out, "two.pt"))
        # Every rank gathers the whole LoRA (what each checkpoint's adapter is written from).
        assert set(fsdp_sd) == set(ddp_sd)
    finally:
        dist.destroy_process_group()


def _one_rank(rank: int, world: int, port: int, out: str):
    from raylora.train.fsdp import full_lora_state_dict, load_sharded, shard_denoiser

    _init(rank, world, port)
    try:
        model = _lora_unet()  # fresh: the initial LoRA, not the trained one
        shard_denoiser(model, ("BasicTransformerBlock",))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        load_sharded(os.path.join(out, "ckpt"), model, opt)
        torch.save({"lora": full_lora_state_dict(model), "exp_avg": _full_exp_avg(model, opt),
                    "steps": {k: v["step"] for k, v in opt.state_dict()["state"].items()}},
                   os.path.join(out, "one.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One 2-process run: DDP training, FSDP training, FSDP sharded checkpoint."""
    out = str(tmp_path_factory.mktemp("fsdp"))
    spawn(_two_ranks, 2, 2, free_port(), out)
    return out, torch.load(os.path.join(out, "two.pt"))


def test_fsdp_trains_the_same_lora_as_ddp(two_rank_run):
    _, r = two_rank_run
    ddp, fsdp, initial = r["ddp"], r["fsdp"], r["initial"]
    # Shard units: the transformer blocks (2 down, 1 mid, 3 up), then the root.
    assert len(r["names"]) == 6 + 1 and r["names"][-1] == ""
    # blocks x (attn1, attn2) x targets x (A, B)
    assert set(fsdp) == set(ddp) == set(initial) and len(ddp) == 6 * 2 * 4 * 2
    # Training moved every LoRA tensor, so equality below is not equality of the init.
    assert all((ddp[k] - initial[k]).abs().max() > 1e-3 for k in ddp)
    worst = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    assert worst < 1e-5, worst


def test_fsdp_holds_about_half_the_parameters_per_rank(two_rank_run):
    _, r = two_rank_run
    for b in r["sharded_bytes"]:
        assert b <= 0.6 * r["unsharded_bytes"], (b, r["unsharded_bytes"])
    # Together the ranks hold the model once (dim-0 shards, no padding counted).
    assert sum(r["sharded_bytes"]) == r["unsharded_bytes"]


def test_sharded_checkpoint_from_two_ranks_resumes_on_one(two_rank_run):
    out, r = two_rank_run
    spawn(_one_rank, 1, 1, free_port(), out)
    one = torch.load(os.path.join(out, "one.pt"))
    assert set(one["lora"]) == set(r["fsdp"])
    for k, v in r["fsdp"].items():
        torch.testing.assert_close(one["lora"][k], v, rtol=0, atol=0)
    assert set(one["exp_avg"]) == set(r["exp_avg"]) and len(r["exp_avg"]) == len(r["fsdp"])
    for k, v in r["exp_avg"].items():
        assert v.abs().max() > 0
        torch.testing.assert_close(one["exp_avg"][k], v, rtol=0, atol=0)
    assert all(float(s) == STEPS for s in one["steps"].values())


def test_bf16_base_with_fp32_lora_trains_in_one_unit(two_rank_run):
    """The layout big models use: frozen bf16 base and fp32 LoRA share each FSDP unit,
    computed in bf16 (MixedPrecisionPolicy), gradients and master weights fp32."""
    _, r = two_rank_run
    assert r["mixed_grad_dtypes"] == {torch.float32}
    assert set(r["mixed"]) == set(r["initial"])
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in r["mixed"].values())
    # One AdamW step moves every LoRA A/B tensor (lr 1e-2; B starts at 0 under peft's init).
    assert all(not torch.equal(v, r["initial"][k]) for k, v in r["mixed"].items() if "lora_B" in k)


def test_offload_without_an_accelerator_is_refused_up_front():
    from raylora.train.fsdp import shard_denoiser

    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: offload is allowed")
    with pytest.raises(ValueError, match="accelerator"):
        shard_denoiser(torch.nn.Linear(2, 2), ("Linear",), offload=True)


from raylora.model.tiny import FAMILIES  # every family raylora has a tiny model of


def _hollow_ranks(rank: int, world: int, port: int, out: str, paths: dict):
    """Per case (family, or family-expert): from_pretrained + LoRA (the DDP path) vs hollow
    + LoRA + shard + read (the FSDP path), same seed: the largest difference of any tensor,
    and bytes. ``paths``: case → (model folder, model.expert)."""
    from accelerate.utils import set_seed
    from torch.distributed.tensor import DTensor

    from raylora.config import LoraSection, ModelSection
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora
    from raylora.train.fsdp import component_folder, param_bytes_per_rank, shard_and_load

    _init(rank, world, port)
    result = {}
    try:
        for family, (path, expert) in paths.items():
            lora = LoraSection(rank=4)
            set_seed(3)
            ref = load_components(ModelSection(pretrained=path, expert=expert), torch.float32)
            add_lora(ref.denoiser, lora, ref.family.default_lora_targets(ref.denoiser))
            set_seed(3)
            comps = load_components(ModelSection(pretrained=path, expert=expert), torch.float32,
                                    encoders=False, hollow_denoiser=True)
            model = comps.denoiser
            add_lora(model, lora, comps.family.default_lora_targets(model))
            # the folder training reads (raylora.train.setup.shard_denoiser_of)
            units = shard_and_load(model, comps.family.repeated_blocks,
                                   component_folder(comps.path, comps.component), "cpu")
            got = model.state_dict()
            worst = 0.0
            for k, v in ref.denoiser.state_dict().items():
                g = got[k].full_tensor() if isinstance(got[k], DTensor) else got[k]
                assert g.shape == v.shape and g.dtype == v.dtype, k
                worst = max(worst, (g - v).abs().max().item())
            lora_keys = [k for k in got if "lora_" in k]
            result[family] = {"worst": worst, "units": len(units), "lora": len(lora_keys),
                              "sharded": param_bytes_per_rank(model),
                              "whole": param_bytes_per_rank(ref.denoiser)}
        if rank == 0:
            torch.save(result, os.path.join(out, "hollow.pt"))
    finally:
        dist.destroy_process_group()


def test_every_family_loads_shard_by_shard_to_the_loaded_model(tiny, tmp_path):
    """The FSDP loading path (no rank holds the whole base) gives every tensor of the
    loaded model, LoRA's initial weights included (peft drew them from the same seed); for
    Wan 2.2's low-noise expert, transformer_2's."""
    paths = {f: (tiny(f), None) for f in FAMILIES}
    paths["wan-low_noise"] = (tiny("wan", experts=True), "low_noise")
    spawn(_hollow_ranks, 2, 2, free_port(), str(tmp_path), paths)
    r = torch.load(os.path.join(tmp_path, "hollow.pt"))
    assert set(r) == set(paths)
    for family, x in r.items():
        assert x["worst"] == 0.0, (family, x)
        assert x["units"] >= 3 and x["lora"] > 0, (family, x)
        assert x["sharded"] <= 0.6 * x["whole"], (family, x)


def _config(**scaling_and_more):
    from raylora.config import validate

    tree = {"model": {"pretrained": "/m"}, "data": {"uri": "/d"}, "output": {"uri": "/o"},
            "scaling": {"num_workers": 2, "strategy": "fsdp"}}
    for section, keys in scaling_and_more.items():
        tree[section] = {**tree.get(section, {}), **keys}
    return validate(tree)


@pytest.mark.parametrize("changes, key", [
    ({"model": {"quantize": "nf4"}}, "model.quantize"),
    ({"train": {"ema_decay": 0.99}}, "train.ema_decay"),
    ({"lora": {"train_text_encoder": True}}, "lora.train_text_encoder"),
    ({"train": {"optimizer": "prodigy"}}, "train.optimizer"),
    ({"train": {"compile": "regional"}}, "train.compile"),
    ({"scaling": {"num_workers": 2, "strategy": "fsdp", "fsdp": {"offload": True}}}, "scaling.fsdp.offload"),
    ({"scaling": {"num_workers": 2, "strategy": "ddp", "fsdp": {"reshard_after_forward": False}}},
     "scaling.fsdp"),
])
def test_what_fsdp_cannot_do_is_refused_by_key(changes, key):
    with pytest.raises(ValueError) as e:
        _config(**changes)
    assert key in str(e.value)


def test_fsdp_defaults_are_accepted_and_compile_auto_is_eager_under_fsdp():
    cfg = _config()
    assert cfg.scaling.strategy == "fsdp" and cfg.scaling.fsdp.reshard_after_forward
    assert cfg.compile_mode == "none"
    gpu = _config(scaling={"num_workers": 2, "strategy": "fsdp", "use_gpu": True})
    assert gpu.compile_mode == "none"
    assert _config(scaling={"strategy": "ddp", "use_gpu": True}).compile_mode == "regional"


@pytest.mark.parametrize("shard", [False, True])
def test_fsdp_reads_a_variants_weights_by_diffusers_names_and_a_folder_without_is_refused_in_planning(
        shard, tiny_model, demo_data, tmp_path):
    """A UNet saved with ``variant="fp16"`` (sharded: its index is
    ``diffusion_pytorch_model.safetensors.index.fp16.json``, as diffusers names it) is read
    row by row as FSDP reads it; a UNet with only ``.bin`` weights is refused by the plan,
    naming scaling.strategy, instead of failing in every worker."""
    import shutil

    from diffusers import UNet2DConditionModel

    from raylora.config import ConfigError, validate
    from raylora.launch import plan
    from raylora.train.fsdp import _WeightFiles

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    shutil.rmtree(folder / "unet")
    unet.save_pretrained(folder / "unet", variant="fp16", max_shard_size="200KB" if shard else "10GB")
    names = sorted(os.listdir(folder / "unet"))
    assert ("diffusion_pytorch_model.safetensors.index.fp16.json" in names) == shard
    files = _WeightFiles(str(folder / "unet"), "fp16")
    sd = unet.state_dict()
    assert set(files.file_of) == set(sd) and len(set(files.file_of.values())) > int(shard)
    for key, value in sd.items():
        assert torch.equal(files.rows(key, 0, 2), value[:2] if value.dim() else value), key

    def cfg(model, variant=None):
        return validate({"model": {"pretrained": str(model), "variant": variant},
                         "data": {"uri": demo_data, "resolution": 64},
                         "scaling": {"num_workers": 2, "strategy": "fsdp"},
                         "output": {"uri": str(tmp_path / "o")}})

    if shard:  # the .bin case once is enough
        return
    binary = tmp_path / "bin"
    shutil.copytree(tiny_model, binary)
    shutil.rmtree(binary / "unet")
    unet.save_pretrained(binary / "unet", safe_serialization=False)
    with pytest.raises(ConfigError) as exc:
        plan(cfg(binary), heldout=False)
    assert exc.value.problems == [
        f"scaling.strategy: fsdp reads each rank's shard straight from safetensors weights; "
        f"model.pretrained: {binary} has neither unet/diffusion_pytorch_model.safetensors nor "
        "unet/diffusion_pytorch_model.safetensors.index.json"]


def _bf16_ranks(rank: int, world: int, port: int, out: str, paths: dict, demo_data: str):
    """Per family: raylora's build_run under train.mixed_precision=bf16 with scaling.strategy
    ddp, then fsdp, on the same 2 ranks; each takes one training micro-step on its own 2
    demo rows (the same seeds). Rank 0 saves {family: {strategy: (loss, adapter)}}."""
    from inproc import _fresh_accelerator, demo_batch

    from raylora.config import validate
    from raylora.train.setup import build_run
    from raylora.train.step import train_micro_step

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    _init(rank, world, port)
    result = {}
    try:
        for family, path in paths.items():
            batch = demo_batch(family, path, demo_data, n=2 * world)
            rows = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
            for strategy in ("ddp", "fsdp"):
                cfg = validate({"model": {"pretrained": path, "max_sequence_length": 32},
                                "data": {"uri": demo_data, "resolution": 64}, "lora": {"rank": 4},
                                "train": {"learning_rate": 1e-2, "seed": 0, "mixed_precision": "bf16"},
                                "scaling": {"num_workers": world, "strategy": strategy},
                                "output": {"uri": os.path.join(out, family, strategy)}})
                run = build_run(cfg, _fresh_accelerator(1, "bf16"), 1, rank=rank)
                torch.manual_seed(100 + rank)
                loss = train_micro_step(run.accelerator, run.model, run.parts, run.optimizer,
                                        run.lr_scheduler, run.params, rows, 1.0)
                result.setdefault(family, {})[strategy] = (float(loss), run.lora_state())
        if rank == 0:
            torch.save(result, os.path.join(out, "bf16.pt"))
    finally:
        dist.destroy_process_group()


BF16_FAMILIES = ("flux", "wan")


@pytest.fixture(scope="module")
def bf16_runs(tiny, demo_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bf16"))
    spawn(_bf16_ranks, 2, 2, free_port(), out, {f: tiny(f) for f in BF16_FAMILIES}, demo_data)
    return torch.load(os.path.join(out, "bf16.pt"))


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_fsdp_under_bf16_computes_what_ddp_computes(bf16_runs, family):
    """FSDP's bf16 gathers must not change what autocast computes in. Flux: its blocks get
    the RoPE cos/sin and guidance in fp32, as under DDP (FSDP's default input cast made
    them bf16: loss 1.5928421 here, DDP's 1.5928419). Wan: its _keep_in_fp32_modules (time
    embedder, norms, scale_shift_table) stay fp32 (gathered in bf16: loss 1.7432759, DDP's
    1.7431313, the adapter 3.5 % off after 3 steps). The same loss and, after one
    optimizer step, the same adapter, to the last bit on these CPUs (so were SD, SDXL,
    SD3, Qwen-Image, Z-Image, Lumina 2, Sana, Chroma and Flux.2, checked once)."""
    ddp, fsdp = bf16_runs[family]["ddp"], bf16_runs[family]["fsdp"]
    assert ddp[0] > 0 and fsdp[0] == ddp[0], (ddp[0], fsdp[0])
    a, b = ddp[1], fsdp[1]
    assert set(a) == set(b) and len(a) > 0
    # the step moved the adapter (lora_B starts at 0): equal adapters are not equal inits
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 1e-3
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, worst


def test_wans_fp32_kept_weights_are_fp32_units_or_left_whole(tiny, tmp_path):
    """Under bf16 the hollow Wan (fp32 where from_pretrained keeps it) shards into its own
    units the time embedder and the affine norm2s, gathered in fp32; the bare
    scale_shift_tables are left out of FSDP, whole fp32 tensors on every rank; the rest
    are bf16 shards. Read shard by shard, every tensor equals the bf16-loaded model's."""
    spawn(_wan_units_ranks, 2, 2, free_port(), str(tmp_path), tiny("wan"))
    r = torch.load(os.path.join(tmp_path, "wan.pt"))
    blocks = r["blocks"]
    assert blocks >= 2
    kept = ["condition_embedder.time_embedder"] + [f"blocks.{i}.norm2" for i in range(blocks)]
    assert r["units"] == kept + [f"blocks.{i}" for i in range(blocks)] + [""]
    assert r["whole"] == ["scale_shift_table"] + [f"blocks.{i}.scale_shift_table" for i in range(blocks)]
    assert r["worst"] == 0.0
    # dtypes: the fp32-kept ones fp32 in the shards (and whole), everything else bf16
    for name, dtype in r["dtypes"].items():
        fp32 = "lora_" in name or "time_embedder" in name or ".norm2." in name or "scale_shift_table" in name
        assert dtype == (torch.float32 if fp32 else torch.bfloat16), (name, dtype)


def _wan_units_ranks(rank: int, world: int, port: int, out: str, path: str):
    from accelerate.utils import set_seed
    from torch.distributed.tensor import DTensor

    from raylora.config import LoraSection, ModelSection
    from raylora.model.load import load_components
    from raylora.model.lora import add_lora
    from raylora.train.fsdp import shard_and_load

    _init(rank, world, port)
    try:
        set_seed(3)
        ref = load_components(ModelSection(pretrained=path), torch.bfloat16, encoders=False)
        add_lora(ref.denoiser, LoraSection(rank=4), ref.family.default_lora_targets(ref.denoiser))
        set_seed(3)
        comps = load_components(ModelSection(pretrained=path), torch.bfloat16, encoders=False,
                                hollow_denoiser=True)
        model = comps.denoiser
        add_lora(model, LoraSection(rank=4), comps.family.default_lora_targets(model))
        units = shard_and_load(model, comps.family.repeated_blocks, os.path.join(path, "transformer"),
                               "cpu", param_dtype=torch.bfloat16)
        got = model.state_dict()
        worst = max((got[k].full_tensor() if isinstance(got[k], DTensor) else got[k]).sub(v).abs().max().item()
                    for k, v in ref.denoiser.state_dict().items())
        if rank == 0:
            torch.save({"units": units, "blocks": len(model.blocks), "worst": worst,
                        "whole": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
                        "dtypes": {n: p.dtype for n, p in model.named_parameters()}},
                       os.path.join(out, "wan.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", [None, "fp16"])
def test_fsdp_downloads_only_the_weights_it_reads_from_the_hub(variant, online, hub, tiny_model, tmp_path):
    """A hub UNet folder as SD 1.5's is (.bin, non-EMA copies, an fp16 variant, here
    sharded, beside the safetensors): FSDP's component_folder requests config.json and
    what _WeightFiles reads for model.variant (the one file, or the index and its
    shards), not the folder's other weights."""
    import shutil

    from diffusers import UNet2DConditionModel

    from raylora.train.fsdp import _WeightFiles, component_folder

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model, repo)
    unet_dir = repo / "unet"
    plain = unet_dir / "diffusion_pytorch_model.safetensors"
    for extra in ("diffusion_pytorch_model.bin", "diffusion_pytorch_model.non_ema.safetensors",
                  "diffusion_pytorch_model.non_ema.bin"):
        shutil.copy(plain, unet_dir / extra)
    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    unet.save_pretrained(tmp_path / "fp16", variant="fp16", max_shard_size="500KB")
    shards = sorted(f for f in os.listdir(tmp_path / "fp16") if f.endswith(".safetensors"))
    assert len(shards) >= 2
    for f in shards + ["diffusion_pytorch_model.safetensors.index.fp16.json"]:
        shutil.copy(tmp_path / "fp16" / f, unet_dir / f)
    name = f"acme/fsdp-{variant}"
    hub.add(name, str(repo))
    hub.seen.clear()

    # without a variant: as raylora.train.setup calls it for a run without model.variant
    folder = component_folder(name, "unet", **({"variant": variant} if variant else {}))

    want = {"config.json"} | ({"diffusion_pytorch_model.safetensors"} if variant is None else
                              {"diffusion_pytorch_model.safetensors.index.fp16.json", *shards})
    assert set(os.listdir(folder)) == want
    got = {p.split("/unet/", 1)[1] for m, p, _ in hub.seen if m == "GET" and "/resolve/" in p}
    assert got == want
    files = _WeightFiles(folder, variant)
    assert set(files.file_of) == set(unet.state_dict())


def test_fsdp_component_download_errors_name_the_model_and_no_mirror_password(
        online, hub, tiny_model, monkeypatch):
    """FSDP's workers download their component themselves (``component_folder``): a repo
    the hub does not have failed there with huggingface_hub's own error, whose chain
    (httpx's) quoted the mirror's ``https://user:pass@...`` in the traceback Ray logs for a
    failed worker. It is now the error the driver gives, naming model.pretrained, its
    password left out, with no chain."""
    import traceback

    from huggingface_hub import constants, hf_api

    from raylora.train.fsdp import component_folder

    secret = hub.endpoint.replace("://", "://mirroruser:MIRRORPASS@")
    monkeypatch.setattr(constants, "ENDPOINT", secret)
    monkeypatch.setattr(hf_api.api, "endpoint", secret)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        secret + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(FileNotFoundError) as exc:
        component_folder("acme/not-on-the-hub", "unet")
    assert str(exc.value).startswith("model.pretrained: acme/not-on-the-hub: no such model repo")
    assert "MIRRORPASS" not in "".join(traceback.format_exception(exc.value))
