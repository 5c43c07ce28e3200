"""Shared pieces of the benchmarks: timing, environment record, model builders, profiling, results (FLOP counting and
the matmul peak: :mod:`spider_training.throughput`, what the trainer logs).

Timing rules: every figure is a ratio of two variants measured side by side in one process on this
machine; each variant gets ``warmup`` untimed calls, then ``repeats`` timed calls, and the **median** is used.
Variants are interleaved (A, B, A, B, ...) by :func:`time_interleaved` so that load from other processes hits
both alike.

Result format (what every ``bench.<name>.run`` returns, and :mod:`bench.report` reads)::

    {"benchmark": str, "description": str, "sizes": {...}, "dtype": str,
     "checks": [{"name": str, "metric": str, "target": float, "measured": float, "met": bool}, ...],
     "info": [{"name": str, "measured": float, "unit": str}]  (figures without a target),
     "met": bool, "measurements": {...}, "notes": [str], "profile": {...} (only when a target is missed),
     "seconds": float}

``met`` of a benchmark is ``all(check["met"])`` unless the module says otherwise in its docstring. A benchmark that
crashed is recorded by the runner as ``{"benchmark": name, "error": "...", "met": False, "checks": []}``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spider_training.mixed_precision import autocast_experts, shared_weight_casts
from spider_training.throughput import measured_matmul_flops, synchronize  # noqa: F401 (synchronize: bench's API)

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/moe.py` and `python -m bench.moe` both import the model files
    sys.path.insert(0, str(REPO_ROOT))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------------
# Environment and results
# ---------------------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, CPU model, load average at the time of the run."""
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": "cpu",
    }


