"""How many CPUs each training worker asks for, so that Ray Data's read/preprocess tasks
always have room beside the workers (without it a small cluster waits forever). Pure
arithmetic over node resources; the real 2-CPU head is in tests/test_cluster_local.py."""

from __future__ import annotations

import pytest

from raylora.config import ConfigError, validate
from raylora.data.source import data_stage_cpus
from raylora.launch import fit_worker_cpus


def cfg(**sections):
    tree = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return validate(tree)


def fit(nodes, **sections):
    c = cfg(**sections)
    want = c.scaling.num_workers
    return fit_worker_cpus(nodes, c.scaling, want, data_stage_cpus(c.data, want))


def test_data_stage_needs_per_mode():
    # (least that streams, enough for one preprocess task per worker)
    assert data_stage_cpus(cfg().data, 2) == (0.5, 1.0)
    assert data_stage_cpus(cfg(data={"sharding": "files"}).data, 2) == (2.0, 2.0)
    cached = {"cache": "latents", "center_crop": True, "random_flip": False}
    assert data_stage_cpus(cfg(data=cached).data, 4) == (0.25, 1.0)
    assert data_stage_cpus(cfg(data={**cached, "sharding": "files"}).data, 4) == (1.0, 1.0)


def test_room_left_for_data_keeps_the_request():
    assert fit([{"CPU": 4}], scaling={"num_workers": 2}) == 1.0
    assert fit([{"CPU": 3}], scaling={"num_workers": 2, "cpus_per_worker": 1.25}) == 1.25
    # Four 1-CPU workers on two 2.5-CPU nodes: 1 CPU for data beside them, across nodes.
    assert fit([{"CPU": 2.5}, {"CPU": 2.5}], scaling={"num_workers": 4}) == 1.0


def test_a_full_cluster_gets_smaller_worker_requests():
    # The README's local head on a 2-core box, the demo's 2 workers: half a CPU each, and
    # the other CPU for the preprocess tasks (what hung before).
    assert fit([{"CPU": 2}], scaling={"num_workers": 2}) == 0.5
    assert fit([{"CPU": 4}], scaling={"num_workers": 4}) == 0.5
    # A GPU node with one CPU per GPU: the GPUs bound the workers, the CPUs are shared.
    assert fit([{"CPU": 8, "GPU": 8}], scaling={"num_workers": 8, "use_gpu": True},
               train={"mixed_precision": "bf16"}) == 0.5
    # Per-worker datasets need a whole CPU each (an actor and a read task): 3 of 5 left.
    assert fit([{"CPU": 5}], scaling={"num_workers": 2}, data={"sharding": "files"}) == 1.0
    assert fit([{"CPU": 3}], scaling={"num_workers": 2}, data={"sharding": "files"}) == 0.5
    # STRICT_SPREAD over two 1-CPU nodes: half of each node's CPU for its worker.
    assert fit([{"CPU": 1}, {"CPU": 1}],
               scaling={"num_workers": 2, "placement_strategy": "STRICT_SPREAD"}) == 0.5


def test_nothing_fits_names_the_keys_and_the_cpus_needed():
    with pytest.raises(ConfigError) as exc:
        fit([{"CPU": 2}], scaling={"num_workers": 2}, data={"sharding": "files"})
    msg = str(exc.value)
    assert "scaling.cpus_per_worker: the cluster's 2 CPUs cannot hold 2 training worker(s)" in msg
    assert "need at least 2 CPU" in msg and "at least 2.1 CPUs in all" in msg
    assert "cluster/local-up.sh --cpus N" in msg and "scaling.num_workers" in msg


def test_workers_that_cannot_be_placed_as_asked_are_still_an_error():
    with pytest.raises(ConfigError, match=r"3 workers of 2 CPU each cannot all be placed .* hold at most 2"):
        fit([{"CPU": 4}], scaling={"num_workers": 3, "cpus_per_worker": 2})
    with pytest.raises(ConfigError, match=r"1 workers of 1 CPU \+ 1 GPU each"):
        fit([{"CPU": 4}], scaling={"use_gpu": True}, train={"mixed_precision": "bf16"})
