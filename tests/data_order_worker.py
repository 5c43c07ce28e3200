"""One process of a ``train_hf.py`` run that records the windows it trains on: the worker of
``tests/test_data_processes.py`` (``torchrun --standalone --nproc_per_node 2 -m tests.data_order_worker RECORD_DIR
<train_hf.py arguments>``).

It runs ``train_hf.py``'s entry point (:func:`spider_training.train.main`) unchanged, with two observers installed on
the library's own functions before it starts: ``SpiderTrainer.training_step`` records each micro-batch's
``input_ids`` with the global step it belongs to, and the byte cache's encoder
(``spider_training.data.cache._build``) counts how often this process encoded a source. At the end it writes
``RECORD_DIR/rank<RANK>.json``: ``{"rank", "world_size", "steps": [[global_step, input_ids as nested lists], ...],
"encoded": count}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    """Run ``train_hf.py`` with ``argv[1:]``, recording into folder ``argv[0]`` (see the module docstring)."""
    record_dir, train_args = Path(argv[0]), argv[1:]
    from spider_training import train
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
    train.main(train_args)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    record_dir.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": world_size, "steps": seen, "encoded": len(encoded)}
    (record_dir / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
