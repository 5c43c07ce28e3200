"""experiments.quality through its command line and JSON (``python -m experiments.quality``), as tests/test_bench.py
drives bench.run_all: the suite's rows (experiments/quality_rows.json) and the recipe each run trains by
(``--print_suite``), a few-step row of each kind trained through train_hf.py's trainer with what the trainer did
recorded (``--suite --rows FILE --record``: the optimizer, loop-count draws, the data and the initial weights each
model gets), the step-time split (``--time_steps``) and the tables, targets and plot rendered from rows (``--report
FILE ... --render_each``). Four commands, started together once for the module. The suite's full training runs are the
benchmark itself; the scoring is spider_training.evaluation's (tests/test_evaluation.py)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from configuration_spider import SpiderConfig
from spider_training.evaluation import BYTE_KINDS
from spider_training.optim import DEFAULT_MUON_LR
from tests.helpers import REPO, run_module

SUITE = json.loads((REPO / "experiments" / "quality_rows.json").read_text())  # the rows file is data
REFERENCES = SUITE["references"]
BATCH8_RECIPE = SUITE["recipes"]["batch8"]  # {"batch_size": 8, "muon_experts": True}
ADAMW = {"muon_lr": None}
DEFAULT_RECIPE = {"muon_lr": DEFAULT_MUON_LR, **SUITE["recipes"]["default"]}
END_TO_END_SEGMENTS = {"boundary_teacher": None, "boundary_prior": 0.333}
GATED_MIXING = {"expand_mixing": "scaled_norm"}
DRAWN_LOOPS = {"extra_train_loops": 1}
DRAWN_LOOPS_NAME = "loop count drawn from {2, 3} each step (extra_train_loops=1)"
GATED_DEFAULT = "mixing: a learned gate that starts shut (scaled_norm, ReZero; the default before 2026-11-25)"
LOCAL_DENSE = "dense, 4-byte local attention"
LARGER_BATCH_NAME = "the batch-8 default at batch 16 x 256 (twice the bytes per step, Muon for every hidden matrix)"
LARGEST_BATCH_NAME = (
    "the batch-8 default at batch 32 x 256 (four times the bytes per step, Muon for every hidden matrix)"
)
#: the step times the plan is made with: (Spider, Llama, byte layers alone) seconds per step under each timing recipe
STEP_TIMES = {"default": [0.6, 1.2, 0.25], "adamw": [0.5, 1.25, 0.2]}
#: the rows the sharding test splits: the ablations, three dense baselines at equal wall-clock, the local baselines
SHARDED = [r["name"] for r in SUITE["rows"] if r["group"] == "ablation"] + [
    *(f"llama lr={lr}, equal wall-clock" for lr in ("0.0005", "0.001", "0.002")),
    LOCAL_DENSE,
    f"{LOCAL_DENSE}, equal wall-clock",
    "llama",
]


def _row(name, bpb, kind="spider", group="ablation", **extra):
    return {
        "name": name,
        "model": kind,
        "group": group,
        "steps": 500,
        "lr": 1e-3,
        "parameters": 6_000_000,
        "sotu_bits_per_byte": bpb,
        **extra,
    }


def _rows(removed_bpb):
    spider = _row(
        "spider",
        2.20,
        xz_bits_per_byte=3.03,
        n_loops=2,
        pydoc_topics_bits_per_byte=4.6,
        bpb_by_loops={"1": 2.25, "2": 2.20, "4": 2.205},
        train_bytes_per_segment=3.4,
        eval_bytes_per_segment=3.2,
        mean_halting_step=2.0,
        sample="The state of the Union is a",
        real_word_rate=0.9,
    )
    return [
        spider,
        _row("global path removed (prelude + coda only)", removed_bpb, kind="bytes_only"),
        _row(
            "llama",
            2.4,
            kind="llama",
            group="baseline equal parameters",
            pydoc_topics_bits_per_byte=4.5,
            sample="x",
            real_word_rate=0.8,
        ),
        _row(
            "llama lr=0.001, equal wall-clock",
            2.5,
            kind="llama",
            group="baseline equal wall-clock",
            pydoc_topics_bits_per_byte=4.58,
        ),
    ]


def _byte_kind_rows():
    kinds = dict.fromkeys(BYTE_KINDS, 2.0)
    shares = dict.fromkeys(BYTE_KINDS, 1 / len(BYTE_KINDS))
    rows = _rows(2.21)
    rows[0].update(
        bpb_by_byte_kind={**kinds, "1st byte of a word": 4.0},
        byte_kind_shares=shares,
        bpb_by_global_stream_probe={
            "removed": {"bits_per_byte": 2.3, "by_byte_kind": {**kinds, "1st byte of a word": 4.5}}
        },
    )
    rows[1].update(bpb_by_byte_kind={**kinds, "1st byte of a word": 4.25}, byte_kind_shares=shares)
    return rows


OLD = dict(overrides=END_TO_END_SEGMENTS, muon_lr=0.01)
ABLATIONS = _rows(2.21) + [
    _row(REFERENCES["batch8_default"], 2.21, muon_lr=0.01, recipe={**BATCH8_RECIPE, "muon_lr": 0.01}),
    _row(REFERENCES["adamw_default"], 2.30),
    _row("n_loops=1", 2.35),
    _row(REFERENCES["end_to_end_default"], 2.24, **OLD),
    _row("Muon at lr 0.02", 2.25, **{**OLD, "muon_lr": 0.02}),
    _row("segments: a fixed stride of 6 bytes instead of the teacher's", 2.23, muon_lr=0.01),
]
CURVE = [{"step": 1, "seconds": 1.0, "bits_per_byte": 3.0}, {"step": 2, "seconds": 2.0, "bits_per_byte": 2.5}]
LARGER = {
    16: (LARGER_BATCH_NAME, REFERENCES["byte_layers_alone"]),
    32: (LARGEST_BATCH_NAME, "global path removed, batch 32 x 256, Muon"),
}


#: every set of rows a test renders (``--report`` files, each rendered on its own)
def _long_sample_rows():
    rows = _rows(2.35)
    rows[0]["sample"] = "The state of the Union is " + " ".join(f"word{i} # - 1. > |" for i in range(30))
    return rows


REPORTS = {
    "targets 2.35": _rows(2.35),
    "long sample": _long_sample_rows(),
    "targets 2.21": _rows(2.21),
    "byte layers alone": _rows(2.21)
    + [
        _row(
            "global path removed, equal wall-clock",
            2.1,
            kind="bytes_only",
            group="byte layers equal wall-clock",
            pydoc_topics_bits_per_byte=4.4,
            steps=1200,
        ),
        _row(
            "global path removed, equal wall-clock, AdamW",
            2.2,
            kind="bytes_only",
            group="byte layers equal wall-clock, AdamW",
            steps=1250,
        ),
        _row("spider, AdamW, equal wall-clock", 2.25, group="spider equal wall-clock, AdamW", steps=600),
    ],
    "ablations": ABLATIONS,
    "ablations and seeds": ABLATIONS
    + [
        _row(DRAWN_LOOPS_NAME, 2.19, muon_lr=0.01, recipe={"muon_lr": 0.01, **DRAWN_LOOPS}),
        _row("the default run, seed 43 (seed noise)", 2.18, muon_lr=0.01, recipe={**DEFAULT_RECIPE, "seed": 43}),
    ],
    "global path pairs": _rows(2.21)
    + [
        _row("2-byte window in the byte layers", 2.34),
        _row("global path removed, 2-byte window", 2.49, kind="bytes_only"),
        _row("3-byte window in the byte layers", 2.23),
    ],  # no partner: no line
    # the rows the tables need, without curves, and an ablation's curve: no default run or baseline to draw
    "plot nothing": _rows(2.21) + [_row("n_loops=3, Muon", 2.2, curve=CURVE)],
    "plot": [
        _row("spider", 2.1, curve=CURVE),
        _row("n_loops=3, Muon", 2.2, curve=CURVE),
        _row("llama", 2.2, kind="llama", curve=CURVE),
        *_rows(2.21)[1:4:2],  # the byte layers alone and the equal-wall-clock baseline: no curves
    ],
    "local dense": _rows(2.21)
    + [
        _row(LOCAL_DENSE, 2.02, kind="llama_local", group="local baseline equal parameters"),
        _row(
            f"{LOCAL_DENSE}, equal wall-clock",
            2.12,
            kind="llama_local",
            group="local baseline equal wall-clock",
            steps=250,
            lr=2e-3,
        ),
    ],
    "byte kinds": _byte_kind_rows(),
    **{
        f"batch {b}": _rows(2.21) + [_row(spider, 2.0), _row(removed, 2.07, kind="bytes_only")]
        for b, (spider, removed) in LARGER.items()
    },
}

#: the few-step rows trained with ``--record``, by name: Spider's ``tiny`` preset (the base recipe: TINY; the 1-step
#: rows only show their optimizer or initial weights)
TINY = dict(steps=6, batch_size=2, seq_len=16, warmup_steps=1, eval_steps=0)  # no held-out evaluation
ONE_STEP = {"steps": 1, "warmup_steps": 2}  # the one step still in warmup: the rates at half their peaks
TINY_MODEL = {"preset": "tiny"}
TRAINED_ROWS = [
    {"name": "fixed", "kind": "spider", "overrides": TINY_MODEL},
    {"name": "drawn", "kind": "spider", "overrides": TINY_MODEL, "recipe": DRAWN_LOOPS},
    {"name": "(1, 3)", "kind": "spider", "overrides": TINY_MODEL, "recipe": {"loop_counts": [1, 3]}},
    {"name": "llama", "kind": "llama", "overrides": {"num_hidden_layers": 1}},
    {"name": "bytes_only", "kind": "bytes_only", "overrides": TINY_MODEL},
    {
        "name": "global path at 3x",
        "kind": "spider",
        "overrides": TINY_MODEL,
        "recipe": {**ONE_STEP, "global_lr_scale": 3.0},
    },
    # two rows for two tests each: the initial weights without Engram, and the optimizer of two other recipes
    {
        "name": "Engram off, Muon for the experts too",
        "kind": "spider",
        "overrides": {**TINY_MODEL, "engram_layer_ids": []},
        "recipe": {**ONE_STEP, "muon_experts": True},
    },
    {
        "name": "Engram off, same init, AdamW",
        "kind": "spider",
        "overrides": {**TINY_MODEL, "engram_layer_ids": []},
        "recipe": {**ONE_STEP, "same_init": True, **ADAMW},
    },
    {  # 30 steps of 4 x 16, scored on 16 held-out windows every 10 steps and by the trainer at the end
        "name": "30 steps",
        "kind": "spider",
        "overrides": TINY_MODEL,
        "steps": {"budget": 5},
        "lr": 3e-3,
        "recipe": {"batch_size": 4, "eval_every": 10, "eval_steps": 30},
    },
]


def _json_out(done) -> dict | list:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The module's four ``experiments.quality`` commands, started together: `{"plan", "unknown_row", "step_times",
    "trained"}` futures of their completed processes. ``plan``: ``--print_suite`` with :data:`STEP_TIMES`, the
    :data:`SHARDED` rows in two shards and every :data:`REPORTS` file rendered; ``trained``: ``--suite`` over
    :data:`TRAINED_ROWS` with ``--record`` (its rows in ``trained.json``)."""
    tmp = tmp_path_factory.mktemp("quality")
    for key, rows in REPORTS.items():
        (tmp / f"{key}.json").write_text(json.dumps(rows))
    rows_file = tmp / "rows.json"
    rows_file.write_text(
        json.dumps({"timing_recipes": {"default": {}}, "rows": [{"group": "t", **r} for r in TRAINED_ROWS]})
    )
    step_times = json.dumps(STEP_TIMES)
    reports = [tmp / f"{key}.json" for key in REPORTS]
    argv = {
        "plan": [
            "--print_suite",
            "--step_times",
            step_times,
            "--shard",
            "0/2",
            "--only",
            *SHARDED,
            "--report",
            *reports,
            "--render_each",
        ],
        "unknown_row": ["--suite", "--only", "no such row"],
        "step_times": ["--time_steps", "--batch_size", "1", "--recipe", '{"seq_len": 16}', "--timed_steps", "1"],
        "trained": [
            "--suite",
            "--rows",
            rows_file,
            "--step_times",
            '{"default": [1, 1, 1]}',
            "--recipe",
            json.dumps(TINY),
            "--slice_bytes",
            16 * 17,
            "--no_samples",
            "--record",
            "--out",
            tmp / "trained.json",
        ],
    }
    with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(len(argv)) as pool:
        for var in ("ACCELERATE_USE_FSDP", "MICRO_BATCH", "LR", "SEQ_LEN", "N_LOOPS", "TARGET_TOKENS"):
            env.delenv(var, raising=False)  # the main job's defaults, not this shell's (train_hf.py reads these)
        env.setenv("OMP_NUM_THREADS", "1")  # four processes side by side: one thread each
        futures = {key: pool.submit(run_module, "experiments.quality", *args) for key, args in argv.items()}
        yield {"tmp": tmp, **futures}


