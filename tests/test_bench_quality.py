"""bench/quality.py without training: the results tables and targets rendered from rows, the shard split, the
evaluation-time boundary rules and the sample measure. (The suite's training runs are the benchmark itself; the slow
short run in tests/test_global_path.py trains with its loop.)"""

import math
import os
import re

import pytest
import torch

from bench import quality
from configuration_spider import SpiderConfig
from spider_training.optim import DEFAULT_MUON_LR
from tests.helpers import tiny_model


def _row(name, bpb, kind="spider", group="ablation", **extra):
    return {"name": name, "model": kind, "group": group, "steps": 500, "lr": 1e-3, "parameters": 6_000_000,
            "sotu_bits_per_byte": bpb, **extra}


def _rows(removed_bpb):
    spider = _row("spider", 2.20, xz_bits_per_byte=3.03, n_loops=2, pydoc_topics_bits_per_byte=4.6,
                  bpb_by_loops={"1": 2.25, "2": 2.20, "4": 2.205}, train_bytes_per_segment=3.4,
                  eval_bytes_per_segment=3.2, mean_halting_step=2.0, sample="The state of the Union is a",
                  real_word_rate=0.9)
    return [spider, _row("global path removed (prelude + coda only)", removed_bpb, kind="bytes_only"),
            _row("llama", 2.4, kind="llama", group="baseline equal parameters", pydoc_topics_bits_per_byte=4.5,
                 sample="x", real_word_rate=0.8),
            _row("llama lr=0.001, equal wall-clock", 2.5, kind="llama", group="baseline equal wall-clock",
                 pydoc_topics_bits_per_byte=4.58)]


@pytest.mark.parametrize("removed_bpb, met", [(2.35, "yes"), (2.21, "**no**")])
def test_targets_are_judged_from_the_measured_numbers(removed_bpb, met):
    text = quality.render(_rows(removed_bpb))
    line = next(line for line in text.splitlines() if line.startswith("| the global path pays"))
    assert line.endswith(f"| {met} |") and f"{removed_bpb - 2.20:+.3f}" in line
    assert "| held-out bpb at or below the dense baseline at equal wall-clock | 2.200 vs 2.500 | yes |" in text
    assert "| technical text: no worse than the dense baseline by more than 0.05 | 4.600 vs 4.580 | yes |" in text
    assert "| 1 loop is worse than the trained count | 2.2500 vs 2.2000 | yes |" in text
    assert "| twice the trained count no worse than it by more than 0.01 | +0.0050 | yes |" in text
    assert "| samples are real words at least as often as the dense baseline's | 90% vs 80% | yes |" in text


