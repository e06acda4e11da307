"""lora.init_from: a run's LoRA starts as an existing adapter, for every family.

At step 0 each LoRA layer of the run computes the delta the family's stock pipeline
computes with that adapter loaded (``load_lora_weights``), though the run trains with
another lora.alpha; a kohya file raylora exported starts the run at the same place. What
cannot be started from (another rank or variant, text-encoder layers the run would drop,
modules the run does not target, a missing file) is one line naming lora.init_from,
before Ray where the file's header tells.
"""

from __future__ import annotations

import os

import pytest
import torch

from raylora.config import ConfigError, validate
from raylora.model.tiny import FAMILIES


# Families whose kohya export the stock pipeline does not read back as the same LoRA, and
# the words that say so. flux (fluxkontext, chroma: the same converter): diffusers' sd-scripts converter has Flux.1's widths built in
# (3072, 12288), not the tiny model's; wan: its converter expects other key names; sd3: it
# converts no kohya names; lumina2: its converter reads diffusion_model.* names
# (musubi-style), not sd-scripts' lora_unet_ ones. (zimage: its converter reads the fused
# qkv layers as rank 3r, which lora_init cuts back to each part's r: not refused.)
KOHYA_REFUSED = {
    "flux": "FluxPipeline's lora_state_dict cannot read it (AssertionError",
    "fluxkontext": "FluxKontextPipeline's lora_state_dict cannot read it (AssertionError",
    "chroma": "ChromaPipeline's lora_state_dict cannot read it (AssertionError",
    "wan": "WanPipeline's lora_state_dict cannot read it (KeyError",
    "sd3": "are not LoRA layers of a StableDiffusion3Pipeline component (transformer, "
           "text_encoder, text_encoder_2), e.g. lora_te1_",
    "lumina2": "are not LoRA layers of a Lumina2Pipeline component (transformer), e.g. lora_unet_",
}


def _cfg(model, data, out, **lora):
    return validate({
        "model": {"pretrained": model}, "data": {"uri": data, "resolution": 64, "center_crop": True},
        "lora": {"rank": 4, **lora}, "output": {"uri": str(out)},
        "train": {"max_steps": 2, "batch_size": 1, "seed": 0},
    })


def _build(cfg):
    from inproc import _fresh_accelerator
    from raylora.train.setup import build_run

    return build_run(cfg, _fresh_accelerator(1), 2, rank=0)


