"""Ops per training step: a launch-bound GPU step runs one kernel per aten op, so the count of aten ops one training
forward+backward dispatches (`HostSyncCounter.ops`: no views, `detach` or `empty*`) stands in for the kernel launches
(docs/design.md, "Shapes that repeat, one host sync per training step"). The layers made leaner for it compute what
the plain formulas compute.
"""

from contextlib import nullcontext

import pytest
import torch

import modeling_spider
from modeling_spider import (
    ALL_ATTENTION_FUNCTIONS,
    RowWeights,
    SpiderForConditionalGeneration,
    SpiderMoEKernels,
    SpiderRMSNorm,
    apply_rotary_pos_emb,
    rotate_half,
    to_autocast_dtype,
)
from spider_training.mixed_precision import autocast_experts, cast_weight, shared_weight_casts
from spider_training.peers import peer_model
from spider_training.profiling import HostSyncCounter, proxy_1b_config
from tests.helpers import float_tol, model_terms, random_bytes, tiny_model


def _fwd_bwd_ops(model, ids) -> int:
    model.train()
    torch.manual_seed(1)
    with HostSyncCounter() as counter:
        model(ids, labels=ids).loss.backward()
    return counter.ops


def test_training_ops_per_layer_application_stay_near_deepseek_v3():
    """The 1b preset's structure at tiny widths (`proxy_1b_config`: 2 prelude + 6 recurrent layers x 6 loops + 2 coda
    = 40 layer applications) against transformers' `DeepseekV3ForCausalLM` of the same config (10 layers). Measured
    on CPU, torch 2.13 / transformers 5.x: DeepseekV3 2,522 ops (252 per layer); Spider 12,834 (321 per layer
    application, 1.27x) before RoPE ran once per layer and the MoE's row weights once per forward, 12,233 (306, 1.21x)
    after, 12,079 (302, 1.20x) once the loss left its zero-weighted terms out, 12,127 (303) with Engram's ShortConv as
    a
    windowed sum (it compiles once for every segment count), 12,023 (301) with the balancing statistics' normalisers
    in `RowWeights`. The bound, 1.25x, keeps that gain with room for a few ops per layer."""
    config = proxy_1b_config()
    ids = random_bytes(2, 64)  # the count does not depend on the shape (checked at 2x64 to 32x256)
    torch.manual_seed(0)
    spider = _fwd_bwd_ops(SpiderForConditionalGeneration(config), ids)
    peer = peer_model(config)
    deepseek = _fwd_bwd_ops(peer, ids)
    applications = config.num_prelude_layers + config.num_recurrent_layers * config.n_loops + config.num_coda_layers
    per_application, per_layer = spider / applications, deepseek / peer.config.num_hidden_layers
    assert per_application <= 1.25 * per_layer, (spider, deepseek, per_application / per_layer)


def _reference_rms_norm(norm: SpiderRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as transformers' Llama/DeepseekV3 write it: fp32 statistics, rounded to the input dtype, then scaled."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_rms_norm_matches_the_reference_formula(x_dtype, w_dtype):
    D = 96
    norm = SpiderRMSNorm(D, eps=1e-6).to(w_dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=generator))
    x = (3 * torch.randn(4, 7, D, generator=generator)).to(x_dtype).requires_grad_()
    out = norm(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference_rms_norm(norm, ref_x)
    assert out.dtype == ref.dtype == torch.promote_types(x_dtype, w_dtype)
    # fp32 statistics: a mean of D squares, then a few elementwise ops; a result in a narrower dtype may round one of
    # its own ulps apart from the reference
    tol = float_tol(ref.detach().float(), D)
    out_eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(
        out.detach().float(),
        ref.detach().float(),
        rtol=tol["rtol"] + out_eps,
        atol=tol["atol"] + out_eps * float(ref.detach().abs().max()),
    )
    if x_dtype == w_dtype == torch.float32:
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad)
        norm_grad = norm.weight.grad.clone()
        norm.weight.grad = None
        ref.backward(grad)
        # the input gradient reduces over D, the weight gradient over the 4 * 7 rows
        torch.testing.assert_close(x.grad, ref_x.grad, **float_tol(ref_x.grad, D))
        torch.testing.assert_close(norm_grad, norm.weight.grad, **float_tol(norm.weight.grad, 4 * 7 * D))