@pytest.fixture(scope="module")
def plan(commands):
    """``--print_suite``'s JSON, with ``runs`` by name and ``reports`` by :data:`REPORTS` key."""
    out = _json_out(commands["plan"].result())
    return {**out, "runs": {r["name"]: r for r in out["runs"]}, "reports": dict(zip(REPORTS, out["reports"]))}


@pytest.fixture(scope="module")
def trained(commands):
    """The rows of :data:`TRAINED_ROWS` as trained, by name (each with its ``record``)."""
    done = commands["trained"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in json.loads((commands["tmp"] / "trained.json").read_text())}


def _section(plan, key):
    return plan["reports"][key]["section"]


@pytest.mark.parametrize("removed_bpb, met", [(2.35, "yes"), (2.21, "**no**")])
def test_targets_are_judged_from_the_measured_numbers(plan, removed_bpb, met):
    text = _section(plan, f"targets {removed_bpb}")
    line = next(line for line in text.splitlines() if line.startswith("| the global path pays"))
    assert line.endswith(f"| {met} |") and f"{removed_bpb - 2.20:+.3f}" in line
    assert "| held-out bpb at or below the dense baseline at equal wall-clock | 2.200 vs 2.500 | yes |" in text
    assert "| technical text: no worse than the dense baseline by more than 0.05 | 4.600 vs 4.580 | yes |" in text
    assert "| 1 loop is worse than the trained count | 2.2500 vs 2.2000 | yes |" in text
    assert "| twice the trained count no worse than it by more than 0.01 | +0.0050 | yes |" in text
    assert "| samples are real words at least as often as the dense baseline's | 90% vs 80% | yes |" in text
    samples = text.split("\n\nSamples (", 1)[1].split("\n\n", 1)[0].splitlines()  # a paragraph wrapped at 119
    assert len(samples) > 1 and all(len(line) <= 119 for line in samples)
    assert " ".join(samples).endswith(
        "real words = share of the sampled words that occur in the training addresses, over 4 200-byte samples):"
    )