def test_byte_layers_alone_train_for_spiders_wall_clock_and_are_rendered():
    """The plain model with Spider's local attention at equal compute: its step count comes from both step times
    under each recipe, and its row stands in the first table beside the dense baselines."""
    runs = {r["name"]: r for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25),
                                                      adamw_step_times=(0.5, 1.25, 0.2))}
    equal = runs["global path removed, equal wall-clock"]
    assert (equal["kind"], equal["steps"], equal["overrides"], equal.get("recipe")) == ("bytes_only", 1200, {}, {})
    assert runs["llama lr=0.001, equal wall-clock"]["steps"] == 250
    assert runs["llama lr=0.002, equal wall-clock"]["recipe"] == {"muon_lr": pytest.approx(0.02)}
    adamw = runs["global path removed, equal wall-clock, AdamW"]
    assert (adamw["steps"], adamw["recipe"]) == (1250, {**quality.BATCH8_RECIPE, "muon_lr": None})
    assert runs["llama lr=0.001, equal wall-clock, AdamW"]["steps"] == 200
    assert runs["spider"].get("recipe") is None and runs["n_loops=1"]["recipe"] == {**quality.BATCH8_RECIPE,
                                                                                        **quality.ADAMW}
    optimizer_at_equal_time = runs["spider, AdamW, equal wall-clock"]  # AdamW for as long as the Muon run takes
    assert (optimizer_at_equal_time["steps"], optimizer_at_equal_time["recipe"]) == \
        (600, {**quality.BATCH8_RECIPE, **quality.ADAMW})
    rows = _rows(2.21) + [_row("global path removed, equal wall-clock", 2.1, kind="bytes_only",
                               group="byte layers equal wall-clock", pydoc_topics_bits_per_byte=4.4, steps=1200),
                          _row("global path removed, equal wall-clock, AdamW", 2.2, kind="bytes_only",
                               group="byte layers equal wall-clock, AdamW", steps=1250),
                          _row("spider, AdamW, equal wall-clock", 2.25, group="spider equal wall-clock, AdamW",
                               steps=600)]
    table = quality.render(rows).split("\n\n")[0]
    assert ("| Spider's byte layers alone (global path removed), equal wall-clock | Muon (lr 0.01) + AdamW | 1200 | "
            "6.00M | 2.100 | 4.400 |") in table
    assert ("| Spider's byte layers alone (global path removed), equal wall-clock | AdamW, batch 8 x 256 | 1250 | 6.00M | "
            "2.200 | - |") in table
    assert "| Spider `small`, for the default run's wall-clock | AdamW, batch 8 x 256 | 600 | 6.00M | 2.250 | - |" in table


def test_ablations_compare_with_the_default_of_their_own_recipe():
    """AdamW rows are measured against the AdamW default run, Muon rows of the batch-8 recipe (and the AdamW default
    itself) against that recipe's default run, rows of today's recipe and the batch-8 default against the default
    run."""
    old = dict(overrides=quality.END_TO_END_SEGMENTS, muon_lr=0.01)
    rows = _rows(2.21) + [_row(quality.BATCH8_DEFAULT, 2.21, muon_lr=0.01,
                               recipe={**quality.BATCH8_RECIPE, "muon_lr": 0.01}),
                          _row(quality.ADAMW_DEFAULT, 2.30), _row("n_loops=1", 2.35),
                          _row(quality.END_TO_END_DEFAULT, 2.24, **old),
                          _row("Muon at lr 0.02", 2.25, **{**old, "muon_lr": 0.02}),
                          _row("segments: a fixed stride of 6 bytes instead of the teacher's", 2.23, muon_lr=0.01)]
    text = quality.render(rows)
    assert f"| {quality.ADAMW_DEFAULT} | 2.300 | +0.060 |" in text  # the optimizer alone: same segmentation
    assert "| n_loops=1 | 2.350 | +0.050 |" in text  # AdamW rows: the AdamW default
    assert "| Muon at lr 0.02 | 2.250 | +0.010 |" in text  # end-to-end boundaries: that default under Muon
    assert f"| {quality.END_TO_END_DEFAULT} | 2.240 | +0.030 |" in text  # against the batch-8 default run
    assert "| segments: a fixed stride of 6 bytes instead of the teacher's | 2.230 | +0.020 |" in text
    assert f"| {quality.BATCH8_DEFAULT} | 2.210 | +0.010 |" in text  # the old default against today's
    drawn = dict(muon_lr=0.01, recipe={"muon_lr": 0.01, **quality.DRAWN_LOOPS})
    seed = dict(muon_lr=0.01, recipe={**quality.DEFAULT_RECIPE, "seed": 43})
    text = quality.render(rows + [_row(quality.DRAWN_LOOPS_NAME, 2.19, **drawn),
                                  _row("the default run, seed 43 (seed noise)", 2.18, **seed)])
    assert f"| {quality.DRAWN_LOOPS_NAME} | 2.190 | -0.020 |" in text  # against the batch-8 default run
    assert "| the default run, seed 43 (seed noise) | 2.180 | -0.020 |" in text  # against the default run
    # a rerun reproduces the stored rows: the AdamW and longer-budget Spider rows run with end-to-end boundaries and
    # the gated mixing of their day
    runs = {r["name"]: r for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25),
                                                      adamw_step_times=(0.5, 1.25, 0.2))}
    then = {**quality.END_TO_END_SEGMENTS, **quality.GATED_MIXING}
    assert runs["n_loops=1"]["overrides"] == {**then, "n_loops": 1}
    assert runs["segments of about 5 bytes (boundary_prior 0.2)"]["overrides"]["boundary_prior"] == 0.2
    assert runs["spider, 4x the steps"]["overrides"] == then
    assert runs["Muon at lr 0.02"]["overrides"] == runs[quality.END_TO_END_DEFAULT]["overrides"] == then
    assert runs["global path removed, 4x the steps"]["overrides"] == {}
    assert runs["spider"]["overrides"] == {} and runs["the default run, seed 43 (seed noise)"]["overrides"] == {}
    assert runs[quality.GATED_DEFAULT]["overrides"] == quality.GATED_MIXING
    # the default run trains with a fixed loop count; only the rows that name the draw draw
    assert quality.Recipe().extra_train_loops == 0
    drawn_rows = {name for name, r in runs.items() if (r.get("recipe") or {}).get("extra_train_loops")}
    assert drawn_rows == {quality.DRAWN_LOOPS_NAME, f"{quality.DRAWN_LOOPS_NAME}, seed 43",
                          f"{quality.DRAWN_LOOPS_NAME}, the default run's recipe",
                          "the default run, 4x the steps, loop count drawn from {2, 3}",
                          "the default run, 4x the steps, loop count drawn from {2, 3}, seed 43"}
    # ... and the gated mixing is not the default any more: the rows that name it differ from the default run
    assert SpiderConfig.from_preset("small").expand_mixing != quality.GATED_MIXING["expand_mixing"]


