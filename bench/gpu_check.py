"""GPU check: the one command a user with a GPU runs.

    python -m bench.gpu_check [--out gpu_check.json]                               # one GPU, under 8 minutes
    python -m bench.gpu_check --only fp8 tile_kernels_moe --budget_s 300           # a subset, another budget
    torchrun --nproc_per_node 2 -m bench.gpu_check --only fsdp2_fp8_all_gather     # FSDP2 over NCCL (>= 2 GPUs)

It prints one JSON result (``--out FILE`` also writes it; everything the parts print, the trainer's progress
included, goes to stderr). ``checks`` holds one entry per check, each with ``status`` ``"passed"``, ``"failed"`` or
``"skipped"``, a ``reason`` (empty when passed) and its figures; ``passed`` is true when no check failed; ``parts``
records each part's time allowance and wall time.

Parts, in the order they run (most important first; see "Time budget"):

- ``main_job``: the README's main job end to end, :func:`spider_training.train.main` with its defaults (the
  ``small`` preset on the embedded SOTU corpus, 500 steps, held-out scoring before, during and after, a sample, a
  release folder) in a temporary output folder; then the release is loaded with
  ``AutoModelForCausalLM.from_pretrained(release, trust_remote_code=True)`` onto the device and generates a few bytes
  there (``--main_job_steps``, ``--main_job_preset`` and ``--main_job_args`` change the run). Figures: steps,
  seconds, held-out bits per byte before / after and by loop count, the sample, the reload's device and bytes.
  Passes when the run finishes, held-out bits per byte fell, and the reloaded release generates on the device.
  (500 steps took 151 s on an H200 at f114b7e, 38 s at c2bcf51; the part 60 s.)
- ``step_table``: one training step (forward, backward, AdamW: fused on CUDA; bf16 autocast on CUDA, fp32 on CPU)
  at 32 x 256 and 8 x 2048 bytes, rows :data:`STEP_TABLE_MODELS` (``--step_table_models``): Spider ``1b`` (its default config,
  the fused experts on ``grouped_mm``; freshly initialised on uniform random bytes, its boundary predictor closes
  about 0.4 segments per byte, 1 + S = 128 slots at 32 x 256 on CPU), Spider at a trained model's segment rate
  (``spider_word_rate``: ``boundary_mode="fixed"``, a segment every ``round(1 / boundary_prior)`` bytes, 5 for
  ``1b``, so 1 + S = 64 slots at 256 bytes, the same slot count the SpaceByte teacher's 0.167 segments per byte on
  the SOTU text gives, where the 1b run's boundaries settle; the same modules and ops, and one axis size every step),
  transformers' ``DeepseekV3ForCausalLM`` of the same shape
  (:func:`bench.common.peer_config`; with fp32 master weights under autocast, as every row, its experts' grouped GEMMs
  run in fp32, torch's fallback on CUDA, where Spider's are cast to bf16: docs/design.md, "MoE experts"), a dense ``LlamaForCausalLM`` of about the same parameter count
  (:func:`bench.common.dense_llama_config`), then Spider as ``--precision fp8`` converts it (``spider_fp8``:
  ``Float8Linear`` where torchao's filter expects a gain, the experts through torchao's FP8 grouped GEMM where the GPU
  has it; the row says what was converted and why the rest was not), Spider as ``--compile`` compiles it
  (``spider_compiled``: accelerate's ``compile_regions``, ``--compile_backend``; three warm-up steps, whose times
  ``warmup_step_s`` include the compilation; no instrumented step, its FLOPs are the plain row's), and on request
  the word-rate model compiled the same way (``spider_word_rate_compiled``) and Spider with
  ``experts_implementation="eager"`` (``spider_eager_experts``: a loop over the experts, as the per-expert layout ran
  them); and ``spider_seed_recipe``: the seed's configuration, activation checkpointing at 112
  x 256 bytes (``--seed_recipe_shape``), in the precision ``--precision auto`` picks, and on request compiled too
  (``spider_seed_recipe_compiled``, for the 40,000 bytes/s target). The order: the comparison rows
  shape by shape (so a budget that runs out leaves the comparison at 32 x 256 complete), the seed's recipe, then the
  compiled rows (one compiled model, recompiled at the second shape; 82-86 s to compile on the H200; then the
  compiled word-rate model and the compiled seed's recipe), then the FP8 rows (the first FP8 step took 54 s there). Per
  row: step seconds (median of ``--step_repeats`` after the warm-up; ``step_s_min`` and ``step_times_s`` beside it:
  a step at a segment count not seen before costs more; Spider's rows record the padded segment axis of each warm-up,
  instrumented, timed and profiled step, ``segment_axis`` (:class:`SegmentAxisRecorder`), how many timed steps met a
  new one, ``timed_steps_at_new_axis``, and the median of the others, ``step_s_repeated_axis``; on CUDA each timed
  step's ``cudaMalloc`` calls, ``device_allocations_per_step``: a larger axis grows the allocator's pool; for a
  compiled model the graphs each warm-up and timed step compiled, ``graphs_compiled_per_step``), host seconds
  (``host_s``: until the step's last call returns, before the device is synchronised: how long the host takes to
  issue the step), bytes/s, peak memory (``torch.cuda.max_memory_allocated`` over the timed steps, weights and
  optimizer state included; null on CPU), FLOPs per step (:func:`bench.common.count_flops`), MFU against the matmul
  peak measured in-process (:func:`bench.common.device_peak_matmul_flops`: bf16 8192^3 on CUDA, fp32 on CPU), aten
  ops dispatched per step,
  host syncs per step, forward+backward and optimizer apart (:class:`bench.common.HostSyncCounter`; on CUDA also the
  ``set_sync_debug_mode`` warnings and the lines they point at, ``cuda_sync_sources``; torch's CPU AdamW reads each
  parameter's step count on the host, the fused CUDA one does not), and on CUDA, at the first shape (the profiler's
  post-processing of ~40k kernels takes seconds, and the launch count hardly depends on the shape), the kernels
  launched in one profiled step, the host's launch calls, the GPU busy time (``torch.profiler`` with CUDA activity;
  ``gpu_busy_fraction`` = busy time / median step time; for Spider also ``gpu_busy_fraction_repeated_axis``, over
  ``step_s_repeated_axis``), the ops with the most host time (``top_host_ops``), the kernels launched most often
  (``top_kernels``: launches and device milliseconds by kernel name) and the aten ops called most often
  (``top_aten_ops``). A
  measurement: passes when every row ran. On CPU the ``1b`` rows are skipped unless ``--step_table_shapes`` is given.
- ``host_syncs``: the device-to-host syncs of one Spider ``1b`` training forward+backward (32 x 256 bytes), with the
  default experts implementation (``grouped_mm``) and with ``eager``. On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` with the warnings
  recorded (:class:`bench.common.CudaSyncWarnings`), counted, with the top source lines; everywhere, the
  dispatch-level count by op and source line (:class:`bench.common.HostSyncCounter`: ``.item()``, ``nonzero``,
  boolean indexing, ... and ``Tensor.tolist``, which the sorted MoE path calls). On CPU the ``1b`` preset runs at the
  ``tiny`` preset's widths with the ``1b`` depth, loops and experts (the sync count depends on the structure, not
  the width; the full ``1b`` takes minutes per step there). Beside each count, the aten ops dispatched by the same
  forward+backward (``aten_ops_forward_backward``: every op but views, ``detach`` and ``empty*``; a proxy for the
  kernels a GPU launches, which tracked it on the H200: 32,344 ops, 40,967 launches) and those of transformers'
  ``DeepseekV3ForCausalLM`` of the same config (``deepseek_v3_aten_ops_forward_backward``). A measurement: passes
  when it ran.
- ``attention_backends``: which of torch's SDPA kernels the recurrent layers' attention should run
  (:func:`bench.attention.sdpa_backend_timings`): forward+backward at the ``1b`` preset's heads and head dims (query/key
  96, value 64), batch 32, bf16, causal without a mask (``is_causal``, as the training forward's recurrent layers call
  it), over the padded segment counts 80, 96, 112 (``1 + S`` at about one segment per 3 bytes of 32 x 256), each
  visited 5 times in a seeded shuffled order after one warm-up call at 32, for ``default`` (torch's own choice, run
  first as training runs it) and each of ``cudnn``, ``flash`` (the value zero-padded to 96), ``efficient`` and
  ``math`` alone (``torch.nn.attention.sdpa_kernel``). Per backend: the kernel that ran at each count (profiler op
  names), the first call at each new count (where cuDNN builds its execution plan) and the steady-state median,
  ``torch.cuda.synchronize`` before and after each call, the host's share (until the call has been launched), the
  whole sequence's total, and ``first_calls_after`` where an earlier row ran the same kernel at these shapes (its plans
  were cached); a kernel that does not take the call is skipped with torch's reason. ``fastest_steady`` and
  ``fastest_sequence_total`` name the winners (the latter among the rows whose first calls were their own: on the
  H200 the ``cudnn`` row reused the plans ``default`` built, and its total of 6 ms against ``default``'s 307 ms hid
  the planning); ``--sdpa_backend`` (``spider_training.sdpa``) makes one the training
  default. On CPU at batch 4 (math, flash on CPU, the rest skipped). A measurement: passes when the default and every
  kernel that takes the call ran (``--attention_*`` flags change the sizes).
- ``run_1b``: ``--run_1b_steps`` (300) training steps of ``--preset 1b`` on the embedded corpus through
  :func:`spider_training.train.main` (bf16, 32 x 256 bytes per step, no activation checkpointing, the
  preset's experts implementation, ``grouped_mm``), held-out bits per
  byte scored 6 times along the way and the compression rate (bytes per segment) logged every few steps. Passes when
  the boundary rate of the last logged steps (``1 / compression_rate``) lies inside the prior's band, where the
  hinge ``relu(r - prior) + relu(prior - k*std - r)`` is zero (``boundary_prior``, ``boundary_prior_std``,
  ``boundary_prior_k`` of the trained config), and held-out bits per byte fell (last < first). Skipped without CUDA
  unless ``--run_1b_preset`` names a smaller preset (``--run_1b_steps``, ``--run_1b_batch``, ``--run_1b_experts`` and
  ``--run_1b_args`` change the run). If the time budget ends training early, the checks judge the steps that ran
  and the entry says how many. Reported beside the judgement: each step's wall time summarised (``step_seconds``,
  :func:`step_time_summary`: median, mean, 90th percentile, max, and how many steps took over twice the median,
  which is what a segment count not seen before costs in a real run; with each step's padded segment axis, the
  sizes met, the steps that met one first, how many of the slow steps those were and the median of the other
  steps), the mean ACT halting step along the run
  (``mean_halting_step``: loops per segment; near 1 means the later loops get no weight) and the held-out bits per
  byte at 1, 2 and 4 loops after training.
- ``fp8_<recipe>_<preset>``: torchao ``Float8Linear`` (real ``torch._scaled_mm`` on a GPU; emulated on CPU), and the
  experts through torchao's FP8 grouped GEMM where the GPU has it (``--fp8_experts auto``), against the same model in
  bf16 autocast, one training step on the same batch: the losses agree within ``FP8_LOSS_RTOL`` and
  the gradients point the same way (cosine >= ``FP8_GRAD_COSINE``); both step times and their ratio are reported
  (medians of ``--step_repeats`` steps after a warm-up; a speed-up above 1 is what FP8 is for; on CPU emulation the
  times mean nothing and are labelled so). Recipes
  ``tensorwise`` and ``rowwise``; presets ``small`` and ``1b`` (``1b`` needs CUDA); ``--fp8_layers`` by default ``auto`` for ``1b``
  (the layers ``--precision fp8`` converts there, so the step times are what ``--precision auto`` chooses by:
  ``spider_training.fp8.FP8_MEASURED``) and ``seed`` for the smaller presets (every layer kind the seed converted;
  ``auto`` converts none of their layers).
- ``tile_kernels_moe``: the TileKernels MoE routing (:func:`spider_training.tile_kernels_moe.swap_in_tile_kernels`)
  against the torch path on one MoE layer in fp32: outputs and gradients (input, expert weights) equal within
  fp32 summation-order roundoff; and the training-step speed ratio of the whole model (bf16 autocast).
  Needs CUDA and ``tile_kernels`` installed.
- ``fsdp2_fp8_all_gather``: under ``torchrun`` with >= 2 CUDA GPUs (NCCL), the model sharded with ``fully_shard`` per
  layer (as ``configs/accelerate/fsdp2.yaml``) and converted with torchao's ``enable_fsdp_float8_all_gather`` (what
  accelerate's ``AORecipeKwargs`` passes) trains 3 steps to the loss curve of the same FP8 model without float8
  all-gather.

Time budget: ``--budget_s`` (default 460 s, so that the command with its imports stays under 8 minutes) is shared
by the parts in the order above; each part gets at most its own cap (:data:`PART_CAPS_S`; ``--part_cap
step_table=400`` replaces one) and at most what is left, and is skipped with the reason "time budget" when less than
:data:`MIN_PART_S` is left. Inside its allowance a part
stops itself (the training runs stop early, keeping time for their final scoring and release; tables skip the rows
that no longer fit), and a hard limit (``SIGALRM``, main thread) cuts off a part still running at the end of its
allowance, reported as skipped for the time budget. The order: the main job is what every user runs; the step table,
the host syncs and the attention kernels are the GPU figures the project's performance work is judged by; the 1b
run is the only check of the 1b preset's training dynamics on a GPU; FP8 and TileKernels come last because their
GPU figures are recorded (FP8 slower than bf16 at every size measured, TileKernels 0.98x; H200, 2026-11-26) and
neither is on the default training path (``--precision auto`` picks bf16 on every CUDA device). The caps follow what
each part took on the H200 at c2bcf51 (``bench/gpu_check_h200.json``: main job 60 s, host syncs 7, attention 1, the
1b run 108 s for 237 of its 300 steps; the table's rows ~10 s each, a compiled one ~95 s). A default run there spends
its budget on the first five parts, and FP8 / TileKernels get what they leave; ``--only fp8 tile_kernels_moe`` runs
them alone.

Everything that can run on CPU does (``tests/test_gpu_check.py``, toy sizes through the size/steps flags: the main
job and the run on the ``tiny`` preset for a few steps, the step table, host syncs and attention kernels on
``tiny``, the FP8
comparison in emulation, the TileKernels comparison with a CPU test double of ``tile_kernels``); the GPU-only parts
report ``"skipped"`` with "needs CUDA" on a machine without one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import importlib
import json
import math
import os
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (CudaSyncWarnings, HostSyncCounter, TrainStep, count_flops, dense_llama_config,
                          device_peak_matmul_flops, eager_aten_ops, environment, graphs_compiled, num_params,
                          peer_model, random_bytes, spider_config, spider_model, synchronize)

FP8_RECIPES = ("tensorwise", "rowwise")
#: FP8 (e4m3, 3 mantissa bits) against bf16 (7 bits) at initialisation: the loss is a mean over every byte, so the
#: per-element rounding (up to 2^-4 relative) averages out far below this; a broken scale is off by orders more.
FP8_LOSS_RTOL = 0.02
FP8_GRAD_COSINE = 0.9
SHAPES = {"tiny": (2, 128), "small": (8, 256), "1b": (1, 2048)}  # (batch, bytes) of the compared FP8 step
PARTS = ("main_job", "step_table", "host_syncs", "attention_backends", "run_1b", "fp8", "tile_kernels_moe", "fsdp2_fp8_all_gather")
CHECKS = PARTS  # the name earlier versions used
#: each part's largest time allowance in seconds (see "Time budget" in the module docstring)
PART_CAPS_S = {"main_job": 90, "step_table": 220, "host_syncs": 20, "attention_backends": 15, "run_1b": 150,
               "fp8": 90, "tile_kernels_moe": 45, "fsdp2_fp8_all_gather": 90}
#: ops named in a profiled step's ``top_host_ops``
TOP_HOST_OPS = 8
#: kernels and aten ops named in a profiled step's ``top_kernels`` and ``top_aten_ops`` (by launches / calls)
TOP_BY_COUNT = 20
#: a part that would get less than this is skipped ("time budget")
MIN_PART_S = 5.0
DEFAULT_BUDGET_S = 460.0
STEP_TABLE_SHAPES = ((32, 256), (8, 2048))
#: the step table's rows at each shape (module docstring: the order they run in)
STEP_TABLE_MODELS = ("spider", "spider_word_rate", "deepseek_v3", "llama_dense", "spider_fp8", "spider_compiled")
#: every row kind ``--step_table_models`` may name (``spider_eager_experts``: the experts looped over, as the
#: per-expert layout ran them)
STEP_TABLE_MODEL_CHOICES = (*STEP_TABLE_MODELS, "spider_eager_experts", "spider_word_rate_compiled",
                            "spider_seed_recipe_compiled")
#: the rows that run first, shape by shape (the compiled, seed-recipe and FP8 rows follow: ``step_table_check``)
_COMPARISON_ROWS = ("spider", "spider_word_rate", "deepseek_v3", "llama_dense", "spider_eager_experts")
#: compiled rows and the eager row whose FLOPs each reports (a dispatch mode does not see into compiled graphs, so
#: they get no instrumented step)
_EAGER_TWIN = {"spider_compiled": "spider", "spider_word_rate_compiled": "spider_word_rate",
               "spider_seed_recipe_compiled": "spider_seed_recipe"}
#: warm-up steps before a row's timed steps (a compiled row compiles its regions and their structural variants, such
#: as the first loop's, during its first steps: ``graphs_compiled_per_step``)
STEP_TABLE_WARMUP = {"spider_compiled": 3, "spider_word_rate_compiled": 3, "spider_seed_recipe_compiled": 3}
#: the seed's micro-batch (``tk-train.py``: 112 windows of 256 bytes, activation checkpointing): the ``spider_seed_recipe``
#: row after the table
SEED_RECIPE_SHAPE = (112, 256)
#: the widths the CPU proxy of the 1b preset takes from ``tiny`` (``host_syncs`` on CPU)
_WIDTH_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size", "engram_num_heads",
                 "engram_head_dim", "engram_table_size", "loop_adapter_rank", "max_position_embeddings")
TIME_BUDGET = "time budget"
#: a training step slower than this x the run's median step counts as slow (``step_seconds.slow_steps``)
SLOW_STEP_FACTOR = 2.0


def _entry(name: str, status: str, reason: str = "", **figures) -> dict:
    return {"name": name, "status": status, "reason": reason, **figures}


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    """``Type: message`` and the innermost frame, for a JSON reason."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]