def test_rope_on_queries_and_shared_key_at_once_is_rope_on_each():
    B, H, T, d = 2, 4, 9, 16
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, T, d, generator=generator), torch.randn(B, 1, T, d, generator=generator)
    cos, sin = torch.randn(B, T, d, generator=generator), torch.randn(B, T, d, generator=generator)
    q_rot, k_rot = apply_rotary_pos_emb(torch.cat((q, k), dim=1), cos, sin).split([H, 1], dim=1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    assert torch.equal(q_rot, q * c + rotate_half(q) * s)  # elementwise: the same ops on the same values
    assert torch.equal(k_rot, k * c + rotate_half(k) * s)


def test_row_weights_give_the_per_call_balancing_statistics():
    """`RowWeights`, built once per forward with the normalisers folded in, give each MoE call what its own row mask
    gave: the load counts of the real rows' token-slots over their number (DeepSeek's f_i) and the mean router score
    over the real rows (the same sums, the division moved: within fp32 rounding of a sum over the rows), and the
    padding rows weigh zero."""
    model = tiny_model(seed=0)
    config, moe = model.config, model.model.recurrent_block.layers[0].mlp
    T, E, k = 23, config.n_routed_experts, config.num_experts_per_tok
    x = torch.randn(T, config.hidden_size, requires_grad=True)
    row_mask = torch.ones(T, dtype=torch.bool)
    row_mask[17:] = False
    out, logits, load, mean_scores = moe(x, RowWeights.of(row_mask, k, E))

    scores = logits.softmax(dim=-1)
    topk_idx = SpiderMoEKernels.topk_gate(scores, k)
    weight = row_mask.to(torch.float32)
    slot_weight = weight[:, None].expand_as(topk_idx).reshape(-1)
    counts = torch.zeros(E).scatter_add_(0, topk_idx.reshape(-1), slot_weight)
    real = weight.sum()
    ref_load = counts * E / (real * k).clamp_min(1)
    ref_mean_scores = (scores * weight[:, None]).sum(dim=0) / real.clamp_min(1)
    torch.testing.assert_close(load, ref_load, **float_tol(ref_load, T * k))
    torch.testing.assert_close(mean_scores, ref_mean_scores, **float_tol(ref_mean_scores, T))
    assert float(load.sum()) == pytest.approx(E)  # f_i averages to 1 over the experts
    with torch.no_grad():
        plain_out = moe(x[:17])[0]
    torch.testing.assert_close(out[:17], plain_out, **float_tol(plain_out, config.hidden_size))
    shared = moe.shared_experts(x[17:]) if moe.shared_experts is not None else torch.zeros_like(x[17:])
    torch.testing.assert_close(out[17:], shared, **float_tol(shared, config.hidden_size))  # padding: no routed share


def test_loss_terms_weighted_zero_add_no_backward():
    """With `router_aux_loss_coef` and `ponder_loss_coef` at 0 (the 1b and small presets), the loss leaves those terms
    out of its graph: the same loss and bit-identical gradients as `lm + 0 * aux + boundary + 0 * ponder` (adding an
    exact zero changes no value), with fewer ops in the backward (each term's backward reached every MoE router and
    halting head through the recurrence: 154 ops of 12,235 on the proxy at 8 x 256; 120 of 12,143 once `RowWeights`
    held the balancing statistics' normalisers)."""
    config = proxy_1b_config()
    assert config.router_aux_loss_coef == config.ponder_loss_coef == 0.0 and config.boundary_loss_coef != 0
    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(config).train()
    ids = random_bytes(2, 64)

    def step(composed: bool):
        torch.manual_seed(1)
        with HostSyncCounter() as counter:
            out = model(ids, labels=ids)
            loss = out.loss
            if composed:  # every term, as before: the zero-weighted ones in the graph
                loss = (
                    out.lm_loss
                    + config.router_aux_loss_coef * out.aux_loss
                    + config.boundary_loss_coef * out.boundary_loss
                    + config.ponder_loss_coef * out.ponder_loss
                )
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, counter.ops

    loss, grads, ops = step(composed=False)
    ref_loss, ref_grads, ref_ops = step(composed=True)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads), [
        name for name in grads if not torch.equal(grads[name], ref_grads[name])
    ]
    assert ops < ref_ops - 3 * config.num_recurrent_layers * config.n_loops, (ops, ref_ops)


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every dtype cast (``aten._to_copy`` to another dtype): `(shape, source dtype, target dtype)`."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy and out.dtype != args[0].dtype:
            self.casts.append((tuple(args[0].shape), args[0].dtype, out.dtype))
        return out


