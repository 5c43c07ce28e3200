"""Tests of spider_training/commands/compute_map.py: the map agrees with the forward pass it was read from (boundaries,
segments, ACT loops and weights, routed experts), padded batches, the HTML and PNG the command writes, bad input."""

from __future__ import annotations

import html
import re

import pytest
import torch

from spider_training.commands.compute_map import (
    PALETTE,
    compute_map,
    encode,
    held_out_paragraph,
    main,
    render_html,
    row_segments,
    write_card_map,
)
from tests.helpers import float_tol, save_tiny_release, tiny_model
from tokenization_spider import SpiderTokenizer

TEXT = "héllo wörld — 日本語 🕷️ the quick brown fox jumps over the lazy dog, twice: the quick brown fox."


def varied_halting_model(**overrides):
    """A tiny model whose halting predictor is scaled up, so that segments halt after different numbers of loops."""
    model = tiny_model(**overrides).eval()
    with torch.no_grad():
        model.model.recurrent_block.halt_predictor.weight.normal_(0.0, 0.5)
    return model


def mapped_with_output(model, input_ids, attention_mask=None, n_loops=None):
    """`(map, output)`: the map and the base model's output of the very forward the map was read from."""
    seen = []
    handle = model.model.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        cmap = compute_map(model, input_ids, attention_mask, n_loops)
    finally:
        handle.remove()
    assert len(seen) == 1, "compute_map must run exactly one forward"
    return cmap, seen[0]


def segments_by_hand(boundaries: list[float], mask: list[bool]) -> tuple[list[int], list[int]]:
    """Segment holding each byte (1-based, -1 padding) and segment each byte reads, by walking the bytes."""
    holding, reading, closed = [], [], 0
    for b, real in zip(boundaries, mask):
        if not real:
            holding.append(-1)
            reading.append(-1)
            continue
        holding.append(closed + 1)
        closed += int(b > 0.5)
        reading.append(closed)
    return holding, reading


def routed_rows_by_hand(segment_mask, halting_step, loop: int, early_exit: bool) -> list[tuple[int, int]]:
    """The (row, segment) pairs the MoE routed at `loop`, in the forward's flattened order."""
    B, S1 = segment_mask.shape
    return [
        (b, s)
        for b in range(B)
        for s in range(S1)
        if segment_mask[b, s] and (not early_exit or loop == 0 or halting_step[b, s] > loop)
    ]


