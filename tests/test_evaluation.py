"""spider_training.evaluation (held-out bits per byte, by the kind of byte predicted, the evaluation-time probes, the
real-word rate of samples) and ``spider-evaluate``, its command, run on a tiny saved release."""

import json
import math
import re

import pytest
import torch

from spider_training import evaluation
from spider_training.commands.evaluate import main
from tests.helpers import save_tiny_release, tiny_model


def test_evaluation_boundary_rules_change_only_the_decision_and_are_undone():
    model = tiny_model(seed=0).eval()
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    plain = evaluation.score(model, ids)
    matched = evaluation.score_with_boundary_rule(model, ids, "rate-matched", 5.0)
    assert matched["bytes_per_segment"] == pytest.approx(5.0, rel=0.25)  # the requested rate, up to quantile ties
    sampled = evaluation.score_with_boundary_rule(model, ids, "sampled", None)
    assert math.isfinite(sampled["bits_per_byte"])
    assert evaluation.score(model, ids) == plain  # the predictor's own forward is back


def test_sample_words_counts_words_of_the_training_text():
    model = tiny_model(seed=0)
    train_ids = torch.tensor(list(b"the state of the union is strong ")).numpy()
    result = evaluation.sample_words(model, train_ids, n_samples=1, new_bytes=40)
    assert result["sample"].startswith(evaluation.SAMPLE_PROMPT)
    words = re.findall(r"[A-Za-z]+", result["sample"][len(evaluation.SAMPLE_PROMPT) :])
    vocabulary = {"the", "state", "of", "union", "is", "strong"}
    expected = sum(w.lower() in vocabulary for w in words) / max(1, len(words))
    assert result["real_word_rate"] == pytest.approx(expected)


def test_byte_kinds_place_every_predicted_byte_in_its_word():
    windows = torch.tensor([list(b"xx, a word!  ok")])
    kinds = evaluation.byte_kinds(windows)[0].tolist()  # predicted bytes: windows[:, 1:] = "x, a word!  ok"
    #       x  ,  ' ' a  ' ' w  o  r  d  !  ' ' ' ' o  k
    assert kinds == [2, 0, 0, 1, 0, 1, 2, 3, 4, 0, 0, 0, 1, 2]
    long_word = torch.tensor([list(b" abcdefg")])
    assert evaluation.byte_kinds(long_word)[0].tolist() == [1, 2, 3, 4, 5, 5, 5]  # the 5th byte on share one kind


def test_score_by_byte_kind_splits_the_same_total():
    model = tiny_model(seed=0).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 3)
    plain = evaluation.score(model, ids)
    split = evaluation.score(model, ids, by_byte_kind=True)
    assert split["bits_per_byte"] == plain["bits_per_byte"]  # the headline number is computed as before
    shares, bpb = split["byte_kind_shares"], split["bits_per_byte_by_byte_kind"]
    assert set(shares) == set(bpb) == set(evaluation.BYTE_KINDS) and sum(shares.values()) == pytest.approx(1.0)
    # the kinds' bits, weighted by their shares, add up to the total (fp64 sums of fp32 per-byte losses over
    # ids.numel() bytes: a relative tolerance of fp32's epsilon times the count)
    total = sum(shares[k] * bpb[k] for k in evaluation.BYTE_KINDS)
    assert total == pytest.approx(plain["bits_per_byte"], rel=torch.finfo(torch.float32).eps * ids.numel())


@pytest.mark.parametrize("probe", list(evaluation.GLOBAL_STREAM_PROBES))
def test_global_stream_probes_change_only_what_the_bytes_read_and_are_undone(probe):
    # a segment closes every 4 bytes (at positions 3, 7, ...); the tiny preset's global stream reaches the output at
    # initialisation
    model = tiny_model(seed=0, boundary_mode="fixed", boundary_prior=0.25).eval()
    ids = torch.tensor([list(b"the state of the union is strong, and we are here. ")] * 2)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with evaluation._GlobalStreamProbe(model, probe):
            probed = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(after, plain)  # the class's global_stream is back
    assert not torch.equal(probed, plain)
    if probe != "removed":  # bytes 0-2, before the first boundary, read the null segment's stream in both: no change
        assert torch.equal(probed[:, :3], plain[:, :3]) and not torch.equal(probed[:, 3:], plain[:, 3:])


