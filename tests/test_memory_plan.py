"""spider_training/memory_plan.py: what it counts and how it extrapolates, on the tiny preset; the command
``spider-memory-plan``; ``python -m bench.memory_plan`` writing its table into docs/results.md."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from spider_training import memory_plan
from tests.helpers import run_module


def test_saved_activations_count_what_autograd_keeps_once_and_no_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with memory_plan.SavedActivations(model) as saved:
        model(x).sum()
    # the first Linear saves its input (4 x 8 fp32), the second the first's output; the weights are parameters
    assert saved.by_call == {"other": 2 * 4 * 8 * 4}


def test_extrapolation_is_exact_for_linear_and_quadratic_costs():
    probes = [{"length": n, "a": 5 + 3 * n, "q": 7 * n + 2 * n * n} for n in (128, 256)]
    assert memory_plan.extrapolate(probes, "a", 2048) == 5 + 3 * 2048
    assert memory_plan.extrapolate(probes, "q", 2048, quadratic=True) == pytest.approx(7 * 2048 + 2 * 2048**2)


def test_static_bytes_shard_over_gpus():
    static = memory_plan.static_bytes(parameters=1000, largest_group=100, gpus=8)
    assert static["ddp"] == {"parameters": 4000, "gradients": 4000, "adamw": 8000, "adamw_8bit": 2000 + 2000 / 64}
    assert static["fsdp2"]["adamw"] == 1000
    assert static["fsdp2"]["parameters"] == 4000 / 8 + 2 * 4 * 100


@pytest.fixture(scope="module")
def tiny_plan():
    return memory_plan.run(preset="tiny", seq_len=512, gpus=2)


def test_plan_of_the_tiny_preset(tiny_plan):
    r = tiny_plan
    assert r["parameters"] == sum(r["shard_groups"].values())
    for p in r["probes"]:
        assert 0 < p["activations_checkpointed"] < p["activations"] and p["flops"] > 0
    budget = memory_plan.GPU_MEMORY_GIB * memory_plan.GIB
    for plan in r["plans"]:
        n, static, per_seq = plan["largest_micro_batch_80gb"], plan["static_gib"], plan["activations_gib_per_sequence"]
        assert (static + n * per_seq) * memory_plan.GIB <= budget < (static + (n + 1) * per_seq) * memory_plan.GIB


def test_the_plan_runs_the_most_loops_a_training_step_draws(tiny_plan):
    from configuration_spider import SpiderConfig
    from spider_training.arguments import SpiderTrainingArguments

    assert (
        tiny_plan["n_loops"] == SpiderConfig.from_preset("tiny").n_loops + SpiderTrainingArguments().extra_train_loops
    )
    fewer = memory_plan.probe("tiny", memory_plan.PROBE_LENGTHS[0], n_loops=tiny_plan["n_loops"] - 1)
    peak = tiny_plan["probes"][0]
    assert fewer["activations"] < peak["activations"] and fewer["flops"] < peak["flops"]


def test_results_block_is_filled_and_a_missing_block_is_named(tiny_plan, tmp_path):
    readme, saved = tmp_path / "results.md", tmp_path / "plan.json"
    saved.write_text(json.dumps(tiny_plan))
    start, end = "<!-- memory_plan:start -->", "<!-- memory_plan:end -->"  # the block in docs/results.md
    readme.write_text(f"before\n{start}\nold\n{end}\nafter\n")
    done = run_module("bench.memory_plan", "--report", saved, "--write_results", readme)
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert "old" not in text and "| FSDP2 | 8-bit AdamW | checkpointing |" in text and text.endswith("after\n")
    assert memory_plan.render(tiny_plan) in text
    readme.write_text("no block\n")
    done = run_module("bench.memory_plan", "--report", saved, "--write_results", readme)
    assert done.returncode != 0 and "ValueError" in done.stderr and "results.md" in done.stderr, done.stderr


def test_rendered_block_wraps_its_paragraphs_at_119_columns():
    """The committed 1b plan (bench/memory_plan.json) renders with no prose line over 119 characters (docs/results.md
    keeps its lines within 120), the same words in order; the table's rows stay one line each."""
    plan = json.loads((Path(__file__).resolve().parents[1] / "bench" / "memory_plan.json").read_text())
    lines = memory_plan.render(plan).splitlines()
    rows = [line for line in lines if line.startswith("|")]
    assert len(rows) == 2 + len(plan["plans"])
    assert all(len(line) <= 119 for line in lines if not line.startswith("|"))
    last = " ".join(lines[lines.index(rows[-1]) + 2 :])
    assert last.startswith(f"One training step of one {plan['seq_len']}-byte sequence at {plan['n_loops']} loops")
    assert last.endswith("allocator fragmentation or NCCL buffers: keep 10-20% free.")
    assert len(lines[lines.index(rows[-1]) + 2 :]) > 1  # it was wrapped, not merely short


def test_command_computes_writes_and_renders_a_plan(tmp_path):
    """``spider-memory-plan``: the plan it computes is :func:`memory_plan.run`'s with its environment, ``--out``
    keeps all of it, ``--report --markdown`` renders that file; bad sizes are refused by name."""
    out = tmp_path / "plan.json"
    done = run_module(
        "spider_training.commands.memory_plan", "--preset", "tiny", "--seq_len", "512", "--gpus", "2", "--out", out
    )
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["environment"]["torch"] == torch.__version__ and len(written["probes"]) == 2
    printed = json.loads(done.stdout)
    assert printed == {k: v for k, v in written.items() if k not in ("probes", "environment")}
    assert (printed["preset"], printed["seq_len"], printed["gpus"]) == ("tiny", 512, 2)
    done = run_module("spider_training.commands.memory_plan", "--report", out, "--markdown")
    assert done.returncode == 0 and done.stdout == memory_plan.render(written), done.stderr
    done = run_module("spider_training.commands.memory_plan", "--gpus", "0")
    assert done.returncode == 2 and "--gpus" in done.stderr
