#!/usr/bin/env python3
"""Train Spider: ``accelerate launch --config_file configs/accelerate/single_process.yaml train_hf.py [flags]`` (or
``python train_hf.py``, or the installed ``spider-train`` command).

The run itself -- arguments, data, model, :class:`~spider_training.trainer.SpiderTrainer`, evaluation, sample,
release -- is wired in :mod:`spider_training.train`, so that an installed package carries it without a generic
top-level ``train_hf`` module; ``--help`` lists every flag.
"""

from spider_training.train import main, skip_final_collection

if __name__ == "__main__":
    main()
    skip_final_collection()  # the process exits at once, without collecting the libraries' objects first