def test_a_long_sample_wraps_at_119_columns_and_no_line_opens_a_markdown_block(plan):
    """A sample is model output shown as inline code in a list item: it wraps at 119 columns (docs/results.md keeps its
    lines within 120), and never before a word that would open a block at the start of a line (a heading, list item,
    quote, table row), which would end the code span; the item's words stay the same, in order."""
    text = _section(plan, "long sample")
    item = text.split("\n- Spider (real words 90%): ", 1)[1].split("\n- Llama", 1)[0].splitlines()
    assert len(item) > 1 and all(len(line) <= 119 for line in item)
    assert all(line.startswith("  ") and line[2:].split()[0].startswith(("word", "`")) for line in item[1:]), item
    sample = " ".join(REPORTS["long sample"][0]["sample"][:160].split())
    assert " ".join(line.strip() for line in item) == f"`{sample}`"


def test_byte_layers_alone_train_for_spiders_wall_clock_and_are_rendered(plan):
    """The plain model with Spider's local attention at equal compute: its step count comes from both step times
    under each recipe, and its row stands in the first table beside the dense baselines."""
    runs = plan["runs"]
    equal = runs["global path removed, equal wall-clock"]
    assert (equal["kind"], equal["steps"], equal["overrides"], equal.get("recipe")) == ("bytes_only", 1200, {}, {})
    assert runs["llama lr=0.001, equal wall-clock"]["steps"] == 250
    assert runs["llama lr=0.002, equal wall-clock"]["recipe"] == {"muon_lr": pytest.approx(0.02)}
    adamw = runs["global path removed, equal wall-clock, AdamW"]
    assert (adamw["steps"], adamw["recipe"]) == (1250, {**BATCH8_RECIPE, "muon_lr": None})
    assert runs["llama lr=0.001, equal wall-clock, AdamW"]["steps"] == 200
    assert runs["spider"].get("recipe") is None and runs["n_loops=1"]["recipe"] == {**BATCH8_RECIPE, **ADAMW}
    optimizer_at_equal_time = runs["spider, AdamW, equal wall-clock"]  # AdamW for as long as the Muon run takes
    assert (optimizer_at_equal_time["steps"], optimizer_at_equal_time["recipe"]) == (600, {**BATCH8_RECIPE, **ADAMW})
    table = _section(plan, "byte layers alone").split("\n\n")[0]
    assert (
        "| Spider's byte layers alone (global path removed), equal wall-clock | Muon (lr 0.01) + AdamW | 1200 | "
        "6.00M | 2.100 | 4.400 |"
    ) in table
    assert (
        "| Spider's byte layers alone (global path removed), equal wall-clock | AdamW, batch 8 x 256 | 1250 | 6.00M | "
        "2.200 | - |"
    ) in table
    assert (
        "| Spider `small`, for the default run's wall-clock | AdamW, batch 8 x 256 | 600 | 6.00M | 2.250 | - |"
        in table
    )


