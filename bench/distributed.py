"""The ``distributed`` part of ``python -m bench.gpu_check``: DDP and FSDP2 at world size 1 on the device at hand.

Multi-GPU users train under DDP or FSDP2 (``configs/accelerate/``). This part runs both where a one-GPU session can:
a process group of one rank over NCCL on CUDA (gloo on CPU), in a fresh process
(``python -m tests.distributed_worker OUT``,
``tests/distributed_worker.py``)
so that its process group and accelerate's state stay out of the other parts. On the same batches and from the same
initial weights it trains

- the unwrapped model (the reference),
- the model under ``DistributedDataParallel``,
- the model sharded as ``configs/accelerate/fsdp2.yaml`` shards it (accelerate's own ``fsdp2_prepare_model``: one
  ``fully_shard`` per ``SpiderDecoderLayer`` / ``SpiderRecurrentLayer``, then the root), whose sharded checkpoint is
  written mid-run by accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` (torch distributed checkpoint,
  ``SHARDED_STATE_DICT``, as the Trainer saves it), loaded into a freshly initialised sharded model that trains on,
  and gathered into a release (:func:`spider_training.release.gather_unsharded`) that ``from_pretrained`` loads.

One training step is a user's: bf16 autocast on CUDA, fp32 on CPU, AdamW. The check passes when the DDP and FSDP2
losses equal the reference's, the resumed losses equal the uninterrupted run's, and the release's logits equal the
sharded model's, each within the worker's ``loss_rtol`` (a wrong gradient scale or a lost reduction moves the second
loss by far more). accelerate refuses FSDP without a launcher on CPU (its state stays ``MULTI_CPU``), so
``fsdp2_prepare_model`` is called with the worker's ``AcceleratorAttributes``, the attributes it reads.
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
