"""The README's reliability table: ``python -m tests.reliability [--kills N] [--json PATH]``.

Runs every entry of the bad-input registry (:data:`tests.bad_inputs.REGISTRY`) directly -- not through pytest -- each
in a fresh temporary folder, and prints a Markdown table: bad inputs tried, clear errors, handled by design (no error,
warning logged: invalid UTF-8, a 50 MB document), crashes (another exception type, a message that does not name the
problem, silent acceptance, or something already written lost) and, among the crashes, those waiting for a fix
proposed for a file outside this registry's reach (``xfail``). Then two rows from the fault-tolerance work:

* ``faults survived``: ``--faults`` runs the fault tests (:data:`FAULT_TESTS`: SIGTERM/SIGINT stop and resume, disk
  full and read-only saves, the output-folder lock, non-finite steps, the Hub down: closed port, 500s, a hang) through
  pytest, slow ones included, and counts those that pass (skipped ones, e.g. no tmpfs mount allowed, are left out);
  without it the figure is read from ``--faults_json`` (default ``tests/.reliability/faults.json``) if present;
* ``kills survived / N``: ``--kills N`` runs ``tests.kill_harness.run_kill_harness(N, workdir, seed)`` if that module
  exists, else it is read from ``--kills_json`` (default ``tests/.reliability/kills.json``) if present; otherwise
  "not run".

Both JSON files hold an object with ``survived`` and ``total`` (other spellings accepted: ``passed``/``ok`` and
``tried``/``n``/``n_kills``/``kills``). ``--json PATH`` writes all figures (and every crash's detail) as JSON.
``--only CATEGORY`` (repeatable) restricts the registry, ``--skip_slow`` leaves out the 50 MB document.
Exit code 0 when every crash is an expected one (``xfail``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.bad_inputs import CATEGORIES, REGISTRY, BadInput, Outcome, run_case

DEFAULT_DIR = Path(__file__).resolve().parent / ".reliability"
SLOW_CASES = ("50 MB single document (memory bounded)",)
README_START, README_END = "<!-- reliability:start -->", "<!-- reliability:end -->"

#: pytest selections whose tests each survive one fault (``--faults``)
FAULT_TESTS = (
    "tests/test_fault_tolerance.py",
    "tests/test_hub.py::test_closed_port_warns_and_returns_without_exception",
    "tests/test_hub.py::test_error500_fails_with_one_warning",
    "tests/test_hub.py::test_transient_upload_errors_are_retried_by_huggingface_hub",
    "tests/test_hub.py::test_wait_is_bounded_while_huggingface_hub_retries",
    "tests/test_hub.py::test_hang_returns_within_timeout_and_server_closes",
    "tests/test_hub.py::test_http_read_timeout_ends_a_hung_request",
)


class _FaultTally:
    """pytest plugin: the final outcome of every test it sees."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")


def run_faults() -> dict[str, Any]:
    """Run :data:`FAULT_TESTS` (slow ones included) in this process; returns ``survived``, ``total``, ``skipped``
    and the ``failed`` node ids."""
    import pytest

    tally = _FaultTally()
    pytest.main(["-q", "-m", "", "-p", "no:cacheprovider", *FAULT_TESTS], plugins=[tally])
    failed = sorted(n for n, o in tally.outcomes.items() if o == "failed")
    passed = sum(o == "passed" for o in tally.outcomes.values())
    return {
        "survived": passed,
        "total": passed + len(failed),
        "failed": failed,
        "skipped": sum(o == "skipped" for o in tally.outcomes.values()),
    }


