"""``SpiderTrainer``: a ``transformers.Trainer`` that trains Spider in FP8 with the TileKernels MoE.

Everything Trainer and accelerate already do (optimizer, cosine schedule, gradient accumulation and clipping, DDP/FSDP,
checkpoint rotation, resume with RNG state and data skipping, the progress bar, logging) stays theirs. The subclass
overrides public, documented methods:

- ``__init__``: converts linear layers to torchao ``Float8Linear`` (:mod:`spider_training.fp8`) and the fused experts
  to torchao's FP8 grouped GEMM, each where it measured faster (:mod:`spider_training.fp8`), and swaps in the
  TileKernels MoE
  routing (:mod:`spider_training.tile_kernels_moe`) and runs the experts in the autocast dtype, their weights cast
  once per forward (:mod:`spider_training.mixed_precision`), before Trainer/accelerate wrap the model, and
  refuses a launch whose processes do not see each other.
- ``get_train_dataloader``: only for a streamed source (:class:`spider_training.data.StreamingTextDataset`, which
  splits itself by rank) the loader is prepared for device placement and gradient-accumulation bookkeeping only, not
  re-sharded; its state (the stream's position, each dataloader worker's with ``--dataloader_num_workers``) goes into
  every checkpoint, one file per rank. Map-style sources keep Trainer's own loader (seeded random sampler,
  accelerate's split across processes, ``skip_first_batches`` on resume).
- ``train``: resuming a streamed source continues from the checkpoint's stream position rather than Trainer's replay
  of the consumed batches (``skip_first_batches``); a checkpoint without one is refused.
- ``compute_loss`` / ``log``: run the forward inside ``mixed_precision.shared_weight_casts``, pass ``n_loops`` (in
  training drawn per step with ``extra_train_loops``) and log every loss term, bits-per-byte, compression rate,
  expert load balance, mean halting step, tokens/s, peak memory, and FLOPs per step, TFLOP/s and MFU
  (:mod:`spider_training.throughput`: the first micro-batch's forward counted, against the device's peak), and on
  request (``log_host_syncs``) the device-to-host syncs per step (:mod:`spider_training.profiling`).
- ``get_eval_dataloader`` / ``prediction_step``: Trainer's own ``evaluate`` and evaluation loop score the first
  ``eval_windows`` held-out windows; bits per byte is its metric (``compute_metrics`` defaults to
  :func:`spider_training.metrics.compute_bits_per_byte`), counted in bytes, not tokens or batches: each window's summed
  next-byte NLL and predicted-byte count pass through the loop (gathered across processes, duplicates dropped), and
  ``eval_loss`` is the held-out next-byte loss (nats per byte) rather than the training objective's regularised sum.
- ``create_optimizer``: with ``muon_lr > 0``, Muon for the hidden matrices and AdamW for the rest
  (:class:`spider_training.optim.MuonWithAdamW`, one optimizer that Trainer schedules, clips and checkpoints);
  with ``lr_scale_of``, per-parameter learning-rate multipliers (``experiments.quality``'s global-path rows).
- ``training_step``: Trainer's step (forward and backward) inside :func:`spider_training.sdpa.sdpa_backend_context`,
  so that ``--sdpa_backend`` picks SDPA's kernel for the training forward, its backward and any recomputed forward.

Six private Trainer methods are overridden, in one marked section at the end of the class, because no public hook
does their job (the section says why for each):

- ``_build_accelerator_args``: FP8 requested through accelerate's own config (``mixed_precision: fp8``) is done
  once, in ``__init__``, with tk-train.py's module filter; accelerate is then told bf16 so it does not convert again.
  ``--compile`` (``torch_compile``) compiles the model's layers in ``__init__`` (:mod:`spider_training.compile`,
  one graph per layer kind), so accelerate is given a dynamo plugin that compiles nothing more.
- ``_get_output_dir`` / ``_save_checkpoint``: checkpoints are written atomically
(:mod:`spider_training.checkpointing`);
  a save that fails for lack of space or on a read-only filesystem raises ``CheckpointWriteError`` naming the folder
  and the cause. With ``--compile`` a checkpoint also holds what was compiled (``compile_artifacts.bin``).
- ``_save``: a model whose parameters are torchao weight wrappers (the FP8 grouped-GEMM experts, FSDP float8
  all-gather) is saved from its plain high-precision tensors (:func:`spider_training.fp8.fp8_to_plain_state_dict`):
  ``save_pretrained`` cannot write the wrappers, and the checkpoint loads as a plain model.
- ``_load_from_checkpoint``: a checkpoint of older runs (per-expert expert layout, older segmentation names) is
  rewritten in today's names once (:func:`spider_training.checkpointing.convert_older_checkpoint`) before Trainer's
  resume reads it; with ``--compile`` every rank loads the checkpoint's compiled artifacts (warm start); a resume
  with another process count, micro-batch or accumulation than the checkpoint's run is refused
  (:func:`spider_training.checkpointing.check_data_layout`: it would skip some windows and repeat others).
- ``_push_from_checkpoint``: Trainer calls it inside the save, on rank 0, while other ranks may still be writing
  into the staged folder; it runs once the checkpoint is published, complete. Hub pushing (``args.push_to_hub``) is
  otherwise Trainer's own, made offline-tolerant by :class:`spider_training.hub.HubPushMixin`; a run stopped by a
  signal does not wait for the pushes in flight (``hub_pushes_abandoned``).

Two callbacks are added (Trainer's documented ``TrainerCallback`` events):

- :class:`spider_training.preemption.StopOnSignalCallback`: SIGTERM/SIGINT finish the step, save, stop cleanly.
- :class:`spider_training.nonfinite.NonFiniteGuardCallback`: optimizer steps with a NaN/inf loss or gradient are
  skipped (parameters and optimizer state untouched) and counted (``nonfinite_steps`` in the logs); too many in a
  row raise ``NonFiniteLossError``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import resource
import time

import torch
from torch.utils.data import DataLoader, Subset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from . import checkpointing
from .arguments import spider_training_arguments
from .compile import compile_model, load_compile_artifacts, save_compile_artifacts
from .data import FirstWindows, StreamingTextDataset, make_dataloader
from .fp8 import (
    convert_for_fp8_training,
    fp8_to_plain_state_dict,
    has_fp8_weight_wrappers,
    is_float8_linear,
    precompute_fp8_scales,
    resolve_precision,
)
from .hub import HubPushMixin
from .metrics import byte_nll, compute_bits_per_byte
from .mixed_precision import autocast_experts, shared_weight_casts
from .nonfinite import NonFiniteGuardCallback
from .optim import muon_with_adamw, scale_learning_rates
from .preemption import DEFAULT_SIGNALS, StopOnSignalCallback
from .profiling import HostSyncsPerStep
from .sdpa import attention_for_backend, sdpa_backend_context
from .throughput import ThroughputMeter
from .tile_kernels_moe import swap_in_tile_kernels

logger = logging.getLogger(__name__)


class LaunchMismatchError(RuntimeError):
    """The launcher started several processes but accelerate sees only one: each would train alone."""


def check_launch(num_processes: int) -> None:
    """Refuse a launch whose processes do not see each other.

    Raises:
        LaunchMismatchError: ``WORLD_SIZE > 1`` in the environment (the launcher started several processes) but
            `num_processes` (accelerate's count) is 1: each would train alone on the same data and overwrite the same
            checkpoints (on CPU, ``accelerate launch --multi_gpu`` without ``--use_cpu``).
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes == 1:
        raise LaunchMismatchError(
            f"the launcher started WORLD_SIZE={launched} processes but accelerate sees 1, so every process would "
            "train alone on the same data and overwrite the same checkpoints. On CPU pass --use_cpu (Trainer) so "
            "accelerate uses the gloo backend, or launch with torchrun."
        )


def peak_memory_mb() -> float:
    """Peak memory of this process in MB: CUDA allocator peak on GPU, else the resident-set high-water mark."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def training_loop_count(
    n_loops: int, extra_train_loops: int, seed: int, step: int, counts: tuple[int, ...] | None = None
) -> int:
    """The loop count of training step `step`: uniform over ``n_loops .. n_loops + extra_train_loops`` (or over
    `counts` when given), a function of `(seed, step)` alone (its own generator, so Trainer's RNG streams and their
    checkpointed state are untouched). Returns an int; ``n_loops`` when ``extra_train_loops`` is 0 and no `counts`."""
    counts = tuple(counts) if counts else tuple(range(n_loops, n_loops + extra_train_loops + 1))
    if len(counts) == 1:
        return counts[0]
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return counts[int(torch.randint(0, len(counts), (), generator=generator))]


class PrecomputeFp8ScalesCallback(TrainerCallback):
    """After each optimizer step under FSDP2 float8 all-gather: every ``Float8Linear`` weight's scale in one
    all-reduce (:func:`spider_training.fp8.precompute_fp8_scales`, torchtitan's post-optimizer hook)."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            precompute_fp8_scales(model)


class SpiderTrainer(HubPushMixin, Trainer):
    """Trainer for :class:`SpiderForConditionalGeneration`, its settings read from `args`, a
    :class:`~spider_training.arguments.SpiderTrainingArguments` (TRL's trainers read their ``SFTConfig`` the same way;
    a plain ``TrainingArguments`` is converted, Spider's fields at their defaults, and None is the defaults).

    Settings read from ``args`` (beyond ``TrainingArguments``'; each field's help text says more):
        n_loops: recurrent iterations per forward (None: the model config's).
        extra_train_loops: each training step draws its loop count uniformly from ``n_loops`` to ``n_loops +
            extra_train_loops`` (Huginn's randomised recurrence, Geiping et al. 2025, arXiv 2502.05171, narrowed to the
            trained count and above), so that the state learns to hold still past the count it is evaluated at;
            evaluation always runs ``n_loops``. The draw is a function of ``args.seed`` and the global step
            (:func:`training_loop_count`): every rank and every micro-batch of a step run the same count, and a
            resumed run draws what the uninterrupted one would. 0 (default): always ``n_loops``.
        precision, preset: the precision, resolved by :func:`spider_training.fp8.resolve_precision` (``auto``: by
            device and preset); bf16 (and FP8 on CUDA) turns on ``args.bf16`` autocast.
        fp8_recipe, fp8_layers, fp8_experts, fp8_gemm_table: with FP8, torchao's recipe, which layers convert
            (``"auto"``: where the GEMM table measured FP8 faster for the layer's shape at this micro-batch,
            ``args.per_device_train_batch_size`` windows of the train dataset's ``seq_len``; ``"tk_train"``: every
            layer tk-train.py converted) and what the routed experts do (:mod:`spider_training.fp8`).
        eval_windows: held-out windows scored by :meth:`evaluate` (rounded up to whole eval batches).
        max_consecutive_nonfinite: optimizer steps with a NaN/inf loss or gradient skipped in a row before the run
            stops with ``NonFiniteLossError``.
        muon_lr, muon_experts: Muon's peak learning rate for the hidden matrices (:mod:`spider_training.optim`),
            AdamW at ``args.learning_rate`` for the rest, both on ``args``' schedule; 0 or None: Trainer's own
            optimizer (``args.optim``) for every parameter. ``muon_experts``: the routed experts' matrices too.
        hub_endpoint: Hub URL for ``args.push_to_hub`` (None: ``HF_ENDPOINT`` or huggingface.co); pushing is
            Trainer's, made offline-tolerant by :class:`spider_training.hub.HubPushMixin`.
        sdpa_backend: the SDPA kernel training steps prefer (:mod:`spider_training.sdpa`): ``"auto"`` (torch's
            choice), ``"cudnn"``, ``"flash"`` (with MLA's narrower value head dim the model's attention becomes
            :data:`spider_training.sdpa.VALUE_PADDED_SDPA`), ``"efficient"`` or ``"math"``.
        log_host_syncs: count each training step's device-to-host syncs and log their mean per step as
            ``host_syncs_per_step`` at every logging step (:class:`spider_training.profiling.HostSyncsPerStep`; the
            counted steps run slower, compiled layers eagerly). False (default): not counted.

    Keyword arguments (beyond ``Trainer``'s): objects a caller hands over rather than settings of a run, so they are
    not fields of `args` (which is saved with each checkpoint and parsed from the command line):
        tile_kernels_module: inject a TileKernels implementation (tests pass a CPU test double); default: import
            ``tile_kernels`` when CUDA is available.
        stop_signals: signals that stop training gracefully (save, then stop); default SIGTERM and SIGINT;
            ``()`` leaves signal handling alone (tests, benchmarks running in-process).
        lr_scale_of: a function of a parameter's name giving its learning-rate multiplier on top of the schedule
            (:func:`spider_training.optim.scale_learning_rates`; ``experiments.quality``'s global path at 3x); None: 1.
        train_loop_counts: each training step's loop count drawn uniformly from these (Huginn's set, e.g. ``(1, 2,
            3)``) instead of from `extra_train_loops`' range; same draw rule (:func:`training_loop_count`).

    Attributes:
        n_loops: the loop count in use (``args.n_loops``; :meth:`evaluate_loop_counts` changes it while it scores).
        precision: the precision trained in, ``"fp8"``, ``"bf16"`` or ``"fp32"`` (FP8 falls back where no layer pays).
        fp8_report: the :class:`spider_training.fp8.Fp8Report` (linear layers and experts), or None (not FP8).
        nonfinite_guard: the :class:`NonFiniteGuardCallback` (``skipped_steps``, ``skipped_at``).
        stop_callback: the :class:`StopOnSignalCallback` (``received``, ``stopped_at_step``), or None.
        host_syncs: the :class:`spider_training.profiling.HostSyncsPerStep` counting each step's host syncs
            (``args.log_host_syncs``), or None.

    Raises:
        LaunchMismatchError: ``WORLD_SIZE > 1`` in the environment but accelerate runs a single process (on CPU,
            ``accelerate launch --multi_gpu`` needs ``--use_cpu``).
        ValueError: ``muon_lr > 0`` with FSDP (its sharded optimizer checkpoints expect one torch optimizer); an
            ``sdpa_backend`` other than ``"auto"`` on a model whose attention is not ``"sdpa"``; what
            :class:`~spider_training.arguments.SpiderTrainingArguments` refuses, when converting a plain
            ``TrainingArguments``.
    """

    def __init__(
        self,
        model=None,
        args=None,
        *,
        tile_kernels_module=None,
        stop_signals=DEFAULT_SIGNALS,
        lr_scale_of=None,
        train_loop_counts=None,
        **kwargs,
    ):
        args = spider_training_arguments(args)
        precision = resolve_precision(args.precision, args.preset)
        if precision == "bf16" or (precision == "fp8" and torch.cuda.is_available()):
            # bf16 autocast; Trainer accepts bf16 without a GPU only with use_cpu
            args = dataclasses.replace(args, bf16=True, use_cpu=args.use_cpu or not torch.cuda.is_available())
        self.hub_endpoint = args.hub_endpoint
        attention = attention_for_backend(model.config, args.sdpa_backend) if model is not None else None
        if attention is not None and attention != (model.config._attn_implementation or "sdpa"):
            model.set_attn_implementation(attention)
            logger.info(
                "--sdpa_backend %s: attention %r (value padded to the query/key head dim)",
                args.sdpa_backend,
                attention,
            )
        self.n_loops = args.n_loops
        self.lr_scale_of = lr_scale_of
        self.train_loop_counts = tuple(train_loop_counts) if train_loop_counts else None
        self.precision = precision
        self.fp8_report = None
        if precision == "fp8" or os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp8":
            self.precision = self._convert_to_fp8(model, args, kwargs.get("train_dataset"))
        self.moe_backend = swap_in_tile_kernels(model, tile_kernels_module)
        logger.info("MoE routing backend: %s", self.moe_backend)
        autocast_experts(model)  # under autocast: grouped GEMM in bf16, the experts' weights cast once per forward
        if args.torch_compile and model is not None:  # after FP8, before DDP/FSDP wrap it
            compile_model(model, backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
        kwargs.setdefault("compute_metrics", compute_bits_per_byte)
        super().__init__(model=model, args=args, **kwargs)
        # Spider's loss is a per-batch mean plus per-batch regularisers: let Trainer divide by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        check_launch(self.accelerator.num_processes)
        if self.args.muon_lr and self.is_fsdp_enabled:
            raise ValueError(
                f"muon_lr={self.args.muon_lr} with FSDP: FSDP's sharded optimizer checkpoints expect one "
                "torch optimizer's state; train with muon_lr=0 (--muon_lr 0)"
            )
        if getattr(self, "_fp8_scales_callback", None) is not None:
            self.add_callback(self._fp8_scales_callback)
        self.nonfinite_guard = NonFiniteGuardCallback(self.args.max_consecutive_nonfinite)
        self.add_callback(self.nonfinite_guard)
        self.stop_callback = StopOnSignalCallback(stop_signals) if stop_signals else None
        if self.stop_callback is not None:
            self.add_callback(self.stop_callback)
        self._metric_sums: dict[str, torch.Tensor] = {}
        self._metric_count = 0
        self._tokens_since_log = 0
        self._last_log_time = time.perf_counter()
        matmul_dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else torch.float32
        self.throughput = ThroughputMeter(self.args.device, matmul_dtype, self.args.gradient_accumulation_steps)
        self.host_syncs = HostSyncsPerStep() if self.args.log_host_syncs else None
        if self.host_syncs is not None:
            self.add_callback(self.host_syncs)  # last: the other callbacks' on_step_end is inside the count

    def _convert_to_fp8(self, model, args, train_dataset) -> str:
        """FP8 where it pays at this run's micro-batch (:func:`spider_training.fp8.convert_for_fp8_training`); under
        FSDP2 with tensorwise scales the weights are all-gathered in float8, their scales precomputed after each
        optimizer step. Returns the precision the run trains in: ``"fp8"``, or, when no layer pays, the high precision
        with a warning citing the table."""
        fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        all_gather = fsdp and args.fp8_recipe == "tensorwise" and torch.cuda.is_available()
        self.fp8_report = convert_for_fp8_training(
            model,
            args.fp8_recipe,
            args.fp8_layers,
            args.fp8_experts,
            device=args.device,
            batch_size=args.per_device_train_batch_size,
            seq_len=getattr(train_dataset, "seq_len", None),
            gemm_table=args.fp8_gemm_table,
            fsdp_float8_all_gather=all_gather,
        )
        if not self.fp8_report.converted:
            high = "bf16" if args.bf16 else "fp32"
            logger.warning(
                "--precision fp8: FP8 pays for no layer here (%s); training in %s", self.fp8_report.source, high
            )
            return high
        if all_gather and any(is_float8_linear(m) for m in model.modules()):
            self._fp8_scales_callback = PrecomputeFp8ScalesCallback()
        return "fp8"

    # --- optimizer -----------------------------------------------------------------------------------------------

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer, or with `muon_lr` Muon for the hidden matrices and AdamW (``args``' learning rate,
        betas, epsilon, and weight decay on Trainer's decay parameters) for the rest."""
        if self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        if not self.args.muon_lr:
            super().create_optimizer(model)
        else:
            self.optimizer = muon_with_adamw(
                opt_model,
                self.args.muon_lr,
                self.args.learning_rate,
                self.args.weight_decay,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                decay_parameter_names=set(self.get_decay_parameter_names(opt_model)),
                muon_experts=self.args.muon_experts,
            )
        if self.lr_scale_of is not None:  # before the scheduler reads each group's initial learning rate
            scale_learning_rates(self.optimizer, opt_model, self.lr_scale_of)
        return self.optimizer

    # --- data ----------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """Trainer's loader for a map-style dataset; for a rank-split stream a loader prepared for device placement
        only (accelerate would otherwise dispatch from rank 0 or re-shard it)."""
        if not isinstance(self.train_dataset, StreamingTextDataset):
            return super().get_train_dataloader()
        # An accelerate DataLoaderShard: iterating it registers it with the accelerator's GradientState (end of data
        # inside an accumulation window), as a loader from `accelerator.prepare` would. Its state_dict() is the
        # stream's position at the last batch handed out (with dataloader workers, each worker's): saved in every
        # checkpoint.
        self._stream_loader = make_dataloader(
            self.train_dataset,
            self._train_batch_size,
            device=self.args.device,
            num_workers=self.args.dataloader_num_workers,
            collate_fn=self.data_collator,
            pin_memory=self.args.dataloader_pin_memory,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            persistent_workers=self.args.dataloader_persistent_workers,
            non_blocking=self.args.accelerator_config.non_blocking,
        )
        return self._stream_loader

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Trainer's ``train``; resuming a streamed source (:class:`StreamingTextDataset`), it continues from the
        stream position saved in the checkpoint (:meth:`_resume_stream`) instead of Trainer's replay of the consumed
        batches (``skip_first_batches``, which re-reads and re-packs every skipped window). With ``log_host_syncs``,
        the step's host-sync counter is closed however training ends."""
        restore = None
        if resume_from_checkpoint and isinstance(self.train_dataset, StreamingTextDataset):
            folder = (
                checkpointing.latest_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is True
                else resume_from_checkpoint
            )
            if folder and self._resume_stream(folder):
                restore, self.args.ignore_data_skip = self.args.ignore_data_skip, True
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            if restore is not None:
                self.args.ignore_data_skip = restore
            if self.host_syncs is not None:
                self.host_syncs.close()

    def _resume_stream(self, folder: str) -> bool:
        """Position the streamed train dataset where checkpoint `folder`'s run left it (this rank's
        :func:`spider_training.checkpointing.read_stream_position`). Returns True when positioned (Trainer must then
        not skip batches), False with ``--ignore_data_skip`` (the stream starts again from its beginning).

        Raises:
            ValueError: the checkpoint's process count, micro-batch or accumulation differ
                (:func:`spider_training.checkpointing.check_data_layout`), it holds no position for this rank (written
                before positions were saved: the stream cannot continue exactly), its position was saved with another
                ``--dataloader_num_workers`` (each worker reads its own part of the stream), or it is of another
                stream (another source, split, seq_len, shuffle).
        """
        checkpointing.check_data_layout(folder, checkpointing.data_layout(self.args))
        if self.args.ignore_data_skip:
            logger.info("%s: --ignore_data_skip: the stream starts again from its beginning", folder)
            return False
        state = checkpointing.read_stream_position(folder, self.args.process_index)
        if state is None:
            raise ValueError(
                f"{folder} holds no position in the streamed source for process {self.args.process_index} (written "
                "before positions were saved), so the stream cannot continue where it stopped. Pass "
                "--ignore_data_skip to resume the model and optimizer with the stream from its beginning, or "
                "--init_from for a new run."
            )
        workers = state.get("num_workers", 0) if "worker_positions" in state else 0
        if workers != self.args.dataloader_num_workers:
            raise ValueError(
                f"{folder}: its stream position was saved by a run with --dataloader_num_workers {workers}, this "
                f"run has {self.args.dataloader_num_workers}; each worker reads its own part of the stream, so the "
                f"stream continues exactly only with --dataloader_num_workers {workers} (or pass --ignore_data_skip "
                "to start the stream from its beginning)"
            )
        self.train_dataset.load_state_dict(state)
        positions = state["worker_positions"] if workers else [state]
        logger.info(
            "%s: the stream continues at window %s of epoch %d (saved position; nothing replayed)",
            folder,
            "/".join(str(p["windows"]) for p in positions),
            positions[0]["epoch"],
        )
        return True

    # --- the training step ---------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step, forward and backward, with SDPA preferring ``sdpa_backend``'s kernel. Under
        ``--torch_compile_mode reduce-overhead`` each step begins a new CUDA graph generation (the layer graphs'
        forwards all run before their backwards, so graph trees would not start one by themselves)."""
        if self.args.torch_compile and self.args.torch_compile_mode in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()
        with sdpa_backend_context(self.args.sdpa_backend, self.args.device):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.throughput.step()
        return loss

    # --- loss and logging ----------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and (self.args.extra_train_loops or self.train_loop_counts):
            n_loops = self.n_loops or self.accelerator.unwrap_model(model).config.n_loops
            inputs = {
                **inputs,
                "n_loops": training_loop_count(
                    n_loops,
                    self.args.extra_train_loops,
                    self.args.seed,
                    self.state.global_step,
                    self.train_loop_counts,
                ),
            }
        elif self.n_loops is not None:
            inputs = {**inputs, "n_loops": self.n_loops}
        compute = functools.partial(
            super().compute_loss, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        with shared_weight_casts():  # spider_training.mixed_precision: one cast of each expert weight per forward
            if model.training and self.throughput.flops_per_micro_batch is None:
                # the run's FLOPs: the first micro-batch's forward under the counter (its backward runs outside it,
                # with the kernels it always has), 3x for forward and backward (spider_training.throughput)
                loss, outputs = self.throughput.count(compute, forward_only=True)
            else:
                loss, outputs = compute()
        if model.training and self.nonfinite_guard.observe_loss(loss):  # a skipped step's terms are not averaged in
            self._record(outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def _record(self, outputs, inputs) -> None:
        # another causal LM (experiments.quality's dense baselines) has only `loss`, its LM loss
        terms = {
            name: getattr(outputs, name, None)
            for name in (
                "lm_loss",
                "aux_loss",
                "boundary_loss",
                "ponder_loss",
                "compression_rate",
                "mean_halting_step",
            )
        }
        terms = {name: value.detach().float() for name, value in terms.items() if value is not None}
        terms.setdefault("lm_loss", outputs.loss.detach().float())
        if getattr(outputs, "expert_load", None) is not None:
            terms["expert_load_max"] = outputs.expert_load.max().float()  # 1.0 = perfect balance
        for name, value in terms.items():
            self._metric_sums[name] = self._metric_sums.get(name, 0.0) + value
        self._metric_count += 1
        self._tokens_since_log += inputs["input_ids"].numel() * self.accelerator.num_processes

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._metric_count:
            for name, total in self._metric_sums.items():
                logs[name] = round(float(total) / self._metric_count, 5)
            logs["bits_per_byte"] = round(logs["lm_loss"] / math.log(2), 5)
            now = time.perf_counter()
            logs["tokens_per_second"] = round(self._tokens_since_log / max(now - self._last_log_time, 1e-9), 1)
            logs["peak_memory_mb"] = round(peak_memory_mb(), 1)
            logs.update(self.throughput.read())
            if self.host_syncs is not None:
                logs.update(self.host_syncs.read())
            self._metric_sums, self._metric_count, self._tokens_since_log = {}, 0, 0
            self._last_log_time = now
        if "loss" in logs:
            # every step since the previous log skipped: Trainer's NaN filter would log 0.0; log NaN ("no loss")
            if self.nonfinite_guard.all_skipped_since_last_log(self.state.global_step):
                logs["loss"] = float("nan")
            logs["nonfinite_steps"] = self.nonfinite_guard.skipped_steps
        super().log(logs, start_time)

    # --- evaluation ----------------------------------------------------------------------------------------------
    # Trainer's own evaluation loop scores the held-out set; bits per byte is its metric, counted in bytes: each
    # window's summed next-byte NLL and predicted-byte count travel through the loop (gathered across processes,
    # duplicates dropped) and compute_bits_per_byte divides the sums. eval_loss is the held-out lm_loss (nats/byte).

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Trainer's loader over the first `eval_windows` held-out windows (rounded up to whole batches of
        ``per_device_eval_batch_size``), split across processes by accelerate; for a rank-split stream
        (:class:`StreamingTextDataset`) a loader of its own that stops after as many windows on each rank."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        batch_size = self.args.per_device_eval_batch_size
        windows = max(1, math.ceil(self.args.eval_windows / batch_size)) * batch_size
        if isinstance(dataset, StreamingTextDataset):
            return make_dataloader(FirstWindows(dataset, windows), batch_size, collate_fn=self.data_collator)
        if len(dataset) > windows:
            dataset = dataset.select(range(windows)) if hasattr(dataset, "select") else Subset(dataset, range(windows))
        return super().get_eval_dataloader(dataset)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """One held-out batch (``input_ids``, ``labels`` int64 ``(B, L)``) at the trainer's ``n_loops``: returns no
        loss, as predictions float64 ``(B, 3)`` each window's summed next-byte NLL (nats), the batch's compression
        rate and mean halting step, and as labels its predicted bytes ``(B,)`` (:func:`compute_bits_per_byte`)."""
        inputs = self._prepare_inputs(inputs)
        features = {name: value for name, value in inputs.items() if name != "labels"}
        if self.n_loops is not None:
            features["n_loops"] = self.n_loops
        with torch.no_grad():
            outputs = model(**features)
        nll, n_bytes = byte_nll(outputs["logits"], inputs["labels"])
        nan = nll.new_tensor(float("nan"))  # another causal LM (experiments.quality's dense rows): no segments, no ACT
        per_batch = torch.stack([outputs.get("compression_rate", nan), outputs.get("mean_halting_step", nan)]).double()
        return None, torch.cat([nll[:, None], per_batch.expand(len(nll), 2)], 1), n_bytes

    def evaluate_loop_counts(self, counts, eval_dataset=None) -> dict[str, float]:
        """Held-out bits per byte at each inference loop count in `counts` (the recurrent depth's test-time curve):
        ``{str(n_loops): bits_per_byte}``, scored like :meth:`evaluate` (not logged)."""
        return {str(n): self._held_out_bits_per_byte(eval_dataset, n)["bits_per_byte"] for n in counts}

    def evaluate_act_early_exit(self, eval_dataset=None) -> dict[str, float]:
        """Held-out bits per byte with ACT early exit at inference (``config.act_early_exit``, restored after), and
        the loops it saves per segment (the configured count minus the mean halting step): ``{"bits_per_byte",
        "mean_halting_step", "loops_saved_per_segment"}``, scored like :meth:`evaluate` (not logged)."""
        config = self.accelerator.unwrap_model(self.model).config
        before = config.act_early_exit
        config.act_early_exit = True
        try:
            result = self._held_out_bits_per_byte(eval_dataset, self.n_loops)
        finally:
            config.act_early_exit = before
        n_loops = self.n_loops or config.n_loops
        return {
            "bits_per_byte": result["bits_per_byte"],
            "mean_halting_step": result["mean_halting_step"],
            "loops_saved_per_segment": n_loops - result["mean_halting_step"],
        }

    def _held_out_bits_per_byte(self, eval_dataset, n_loops: int | None) -> dict[str, float]:
        """Trainer's evaluation loop at `n_loops` (None: the trainer's), not logged: :func:`compute_bits_per_byte`'s
        figures without a prefix."""
        trained_n_loops, self.n_loops = self.n_loops, n_loops
        try:
            output = self.evaluation_loop(
                self.get_eval_dataloader(eval_dataset), description="Evaluation", metric_key_prefix="eval"
            )
        finally:
            self.n_loops = trained_n_loops
        return {name[len("eval_") :]: value for name, value in output.metrics.items()}

    # --- Hub ----------------------------------------------------------------------------------------------------

    def hub_pushes_abandoned(self) -> bool:
        """A run stopped by SIGTERM/SIGINT exits without waiting for Hub pushes in flight (its grace period is short;
        the restart pushes again)."""
        return self.stop_callback is not None and self.stop_callback.stopped

    # --- private Trainer methods ---------------------------------------------------------------------------------
    # The only overrides of Trainer's private methods, each because no public hook exists for what it does (checked
    # against transformers 5.23; re-check them on every transformers upgrade):
    # - `_build_accelerator_args`: the Accelerator is built inside `Trainer.__init__` from `mixed_precision`; after
    #   our own FP8 conversion accelerate must not convert again, and after our own per-layer compile it must not
    #   compile the whole model; no argument or callback reaches that dict.
    # - `_get_output_dir` + `_save_checkpoint`: Trainer writes `checkpoint-N` straight into `output_dir`; `on_save`
    #   callbacks run only after it is written, so an atomic write (stage, then one rename) has to move the folder
    #   Trainer writes into. `rotate_checkpoints` (public, `trainer_utils`) then rotates as Trainer would.
    # - `_save`: Trainer saves `model.state_dict()` unless a state dict is passed in, and only its FSDP/DeepSpeed paths
    #   pass one; torchao's weight wrappers (FP8 grouped-GEMM experts) need the plain tensors passed instead.
    # - `_load_from_checkpoint`: Trainer reads the checkpoint's weights with `load_state_dict`, which knows only the
    #   fused expert names; a checkpoint in the per-expert layout of older runs is rewritten fused first, once; and
    #   the data layout is checked before anything is loaded (no hook runs earlier on resume).
    # - `_push_from_checkpoint` (HubPushMixin's, see spider_training/hub.py): Trainer calls it from `_save_checkpoint`
    #   on rank 0 as soon as its own files are written; the push waits until every rank has written its part and the
    #   folder is published.

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        if self.fp8_report is not None and args.get("mixed_precision") == "fp8":
            logger.info(
                "accelerate asked for fp8: converted once by SpiderTrainer (--fp8_layers filter); accelerate runs bf16"
            )
            args["mixed_precision"] = "bf16"
        if self.args.torch_compile:
            # --compile compiled the layers in __init__ (spider_training.compile); accelerate would compile the whole
            # model again (TrainingArguments also sets ACCELERATE_DYNAMO_BACKEND, read when no plugin is given)
            from accelerate.utils import TorchDynamoPlugin

            args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return args

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and has_fp8_weight_wrappers(self.model):
            state_dict = fp8_to_plain_state_dict(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        checkpointing.check_data_layout(resume_from_checkpoint, checkpointing.data_layout(self.args))
        if self.args.should_save and checkpointing.convert_older_checkpoint(resume_from_checkpoint):
            logger.info(
                "%s: an older checkpoint's weights, rewritten in today's layout and names", resume_from_checkpoint
            )
        self.accelerator.wait_for_everyone()
        if self.args.torch_compile and load_compile_artifacts(resume_from_checkpoint):
            logger.info("%s: compiled artifacts loaded (the layers compile from them)", resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if getattr(self, "_staging_root", None) is not None:
            return  # called by Trainer inside the save, on the staged folder: pushed after the publishing rename
        super()._push_from_checkpoint(checkpoint_folder)

    def _get_output_dir(self, trial) -> str:
        staging = getattr(self, "_staging_root", None)
        return staging if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, written under ``OUTPUT_DIR/.staging`` and published with one rename.

        Raises:
            CheckpointWriteError: the disk is full, the filesystem read-only, or writing not permitted; names the
                folder, the cause and the previous (intact) checkpoint. Staging debris is removed when possible (and
                by the next save otherwise).
        """
        run_dir = super()._get_output_dir(trial)
        previous = checkpointing.latest_checkpoint(run_dir) if self.args.should_save else None
        try:
            self._save_checkpoint_atomically(model, trial, run_dir)
        except Exception as err:
            if not self.args.should_save or isinstance(err, checkpointing.CheckpointWriteError):
                raise
            final = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
            number, _ = checkpointing.describe_write_failure(final, err)
            if number is None:
                raise
            checkpointing.clear_staging(run_dir)
            raise checkpointing.checkpoint_write_error(final, err, previous) from err

    def _save_checkpoint_atomically(self, model, trial, run_dir: str) -> None:
        if self.args.should_save:
            staging = checkpointing.clear_staging(run_dir)
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self._staging_root = str(os.path.join(run_dir, checkpointing.STAGING_DIRNAME))
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        loader = getattr(self, "_stream_loader", None)
        if loader is not None:  # every rank its own position (with dataloader workers: each worker's)
            checkpointing.write_stream_position(
                os.path.join(run_dir, checkpointing.STAGING_DIRNAME, f"checkpoint-{self.state.global_step}"),
                self.args.process_index,
                loader.state_dict(),
            )
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            name = f"checkpoint-{self.state.global_step}"
            checkpointing.write_data_layout(
                os.path.join(run_dir, checkpointing.STAGING_DIRNAME, name), checkpointing.data_layout(self.args)
            )
            if self.args.torch_compile:  # a warm start for a resumed run and each of its ranks
                save_compile_artifacts(os.path.join(run_dir, checkpointing.STAGING_DIRNAME, name))
            checkpointing.publish(
                os.path.join(run_dir, checkpointing.STAGING_DIRNAME, name), os.path.join(run_dir, name)
            )
            checkpointing.clear_staging(run_dir)
            if self.args.push_to_hub:
                self._push_from_checkpoint(os.path.join(run_dir, name))
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )
        self.accelerator.wait_for_everyone()
