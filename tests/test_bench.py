"""Smoke test of the benchmark runner (bench/): the quick mode runs every benchmark and writes a well-formed JSON.

No timing assertions (timings on a shared 2-core machine are noise): the test checks that every benchmark ran, that
every measured figure is a finite positive number and every ``met`` a bool, and that the report renders and
replaces exactly the text between the markers. The whole quick run takes ~1.5 min on an idle 2-core CPU
(more under load), hence ``slow``.
"""

import json
import math

import pytest

from bench import report
from bench.run_all import BENCHMARKS
from bench.run_all import main as run_all_main


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    exit_code = run_all_main(["--quick", "--out", str(out)])
    results = json.loads(out.read_text())
    return exit_code, results


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive_number(x) -> bool:
    return _finite_number(x) and x > 0


@pytest.mark.slow
def test_quick_run_has_every_benchmark_with_measurements(quick_results):
    exit_code, results = quick_results
    assert results["quick"] is True
    env = results["environment"]
    assert env["torch"] and env["torch_num_threads"] >= 1
    assert set(results["benchmarks"]) == set(BENCHMARKS)
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
    summary = results["summary"]
    assert sorted(summary["met"] + summary["missed"]) == sorted(BENCHMARKS) and summary["errors"] == []


@pytest.mark.slow
def test_report_renders_every_check_and_replaces_only_the_marked_block(quick_results, tmp_path):
    _, results = quick_results
    section = report.render(results)
    n_checks = sum(len(r["checks"]) for r in results["benchmarks"].values())
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Benchmark")]
    assert sum(line.endswith("| yes |") or line.endswith("| no |") for line in rows) == n_checks

    readme = tmp_path / "results.md"
    readme.write_text(f"# Spider\n\nintro\n\n{report.START}\nold table\n{report.END}\n\n## Next\nrest\n")
    results_file = tmp_path / "results.json"
    results_file.write_text(json.dumps(results))
    assert report.main([str(results_file), "--write-results", str(readme)]) == 0
    text = readme.read_text()
    assert "old table" not in text
    assert text.startswith("# Spider\n\nintro\n\n" + report.START + "\n## Performance")
    assert text.endswith(report.END + "\n\n## Next\nrest\n")
    # idempotent: a second write gives the same file
    assert report.main([str(results_file), "--write-results", str(readme)]) == 0
    assert readme.read_text() == text


def test_write_block_rejects_a_file_without_markers(tmp_path):
    readme = tmp_path / "results.md"
    readme.write_text("# Spider\nno markers here\n")
    with pytest.raises(ValueError, match="bench:start"):
        report.write_block(readme, "## Performance\n")
    assert readme.read_text() == "# Spider\nno markers here\n"


def test_run_all_rejects_unknown_benchmark():
    from bench.run_all import run_all

    with pytest.raises(ValueError, match="unknown benchmark"):
        run_all(quick=True, only=["nope"])
