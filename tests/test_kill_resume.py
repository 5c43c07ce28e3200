"""kill -9 reliability: 20 SIGKILLs of a training run with checkpoint pushes, each followed by a restart.

See :mod:`tests.kill_harness` for what is killed when and what is checked. Writes
``<tmp>/kills/reliability_kills.json`` and prints ``kills survived: S / N``.
"""

import pytest

from tests.kill_harness import run_kill_harness


@pytest.mark.slow
def test_twenty_kills_resume_from_newest_complete_checkpoint(tmp_path):
    result = run_kill_harness(n_kills=20, workdir=tmp_path / "kills", seed=0)
    assert (tmp_path / "kills" / "reliability_kills.json").is_file()
    assert result["violations"] == []
    assert result["kills"] == 20 and result["survived"] == 20
    assert all(result["phases"][phase] > 0 for phase in ("step", "save", "push")), result["phases"]
    assert result["final_step"] == result["max_steps"] and result["trajectory_equal"]
