"""A hub id as ``model.pretrained``, checked before Ray starts (``raylora.model.hub``):
read from a Hugging Face hub on 127.0.0.1 (tests/hubemu.py) serving the tiny models, the
way huggingface_hub reads the real one. Training from a gated hub repo on a two-node
cluster, the token reaching every worker: test_cluster_local."""

from __future__ import annotations

import logging
import shutil

import pytest

from raylora.config import ConfigError, validate

TOKEN = "hf_RayLoraHubTest0001doNotLeak"


@pytest.fixture
def online(hub, monkeypatch, tmp_path):
    """This process's huggingface_hub pointed at ``hub`` with an empty cache, no token.
    It read HF_ENDPOINT, HF_HUB_OFFLINE (1: conftest) and its paths when imported, so its
    constants are set as those variables would have set them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return constants


@pytest.fixture(scope="module")
def repos(hub, tiny_model, tiny, tmp_path_factory):
    """org/tiny-sd (public), org/tiny-flux (gated behind TOKEN), org/no-unet (an SD
    pipeline without its unet folder)."""
    broken = tmp_path_factory.mktemp("no-unet") / "m"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("unet"))
    hub.add("org/tiny-sd", tiny_model)
    hub.add("org/tiny-flux", tiny("flux"), token=TOKEN)
    hub.add("org/no-unet", str(broken))
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
], ids=["gated", "no-repo", "no-revision", "no-unet"])
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
        return lora_init.problems(cfg, cfg.storage.client())

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


def test_a_relative_path_that_is_not_there_is_not_asked_of_the_hub(online, repos, demo_data,
                                                                   tmp_path):
    asked = len(repos.seen)
    assert ("model.pretrained: runs/demo/modle: no such folder here, and not a hub id "
            "(owner/name)") in _problems(_cfg(demo_data, tmp_path, pretrained="runs/demo/modle"))
    assert len(repos.seen) == asked


def test_a_push_to_a_hub_repo_keys_new_latent_caches_and_class_images(online, hub, tiny_model,
                                                                      demo_data, tmp_path):
    """A hub id's latent cache and generated class images were keyed by its name alone: a
    push to the repo (another VAE, another text encoder) reused what the old one made.
    They are keyed by its commit now, as the hub says, or offline the cache."""
    from raylora.data import cache, classgen
    from raylora.data.plan import plan_data

    hub.add("org/pushed", tiny_model)
    cfg = _cfg(demo_data, tmp_path, pretrained="org/pushed")
    store = cfg.storage.client()
    data = plan_data(cfg.data, store)

    def keys() -> tuple[str, str]:
        return (cache.fingerprint(cfg, "sd", "org/pushed", data, store),
                classgen.generation_key(cfg, "sd", "org/pushed", 4, store))

    first = keys()
    assert keys() == first
    online.HF_HUB_OFFLINE = True  # monkeypatched: restored after the test
    assert keys() == first
    online.HF_HUB_OFFLINE = False
    hub.add("org/pushed", tiny_model, version=1)
    second = keys()
    assert second[0] != first[0] and second[1] != first[1]
