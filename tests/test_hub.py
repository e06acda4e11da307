"""A hub id as ``model.pretrained``, checked before Ray starts (``raylora.model.hub``):
read from a Hugging Face hub on 127.0.0.1 (tests/hubemu.py) serving the tiny models, the
way huggingface_hub reads the real one. Training from a gated hub repo on a two-node
cluster, the token reaching every worker: test_cluster_local."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from raylora.config import ConfigError, validate

TOKEN = "hf_RayLoraHubTest0001doNotLeak"
# What a clone without git-lfs holds in place of a weights file.
LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4c2f0b0d2f1c4f3d0a5b8f2b3e9a0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b\n"
               "size 3438167536\n")
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def repos(hub, tiny_model, tiny, tmp_path_factory):
    """org/tiny-sd (public), org/tiny-flux (gated behind TOKEN), org/no-unet (an SD
    pipeline without its unet folder), org/no-vae-weights (its vae folder without weights),
    org/lfs-unet (its unet weights a git-lfs pointer)."""
    broken = tmp_path_factory.mktemp("no-unet") / "m"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("unet"))
    hub.add("org/tiny-sd", tiny_model)
    hub.add("org/tiny-flux", tiny("flux"), token=TOKEN)
    hub.add("org/no-unet", str(broken))
    unweighted = tmp_path_factory.mktemp("no-vae-weights") / "m"
    shutil.copytree(tiny_model, unweighted, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in ("unet", "text_encoder"):  # the vae's alone missing
        shutil.copytree(f"{tiny_model}/{name}", unweighted / name, dirs_exist_ok=True)
    hub.add("org/no-vae-weights", str(unweighted))
    pointed = tmp_path_factory.mktemp("lfs-unet") / "m"
    shutil.copytree(tiny_model, pointed)
    (pointed / UNET_WEIGHTS).write_text(LFS_POINTER)
    hub.add("org/lfs-unet", str(pointed))
    return hub


def _cfg(demo_data, tmp_path, **model):
    return validate({"model": model, "data": {"uri": demo_data, "resolution": 64},
                     "train": {"batch_size": 2, "max_steps": 2},
                     "output": {"uri": str(tmp_path / "out")}})


def _problems(cfg) -> str:
    from raylora.launch import plan

    with pytest.raises(ConfigError) as err:
        plan(cfg, heldout=False)
    return str(err.value)


def test_a_hub_repos_family_and_grid_are_read_before_ray(online, repos, demo_data, tmp_path,
                                                          monkeypatch):
    """Without reading the repo the driver took every hub id for SD, with SD's VAE: a Flux
    repo's sizes were checked against SD's 8 px grid, and its caches and tokens were SD's.
    Read, it is Flux with its VAE (the tiny one's grid is 4 px: VAE 2 × patch 2)."""
    from raylora.launch import plan

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    p = plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"), heldout=False)
    assert (p.family, p.objective) == ("flux", "flow_matching")
    bad = _cfg(demo_data, tmp_path, pretrained="org/tiny-flux")
    bad.data.resolution = 66
    assert "data.resolution: 66 is not a multiple of 4 (the flux latent grid" in _problems(bad)
    sd = plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-sd"), heldout=False)
    assert (sd.family, sd.objective) == ("sd", "epsilon")
    sent = {t for m, path, t in repos.seen if path.startswith("/org/tiny-flux/resolve/")}
    assert sent == {TOKEN}


@pytest.mark.parametrize("model,expected", [
    ({"pretrained": "org/tiny-flux"},
     "model.pretrained: org/tiny-flux is a gated repo and no Hugging Face token is set: "
     "accept its terms on the hub, then set HF_TOKEN"),
    ({"pretrained": "org/nothing-here"},
     "model.pretrained: org/nothing-here: no such model repo on the hub"),
    ({"pretrained": "org/tiny-sd", "revision": "v9"},
     "model.revision: v9: no such revision of org/tiny-sd"),
    ({"pretrained": "org/no-unet"},
     "model.pretrained: org/no-unet: missing component folder(s) of a sd pipeline: unet"),
    ({"pretrained": "org/tiny-sd", "variant": "fp16"},
     "model.variant: fp16: model.pretrained: org/tiny-sd has no fp16 weights in unet, vae, "
     "text_encoder"),
    # each worker's load failed: "no file named diffusion_pytorch_model.bin found"
    ({"pretrained": "org/no-vae-weights"},
     "model.pretrained: org/no-vae-weights: no weights in org/no-vae-weights/vae (no "
     ".safetensors or .bin file); an upload that stopped part way?"),
    ({"pretrained": "org/lfs-unet"},
     "model.pretrained: org/lfs-unet: no weights in org/lfs-unet/unet "
     "(diffusion_pytorch_model.safetensors is a git-lfs pointer, not the weights); pushed or "
     "copied from a clone without git-lfs (`git lfs pull` there fetches them)"),
], ids=["gated", "no-repo", "no-revision", "no-unet", "no-variant", "no-weights", "lfs-pointer"])
def test_a_hub_repo_that_cannot_be_trained_is_named_before_ray(online, repos, demo_data,
                                                               tmp_path, model, expected):
    assert expected in _problems(_cfg(demo_data, tmp_path, **model))


def test_a_gated_repo_with_a_token_without_access_or_a_stored_one(online, repos, demo_data,
                                                                   tmp_path, monkeypatch):
    """A wrong token is told apart from none; the token ``hf auth login`` stored is read
    as huggingface_hub reads it, and it is what the workers are sent (as a credential:
    never in the runtime_env's logged env_vars)."""
    from raylora import launch, storage
    from raylora.launch import plan

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    text = _problems(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"))
    assert "is a gated repo and the token sent has no access" in text and "hf_wrong" not in text
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "hf-token").write_text(TOKEN + "\n")
    assert plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"), heldout=False).family == "flux"
    monkeypatch.setenv("HF_ENDPOINT", online.ENDPOINT)
    plain, secret = storage.split_secrets(storage.forwarded_env())
    assert secret["HF_TOKEN"] == TOKEN and plain["HF_ENDPOINT"] == online.ENDPOINT
    env = launch.job_runtime_env()
    assert "HF_TOKEN" not in env["env_vars"] and env["env_vars"]["HF_ENDPOINT"] == online.ENDPOINT


def test_the_token_under_its_older_name_is_the_one_named_and_sent_to_the_workers(
        online, repos, demo_data, tmp_path, monkeypatch):
    """``HUGGING_FACE_HUB_TOKEN``, huggingface_hub's older name that it still reads, let
    the driver's plan read a gated repo; raylora read HF_TOKEN and the stored token alone,
    so workers on other nodes were sent no token (each download refused after the cluster
    started) and a wrong one was called "no Hugging Face token is set". The token
    huggingface_hub sends is the one forwarded, as HF_TOKEN, with the credentials, never in
    the runtime_env's logged env_vars nor in a message."""
    from huggingface_hub import hf_hub_download

    from raylora import launch, storage
    from raylora.launch import plan

    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_wrong")
    text = _problems(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"))
    assert "is a gated repo and the token sent has no access" in text and "hf_wrong" not in text
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKEN)
    assert plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"), heldout=False).family == "flux"
    plain, secret = storage.split_secrets(storage.forwarded_env())
    assert secret["HF_TOKEN"] == TOKEN and TOKEN not in json.dumps(plain)
    assert TOKEN not in json.dumps(launch.job_runtime_env()["env_vars"])
    # a worker on another node: this machine's token settings gone, the forwarded ones set
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN")
    monkeypatch.setenv("HF_TOKEN", secret["HF_TOKEN"])
    asked = len(repos.seen)
    hf_hub_download("org/tiny-flux", "transformer/config.json", cache_dir=str(tmp_path / "node-b"))
    assert {t for _, path, t in repos.seen[asked:] if "/resolve/" in path} == {TOKEN}


def test_a_component_folder_without_weights_is_named_before_ray(tiny_model, demo_data,
                                                                tmp_path):
    """A folder whose unet lost its weights (a copy or upload that stopped part way) or
    holds git-lfs pointers (a clone without git-lfs) passed the plan, and every worker
    failed on it ("no file named diffusion_pytorch_model.bin found in directory" the
    model's root). A pointer beside real weights (`git lfs pull --include
    "*.safetensors"` left the .bin out) is not what the loader reads: it passes."""
    from raylora.launch import plan

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    weights = folder / UNET_WEIGHTS
    real = weights.read_bytes()
    weights.unlink()
    assert (f"model.pretrained: {folder}: no weights in {folder}/unet (no .safetensors or "
            ".bin file); an upload or copy that stopped part way? Copy the model again"
            ) in _problems(_cfg(demo_data, tmp_path, pretrained=str(folder)))
    weights.write_text(LFS_POINTER)
    encoder = folder / "text_encoder" / "model.safetensors"
    encoder.write_bytes(b"")
    assert (f"model.pretrained: {folder}: no weights in {folder}/unet "
            "(diffusion_pytorch_model.safetensors is a git-lfs pointer, not the weights), "
            f"{folder}/text_encoder (model.safetensors is empty); a clone without git-lfs: "
            "`git lfs pull` in it fetches them") in _problems(
                _cfg(demo_data, tmp_path, pretrained=str(folder)))
    weights.write_bytes(real)
    shutil.copy(f"{tiny_model}/text_encoder/model.safetensors", encoder)
    (folder / "unet" / "diffusion_pytorch_model.bin").write_text(LFS_POINTER)
    assert plan(_cfg(demo_data, tmp_path, pretrained=str(folder)), heldout=False).family == "sd"


def test_a_revision_with_a_slash_is_written_2F_in_an_hf_uri(online, hub, tiny_model, pushed,
                                                            demo_data, tmp_path):
    """``hf://owner/name@refs%2Fpr%2F1`` (a PR's branch, written as huggingface_hub and a
    dataset's hf:// write it) was asked of the hub as the revision "refs%2Fpr%2F1": no such
    revision, as model.pretrained and as lora.init_from. It is refs/pr/1."""
    from raylora.launch import plan
    from raylora.model import hub as rhub

    hub.add("org/prs", tiny_model)
    pr = hub.add("org/prs", pushed, version=1, branch="refs/pr/1")
    cfg = _cfg(demo_data, tmp_path, pretrained="hf://org/prs@refs%2Fpr%2F1")
    assert (cfg.model.pretrained, cfg.model.revision) == ("org/prs", "refs/pr/1")
    assert plan(cfg, heldout=False).model_commit == pr
    uri = "hf://org/prs@refs%2Fpr%2F1/unet"
    local = rhub.fetch(uri, "lora.init_from")
    assert rhub.pinned(uri, local, "lora.init_from") == f"hf://org/prs@{pr}/unet"
    with open(f"{local}/diffusion_pytorch_model.safetensors", "rb") as got, \
            open(f"{pushed}/{UNET_WEIGHTS}", "rb") as want:
        assert got.read() == want.read()  # the PR's weights, not main's


def test_offline_a_cached_repo_is_read_and_an_unknown_one_needs_its_family(
        online, repos, demo_data, tmp_path, caplog):
    """HF_HUB_OFFLINE: a repo read once is read from the cache (its family known; the
    component list, which the cache does not keep, unchecked). One never read cannot be:
    with model.family auto that is refused (the run would take it for SD); with the family
    given the run goes on, with a warning."""
    from raylora.launch import plan

    assert plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-sd"), heldout=False).family == "sd"
    online.HF_HUB_OFFLINE = True  # monkeypatched: restored after the test
    asked = len(repos.seen)
    assert plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-sd"), heldout=False).family == "sd"
    assert len(repos.seen) == asked  # from the cache alone
    text = _problems(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux"))
    assert "model.pretrained: org/tiny-flux: the hub could not be read here" in text
    assert "set model.family (" in text
    with caplog.at_level(logging.WARNING, logger="raylora"):
        p = plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-flux", family="flux"), heldout=False)
    assert p.family == "flux"
    assert "its family (flux) and components are not checked" in caplog.text


def test_a_run_starts_from_an_adapter_on_the_hub(online, hub, tiny_model, demo_data, tmp_path,
                                                 monkeypatch):
    """``lora.init_from: hf://owner/name[@revision][/path]``: the adapter's folder in a
    gated repo, and its one file at a revision, start the run as the same folder read
    locally does; only the adapter's files are downloaded. What cannot be started from is
    one line naming the key and the URI."""
    import torch
    from test_lora_init import _build, _cfg, _deltas, _random_adapter

    from raylora.model import lora_init

    repo = tmp_path / "repo"
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a", alpha=8)), str(repo / "style"))
    (repo / "sample.png").write_bytes(b"not an adapter file")
    hub.add("org/sd-lora", str(repo), token=TOKEN)

    def problems(**lora):
        cfg = _cfg(tiny_model, demo_data, tmp_path / "p", **lora)
        return lora_init.checked(cfg, cfg.storage.client())[0]

    def start(init_from: str) -> dict:
        run = _build(_cfg(tiny_model, demo_data, tmp_path / "b", alpha=2, init_from=init_from))
        return _deltas(run.accelerator.unwrap_model(run.model), "default")

    folder = "hf://org/sd-lora/style"
    assert problems(init_from=folder) == [
        f"lora.init_from: {folder} is a gated repo and no Hugging Face token is set: accept its "
        "terms on the hub, then set HF_TOKEN (or run `hf auth login`) to a token with access"]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    want = start(str(repo / "style"))
    assert want and max(float(d.abs().max()) for d in want.values()) > 1e-3
    for uri in (folder, "hf://org/sd-lora@main/style/pytorch_lora_weights.safetensors"):
        assert problems(init_from=uri) == []
        got = start(uri)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    assert not [p for _, p, _ in hub.seen if p.endswith("sample.png")]
    assert problems(init_from=folder, rank=8) == [
        f"lora.init_from: {folder} has rank 4, this run lora.rank=8; set lora.rank=4 to start from it"]
    assert problems(init_from="hf://org/sd-lora/other") == [
        "lora.init_from: hf://org/sd-lora/other: not found"]
    assert problems(init_from="hf://org/no-such-lora")[0].startswith(
        "lora.init_from: hf://org/no-such-lora: no such model repo on the hub")
    assert problems(init_from="hf://org") == ["lora.init_from: hf://org: not hf://owner/name[@revision][/path]"]


def test_an_adapter_on_the_hub_is_started_from_at_the_commit_its_plan_read(
        online, hub, tiny_model, demo_data, tmp_path):
    """Every worker downloaded ``lora.init_from: hf://owner/name/...`` at its branch when
    it got to it: a push after the plan started the workers from another adapter than the
    driver checked (two nodes, from each other's). The plan pins the commit it read, for a
    search's adapters too; the workers start from it; raylora.json and the model card
    name it; what a checkpoint records stays as written."""
    import torch
    from inproc import _fresh_accelerator
    from test_lora_init import _build, _cfg, _deltas, _random_adapter

    from raylora.checkpoint.export import model_card, run_data
    from raylora.checkpoint.state import trained_settings
    from raylora.launch import plan
    from raylora.train.setup import build_run
    from raylora.tune import preflight

    made = _build(_cfg(tiny_model, demo_data, tmp_path / "a"))
    for version in (0, 1):  # two different adapters, one per commit
        _random_adapter(made, str(tmp_path / f"v{version}" / "style"), seed=version)
    v0 = hub.add("org/moving-lora", str(tmp_path / "v0"))
    uri = "hf://org/moving-lora/style"
    cfg = _cfg(tiny_model, demo_data, tmp_path / "run", init_from=uri)
    p = plan(cfg, heldout=False)
    assert p.pins == {uri: f"hf://org/moving-lora@{v0}/style"}
    v1 = hub.add("org/moving-lora", str(tmp_path / "v1"), version=1)  # main moves

    def start(pins=None) -> dict:
        run = build_run(cfg, _fresh_accelerator(1), 2, rank=0, pins=pins)
        return _deltas(run.accelerator.unwrap_model(run.model), "default")

    def same(a: dict, b: dict) -> bool:
        return set(a) == set(b) and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)

    at = {v: start({uri: f"hf://org/moving-lora@{c}/style"}) for v, c in ((0, v0), (1, v1))}
    assert not same(at[0], at[1])
    assert same(start(p.pins), at[0])  # the workers: the plan's commit, not main's
    assert same(start(), at[1])  # unpinned, as before: whatever main is now

    data = run_data(cfg, p.to_dict(), cfg.storage.client())
    assert data["init_from"] == f"hf://org/moving-lora@{v0}/style"
    assert f"| started from (lora.init_from) | hf://org/moving-lora@{v0}/style |" in model_card(
        cfg, {}, data)
    assert trained_settings(cfg, "sd")["lora.init_from"] == uri  # a rerun compares as written

    tree = {**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "validation_split": 0.2}}
    other = "hf://org/moving-lora@main/style/pytorch_lora_weights.safetensors"
    tree["tune"] = {"search_space": {"lora.init_from": {"choice": [uri, other]}}}
    pins = preflight(validate(tree)).pins
    assert pins == {uri: f"hf://org/moving-lora@{v1}/style",
                    other: f"hf://org/moving-lora@{v1}/style/pytorch_lora_weights.safetensors"}


