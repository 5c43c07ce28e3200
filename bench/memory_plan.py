"""``python -m bench.memory_plan [spider-memory-plan's flags] [--write_results docs/results.md]``: the memory plan of a
preset (``spider-memory-plan``, :mod:`spider_training.commands.memory_plan`), its table written into the memory-plan
block of docs/results.md. ``--out bench/memory_plan.json --write_results docs/results.md`` refreshes both (about 3
minutes for the 1b preset on 2 cores); ``--report bench/memory_plan.json --write_results docs/results.md`` renders the
saved plan again.
"""

from __future__ import annotations

import argparse

from bench.report import write_block
from spider_training.commands.memory_plan import plan
from spider_training.memory_plan import render

MARKERS = ("<!-- memory_plan:start -->", "<!-- memory_plan:end -->")  # the block in docs/results.md


def main(argv=None) -> dict:
    """Run ``spider-memory-plan`` with the other flags; with ``--write_results``, replace that file's memory-plan
    block (:data:`MARKERS`) with the table. Returns the plan. Raises ``ValueError`` naming the file if it has no such
    block."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write_results", help="fill the memory-plan block of this file (docs/results.md)")
    args, rest = parser.parse_known_args(argv)
    result = plan(rest)
    if args.write_results:
        write_block(args.write_results, render(result), *MARKERS)
    return result


if __name__ == "__main__":
    main()
