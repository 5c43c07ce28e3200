"""Spider's performance benchmarks: one module per benchmark, one runner for all of them.

Run everything (writes and prints one JSON file)::

    python -m bench.run_all --out bench/results.json          # full sizes, <= ~10 min on a 2-core CPU
    python -m bench.run_all --quick --out /tmp/bench.json     # toy sizes, ~1 min (what tests/test_bench.py runs)
    python -m bench.moe --quick                               # one benchmark alone
    python -m bench.report bench/results.json                 # the "Performance on CPU" section of docs/results.md

Every figure is a ratio of two variants measured side by side in one process, on this machine (see
:mod:`bench.common` for the timing rules). See bench/README.md.
"""