def parse_part_cap(text: str) -> tuple[str, float]:
    """``"step_table=400"`` -> ``("step_table", 400.0)``: a part of :data:`PARTS` and its cap in seconds (> 0)."""
    part, _, seconds = text.partition("=")
    if part not in PARTS:
        raise argparse.ArgumentTypeError(f"unknown part {part!r} in {text!r}; parts: {', '.join(PARTS)}")
    try:
        cap = float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PART=SECONDS such as step_table=400, got {text!r}") from None
    if not cap > 0:
        raise argparse.ArgumentTypeError(f"a part's cap must be > 0 seconds, got {text!r}")
    return part, cap


def parse_shape(text: str) -> tuple[int, int]:
    """``"32x256"`` -> ``(32, 256)`` (batch, bytes)."""
    try:
        batch, length = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxBYTES such as 32x256, got {text!r}") from None
    if batch < 1 or length < 2:
        raise argparse.ArgumentTypeError(f"batch must be >= 1 and bytes >= 2, got {text!r}")
    return batch, length


# ----------------------------------------------------------------------------------------------------------------------
# Time budget
# ----------------------------------------------------------------------------------------------------------------------


class Deadline:
    """A point in time (``time.monotonic``); ``Deadline(None)`` never expires."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def expired(self, needed: float = 0.0) -> bool:
        return self.left() <= needed

    def at_fraction(self, fraction: float, keep_s: float = 0.0) -> float | None:
        """The monotonic time at which a part should stop its main work: `fraction` of what is left from now, and at
        least `keep_s` before the end. None when unlimited."""
        if self.end is None:
            return None
        left = self.left()
        return time.monotonic() + max(0.0, min(fraction * left, left - keep_s))


class PartTimeout(BaseException):
    """Raised inside a part by the hard limit of its allowance (a ``BaseException``, like ``KeyboardInterrupt``, so
    that library code catching ``Exception`` does not swallow it)."""


@contextlib.contextmanager
def _hard_limit(seconds: float | None):
    """Raise :class:`PartTimeout` in the main thread after `seconds` (``SIGALRM``); no limit elsewhere."""
    usable = (seconds is not None and math.isfinite(seconds) and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def alarm(signum, frame):
        raise PartTimeout(f"cut off after its allowance of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _trainer_hook_class():
    from transformers import TrainerCallback

    class TrainerHook(TrainerCallback):
        """A ``TrainerCallback`` handed to :func:`spider_training.train.main` (``callbacks=``): keeps the run's
        ``state`` (``log_history``), the trained model's config and each step's wall time (``step_times``: from
        ``on_step_begin`` to ``on_step_end``, so evaluation and the next batch's loading are outside it; the step's
        one host sync keeps the host within a step of the device), each step's largest padded segment axis
        (``step_axes``, :class:`SegmentAxisRecorder`; empty for a model without one or under ``--compile``) and, with
        `stop_at` (``time.monotonic``), stops training at the first step that ends after it
        (``control.should_training_stop``: the run then scores, samples and writes its release as after its last
        step)."""

        def __init__(self, stop_at: float | None):
            self.stop_at = stop_at
            self.state = None
            self.config = None
            self.stopped_at_step = None
            self.step_times: list[float] = []
            self.step_axes: list[int | None] = []
            self._step_start = None
            self._axis = None
            self._axis_mark = 0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.state = state
            self.config = getattr(model, "config", None)
            # not under --compile: a hook inside a compiled region would be traced (and could specialise the axis)
            if model is not None and self._axis is None and not getattr(args, "torch_compile", False):
                recorder = SegmentAxisRecorder(model)
                self._axis = recorder if recorder.active else None

        def on_train_end(self, args, state, control, **kwargs):
            if self._axis is not None:
                self._axis.close()
                self._axis = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._step_start = time.perf_counter()
            self._axis_mark = len(self._axis.sizes) if self._axis is not None else 0

        def on_step_end(self, args, state, control, **kwargs):
            if self._step_start is not None:
                self.step_times.append(time.perf_counter() - self._step_start)
                self._step_start = None
                if self._axis is not None:  # the step's forwards (micro-batches) only: evaluation runs after this
                    sizes = self._axis.sizes[self._axis_mark:]
                    self.step_axes.append(max(sizes) if sizes else None)
            if self.stop_at is not None and time.monotonic() >= self.stop_at and not control.should_training_stop:
                control.should_training_stop = True
                self.stopped_at_step = state.global_step
            return control

    return TrainerHook


def _train_main(argv: list[str], stop_at: float | None):
    """``spider_training.train.main(argv)`` with a trainer hook (:func:`_trainer_hook_class`); returns (summary, hook,
    seconds)."""
    from spider_training import train as train_module

    hook = _trainer_hook_class()(stop_at)
    start = time.perf_counter()
    summary = train_module.main(argv, callbacks=[hook])
    return summary, hook, time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------------
# main_job
# ----------------------------------------------------------------------------------------------------------------------


def main_job_check(steps: int = 500, preset: str = "small", device: torch.device | None = None,
                   deadline: Deadline | None = None, extra_args: tuple[str, ...] = (),
                   prompt: str = "The state of the union is", new_bytes: int = 16) -> dict:
    """The README's main job in a temporary folder, then its release reloaded onto `device` to generate (see the
    module docstring). `extra_args` are appended to the training command line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or _device()
    deadline = deadline or Deadline(None)
    name = "main_job"
    figures = {"device": str(device), "preset": preset, "steps_requested": steps}
    with tempfile.TemporaryDirectory(prefix="spider_gpu_check_main_") as tmp:
        argv = ["--preset", preset, "--max_steps", str(steps), "--output_dir", os.path.join(tmp, "run"), *extra_args]
        # training stops early enough to keep 15% of the allowance (at least 20 s) for the final scoring, the sample,
        # the release and its reload
        stop_at = deadline.at_fraction(0.85, keep_s=max(20.0, 0.15 * min(deadline.left(), 1e9)))
        try:
            summary, hook, seconds = _train_main(argv, stop_at)
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - the check reports what broke
            return _entry(name, "failed", f"spider_training.train.main raised {_error(exc)}",
                          command=["spider_training.train.main", *argv], **figures)
        before = summary.get("eval_before_bits_per_byte")
        after = summary.get("eval_after_bits_per_byte")
        figures.update(steps=summary.get("steps"), seconds=round(seconds, 2),
                       train_runtime_s=_train_runtime(hook),
                       step_seconds=step_time_summary(hook.step_times, step_axes=hook.step_axes),
                       precision=summary.get("precision"),
                       moe_backend=summary.get("moe_backend"), parameters=summary.get("parameters"),
                       bits_per_byte_before=before, bits_per_byte_after=after,
                       bits_per_byte_by_loops=summary.get("bits_per_byte_by_loops"),
                       compression_rate_after=summary.get("eval_after_compression_rate"),
                       sample=summary.get("sample"), stopped_by_time_budget_at_step=hook.stopped_at_step)
        hook.state = hook.config = None  # nothing of the trained run outlives the part
        _free_memory()
        problems = []
        if hook.stopped_at_step is not None:
            figures["note"] = f"training stopped by the time budget at step {hook.stopped_at_step} of {steps}"
        if before is None or after is None:
            problems.append("no held-out bits per byte before/after in the run's summary")
        elif not after < before:
            problems.append(f"held-out bits per byte did not fall ({before:.4f} -> {after:.4f})")
        release = summary.get("release_dir")
        figures["release_written"] = bool(release) and Path(release, "config.json").is_file()
        try:
            model = AutoModelForCausalLM.from_pretrained(release, trust_remote_code=True).to(device).eval()
            tokenizer = AutoTokenizer.from_pretrained(release, trust_remote_code=True)
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1).to(device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_bytes,
                                     min_new_tokens=new_bytes, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            generated = out[0, ids.shape[1]:]
            reload_ok = out.device.type == device.type and generated.numel() == new_bytes
            figures.update(release_reload_ok=reload_ok, reload_device=str(out.device),
                           reload_class=type(model).__name__, generated_bytes=int(generated.numel()),
                           generated_text=tokenizer.decode(generated, skip_special_tokens=True))
            if not reload_ok:
                problems.append(f"the reloaded release generated {generated.numel()} of {new_bytes} bytes on "
                                f"{out.device}")
            del model
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            figures["release_reload_ok"] = False
            problems.append(f"reloading the release and generating on {device} raised {_error(exc)}")
    if problems and "note" in figures:
        problems.append(figures["note"])
    return _entry(name, "failed" if problems else "passed", "; ".join(problems), **figures)


def _train_runtime(hook) -> float | None:
    history = hook.state.log_history if hook.state is not None else []
    runtime = next((e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None)
    return None if runtime is None else round(float(runtime), 2)


# ----------------------------------------------------------------------------------------------------------------------
# run_1b
# ----------------------------------------------------------------------------------------------------------------------


def held_out_curve(log_history: list[dict]) -> list[tuple[int, float]]:
    """``[(step, bits_per_byte)]`` of every held-out scoring in a trainer's ``log_history`` (``eval_before_``,
    ``eval_``, ``eval_after_`` prefixes), in logging order."""
    curve = []
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith("eval") and key.endswith("_bits_per_byte") and isinstance(value, (int, float)):
                curve.append((int(entry.get("step", 0)), float(value)))
    return curve


def training_curve(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of `key` in the training logs (averaged over each logging window; evaluation entries,
    whose keys carry the ``eval_`` prefix, are not read)."""
    return [(int(e.get("step", 0)), float(e[key])) for e in log_history
            if key in e and isinstance(e[key], (int, float))]


def compression_curve(log_history: list[dict]) -> list[tuple[int, float]]:
    """``[(step, compression_rate)]`` of the training logs (bytes per segment, averaged over each logging window)."""
    return training_curve(log_history, "compression_rate")


def judge_1b_run(held_out: list[tuple[int, float]], compression: list[tuple[int, float]], boundary_prior: float,
                 boundary_prior_std: float, boundary_prior_k: float) -> tuple[str, str, dict]:
    """The ``run_1b`` checks on a run's curves: the last logged boundary rate ``1 / compression_rate`` inside
    ``[prior - k*std, prior]`` (where the rate hinge is zero) and held-out bits per byte falling (last < first).
    Returns ``(status, reason, figures)``."""
    low, high = boundary_prior - boundary_prior_k * boundary_prior_std, boundary_prior
    figures = {"boundary_rate_band": [low, high], "bytes_per_segment_band": [1 / high, 1 / low if low > 0 else None]}
    problems = []
    if not compression:
        problems.append("no compression_rate in the training logs")
    else:
        rate = 1.0 / compression[-1][1]
        figures.update(boundary_rate_end=rate, compression_rate_end=compression[-1][1])
        if not low <= rate <= high:
            problems.append(f"boundary rate {rate:.4f} at step {compression[-1][0]} is outside the prior's band "
                            f"[{low:.4f}, {high:.4f}]")
    if len(held_out) < 2:
        problems.append(f"{len(held_out)} held-out scoring(s) logged, need 2 to see a trend")
    else:
        first, last = held_out[0][1], held_out[-1][1]
        figures.update(bits_per_byte_first=first, bits_per_byte_last=last)
        if not last < first:
            problems.append(f"held-out bits per byte did not fall ({first:.4f} at step {held_out[0][0]} -> "
                            f"{last:.4f} at step {held_out[-1][0]})")
    return ("failed" if problems else "passed"), "; ".join(problems), figures


def run_1b_check(steps: int = 300, preset: str = "1b", batch: int = 32, seq_len: int = 256,
                 device: torch.device | None = None, deadline: Deadline | None = None,
                 experts_implementation: str | None = None, extra_args: tuple[str, ...] = ()) -> dict:
    """`steps` training steps of `preset` on the embedded corpus, judged by :func:`judge_1b_run` (see the module
    docstring). Skipped without CUDA for the ``1b`` preset."""
    device = device or _device()
    deadline = deadline or Deadline(None)
    name = "run_1b"
    if preset == "1b" and device.type != "cuda":
        return _entry(name, "skipped", "needs CUDA (300 steps of the 1b preset take days on a CPU)")
    figures = {"device": str(device), "preset": preset, "steps_requested": steps, "micro_batch": batch,
               "seq_len": seq_len, "experts_implementation": experts_implementation or "the preset's"}
    with tempfile.TemporaryDirectory(prefix="spider_gpu_check_1b_") as tmp:
        argv = ["--preset", preset, "--max_steps", str(steps), "--micro_batch", str(batch), "--seq_len", str(seq_len),
                "--output_dir", os.path.join(tmp, "run"), "--eval_steps", str(max(1, steps // 6)),
                "--logging_steps", str(max(1, min(10, steps // 10))), "--save_strategy", "no", "--sample_bytes", "0",
                "--no_gradient_checkpointing"]
        if device.type == "cuda":
            argv += ["--precision", "bf16"]
        if experts_implementation:  # the config field of releases before the fused experts, still mapped
            argv += ["--config_overrides", f"moe_implementation={experts_implementation}"]
        argv += list(extra_args)
        stop_at = deadline.at_fraction(0.8, keep_s=max(20.0, 0.2 * min(deadline.left(), 1e9)))
        try:
            summary, hook, seconds = _train_main(argv, stop_at)
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            return _entry(name, "failed", f"spider_training.train.main raised {_error(exc)}",
                          command=["spider_training.train.main", *argv], **figures)
        history = hook.state.log_history
        config = hook.config
        held_out, compression = held_out_curve(history), compression_curve(history)
        status, reason, judged = judge_1b_run(held_out, compression, config.boundary_prior,
                                              config.boundary_prior_std, config.boundary_prior_k)
        figures.update(steps=summary.get("steps"), seconds=round(seconds, 2), train_runtime_s=_train_runtime(hook),
                       precision=summary.get("precision"), parameters=summary.get("parameters"),
                       held_out_bits_per_byte=held_out, compression_rate=_thin(compression, 40),
                       eval_compression_rate_after=summary.get("eval_after_compression_rate"),
                       # reported, not judged: whether ACT keeps using the loops (docs/research_log.md: on CPU, the
                       # 1b preset at micro-batch 4 halted after about one loop from step 7 on)
                       mean_halting_step=_thin(training_curve(history, "mean_halting_step"), 40),
                       held_out_bits_per_byte_by_loops=summary.get("bits_per_byte_by_loops"),
                       boundary_prior=config.boundary_prior, boundary_prior_std=config.boundary_prior_std,
                       boundary_prior_k=config.boundary_prior_k,
                       step_seconds=step_time_summary(hook.step_times, step_axes=hook.step_axes), **judged)
        if hook.stopped_at_step is not None:
            figures["note"] = f"training stopped by the time budget at step {hook.stopped_at_step} of {steps}"
            if status == "failed":
                reason = f"{reason}; {figures['note']}"
        peak = [e["peak_memory_mb"] for e in history if "peak_memory_mb" in e]
        figures["peak_memory_mb"] = max(peak) if peak else None
        hook.state = hook.config = config = None
    return _entry(name, status, reason, **figures)


def step_time_summary(step_times: list[float], slow_factor: float = SLOW_STEP_FACTOR,
                      step_axes: list[int | None] | None = None) -> dict | None:
    """Wall seconds of a run's training steps (the trainer hook's ``step_times``): count, median, mean, 90th
    percentile, max, and the steps slower than `slow_factor` x the median (1-based step numbers; on the H200 a step at
    a segment count not seen before took 5x a repeated one). With `step_axes` (each step's padded segment axis, as
    long as `step_times`): the axis sizes met (``axis_sizes``), the steps that met one first (``new_axis_steps``,
    1-based), how many slow steps were among them (``slow_steps_at_new_axis``) and the median of the other steps
    (``median_s_repeated_axis``). None for no steps."""
    if not step_times:
        return None
    median = statistics.median(step_times)
    ordered = sorted(step_times)
    slow = [i + 1 for i, t in enumerate(step_times) if t > slow_factor * median]
    summary = {"steps": len(step_times), "median_s": round(median, 4),
               "mean_s": round(statistics.fmean(step_times), 4),
               "p90_s": round(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)], 4),
               "max_s": round(ordered[-1], 4), "slow_factor": slow_factor, "slow_steps": len(slow),
               "slow_step_numbers": slow[:50]}
    if step_axes and len(step_axes) == len(step_times):
        new, repeated = split_by_axis(step_axes, step_times)
        new = [i + 1 for i in new]
        summary.update(axis_sizes=sorted({size for size in step_axes if size is not None}), new_axis_steps=new[:50],
                       slow_steps_at_new_axis=len(set(slow) & set(new)),
                       median_s_repeated_axis=round(statistics.median(repeated), 4) if repeated else None)
    return summary


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


def _thin(points: list, at_most: int) -> list:
    """At most `at_most` of `points`, evenly spaced, the last one kept."""
    if len(points) <= at_most:
        return list(points)
    stride = math.ceil(len(points) / at_most)
    kept = points[::stride]
    return kept if kept[-1] == points[-1] else kept + [points[-1]]


# ----------------------------------------------------------------------------------------------------------------------
# step_table
# ----------------------------------------------------------------------------------------------------------------------


def _build(fn, device: torch.device):
    """`fn()` built on `device` directly (fast for 1B parameters on a GPU), else on CPU and moved."""
    if device.type != "cpu":
        try:
            with torch.device(device):
                return fn()
        except Exception:  # noqa: BLE001 - a constructor that insists on CPU tensors
            _free_memory()
    return fn().to(device)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.bfloat16 if device.type == "cuda" else None


def _train_step_of(model, ids: torch.Tensor, device: torch.device) -> TrainStep:
    """One training step as a user trains: bf16 autocast and fused AdamW on CUDA, fp32 and torch's AdamW on CPU."""
    return TrainStep(model, ids, autocast_dtype=_autocast_dtype(device), fused=device.type == "cuda")


def _profile_kernels(step, device: torch.device) -> dict:
    """Kernels launched by one `step` and the GPU's busy time (``torch.profiler`` with CUDA activity): device-side
    events (kernels, memcpy, memset), the host-side launch calls, the summed device time, the profiled wall time and
    the :data:`TOP_HOST_OPS` ops with the most self host time (``top_host_ops``: where a slow step's host time goes,
    e.g. a cuDNN plan built at a new segment count), and the aten ops run outside compiled regions
    (``eager_aten_ops``, :func:`bench.common.eager_aten_ops`: a compiled model's glue between its regions)."""
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
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx")]
    busy_us = sum(e.time_range.elapsed_us() for e in device_events)
    averages = prof.key_averages()
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_HOST_OPS]
    return {"kernel_launches": len(kernels), "device_events": len(device_events), "launch_calls": len(launches),
            "gpu_busy_s": busy_us / 1e6, "profiled_step_s": wall,
            "top_host_ops": {a.key: {"self_host_ms": round(a.self_cpu_time_total / 1e3, 3), "calls": a.count}
                             for a in top},
            "top_kernels": _kernels_by_launches(kernels),
            "top_aten_ops": {a.key: a.count for a in sorted((a for a in averages if a.key.startswith("aten::")),
                                                            key=lambda a: a.count, reverse=True)[:TOP_BY_COUNT]},
            "eager_aten_ops": eager_aten_ops(events)}


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
    figures = dict(flops_per_step=flops, aten_ops_per_step=fwd_bwd.ops + optimizer.ops,
                   aten_ops_forward_backward=fwd_bwd.ops, host_syncs=fwd_bwd.total + optimizer.total,
                   host_syncs_forward_backward=fwd_bwd.total, host_syncs_optimizer=optimizer.total,
                   host_syncs_by_op=dict((fwd_bwd.counts + optimizer.counts).most_common()))
    if device.type == "cuda":
        figures["cuda_sync_warnings"] = sum(cuda.count for _, cuda in counted.values())
        figures["cuda_sync_warnings_forward_backward"] = counted["forward_backward"][1].count
        figures["cuda_sync_sources"] = dict(sum((cuda.sources for _, cuda in counted.values()),
                                                collections.Counter()).most_common())
    return figures


class SegmentAxisRecorder:
    """The segment axis ``1 + S`` (padded to ``pad_segments_to_multiple_of``) of each forward of a Spider model: a
    forward hook on ``model.model.flexitokens``, compiled (accelerate's ``compile_regions`` wraps it) or not, reading
    the segments' shape (no host sync). Inert (:attr:`active` False) for a model without one (the transformers peers).

    On the H200 some steps took several times the others, most likely those at an axis size the process had not met
    (cuDNN plans attention once per shape; not yet traced): :meth:`step` tells which steps met one."""

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
        """Run `call()`; returns its result and the axis size of its first forward (None: no forward was
        recorded)."""
        before = len(self.sizes)
        result = call()
        return result, (self.sizes[before] if len(self.sizes) > before else None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def device_allocations(device: torch.device) -> int | None:
    """How many times the CUDA caching allocator has called ``cudaMalloc`` so far (``torch.cuda.memory_stats``'
    ``num_device_alloc``); None off CUDA or where torch does not count them."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_device_alloc")


def repeated_axis_summary(axis_before: list, timed_axis: list, times: list[float]) -> dict:
    """Which timed steps ran at a segment axis an earlier step of the row (`axis_before`: warm-up and instrumented
    steps; then the earlier timed steps) had met, and the median seconds of those (``step_s_repeated_axis``, None when
    none had): what a long run's steps cost once its few axis sizes have all been met (the main job met 11 in 500
    steps, the last new one at step 86). Inputs in step order; `timed_axis` and `times` of equal length."""
    new, repeated = split_by_axis(timed_axis, times, met_before=axis_before)
    return {"timed_steps_at_new_axis": len(new),
            "step_s_repeated_axis": statistics.median(repeated) if repeated else None}


def _step_row(model, label: str, shape: tuple[int, int], device: torch.device, repeats: int,
              peak_flops: float | None, profile: bool = True, warmup: int = 1, instrument: bool = True,
              flops: int | None = None) -> dict:
    """One row of the step table. `instrument`: run one instrumented step (FLOPs, aten ops, host syncs); off for a
    compiled model, whose graphs a dispatch mode does not see into: its FLOPs are then `flops` (its eager twin's,
    None when unknown), as they are when the instrumented step fails (``instrument_error``; the row is still timed)."""
    batch, length = shape
    row = {"model": label, "shape": f"{batch}x{length}", "status": "passed", "reason": ""}
    ids = random_bytes(batch, length).to(device)
    step = _train_step_of(model, ids, device)
    axis = SegmentAxisRecorder(model)
    try:
        return _timed_row(row, (batch, length), model, step, axis, device, repeats, peak_flops, profile, warmup,
                          instrument, flops)
    finally:
        axis.close()


def _timed_row(row: dict, shape: tuple[int, int], model, step, axis: SegmentAxisRecorder, device: torch.device,
               repeats: int, peak_flops: float | None, profile: bool, warmup: int, instrument: bool,
               flops: int | None) -> dict:
    """:func:`_step_row`'s measurements of `step` at `shape` (batch, bytes) into `row`; `axis` records Spider's
    segment axis per step."""
    batch, length = shape
    warmup_s, warmup_axis, compiled = [], [], {"warmup": [], "timed": []}

    def recorded_step(phase: str):
        """One step; its segment axis size, and the graphs it compiled recorded under `phase`."""
        (_, size), graphs = graphs_compiled(lambda: axis.step(step))
        compiled[phase].append(graphs)
        return size

    for _ in range(warmup):  # optimizer state, kernels' plans, compilation
        synchronize(device)
        start = time.perf_counter()
        warmup_axis.append(recorded_step("warmup"))
        synchronize(device)
        warmup_s.append(time.perf_counter() - start)
    row["warmup_step_s"] = [round(t, 3) for t in warmup_s]
    figures = dict(flops_per_step=flops, aten_ops_per_step=None, host_syncs=None)
    instrumented_axis = []
    if instrument:
        try:
            figures, size = axis.step(lambda: _instrumented_step(step, device))
            instrumented_axis = [size] if size is not None else []
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor subclass a counting mode trips on: time the row anyway
            model.zero_grad(set_to_none=True)
            figures["instrument_error"] = _error(exc)
    row.update(figures)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, host, timed_axis, allocations = [], [], [], []
    for _ in range(repeats):
        allocated_before = device_allocations(device)
        synchronize(device)
        start = time.perf_counter()
        timed_axis.append(recorded_step("timed"))
        host.append(time.perf_counter() - start)  # the host's time to issue the step (on CPU: the step)
        synchronize(device)
        times.append(time.perf_counter() - start)
        allocated_after = device_allocations(device)
        if allocated_before is not None and allocated_after is not None:
            allocations.append(allocated_after - allocated_before)
    if allocations:  # a step that grows the allocator's pool (a larger segment axis) pays for each cudaMalloc
        row["device_allocations_per_step"] = allocations
    if any(compiled["warmup"]) or any(compiled["timed"]):  # a compiled model: which steps compiled graphs, how many
        row["graphs_compiled_per_step"] = compiled
    median = statistics.median(times)
    if axis.active:
        row.update(segment_axis={"warmup": warmup_axis, "instrumented": instrumented_axis, "timed": timed_axis},
                   **repeated_axis_summary(warmup_axis + instrumented_axis, timed_axis, times))
    row.update(step_s=median, step_s_min=min(times), step_times_s=[round(t, 5) for t in times],
               host_s=statistics.median(host),
               bytes_per_s=batch * length / median,
               peak_memory_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
               mfu=row["flops_per_step"] / median / peak_flops if peak_flops and row["flops_per_step"] else None)
    if device.type == "cuda" and profile:
        try:
            profiled, size = axis.step(lambda: _profile_kernels(step, device))
            row.update(profiled, gpu_busy_fraction=profiled["gpu_busy_s"] / median)
            if axis.active:  # a profiled step at a new axis size times the planning too
                row["segment_axis"]["profiled"] = [size] if size is not None else []
                if row["step_s_repeated_axis"]:  # the share of a step whose plans and graphs exist
                    row["gpu_busy_fraction_repeated_axis"] = profiled["gpu_busy_s"] / row["step_s_repeated_axis"]
        except Exception as exc:  # noqa: BLE001 - a profiler failure leaves the timings valid
            row["profile_error"] = _error(exc)
    return row


def _spider_fp8(preset: str, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """Spider converted as ``--precision fp8`` converts it (``--fp8_layers auto``, ``--fp8_experts auto``; emulated
    ``Float8Linear`` off CUDA), with what was converted."""
    from spider_training.fp8 import convert_for_fp8_training

    model = _build(lambda: spider_model(preset), device)
    linear, experts = convert_for_fp8_training(model, emulate=device.type != "cuda", device=device)
    return model, {"fp8_linear_layers": linear.converted, "fp8_linear_skipped": linear.skipped_by_reason(),
                   "fp8_experts_modules": len(experts.converted_fqns),
                   "fp8_experts_skipped": sorted(set(experts.skipped.values()))}


def _spider_compiled(preset: str, device: torch.device, backend: str, mode: str | None = None,
                     **overrides) -> tuple[torch.nn.Module, dict]:
    """Spider (`preset` with the config `overrides`) compiled as ``--compile`` compiles it: accelerate's
    ``compile_regions`` (each layer and submodule on its own; the loops and the segment count in eager Python between
    them), with ``torch.compile``'s `backend` and `mode` (``--torch_compile_mode`` of the trainer; e.g.
    ``"reduce-overhead"``: CUDA graphs per region)."""
    return _compile_regions(_build(lambda: spider_model(preset, **overrides), device), backend, mode)


def _compile_regions(model, backend: str, mode: str | None) -> tuple[torch.nn.Module, dict]:
    """`model` compiled as ``--compile`` compiles it (:func:`spider_training.compile.compile_model`), after a dynamo
    reset; and what the row adds about it."""
    from spider_training.compile import compile_model

    torch._dynamo.reset()
    return compile_model(model, backend=backend, mode=mode), {"compile_backend": backend, "compile_mode": mode or "default"}


def _spider_seed_recipe(preset: str, device: torch.device, compile_backend: str | None = None,
                        compile_mode: str | None = None) -> tuple[torch.nn.Module, dict]:
    """The seed's own training configuration: `preset` with activation checkpointing (``gradient_checkpointing_enable``,
    as ``--preset 1b`` trains by default), in the precision ``--precision auto`` picks on this device (bf16 autocast on
    CUDA until FP8 measures faster; then converted as :func:`_spider_fp8`). With `compile_backend` also compiled as
    ``--compile`` compiles it (the ``spider_seed_recipe_compiled`` row, as :func:`_spider_compiled`)."""
    from spider_training.fp8 import resolve_precision

    precision = resolve_precision("auto", preset) if device.type == "cuda" else "fp32"
    model = _spider_fp8(preset, device)[0] if precision == "fp8" else _build(lambda: spider_model(preset), device)
    model.gradient_checkpointing_enable()
    autocast = str(_autocast_dtype(device) or torch.float32).replace("torch.", "")
    extra = {"activation_checkpointing": True, "precision": "fp8" if precision == "fp8" else autocast}
    if compile_backend is not None:
        model, compiled = _compile_regions(model, compile_backend, compile_mode)
        extra.update(compiled)
    return model, extra


def step_table_check(preset: str = "1b", shapes=None, repeats: int = 3, device: torch.device | None = None,
                     deadline: Deadline | None = None, models: tuple[str, ...] = STEP_TABLE_MODELS,
                     compile_backend: str = "inductor", seed_recipe_shape: tuple[int, int] | None = SEED_RECIPE_SHAPE,
                     compile_mode: str | None = None) -> dict:
    """The training-step table (see the module docstring). `shapes`: ``[(batch, bytes)]``, default
    :data:`STEP_TABLE_SHAPES`; without CUDA the ``1b`` preset needs explicit `shapes`. `models`: rows of each shape
    (:data:`STEP_TABLE_MODELS`); `compile_backend`: ``torch.compile`` backend of the ``spider_compiled`` row;
    `seed_recipe_shape`: the ``spider_seed_recipe`` row's batch (None: no such row); `compile_mode`: ``torch.compile``'s
    mode for the compiled rows."""
    from transformers import LlamaForCausalLM

    device = device or _device()
    deadline = deadline or Deadline(None)
    name = "step_table"
    if preset == "1b" and device.type != "cuda" and shapes is None:
        return _entry(name, "skipped", "needs CUDA for the 1b rows (pass --step_table_shapes, or --step_table_preset "
                                       "tiny, to run the table on CPU)")
    shapes = [tuple(s) for s in (shapes or STEP_TABLE_SHAPES)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = device_peak_matmul_flops(device, dtype)
    config = spider_config(preset)
    llama_config = dense_llama_config(config)
    default_experts = config._experts_implementation
    plain = {  # built on the device by _build
        "spider": lambda: spider_model(preset),
        "deepseek_v3": lambda: peer_model(config),
        "llama_dense": lambda: (torch.manual_seed(0), LlamaForCausalLM(llama_config))[1],
    }
    # each builder returns (model on the device, what the row adds about it)
    builders = {key: (lambda fn=fn: (_build(fn, device), {})) for key, fn in plain.items()}
    # The order: every shape's comparison rows (shape by shape, so a budget that runs out leaves the comparison at the
    # first shape complete), then the seed's recipe, then the compiled rows (compilation takes the longest), then
    # FP8's (on the H200 its first step took 54 s and each new segment count ~5 s).
    seed_shapes = [] if seed_recipe_shape is None else [tuple(seed_recipe_shape)]
    plan = [(label, shape) for shape in shapes for label in models if label in _COMPARISON_ROWS]
    plan += [("spider_seed_recipe", shape) for shape in seed_shapes if "spider" in models]
    plan += [(label, shape) for label in ("spider_compiled", "spider_word_rate_compiled") for shape in shapes
             if label in models]
    plan += [("spider_seed_recipe_compiled", shape) for shape in seed_shapes if "spider_seed_recipe_compiled" in models]
    plan += [("spider_fp8", shape) for shape in shapes if "spider_fp8" in models]

    def word_rate(model, extra: dict) -> tuple[torch.nn.Module, dict]:
        """A model built with ``boundary_mode="fixed"``, and the stride its boundary predictor closes segments at."""
        stride = model.model.flexitokens.boundary_predictor.stride
        return model, {**extra, "boundary_mode": "fixed", "bytes_per_segment": stride}

    builders.update(spider_word_rate=lambda: word_rate(
                        _build(lambda: spider_model(preset, boundary_mode="fixed"), device), {}),
                    spider_word_rate_compiled=lambda: word_rate(
                        *_spider_compiled(preset, device, compile_backend, compile_mode, boundary_mode="fixed")),
                    spider_fp8=lambda: _spider_fp8(preset, device),
                    spider_seed_recipe=lambda: _spider_seed_recipe(preset, device),
                    spider_seed_recipe_compiled=lambda: _spider_seed_recipe(preset, device, compile_backend,
                                                                            compile_mode),
                    spider_compiled=lambda: _spider_compiled(preset, device, compile_backend, compile_mode))
    rows, params, spider_flops = [], {}, {}  # spider_flops: by (eager row, shape), for the compiled twins
    held = None  # (builder key, model, extra): the plain model serves its eager-experts row, the compiled one both shapes
    needed = MIN_PART_S  # a row starts only if this much time is left: 1.5 x the slowest row so far
    for label, (batch, length) in plan:
        row_name = {"model": label, "shape": f"{batch}x{length}"}
        if deadline.expired(needed):
            rows.append({**row_name, "status": "skipped", "reason": TIME_BUDGET})
            continue
        row_start = time.monotonic()
        key = "spider" if label == "spider_eager_experts" else label
        try:
            if held is None or held[0] != key:
                held = None
                _free_memory()
                held = (key, *builders[key]())
            _, model, extra = held
            if key == "spider":
                model.set_experts_implementation("eager" if label == "spider_eager_experts" else default_experts)
            params[label] = num_params(model)
            row = _step_row(model, label, (batch, length), device, repeats, peak["flops_per_s"],
                            profile=(batch, length) == shapes[0], warmup=STEP_TABLE_WARMUP.get(label, 1),
                            instrument=label not in _EAGER_TWIN,
                            flops=spider_flops.get((_EAGER_TWIN.get(label), batch, length)))
            rows.append({**row, **extra})
            if label in _EAGER_TWIN.values():
                spider_flops[(label, batch, length)] = row["flops_per_step"]
        except PartTimeout as exc:  # the hard limit: keep the rows measured so far
            rows.append({**row_name, "status": "skipped", "reason": f"{TIME_BUDGET}: {exc}"})
            deadline.end = time.monotonic()  # every later row is skipped
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the other rows still run
            rows.append({**row_name, "status": "failed", "reason": _error(exc)})
            held = None
        if held is not None:
            held[1].zero_grad(set_to_none=True)
        _free_memory()
        needed = max(needed, 1.5 * (time.monotonic() - row_start))
    held = None
    _free_memory()
    failed = [f"{r['model']} {r['shape']}: {r['reason']}" for r in rows if r["status"] == "failed"]
    ran = [r for r in rows if r["status"] == "passed"]
    if failed:
        status, reason = "failed", "; ".join(failed)
    elif not ran:
        status, reason = "skipped", TIME_BUDGET
    else:
        status = "passed"
        reason = TIME_BUDGET + ": some rows skipped" if len(ran) < len(rows) else ""
    return _entry(name, status, reason, device=str(device), preset=preset, dtype=str(dtype).replace("torch.", ""),
                  peak_matmul=peak, parameters=params, repeats=repeats,
                  llama_dense_layers=llama_config.num_hidden_layers,
                  llama_params_over_spider=(params["llama_dense"] / params["spider"]
                                            if {"llama_dense", "spider"} <= params.keys() else None),
                  rows=rows)


# ----------------------------------------------------------------------------------------------------------------------
# host_syncs
# ----------------------------------------------------------------------------------------------------------------------


def proxy_1b_config(**overrides):
    """The ``1b`` preset's structure (layers, loops, experts, Engram layers, boundaries) at the ``tiny`` preset's
    widths: a CPU stand-in for counting host syncs, which depend on the structure and not the width."""
    tiny = spider_config("tiny")
    return spider_config("1b", **{**{k: getattr(tiny, k) for k in _WIDTH_FIELDS}, **overrides})


def host_syncs_check(preset: str = "1b", shape: tuple[int, int] | None = None, device: torch.device | None = None,
                     deadline: Deadline | None = None, variants: tuple[str | None, ...] = (None, "eager"),
                     top: int = 10) -> dict:
    """Device-to-host syncs of one training forward+backward of `preset` (see the module docstring). `variants`:
    experts implementations (None: the preset's own)."""
    from modeling_spider import SpiderForConditionalGeneration

    device = device or _device()
    deadline = deadline or Deadline(None)
    name = "host_syncs"
    shape = shape or ((32, 256) if device.type == "cuda" else (2, 256))
    proxy = preset == "1b" and device.type != "cuda"
    config = proxy_1b_config() if proxy else spider_config(preset)
    torch.manual_seed(0)
    model = _build(lambda: SpiderForConditionalGeneration(config), device).train()
    step = _train_step_of(model, random_bytes(*shape).to(device), device)  # forward+backward only, grads reset
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
        result = {"status": "passed", "dispatch_count": counter.total, "aten_ops_forward_backward": counter.ops,
                  "dispatch_by_op": dict(counter.counts.most_common()),
                  "dispatch_top_sources": dict(counter.sources.most_common(top))}
        if device.type == "cuda":
            result.update(cuda_sync_warnings=cuda_syncs.count,
                          cuda_top_sources=dict(cuda_syncs.sources.most_common(top)))
        results[label] = result
    del model, step
    _free_memory()
    peer_ops = None  # the launch proxy's yardstick: transformers' DeepseekV3 of the same config, same batch
    if not deadline.expired(MIN_PART_S):
        peer = _build(lambda: peer_model(config), device).train()
        peer_step = _train_step_of(peer, random_bytes(*shape).to(device), device)
        peer_step.forward_backward()
        peer.zero_grad(set_to_none=True)
        with HostSyncCounter(record_sources=False) as counter:
            peer_step.forward_backward()
        peer_ops = counter.ops
        del peer, peer_step
        _free_memory()
    ran = [r for r in results.values() if r["status"] == "passed"]
    return _entry(name, "passed" if ran else "skipped", "" if len(ran) == len(results) else TIME_BUDGET,
                  deepseek_v3_aten_ops_forward_backward=peer_ops,
                  device=str(device), preset=preset + (" structure at tiny widths (CPU proxy)" if proxy else ""),
                  shape=f"{shape[0]}x{shape[1]}", method=("torch.cuda.set_sync_debug_mode('warn') warnings and "
                                                          "HostSyncCounter" if device.type == "cuda"
                                                          else "HostSyncCounter (TorchDispatchMode + Tensor.tolist)"),
                  variants=results)


# ----------------------------------------------------------------------------------------------------------------------
# attention_backends
# ----------------------------------------------------------------------------------------------------------------------


def attention_backends_check(preset: str = "1b", batch: int | None = None, segment_counts=None, visits: int = 5,
                             device: torch.device | None = None, deadline: Deadline | None = None) -> dict:
    """SDPA forward+backward per kernel at `preset`'s recurrent-layer attention over a shuffled sequence of padded
    segment counts (:func:`bench.attention.sdpa_backend_timings`; see the module docstring). `batch`: default 32 on
    CUDA, 4 on CPU. A measurement: passes when torch's default and every kernel that takes the call ran."""
    from bench.attention import SDPA_SEGMENT_COUNTS, sdpa_backend_timings

    device = device or _device()
    deadline = deadline or Deadline(None)
    batch = batch or (32 if device.type == "cuda" else 4)
    timings = sdpa_backend_timings(preset, batch, tuple(segment_counts or SDPA_SEGMENT_COUNTS), visits, device,
                                   stop_at=deadline.at_fraction(0.9))
    backends = timings["backends"]
    failed = [f"{name}: {r['reason']}" for name, r in backends.items() if r["status"] == "failed"]
    if failed:
        status, reason = "failed", "; ".join(failed)
    elif backends.get("default", {}).get("status") != "ran":
        status, reason = "skipped", backends.get("default", {}).get("reason", "the default did not run")
    else:
        timed_out = [name for name, r in backends.items() if r.get("reason") == TIME_BUDGET]
        status, reason = "passed", f"{TIME_BUDGET}: {', '.join(timed_out)} not timed" if timed_out else ""
    return _entry("attention_backends", status, reason, **timings)


# ----------------------------------------------------------------------------------------------------------------------
# fp8, tile_kernels_moe, fsdp2_fp8_all_gather
# ----------------------------------------------------------------------------------------------------------------------


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


def fp8_check(preset: str, recipe: str, device: torch.device | None = None, repeats: int = 5,
              layers: str = "tk_train") -> dict:
    """torchao FP8 against bf16 autocast on one training step of `preset` (see the module docstring)."""
    from spider_training.fp8 import convert_for_fp8_training

    device = device or _device()
    name = f"fp8_{recipe}_{preset}"
    if preset == "1b" and device.type != "cuda":
        return _entry(name, "skipped", "needs CUDA (the 1b preset on CPU emulation takes hours)")
    batch, length = SHAPES[preset]
    reference = _build(lambda: spider_model(preset), device)
    fp8 = copy.deepcopy(reference)
    # as --precision fp8 converts: the experts where the GPU has the FP8 grouped GEMM
    report, experts = convert_for_fp8_training(fp8, recipe, layers, emulate=device.type != "cuda", device=device)
    converted = report.converted + len(experts.converted_fqns)
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
        reason = f"no layer converted (--fp8_layers {layers}, experts: {sorted(set(experts.skipped.values()))}): " \
                 "nothing compared"
    elif not ok:
        reason = (f"loss rel. difference {rel:.4f} (max {FP8_LOSS_RTOL}) or gradient cosine {cosine:.3f} "
                  f"(min {FP8_GRAD_COSINE})")
    del reference, fp8
    _free_memory()
    return _entry(name, "passed" if ok else "failed", reason,
                  device=str(device), emulated=device.type != "cuda", layers=layers,
                  converted_layers=report.converted, converted_experts_modules=len(experts.converted_fqns),
                  experts_skipped=sorted(set(experts.skipped.values())), shape=f"{batch}x{length}",
                  loss_bf16=loss_ref, loss_fp8=loss_fp8, loss_rel_difference=rel, gradient_cosine=cosine,
                  step_s_bf16=step_bf16, step_s_fp8=step_fp8, speedup_bf16_over_fp8=step_bf16 / step_fp8,
                  note="CPU emulation: the step times are not FP8's" if device.type != "cuda" else "")


def tile_kernels_check(tile_kernels_module=None, preset: str = "small", device: torch.device | None = None,
                       repeats: int = 5) -> dict:
    """The TileKernels MoE routing against the torch path on one training step (bf16 autocast). Without
    `tile_kernels_module` it needs CUDA and an importable ``tile_kernels``; tests pass a CPU test double."""
    from spider_training.tile_kernels_moe import BACKEND_TORCH, spider_moe_layers, swap_in_tile_kernels

    device = device or _device()
    if tile_kernels_module is None:
        if device.type != "cuda":
            return _entry("tile_kernels_moe", "skipped", "needs CUDA (TileKernels kernels are CUDA-only, SM90/SM100)")
        try:
            tile_kernels_module = importlib.import_module("tile_kernels.moe")
        except Exception as exc:  # not installed, or tilelang failing at import
            return _entry("tile_kernels_moe", "skipped", f"tile_kernels does not import: {type(exc).__name__}: {exc}")
    batch, length = SHAPES[preset]
    reference = spider_model(preset).to(device)
    swapped = copy.deepcopy(reference)
    backend = swap_in_tile_kernels(swapped, tile_kernels_module)
    if backend == BACKEND_TORCH:
        return _entry("tile_kernels_moe", "failed", f"the swap kept the torch path: {backend.reason}")
    # One MoE layer on the same tokens, fp32: outputs and gradients (input and expert weights) of the two routing
    # implementations differ only in fp32 summation order (the fused reduce), a few ulps per accumulated term.
    layer_ref, layer_tk = spider_moe_layers(reference)[0], spider_moe_layers(swapped)[0]
    x = torch.randn(batch * length // 2, reference.config.hidden_size,
                    generator=torch.Generator().manual_seed(0)).to(device)
    diffs = {}
    results = []
    for layer in (layer_ref, layer_tk):
        inp = x.clone().requires_grad_(True)
        out = layer(inp)[0]
        out.square().sum().backward()
        results.append({"output": out.detach(), "input_grad": inp.grad,
                        "weight_grad": torch.cat([p.grad.flatten() for p in layer.parameters() if p.grad is not None])})
    ok = True
    for key in results[0]:
        ref, got = results[0][key], results[1][key]
        tol = 16 * torch.finfo(torch.float32).eps * reference.config.hidden_size * float(ref.abs().max())
        diffs[key] = float((got - ref).abs().max())
        ok = ok and diffs[key] <= tol
    ids = random_bytes(batch, length).to(device)
    step_torch = _median_step_seconds(reference, ids, device, repeats)
    step_tile = _median_step_seconds(swapped, ids, device, repeats)
    return _entry("tile_kernels_moe", "passed" if ok else "failed",
                  "" if ok else f"the MoE layer's outputs or gradients differ: {diffs}",
                  backend=str(backend), device=str(device), max_difference=diffs, step_s_torch=step_torch,
                  step_s_tile_kernels=step_tile, speedup_torch_over_tile_kernels=step_torch / step_tile)


def fsdp2_fp8_all_gather_check(preset: str = "small", steps: int = 3) -> dict:
    """FSDP2 over NCCL with torchao's float8 all-gather against the same FP8 model without it (see the module
    docstring). Run under ``torchrun --nproc_per_node N`` with N >= 2 CUDA GPUs."""
    import torch.distributed as dist

    name = "fsdp2_fp8_all_gather"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return _entry(name, "skipped", "needs CUDA with >= 2 GPUs (torchrun --nproc_per_node 2, NCCL)")
    if "RANK" not in os.environ:
        return _entry(name, "skipped", "run under torchrun --nproc_per_node >= 2 (no RANK in the environment)")
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from spider_training.fp8 import build_float8_config, fp8_module_filter

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
        config = dataclasses.replace(build_float8_config("tensorwise", emulate=False),
                                     enable_fsdp_float8_all_gather=all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=fp8_module_filter)
        for module in model.modules():
            if type(module).__name__ in type(model)._no_split_modules:
                fully_shard(module)
        fully_shard(model)
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
    return _entry(name, "passed" if ok else "failed", "" if ok else f"loss curves differ by {rel:.4f}",
                  world_size=world, losses_fp8_all_gather=curves[True], losses_bf16_all_gather=curves[False])


# ----------------------------------------------------------------------------------------------------------------------
# The parts, the budget, the command
# ----------------------------------------------------------------------------------------------------------------------


def _fp8_part(options, deadline: Deadline) -> list[dict]:
    entries = []
    for preset in options.presets:
        for recipe in FP8_RECIPES:
            name = f"fp8_{recipe}_{preset}"
            if deadline.expired(MIN_PART_S):
                entries.append(_entry(name, "skipped", TIME_BUDGET))
                continue
            try:
                entries.append(fp8_check(preset, recipe, repeats=options.step_repeats, layers=options.fp8_layers or ("auto" if preset == "1b" else "tk_train")))
            except PartTimeout as exc:  # the hard limit: keep the entries measured so far
                entries.append(_entry(name, "skipped", f"{TIME_BUDGET}: {exc}"))
                deadline.end = time.monotonic()
            except Exception as exc:  # noqa: BLE001
                entries.append(_entry(name, "failed", _error(exc)))
            _free_memory()
    return entries


def _part_functions(options) -> dict:
    return {
        "main_job": lambda d: [main_job_check(options.main_job_steps, options.main_job_preset, deadline=d,
                                                extra_args=tuple(options.main_job_args))],
        "step_table": lambda d: [step_table_check(options.step_table_preset, options.step_table_shapes,
                                                  options.step_repeats, deadline=d,
                                                  models=tuple(options.step_table_models),
                                                  compile_backend=options.compile_backend,
                                                  seed_recipe_shape=options.seed_recipe_shape or None,
                                                  compile_mode=options.compile_mode)],
        "host_syncs": lambda d: [host_syncs_check(options.host_syncs_preset, options.host_syncs_shape, deadline=d)],
        "attention_backends": lambda d: [attention_backends_check(options.attention_preset, options.attention_batch,
                                                                  options.attention_segments,
                                                                  options.attention_visits, deadline=d)],
        "run_1b": lambda d: [run_1b_check(options.run_1b_steps, options.run_1b_preset, *options.run_1b_batch,
                                          deadline=d, experts_implementation=options.run_1b_experts or None,
                                          extra_args=tuple(options.run_1b_args))],
        "fp8": lambda d: _fp8_part(options, d),
        "tile_kernels_moe": lambda d: [tile_kernels_check()],
        "fsdp2_fp8_all_gather": lambda d: [fsdp2_fp8_all_gather_check()],
    }


def _placeholder_names(part: str, options) -> list[str]:
    if part == "fp8":
        return [f"fp8_{recipe}_{preset}" for preset in options.presets for recipe in FP8_RECIPES]
    return [part]


def run(presets=("small", "1b"), only: tuple[str, ...] = PARTS, budget_s: float | None = DEFAULT_BUDGET_S,
        caps: dict | None = None, **options) -> dict:
    """Run the selected parts in :data:`PARTS` order under the time budget; returns the JSON-ready result. Keyword
    `options` are the command's size/steps flags (see :func:`build_parser`)."""
    namespace = build_parser().parse_args([])
    vars(namespace).update(presets=list(presets), **options)
    caps = {**PART_CAPS_S, **(caps or {})}
    start = time.perf_counter()
    total = Deadline(budget_s)
    checks, parts = [], []
    functions = _part_functions(namespace)
    for part in PARTS:
        if part not in only:
            continue
        allowed = None if budget_s is None else min(caps[part], total.left())  # no budget: no caps either
        if allowed is not None and allowed < MIN_PART_S:
            left = max(0.0, total.left())
            checks += [_entry(name, "skipped", f"{TIME_BUDGET}: {left:.0f} s of --budget_s {budget_s:g} left")
                       for name in _placeholder_names(part, namespace)]
            parts.append({"name": part, "allowed_s": round(left, 1), "seconds": 0.0, "ran": False})
            continue
        part_start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr), _hard_limit(allowed):
                entries = functions[part](Deadline(allowed))
        except PartTimeout as exc:
            entries = [_entry(name, "skipped", f"{TIME_BUDGET}: {exc}") for name in _placeholder_names(part, namespace)]
        except Exception as exc:  # noqa: BLE001 - one broken part does not hide the others
            entries = [_entry(name, "failed", _error(exc)) for name in _placeholder_names(part, namespace)]
        _free_memory()
        checks += entries
        parts.append({"name": part, "allowed_s": None if allowed is None else round(allowed, 1),
                      "seconds": round(time.perf_counter() - part_start, 2), "ran": True})
    env = environment()
    env.update(cuda=torch.cuda.is_available(),
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               device=str(_device()))
    return {"benchmark": "gpu_check", "environment": env, "budget_s": budget_s, "parts": parts, "checks": checks,
            "passed": all(c["status"] != "failed" for c in checks), "seconds": time.perf_counter() - start}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=list(PARTS), choices=PARTS, help="parts to run (default: all)")
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--budget_s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds shared by all parts (each also capped by PART_CAPS_S); 0 or less: no budget")
    parser.add_argument("--part_cap", type=parse_part_cap, action="append", default=[], metavar="PART=SECONDS",
                        help="replace one part's cap in PART_CAPS_S (repeatable), e.g. --part_cap step_table=400 "
                             "to give the table more of --budget_s")
    parser.add_argument("--main_job_steps", type=int, default=500, help="training steps of the main job")
    parser.add_argument("--main_job_preset", default="small", help="preset of the main job (the README's: small)")
    parser.add_argument("--main_job_args", type=shlex.split, default=[],
                        help="more flags for the main job's command line as one string, e.g. "
                             "--main_job_args='--eval_windows 16'")
    parser.add_argument("--step_table_preset", default="1b", help="preset of the step table's Spider (and peers)")
    parser.add_argument("--step_table_shapes", nargs="+", type=parse_shape, default=None,
                        help="BATCHxBYTES shapes of the step table (default 32x256 8x2048; on CPU the 1b rows run "
                             "only when given)")
    parser.add_argument("--step_table_models", nargs="+", default=list(STEP_TABLE_MODELS),
                        choices=STEP_TABLE_MODEL_CHOICES,
                        help="rows of each shape (default: all but spider_eager_experts and spider_seed_recipe_compiled; the "
                             "compiled and FP8 rows run last)")
    parser.add_argument("--compile_backend", default="inductor",
                        help="torch.compile backend of the spider_compiled row (tests on CPU use 'eager')")
    parser.add_argument("--compile_mode", default=None,
                        help="torch.compile mode of the spider_compiled row, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--seed_recipe_shape", type=parse_shape, default=SEED_RECIPE_SHAPE,
                        help="BATCHxBYTES of the step table's last row, the seed's recipe (activation checkpointing)")
    parser.add_argument("--step_repeats", type=int, default=3,
                        help="timed steps (after a warm-up) per step-table row and per FP8 variant; the median is used")
    parser.add_argument("--host_syncs_preset", default="1b")
    parser.add_argument("--host_syncs_shape", type=parse_shape, default=None,
                        help="BATCHxBYTES (default 32x256 on CUDA, 2x256 on CPU)")
    parser.add_argument("--attention_preset", default="1b", help="preset whose attention heads and dims are timed")
    parser.add_argument("--attention_batch", type=int, default=None,
                        help="batch of the attention timings (default 32 on CUDA, 4 on CPU)")
    parser.add_argument("--attention_segments", nargs="+", type=int, default=None,
                        help="padded segment counts visited in shuffled order (default 80 96 112)")
    parser.add_argument("--attention_visits", type=int, default=5, help="visits of each segment count")
    parser.add_argument("--run_1b_steps", type=int, default=300)
    parser.add_argument("--run_1b_preset", default="1b", help="preset of the run (smaller presets also run on CPU)")
    parser.add_argument("--run_1b_batch", type=parse_shape, default=(32, 256), help="BATCHxBYTES per step")
    parser.add_argument("--run_1b_experts", default="",
                        help="experts_implementation of the run: grouped_mm, batched_mm, eager ('' keeps the preset's)")
    parser.add_argument("--run_1b_args", type=shlex.split, default=[],
                        help="more flags for the 1b run's command line, one string: --run_1b_args='--lr 3e-4'")
    parser.add_argument("--presets", nargs="+", default=["small", "1b"], choices=sorted(SHAPES),
                        help="presets of the FP8 comparison")
    parser.add_argument("--fp8_layers", default=None, choices=("tk_train", "auto", "seed"),
                        help="FP8 layer selection (spider_training.fp8); default: auto for 1b, tk_train for smaller presets; seed: deprecated name of tk_train")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in ("only", "out", "budget_s", "presets", "part_cap")}
    result = run(tuple(args.presets), tuple(args.only), args.budget_s if args.budget_s > 0 else None,
                 caps=dict(args.part_cap), **options)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return json.loads(text)


if __name__ == "__main__":
    main()