def test_heldout_windows_and_text_files_refuse_what_cannot_be_scored(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        evaluation.text_file_ids(str(tmp_path / "missing.txt"))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="blank.txt"):
        evaluation.text_file_ids(str(tmp_path / "blank.txt"))
    with pytest.raises(ValueError, match="shorter than one window of 65 ids"):
        evaluation.heldout_windows(torch.arange(40).numpy(), seq_len=64)
    windows = evaluation.heldout_windows(torch.arange(1000).numpy(), seq_len=64, slice_bytes=300, start_fraction=0.5)
    assert windows.shape == (4, 65) and windows[0, 0] == 500 and torch.equal(windows[1, 0], windows[0, -1])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny saved release (weights, config, the remote-code files, the tokenizer) of ``tiny_model(seed=0)``."""
    return save_tiny_release(tmp_path_factory.mktemp("release"), seed=0)


def test_command_scores_a_release_per_loop_count_as_the_library_does(release, tmp_path, capsys):
    """``spider-evaluate`` loads the folder through trust_remote_code and prints, per loop count asked, what
    :func:`spider_training.evaluation.score` gives the same weights on the same windows."""
    text = tmp_path / "speech.txt"
    text.write_text("The state of the union is strong, and the people of this nation are here. " * 12)
    result = main([str(release), "--text", str(text), "--n_loops", "1", "3", "--seq_len", "64", "--max_bytes", "600"])
    assert json.loads(capsys.readouterr().out) == result
    model = tiny_model(seed=0).eval()
    windows = evaluation.heldout_windows(evaluation.text_file_ids(str(text)), 64, slice_bytes=600, start_fraction=0)
    assert result["predicted_bytes"] == windows.shape[0] * 64 == 9 * 64 and result["text"] == str(text)
    assert set(result["n_loops"]) == {"1", "3"}
    for n, scored in result["n_loops"].items():
        expected = evaluation.score(model, windows, n_loops=int(n), by_byte_kind=True)
        assert scored["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-6)
        assert scored["bits_per_byte_by_byte_kind"] == pytest.approx(expected["bits_per_byte_by_byte_kind"], rel=1e-6)
        assert sum(scored["byte_kind_shares"].values()) == pytest.approx(1.0)
    assert result["n_loops"]["1"]["bits_per_byte"] != result["n_loops"]["3"]["bits_per_byte"]  # the count reached it
    # by default: the held-out SOTU slice, a third of the way in, at the release's own loop count
    default = main([str(release), "--seq_len", "64", "--max_bytes", "600"])
    windows = evaluation.heldout_windows(evaluation.corpus_bytes("eval"), 64, slice_bytes=600)
    assert list(default["n_loops"]) == [str(model.config.n_loops)]
    assert default["n_loops"][str(model.config.n_loops)]["bits_per_byte"] == pytest.approx(
        evaluation.score(model, windows)["bits_per_byte"], rel=1e-6
    )


def test_command_probes_are_what_the_results_tables_probe(release, capsys):
    """``spider-evaluate --probes`` adds :func:`spider_training.evaluation.probe_spider`'s figures (what
    experiments.quality records in every Spider row) for the same weights on the same windows, its rate-matched
    boundary rule at the release's own bytes per segment there; the config's ACT early exit is left off."""
    result = main([str(release), "--seq_len", "64", "--max_bytes", "600", "--probes"])
    assert json.loads(capsys.readouterr().out) == result
    model = tiny_model(seed=0).eval()
    windows = evaluation.heldout_windows(evaluation.corpus_bytes("eval"), 64, slice_bytes=600)
    expected = evaluation.probe_spider(model, windows, evaluation.score(model, windows)["bytes_per_segment"])
    n = model.config.n_loops
    assert set(result["probes"]["bpb_by_loops"]) == {str(c) for c in {1, max(1, n // 2), n, 2 * n}}
    assert set(result["probes"]["bpb_by_global_stream_probe"]) == set(evaluation.GLOBAL_STREAM_PROBES)
    assert set(result["probes"]) == set(expected) and model.config.act_early_exit is False
    for key in ("bpb_by_loops", "mean_halting_step", "act_early_exit"):
        assert result["probes"][key] == pytest.approx(expected[key], rel=1e-6)
    for key in ("bpb_by_global_stream_probe", "bpb_by_eval_boundary_rule"):
        for name, probed in expected.get(key, {}).items():
            assert result["probes"][key][name]["bits_per_byte"] == pytest.approx(probed["bits_per_byte"], rel=1e-6)


def test_command_errors_name_the_problem(release, tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    cases = [
        ([str(release), "--text", str(tmp_path / "missing.txt")], "missing.txt"),
        ([str(release), "--text", str(tmp_path / "short.txt")], "shorter than one window"),
        ([str(release), "--n_loops", "0"], "--n_loops must be at least 1"),
        ([str(tmp_path / "no_release"), "--text", str(tmp_path / "short.txt")], "no_release"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert message in str(exit_info.value.code)


def test_readme_commands_run_as_written(release, tmp_path, monkeypatch, capsys):
    """The README's ``spider-evaluate`` lines, with this test's release for ``runs/spider-small/release`` and a
    ``speech.txt`` in the working folder."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- recipe:evaluate -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert lines and all(argv[0] == "spider-evaluate" for argv in lines)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "speech.txt").write_text("The state of the union is strong. " * 20)
    for argv in lines:
        argv = [str(release) if a == "runs/spider-small/release" else a for a in argv[1:]]
        result = main(argv)
        assert json.loads(capsys.readouterr().out) == result
        asked = argv[argv.index("--n_loops") + 1 :] if "--n_loops" in argv else [str(tiny_model().config.n_loops)]
        assert list(result["n_loops"]) == asked
        assert all(0 < scored["bits_per_byte"] < 16 for scored in result["n_loops"].values())
