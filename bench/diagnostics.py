"""Diagnostics of a training step: host syncs, aten ops, kernel launches and profiles, the segment axis of each
step, and two parts of ``python -m bench.gpu_check``:

What its entries and fields mean: bench/README.md, "Module notes", `diagnostics.py`.
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch

from bench.common import TrainStep, random_bytes, spider_config
from bench.parts import MIN_PART_S, TIME_BUDGET, Deadline, build_on, default_device, entry, free_memory, train_step_of
from spider_training.peers import peer_model
from spider_training.profiling import CudaSyncWarnings, HostSyncCounter, eager_aten_ops
from spider_training.throughput import count_flops, synchronize

#: ops named in a profiled step's ``top_host_ops``
TOP_HOST_OPS = 8
#: kernels and aten ops named in a profiled step's ``top_kernels`` and ``top_aten_ops`` (by launches / calls)
TOP_BY_COUNT = 20


def _profile_kernels(step, device: torch.device) -> dict:
    """Kernels launched by one `step` and the GPU's busy time (``torch.profiler`` with CUDA activity): device-side
    events (kernels, memcpy, memset), the host-side launch calls, the summed device time, the profiled wall time and
    the :data:`TOP_HOST_OPS` ops with the most self host time (``top_host_ops``: where a slow step's host time goes,
    e.g. a cuDNN plan built at a new segment count), and the aten ops run outside compiled regions
    (``eager_aten_ops``, :func:`spider_training.profiling.eager_aten_ops`: a compiled model's glue between its
    regions)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    wall = time.perf_counter() - start
    events = prof.events()
    device_events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in device_events if not e.name.lower().startswith(("memcpy", "memset"))]
    launches = [
        e
        for e in events
        if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    ]
    busy_us = sum(e.time_range.elapsed_us() for e in device_events)
    averages = prof.key_averages()
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_HOST_OPS]
    return {
        "kernel_launches": len(kernels),
        "device_events": len(device_events),
        "launch_calls": len(launches),
        "gpu_busy_s": busy_us / 1e6,
        "profiled_step_s": wall,
        "top_host_ops": {
            a.key: {"self_host_ms": round(a.self_cpu_time_total / 1e3, 3), "calls": a.count} for a in top
        },
        "top_kernels": _kernels_by_launches(kernels),
        "top_aten_ops": {
            a.key: a.count
            for a in sorted((a for a in averages if a.key.startswith("aten::")), key=lambda a: a.count, reverse=True)[
                :TOP_BY_COUNT
            ]
        },
        "eager_aten_ops": eager_aten_ops(events),
    }


