"""bench.quality: its rows (bench/quality_rows.json) and their recipes, training through train_hf.py's trainer (a
few-step row of each kind, the recipe against train_hf.py's defaults, the optimizer, loop-count draws and data the
trainer gets), the scoring (bench/quality_scoring.py) and the tables and targets rendered from rows
(bench/quality_report.py). The suite's full training runs are the benchmark itself."""

import math
import os
import re

import pytest
import torch

from bench import quality, quality_report, quality_scoring
from configuration_spider import SpiderConfig
from spider_training.optim import DEFAULT_MUON_LR
from tests.helpers import tiny_model

SUITE = quality.suite()
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


@pytest.mark.parametrize("removed_bpb, met", [(2.35, "yes"), (2.21, "**no**")])
def test_targets_are_judged_from_the_measured_numbers(removed_bpb, met):
    text = quality_report.render(_rows(removed_bpb))
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


def test_a_long_sample_wraps_at_119_columns_and_no_line_opens_a_markdown_block():
    """A sample is model output shown as inline code in a list item: it wraps at 119 columns (docs/results.md keeps its
    lines within 120), and never before a word that would open a block at the start of a line (a heading, list item,
    quote, table row), which would end the code span; the item's words stay the same, in order."""
    rows = _rows(2.35)
    rows[0]["sample"] = "The state of the Union is " + " ".join(f"word{i} # - 1. > |" for i in range(30))
    text = quality_report.render(rows)
    item = text.split("\n- Spider (real words 90%): ", 1)[1].split("\n- Llama", 1)[0].splitlines()
    assert len(item) > 1 and all(len(line) <= 119 for line in item)
    assert all(line.startswith("  ") and line[2:].split()[0].startswith(("word", "`")) for line in item[1:]), item
    sample = " ".join(rows[0]["sample"][:160].split())
    assert " ".join(line.strip() for line in item) == f"`{sample}`"


def test_byte_layers_alone_train_for_spiders_wall_clock_and_are_rendered():
    """The plain model with Spider's local attention at equal compute: its step count comes from both step times
    under each recipe, and its row stands in the first table beside the dense baselines."""
    runs = {
        r["name"]: r
        for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25), adamw_step_times=(0.5, 1.25, 0.2))
    }
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
    rows = _rows(2.21) + [
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
    ]
    table = quality_report.render(rows).split("\n\n")[0]
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


