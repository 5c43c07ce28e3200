"""Fault tolerance of training: preemption signals, full/read-only disk, one run per folder, NaN/inf steps.

The tests drive a real ``SpiderTrainer`` (tiny preset, mock data, CPU) in-process; ``train_hf.py`` in a process of
its own, sent a real SIGTERM / SIGINT and restarted, is tested in ``tests/test_kill_resume.py``, beside the kill -9
tests whose fork server (the training libraries imported once) it shares. Test doubles, named as such:
``NaNLossAtSteps`` (a forward hook poisoning the real model's loss at chosen steps -- a NaN cannot be provoked on
demand otherwise) and ``FullDiskWriter`` (raises ``OSError(ENOSPC)`` from the safetensors writer; used where no
tmpfs can be mounted).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback, default_data_collator

from spider_training import checkpointing
from spider_training.arguments import SpiderTrainingArguments
from spider_training.checkpointing import CheckpointWriteError
from spider_training.data import build_dataset
from spider_training.nonfinite import NonFiniteGuardCallback, NonFiniteLossError
from spider_training.preemption import DEFAULT_SIGNALS, StopOnSignalCallback
from spider_training.run_lock import RunLock, RunLockedError, lock_path
from spider_training.trainer import SpiderTrainer
from tests.helpers import TINY_TRAIN_HF_ARGS, checkpoint_names, tiny_model
from tokenization_spider import SpiderTokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = [*TINY_TRAIN_HF_ARGS, "--data", "mock"]


def make_trainer(
    output_dir: Path, max_steps: int, save_steps: int = 1000, callbacks=(), stop_signals=DEFAULT_SIGNALS, **settings
) -> SpiderTrainer:
    """A real SpiderTrainer on the tiny preset and mock data (fp32, CPU), AdamW with weight decay; `settings` are
    further ``SpiderTrainingArguments`` fields."""
    model = tiny_model(seed=0)
    args = SpiderTrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        max_steps=max_steps,
        per_device_train_batch_size=2,
        remove_unused_columns=False,
        save_steps=save_steps,
        save_total_limit=None,
        logging_steps=1,
        learning_rate=1e-3,
        weight_decay=0.1,
        dataloader_num_workers=0,
        seed=0,
        precision="fp32",
        **settings,
    )
    return SpiderTrainer(
        model=model,
        args=args,
        train_dataset=build_dataset("mock", 32),
        data_collator=default_data_collator,
        processing_class=SpiderTokenizer(),
        callbacks=list(callbacks),
        stop_signals=stop_signals,
    )


class NaNLossAtSteps:
    """Test double: a forward hook on the real model that multiplies the training loss by NaN (or inf) at the chosen
    optimizer steps (1-based; one micro-batch per step)."""

    def __init__(self, model, steps, value=float("nan")):
        self.steps, self.value, self.calls = set(steps), value, 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if not module.training:
            return output
        self.calls += 1
        if self.calls in self.steps:
            output.loss = output.loss * self.value
        return output


class Snapshots(TrainerCallback):
    """Copies every parameter and the optimizer's step counts at the end of each step."""

    def __init__(self):
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.opt_steps: dict[int, list[float]] = {}
        self.trainer = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = self.trainer.optimizer
        self.opt_steps[state.global_step] = [float(s["step"]) for s in opt.state_dict()["state"].values()]


def logged(trainer, key):
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e and "loss" in e}


# ----------------------------------------------------------------------------------------------- 4. non-finite loss


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_step_is_skipped_bit_identically_and_counted(tmp_path, value):
    snaps = Snapshots()
    trainer = make_trainer(tmp_path / "run", max_steps=4, callbacks=[snaps])
    snaps.trainer = trainer
    double = NaNLossAtSteps(trainer.model, steps=[3], value=value)
    trainer.train()
    assert trainer.state.global_step == 4 and double.calls == 4
    # step 3 skipped: parameters bit-identical to step 2 (AdamW with weight decay would have moved them on zero grads)
    for name, before in snaps.params[2].items():
        assert torch.equal(snaps.params[3][name], before), name
    changed = [n for n in snaps.params[3] if not torch.equal(snaps.params[4][n], snaps.params[3][n])]
    assert changed, "step 4 (finite) must update the weights again"
    assert snaps.opt_steps[3] == snaps.opt_steps[2] and max(snaps.opt_steps[4]) == max(snaps.opt_steps[2]) + 1
    assert trainer.nonfinite_guard.skipped_at == [3] and trainer.nonfinite_guard.skipped_steps == 1
    assert logged(trainer, "nonfinite_steps") == {1: 0, 2: 0, 3: 1, 4: 1}
    loss = logged(trainer, "loss")
    assert loss[3] != loss[3] and all(loss[s] == loss[s] for s in (1, 2, 4))  # no loss (NaN) for the skipped step
    assert sorted(logged(trainer, "lm_loss")) == [1, 2, 4]  # its loss terms are not averaged into the logs