def _autocast_step(model, ids, shared_casts: bool = True):
    """A bf16-autocast training forward+backward as SpiderTrainer runs it (the experts' weight casts shared across the
    loops: spider_training.mixed_precision), or with a cast per experts call. Returns the casts and the gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    autocast_experts(model)
    torch.manual_seed(1)
    with _Casts() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16), shared_weight_casts() if shared_casts else nullcontext():
            loss = model(ids, labels=ids).loss
        loss.backward()
    return seen.casts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _casts_per_application(model, ids, layers: int) -> float:
    return len(_autocast_step(model, ids)[0]) / layers


def test_training_casts_per_layer_application_under_autocast():
    """Under bf16 autocast a cast is a kernel of its own each way (on an H200 `aten::copy_` was a fifth of the eager
    step's launches). On `proxy_1b_config` (CPU, torch 2.13), forward+backward: DeepseekV3 643 casts (64 per layer);
    Spider 2,551 (64 per layer application), 2,311 once the rotated query and key parts were rounded to bf16 before
    the concatenation instead of promoting the whole query and key to fp32 for attention to cast back, 2,191 once the
    experts' weights were cast once per forward instead of once per loop, 1,913 (48) once an input that several
    projections read was cast once (`to_autocast_dtype`) instead of once per projection. The bound, 0.8x
    DeepseekV3's per layer, holds all three gains."""
    config = proxy_1b_config()
    ids = random_bytes(2, 64)
    torch.manual_seed(0)
    spider = _casts_per_application(
        SpiderForConditionalGeneration(config),
        ids,
        config.num_prelude_layers + config.num_recurrent_layers * config.n_loops + config.num_coda_layers,
    )
    peer = peer_model(config)
    deepseek = _casts_per_application(peer, ids, peer.config.num_hidden_layers)
    assert spider <= 0.8 * deepseek, (spider, deepseek)


def test_attention_hands_rotated_queries_and_keys_in_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast the queries and keys reach the attention function in bf16, each element the bf16 rounding of
    what attention would have cast: the unrotated part as the projection gave it, the rotated part the fp32 rotation
    (RoPE's cos and sin are fp32) rounded once."""
    model = tiny_model(seed=0)
    attention = model.model.prelude_layers[0].self_attn
    config = attention.config
    seen = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.update(query=query, key=key, value=value)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "spider_test_recording", recording)
    model.set_attn_implementation("spider_test_recording")
    B, T, D, H = 2, 11, config.hidden_size, config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=generator)
    cos, sin = model.model.rotary_emb(x, torch.arange(T).expand(B, T))
    assert cos.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention(x, (cos, sin), None)
        if config.q_lora_rank is None:
            q = attention.q_proj(x)
        else:
            q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x)))
        kv_a = attention.kv_a_proj_with_mqa(x)
    assert attention.config._attn_implementation == "spider_test_recording"
    assert {t.dtype for t in seen.values()} == {torch.bfloat16}
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    q = q.view(B, T, H, nope + rope).transpose(1, 2)
    assert torch.equal(seen["query"][..., :nope], q[..., :nope])
    assert torch.equal(seen["query"][..., nope:], apply_rotary_pos_emb(q[..., nope:], cos, sin).to(torch.bfloat16))
    k_pe = kv_a[..., config.kv_lora_rank :].view(B, 1, T, rope)
    k_rot = apply_rotary_pos_emb(k_pe, cos, sin).to(torch.bfloat16)
    assert torch.equal(seen["key"][..., nope:], k_rot.expand(B, H, T, rope))


