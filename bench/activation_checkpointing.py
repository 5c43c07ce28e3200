"""Benchmark 5 -- activation checkpointing: peak memory of a training step with and without, and its time cost.

What its entries and fields mean: bench/README.md, "Module notes", `activation_checkpointing.py`.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import statistics
import time

import torch

from bench.common import (
    TrainStep,
    check,
    finish,
    info,
    main_for,
    random_bytes,
    run_child,
    spider_model,
    trainer_steps,
)

TARGET = 0.40
FULL = dict(preset="small", batch=1, seq_len=2048, warmup=1, repeats=3, memory_repeats=2)
QUICK = dict(preset="tiny", batch=1, seq_len=128, warmup=1, repeats=2, memory_repeats=1)
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def enable_checkpointing(model) -> str:
    """Switch on activation checkpointing (transformers >= 5.24, ``setup.cfg``'s: ``activation_checkpointing_enable``,
    the non-deprecated name); returns the method's name, the JSON's ``checkpointing_method``."""
    model.activation_checkpointing_enable()
    return "activation_checkpointing_enable"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def child(variant: str, preset: str, batch: int, seq_len: int, repeats: int) -> dict:
    """Measure the step peak in this (fresh) process (bench/README.md). Returns a JSON-able dict (bytes)."""
    model = spider_model(preset)
    method = enable_checkpointing(model) if variant == "on" else None
    step = TrainStep(model, random_bytes(batch, seq_len))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    peaks = []
    if hwm_reset:
        torch.manual_seed(0)
        step()  # warm-up: AdamW state, lazy allocations
        for i in range(repeats):
            _release_memory()
            baseline = _status_kb("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            torch.manual_seed(i + 1)
            step()
            peaks.append((_status_kb("VmHWM") - baseline) * 1024)
        how = "VmHWM - VmRSS baseline after warm-up step (clear_refs reset)"
    else:
        _release_memory()
        baseline = _status_kb("VmRSS")
        torch.manual_seed(1)
        step()
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline * 1024)
        how = "ru_maxrss - VmRSS after model build (no warm-up; includes AdamW state)"
    return {
        "variant": variant,
        "checkpointing_method": method,
        "step_peak_bytes": statistics.median(peaks),
        "step_peak_bytes_all": peaks,
        "how": how,
        "malloc_env": {k: os.environ.get(k) for k in CHILD_ENV},
    }


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    shape = {k: s[k] for k in ("preset", "batch", "seq_len")}
    mem = {  # each variant's peak in a fresh interpreter (`child`)
        v: run_child(
            "bench.activation_checkpointing", dict(variant=v, **shape, repeats=s["memory_repeats"]), env=CHILD_ENV
        )
        for v in ("off", "on")
    }

    ids = random_bytes(s["batch"], s["seq_len"])
    off_model, on_model = spider_model(s["preset"]), spider_model(s["preset"])  # same seed: same weights
    method = enable_checkpointing(on_model)
    timed = {
        v: trainer_steps(m, ids, None, s["warmup"], s["repeats"]) for v, m in (("off", off_model), ("on", on_model))
    }
    off_b, on_b = mem["off"]["step_peak_bytes"], mem["on"]["step_peak_bytes"]
    cost = timed["on"]["median_s"] / timed["off"]["median_s"]
    saving = 1.0 - on_b / off_b if off_b > 0 else None
    result = {
        "benchmark": "activation_checkpointing",
        "description": "training-step peak memory saved by activation checkpointing (1 - on/off)",
        "sizes": shape,
        "dtype": "fp32",
        "timing": {
            "warmup": s["warmup"],
            "repeats": s["repeats"],
            "statistic": "median",
            "memory_repeats": s["memory_repeats"],
        },
        "checkpointing_method": method,
        "memory_method": ("fresh subprocess per variant, MALLOC_MMAP_THRESHOLD_=65536; " + mem["off"]["how"]),
        "measurements": {
            "step_peak_mb": {v: round(m["step_peak_bytes"] / 2**20, 2) for v, m in mem.items()},
            "step_peak_mb_all": {v: [round(b / 2**20, 2) for b in m["step_peak_bytes_all"]] for v, m in mem.items()},
            "median_step_s": {v: round(t["median_s"], 5) for v, t in timed.items()},
            "times_s": {v: t["times_s"] for v, t in timed.items()},
            "time_cost_on_over_off": round(cost, 4),
        },
        "checks": [check("activation checkpointing memory saving", "1 - peak(on)/peak(off)", TARGET, saving)],
        "info": [info("activation checkpointing step time cost (on / off)", cost, "x")],
        "notes": [],
    }
    return finish(result, start)


if __name__ == "__main__":
    main_for(run, child=child)
