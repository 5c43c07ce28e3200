"""The correctness checks of ``python -m bench.gpu_check`` as pytest tests, marked ``gpu`` and skipped without CUDA.

``pytest -m gpu`` on a GPU machine runs them alone; ``python -m bench.gpu_check`` runs the same check functions
(``bench.correctness``, ``bench.distributed``, ``bench.training_runs``) in one command, with the step table and the
diagnostics, and writes one JSON. A check that reports itself ``skipped`` (TileKernels not installed, one GPU for the
float8 all-gather) skips here with its reason; ``failed`` fails with it. On CPU, ``tests/test_gpu_check.py`` runs the
same functions at toy sizes.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench.gpu_check's checks)"),
]


def outcome(check: dict) -> None:
    """Pass, skip or fail as the ``bench.parts.entry`` dict `check` says."""
    if check["status"] == "skipped":
        pytest.skip(f"{check['name']}: {check['reason']}")
    assert check["status"] == "passed", f"{check['name']}: {check['reason']}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("preset", ["small", "1b"])
def test_fp8_training_step_matches_bf16(preset, recipe):
    """torchao Float8Linear (and the experts' FP8 grouped GEMM where the GPU has it) against bf16 autocast: the same
    loss within bench.correctness.FP8_LOSS_RTOL, gradients with cosine >= FP8_GRAD_COSINE."""
    from bench.correctness import fp8_check

    outcome(fp8_check(preset, recipe, repeats=2, layers="auto" if preset == "1b" else "tk_train"))


def test_tile_kernels_moe_matches_torch_routing():
    """TileKernels' MoE routing against the torch path on one MoE layer in fp32: outputs and gradients equal within
    fp32 summation-order roundoff."""
    from bench.correctness import tile_kernels_check

    outcome(tile_kernels_check(repeats=2))


def test_main_job_trains_and_its_release_generates_on_cuda():
    """The README's main job (a few steps) on the GPU, its release reloaded onto the GPU."""
    from bench.training_runs import main_job_check

    outcome(main_job_check(steps=20, preset="small"))


def test_ddp_and_fsdp2_at_world_size_1_match_the_unwrapped_model():
    """DDP and FSDP2 over NCCL on one GPU: losses equal to the unwrapped model's within the step dtype's rounding;
    FSDP2's sharded checkpoint saved, resumed and gathered into a release that loads."""
    from bench.distributed import distributed_check

    outcome(distributed_check("small", steps=4, shape=(4, 256), timeout_s=300))


def test_fsdp2_float8_all_gather_matches_plain_fp8():
    """Under torchrun with >= 2 GPUs: FSDP2 with float8 all-gather trains to the curve of the same FP8 model without
    it (``torchrun --nproc_per_node 2 -m pytest -m gpu -k all_gather``)."""
    from bench.correctness import fsdp2_fp8_all_gather_check

    outcome(fsdp2_fp8_all_gather_check())