def test_ablations_compare_with_the_default_of_their_own_recipe():
    """AdamW rows are measured against the AdamW default run, Muon rows of the batch-8 recipe (and the AdamW default
    itself) against that recipe's default run, rows of today's recipe and the batch-8 default against the default
    run."""
    old = dict(overrides=END_TO_END_SEGMENTS, muon_lr=0.01)
    rows = _rows(2.21) + [
        _row(REFERENCES["batch8_default"], 2.21, muon_lr=0.01, recipe={**BATCH8_RECIPE, "muon_lr": 0.01}),
        _row(REFERENCES["adamw_default"], 2.30),
        _row("n_loops=1", 2.35),
        _row(REFERENCES["end_to_end_default"], 2.24, **old),
        _row("Muon at lr 0.02", 2.25, **{**old, "muon_lr": 0.02}),
        _row("segments: a fixed stride of 6 bytes instead of the teacher's", 2.23, muon_lr=0.01),
    ]
    text = quality_report.render(rows)
    assert f"| {REFERENCES['adamw_default']} | 2.300 | +0.060 |" in text  # the optimizer alone: same segmentation
    assert "| n_loops=1 | 2.350 | +0.050 |" in text  # AdamW rows: the AdamW default
    assert "| Muon at lr 0.02 | 2.250 | +0.010 |" in text  # end-to-end boundaries: that default under Muon
    assert f"| {REFERENCES['end_to_end_default']} | 2.240 | +0.030 |" in text  # against the batch-8 default run
    assert "| segments: a fixed stride of 6 bytes instead of the teacher's | 2.230 | +0.020 |" in text
    assert f"| {REFERENCES['batch8_default']} | 2.210 | +0.010 |" in text  # the old default against today's
    drawn = dict(muon_lr=0.01, recipe={"muon_lr": 0.01, **DRAWN_LOOPS})
    seed = dict(muon_lr=0.01, recipe={**DEFAULT_RECIPE, "seed": 43})
    text = quality_report.render(
        rows + [_row(DRAWN_LOOPS_NAME, 2.19, **drawn), _row("the default run, seed 43 (seed noise)", 2.18, **seed)]
    )
    assert f"| {DRAWN_LOOPS_NAME} | 2.190 | -0.020 |" in text  # against the batch-8 default run
    assert "| the default run, seed 43 (seed noise) | 2.180 | -0.020 |" in text  # against the default run
    # a rerun reproduces the stored rows: the AdamW and longer-budget Spider rows run with end-to-end boundaries and
    # the gated mixing of their day
    runs = {
        r["name"]: r
        for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25), adamw_step_times=(0.5, 1.25, 0.2))
    }
    then = {**END_TO_END_SEGMENTS, **GATED_MIXING}
    assert runs["n_loops=1"]["overrides"] == {**then, "n_loops": 1}
    assert runs["segments of about 5 bytes (boundary_prior 0.2)"]["overrides"]["boundary_prior"] == 0.2
    assert runs["spider, 4x the steps"]["overrides"] == then
    assert runs["Muon at lr 0.02"]["overrides"] == runs[REFERENCES["end_to_end_default"]]["overrides"] == then
    assert runs["global path removed, 4x the steps"]["overrides"] == {}
    assert runs["spider"]["overrides"] == {} and runs["the default run, seed 43 (seed noise)"]["overrides"] == {}
    assert runs[GATED_DEFAULT]["overrides"] == GATED_MIXING
    # the default run trains with a fixed loop count; only the rows that name the draw draw
    assert quality.Recipe().extra_train_loops == 0
    drawn_rows = {name for name, r in runs.items() if (r.get("recipe") or {}).get("extra_train_loops")}
    assert drawn_rows == {
        DRAWN_LOOPS_NAME,
        f"{DRAWN_LOOPS_NAME}, seed 43",
        f"{DRAWN_LOOPS_NAME}, the default run's recipe",
        "the default run, 4x the steps, loop count drawn from {2, 3}",
        "the default run, 4x the steps, loop count drawn from {2, 3}, seed 43",
    }
    # ... and the gated mixing is not the default any more: the rows that name it differ from the default run
    assert SpiderConfig.from_preset("small").expand_mixing != GATED_MIXING["expand_mixing"]


def test_shards_keep_the_baselines_together_and_balance_the_rest():
    runs = [dict(kind=r["kind"], name=r["name"], steps=500) for r in SUITE["rows"] if r["group"] == "ablation"]
    runs += [dict(kind="llama", name=f"llama {i}", steps=250) for i in range(3)]
    shards = [quality.shard_of(runs, i, 2) for i in range(2)]
    assert sorted(r["name"] for s in shards for r in s) == sorted(r["name"] for r in runs)
    assert all(r["kind"] != "llama" for r in shards[0])
    cost = [
        sum(quality._COST[r["kind"]] * (r["steps"] if r["kind"] == "llama" else r["steps"] / 500) for r in s)
        for s in shards
    ]
    assert max(cost) - min(cost) <= quality._COST["spider"]  # within one run of each other


def test_evaluation_boundary_rules_change_only_the_decision_and_are_undone():
    model = tiny_model(seed=0).eval()
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    plain = quality_scoring.score(model, ids)
    matched = quality_scoring.score_with_boundary_rule(model, ids, "rate-matched", 5.0)
    assert matched["bytes_per_segment"] == pytest.approx(5.0, rel=0.25)  # the requested rate, up to quantile ties
    sampled = quality_scoring.score_with_boundary_rule(model, ids, "sampled", None)
    assert math.isfinite(sampled["bits_per_byte"])
    assert quality_scoring.score(model, ids) == plain  # the predictor's own forward is back


def test_sample_words_counts_words_of_the_training_text():
    model = tiny_model(seed=0)
    train_ids = torch.tensor(list(b"the state of the union is strong ")).numpy()
    result = quality_scoring.sample_words(model, train_ids, n_samples=1, new_bytes=40)
    assert result["sample"].startswith(quality_scoring.SAMPLE_PROMPT)
    words = re.findall(r"[A-Za-z]+", result["sample"][len(quality_scoring.SAMPLE_PROMPT) :])
    vocabulary = {"the", "state", "of", "union", "is", "strong"}
    expected = sum(w.lower() in vocabulary for w in words) / max(1, len(words))
    assert result["real_word_rate"] == pytest.approx(expected)