def test_shards_keep_the_baselines_together_and_balance_the_rest():
    runs = [dict(kind=k, name=n, steps=500) for n, k, *_ in quality.ABLATIONS]
    runs += [dict(kind="llama", name=f"llama {i}", steps=250) for i in range(3)]
    shards = [quality.shard_of(runs, i, 2) for i in range(2)]
    assert sorted(r["name"] for s in shards for r in s) == sorted(r["name"] for r in runs)
    assert all(r["kind"] != "llama" for r in shards[0])
    cost = [sum(quality._COST[r["kind"]] * (r["steps"] if r["kind"] == "llama" else r["steps"] / 500) for r in s)
            for s in shards]
    assert max(cost) - min(cost) <= quality._COST["spider"]  # within one run of each other


def test_evaluation_boundary_rules_change_only_the_decision_and_are_undone():
    model = tiny_model(seed=0).eval()
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    plain = quality.score(model, ids)
    matched = quality.score_with_boundary_rule(model, ids, "rate-matched", 5.0)
    assert matched["bytes_per_segment"] == pytest.approx(5.0, rel=0.25)  # the requested rate, up to quantile ties
    sampled = quality.score_with_boundary_rule(model, ids, "sampled", None)
    assert math.isfinite(sampled["bits_per_byte"])
    assert quality.score(model, ids) == plain  # the predictor's own forward is back


def test_sample_words_counts_words_of_the_training_text():
    model = tiny_model(seed=0)
    train_ids = torch.tensor(list(b"the state of the union is strong ")).numpy()
    result = quality.sample_words(model, train_ids, n_samples=1, new_bytes=40)
    assert result["sample"].startswith(quality.SAMPLE_PROMPT)
    words = re.findall(r"[A-Za-z]+", result["sample"][len(quality.SAMPLE_PROMPT):])
    vocabulary = {"the", "state", "of", "union", "is", "strong"}
    expected = sum(w.lower() in vocabulary for w in words) / max(1, len(words))
    assert result["real_word_rate"] == pytest.approx(expected)


