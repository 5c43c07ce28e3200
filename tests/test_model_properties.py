"""Property-based tests of the model's forward pass (hypothesis), on the tiny preset in eval mode.

For any id tensor in range -- batch 1-3, length 1-64, ids in [0, 272), optionally left-padded with an attention mask --
and any ``n_loops`` in 1..4, ``SpiderForConditionalGeneration`` returns finite logits of shape ``(B, L, 272)``, and
with labels (padding labelled -100) a finite scalar loss. Left padding must not change a row's real positions: the
logits of a padded row equal those of the same row alone. The tokenizer's round-trip properties live in
``tests/test_tokenization_spider.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.helpers import float_tol, model_terms, tiny_model

VOCAB = 272
PAD = 256

# built once: hypothesis runs each test body many times, and function-scoped fixtures are not reset between examples
MODEL = tiny_model(seed=0).eval()

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


@st.composite
def batches(draw):
    """``(input_ids int64 [B, L], attention_mask int64 [B, L] or None)``: ids in [0, 272); with a mask, each row has
    ``pad_b`` leading PAD tokens (mask 0) and at least one real token."""
    b = draw(st.integers(1, 3))
    length = draw(st.integers(1, 64))
    rows = draw(
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length), min_size=b, max_size=b)
    )
    ids = torch.tensor(rows, dtype=torch.long)
    if not draw(st.booleans()):
        return ids, None
    pads = draw(st.lists(st.integers(0, length - 1), min_size=b, max_size=b))
    mask = torch.ones(b, length, dtype=torch.long)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
        ids[i, :p] = PAD
    return ids, mask


@SETTINGS
@given(batch=batches(), n_loops=st.integers(1, 4))
def test_forward_logits_finite_and_shaped(batch, n_loops):
    ids, mask = batch
    with torch.no_grad():
        out = MODEL(ids, attention_mask=mask, n_loops=n_loops)
    assert out.logits.shape == (*ids.shape, VOCAB)
    assert torch.isfinite(out.logits).all()
    for name in ("aux_loss", "boundary_loss", "ponder_loss"):
        assert torch.isfinite(getattr(out, name)).all(), name


@SETTINGS
@given(batch=batches(), n_loops=st.integers(1, 4))
def test_loss_finite_with_labels(batch, n_loops):
    ids, mask = batch
    labels = ids.clone()
    if mask is not None:
        labels[mask == 0] = -100
    assume((labels[:, 1:] != -100).any())  # at least one target after the shift; none: see the test below
    with torch.no_grad():
        out = MODEL(ids, attention_mask=mask, labels=labels, n_loops=n_loops)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert torch.isfinite(out.lm_loss) and out.lm_loss > 0


@pytest.mark.parametrize("ids, labels", [([[65]], [[65]]), ([[257, 65, 66]], [[-100, -100, -100]])])
def test_loss_without_any_target_is_finite(ids, labels):
    with torch.no_grad():
        out = MODEL(torch.tensor(ids), labels=torch.tensor(labels))
    assert torch.isfinite(out.loss)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(row=st.lists(st.integers(0, 255), min_size=1, max_size=40), pad=st.integers(1, 16), n_loops=st.integers(1, 4))
def test_left_padding_leaves_the_real_tokens_unchanged(row, pad, n_loops):
    alone = torch.tensor([row])
    padded = torch.tensor([[PAD] * pad + row])
    mask = torch.tensor([[0] * pad + [1] * len(row)])
    with torch.no_grad():
        a = MODEL(alone, n_loops=n_loops).logits
        b = MODEL(padded, attention_mask=mask, n_loops=n_loops).logits
    torch.testing.assert_close(b[:, pad:], a, **float_tol(a, model_terms(MODEL)))
