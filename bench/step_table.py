"""The training-step table of ``python -m bench.gpu_check`` (:func:`step_table_check`).

What its entries and fields mean: bench/README.md, "Module notes", `step_table.py`.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

from bench.common import num_params, random_bytes, spider_config, spider_model
from bench.diagnostics import _instrumented_step, _profile_kernels, device_allocations
from bench.parts import (
    MIN_PART_S,
    TIME_BUDGET,
    Deadline,
    PartTimeout,
    autocast_dtype,
    build_on,
    default_device,
    entry,
    error_reason,
    free_memory,
    train_step_of,
)
from bench.step_table_rows import (  # noqa: F401  (re-exported: the names bench.gpu_check parses its flags with)
    DEPRECATED_ROW_NAMES,
    FP8_COMPILED_ROWS,
    STEP_TABLE_MODEL_CHOICES,
    STEP_TABLE_MODELS,
    STEP_TABLE_SHAPES,
    TK_TRAIN_RECIPE_SHAPE,
)
from spider_training.peers import dense_llama_config, peer_model
from spider_training.profiling import graphs_compiled
from spider_training.step_times import SegmentAxisRecorder, repeated_axis_summary
from spider_training.throughput import measured_matmul_flops, synchronize

#: the rows that run first, shape by shape (the compiled, tk-train-recipe and FP8 rows follow: ``step_table_check``)
_COMPARISON_ROWS = ("spider", "spider_word_rate", "deepseek_v3", "llama_dense", "spider_eager_experts")
#: compiled rows and the eager row whose FLOPs each reports (a dispatch mode does not see into compiled graphs, so
#: they get no instrumented step)
_EAGER_TWIN = {
    "spider_compiled": "spider",
    "spider_compiled_automatic_dynamic": "spider",
    "spider_word_rate_compiled": "spider_word_rate",
    "spider_tk_train_recipe_compiled": "spider_tk_train_recipe",
    **dict.fromkeys(FP8_COMPILED_ROWS, "spider"),
}
#: warm-up steps before a row's timed steps (a compiled row compiles its regions and their structural variants, such
#: as the first loop's, during its first steps: ``graphs_compiled_per_step``); every compiled row is an eager row's
#: twin
STEP_TABLE_WARMUP = dict.fromkeys(_EAGER_TWIN, 3)


def _step_row(
    model,
    label: str,
    shape: tuple[int, int],
    device: torch.device,
    repeats: int,
    peak_flops: float | None,
    profile: bool = True,
    warmup: int = 1,
    instrument: bool = True,
    flops: int | None = None,
) -> dict:
    """One row of the step table. `instrument`: run one instrumented step (FLOPs, aten ops, host syncs); off for a
    compiled model, whose graphs a dispatch mode does not see into: its FLOPs are then `flops` (its eager twin's,
    None when unknown), as they are when the instrumented step fails (``instrument_error``; the row is still timed)."""
    batch, length = shape
    row = {"model": label, "shape": f"{batch}x{length}", "status": "passed", "reason": ""}
    ids = random_bytes(batch, length).to(device)
    step = train_step_of(model, ids, device)
    axis = SegmentAxisRecorder(model)  # Spider's segment axis per step
    try:
        warmup_s, warmup_axis, compiled = [], [], {"warmup": [], "timed": []}

        def recorded_step(phase: str):
            """One step; its segment axis size, and the graphs it compiled recorded under `phase`."""
            (_, size), graphs = graphs_compiled(lambda: axis.step(step))
            compiled[phase].append(graphs)
            return size

        for _ in range(warmup):  # optimizer state, kernels' plans, compilation
            synchronize(device)
            start = time.perf_counter()
            warmup_axis.append(recorded_step("warmup"))
            synchronize(device)
            warmup_s.append(time.perf_counter() - start)
        row["warmup_step_s"] = [round(t, 3) for t in warmup_s]
        figures = dict(flops_per_step=flops, aten_ops_per_step=None, host_syncs=None)
        instrumented_axis = []
        if instrument:
            try:
                figures, size = axis.step(lambda: _instrumented_step(step, device))
                instrumented_axis = [size] if size is not None else []
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a tensor subclass a counting mode trips on: time the row
                model.zero_grad(set_to_none=True)
                figures["instrument_error"] = error_reason(exc)
        row.update(figures)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, host, timed_axis, allocations = [], [], [], []
        for _ in range(repeats):
            allocated_before = device_allocations(device)
            synchronize(device)
            start = time.perf_counter()
            timed_axis.append(recorded_step("timed"))
            host.append(time.perf_counter() - start)  # the host's time to issue the step (on CPU: the step)
            synchronize(device)
            times.append(time.perf_counter() - start)
            allocated_after = device_allocations(device)
            if allocated_before is not None and allocated_after is not None:
                allocations.append(allocated_after - allocated_before)
        if allocations:  # a step that grows the allocator's pool (a larger segment axis) pays for each cudaMalloc
            row["device_allocations_per_step"] = allocations
        if any(compiled["warmup"] + compiled["timed"]):  # a compiled model: which steps compiled graphs, how many
            row["graphs_compiled_per_step"] = compiled
        median = statistics.median(times)
        if axis.active:
            row.update(
                segment_axis={"warmup": warmup_axis, "instrumented": instrumented_axis, "timed": timed_axis},
                **repeated_axis_summary(warmup_axis + instrumented_axis, timed_axis, times),
            )
        row.update(
            step_s=median,
            step_s_min=min(times),
            step_times_s=[round(t, 5) for t in times],
            host_s=statistics.median(host),
            bytes_per_s=batch * length / median,
            peak_memory_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            mfu=row["flops_per_step"] / median / peak_flops if peak_flops and row["flops_per_step"] else None,
        )
        if profile:  # on CPU: the host ops and aten ops (no kernels)
            try:
                profiled, size = axis.step(lambda: _profile_kernels(step, device))
                row.update(profiled)
                if device.type == "cuda":
                    row["gpu_busy_fraction"] = profiled["gpu_busy_s"] / median
                if axis.active:  # a profiled step at a new axis size times the planning too
                    row["segment_axis"]["profiled"] = [size] if size is not None else []
                    if device.type == "cuda" and row["step_s_repeated_axis"]:  # the share of a step whose plans exist
                        row["gpu_busy_fraction_repeated_axis"] = profiled["gpu_busy_s"] / row["step_s_repeated_axis"]
            except Exception as exc:  # noqa: BLE001 - a profiler failure leaves the timings valid
                row["profile_error"] = error_reason(exc)
        return row
    finally:
        axis.close()


def _spider_fp8(
    preset: str, device: torch.device, recipe: str = "tensorwise", experts_mode: str = "auto"
) -> tuple[torch.nn.Module, dict]:
    """Spider converted as ``--precision fp8 --fp8_recipe RECIPE --fp8_experts EXPERTS_MODE`` converts it
    (``--fp8_layers auto``; emulated ``Float8Linear`` off CUDA), with what was converted."""
    from spider_training.fp8 import convert_for_fp8_training

    model = build_on(lambda: spider_model(preset), device)
    report = convert_for_fp8_training(
        model, recipe=recipe, experts=experts_mode, emulate=device.type != "cuda", device=device
    )
    experts = [fqn for fqn in report.converted if fqn.endswith(".experts")]
    kept_linear = [r for fqn, r in report.kept.items() if not fqn.endswith(".experts")]
    return model, {
        "fp8_recipe": recipe,
        "fp8_linear_layers": len(report.converted) - len(experts),
        "fp8_linear_skipped": dict(collections.Counter(r.split(" at ")[0] for r in kept_linear)),
        "fp8_experts_modules": len(experts),
        "fp8_experts_skipped": sorted({r for fqn, r in report.kept.items() if fqn.endswith(".experts")}),
        "fp8_report": report.message,
    }


def _compiled(
    built: tuple[torch.nn.Module, dict], backend: str, mode: str | None, **options
) -> tuple[torch.nn.Module, dict]:
    """`built` (a row's model, and what the row adds about it) compiled as ``--compile`` compiles it
    (:func:`spider_training.compile.compile_model`, with `options` over its defaults: each layer kind one graph; the
    loops, the segment count and the glue between the layers in eager Python) after a dynamo reset, with
    ``torch.compile``'s `backend` and `mode` (``--torch_compile_mode`` of the trainer; e.g. ``"reduce-overhead"``:
    CUDA graphs per layer call); what the row adds then includes the compilation's settings."""
    from spider_training.compile import COMPILE_OPTIONS, compile_model

    model, extra = built
    torch._dynamo.reset()
    return compile_model(model, backend=backend, mode=mode, **options), {
        **extra,
        "compile_backend": backend,
        "compile_mode": mode or "default",
        "compile_dynamic": {**COMPILE_OPTIONS, **options}["dynamic"],
    }