def test_global_path_table_pairs_each_spider_row_with_its_ablation():
    rows = _rows(2.21) + [_row("2-byte window in the byte layers", 2.34),
                          _row("global path removed, 2-byte window", 2.49, kind="bytes_only"),
                          _row("3-byte window in the byte layers", 2.23)]  # no partner: no line
    text = quality.render(rows)
    assert "| 2-byte window | 500 | 2.340 | 2.490 | +0.150 |" in text
    assert ("| 4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256 (the "
            "default run) | 500 | 2.200 | 2.210 | +0.010 |") in text
    assert "| 3-byte window |" not in text


def test_global_lr_scale_multiplies_only_the_global_path():
    model = tiny_model(seed=0)
    groups = quality.param_groups(model, quality.Recipe(global_lr_scale=3.0, muon_lr=None))
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(scale) == len(named)
    for name, p in named.items():
        assert scale[id(p)] == (1.0 if name.startswith(quality.BYTE_LAYERS) else 3.0), name
        assert decay[id(p)] == (0.1 if p.dim() >= 2 else 0.0), name
    assert scale[id(named["model.recurrent_block.layers.0.mlp.router.weight"])] == 3.0
    assert scale[id(named["model.prelude_layers.0.mlp.up_proj.weight"])] == 1.0
    baseline = quality.param_groups(quality.build("llama", {"num_hidden_layers": 1}),
                                    quality.Recipe(global_lr_scale=3.0, muon_lr=None))
    assert {g["lr_scale"] for g in baseline} == {1.0}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    """`Recipe.muon_lr`: every parameter is in exactly one optimizer; Muon holds the 2-D weights inside the layers
    (experts included, routers not), AdamW the embeddings, head, norms and vectors; Muon's groups keep AdamW's
    per-step decay (lr x weight decay) and the schedule's ratio muon_lr / lr."""
    model = tiny_model(seed=0)
    recipe = quality.Recipe(muon_lr=0.02, muon_experts=True)
    adamw, muon = quality.optimizers(model, recipe)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert not in_muon & in_adamw and in_muon | in_adamw == {id(p) for p in named.values()}
    for name in ("model.prelude_layers.0.self_attn.q_a_proj.weight", "model.coda_layers.0.mlp.down_proj.weight",
                 "model.recurrent_block.layers.0.mlp.experts.gate_up_proj",
                 "model.recurrent_block.layers.0.mlp.experts.down_proj",
                 "model.flexitokens.boundary_predictor.dense.weight"):
        assert id(named[name]) in in_muon, name
    gate_up = {id(p) for n, p in named.items() if n.endswith(".mlp.experts.gate_up_proj")}
    for group in muon.param_groups:  # gate and up orthogonalised apart, as their per-expert weights were
        assert group.get("row_blocks", 1) == (2 if {id(p) for p in group["params"]} <= gate_up else 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.recurrent_block.layers.0.mlp.router.weight",
                 "model.prelude_layers.0.input_layernorm.weight", "model.recurrent_block.loop_lora.lora_A"):
        assert id(named[name]) in in_adamw, name
    for group in muon.param_groups:
        assert math.isclose(group["lr_scale"] * recipe.lr, recipe.muon_lr)
        assert math.isclose(group["weight_decay"] * recipe.muon_lr, recipe.weight_decay * recipe.lr)
    dense = quality.build("llama", {"num_hidden_layers": 1})
    _, dense_muon = quality.optimizers(dense, recipe)
    assert {n for n, p in dense.named_parameters() if id(p) in {id(q) for g in dense_muon.param_groups
                                                               for q in g["params"]}} == {
        n for n, p in dense.named_parameters() if n.startswith("model.layers.0.") and p.dim() == 2}
    assert len(quality.optimizers(model, quality.Recipe(muon_lr=None))) == 1  # the AdamW recipe
    assert quality.Recipe().muon_lr == DEFAULT_MUON_LR  # the default run's


