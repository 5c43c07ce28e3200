#!/usr/bin/env python3
"""Train Spider: ``accelerate launch --config_file configs/accelerate/single_process.yaml train_hf.py [flags]`` (or
``python train_hf.py``, or the installed ``spider-train`` command).

The run itself -- arguments, data, model, :class:`~spider_training.trainer.SpiderTrainer`, evaluation, sample,
release -- is wired in :mod:`spider_training.train`, so that an installed package carries it without a generic
top-level ``train_hf`` module; ``--help`` lists every flag.
"""

from spider_training.train import cli, main  # noqa: F401  (main: the entry point tests and scripts import)

if __name__ == "__main__":
    cli()  # spider-train's: main, then exit without collecting the libraries' objects first