def test_a_relative_path_that_is_not_there_is_not_asked_of_the_hub(online, repos, demo_data,
                                                                   tmp_path):
    asked = len(repos.seen)
    assert ("model.pretrained: runs/demo/modle: no such folder here, and not a hub id "
            "(owner/name)") in _problems(_cfg(demo_data, tmp_path, pretrained="runs/demo/modle"))
    assert len(repos.seen) == asked


def test_a_named_revision_is_trained_at_the_commit_it_names_when_planned(
        online, hub, tiny_model, pushed, demo_data, tmp_path):
    """model.revision: a branch (SD 1.5's old fp16 branch, a tag): the plan reads that
    branch, not main, and the workers and tokenizers get its commit; the config keeps
    the name."""
    from raylora.launch import build_trainer, plan

    hub.add("org/branchy", tiny_model)
    fp16 = hub.add("org/branchy", pushed, version=1, branch="fp16")
    cfg = _cfg(demo_data, tmp_path, pretrained="org/branchy", revision="fp16")
    p = plan(cfg, heldout=False)
    assert p.model_commit == fp16
    spec = build_trainer(cfg, p, str(tmp_path / "out"), "train").train_loop_config["spec"]
    assert (spec.config.model.revision, cfg.model.revision) == (fp16, "fp16")
    assert [t.max_length for t in spec.tokenizer_specs] == [40]  # the branch's tokenizer
    # named as lora.init_from names a hub adapter: the same repo and branch
    uri = _cfg(demo_data, tmp_path, pretrained="hf://org/branchy@fp16")
    assert (uri.model.pretrained, uri.model.revision) == ("org/branchy", "fp16")
    assert plan(uri, heldout=False).model_commit == fp16


