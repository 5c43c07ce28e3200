"""Issue 67, two processes on CPU (``torchrun --nproc_per_node 2 train_hf.py --use_cpu``): a local text corpus is
encoded once into the byte cache and the ranks' windows are disjoint and follow one process's global order; a
streamed corpus is split between the ranks (disjoint parts) and a two-process resume continues each rank's stream
exactly.

Each run is ``train_hf.py``'s entry point under ``torchrun`` (gloo), recording what every rank trained on
(:mod:`tests.data_order_worker`). Two launches carry all the runs (each process runs its launch's runs one after the
other: an interpreter start with the training libraries costs more than a tiny run): the first the byte-cache run
and the uninterrupted streamed runs (0 and 2 dataloader workers), the second, in fresh processes as a restart is,
the streamed runs resumed from their checkpoints. The one-process order is Trainer's own loader for the same
arguments, built in this process (``build_trainer(...).get_train_dataloader()``: what a one-process ``train_hf.py``
iterates).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

from spider_training import data as D
from tests.helpers import REPO

SEQ_LEN = 32
MICRO_BATCH = 2


def write_corpus(folder: Path, files: int = 2, per_file: int = 60) -> Path:
    """`files` JSON Lines files of `per_file` documents of seeded random letters, 20-80 bytes each (about 90 windows
    of 33 bytes per file, all distinct)."""
    folder.mkdir(parents=True, exist_ok=True)
    draw = random.Random(0)
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w", encoding="utf-8") as handle:
            for _ in range(per_file):
                text = "".join(draw.choices(string.ascii_letters + " ", k=draw.randint(20, 80)))
                handle.write(json.dumps({"text": text}) + "\n")
    return folder


def train_args(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    """``train_hf.py``'s arguments of these runs (tiny preset, no held-out data, no sample)."""
    return [
        "--preset",
        "tiny",
        "--data",
        str(corpus),
        "--seq_len",
        str(SEQ_LEN),
        "--micro_batch",
        str(MICRO_BATCH),
        "--sample_bytes",
        "0",
        "--logging_steps",
        "1",
        "--ckpt_dir",
        str(output_dir),
        "--use_cpu",
        "--precision",
        "fp32",
        *extra,
    ]


def run_two_processes(tmp_path: Path, runs: list[dict]) -> list[dict]:
    """One ``torchrun --standalone --nproc_per_node 2`` of :mod:`tests.data_order_worker` running `runs` one after the
    other (``{"record_dir", "datasets_cache", "args"}`` each: ``train_hf.py``'s arguments, the run's
    ``HF_DATASETS_CACHE``); per run, each rank's record (``{rank: {"steps": [[step, input_ids], ...], "encoded":
    n}}``) and the run's combined output under ``"log"``."""
    plan = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*.json')))}.json"
    plan.write_text(json.dumps([{**run, "datasets_cache": str(run["datasets_cache"])} for run in runs]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(runs[0]["datasets_cache"])
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tests.data_order_worker", str(plan)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    logs = {
        f"{run['record_dir']}/rank{r}.log": Path(run["record_dir"], f"rank{r}.log").read_text(errors="replace")
        for run in runs
        for r in range(2)
        if Path(run["record_dir"], f"rank{r}.log").is_file()
    }
    assert result.returncode == 0, (
        result.stdout[-3000:],
        result.stderr[-6000:],
        {k: v[-3000:] for k, v in logs.items()},
    )
    out = []
    for run in runs:
        record_dir = Path(run["record_dir"])
        records = {r: json.loads((record_dir / f"rank{r}.json").read_text()) for r in range(2)}
        assert all(records[r]["world_size"] == 2 for r in range(2))
        out.append({**records, "log": "".join(logs[f"{record_dir}/rank{r}.log"] for r in range(2))})
    return out


def windows(record: dict, first_step: int = 0) -> list[tuple[int, ...]]:
    """The windows of a rank's record from `first_step` on, in the order trained."""
    return [tuple(row) for step, batch in record["steps"] if step >= first_step for row in batch]


def cache_entries(datasets_cache: Path) -> list[Path]:
    """The complete entries of the byte cache under `datasets_cache` (folders holding a metadata.json)."""
    return [p.parent for p in (datasets_cache / "spider_bytes").glob("*/metadata.json")]


STEPS_ENCODED = 4  # the byte-cache run
STEPS_STREAMED, CHECKPOINT = 6, 3  # the streamed runs, resumed from checkpoint-3
WORKERS = (0, 2)  # dataloader workers of the streamed runs


def stream_args(workers: int) -> list[str]:
    return ["--streaming", "--shuffle_buffer", "16", "--seed", "4", "--dataloader_num_workers", str(workers)]


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory) -> dict:
    """One two-process launch running, one after the other, the byte-cache run (``"encoded"``) and the uninterrupted
    streamed run with each number of dataloader workers (``workers``: 0 and 2), each into its own output and
    datasets-cache folder; the records of each and the folders (``"tmp"``, ``"corpus"``, ``"streamed_args"``)."""
    tmp = tmp_path_factory.mktemp("data_processes")
    corpus = write_corpus(tmp / "corpus")
    encoded = train_args(corpus, tmp / "two", "--max_steps", str(STEPS_ENCODED), "--save_steps", str(STEPS_ENCODED))
    streamed = {
        w: train_args(
            corpus,
            tmp / f"run{w}",
            *stream_args(w),
            "--max_steps",
            str(STEPS_STREAMED),
            "--save_steps",
            str(CHECKPOINT),
        )
        for w in WORKERS
    }
    runs = [{"record_dir": str(tmp / "record"), "datasets_cache": tmp / "datasets-two", "args": encoded}]
    runs += [
        {"record_dir": str(tmp / f"full{w}"), "datasets_cache": tmp / f"datasets{w}", "args": streamed[w]}
        for w in WORKERS
    ]
    records = run_two_processes(tmp, runs)
    return {
        "encoded": records[0],
        **dict(zip(WORKERS, records[1:])),
        "tmp": tmp,
        "corpus": corpus,
        "streamed_args": streamed,
    }


