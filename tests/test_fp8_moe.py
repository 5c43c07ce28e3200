"""Tests of spider_training.fp8_moe: the fused MoE experts through torchao's FP8 rowwise grouped GEMM.

torchao's FP8 grouped GEMM runs only on CUDA SM90 with triton (``torch._scaled_grouped_mm``; torchao 0.18 has no
emulated mode), so on CPU its one entry point, ``_quantize_then_scaled_grouped_mm`` as torchao's weight wrapper calls
it, is replaced by a named test double, :func:`emulated_fp8_rowwise_grouped_mm`: the same rowwise FP8 semantics
written from torchao's contract (``fp8_grouped_mm.py``: ``A`` (tokens, K) scaled per row, ``B_t`` (E, K, N) scaled per
expert and output column, both over K, cast to e4m3 with scale ``448 / amax``, the product in fp32 with the scales
applied after, output in ``config.out_dtype``), differentiable with a straight-through estimator. Around it runs the
real chain: Spider's fused experts, transformers' ``grouped_mm`` experts implementation, ``torch._grouped_mm`` and
torchao's ``Float8TrainingWeightWrapperTensor`` dispatch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.prototype.moe_training")

from torchao.prototype.moe_training import tensor as moe_tensor  # noqa: E402
from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor  # noqa: E402

from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training import fp8_moe  # noqa: E402
from spider_training.fp8 import fp8_to_plain_state_dict, has_fp8_weight_wrappers  # noqa: E402
from spider_training.fp8_moe import (  # noqa: E402
    convert_experts_for_training,
    convert_experts_to_fp8_grouped_mm,
    experts_fp8_to_plain,
    fp8_grouped_mm_unsupported_reason,
)
from tests.helpers import float_tol, tiny_model  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
#: e4m3 keeps 3 mantissa bits: round-to-nearest moves a value by at most 2^-4 of itself (normal range)
E4M3_UNIT_ROUNDOFF = 2.0 ** -4


def _fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` cast to e4m3 with an amax scale over `dim` (torchao's rowwise recipe) and scaled back, in fp32; the
    gradient passes straight through."""
    x32 = x.float()
    scale = E4M3_MAX / x32.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    quantised = (x32 * scale).to(E4M3).float() / scale
    return x32 + (quantised - x32).detach()


class EmulatedFp8GroupedMM:
    """The test double: ``_quantize_then_scaled_grouped_mm(A, B_t, config, offs, bias)`` in emulation; counts
    calls in ``calls``."""

    def __init__(self):
        self.calls = 0

    def __call__(self, A, B_t, config=None, offs=None, bias=None):
        self.calls += 1
        assert A.dim() == 2 and B_t.dim() == 3 and offs is not None and offs.dtype == torch.int32
        out = torch._grouped_mm(_fake_quant(A, dim=-1), _fake_quant(B_t, dim=-2), offs=offs)
        out_dtype = getattr(config, "out_dtype", None) or A.dtype
        return out.to(out_dtype) if bias is None else (out + bias).to(out_dtype)


emulated_fp8_rowwise_grouped_mm = EmulatedFp8GroupedMM


@pytest.fixture
def fp8_double(monkeypatch):
    double = EmulatedFp8GroupedMM()
    monkeypatch.setattr(moe_tensor, "_quantize_then_scaled_grouped_mm", double)
    return double