def test_ablations_compare_with_the_default_of_their_own_recipe(plan):
    """AdamW rows are measured against the AdamW default run, Muon rows of the batch-8 recipe (and the AdamW default
    itself) against that recipe's default run, rows of today's recipe and the batch-8 default against the default
    run."""
    text = _section(plan, "ablations")
    assert f"| {REFERENCES['adamw_default']} | 2.300 | +0.060 |" in text  # the optimizer alone: same segmentation
    assert "| n_loops=1 | 2.350 | +0.050 |" in text  # AdamW rows: the AdamW default
    assert "| Muon at lr 0.02 | 2.250 | +0.010 |" in text  # end-to-end boundaries: that default under Muon
    assert f"| {REFERENCES['end_to_end_default']} | 2.240 | +0.030 |" in text  # against the batch-8 default run
    assert "| segments: a fixed stride of 6 bytes instead of the teacher's | 2.230 | +0.020 |" in text
    assert f"| {REFERENCES['batch8_default']} | 2.210 | +0.010 |" in text  # the old default against today's
    text = _section(plan, "ablations and seeds")
    assert f"| {DRAWN_LOOPS_NAME} | 2.190 | -0.020 |" in text  # against the batch-8 default run
    assert "| the default run, seed 43 (seed noise) | 2.180 | -0.020 |" in text  # against the default run
    # a rerun reproduces the stored rows: the AdamW and longer-budget Spider rows run with end-to-end boundaries and
    # the gated mixing of their day
    runs = plan["runs"]
    then = {**END_TO_END_SEGMENTS, **GATED_MIXING}
    assert runs["n_loops=1"]["overrides"] == {**then, "n_loops": 1}
    assert runs["segments of about 5 bytes (boundary_prior 0.2)"]["overrides"]["boundary_prior"] == 0.2
    assert runs["spider, 4x the steps"]["overrides"] == then
    assert runs["Muon at lr 0.02"]["overrides"] == runs[REFERENCES["end_to_end_default"]]["overrides"] == then
    assert runs["global path removed, 4x the steps"]["overrides"] == {}
    assert runs["spider"]["overrides"] == {} and runs["the default run, seed 43 (seed noise)"]["overrides"] == {}
    assert runs[GATED_DEFAULT]["overrides"] == GATED_MIXING
    # the default run trains with a fixed loop count; only the rows that name the draw draw
    assert plan["recipe"]["extra_train_loops"] == 0
    drawn_rows = {name for name, r in runs.items() if r["trained"]["extra_train_loops"]}
    assert drawn_rows == {
        DRAWN_LOOPS_NAME,
        f"{DRAWN_LOOPS_NAME}, seed 43",
        f"{DRAWN_LOOPS_NAME}, the default run's recipe",
        "the default run, 4x the steps, loop count drawn from {2, 3}",
        "the default run, 4x the steps, loop count drawn from {2, 3}, seed 43",
    }
    # ... and the gated mixing is not the default any more: the rows that name it differ from the default run
    assert SpiderConfig.from_preset("small").expand_mixing != GATED_MIXING["expand_mixing"]


