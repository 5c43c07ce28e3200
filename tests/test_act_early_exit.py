"""ACT early exit at inference (`SpiderConfig.act_early_exit`): halted segments skip the rest of the loops.

Each test sets the halt predictor by hand so that the case it claims happens (no segment halts early, every segment
halts at the first loop, segments halting at different loops), then compares with the path it must equal.
"""

import torch

from tests.helpers import float_tol, model_terms, tiny_model

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=256)


def _model(bias: float, weight_std: float = 0.0, n_loops: int = 4, early_exit: bool = True, seed: int = 1):
    model = tiny_model(seed=seed, n_loops=n_loops, act_early_exit=early_exit).eval()
    halt = model.model.recurrent_block.halt_predictor
    with torch.no_grad():
        halt.bias.fill_(bias)
        halt.weight.normal_(0.0, weight_std, generator=torch.Generator().manual_seed(0))
    return model


def _ids(batch=2, length=60, seed=2):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _count_moe_rows(model) -> list[int]:
    rows = []
    for layer in model.model.recurrent_block.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    return rows


def test_flag_changes_nothing_when_no_segment_halts_early_or_in_training():
    ids = _ids()
    on, off = _model(-20.0), _model(-20.0, early_exit=False)  # p ~ 2e-9: every segment runs every loop
    with torch.no_grad():
        out_on, out_off = on(ids), off(ids)
    assert torch.equal(out_on.logits, out_off.logits)
    assert float(out_on.mean_halting_step) == 4.0
    on.train(), off.train()
    torch.manual_seed(0)
    train_on = on(ids, labels=ids).loss
    torch.manual_seed(0)
    assert torch.equal(train_on, off(ids, labels=ids).loss)


def test_segments_halting_at_the_first_loop_skip_the_others():
    """p ~ 1 at the first loop: the output is the one-loop model's, and the MoE runs for the first loop only."""
    ids = _ids()
    model = _model(20.0)
    rows = _count_moe_rows(model)
    with torch.no_grad():
        out = model(ids)  # with a cache (eval default): every loop's attention runs, the MoE only in the first
        assert len(rows) == model.config.num_recurrent_layers
        rows.clear()
        assert torch.equal(model(ids, use_cache=False).logits, out.logits)  # without: loops 2..4 are skipped
        assert len(rows) == model.config.num_recurrent_layers
        one_loop = model(ids, n_loops=1)
    assert float(out.mean_halting_step) == 1.0
    torch.testing.assert_close(out.logits, one_loop.logits, **float_tol(out.logits, model_terms(model)))
    off = _model(20.0, early_exit=False)
    rows_off = _count_moe_rows(off)
    with torch.no_grad():
        torch.testing.assert_close(off(ids).logits, out.logits, **float_tol(out.logits, model_terms(model)))
    assert len(rows_off) == 4 * model.config.num_recurrent_layers


def test_cached_decoding_follows_the_same_exit_rule():
    """Segments halting at different loops: fewer rows reach the MoE in later loops, and cached decoding (one
    segment at a time) gives the full forward's logits and greedy generation."""
    model = _model(0.5, weight_std=2.0)
    ids = _ids()
    rows = _count_moe_rows(model)
    with torch.no_grad():
        full = model(ids)
        prefill = model(ids[:, :30], use_cache=True)
        step = model(ids[:, 30:], cache=prefill.cache)
    steps = float(full.mean_halting_step)
    assert 1.0 < steps < 4.0
    per_loop = rows[: 4 * model.config.num_recurrent_layers : model.config.num_recurrent_layers]
    assert per_loop[0] > per_loop[-1]  # halted segments left the MoE
    tol = float_tol(full.logits, model_terms(model))
    torch.testing.assert_close(prefill.logits, full.logits[:, :30], **tol)
    torch.testing.assert_close(step.logits, full.logits[:, 30:], **tol)
    prompt = ids[:1, :24]
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, **GREEDY)
    assert torch.equal(
        model.generate(prompt, use_cache=True, **kwargs), model.generate(prompt, use_cache=False, **kwargs)
    )


def test_halt_bias_init_reaches_the_halt_predictor():
    """`halt_bias_init` sets the halt predictor's bias at initialisation (transformers initialises only modules with
    parameters of their own, which the recurrent block is not), so a large negative value gives a fixed loop count."""
    for bias in (-10.0, 0.0, 2.5):
        model = tiny_model(seed=0, halt_bias_init=bias)
        assert torch.equal(model.model.recurrent_block.halt_predictor.bias, torch.full((1,), bias))
    with torch.no_grad():
        out = tiny_model(seed=0, halt_bias_init=-10.0, n_loops=3).eval()(_ids())
    assert float(out.mean_halting_step) == 3.0
