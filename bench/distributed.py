"""The ``distributed`` part of ``python -m bench.gpu_check``: DDP and FSDP2 at world size 1 on the device at hand.

It runs ``python -m tests.distributed_worker OUT`` in a fresh process (so that its process group and accelerate's
state stay out of the other parts) and judges the JSON it writes; what the worker trains, saves, resumes and gathers,
and its tolerance, are in ``tests/distributed_worker.py``'s docstring.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def distributed_check(
    preset: str = "tiny", steps: int = 4, shape: tuple[int, int] = (4, 64), timeout_s: float | None = 300
) -> dict:
    """The ``distributed`` part's entry: ``tests/distributed_worker.py``'s ``run_world_size_1`` in a fresh Python
    process (``python -m tests.distributed_worker``, killed after `timeout_s`; None or inf: no limit), judged by
    :func:`judge`.

    Returns:
        A ``bench.parts.entry`` dict named ``distributed_world_size_1`` with the figures: passed when every difference
        is within ``rtol`` and the release has no shards; failed naming each that is not, or with the process's error.
    Raises:
        subprocess.TimeoutExpired: the process ran past `timeout_s`.
    """
    from bench.parts import entry

    name = "distributed_world_size_1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [
            sys.executable,
            "-m",
            "tests.distributed_worker",
            str(out),
            "--preset",
            preset,
            "--steps",
            str(steps),
            "--shape",
            f"{shape[0]}x{shape[1]}",
        ]
        done = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=None if timeout_s is None or math.isinf(timeout_s) else timeout_s,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
        result_file = out / "distributed.json"
        if done.returncode != 0 or not result_file.exists():
            return entry(
                name,
                "failed",
                f"python -m tests.distributed_worker exited {done.returncode}: {done.stderr.strip()[-1500:]}",
            )
        figures = json.loads(result_file.read_text())
    return entry(name, *judge(figures), **figures)


def judge(figures: dict) -> tuple[str, str]:
    """``("passed", "")``, or ``("failed", reason)`` naming each difference of the worker's `figures`
    over its ``rtol`` (NaN counts as over) and a release that still holds shards."""
    over = [
        f"{key} {figures[key]:.3g} > rtol {figures['rtol']:.3g}"
        for key in ("ddp_max_rel_diff", "fsdp2_max_rel_diff", "resumed_max_rel_diff", "release_logits_max_rel_diff")
        if not figures[key] <= figures["rtol"]
    ]
    if figures["release_has_dtensors"]:
        over.append("the gathered release still holds DTensor shards")
    return ("failed" if over else "passed"), "; ".join(over)
