"""Benchmark 3 -- model FLOP utilisation of a training step, Spider vs the DeepseekV3 peer.

What its entries and fields mean: bench/README.md, "Module notes", `mfu.py`.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import check, finish, main_for
from bench.train_step import FULL as TRAIN_FULL
from bench.train_step import QUICK as TRAIN_QUICK
from bench.train_step import build_models, profile_trainer, train_rows
from spider_training.throughput import measured_matmul_flops

TARGET = 1.0
FULL = {**TRAIN_FULL, "matmul_n": 2048}
QUICK = {**TRAIN_QUICK, "matmul_n": 512}
ROWS = ("spider_n_loops_1", "spider_default", "peer")


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    models, details = build_models(s["preset"])
    peak = measured_matmul_flops("cpu", torch.float32, n=s["matmul_n"])
    runs = train_rows({name: models[name] for name in ROWS}, s, peak=peak["flops_per_s"])
    meters = {n: run["trainer"].throughput for n, run in runs.items()}
    logged = {  # what the trainer logged at the timed steps, against `peak`
        n: {k: statistics.median(e[k] for e in run["logs"]) for k in ("tflops_per_second", "mfu")}
        for n, run in runs.items()
    }
    mfu = {n: v["mfu"] for n, v in logged.items()}
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
            "step_gflops": {n: round(m.flops_per_micro_batch / 1e9, 3) for n, m in meters.items()},
            "step_gflops_by_op": {
                n: {op: round(v / 1e9, 3) for op, v in m.flops_by_op.items()} for n, m in meters.items()
            },
            "median_step_s": {n: round(run["median_s"], 5) for n, run in runs.items()},
            "achieved_gflops_per_s": {n: round(v["tflops_per_second"] * 1e3, 2) for n, v in logged.items()},
            "mfu": {n: round(v, 4) for n, v in mfu.items()},
        },
        "checks": [
            check("MFU Spider(default n_loops) / peer", "MFU ratio", TARGET, mfu["spider_default"] / mfu["peer"])
        ],
        "notes": [
            "FLOPs, achieved FLOP/s and MFU as the trainer logs them (spider_training.throughput): the first "
            "micro-batch's forward counted by FlopCounterMode (matmul-like ops only; _grouped_mm and CPU flash SDPA "
            "formulas added), 3x for forward and backward",
            f"Spider(n_loops=1) / peer MFU ratio: {mfu['spider_n_loops_1'] / mfu['peer']:.3f}",
        ],
    }
    if profile and not result["checks"][0]["met"]:
        result["profile"] = {"spider_default": profile_trainer(runs["spider_default"]["trainer"])}
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
