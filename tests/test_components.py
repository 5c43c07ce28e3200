"""Component tests of modeling_spider against independent references (docs/design.md, "The forward pass")."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configuration_spider import SpiderConfig
from modeling_spider import (
    ACTState,
    SpiderEngramEmbeddings,
    SpiderForConditionalGeneration,
    SpiderHaltingStep,
    SpiderLTIInjection,
    SpiderMLP,
    SpiderMoE,
    SpiderMoEKernels,
    SpiderShortConv,
    depthwise_conv1d,
    expand_segments,
    pool_segments,
)
from tests.helpers import float_tol, model_terms, tiny, tiny_model

REPO = Path(__file__).resolve().parents[1]


# --- FlexiTokens: pool_segments / expand_segments --------------------------------------------------------------


def test_pool_and_expand_segments_worked_example():
    # bytes:      0  1  2  3  4  5  6
    # boundary:   0  1  0  0  1  0  0   -> segments {0,1}, {2,3,4}; bytes 5,6 are the open tail (dropped)
    b = torch.tensor([[0.0, 1, 0, 0, 1, 0, 0]])
    h = torch.arange(7, dtype=torch.float32).view(1, 7, 1) * torch.tensor([1.0, 10.0])
    null = torch.tensor([-1.0, -2.0])
    seg, mask = pool_segments(b, h, null)
    expected = torch.tensor([[[-1.0, -2.0], [0.5, 5.0], [3.0, 30.0]]])
    torch.testing.assert_close(seg, expected)
    assert mask.tolist() == [[True, True, True]]
    # expand_segments: byte l reads the last segment closed at or before l
    up = expand_segments(b, seg)
    reads = [0, 1, 1, 1, 2, 2, 2]
    torch.testing.assert_close(up, seg[0, reads].unsqueeze(0))


def test_pool_segments_padding_and_ragged_rows():
    b = torch.tensor([[1.0, 0, 1, 1], [0.0, 0, 0, 1]])
    mask = torch.tensor([[True, True, True, True], [False, False, True, True]])
    h = torch.randn(2, 4, 3)
    seg, seg_mask = pool_segments(b, h, None, mask)
    assert seg.shape == (2, 4, 3)
    assert seg_mask.tolist() == [[True] * 4, [True, True, False, False]]
    torch.testing.assert_close(seg[0, 2], h[0, 1:3].mean(0))
    torch.testing.assert_close(seg[1, 1], h[1, 2:4].mean(0))  # padding bytes 0, 1 never enter the mean
    assert torch.equal(seg[1, 2:], torch.zeros(2, 3))


def test_pool_segments_of_concatenated_features_equals_separate_calls():
    """The model pools byte states and Engram memory in one call over both; it must equal pooling each alone."""
    torch.manual_seed(0)
    b = (torch.rand(3, 17) > 0.6).float()
    mask = torch.ones(3, 17, dtype=torch.bool)
    mask[1, :5] = False
    x, memory, null = torch.randn(3, 17, 4), torch.randn(3, 17, 6), torch.randn(4)
    joint, joint_mask = pool_segments(b, torch.cat([x, memory], -1), torch.cat([null, torch.zeros(6)]), mask)
    seg_x, mask_x = pool_segments(b, x, null, mask)
    seg_m, _ = pool_segments(b, memory, None, mask)
    assert torch.equal(joint_mask, mask_x)
    assert torch.equal(joint[..., :4], seg_x) and torch.equal(joint[..., 4:], seg_m)


def test_pool_segments_gradient_reaches_boundaries():
    logits = torch.zeros(1, 6, requires_grad=True)
    soft = torch.sigmoid(logits)
    hard = torch.tensor([[0.0, 1, 0, 1, 0, 1]])
    b = hard + soft - soft.detach()
    h = torch.randn(1, 6, 4)
    seg, _ = pool_segments(b, h, torch.zeros(4))
    expand_segments(b, seg).pow(2).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# --- causality, padding ------------------------------------------------------------------------------------------


def test_causality_in_eval():
    model = tiny_model().eval()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
        for k in (5, 20, 47):
            changed = ids.clone()
            changed[0, k] = (changed[0, k] + 101) % 256
            out = model(changed).logits
            torch.testing.assert_close(out[:, :k], base[:, :k], **float_tol(base, model_terms(model)))
            assert (out[:, k:] - base[:, k:]).abs().max() > 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_rows_alone(side):
    model = tiny_model().eval()
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, (1, 30), generator=g)
    b = torch.randint(0, 256, (1, 17), generator=g)
    pad = torch.full((1, 13), 256)
    row_b = torch.cat([pad, b], 1) if side == "left" else torch.cat([b, pad], 1)
    mask_b = (row_b != 256).long() if side == "left" else torch.cat([torch.ones(1, 17), torch.zeros(1, 13)], 1).long()
    with torch.no_grad():
        alone_a, alone_b = model(a).logits, model(b).logits
        both = model(torch.cat([a, row_b]), attention_mask=torch.cat([torch.ones(1, 30).long(), mask_b])).logits
    torch.testing.assert_close(both[0], alone_a[0], **float_tol(alone_a, model_terms(model)))
    got_b = both[1, 13:] if side == "left" else both[1, :17]
    torch.testing.assert_close(got_b, alone_b[0], **float_tol(alone_b, model_terms(model)))


def test_padding_gets_no_loss():
    model = tiny_model().eval()
    ids = torch.randint(0, 256, (1, 20))
    labels = ids.clone()
    padded_ids = torch.cat([ids, torch.full((1, 8), 256)], 1)
    padded_labels = torch.cat([labels, torch.full((1, 8), -100)], 1)
    mask = torch.cat([torch.ones(1, 20), torch.zeros(1, 8)], 1).long()
    with torch.no_grad():
        alone = model(ids, labels=labels).lm_loss
        padded = model(padded_ids, attention_mask=mask, labels=padded_labels).lm_loss
    torch.testing.assert_close(padded, alone, **float_tol(alone, model_terms(model)))


# --- recurrence: ACT, LTI --------------------------------------------------------------------------------------------


def _act_loops(probs: list[torch.Tensor], threshold: float) -> tuple[list[torch.Tensor], ACTState]:
    """Run `SpiderHaltingStep` over per-loop halting probabilities (as logits); returns each loop's weight and the
    final state."""
    step = SpiderHaltingStep()
    state = ACTState(*(torch.zeros_like(probs[0]) for _ in range(3)))
    h_out, weights = torch.zeros(*probs[0].shape, 1), []
    for t, p in enumerate(probs):
        h_out, state, w = step(
            torch.logit(p.double()).float(), torch.ones_like(h_out), h_out, state, threshold, t == len(probs) - 1
        )
        weights.append(w)
    return weights, state


@pytest.mark.parametrize("n_loops,threshold", [(1, 0.99), (4, 0.99), (7, 0.5), (12, 0.999)])
def test_act_weights_sum_to_one(n_loops, threshold):
    g = torch.Generator().manual_seed(n_loops)
    probs = [(torch.rand(3, 50, generator=g) ** 2).clamp(1e-3, 1 - 1e-3) for _ in range(n_loops)]
    weights, state = _act_loops(probs, threshold)
    assert all((w >= 0).all() for w in weights)
    torch.testing.assert_close(sum(weights), torch.ones(3, 50))
    assert ((state.n_updates >= 1) & (state.n_updates <= n_loops)).all()


def test_act_matches_reference_recursion():
    # independent scalar reference of Graves' ACT for one position
    ps, threshold = [0.3, 0.5, 0.4, 0.9], 0.99
    acc, weights = 0.0, []
    for t, p in enumerate(ps):
        if t == len(ps) - 1 or acc + p >= threshold:
            weights.append(1.0 - acc)
            break
        acc += p
        weights.append(p)
    got, state = _act_loops([torch.tensor([p]) for p in ps], threshold)
    got = [float(w) for w in got]
    assert got[: len(weights)] == pytest.approx(weights, rel=1e-5)
    assert sum(got) == pytest.approx(1.0)
    assert float(state.n_updates) == len(weights)


def test_halting_step_sums_the_loops_by_their_weights():
    """`SpiderHaltingStep`'s output is the sum of the loop states weighted by the weights it returns, and it adds no
    parameter to the checkpoint."""
    g = torch.Generator().manual_seed(0)
    B, S, D, n_loops, threshold = 2, 5, 8, 3, 0.9
    step = SpiderHaltingStep()
    state = ACTState(*(torch.zeros(B, S) for _ in range(3)))
    h_out = ref_out = torch.zeros(B, S, D)
    for t in range(n_loops):
        logits, h = torch.randn(B, S, generator=g), torch.randn(B, S, D, generator=g)
        h_out, state, weight = step(logits, h, h_out, state, threshold, t == n_loops - 1)
        ref_out = ref_out + weight[..., None] * h
        assert torch.equal(h_out, ref_out)
    assert not list(SpiderHaltingStep().parameters())  # nothing added to the checkpoint


def test_lti_decay_strictly_inside_unit_interval():
    lti = SpiderLTIInjection(tiny())
    for value in (-1e4, -50.0, -3.0, 0.0, 3.0, 50.0, 1e4):
        with torch.no_grad():
            lti.log_A.fill_(value)
            lti.log_dt.fill_(value / 2)
        A = lti.decay()
        assert ((A > 0) & (A < 1)).all(), value


# --- MoE -------------------------------------------------------------------------------------------------------------


def test_aux_fi_is_one_at_uniform_load():
    E, k = 8, 2
    topk_idx = torch.stack([torch.arange(16) % E, (torch.arange(16) + 3) % E], 1)
    f = SpiderMoEKernels.aux_fi(topk_idx, E, k)
    torch.testing.assert_close(f, torch.ones(E))
    uniform_scores = torch.full((16, E), 1.0 / E)
    assert float((f * uniform_scores.mean(0)).sum()) == pytest.approx(1.0)
    # all tokens on one expert: f = [E, 0, ...] and aux = E * P_0
    skewed = SpiderMoEKernels.aux_fi(torch.zeros(16, 1, dtype=torch.long), E, 1)
    assert skewed.tolist() == [E] + [0.0] * (E - 1)


def test_topk_ties_go_to_smaller_index():
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25], [0.4, 0.1, 0.4, 0.1]])
    assert SpiderMoEKernels.topk_gate(scores, 2).tolist() == [[1, 2], [0, 1], [0, 2]]
    # large random tie-heavy case against a pure-Python reference
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (300, 32), generator=g).float()
    got = SpiderMoEKernels.topk_gate(scores, 2).tolist()
    ref = [sorted(range(32), key=lambda e: (-row[e], e))[:2] for row in scores.tolist()]
    assert got == ref


def per_expert_mlps(moe: SpiderMoE) -> list[SpiderMLP]:
    """The routed experts in the per-expert layout of older releases: one :class:`SpiderMLP` per expert
    (``experts.{e}.gate_proj / up_proj / down_proj``), holding copies of the fused weights."""
    I = moe.experts.intermediate_dim
    mlps = []
    for e in range(moe.num_experts):
        mlp = SpiderMLP(moe.config, I).to(moe.experts.gate_up_proj.dtype)
        with torch.no_grad():
            mlp.gate_proj.weight.copy_(moe.experts.gate_up_proj[e, :I])
            mlp.up_proj.weight.copy_(moe.experts.gate_up_proj[e, I:])
            mlp.down_proj.weight.copy_(moe.experts.down_proj[e])
        mlps.append(mlp)
    return mlps


def per_expert_reference(moe: SpiderMoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output as the per-expert layout computed it (tk-train.py's masked loop, each expert an nn.Linear SwiGLU,
    fp32 accumulation), from the same weights: `(T, D)` in `x.dtype`."""
    scores = moe.route(x).softmax(-1)
    topk_idx = SpiderMoEKernels.topk_gate(scores, moe.top_k)
    weights = SpiderMoEKernels.normalize_weight(scores.gather(1, topk_idx))[1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, expert in enumerate(per_expert_mlps(moe)):
        token_idx, slot = torch.where(topk_idx == e)
        out.index_add_(0, token_idx, (expert(x[token_idx]) * weights[token_idx, slot, None]).to(torch.float32))
    out = out.to(x.dtype)
    return out + moe.shared_experts(x) if moe.shared_experts is not None else out


def test_fused_experts_match_the_per_expert_layout():
    """Fused 3-D experts (every implementation) give the per-expert nn.Linear layout's output from the same weights."""
    torch.manual_seed(0)
    moe = SpiderMoE(tiny())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert moe.experts.gate_up_proj.shape == (8, 2 * 32, 64) and moe.experts.down_proj.shape == (8, 64, 32)
    x = torch.randn(57, moe.config.hidden_size)
    with torch.no_grad():
        reference = per_expert_reference(moe, x)
        for implementation in ("eager", "grouped_mm", "batched_mm"):
            moe.config._experts_implementation = implementation
            out = moe(x)[0]
            # one matmul over [gate; up] instead of two: same dot products, possibly blocked differently
            terms = moe.config.hidden_size + moe.config.moe_intermediate_size
            torch.testing.assert_close(out, reference, **float_tol(reference, terms), msg=implementation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_moe_fast_paths_equal_eager(implementation, dtype):
    torch.manual_seed(0)
    config = tiny(experts_implementation="eager")
    moe = SpiderMoE(config).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(57, config.hidden_size, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(57, config.hidden_size, dtype=dtype)

    def run(impl):
        moe.config._experts_implementation = impl
        moe.zero_grad()
        x.grad = None
        out, _, load, scores = moe(x)
        (out * grad_out).sum().backward()
        return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in moe.named_parameters()}, scores, load

    ref_out, ref_dx, ref_grads, ref_scores, ref_load = run("eager")
    out, dx, grads, scores, load = run(implementation)
    # the paths sum each token's k expert outputs, and each expert's matmuls, in another order
    terms = config.hidden_size + config.moe_intermediate_size
    torch.testing.assert_close(out, ref_out, **float_tol(ref_out, terms))
    torch.testing.assert_close(dx, ref_dx, **float_tol(ref_dx, 2 * terms))
    for name in ref_grads:  # a weight gradient sums over the 57 tokens too
        torch.testing.assert_close(grads[name], ref_grads[name], **float_tol(ref_grads[name], 57 * terms), msg=name)
    assert torch.equal(scores, ref_scores)  # the router is the same in every path
    assert torch.equal(load, ref_load)


def test_full_model_moe_paths_equal():
    ids = torch.randint(0, 256, (2, 33))
    losses = {}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model = tiny_model(seed=3, experts_implementation=impl).eval()
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            losses[impl] = model(ids, labels=ids).loss
    tol = float_tol(losses["eager"], model_terms(model))
    torch.testing.assert_close(losses["grouped_mm"], losses["eager"], **tol)
    torch.testing.assert_close(losses["batched_mm"], losses["eager"], **tol)


def test_experts_implementation_settings():
    """grouped_mm by default; set at construction, by the deprecated moe_implementation of old configs, and with
    transformers' set_experts_implementation, which every MoE layer follows (they share the model's config)."""
    assert tiny()._experts_implementation == "grouped_mm"
    assert tiny(moe_implementation="sorted")._experts_implementation == "grouped_mm"
    assert tiny(moe_implementation="eager")._experts_implementation == "eager"
    assert (
        tiny(moe_implementation="eager", experts_implementation="batched_mm")._experts_implementation == "batched_mm"
    )
    assert "moe_implementation" not in tiny(moe_implementation="eager").to_dict()
    config = tiny()
    config.update_from_string("moe_implementation=eager")
    assert config._experts_implementation == "eager"
    config.moe_implementation = "sorted"  # the deprecated alias: read and assigned, mapped like old configs
    assert config._experts_implementation == config.moe_implementation == "grouped_mm"
    with pytest.raises(ValueError, match="moe_implementation"):
        config.moe_implementation = "nope"
    model = tiny_model(seed=0)
    model.set_experts_implementation("eager")
    layers = [layer.mlp.experts for layer in model.model.recurrent_block.layers]
    assert all(experts.config._experts_implementation == "eager" for experts in layers)
    with pytest.raises(ValueError, match="experts_implementation"):
        model.set_experts_implementation("nope")


# --- Engram ----------------------------------------------------------------------------------------------------------


def _hash_script(config_json: str) -> str:
    return (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from configuration_spider import SpiderConfig\n"
        "from modeling_spider import SpiderEngramEmbeddings\n"
        f"cfg = SpiderConfig(**json.loads({config_json!r}))\n"
        "ids = torch.arange(0, 272).remainder(251).view(2, 136)\n"
        "print(json.dumps(SpiderEngramEmbeddings(cfg).hash_ids(ids).tolist()))\n"
    )


def test_engram_hashes_identical_across_processes():
    overrides = {"engram_table_size": 1000, "engram_num_heads": 3, "engram_ngram_sizes": [2, 3]}
    config = SpiderConfig(**overrides)
    ids = torch.arange(0, 272).remainder(251).view(2, 136)
    here = SpiderEngramEmbeddings(config).hash_ids(ids).tolist()
    # one fresh interpreter with a fixed string-hash seed (this one's is random): the hashes use no Python hash()
    out = subprocess.run(
        [sys.executable, "-c", _hash_script(json.dumps(overrides))],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "1"},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_engram_hash_reference_and_moduli():
    config = tiny(engram_table_size=500, engram_num_heads=2, engram_ngram_sizes=[2, 3])
    emb = SpiderEngramEmbeddings(config)
    assert len(set(emb.moduli)) == 4 and all(p >= 500 for p in emb.moduli)
    assert all(all(p % d for d in range(2, int(p**0.5) + 1)) for p in emb.moduli)
    assert all(m % 2 == 1 for per_n in emb.multipliers for head in per_n for m in head)
    ids = torch.randint(0, 256, (1, 9))
    rows = emb.hash_ids(ids)
    fill = config.vocab_size
    seq = ids[0].tolist()
    table = 0
    for n_idx, n in enumerate(config.engram_ngram_sizes):
        for h in range(2):
            mult = emb.multipliers[n_idx][h]
            for l in range(9):
                acc = 0
                for i in range(n):
                    acc ^= (seq[l - i] if l - i >= 0 else fill) * mult[i]
                assert int(rows[0, l, table]) == acc % emb.moduli[table] + emb.offsets[table]
            table += 1


def test_engram_identical_after_save_and_load(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 21))
    a, b = model.model.engram_embeddings, loaded.model.engram_embeddings
    assert a.moduli == b.moduli and a.multipliers == b.multipliers
    assert torch.equal(a.hash_ids(ids), b.hash_ids(ids))
    torch.testing.assert_close(a(ids), b(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_engram_short_conv_equals_a_depthwise_conv1d(dtype):
    """`SpiderShortConv` (a sum over unfolded windows, for torch.compile) against ``nn.Conv1d(groups=D)`` holding the
    same weight (loaded from its state dict: the checkpoint key and layout are the Conv1d's), on the same `(B, D, L)`
    input: outputs and the gradients of the input and the weight, K products per output element, B * S per weight
    element."""
    B, S, D, K = 2, 9, 6, 4
    conv = torch.nn.Conv1d(D, D, K, groups=D, bias=False).to(dtype)
    short_conv = SpiderShortConv(D, K).to(dtype)
    short_conv.load_state_dict(conv.state_dict())
    generator = torch.Generator().manual_seed(0)
    window = torch.randn(B, D, S + K - 1, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(B, D, S, generator=generator).to(dtype)
    out = short_conv(window)
    (window_grad, weight_grad) = torch.autograd.grad(out, (window, short_conv.weight), grad)
    ref = conv(window)
    (ref_window_grad, ref_weight_grad) = torch.autograd.grad(ref, (window, conv.weight), grad)
    assert out.shape == ref.shape == (B, D, S) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **float_tol(ref, K))
    torch.testing.assert_close(window_grad, ref_window_grad, **float_tol(ref_window_grad, K))
    torch.testing.assert_close(weight_grad, ref_weight_grad, **float_tol(ref_weight_grad, B * S))
    # the output at s reads input[..., s : s + K] only (Engram puts the K - 1 steps before the first segment in front)
    short_conv(window)[..., 2].sum().backward()
    assert window.grad[..., 2 : 2 + K].abs().sum() > 0 and not window.grad[..., 2 + K :].any()
    assert not window.grad[..., :2].any()
    # fp32 weights on bf16 activations (a bf16 forward of an fp32 model): the output keeps the activations' dtype
    assert depthwise_conv1d(window.detach().bfloat16(), conv.weight.float()).dtype == torch.bfloat16


# --- losses and gradients --------------------------------------------------------------------------------------------


LOSS_REACHES = {
    "lm_loss": ["lm_head.weight", "model.embed_tokens.weight", "model.recurrent_block.layers.0.mlp.router.weight"],
    "aux_loss": ["model.recurrent_block.layers.0.mlp.router.weight"],
    "boundary_loss": ["model.flexitokens.boundary_predictor.out_proj.weight"],
    "ponder_loss": ["model.recurrent_block.halt_predictor.weight"],
}


@pytest.mark.parametrize("term", sorted(LOSS_REACHES))
def test_each_loss_term_is_finite_and_reaches_its_parameters(term):
    # boundary_prior far from the initial rate so the boundary hinge is active
    model = tiny_model(boundary_prior=0.9).train()
    ids = torch.randint(0, 256, (2, 40))
    out = model(ids, labels=ids)
    for name in ("loss", "lm_loss", "aux_loss", "boundary_loss", "ponder_loss"):
        assert torch.isfinite(out[name]), name
    out[term].backward()
    params = dict(model.named_parameters())
    for name in LOSS_REACHES[term]:
        grad = params[name].grad
        assert grad is not None and grad.abs().sum() > 0, f"{term} does not reach {name}"
    if term == "aux_loss":  # the load-balancing loss touches the router only
        assert params["lm_head.weight"].grad is None


def test_total_loss_is_weighted_sum():
    model = tiny_model().eval()
    ids = torch.randint(0, 256, (2, 30))
    out = model(ids, labels=ids)
    c = model.config
    expected = (
        out.lm_loss
        + c.router_aux_loss_coef * out.aux_loss
        + c.boundary_loss_coef * out.boundary_loss
        + c.ponder_loss_coef * out.ponder_loss
    )
    torch.testing.assert_close(out.loss, expected)
    ref = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:]) + torch.nn.functional.cross_entropy(
        out.logits[1, :-1], ids[1, 1:]
    )
    torch.testing.assert_close(out.lm_loss, ref / 2)


def test_activation_checkpointing_gives_equal_gradients():
    ids = torch.randint(0, 256, (2, 40))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(seed=4).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        torch.manual_seed(7)  # same relaxed-Bernoulli boundary sample
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        # recomputation runs the same ops on the same inputs: only the backward's accumulation order may differ
        torch.testing.assert_close(
            grads[1][name], grads[0][name], **float_tol(grads[0][name], 2 * model_terms(model)), msg=name
        )


def test_n_loops_beyond_max_loop_iters():
    model = tiny_model().eval()
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        out = model(ids, n_loops=model.config.max_loop_iters + 3)
    assert torch.isfinite(out.logits).all()
    assert 1 <= float(out.mean_halting_step) <= model.config.max_loop_iters + 3


# --- bad input
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [-1, 272, 10_000])
def test_out_of_vocabulary_ids_raise(bad_id):
    model = tiny_model()
    ids = torch.tensor([[1, 2, bad_id, 3]])
    with pytest.raises(ValueError, match=f"token id {bad_id}"):
        model(ids)


