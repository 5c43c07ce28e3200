"""spider_training.compatibility: the one list of compatibility aliases agrees with the code. Every listed module alias
is its new module (with a FutureWarning naming the removal version), runs as that command under ``python -m``, and
every alias module in spider_training/ is listed; every listed alias names a file that reads it."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spider_training.compatibility import ALIASES

ROOT = Path(__file__).resolve().parents[1]
MODULE_ALIASES = [a for a in ALIASES if re.fullmatch(r"spider_training\.\w+", a.old)]


@pytest.mark.parametrize("alias", MODULE_ALIASES, ids=lambda a: a.old)
def test_a_module_alias_is_the_new_module_and_warns(alias):
    new = importlib.import_module(alias.new)
    package, name = alias.old.rsplit(".", 1)
    sys.modules.pop(alias.old, None)
    try:
        with pytest.warns(FutureWarning, match=re.escape(alias.removed_in)):
            old = importlib.import_module(alias.old)
        assert old is new or all(getattr(old, f) is getattr(new, f) for f in ("main",) if hasattr(new, f))
    finally:  # as before the import: other tests import the alias afresh and expect its warning
        sys.modules.pop(alias.old, None)
        if hasattr(sys.modules[package], name):
            delattr(sys.modules[package], name)


def test_every_alias_module_is_listed_and_every_listed_file_exists():
    listed = {a.old for a in MODULE_ALIASES}
    forwarding = {
        f"spider_training.{path.stem}"
        for path in (ROOT / "spider_training").glob("*.py")
        if "forward_module(__name__)" in path.read_text() or "is deprecated; use" in path.read_text()
    }
    assert forwarding == listed
    for alias in ALIASES:
        assert (ROOT / alias.where).is_file(), alias
        assert re.fullmatch(r"(transformers )?\d+\.\d+\.\d+", alias.removed_in), alias


def test_an_old_command_path_runs_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "spider_training.write_shards", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--source" in result.stdout and "removed in 0.3.0" in result.stderr