def test_global_path_table_pairs_each_spider_row_with_its_ablation():
    rows = _rows(2.21) + [
        _row("2-byte window in the byte layers", 2.34),
        _row("global path removed, 2-byte window", 2.49, kind="bytes_only"),
        _row("3-byte window in the byte layers", 2.23),
    ]  # no partner: no line
    text = quality_report.render(rows)
    assert "| 2-byte window | 500 | 2.340 | 2.490 | +0.150 |" in text
    assert (
        "| 4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256 (the "
        "default run) | 500 | 2.200 | 2.210 | +0.010 |"
    ) in text
    assert "| 3-byte window |" not in text


def _trainer_of(model, recipe, **fit_kwargs):
    """The SpiderTrainer :func:`bench.quality.fit` builds for `model` and `recipe`, set up but not trained."""
    from spider_training.train import build_trainer

    args = quality.training_arguments(recipe, "/nonexistent-not-written", evaluate=False)
    trainer = build_trainer(args, model, stop_signals=(), eval_dataset=None, **fit_kwargs)
    trainer.create_optimizer()
    return trainer


def test_global_lr_scale_multiplies_only_the_global_path():
    """`Recipe.global_lr_scale` reaches the trainer as per-parameter learning rates (SpiderTrainer's `lr_scale_of`):
    the global path's parameters at 3x in both optimizers, the byte layers at 1x, weight decay as without it."""
    from spider_training.optim import MuonWithAdamW

    model = tiny_model(seed=0)
    scale = {"lr_scale_of": lambda name: 1.0 if name.startswith(quality.BYTE_LAYERS) else 3.0}
    plain, scaled = _trainer_of(tiny_model(seed=0), quality.Recipe()), _trainer_of(model, quality.Recipe(), **scale)
    assert isinstance(scaled.optimizer, MuonWithAdamW)

    def rates(trainer, model):
        named = {id(p): n for n, p in model.named_parameters()}
        return {
            named[id(p)]: (g["lr"], g["weight_decay"]) for g in trainer.optimizer.param_groups for p in g["params"]
        }

    before, after = rates(plain, plain.model), rates(scaled, model)
    assert set(before) == set(after) == {n for n, _ in model.named_parameters()}
    for name, (lr, decay) in after.items():
        factor = 1.0 if name.startswith(quality.BYTE_LAYERS) else 3.0
        assert lr == pytest.approx(factor * before[name][0]) and decay == before[name][1], name
    assert after["model.recurrent_block.layers.0.mlp.router.weight"][0] == pytest.approx(3e-3)  # AdamW's half
    assert after["model.prelude_layers.0.mlp.up_proj.weight"][0] == pytest.approx(DEFAULT_MUON_LR)  # Muon's
    assert after["model.recurrent_block.layers.0.self_attn.q_a_proj.weight"][0] == pytest.approx(3 * DEFAULT_MUON_LR)
    peaks = [g["lr"] for g in scaled.optimizer.param_groups]
    scaled.create_scheduler(num_training_steps=10, optimizer=scaled.optimizer)  # the schedule scales every group alike
    assert [g["initial_lr"] for g in scaled.optimizer.param_groups] == peaks


