"""spider_training.step_times: each training step's wall time and segment axis (StepTimes, a TrainerCallback) and
their summary."""

import time

import torch

from spider_training.step_times import StepTimes, repeated_axis_summary, step_time_summary
from tests.helpers import cpu_trainer


def test_step_time_summary_counts_the_slow_steps():
    """Steps over twice the median are named (1-based); the percentiles come from the sorted times."""
    times = [0.25, 0.26, 1.4, 0.25, 0.24, 0.26, 0.25, 1.3, 0.25, 0.26]
    summary = step_time_summary(times)
    assert summary["steps"] == 10 and summary["median_s"] == 0.255 and summary["max_s"] == 1.4
    assert summary["slow_steps"] == 2 and summary["slow_step_numbers"] == [3, 8]
    assert summary["p90_s"] == 1.3 and summary["mean_s"] == round(sum(times) / 10, 4)
    assert step_time_summary([]) is None
    assert step_time_summary(times, slow_factor=6.0)["slow_steps"] == 0
    assert "new_axis_steps" not in summary  # no axes given


def test_step_time_summary_with_each_steps_segment_axis():
    """Given each step's segment axis, the summary names the steps that met a size first and how many of the slow
    steps they were, and takes the median of the others."""
    times = [3.0, 0.25, 1.4, 0.26, 0.25, 1.3, 0.24]
    axes = [64, 64, 80, 64, 80, 96, 80]
    summary = step_time_summary(times, step_axes=axes)
    assert summary["axis_sizes"] == [64, 80, 96] and summary["new_axis_steps"] == [1, 3, 6]
    assert summary["slow_step_numbers"] == [1, 3, 6] and summary["slow_steps_at_new_axis"] == 3
    assert summary["median_s_repeated_axis"] == 0.25  # of 0.25, 0.26, 0.25, 0.24
    assert "new_axis_steps" not in step_time_summary(times, step_axes=axes[:3])  # lengths differ


def test_repeated_axis_summary_times_the_steps_at_an_axis_met_before():
    """A timed step counts as repeated when a warm-up, instrumented or earlier timed step ran its segment axis."""
    summary = repeated_axis_summary([64, 80], [80, 96, 96, 112, 64], [0.25, 1.4, 0.26, 1.3, 0.24])
    assert summary["timed_steps_at_new_axis"] == 2  # 96 first, 112
    assert summary["step_s_repeated_axis"] == 0.25  # median of 0.25 (80), 0.26 (96 again), 0.24 (64)
    assert repeated_axis_summary([], [48, 64], [1.0, 1.1]) == {
        "timed_steps_at_new_axis": 2,
        "step_s_repeated_axis": None,
    }


def test_step_times_records_every_step_of_a_trainer_run(tmp_path):
    """In a real Trainer run: one wall time per optimizer step, split at the optimizer (both parts positive, summing to
    the step), one segment axis per step from the model's own forwards (a multiple of the padding, at least the null
    segment's), and the forward hook gone after training."""
    times = StepTimes()
    trainer = cpu_trainer(tmp_path, max_steps=3, trainer_kwargs={"callbacks": [times]})
    trainer.train()
    assert len(times.step_times) == len(times.phase_times) == len(times.step_axes) == 3
    # three differences of perf_counter readings: each rounds at the readings' magnitude
    tol = 4 * torch.finfo(torch.float64).eps * time.perf_counter()
    for total, (forward_backward, optimizer) in zip(times.step_times, times.phase_times):
        assert forward_backward > 0 and optimizer > 0
        assert abs(forward_backward + optimizer - total) <= tol
    pad = trainer.model.config.pad_segments_to_multiple_of
    assert all(axis >= 1 and axis % pad == 0 for axis in times.step_axes), times.step_axes
    assert not trainer.model.model.flexitokens._forward_hooks
    summary = times.summary()
    assert summary["steps"] == 3 and summary["axis_sizes"] == sorted(set(times.step_axes))
