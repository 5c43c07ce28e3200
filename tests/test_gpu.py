"""The correctness checks that ``python -m bench.gpu_check`` reports: FP8 against bf16, TileKernels against torch's MoE
routing, DDP/FSDP2 at world size 1 against the unwrapped model, FSDP2 with float8 all-gather, and the step table's
CUDA-only figures (the training checks, main job and 1b run: ``tests/test_training_runs.py``). The ones that need
CUDA are marked ``gpu`` (``pytest -m gpu``) and skip without it, naming what they need.

``bench.gpu_check`` runs these tests in its process (``bench.parts.run_tests``) and turns each outcome into an entry of
its JSON: the test's status, the reason it failed or skipped, and the figures it recorded with ``record_property``
under the same keys as before. The sizes come from this folder's conftest options (``--step_repeats``,
``--fp8_layers``, ``--distributed_preset``, ``--distributed_steps``, ``--distributed_shape``), which the command
passes on.

- ``fp8_<recipe>_<preset>``: torchao ``Float8Linear`` (real ``torch._scaled_mm`` on a GPU; emulated on CPU), and the
  experts through torchao's FP8 grouped GEMM where the GPU has it, against the same model in bf16 autocast, one
  training step on the same batch: the losses agree within :data:`FP8_LOSS_RTOL` and the gradients point the same
  way (cosine >= :data:`FP8_GRAD_COSINE`); both step times are recorded (medians after a warm-up; on CPU emulation
  they mean nothing and say so). ``--fp8_layers`` defaults to ``auto`` for ``1b`` (the layers ``--precision fp8``
  converts there) and ``tk_train`` for the smaller presets (``auto`` converts none of their layers).
- ``tile_kernels_moe``: the TileKernels MoE routing (:func:`spider_training.tile_kernels_moe.swap_in_tile_kernels`)
  against the torch path on one MoE layer in fp32: outputs and gradients equal within fp32 summation-order roundoff;
  on CPU a test double (``tests/test_tile_kernels_moe.py``) stands in, and a broken double must be caught.
- ``distributed_world_size_1``: ``python -m tests.distributed_worker`` in a fresh process (see its docstring), every
  difference within its ``rtol`` and no shard left in the release (NCCL on a GPU, gloo on CPU).
- ``fsdp2_fp8_all_gather``: with >= 2 CUDA GPUs, the model sharded with ``fully_shard`` per layer and converted with
  torchao's ``enable_fsdp_float8_all_gather`` trains 3 steps to the loss curve of the same FP8 model without it.
"""

import copy
import importlib
import json
import os
import shutil
import statistics
import subprocess
import time

import pytest
import torch
import torch.nn.functional as F

from spider_training.mixed_precision import autocast_experts
from spider_training.throughput import synchronize
from tests.distributed_worker import loss_rtol, spider_model
from tests.helpers import REPO, random_bytes, run_module
from tests.test_tile_kernels_moe import FakeTileKernels2x

CUDA = torch.cuda.is_available()


def needs_cuda_for(why: str) -> list:
    """The marks of a test that needs CUDA: ``gpu``, and skipped without CUDA with the reason "needs CUDA (`why`)"."""
    return [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=f"needs CUDA ({why})")]


FP8_RECIPES = ("tensorwise", "rowwise")
#: FP8 (e4m3, 3 mantissa bits) against bf16 (7 bits) at initialisation: the loss is a mean over every byte, so the
#: per-element rounding (up to 2^-4 relative) averages out far below this; a broken scale is off by orders more.
FP8_LOSS_RTOL = 0.02
FP8_GRAD_COSINE = 0.9
SHAPES = {"tiny": (2, 128), "small": (8, 256), "1b": (1, 2048)}  # (batch, bytes) of the compared steps


def device() -> torch.device:
    return torch.device("cuda") if CUDA else torch.device("cpu")


def build_on(fn, where: torch.device):
    """`fn()` built on `where` directly (fast for 1B parameters on a GPU), else on CPU and moved."""
    if where.type != "cpu":
        try:
            with torch.device(where):
                return fn()
        except Exception:  # noqa: BLE001 - a constructor that insists on CPU tensors
            torch.cuda.empty_cache()
    return fn().to(where)


