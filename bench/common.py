"""Shared pieces of the benchmarks: timing, environment record, model builders, profiling, results (FLOP counting and
the matmul peak: :mod:`spider_training.throughput`, what the trainer logs).

What its entries and fields mean: bench/README.md, "Module notes", `common.py`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spider_training.checkpointing import write_json  # the one atomic JSON writer; bench's runners write with it
from spider_training.throughput import environment

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/moe.py` and `python -m bench.moe` both import the model files
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------------------------------------------------
# Environment and results
# ---------------------------------------------------------------------------------------------------------------------


def run_child(module: str, kwargs: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """``python -m <module> --child <kwargs as JSON>`` in a fresh interpreter on this checkout (its root the working
    directory and first on ``PYTHONPATH``; `env` on top of this process's environment), whose ``__main__`` calls its
    child function with `kwargs` (:func:`main_for`'s `child`): the JSON its last printed line holds. Raises
    ``RuntimeError`` with the exit code and the tail of its stderr if it fails or prints nothing,
    ``subprocess.TimeoutExpired`` after `timeout` seconds. What the benchmarks measure in a fresh process (peak memory,
    a cold compile, a loader's start) runs through it."""
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(kwargs)],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"python -m {module} failed with exit code {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def check(name: str, metric: str, target: float, measured: float | None, higher_is_better: bool = True) -> dict:
    """One target line: ``met`` is ``measured >= target`` (or ``<=`` when lower is better), judged on the recorded
    (rounded to 4 decimals) value so that the record agrees with itself; None -> not met."""
    measured = None if measured is None else float(round(measured, 4))
    met = measured is not None and bool(measured >= target if higher_is_better else measured <= target)
    return {
        "name": name,
        "metric": metric,
        "target": target,
        "comparison": ">=" if higher_is_better else "<=",
        "measured": measured,
        "met": met,
    }


def info(name: str, measured: float | None, unit: str) -> dict:
    """A reported figure without a target (shown in the report table with target "-")."""
    return {"name": name, "measured": None if measured is None else float(round(measured, 4)), "unit": unit}


def finish(result: dict, start: float) -> dict:
    """Fill ``met`` (all checks met, unless already set) and the wall time of the benchmark."""
    result.setdefault("met", bool(result["checks"]) and all(c["met"] for c in result["checks"]))
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (wall clock, ``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Time several variants side by side.

    Each variant is warmed up ``warmup`` times, then the variants run in turn ``repeats`` rounds. Returns
    ``{name: {"median_s": float, "times_s": [float]}}``. Raises ``ValueError`` if ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn))
    return {
        name: {"median_s": statistics.median(ts), "times_s": [round(t, 5) for t in ts]} for name, ts in times.items()
    }


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def spider_config(preset: str, **overrides):
    """``SpiderConfig.from_preset(preset, **overrides)``; ``"proxy_1b"``: the 1b preset's depth and loops at the tiny
    preset's widths (:func:`spider_training.profiling.proxy_1b_config`), the 1b structure on a CPU."""
    if preset == "proxy_1b":
        from spider_training.profiling import proxy_1b_config

        return proxy_1b_config(**overrides)
    from configuration_spider import SpiderConfig

    return SpiderConfig.from_preset(preset, **overrides)


def spider_model(preset: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A freshly initialised ``SpiderForConditionalGeneration`` of :func:`spider_config` (seeded), in ``dtype``."""
    from modeling_spider import SpiderForConditionalGeneration

    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(spider_config(preset, **overrides)).to(dtype)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_bytes(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    """int64 ``(batch, length)`` ids drawn uniformly from the 256 byte values (no specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


def trainer_steps(
    model, ids: torch.LongTensor, n_loops: int | None, warmup: int, repeats: int, peak: float | None = None
) -> dict:
    """``warmup + repeats`` optimizer steps of `model` on the one batch `ids` (int64 ``(batch, seq_len)``) through
    :class:`~spider_training.trainer.SpiderTrainer` on the CPU (what ``spider-train`` runs there: AdamW at 1e-4,
    fp32, gradient clipping, the trainer's loss terms), logging every step, each step timed by
    :class:`~spider_training.step_times.StepTimes`. `peak`: the FLOP/s the trainer's MFU is against (None: its own,
    :func:`spider_training.throughput.peak_flops`). Returns ``{"median_s", "times_s": the timed steps' seconds,
    "logs": their logged entries (``tokens_per_second``, ``flops_per_step``, ``tflops_per_second``, ``mfu``, ...),
    "trainer"}``."""
    from transformers import PrinterCallback

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.step_times import StepTimes
    from spider_training.train import build_trainer

    clock, rows = StepTimes(), [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory(prefix="bench-trainer-steps-") as output_dir:  # nothing is saved there
        args = SpiderTrainingArguments(
            output_dir=output_dir,
            use_cpu=True,  # bench measures this CPU in fp32 (gpu_check measures GPUs)
            precision="fp32",
            report_to="none",
            save_strategy="no",
            max_steps=warmup + repeats,
            per_device_train_batch_size=len(ids),
            learning_rate=1e-4,
            n_loops=n_loops,
            logging_steps=1,
            disable_tqdm=True,
        )
        trainer = build_trainer(args, model, train_dataset=rows, eval_dataset=None, callbacks=[clock], stop_signals=())
        trainer.remove_callback(PrinterCallback)
        if peak is not None:
            trainer.throughput.peak, trainer.throughput.peak_source = peak, "given"
        trainer.train()
    times = clock.step_times[warmup:]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and entry["step"] > warmup]
    return {
        "median_s": statistics.median(times),
        "times_s": [round(t, 5) for t in times],
        "logs": logs,
        "trainer": trainer,
    }


class TrainStep:
    """One training step as the trainer does it: ``model.train()``, forward with labels (the experts in the autocast
    dtype, their weight casts shared across the loops: :mod:`spider_training.mixed_precision`), backward, AdamW step,
    ``zero_grad``. ``forward_kwargs`` go to every forward (e.g. ``n_loops``). Callable with no arguments; the two
    halves are :meth:`forward_backward` and :meth:`optimizer_step`.

    `autocast_dtype` (e.g. ``torch.bfloat16``): the forward under ``torch.autocast`` on the inputs' device (None:
    none). `fused`: torch's fused AdamW (CUDA)."""

    def __init__(
        self,
        model,
        input_ids: torch.LongTensor,
        lr: float = 1e-4,
        *,
        autocast_dtype: torch.dtype | None = None,
        fused: bool = False,
        **forward_kwargs,
    ):
        self.model = model
        self.input_ids = input_ids
        self.forward_kwargs = forward_kwargs
        self.autocast_dtype = autocast_dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
        self.model.train()
        from spider_training.mixed_precision import autocast_experts  # the models' imports: not at bench.common's

        autocast_experts(model)

    def forward_backward(self):
        """Forward with labels and backward; returns the model output. Each call begins a new CUDA graph generation
        (``torch.compiler.cudagraph_mark_step_begin``, as ``SpiderTrainer.training_step`` does under
        ``reduce-overhead``): the compiled layers' forwards all run before their backwards."""
        from spider_training.mixed_precision import shared_weight_casts

        torch.compiler.cudagraph_mark_step_begin()
        autocast = (
            torch.autocast(self.input_ids.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast, shared_weight_casts():
            out = self.model(input_ids=self.input_ids, labels=self.input_ids, **self.forward_kwargs)
        out.loss.backward()
        return out

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self):
        out = self.forward_backward()
        self.optimizer_step()
        return out


# ---------------------------------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------------------------------


def profile_top(fn: Callable[[], Any], steps: int = 2, top: int = 12) -> dict[str, Any]:
    """Profile ``steps`` calls of ``fn`` with ``torch.profiler`` (CPU) and return the top ops by self CPU time.

    Returns ``{"steps": int, "total_self_cpu_ms": float, "top": [{"op", "self_cpu_pct", "self_cpu_ms", "calls"}]}``
    (percent of the summed self CPU time of all ops in the profile)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": steps,
        "total_self_cpu_ms": round(total_us / 1e3, 2),
        "top": [
            {
                "op": e.key,
                "self_cpu_pct": round(100.0 * e.self_cpu_time_total / total_us, 2),
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                "calls": int(e.count),
            }
            for e in rows
        ],
    }


# ---------------------------------------------------------------------------------------------------------------------
# Command line of a single benchmark
# ---------------------------------------------------------------------------------------------------------------------


def main_for(run: Callable[..., dict], argv: list[str] | None = None, child: Callable | None = None) -> dict:
    """``python -m bench.<name> [--quick] [--out FILE]``: run one benchmark, print (and write) its JSON. With
    ``--child JSON`` (a fresh interpreter :func:`run_child` started), print ``child(**JSON)``'s JSON instead."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if child is not None and argv[:1] == ["--child"]:
        result = child(**json.loads(argv[1]))
        print(json.dumps(result))
        return result

    parser = argparse.ArgumentParser(description=(run.__module__ or "").split(".")[-1] + " benchmark")
    parser.add_argument("--quick", action="store_true", help="toy sizes (seconds, not minutes)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = {"environment": environment(), "quick": args.quick, "benchmarks": {}}
    single = run(quick=args.quick)
    result["benchmarks"][single["benchmark"]] = single
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result, indent=2)
    return result
