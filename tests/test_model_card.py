"""Tests of ``spider_training/model_card.py``: the card renders every section from ``hub_card/model_card.md.j2``, its
YAML front matter survives a ``huggingface_hub.ModelCard.load`` round trip, and ``loss_curve.png`` is a real plot."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import ModelCard

from spider_training.model_card import (
    LOSS_CURVE_NAME,
    inspect_remote_code,
    loading_requirements,
    plot_loss_curve,
    write_model_card,
)
from tests.helpers import REMOTE_CODE_FILES

ROOT = Path(__file__).resolve().parent.parent
REPO = "spider-test/spider-tiny"

SECTIONS = (
    "## How one forward pass works",
    "## Usage",
    "## What `trust_remote_code=True` runs",
    "## Pinning a revision",
    "## Configuration",
    "## Training data",
    "## Training setup",
    "## Results",
    "## Limitations",
    "## License and sources",
)


def log_history(steps: int = 60, eval_every: int = 20, with_bpb: bool = True) -> list[dict]:
    """Trainer.state.log_history-shaped entries: train logs, eval logs, and the final summary entry."""
    history = []
    for step in range(1, steps + 1):
        history.append(
            {
                "step": step,
                "epoch": step / steps,
                "loss": 4.0 * math.exp(-step / 20) + 1.5,
                "learning_rate": 1e-3,
                "grad_norm": 1.0,
            }
        )
        if step % eval_every == 0:
            entry = {"step": step, "eval_loss": 3.5 * math.exp(-step / 20) + 1.7, "eval_runtime": 0.5}
            if with_bpb:
                entry["eval_bits_per_byte"] = entry["eval_loss"] / math.log(2)
            history.append(entry)
    history.append({"step": steps, "train_runtime": 12.0, "train_loss": 2.2, "total_flos": 0.0})
    return history


@pytest.fixture
def config() -> dict:
    from configuration_spider import SpiderConfig

    return SpiderConfig.from_preset("tiny").to_dict()


@pytest.fixture
def release(tmp_path) -> Path:
    folder = tmp_path / "release"
    folder.mkdir()
    for name in REMOTE_CODE_FILES:
        shutil.copy(ROOT / name, folder / name)
    return folder


def write(release: Path, config: dict, **overrides) -> Path:
    kwargs = dict(
        config=config,
        training={
            "precision": "fp8",
            "optimizer": "adamw_torch",
            "learning_rate": 1e-3,
            "max_steps": 60,
            "seq_len": 256,
            "num_parameters": 1_234_567,
            "train_runtime_s": 12.0,
            "custom_knob": "on",
        },
        data={
            "source": "sotu",
            "name": "State of the Union addresses",
            "hub_dataset": "someone/sotu-bytes",
            "train_bytes": 11_534_336,
            "eval_bytes": 1_048_576,
            "eval_split": "addresses from 2000 on",
        },
        metrics={
            "bits_per_byte_before": 8.123,
            "bits_per_byte_after": 2.456,
            "final_train_loss": 1.61,
            "final_eval_loss": 1.702,
            "tokens_per_second": 4321.0,
        },
        loss_history=log_history(),
        repo_id=REPO,
    )
    kwargs.update(overrides)
    return write_model_card(release, **kwargs)


def test_card_renders_every_section_with_run_facts(release, config):
    readme = write(release, config)
    assert readme == release / "README.md"
    text = readme.read_text()

    positions = [text.index(heading) for heading in SECTIONS]
    assert positions == sorted(positions)  # all present, in order
    assert "{{" not in text and "{%" not in text
    # loading and pinning
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}", trust_remote_code=True, revision=rev)' in text
    assert 'rev = "<commit sha>"' in text
    assert f"n_loops={config['n_loops']}," in text
    # what remote code runs: each file with its real sha256, and the imports parsed from them
    for name in REMOTE_CODE_FILES:
        digest = hashlib.sha256((release / name).read_bytes()).hexdigest()
        assert f"| `{name}` |" in text and digest in text
    assert "**huggingface_hub, numpy, torch, transformers**" in text
    assert "None of these is a module for network access" in text
    # config, data, training, metrics
    assert f"| hidden size | {config['hidden_size']} |" in text
    assert f"| routed experts per layer | {config['n_routed_experts']} |" in text
    assert "| training bytes | 11,534,336 (11.0 MiB) |" in text
    assert "| held-out split | addresses from 2000 on |" in text
    assert "| precision | fp8 |" in text and "| `custom_knob` | on |" in text
    assert "from **8.123** (the freshly initialised model) to **2.456**" in text
    assert "| training throughput (bytes/s) | 4,321 |" in text
    assert f"![Training and held-out loss by step]({LOSS_CURVE_NAME})" in text
    assert "1.2M parameters" in text


def test_usage_names_the_versions_loading_needs(release, config):
    """The usage section names the package's own requirements outside its extras (read from the installed metadata:
    the README's set-up installs the package), torch and transformers among them."""
    requirements = loading_requirements()
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}
    assert {"torch", "transformers"} <= names and not any("extra ==" in r for r in requirements)
    text = write(release, config).read_text()
    start = text.index("## Usage")
    usage = text[start : text.index("```python", start)]
    for requirement in requirements:
        assert f'"{requirement}"' in usage
    assert all(len(line) <= 119 for line in usage.splitlines()), usage  # the list, then the pip line (both fit)
    assert loading_requirements("no-such-distribution-spider") == []


