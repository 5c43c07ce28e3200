"""GPU check: the one command a user with a GPU runs.

    python -m bench.gpu_check [--out gpu_check.json]                               # one GPU, under 8 minutes
    python -m bench.gpu_check --only fp8 tile_kernels_moe --budget_s 300           # a subset, another budget
    torchrun --nproc_per_node 2 -m bench.gpu_check --only fsdp2_fp8_all_gather     # FSDP2 over NCCL (>= 2 GPUs)
    python -m pytest -m gpu                                                        # the correctness checks as tests

What its entries and fields mean: bench/README.md, "Module notes", `gpu_check.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shlex
import sys
import time
from typing import TYPE_CHECKING

# Only what the flags are parsed with is imported here: a bad flag costs an interpreter start, not torch's and the
# models' imports (each part imports what it runs, :func:`_part_functions`).
from bench.step_table_rows import (
    DEPRECATED_ROW_NAMES,
    STEP_TABLE_MODEL_CHOICES,
    STEP_TABLE_MODELS,
    TK_TRAIN_RECIPE_SHAPE,
)
from spider_training.shapes import DEFAULT_BATCHES, parse_batch

if TYPE_CHECKING:
    from bench.parts import Deadline

PARTS = (
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
)
FP8_RECIPES = ("tensorwise", "rowwise")
PRESETS = ("tiny", "small", "1b")
#: each part's largest time allowance in seconds (see bench.parts: "Time budget")
PART_CAPS_S = {
    "main_job": 90,
    "step_table": 220,
    "host_syncs": 20,
    "distributed": 90,
    "attention_backends": 15,
    "generation": 240,
    "run_1b": 150,
    "fp8": 90,
    "fp8_gemm": 150,
    "tile_kernels_moe": 45,
    "fsdp2_fp8_all_gather": 90,
}
DEFAULT_BUDGET_S = 460.0


def parse_part_cap(text: str) -> tuple[str, float]:
    """``"step_table=400"`` -> ``("step_table", 400.0)``: a part of :data:`PARTS` and its cap in seconds (> 0)."""
    part, _, seconds = text.partition("=")
    if part not in PARTS:
        raise argparse.ArgumentTypeError(f"unknown part {part!r} in {text!r}; parts: {', '.join(PARTS)}")
    try:
        cap = float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PART=SECONDS such as step_table=400, got {text!r}") from None
    if not cap > 0:
        raise argparse.ArgumentTypeError(f"a part's cap must be > 0 seconds, got {text!r}")
    return part, cap


parse_shape = parse_batch  # BATCHxBYTES


def _check_tests(options) -> dict[str, dict[str, str]]:
    """The parts that are tests (``tests/test_gpu.py``, ``tests/test_training_runs.py``), run by pytest in this
    process (``bench.parts.run_tests``): each part's tests, node id -> entry name."""
    gpu, runs = "tests/test_gpu.py::", "tests/test_training_runs.py::"
    fp8 = f"{gpu}test_fp8_training_step_matches_bf16"
    return {
        "main_job": {f"{runs}test_main_job_trains_and_its_release_generates": "main_job"},
        "distributed": {
            f"{gpu}test_ddp_and_fsdp2_at_world_size_1_match_the_unwrapped_model": "distributed_world_size_1"
        },
        "run_1b": {f"{runs}test_1b_run_keeps_its_boundary_rate_in_band_and_learns": "run_1b"},
        "fp8": {f"{fp8}[{r}_{p}]": f"fp8_{r}_{p}" for p in options.presets for r in FP8_RECIPES},
        "tile_kernels_moe": {f"{gpu}test_tile_kernels_moe_matches_torch_routing": "tile_kernels_moe"},
        "fsdp2_fp8_all_gather": {f"{gpu}test_fsdp2_float8_all_gather_matches_plain_fp8": "fsdp2_fp8_all_gather"},
    }


#: the flags of this command that size the checks, passed on to ``tests/conftest.py``'s flags of the same names
_TEST_SIZE_FLAGS = (
    "step_repeats fp8_layers distributed_preset distributed_steps distributed_shape main_job_steps main_job_preset "
    "main_job_args run_1b_steps run_1b_preset run_1b_batch run_1b_experts run_1b_args"
).split()


def _test_options(options, deadline: Deadline) -> tuple[str, ...]:
    """The flags of ``tests/conftest.py`` that size the checks, from this command's flags of the same names (a shape
    as BATCHxBYTES, a list of flags as one string; ``--run_1b_experts ''`` left out), and the part's allowance
    (``--check_allowance_s``)."""
    sizes = {name: getattr(options, name) for name in _TEST_SIZE_FLAGS}
    for name in ("distributed_shape", "run_1b_batch"):
        sizes[name] = "x".join(map(str, sizes[name]))
    for name in ("main_job_args", "run_1b_args"):
        sizes[name] = shlex.join(sizes[name])
    sizes["run_1b_experts"] = sizes["run_1b_experts"] or None
    sizes["check_allowance_s"] = deadline.left() if math.isfinite(deadline.left()) else None
    return tuple(f"--{name}={value}" for name, value in sizes.items() if value is not None)


