"""Skip optimizer steps whose loss or gradients are NaN/inf; stop the run after too many in a row.

How a step is skipped (no weight update at all): just before ``optimizer.step()`` -- Trainer's documented
``on_pre_optimizer_step`` event, after gradient synchronisation and clipping -- the guard decides whether this
optimizer
step is bad: a micro-batch of it had a non-finite loss (reported by :meth:`NonFiniteGuardCallback.observe_loss`) or
any gradient of the optimizer's parameters is non-finite. If so it sets every parameter's ``.grad`` to ``None``.
PyTorch optimizers (``torch.optim.AdamW``, bitsandbytes ``AdamW8bit``, ...) skip parameters whose gradient is
``None`` entirely: no weight decay, no moment update, no step count -- the parameters and the optimizer state stay
bit-identical. (A zero gradient would not do: AdamW still decays the weights and moves them with its momentum.)
The learning-rate schedule still advances with ``global_step``, so the run keeps its length.

Several processes: the bad/good decision is max-reduced over all ranks (one 1-element collective per optimizer step),
so every rank skips the same steps and the replicas stay identical -- also with FSDP, where each rank sees only its
gradient shard.

``max_consecutive`` skipped steps in a row are tolerated; the next one raises :class:`NonFiniteLossError` naming the
step and the newest complete checkpoint to restart from (for example with a lower ``--lr``).
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from .checkpointing import latest_checkpoint
from .preemption import any_rank

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_NONFINITE = 10
"""Skipped (non-finite) optimizer steps tolerated in a row before the run stops (``SpiderTrainer`` kwarg
``max_consecutive_nonfinite``)."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive optimizer steps had a NaN/inf loss or gradient."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor (FSDP2) shard


def grads_are_finite(params) -> bool:
    """True if every existing ``.grad`` of `params` (an iterable of tensors) holds only finite values (one sync)."""
    checks = [torch.isfinite(_local(p.grad)).all() for p in params if p.grad is not None]
    if not checks:
        return True
    return bool(torch.stack([c.to(checks[0].device) for c in checks]).all())


class NonFiniteGuardCallback(TrainerCallback):
    """``TrainerCallback`` that skips optimizer steps with a non-finite loss or gradient and counts them.

    Args:
        max_consecutive: skipped steps tolerated in a row (>= 0); one more raises :class:`NonFiniteLossError`.

    Attributes:
        skipped_steps: total optimizer steps skipped (also after a resume: restored from the last
            ``nonfinite_steps`` entry of ``state.log_history``).
        consecutive: skipped steps in a row right now.
        skipped_at: the step numbers skipped in this process (the number the step would have had in the logs,
            ``state.global_step`` after it).

    Raises:
        ValueError: a negative `max_consecutive`.
    """

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE):
        if not isinstance(max_consecutive, int) or max_consecutive < 0:
            raise ValueError(f"max_consecutive_nonfinite must be an integer >= 0, got {max_consecutive!r}")
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0
        self.skipped_at: list[int] = []
        self._loss_bad = False
        self._last_log_step = 0

    def all_skipped_since_last_log(self, global_step: int) -> bool:
        """Called when a training loss is logged at `global_step`: whether every step since the previous log was
        skipped (then there is no loss to report). Marks `global_step` as the last logged step."""
        since, self._last_log_step = self._last_log_step, global_step
        steps = global_step - since
        return steps > 0 and sum(1 for step in self.skipped_at if step > since) >= steps

    def observe_loss(self, loss: torch.Tensor) -> bool:
        """Record one training micro-batch's loss (scalar tensor). Returns whether it is finite."""
        finite = bool(torch.isfinite(loss.detach()).all())
        if not finite:
            self._loss_bad = True
        return finite

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_log_step = state.global_step
        self._loss_bad = False
        for entry in reversed(state.log_history):
            if "nonfinite_steps" in entry:
                self.skipped_steps = int(entry["nonfinite_steps"])
                break

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        # Trainer hands callbacks the optimizer it had at __init__ (usually None): fall back to the model's parameters
        params = (
            [p for group in optimizer.param_groups for p in group["params"]]
            if optimizer is not None
            else list(model.parameters())
        )
        bad = any_rank(self._loss_bad or not grads_are_finite(params), args.device)
        self._loss_bad = False
        if not bad:
            self.consecutive = 0
            return
        step = state.global_step + 1
        for p in params:
            p.grad = None  # optimizers skip parameters without a gradient: no update, no state change
        self.skipped_steps += 1
        self.consecutive += 1
        self.skipped_at.append(step)
        if self.consecutive > self.max_consecutive:
            last = latest_checkpoint(args.output_dir)
            raise NonFiniteLossError(
                f"step {step}: non-finite (NaN/inf) loss or gradients for {self.consecutive} optimizer steps in a row "
                f"(limit max_consecutive_nonfinite={self.max_consecutive}); training stopped. Last good checkpoint: "
                f"{last or 'none written yet'}. Restart from it, e.g. with a lower learning rate."
            )
        if state.is_world_process_zero:
            logger.warning(
                "step %d: non-finite loss or gradients; optimizer step skipped (%d in a row, %d total)",
                step,
                self.consecutive,
                self.skipped_steps,
            )