def test_the_double_keeps_within_the_fp8_error_bound():
    """Each product term `a_k b_k` of the emulated GEMM moves by at most (1 + u)^2 - 1 of |a_k b_k| (u = e4m3 unit
    roundoff; values below e4m3's normal range round more coarsely, but amax scaling puts the large terms at the top
    of the range), plus fp32 roundoff over K terms."""
    gen = torch.Generator().manual_seed(0)
    A, B_t = torch.randn(40, 64, generator=gen), torch.randn(4, 64, 48, generator=gen)
    offs = torch.tensor([10, 10, 25, 40], dtype=torch.int32)
    got = EmulatedFp8GroupedMM()(A, B_t, offs=offs)
    exact = torch._grouped_mm(A, B_t, offs=offs)
    magnitude = torch._grouped_mm(A.abs(), B_t.abs(), offs=offs)
    subnormal = 2.0 ** -9 / E4M3_MAX  # e4m3's smallest subnormal step, relative to the amax
    bound = ((1 + E4M3_UNIT_ROUNDOFF) ** 2 - 1) * magnitude \
        + 2 * subnormal * A.abs().amax() * B_t.abs().amax() * A.shape[1] \
        + float_tol(exact, terms=A.shape[1])["atol"]
    assert ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, exact)  # it does round


