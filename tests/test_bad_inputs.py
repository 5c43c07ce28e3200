"""Every bad input of the registry (tests/bad_inputs.py) gives a clear error naming the problem and loses nothing.

Entries that need a change in a file outside this registry's reach are ``xfail(strict=True)``: once the proposed fix
is in, they XPASS and fail, so their ``xfail`` reason is removed from the registry. Also tests the reliability table
command (``python -m tests.reliability``) and the piecewise encoding of long documents behind the 50 MB case.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from spider_training import data as D
from tests import reliability
from tests.bad_inputs import CATEGORIES, REGISTRY, BadInput, run_case


def _param(case: BadInput):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=f"{case.category}: {case.name}", marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in REGISTRY])
def test_bad_input_gives_a_clear_error(case, tmp_path):
    outcome = run_case(case, tmp_path)
    assert outcome.status == ("clear" if case.expected is not None else "handled"), outcome.detail


def test_registry_covers_every_category_and_names_things():
    assert {c.category for c in REGISTRY} == set(CATEGORIES)
    assert len(REGISTRY) >= 150
    for case in REGISTRY:  # a message regex that any message would match names nothing
        assert case.match and case.match not in (".*", ".+", "")
        assert not re.fullmatch(case.match.replace("{tmp}", "x"), "")


# ---------------------------------------------------------------------------------------------------------------------
# the runner classifies: wrong type, unclear message, silent acceptance and lost files are crashes
# ---------------------------------------------------------------------------------------------------------------------


def _case(thunk, expected=ValueError, match=r"{tmp}/x", **kw):
    return BadInput("probe", "configs", lambda tmp: thunk(tmp), expected, match, **kw)


def test_runner_classifies_outcomes(tmp_path):
    def raises(exc):
        def make(tmp):
            def run():
                raise exc(f"file {tmp}/x is bad")

            return run

        return make

    for name, case, status in [
        ("clear", _case(raises(ValueError)), "clear"),
        ("wrong type", _case(raises(KeyError)), "crash"),
        ("unclear message", _case(raises(ValueError), match=r"{tmp}/y"), "crash"),
        ("no error", _case(lambda tmp: lambda: 1), "crash"),
    ]:
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        assert run_case(case, d).status == status, name

    def deletes(tmp):
        (tmp / "precious.txt").write_text("keep me")

        def run():
            (tmp / "precious.txt").unlink()
            raise ValueError(f"file {tmp}/x is bad")

        return run

    d = tmp_path / "loss"
    d.mkdir()
    out = run_case(_case(deletes), d)
    assert out.status == "crash" and "precious.txt" in out.detail


def test_argparse_errors_are_matched_against_stderr(tmp_path):
    case = next(c for c in REGISTRY if c.name == "--max_steps abc")
    out = run_case(case, tmp_path)
    assert out.status == "clear" and "usage:" in out.text  # the argparse message the user reads


# ---------------------------------------------------------------------------------------------------------------------
# the reliability table command
# ---------------------------------------------------------------------------------------------------------------------


def test_reliability_table_counts_add_up(tmp_path, capsys):
    fast = [c for c in REGISTRY if c.category in ("byte shards", "env vars", "model forward")]
    kills = tmp_path / "kills.json"
    kills.write_text(json.dumps({"survived": 19, "total": 20}))
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"survived": 7, "total": 7}))
    out_json = tmp_path / "figures.json"
    summary = reliability.main(
        ["--json", str(out_json), "--kills_json", str(kills), "--faults_json", str(faults)], cases=fast
    )
    printed = capsys.readouterr().out
    total = summary["total"]
    assert total["tried"] == len(fast)
    assert total["tried"] == total["clear"] + total["handled"] + total["crashes"]
    assert total["crashes"] == total["xfail"] + total["unexpected"]
    assert total["unexpected"] == 0
    assert total["xfail"] == sum(c.xfail is not None for c in fast)  # (while the proposed fixes are pending)
    assert sum(v["tried"] for v in summary["categories"].values()) == total["tried"]
    assert json.loads(out_json.read_text())["total"] == total
    rows = {
        line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]]
        for line in printed.splitlines()
        if line.startswith("| ") and not line.startswith("| bad inputs")
    }
    assert rows["byte shards"] == ["16", "16", "0", "0", "0"]
    assert rows["**total**"][0] == f"**{len(fast)}**"
    assert rows["faults survived"] == ["7 / 7"]
    assert rows["kills survived (kill -9, then the same command)"] == ["19 / 20"]


def test_reliability_kills_flag_without_harness(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(reliability.importlib.util, "find_spec", lambda name: None)
    summary = reliability.main(["--kills", "3", "--only", "env vars", "--faults_json", str(tmp_path / "none.json")])
    printed = capsys.readouterr()
    assert "| kills survived (kill -9, then the same command) | not run (3 wanted) |" in printed.out
    assert "not found" in printed.err
    assert "| faults survived | not run |" in printed.out
    assert summary["kills_survived"] is None and summary["total"]["tried"] == 12


# ---------------------------------------------------------------------------------------------------------------------
# long documents are encoded in pieces: same stream, same truncation, same counters
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_doc_bytes", [None, 1, 7, 8, 9, 20, 1000])
@pytest.mark.parametrize("doc", ["abcdefghijklmnopqrst", "é日本語🕷 ünï" * 3, b"\x00\xffraw bytes\x80" * 2])
def test_piecewise_encoding_equals_whole_documents(doc, max_doc_bytes):
    whole, pieces = D.DocumentStats(), D.DocumentStats()
    docs = ["short", doc, "  ", doc]
    want = np.concatenate(list(D.encode_texts(docs, whole, "t", "text", max_doc_bytes)))
    got = np.concatenate(list(D.encode_texts(docs, pieces, "t", "text", max_doc_bytes, piece_chars=4)))
    assert got.tolist() == want.tolist()
    assert pieces == whole


def test_replacement_character_is_counted_once_per_document(caplog):
    stats = D.DocumentStats()
    with caplog.at_level("WARNING", logger="spider_training.data"):
        list(D.encode_texts(["ok", "a\ufffdb", "\ufffd\ufffd"], stats, "src.txt", "text", None))
    assert stats.replaced_documents == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "src.txt: document 1 holds U+FFFD at character 1" in warnings[0]