def _part_functions(options, on_row=None) -> dict:
    """Each part's function of its :class:`~bench.parts.Deadline`, returning its entries; the modules the parts run
    (torch's, transformers', the models') are imported here."""
    from bench.diagnostics import attention_backends_check, host_syncs_check
    from bench.generation import generation_check
    from bench.parts import run_tests
    from bench.step_table import step_table_check

    tests = {
        part: (lambda d, names=names: run_tests(names, _test_options(options, d), d))
        for part, names in _check_tests(options).items()
    }
    return {
        **tests,
        "step_table": lambda d: [
            step_table_check(
                options.step_table_preset,
                options.step_table_shapes,
                options.step_repeats,
                deadline=d,
                models=tuple(options.step_table_models),
                compile_backend=options.compile_backend,
                tk_train_recipe_shape=options.tk_train_recipe_shape or None,
                compile_mode=options.compile_mode,
                on_row=on_row,
            )
        ],
        "host_syncs": lambda d: [host_syncs_check(options.host_syncs_preset, options.host_syncs_shape, deadline=d)],
        "attention_backends": lambda d: [
            attention_backends_check(
                options.attention_preset,
                options.attention_batch,
                options.attention_segments,
                options.attention_visits,
                deadline=d,
            )
        ],
        "generation": lambda d: [
            generation_check(
                options.generation_preset,
                options.generation_prompt_len,
                options.generation_new_tokens,
                options.compile_backend,
            )
        ],
        "fp8_gemm": lambda d: [fp8_gemm_check(options, d)],
    }


def fp8_gemm_check(options, deadline: Deadline) -> dict:
    """The ``fp8_gemm`` entry: ``spider-measure-fp8-gemms``'s ``rows`` (seconds per variant, FP8's speedup) and its
    table as ``fp8_gemm_table``, measured at ``--fp8_gemm_presets`` / ``--fp8_gemm_batches`` until `deadline`."""
    from bench.parts import TIME_BUDGET, default_device, entry
    from spider_training.commands.measure_fp8_gemms import measure_gemm_table

    device = default_device()
    measured = measure_gemm_table(
        options.fp8_gemm_presets,
        options.fp8_gemm_batches,
        device,
        repeats=options.step_repeats,
        backend=options.compile_backend,
        out_of_time=lambda: deadline.expired(10),
    )
    rows, skipped = measured["rows"], measured["skipped"]
    return entry(
        "fp8_gemm",
        "skipped" if skipped and not rows else "passed",
        f"{TIME_BUDGET}: {skipped} of {measured['shapes']} shapes not measured" if skipped else "",
        device=str(device),
        presets=list(options.fp8_gemm_presets),
        batches=[f"{b}x{length}" for b, length in options.fp8_gemm_batches],
        compile_backend=options.compile_backend,
        rows=rows,
        not_run=measured["not_run"],
        fp8_gemm_table=measured["table"],
        note="" if device.type == "cuda" else "CPU emulation: the FP8 times are not FP8's",
    )


def _freeze_imported() -> None:
    """Leave the objects alive now, the imported libraries and models' modules, out of the garbage collections that
    follow until :func:`run` ends (``gc.freeze``; ``gc.unfreeze`` at the end): ``bench.parts.free_memory`` collects
    after every part and step-table row, and pytest twice after each part's tests, and on a CPU each full collection
    over torch's, transformers' and the models' objects took ~0.4 s. What the parts build is made after this point,
    and collected as before."""
    gc.collect()
    gc.freeze()


def _placeholder_names(part: str, options) -> list[str]:
    return list(_check_tests(options).get(part, {part: part}).values())