@pytest.fixture(scope="module")
def resumed_launch(first_launch) -> dict:
    """One two-process launch resuming each streamed run of `first_launch` from checkpoint-3 (its newest once
    checkpoint-6 is deleted), with the same command: ``{workers: records}``."""
    tmp = first_launch["tmp"]
    runs = []
    for w in WORKERS:
        shutil.rmtree(tmp / f"run{w}" / f"checkpoint-{STEPS_STREAMED}")  # checkpoint-3 is now the newest
        runs.append(
            {
                "record_dir": str(tmp / f"resumed{w}"),
                "datasets_cache": tmp / f"datasets{w}",
                "args": first_launch["streamed_args"][w],
            }
        )
    return dict(zip(WORKERS, run_two_processes(tmp, runs)))


@pytest.mark.slow
def test_two_processes_encode_once_and_split_one_processs_order(first_launch, tmp_path, monkeypatch):
    """Byte cache: the two ranks encode the corpus once (one rank encodes, the other waits and maps the same entry);
    at step s rank r trains on micro-batch 2s + r of the shuffled order one process iterates with two accumulation
    steps (accelerate's split of Trainer's seeded sampler), so the ranks' windows are disjoint and together are one
    process's first windows in order."""
    from spider_training.arguments import parse_args
    from spider_training.train import build_trainer
    from tests.helpers import tiny_model

    corpus, steps = first_launch["corpus"], STEPS_ENCODED
    two = first_launch["encoded"]
    assert two[0]["encoded"] + two[1]["encoded"] == 1, (two[0]["encoded"], two[1]["encoded"])
    assert len(cache_entries(first_launch["tmp"] / "datasets-two")) == 1

    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-one")
    one_args = parse_args(
        train_args(corpus, tmp_path / "one", "--max_steps", str(steps), "--grad_accum", "2", "--save_steps", "9")
    )
    trainer = build_trainer(one_args, tiny_model())
    assert isinstance(trainer.train_dataset, D.TextByteDataset)
    one = []
    for batch in trainer.get_train_dataloader():
        one += [tuple(row) for row in batch["input_ids"].tolist()]
        if len(one) == steps * 2 * MICRO_BATCH:
            break
    assert len(trainer.train_dataset) > len(one)  # the runs stay within one epoch

    ranks = [windows(two[r]) for r in range(2)]
    assert [len(w) for w in ranks] == [steps * MICRO_BATCH] * 2
    assert not set(ranks[0]) & set(ranks[1])  # disjoint (the corpus's windows are all distinct)
    interleaved = [
        w for s in range(steps) for r in range(2) for w in ranks[r][s * MICRO_BATCH : (s + 1) * MICRO_BATCH]
    ]
    assert interleaved == one
    assert one != sorted(one)  # the order is the sampler's shuffle, not the corpus's


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
def test_two_processes_stream_disjoint_parts_and_resume_them(first_launch, resumed_launch, workers):
    """--streaming on two files: each rank reads its own file (split_dataset_by_node), so the ranks' windows are
    disjoint and each is the first windows of the library's stream for that rank (with 2 dataloader workers, taken
    every other window by each worker, a batch each in turn); a two-process run resumed from a checkpoint continues
    every rank's stream (with 2 dataloader workers: every worker's part) from its saved position with the windows
    the uninterrupted run trained on."""
    corpus, steps, checkpoint = first_launch["corpus"], STEPS_STREAMED, CHECKPOINT
    full = first_launch[workers]
    assert full[0]["encoded"] == full[1]["encoded"] == 0 and not cache_entries(
        first_launch["tmp"] / f"datasets{workers}"
    )
    ranks = [windows(full[r]) for r in range(2)]
    assert [len(w) for w in ranks] == [steps * MICRO_BATCH] * 2
    assert not set(ranks[0]) & set(ranks[1])
    for rank in range(2):
        stream = D.build_dataset(
            str(corpus), SEQ_LEN, stream=True, rank=rank, world_size=2, shuffle=True, shuffle_buffer=16, seed=4
        )
        assert stream.source.num_shards == 1  # one file per rank
        expected = [tuple(w.tolist()) for w in stream.iter_windows()]
        if workers:  # worker w takes windows w, w + 2, ... of the rank's stream; the workers give a batch in turn
            parts = [expected[w::workers] for w in range(workers)]
            expected = [
                x for j in range(steps) for part in parts for x in part[j * MICRO_BATCH : (j + 1) * MICRO_BATCH]
            ]
        assert ranks[rank] == expected[: len(ranks[rank])]

    resumed = resumed_launch[workers]  # the same command once checkpoint-6 was deleted: it resumed checkpoint-3
    assert "saved position; nothing replayed" in resumed["log"]
    for rank in range(2):
        assert {step for step, _ in resumed[rank]["steps"]} == set(range(checkpoint, steps))
        assert windows(resumed[rank]) == windows(full[rank], checkpoint)
