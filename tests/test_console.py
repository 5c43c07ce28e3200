"""The main job's console: the README's command starts with what the run will do, not library noise.

Runs the README's main command (``accelerate launch --num_cpu_threads_per_process $(nproc) --config_file
configs/accelerate/single_process.yaml train_hf.py``) for one step in a subprocess and checks its output for every line
of noise a fresh machine printed
before, and for the start-up summary. Slow: one short training run in a fresh process (~13 s).
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spider_training.console import IMPORT_TIME_LOGGERS, describe_run, quiet_loggers

REPO = Path(__file__).resolve().parents[1]

#: (what it was, a substring of it) -- each printed by the default command on a fresh machine before the fix
KNOWN_NOISE = [
    ("accelerate's defaults block", "were not passed to `accelerate launch`"),
    ("torchao's CUDA extension warnings", "Failed to load"),
    ("torch pytree deprecation warnings", "is an Enum subclass"),
    ("transformers' GenerationConfig dump", "GenerationConfig {"),
    ("the sampler note about IterableDataset", "IterableDataset"),
    ("an infinite epoch count", "Num Epochs = 9,223,372,036,854,775,807"),
    ("the pin_memory warning on a CPU machine", "pin_memory"),
    ("transformers' shard-writing progress bars", "Writing model shards"),
]


def test_quiet_loggers_restores_levels_and_leaves_other_loggers_alone():
    other = logging.getLogger("spider_training.data")
    before = [logging.getLogger(n).level for n in IMPORT_TIME_LOGGERS] + [other.level]
    with quiet_loggers():
        assert all(logging.getLogger(n).level == logging.ERROR for n in IMPORT_TIME_LOGGERS)
        assert other.level == before[-1]
    assert [logging.getLogger(n).level for n in IMPORT_TIME_LOGGERS] + [other.level] == before


def test_describe_run_says_how_much_of_the_corpus_a_run_sees():
    text = describe_run(
        preset="small",
        parameters=6_045_379,
        data="sotu",
        train_windows=44_081,
        window_bytes=257,
        eval_data="sotu",
        precision="fp32",
        moe_backend="torch",
        devices="1 process(es) on cpu",
        output_dir="runs/x",
        max_steps=500,
        batch_windows=8,
        eval_steps=50,
    )
    assert text.splitlines()[0] == "Spider small: 6.05M parameters"
    assert "500 steps x 8 windows see 4,000 windows (9.1% of them)" in text
    assert "scored every 50 steps and after training" in text and "output:     runs/x" in text


@pytest.mark.slow
def test_main_command_starts_with_the_run_summary_and_no_library_noise(tmp_path):
    # The README's command at a test's size: one step of 2 windows of 64 bytes, one held-out batch, 2 sampled bytes,
    # and one thread, as the suite gives every subprocess (its two workers already fill the cores: with $(nproc)
    # threads on 2 busy cores the same run took 28 s instead of 13 s). None of them changes what the run prints.
    cmd = [
        "accelerate",
        "launch",
        "--num_cpu_threads_per_process",
        "1",
        "--config_file",
        str(REPO / "configs/accelerate/single_process.yaml"),
        str(REPO / "train_hf.py"),
        "--max_steps",
        "1",
        "--micro_batch",
        "2",
        "--seq_len",
        "64",
        "--eval_windows",
        "1",
        "--sample_bytes",
        "2",
        "--ckpt_dir",
        str(tmp_path / "run"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    accelerate = Path(sys.executable).with_name("accelerate")
    if accelerate.exists():
        cmd[0] = str(accelerate)
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for what, needle in KNOWN_NOISE:
        assert needle not in output, f"{what} is back: {needle!r}\n{output[:3000]}"
    first = output.splitlines()[:12]
    summary = next(i for i, line in enumerate(first) if line.startswith("Spider small: "))
    for key in ("data:", "held-out:", "precision:", "MoE:", "devices:", "output:"):
        assert any(line.strip().startswith(key) for line in first[summary:]), (key, first)
    assert "release written to" in output and "sample:" in output
