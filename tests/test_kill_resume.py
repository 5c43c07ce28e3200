"""kill -9 reliability: 20 SIGKILLs of a training run with checkpoint pushes, each followed by a restart.

See :mod:`tests.kill_harness` for what is killed when and what is checked. Writes
``<tmp>/kills/reliability_kills.json`` and prints ``kills survived: S / N``.
"""

import pytest

from tests.kill_harness import run_kill_harness


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