def _deltas(module, adapter=None) -> dict[str, torch.Tensor]:
    """Module name → the weight delta its LoRA layer adds (scale included)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in module.named_modules():
        if isinstance(m, LoraLayer):
            with torch.no_grad():
                out[name] = m.get_delta_weight(adapter or m.active_adapters[0]).float()
    return out


def _random_adapter(run, folder: str, seed: int = 0) -> None:
    """``run``'s LoRA drawn at random (B included: not a no-op), saved as raylora publishes it."""
    from raylora.model.lora import save_adapter

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in run.params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    save_adapter(run.accelerator.unwrap_model(run.model), folder, run.family,
                 run.trained_text_encoders)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_starts_as_the_stock_pipeline_with_the_adapter_loaded(tiny, family, demo_data, tmp_path):
    from raylora.checkpoint.kohya import export_kohya
    from raylora.model import families, lora_init
    from raylora.model.lora import WEIGHT_NAME
    from raylora.sample import load_adapter
    from raylora.storage import Storage

    fam = families.get(family)
    model = tiny(family)
    te = bool(fam.text_encoder_lora())  # the text encoders too, where the pipeline loads them
    folder = str(tmp_path / "adapter")
    _random_adapter(_build(_cfg(model, demo_data, tmp_path / "a", alpha=8, train_text_encoder=te)),
                    folder)

    # alpha 2, not the file's 8: B is rescaled so the delta is the file's
    run = _build(_cfg(model, demo_data, tmp_path / "b", alpha=2, train_text_encoder=te,
                      init_from=folder))
    denoiser = run.accelerator.unwrap_model(run.model)
    pipe = fam.load_pipeline(model)
    load_adapter(pipe, fam, folder)
    parts = [(denoiser, getattr(pipe, fam.denoiser))] + [
        (enc, getattr(pipe, name)) for name, enc in run.trained_text_encoders.items()]
    assert len(parts) == 1 + (len(fam.text_encoder_lora()) if te else 0)
    for mine, stock in parts:
        got, want = _deltas(mine, "default"), _deltas(stock)
        assert set(got) == set(want) and len(got) > 0
        assert max(float(w.abs().max()) for w in want.values()) > 1e-3  # not a no-op
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
        # only the run's own adapter is left, trainable, its factors fp32
        assert set(mine.peft_config) == {"default"}
        lora = [p for n, p in mine.named_parameters() if "lora_" in n]
        assert lora and all(p.requires_grad and p.dtype == torch.float32 for p in lora)
    # the optimizer steps those very parameters
    stepped = {id(p) for g in run.optimizer.optimizer.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in run.params}
    assert {id(p) for p in denoiser.parameters() if p.requires_grad} <= stepped

    if not fam.kohya_export:
        return
    # The kohya file raylora exports of the same adapter, read by the stock pipeline's
    # converters: the same start, or one line saying why not.
    kohya = str(tmp_path / "adapter.safetensors")
    export_kohya(os.path.join(folder, WEIGHT_NAME), kohya, model, fam)
    kcfg = _cfg(model, demo_data, tmp_path / "k", alpha=2, train_text_encoder=te, init_from=kohya)
    if family in KOHYA_REFUSED:
        with pytest.raises(ValueError) as exc:
            _build(kcfg)
        assert str(exc.value).startswith(f"lora.init_from: {kohya}")
        assert KOHYA_REFUSED[family] in str(exc.value)
    else:
        # the check before Ray agrees (a fused q/k/v module is rank 3r there: not "mixed ranks")
        assert lora_init.checked(kcfg, Storage()) == ([], kohya)
        run_k = _build(kcfg)
        got = _deltas(run_k.accelerator.unwrap_model(run_k.model), "default")
        want = _deltas(denoiser, "default")
        assert set(got) == set(want)
        # exactly the folder's start (Z-Image: its fused q|k|v cut back to each part's r)
        assert max(float((got[n] - want[n]).abs().max()) for n in want) == 0.0


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_over_a_bf16_base_the_run_starts_from_the_files_exact_values(tiny, family, demo_data, tmp_path):
    """peft puts a loaded adapter in its base layer's dtype; the run's fp32 LoRA still gets
    the file's values, not their bf16 roundings (text encoders too, and through diffusers'
    renaming of the older lora.down/lora.up keys SDXL's file has), and stays fp32."""
    from inproc import _fresh_accelerator
    from raylora.model.lora import lora_state_dict
    from raylora.train.setup import build_run

    def build(out, **lora):
        tree = _cfg(tiny(family), demo_data, out, train_text_encoder=True, **lora).model_dump()
        tree["train"]["mixed_precision"] = "bf16"
        return build_run(validate(tree), _fresh_accelerator(1, "bf16"), 2, rank=0)

    def state(run):
        return lora_state_dict(run.accelerator.unwrap_model(run.model), run.trained_text_encoders)

    first = build(tmp_path / "a")
    _random_adapter(first, str(tmp_path / "adapter"))
    want = state(first)
    started = build(tmp_path / "b", init_from=str(tmp_path / "adapter"))
    got = state(started)
    assert set(got) == set(want) and any(k.startswith("text_encoder") for k in got)
    # fp32 masters, and the ones the optimizer steps (diffusers' text-encoder loader casts
    # the whole encoder to bf16)
    assert started.params and all(p.dtype == torch.float32 for p in started.params)
    lora = [p for _, enc in [("", started.accelerator.unwrap_model(started.model)),
                             *started.trained_text_encoders.items()]
            for n, p in enc.named_parameters() if "lora_" in n]
    assert {id(p) for p in lora} == {id(p) for p in started.params}
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(v.bfloat16().float(), v) for v in want.values())