def run(
    presets=("small", "1b"),
    only: tuple[str, ...] = PARTS,
    budget_s: float | None = DEFAULT_BUDGET_S,
    caps: dict | None = None,
    progress=None,
    **options,
) -> dict:
    """Run the selected parts in :data:`PARTS` order under the time budget; returns the JSON-ready result. Keyword
    `options` are the command's size/steps flags (see :func:`build_parser`). `progress`, if given, is called with the
    result so far (``"complete": False``; a step table still running appears with status ``"running"`` and its rows)
    after each part and each step-table row."""
    import torch

    from bench.common import environment
    from bench.parts import (
        MIN_PART_S,
        TIME_BUDGET,
        Deadline,
        PartTimeout,
        default_device,
        entry,
        error_reason,
        free_memory,
        hard_limit,
    )

    namespace = build_parser().parse_args([])
    vars(namespace).update(presets=list(presets), **options)
    caps = {**PART_CAPS_S, **(caps or {})}
    # the parts' modules (torch's, transformers', the models') are imported before the budget starts, and only when a
    # part fits it (each gets at most its cap and what is left, and needs MIN_PART_S)
    fits = budget_s is None or any(min(caps[part], budget_s) >= MIN_PART_S for part in PARTS if part in only)
    functions = (
        _part_functions(namespace, lambda rows: report([entry("step_table", "running", rows=rows)])) if fits else {}
    )
    if fits:
        _freeze_imported()
    start = time.perf_counter()
    total = Deadline(budget_s)
    checks, parts = [], []

    def report(running: list[dict] = ()) -> None:
        if progress is not None:
            progress(
                {
                    "benchmark": "gpu_check",
                    "complete": False,
                    "budget_s": budget_s,
                    "parts": list(parts),
                    "checks": [*checks, *running],
                    "seconds": time.perf_counter() - start,
                }
            )

    try:
        for part in PARTS:
            if part not in only:
                continue
            allowed = None if budget_s is None else min(caps[part], total.left())  # no budget: no caps either
            if allowed is not None and allowed < MIN_PART_S:
                left = max(0.0, total.left())
                checks += [
                    entry(name, "skipped", f"{TIME_BUDGET}: {left:.0f} s of --budget_s {budget_s:g} left")
                    for name in _placeholder_names(part, namespace)
                ]
                parts.append({"name": part, "allowed_s": round(left, 1), "seconds": 0.0, "ran": False})
                continue
            part_start = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr), hard_limit(allowed):
                    entries = functions[part](Deadline(allowed))
            except PartTimeout as exc:
                entries = [
                    entry(name, "skipped", f"{TIME_BUDGET}: {exc}") for name in _placeholder_names(part, namespace)
                ]
            except Exception as exc:  # noqa: BLE001 - one broken part does not hide the others
                entries = [entry(name, "failed", error_reason(exc)) for name in _placeholder_names(part, namespace)]
            free_memory()
            checks += entries
            parts.append(
                {
                    "name": part,
                    "allowed_s": None if allowed is None else round(allowed, 1),
                    "seconds": round(time.perf_counter() - part_start, 2),
                    "ran": True,
                }
            )
            report()
    finally:
        if fits:
            gc.unfreeze()
    env = environment()
    env.update(
        cuda=torch.cuda.is_available(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        device=str(default_device()),
    )
    return {
        "benchmark": "gpu_check",
        "complete": True,
        "environment": env,
        "budget_s": budget_s,
        "parts": parts,
        "checks": checks,
        "passed": all(c["status"] != "failed" for c in checks),
        "seconds": time.perf_counter() - start,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", default=list(PARTS), choices=PARTS, help="parts to run (default: all)")
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument(
        "--progress_log",
        help="append each partial result (after each part and step-table row) and the final one as a JSON line "
        "(follow a long run with tail -f)",
    )
    parser.add_argument(
        "--budget_s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds shared by all parts (each also capped by PART_CAPS_S); 0 or less: no budget",
    )
    parser.add_argument(
        "--part_cap",
        type=parse_part_cap,
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="replace one part's cap in PART_CAPS_S (repeatable), e.g. --part_cap step_table=400 "
        "to give the table more of --budget_s",
    )
    parser.add_argument("--main_job_steps", type=int, default=500, help="training steps of the main job")
    parser.add_argument("--main_job_preset", default="small", help="preset of the main job (the README's: small)")
    parser.add_argument(
        "--main_job_args",
        type=shlex.split,
        default=[],
        help="more flags for the main job's command line as one string, e.g. --main_job_args='--eval_windows 16'",
    )
    parser.add_argument("--step_table_preset", default="1b", help="preset of the step table's Spider (and peers)")
    parser.add_argument(
        "--step_table_shapes",
        nargs="+",
        type=parse_shape,
        default=None,
        help="BATCHxBYTES shapes of the step table (default 32x256 8x2048; on CPU the 1b rows run only when given)",
    )
    parser.add_argument(
        "--step_table_models",
        nargs="+",
        default=list(STEP_TABLE_MODELS),
        choices=(*STEP_TABLE_MODEL_CHOICES, *DEPRECATED_ROW_NAMES),
        help="rows of each shape (default: all but spider_eager_experts, the word-rate and tk-train-recipe "
        "compiled rows and the compiled FP8 rows; the compiled and FP8 rows run last)",
    )
    parser.add_argument(
        "--compile_backend",
        default="inductor",
        help="torch.compile backend of the spider_compiled row and the generation part (tests on CPU use 'eager')",
    )
    parser.add_argument(
        "--compile_mode",
        default=None,
        help="torch.compile mode of the spider_compiled row, e.g. reduce-overhead (CUDA graphs)",
    )
    parser.add_argument(
        "--tk_train_recipe_shape",
        "--seed_recipe_shape",
        type=parse_shape,
        default=TK_TRAIN_RECIPE_SHAPE,
        help="BATCHxBYTES of the step table's last row, tk-train.py's recipe (activation checkpointing)",
    )
    parser.add_argument(
        "--step_repeats",
        type=int,
        default=3,
        help="timed steps (after a warm-up) per step-table row and per FP8 variant; the median is used",
    )
    parser.add_argument("--host_syncs_preset", default="1b")
    parser.add_argument(
        "--host_syncs_shape", type=parse_shape, default=None, help="BATCHxBYTES (default 32x256 on CUDA, 2x256 on CPU)"
    )
    parser.add_argument("--distributed_preset", default="small", help="preset of the DDP/FSDP2 world-size-1 part")
    parser.add_argument(
        "--distributed_steps",
        type=int,
        default=4,
        help="steps before the FSDP2 checkpoint (2 more follow, straight on and resumed)",
    )
    parser.add_argument("--distributed_shape", type=parse_shape, default=(4, 256), help="BATCHxBYTES per step")
    parser.add_argument("--attention_preset", default="1b", help="preset whose attention heads and dims are timed")
    parser.add_argument(
        "--attention_batch",
        type=int,
        default=None,
        help="batch of the attention timings (default 32 on CUDA, 4 on CPU)",
    )
    parser.add_argument(
        "--attention_segments",
        nargs="+",
        type=int,
        default=None,
        help="padded segment counts visited in shuffled order (default 80 96 112)",
    )
    parser.add_argument("--attention_visits", type=int, default=5, help="visits of each segment count")
    parser.add_argument(
        "--generation_preset", default="1b", help="preset of the generation part's Spider (and its dense Llama)"
    )
    parser.add_argument("--generation_prompt_len", type=int, default=256, help="prompt bytes of the generation part")
    parser.add_argument("--generation_new_tokens", type=int, default=256, help="greedy bytes generated and timed")
    parser.add_argument("--run_1b_steps", type=int, default=300)
    parser.add_argument("--run_1b_preset", default="1b", help="preset of the run (smaller presets also run on CPU)")
    parser.add_argument("--run_1b_batch", type=parse_shape, default=(32, 256), help="BATCHxBYTES per step")
    parser.add_argument(
        "--run_1b_experts",
        default="",
        help="experts_implementation of the run: grouped_mm, batched_mm, eager ('' keeps the preset's)",
    )
    parser.add_argument(
        "--run_1b_args",
        type=shlex.split,
        default=[],
        help="more flags for the 1b run's command line, one string: --run_1b_args='--lr 3e-4'",
    )
    parser.add_argument(
        "--presets", nargs="+", default=["small", "1b"], choices=PRESETS, help="presets of the FP8 comparison"
    )
    parser.add_argument(
        "--fp8_layers",
        default=None,
        choices=("tk_train", "auto"),
        help="FP8 layer selection (spider_training.fp8); default: auto for 1b, tk_train for smaller presets",
    )
    parser.add_argument(
        "--fp8_gemm_presets",
        nargs="+",
        default=["1b"],
        choices=PRESETS,
        help="fp8_gemm: the presets whose GEMM shapes are timed (spider-measure-fp8-gemms --presets)",
    )
    parser.add_argument(
        "--fp8_gemm_batches",
        nargs="+",
        type=parse_shape,
        default=list(DEFAULT_BATCHES),
        help="fp8_gemm: the micro-batches BATCHxBYTES whose GEMM shapes are timed",
    )
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)  # before any torch import: a bad flag costs only an interpreter start
    from spider_training.checkpointing import write_json

    args.step_table_models = [DEPRECATED_ROW_NAMES.get(label, label) for label in args.step_table_models]
    kept = ("only", "out", "progress_log", "budget_s", "presets", "part_cap")
    options = {k: v for k, v in vars(args).items() if k not in kept}

    def progress(partial: dict) -> None:  # after each part and step-table row, and the final result
        if args.out:
            write_json(args.out, partial)
        if args.progress_log:
            with open(args.progress_log, "a") as log:
                log.write(json.dumps(partial, default=str) + "\n")

    result = run(
        tuple(args.presets),
        tuple(args.only),
        args.budget_s if args.budget_s > 0 else None,
        caps=dict(args.part_cap),
        progress=progress if args.out or args.progress_log else None,
        **options,
    )
    result["options"] = {k: v for k, v in vars(args).items() if k not in ("out", "progress_log")}
    text = json.dumps(result, indent=1, default=str)
    progress(result)
    print(text)
    return json.loads(text)


if __name__ == "__main__":
    main()
