"""How much GPU memory training a Spider preset needs, on paper: ``spider-memory-plan`` (or ``python -m
spider_training.commands.memory_plan``) ``[--preset 1b] [--seq_len 2048] [--gpus 8] [--out plan.json] [--markdown]``.

For DDP and FSDP2 over ``--gpus`` GPUs of 80 GB, with AdamW and with 8-bit AdamW, with and without activation
checkpointing: the weights, gradients and optimizer states per GPU, the activations of one ``--seq_len``-byte sequence
in bf16 and the largest micro-batch that fits; and the FLOPs of a training step of one sequence. Nothing runs on a GPU:
the figures come from the preset built on the meta device and CPU forwards at two short lengths, extrapolated
(:mod:`spider_training.memory_plan` says how; about 3 minutes for the 1b preset on 2 cores). Prints the plan as JSON
(without its probes and environment; ``--out`` writes all of it) or, with ``--markdown``, as a table; ``--report
FILE`` reads a written plan back instead of computing one. ``python -m bench.memory_plan`` runs it to fill
docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# torch is imported where a plan is computed: a bad flag, and --report, cost an interpreter start
from spider_training.memory_plan import render

__all__ = ["plan", "main"]


def plan(argv=None) -> dict:
    """The command's work: parse `argv`, compute the plan (or read ``--report``), write ``--out``, print it. Returns
    the plan: :func:`spider_training.memory_plan.run`'s dict plus ``environment``
    (:func:`spider_training.throughput.environment`: versions, threads, CPU). Bad flags, a ``--report`` file that does
    not read as JSON: argparse's error naming it (exit code 2)."""
    parser = argparse.ArgumentParser(
        prog="spider-memory-plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="1b", help="SpiderConfig preset (default 1b)")
    parser.add_argument("--seq_len", type=int, default=2048, help="bytes per training sequence (default 2048)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the weights and optimizer states shard over")
    parser.add_argument("--out", help="write the whole plan (probes and environment included) as JSON here")
    parser.add_argument("--report", help="read a plan written by --out instead of computing one")
    parser.add_argument("--markdown", action="store_true", help="print the plan as a Markdown table")
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.gpus < 1:
        parser.error(f"--seq_len and --gpus must be >= 1, got {args.seq_len} and {args.gpus}")
    if args.report:
        try:
            result = json.loads(Path(args.report).read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--report {args.report}: {e}")
    else:
        from spider_training.memory_plan import run
        from spider_training.throughput import environment

        result = {**run(args.preset, args.seq_len, args.gpus), "environment": environment()}
    if args.out:
        from spider_training.checkpointing import write_json

        write_json(args.out, result)
    if args.markdown:
        print(render(result), end="")
    else:
        print(json.dumps({k: v for k, v in result.items() if k not in ("probes", "environment")}, indent=1))
    return result


def main(argv=None) -> int:
    """``spider-memory-plan``: :func:`plan`; returns the exit code 0."""
    plan(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