def test_what_cannot_be_started_from_is_named_before_ray(tiny_model, demo_data, tmp_path):
    """launch.plan (no Ray, no weights) names each problem with lora.init_from; the config
    refuses a search of the rank every trial's start fixes."""
    from raylora.launch import plan
    from raylora.model.lora import WEIGHT_NAME

    folder = str(tmp_path / "adapter")
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a", alpha=8,
                                train_text_encoder=True)), folder)

    def problems(**lora):
        with pytest.raises(ConfigError) as exc:
            plan(_cfg(tiny_model, demo_data, tmp_path / "b", **lora))
        return exc.value.problems

    assert problems(rank=8, init_from=folder, train_text_encoder=True) == [
        f"lora.init_from: {folder} has rank 4, this run lora.rank=8; set lora.rank=4 to start from it"]
    (line,) = problems(init_from=folder)
    assert line.startswith(f"lora.init_from: {folder} has text-encoder LoRA layers (text_encoder.")
    assert line.endswith("which this run would drop; set lora.train_text_encoder: true to train them on")
    assert problems(variant="dora", init_from=folder, train_text_encoder=True) == [
        f"lora.init_from: {folder} is a LORA adapter, this run lora.variant=dora; set lora.variant=lora"]
    missing = str(tmp_path / "nothing")
    assert problems(init_from=missing) == [f"lora.init_from: {missing}: not found"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (line,) = problems(init_from=str(empty))
    assert line.startswith(f"lora.init_from: {empty}: has no {WEIGHT_NAME} (a diffusers LoRA)")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 4)
    assert problems(init_from=str(bad)) == [f"lora.init_from: {bad}: not a safetensors file (too short)"]
    # every trial of a search starts from it: its rank is not searched
    tree = _cfg(tiny_model, demo_data, tmp_path / "t", init_from=folder,
                train_text_encoder=True).model_dump()
    tree["tune"] = {"search_space": {"lora.rank": {"choice": [4, 8]}}, "metric": "train_loss"}
    with pytest.raises(ConfigError) as exc:
        validate(tree)
    assert exc.value.problems == [
        f"tune.search_space.lora.rank: every trial starts from lora.init_from ({folder}), whose "
        "rank is fixed; search other keys"]
    # plan accepts what fits
    assert plan(_cfg(tiny_model, demo_data, tmp_path / "c", init_from=folder,
                     train_text_encoder=True)).family == "sd"


def test_layers_the_run_does_not_target_are_named_on_the_worker(tiny_model, demo_data, tmp_path):
    """The file's layer names meet the denoiser's on the worker: a run targeting fewer
    modules than the adapter has is refused there (naming them), not trained with part of
    it; one targeting more starts the others as no-ops."""
    folder = str(tmp_path / "adapter")
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a",
                                target_modules=["to_q", "to_v"])), folder)
    with pytest.raises(ValueError) as exc:
        _build(_cfg(tiny_model, demo_data, tmp_path / "b", target_modules=["to_q"],
                    init_from=folder))
    assert str(exc.value).startswith(f"lora.init_from: {folder} ")
    assert "lora.target_modules" in str(exc.value)
    run = _build(_cfg(tiny_model, demo_data, tmp_path / "c", init_from=folder))  # q, k, v, out
    deltas = _deltas(run.accelerator.unwrap_model(run.model), "default")
    moved = {n.rsplit(".", 1)[-1] if not n.endswith("to_out.0") else "to_out.0"
             for n, d in deltas.items() if float(d.abs().max()) > 0}
    assert moved == {"to_q", "to_v"}
    assert len(deltas) == 2 * sum(n.endswith(("to_q", "to_v")) for n in deltas)