def test_shards_keep_the_baselines_together_and_balance_the_rest(plan):
    shards, runs, cost_per_run = plan["shards"], plan["runs"], plan["cost_per_run"]
    assert sorted(name for s in shards for name in s) == sorted(SHARDED)
    assert all(runs[name]["kind"] != "llama" for name in shards[0])
    cost = [
        sum(
            cost_per_run[runs[n]["kind"]]
            * (runs[n]["steps"] if runs[n]["kind"] in plan["dense_kinds"] else runs[n]["steps"] / 500)
            for n in s
        )
        for s in shards
    ]
    assert max(cost) - min(cost) <= cost_per_run["spider"]  # within one run of each other


def test_global_path_table_pairs_each_spider_row_with_its_ablation(plan):
    text = _section(plan, "global path pairs")
    assert "| 2-byte window | 500 | 2.340 | 2.490 | +0.150 |" in text
    assert (
        "| 4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256 (the "
        "default run) | 500 | 2.200 | 2.210 | +0.010 |"
    ) in text
    assert "| 3-byte window |" not in text


def _parameters(row):
    return row["record"]["optimizer"]["parameters"]


def test_global_lr_scale_multiplies_only_the_global_path(plan, trained):
    """`Recipe.global_lr_scale` reaches the trainer as per-parameter learning rates (SpiderTrainer's `lr_scale_of`):
    the global path's parameters at 3x in both optimizers, the byte layers at 1x, weight decay as without it."""
    from modeling_spider import SpiderForConditionalGeneration

    scaled = trained["global path at 3x"]["record"]
    assert scaled["optimizer"]["type"] == "MuonWithAdamW"
    before, after = _parameters(trained["fixed"]), scaled["optimizer"]["parameters"]
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny"))
    assert set(before) == set(after) == {n for n, _ in model.named_parameters()}
    byte_layers = tuple(plan["byte_layers"])
    for name, group in after.items():
        factor = 1.0 if name.startswith(byte_layers) else 3.0
        assert group["initial_lr"] == pytest.approx(factor * before[name]["initial_lr"]), name
        assert group["weight_decay"] == before[name]["weight_decay"], name
    assert after["model.recurrent_block.layers.0.mlp.router.weight"]["initial_lr"] == pytest.approx(3e-3)  # AdamW's
    assert after["model.prelude_layers.0.mlp.up_proj.weight"]["initial_lr"] == pytest.approx(DEFAULT_MUON_LR)  # Muon's
    q_a = after["model.recurrent_block.layers.0.self_attn.q_a_proj.weight"]
    assert q_a["initial_lr"] == pytest.approx(3 * DEFAULT_MUON_LR)
    # the schedule scales every group alike: after one step every parameter's rate is the same share of its peak
    shares = {g["lr_after_step_1"] / g["initial_lr"] for g in after.values()}
    assert max(shares) == pytest.approx(min(shares)) == 0.5


