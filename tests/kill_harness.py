"""kill -9 harness: SIGKILL ``train_hf.py`` at random moments, restart it with the same command, check every resume.

:func:`run_kill_harness` trains the tiny preset (``--data mock``, or a local ``.jsonl`` corpus through the byte
cache or streamed: ``source``; seq_len 32, micro_batch 2, a checkpoint every step, each pushed to a local
:class:`tests.hub_server.FakeHubServer` -- the Hub test double) in a subprocess and kills it ``n_kills`` times
with SIGKILL. Each kill waits until the life made progress (a checkpoint newer than the one it resumed from) and then
lands in a phase drawn from a seeded RNG:

* ``"step"``: a uniform random delay (0-0.4 s) -- anywhere in a step, a save or a push;
* ``"save"``: the moment ``OUTPUT_DIR/.staging/checkpoint-*`` appears (a checkpoint half-written);
* ``"push"``: the moment ``OUTPUT_DIR/.hub_push_staging/checkpoint-*`` appears (an upload in flight), plus 0-50 ms.

After every kill the harness checks that the newest ``checkpoint-N`` folder is complete (every file present,
safetensors and the optimizer state readable, ``trainer_state.json`` at step N), restarts the same command, and checks
from its log that it resumed from exactly that folder and got further (staging debris must not block its next
save; the dead run's lock must not block the start). A kill is *survived* when all of that holds. Finally the run
completes, and its loss trajectory (``log_history`` of the last checkpoint) is compared step by step with an
uninterrupted run of the same command (run alongside, on the other core).

Each life is a fresh process running ``train_hf.py``'s entry point (:func:`spider_training.train.cli`) with the same
argument list, forked from a ``multiprocessing`` fork server that imported the training modules once
(:func:`_life_context`): importing torch, transformers, peft, bitsandbytes and torchao costs 10-20 s of the 2-core
machine per process, several times a tiny life's training, so a fork server keeps the kills on the training code
(the run lock, resume, steps, saves, pushes) rather than on library imports. Nothing of a life survives it: every
life starts from the fork server's import-only state, and SIGKILL ends it as it ends a ``python train_hf.py``.
A life first moves the fork server's objects (half a million, from the imports) out of the garbage collector's reach
(``gc.freeze``), as a fork server's children should: its collections (Trainer's ``train`` starts with a full one)
then walk only the life's own objects instead of taking ~0.5 s and copying every inherited page.

The lives run with ``OMP_NUM_THREADS=1``: on the 2-core development machine two intra-op threads make a tiny
step 10-100x slower (0.5-7 s instead of 0.05 s); one thread per process also lets the reference run use the other
core.

Command line (for the reliability table)::

    python -m tests.kill_harness --kills 20 --workdir /tmp/kills --seed 0
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import multiprocessing
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spider_training import checkpointing  # noqa: E402
from tests.hub_server import FakeHubServer  # noqa: E402

PHASES = ("step", "save", "push")
CHECKPOINT_FILES = (
    "model.safetensors",
    "config.json",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "modeling_spider.py",
    "tokenizer_config.json",
)
HUB_STAGING = ".hub_push_staging"
LOSS_RTOL = 1e-4
LOSS_ATOL = 1e-5


def command(output_dir: Path, max_steps: int, hub_url: str, data_args: list[str] | None = None) -> list[str]:
    """The training command every life runs (identical each time): ``train_hf.py``'s arguments; `data_args` in place
    of ``--data mock``."""
    return [
        "--preset",
        "tiny",
        *(data_args or ["--data", "mock"]),
        "--seq_len",
        "32",
        "--micro_batch",
        "2",
        "--logging_steps",
        "1",
        "--dataloader_num_workers",
        "0",
        "--sample_bytes",
        "4",
        "--ckpt_dir",
        str(output_dir),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "1",
        "--save_total_limit",
        "2",
        "--push_to_hub",
        "--hub_model_id",
        "spider/kills",
        "--hub_token",
        "hf_fake",
        "--hub_endpoint",
        hub_url,
    ]


#: the lives' environment, set before the fork server imports anything (huggingface_hub reads its constants at
#: import; torch its thread count at its first parallel op)
LIFE_ENVIRONMENT = dict(
    OMP_NUM_THREADS="1",
    MKL_NUM_THREADS="1",
    HF_HUB_DISABLE_XET="1",
    HF_HUB_OFFLINE="0",
    TOKENIZERS_PARALLELISM="false",
    PYTHONUNBUFFERED="1",
    # the byte cache of a local text source (<HF_DATASETS_CACHE>/spider_bytes) kept out of the user's cache
    HF_DATASETS_CACHE=os.path.join(tempfile.gettempdir(), "spider-kill-harness-datasets"),
)
#: imported once by the fork server, before any life: train_hf.py's entry point and everything it imports
PRELOADED_MODULES = ["spider_training.train", "tests.kill_harness"]


def _life_context():
    """The ``forkserver`` multiprocessing context, its server started (once per process) in
    :data:`LIFE_ENVIRONMENT` with :data:`PRELOADED_MODULES` imported."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)
    from multiprocessing import forkserver

    with mock.patch.dict(os.environ, LIFE_ENVIRONMENT):
        forkserver.ensure_running()
    return context


