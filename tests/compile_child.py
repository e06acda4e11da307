"""A fresh process (its own empty inductor cache) that builds a run from a config file
with ``train.compile_cache_uri`` and trains two steps in process (tests/inproc), for
test_compile's compile-cache test. Prints one JSON line: what it loaded and saved, the
compile counters, and its first batch's loss compiled and forced eager."""

import json
import sys

import torch
from torch._dynamo.utils import counters

from inproc import _train, demo_batch

from raylora.config import load_config
from raylora.train.step import compute_loss


def main(config_path: str) -> None:
    cfg = load_config(config_path)
    batch = demo_batch("sd", cfg.model.pretrained, cfg.data.uri)
    run, _ = _train(cfg, [batch], 2, config_path + ".ckpt")
    saved = run.compile_cache.save()  # nothing new: the stored entry had it all
    compiled = {"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}
    model = run.accelerator.unwrap_model(run.model)
    losses = []  # no-grad variants compile now (cold: nobody stored them); not counted above
    for stance in ("default", "force_eager"):  # the loaded code against no compiled code
        torch.compiler.set_stance(stance)
        torch.manual_seed(0)
        with torch.no_grad():
            losses.append(float(compute_loss(model, run.parts, batch)))
    torch.compiler.set_stance("default")
    print(json.dumps({
        "loaded": run.compile_cache.loaded, "saved": saved, "losses": losses,
        "history": [r["loss"] for r in run.state.history],
        **compiled,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