@pytest.mark.parametrize("muon_experts", [False, True])
def test_rows_train_with_the_main_jobs_optimizer(muon_experts):
    """A row's optimizer is the trainer's (spider_training.optim.muon_with_adamw, as train_hf.py's): Muon at the
    recipe's rate for the hidden matrices (the routed experts' only with `muon_experts`), AdamW at `lr` for the rest;
    `muon_lr=None` is Trainer's AdamW for every parameter. A dense baseline gets the same split."""
    from spider_training.optim import MuonWithAdamW

    model = tiny_model(seed=0)
    optimizer = _trainer_of(model, quality.Recipe(muon_experts=muon_experts)).optimizer
    assert isinstance(optimizer, MuonWithAdamW)
    named = {id(p): n for n, p in model.named_parameters()}
    in_muon = {named[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    assert {g["lr"] for g in optimizer.muon.param_groups} == {DEFAULT_MUON_LR}
    assert {g["lr"] for g in optimizer.adamw.param_groups} == {quality.Recipe.lr}
    experts = {n for n in named.values() if ".mlp.experts." in n}
    assert experts and (experts <= in_muon) == muon_experts and not (experts & in_muon and not muon_experts)
    assert "model.prelude_layers.0.self_attn.q_a_proj.weight" in in_muon and "lm_head.weight" not in in_muon
    adamw = _trainer_of(tiny_model(seed=0), quality.Recipe(muon_lr=None)).optimizer
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == quality.Recipe.betas
    dense = quality.build("llama", {"num_hidden_layers": 1})
    dense_muon = _trainer_of(dense, quality.Recipe()).optimizer.muon
    names = {id(p): n for n, p in dense.named_parameters()}
    assert {names[id(p)] for g in dense_muon.param_groups for p in g["params"]} == {
        n for n, p in dense.named_parameters() if n.startswith("model.layers.0.") and p.dim() == 2
    }


def _spy_forward(model, calls):
    forward = model.forward

    def spy(*args, **kwargs):  # the real forward, recording what the trainer passed in training
        if model.training:
            calls.append((kwargs.get("n_loops"), kwargs["input_ids"].clone()))
        return forward(*args, **kwargs)

    model.forward = spy


TINY = dict(steps=6, batch_size=2, seq_len=16, warmup_steps=1, eval_steps=0)  # no held-out evaluation


def test_loop_counts_draw_each_steps_loop_count_without_changing_the_data():
    """`Recipe.extra_train_loops` (n_loops or one more) and `Recipe.loop_counts` (a given set): the trainer draws
    every training step's loop count (SpiderTrainer's `extra_train_loops`, `train_loop_counts`), and the batches are
    the fixed-count run's."""
    seen = {}
    variants = {"fixed": {}, "drawn": dict(extra_train_loops=1), (1, 3): dict(loop_counts=(1, 3))}
    for key, recipe in variants.items():
        model, calls = tiny_model(seed=0), []
        _spy_forward(model, calls)
        quality.fit(model, quality.Recipe(**TINY, **recipe))
        seen[key] = calls
    assert [n for n, _ in seen["fixed"]] == [None] * 6
    n = tiny_model(seed=0).config.n_loops
    for key, allowed in (("drawn", {n, n + 1}), ((1, 3), {1, 3})):
        drawn = [n for n, _ in seen[key]]
        assert set(drawn) == allowed, key
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen["fixed"], seen[key]))


def test_a_row_trains_through_spider_trainer_and_its_loss_falls(monkeypatch):
    """bench.quality has no training loop of its own: a row is SpiderTrainer.train (train_hf.py's), its held-out
    figure the trainer's evaluation, its training loss the trainer's logs, and the loss falls."""
    from spider_training.trainer import SpiderTrainer

    trained = []
    train = SpiderTrainer.train
    monkeypatch.setattr(SpiderTrainer, "train", lambda self, *a, **k: trained.append(self) or train(self, *a, **k))
    model = tiny_model(seed=0)
    windows = quality_scoring.heldout_windows(quality_scoring.corpus_bytes("eval"), 16, slice_bytes=16 * 17)
    before = quality_scoring.score(model, windows)["bits_per_byte"]
    stats = quality.fit(
        model,
        quality.Recipe(steps=30, batch_size=4, seq_len=16, warmup_steps=3, lr=3e-3, eval_every=10, eval_steps=30),
        windows,
    )
    assert len(trained) == 1 and trained[0].model is model
    history = trained[0].state.log_history
    losses = [e["bits_per_byte"] for e in history if "loss" in e and "bits_per_byte" in e]
    assert losses[-1] < losses[0] - 0.5, losses
    assert stats["train_bits_per_byte"] == pytest.approx(sum(losses[-3:]) / 3)  # the last tenth: logged every step
    assert stats["eval_bits_per_byte"] == next(
        e["eval_bits_per_byte"] for e in reversed(history) if "eval_bits_per_byte" in e
    )
    assert [c["step"] for c in stats["curve"]] == [10, 20, 30] and stats["curve"][-1]["bits_per_byte"] < before
    assert 0 < stats["curve"][0]["seconds"] < stats["curve"][-1]["seconds"] == stats["train_seconds"]


