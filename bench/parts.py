"""The frame every part of ``python -m bench.gpu_check`` runs in: its JSON entry, its device, its time budget
(:class:`Deadline`, the hard limit :func:`hard_limit`), building its models on the device, and running the checks
that are tests (:func:`run_tests`: ``tests/test_gpu.py``, ``tests/test_training_runs.py``) into entries.

What its entries and fields mean: bench/README.md, "Module notes", `parts.py`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import torch

from bench.common import TrainStep

#: a part that would get less than this is skipped ("time budget")
MIN_PART_S = 5.0
TIME_BUDGET = "time budget"


def entry(name: str, status: str, reason: str = "", **figures) -> dict:
    return {"name": name, "status": status, "reason": reason, **figures}


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_reason(exc: BaseException) -> str:
    """``Type: message`` and the innermost frame, for a JSON reason."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]


class _EntryRecorder:
    """pytest plugin: one :func:`entry` per test of `names` (node id -> entry name), with the test's outcome, the
    reason it failed or skipped, and the figures it recorded (``record_property("figures", {...})``); a test that
    would start with less than :data:`MIN_PART_S` of `deadline` left is skipped ("time budget")."""

    def __init__(self, names: dict[str, str], deadline):
        self.names, self.deadline, self.entries, self.collect_errors = names, deadline, {}, []

    def pytest_collectreport(self, report):
        if report.failed:  # e.g. a test module that does not import on this machine
            self.collect_errors.append(report.longreprtext[-1500:])

    def pytest_runtest_setup(self, item):
        import pytest

        if self.deadline is not None and self.deadline.expired(MIN_PART_S):
            pytest.skip(TIME_BUDGET)

    def pytest_runtest_logreport(self, report):
        name = self.names.get(report.nodeid)
        if name is None or (report.when != "call" and report.passed) or name in self.entries:
            return
        figures = dict(report.user_properties).get("figures", {})
        if report.passed:
            status, reason = "passed", ""
        elif report.skipped:
            status, reason = "skipped", str(report.longrepr[-1]).removeprefix("Skipped: ")
        else:
            crash = getattr(report.longrepr, "reprcrash", None)
            reason = crash.message if crash is not None else report.longreprtext
            # the test's own message (pytest.fail's, an assert's), without pytest's introspection of the assert
            for prefix in ("Failed: ", "AssertionError: "):
                reason = reason.removeprefix(prefix)
            status, reason = "failed", reason.split("\nassert ")[0][-2000:]
            if "PartTimeout" in reason:  # the hard limit cut the test off
                status, reason = "skipped", f"{TIME_BUDGET}: {reason}"
        self.entries[name] = entry(name, status, reason, **figures)


def run_tests(names: dict[str, str], options: tuple[str, ...] = (), deadline=None) -> list[dict]:
    """The tests of `names` (pytest node id relative to the repository root -> entry name) run by pytest in this
    process with the command-line `options` (``tests/conftest.py``'s sizes), one :func:`entry` each in the order of
    `names`: how ``gpu_check`` reports the correctness checks that live in ``tests/test_gpu.py``. The environment is
    restored afterwards (the test conftest sets its own dataset cache). A test pytest did not report (not collected)
    is ``failed`` with the reason."""
    import pytest

    repo = Path(__file__).resolve().parents[1]
    recorder = _EntryRecorder(names, deadline)
    environ = dict(os.environ)
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", "--rootdir", str(repo), *options]
    try:
        code = pytest.main([*args, *(str(repo / nodeid) for nodeid in names)], plugins=[recorder])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    missing = f"pytest did not run the test (exit code {code}) {' '.join(recorder.collect_errors)}".strip()
    return [recorder.entries.get(name) or entry(name, "failed", missing) for name in names.values()]


# step_table
# ---------------------------------------------------------------------------------------------------------------------


def build_on(fn, device: torch.device):
    """`fn()` built on `device` directly (fast for 1B parameters on a GPU), else on CPU and moved."""
    if device.type != "cpu":
        try:
            with torch.device(device):
                return fn()
        except Exception:  # noqa: BLE001 - a constructor that insists on CPU tensors
            free_memory()
    return fn().to(device)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.bfloat16 if device.type == "cuda" else None


def train_step_of(model, ids: torch.Tensor, device: torch.device) -> TrainStep:
    """One training step as a user trains: bf16 autocast and fused AdamW on CUDA, fp32 and torch's AdamW on CPU."""
    return TrainStep(model, ids, autocast_dtype=autocast_dtype(device), fused=device.type == "cuda")


# ---------------------------------------------------------------------------------------------------------------------


class Deadline:
    """A point in time (``time.monotonic``); ``Deadline(None)`` never expires."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def expired(self, needed: float = 0.0) -> bool:
        return self.left() <= needed

    def at_fraction(self, fraction: float, keep_s: float = 0.0) -> float | None:
        """The monotonic time at which a part should stop its main work: `fraction` of what is left from now, and at
        least `keep_s` before the end. None when unlimited."""
        if self.end is None:
            return None
        left = self.left()
        return time.monotonic() + max(0.0, min(fraction * left, left - keep_s))


class PartTimeout(BaseException):
    """Raised inside a part by the hard limit of its allowance (a ``BaseException``, like ``KeyboardInterrupt``, so
    that library code catching ``Exception`` does not swallow it)."""


@contextlib.contextmanager
def hard_limit(seconds: float | None):
    """Raise :class:`PartTimeout` in the main thread after `seconds` (``SIGALRM``); no limit elsewhere."""
    usable = (
        seconds is not None
        and math.isfinite(seconds)
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def alarm(signum, frame):
        raise PartTimeout(f"cut off after its allowance of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