def test_nonfinite_gradient_with_finite_loss_is_skipped(tmp_path):
    """A finite loss whose gradient is NaN (poisoned in backward) is caught by the gradient check."""
    snaps = Snapshots()
    trainer = make_trainer(tmp_path / "run", max_steps=2, callbacks=[snaps])
    snaps.trainer = trainer
    weight = next(p for p in trainer.model.parameters() if p.requires_grad)
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 2 else grad

    weight.register_hook(poison)
    trainer.train()
    assert trainer.nonfinite_guard.skipped_at == [2]
    for name, before in snaps.params[1].items():
        assert torch.equal(snaps.params[2][name], before), name


def test_too_many_consecutive_nonfinite_steps_stop_with_step_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(out, max_steps=10, save_steps=2, max_consecutive_nonfinite=2)
    NaNLossAtSteps(trainer.model, steps=range(3, 11))
    with pytest.raises(NonFiniteLossError) as info:
        trainer.train()
    message = str(info.value)
    assert "step 5" in message and "3 optimizer steps in a row" in message
    assert str(out / "checkpoint-4") in message  # steps 3-4 were skipped but the save at step 4 still happened
    assert trainer.nonfinite_guard.skipped_at == [3, 4, 5]


def test_nonfinite_guard_rejects_bad_limit():
    with pytest.raises(ValueError, match="max_consecutive_nonfinite"):
        NonFiniteGuardCallback(-1)


# ------------------------------------------------------------------------------------------- 2. disk full / read-only


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class FullDiskWriter:
    """Test double for a full disk: the safetensors writer transformers uses raises ``OSError(ENOSPC)`` while armed."""

    def __init__(self, monkeypatch):
        import transformers.modeling_utils as modeling_utils

        self.armed = False
        real = modeling_utils.safe_save_file

        def save_file(tensors, filename, *args, **kwargs):
            if self.armed:
                raise OSError(errno.ENOSPC, "No space left on device", filename)
            return real(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(modeling_utils, "safe_save_file", save_file)


class Arm(TrainerCallback):
    """Calls `action()` once, at the end of step `step` (before that step's save)."""

    def __init__(self, step, action):
        self.step, self.action, self.done = step, action, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            self.action()


def test_disk_full_during_save_names_path_and_keeps_previous_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    disk = FullDiskWriter(monkeypatch)
    snapshot = {}

    def fill_disk():
        snapshot.update(tree_bytes(out / "checkpoint-2"))
        disk.armed = True

    trainer = make_trainer(out, max_steps=6, save_steps=2, callbacks=[Arm(4, fill_disk)])
    with pytest.raises(CheckpointWriteError) as info:
        trainer.train()
    err = info.value
    assert err.errno == errno.ENOSPC and err.path == str(out / "checkpoint-4")
    assert "disk full" in str(err) and str(out / "checkpoint-4") in str(err) and str(out / "checkpoint-2") in str(err)
    assert checkpoint_names(out) == ["checkpoint-2"]
    assert tree_bytes(out / "checkpoint-2") == snapshot  # byte-identical
    # staging debris (left on purpose) does not block the next save once space is back
    (out / checkpointing.STAGING_DIRNAME / "checkpoint-4").mkdir(parents=True, exist_ok=True)
    disk.armed = False
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / checkpointing.STAGING_DIRNAME).exists()


def test_describe_write_failure_reads_errno_messages_and_filesystem(tmp_path):
    assert checkpointing.describe_write_failure(tmp_path, OSError(errno.EROFS, "x"))[0] == errno.EROFS
    wrapped = RuntimeError("open file failed with strerror: Read-only file system")
    assert checkpointing.describe_write_failure(tmp_path, wrapped) == (errno.EROFS, "read-only filesystem")
    safetensors_like = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert checkpointing.describe_write_failure(tmp_path, safetensors_like)[0] == errno.ENOSPC
    assert checkpointing.describe_write_failure(tmp_path, ValueError("a bug"))[0] is None  # plenty of space here


def _mount_tmpfs(target: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    target.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True
        ).returncode
        == 0
    )


