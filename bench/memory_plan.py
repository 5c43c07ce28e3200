"""``python -m bench.memory_plan``: the memory plan of a Spider preset on 8 GPUs, on paper
(:mod:`spider_training.memory_plan` computes it and says how), printed as JSON and written into docs/results.md.

Usage: ``python -m bench.memory_plan [--preset 1b] [--seq_len 2048] [--gpus 8] [--out F.json]
[--write_results docs/results.md]`` (about 3 minutes for the 1b preset on 2 cores; prints one JSON result);
``--report F.json`` renders a saved result instead of measuring.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import environment, write_json
from bench.report import write_block
from spider_training.memory_plan import render, run

MARKERS = ("<!-- memory_plan:start -->", "<!-- memory_plan:end -->")  # the block in docs/results.md


def write_results(result: dict, path: Path) -> None:
    """Replace the memory-plan block (:data:`MARKERS`) of ``path`` (docs/results.md) with :func:`render`'s table.
    Raises ``ValueError`` naming the file if it has no such block."""
    write_block(path, render(result), *MARKERS)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--report", help="render a saved result instead of measuring")
    parser.add_argument("--write_results", help="fill the memory-plan block of this file (docs/results.md)")
    args = parser.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
    else:
        result = {**run(args.preset, args.seq_len, args.gpus), "environment": environment()}
    if args.out:
        write_json(args.out, result)
    if args.write_results:
        write_results(result, Path(args.write_results))
    print(json.dumps({k: v for k, v in result.items() if k not in ("probes", "environment")}, indent=1))
    return result


if __name__ == "__main__":
    main()