def test_dense_rows_train_on_the_same_windows_as_spiders():
    """Equal data: the dense baseline and the byte layers alone see the batches Spider's row sees, in order (Spider
    is scored on the main job's held-out windows before and after training; they are not)."""
    batches = {}
    for kind in ("spider", "llama", "bytes_only"):
        model, calls = quality.initial_model(kind, {"num_hidden_layers": 1} if kind == "llama" else {}, seed=0), []
        if kind == "spider":
            model = tiny_model(seed=0)
        _spy_forward(model, calls)
        quality.fit(model, quality.Recipe(**{**TINY, "steps": 3, "eval_steps": 3}))
        batches[kind] = [ids for _, ids in calls]
    assert len(batches["spider"]) == 3
    for kind in ("llama", "bytes_only"):
        assert all(torch.equal(a, b) for a, b in zip(batches["spider"], batches[kind], strict=True)), kind


def test_suite_rows_can_be_chosen_by_name(monkeypatch):
    with pytest.raises(ValueError, match="no such row"):
        quality.run_suite(only=["no such row"])


def test_step_times_given_to_the_suite_set_the_equal_wall_clock_steps(monkeypatch):
    """Shards started side by side share one step-time measurement (`--step_times`) instead of each timing the
    models while the others train; nothing is timed then."""
    monkeypatch.setattr(quality, "step_seconds", lambda *a, **k: pytest.fail("timed although times were given"))
    trained = []
    monkeypatch.setattr(
        quality,
        "train_and_score",
        lambda kind, name, overrides, recipe, *a, **k: (
            trained.append((name, recipe.steps, recipe.muon_lr)) or {"name": name}
        ),
    )
    quality.run_suite(
        only=["global path removed, equal wall-clock", "spider, AdamW, equal wall-clock"],
        step_times={"default": (0.8, 1.6, 0.4), "adamw": (0.5, 1.0, 0.25)},
        log=open(os.devnull, "w"),
    )
    assert sorted(trained) == [
        ("global path removed, equal wall-clock", 1000, quality.DEFAULT_MUON_LR),
        ("spider, AdamW, equal wall-clock", 800, None),
    ]


def test_step_split_times_the_forward_backward_and_the_optimizer_apart():
    split = quality.step_split("bytes_only", {}, quality.Recipe(batch_size=1, seq_len=16), steps=1, warmup=0)
    assert set(split) == {"step", "forward_backward", "optimizer"}
    assert split["forward_backward"] > 0 and split["optimizer"] > 0
    # one timed step: the two parts are the step's two intervals
    assert split["step"] == pytest.approx(split["forward_backward"] + split["optimizer"], rel=1e-9)


def test_plot_draws_the_default_runs_and_their_baselines_only(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    curve = [{"step": 1, "seconds": 1.0, "bits_per_byte": 3.0}, {"step": 2, "seconds": 2.0, "bits_per_byte": 2.5}]
    drawn = []
    plot_line = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, label=None, **k: (drawn.append(label), plot_line(ax, *a, **k))[1])
    ablation = _row("n_loops=3, Muon", 2.2, curve=curve)
    assert not quality_report.plot(
        [ablation], str(tmp_path / "none.png")
    )  # no default run or baseline: nothing to draw
    assert quality_report.plot(
        [_row("spider", 2.1, curve=curve), ablation, _row("llama", 2.2, kind="llama", curve=curve)],
        str(tmp_path / "q.png"),
    )
    assert (tmp_path / "q.png").stat().st_size > 0
    assert drawn == [
        "Spider small (the default run), batch 16, Muon + AdamW",
        "LlamaForCausalLM (equal parameters), batch 16, Muon + AdamW",
    ]


def test_same_init_gives_a_variant_the_default_models_initial_weights():
    """Removing Engram shifts the random stream for every later parameter (another seed for the byte layers);
    with same_init the shared parameters start from the default model's values, and only they."""
    default = quality.initial_model("spider", {}, seed=5).state_dict()
    shifted = quality.initial_model("spider", {"engram_layer_ids": []}, seed=5).state_dict()
    same = quality.initial_model("spider", {"engram_layer_ids": []}, seed=5, same_init=True).state_dict()
    assert not torch.equal(shifted["lm_head.weight"], default["lm_head.weight"])
    assert set(same) < set(default)
    for name, tensor in same.items():
        assert torch.equal(tensor, default[name]), name