def test_loops_table_marks_the_trained_count_and_is_absent_without_a_sweep(release, config):
    sweep = {"1": 2.5, str(config["n_loops"]): 2.25, str(2 * config["n_loops"]): 2.2}
    text = write(release, config, bits_per_byte_by_loops=sweep).read_text()
    assert "| loops | held-out bits per byte |" in text
    assert "| 1 | 2.5000 |" in text and f"| {config['n_loops']} (trained) | 2.2500 |" in text
    assert text.index("| 1 | 2.5000 |") < text.index(f"| {2 * config['n_loops']} | 2.2000 |")  # by loop count
    assert "| loops | held-out bits per byte |" not in write(release, config).read_text()


def test_the_cards_prose_says_only_what_its_figures_show(release, config):
    """Issue 66 D6: the loop sentence follows the card's own loop table (the small release's 4 loops scored worse
    than 2), and the code sentence counts the Python files the release holds."""
    n = config["n_loops"]
    worse_with_more = write(release, config, bits_per_byte_by_loops={"1": 2.5, str(n): 2.2, str(2 * n): 2.3})
    text = " ".join(worse_with_more.read_text().split())
    assert f"{n} loops scored best (the trained count); more did not help" in text
    assert "usually give better predictions" not in text
    better_with_more = " ".join(
        write(release, config, bits_per_byte_by_loops={"1": 2.5, str(n): 2.3, str(2 * n): 2.2}).read_text().split()
    )
    assert f"the most loops tried ({2 * n}) scored best" in better_with_more
    assert "whether more loops help is measured per checkpoint" in " ".join(write(release, config).read_text().split())
    files = sorted(p.name for p in release.glob("*.py"))
    assert len(files) == len(REMOTE_CODE_FILES)
    expected = f"The code is the {len(files)} Python files in this repository (" + ", ".join(f"`{f}`" for f in files)
    assert expected in " ".join(worse_with_more.read_text().split())


def test_the_code_files_sentence_wraps_at_119_columns(release, config):
    """The sentence naming a release's remote-code files (five of them here) grows with their names: the template wraps
    it at 119 columns with Jinja's ``wordwrap`` (the same words, in order)."""
    lines = write(release, config).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("The code is the 5 Python files"))
    end = lines.index("", start)
    assert end - start > 1 and all(len(line) <= 119 for line in lines[start:end])
    assert " ".join(lines[start:end]).endswith("the papers each part comes from are listed at the end of this card.")