@pytest.mark.parametrize("muon_experts", [False, True])
def test_rows_train_with_the_main_jobs_optimizer(plan, trained, muon_experts):
    """A row's optimizer is the trainer's (spider_training.optim.muon_with_adamw, as train_hf.py's): Muon at the
    recipe's rate for the hidden matrices (the routed experts' only with `muon_experts`), AdamW at `lr` for the rest;
    `muon_lr=None` is Trainer's AdamW for every parameter. A dense baseline gets the same split."""
    row = trained["Engram off, Muon for the experts too" if muon_experts else "fixed"]
    assert row["record"]["optimizer"]["type"] == "MuonWithAdamW"
    parameters = _parameters(row)
    in_muon = {n for n, g in parameters.items() if g["optimizer"] == "muon"}
    assert {g["initial_lr"] for g in parameters.values() if g["optimizer"] == "muon"} == {DEFAULT_MUON_LR}
    assert {g["initial_lr"] for g in parameters.values() if g["optimizer"] == "adamw"} == {plan["recipe"]["lr"]}
    experts = {n for n in parameters if ".mlp.experts." in n}
    assert experts and (experts <= in_muon) == muon_experts and not (experts & in_muon and not muon_experts)
    assert "model.prelude_layers.0.self_attn.q_a_proj.weight" in in_muon and "lm_head.weight" not in in_muon
    adamw = trained["Engram off, same init, AdamW"]["record"]["optimizer"]
    assert adamw["type"] == "AdamW"
    assert {tuple(g["betas"]) for g in adamw["parameters"].values()} == {tuple(plan["recipe"]["betas"])}
    dense = _parameters(trained["llama"])
    assert {n for n, g in dense.items() if g["optimizer"] == "muon"} == {
        n for n, g in dense.items() if n.startswith("model.layers.0.") and len(g["shape"]) == 2
    }


def test_loop_counts_draw_each_steps_loop_count_without_changing_the_data(trained):
    """`Recipe.extra_train_loops` (n_loops or one more) and `Recipe.loop_counts` (a given set): the trainer draws
    every training step's loop count (SpiderTrainer's `extra_train_loops`, `train_loop_counts`), and the batches are
    the fixed-count run's."""
    seen = {key: trained[key]["record"]["steps"] for key in ("fixed", "drawn", "(1, 3)")}
    assert [n for n, _ in seen["fixed"]] == [None] * TINY["steps"]
    n = SpiderConfig.from_preset("tiny").n_loops
    for key, allowed in (("drawn", {n, n + 1}), ("(1, 3)", {1, 3})):
        drawn = [n for n, _ in seen[key]]
        assert set(drawn) == allowed, key
        assert [batch for _, batch in seen["fixed"]] == [batch for _, batch in seen[key]]