@pytest.fixture
def pushed(tiny_model, tmp_path) -> str:
    """tiny_model as a push would change it: other UNet weights, another tokenizer length."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "pushed"
    shutil.copytree(tiny_model, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({k: v + 1 for k, v in load_file(weights).items()}, weights)
    config = folder / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 40}))
    return str(folder)


def test_a_run_loads_the_commit_its_plan_read_while_the_repo_moves(
        online, hub, tiny_model, pushed, demo_data, tmp_path, caplog, capsys):
    """Every process downloaded the repo's main when it got to it: a push after the plan
    gave the workers other weights than the driver checked (and two nodes' workers each
    other's), the driver's tokenizers could be another commit's than the text encoders,
    and a latent cache or class images made from the old commit were keyed as the new
    one. The plan pins the commit it read: the driver's tokenizers, the workers' config,
    the cache and class-image keys and the checkpoint's record follow it; the run's
    config keeps model.revision as written. A new plan reads the push."""
    import torch
    from safetensors.torch import load_file

    from raylora.checkpoint.recorded import check_latest
    from raylora.checkpoint.state import LoopState, save_main_state, trained_settings
    from raylora.data import cache, classgen
    from raylora.data.plan import plan_data
    from raylora.launch import build_trainer, plan
    from raylora.data.preprocess import Preprocess, StageSpec, stage_kwargs
    from raylora.model import families
    from raylora.model.load import load_components, load_pipeline_as_trained, read_index

    v0 = hub.add("org/pushed", tiny_model)
    cfg = _cfg(demo_data, tmp_path, pretrained="org/pushed")
    store = cfg.storage.client()
    data = plan_data(cfg.data, store)
    first = plan(cfg, heldout=False)
    assert first.model_commit == v0 and cfg.model.revision is None

    def keys(p) -> tuple[str, str]:
        loads = cfg.at_commit(p.model_commit)
        return (cache.fingerprint(loads, "sd", "org/pushed", data, store),
                classgen.generation_key(loads, "sd", "org/pushed", store))

    def unet_weight(model) -> torch.Tensor:
        return load_components(model, torch.float32, encoders=False).denoiser.conv_in.weight

    old = keys(first)
    online.HF_HUB_OFFLINE = True  # monkeypatched: restored after the test
    offline = plan(cfg, heldout=False)
    assert offline.model_commit == v0 and keys(offline) == old
    online.HF_HUB_OFFLINE = False

    v1 = hub.add("org/pushed", pushed, version=1)  # main moves after the first plan
    spec = build_trainer(cfg, first, str(tmp_path / "out"), "train").train_loop_config["spec"]
    assert spec.config.model.revision == v0 and cfg.model.revision is None
    assert [t.max_length for t in spec.tokenizer_specs] == [77]
    stock = load_file(f"{tiny_model}/unet/diffusion_pytorch_model.safetensors")["conv_in.weight"]
    torch.testing.assert_close(unet_weight(spec.config.model), stock)

    # what loads the model inside Ray: the cache's and class images' preprocess stages
    # (their tokenizers), the stock pipeline of class images and previews
    loads = cfg.at_commit(first.model_commit)
    stage = Preprocess(StageSpec(**stage_kwargs("cache", cfg.data, model_path="org/pushed",
                                                family="sd", storage=store,
                                                revision=loads.model.revision)))
    assert [e.model_max_length for e in stage.encoders] == [77]
    pipe = load_pipeline_as_trained("org/pushed", families.get("sd"), torch.float32,
                                    read_index(loads.model, "org/pushed"), loads.model)
    torch.testing.assert_close(pipe.unet.conv_in.weight, stock)

    # the memory preflight: the configs of the plan's commit (as the tiny folder's), not
    # main's (its tokenizer's 40 tokens make another text-encoder step)
    from raylora import memory
    from raylora.preflight import check_memory

    folder = memory.from_config(_cfg(demo_data, tmp_path, pretrained=tiny_model))
    assert memory.from_config(loads).peak == folder.peak
    assert memory.from_config(cfg).peak != folder.peak

    def table(c, commit=None) -> str:  # the preflight's logged table, on an 80 GiB GPU
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="raylora"):
            check_memory(c.model_copy(update={"scaling": c.scaling.model_copy(
                update={"gpu_memory_gb": 80})}), commit=commit)
        said = "\n".join(r.getMessage() for r in caplog.records)
        assert "memory preflight: fits" in said
        return said

    assert table(cfg, commit=v0) == table(_cfg(demo_data, tmp_path, pretrained=tiny_model))
    assert table(cfg) != table(cfg, commit=v0)
    # `raylora plan` prints the table of the revision it is given, as a run would plan it
    import yaml

    from raylora.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(cfg.to_dict()))
    printed = {}
    for revision in (v0, "main"):
        capsys.readouterr()
        assert main(["plan", str(job), f"model.revision={revision}"]) == 0
        printed[revision] = capsys.readouterr().out
    assert re.search(rf"\ntotal per GPU +{folder.total / 2**20:.2f}\n", printed[v0])  # MiB
    assert printed["main"] != printed[v0]

    second = plan(cfg, heldout=False)
    assert second.model_commit == v1
    new = keys(second)
    assert new[0] != old[0] and new[1] != old[1]
    spec = build_trainer(cfg, second, str(tmp_path / "out"), "train").train_loop_config["spec"]
    assert [t.max_length for t in spec.tokenizer_specs] == [40]
    torch.testing.assert_close(unet_weight(spec.config.model), stock + 1)

    # a checkpoint of the first run, resumed after the push: resumed, with the way back
    run = tmp_path / "ckpts"
    (run / "checkpoint_a").mkdir(parents=True)
    was = trained_settings(cfg.at_commit(first.model_commit), "sd")
    assert was["model.revision"] == v0
    save_main_state(str(run / "checkpoint_a"), lora_sd={"w": torch.ones(2)}, optimizer_sd={},
                    scheduler_sd={}, scaler_sd=None, loop=LoopState(global_step=2, world_size=1),
                    trained=was)
    (run / "checkpoint_manager_snapshot.json").write_text(
        '{"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_a"}}')
    with caplog.at_level(logging.WARNING, logger="raylora"):
        check_latest(store, str(run), trained=trained_settings(cfg.at_commit(v1), "sd"))
    assert (f"model.revision: this run has {v1}, but the checkpoint this output.uri resumes "
            f"from ({run / 'checkpoint_a'}) was trained with {v0}; resuming (on the model as it "
            "is now: it changed since the checkpoint (a hub repo: set model.revision to the "
            "checkpoint's commit") in caplog.text


def test_raylora_sample_loads_the_base_at_the_commit_its_adapter_trained_on(
        online, hub, tiny_model, pushed, demo_data, tmp_path):
    """``raylora sample --model org/name`` loaded main: after a push, an adapter sampled on
    another base than it trained on. The adapter's raylora.json names the commit; a
    --revision, or a raylora.json of another base, loads what it says."""
    import torch
    from safetensors.torch import load_file
    from test_lora_init import _build, _cfg, _random_adapter

    from raylora.sample import load_pipeline

    v0 = hub.add("org/sampled", tiny_model)
    v1 = hub.add("org/sampled", pushed, version=1)
    adapter = tmp_path / "adapter"
    _random_adapter(_build(_cfg(tiny_model, demo_data, tmp_path / "a")), str(adapter))
    meta = {"config": {"model": {"pretrained": "org/sampled"}}, "data": {"model_commit": v0}}
    (adapter / "raylora.json").write_text(json.dumps(meta))
    stock = load_file(f"{tiny_model}/unet/diffusion_pytorch_model.safetensors")["conv_in.weight"]

    def conv_in(**kw) -> torch.Tensor:
        return load_pipeline("org/sampled", str(adapter), **kw)[0].unet.conv_in.weight

    torch.testing.assert_close(conv_in(), stock)
    torch.testing.assert_close(conv_in(revision=v1), stock + 1)
    hf = load_pipeline(f"hf://org/sampled@{v1}", str(adapter))[0]  # as model.pretrained takes it
    torch.testing.assert_close(hf.unet.conv_in.weight, stock + 1)
    (adapter / "raylora.json").write_text(json.dumps(
        {**meta, "config": {"model": {"pretrained": "org/other"}}}))
    torch.testing.assert_close(conv_in(), stock + 1)


def test_a_mirrors_password_in_hf_endpoint_is_in_no_log_line_message_or_logged_env(
        online, hub, repos, demo_data, tmp_path, monkeypatch, caplog):
    """HF_ENDPOINT=https://user:pass@mirror (a mirror behind basic auth): httpx logged every
    request's URL at INFO (45 lines for a tiny run, on the driver and every worker), the
    variable went as a plain runtime_env setting (which Ray's agent logs), and raylora's
    hub errors quoted httpx's message, URL and password included."""
    import logging

    from huggingface_hub import constants, hf_api

    from raylora import launch, quiet, storage

    secret = hub.endpoint.replace("://", "://mirroruser:MIRRORPASS@")
    monkeypatch.setattr(constants, "ENDPOINT", secret)
    monkeypatch.setattr(hf_api.api, "endpoint", secret)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", secret + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_ENDPOINT", secret)
    plain, creds = storage.split_secrets(storage.forwarded_env())
    assert creds["HF_ENDPOINT"] == secret and "HF_ENDPOINT" not in plain
    assert "MIRRORPASS" not in json.dumps(launch.job_runtime_env()["env_vars"])
    for name in quiet.QUIET_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    quiet.apply()
    caplog.set_level(logging.INFO)
    from raylora.launch import plan

    assert plan(_cfg(demo_data, tmp_path, pretrained="org/tiny-sd"), heldout=False).family == "sd"
    assert hub.seen and "MIRRORPASS" not in caplog.text and "HTTP Request" not in caplog.text
    text = _problems(_cfg(demo_data, tmp_path, pretrained="org/no-such-repo"))
    assert "org/no-such-repo" in text and "MIRRORPASS" not in text
    assert storage.masked(f"failed for url '{secret}/api/x'") == (
        f"failed for url '{hub.endpoint.replace('://', '://***@')}/api/x'")
