"""#21 on a real local Ray: ``scaling.strategy: fsdp`` with 2 CPU workers (gloo) trains the
adapter DDP trains from the same seed and files (Flux.1), holds about half the
denoiser per worker, writes a normal diffusers adapter that the stock pipeline loads, and
its sharded checkpoints resume: after a worker is killed, to the uninterrupted run's
adapter; and on 1 worker instead of 2."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from killer import kill_a_worker_after
from raylora.config import validate
from stock import stock_image_change

pytestmark = pytest.mark.integration

STEPS = 6  # 4 micro-batches per worker per epoch: the runs cross an epoch boundary
ADAPTER = os.path.join("adapter", "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def runs(ray_local, tiny, tmp_path_factory):
    """``go(name, family, strategy, ...)``: one raylora run into ``root/name``; its summary."""
    from raylora.data.demo import write_parquet_shards
    from raylora.launch import run

    root = tmp_path_factory.mktemp("fsdp")
    write_parquet_shards(root / "data", n=16, num_shards=2, size=64, seed=5)
    write_parquet_shards(root / "heldout", n=5, num_shards=1, size=64, seed=6)

    def tree(name, family, strategy, workers=2, steps=STEPS, precision="no", **more):
        return {
            "model": {"pretrained": tiny(family)},
            # Reproducible data: each worker reads its own files in order.
            "data": {"uri": str(root / "data"), "resolution": 64, "center_crop": True,
                     "random_flip": True, "sharding": "files", "shuffle_buffer_size": 4},
            "train": {"batch_size": 2, "max_steps": steps, "learning_rate": 2e-3, "seed": 11,
                      "record_samples": True, "mixed_precision": precision},
            "scaling": {"num_workers": workers, "strategy": strategy},
            "checkpoint": {"every_n_steps": 2, "num_to_keep": 2},
            "failure": {"max_failures": 1},
            "output": {"uri": str(root / name)},
            **more,
        }

    def go(name, family, strategy, **kw):
        return run(validate(tree(name, family, strategy, **kw)))

    return root, tree, go


def _rows(root, name):
    return [json.loads(x) for x in open(root / name / "metrics.jsonl")]


def test_fsdp_trains_the_adapter_ddp_trains_on_half_the_memory(runs, tiny):
    """Flux.1's transformer: a DiT's blocks sharded through Ray Train. SD's UNet is
    compared with DDP below Ray (test_fsdp.py) and resharded through Ray below."""
    root, _, go = runs
    family = "flux"
    ddp = go(f"{family}-ddp", family, "ddp")["metrics"]
    fsdp = go(f"{family}-fsdp", family, "fsdp")["metrics"]
    assert ddp["steps"] == fsdp["steps"] == STEPS
    a = load_file(str(root / f"{family}-ddp" / ADAPTER))
    b = load_file(str(root / f"{family}-fsdp" / ADAPTER))
    assert set(a) == set(b) and len(a) > 0
    # Training moved the adapter (lora_B starts at 0), so agreement is not agreement of inits.
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k or "lora.up" in k) > 1e-4
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, worst
    ddp_rows, fsdp_rows = _rows(root, f"{family}-ddp"), _rows(root, f"{family}-fsdp")
    assert [r["samples"] for r in fsdp_rows] == [r["samples"] for r in ddp_rows]
    assert [r["loss"] for r in fsdp_rows] == pytest.approx([r["loss"] for r in ddp_rows], rel=1e-4)
    # Per worker: the whole denoiser under DDP, about half of it under FSDP.
    assert len(fsdp["denoiser_param_bytes_per_rank"]) == 2
    for shard in fsdp["denoiser_param_bytes_per_rank"]:
        assert shard <= 0.6 * ddp["denoiser_param_bytes_per_rank"][0]
    # The checkpoint holds DCP shards from both ranks; the adapter is a normal one.
    meta = json.load(open(root / f"{family}-fsdp" / "adapter" / "raylora.json"))
    assert meta["config"]["scaling"]["strategy"] == "fsdp"
    ckpts = sorted(p for p in (root / f"{family}-fsdp" / "train").iterdir() if p.name.startswith("checkpoint_2"))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpts[-1] / "fsdp"))
    # ...and records them: rank 1's shard by the name rank 0's .metadata gives it.
    record = json.load(open(ckpts[-1] / "checkpoint_files.json"))
    assert record["other_ranks"] == ["fsdp/__1_0.distcp", "rng_rank1.pt"]
    assert {"fsdp/.metadata", "fsdp/__0_0.distcp", "lora.safetensors"} <= set(record["rank0"])
    assert stock_image_change(family, tiny(family), root / f"{family}-fsdp" / "adapter") > 1e-4


def test_a_killed_fsdp_worker_resumes_to_the_same_adapter(runs):
    root, _, go = runs
    reference = root / "flux-fsdp" / ADAPTER
    if not reference.exists():
        go("flux-fsdp", "flux", "fsdp")
    with kill_a_worker_after(root / "killed" / "train", 2) as killed:
        summary = go("killed", "flux", "fsdp")
    assert killed, "the worker was never killed"
    assert summary["metrics"]["resumed_from_step"] in (2, 4)
    rows, ref_rows = _rows(root, "killed"), _rows(root, "flux-fsdp")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in rows] == [r["samples"] for r in ref_rows]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-5)
    got, want = load_file(str(root / "killed" / ADAPTER)), load_file(str(reference))
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7)


def test_a_two_worker_fsdp_checkpoint_resumes_on_one_worker(runs):
    """DCP reshards the LoRA and optimizer state written by 2 ranks onto 1. In bf16: the
    frozen base in bf16, computed in bf16 (FSDP's mixed-precision policy under autocast),
    LoRA masters and their optimizer state in fp32. With a held-out loss (5 images: the
    ranks hold 3 and 2, yet make the same number of denoiser calls) and validation images
    (every rank renders, rank 0 writes) every 4 steps: bf16 on these CPUs is slow (a
    step ~4 s, a render or an evaluation ~6 s), so this run renders and evaluates at 0, 4
    and 6 only."""
    from raylora.launch import run

    root, tree, _ = runs
    more = {"validation": {"every_n_steps": 4, "prompts": ["a red circle"], "num_inference_steps": 2}}

    def reshard(workers, steps):
        t = tree("reshard", "sd", "fsdp", workers=workers, steps=steps, precision="bf16", **more)
        t["data"]["validation_uri"] = str(root / "heldout")
        return run(validate(t))

    first = reshard(2, 4)
    before = load_file(str(root / "reshard" / ADAPTER))
    assert all(v.dtype == torch.float32 for v in before.values())
    fm = first["metrics"]
    assert fm["eval_loss_base"] > 0 and fm["eval_loss_last"] > 0
    assert fm["eval_loss_last"] != fm["eval_loss_base"]
    assert {f"step_{s:06d}.png" for s in (0, 4)} <= set(os.listdir(root / "reshard" / "validation"))
    summary = reshard(1, STEPS)
    m = summary["metrics"]
    assert m["resumed_from_step"] == 4 and m["steps"] == STEPS
    assert m["train_loss_first"] == first["metrics"]["train_loss_first"]
    assert len(m["denoiser_param_bytes_per_rank"]) == 1
    rows = _rows(root, "reshard")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["loss"] > 0 for r in rows)
    after = load_file(str(root / "reshard" / ADAPTER))
    assert set(after) == set(before)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 0  # it trained on
