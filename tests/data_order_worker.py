"""One process of ``train_hf.py`` runs that records the windows each run trains on: the worker of
``tests/test_data_processes.py`` (``torchrun --standalone --nproc_per_node 2 -m tests.data_order_worker PLAN.json``).

``PLAN.json`` lists runs, ``[{"record_dir": ..., "datasets_cache": ..., "args": [<train_hf.py arguments>]}, ...]``;
the process runs them one after the other (one interpreter start and one process group for several runs: importing
the training libraries costs several times a tiny run on a 2-core machine). Each run is ``train_hf.py``'s entry point
(:func:`spider_training.train.main`) unchanged, with two observers installed on the library's own functions before
the first starts: ``SpiderTrainer.training_step`` records each micro-batch's ``input_ids`` with the global step it
belongs to, and the byte cache's encoder (``spider_training.data.cache._build``) counts how often this process encoded
a source. Before a run, ``datasets``' cache folder (where the byte cache lives: ``<HF_DATASETS_CACHE>/spider_bytes``)
is set to the run's ``datasets_cache``, as ``HF_DATASETS_CACHE`` would set it in a process of its own.

For every run it writes ``<record_dir>/rank<RANK>.json``: ``{"rank", "world_size", "steps": [[global_step, input_ids
as nested lists], ...], "encoded": count}``, and ``<record_dir>/rank<RANK>.log``: the process's output (stdout and
stderr) during that run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path


class _OutputTo:
    """Inside the ``with`` block this process's stdout and stderr go to the file `path` (the file descriptors are
    redirected, so C code and logging handlers holding ``sys.stderr`` follow)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        log = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd in (1, 2):
            os.dup2(log, fd)
        os.close(log)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        return False


def main(argv: list[str]) -> None:
    """Run the runs of the plan ``argv[0]`` (see the module docstring)."""
    plan = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    from spider_training import train  # first, as in train_hf.py (it imports some libraries quietly)
    from spider_training.data import cache
    from spider_training.trainer import SpiderTrainer

    seen: list = []
    encoded: list = []
    training_step, build = SpiderTrainer.training_step, cache._build

    def recording_step(self, model, inputs, num_items_in_batch=None):
        seen.append([self.state.global_step, inputs["input_ids"].tolist()])
        return training_step(self, model, inputs, num_items_in_batch)

    def counted_build(*args, **kwargs):
        encoded.append(1)
        return build(*args, **kwargs)

    SpiderTrainer.training_step = recording_step
    cache._build = counted_build
    import datasets.config  # where the byte cache's default folder is read (after train: see the first import)

    # the imports' objects out of the garbage collector's reach: Trainer starts every train() with a full collection
    # (~0.4 s over them each time, in each process); what the runs make is collected as before
    gc.freeze()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for run in plan:
        seen.clear()
        encoded.clear()
        record_dir = Path(run["record_dir"])
        record_dir.mkdir(parents=True, exist_ok=True)
        os.environ["HF_DATASETS_CACHE"] = run["datasets_cache"]
        datasets.config.HF_DATASETS_CACHE = Path(run["datasets_cache"])
        with _OutputTo(record_dir / f"rank{rank}.log"):
            train.main(run["args"])
        record = {"rank": rank, "world_size": world_size, "steps": seen, "encoded": len(encoded)}
        (record_dir / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
