"""``python -m bench.gpu_check`` through its command line and JSON: every part that can run on CPU runs here at toy
sizes; the GPU-only parts say they need CUDA and skip. The checks it runs as tests are tests/test_gpu.py and
tests/test_training_runs.py; what it times steps with is spider_training.step_times (tests/test_step_times.py)."""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from configuration_spider import SpiderConfig
from tests.helpers import run_module
from tests.test_gpu import FP8_LOSS_RTOL, FP8_RECIPES
from tests.test_training_runs import judge_1b_run

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU check")

#: the parts in the order they run (bench/gpu_check.py's PARTS, its JSON's ``parts``)
PARTS = [
    "main_job",
    "step_table",
    "host_syncs",
    "distributed",
    "attention_backends",
    "generation",
    "run_1b",
    "fp8",
    "fp8_gemm",
    "tile_kernels_moe",
    "fsdp2_fp8_all_gather",
]
#: warm-up steps of a step-table row: 3 for a compiled row (the first compiles), 1 for an eager one
WARMUP_STEPS = {"spider": 1, "spider_compiled": 3}


def spider_config(preset: str) -> SpiderConfig:
    return SpiderConfig.from_preset(preset)


def gpu_check(*args, timeout: float = 900) -> tuple[dict, subprocess.CompletedProcess]:
    """``python -m bench.gpu_check *args`` with one intra-op thread (as under pytest-xdist: with more threads than
    free cores every aten op of these many-small-op models waits on the others); its JSON result (stdout) and the
    process. Fails with the process's stderr when it exited with an error."""
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        done = run_module("bench.gpu_check", *args, timeout=timeout)
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done


def gpu_check_checks(*args) -> dict:
    """The checks of ``python -m bench.gpu_check --budget_s 0 *args`` by name."""
    result, _ = gpu_check("--budget_s", "0", *args)
    return {c["name"]: c for c in result["checks"]}


@pytest.fixture(scope="module")
def budget_run() -> dict:
    """A run whose budget (3 s) fits none of its parts; its JSON records the command's options, defaults included."""
    result, _ = gpu_check("--budget_s", "3", "--only", "main_job", "host_syncs", "--part_cap", "host_syncs=1")
    return result


@pytest.fixture(scope="module")
def default_rows(budget_run) -> list[str]:
    """The step table's default rows (``--step_table_models``' default)."""
    return budget_run["options"]["step_table_models"]


def toy_args(default_rows: list[str]) -> list[str]:
    return [
        *("--presets", "tiny", "1b"),
        *("--main_job_preset", "tiny", "--main_job_steps", "3", "--main_job_args", "--eval_windows 8"),
        *("--step_table_preset", "tiny", "--step_table_shapes", "2x32", "--step_repeats", "1"),
        *("--compile_backend", "eager", "--tk_train_recipe_shape", "2x32"),
        # the default rows but the compiled one, whose compilation requested_rows below pays once for every test
        "--step_table_models",
        *(label for label in default_rows if label != "spider_compiled"),
        *("--host_syncs_preset", "tiny", "--host_syncs_shape", "1x64"),
        *("--distributed_preset", "tiny", "--distributed_steps", "2", "--distributed_shape", "2x48"),
        *("--attention_preset", "tiny", "--attention_batch", "2", "--attention_segments", "16", "48"),
        *("--attention_visits", "3"),
        *("--generation_preset", "tiny", "--generation_prompt_len", "16", "--generation_new_tokens", "8"),
        *(
            "--run_1b_preset",
            "tiny",
            "--run_1b_steps",
            "4",
            "--run_1b_batch",
            "2x64",
            "--run_1b_args",
            "--eval_windows 8",
        ),
        *("--fp8_gemm_presets", "tiny", "--fp8_gemm_batches", "2x64"),
    ]