def test_a_row_trains_through_spider_trainer_and_its_loss_falls(trained):
    """experiments.quality has no training loop of its own: a row is SpiderTrainer.train (train_hf.py's), its held-out
    figure the trainer's evaluation, its training loss the trainer's logs, and the loss falls."""
    row = trained["30 steps"]
    record = row["record"]
    assert record["trainer"] == "SpiderTrainer" and record["train_calls"] == 1
    assert len(record["steps"]) == 30  # the row's own model took every training step
    history = record["log_history"]
    losses = [e["bits_per_byte"] for e in history if "loss" in e and "bits_per_byte" in e]
    assert losses[-1] < losses[0] - 0.5, losses
    assert row["train_bits_per_byte"] == pytest.approx(sum(losses[-3:]) / 3)  # the last tenth: logged every step
    assert row["eval_bits_per_byte"] == next(
        e["eval_bits_per_byte"] for e in reversed(history) if "eval_bits_per_byte" in e
    )
    curve = row["curve"]
    assert [c["step"] for c in curve] == [10, 20, 30] and curve[-1]["bits_per_byte"] < record["bits_per_byte_before"]
    assert 0 < curve[0]["seconds"] < curve[-1]["seconds"] == row["train_seconds"]


def test_dense_rows_train_on_the_same_windows_as_spiders(trained):
    """Equal data: the dense baseline and the byte layers alone see the batches Spider's row sees, in order (Spider
    is scored on the main job's held-out windows before and after training; they are not)."""
    batches = {
        kind: [ids for _, ids in trained[name]["record"]["steps"]]
        for kind, name in (("spider", "fixed"), ("llama", "llama"), ("bytes_only", "bytes_only"))
    }
    assert len(batches["spider"]) == TINY["steps"]
    for kind in ("llama", "bytes_only"):
        assert batches[kind] == batches["spider"], kind


def test_suite_rows_can_be_chosen_by_name(commands):
    done = commands["unknown_row"].result()
    assert done.returncode != 0 and "ValueError" in done.stderr and "no such row" in done.stderr


def test_step_times_given_to_the_suite_set_the_equal_wall_clock_steps(plan):
    """Shards started side by side share one step-time measurement (`--step_times`) instead of each timing the
    models while the others train: every run carries the given times (nothing was measured), and the
    equal-wall-clock rows train for the steps they give."""
    runs = plan["runs"]
    given = [dict(zip(("spider", "llama", "bytes_only"), times)) for times in STEP_TIMES.values()]
    assert all(r["step_seconds"] in given for r in runs.values())
    trained = [
        (name, runs[name]["trained"]["steps"], runs[name]["trained"]["muon_lr"])
        for name in ("global path removed, equal wall-clock", "spider, AdamW, equal wall-clock")
    ]
    assert trained == [
        ("global path removed, equal wall-clock", 1200, DEFAULT_MUON_LR),  # 500 x 0.6 / 0.25
        ("spider, AdamW, equal wall-clock", 600, None),  # 500 x 0.6 / 0.5
    ]


def test_step_split_times_the_forward_backward_and_the_optimizer_apart(commands):
    out = _json_out(commands["step_times"].result())
    assert set(out["seconds_per_step"]) == {"spider", "llama", "bytes_only"}
    for kind, split in out["seconds_per_step"].items():
        assert set(split) == {"step", "forward_backward", "optimizer"}, kind
        assert split["forward_backward"] > 0 and split["optimizer"] > 0, kind
        # one timed step: the two parts are the step's two intervals
        assert split["step"] == pytest.approx(split["forward_backward"] + split["optimizer"], rel=1e-9), kind


def test_plot_draws_the_default_runs_and_their_baselines_only(plan, commands):
    pytest.importorskip("matplotlib")
    tmp = commands["tmp"]
    # no default run or baseline: nothing to draw
    assert plan["reports"]["plot nothing"]["plot_labels"] == [] and not (tmp / "plot nothing.png").exists()
    assert (tmp / "plot.png").stat().st_size > 0
    assert plan["reports"]["plot"]["plot_labels"] == [
        "Spider small (the default run), batch 16, Muon + AdamW",
        "LlamaForCausalLM (equal parameters), batch 16, Muon + AdamW",
    ]


def test_same_init_gives_a_variant_the_default_models_initial_weights(trained):
    """Removing Engram shifts the random stream for every later parameter (another seed for the byte layers);
    with same_init the shared parameters start from the default model's values, and only they."""
    default = trained["fixed"]["record"]["initial_parameters"]
    shifted = trained["Engram off, Muon for the experts too"]["record"]["initial_parameters"]
    same = trained["Engram off, same init, AdamW"]["record"]["initial_parameters"]
    assert shifted["lm_head.weight"] != default["lm_head.weight"]
    assert set(same) < set(default)
    for name, digest in same.items():
        assert digest == default[name], name


