"""bench/gpu_check.py and the modules of its parts (bench/parts.py, training_runs.py, step_table.py, diagnostics.py,
correctness.py): every part that can run on CPU runs here at toy sizes; the GPU-only parts say they need CUDA and
skip."""

import argparse
import json
import threading
import time

import pytest
import torch

from bench import diagnostics, gpu_check, parts, step_table, training_runs
from bench.common import spider_config, spider_model
from tests.test_gpu import FP8_LOSS_RTOL, FP8_RECIPES

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU check")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread (as under pytest-xdist): with more threads than free cores every aten op of these
    many-small-op models waits on the others, and the toy runs take many times longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOY_ARGS = [
    "--presets",
    "tiny",
    "1b",
    "--main_job_preset",
    "tiny",
    "--main_job_steps",
    "3",
    "--main_job_args",
    "--eval_windows 8",
    "--step_table_preset",
    "tiny",
    "--step_table_shapes",
    "2x32",
    "--step_repeats",
    "1",
    "--compile_backend",
    "eager",
    "--tk_train_recipe_shape",
    "2x32",
    # the default rows but the compiled one, whose compilation requested_rows below pays once for every test
    "--step_table_models",
    *(label for label in step_table.STEP_TABLE_MODELS if label != "spider_compiled"),
    "--host_syncs_preset",
    "tiny",
    "--host_syncs_shape",
    "1x64",
    "--distributed_preset",
    "tiny",
    "--distributed_steps",
    "2",
    "--distributed_shape",
    "2x48",
    "--attention_preset",
    "tiny",
    "--attention_batch",
    "2",
    "--attention_segments",
    "16",
    "48",
    "--attention_visits",
    "2",
    "--run_1b_preset",
    "tiny",
    "--run_1b_steps",
    "4",
    "--run_1b_batch",
    "2x64",
    "--run_1b_args",
    "--eval_windows 8",
    "--fp8_gemm_presets",
    "tiny",
    "--fp8_gemm_batches",
    "2x64",
]


