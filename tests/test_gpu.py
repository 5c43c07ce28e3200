"""The correctness checks of ``python -m bench.gpu_check`` as pytest tests, marked ``gpu`` and skipped without CUDA.

``pytest -m gpu`` on a GPU machine runs them alone; each test runs ``python -m bench.gpu_check --only PART`` (no time
budget) and reads its JSON, the command's contract (``bench.correctness``, ``bench.distributed``,
``bench.training_runs`` hold the check functions; ``tests/distributed_worker.py`` the DDP/FSDP2 worker). A check that
reports itself ``skipped`` (TileKernels not installed, one GPU for the float8 all-gather) skips here with its reason;
``failed`` fails with it. On CPU, ``tests/test_gpu_check.py`` runs the same functions at toy sizes.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.helpers import REPO, run_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench.gpu_check's checks)"),
]


def gpu_check(tmp_path, *args) -> dict:
    """The checks of ``python -m bench.gpu_check --budget_s 0 *args`` by name (the command's JSON ``checks``)."""
    out = tmp_path / "gpu_check.json"
    done = run_module("bench.gpu_check", "--budget_s", "0", "--out", out, *args)
    assert out.exists(), done.stderr[-3000:]
    return {check["name"]: check for check in json.loads(out.read_text())["checks"]}


def outcome(check: dict) -> None:
    """Pass, skip or fail as the ``bench.parts.entry`` dict `check` says."""
    if check["status"] == "skipped":
        pytest.skip(f"{check['name']}: {check['reason']}")
    assert check["status"] == "passed", f"{check['name']}: {check['reason']}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("preset", ["small", "1b"])
def test_fp8_training_step_matches_bf16(tmp_path, preset, recipe):
    """torchao Float8Linear (and the experts' FP8 grouped GEMM where the GPU has it) against bf16 autocast: the same
    loss within bench.correctness.FP8_LOSS_RTOL, gradients with cosine >= FP8_GRAD_COSINE."""
    checks = gpu_check(tmp_path, "--only", "fp8", "--presets", preset, "--step_repeats", "2")
    outcome(checks[f"fp8_{recipe}_{preset}"])


def test_tile_kernels_moe_matches_torch_routing(tmp_path):
    """TileKernels' MoE routing against the torch path on one MoE layer in fp32: outputs and gradients equal within
    fp32 summation-order roundoff."""
    outcome(gpu_check(tmp_path, "--only", "tile_kernels_moe")["tile_kernels_moe"])


def test_main_job_trains_and_its_release_generates_on_cuda(tmp_path):
    """The README's main job (a few steps) on the GPU, its release reloaded onto the GPU."""
    checks = gpu_check(tmp_path, "--only", "main_job", "--main_job_steps", "20", "--main_job_preset", "small")
    outcome(checks["main_job"])


def test_ddp_and_fsdp2_at_world_size_1_match_the_unwrapped_model(tmp_path):
    """DDP and FSDP2 over NCCL on one GPU: losses equal to the unwrapped model's within the step dtype's rounding;
    FSDP2's sharded checkpoint saved, resumed and gathered into a release that loads."""
    checks = gpu_check(
        tmp_path,
        *("--only", "distributed", "--distributed_preset", "small"),
        *("--distributed_steps", "4", "--distributed_shape", "4x256"),
    )
    outcome(checks["distributed_world_size_1"])


def test_fsdp2_float8_all_gather_matches_plain_fp8(tmp_path):
    """With >= 2 GPUs: FSDP2 with float8 all-gather trains to the curve of the same FP8 model without it
    (``torchrun --nproc_per_node 2 -m bench.gpu_check --only fsdp2_fp8_all_gather``, run here)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("fsdp2_fp8_all_gather: needs CUDA with >= 2 GPUs (torchrun --nproc_per_node 2, NCCL)")
    out = tmp_path / "gpu_check.json"
    torchrun = shutil.which("torchrun") or "torchrun"
    cmd = [torchrun, "--nproc_per_node", "2", "-m", "bench.gpu_check", "--budget_s", "0", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*cmd, "--only", "fsdp2_fp8_all_gather"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.exists(), done.stderr[-3000:]
    outcome({c["name"]: c for c in json.loads(out.read_text())["checks"]}["fsdp2_fp8_all_gather"])
