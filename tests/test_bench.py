"""The bench's own arithmetic (bench/common.py): the GPU's peak and the FLOPs an MFU
divides by. Timings themselves are bench work, run on a GPU (bench/RESULTS.md)."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from common import model_flops_counter, peak_flops  # noqa: E402


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H800 PCIe", 756.0), ("NVIDIA L40", 181.05),
    ("NVIDIA L40S", 362.1), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 70.0)])
def test_peak_flops_is_the_longest_name_the_device_has(name, tflops):
    """First match in list order gave an L40 the L4's peak (MFU x1.5) and an H200 NVL or
    H800 PCIe the SXM part's (MFU x0.84, x0.76)."""
    assert peak_flops(name, None) == pytest.approx(tflops * 1e12)
    assert peak_flops("Some GPU", None) is None and peak_flops("NVIDIA L4", 100.0) == 1e14


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_model_flops_count_attention_backward_as_twice_its_forward(device):
    """One attention layer (SD1.5's first level: 8 heads, 1024 tokens, head 40): forward
    2 matmuls, backward 4 (dQ, dK, dV and the scores' gradient), whatever kernel runs. The
    CPU flash kernel had no formula (counted 0) and torch's fused-kernel formula counts
    the recomputed scores (2.5x), so the bench's MFU read 3-5 % high on GPUs."""
    b, h, s, d = 1, 8, 1024, 40
    forward = 2 * (2 * b * h * s * s * d)
    q, k, v = (torch.randn(b, h, s, d, device=device, requires_grad=True) for _ in range(3))
    with model_flops_counter() as counter:
        out = F.scaled_dot_product_attention(q, k, v)
        counted_forward = counter.get_total_flops()
        out.sum().backward()
    assert counted_forward == forward
    assert counter.get_total_flops() == 3 * forward
    # the fused GPU kernels' backward ops, as they are counted on a CUDA run
    from torch.utils.flop_counter import sdpa_backward_flop

    shaped = [torch.empty(b, h, s, d, device="meta") for _ in range(4)]  # grad_out, q, k, v
    for op in ("flash", "efficient", "cudnn"):
        fused = getattr(torch.ops.aten, f"_scaled_dot_product_{op}_attention_backward")
        assert counter.flop_registry[fused](*shaped) == 2 * forward, op
    assert sdpa_backward_flop(*[t.shape for t in shaped]) == 2.5 * forward  # torch's own