def test_an_earlier_rayloras_mixed_style_sd_adapter_is_read_whole(tiny_model, demo_data, tmp_path, caplog,
                                                                   capsys):
    """SD adapters an earlier raylora wrote for attention + proj_in mixed diffusers' keys
    (attention) with peft's (proj_in); the stock loader takes one style from the first key
    and leaves the other layers out. ``lora.init_from``, ``raylora sample`` and
    ``raylora export --format diffusers`` read (and rewrite) such a file whole."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from raylora.cli import main
    from raylora.model import families
    from raylora.model.lora import WEIGHT_NAME, mixed_key_style
    from raylora.sample import load_adapter

    fam = families.get("sd")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]
    run = _build(_cfg(tiny_model, demo_data, tmp_path / "a", target_modules=targets))
    old = tmp_path / "old"
    _random_adapter(run, str(old))
    trained = _deltas(run.accelerator.unwrap_model(run.model), "default")
    assert any("proj_in" in n for n in trained) and any("to_q" in n for n in trained)
    # The file as the earlier raylora wrote it: proj_in in peft's names
    path = str(old / WEIGHT_NAME)
    with safe_open(path, "pt") as f:
        sd, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    sd = {k.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B.")
          if ".proj_in." in k else k: v for k, v in sd.items()}
    save_file(sd, path, metadata=meta)
    (old / "manifest.json").write_text(json.dumps({"files": {WEIGHT_NAME: os.path.getsize(path)}}))
    assert mixed_key_style(sd, "unet")

    def assert_trained(deltas):
        assert set(deltas) == set(trained)
        for name in trained:
            torch.testing.assert_close(deltas[name], trained[name], rtol=1e-5, atol=1e-7)

    stock = fam.load_pipeline(tiny_model)
    stock.load_lora_weights(str(old))
    assert set(_deltas(stock.unet)) < set(trained)  # what the file does to a stock loader

    pipe = fam.load_pipeline(tiny_model)
    with caplog.at_level("WARNING", logger="raylora"):
        load_adapter(pipe, fam, str(old))
    assert "export --format diffusers" in caplog.text
    assert_trained(_deltas(pipe.unet))

    init = _build(_cfg(tiny_model, demo_data, tmp_path / "b", target_modules=targets,
                       init_from=str(old)))
    assert_trained(_deltas(init.accelerator.unwrap_model(init.model), "default"))

    new = tmp_path / "new"
    assert main(["export", "--format", "diffusers", str(old), "--out", str(new)]) == 0
    with safe_open(str(new / WEIGHT_NAME), "pt") as f:
        assert not mixed_key_style(list(f.keys()), "unet") and f.metadata() == meta
    listed = json.loads((new / "manifest.json").read_text())["files"]
    assert listed == {WEIGHT_NAME: os.path.getsize(new / WEIGHT_NAME)}
    rewritten = fam.load_pipeline(tiny_model)
    rewritten.load_lora_weights(str(new))
    assert_trained(_deltas(rewritten.unet))
    # never over the folder it reads, nor into a folder that holds something
    for out, words in ((old / "x", "is inside the adapter folder"), (new, "exists and is not an empty folder")):
        capsys.readouterr()
        assert main(["export", "--format", "diffusers", str(old), "--out", str(out)]) != 0
        assert f"--out: {out} {words}" in capsys.readouterr().err
    assert not (old / "x").exists() and json.loads((new / "manifest.json").read_text())["files"] == listed


def _lora_file(path, downs: dict[str, tuple[int, int]], ups: dict[str, int] | None = None) -> str:
    """A LoRA file of ``downs`` (down key → (rank, in)); ups ``[ups[key] or 8, rank]``."""
    from safetensors.torch import save_file

    sd = {}
    for key, (rank, n_in) in downs.items():
        sd[key] = torch.randn(rank, n_in)
        up = key.replace("lora_down", "lora_up").replace("lora_A", "lora_B")
        sd[up] = torch.randn((ups or {}).get(key, 8), rank)
    save_file(sd, str(path))
    return str(path)


def test_a_kohya_file_with_fused_modules_is_checked_at_its_parts_rank(tmp_path):
    """raylora's kohya file of a Flux.1 / Flux.2 adapter holds q|k|v (Flux.1's single blocks:
    q|k|v|mlp) as one module of rank 3r (4r), which diffusers' loaders split back into rank-r
    layers: the check before Ray called it "mixed ranks" and refused it, though the worker
    starts from it exactly. A file of another rank, or of mixed ranks, is still named there."""
    from raylora.checkpoint.kohya import export_kohya
    from raylora.model import families, lora_init
    from raylora.storage import Storage
    from safetensors import safe_open
    from safetensors.torch import save_file

    def problems(uri, rank):
        return lora_init.checked(_cfg("org/model", "d", tmp_path / "o", rank=rank, init_from=uri),
                                 Storage())[0]

    # diffusers adapters (rank 4, 8 wide; Flux.1's proj_mlp 32) → raylora's kohya export
    a, b = lambda n: torch.randn(4, n), lambda n: torch.randn(n, 4)
    adapters = {
        "flux": {"transformer_blocks.0.attn.to_q": (8, 8), "transformer_blocks.0.attn.to_k": (8, 8),
                 "transformer_blocks.0.attn.to_v": (8, 8), "transformer_blocks.0.attn.to_out.0": (8, 8),
                 "single_transformer_blocks.0.attn.to_q": (8, 8), "single_transformer_blocks.0.attn.to_k": (8, 8),
                 "single_transformer_blocks.0.attn.to_v": (8, 8), "single_transformer_blocks.0.proj_mlp": (8, 32),
                 "single_transformer_blocks.0.proj_out": (40, 8)},
        "flux2klein": {"transformer_blocks.1.attn.to_q": (8, 8), "transformer_blocks.1.attn.to_k": (8, 8),
                       "transformer_blocks.1.attn.to_v": (8, 8), "transformer_blocks.1.attn.add_q_proj": (8, 8),
                       "transformer_blocks.1.attn.add_k_proj": (8, 8), "transformer_blocks.1.attn.add_v_proj": (8, 8),
                       "single_transformer_blocks.0.attn.to_qkv_mlp_proj": (8, 40)},
        # diffusers' Z-Image converter keeps q|k|v's rank 3r for each part (lora_init cuts it)
        "zimage": {"layers.0.attention.to_q": (8, 8), "layers.0.attention.to_k": (8, 8),
                   "layers.0.attention.to_v": (8, 8), "layers.0.attention.to_out.0": (8, 8)},
    }
    for family, layers in adapters.items():
        src, kohya = tmp_path / f"{family}.safetensors", str(tmp_path / f"{family}_kohya.safetensors")
        save_file({f"transformer.{m}.{k}": f(n) for m, (n_in, n_out) in layers.items()
                   for k, f, n in (("lora_A.weight", a, n_in), ("lora_B.weight", b, n_out))}, str(src))
        export_kohya(str(src), kohya, "m", families.get(family))
        with safe_open(kohya, "pt") as f:
            written = {f.get_slice(k).get_shape()[0] for k in f.keys() if k.endswith("lora_down.weight")}
        assert written == ({4, 12, 16} if family == "flux" else {4, 12})  # fused: 3r, 4r
        assert problems(kohya, 4) == [], family
        assert problems(kohya, 8) == [f"lora.init_from: {kohya} has rank 4, this run lora.rank=8; set "
                                      "lora.rank=4 to start from it"], family

    q = "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    proj = "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"
    # sd-scripts trains the fused module whole: rank r there too
    whole = _lora_file(tmp_path / "whole.safetensors", {q: (6, 8), proj: (6, 8)}, {q: 24})
    assert problems(whole, 6) == []
    mixed = _lora_file(tmp_path / "mixed.safetensors", {q: (12, 8), proj: (8, 8)}, {q: 24})
    assert problems(mixed, 4) == [f"lora.init_from: {mixed} has layers of ranks 8, 12; a run trains one "
                                  "lora.rank"]
    only = _lora_file(tmp_path / "only.safetensors", {q: (12, 8)}, {q: 24})
    assert problems(only, 12) == problems(only, 4) == []
    assert problems(only, 8) == [
        f"lora.init_from: {only} has rank 4 or 12 (its layers are all fused kohya modules, which load "
        "as parts of either rank), this run lora.rank=8; set lora.rank=4 or 12 to start from it"]
    # diffusers names: each layer's own rank, as before
    two = _lora_file(tmp_path / "two.safetensors", {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": (4, 8),
        "transformer.transformer_blocks.0.attn.to_k.lora_A.weight": (12, 8)})
    assert problems(two, 4) == [f"lora.init_from: {two} has layers of ranks 4, 12; a run trains one "
                                "lora.rank"]


def test_a_zimage_kohya_files_fused_qkv_is_read_at_each_parts_rank(tmp_path):
    """diffusers' Z-Image converter gives to_q, to_k and to_v each the fused attention.qkv's
    whole down (rank 3r) and their rows of its up: raylora's export (a block-diagonal up)
    could start no run (ranks 4 and 12). Each part keeps its own r rows / columns, the
    tensors it was exported from; an up trained whole (sd-scripts') keeps rank 3r."""
    from safetensors.torch import load_file, save_file

    from raylora.checkpoint.kohya import export_kohya
    from raylora.model import families, lora_init

    fam = families.get("zimage")
    g = torch.Generator().manual_seed(0)
    src = {f"transformer.layers.0.attention.{m}.{k}": torch.randn(shape, generator=g)
           for m in ("to_q", "to_k", "to_v", "to_out.0")
           for k, shape in (("lora_A.weight", (4, 8)), ("lora_B.weight", (8, 4)))}
    save_file(src, str(tmp_path / "src.safetensors"))
    kohya = str(tmp_path / "kohya.safetensors")
    export_kohya(str(tmp_path / "src.safetensors"), kohya, "m", fam)  # alpha = rank: scale 1

    sd, _, _ = lora_init.stock_state_dict(kohya, fam, "lora.init_from", kohya)
    q = "transformer.layers.0.attention.to_q.lora_A.weight"
    assert sd[q].shape == (12, 8)  # as the converter gives it
    parts = lora_init._own_parts(sd, fam)
    assert parts.keys() == src.keys()
    assert all(torch.equal(parts[k], v) for k, v in src.items())

    whole = load_file(kohya)
    qkv = "lora_unet_layers_0_attention_qkv.lora_up.weight"
    whole[qkv] = torch.randn(whole[qkv].shape, generator=g)  # not block-diagonal
    save_file(whole, str(tmp_path / "whole.safetensors"))
    sd, _, _ = lora_init.stock_state_dict(str(tmp_path / "whole.safetensors"), fam, "k", "u")
    kept = lora_init._own_parts(sd, fam)
    assert kept[q].shape == (12, 8) and all(torch.equal(kept[k], sd[k]) for k in sd)
    # a diffusers file of rank 12 (each layer its own down), ups still zero: as it is
    fresh = {k: torch.randn(12, 8, generator=g) if "lora_A" in k else torch.zeros(8, 12)
             for k in src}
    assert all(torch.equal(v, fresh[k]) for k, v in lora_init._own_parts(fresh, fam).items())


def _export_checkpoint(adapter: str, ckpt, tiny_model, demo_data, out, **lora) -> None:
    """``export_run`` of a checkpoint whose adapter/ is ``adapter``: what a finished run run
    again (launch._exported_again) and a Tune search's best trial publish."""
    import glob
    import json
    import shutil

    from raylora.checkpoint.export import export_run

    shutil.copytree(adapter, ckpt / "adapter")
    (ckpt / "history.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                for s in (1, 2)))
    cfg = validate({"model": {"pretrained": tiny_model}, "data": {"uri": demo_data},
                    "lora": {"rank": 4, **lora}, "output": {"uri": str(out)}})
    plan = {"shard_files": sorted(glob.glob(os.path.join(demo_data, "*.parquet"))),
            "data_format": "parquet", "total_rows": 8, "family": "sd"}
    export_run(str(ckpt), cfg, {"global_step": 2}, plan)


def test_an_earlier_rayloras_mixed_style_checkpoint_is_exported_again_in_one_style(
        tiny_model, demo_data, tmp_path, caplog):
    """A finished SD run of an earlier raylora that targeted more than attention, run again
    as it was: its final checkpoint's adapter/ (two key styles) was published as it was, and
    the stock loader read 12 of its 44 LoRA modules, silently. Now in one style, the
    manifest listing the file as written, loaded whole by load_lora_weights."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from raylora.model import families
    from raylora.model.lora import WEIGHT_NAME, mixed_key_style

    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]
    run = _build(_cfg(tiny_model, demo_data, tmp_path / "a", target_modules=targets))
    old = tmp_path / "old"
    _random_adapter(run, str(old))
    trained = _deltas(run.accelerator.unwrap_model(run.model), "default")
    path = str(old / WEIGHT_NAME)
    with safe_open(path, "pt") as f:
        sd, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    sd = {k.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B.")
          if ".proj_in." in k else k: v for k, v in sd.items()}  # as the earlier raylora wrote it
    save_file(sd, path, metadata=meta)
    assert mixed_key_style(sd, "unet")

    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="raylora"):
        _export_checkpoint(str(old), tmp_path / "ckpt", tiny_model, demo_data, out,
                           target_modules=targets)
    assert "written by an earlier raylora with two key styles for the unet" in caplog.text
    published = out / "adapter" / WEIGHT_NAME
    with safe_open(str(published), "pt") as f:
        assert not mixed_key_style(list(f.keys()), "unet") and f.metadata() == meta
        assert len(list(f.keys())) == len(sd)
    listed = json.loads((out / "adapter" / "manifest.json").read_text())["files"]
    assert listed[WEIGHT_NAME] == os.path.getsize(published)
    stock = families.get("sd").load_pipeline(tiny_model)
    stock.load_lora_weights(str(out / "adapter"))
    deltas = _deltas(stock.unet)
    assert set(deltas) == set(trained)
    for name in trained:
        torch.testing.assert_close(deltas[name], trained[name], rtol=1e-5, atol=1e-7)