def test_experts_weights_are_cast_once_per_forward():
    """Under autocast the routed experts' fp32 weights are cast to bf16 once per forward and layer, not once per loop
    (autocast casts the other layers' weights once itself; the grouped GEMM is no autocast op): one bf16 copy per layer
    kept for the backward instead of `n_loops`. The gradients are those of a cast per call up to the loops' bf16
    accumulation (autocast's own weight cache accumulates the same way)."""
    model = tiny_model(seed=0, n_loops=3)
    config, ids = model.config, torch.randint(0, 256, (2, 48))
    expert_shapes = {tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}

    def expert_casts(casts):
        return [c for c in casts if c[0] in expert_shapes and c[1:] == (torch.float32, torch.bfloat16)]

    casts, grads = _autocast_step(model, ids)
    assert len(expert_casts(casts)) == 2 * config.num_recurrent_layers  # gate_up_proj and down_proj, per layer
    casts, per_call = _autocast_step(model, ids, shared_casts=False)
    assert len(expert_casts(casts)) == 2 * config.num_recurrent_layers * config.n_loops
    assert grads.keys() == per_call.keys()
    for name in grads:
        # per loop a bf16 gradient; summed in bf16 (shared cast) or each cast to fp32 first (a cast per call)
        reference = per_call[name]
        tol = float_tol(reference.to(torch.bfloat16), config.n_loops)
        torch.testing.assert_close(grads[name], reference, rtol=tol["rtol"], atol=tol["atol"], msg=name)


def test_shared_weight_casts_with_activation_checkpointing():
    """The recomputation in the backward runs outside the shared casts and casts afresh; the gradients are those of a
    step without checkpointing."""
    ids = torch.randint(0, 256, (2, 40))
    model = tiny_model(seed=4, n_loops=3)
    _, reference = _autocast_step(model, ids)
    model.activation_checkpointing_enable()
    _, grads = _autocast_step(model, ids)
    assert grads.keys() == reference.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], reference[name], **float_tol(reference[name], 2 * model_terms(model)), msg=name
        )


def test_cast_weight_shares_one_cast_per_parameter():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    assert cast_weight(weight, torch.bfloat16) is not cast_weight(weight, torch.bfloat16)  # no sharing outside
    with shared_weight_casts():
        first = cast_weight(weight, torch.bfloat16)
        assert first.dtype == torch.bfloat16 and torch.equal(first, weight.detach().to(torch.bfloat16))
        assert cast_weight(weight, torch.bfloat16) is first
        assert cast_weight(weight, torch.float16) is not first  # another dtype: its own cast
        assert cast_weight(weight, torch.float32) is weight  # no cast at all
        computed = weight * 2  # a tensor computed from a parameter (PEFT's LoRA): cast each call
        assert cast_weight(computed, torch.bfloat16) is not cast_weight(computed, torch.bfloat16)
        with torch.no_grad():
            weight.add_(1.0)  # written in place: the next call casts the new values
        again = cast_weight(weight, torch.bfloat16)
        assert again is not first and torch.equal(again, weight.detach().to(torch.bfloat16))
    assert cast_weight(weight, torch.bfloat16) is not again