def test_act_early_exit_is_reported_under_the_loops_table(release, config):
    sweep = {"1": 2.5, str(config["n_loops"]): 2.25}
    exit_result = {
        "bits_per_byte": 2.2513,
        "mean_halting_step": config["n_loops"] - 0.375,
        "loops_saved_per_segment": 0.375,
    }
    text = write(release, config, bits_per_byte_by_loops=sweep, act_early_exit=exit_result).read_text()
    assert "held-out bits per byte are 2.2513 at" in text and "saves 0.375 loops on average" in text
    assert text.index("| 1 | 2.5000 |") < text.index("saves 0.375 loops")
    assert "ACT early exit" not in write(release, config, bits_per_byte_by_loops=sweep).read_text()


def test_metadata_round_trips_through_modelcard_load(release, config):
    card = ModelCard.load(write(release, config))
    data = card.data
    assert data.language == "en"
    assert data.license == "apache-2.0"
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation"
    assert {"byte-level", "moe", "recurrent-depth", "fp8", "flexitokens"} <= set(data.tags)
    assert data.datasets == ["someone/sotu-bytes"]
    assert data.model_name == "spider-tiny"
    (result,) = data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_type) == (
        "bits_per_byte",
        2.456,
        "someone/sotu-bytes",
    )
    assert card.text.lstrip().startswith("# spider-tiny")


def test_fp8_tag_and_paragraph_only_for_fp8_runs(release, config):
    card = ModelCard.load(write(release, config, training={"precision": "fp32", "optimizer": "adamw_torch"}))
    assert "fp8" not in card.data.tags
    assert "Float8Linear" not in card.text
    card = ModelCard.load(write(release, config))
    assert "fp8" in card.data.tags and "Float8Linear" in card.text


def test_loss_curve_is_a_real_nonblank_plot(release, config):
    write(release, config)
    png = release / LOSS_CURVE_NAME
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"

    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    height, width, _ = image.shape
    assert (width, height) == (1100, 400)  # two panels (loss + bits per byte) at 100 dpi
    non_white = (image.sum(axis=2) < 720).mean()
    assert non_white > 0.02  # axes, labels and lines were drawn

    def pixels_near(rgb) -> int:
        return int((np.abs(image - np.array(rgb)).sum(axis=2) < 40).sum())

    assert pixels_near((31, 119, 180)) > 200  # tab:blue training loss line
    assert pixels_near((255, 127, 14)) > 50  # tab:orange held-out loss
    assert pixels_near((44, 160, 44)) > 50  # tab:green bits per byte


def test_single_panel_without_bits_per_byte(tmp_path):
    assert plot_loss_curve(log_history(with_bpb=False), tmp_path / "c.png")
    from PIL import Image

    assert Image.open(tmp_path / "c.png").size == (800, 400)


def test_no_history_means_no_curve_and_the_card_says_so(release, config):
    write(release, config)
    assert (release / LOSS_CURVE_NAME).exists()
    text = write(release, config, loss_history=None).read_text()
    assert not (release / LOSS_CURVE_NAME).exists()  # the earlier run's curve is not left behind
    assert "No loss history was recorded" in text and LOSS_CURVE_NAME not in text
    # only non-plottable entries (summary, NaN loss): nothing to draw either
    assert not plot_loss_curve(
        [{"step": 1, "loss": float("nan")}, {"step": 2, "train_runtime": 3.0}], release / "x.png"
    )
    assert not (release / "x.png").exists()


def test_minimal_inputs_render(tmp_path):
    text = write_model_card(
        tmp_path, config={}, training={}, data={}, metrics={}, loss_history=None, repo_id=None
    ).read_text()
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.eval_results is None and card.data.datasets is None
    assert "# Spider" in text
    assert f'repo = "{tmp_path}"' in text  # snippets load the local folder
    assert "their imports could not be listed" in text
    assert "No metrics were recorded" in text and "No training setup was recorded" in text


def test_remote_code_that_can_reach_the_network_is_flagged(release, config):
    path = release / "modeling_spider.py"
    path.write_text(path.read_text() + "\n\ndef _phone_home():\n    import socket\n    import urllib.request\n")
    files, imports = inspect_remote_code(release)
    assert imports["risky"] == ["socket", "urllib"]
    text = write(release, config).read_text()
    assert "Note: socket, urllib can reach the network or run programs." in text
    assert "None of these is a module for network access" not in text


