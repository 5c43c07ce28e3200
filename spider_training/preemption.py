"""Graceful stop on a preemption notice: SIGTERM / SIGINT finish the current step, save a checkpoint, and stop.

Cluster schedulers (SLURM, Kubernetes, spot/preemptible VMs) announce a preemption with SIGTERM and kill the process a
grace period later; Ctrl-C sends SIGINT. :class:`StopOnSignalCallback` turns either into Trainer's own documented
stop: the signal handler only records the signal, and at the end of the current optimizer step ``on_step_end`` sets
``control.should_save = True`` and ``control.should_training_stop = True``. Trainer then writes ``checkpoint-N`` (the
atomic save of :class:`spider_training.trainer.SpiderTrainer`) and returns from ``train()`` normally; restarting the
same
command auto-resumes from ``checkpoint-N``.

Rules:

* The handlers are installed in ``on_train_begin`` and the previous handlers restored in ``on_train_end``: outside
  ``trainer.train()`` (model building, the final evaluation, the release) the signals keep their usual effect.
* A second signal while the graceful stop is pending restores the previous handler and re-delivers the signal
  (Ctrl-C twice = stop now: ``KeyboardInterrupt``; SIGTERM twice = terminate).
* Several processes (DDP / FSDP): the "stop" flag is max-reduced over all ranks at every step end (one 1-element
  collective), so all ranks stop -- and save -- at the same step even when only one of them got the signal.
* Handlers can only be installed from the main thread; elsewhere a warning is logged and signals are not handled.
* Dataloader worker processes (``dataloader_num_workers > 0``) get a terminal's Ctrl-C too and exit; sending the
  signal to the main process only (``kill -TERM <pid>``, what schedulers do) is unaffected.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def any_rank(flag: bool, device) -> bool:
    """True if `flag` is True on any process of the default process group (the flag itself without one)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    if torch.distributed.get_world_size() == 1:
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return bool(tensor.item())


class StopOnSignalCallback(TrainerCallback):
    """``TrainerCallback``: on SIGTERM/SIGINT, finish the step, save ``checkpoint-N``, stop training (no crash).

    Args:
        signals: the signals handled (default SIGTERM and SIGINT).

    Attributes:
        received: name of the first signal received during training (``"SIGTERM"``), or None.
        stopped_at_step: ``state.global_step`` at which training was stopped by the signal (the step of the
            checkpoint written), or None.
        stopped: ``stopped_at_step is not None``.

    Raises:
        ValueError: an empty `signals`.
    """

    def __init__(self, signals=DEFAULT_SIGNALS):
        signals = tuple(signals)
        if not signals:
            raise ValueError("StopOnSignalCallback needs at least one signal")
        self.signals = signals
        self.received: str | None = None
        self.stopped_at_step: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def stopped(self) -> bool:
        return self.stopped_at_step is not None

    # -- handlers ----------------------------------------------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers (main thread only). Returns whether they were installed."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "StopOnSignalCallback: not in the main thread; %s will not stop training gracefully",
                ", ".join(signal.Signals(s).name for s in self.signals),
            )
            return False
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return True

    def uninstall(self) -> None:
        """Restore the handlers that were in place before :meth:`install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # second signal: stop waiting for the step to end
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name

    # -- Trainer events ----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.install()

    def on_step_end(self, args, state, control, **kwargs):
        if not any_rank(self.received is not None, args.device):
            return
        if self.received is None:
            self.received = "signal on another rank"
        self.stopped_at_step = state.global_step
        control.should_save = True
        control.should_training_stop = True
        if state.is_world_process_zero:
            logger.warning("%s received: saving checkpoint-%d and stopping", self.received, state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.uninstall()