def _assert_profiled_on_cpu(row: dict) -> None:
    """A step-table row's profiled step on CPU: no device events or kernels; where the host's time went, most first
    (``top_host_ops``), the aten ops called most often (``top_aten_ops``, most first) and those outside compiled
    regions (``eager_aten_ops``: in an eager row, every outermost op)."""
    assert row["kernel_launches"] == row["device_events"] == 0 and row["profiled_step_s"] > 0, row
    top = row["top_host_ops"]
    times = [op["self_host_ms"] for op in top.values()]
    assert 0 < len(top) <= 8 and times == sorted(times, reverse=True) and all(op["calls"] >= 1 for op in top.values())
    assert row["top_kernels"] == {}
    aten = row["top_aten_ops"]
    assert aten and list(aten.values()) == sorted(aten.values(), reverse=True) and all(c >= 1 for c in aten.values())
    eager = row["eager_aten_ops"]
    assert eager["count"] >= sum(eager["by_op"].values()) > 0 or eager["count"] > 0, eager


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, default_rows) -> tuple[dict, subprocess.CompletedProcess, Path]:
    """Every part at toy sizes (:func:`toy_args`) with ``--out`` and ``--progress_log`` in a temporary folder: the
    result, the process and the folder."""
    folder = tmp_path_factory.mktemp("gpu_check")
    result, done = gpu_check(
        *toy_args(default_rows), "--out", folder / "gpu_check.json", "--progress_log", folder / "progress.jsonl"
    )
    return result, done, folder


