"""Smoke test of the benchmark runner (bench/): the quick mode runs every benchmark and writes a well-formed JSON.

No timing assertions (timings on a shared 2-core machine are noise): the test checks that every benchmark ran, that
every measured figure is a finite positive number and every ``met`` a bool, and that the report renders and
replaces exactly the text between the markers. The whole quick run takes ~1.5 min on an idle 2-core CPU
(more under load), hence ``slow``. The runner is driven through its command line (``python -m bench.run_all``,
``python -m bench.report``) and read through its JSON: the tests import nothing of ``bench``.
"""

import ast
import json
import math
import re

import pytest

from tests.helpers import run_module

#: the markers ``python -m bench.report --write-results`` fills (docs/results.md)
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


@pytest.fixture(scope="module")
def rejected_unknown_benchmark():
    """``python -m bench.run_all --only nope``: the command's result and the benchmarks its error names as known."""
    done = run_module("bench.run_all", "--only", "nope", "--out", "/dev/null")
    known = re.search(r"known: (\[[^\]]*\])", done.stderr)
    return done, ast.literal_eval(known.group(1)) if known else None


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    exit_code = run_module("bench.run_all", "--quick", "--out", out).returncode
    results = json.loads(out.read_text())
    return exit_code, results


@pytest.fixture(scope="module")
def benchmarks(rejected_unknown_benchmark):
    """Every benchmark ``run_all`` runs by default, as its error for an unknown name lists them."""
    return rejected_unknown_benchmark[1]


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive_number(x) -> bool:
    return _finite_number(x) and x > 0


@pytest.mark.slow
def test_quick_run_has_every_benchmark_with_measurements(quick_results, benchmarks):
    exit_code, results = quick_results
    assert results["quick"] is True
    env = results["environment"]
    assert env["torch"] and env["torch_num_threads"] >= 1
    assert set(results["benchmarks"]) == set(benchmarks)
    for name, r in results["benchmarks"].items():
        assert "error" not in r, f"{name} crashed: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["benchmark"] == name
        assert isinstance(r["met"], bool), name
        assert r["sizes"] and r["dtype"], name
        assert r["checks"], f"{name} has no target checks"
        for c in r["checks"]:
            # speed checks are positive ratios; quality's are differences in bits per byte (any sign, 0 included);
            # a count (compile's graphs compiled after the first steps) may be 0, and so may an upper bound on a
            # difference (compile's compiled-against-eager losses, equal under the quick mode's eager backend)
            signed = name == "quality" or c["metric"].startswith("count")
            if name == "quality":
                assert _finite_number(c["measured"]), (name, c)
            elif signed or c["comparison"] == "<=":
                assert _finite_number(c["measured"]) and c["measured"] >= 0, (name, c)
            else:
                assert _positive_number(c["measured"]), (name, c)
            assert _finite_number(c["target"]) and (signed or c["target"] > 0), (name, c)
            assert isinstance(c["met"], bool), (name, c)
            agrees = c["measured"] >= c["target"] if c["comparison"] == ">=" else c["measured"] <= c["target"]
            assert c["met"] == agrees, (name, c)  # met agrees with the numbers
        for i in r.get("info", []):
            assert _positive_number(i["measured"]), (name, i)
    assert exit_code == 0
    generation = results["benchmarks"]["generation"]
    assert isinstance(generation["outputs_equal"], bool)
    peers = generation["measurements"]["peers"]  # issue 65's table: Spider's loop counts beside Llama and Mistral
    assert set(peers["bytes_per_s"]) == {
        *(
            f"spider_loops{n}{exit_}{cache}"
            for n in (1, 2, 4)
            for exit_ in ("", "_act_early_exit")
            for cache in ("", "_static")  # --quick: SpiderStaticCache uncompiled
        ),
        *(f"{peer}_{cache}" for peer in ("llama", "mistral") for cache in ("dynamic", "static")),
    }
    assert all(_positive_number(v) for v in peers["bytes_per_s"].values())
    for peer in ("llama", "mistral"):  # each peer's best cache
        assert peers["best_peer_bytes_per_s"][peer] == max(
            peers["bytes_per_s"][f"{peer}_{c}"] for c in ("dynamic", "static")
        )
    sizes = peers["parameters"]
    assert abs(sizes["llama"] - sizes["spider"]) < 0.2 * sizes["spider"]  # peers of about Spider's size
    serving = generation["measurements"]["serving"]  # through spider-serve: one stream, then 8 at once
    assert set(serving["bytes_per_s"]) == {"one_stream", "8_streams"} and serving["streams"] == 8
    assert all(_positive_number(v) for v in serving["bytes_per_s"].values())
    assert "spider-serve batching" in {c["name"] for c in generation["checks"]}
    summary = results["summary"]
    assert sorted(summary["met"] + summary["missed"]) == sorted(benchmarks) and summary["errors"] == []