def test_to_autocast_dtype_casts_only_under_autocast():
    x = torch.randn(3, 4)
    assert to_autocast_dtype(x) is x
    ids = torch.arange(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert to_autocast_dtype(x).dtype == torch.bfloat16 and torch.equal(to_autocast_dtype(x), x.to(torch.bfloat16))
        assert to_autocast_dtype(ids) is ids  # integers are no autocast input
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert to_autocast_dtype(x) is x


def _layer_with_one_or_per_layer_casts(monkeypatch, layer, run):
    """`run(layer, x)` under bf16 autocast twice: as it is (an input several projections read cast once) and with
    `to_autocast_dtype` as the identity (autocast casting that input once per projection). Returns both
    `(output, input gradient)` pairs."""
    x = torch.randn(2, 9, layer_hidden_size(layer), generator=torch.Generator().manual_seed(0))
    results = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(modeling_spider, "to_autocast_dtype", lambda t: t)
        x_in = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(layer, x_in * 1.0)  # not a leaf: autocast caches a leaf's cast itself (the weights')
        out.float().square().sum().backward()
        results.append((out.detach(), x_in.grad))
    return results


def layer_hidden_size(layer) -> int:
    return layer.config.hidden_size if hasattr(layer, "config") else layer.gate_proj.in_features


@pytest.mark.parametrize("which", ["mlp", "attention"])
def test_an_input_cast_once_gives_the_per_projection_casts_values(monkeypatch, which):
    """The output is bit-identical (each projection reads the same bf16 values); the input's gradient, the sum of two
    projections' bf16 gradients, is rounded to bf16 once before the cast back to fp32, instead of adding the two in
    fp32: within one bf16 rounding (2^-8 of the result) of it."""
    model = tiny_model(seed=0)
    layer = model.model.prelude_layers[0]
    if which == "mlp":
        module, run = layer.mlp, lambda m, x: m(x)
    else:
        module = layer.self_attn
        rope = model.model.rotary_emb(torch.zeros(1), torch.arange(9).expand(2, 9))

        def run(m, x):
            return m(x, rope, None)[0]

    (out, grad), (ref_out, ref_grad) = _layer_with_one_or_per_layer_casts(monkeypatch, module, run)
    assert torch.equal(out, ref_out)
    assert not torch.equal(grad, ref_grad)  # the rounding is real: the test would see a gradient left out
    torch.testing.assert_close(grad, ref_grad, rtol=2.0**-8, atol=0.0)


def test_model_loss_under_autocast_is_unchanged_by_casting_shared_inputs_once(monkeypatch):
    """The whole training forward under bf16 autocast, the experts run as the trainer runs them
    (``autocast_experts``), gives the same loss to the bit with inputs cast once or per projection (the projections
    read the same values either way)."""
    model = tiny_model(seed=0)
    autocast_experts(model)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    losses = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(modeling_spider, "to_autocast_dtype", lambda t: t)
        torch.manual_seed(1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(model.train()(ids, labels=ids).loss)
    assert torch.equal(losses[0], losses[1])


class _RmsNormCalls(torch.overrides.TorchFunctionMode):
    """Records `(input dtype, autocast enabled on its device)` at every ``F.rms_norm`` call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.rms_norm:
            self.seen.append((args[0].dtype, torch.is_autocast_enabled(args[0].device.type)))
        return func(*args, **(kwargs or {}))


def test_rms_norm_of_a_bf16_input_under_autocast_is_the_fp32_formula_rounded():
    """A bf16 input under autocast (the MLA query and key-value norms, Engram's norms) is normalised by `F.rms_norm`
    with autocast off, on the bf16 tensor itself: the statistics are still fp32 (the reference formula, rounded to bf16
    once, then scaled by the fp32 weight), without autocast's CUDA policy copying the input to fp32 and the result
    back. On CPU the values are the reference's to the bit, output and input gradient."""
    D = 96
    norm = SpiderRMSNorm(D, eps=1e-6)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=generator))
    x = (3 * torch.randn(4, 7, D, generator=generator)).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference_rms_norm(norm, ref_x)
    assert out.dtype == ref.dtype == torch.float32
    assert torch.equal(out, ref)
    with _RmsNormCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        norm(x)
    assert calls.seen == [(torch.bfloat16, False)]  # the bf16 tensor itself, autocast off (CUDA's would copy it)
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)
    ref.backward(grad)
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, ref_x.grad)
