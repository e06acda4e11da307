"""Load an adapter with stock diffusers in a fresh process that never imports raylora."""

from __future__ import annotations

import json
import os
import subprocess
import sys

STOCK_LOAD = r"""
import json, sys, torch
from diffusers import StableDiffusionPipeline
model, adapter = sys.argv[1], sys.argv[2]
pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 4, 32, 32, generator=g)
t = torch.tensor([500])
ids = pipe.tokenizer(["a red circle on a blue background"], padding="max_length",
                     max_length=pipe.tokenizer.model_max_length, return_tensors="pt").input_ids
with torch.no_grad():
    enc = pipe.text_encoder(ids)[0]
    before = pipe.unet(x, t, enc).sample
    pipe.load_lora_weights(adapter)
    after = pipe.unet(x, t, enc).sample
print(json.dumps({
    "raylora_imported": any(m.split(".")[0] == "raylora" for m in sys.modules),
    "adapters": pipe.get_active_adapters(),
    "max_abs_diff": float((after - before).abs().max()),
    "finite": bool(torch.isfinite(after).all()),
}))
"""


# SDXL: the whole stock pipeline (two encoders, pooled embeds, size/crop ids) renders the
# same seed before and after loading the adapter.
STOCK_LOAD_SDXL = r"""
import json, sys, torch
from diffusers import StableDiffusionXLPipeline
model, adapter = sys.argv[1], sys.argv[2]
pipe = StableDiffusionXLPipeline.from_pretrained(model)
pipe.set_progress_bar_config(disable=True)
def render():
    return pipe("a red circle on a blue background", num_inference_steps=2, height=64, width=64,
                guidance_scale=5.0, generator=torch.Generator().manual_seed(0), output_type="pt").images
with torch.no_grad():
    before = render()
    pipe.load_lora_weights(adapter)
    after = render()
print(json.dumps({
    "raylora_imported": any(m.split(".")[0] == "raylora" for m in sys.modules),
    "adapters": pipe.get_active_adapters(),
    "max_abs_diff": float((after - before).abs().max()),
    "finite": bool(torch.isfinite(after).all()),
    "pipeline": type(pipe).__name__,
}))
"""


def stock_load(model: str, adapter: str, workdir, family: str = "sd") -> dict:
    """Run the stock load script from ``workdir`` (an empty directory, so the repo's raylora
    package is not importable by path) and return its JSON line."""
    script = os.path.join(str(workdir), "stock_load.py")
    with open(script, "w") as f:
        f.write(STOCK_LOAD_SDXL if family == "sdxl" else STOCK_LOAD)
    proc = subprocess.run(
        [sys.executable, script, model, adapter],
        capture_output=True, text=True, cwd=str(workdir), timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
