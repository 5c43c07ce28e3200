"""What a training run measures of itself: FLOPs per step, achieved FLOP/s and MFU (torchtitan's
``components/metrics.py`` logs the same every logging step), so that a benchmark and a real run report one number.

FLOPs are counted, not estimated: :func:`count_flops` runs one call under ``torch.utils.flop_counter.FlopCounterMode``
with the formulas torch lacks on CPU (:func:`extra_flop_formulas`: ``torch._grouped_mm``, the CPU flash-attention
kernel). Only matmul-like ops count (norms, softmax, the optimizer: 0); causal and windowed attention count as full
attention, as torch counts them. The trainer counts the forward of its first training micro-batch (its backward
runs outside the counter, whose dispatch mode would change the backward kernels: the step computes exactly what it
computes uncounted, tested; under ``--compile`` that one forward runs eagerly), takes 3 times that for forward and
backward, and scales by the micro-batches since the
last log: Spider's FLOPs move a little with its segment count, which the first micro-batch fixes. MFU divides the
achieved FLOP/s by :func:`peak_flops`: the GPU's dense bf16 peak
from its data sheet (:data:`PEAK_FLOPS`), or on another device a measured ``n x n`` matmul. Beside a measurement, the
machine and versions it was taken on: :func:`environment`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: Dense bf16 tensor-core peak FLOP/s per device name (substring, first match), from NVIDIA's data sheets.
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm`` FLOPs (2 per multiply-add) for the four 2-D/3-D operand layouts."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (M, K) x (E, K, N), rows grouped by offs
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:  # (E, M, K) x (K, N), columns grouped
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K) x (K, N), K grouped -> (E, M, N)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # batched


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def extra_flop_formulas() -> dict:
    """FLOP formulas torch 2.13's ``FlopCounterMode`` lacks on CPU: ``_grouped_mm`` (transformers' and Spider's
    grouped experts) and the CPU flash-attention SDPA kernel (forward and backward)."""
    aten = torch.ops.aten
    formulas = {aten._grouped_mm: _grouped_mm_flop}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop
        formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flop
    return formulas


def count_flops(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` once under ``FlopCounterMode`` (plus :func:`extra_flop_formulas`), compiled functions eagerly
    (``torch.compiler.set_stance("force_eager")``: dynamo refuses to trace under a dispatch mode).

    Returns:
        ``{"total": int, "by_op": {op name: int}, "result": fn's return value}``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas())
    with torch.compiler.set_stance("force_eager"), counter:
        result = fn()
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return {"total": int(counter.get_total_flops()), "by_op": by_op, "result": result}


def measured_matmul_flops(
    device: torch.device | str, dtype: torch.dtype, n: int | None = None, warmup: int = 2, repeats: int = 5
) -> dict[str, float]:
    """FLOP/s of an ``n x n @ n x n`` matmul in `dtype` on `device` (2 n^3 FLOPs a call): the median of `repeats`
    calls, each between two device synchronisations. ``n``: 8192 on CUDA, 1024 elsewhere.

    Returns:
        ``{"n", "median_s", "flops_per_s"}``.
    """
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"n": n, "median_s": median, "flops_per_s": 2 * n**3 / median}


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has run everything queued on it (a no-op on CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """``(peak FLOP/s, where it comes from)`` of `device` for MFU: a CUDA GPU named in :data:`PEAK_FLOPS` in bf16 or
    fp16, its data sheet's dense peak (FP8's 2x is not counted); otherwise a measured matmul in `dtype`."""
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops, f"{name} data sheet, dense {str(dtype).replace('torch.', '')}"
    measured = measured_matmul_flops(device, dtype)
    return measured["flops_per_s"], f"measured {measured['n']}^3 matmul, {str(dtype).replace('torch.', '')}"


class ThroughputMeter:
    """FLOPs and MFU of a training loop: :meth:`count` the first micro-batch, :meth:`step` each micro-batch,
    :meth:`read` at each log.

    Args:
        device: the training device; dtype: the matmul dtype (bf16 under autocast, else fp32) for :func:`peak_flops`.
        micro_batches_per_step: gradient accumulation steps (``flops_per_step`` = FLOPs of that many micro-batches).

    Attributes (after :meth:`count`): ``flops_per_micro_batch`` (int), ``flops_by_op`` (those FLOPs by aten op, e.g.
    ``{"aten.mm": ...}``; ``bench.mfu`` reports them), ``peak`` (FLOP/s; set it beforehand to skip measuring) and
    ``peak_source``.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype, micro_batches_per_step: int = 1):
        self.device, self.dtype, self.micro_batches_per_step = torch.device(device), dtype, micro_batches_per_step
        self.flops_per_micro_batch: int | None = None
        self.flops_by_op: dict[str, int] = {}  # flops_per_micro_batch by aten op (str), as count_flops names them
        self.peak: float | None = None
        self.peak_source = ""
        self._micro_batches, self._since = 0, time.perf_counter()

    def count(self, fn: Callable[[], Any], forward_only: bool = False) -> Any:
        """Run one micro-batch's forward+backward `fn` under the FLOP counter; returns what `fn` returns. With
        `forward_only`, `fn` is the forward alone and its FLOPs count 3 times (the backward's matmuls are twice the
        forward's: the input and the weight gradient), the convention of MFU (PaLM's 6N per token)."""
        counted = count_flops(fn)
        scale = 3 if forward_only else 1
        self.flops_per_micro_batch = counted["total"] * scale
        self.flops_by_op = {op: flops * scale for op, flops in counted["by_op"].items()}
        if self.peak is None:
            self.peak, self.peak_source = peak_flops(self.device, self.dtype)
        return counted["result"]

    def step(self) -> None:
        """One more micro-batch trained."""
        self._micro_batches += 1

    def read(self) -> dict[str, float]:
        """Since the previous read: ``flops_per_step``, ``tflops_per_second`` (this process) and ``mfu`` (of the
        device's peak, 0..1), to 4 significant digits; empty before anything was counted."""
        now = time.perf_counter()
        elapsed, micro_batches = max(now - self._since, 1e-9), self._micro_batches
        self._micro_batches, self._since = 0, now
        if not self.flops_per_micro_batch:
            return {}
        achieved = self.flops_per_micro_batch * micro_batches / elapsed
        return {
            "flops_per_step": float(self.flops_per_micro_batch * self.micro_batches_per_step),
            "tflops_per_second": float(f"{achieved / 1e12:.4g}"),
            "mfu": float(f"{achieved / self.peak:.4g}"),
        }


def environment() -> dict[str, Any]:
    """What a measurement depends on, recorded beside it (``spider-memory-plan``'s plan, every ``bench`` JSON):
    versions, threads, CPU model, load average at the time of the run; ``device`` is ``"cpu"`` (``bench.gpu_check``
    adds its GPU)."""
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": "cpu",
    }
