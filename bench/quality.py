"""Benchmark 8 -- model quality: held-out bits per byte of Spider's default run against its byte layers alone and a
dense byte ``LlamaForCausalLM`` of equal parameters and steps, judged against the quality targets.

The rows train and score as the quality study's do (:func:`experiments.quality.train_and_score`: ``train_hf.py``'s
trainer, the library's scoring); the study's full tables, ablations and plot are experiments/README.md's.
"""

from __future__ import annotations

import time

from bench.common import check, finish, info, main_for
from experiments.quality import Recipe, train_and_score


def run(quick: bool = False, profile: bool | None = None) -> dict:
    """``bench.run_all``'s entry (result format of :mod:`bench.common`): Spider's default run, the same byte layers
    without the global path and the dense Llama at equal parameters and steps, each trained by the default recipe
    (about 35 minutes on one thread), judged against the quality targets. `quick`: 6 steps of 2 x 64 bytes scored
    on a 4 KB slice, which checks the wiring, not the model. The complete tables (every ablation, the equal
    wall-clock sweep, longer budgets) are ``python -m experiments.quality --suite``. `profile`:
    accepted for the runner, unused."""
    start = time.perf_counter()
    recipe = Recipe(steps=6, batch_size=2, seq_len=64, warmup_steps=2, eval_steps=0) if quick else Recipe()
    size = dict(slice_bytes=4096, samples=False) if quick else {}
    rows = {
        kind: train_and_score(kind, kind, {}, recipe, loops_curve=kind == "spider", **size)
        for kind in ("spider", "bytes_only", "llama")
    }
    spider, removed, dense = rows["spider"], rows["bytes_only"], rows["llama"]
    bpb = spider["sotu_bits_per_byte"]
    loops = {int(k): v for k, v in spider["bpb_by_loops"].items()}
    n = spider["n_loops"]
    checks = [
        check(
            "held-out bpb: dense Llama (equal parameters) minus Spider",
            "bits per byte",
            0.0,
            dense["sotu_bits_per_byte"] - bpb,
        ),
        check(
            "held-out bpb: global path removed minus Spider",
            "bits per byte",
            0.10,
            removed["sotu_bits_per_byte"] - bpb,
        ),
        check("held-out bpb: 1 loop minus the trained count", "bits per byte", 0.0, loops[1] - loops[n]),
        check(
            "held-out bpb: twice the trained loops minus the trained count",
            "bits per byte",
            0.01,
            loops[2 * n] - loops[n],
            higher_is_better=False,
        ),
        check(
            "evaluation vs training bytes per segment",
            "relative difference",
            0.25,
            abs(spider["eval_bytes_per_segment"] / spider["train_bytes_per_segment"] - 1),
            higher_is_better=False,
        ),
    ]
    result = {
        "benchmark": "quality",
        "description": "held-out bits per byte: Spider, its byte layers alone, a dense Llama (quality targets)",
        "sizes": {"steps": recipe.steps, "batch": recipe.batch_size, "seq_len": recipe.seq_len},
        "dtype": "fp32",
        "checks": checks,
        "info": [info(f"{kind} held-out bpb", r["sotu_bits_per_byte"], "bits/byte") for kind, r in rows.items()]
        + [info("xz -9e on the slice", spider["xz_bits_per_byte"], "bits/byte")],
        "measurements": rows,
        "notes": [] if not quick else ["quick: 6 steps, not a model measurement"],
    }
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