def _life(argv: list[str], log_path: str) -> None:
    """One life, in a process forked from the fork server: stdout and stderr unbuffered into `log_path`, then
    ``train_hf.py``'s entry point on `argv` (its exit status is the process's)."""
    gc.freeze()  # the fork server's objects (the imported libraries): no garbage collection walks them again
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    sys.stdout = sys.stderr = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    os.chdir(REPO)
    sys.argv = [str(REPO / "train_hf.py"), *argv]
    from spider_training.train import cli

    sys.exit(cli())


class _Life:
    """A running life: ``poll``/``kill``/``wait``/``returncode`` as on a ``subprocess.Popen`` (killed: -9)."""

    def __init__(self, context, argv: list[str], log_path: Path):
        self.process = context.Process(target=_life, args=(argv, str(log_path)), daemon=True)
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        self.process.kill()  # SIGKILL

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` (``checkpoint-N``) is not a complete, loadable checkpoint, or None if it is."""
    import torch
    from safetensors import safe_open

    step = int(folder.name.split("-")[1])
    missing = [name for name in CHECKPOINT_FILES if not (folder / name).is_file()]
    if missing:
        return f"{folder.name}: missing {missing}"
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
        if state["global_step"] != step:
            return f"{folder.name}: trainer_state global_step {state['global_step']}"
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            for key in handle.keys():
                handle.get_tensor(key)
        torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- any failure to read is a broken checkpoint
        return f"{folder.name}: unreadable ({type(err).__name__}: {err})"
    return None


def newest_step(output_dir: Path) -> int:
    latest = checkpointing.latest_checkpoint(output_dir)
    return int(Path(latest).name.split("-")[1]) if latest else 0


def _appeared(folder: Path) -> bool:
    try:
        return any(child.name.startswith("checkpoint-") for child in folder.iterdir())
    except OSError:
        return False


def losses(output_dir: Path, step: int) -> dict[int, float]:
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


def _start(context, cmd: list[str], log_path: Path) -> _Life:
    return _Life(context, cmd, log_path)


def start_train_hf(argv: list[str], log_path: Path) -> _Life:
    """``python train_hf.py ARGV`` as a life: a fresh process forked from the fork server (started on first use, with
    :data:`LIFE_ENVIRONMENT`), its stdout and stderr in `log_path`; ``poll``/``kill``/``wait``/``returncode`` and
    ``pid`` (send it signals) as on a ``subprocess.Popen``. Used by tests that signal a training run
    (``tests/test_kill_resume.py``'s preemption test)."""
    return _Life(_life_context(), argv, log_path)


def _resumed_from(log_text: str) -> str | None:
    match = re.search(r"resuming from (\S+)", log_text)
    return match.group(1) if match else None


#: training data the harness can run on besides ``mock`` (``--source``): a local ``.jsonl`` corpus written into the
#: work folder, read through the byte cache or streamed (``--streaming``, its position saved in each checkpoint)
SOURCES = ("mock", "cached_text", "streamed_text")


def write_corpus(folder: Path, documents: int = 400) -> Path:
    """A small ``.jsonl`` corpus (`documents` lines of 20-200 bytes, varied) in `folder`; returns its path."""
    rng = random.Random(7)
    words = ["spider", "byte", "window", "resume", "kill", "stream", "cache", "loss", "step", "shard"]
    path = Path(folder) / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def data_arguments(source: str, workdir: Path) -> list[str]:
    """The ``--data`` arguments of `source` (one of :data:`SOURCES`), writing its corpus into `workdir`."""
    if source == "mock":
        return ["--data", "mock"]
    corpus = str(write_corpus(workdir))
    if source == "cached_text":
        return ["--data", corpus]
    if source == "streamed_text":
        return ["--data", corpus, "--streaming", "--shuffle_buffer", "16"]
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")


def run_kill_harness(
    n_kills: int,
    workdir: Path,
    seed: int,
    max_steps: int = 80,
    life_timeout_s: float = 120.0,
    source: str = "mock",
) -> dict:
    """Kill a training run `n_kills` times (SIGKILL), restart it each time, and check every resume.

    Args:
        n_kills: SIGKILLs to deliver (fewer happen if training finishes first; reported).
        workdir: scratch folder (created); results go to ``workdir/reliability_kills.json``.
        seed: seeds the RNG choosing the phase and delay of each kill.
        max_steps: training length (a life makes ~1-3 steps before its kill).
        life_timeout_s: a life that makes no progress for this long is a failure.
        source: the training data, one of :data:`SOURCES` (``mock``; a local ``.jsonl`` corpus through the byte cache,
            or streamed with its position in each checkpoint).

    Returns:
        dict with ``kills`` (attempted), ``survived``, ``phases`` (kills per phase), ``violations`` (list of str),
        ``final_step``, ``max_loss_diff`` (largest |loss - reference loss| over all steps), ``trajectory_equal``,
        ``seconds``, ``summary`` (``"kills survived: S / N"``).
    """
    started = time.monotonic()
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    rng = random.Random(seed)
    out, ref_out = workdir / "killed", workdir / "reference"
    violations: list[str] = []
    phases = {phase: 0 for phase in PHASES}
    kills = survived = 0
    context = _life_context()
    data_args = data_arguments(source, workdir)
    with FakeHubServer(token="hf_fake") as hub:
        cmd = command(out, max_steps, hub.url, data_args)
        ref_cmd = command(ref_out, max_steps, hub.url, data_args)
        ref_cmd[ref_cmd.index("spider/kills")] = "spider/reference"
        reference = _start(context, ref_cmd, workdir / "reference.log")
        life = 0
        pending_check = None  # (expected resume folder, step) of the kill to confirm on the next life
        while True:
            life += 1
            start_step = newest_step(out)
            log_path = workdir / f"life{life:02d}.log"
            proc = _start(context, cmd, log_path)
            phase = rng.choice(PHASES) if kills < n_kills else None
            delay = rng.uniform(0.0, 0.4) if phase == "step" else rng.uniform(0.0, 0.05)
            deadline = time.monotonic() + life_timeout_s
            killed = False
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    violations.append(f"life {life}: no progress within {life_timeout_s:.0f}s")
                    proc.kill()
                    break
                if phase is not None and newest_step(out) > start_step:
                    if phase == "step":
                        time.sleep(delay)
                        fire = True
                    elif phase == "save":
                        fire = _appeared(out / checkpointing.STAGING_DIRNAME)
                    else:
                        fire = _appeared(out / HUB_STAGING)
                        if fire:
                            time.sleep(delay)
                    if fire and proc.poll() is None:
                        proc.kill()  # SIGKILL
                        killed = True
                        break
                time.sleep(0.005)
            proc.wait()
            text = log_path.read_text(errors="replace")
            # the previous kill is survived if this life resumed from the newest complete checkpoint and got further
            if pending_check is not None:
                want, kill_no = pending_check
                got = _resumed_from(text)
                progressed = newest_step(out) > start_step or proc.returncode == 0
                if got != want:
                    violations.append(f"kill {kill_no}: restart resumed from {got}, newest complete is {want}")
                elif not progressed:
                    violations.append(f"kill {kill_no}: restart made no progress after resuming from {want}")
                else:
                    survived += 1
            if killed:
                kills += 1
                phases[phase] += 1
                newest = checkpointing.latest_checkpoint(out)
                problem = checkpoint_problem(Path(newest)) if newest else "no checkpoint at all"
                if problem:
                    violations.append(f"kill {kills} ({phase}): newest checkpoint broken: {problem}")
                pending_check = (newest, kills)
                continue
            pending_check = None
            if proc.returncode != 0:
                violations.append(f"life {life}: exited {proc.returncode}: {text[-1500:]}")
            break
        reference.wait(timeout=600)
    final_step = newest_step(out)
    max_diff, trajectory_equal = float("inf"), False
    if final_step == max_steps and reference.returncode == 0:
        got, want = losses(out, max_steps), losses(ref_out, max_steps)
        steps = sorted(want)
        if sorted(got) != steps:
            violations.append(f"logged steps differ: {sorted(set(steps) ^ set(got))}")
        else:
            diffs = [abs(got[s] - want[s]) for s in steps]
            max_diff = max(diffs)
            trajectory_equal = all(abs(got[s] - want[s]) <= LOSS_ATOL + LOSS_RTOL * abs(want[s]) for s in steps)
            if not trajectory_equal:
                violations.append(f"loss trajectory differs from the uninterrupted run (max |diff| {max_diff:.3g})")
    else:
        violations.append(f"run ended at step {final_step} (reference exit {reference.returncode})")
    result = {
        "kills": kills,
        "survived": survived,
        "requested_kills": n_kills,
        "phases": phases,
        "seed": seed,
        "source": source,
        "max_steps": max_steps,
        "final_step": final_step,
        "max_loss_diff": max_diff,
        "trajectory_equal": trajectory_equal,
        "violations": violations,
        "lives": life,
        "seconds": round(time.monotonic() - started, 1),
    }
    result["summary"] = f"kills survived: {survived} / {kills}"
    (workdir / "reliability_kills.json").write_text(json.dumps(result, indent=2))
    print(result["summary"], flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/spider-kill-harness"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=80)
    parser.add_argument("--source", choices=SOURCES, default="mock")
    ns = parser.parse_args(argv)
    result = run_kill_harness(ns.kills, ns.workdir, ns.seed, max_steps=ns.max_steps, source=ns.source)
    print(json.dumps(result, indent=2))
    return 0 if not result["violations"] and result["survived"] == result["kills"] else 1


if __name__ == "__main__":
    sys.exit(main())