def test_dense_baseline_with_spiders_local_attention():
    """The stronger plain baseline: the dense Llama with Spider's 4-byte byte-layer window. Its window is real (a
    prediction far enough from a byte cannot depend on it: 7 layers x 3 bytes back), it runs at equal parameters and
    at the Llama's equal-wall-clock step count, stays in the baselines' shard, and is rendered beside them."""
    model = quality.build("llama_local", {"num_hidden_layers": 2}).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    reach = 2 * (4 - 1)  # two layers, each 3 bytes further back than the byte itself
    assert torch.equal(a[0, reach + 1 :], b[0, reach + 1 :])  # beyond the receptive field: bit-identical
    assert not torch.allclose(a[0, : reach + 1], b[0, : reach + 1])  # inside it: the byte matters
    runs = {
        r["name"]: r
        for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25), adamw_step_times=(0.5, 1.25, 0.2))
    }
    equal, timed = runs[LOCAL_DENSE], runs[f"{LOCAL_DENSE}, equal wall-clock"]
    assert (equal["kind"], equal["steps"], timed["steps"]) == ("llama_local", 500, 250)
    assert timed["recipe"] == {"muon_lr": pytest.approx(2 * quality.DEFAULT_MUON_LR)}
    last_shard = {r["name"] for r in quality.shard_of(list(runs.values()), 1, 2)}
    assert {LOCAL_DENSE, f"{LOCAL_DENSE}, equal wall-clock", "llama"} <= last_shard
    rows = _rows(2.21) + [
        _row(LOCAL_DENSE, 2.02, kind="llama_local", group="local baseline equal parameters"),
        _row(
            f"{LOCAL_DENSE}, equal wall-clock",
            2.12,
            kind="llama_local",
            group="local baseline equal wall-clock",
            steps=250,
            lr=2e-3,
        ),
    ]
    table = quality_report.render(rows).split("\n\n")[0]
    assert "4-byte local attention (`MistralForCausalLM`), equal parameters and steps (lr 0.001) |" in table
    assert "equal wall-clock (lr 0.002) | Muon (lr 0.01) + AdamW | 250 | 6.00M | 2.120 |" in table


def test_byte_kinds_place_every_predicted_byte_in_its_word():
    windows = torch.tensor([list(b"xx, a word!  ok")])
    kinds = quality_scoring.byte_kinds(windows)[0].tolist()  # predicted bytes: windows[:, 1:] = "x, a word!  ok"
    #       x  ,  ' ' a  ' ' w  o  r  d  !  ' ' ' ' o  k
    assert kinds == [2, 0, 0, 1, 0, 1, 2, 3, 4, 0, 0, 0, 1, 2]
    long_word = torch.tensor([list(b" abcdefg")])
    assert quality_scoring.byte_kinds(long_word)[0].tolist() == [1, 2, 3, 4, 5, 5, 5]  # the 5th byte on share one kind


def test_score_by_byte_kind_splits_the_same_total():
    model = tiny_model(seed=0).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 3)
    plain = quality_scoring.score(model, ids)
    split = quality_scoring.score(model, ids, by_byte_kind=True)
    assert split["bits_per_byte"] == plain["bits_per_byte"]  # the headline number is computed as before
    shares, bpb = split["byte_kind_shares"], split["bits_per_byte_by_byte_kind"]
    assert set(shares) == set(bpb) == set(quality_scoring.BYTE_KINDS) and sum(shares.values()) == pytest.approx(1.0)
    # the kinds' bits, weighted by their shares, add up to the total (fp64 sums of fp32 per-byte losses over
    # ids.numel() bytes: a relative tolerance of fp32's epsilon times the count)
    total = sum(shares[k] * bpb[k] for k in quality_scoring.BYTE_KINDS)
    assert total == pytest.approx(plain["bits_per_byte"], rel=torch.finfo(torch.float32).eps * ids.numel())


@pytest.mark.parametrize("probe", list(quality_scoring.GLOBAL_STREAM_PROBES))
def test_global_stream_probes_change_only_what_the_bytes_read_and_are_undone(probe):
    # a segment closes every 4 bytes (at positions 3, 7, ...); the tiny preset's global stream reaches the output at
    # initialisation
    model = tiny_model(seed=0, boundary_mode="fixed", boundary_prior=0.25).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 2)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with quality_scoring._GlobalStreamProbe(model, probe):
            probed = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(after, plain)  # the class's global_stream is back
    assert not torch.equal(probed, plain)
    if probe != "removed":  # bytes 0-2, before the first boundary, read the null segment's stream in both: no change
        assert torch.equal(probed[:, :3], plain[:, :3]) and not torch.equal(probed[:, 3:], plain[:, 3:])


