"""Inputs past the model's range and the bf16 state update."""

import pytest
import torch

from tests.helpers import tiny_model


def test_generation_past_max_position_embeddings_is_refused_with_and_without_cache():
    model = tiny_model(seed=0, max_position_embeddings=48).eval()
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=256, max_new_tokens=20, min_new_tokens=20)
    with pytest.raises(ValueError, match="max_position_embeddings=48"):
        model.generate(prompt, use_cache=True, **greedy)
    with pytest.raises(ValueError, match="max_position_embeddings=48"):
        model.generate(prompt, use_cache=False, **greedy)
    # up to the limit both paths generate
    ok = dict(greedy, max_new_tokens=8, min_new_tokens=8)
    assert torch.equal(model.generate(prompt, use_cache=True, **ok), model.generate(prompt, use_cache=False, **ok))


def test_bf16_state_update_keeps_a_decay_close_to_one():
    model = tiny_model(seed=0)
    injection = model.model.recurrent_block.injection
    with torch.no_grad():
        injection.log_A.fill_(-9.0)  # A = exp(-exp(log_dt - 9)) = 1 - 8.6e-5, which bf16 rounds to exactly 1
        injection.B.zero_()
    A = injection.decay()
    assert A.to(torch.bfloat16).eq(1).all() and (A < 1).all()
    h = torch.ones(1, 2, model.config.hidden_size, dtype=torch.bfloat16)
    z = -h  # the state minus its decayed self: what a bf16 decay of 1 turns into exactly 0
    out = injection(h, torch.zeros_like(h), z)
    assert out.dtype == torch.bfloat16
    expected = (A * h.float() + z.float()).to(torch.bfloat16)  # fp32 arithmetic, one rounding at the end
    assert torch.equal(out, expected)
    assert (out < 0).all()  # -8.6e-5, not the 0 that A rounded to bf16 gives
