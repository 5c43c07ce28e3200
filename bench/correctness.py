"""The correctness checks of ``python -m bench.gpu_check``: FP8 against bf16, TileKernels against torch's MoE
routing, FSDP2 with float8 all-gather.

- ``fp8_<recipe>_<preset>``: torchao ``Float8Linear`` (real ``torch._scaled_mm`` on a GPU; emulated on CPU), and the
  experts through torchao's FP8 grouped GEMM where the GPU has it (``--fp8_experts auto``), against the same model in
  bf16 autocast, one training step on the same batch: the losses agree within ``FP8_LOSS_RTOL`` and
  the gradients point the same way (cosine >= ``FP8_GRAD_COSINE``); both step times and their ratio are reported
  (medians of ``--step_repeats`` steps after a warm-up; a speed-up above 1 is what FP8 is for; on CPU emulation the
  times mean nothing and are labelled so). Recipes
  ``tensorwise`` and ``rowwise``; presets ``small`` and ``1b`` (``1b`` needs CUDA); ``--fp8_layers`` by default
  ``auto`` for ``1b``
  (the layers ``--precision fp8`` converts there, so the step times are what ``--precision auto`` chooses by:
  ``spider_training.fp8.FP8_MEASURED``) and ``tk_train`` for the smaller presets (every layer kind tk-train.py
  converted;
  ``auto`` converts none of their layers).
- ``tile_kernels_moe``: the TileKernels MoE routing (:func:`spider_training.tile_kernels_moe.swap_in_tile_kernels`)
  against the torch path on one MoE layer in fp32: outputs and gradients (input, expert weights) equal within
  fp32 summation-order roundoff; and the training-step speed ratio of the whole model (bf16 autocast).
  Needs CUDA and ``tile_kernels`` installed.
- ``fsdp2_fp8_all_gather``: under ``torchrun`` with >= 2 CUDA GPUs (NCCL), the model sharded with ``fully_shard`` per
  layer (as ``configs/accelerate/fsdp2.yaml``) and converted with torchao's ``enable_fsdp_float8_all_gather`` (what
  accelerate's ``AORecipeKwargs`` passes) trains 3 steps to the loss curve of the same FP8 model without float8
  all-gather.
"""

from __future__ import annotations

import copy
import importlib
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import random_bytes, spider_model, synchronize
from bench.parts import build_on, default_device, entry, free_memory
from spider_training.mixed_precision import autocast_experts

FP8_RECIPES = ("tensorwise", "rowwise")
#: FP8 (e4m3, 3 mantissa bits) against bf16 (7 bits) at initialisation: the loss is a mean over every byte, so the
#: per-element rounding (up to 2^-4 relative) averages out far below this; a broken scale is off by orders more.
FP8_LOSS_RTOL = 0.02
FP8_GRAD_COSINE = 0.9
SHAPES = {"tiny": (2, 128), "small": (8, 256), "1b": (1, 2048)}  # (batch, bytes) of the compared FP8 step


def _train_step(model, ids: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Forward + backward in bf16 autocast; returns (loss, the flattened gradient of every parameter)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), torch.cat(grads)