@pytest.mark.slow
def test_cpu_run_of_every_part(tmp_path, capsys, monkeypatch):
    out = tmp_path / "gpu_check.json"
    snapshots = []
    write = gpu_check._write_json

    def recording_write(path, result):
        write(path, result)
        snapshots.append(json.loads(out.read_text()))  # what a kill at this moment leaves

    monkeypatch.setattr(gpu_check, "_write_json", recording_write)
    result = gpu_check.main([*TOY_ARGS, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result  # stdout holds the JSON only
    _assert_each_row_was_written_as_it_was_measured(snapshots, result)
    assert not (tmp_path / "gpu_check.json.tmp").exists()
    by_name = {c["name"]: c for c in result["checks"]}
    assert [p["name"] for p in result["parts"]] == list(gpu_check.PARTS) and all(p["ran"] for p in result["parts"])

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
    comparison = [label for label in step_table.STEP_TABLE_MODELS if label not in ("spider_compiled", "spider_fp8")]
    # the slow rows last: compiled (requested_rows), then FP8 (on the H200 its first step took 54 s)
    assert [row["model"] for row in table["rows"]] == [*comparison, "spider_tk_train_recipe", "spider_fp8"]
    assert (
        rows["spider_tk_train_recipe"]["activation_checkpointing"]
        and rows["spider_tk_train_recipe"]["precision"] == "float32"
    )
    for row in table["rows"]:
        assert row["status"] == "passed" and row["shape"] == "2x32", row
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
    status, reason, _ = training_runs.judge_1b_run(
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


def test_step_time_summary_counts_the_slow_steps():
    """Steps over twice the median are named (1-based); the percentiles come from the sorted times."""
    times = [0.25, 0.26, 1.4, 0.25, 0.24, 0.26, 0.25, 1.3, 0.25, 0.26]
    summary = diagnostics.step_time_summary(times)
    assert summary["steps"] == 10 and summary["median_s"] == 0.255 and summary["max_s"] == 1.4
    assert summary["slow_steps"] == 2 and summary["slow_step_numbers"] == [3, 8]
    assert summary["p90_s"] == 1.3 and summary["mean_s"] == round(sum(times) / 10, 4)
    assert diagnostics.step_time_summary([]) is None
    assert diagnostics.step_time_summary(times, slow_factor=6.0)["slow_steps"] == 0
    assert "new_axis_steps" not in summary  # no axes given


def test_step_time_summary_with_each_steps_segment_axis():
    """Given each step's segment axis, the summary names the steps that met a size first and how many of the slow
    steps they were, and takes the median of the others."""
    times = [3.0, 0.25, 1.4, 0.26, 0.25, 1.3, 0.24]
    axes = [64, 64, 80, 64, 80, 96, 80]
    summary = diagnostics.step_time_summary(times, step_axes=axes)
    assert summary["axis_sizes"] == [64, 80, 96] and summary["new_axis_steps"] == [1, 3, 6]
    assert summary["slow_step_numbers"] == [1, 3, 6] and summary["slow_steps_at_new_axis"] == 3
    assert summary["median_s_repeated_axis"] == 0.25  # of 0.25, 0.26, 0.25, 0.24
    assert "new_axis_steps" not in diagnostics.step_time_summary(times, step_axes=axes[:3])  # lengths differ


def test_default_cpu_run_skips_the_1b_parts_that_need_cuda():
    """Without size flags the 1b run and the 1b step table say they need CUDA (they would take hours on a CPU)."""
    table = step_table.step_table_check("1b")
    run = training_runs.run_1b_check()
    assert table["status"] == run["status"] == "skipped"
    assert "needs CUDA" in table["reason"] and "needs CUDA" in run["reason"]


@pytest.fixture(scope="module")
def requested_rows():
    """One step table at 2 x 64 (two timed steps) with the rows on request and the regionally compiled ones (each
    costs a compilation, ~15 s here), shared by the tests that read them."""
    table = step_table.step_table_check(
        "tiny",
        shapes=[(2, 64)],
        repeats=2,
        device=torch.device("cpu"),
        models=(
            "spider_fp8_rowwise_compiled",
            "spider",
            "spider_word_rate",
            "deepseek_v3",
            "spider_compiled",
            "spider_fp8",
            "spider_compiled_automatic_dynamic",
            "spider_word_rate_compiled",
            "spider_tk_train_recipe_compiled",
        ),
        compile_backend="eager",
        tk_train_recipe_shape=(2, 32),
    )
    assert table["status"] == "passed", table
    return table


def test_compiled_rows_on_request_run_before_the_fp8_rows(requested_rows):
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
    assert (
        "spider_compiled" in step_table.STEP_TABLE_MODELS
    )  # a default row (test_cpu_run_of_every_part leaves it out)
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


def test_tk_train_recipe_keeps_its_earlier_flag_and_row_names():
    """tk-train.py was once called "the seed": ``--seed_recipe_shape`` and the ``spider_seed_recipe_compiled`` row
    still parse, as the ``tk_train`` names."""
    args = gpu_check.build_parser().parse_args(
        ["--seed_recipe_shape", "2x32", "--step_table_models", "spider_seed_recipe_compiled"]
    )
    assert args.tk_train_recipe_shape == (2, 32)
    renamed = step_table.DEPRECATED_ROW_NAMES[args.step_table_models[0]]
    assert renamed == "spider_tk_train_recipe_compiled" and renamed in step_table.STEP_TABLE_MODEL_CHOICES


def test_attention_backends_at_toy_sizes_on_cpu():
    """Every SDPA kernel over the same shuffled segment counts: CPU has math and flash (the value padded to the
    query/key head dim), torch's default runs math for MLA's unequal head dims; cuDNN and memory-efficient are
    skipped with torch's reason."""
    entry = diagnostics.attention_backends_check(
        "tiny", batch=2, segment_counts=(16, 48), visits=3, device=torch.device("cpu")
    )
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


def test_attention_backends_stop_at_the_deadline():
    entry = diagnostics.attention_backends_check(
        "tiny", batch=1, segment_counts=(16,), visits=1, device=torch.device("cpu"), deadline=parts.Deadline(0.0)
    )
    assert entry["status"] == "skipped" and entry["reason"] == "time budget"
    assert {r["reason"] for r in entry["backends"].values()} == {"time budget"}


def test_1b_run_judgement():
    band = dict(boundary_prior=0.2, boundary_prior_std=0.023, boundary_prior_k=3.0)  # rate in [0.131, 0.2]
    falling, rising = [(0, 3.1), (50, 2.6), (100, 2.3)], [(0, 2.3), (50, 2.6), (100, 2.9)]
    in_band, too_few = [(10, 9.0), (100, 6.0)], [(10, 9.0), (100, 12.0)]  # bytes per segment: rate 1/6, 1/12
    assert training_runs.judge_1b_run(falling, in_band, **band)[:2] == ("passed", "")
    status, reason, figures = training_runs.judge_1b_run(rising, in_band, **band)
    assert status == "failed" and "did not fall" in reason and figures["bits_per_byte_last"] == 2.9
    status, reason, figures = training_runs.judge_1b_run(falling, too_few, **band)
    assert status == "failed" and "outside the prior's band" in reason
    assert figures["boundary_rate_end"] == pytest.approx(1 / 12)
    assert figures["boundary_rate_band"] == pytest.approx([0.2 - 3 * 0.023, 0.2])
    assert training_runs.judge_1b_run(falling[:1], in_band, **band)[0] == "failed"  # one scoring shows no trend


def test_held_out_and_compression_curves_from_a_log_history():
    history = [
        {"eval_before_bits_per_byte": 8.0, "step": 0},
        {"loss": 5.0, "compression_rate": 2.0, "bits_per_byte": 7.5, "step": 10},
        {"eval_bits_per_byte": 7.0, "eval_compression_rate": 3.0, "step": 10},
        {"eval_after_bits_per_byte": 6.5, "step": 12},
    ]
    assert training_runs.held_out_curve(history) == [(0, 8.0), (10, 7.0), (12, 6.5)]  # training's bpb is not held-out
    assert training_runs.compression_curve(history) == [(10, 2.0)]
    assert training_runs.training_curve(history, "bits_per_byte") == [(10, 7.5)]


def test_budget_skips_parts_that_do_not_fit():
    result = gpu_check.main(["--budget_s", "3", "--only", "main_job", "host_syncs"])
    assert [c["name"] for c in result["checks"]] == ["main_job", "host_syncs"]
    assert all(c["status"] == "skipped" and c["reason"].startswith("time budget") for c in result["checks"])
    assert result["passed"] and result["seconds"] < 3


def test_part_cap_replaces_one_parts_cap():
    """``--part_cap PART=SECONDS`` replaces that part's cap: below the minimum a part needs, it is skipped however
    much budget is left; bad values name the problem."""
    result = gpu_check.main(["--budget_s", "1000", "--part_cap", "host_syncs=1", "--only", "host_syncs"])
    assert result["checks"][0]["status"] == "skipped" and result["checks"][0]["reason"].startswith("time budget")
    assert result["parts"][0]["ran"] is False
    assert gpu_check.parse_part_cap("step_table=400") == ("step_table", 400.0)
    for bad, message in (
        ("tables=400", "unknown part"),
        ("step_table=x", "PART=SECONDS"),
        ("step_table=0", "must be > 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            gpu_check.parse_part_cap(bad)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGALRM needs the main thread")
def test_a_part_running_past_its_allowance_is_cut_off(monkeypatch):
    seen = {}

    def slow_part(deadline):
        seen["allowed"] = deadline.seconds
        time.sleep(30)
        return [parts.entry("host_syncs", "passed")]

    monkeypatch.setattr(gpu_check, "MIN_PART_S", 0.1)
    monkeypatch.setattr(gpu_check, "_part_functions", lambda options, on_row=None: {"host_syncs": slow_part})
    start = time.monotonic()
    result = gpu_check.run(only=("host_syncs",), caps={"host_syncs": 0.5})
    assert time.monotonic() - start < 10 and seen["allowed"] == 0.5
    (entry,) = result["checks"]
    assert entry["status"] == "skipped" and entry["reason"].startswith("time budget"), entry


def test_main_job_stops_training_at_its_deadline():
    """A deadline that leaves no time for training: the trainer stops after its first step, and the run still
    scores, writes and reloads its release (the time kept for them is not the training's)."""
    entry = training_runs.main_job_check(
        steps=50,
        preset="tiny",
        deadline=parts.Deadline(1.0),
        extra_args=("--eval_windows", "4", "--save_strategy", "no"),
    )
    assert entry["steps"] == 1 and entry["stopped_by_time_budget_at_step"] == 1, entry
    assert "time budget at step 1 of 50" in entry["note"] and entry["release_reload_ok"]


def test_profile_kernels_on_cpu_sees_no_device_events():
    model = torch.nn.Linear(8, 8)
    entry = diagnostics._profile_kernels(lambda: model(torch.randn(4, 8)).sum().backward(), torch.device("cpu"))
    assert entry["kernel_launches"] == entry["device_events"] == 0 and entry["profiled_step_s"] > 0
    top = entry["top_host_ops"]  # where the host's time went, most first
    assert 0 < len(top) <= diagnostics.TOP_HOST_OPS and any("addmm" in name for name in top), top
    times = [op["self_host_ms"] for op in top.values()]
    assert times == sorted(times, reverse=True) and all(op["calls"] >= 1 for op in top.values())
    assert entry["top_kernels"] == {}
    aten = entry["top_aten_ops"]  # one forward+backward of a linear layer: one addmm, the weight's grad one mm
    assert aten["aten::addmm"] == 1 and aten["aten::mm"] >= 1, aten
    assert list(aten.values()) == sorted(aten.values(), reverse=True)
    eager = entry["eager_aten_ops"]  # nothing compiled: every outermost op (linear, not the addmm inside it) counts
    assert eager["by_op"]["aten::linear"] == 1 and "aten::addmm" not in eager["by_op"] and eager["count"] >= 3, eager


def test_kernels_by_launches_ranks_kernel_names_by_launch_count():
    """Profiler device events stand in as plain objects with the two attributes read (a name, a time range)."""
    from types import SimpleNamespace

    def kernel(name, us):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: us))

    long_name = "void at::native::elementwise_kernel<" + "x" * 300 + ">"
    events = [
        kernel("gemm", 30.0),
        kernel(long_name, 1000.0),
        kernel(long_name, 2000.0),
        kernel(long_name, 1500.0),
        kernel("gemm", 10.0),
    ] + [kernel(f"k{i}", 1.0) for i in range(diagnostics.TOP_BY_COUNT)]
    ranked = diagnostics._kernels_by_launches(events)
    assert len(ranked) == diagnostics.TOP_BY_COUNT
    assert list(ranked.items())[:2] == [
        (long_name[:120], {"launches": 3, "device_ms": 4.5}),
        ("gemm", {"launches": 2, "device_ms": 0.04}),
    ]


def test_a_row_whose_counting_step_fails_is_still_timed(monkeypatch):
    """A model the counting modes trip on (say a tensor subclass) keeps its timing; the row says why it has no counts
    and takes the FLOPs it was given."""

    def failing(step, device):
        step.forward_backward()  # fails halfway: gradients were written
        raise RuntimeError("a counting mode tripped")

    monkeypatch.setattr(step_table, "_instrumented_step", failing)
    model = spider_model("tiny")
    row = step_table._step_row(model, "spider", (1, 32), torch.device("cpu"), repeats=1, peak_flops=1e9, flops=123)
    assert row["status"] == "passed" and row["step_s"] > 0 and "a counting mode tripped" in row["instrument_error"]
    assert row["flops_per_step"] == 123 and row["aten_ops_per_step"] is None and row["mfu"] > 0


def test_repeated_axis_summary_times_the_steps_at_an_axis_met_before():
    """A timed step counts as repeated when a warm-up, instrumented or earlier timed step ran its segment axis."""
    summary = diagnostics.repeated_axis_summary([64, 80], [80, 96, 96, 112, 64], [0.25, 1.4, 0.26, 1.3, 0.24])
    assert summary["timed_steps_at_new_axis"] == 2  # 96 first, 112
    assert summary["step_s_repeated_axis"] == 0.25  # median of 0.25 (80), 0.26 (96 again), 0.24 (64)
    assert diagnostics.repeated_axis_summary([], [48, 64], [1.0, 1.1]) == {
        "timed_steps_at_new_axis": 2,
        "step_s_repeated_axis": None,
    }


def test_step_rows_record_the_segment_axis_of_each_step(requested_rows):
    """Spider's rows (eager and regionally compiled) record the padded segment axis of every step; the word-rate row
    closes a segment every round(1 / boundary_prior) bytes, so its axis is fixed by the length; the peer records
    none; no row leaves its hook behind."""
    config = spider_config("tiny")
    length = 64  # requested_rows' shape
    rows = {row["model"]: row for row in requested_rows["rows"]}
    pad = config.pad_segments_to_multiple_of
    stride = round(1 / config.boundary_prior)
    word_axis = -(-(1 + length // stride) // pad) * pad
    word = rows["spider_word_rate"]
    assert word["boundary_mode"] == "fixed" and word["bytes_per_segment"] == stride
    assert word["segment_axis"] == {"warmup": [word_axis], "instrumented": [word_axis], "timed": [word_axis] * 2}
    assert word["timed_steps_at_new_axis"] == 0 and word["step_s_repeated_axis"] > 0
    for label in ("spider", "spider_compiled"):
        axis = rows[label]["segment_axis"]
        assert len(axis["timed"]) == 2 and len(axis["warmup"]) == step_table.STEP_TABLE_WARMUP.get(label, 1), axis
        assert all(
            size % pad == 0 and pad <= size <= -(-(1 + length) // pad) * pad
            for size in axis["warmup"] + axis["instrumented"] + axis["timed"]
        ), axis
    assert "segment_axis" not in rows["deepseek_v3"] and "step_s_repeated_axis" not in rows["deepseek_v3"]

    model = spider_model("tiny")
    step_table._step_row(model, "spider", (1, 32), torch.device("cpu"), repeats=1, peak_flops=None)
    assert not model.model.flexitokens._forward_hooks


def test_device_allocations_per_timed_step(monkeypatch):
    """Off CUDA there is no allocator count and the row has no such field; with a stand-in for the CUDA caching
    allocator's ``num_device_alloc`` counter (no CUDA here), each timed step records the calls it made."""
    assert diagnostics.device_allocations(torch.device("cpu")) is None
    model = spider_model("tiny")
    row = step_table._step_row(model, "spider", (1, 32), torch.device("cpu"), repeats=2, peak_flops=None)
    assert "device_allocations_per_step" not in row

    calls = iter([10, 13, 13, 20])  # before / after each of the two timed steps

    def fake_allocator_counter(device):  # test double: the CUDA caching allocator's num_device_alloc
        return next(calls)

    monkeypatch.setattr(step_table, "device_allocations", fake_allocator_counter)
    row = step_table._step_row(model, "spider", (1, 32), torch.device("cpu"), repeats=2, peak_flops=None)
    assert row["device_allocations_per_step"] == [3, 7]