def test_fused_experts_run_the_fp8_grouped_gemm(fp8_double):
    """After conversion a training step sends every grouped GEMM of every MoE layer and loop through torchao's FP8 op
    (forward: gate_up and down per layer per loop), the loss moves by FP8 rounding only, and the wrapped parameters get
    gradients."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 40))
    reference = tiny_model(seed=0).to(torch.bfloat16)
    model = tiny_model(seed=0).to(torch.bfloat16)
    report = convert_experts_to_fp8_grouped_mm(model)
    layers = model.model.recurrent_block.layers
    assert report.converted_fqns == [f"model.recurrent_block.layers.{i}.mlp.experts" for i in range(len(layers))]
    assert not report.skipped and "2 of 2" in report.message
    for layer in layers:
        assert isinstance(layer.mlp.experts.gate_up_proj.data, TrainingWeightWrapperBaseTensor)
    reference.eval(), model.eval()
    with torch.no_grad():
        expected = reference(ids, labels=ids).lm_loss
        got = model(ids, labels=ids).lm_loss
    assert fp8_double.calls == 2 * len(layers) * model.config.n_loops
    assert torch.isfinite(got) and not torch.equal(got, expected)  # closeness: the layer-level test below
    model.train()
    model(ids, labels=ids).loss.backward()
    gate_up = layers[0].mlp.experts.gate_up_proj
    assert gate_up.grad is not None and torch.isfinite(gate_up.grad.float()).all() and gate_up.grad.abs().sum() > 0


def test_moe_layer_output_within_the_fp8_error_bound(fp8_double):
    """One MoE layer (fp32, FP8 output in fp32) against the same layer unconverted: every token's output stays within
    6 standard deviations of the rounding error of rowwise-FP8 GEMMs, propagated through the SwiGLU per token and
    expert from the weights. Rounding errors as independent relative errors uniform in [-u, u] (u = e4m3 unit
    roundoff, two rounded operands per product term: variance 2 u^2 / 3), summed as a random walk over each dot
    product (a worst-case sum would be loose by about sqrt(K) and let a wrong layout, e.g. a transposed expert matrix,
    through: tested below); values in e4m3's subnormal range add at most half a subnormal step each (absolute)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    from modeling_spider import SpiderMoE, SpiderMoEKernels
    from tests.helpers import tiny

    torch.manual_seed(0)
    moe = SpiderMoE(tiny(n_shared_experts=0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(57, moe.config.hidden_size)
    with torch.no_grad():
        expected = moe(x)[0]
        gate_up, down = moe.experts.gate_up_proj.clone(), moe.experts.down_proj.clone()
        scores = moe.route(x).softmax(-1)
    config = Float8TrainingOpConfig(out_dtype=torch.float32, pad_token_groups_for_grouped_mm=True)
    assert convert_experts_to_fp8_grouped_mm(moe, config=config).converted_fqns == ["experts"]
    with torch.no_grad():
        got = moe(x)[0]
    assert fp8_double.calls == 2
    bound = fp8_error_bound(x, gate_up, down, scores, moe.top_k) + float_tol(expected, terms=gate_up.shape[-1])["atol"]
    assert ((got - expected).abs() <= bound).all()
    assert not torch.equal(got, expected)


def fp8_error_bound(x, gate_up, down, scores, top_k, sigmas: float = 6.0) -> torch.Tensor:
    """`sigmas` standard deviations of the FP8 experts' output error, `(T, D)` (see the test's docstring)."""
    from modeling_spider import SpiderMoEKernels

    F = torch.nn.functional
    rel_sd = E4M3_UNIT_ROUNDOFF * (2.0 / 3.0) ** 0.5
    half_subnormal = 2.0 ** -10 / E4M3_MAX  # relative to the amax of the row / column being scaled
    silu_lipschitz = 1.1  # max |silu'(g)| = 1.0998
    idx = SpiderMoEKernels.topk_gate(scores, top_k)
    weights = SpiderMoEKernels.normalize_weight(scores.gather(1, idx))[1]
    I = down.shape[-1]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(top_k):
            w_gu, w_d = gate_up[idx[t, j]], down[idx[t, j]]
            xt = x[t]
            h = w_gu @ xt
            sub_h = half_subnormal * (xt.abs().max() * w_gu.abs().sum(1) + w_gu.abs().amax(1) * xt.abs().sum())
            dh = rel_sd * ((w_gu ** 2) @ (xt ** 2)).sqrt()
            g, u, dg, du = h[:I], h[I:], dh[:I], dh[I:]
            z = F.silu(g) * u
            dz = ((silu_lipschitz * dg * u) ** 2 + (F.silu(g) * du) ** 2).sqrt()
            dy = ((w_d ** 2) @ (dz ** 2) + rel_sd ** 2 * (w_d ** 2) @ (z ** 2)).sqrt()
            sub_y = half_subnormal * (z.abs().max() * w_d.abs().sum(1) + w_d.abs().amax(1) * z.abs().sum())
            sub_z = w_d.abs() @ (silu_lipschitz * sub_h[:I] * u.abs() + F.silu(g).abs() * sub_h[I:])
            out[t] += weights[t, j] * (sigmas * dy + sub_y + sub_z)
    return out


def test_the_layer_bound_catches_a_wrong_layout(monkeypatch):
    """The bound above is tight enough to see an FP8 op that multiplied a transposed expert matrix."""
    from modeling_spider import SpiderMoE
    from tests.helpers import tiny

    class Transposing(EmulatedFp8GroupedMM):
        def __call__(self, A, B_t, config=None, offs=None, bias=None):
            if B_t.shape[-1] == B_t.shape[-2]:  # gate_up_proj: (E, 2I, D) with 2I == D in the tiny preset
                B_t = B_t.transpose(-2, -1).contiguous()
            return super().__call__(A, B_t, config, offs, bias)

    monkeypatch.setattr(moe_tensor, "_quantize_then_scaled_grouped_mm", Transposing())
    torch.manual_seed(0)
    moe = SpiderMoE(tiny(n_shared_experts=0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert moe.experts.gate_up_proj.shape[-1] == moe.experts.gate_up_proj.shape[-2]
    x = torch.randn(57, moe.config.hidden_size)
    with torch.no_grad():
        expected = moe(x)[0]
        gate_up, down = moe.experts.gate_up_proj.clone(), moe.experts.down_proj.clone()
        scores = moe.route(x).softmax(-1)
        convert_experts_to_fp8_grouped_mm(moe)
        got = moe(x)[0].float()
    assert ((got - expected).abs() > fp8_error_bound(x, gate_up, down, scores, moe.top_k)).any()


def test_other_implementations_and_odd_sizes_are_skipped_with_the_reason():
    report = convert_experts_to_fp8_grouped_mm(tiny_model(experts_implementation="eager"))
    assert not report.converted_fqns and all("only 'grouped_mm'" in r for r in report.skipped.values())
    report = convert_experts_to_fp8_grouped_mm(tiny_model(moe_intermediate_size=24))
    assert not report.converted_fqns and all("not divisible by 16" in r for r in report.skipped.values())


def test_unwrapped_model_saves_and_loads_plain(tmp_path, fp8_double):
    model = tiny_model(seed=0)
    convert_experts_to_fp8_grouped_mm(model)
    assert convert_experts_to_fp8_grouped_mm(model).converted_fqns  # idempotent: already wrapped, still grouped_mm
    assert experts_fp8_to_plain(model) == 2 * model.config.num_recurrent_layers
    experts = model.model.recurrent_block.layers[0].mlp.experts
    assert type(experts.gate_up_proj.data) is torch.Tensor and experts.gate_up_proj.requires_grad
    model.save_pretrained(tmp_path)
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert fp8_double.calls == 0


def test_unsupported_reason_on_this_machine():
    reason = fp8_grouped_mm_unsupported_reason("cpu")
    assert reason is not None and "needs CUDA" in reason


def test_fp8_experts_modes_on_a_machine_without_the_kernels():
    """``--fp8_experts`` on this CPU: ``auto`` leaves every experts module in high precision with the reason, ``on``
    refuses with it, ``off`` says it was asked; a wrong value names the flag."""
    model = tiny_model(seed=0)
    experts = [f"model.recurrent_block.layers.{i}.mlp.experts" for i in range(model.config.num_recurrent_layers)]
    auto = convert_experts_for_training(model, "auto", "cpu")
    assert not auto.converted_fqns and sorted(auto.skipped) == experts
    assert all("needs CUDA" in reason for reason in auto.skipped.values()) and "0 of 2" in auto.message
    assert not has_fp8_weight_wrappers(model)
    with pytest.raises(RuntimeError, match="--fp8_experts on: .*needs CUDA"):
        convert_experts_for_training(model, "on", "cpu")
    assert set(convert_experts_for_training(model, "off", "cpu").skipped.values()) == {"--fp8_experts off"}
    with pytest.raises(ValueError, match="--fp8_experts must be one of"):
        convert_experts_for_training(model, "yes", "cpu")


def test_trainer_trains_fp8_experts_and_writes_a_plain_checkpoint(tmp_path, fp8_double, monkeypatch):
    """``SpiderTrainer(precision="fp8")`` on a machine that has the kernels. Test doubles for what this CPU lacks: the
    hardware check answers as on an SM90 GPU with triton, and the FP8 op is the emulated double. The experts train
    through the FP8 grouped GEMM, and the checkpoint Trainer writes holds the plain trained tensors and loads into a
    plain model."""
    from transformers import TrainingArguments, default_data_collator

    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer

    monkeypatch.setattr(fp8_moe, "fp8_grouped_mm_unsupported_reason", lambda device=None: None)
    model = tiny_model(seed=0)
    initial = model.model.recurrent_block.layers[0].mlp.experts.gate_up_proj.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2,
                             per_device_train_batch_size=2, remove_unused_columns=False, save_strategy="steps",
                             save_steps=2, eval_strategy="no")
    trainer = SpiderTrainer(model=model, args=args, train_dataset=build_dataset("mock", 32),
                            data_collator=default_data_collator, precision="fp8", stop_signals=())
    assert len(trainer.fp8_experts_report.converted_fqns) == model.config.num_recurrent_layers
    assert has_fp8_weight_wrappers(trainer.model)
    trainer.train()
    assert fp8_double.calls > 0
    saved = SpiderForConditionalGeneration.from_pretrained(tmp_path / "checkpoint-2")
    trained = fp8_to_plain_state_dict(trainer.model)
    assert not has_fp8_weight_wrappers(saved)
    for key, value in saved.state_dict().items():
        assert torch.equal(value, trained[key]), key
    gate_up = saved.model.recurrent_block.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(gate_up, initial)  # the FP8 experts trained