def _median_step_seconds(model, ids, device, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        _train_step(model, ids, device)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call warms up


def fp8_check(
    preset: str, recipe: str, device: torch.device | None = None, repeats: int = 5, layers: str = "tk_train"
) -> dict:
    """torchao FP8 against bf16 autocast on one training step of `preset` (see the module docstring)."""
    from spider_training.fp8 import convert_for_fp8_training

    device = device or default_device()
    name = f"fp8_{recipe}_{preset}"
    if preset == "1b" and device.type != "cuda":
        return entry(name, "skipped", "needs CUDA (the 1b preset on CPU emulation takes hours)")
    batch, length = SHAPES[preset]
    reference = build_on(lambda: spider_model(preset), device)
    fp8 = copy.deepcopy(reference)
    # as --precision fp8 converts: the experts where the GPU has the FP8 grouped GEMM
    report = convert_for_fp8_training(fp8, recipe, layers, emulate=device.type != "cuda", device=device)
    experts = [fqn for fqn in report.converted if fqn.endswith(".experts")]
    converted = len(report.converted)
    for model in (reference, fp8):  # the experts in bf16 under autocast, as the trainer runs them
        autocast_experts(model)
    ids = random_bytes(batch, length).to(device)
    loss_ref, grad_ref = _train_step(reference, ids, device)
    loss_fp8, grad_fp8 = _train_step(fp8, ids, device)
    rel = abs(loss_fp8 - loss_ref) / abs(loss_ref)
    cosine = float(F.cosine_similarity(grad_fp8, grad_ref, dim=0))
    del grad_ref, grad_fp8
    step_bf16 = _median_step_seconds(reference, ids, device, repeats)
    step_fp8 = _median_step_seconds(fp8, ids, device, repeats)
    ok = converted > 0 and rel <= FP8_LOSS_RTOL and cosine >= FP8_GRAD_COSINE
    reason = ""
    if converted == 0:
        reason = f"no layer converted (--fp8_layers {layers}): nothing compared\n{report.message}"
    elif not ok:
        reason = (
            f"loss rel. difference {rel:.4f} (max {FP8_LOSS_RTOL}) or gradient cosine {cosine:.3f} "
            f"(min {FP8_GRAD_COSINE})"
        )
    del reference, fp8
    free_memory()
    return entry(
        name,
        "passed" if ok else "failed",
        reason,
        device=str(device),
        emulated=device.type != "cuda",
        layers=layers,
        converted_layers=converted - len(experts),
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
        note="CPU emulation: the step times are not FP8's" if device.type != "cuda" else "",
    )


def tile_kernels_check(
    tile_kernels_module=None, preset: str = "small", device: torch.device | None = None, repeats: int = 5
) -> dict:
    """The TileKernels MoE routing against the torch path on one training step (bf16 autocast). Without
    `tile_kernels_module` it needs CUDA and an importable ``tile_kernels``; tests pass a CPU test double."""
    from spider_training.tile_kernels_moe import BACKEND_TORCH, spider_moe_layers, swap_in_tile_kernels

    device = device or default_device()
    if tile_kernels_module is None:
        if device.type != "cuda":
            return entry("tile_kernels_moe", "skipped", "needs CUDA (TileKernels kernels are CUDA-only, SM90/SM100)")
        try:
            tile_kernels_module = importlib.import_module("tile_kernels.moe")
        except Exception as exc:  # not installed, or tilelang failing at import
            return entry("tile_kernels_moe", "skipped", f"tile_kernels does not import: {type(exc).__name__}: {exc}")
    batch, length = SHAPES[preset]
    reference = spider_model(preset).to(device)
    swapped = copy.deepcopy(reference)
    backend = swap_in_tile_kernels(swapped, tile_kernels_module)
    if backend == BACKEND_TORCH:
        return entry("tile_kernels_moe", "failed", f"the swap kept the torch path: {backend.reason}")
    for model in (reference, swapped):  # the experts in bf16 under autocast, as the trainer runs them
        autocast_experts(model)
    # One MoE layer on the same tokens, fp32: outputs and gradients (input and expert weights) of the two routing
    # implementations differ only in fp32 summation order (the fused reduce), a few ulps per accumulated term.
    layer_ref, layer_tk = spider_moe_layers(reference)[0], spider_moe_layers(swapped)[0]
    x = torch.randn(batch * length // 2, reference.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(
        device
    )
    diffs = {}
    results = []
    for layer in (layer_ref, layer_tk):
        inp = x.clone().requires_grad_(True)
        out = layer(inp)[0]
        out.square().sum().backward()
        results.append(
            {
                "output": out.detach(),
                "input_grad": inp.grad,
                "weight_grad": torch.cat([p.grad.flatten() for p in layer.parameters() if p.grad is not None]),
            }
        )
    ok = True
    for key in results[0]:
        ref, got = results[0][key], results[1][key]
        tol = 16 * torch.finfo(torch.float32).eps * reference.config.hidden_size * float(ref.abs().max())
        diffs[key] = float((got - ref).abs().max())
        ok = ok and diffs[key] <= tol
    ids = random_bytes(batch, length).to(device)
    step_torch = _median_step_seconds(reference, ids, device, repeats)
    step_tile = _median_step_seconds(swapped, ids, device, repeats)
    return entry(
        "tile_kernels_moe",
        "passed" if ok else "failed",
        "" if ok else f"the MoE layer's outputs or gradients differ: {diffs}",
        backend=str(backend),
        device=str(device),
        max_difference=diffs,
        step_s_torch=step_torch,
        step_s_tile_kernels=step_tile,
        speedup_torch_over_tile_kernels=step_torch / step_tile,
    )


def fsdp2_fp8_all_gather_check(preset: str = "small", steps: int = 3) -> dict:
    """FSDP2 over NCCL with torchao's float8 all-gather against the same FP8 model without it (see the module
    docstring). Run under ``torchrun --nproc_per_node N`` with N >= 2 CUDA GPUs."""
    import torch.distributed as dist

    name = "fsdp2_fp8_all_gather"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return entry(name, "skipped", "needs CUDA with >= 2 GPUs (torchrun --nproc_per_node 2, NCCL)")
    if "RANK" not in os.environ:
        return entry(name, "skipped", "run under torchrun --nproc_per_node >= 2 (no RANK in the environment)")
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from spider_training.fp8 import build_float8_config, keep_reason

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    batch, length = SHAPES[preset]
    ids = random_bytes(batch * world, length).to(device).chunk(world)[rank]
    curves = {}
    for all_gather in (False, True):
        model = spider_model(preset).to(device)
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
    rel = max(abs(a - b) / abs(b) for a, b in zip(curves[True], curves[False]))
    ok = rel <= FP8_LOSS_RTOL
    return entry(
        name,
        "passed" if ok else "failed",
        "" if ok else f"loss curves differ by {rel:.4f}",
        world_size=world,
        losses_fp8_all_gather=curves[True],
        losses_bf16_all_gather=curves[False],
    )


# ---------------------------------------------------------------------------------------------------------------------
# The parts, the budget, the command
