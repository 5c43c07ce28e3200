"""What one training step does on the host besides computing: device-to-host synchronisations
(:class:`HostSyncCounter`, :class:`CudaSyncWarnings`), aten ops dispatched (``HostSyncCounter.ops``; on a launch-bound
GPU one kernel launch each), the aten ops a compiled model runs eagerly between its regions (:func:`eager_aten_ops`)
and the graphs ``torch.compile`` compiles (:func:`graphs_compiled`).

``SpiderTrainer`` counts the host syncs of its training steps with :class:`HostSyncCounter` when asked
(``--log_host_syncs``: ``host_syncs_per_step`` in the logs); ``python -m bench.gpu_check`` and the step table use all
four. Why syncs matter: on a GPU every value the host waits for drains the launch queue (torchtitan and PyTorch's
``torch.cuda.set_sync_debug_mode`` hunt the same; a dispatch mode sees them on CPU too, where the aten ops are the
GPU's).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

REPO_ROOT = Path(__file__).resolve().parent.parent

#: the widths the CPU proxy of the 1b preset takes from ``tiny`` (``host_syncs`` on CPU)
_WIDTH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "engram_num_heads",
    "engram_head_dim",
    "engram_table_size",
    "loop_adapter_rank",
    "max_position_embeddings",
)
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
_SKIPPED_SOURCE_PARTS = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}contextlib.py",
    f"{os.sep}spider_training{os.sep}profiling.py",
)


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


def proxy_1b_config(**overrides):
    """The ``1b`` preset's structure (layers, loops, experts, Engram layers, boundaries) at the ``tiny`` preset's
    widths: a CPU stand-in for counting host syncs, which depend on the structure and not the width."""
    from configuration_spider import SpiderConfig

    tiny = SpiderConfig.from_preset("tiny")
    return SpiderConfig.from_preset("1b", **{**{k: getattr(tiny, k) for k in _WIDTH_FIELDS}, **overrides})


class HostSyncsPerStep(TrainerCallback):
    """``--log_host_syncs``: a :class:`HostSyncCounter` open from each training step's start
    (``on_step_begin``: its micro-batches' forwards and backwards, Trainer's loss checks, gradient clipping, the
    optimizer step, the other callbacks' ``on_step_end`` when this one is added last) to its end (``on_step_end``),
    so that :meth:`read` gives the mean count per optimizer step since the previous read; ``SpiderTrainer`` logs it as
    ``host_syncs_per_step`` at every logging step. Nothing outside the steps (data loading, logging, evaluation,
    checkpoints) is counted.

    Costs: every aten op of a counted step goes through Python (the dispatch mode), so a step runs several times
    slower; ``torch.compile``'d layers run eagerly while counted (``torch.compiler.set_stance("force_eager")``: dynamo
    does not trace under a dispatch mode), so the count is the eager step's. Hence off by default (torchtitan's
    trainer likewise leaves its profiling off unless asked). Call :meth:`close` if training stops mid-step (an
    exception): ``SpiderTrainer.train`` does.
    """

    def __init__(self):
        self._open: contextlib.ExitStack | None = None
        self._counter: HostSyncCounter | None = None
        self._syncs = 0
        self._steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.close()
        self._open = contextlib.ExitStack()
        self._open.enter_context(torch.compiler.set_stance("force_eager"))
        self._counter = self._open.enter_context(HostSyncCounter(record_sources=False))

    def on_step_end(self, args, state, control, **kwargs):
        if self._counter is not None:
            self._syncs += self._counter.total
            self._steps += 1
        self.close()

    def close(self) -> None:
        """Leave the counter and the eager stance if a step left them open (nothing is added to the counts)."""
        if self._open is not None:
            self._open.close()
        self._open, self._counter = None, None

    def read(self) -> dict[str, float]:
        """``{"host_syncs_per_step": mean syncs per step since the previous read}`` (4 significant digits); empty
        when no step ended since then."""
        if not self._steps:
            return {}
        mean = self._syncs / self._steps
        self._syncs, self._steps = 0, 0
        return {"host_syncs_per_step": float(f"{mean:.4g}")}
