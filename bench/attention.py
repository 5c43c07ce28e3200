"""Benchmark 9 -- attention backends: the training step with each ``attn_implementation``.

What its entries and fields mean: bench/README.md, "Module notes", `attention.py`.
"""

from __future__ import annotations

import time

import torch

from bench.common import check, finish, info, main_for, random_bytes, spider_model, trainer_steps

TARGET = 1.0

IMPLEMENTATIONS = ("sdpa", "eager")
FULL = dict(preset="small", batch=8, seq_len=256, warmup=2, repeats=5)
QUICK = dict(preset="tiny", batch=2, seq_len=32, warmup=1, repeats=2)


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. ``profile`` is accepted for the runner and
    unused. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    ids = random_bytes(s["batch"], s["seq_len"])
    timed, losses = {}, {}
    for implementation in IMPLEMENTATIONS:
        model = spider_model(s["preset"])  # same seed: the same weights for every backend
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            losses[implementation] = float(model(input_ids=ids, labels=ids).loss)
        timed[implementation] = trainer_steps(model, ids, None, s["warmup"], s["repeats"])
    ms = {name: 1000 * t["median_s"] for name, t in timed.items()}
    result = {
        "benchmark": "attention",
        "description": "training step time per attention backend (attn_implementation)",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len")},
        "dtype": "fp32",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "losses": losses,
        "measurements": {
            "median_ms": {k: round(v, 2) for k, v in ms.items()},
            "times_s": {n: t["times_s"] for n, t in timed.items()},
        },
        "checks": [
            check(
                "attention: the default sdpa against eager",
                "step time ratio (eager / sdpa)",
                TARGET,
                ms["eager"] / ms["sdpa"],
            )
        ],
        "info": [info(f"attention {name}: training step", ms[name], "ms") for name in IMPLEMENTATIONS],
        "notes": [],
    }
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