@pytest.mark.slow
def test_cpu_run_of_every_part(toy_run, default_rows):
    result, done, tmp_path = toy_run
    out, log = tmp_path / "gpu_check.json", tmp_path / "progress.jsonl"
    assert json.loads(out.read_text()) == json.loads(done.stdout) == result  # stdout holds the JSON only
    snapshots = [json.loads(line) for line in log.read_text().splitlines()]  # what a kill at each moment leaves
    _assert_each_row_was_written_as_it_was_measured(snapshots, result)
    assert not (tmp_path / "gpu_check.json.tmp").exists()
    by_name = {c["name"]: c for c in result["checks"]}
    assert [p["name"] for p in result["parts"]] == PARTS and all(p["ran"] for p in result["parts"])

    main_job = by_name["main_job"]
    assert main_job["status"] == "passed", main_job
    assert main_job["steps"] == 3 and main_job["release_written"] and main_job["release_reload_ok"]
    assert main_job["bits_per_byte_after"] < main_job["bits_per_byte_before"]
    assert main_job["generated_bytes"] == 16 and main_job["reload_device"] == "cpu"

    gemm = by_name["fp8_gemm"]  # the FP8 GEMM table, emulated: the runner and its output's shape, not FP8's times
    assert gemm["status"] == "passed" and gemm["rows"], gemm
    ((gpu, measured),) = gemm["fp8_gemm_table"]["gpus"].items()
    assert all("bf16" in row["seconds"] for row in measured["gemms"])
    assert all(
        {"tensorwise", "rowwise"} <= row["seconds"].keys() for row in measured["gemms"] if row["kind"] == "linear"
    )
    assert all(row["seconds"].keys() == {"bf16"} for row in measured["gemms"] if row["kind"] == "grouped")  # no CUDA
    from spider_training.fp8 import convert_for_fp8_training
    from tests.helpers import tiny_model

    report = convert_for_fp8_training(
        tiny_model(), batch_size=2, seq_len=64, gemm_table=gemm["fp8_gemm_table"], gpu=gpu, emulate=True
    )
    assert report.source == f"GEMM table of {gpu} at 2 x 64 bytes"
    assert not any("not measured" in reason for reason in report.kept.values())  # every shape has its row

    table = by_name["step_table"]
    assert table["status"] == "passed", table
    rows = {row["model"]: row for row in table["rows"]}
    comparison = [label for label in default_rows if label not in ("spider_compiled", "spider_fp8")]
    # the slow rows last: compiled (requested_rows), then FP8 (on the H200 its first step took 54 s)
    assert [row["model"] for row in table["rows"]] == [*comparison, "spider_tk_train_recipe", "spider_fp8"]
    assert (
        rows["spider_tk_train_recipe"]["activation_checkpointing"]
        and rows["spider_tk_train_recipe"]["precision"] == "float32"
    )
    for row in table["rows"]:
        assert row["status"] == "passed" and row["shape"] == "2x32", row
        assert "device_allocations_per_step" not in row  # no CUDA allocator count on CPU
        _assert_profiled_on_cpu(row)
        assert row["bytes_per_s"] > 0 and row["step_s"] > 0 and row["flops_per_step"] > 0 and 0 < row["mfu"]
        assert 0 < row["step_s_min"] <= row["step_s"] and len(row["step_times_s"]) == 1
        assert row["peak_memory_bytes"] is None  # no CUDA allocator on CPU
        assert row["aten_ops_per_step"] > 0
        assert row["host_syncs"] == row["host_syncs_forward_backward"] + row["host_syncs_optimizer"]
    fp8 = rows["spider_fp8"]  # as --precision fp8 converts: on CPU the experts stay bf16, and say why
    assert fp8["fp8_experts_modules"] == 0 and any("needs CUDA" in r for r in fp8["fp8_experts_skipped"])
    assert 0.9 <= table["llama_params_over_spider"] <= 1.1  # the dense baseline has about Spider's size

    syncs = by_name["host_syncs"]
    assert syncs["status"] == "passed" and set(syncs["variants"]) == {"grouped_mm", "eager"}
    for variant in syncs["variants"].values():
        assert variant["dispatch_count"] == sum(variant["dispatch_by_op"].values())
        assert variant["aten_ops_forward_backward"] > syncs["deepseek_v3_aten_ops_forward_backward"] > 0
    assert "tolist" not in syncs["variants"]["grouped_mm"]["dispatch_by_op"]  # the fused experts read no row count

    distributed = by_name["distributed_world_size_1"]  # gloo here; NCCL on a GPU
    assert distributed["status"] == "passed", distributed
    assert distributed["backend"] == "gloo" and distributed["world_size"] == 1
    assert len(distributed["ddp_losses"]) == len(distributed["fsdp2_losses"]) == 4  # 2 steps, the checkpoint, 2 more
    assert distributed["fsdp2_dtensor_parameters"] == distributed["parameters"] > 0
    assert distributed["fsdp2_units"].count("FSDPSpiderRecurrentLayer") == spider_config("tiny").num_recurrent_layers
    assert any(f.endswith(".distcp") for f in distributed["checkpoint_files"])
    assert distributed["reference_losses"][-1] != distributed["reference_losses"][0]  # the weights moved

    attention = by_name["attention_backends"]
    assert attention["status"] == "passed" and attention["backends"]["default"]["kernel"] == ["math"], attention

    generation = by_name["generation"]  # issue 65's GPU row: Spider and its dense Llama, static caches compiled
    assert generation["status"] == "passed" and generation["preset"] == "tiny", generation
    assert (
        generation["device"] == "cpu" and generation["dtype"] == "float32" and generation["compile_backend"] == "eager"
    )
    speeds = generation["bytes_per_s"]
    assert set(speeds) == set(generation["compile_s"]) == {"spider", "llama"} and min(speeds.values()) > 0
    assert generation["spider_over_llama"] == pytest.approx(speeds["spider"] / speeds["llama"], rel=1e-3)
    assert 0.9 <= generation["parameters"]["llama"] / generation["parameters"]["spider"] <= 1.1

    run = by_name["run_1b"]
    assert run["steps"] == 4 and run["preset"] == "tiny"
    assert len(run["held_out_bits_per_byte"]) >= 3 and run["compression_rate"]  # scored before, during and after
    assert len(run["mean_halting_step"]) == len(run["compression_rate"])  # every training log has both
    assert all(1 <= loops <= spider_config("tiny").n_loops for _, loops in run["mean_halting_step"])
    assert set(run["held_out_bits_per_byte_by_loops"]) == {"1", "2", "4"}
    for entry in (run, main_job):  # every training step timed, evaluation outside
        times = entry["step_seconds"]
        assert times["steps"] == entry["steps"] and 0 < times["median_s"] <= times["p90_s"] <= times["max_s"], times
        # each step's segment axis (the trainer hook on flexitokens): the first step meets the first size
        assert times["new_axis_steps"][0] == 1 and len(times["new_axis_steps"]) == len(times["axis_sizes"]) >= 1
    config = spider_config("tiny")
    status, reason, _ = judge_1b_run(
        run["held_out_bits_per_byte"],
        run["compression_rate"],
        config.boundary_prior,
        config.boundary_prior_std,
        config.boundary_prior_k,
    )
    assert (run["status"], run["reason"]) == (status, reason)  # the entry is the judgement of its own curves

    for recipe in FP8_RECIPES:
        tiny = by_name[f"fp8_{recipe}_tiny"]
        assert tiny["status"] == "passed" and tiny["emulated"] and tiny["converted_layers"] > 0, tiny
        assert tiny["loss_rel_difference"] <= FP8_LOSS_RTOL and "not FP8's" in tiny["note"]
        assert tiny["step_s_bf16"] > 0 and tiny["step_s_fp8"] > 0
        assert by_name[f"fp8_{recipe}_1b"]["status"] == "skipped"
    for name in ("fp8_tensorwise_1b", "tile_kernels_moe", "fsdp2_fp8_all_gather"):
        assert "needs CUDA" in by_name[name]["reason"], name
    assert result["environment"]["cuda"] is False
    assert result["passed"] == all(c["status"] != "failed" for c in result["checks"])