def _kernels_by_launches(kernels: list) -> dict:
    """The :data:`TOP_BY_COUNT` kernel names launched most often among the profiler's device `kernels`, each with its
    ``launches`` and summed device milliseconds (``device_ms``): which ops a launch-bound step's launches come from.
    A name is cut to 120 characters (template arguments make some thousands long)."""
    by_name: dict[str, list] = {}
    for event in kernels:
        entry = by_name.setdefault(event.name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    ranked = sorted(by_name.items(), key=lambda item: item[1][0], reverse=True)[:TOP_BY_COUNT]
    return {name: {"launches": launches, "device_ms": round(ms, 3)} for name, (launches, ms) in ranked}


def _instrumented_step(step: TrainStep, device: torch.device) -> dict:
    """One instrumented step: FLOPs, aten ops and host syncs, those of forward+backward and of the optimizer apart
    (torch's CPU AdamW reads each parameter's step count on the host; the fused CUDA one does not)."""
    flops = 0
    counted = {}
    for phase, call in (("forward_backward", step.forward_backward), ("optimizer", step.optimizer_step)):
        cuda_syncs = CudaSyncWarnings() if device.type == "cuda" else contextlib.nullcontext()
        with HostSyncCounter() as syncs, cuda_syncs:
            flops += count_flops(call)["total"]
        synchronize(device)  # outside: an explicit synchronize is not one of the step's syncs
        counted[phase] = (syncs, cuda_syncs)
    fwd_bwd, optimizer = counted["forward_backward"][0], counted["optimizer"][0]
    figures = dict(
        flops_per_step=flops,
        aten_ops_per_step=fwd_bwd.ops + optimizer.ops,
        aten_ops_forward_backward=fwd_bwd.ops,
        host_syncs=fwd_bwd.total + optimizer.total,
        host_syncs_forward_backward=fwd_bwd.total,
        host_syncs_optimizer=optimizer.total,
        host_syncs_by_op=dict((fwd_bwd.counts + optimizer.counts).most_common()),
    )
    if device.type == "cuda":
        figures["cuda_sync_warnings"] = sum(cuda.count for _, cuda in counted.values())
        figures["cuda_sync_warnings_forward_backward"] = counted["forward_backward"][1].count
        figures["cuda_sync_sources"] = dict(
            sum((cuda.sources for _, cuda in counted.values()), collections.Counter()).most_common()
        )
    return figures


def device_allocations(device: torch.device) -> int | None:
    """How many times the CUDA caching allocator has called ``cudaMalloc`` so far (``torch.cuda.memory_stats``'
    ``num_device_alloc``); None off CUDA or where torch does not count them."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_device_alloc")


# ---------------------------------------------------------------------------------------------------------------------


def host_syncs_check(
    preset: str = "1b",
    shape: tuple[int, int] | None = None,
    device: torch.device | None = None,
    deadline: Deadline | None = None,
    variants: tuple[str | None, ...] = (None, "eager"),
    top: int = 10,
) -> dict:
    """Device-to-host syncs of one training forward+backward of `preset` (bench/README.md). `variants`:
    experts implementations (None: the preset's own)."""
    from modeling_spider import SpiderForConditionalGeneration

    device = device or default_device()
    deadline = deadline or Deadline(None)
    shape = shape or ((32, 256) if device.type == "cuda" else (2, 256))
    proxy = preset == "1b" and device.type != "cuda"
    config = spider_config("proxy_1b" if proxy else preset)
    torch.manual_seed(0)
    model = build_on(lambda: SpiderForConditionalGeneration(config), device).train()
    step = train_step_of(model, random_bytes(*shape).to(device), device)  # forward+backward only, grads reset
    results = {}
    for variant in variants:
        label = variant or config._experts_implementation
        if deadline.expired(MIN_PART_S):
            results[label] = {"status": "skipped", "reason": TIME_BUDGET}
            continue
        model.set_experts_implementation(variant or config._experts_implementation)
        model.zero_grad(set_to_none=True)
        step.forward_backward()  # warm-up: first-call plans and allocations are not the steady state
        model.zero_grad(set_to_none=True)
        synchronize(device)
        cuda_syncs = CudaSyncWarnings() if device.type == "cuda" else contextlib.nullcontext()
        with cuda_syncs, HostSyncCounter() as counter:
            step.forward_backward()
        synchronize(device)  # outside the count: an explicit synchronize is not one of the step's syncs
        result = {
            "status": "passed",
            "dispatch_count": counter.total,
            "aten_ops_forward_backward": counter.ops,
            "dispatch_by_op": dict(counter.counts.most_common()),
            "dispatch_top_sources": dict(counter.sources.most_common(top)),
        }
        if device.type == "cuda":
            result.update(
                cuda_sync_warnings=cuda_syncs.count, cuda_top_sources=dict(cuda_syncs.sources.most_common(top))
            )
        results[label] = result
    del model, step
    free_memory()
    peer_ops = None  # the launch proxy's yardstick: transformers' DeepseekV3 of the same config, same batch
    if not deadline.expired(MIN_PART_S):
        peer = build_on(lambda: peer_model(config), device).train()
        peer_step = train_step_of(peer, random_bytes(*shape).to(device), device)
        peer_step.forward_backward()
        peer.zero_grad(set_to_none=True)
        with HostSyncCounter(record_sources=False) as counter:
            peer_step.forward_backward()
        peer_ops = counter.ops
        del peer, peer_step
        free_memory()
    ran = [r for r in results.values() if r["status"] == "passed"]
    return entry(
        "host_syncs",
        "passed" if ran else "skipped",
        "" if len(ran) == len(results) else TIME_BUDGET,
        deepseek_v3_aten_ops_forward_backward=peer_ops,
        device=str(device),
        preset=preset + (" structure at tiny widths (CPU proxy)" if proxy else ""),
        shape=f"{shape[0]}x{shape[1]}",
        method=(
            "torch.cuda.set_sync_debug_mode('warn') warnings and HostSyncCounter"
            if device.type == "cuda"
            else "HostSyncCounter (TorchDispatchMode + Tensor.tolist)"
        ),
        variants=results,
    )


# ---------------------------------------------------------------------------------------------------------------------
# attention_backends
# ---------------------------------------------------------------------------------------------------------------------


def attention_backends_check(
    preset: str = "1b",
    batch: int | None = None,
    segment_counts=None,
    visits: int = 5,
    device: torch.device | None = None,
    deadline: Deadline | None = None,
) -> dict:
    """SDPA forward+backward per kernel at `preset`'s recurrent-layer attention over a shuffled sequence of padded
    segment counts (``spider-measure-sdpa-backends``'s :func:`sdpa_backend_timings`). `batch`: default 32 on CUDA, 4
    on CPU. A measurement: passes when torch's default and every kernel that takes the call ran."""
    from spider_training.commands.measure_sdpa_backends import SDPA_SEGMENT_COUNTS, sdpa_backend_timings

    device = device or default_device()
    deadline = deadline or Deadline(None)
    batch = batch or (32 if device.type == "cuda" else 4)
    timings = sdpa_backend_timings(
        preset, batch, tuple(segment_counts or SDPA_SEGMENT_COUNTS), visits, device, stop_at=deadline.at_fraction(0.9)
    )
    backends = timings["backends"]
    failed = [f"{name}: {r['reason']}" for name, r in backends.items() if r["status"] == "failed"]
    if failed:
        status, reason = "failed", "; ".join(failed)
    elif backends.get("default", {}).get("status") != "ran":
        status, reason = "skipped", backends.get("default", {}).get("reason", "the default did not run")
    else:
        timed_out = [name for name, r in backends.items() if r.get("reason") == TIME_BUDGET]
        status, reason = "passed", f"{TIME_BUDGET}: {', '.join(timed_out)} not timed" if timed_out else ""
    return entry("attention_backends", status, reason, **timings)


# ---------------------------------------------------------------------------------------------------------------------
# fp8, tile_kernels_moe, fsdp2_fp8_all_gather