def test_dense_baseline_with_spiders_local_attention(plan):
    """The stronger plain baseline: the dense Llama with Spider's 4-byte byte-layer window. Its window is real (a
    prediction far enough from a byte cannot depend on it: 7 layers x 3 bytes back), it runs at equal parameters and
    at the Llama's equal-wall-clock step count, stays in the baselines' shard, and is rendered beside them."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig.from_dict({**plan["model_configs"]["llama_local"], "num_hidden_layers": 2})
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    reach = 2 * (4 - 1)  # two layers, each 3 bytes further back than the byte itself
    assert torch.equal(a[0, reach + 1 :], b[0, reach + 1 :])  # beyond the receptive field: bit-identical
    assert not torch.allclose(a[0, : reach + 1], b[0, : reach + 1])  # inside it: the byte matters
    runs = plan["runs"]
    equal, timed = runs[LOCAL_DENSE], runs[f"{LOCAL_DENSE}, equal wall-clock"]
    assert (equal["kind"], equal["steps"], timed["steps"]) == ("llama_local", 500, 250)
    assert timed["recipe"] == {"muon_lr": pytest.approx(2 * DEFAULT_MUON_LR)}
    assert {LOCAL_DENSE, f"{LOCAL_DENSE}, equal wall-clock", "llama"} <= set(plan["shards"][-1])
    table = _section(plan, "local dense").split("\n\n")[0]
    assert "4-byte local attention (`MistralForCausalLM`), equal parameters and steps (lr 0.001) |" in table
    assert "equal wall-clock (lr 0.002) | Muon (lr 0.01) + AdamW | 250 | 6.00M | 2.120 |" in table


def test_gain_by_byte_kind_table_is_rendered_from_the_rows(plan):
    text = _section(plan, "byte kinds")
    assert "| 1st byte of a word | 16.7% | 4.000 | 4.250 | +0.250 |" in text
    assert "| **every byte** | 100.0% | 2.200 | 2.210 | +0.010 |" in text
    assert "| removed | +0.100 | +0.500 |" in text


@pytest.mark.parametrize("batch_size", [16, 32])
def test_larger_batch_pairs_train_both_models_with_more_bytes_per_step(plan, batch_size):
    spider_name, removed_name = LARGER[batch_size]
    spider, removed = plan["runs"][spider_name], plan["runs"][removed_name]
    assert (spider["kind"], spider["overrides"], spider["steps"]) == ("spider", {}, plan["recipe"]["steps"])
    assert spider["trained"]["batch_size"] == removed["trained"]["batch_size"] == batch_size
    assert spider["trained"]["muon_lr"] == DEFAULT_MUON_LR and spider["trained"]["muon_experts"]  # Muon everywhere
    assert removed["kind"] == "bytes_only"  # (no experts: the default run's split leaves it on the same optimizers)
    label = f"4-byte window, Muon, the teacher's word segments, batch {batch_size} x 256"
    assert f"| {label} | 500 | 2.000 | 2.070 | +0.070 |" in _section(plan, f"batch {batch_size}")


def test_the_recipe_is_train_hf_defaults(plan, monkeypatch):
    """The benchmark's default run is `train_hf.py` with no arguments: the same steps, batch, learning rates,
    schedule, clipping, seed and optimizer split."""
    from spider_training.arguments import parse_args

    for var in ("ACCELERATE_USE_FSDP", "MICRO_BATCH", "LR", "SEQ_LEN", "N_LOOPS", "TARGET_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    args = parse_args([])
    recipe = plan["recipe"]
    assert (args.max_steps, args.per_device_train_batch_size, args.seq_len) == (
        recipe["steps"],
        recipe["batch_size"],
        recipe["seq_len"],
    )
    assert (args.learning_rate, args.weight_decay, [args.adam_beta1, args.adam_beta2], args.max_grad_norm) == (
        recipe["lr"],
        recipe["weight_decay"],
        recipe["betas"],
        recipe["max_grad_norm"],
    )
    assert (args.warmup_steps, args.lr_scheduler_kwargs["min_lr_rate"], args.seed) == (
        recipe["warmup_steps"],
        recipe["min_lr_rate"],
        recipe["seed"],
    )
    assert (args.muon_lr, args.muon_experts, args.extra_train_loops) == (
        recipe["muon_lr"],
        recipe["muon_experts"],
        recipe["extra_train_loops"],
    )
    # ... and the arguments a row trains with are train_hf.py's, parsed by its parser: only the output folder,
    # checkpointing, progress bar and logging interval (every 10 steps either way here) differ
    mine, main_job = plan["training_arguments"], json.loads(json.dumps(args.to_dict(), default=str))
    differ = {"output_dir", "logging_dir", "save_strategy", "disable_tqdm", "logging_steps"}
    assert {k for k in mine if mine[k] != main_job.get(k)} <= differ
    assert (mine["logging_steps"], args.logging_steps) == (10, 10)