def test_default_cpu_run_skips_the_1b_parts_that_need_cuda():
    """Without size flags the 1b run, the 1b step table and the 1b generation say they need CUDA (they would take
    hours on a CPU); the step table's rows and tk-train.py's recipe shape keep their earlier names ("the seed":
    ``--seed_recipe_shape``, ``spider_seed_recipe_compiled``), as the ``tk_train`` names."""
    result, _ = gpu_check(
        *("--budget_s", "0", "--only", "step_table", "generation", "run_1b"),
        *("--seed_recipe_shape", "2x32", "--step_table_models", "spider", "spider_seed_recipe_compiled"),
    )
    table, generation, run = result["checks"]
    assert table["status"] == generation["status"] == run["status"] == "skipped"
    assert all("needs CUDA" in entry["reason"] for entry in (table, generation, run))
    assert result["options"]["tk_train_recipe_shape"] == [2, 32]
    assert result["options"]["step_table_models"] == ["spider", "spider_tk_train_recipe_compiled"]


@pytest.fixture(scope="module")
def requested_rows():
    """One step table at 2 x 64 (two timed steps) with the rows on request and the regionally compiled ones (each
    costs a compilation, ~15 s here), shared by the tests that read them."""
    models = (
        "spider_fp8_rowwise_compiled",
        "spider",
        "spider_word_rate",
        "deepseek_v3",
        "spider_compiled",
        "spider_fp8",
        "spider_compiled_automatic_dynamic",
        "spider_word_rate_compiled",
        "spider_tk_train_recipe_compiled",
    )
    table = gpu_check_checks(
        *("--only", "step_table", "--step_table_preset", "tiny", "--step_table_shapes", "2x64"),
        *("--step_repeats", "2", "--step_table_models", *models),
        *("--compile_backend", "eager", "--tk_train_recipe_shape", "2x32"),
    )["step_table"]
    assert table["status"] == "passed", table
    return table