def test_too_long_input_raises():
    model = tiny_model(max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_bad_n_loops_raises():
    with pytest.raises(ValueError, match="n_loops"):
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), n_loops=0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", -8),
        ("num_experts_per_tok", 9),
        ("engram_layer_ids", [5]),
        ("n_loops", 0),
        ("moe_implementation", "fast"),
        ("experts_implementation", "fast"),
        ("qk_rope_head_dim", 7),
        ("act_threshold", 1.5),
        ("num_hidden_layers", 3),
        ("boundary_threshold", 1.0),
        ("vocab_size", 100),
    ],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_presets():
    assert tiny().hidden_size == 64
    assert SpiderConfig.from_preset("small", n_loops=3).n_loops == 3
    with pytest.raises(ValueError, match="known presets"):
        SpiderConfig.from_preset("huge")


def test_default_config_is_the_seed_1b_model():
    config = SpiderConfig()
    assert (config.hidden_size, config.num_recurrent_layers, config.n_routed_experts, config.num_experts_per_tok) == (
        2048,
        6,
        32,
        2,
    )
    with torch.device("meta"):
        model = SpiderForConditionalGeneration(config)
    n = sum(p.numel() for p in model.parameters())
    assert 0.9e9 <= n <= 1.1e9, n
    assert math.isclose(config.num_hidden_layers, 10)
