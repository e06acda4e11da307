"""What every benchmark shares: the machine and versions it ran on, a markdown table, and
appending both to ``bench/RESULTS.md``.

Benchmarks are scripts, not tests: each measures raylora against a baseline in the same
run and prints the ratio, so a slower or busier machine moves both sides together.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")
PACKAGES = ("torch", "ray", "diffusers", "transformers", "peft", "accelerate", "pyarrow")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return float("nan")


def _git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "raylora", "bench",
                                ":!bench/RESULTS.md"],
                               cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=10)
        # Results of uncommitted code say so.
        return (out.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


# Peak dense (no sparsity) bf16 tensor FLOP/s from the vendors' datasheets, matched
# against torch.cuda.get_device_name: the longest name it contains wins ("L40" is not
# "L4", "H200 NVL" not "H200").
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200 NVL", 835.0),
    ("H200", 989.4), ("H800 PCIe", 756.0), ("H800", 989.4), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.05), ("L4", 121.0),
    ("A10G", 70.0), ("A10", 125.0),
]


def peak_flops(device_name: str, override: float | None) -> float | None:
    """Peak dense bf16 FLOP/s of the named GPU (``override`` in TFLOP/s wins); None if unknown."""
    if override:
        return override * 1e12
    known = [(k, t) for k, t in PEAK_BF16_TFLOPS if k in device_name]
    return max(known, key=lambda kt: len(kt[0]))[1] * 1e12 if known else None


def model_flops_counter():
    """torch's FlopCounterMode counting model FLOPs: what the step computes, each
    attention's backward 2x its forward (dQ, dK, dV through the two matmuls). torch's own
    formula for the fused GPU kernels (flash, efficient, cuDNN) adds the recomputed QK^T
    (2.5x: hardware FLOPs, 3-5 % more per step, so MFU read high), and it has none for
    the CPU flash kernel (attention counted as 0 in CPU smoke runs)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    aten = torch.ops.aten

    def forward(q, k, v, *args, **kwargs) -> int:
        return sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, **kwargs) -> int:
        return 2 * sdpa_flop_count(q, k, v)

    mapping = {op: backward for op in (aten._scaled_dot_product_efficient_attention_backward,
                                       aten._scaled_dot_product_flash_attention_backward,
                                       aten._scaled_dot_product_cudnn_attention_backward)}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = forward
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    return FlopCounterMode(display=False, custom_mapping=mapping)


def sync(device) -> None:
    """Wait for queued GPU work, so wall-clock timers measure it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def machine() -> dict:
    """Date, hardware and versions, for the results file."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{_cpu_model()}, {os.cpu_count()} cores, {_memory_gib():.0f} GiB",
        "gpu": gpu or "none",
        "python": platform.python_version(),
        "versions": versions,
        "raylora": _git_rev(),
    }


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table; floats with 3 significant figures (ratios with 2 decimals)."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def record(title: str, env: dict, body: str, notes: list[str] = ()) -> str:
    """Print a result section and append it to bench/RESULTS.md; returns the text."""
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    text = "\n".join([
        f"## {title}",
        "",
        f"- Date: {env['date']}; raylora {env['raylora']}",
        f"- Machine: {env['cpu']}; GPU: {env['gpu']}",
        f"- Python {env['python']}; {versions}",
        *[f"- {n}" for n in notes],
        "",
        body,
        "",
    ])
    print(text, flush=True)
    with open(RESULTS, "a") as f:
        f.write("\n" + text)
    return text


@contextmanager
def moto_bucket(bucket: str = "bench"):
    """moto's S3 server on loopback for one benchmark, with bench credentials in the
    environment (``AWS_ENDPOINT_URL`` too) and ``bucket`` made: yields (endpoint, client)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket=bucket)
        yield endpoint, s3
    finally:
        server.stop()


@contextmanager
def stopwatch(out: dict, key: str):
    t0 = time.perf_counter()
    yield
    out[key] = time.perf_counter() - t0
