"""Run every Spider benchmark and write one JSON file: ``python -m bench.run_all --out bench/results.json``.

Options: ``--quick`` (toy sizes, about 1.5 minutes on an idle 2-core CPU; what ``tests/test_bench.py`` runs),
``--only moe,train_step`` (a subset), ``--no-profile`` (skip the torch.profiler pass on missed targets).
The JSON (also printed on stdout) is ``{"environment": {...}, "quick": bool, "benchmarks": {name: result},
"summary": {"met": [...], "missed": [...], "errors": [...]}, "seconds": float}``; each result is described in
:mod:`bench.common`. A benchmark that raises is recorded as ``{"benchmark": name, "error": "...", "met": false,
"checks": []}`` and the run goes on. ``torch.compile`` runs last (and in its own subprocess).
Exit code 0 even when targets are missed (they are data, not failures); 1 when a benchmark crashed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python bench/run_all.py` as well as `python -m bench.run_all`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BENCHMARKS = (
    "moe",
    "train_step",
    "mfu",
    "generation",
    "activation_checkpointing",
    "data_pipeline",
    "attention",
    "quality",
    "compile",
)


def run_all(
    quick: bool = False,
    only: list[str] | None = None,
    profile: bool | None = None,
    log=sys.stderr,
    partial_out: str | Path | None = None,
) -> dict:
    """Run the selected benchmarks (all by default) in order; returns the combined result dict.

    ``partial_out``: rewrite this JSON file after every benchmark (so a long run can be watched or cut short).
    Raises ``ValueError`` for an unknown benchmark name in ``only``."""
    names = list(BENCHMARKS) if not only else list(only)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    # imported once the names are known good: bench.common brings in torch, transformers and torchao (~5 s)
    from bench.common import environment, write_json

    start = time.perf_counter()
    out = {"environment": environment(), "quick": quick, "benchmarks": {}}
    for name in names:
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=log, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            result = module.run(quick=quick, profile=profile)
        except Exception as e:  # record and go on: one broken benchmark must not lose the others
            result = {
                "benchmark": name,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
                "met": False,
                "checks": [],
                "seconds": round(time.perf_counter() - t0, 2),
            }
        out["benchmarks"][name] = result
        status = "ERROR" if "error" in result else ("met" if result["met"] else "missed")
        print(f"[bench] {name}: {status} ({result.get('seconds', 0):.1f} s)", file=log, flush=True)
        if partial_out is not None:
            write_json(partial_out, out, indent=2)
    out["summary"] = {
        "met": [n for n, r in out["benchmarks"].items() if r.get("met") and "error" not in r],
        "missed": [n for n, r in out["benchmarks"].items() if not r.get("met") and "error" not in r],
        "errors": [n for n, r in out["benchmarks"].items() if "error" in r],
    }
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results.json", help="JSON output file (default bench/results.json)")
    parser.add_argument("--quick", action="store_true", help="toy sizes (~1.5 min on an idle 2-core CPU)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        default=None,
        help="skip torch.profiler on missed targets",
    )
    args = parser.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result = run_all(quick=args.quick, only=only, profile=args.profile, partial_out=args.out)
    except ValueError as e:
        parser.error(str(e))
    from bench.common import write_json

    write_json(args.out, result, indent=2)
    print(json.dumps(result, indent=2))
    print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 1 if result["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
