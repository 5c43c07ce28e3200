"""Attention goes through transformers' attention interface: `attn_implementation` picks the function that runs."""

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.helpers import float_tol, model_terms, tiny_model

CALLS = []


def counting_attention(module, *args, **kwargs):
    """A user-registered attention function: records which layer called it, then runs transformers' sdpa."""
    CALLS.append(module.layer_idx)
    return sdpa_attention_forward(module, *args, **kwargs)


AttentionInterface.register("spider_test_counting", counting_attention)


def _inputs():
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the masks are real (padding, sliding window) on every path
    return ids, mask


def test_eager_sdpa_and_a_registered_function_give_the_same_logits():
    model = tiny_model(seed=0, sliding_window=4).eval()
    ids, mask = _inputs()
    logits = {}
    for implementation in ("sdpa", "eager", "spider_test_counting"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        CALLS.clear()
        with torch.no_grad():
            logits[implementation] = model(ids, attention_mask=mask).logits
        if implementation == "spider_test_counting":
            config = model.config
            # every attention layer, the recurrent ones once per loop
            assert (
                len(CALLS)
                == config.num_prelude_layers + config.num_recurrent_layers * config.n_loops + config.num_coda_layers
            )
    tol = float_tol(logits["sdpa"], terms=model_terms(model))
    torch.testing.assert_close(logits["eager"], logits["sdpa"], **tol)
    assert torch.equal(logits["spider_test_counting"], logits["sdpa"])


def test_cached_generation_is_the_same_with_eager_attention():
    model = tiny_model(seed=1).eval()
    prompt = torch.tensor([[257, *b"Four score and"]])
    greedy = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=256)
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(prompt, **greedy)
    assert torch.equal(outputs["eager"], outputs["sdpa"])


def test_from_pretrained_uses_the_requested_implementation(tmp_path):
    tiny_model(seed=2).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, attn_implementation="spider_test_counting"
    )
    CALLS.clear()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    assert model.config._attn_implementation == "spider_test_counting" and CALLS


@pytest.mark.parametrize("window", [{}, {"sliding_window": 4, "recurrent_sliding_window": 2}])
def test_flex_attention_gives_the_sdpa_logits_and_decodes_the_same(window):
    """`attn_implementation="flex_attention"` runs on CPU: its masks are `BlockMask`s built by masking_utils from the
    same mask functions (padding, sliding windows), so a padded batch gets SDPA's logits, and a cached greedy decode
    the same bytes as SDPA's. Every shape compiles static here: torch 2.13's CPU inductor fails to compile flex
    attention for the dynamic shapes it switches to after a few lengths (`cur_qSplitSize2` undeclared in its C++).
    dynamo's own `config.patch` restores the setting (pytest 9.2's monkeypatch deletes it from dynamo's config)."""
    model = tiny_model(seed=0, **window).eval()
    ids, mask = _inputs()
    with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        sdpa = model(ids, attention_mask=mask).logits
        sdpa_bytes = model.generate(ids[:1, :12], max_new_tokens=3, do_sample=False)
        model.set_attn_implementation("flex_attention")
        flex = model(ids, attention_mask=mask).logits
        flex_bytes = model.generate(ids[:1, :12], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(flex, sdpa, **float_tol(sdpa, terms=model_terms(model)))
    assert torch.equal(flex_bytes, sdpa_bytes)


def test_output_attentions_returns_the_eager_weights():
    """eager: one weight tensor per attention call (prelude, each loop of each recurrent layer, coda), softmax rows
    that sum to 1 over the keys a query may see (causal, inside the 4-byte window, never a padded byte); the logits
    are those of a call without output_attentions. sdpa computes no weights and returns none."""
    model = tiny_model(seed=0, sliding_window=4).eval()
    model.set_attn_implementation("eager")
    ids, mask = _inputs()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        plain = model(ids, attention_mask=mask)
        segments = model.model(ids, attention_mask=mask).boundaries.sum(1).max().int().item() + 1
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    config = model.config
    byte_calls = config.num_prelude_layers + config.num_coda_layers
    assert len(out.attentions) == byte_calls + config.num_recurrent_layers * config.n_loops
    byte_weights = [out.attentions[0], out.attentions[-1]]  # a prelude and a coda layer
    recurrent_weights = out.attentions[1:-1]
    H, L = config.num_attention_heads, ids.shape[1]
    tol = float_tol(out.attentions[0], terms=L)
    for weights in byte_weights:
        assert weights.shape == (2, H, L, L)
        query, key = torch.arange(L)[:, None], torch.arange(L)[None]
        outside = (key > query) | (key <= query - 4)  # causal 4-byte window (row 0 has no padding)
        assert bool((weights[0][:, outside] == 0).all())
        assert bool((weights[1][:, :, :7] == 0)[:, 7:].all())  # row 1's real bytes never attend its left padding
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(H, L), **tol)
    for weights in recurrent_weights:
        assert weights.shape == (2, H, segments, segments)
        assert bool((weights.triu(1) == 0).all())  # causal over segments
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert model(ids, attention_mask=mask, output_attentions=True).attentions == ()
