"""Benchmark 3 -- model FLOP utilisation of a training step, Spider vs the DeepseekV3 peer.

What its entries and fields mean: bench/README.md, "Module notes", `mfu.py`.
"""

from __future__ import annotations

import time

import torch

from bench.common import check, finish, main_for, profile_top, time_interleaved
from bench.train_step import FULL as TRAIN_FULL
from bench.train_step import QUICK as TRAIN_QUICK
from bench.train_step import build_steps
from spider_training.throughput import count_flops, measured_matmul_flops

TARGET = 1.0
FULL = {**TRAIN_FULL, "matmul_n": 2048}
QUICK = {**TRAIN_QUICK, "matmul_n": 512}


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    steps, details = build_steps(s["preset"], s["batch"], s["seq_len"])
    flops = {}
    for name, step in steps.items():
        torch.manual_seed(0)  # Spider's boundary sampling (hence its segment count) is seeded
        flops[name] = count_flops(step)
    peak = measured_matmul_flops("cpu", torch.float32, n=s["matmul_n"])
    timed = time_interleaved(steps, s["warmup"], s["repeats"])
    mfu = {n: flops[n]["total"] / (timed[n]["median_s"] * peak["flops_per_s"]) for n in steps}
    result = {
        "benchmark": "mfu",
        "description": "MFU of a training step: Spider (default n_loops) / DeepseekV3 peer",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len", "matmul_n")},
        "dtype": "fp32",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "models": details,
        "measurements": {
            "peak_matmul": {
                "n": peak["n"],
                "median_s": round(peak["median_s"], 5),
                "gflops_per_s": round(peak["flops_per_s"] / 1e9, 2),
            },
            "step_gflops": {n: round(f["total"] / 1e9, 3) for n, f in flops.items()},
            "step_gflops_by_op": {
                n: {op: round(v / 1e9, 3) for op, v in f["by_op"].items()} for n, f in flops.items()
            },
            "median_step_s": {n: round(t["median_s"], 5) for n, t in timed.items()},
            "achieved_gflops_per_s": {n: round(flops[n]["total"] / timed[n]["median_s"] / 1e9, 2) for n in steps},
            "mfu": {n: round(v, 4) for n, v in mfu.items()},
        },
        "checks": [
            check("MFU Spider(default n_loops) / peer", "MFU ratio", TARGET, mfu["spider_default"] / mfu["peer"])
        ],
        "notes": [
            "FlopCounterMode counts matmul-like ops only; _grouped_mm and CPU flash SDPA formulas added by the bench",
            "convolution_backward of the depthwise Engram ShortConv is over-counted by torch's formula "
            "(ignores groups)",
            f"Spider(n_loops=1) / peer MFU ratio: {mfu['spider_n_loops_1'] / mfu['peer']:.3f}",
        ],
    }
    if profile and not result["checks"][0]["met"]:
        result["profile"] = {"spider_default": profile_top(steps["spider_default"], steps=2)}
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