def check_against_forward(cmap, out, model, attention_mask, early_exit: bool, n_loops: int):
    """Every field of `cmap` against the forward's own output `out`, recomputed independently."""
    B, L = out.boundaries.shape
    mask = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    assert torch.equal(cmap.boundaries, out.boundaries > 0.5)
    assert torch.equal(cmap.boundary_probs, out.boundary_probs)
    assert not cmap.boundaries[~mask].any()
    for b in range(B):
        holding, reading = segments_by_hand(out.boundaries[b].tolist(), mask[b].tolist())
        assert cmap.segment_ids[b].tolist() == holding
        assert cmap.read_segment_ids[b].tolist() == reading
        closed = int(out.boundaries[b].sum())
        assert cmap.segment_mask[b].tolist() == [s <= closed for s in range(cmap.segment_mask.shape[1])]
    assert torch.equal(cmap.segment_mask, out.segment_mask > 0.5)
    real = cmap.segment_mask
    assert torch.equal(cmap.halting_step[real], out.halting_step[real].long())
    assert (cmap.halting_step[~real] == 0).all()

    # ACT: one weight per loop run; a real segment's weights sum to 1 and are 0 from its halting step on
    T = cmap.loop_weights.shape[-1]
    assert T == (int(cmap.halting_step.max()) if early_exit else n_loops)
    torch.testing.assert_close(cmap.loop_weights.sum(-1)[real], torch.ones(int(real.sum())))
    after_halting = torch.arange(T) >= cmap.halting_step[..., None]
    assert (cmap.loop_weights[after_halting] == 0).all()

    # experts: an independent top-k of the forward's router logits, placed on the rows it routed
    R, k, E = model.config.num_recurrent_layers, model.config.num_experts_per_tok, model.config.n_routed_experts
    assert len(out.router_logits) == T * R
    for t in range(T):
        rows = routed_rows_by_hand(cmap.segment_mask, cmap.halting_step, t, early_exit)
        for i in range(R):
            logits = out.router_logits[t * R + i]
            assert logits.shape == (len(rows), E)
            weights, ids = logits.softmax(-1).topk(k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            got_ids = torch.stack([cmap.experts[b, s, t, i] for b, s in rows])
            got_weights = torch.stack([cmap.expert_weights[b, s, t, i] for b, s in rows])
            assert torch.equal(got_ids, ids)
            torch.testing.assert_close(got_weights, weights)
            # the forward's own load statistic (DeepSeek's f_i) counts exactly these experts
            counts = torch.bincount(got_ids.reshape(-1), minlength=E).float()
            torch.testing.assert_close(out.expert_loads[t * R + i], counts * E / (len(rows) * k))
            routed = torch.zeros_like(cmap.segment_mask)
            for b, s in rows:
                routed[b, s] = True
            assert (cmap.experts[:, :, t, i][~routed] == -1).all()
            assert (cmap.expert_weights[:, :, t, i][~routed] == 0).all()


@pytest.mark.parametrize("early_exit", [False, True])
def test_map_agrees_with_the_forward_it_was_read_from(early_exit):
    model = varied_halting_model(act_early_exit=early_exit)
    ids = encode(TEXT, model)
    cmap, out = mapped_with_output(model, ids, n_loops=4)
    assert int(cmap.closed_segments[0]) >= 5  # the check below is about real segmentation, not one segment
    assert len(set(cmap.halting_step[0].tolist())) > 1, "the halting steps should differ between segments"
    check_against_forward(cmap, out, model, None, early_exit, n_loops=4)
    assert model.training is False and not model.model.recurrent_block.halting_step._forward_hooks


def test_the_model_call_returns_what_the_map_shows():
    """One call on the model is the map's source too: `model(ids, output_router_logits=True)` returns per byte the
    boundaries and their probabilities, per segment the loops ACT ran and each loop's weight, and the router logits
    per (loop, layer) -- equal to the map compute_map reads from the same kind of call."""
    model = varied_halting_model().eval()
    ids = encode(TEXT, model)
    cmap = compute_map(model, ids, n_loops=4)
    with torch.no_grad():
        out = model(ids, n_loops=4, output_router_logits=True)
    mask = out.segment_mask > 0.5
    assert torch.equal(mask, cmap.segment_mask)
    assert torch.equal(out.boundaries > 0.5, cmap.boundaries)
    assert torch.equal(out.boundary_probs, cmap.boundary_probs)
    assert torch.equal(out.halting_step.round().long() * mask, cmap.halting_step)
    assert out.loop_weights.shape == (*mask.shape, 4)
    assert torch.equal(out.loop_weights * mask[..., None], cmap.loop_weights)
    torch.testing.assert_close(out.loop_weights.sum(-1)[mask], torch.ones(int(mask.sum())))
    assert len(out.router_logits) == 4 * model.config.num_recurrent_layers
    assert model(ids, n_loops=4).loop_weights is None  # only asked for with the router logits


def test_left_padded_batch():
    model = varied_halting_model()
    tok = SpiderTokenizer()
    batch = tok(["a short row", TEXT], padding=True, padding_side="left", return_tensors="pt")
    cmap, out = mapped_with_output(model, batch["input_ids"], batch["attention_mask"], n_loops=3)
    assert not cmap.segment_mask.all()  # the short row's segment axis is padded
    check_against_forward(cmap, out, model, batch["attention_mask"], early_exit=False, n_loops=3)
    # the padded row maps as it would alone (left padding is invisible to the model up to float rounding)
    alone = compute_map(model, tok(["a short row"], return_tensors="pt")["input_ids"], n_loops=3)
    real = batch["attention_mask"][0].bool()
    torch.testing.assert_close(
        cmap.boundary_probs[0, real],
        alone.boundary_probs[0],
        **float_tol(alone.boundary_probs, model.config.hidden_size * 2),
    )


def test_training_mode_is_restored_and_map_is_in_eval():
    model = tiny_model().train()
    ids = encode("abc def ghi", model)
    first, second = compute_map(model, ids), compute_map(model, ids)
    assert model.training
    assert torch.equal(first.boundaries, second.boundaries)  # eval: deterministic, no sampled boundaries


def test_segments_render_characters_split_by_boundaries():
    # a boundary every other byte splits every multi-byte character
    model = tiny_model(boundary_mode="fixed", boundary_prior=0.5)
    cmap = compute_map(model, encode(TEXT, model))
    segments = row_segments(cmap)
    assert segments[0].index == 0 and segments[0].text == "∅"
    assert "".join(s.text for s in segments[1:]) == "⟨s⟩" + TEXT
    assert all("\ufffd" not in s.text for s in segments)
    assert sum(1 for s in segments if s.text == "") > 0  # the segments holding only a character's first bytes


def test_html_has_one_colour_class_per_segment():
    model = varied_halting_model()
    cmap = compute_map(model, encode(TEXT + " <b>&amp;</b>", model))
    page = render_html(cmap)
    spans = re.findall(r'<span class="(c\d+)[^"]*" data-i="(\d+)">', page)
    assert [int(i) for _, i in spans] == list(range(int(cmap.closed_segments[0]) + 1))
    assert all(a != b for (a, _), (b, _) in zip(spans, spans[1:]))  # neighbours differ
    body = page.split("<div id='t'>", 1)[1].split("</div>", 1)[0]
    assert "<b>" not in body  # the text is escaped, not markup
    assert html.unescape(re.sub(r"<[^>]+>", "", body)) == "∅⟨s⟩" + TEXT + " <b>&amp;</b>"
    assert "http" not in page and "<link" not in page and " src=" not in page  # self-contained


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny release folder that reads 2 KB texts."""
    return save_tiny_release(tmp_path_factory.mktemp("release"), max_position_embeddings=2048)


def test_command_writes_html_and_png(release, tmp_path):
    from PIL import Image

    words = ["state", "union", "nation", "people", "страна", "日本"]
    text = " ".join(words[i % len(words)] for i in range(400)).encode()[:2040].decode("utf-8", "ignore")
    source = tmp_path / "text.txt"
    source.write_text(text, encoding="utf-8")
    page, picture = main([str(release), "--file", str(source), "--n_loops", "3", "--out", str(tmp_path / "m")])
    assert page == tmp_path / "m.html" and picture == tmp_path / "m.png"
    source_html = page.read_text(encoding="utf-8")
    assert page.stat().st_size < 200_000
    shown = html.unescape(re.sub(r"<[^>]+>", "", source_html.split("<div id='t'>", 1)[1].split("</div>", 1)[0]))
    assert shown == "∅⟨s⟩" + text and all(word in shown for word in words)
    classes = re.findall(r'<span class="c(\d+)[^"]*" data-i="(\d+)"', source_html)
    assert len(classes) > 10 and [int(i) for _, i in classes] == list(range(len(classes)))
    assert all(int(c) == int(i) % len(PALETTE) for c, i in classes)
    with Image.open(picture) as image:
        assert image.width > 400 and image.height > 200
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > len(PALETTE)


def test_command_errors_name_the_problem(release, tmp_path, capsys):
    cases = [
        ([str(release), "--file", str(tmp_path / "missing.txt")], "missing.txt: no such file"),
        ([str(release), "--text", ""], "empty"),
        ([str(tmp_path / "no_release"), "--text", "hi"], "no_release"),
        ([str(tmp_path), "--text", "hi"], "holds no config.json"),
        ([str(release), "--text", "x" * 2048], "at most 2047"),
        ([str(release)], "one of the arguments --text --file is required"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(TypeError, match="input_ids must be a torch.LongTensor"):
        compute_map(model, [[257, 104]])
    with pytest.raises(ValueError, match="empty"):
        encode("", model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compute_map(model, torch.tensor([[257, 999]]))


def test_write_card_map(release, tmp_path):
    from PIL import Image

    path = write_card_map(release, "A held-out paragraph about the state of the union.")
    assert path == release / "compute_map.png"
    with Image.open(path) as image:
        assert image.width > 400
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_card_map(tmp_path / "nowhere", "text")


def test_held_out_paragraph_picks_a_paragraph_from_the_eval_windows():
    text = "Mr. Speaker.\n\n" + "We gather tonight to speak of the union. " * 30 + "\n\nEnd."
    window = {"input_ids": torch.tensor([257, *text.encode()[:900]])}
    paragraph = held_out_paragraph([window])
    assert paragraph.startswith("We gather tonight") and len(paragraph.encode()) <= 600
    assert paragraph in text and text[text.index(paragraph) + len(paragraph)] == " "  # cut between words
    assert held_out_paragraph(None) is None and held_out_paragraph([]) is None