def test_compiled_rows_on_request_run_before_the_fp8_rows(requested_rows, default_rows):
    """``spider_word_rate_compiled`` and ``spider_tk_train_recipe_compiled`` (on request): the word-rate model and
    activation checkpointing compiled as ``--compile`` compiles, each timed with its eager twin's FLOPs, after the
    compiled
    row and before FP8's; the compiled FP8 rows (on request) last: Spider converted as ``--precision fp8`` with the
    row's recipe and ``--fp8_experts`` (emulated ``Float8Linear`` on CPU, where the experts stay in bf16 and the row
    says why; one row here, each costs a compilation), then compiled as ``--compile`` compiles, with the eager row's
    FLOPs."""
    table = requested_rows
    assert [row["model"] for row in table["rows"]] == [
        "spider",
        "spider_word_rate",
        "deepseek_v3",
        "spider_tk_train_recipe",
        "spider_compiled",
        "spider_compiled_automatic_dynamic",
        "spider_word_rate_compiled",
        "spider_tk_train_recipe_compiled",
        "spider_fp8",
        "spider_fp8_rowwise_compiled",
    ]
    rows = {row["model"]: row for row in table["rows"]}
    compiled = rows["spider_compiled"]  # as --compile compiles: the segment axis dynamic, the eager row's FLOPs
    assert compiled["compile_backend"] == "eager" and len(compiled["warmup_step_s"]) == 3
    assert compiled["flops_per_step"] == rows["spider"]["flops_per_step"] and compiled["aten_ops_per_step"] is None
    graphs = compiled["graphs_compiled_per_step"]  # the first warm-up step compiles; an eager row records nothing
    assert graphs["warmup"][0] > 0 and len(graphs["warmup"]) == 3 and len(graphs["timed"]) == 2, graphs
    assert "graphs_compiled_per_step" not in rows["spider"]
    assert "spider_compiled" in default_rows  # a default row (test_cpu_run_of_every_part leaves it out)
    automatic = rows["spider_compiled_automatic_dynamic"]  # torch's automatic dynamic shapes, no axis marked
    assert automatic["compile_dynamic"] is None and rows["spider_compiled"]["compile_dynamic"] is False
    assert automatic["flops_per_step"] == rows["spider"]["flops_per_step"] and automatic["graphs_compiled_per_step"]
    rowwise = rows["spider_fp8_rowwise_compiled"]  # the row's recipe and --fp8_experts reach the conversion
    assert rowwise["fp8_recipe"] == "rowwise"
    assert any("needs CUDA" in reason for reason in rowwise["fp8_experts_skipped"])
    assert rowwise["compile_backend"] == "eager" and len(rowwise["warmup_step_s"]) == 3, rowwise
    assert rowwise["flops_per_step"] == rows["spider"]["flops_per_step"] > 0 and rowwise["aten_ops_per_step"] is None
    word = rows["spider_word_rate_compiled"]
    assert (
        word["boundary_mode"] == "fixed" and word["compile_backend"] == "eager" and word["aten_ops_per_step"] is None
    )
    assert word["flops_per_step"] == rows["spider_word_rate"]["flops_per_step"] > 0
    assert word["segment_axis"]["timed"] == rows["spider_word_rate"]["segment_axis"]["timed"]
    compiled = rows["spider_tk_train_recipe_compiled"]
    assert compiled["activation_checkpointing"] and compiled["compile_backend"] == "eager", compiled
    assert len(compiled["warmup_step_s"]) == 3 and compiled["aten_ops_per_step"] is None
    assert compiled["flops_per_step"] == rows["spider_tk_train_recipe"]["flops_per_step"] > 0


def _assert_each_row_was_written_as_it_was_measured(snapshots: list[dict], result: dict) -> None:
    """``--out`` is rewritten after every step-table row and part, so a run killed from outside (as ``timeout`` kills
    a device call) keeps the rows it measured: each snapshot on disk is whole JSON marked incomplete, the step
    table's running entry one row longer each time, and the last snapshot the result."""
    partial = [snap for snap in snapshots if not snap["complete"]]
    running = [
        [row["model"] for row in check["rows"]]
        for snap in partial
        for check in snap["checks"]
        if check["name"] == "step_table" and check["status"] == "running"
    ]
    final_rows = [row["model"] for row in next(c for c in result["checks"] if c["name"] == "step_table")["rows"]]
    assert running == [final_rows[: n + 1] for n in range(len(final_rows))], running
    counts = [len(snap["parts"]) for snap in partial]
    assert counts == sorted(counts) and partial[-1]["parts"] == result["parts"]  # each part added as it ends
    assert snapshots[-1] == result and result["complete"]


@pytest.mark.slow
def test_attention_backends_at_toy_sizes_on_cpu(toy_run):
    """Every SDPA kernel over the same shuffled segment counts: CPU has math and flash (the value padded to the
    query/key head dim), torch's default runs math for MLA's unequal head dims; cuDNN and memory-efficient are
    skipped with torch's reason."""
    entry = next(c for c in toy_run[0]["checks"] if c["name"] == "attention_backends")
    assert entry["status"] == "passed" and entry["reason"] == "", entry
    assert entry["shape"] == {"batch": 2, "heads": 4, "qk_head_dim": 32, "v_head_dim": 16}
    assert sorted(entry["sequence"]) == [16, 16, 16, 48, 48, 48] and entry["warmup_segments"] not in (16, 48)
    backends = entry["backends"]
    assert list(backends) == ["default", "cudnn", "flash", "efficient", "math"]
    for name in ("cudnn", "efficient"):
        assert backends[name]["status"] == "skipped" and "No viable backend" in backends[name]["reason"], name
    expected = {"default": (["math"], None), "flash": (["flash"], 32), "math": (["math"], None)}
    for name, (kernel, padded) in expected.items():
        timed = backends[name]
        assert timed["status"] == "ran" and timed["kernel"] == kernel and timed["value_padded_to"] == padded, name
        assert timed["kernels_by_segments"] == {"16": kernel, "48": kernel}
        assert set(timed["first_call_s"]) == set(timed["steady_median_s_by_segments"]) == {"16", "48"}
        assert timed["calls"] == 6 and timed["steady_median_s"] > 0 and timed["steady_median_host_s"] > 0
        assert timed["sequence_total_s"] >= sum(timed["first_call_s"].values())
    assert "default" in backends["math"]["first_calls_after"]  # the same kernel ran these shapes before
    assert entry["fastest_steady"] in expected
    # math reused default's shapes (the same kernel): only rows that met the shapes cold compete on the total
    assert entry["fastest_sequence_total"] in {"default", "flash"}


