"""Packaging: the wheel carries the card template, installs no generic top-level module, and its card
writer works from site-packages alone (a folder the wheel was installed into, the checkout off the path)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REMOTE_CODE_FILES

REPO = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)]
    try:  # the build backend installed here avoids fetching setuptools again; else pip's isolated build
        import setuptools  # noqa: F401
        import wheel  # noqa: F401

        cmd.append("--no-build-isolation")
    except ImportError:
        pass
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (wheel_file,) = out.glob("spider_lm-*.whl")
    return wheel_file


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheel_file = _build_wheel(tmp / "dist")
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel_file)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return wheel_file, site


def test_wheel_ships_the_card_template_and_no_generic_top_level_module(installed):
    wheel_file, _ = installed
    names = zipfile.ZipFile(wheel_file).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {*REMOTE_CODE_FILES, "spider_training"}
    assert "spider_training/hub_card/model_card.md.j2" in names
    assert "spider_training/hub_card/card_labels.json" in names
    entry_points = zipfile.ZipFile(wheel_file).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "spider-train = spider_training.train:cli" in entry_points
    assert "spider-serve = spider_training.commands.serve:cli" in entry_points
    assert "spider-evaluate = spider_training.commands.evaluate:main" in entry_points
    assert "spider_training/evaluation.py" in names and "spider_training/commands/evaluate.py" in names
    assert "spider-memory-plan = spider_training.commands.memory_plan:main" in entry_points
    assert "spider_training/commands/serve.py" in names and "spider_training/commands/__init__.py" in names
    assert "spider_training/fp8_gemm_table.json" in names  # --fp8_layers auto reads it from the installed package


def test_card_writer_runs_from_the_installed_wheel(installed, tmp_path):
    _, site = installed
    script = r"""
import json, shutil, sys
from pathlib import Path
import spider_training.model_card as mc, modeling_spider
site = Path(sys.argv[1]).resolve()
assert Path(mc.__file__).resolve().is_relative_to(site), mc.__file__   # the installed copy, not the checkout
assert Path(mc.DEFAULT_TEMPLATE).resolve().is_relative_to(site), mc.DEFAULT_TEMPLATE
release = Path(sys.argv[2]); release.mkdir()
for name in sys.argv[3].split(","):
    shutil.copy(site / name, release / name)
readme = mc.write_model_card(release, config={"hidden_size": 64, "n_loops": 2}, training={"steps": 3}, data={},
                             metrics={"bits_per_byte_after": 3.2}, loss_history=[{"step": 1, "loss": 5.0}],
                             repo_id=None, model_name="spider-tiny-0.3M")
print(json.dumps({"card": readme.read_text()}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-c", script, str(site), str(tmp_path / "release"), ",".join(REMOTE_CODE_FILES)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads(done.stdout.strip().splitlines()[-1])["card"]
    assert "# spider-tiny-0.3M" in card and (tmp_path / "release" / "loss_curve.png").is_file()


def test_the_code_is_formatted_and_linted_with_the_projects_ruff_settings():
    """``ruff format --check`` and ``ruff check`` with pyproject.toml's settings pass on the whole tree."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (the test extra pins it)")
    for command in (["format", "--check", "."], ["check", "."]):
        done = subprocess.run([ruff, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_markdown_keeps_its_lines_within_120_columns_but_table_rows_and_headings():
    """No line of the project's Markdown (README.md, the bench/ and experiments/ READMEs, docs/, hub_card/) is over 120
    characters, as ruff keeps the Python within 119 (issue 66). Exceptions: a table row, which cannot wrap, and a
    heading, one line by definition; a line in a fenced code block is no exception. Wrap prose at 119 without changing
    a word; move a long table cell's explanation into a numbered note under the table."""
    over = []
    for path in sorted(
        {
            p
            for pattern in ("*.md", "bench/*.md", "experiments/*.md", "docs/*.md", "hub_card/*.md")
            for p in REPO.glob(pattern)
        }
    ):
        fenced = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            exempt = not fenced and line.lstrip().startswith(("|", "#"))
            if len(line) > 120 and not exempt:
                over.append(f"{path.relative_to(REPO)}:{number} ({len(line)} characters)")
    assert not over, over
