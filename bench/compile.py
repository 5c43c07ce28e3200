"""Benchmark 7 -- ``--compile``: does the model compile and train, and how much faster is a steady-state step?

Runs in a **fresh subprocess** (``python -m bench.compile --child``) with a wall-clock ``timeout`` so that a slow or
hanging compilation cannot stall the whole run, and so dynamo/inductor state does not leak into the other
benchmarks. In the child: two Spider models with the same weights (preset ``preset``), one eager, one compiled as
``--compile`` compiles it (``spider_training.compile.compile_model``: accelerate's ``compile_regions`` with dynamic
shapes), each layer and submodule a region of its own, the loops and the data-dependent segment count (FlexiTokens) in eager Python between them. Each trains with its own AdamW on the same
random byte batch. Compile time = wall time of the compiled model's first ``compile_steps`` steps (they include the
recompilations for the changing segment count) minus the same number of eager steps. Then both run ``repeats``
interleaved steps; speedup = median eager step / median compiled step.

Targets: ``speedup >= 1.0`` (compiling must not slow training down), and no graph compiled after the first
``compile_steps`` steps although the segment count changes between steps (``graphs_compiled_after_first_steps``:
the regions compile with dynamic shapes; an inductor lowering that fixed a size recompiled at every new count). The graphs each first step compiled are recorded too (``graphs_compiled_in_first_steps``). At these sizes
the few segment counts a batch meets mostly appear within the first steps, so the count after them guards the
steady state; tests/test_compile.py checks that a new count compiles nothing. ``eager_aten_ops_per_step`` counts the
aten ops each model runs eagerly in one profiled forward+backward (:func:`bench.common.eager_aten_ops`): all of the
eager model's, and the compiled model's glue between its regions (each a kernel launch from Python on a GPU). A
compile failure or timeout is recorded under ``"error"`` with ``met: false`` instead of crashing the run. ``--quick``
uses the ``tiny`` preset and dynamo's
``"eager"`` backend (graph capture only, no code generation) -- it checks the machinery, not inductor's speed.

Run alone: ``python -m bench.compile [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.common import REPO_ROOT, check, finish, info, main_for
from spider_training.compile import COMPILE_OPTIONS

TARGET = 1.0
FULL = dict(preset="tiny", batch=8, seq_len=256, backend="inductor", compile_steps=3, warmup=2,
            repeats=5, timeout=420)
QUICK = dict(preset="tiny", batch=1, seq_len=32, backend="eager", compile_steps=2, warmup=1, repeats=2,
             timeout=240)


def child(preset: str, batch: int, seq_len: int, backend: str, compile_steps: int,
          warmup: int, repeats: int) -> dict:
    """Measure in this process (see the module docstring); returns a JSON-able dict."""
    from torch.profiler import ProfilerActivity, profile

    from bench.common import (TrainStep, eager_aten_ops, graphs_compiled, random_bytes, spider_model, time_call,
                              time_interleaved)

    ids = random_bytes(batch, seq_len)
    eager_model, compiled_model = spider_model(preset), spider_model(preset)
    eager = TrainStep(eager_model, ids)
    from spider_training.compile import compile_model

    compiled = TrainStep(compile_model(compiled_model, backend=backend), ids)
    first, first_graphs = [], []
    for _ in range(compile_steps):
        seconds, graphs = graphs_compiled(lambda: time_call(compiled))
        first.append(seconds)
        first_graphs.append(graphs)
    eager_first = [time_call(eager) for _ in range(compile_steps)]
    # the steady state: every later step's segment count reuses a graph (an inductor lowering that fixes a size
    # would recompile here: Engram's nn.Conv1d did, once per new count)
    timed, later_graphs = graphs_compiled(lambda: time_interleaved({"eager": eager, "compiled": compiled}, warmup,
                                                                    repeats))
    from torch._dynamo.utils import counters as dynamo_counters  # read by graphs_compiled above too

    counters = {"unique_graphs": int(dynamo_counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(dynamo_counters["graph_break"].values()))}
    eager_ops = {}
    for name, step in (("eager", eager), ("compiled", compiled)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step.forward_backward()  # the optimizer's ops are the same for both
        step.model.zero_grad(set_to_none=True)
        eager_ops[name] = eager_aten_ops(prof.events())
    return {
        "compile_s": sum(first) - sum(eager_first),
        "first_compiled_steps_s": [round(t, 3) for t in first],
        "median_s": {k: v["median_s"] for k, v in timed.items()},
        "times_s": {k: v["times_s"] for k, v in timed.items()},
        "dynamo": counters,
        "graphs_compiled_in_first_steps": first_graphs,
        "graphs_compiled_after_first_steps": later_graphs,
        "eager_aten_ops_per_step": eager_ops,
    }


def measure_in_subprocess(s: dict) -> dict:
    """Run :func:`child` in a fresh interpreter with ``s["timeout"]``; returns its dict or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "bench.compile", "--child", json.dumps(
        {k: s[k] for k in ("preset", "batch", "seq_len", "backend", "compile_steps", "warmup", "repeats")})]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=s["timeout"])
    except subprocess.TimeoutExpired:
        return {"error": f"timeout: compile + {s['compile_steps'] + s['warmup'] + s['repeats']} steps took more "
                         f"than {s['timeout']} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = [l for l in proc.stderr.splitlines() if l.strip()][-15:]
        return {"error": f"exit code {proc.returncode}: " + "\n".join(tail)}
    return json.loads(lines[-1])


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict (never raises
    for a compile failure: the error is recorded)."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    m = measure_in_subprocess(s)
    result = {
        "benchmark": "compile",
        "description": "--compile (accelerate compile_regions) steady-state training step speedup over eager",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len")},
        "dtype": "fp32",
        "backend": s["backend"],
        "compile_options": COMPILE_OPTIONS,
        "timing": {"compile_steps": s["compile_steps"], "warmup": s["warmup"], "repeats": s["repeats"],
                   "statistic": "median", "timeout_s": s["timeout"]},
        "notes": [],
    }
    if "error" in m:
        result.update(error=m["error"], measurements={}, info=[],
                      checks=[check("--compile (regional) step speedup", "eager time / compiled time", TARGET, None)])
        result["notes"].append("compile failed or timed out; see error")
        return finish(result, start)
    speedup = m["median_s"]["eager"] / m["median_s"]["compiled"]
    result["measurements"] = {
        "compile_s": round(m["compile_s"], 3),
        "first_compiled_steps_s": m["first_compiled_steps_s"],
        "median_step_s": {k: round(v, 5) for k, v in m["median_s"].items()},
        "times_s": m["times_s"],
        "dynamo": m["dynamo"],
    }
    for key in ("graphs_compiled_in_first_steps", "graphs_compiled_after_first_steps", "eager_aten_ops_per_step"):
        result["measurements"][key] = m[key]
    result["checks"] = [check("--compile (regional) step speedup", "eager time / compiled time", TARGET, speedup),
                        check("graphs compiled after the first steps", "count over the warm-up and timed steps",
                              0, m["graphs_compiled_after_first_steps"], higher_is_better=False)]
    result["info"] = [info(f"--compile ({s['backend']}, regional) compile time", m["compile_s"], "s")]
    return finish(result, start)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        print(json.dumps(child(**json.loads(sys.argv[2]))))
    else:
        main_for(run)
