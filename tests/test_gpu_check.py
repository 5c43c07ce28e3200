"""bench/gpu_check.py (issue #12): its CPU-runnable parts run here; its GPU parts say they need CUDA and skip."""

import json

import pytest
import torch

from bench import gpu_check
from tests.test_tile_kernels_moe import FakeTileKernels1x

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU check")


def test_cpu_run_emulates_fp8_and_skips_what_needs_cuda(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    result = gpu_check.main(["--presets", "tiny", "1b", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    by_name = {c["name"]: c for c in result["checks"]}
    for recipe in gpu_check.FP8_RECIPES:
        tiny = by_name[f"fp8_{recipe}_tiny"]
        assert tiny["status"] == "passed" and tiny["emulated"] and tiny["converted_layers"] > 0
        assert tiny["loss_rel_difference"] <= gpu_check.FP8_LOSS_RTOL and "not FP8's" in tiny["note"]
        assert by_name[f"fp8_{recipe}_1b"]["status"] == "skipped"
    for name in ("fp8_tensorwise_1b", "tile_kernels_moe", "fsdp2_fp8_all_gather"):
        assert "needs CUDA" in by_name[name]["reason"], name
    assert result["passed"] and result["environment"]["cuda"] is False


class BrokenTileKernels(FakeTileKernels1x):
    """A test double of tile_kernels whose topk_gate picks the least likely experts (what the check must catch)."""

    def topk_gate(self, scores, num_topk):
        return super().topk_gate(-scores, num_topk)


@pytest.mark.parametrize("double, status", [(FakeTileKernels1x, "passed"), (BrokenTileKernels, "failed")])
def test_tile_kernels_comparison_with_a_cpu_double(double, status):
    entry = gpu_check.tile_kernels_check(double(), preset="tiny", repeats=1)
    assert entry["status"] == status, entry
    assert entry["backend"] == "tile_kernels 1.x fused"
