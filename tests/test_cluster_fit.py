"""How many CPUs each training worker asks for, so that Ray Data's read/preprocess tasks
always have room beside the workers (without it a small cluster waits forever). Pure
arithmetic over node resources; the real 2-CPU head is in tests/test_cluster_local.py."""

from __future__ import annotations

import pytest

from raylora.config import ConfigError, validate
from raylora.data.source import data_stage_cpus
from raylora.launch import fit_worker_cpus, fitted_to, stage_task_cpus


def cfg(**sections):
    tree = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return validate(tree)


def fit(nodes, **sections):
    c = cfg(**sections)
    want = c.scaling.num_workers
    return fit_worker_cpus(nodes, c.scaling, want, data_stage_cpus(c.data, want), stage_task_cpus(c.data))


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


def test_ray_datas_task_must_find_its_cpus_on_one_node():
    """The check added up the CPUs the workers leave on every node: two 1-CPU nodes with a
    worker of 0.75 each left 0.5 "free" and were accepted, but each node had 0.25 and Ray
    Data's 0.5-CPU read/preprocess task never started (the run waited forever). Now the
    workers are placed per node as Ray places them, and some node must keep a whole task."""
    spread = {"placement_strategy": "STRICT_SPREAD"}
    assert fit([{"CPU": 1}, {"CPU": 1}],
               scaling={"num_workers": 2, "cpus_per_worker": 0.75, **spread}) == 0.5
    # PACK places them one a node too (a node holds one of 0.75): the same answer.
    assert fit([{"CPU": 1}, {"CPU": 1}], scaling={"num_workers": 2, "cpus_per_worker": 0.75}) == 0.5
    # 3 nodes of 8 CPUs and 1 GPU, a worker of 7.8 on each: 0.2 per node; 7.5 leaves each
    # node a task (the 3 that run at once).
    gpu = {"use_gpu": True, "num_workers": 3, "cpus_per_worker": 7.8}
    bf16 = {"mixed_precision": "bf16"}
    assert fit([{"CPU": 8, "GPU": 1}] * 3, scaling=gpu, train=bf16) == 7.5
    # ...unless a node without workers keeps room (a CPU-only head): the request stands.
    assert fit([{"CPU": 8, "GPU": 1}] * 3 + [{"CPU": 8}], scaling=gpu, train=bf16) == 7.8
    # PACK fills one node, the other keeps its CPUs for the data stage.
    assert fit([{"CPU": 2}, {"CPU": 2}], scaling={"num_workers": 2}) == 1.0
    # The latent cache's read tasks ask for 0.25 CPU: 0.2 left on each node is none.
    cached = {"cache": "latents", "center_crop": True, "random_flip": False}
    assert fit([{"CPU": 1}, {"CPU": 1}], scaling={"num_workers": 2, "cpus_per_worker": 0.8, **spread},
               data=cached) == 0.75
    # data.sharding=files: 2 CPUs of 0.5-CPU tasks; 1.25 + 0.75 left is 3 tasks, not 4.
    assert fit([{"CPU": 3.25}, {"CPU": 2.75}], scaling={"num_workers": 2, "cpus_per_worker": 2, **spread},
               data={"sharding": "files"}) == 1.75


def test_no_node_with_room_for_a_data_task_is_refused_naming_the_keys():
    # 0.8 CPUs in all, but no node can ever hold a 0.5-CPU task beside its worker (0.15
    # each was accepted).
    with pytest.raises(ConfigError) as exc:
        fit([{"CPU": 0.4}, {"CPU": 0.4}],
            scaling={"num_workers": 2, "cpus_per_worker": 0.25, "placement_strategy": "STRICT_SPREAD"})
    msg = str(exc.value)
    assert "scaling.cpus_per_worker: the cluster's 0.8 CPUs cannot hold 2 training worker(s)" in msg
    assert "in tasks of 0.5 CPU that each run on one node" in msg and "scaling.num_workers" in msg


def test_elastic_runs_and_tune_trials_judge_the_data_stage_per_node():
    from raylora.tune import trial_cpus_per_worker

    # An elastic run (data.sharding=files: 1 CPU of 0.5-CPU tasks a worker): Ray Train
    # would start both workers of 2 CPUs, leaving 1.25 + 0.75 CPUs, 3 tasks where 4 are needed.
    files, nodes = {"sharding": "files"}, [{"CPU": 3.25}, {"CPU": 2.75}]
    spread = {"placement_strategy": "STRICT_SPREAD", "cpus_per_worker": 2}
    elastic = fitted_to(cfg(scaling={"num_workers": [1, 2], **spread}, data=files), nodes)
    assert (elastic.scaling.num_workers, elastic.scaling.cpus_per_worker) == ((1, 2), 1.75)
    # A Tune trial's workers, alone on the cluster: the same per-node answer as one run.
    trial = cfg(scaling={"num_workers": 2, **spread}, data=files)
    assert trial_cpus_per_worker(trial, nodes, 1) == 1.75
