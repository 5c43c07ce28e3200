"""Studies of the model (experiments/README.md): trainings of many rows, hours long, rendered into docs/results.md.

    python -m experiments.quality --suite --shard 0/2 --threads 1 --out q0.json   # the Model quality tables' rows
    python -m experiments.quality --report q0.json q1.json --write_results docs/results.md --plot docs/quality.png

The benchmarks (speed, memory, minutes) are bench/'s.
"""