def check(name: str, metric: str, target: float, measured: float | None, higher_is_better: bool = True) -> dict:
    """One target line: ``met`` is ``measured >= target`` (or ``<=`` when lower is better), judged on the recorded
    (rounded to 4 decimals) value so that the record agrees with itself; None -> not met."""
    if measured is None:
        met = False
    else:
        measured = float(round(measured, 4))
        met = bool(measured >= target) if higher_is_better else bool(measured <= target)
    return {
        "name": name,
        "metric": metric,
        "target": target,
        "comparison": ">=" if higher_is_better else "<=",
        "measured": None if measured is None else float(round(measured, 4)),
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


def peak_matmul_flops(dtype: torch.dtype, n: int = 2048, warmup: int = 2, repeats: int = 5) -> dict[str, float]:
    """Measured peak FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on CPU (2 n^3 FLOPs per call), median of
    repeats: the trainer's own measurement (:func:`spider_training.throughput.measured_matmul_flops`)."""
    return measured_matmul_flops("cpu", dtype, n=n, warmup=warmup, repeats=repeats)


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def spider_config(preset: str, **overrides):
    """``SpiderConfig.from_preset(preset, **overrides)``."""
    from configuration_spider import SpiderConfig

    return SpiderConfig.from_preset(preset, **overrides)


def spider_model(preset: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A freshly initialised ``SpiderForConditionalGeneration`` (seeded), in ``dtype``."""
    from modeling_spider import SpiderForConditionalGeneration

    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(spider_config(preset, **overrides)).to(dtype)


def peer_config(spider_cfg):
    """transformers' ``DeepseekV3Config`` with Spider's width, heads, MLA ranks, experts, layer count and vocab.

    Layers: ``num_hidden_layers = prelude + recurrent + coda``; ``first_k_dense_replace = num_prelude_layers`` makes
    the prelude dense. DeepseekV3 cannot make a *last* layer dense (``layer_idx >= first_k_dense_replace`` is MoE),
    so the peer's coda layers are MoE layers -- a documented mismatch. Routing: one group (``n_group=topk_group=1``),
    no multi-token prediction, non-interleaved RoPE as in Spider, SDPA attention, transformers' default experts
    implementation.
    """
    from transformers import DeepseekV3Config

    c = spider_cfg
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts,
        n_routed_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim,
        v_head_dim=c.v_head_dim,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=c.num_prelude_layers,
        norm_topk_prob=c.norm_topk_prob,
        max_position_embeddings=c.max_position_embeddings,
        num_mtp_layers=0,
        rope_interleave=False,
        rms_norm_eps=c.rms_norm_eps,
        initializer_range=c.initializer_range,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        use_cache=False,
        attn_implementation="sdpa",
    )


def peer_model(spider_cfg, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A freshly initialised ``DeepseekV3ForCausalLM`` built from :func:`peer_config`."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(peer_config(spider_cfg)).to(dtype)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_bytes(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    """int64 ``(batch, length)`` ids drawn uniformly from the 256 byte values (no specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


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
        autocast_experts(model)

    def forward_backward(self):
        """Forward with labels and backward; returns the model output. Each call begins a new CUDA graph generation
        (``torch.compiler.cudagraph_mark_step_begin``, as ``SpiderTrainer.training_step`` does under
        ``reduce-overhead``): the compiled layers' forwards all run before their backwards."""
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


def main_for(run: Callable[..., dict], argv: list[str] | None = None) -> dict:
    """``python -m bench.<name> [--quick] [--out FILE]``: run one benchmark, print (and write) its JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=(run.__module__ or "").split(".")[-1] + " benchmark")
    parser.add_argument("--quick", action="store_true", help="toy sizes (seconds, not minutes)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = {"environment": environment(), "quick": args.quick, "benchmarks": {}}
    single = run(quick=args.quick)
    result["benchmarks"][single["benchmark"]] = single
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Device-to-host syncs, GPU matmul peak (bench/gpu_check.py, tests/test_host_syncs.py)
# ---------------------------------------------------------------------------------------------------------------------

#: aten ops whose output size or value has to reach the host before the next op can be launched
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "bincount",
    "unique_consecutive",
    "_unique2",
    "unique_dim",
    "equal",
}
_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
_SKIPPED_SOURCE_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}contextlib.py", f"{os.sep}bench{os.sep}common.py")


def _calling_line() -> str | None:
    """``path:line`` of the innermost Python frame outside torch, contextlib and this file (the model or trainer line
    that asked for the value), relative to the repository root when inside it."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _SKIPPED_SOURCE_PARTS):
            try:
                filename = str(Path(filename).resolve().relative_to(REPO_ROOT))
            except ValueError:
                pass
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _host_copy(func_name: str, args, kwargs) -> str | None:
    """``"copy to host"``: a copy from an accelerator tensor into host memory (``.cpu()``, ``.to("cpu")``,
    ``cpu_tensor.copy_(gpu)``); ``"copy to device"``: a blocking copy from host memory into an accelerator tensor
    (``cpu_tensor.to("cuda")``, ``gpu.copy_(cpu)`` without ``non_blocking``), which ATen runs as ``memcpy_and_sync``,
    waiting for the stream (``Copy.cu``); None for any other op."""
    kwargs = kwargs or {}
    if func_name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None:
        source, target = args[0].device.type, torch.device(kwargs["device"]).type
        non_blocking = kwargs.get("non_blocking", False)
    elif func_name in ("copy_", "copy") and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        source, target = args[1].device.type, args[0].device.type
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return None
    if source != "cpu" and target == "cpu":
        return "copy to host"
    if source == "cpu" and target != "cpu" and not non_blocking:
        return "copy to device"
    return None


def graphs_compiled(call) -> tuple:
    """Run `call()`; returns its result and how many graphs ``torch.compile`` compiled meanwhile (dynamo's
    ``unique_graphs`` counter: first compilations and recompilations alike, 0 for an eager model). A step that
    compiles is slow for it: ``TORCH_LOGS=recompiles`` prints why."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    result = call()
    return result, counters["stats"]["unique_graphs"] - before


#: profiler event names that mark code ``torch.compile`` runs: a region's forward and its backward
COMPILED_REGION_EVENTS = ("Torch-Compiled Region", "CompiledFunction", "CompiledFunctionBackward")


#: aten ops other than views that launch no kernel: left out of the op counts that stand in for launches
NO_KERNEL_OPS = ("detach", "empty", "empty_like", "empty_strided")


@functools.cache
def _is_view_op(name: str) -> bool:
    """Whether the aten op `name` (``"aten::transpose"``) is a view or one of :data:`NO_KERNEL_OPS`: no kernel of its
    own."""
    op = name.removeprefix("aten::")
    if op in NO_KERNEL_OPS:
        return True
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return False
    return any(getattr(packet, overload).is_view for overload in packet.overloads())


def eager_aten_ops(events, top: int = 10) -> dict:
    """The aten ops that ran eagerly in a ``torch.profiler`` trace (`events`: ``prof.events()``, CPU activity): the
    outermost ``aten::`` events (an op's own sub-ops are not counted again) that are not nested, on the same thread,
    in a compiled region's event (:data:`COMPILED_REGION_EVENTS`), views, ``detach`` and ``empty*`` left out. For a
    compiled model these are the glue between the regions; on a GPU each is a kernel launch from Python. Returns
    ``{"count": int, "by_op": {name: count}}`` with the `top` most frequent names."""
    import collections

    by_thread: dict[int, list] = collections.defaultdict(list)
    for event in events:
        by_thread[event.thread].append(event)
    counts = collections.Counter()
    for thread_events in by_thread.values():
        stack = []  # (end, compiled?, aten?) of the events enclosing the current one
        for event in sorted(thread_events, key=lambda e: (e.time_range.start, -e.time_range.end)):
            while stack and stack[-1][0] <= event.time_range.start:
                stack.pop()
            compiled = event.name.startswith(COMPILED_REGION_EVENTS)
            aten = event.name.startswith("aten::")
            if aten and not any(c or a for _, c, a in stack) and not _is_view_op(event.name):
                counts[event.name] += 1
            stack.append((event.time_range.end, compiled, aten))
    return {"count": sum(counts.values()), "by_op": dict(counts.most_common(top))}


class HostSyncCounter(TorchDispatchMode):
    """Counts the device-to-host synchronisations run inside the context, on any device.

    A ``TorchDispatchMode`` sees every aten op (backward included: the autograd engine carries the mode to its
    threads): it counts :data:`SYNC_OPS` (``.item()``, ``bool(tensor)`` and ``int(tensor)`` arrive as
    ``_local_scalar_dense``), ``index`` / ``index_put`` with a boolean index (a ``nonzero`` on the device),
    ``repeat_interleave`` without ``output_size``, copies from a device tensor into host memory, blocking copies from
    host memory into a device tensor (``"copy to device"``) and tensors made from Python or NumPy data
    (``"tensor from host data"``: ``torch.tensor(data, device=...)``, seen as ``lift_fresh``; on an accelerator it is a
    blocking host-to-device copy, which waits for the stream like any other sync; on CPU the counter cannot tell the
    line's device, so it counts every one). On CPU
    ``Tensor.tolist`` reads the data without dispatching any op, so with ``count_tolist`` (default) the context also
    wraps ``torch.Tensor.tolist`` and counts its calls as ``"tolist"`` (on a GPU the same call is one device-to-host
    copy, counted once, as ``"tolist"``).

    ``counts`` maps op name to calls; ``sources`` maps ``path:line`` (the innermost frame outside torch: the model's
    line that asked for the value) to calls; ``total`` is their sum. ``ops`` counts every aten op dispatched except
    views, ``detach`` and ``empty*`` (a CPU proxy for the kernels a GPU would launch).
    """

    def __init__(self, count_tolist: bool = True, record_sources: bool = True):
        super().__init__()
        import collections

        self.counts = collections.Counter()
        self.sources = collections.Counter()
        self.count_tolist = count_tolist
        self.record_sources = record_sources
        self.ops = 0
        self._original_tolist = None
        self._inside_tolist = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, name: str) -> None:
        self.counts[name] += 1
        if self.record_sources:
            self.sources[_calling_line() or "?"] += 1

    def __enter__(self):
        if self.count_tolist:
            original = self._original_tolist = torch.Tensor.tolist
            counter = self

            def tolist(tensor, *args, **kwargs):
                counter._count("tolist")
                counter._inside_tolist += 1
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    counter._inside_tolist -= 1

            torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._original_tolist is not None:
                torch.Tensor.tolist = self._original_tolist
                self._original_tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_KERNEL_OPS):
            self.ops += 1
        if self._inside_tolist:  # the copy a GPU tensor's .tolist() makes was counted as "tolist"
            pass
        elif name in SYNC_OPS:
            self._count(name)
        elif name in _INDEX_OPS:
            if len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
                self._count(f"{name} (boolean)")
        elif name == "repeat_interleave":
            if (kwargs or {}).get("output_size") is None and any(isinstance(a, torch.Tensor) for a in args[:2]):
                self._count(name)
        elif (copy := _host_copy(name, args, kwargs)) is not None:
            self._count(copy)
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self._count("tensor from host data")
        return func(*args, **(kwargs or {}))


class CudaSyncWarnings:
    """``torch.cuda.set_sync_debug_mode("warn")`` inside the context, every warning recorded
    (``warnings.catch_warnings(record=True)`` with ``simplefilter("always")``): ``count`` is the number of
    synchronising CUDA calls, ``sources`` maps the ``path:line`` each warning points at to its count (warnings raised
    during backward are replayed by autograd at the ``.backward()`` call). CUDA only."""

    MESSAGE = "synchroniz"  # "called a synchronizing CUDA operation"

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import collections

        torch.cuda.set_sync_debug_mode(self._previous)
        self._catch.__exit__(*exc)
        syncs = [w for w in self._records if self.MESSAGE in str(w.message)]
        self.count = len(syncs)
        self.sources = collections.Counter()
        for w in syncs:
            filename = w.filename
            try:
                filename = str(Path(filename).resolve().relative_to(REPO_ROOT))
            except ValueError:
                pass
            self.sources[f"{filename}:{w.lineno}"] += 1
        return False


def device_peak_matmul_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    n: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
) -> dict[str, float]:
    """The trainer's own measurement (:func:`spider_training.throughput.measured_matmul_flops`): the median of
    `repeats` timed ``n x n @ n x n`` matmuls on `device` (n: 8192 on CUDA, as ``/work/shared/NOTES.md``, 1024 on
    CPU)."""
    return measured_matmul_flops(device, dtype, n=n, warmup=warmup, repeats=repeats)


def dense_llama_config(spider_cfg, max_position_embeddings: int = 4096):
    """transformers' ``LlamaConfig`` of a dense byte model with about the parameter count of a Spider model built from
    `spider_cfg`: Spider's vocab, width, heads and dense-MLP width; the layer count is the one that brings the
    parameter count nearest to Spider's (untied embeddings, full multi-head attention, SDPA)."""
    from transformers import LlamaConfig

    from modeling_spider import SpiderForConditionalGeneration

    with torch.device("meta"):
        target = num_params(SpiderForConditionalGeneration(spider_cfg))
    c = spider_cfg
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    layers = max(1, round((target - 2 * v * h - h) / per_layer))
    return LlamaConfig(
        vocab_size=v,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        max_position_embeddings=max(max_position_embeddings, c.max_position_embeddings),
        tie_word_embeddings=False,
        rms_norm_eps=c.rms_norm_eps,
        initializer_range=c.initializer_range,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        use_cache=False,
        attn_implementation="sdpa",
    )