def test_experts_on_adamw_moves_only_the_routed_experts_matrices_to_adamw():
    """`Recipe.muon_experts=False` (the default run's): the routed experts' matrices leave Muon for AdamW's decayed
    group; every other hidden matrix (the shared expert's included) stays with Muon."""
    model = tiny_model(seed=0)
    named = dict(model.named_parameters())

    def muon_names(recipe):
        _, muon = quality.optimizers(model, recipe)
        return {n for n, p in named.items() if id(p) in {id(q) for g in muon.param_groups for q in g["params"]}}

    everywhere, moved = muon_names(quality.Recipe(muon_experts=True)), muon_names(quality.Recipe())
    experts = {n for n in everywhere if ".mlp.experts." in n}
    assert experts and everywhere - moved == experts and moved < everywhere
    assert any(".shared_experts." in n for n in moved)
    adamw, _ = quality.optimizers(model, quality.Recipe())
    decayed = next(g for g in adamw.param_groups if g["weight_decay"] > 0)
    assert {id(named[n]) for n in experts} <= {id(p) for p in decayed["params"]}


def test_loop_counts_draw_each_steps_loop_count_without_changing_the_data():
    """`Recipe.extra_train_loops` (n_loops or one more) and `Recipe.loop_counts` (a given set): every training step runs
    a loop count drawn from its own random stream, so the batches are the fixed-count run's (the default)."""
    import numpy as np

    seen = {}
    variants = {"fixed": {}, "drawn": dict(extra_train_loops=1), (1, 3): dict(loop_counts=(1, 3))}
    for key, recipe in variants.items():
        model = tiny_model(seed=0)
        calls = []
        forward = model.forward

        def spy(*args, **kwargs):  # the real forward, recording what the loop passed
            calls.append((kwargs.get("n_loops"), kwargs["input_ids"].clone()))
            return forward(*args, **kwargs)

        model.forward = spy
        ids = np.arange(5000) % 256
        quality.train(model, ids, quality.Recipe(steps=6, batch_size=2, seq_len=16, warmup_steps=1, **recipe))
        seen[key] = calls
    assert [n for n, _ in seen["fixed"]] == [None] * 6
    n = tiny_model(seed=0).config.n_loops
    for key, allowed in (("drawn", {n, n + 1}), ((1, 3), {1, 3})):
        drawn = [n for n, _ in seen[key]]
        assert set(drawn) == allowed, key
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen["fixed"], seen[key]))


def test_suite_rows_can_be_chosen_by_name(monkeypatch):
    with pytest.raises(ValueError, match="no such row"):
        quality.run_suite(only=["no such row"])