def run_registry(cases: Sequence[BadInput], workdir: str | Path | None = None) -> list[Outcome]:
    """Run ``cases``, each in its own fresh folder under ``workdir`` (a temporary folder if ``None``, removed
    after)."""
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="spider-bad-inputs-") if own else workdir)
    outcomes = []
    try:
        for i, case in enumerate(cases):
            tmp = root / f"case{i:03d}"
            tmp.mkdir(parents=True)
            try:
                outcomes.append(run_case(case, tmp))
            except Exception as e:  # noqa: BLE001 -- a case whose set-up fails is reported, not fatal to the table
                outcomes.append(Outcome(case, "crash", f"set-up failed: {type(e).__name__}: {e}"))
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return outcomes


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts per category and in total: ``tried``, ``clear``, ``handled``, ``crashes``, ``xfail`` (crashes with a
    proposed fix pending), ``unexpected`` (crashes without one) and ``xpass`` (xfail entries that now pass)."""

    def count(items):
        crashes = [o for o in items if o.status == "crash"]
        return {
            "tried": len(items),
            "clear": sum(o.status == "clear" for o in items),
            "handled": sum(o.status == "handled" for o in items),
            "crashes": len(crashes),
            "xfail": sum(o.case.xfail is not None for o in crashes),
            "unexpected": sum(o.case.xfail is None for o in crashes),
            "xpass": sum(o.case.xfail is not None and o.status != "crash" for o in items),
        }

    per = {c: count([o for o in outcomes if o.case.category == c]) for c in CATEGORIES}
    return {
        "categories": {c: v for c, v in per.items() if v["tried"]},
        "total": count(list(outcomes)),
        "crash_details": [
            {"name": o.case.name, "category": o.case.category, "detail": o.detail, "fix_proposed": o.case.xfail}
            for o in outcomes
            if o.status == "crash"
        ],
        "xpass": [o.case.name for o in outcomes if o.case.xfail is not None and o.status != "crash"],
    }


def _fraction(data: dict | None) -> tuple[int, int] | None:
    if not isinstance(data, dict):
        return None
    survived = next(
        (data[k] for k in ("survived", "passed", "ok", "kills_survived", "faults_survived") if k in data), None
    )
    total = next((data[k] for k in ("total", "tried", "n", "n_kills", "kills", "faults") if k in data), None)
    if isinstance(survived, (int, float)) and isinstance(total, (int, float)):
        return int(survived), int(total)
    return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_kills(n: int, seed: int = 0) -> dict | None:
    """``tests.kill_harness.run_kill_harness(n, workdir, seed)`` if the module exists, else ``None``."""
    if importlib.util.find_spec("tests.kill_harness") is None:
        return None
    from tests.kill_harness import run_kill_harness

    with tempfile.TemporaryDirectory(prefix="spider-kills-") as workdir:
        return run_kill_harness(n, workdir, seed)


def format_table(
    summary: dict[str, Any], faults: tuple[int, int] | None, kills: tuple[int, int] | None, kills_wanted: int
) -> str:
    """The Markdown table."""
    lines = [
        "| bad inputs | tried | clear errors | handled by design | crashes | of which fix proposed (xfail) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in summary["categories"].items():
        lines.append(f"| {name} | {v['tried']} | {v['clear']} | {v['handled']} | {v['crashes']} | {v['xfail']} |")
    t = summary["total"]
    lines.append(
        f"| **total** | **{t['tried']}** | **{t['clear']}** | **{t['handled']}** | **{t['crashes']}** | "
        f"**{t['xfail']}** |"
    )
    lines += [
        "",
        "| fault tolerance | result |",
        "|---|---|",
        f"| faults survived | {f'{faults[0]} / {faults[1]}' if faults else 'not run'} |",
        f"| kills survived (kill -9, then the same command) | "
        f"{f'{kills[0]} / {kills[1]}' if kills else f'not run ({kills_wanted} wanted)'} |",
    ]
    return "\n".join(lines)


def write_block(path: Path, section: str) -> None:
    """Replace the text between :data:`README_START` and :data:`README_END` in `path` with `section` (the contract of
    ``python -m bench.report --write-results``). Raises ``ValueError`` naming the file if a marker is missing,
    duplicated or out of order."""
    text = path.read_text(encoding="utf-8")
    if (
        text.count(README_START) != 1
        or text.count(README_END) != 1
        or text.index(README_START) > text.index(README_END)
    ):
        raise ValueError(f"{path} must contain exactly one {README_START} followed by exactly one {README_END}")
    head, rest = text.split(README_START, 1)
    path.write_text(f"{head}{README_START}\n{section}{README_END}{rest.split(README_END, 1)[1]}", encoding="utf-8")


def main(argv: Sequence[str] | None = None, cases: Sequence[BadInput] | None = None) -> dict[str, Any]:
    """Run the registry (or ``cases``), print the table, and return the figures (what ``--json`` writes)."""
    p = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=None, help="run tests.kill_harness with this many kills")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill harness")
    p.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    p.add_argument("--faults", action="store_true", help="run the fault tests (FAULT_TESTS) through pytest")
    p.add_argument("--faults_json", default=str(DEFAULT_DIR / "faults.json"))
    p.add_argument(
        "--write-readme",
        dest="write_readme",
        metavar="README",
        default=None,
        help="also put the table between the reliability markers of this file",
    )
    p.add_argument("--kills_json", default=str(DEFAULT_DIR / "kills.json"))
    p.add_argument("--only", action="append", choices=CATEGORIES, help="only this category (repeatable)")
    p.add_argument("--skip_slow", action="store_true", help="leave out the 50 MB document")
    p.add_argument("--verbose", action="store_true", help="list every crash")
    args = p.parse_args(argv)

    selected = list(REGISTRY if cases is None else cases)
    if args.only:
        selected = [c for c in selected if c.category in args.only]
    if args.skip_slow:
        selected = [c for c in selected if c.name not in SLOW_CASES]
    logging.getLogger().setLevel(logging.WARNING)
    start = time.perf_counter()
    outcomes = run_registry(selected)
    summary = summarize(outcomes)
    summary["seconds"] = round(time.perf_counter() - start, 1)

    faults_data = run_faults() if args.faults else _read_json(Path(args.faults_json))
    faults = _fraction(faults_data)
    if args.faults and faults_data["failed"]:
        print("faults not survived: " + ", ".join(faults_data["failed"]), file=sys.stderr)
    kills_data = None
    kills_wanted = args.kills if args.kills is not None else 20
    if args.kills is not None:
        kills_data = run_kills(args.kills, args.seed)
        if kills_data is None:
            print("kills: tests/kill_harness.py not found -- not run", file=sys.stderr)
    if kills_data is None and args.kills is None:
        kills_data = _read_json(Path(args.kills_json))
    kills = _fraction(kills_data)
    summary["faults_survived"] = list(faults) if faults else None
    summary["kills_survived"] = list(kills) if kills else None

    table = format_table(summary, faults, kills, kills_wanted)
    print(table)
    if args.write_readme:
        write_block(Path(args.write_readme), table + "\n")
    details = (
        summary["crash_details"] if args.verbose else [d for d in summary["crash_details"] if not d["fix_proposed"]]
    )
    for d in details:
        print(
            f"\ncrash: [{d['category']}] {d['name']}: {d['detail']}"
            + (f"\n  fix: {d['fix_proposed']}" if d["fix_proposed"] else "")
        )
    for name in summary["xpass"]:
        print(f"\nnow passing (remove its xfail): {name}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["total"]["unexpected"] == 0 else 1)