def forward_backward(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Forward + backward of `ids` int64 ``(B, T)`` in bf16 autocast; returns (loss, the gradients flat, fp32)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), torch.cat(
        [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    )


def median_step_seconds(model, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of `repeats` calls of :func:`forward_backward` after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        synchronize(ids.device)
        start = time.perf_counter()
        forward_backward(model, ids)
        synchronize(ids.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def record_figures(record_property, **figures) -> None:
    """The figures of ``bench.gpu_check``'s entry for this test (``record_property("figures", ...)``)."""
    record_property("figures", figures)


# ---------------------------------------------------------------------------------------------------------------------
# FP8 against bf16


#: emulated on CPU: tiny (seconds); small took minutes per recipe on 2 cores, 1b would take hours
FP8_CPU_PRESETS = ("tiny",)
FP8_CASES = [
    pytest.param(
        preset,
        recipe,
        id=f"{recipe}_{preset}",
        marks=[]
        if preset in FP8_CPU_PRESETS
        else needs_cuda_for(f"the {preset} preset on CPU emulation takes minutes to hours"),
    )
    for preset in SHAPES
    for recipe in FP8_RECIPES
]


@pytest.mark.parametrize("preset, recipe", FP8_CASES)
def test_fp8_training_step_matches_bf16(preset, recipe, request, record_property):
    """One training step of `preset` converted as ``--precision fp8`` converts it against bf16 autocast: the same loss
    within FP8_LOSS_RTOL and gradients with cosine >= FP8_GRAD_COSINE (see the module docstring)."""
    from spider_training.fp8 import convert_for_fp8_training

    where = device()
    repeats = request.config.getoption("--step_repeats")
    layers = request.config.getoption("--fp8_layers") or ("auto" if preset == "1b" else "tk_train")
    batch, length = SHAPES[preset]
    reference = build_on(lambda: spider_model(preset), where)
    fp8 = copy.deepcopy(reference)
    report = convert_for_fp8_training(fp8, recipe, layers, emulate=not CUDA, device=where)
    experts = [fqn for fqn in report.converted if fqn.endswith(".experts")]
    for model in (reference, fp8):  # the experts in bf16 under autocast, as the trainer runs them
        autocast_experts(model)
    ids = random_bytes(batch, length).to(where)
    loss_ref, grad_ref = forward_backward(reference, ids)
    loss_fp8, grad_fp8 = forward_backward(fp8, ids)
    rel = abs(loss_fp8 - loss_ref) / abs(loss_ref)
    cosine = float(F.cosine_similarity(grad_fp8, grad_ref, dim=0))
    del grad_ref, grad_fp8
    step_bf16 = median_step_seconds(reference, ids, repeats)
    step_fp8 = median_step_seconds(fp8, ids, repeats)
    record_figures(
        record_property,
        device=str(where),
        emulated=not CUDA,
        layers=layers,
        converted_layers=len(report.converted) - len(experts),
        converted_experts_modules=len(experts),
        experts_skipped=sorted({r for f, r in report.kept.items() if f.endswith(".experts")}),
        shape=f"{batch}x{length}",
        loss_bf16=loss_ref,
        loss_fp8=loss_fp8,
        loss_rel_difference=rel,
        gradient_cosine=cosine,
        step_s_bf16=step_bf16,
        step_s_fp8=step_fp8,
        speedup_bf16_over_fp8=step_bf16 / step_fp8,
        note="" if CUDA else "CPU emulation: the step times are not FP8's",
    )
    assert report.converted, f"no layer converted (--fp8_layers {layers}): nothing compared\n{report.message}"
    assert rel <= FP8_LOSS_RTOL and cosine >= FP8_GRAD_COSINE, (
        f"loss rel. difference {rel:.4f} (max {FP8_LOSS_RTOL}) or gradient cosine {cosine:.3f} (min {FP8_GRAD_COSINE})"
    )
    assert step_bf16 > 0 and step_fp8 > 0


# ---------------------------------------------------------------------------------------------------------------------
# TileKernels against torch's MoE routing


def tile_kernels_comparison(tile_kernels_module, preset: str, where: torch.device, repeats: int) -> dict:
    """The TileKernels MoE routing swapped into `preset` against the torch path: the largest difference of one MoE
    layer's output, input gradient and weight gradients (fp32, ``max_difference``) with the tolerance of each
    (``tolerance``: 16 fp32 ulps per accumulated term, the hidden size, scaled by the reference's largest value), and
    the step times of the whole model in bf16 autocast. Raises AssertionError when the swap kept the torch path."""
    from spider_training.tile_kernels_moe import BACKEND_TORCH, spider_moe_layers, swap_in_tile_kernels

    batch, length = SHAPES[preset]
    reference = spider_model(preset).to(where)
    swapped = copy.deepcopy(reference)
    backend = swap_in_tile_kernels(swapped, tile_kernels_module)
    assert backend != BACKEND_TORCH, f"the swap kept the torch path: {backend.reason}"
    for model in (reference, swapped):  # the experts in bf16 under autocast, as the trainer runs them
        autocast_experts(model)
    hidden = reference.config.hidden_size
    x = torch.randn(batch * length // 2, hidden, generator=torch.Generator().manual_seed(0)).to(where)
    results = []
    for layer in (spider_moe_layers(reference)[0], spider_moe_layers(swapped)[0]):
        inp = x.clone().requires_grad_(True)
        out = layer(inp)[0]
        out.square().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters() if p.grad is not None])
        results.append({"output": out.detach(), "input_grad": inp.grad, "weight_grad": grads})
    ref, got = results
    eps = torch.finfo(torch.float32).eps
    ids = random_bytes(batch, length).to(where)
    step_torch = median_step_seconds(reference, ids, repeats)
    step_tile = median_step_seconds(swapped, ids, repeats)
    return dict(
        backend=str(backend),
        device=str(where),
        max_difference={key: float((got[key] - ref[key]).abs().max()) for key in ref},
        tolerance={key: 16 * eps * hidden * float(ref[key].abs().max()) for key in ref},
        step_s_torch=step_torch,
        step_s_tile_kernels=step_tile,
        speedup_torch_over_tile_kernels=step_torch / step_tile,
    )


def assert_within_tolerance(figures: dict) -> None:
    over = {k: v for k, v in figures["max_difference"].items() if not v <= figures["tolerance"][k]}
    assert not over, f"the MoE layer's outputs or gradients differ: {figures['max_difference']}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (TileKernels kernels are CUDA-only, SM90/SM100)")
def test_tile_kernels_moe_matches_torch_routing(request, record_property):
    """TileKernels' MoE routing against the torch path on CUDA (skipped when ``tile_kernels`` does not import)."""
    try:
        module = importlib.import_module("tile_kernels.moe")
    except Exception as exc:  # not installed, or tilelang failing at import
        pytest.skip(f"tile_kernels does not import: {type(exc).__name__}: {exc}")
    figures = tile_kernels_comparison(module, "small", device(), request.config.getoption("--step_repeats"))
    record_figures(record_property, **figures)
    assert_within_tolerance(figures)


class BrokenTileKernels(FakeTileKernels2x):
    """A test double of tile_kernels whose topk_gate picks the least likely experts (what the check must catch)."""

    def topk_gate(self, scores, num_topk):
        return super().topk_gate(-scores, num_topk)


@pytest.mark.skipif(CUDA, reason="the CPU test double")
def test_tile_kernels_comparison_with_a_cpu_double():
    """The comparison on CPU with the test double passes, and catches a double that routes to the wrong experts."""
    good = tile_kernels_comparison(FakeTileKernels2x(), "tiny", torch.device("cpu"), repeats=1)
    assert_within_tolerance(good)
    assert good["backend"] == "tile_kernels" and good["step_s_torch"] > 0 and good["step_s_tile_kernels"] > 0
    broken = tile_kernels_comparison(BrokenTileKernels(), "tiny", torch.device("cpu"), repeats=1)
    with pytest.raises(AssertionError, match="differ"):
        assert_within_tolerance(broken)


# ---------------------------------------------------------------------------------------------------------------------
# DDP and FSDP2 at world size 1


def distributed_failures(figures: dict) -> list[str]:
    """Each difference of ``tests.distributed_worker``'s `figures` over its ``rtol`` (NaN counts as over), and a
    release that still holds shards; empty when the run matches."""
    over = [
        f"{key} {figures[key]:.3g} > rtol {figures['rtol']:.3g}"
        for key in ("ddp_max_rel_diff", "fsdp2_max_rel_diff", "resumed_max_rel_diff", "release_logits_max_rel_diff")
        if not figures[key] <= figures["rtol"]
    ]
    if figures["release_has_dtensors"]:
        over.append("the gathered release still holds DTensor shards")
    return over


@pytest.mark.slow
def test_ddp_and_fsdp2_at_world_size_1_match_the_unwrapped_model(tmp_path, request, record_property):
    """DDP and FSDP2 over NCCL on one GPU (gloo on CPU): losses equal to the unwrapped model's within the step dtype's
    rounding; FSDP2's sharded checkpoint saved, resumed and gathered into a release that loads."""
    option = request.config.getoption
    batch, length = option("--distributed_shape").lower().split("x")
    done = run_module(
        "tests.distributed_worker",
        tmp_path,
        *("--preset", option("--distributed_preset"), "--steps", option("--distributed_steps")),
        *("--shape", f"{batch}x{length}"),
        timeout=600,
    )
    result = tmp_path / "distributed.json"
    assert done.returncode == 0 and result.exists(), (
        f"python -m tests.distributed_worker exited {done.returncode}: {done.stderr.strip()[-1500:]}"
    )
    figures = json.loads(result.read_text())
    record_figures(record_property, **figures)
    failures = distributed_failures(figures)
    assert not failures, "; ".join(failures)
    assert figures["backend"] == ("nccl" if CUDA else "gloo") and figures["world_size"] == 1
    steps = int(option("--distributed_steps"))
    assert len(figures["ddp_losses"]) == len(figures["fsdp2_losses"]) == steps + 2  # the checkpoint, 2 more
    assert figures["fsdp2_dtensor_parameters"] == figures["parameters"] > 0
    assert any(f.endswith(".distcp") for f in figures["checkpoint_files"])
    assert figures["reference_losses"][-1] != figures["reference_losses"][0]  # the weights moved


def test_distributed_judgement_names_what_differs():
    figures = dict(
        rtol=loss_rtol(torch.float32),
        ddp_max_rel_diff=0.0,
        fsdp2_max_rel_diff=0.0,
        resumed_max_rel_diff=0.0,
        release_logits_max_rel_diff=0.0,
        release_has_dtensors=False,
    )
    assert distributed_failures(figures) == []
    # a gradient summed twice or a lost optimizer state moves the losses after the first step far past rtol
    reason = "; ".join(
        distributed_failures({**figures, "resumed_max_rel_diff": 0.02, "ddp_max_rel_diff": float("nan")})
    )
    assert "resumed_max_rel_diff 0.02" in reason and "ddp_max_rel_diff nan" in reason
    assert "DTensor" in distributed_failures({**figures, "release_has_dtensors": True})[0]
    assert loss_rtol(torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 with float8 all-gather (>= 2 GPUs)


def _fsdp2_fp8_curves(preset: str, steps: int) -> tuple[int, dict]:
    """Under torchrun: the mean loss of each of `steps` steps of `preset`, FSDP2 + FP8 with and without float8
    all-gather, on the same batches; returns (world size, {all_gather: losses})."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from spider_training.fp8 import build_float8_config, keep_reason

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    batch, length = SHAPES[preset]
    ids = random_bytes(batch * world, length).cuda().chunk(world)[rank]
    curves = {}
    for all_gather in (False, True):
        model = spider_model(preset).cuda()
        config = build_float8_config("tensorwise", emulate=False, fsdp_float8_all_gather=all_gather)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: keep_reason(m, fqn, "tk_train") is None
        )
        for module in model.modules():
            if type(module).__name__ in type(model)._no_split_modules:
                fully_shard(module)
        fully_shard(model)
        autocast_experts(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if all_gather:
                precompute_float8_dynamic_scale_for_fsdp(model)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        curves[all_gather] = losses
    return world, curves


@pytest.mark.gpu
@pytest.mark.skipif(
    not CUDA or torch.cuda.device_count() < 2, reason="needs CUDA with >= 2 GPUs (torchrun --nproc_per_node 2, NCCL)"
)
def test_fsdp2_float8_all_gather_matches_plain_fp8(request, record_property):
    """FSDP2 with float8 all-gather trains to the curve of the same FP8 model without it. Outside torchrun the test
    runs itself under ``torchrun --nproc_per_node 2``."""
    if "RANK" not in os.environ:
        torchrun = shutil.which("torchrun") or "torchrun"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [torchrun, "--nproc_per_node", "2", "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]
        done = subprocess.run(
            [*cmd, request.node.nodeid], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return
    world, curves = _fsdp2_fp8_curves("small", steps=3)
    record_figures(
        record_property, world_size=world, losses_fp8_all_gather=curves[True], losses_bf16_all_gather=curves[False]
    )
    rel = max(abs(a - b) / abs(b) for a, b in zip(curves[True], curves[False]))
    assert rel <= FP8_LOSS_RTOL, f"loss curves differ by {rel:.4f}"


# ---------------------------------------------------------------------------------------------------------------------
# The step table's CUDA-only figures (through the command)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (the caching allocator's counts, kernel events)")
def test_step_table_counts_device_allocations_and_ranks_kernels(tmp_path):
    """On CUDA each timed step records the ``cudaMalloc`` calls it made, and the profiled step names the kernels
    launched most often: at most 20, most launches first, names cut to 120 characters."""
    out = tmp_path / "gpu_check.json"
    args = ("--only", "step_table", "--step_table_preset", "tiny", "--step_table_shapes", "2x64")
    args += ("--step_table_models", "spider", "deepseek_v3")
    done = run_module("bench.gpu_check", "--budget_s", "0", "--out", out, *args, "--step_repeats", "2")
    assert out.exists(), done.stderr[-3000:]
    ((table,),) = [json.loads(out.read_text())["checks"]]
    assert table["status"] == "passed", table
    for row in table["rows"]:
        allocations = row["device_allocations_per_step"]
        assert len(allocations) == 2 and all(isinstance(n, int) and n >= 0 for n in allocations), row
        kernels = row["top_kernels"]
        launches = [k["launches"] for k in kernels.values()]
        assert 0 < len(kernels) <= 20 and launches == sorted(launches, reverse=True), kernels
        assert all(len(name) <= 120 and k["device_ms"] >= 0 for name, k in kernels.items())
        assert sum(launches) <= row["kernel_launches"]