def test_step_times_given_to_the_suite_set_the_equal_wall_clock_steps(monkeypatch):
    """Shards started side by side share one step-time measurement (`--step_times`) instead of each timing the
    models while the others train; nothing is timed then."""
    monkeypatch.setattr(quality, "step_seconds", lambda *a, **k: pytest.fail("timed although times were given"))
    trained = []
    monkeypatch.setattr(quality, "train_and_score", lambda kind, name, overrides, recipe, *a, **k:
                        trained.append((name, recipe.steps, recipe.muon_lr)) or {"name": name})
    quality.run_suite(only=["global path removed, equal wall-clock", "spider, AdamW, equal wall-clock"],
                      step_times={"default": (0.8, 1.6, 0.4), "adamw": (0.5, 1.0, 0.25)}, log=open(os.devnull, "w"))
    assert sorted(trained) == [("global path removed, equal wall-clock", 1000, quality.DEFAULT_MUON_LR),
                               ("spider, AdamW, equal wall-clock", 800, None)]


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
    assert not quality.plot([ablation], str(tmp_path / "none.png"))  # no default run or baseline: nothing to draw
    assert quality.plot([_row("spider", 2.1, curve=curve), ablation, _row("llama", 2.2, kind="llama", curve=curve)],
                        str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").stat().st_size > 0
    assert drawn == ["Spider small (the default run), batch 16, Muon + AdamW",
                     "LlamaForCausalLM (equal parameters), batch 16, Muon + AdamW"]


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
    runs = {r["name"]: r for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25),
                                                      adamw_step_times=(0.5, 1.25, 0.2))}
    equal, timed = runs[quality.LOCAL_DENSE], runs[f"{quality.LOCAL_DENSE}, equal wall-clock"]
    assert (equal["kind"], equal["steps"], timed["steps"]) == ("llama_local", 500, 250)
    assert timed["recipe"] == {"muon_lr": pytest.approx(2 * quality.DEFAULT_MUON_LR)}
    last_shard = {r["name"] for r in quality.shard_of(list(runs.values()), 1, 2)}
    assert {quality.LOCAL_DENSE, f"{quality.LOCAL_DENSE}, equal wall-clock", "llama"} <= last_shard
    rows = _rows(2.21) + [_row(quality.LOCAL_DENSE, 2.02, kind="llama_local", group="local baseline equal parameters"),
                          _row(f"{quality.LOCAL_DENSE}, equal wall-clock", 2.12, kind="llama_local",
                               group="local baseline equal wall-clock", steps=250, lr=2e-3)]
    table = quality.render(rows).split("\n\n")[0]
    assert "4-byte local attention (`MistralForCausalLM`), equal parameters and steps (lr 0.001) |" in table
    assert "equal wall-clock (lr 0.002) | Muon (lr 0.01) + AdamW | 250 | 6.00M | 2.120 |" in table


def test_byte_kinds_place_every_predicted_byte_in_its_word():
    windows = torch.tensor([list(b"xx, a word!  ok")])
    kinds = quality.byte_kinds(windows)[0].tolist()  # predicted bytes: windows[:, 1:] = "x, a word!  ok"
    #       x  ,  ' ' a  ' ' w  o  r  d  !  ' ' ' ' o  k
    assert kinds == [2, 0, 0, 1, 0, 1, 2, 3, 4, 0, 0, 0, 1, 2]
    long_word = torch.tensor([list(b" abcdefg")])
    assert quality.byte_kinds(long_word)[0].tolist() == [1, 2, 3, 4, 5, 5, 5]  # the 5th byte on share one kind


def test_score_by_byte_kind_splits_the_same_total():
    model = tiny_model(seed=0).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 3)
    plain = quality.score(model, ids)
    split = quality.score(model, ids, by_byte_kind=True)
    assert split["bits_per_byte"] == plain["bits_per_byte"]  # the headline number is computed as before
    shares, bpb = split["byte_kind_shares"], split["bits_per_byte_by_byte_kind"]
    assert set(shares) == set(bpb) == set(quality.BYTE_KINDS) and sum(shares.values()) == pytest.approx(1.0)
    # the kinds' bits, weighted by their shares, add up to the total (fp64 sums of fp32 per-byte losses over
    # ids.numel() bytes: a relative tolerance of fp32's epsilon times the count)
    total = sum(shares[k] * bpb[k] for k in quality.BYTE_KINDS)
    assert total == pytest.approx(plain["bits_per_byte"], rel=torch.finfo(torch.float32).eps * ids.numel())


@pytest.mark.parametrize("probe", list(quality.GLOBAL_STREAM_PROBES))
def test_global_stream_probes_change_only_what_the_bytes_read_and_are_undone(probe):
    # a segment closes every 4 bytes (at positions 3, 7, ...); the tiny preset's global stream reaches the output at
    # initialisation
    model = tiny_model(seed=0, boundary_mode="fixed", boundary_prior=0.25).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 2)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with quality._GlobalStreamProbe(model, probe):
            probed = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(after, plain)  # the class's global_stream is back
    assert not torch.equal(probed, plain)
    if probe != "removed":  # bytes 0-2, before the first boundary, read the null segment's stream in both: no change
        assert torch.equal(probed[:, :3], plain[:, :3]) and not torch.equal(probed[:, 3:], plain[:, 3:])


