"""Each training step's wall time and segment axis, and their summary: which steps were slow and whether they were the
steps that met a segment count for the first time.

Spider's segment axis (``1 + S``, padded to ``pad_segments_to_multiple_of``) varies from batch to batch; a step at an
axis size the process has not met yet costs more (on the H200 about 5x a repeated one: cuDNN plans attention once per
shape, ``torch.compile`` traces once per shape). :class:`StepTimes` is a ``TrainerCallback`` that records both per
step (``Trainer(callbacks=[StepTimes()])``); :func:`step_time_summary` says how many steps were slow and how many of
those met a new axis. ``python -m bench.gpu_check``'s training runs, ``experiments.quality`` and ``bench.train_step``
time their steps with it.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from transformers import TrainerCallback

#: a step slower than this many times the median is named in :func:`step_time_summary`
SLOW_STEP_FACTOR = 2.0


class SegmentAxisRecorder:
    """The segment axis ``1 + S`` of each forward of a Spider model, read from the segments' shape by a forward hook
    on ``model.model.flexitokens`` (no host sync; eager glue in a compiled model too) into :attr:`sizes`. Inert
    (:attr:`active` False) for a model without one (transformers' peers)."""

    def __init__(self, model: torch.nn.Module):
        self.sizes: list[int] = []
        flexitokens = getattr(getattr(model, "model", None), "flexitokens", None)
        self._handle = flexitokens.register_forward_hook(self._record) if flexitokens is not None else None

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _record(self, module, args, output) -> None:
        self.sizes.append(int(output[2].shape[1]))

    def step(self, call):
        """Run `call()`; returns its result and the axis size of its first forward (None: no forward recorded)."""
        before = len(self.sizes)
        result = call()
        return result, (self.sizes[before] if len(self.sizes) > before else None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class StepTimes(TrainerCallback):
    """Times every optimizer step through Trainer's callback events, so evaluation, logging and loading the next
    batch fall outside it (the step's host sync keeps the host within a step of the device).

    Attributes:
        step_times: seconds of each step, ``on_step_begin`` to ``on_step_end``.
        phase_times: ``(forward + backward + clipping, optimizer + scheduler + zeroing)`` seconds of each step (the
            split at ``on_pre_optimizer_step``).
        step_axes: each step's largest segment axis (:class:`SegmentAxisRecorder`; empty for a model without one and
            under ``torch_compile``, where a hook inside a compiled region would be traced).
    """

    def __init__(self):
        self.step_times: list[float] = []
        self.phase_times: list[tuple[float, float]] = []
        self.step_axes: list[int | None] = []
        self._begin = self._backward_done = None
        self._axis, self._axis_mark = None, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._axis is None and not getattr(args, "torch_compile", False):
            recorder = SegmentAxisRecorder(model)
            self._axis = recorder if recorder.active else None

    def on_train_end(self, args, state, control, **kwargs):
        if self._axis is not None:
            self._axis.close()
            self._axis = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()
        self._axis_mark = len(self._axis.sizes) if self._axis is not None else 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._backward_done = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._begin is None:
            return
        end = time.perf_counter()
        self.step_times.append(end - self._begin)
        split = self._backward_done if self._backward_done is not None else end
        self.phase_times.append((split - self._begin, end - split))
        self._begin = self._backward_done = None
        if self._axis is not None:  # the step's forwards (micro-batches) only: evaluation runs after this
            sizes = self._axis.sizes[self._axis_mark :]
            self.step_axes.append(max(sizes) if sizes else None)

    def summary(self, slow_factor: float = SLOW_STEP_FACTOR) -> dict | None:
        """:func:`step_time_summary` of the steps so far, with their segment axes."""
        return step_time_summary(self.step_times, slow_factor, self.step_axes)


def split_by_axis(axes: list, times: list[float], met_before=()) -> tuple[list[int], list[float]]:
    """Steps in order, each with its segment axis size in `axes` and its seconds in `times` (equal lengths): the
    0-based indices of the steps that met their size first (not in `met_before`, nor at an earlier step), and the
    seconds of the others (steps at a size already met)."""
    seen, new, repeated = set(met_before), [], []
    for index, (size, seconds) in enumerate(zip(axes, times)):
        if size in seen:
            repeated.append(seconds)
        else:
            new.append(index)
            seen.add(size)
    return new, repeated


def step_time_summary(
    step_times: list[float], slow_factor: float = SLOW_STEP_FACTOR, step_axes: list[int | None] | None = None
) -> dict | None:
    """Wall seconds of a run's steps (:attr:`StepTimes.step_times`): count, median, mean, 90th percentile, max, and
    the steps slower than `slow_factor` x the median (1-based step numbers, the first 50). With `step_axes` (each
    step's segment axis, as long as `step_times`): the sizes met (``axis_sizes``), the steps that met one first
    (``new_axis_steps``, 1-based), how many slow steps were among them (``slow_steps_at_new_axis``) and the median of
    the other steps (``median_s_repeated_axis``). None for no steps."""
    if not step_times:
        return None
    median = statistics.median(step_times)
    ordered = sorted(step_times)
    slow = [i + 1 for i, t in enumerate(step_times) if t > slow_factor * median]
    summary = {
        "steps": len(step_times),
        "median_s": round(median, 4),
        "mean_s": round(statistics.fmean(step_times), 4),
        "p90_s": round(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)], 4),
        "max_s": round(ordered[-1], 4),
        "slow_factor": slow_factor,
        "slow_steps": len(slow),
        "slow_step_numbers": slow[:50],
    }
    if step_axes and len(step_axes) == len(step_times):
        new, repeated = split_by_axis(step_axes, step_times)
        new = [i + 1 for i in new]
        summary.update(
            axis_sizes=sorted({size for size in step_axes if size is not None}),
            new_axis_steps=new[:50],
            slow_steps_at_new_axis=len(set(slow) & set(new)),
            median_s_repeated_axis=round(statistics.median(repeated), 4) if repeated else None,
        )
    return summary


def repeated_axis_summary(axis_before: list, timed_axis: list, times: list[float]) -> dict:
    """How many of the steps `times` (their axes `timed_axis`) met a segment axis that neither an earlier step nor
    `axis_before` (the steps before them: warm-up) had met (``timed_steps_at_new_axis``), and the median seconds of
    the others (``step_s_repeated_axis``, None when none): what a long run's steps cost once its few axis sizes have
    all been met (the main job met 11 in 500 steps, the last new one at step 86)."""
    new, repeated = split_by_axis(timed_axis, times, met_before=axis_before)
    return {
        "timed_steps_at_new_axis": len(new),
        "step_s_repeated_axis": statistics.median(repeated) if repeated else None,
    }
