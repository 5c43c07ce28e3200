"""Deprecated name of :mod:`spider_training.commands.convert_tk_train`, kept until 0.3.0 so that ``python -m
spider_training.convert_seed`` and imports from here keep working (with a warning); listed in
:mod:`spider_training.compatibility`. Use ``spider-convert-tk-train``."""

import sys
import warnings

from .commands.convert_tk_train import *  # noqa: F401,F403
from .commands.convert_tk_train import (  # noqa: F401
    TK_TRAIN_KEY_MAPPING as SEED_KEY_MAPPING,
    convert_tk_train_checkpoint as convert_seed_checkpoint,
    load_tk_train_checkpoint as load_seed_checkpoint,
    main,
    tk_train_to_spider_name as seed_to_spider_name,
)

warnings.warn(
    "spider_training.convert_seed is deprecated; use spider_training.commands.convert_tk_train (removed in 0.3.0)",
    FutureWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    sys.exit(main())
