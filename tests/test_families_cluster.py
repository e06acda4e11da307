"""DiT families on a real local Ray: 2 DDP workers train from parquet shards, the adapter
loads in the family's stock diffusers pipeline (every module live) and changes its image;
validation grids and ``raylora sample`` work too.

Cases: raylora's own tiny model of the DiT families whose run takes a path of its own on
Ray (``CASES``), and Wan 2.2 A14B's layout training its low-noise expert (``model.expert``:
previews, card, ``raylora sample`` and the stock load all put the adapter into
``transformer_2``). Flux.2 [dev] and Qwen-Image 2.1 train from the latent cache. Every
family trains, loads into its stock pipeline and samples with ``raylora sample``
in-process (test_families.py). SD 1.x runs the same path in
test_train_ray.py, SDXL in test_sdxl_cache.py; the Flux and SD3 folders built straight with
diffusers classes (tests/userbuilt.py, as a user's converted checkpoint arrives) train
through the same step in-process in test_tiny_model.py."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from raylora.config import validate
from raylora.model import families
from stock import PIPELINES, stock_image_change

pytestmark = pytest.mark.integration

# A DiT family whose Ray run differs from the others' (SD 1.x and SDXL run elsewhere: see
# the docstring), trained text to image: Flux.1 (two text encoders, a guidance embedding),
# Flux.2 [dev] (the latent cache; previews load its text encoder quantized), Qwen-Image 2.1
# (the cache's RGBA latents and unpadded captions), Sana (model.system_prompt in training
# captions, previews and the card, and instruction tokens marked in the mask through Ray
# Data) and Wan 2.2 A14B's low-noise expert. The other families' runs on Ray are this path
# with another model: ~50 s each of the Ray lane, which is CI's longest, for no step of
# their own (each still trains, loads and samples in-process: test_families.py). Edit pairs
# on Ray: test_edit.py (test_an_edit_run_on_pairs_edits_in_the_stock_pipeline).
CASES = [("flux", None), ("flux2", None), ("qwenimage21", None), ("sana", None), ("wan", "low_noise")]


@pytest.mark.parametrize("family,expert", CASES, ids=[f"{f}-{e}" if e else f for f, e in CASES])
def test_two_workers_train_from_parquet_and_stock_pipeline_loads(family, expert, ray_local, tiny,
                                                                  demo_data, tmp_path):
    from raylora.launch import run
    from raylora.sample import sample

    model = tiny(family, experts=expert is not None)
    out = tmp_path / "out"
    tree = {
        "model": {"pretrained": model, "max_sequence_length": 32, "expert": expert},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "lora": {"rank": 4},
        "train": {"batch_size": 1, "max_steps": 3, "learning_rate": 5e-3, "seed": 3},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 3},
        "validation": {"prompts": ["a red circle"], "num_inference_steps": 2, "every_n_steps": 3},
        "output": {"uri": str(out)},
    }
    if family == "flux2":
        # From the latent cache, whose workers hold no text encoder: each preview loads it
        # as training would, quantized (test_quantize checks what it loads).
        tree["data"]["cache"] = "latents"
        tree["model"]["quantize_text_encoders"] = "nf4"
    if family == "qwenimage21":  # its RGBA latents and unpadded captions, through the cache
        tree["data"]["cache"] = "latents"
    # A pipeline with a system prompt (Lumina-Image 2.0; Sana's instruction): the run's own,
    # in training captions, previews and the card (test_families checks the conditioning
    # against the pipeline's).
    system_prompt = "Draw it." if families.get(family).system_prompt is not None else None
    if system_prompt:
        tree["model"]["system_prompt"] = system_prompt
    summary = run(validate(tree))
    m = summary["metrics"]
    assert m["steps"] == 3 and m["images_seen"] == 3 * 1 * 2
    assert len(m["replica_lora_digests"]) == 2 and m["replicas_in_sync"] is True
    assert np.isfinite(m["train_loss_first"]) and np.isfinite(m["train_loss_last"])

    adapter = out / "adapter"
    pipeline = PIPELINES[family][0]
    meta = json.loads((adapter / "raylora.json").read_text())["data"]
    assert (meta["family"], meta["pipeline"], meta["objective"]) == (family, pipeline, "flow_matching")
    assert "control_inputs" not in meta  # text to image: no input images
    card = (adapter / "README.md").read_text()
    assert f"from diffusers import {pipeline}" in card
    # the pipeline's own argument for it (Lumina2's system_prompt, Sana's
    # complex_human_instruction), as the run trained
    call = families.get(family).prompt_kwargs(system_prompt)
    assert bool(call) == (system_prompt is not None)
    assert all(f"{k}={v!r}" in card for k, v in call.items())
    if expert:
        # The card's own code, up to its load, puts the adapter into the trained expert.
        code = card.split("```python\n")[1].split("image = pipe(")[0]
        scope: dict = {}
        exec(code.replace("path/to/this/folder", str(adapter)), scope)
        assert "load_into_transformer_2=True" in code and "expert `low_noise` (`transformer_2`)" in card
        assert '# pipe.load_lora_weights("path/to/that/folder")\n' in code  # the high-noise one
        lora = [sum(hasattr(m, "lora_A") for _, m in getattr(scope["pipe"], c).named_modules())
                for c in ("transformer", "transformer_2")]
        assert lora[0] == 0 and lora[1] > 0, lora
        # The run's summary says the same; a rerun at this output.uri with the other expert
        # is refused before Ray starts (it would resume this expert's LoRA as that one's).
        from raylora.progress import summary_lines

        assert 'load_lora_weights("' + summary["adapter"] + '", load_into_transformer_2=True)' in \
            "\n".join(summary_lines(summary))
        other = {**tree, "model": {**tree["model"], "expert": "high_noise"}}
        with pytest.raises(ValueError, match="model.expert: this run has model.expert=high_noise, "
                                             "but the checkpoint this output.uri resumes from"):
            run(validate(other))

    # A rerun at this output.uri with another rank or alpha is refused before Ray starts,
    # naming each key (another rank could not load the LoRA state; another alpha would
    # carry it on scaled otherwise).
    from raylora.launch import TRAIN, checked

    changed = {**tree, "lora": {"rank": 8, "alpha": 2}}
    with pytest.raises(ValueError) as exc:
        checked(validate(changed), TRAIN)
    assert str(exc.value).startswith("lora.rank, lora.alpha: this run has lora.rank=8, lora.alpha=2.0, "
                                     "but the checkpoint this output.uri resumes from (")
    assert str(exc.value).endswith("trained lora.rank=4, lora.alpha=4; set them back to resume that "
                                   "run, or give this one its own output.uri")
    assert checked(validate(tree), TRAIN).resume  # unchanged: it resumes

    # Validation grids before the first step and at the end, drawn by the family's pipeline.
    grids = sorted(os.listdir(out / "validation"))
    assert grids == ["step_000000.png", "step_000003.png"]
    first, last = (np.asarray(Image.open(out / "validation" / g), dtype=np.float32) for g in grids)
    assert first.shape == (64, 64, 3) and np.abs(first - last).max() > 0

    # The family's stock pipeline loads the adapter (active, every module live) and its
    # image changes. In this process: a fresh one, which never imports raylora, costs ~8 s
    # of imports per family; test_train_ray and test_sdxl_cache load sd/sdxl adapters so.
    assert stock_image_change(family, model, str(adapter), expert=expert) > 1e-4

    # raylora sample: the expert from the folder's raylora.json
    png = sample(model, str(adapter), "a red circle", str(tmp_path / "sample.png"), steps=2, size=64)
    assert Image.open(png).size == (64, 64)