def test_template_errors_are_clear(release, config, tmp_path):
    custom = tmp_path / "custom.md.j2"
    custom.write_text("---\n{{ card_data }}\n---\n\n# {{ model_name }} by {{ author_name }}\n")
    with pytest.raises(ValueError, match=r"undefined variable\(s\) \['author_name'\]"):
        write(release, config, template_path=custom)
    custom.write_text("---\n{{ card_data }}\n---\n\n# Custom card for {{ model_ref }}\n")
    assert write(release, config, template_path=custom).read_text().rstrip().endswith(f"# Custom card for {REPO}")
    with pytest.raises(FileNotFoundError, match="template not found"):
        write(release, config, template_path=tmp_path / "nope.j2")


def test_bad_inputs_raise(release, config, tmp_path):
    with pytest.raises(FileNotFoundError, match="release folder does not exist"):
        write(tmp_path / "missing", config)
    with pytest.raises(TypeError, match="`metrics` must be a dict"):
        write(release, config, metrics=[1, 2])
    with pytest.raises(TypeError, match=r"loss_history\[1\] must be a dict"):
        write(release, config, loss_history=[{"step": 1, "loss": 2.0}, "oops"])
    with pytest.raises(ValueError, match=r"loss_history\[0\]"):
        write(release, config, loss_history=[{"step": 1, "loss": "high"}])


def test_key_names_of_release_py_are_understood(release, config):
    """spider_training/release.py passes Trainer-style names (eval_before_bits_per_byte, micro_batch, eval, ...)."""
    readme = write(
        release,
        config,
        training={
            "steps": 60,
            "precision": "bf16",
            "moe_backend": "sorted",
            "seq_len": 256,
            "micro_batch": 4,
            "grad_accum": 2,
            "optimizer": "adamw_torch",
            "world_size": 1,
        },
        data={"source": "sotu", "eval": "sotu, years >= 2000"},
        metrics={
            "steps": 60,
            "train_loss": 2.1,
            "eval_before_bits_per_byte": 8.3,
            "eval_after_bits_per_byte": 2.9,
            "parameters": 2_000_000,
        },
    )
    text = readme.read_text()
    assert "from **8.300** (the freshly initialised model) to **2.900**" in text
    assert "2.0M parameters" in text
    assert "| held-out split | sotu, years >= 2000 |" in text
    assert "| sequences per device per step | 4 |" in text and "| gradient accumulation | 2 |" in text
    assert "| held-out bits per byte, after training | 2.9 |" in text
    (result,) = ModelCard.load(readme).data.eval_results
    assert (result.metric_value, result.dataset_type) == (2.9, "sotu")


def test_release_model_name_prefers_the_flag_then_the_hub_id_then_preset_and_size():
    from types import SimpleNamespace

    from spider_training.release import release_model_name

    assert release_model_name(SimpleNamespace(preset="small", model_name=None), None, 6_045_379) == "spider-small-6.0M"
    assert (
        release_model_name(SimpleNamespace(preset="small", model_name=None), "me/spider-sotu", 6_045_379)
        == "spider-sotu"
    )
    named = SimpleNamespace(preset="small", model_name="spider-small-sotu-500steps")
    assert release_model_name(named, "me/spider-sotu", 6_045_379) == "spider-small-sotu-500steps"


def test_sample_and_the_recipes_dense_baseline_reference(release, config, tmp_path):
    """The card shows a sample and, for the default recipe, the benchmark's dense-baseline
    comparison (labelled as the recipe's, not this run's measurement)."""
    from spider_training.model_card import reference_quality

    reference = reference_quality("small", "sotu")
    assert reference is not None and reference_quality("1b", "sotu") is None
    assert reference_quality("small", "sotu", path=tmp_path / "missing.json") is None
    text = write(
        release, config, sample={"prompt": "The state of", "text": " the Union is"}, reference=reference
    ).read_text()
    assert "```text\nThe state of the Union is\n```" in text
    assert (
        f"| `LlamaForCausalLM`, equal parameters and steps | {reference['llama_parameters']} | "
        f"{reference['llama_bits_per_byte']} |" in text
    )
    assert "not by this run" in text
    plain = write(release, config).read_text()
    assert "LlamaForCausalLM" not in plain and "```text" not in plain