def _spider_tk_train_recipe(preset: str, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """tk-train.py's own training configuration: `preset` with activation checkpointing
    (``activation_checkpointing_enable``, as ``--preset 1b`` trains by default), in the precision ``--precision auto``
    picks on this device (bf16 autocast on CUDA until FP8 measures faster; then converted as :func:`_spider_fp8`)."""
    from spider_training.fp8 import resolve_precision

    precision = resolve_precision("auto", preset) if device.type == "cuda" else "fp32"
    model = _spider_fp8(preset, device)[0] if precision == "fp8" else build_on(lambda: spider_model(preset), device)
    model.activation_checkpointing_enable()
    autocast = str(autocast_dtype(device) or torch.float32).replace("torch.", "")
    return model, {"activation_checkpointing": True, "precision": "fp8" if precision == "fp8" else autocast}


def step_table_check(
    preset: str = "1b",
    shapes=None,
    repeats: int = 3,
    device: torch.device | None = None,
    deadline: Deadline | None = None,
    models: tuple[str, ...] = STEP_TABLE_MODELS,
    compile_backend: str = "inductor",
    tk_train_recipe_shape: tuple[int, int] | None = TK_TRAIN_RECIPE_SHAPE,
    compile_mode: str | None = None,
    on_row=None,
) -> dict:
    """The training-step table (bench/README.md). `shapes`: ``[(batch, bytes)]``, default
    :data:`STEP_TABLE_SHAPES`; without CUDA the ``1b`` preset needs explicit `shapes`. `models`: rows of each shape
    (:data:`STEP_TABLE_MODELS`); `compile_backend`: ``torch.compile`` backend of the ``spider_compiled`` row;
    `tk_train_recipe_shape`: the ``spider_tk_train_recipe`` row's batch (None: no such row); `compile_mode`:
    ``torch.compile``'s mode for the compiled rows; `on_row`: called with the list of rows so far after each row
    (``python -m bench.gpu_check --out`` writes them, so a run killed from outside keeps the rows it measured)."""
    from transformers import LlamaForCausalLM

    models = tuple(DEPRECATED_ROW_NAMES.get(label, label) for label in models)
    device = device or default_device()
    deadline = deadline or Deadline(None)
    name = "step_table"
    if preset == "1b" and device.type != "cuda" and shapes is None:
        return entry(
            name,
            "skipped",
            "needs CUDA for the 1b rows (pass --step_table_shapes, or --step_table_preset "
            "tiny, to run the table on CPU)",
        )
    shapes = [tuple(s) for s in (shapes or STEP_TABLE_SHAPES)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = measured_matmul_flops(device, dtype)
    config = spider_config(preset)
    llama_config = dense_llama_config(config)
    default_experts = config._experts_implementation
    # The order: every shape's comparison rows (shape by shape, so a budget that runs out leaves the comparison at the
    # first shape complete), then tk-train.py's recipe, then the compiled rows (compilation takes the longest), then
    # FP8's (on the H200 its first step took 54 s and each new segment count ~5 s).
    recipe_shapes = [] if tk_train_recipe_shape is None else [tuple(tk_train_recipe_shape)]
    plan = [(label, shape) for shape in shapes for label in models if label in _COMPARISON_ROWS]
    plan += [("spider_tk_train_recipe", shape) for shape in recipe_shapes if "spider" in models]
    later = (  # row by row, each at its shapes
        (("spider_compiled", "spider_compiled_automatic_dynamic", "spider_word_rate_compiled"), shapes),
        (("spider_tk_train_recipe_compiled",), recipe_shapes),
        (("spider_fp8", *FP8_COMPILED_ROWS), shapes),
    )
    plan += [(label, shape) for labels, at in later for label in labels if label in models for shape in at]

    def built(fn) -> tuple[torch.nn.Module, dict]:
        """`fn()` built on the device, with nothing the row adds about it."""
        return build_on(fn, device), {}

    def spider(**overrides) -> tuple[torch.nn.Module, dict]:
        """Spider, `preset` with the config `overrides`, built on the device."""
        return built(lambda: spider_model(preset, **overrides))

    def compiled(model_and_extra: tuple[torch.nn.Module, dict], **options) -> tuple[torch.nn.Module, dict]:
        return _compiled(model_and_extra, compile_backend, compile_mode, **options)

    def word_rate(model, extra: dict) -> tuple[torch.nn.Module, dict]:
        """A model built with ``boundary_mode="fixed"``, and the stride its boundary predictor closes segments at."""
        stride = model.model.flexitokens.boundary_predictor.stride
        return model, {**extra, "boundary_mode": "fixed", "bytes_per_segment": stride}

    # each builder returns (model on the device, what the row adds about it)
    builders = {
        "spider": spider,
        "deepseek_v3": lambda: built(lambda: peer_model(config)),
        "llama_dense": lambda: built(lambda: (torch.manual_seed(0), LlamaForCausalLM(llama_config))[1]),
        "spider_word_rate": lambda: word_rate(*spider(boundary_mode="fixed")),
        "spider_word_rate_compiled": lambda: word_rate(*compiled(spider(boundary_mode="fixed"))),
        "spider_fp8": lambda: _spider_fp8(preset, device),
        "spider_tk_train_recipe": lambda: _spider_tk_train_recipe(preset, device),
        "spider_tk_train_recipe_compiled": lambda: compiled(_spider_tk_train_recipe(preset, device)),
        "spider_compiled": lambda: compiled(spider()),
        "spider_compiled_automatic_dynamic": lambda: compiled(spider(), dynamic=None),
    }
    for label, (recipe, experts) in FP8_COMPILED_ROWS.items():
        builders[label] = lambda recipe=recipe, experts=experts: compiled(_spider_fp8(preset, device, recipe, experts))
    rows, params, spider_flops = [], {}, {}  # spider_flops: by (eager row, shape), for the compiled twins
    # (builder key, model, extra): the plain model serves its eager-experts row, the compiled one both shapes
    held = None
    needed = MIN_PART_S  # a row starts only if this much time is left: 1.5 x the slowest row so far
    for label, (batch, length) in plan:
        row_name = {"model": label, "shape": f"{batch}x{length}"}
        if deadline.expired(needed):
            rows.append({**row_name, "status": "skipped", "reason": TIME_BUDGET})
            continue
        row_start = time.monotonic()
        key = "spider" if label == "spider_eager_experts" else label
        try:
            if held is None or held[0] != key:
                held = None
                free_memory()
                held = (key, *builders[key]())
            _, model, extra = held
            if key == "spider":
                model.set_experts_implementation("eager" if label == "spider_eager_experts" else default_experts)
            params[label] = num_params(model)
            row = _step_row(
                model,
                label,
                (batch, length),
                device,
                repeats,
                peak["flops_per_s"],
                profile=(batch, length) == shapes[0],
                warmup=STEP_TABLE_WARMUP.get(label, 1),
                instrument=label not in _EAGER_TWIN,
                flops=spider_flops.get((_EAGER_TWIN.get(label), batch, length)),
            )
            rows.append({**row, **extra})
            if label in _EAGER_TWIN.values():
                spider_flops[(label, batch, length)] = row["flops_per_step"]
        except PartTimeout as exc:  # the hard limit: keep the rows measured so far
            rows.append({**row_name, "status": "skipped", "reason": f"{TIME_BUDGET}: {exc}"})
            deadline.end = time.monotonic()  # every later row is skipped
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the other rows still run
            rows.append({**row_name, "status": "failed", "reason": error_reason(exc)})
            held = None
        if held is not None:
            held[1].zero_grad(set_to_none=True)
        free_memory()
        needed = max(needed, 1.5 * (time.monotonic() - row_start))
        if on_row is not None:
            on_row(list(rows))
    held = None
    free_memory()
    failed = [f"{r['model']} {r['shape']}: {r['reason']}" for r in rows if r["status"] == "failed"]
    ran = [r for r in rows if r["status"] == "passed"]
    if failed:
        status, reason = "failed", "; ".join(failed)
    elif not ran:
        status, reason = "skipped", TIME_BUDGET
    else:
        status = "passed"
        reason = TIME_BUDGET + ": some rows skipped" if len(ran) < len(rows) else ""
    return entry(
        name,
        status,
        reason,
        device=str(device),
        preset=preset,
        dtype=str(dtype).replace("torch.", ""),
        peak_matmul=peak,
        parameters=params,
        repeats=repeats,
        llama_dense_layers=llama_config.num_hidden_layers,
        llama_params_over_spider=(
            params["llama_dense"] / params["spider"] if {"llama_dense", "spider"} <= params.keys() else None
        ),
        rows=rows,
    )


# ---------------------------------------------------------------------------------------------------------------------
# host_syncs