@pytest.fixture
def tmpfs(tmp_path):
    """A real 64 MiB tmpfs (needs root with mount rights; skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    if not _mount_tmpfs(mnt, "64m"):
        pytest.skip("cannot mount a tmpfs here (not root or no CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("failure", ["disk_full", "read_only"])
def test_real_full_or_read_only_filesystem(tmpfs, failure):
    out = tmpfs / "run"
    snapshot = {}

    def break_disk():
        snapshot.update(tree_bytes(out / "checkpoint-2"))
        if failure == "disk_full":  # fill what is left of the real tmpfs
            with open(tmpfs / "filler", "wb", buffering=0) as handle:
                try:
                    while True:
                        handle.write(b"\0" * (1 << 16))
                except OSError as err:
                    assert err.errno == errno.ENOSPC
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)

    trainer = make_trainer(out, max_steps=6, save_steps=2, callbacks=[Arm(4, break_disk)], stop_signals=())
    with pytest.raises(CheckpointWriteError) as info:
        trainer.train()
    expected = {"disk_full": (errno.ENOSPC, "disk full"), "read_only": (errno.EROFS, "read-only")}[failure]
    assert info.value.errno == expected[0] and expected[1] in str(info.value)
    assert str(out / "checkpoint-4") in str(info.value)
    assert tree_bytes(out / "checkpoint-2") == snapshot
    assert checkpoint_names(out) == ["checkpoint-2"]
    # space / writability back: the next save goes through despite any debris
    if failure == "disk_full":
        (tmpfs / "filler").unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert checkpoint_names(out)[-1] == "checkpoint-6"
    assert not (out / checkpointing.STAGING_DIRNAME).exists()


def test_kill_harness_flags_a_half_written_checkpoint(tmp_path):
    """The kill harness's completeness check (tests/kill_harness.py) is not vacuous."""
    from tests.kill_harness import checkpoint_problem

    out = tmp_path / "run"
    make_trainer(out, max_steps=1, save_steps=1).train()
    folder = out / "checkpoint-1"
    assert checkpoint_problem(folder) is None
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # what a non-atomic save could leave
    assert "unreadable" in checkpoint_problem(folder)
    (folder / "optimizer.pt").unlink()
    assert "missing ['optimizer.pt']" in checkpoint_problem(folder)


# --------------------------------------------------------------------------------------------- 3. one run per folder


def test_run_lock_refuses_a_second_holder_and_allows_other_ranks(tmp_path):
    with RunLock(tmp_path / "run", rank=0) as first:
        assert first.is_locked
        with pytest.raises(RunLockedError, match=str(tmp_path / "run")) as info:
            RunLock(tmp_path / "run", rank=0).acquire()
        assert f"pid {os.getpid()}" in str(info.value)
        with RunLock(tmp_path / "run", rank=1):  # another rank of the same run
            pass
    with RunLock(tmp_path / "run", rank=0):  # released on exit
        pass


def test_second_train_hf_run_on_same_folder_refuses_to_start(tmp_path):
    import train_hf

    out = tmp_path / "run"
    with RunLock(out, rank=0):
        with pytest.raises(RunLockedError, match="another run is using output directory"):
            train_hf.main(TINY + ["--ckpt_dir", str(out), "--max_steps", "1"])
    assert not checkpoint_names(out)


def test_lock_of_a_killed_run_does_not_block_the_restart(tmp_path):
    out = tmp_path / "run"
    code = (
        "import sys, time\nfrom spider_training.run_lock import RunLock\n"
        "lock = RunLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            RunLock(out).acquire()
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert lock_path(out).exists()  # the stale file is still there...
    with RunLock(out):  # ...but the OS released the lock
        pass


# ------------------------------------------------------------------------------------------------ 1. SIGTERM / SIGINT


class SendSignal(TrainerCallback):
    """Sends `signum` to this very process at the end of step `step` (a real signal, delivered by the OS)."""

    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_step_saves_and_stops(tmp_path, signum):
    out = tmp_path / "run"
    previous = signal.getsignal(signum)
    trainer = make_trainer(out, max_steps=8, save_steps=100, callbacks=[SendSignal(2, signum)])
    trainer.train()  # no KeyboardInterrupt, no death
    stop = trainer.stop_callback
    # the handler ran during SendSignal's on_step_end; the stop callback (added after it) sees it the same step
    assert stop.received == signal.Signals(signum).name and stop.stopped_at_step == 2
    assert trainer.state.global_step == 2
    assert checkpoint_names(out) == ["checkpoint-2"]
    assert signal.getsignal(signum) is previous  # handlers restored after train()


def test_stop_callback_without_signals_is_refused():
    with pytest.raises(ValueError, match="at least one signal"):
        StopOnSignalCallback(())