def test_shipped_reference_matches_the_committed_benchmark(tmp_path):
    """hub_card/reference_quality.json is what experiments.quality_report derives from experiments/quality_results.json
    (``python -m experiments.quality --report experiments/quality_results.json --write_card_reference FILE``)."""
    from spider_training.model_card import REFERENCE_QUALITY
    from tests.helpers import run_module

    derived = tmp_path / "reference_quality.json"
    rows = ROOT / "experiments" / "quality_results.json"
    done = run_module("experiments.quality", "--report", rows, "--write_card_reference", derived)
    assert done.returncode == 0, done.stderr
    assert json.loads(REFERENCE_QUALITY.read_text()) == json.loads(derived.read_text())


def test_boundary_predictor_paragraph_follows_the_configured_teacher(release, config):
    """The architecture section says how the boundary predictor was trained: from the spacelike teacher (the small
    preset) or end to end under the rate hinge (the `1b` preset, tk-train.py's)."""
    taught = write(release, {**config, "boundary_teacher": "spacelike"}).read_text()
    assert "learns a\n   teacher segmentation (the byte after each word" in taught and "hinge loss" not in taught
    end_to_end = write(release, {**config, "boundary_teacher": None, "boundary_prior": 0.333}).read_text()
    assert "A hinge loss keeps the\n   boundary rate near 0.333 boundaries per byte." in end_to_end
    assert "teacher segmentation" not in end_to_end


def test_the_compute_map_is_shown_with_its_command_only_when_drawn(release, config):
    """With a held-out paragraph's map in the folder the card shows it, says what it shows and the command that drew
    it; without the file (or without a map) the card has no such line."""
    from spider_training.commands.compute_map import CARD_MAP_NAME

    assert CARD_MAP_NAME not in write(release, config, compute_map=CARD_MAP_NAME).read_text()  # named, not drawn
    (release / CARD_MAP_NAME).write_bytes(b"\x89PNG\r\n\x1a\n")
    text = write(release, config, compute_map=CARD_MAP_NAME).read_text()
    assert f"]({CARD_MAP_NAME})" in text and "each colour is one segment" in text
    assert f"python -m spider_training.commands.compute_map {REPO} --file paragraph.txt" in text
    assert CARD_MAP_NAME not in write(release, config).read_text()


def test_generation_speed_reference_for_its_preset(release, config, tmp_path):
    """The card shows bench.generation's speed table for the preset it was measured on (labelled as the preset's
    reference, not this run's), and nothing for another preset or without the file."""
    from spider_training.model_card import reference_generation

    reference = reference_generation("small")
    assert reference is not None and reference_generation("1b") is None
    assert reference_generation("small", path=tmp_path / "missing.json") is None
    text = write(release, config, generation_reference=reference).read_text()
    assert "Generation speed (measured by `bench/generation.py` for the `small` preset" in text
    for row in reference["rows"]:
        assert f"| {row['model']} | {row['cache']} | {row['bytes_per_s']} |" in text
    assert any("SpiderStaticCache" in row["cache"] for row in reference["rows"])
    assert "Generation speed" not in write(release, config).read_text()


def test_shipped_generation_reference_matches_the_committed_benchmark(tmp_path):
    """hub_card/reference_generation.json is what ``python -m bench.generation --write_card_reference
    bench/generation_cpu.json FILE`` derives from the committed full run."""
    from spider_training.model_card import REFERENCE_GENERATION
    from tests.helpers import run_module

    derived = tmp_path / "reference_generation.json"
    done = run_module("bench.generation", "--write_card_reference", ROOT / "bench" / "generation_cpu.json", derived)
    assert done.returncode == 0, done.stderr
    assert json.loads(derived.read_text()) == json.loads(REFERENCE_GENERATION.read_text())