def test_budget_skips_parts_that_do_not_fit(budget_run):
    result = budget_run
    assert [c["name"] for c in result["checks"]] == ["main_job", "host_syncs"]
    assert all(c["status"] == "skipped" and c["reason"].startswith("time budget") for c in result["checks"])
    assert result["passed"] and result["seconds"] < 3


def test_part_cap_replaces_one_parts_cap(budget_run):
    """``--part_cap PART=SECONDS`` replaces that part's cap: below the minimum a part needs, it is skipped however
    much budget is left; bad values name the problem."""
    result, _ = gpu_check("--budget_s", "1000", "--part_cap", "host_syncs=1", "--only", "host_syncs")
    assert result["checks"][0]["status"] == "skipped" and result["checks"][0]["reason"].startswith("time budget")
    assert result["parts"][0]["ran"] is False
    assert budget_run["options"]["part_cap"] == [["host_syncs", 1.0]]
    bad = {"tables=400": "unknown part", "step_table=x": "PART=SECONDS", "step_table=0": "must be > 0"}
    with ThreadPoolExecutor(len(bad)) as pool:  # three interpreters starting at once: the test waits on one
        done = pool.map(lambda cap: run_module("bench.gpu_check", "--part_cap", cap, "--only", "host_syncs"), bad)
    for process, message in zip(done, bad.values()):
        assert process.returncode == 2 and message in process.stderr, process.stderr


def test_a_part_running_past_its_allowance_is_cut_off():
    """A part still running at the end of its allowance is cut off (SIGALRM) and reported skipped for the time
    budget: the host syncs of the small preset at 8 x 2048 bytes take far longer than 5.5 s here."""
    result, _ = gpu_check(
        *("--budget_s", "1000", "--part_cap", "host_syncs=5.5", "--only", "host_syncs"),
        *("--host_syncs_preset", "small", "--host_syncs_shape", "8x2048"),
    )
    ((part,), (entry,)) = result["parts"], result["checks"]
    assert part["allowed_s"] == 5.5 and part["seconds"] < 5.5 + 5, part
    assert entry["status"] == "skipped" and entry["reason"].startswith("time budget"), entry


def test_step_rows_record_the_segment_axis_of_each_step(requested_rows):
    """Spider's rows (eager and regionally compiled) record the padded segment axis of every step; the word-rate row
    closes a segment every round(1 / boundary_prior) bytes, so its axis is fixed by the length; the peer records
    none."""
    config = spider_config("tiny")
    length = 64  # requested_rows' shape
    rows = {row["model"]: row for row in requested_rows["rows"]}
    pad = config.pad_segments_to_multiple_of
    stride = round(1 / config.boundary_prior)
    word_axis = -(-(1 + length // stride) // pad) * pad
    word = rows["spider_word_rate"]
    assert word["boundary_mode"] == "fixed" and word["bytes_per_segment"] == stride
    assert word["segment_axis"] == {
        "warmup": [word_axis],
        "instrumented": [word_axis],
        "timed": [word_axis] * 2,
        "profiled": [word_axis],  # the profiled step (its top host and aten ops)
    }
    assert word["timed_steps_at_new_axis"] == 0 and word["step_s_repeated_axis"] > 0
    for label in ("spider", "spider_compiled"):
        axis = rows[label]["segment_axis"]
        assert len(axis["timed"]) == 2 and len(axis["warmup"]) == WARMUP_STEPS[label], axis
        assert all(
            size % pad == 0 and pad <= size <= -(-(1 + length) // pad) * pad
            for size in axis["warmup"] + axis["instrumented"] + axis["timed"] + axis["profiled"]
        ), axis
    assert "segment_axis" not in rows["deepseek_v3"] and "step_s_repeated_axis" not in rows["deepseek_v3"]