def test_gain_by_byte_kind_table_is_rendered_from_the_rows():
    kinds = dict.fromkeys(quality_scoring.BYTE_KINDS, 2.0)
    shares = dict.fromkeys(quality_scoring.BYTE_KINDS, 1 / len(quality_scoring.BYTE_KINDS))
    rows = _rows(2.21)
    rows[0].update(
        bpb_by_byte_kind={**kinds, "1st byte of a word": 4.0},
        byte_kind_shares=shares,
        bpb_by_global_stream_probe={
            "removed": {"bits_per_byte": 2.3, "by_byte_kind": {**kinds, "1st byte of a word": 4.5}}
        },
    )
    rows[1].update(bpb_by_byte_kind={**kinds, "1st byte of a word": 4.25}, byte_kind_shares=shares)
    text = quality_report.render(rows)
    assert "| 1st byte of a word | 16.7% | 4.000 | 4.250 | +0.250 |" in text
    assert "| **every byte** | 100.0% | 2.200 | 2.210 | +0.010 |" in text
    assert "| removed | +0.100 | +0.500 |" in text


@pytest.mark.parametrize(
    "spider_name, removed_name, batch_size",
    [
        (LARGER_BATCH_NAME, REFERENCES["byte_layers_alone"], 16),
        (LARGEST_BATCH_NAME, "global path removed, batch 32 x 256, Muon", 32),
    ],
)
def test_larger_batch_pairs_train_both_models_with_more_bytes_per_step(spider_name, removed_name, batch_size):
    runs = {
        r["name"]: r
        for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25), adamw_step_times=(0.5, 1.25, 0.2))
    }
    spider, removed = runs[spider_name], runs[removed_name]
    assert (spider["kind"], spider["overrides"], spider["steps"]) == ("spider", {}, quality.Recipe.steps)
    trained = {
        name: quality.Recipe(**(r.get("recipe") or {})) for name, r in (("spider", spider), ("removed", removed))
    }
    assert trained["spider"].batch_size == trained["removed"].batch_size == batch_size
    assert trained["spider"].muon_lr == DEFAULT_MUON_LR and trained["spider"].muon_experts  # Muon everywhere
    assert removed["kind"] == "bytes_only"  # (no experts: the default run's split leaves it on the same optimizers)
    rows = _rows(2.21) + [_row(spider_name, 2.0), _row(removed_name, 2.07, kind="bytes_only")]
    label = f"4-byte window, Muon, the teacher's word segments, batch {batch_size} x 256"
    assert f"| {label} | 500 | 2.000 | 2.070 | +0.070 |" in quality_report.render(rows)


def test_the_recipe_is_train_hf_defaults(monkeypatch):
    """The benchmark's default run is `train_hf.py` with no arguments: the same steps, batch, learning rates,
    schedule, clipping, seed and optimizer split."""
    from spider_training.arguments import parse_args

    for var in ("ACCELERATE_USE_FSDP", "MICRO_BATCH", "LR", "SEQ_LEN", "N_LOOPS", "TARGET_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    args = parse_args([])
    recipe = quality.Recipe()
    assert (args.max_steps, args.per_device_train_batch_size, args.seq_len) == (
        recipe.steps,
        recipe.batch_size,
        recipe.seq_len,
    )
    assert (args.learning_rate, args.weight_decay, (args.adam_beta1, args.adam_beta2), args.max_grad_norm) == (
        recipe.lr,
        recipe.weight_decay,
        recipe.betas,
        recipe.max_grad_norm,
    )
    assert (args.warmup_steps, args.lr_scheduler_kwargs["min_lr_rate"], args.seed) == (
        recipe.warmup_steps,
        recipe.min_lr_rate,
        recipe.seed,
    )
    assert (args.muon_lr, args.muon_experts, args.extra_train_loops) == (
        recipe.muon_lr,
        recipe.muon_experts,
        recipe.extra_train_loops,
    )
    # ... and the arguments a row trains with are train_hf.py's, parsed by its parser: only the output folder,
    # checkpointing, progress bar and logging interval (every 10 steps either way here) differ
    row_args = quality.training_arguments(recipe, "/tmp/quality-row")
    differ = {"output_dir", "logging_dir", "save_strategy", "disable_tqdm", "logging_steps"}
    mine, main_job = row_args.to_dict(), args.to_dict()
    assert {k for k in mine if mine[k] != main_job.get(k)} <= differ
    assert (row_args.logging_steps, args.logging_steps) == (10, 10)
