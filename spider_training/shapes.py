"""Micro-batch shapes as the commands take them (``BATCHxBYTES``), without importing torch: a command that parses its
flags before it imports the models refuses a bad one in an interpreter start (``python -m bench.gpu_check``,
``spider-measure-fp8-gemms``)."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_BATCHES", "parse_batch"]

#: (batch, bytes) per micro-batch: the step table's shapes and tk-train.py's recipe (``spider-measure-fp8-gemms``'
#: default ``--batches``)
DEFAULT_BATCHES = ((8, 2048), (32, 256), (112, 256))


def parse_batch(text: str) -> tuple[int, int]:
    """``"32x256"`` -> ``(32, 256)``: a micro-batch, BATCHxBYTES (batch >= 1, bytes >= 2), else argparse's error."""
    try:
        batch, length = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxBYTES such as 32x256, got {text!r}") from None
    if batch < 1 or length < 2:
        raise argparse.ArgumentTypeError(f"batch must be >= 1 and bytes >= 2, got {text!r}")
    return batch, length
