"""kill -9 reliability: 20 SIGKILLs of a training run with checkpoint pushes, each followed by a restart; and a run
preempted by SIGTERM / SIGINT, then restarted.

See :mod:`tests.kill_harness` for what is killed when and what is checked. Writes
``<tmp>/kills/reliability_kills.json`` and prints ``kills survived: S / N``. Every run here is ``train_hf.py`` in a
process of its own, forked from the kill harness's fork server (started once per pytest process: the training
libraries imported once, not by every run); the preemption test lives here rather than in
``tests/test_fault_tolerance.py`` (the rest of the fault tolerance tests, in-process) to share that server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import TINY_TRAIN_HF_ARGS, checkpoint_names
from tests.kill_harness import run_kill_harness, start_train_hf

#: train_hf.py's arguments of the preempted run (tiny preset, mock data)
TINY = [*TINY_TRAIN_HF_ARGS, "--data", "mock"]


@pytest.mark.slow
def test_twenty_kills_resume_from_newest_complete_checkpoint(tmp_path):
    # 48 steps: the 20 kills of seed 0 take 23-24 steps here (a life makes 1-3 steps before its kill), twice that
    # leaves room for faster steps (the reliability table's command line keeps 80)
    result = run_kill_harness(n_kills=20, workdir=tmp_path / "kills", seed=0, max_steps=48)
    assert (tmp_path / "kills" / "reliability_kills.json").is_file()
    assert result["violations"] == []
    assert result["kills"] == 20 and result["survived"] == 20
    assert all(result["phases"][phase] > 0 for phase in ("step", "save", "push")), result["phases"]
    assert result["final_step"] == result["max_steps"] and result["trajectory_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["cached_text", "streamed_text"])
def test_kills_resume_a_local_text_source_cached_or_streamed(tmp_path, source):
    """Issue 67: SIGKILLs of a run on a local .jsonl corpus, read through the byte cache (built by the first life or
    the reference run, reused by every restart) or streamed and shuffled (each restart continues from the position
    in the checkpoint): every restart resumes from the newest complete checkpoint and the per-step losses equal an
    uninterrupted run's."""
    result = run_kill_harness(n_kills=3, workdir=tmp_path / "kills", seed=1, max_steps=12, source=source)
    assert result["violations"] == []
    assert result["kills"] == 3 and result["survived"] == 3
    assert result["final_step"] == result["max_steps"] and result["trajectory_equal"]
    lives = [path.read_text() for path in sorted((tmp_path / "kills").glob("life*.log"))[1:]]
    if source == "streamed_text":  # every restart continued the stream from its saved position
        assert all("saved position; nothing replayed" in text for text in lives)
    else:  # every restart found the byte cache the first life or the reference run wrote
        assert all("byte cache" in text for text in lives)


def _start(out: Path, log: Path, *extra: str):
    """``python train_hf.py`` on the tiny preset into `out`, its output in `log`: a process of its own, forked from the
    kill harness's fork server (:func:`tests.kill_harness.start_train_hf`: the training libraries imported once, not
    by every run; ``OMP_NUM_THREADS=1``, as 2 intra-op threads make tiny steps 10-100x slower on 2 cores)."""
    return start_train_hf([*TINY, "--ckpt_dir", str(out), *extra], log)


def _output(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _log_steps(output_dir: Path, step: int) -> list[int]:
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [e["step"] for e in state["log_history"] if "loss" in e]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_train_hf_preempted_then_resumed(tmp_path, signum):
    out = tmp_path / "run"
    args = ["--max_steps", "12", "--save_steps", "1000"]
    proc = _start(out, tmp_path / "first.log", *args)
    # wait for the first logged step (Trainer prints each log dict, "{'loss': ...}", at the end of a step)
    deadline = time.monotonic() + 180
    while "'loss'" not in (text := _output(tmp_path / "first.log")):
        assert proc.poll() is None, f"train_hf.py ended before logging a step:\n{text[-3000:]}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.01)
    os.kill(proc.pid, signum)
    proc.wait(timeout=180)
    text = _output(tmp_path / "first.log")
    assert proc.returncode == 0, text[-3000:]
    name = signal.Signals(signum).name
    stopped = [line for line in text.splitlines() if line.startswith(f"stopped by {name} at step ")]
    assert stopped, text[-3000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert 1 <= step < 12
    assert f"checkpoint written to {out / f'checkpoint-{step}'}" in stopped[0]
    assert checkpoint_names(out) == [f"checkpoint-{step}"]
    assert "release written" not in text and not (out / "release").exists()  # post-training work skipped
    if signum != signal.SIGTERM:
        return  # the resume below does not depend on which signal stopped the run: once is enough
    # restart with the same command: resumes from `step`, reaches max_steps
    proc = _start(out, tmp_path / "restart.log", *args)
    proc.wait(timeout=300)
    text = _output(tmp_path / "restart.log")
    assert proc.returncode == 0, text[-3000:]
    assert f"resuming from {out / f'checkpoint-{step}'}" in text
    assert _log_steps(out, 12)[-1] == 12
    assert sorted(set(_log_steps(out, 12))) == list(range(1, 13))