@pytest.mark.slow
def test_report_renders_every_check_and_replaces_only_the_marked_block(quick_results, tmp_path):
    _, results = quick_results
    results_file = tmp_path / "results.json"
    results_file.write_text(json.dumps(results))
    rendered = run_module("bench.report", results_file)
    assert rendered.returncode == 0, rendered.stderr
    section = rendered.stdout
    n_checks = sum(len(r["checks"]) for r in results["benchmarks"].values())
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Benchmark")]
    assert sum(line.endswith("| yes |") or line.endswith("| no |") for line in rows) == n_checks

    readme = tmp_path / "results.md"
    readme.write_text(f"# Spider\n\nintro\n\n{START}\nold table\n{END}\n\n## Next\nrest\n")
    assert run_module("bench.report", results_file, "--write-results", readme).returncode == 0
    text = readme.read_text()
    assert "old table" not in text
    assert text.startswith("# Spider\n\nintro\n\n" + START + "\n## Performance")
    assert text.endswith(END + "\n\n## Next\nrest\n")
    # idempotent: a second write gives the same file
    assert run_module("bench.report", results_file, "--write-results", readme).returncode == 0
    assert readme.read_text() == text


def test_write_block_rejects_a_file_without_markers(tmp_path):
    readme = tmp_path / "results.md"
    readme.write_text("# Spider\nno markers here\n")
    results_file = tmp_path / "results.json"
    results_file.write_text(json.dumps({"benchmarks": {}}))
    done = run_module("bench.report", results_file, "--write-results", readme)
    assert done.returncode == 2 and "bench:start" in done.stderr, done.stderr  # the ValueError, named
    assert readme.read_text() == "# Spider\nno markers here\n"


def test_report_wraps_its_prose_at_119_columns_and_keeps_each_table_row_one_line(tmp_path):
    """docs/results.md keeps no line over 120 characters: the section's paragraph and hot-spot items break between
    words (the same words, in order), a table row (which cannot wrap) stays one line."""
    ops = ["aten::mm", "aten::bmm", "aten::_index_put_impl_", "aten::_softmax_backward_data", "Optimizer.step#AdamW"]
    check = {"name": "train step " + "Spider(n_loops=1) / peer, " * 5, "metric": "tokens/s ratio", "target": 1.5}
    results = {
        "environment": {"torch": "2.13.0+cpu", "transformers": "5.24.0", "torch_num_threads": 2, "cpu": "AMD EPYC"},
        "benchmarks": {
            "train_step": {
                "checks": [{**check, "measured": 1.2, "met": False}],
                "profile": {"peer": {"top": [{"op": op, "self_cpu_pct": 20.0} for op in ops]}},
            }
        },
    }
    results_file = tmp_path / "results.json"
    results_file.write_text(json.dumps(results))
    done = run_module("bench.report", results_file)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    row = next(line for line in lines if line.startswith("| train step"))
    assert len(row) > 120 and row.endswith("| no |")  # one line, however long
    assert all(len(line) <= 119 for line in lines if not line.startswith("|")), done.stdout
    prose = " ".join(lines[2 : lines.index("| Benchmark | Target | Measured | Met |")]).split()
    assert " ".join(prose).startswith("Measured with `python -m bench.run_all` (torch 2.13.0+cpu, transformers 5.24.0")
    assert " ".join(prose).endswith("(median of repeats after warm-up); see `bench/README.md`.")
    item = lines[lines.index("Hot spots where a target is missed (torch.profiler, self CPU time):") + 1 :]
    assert len(item) > 1 and item[0].startswith("- train_step / peer: ") and all(x.startswith("  `") for x in item[1:])
    assert " ".join(x.strip() for x in item) == "- train_step / peer: " + ", ".join(f"`{op}` 20%" for op in ops)


def test_run_all_rejects_unknown_benchmark(rejected_unknown_benchmark):
    done, known = rejected_unknown_benchmark
    assert done.returncode == 2 and "unknown benchmark" in done.stderr, done.stderr
    assert known and "nope" not in known