def test_gain_by_byte_kind_table_is_rendered_from_the_rows():
    kinds = dict.fromkeys(quality.BYTE_KINDS, 2.0)
    shares = dict.fromkeys(quality.BYTE_KINDS, 1 / len(quality.BYTE_KINDS))
    rows = _rows(2.21)
    rows[0].update(bpb_by_byte_kind={**kinds, "1st byte of a word": 4.0}, byte_kind_shares=shares,
                   bpb_by_global_stream_probe={"removed": {"bits_per_byte": 2.3,
                                                           "by_byte_kind": {**kinds, "1st byte of a word": 4.5}}})
    rows[1].update(bpb_by_byte_kind={**kinds, "1st byte of a word": 4.25}, byte_kind_shares=shares)
    text = quality.render(rows)
    assert "| 1st byte of a word | 16.7% | 4.000 | 4.250 | +0.250 |" in text
    assert "| **every byte** | 100.0% | 2.200 | 2.210 | +0.010 |" in text
    assert "| removed | +0.100 | +0.500 |" in text


@pytest.mark.parametrize("spider_name, removed_name, batch_size", [
    (quality.LARGER_BATCH_NAME, quality.DEFAULT_REMOVED, 16),
    (quality.LARGEST_BATCH_NAME, "global path removed, batch 32 x 256, Muon", 32),
])
def test_larger_batch_pairs_train_both_models_with_more_bytes_per_step(spider_name, removed_name, batch_size):
    runs = {r["name"]: r for r in quality.suite_runs(quality.Recipe(), step_times=(0.6, 1.2, 0.25),
                                                      adamw_step_times=(0.5, 1.25, 0.2))}
    spider, removed = runs[spider_name], runs[removed_name]
    assert (spider["kind"], spider["overrides"], spider["steps"]) == ("spider", {}, quality.Recipe.steps)
    trained = {name: quality.Recipe(**(r.get("recipe") or {})) for name, r in (("spider", spider), ("removed", removed))}
    assert trained["spider"].batch_size == trained["removed"].batch_size == batch_size
    assert trained["spider"].muon_lr == DEFAULT_MUON_LR and trained["spider"].muon_experts  # Muon everywhere
    assert removed["kind"] == "bytes_only"  # (no experts: the default run's split leaves it on the same optimizers)
    rows = _rows(2.21) + [_row(spider_name, 2.0), _row(removed_name, 2.07, kind="bytes_only")]
    label = f"4-byte window, Muon, the teacher's word segments, batch {batch_size} x 256"
    assert f"| {label} | 500 | 2.000 | 2.070 | +0.070 |" in quality.render(rows)


def test_the_recipe_is_train_hf_defaults(monkeypatch):
    """The benchmark's default run is `train_hf.py` with no arguments: the same steps, batch, learning rates,
    schedule, clipping, seed and optimizer split."""
    from spider_training.arguments import parse_args

    for var in ("ACCELERATE_USE_FSDP", "MICRO_BATCH", "LR", "SEQ_LEN", "N_LOOPS", "TARGET_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    spider, args = parse_args([])
    recipe = quality.Recipe()
    assert (args.max_steps, args.per_device_train_batch_size, spider.seq_len) == \
        (recipe.steps, recipe.batch_size, recipe.seq_len)
    assert (args.learning_rate, args.weight_decay, (args.adam_beta1, args.adam_beta2), args.max_grad_norm) == \
        (recipe.lr, recipe.weight_decay, recipe.betas, recipe.max_grad_norm)
    assert (args.warmup_steps, args.lr_scheduler_kwargs["min_lr_rate"], args.seed) == \
        (recipe.warmup_steps, recipe.min_lr_rate, recipe.seed)
    assert (spider.muon_lr, spider.muon_experts, spider.extra_train_loops) == \
        (recipe.muon_lr, recipe.muon_experts, recipe.extra_train_loops)
