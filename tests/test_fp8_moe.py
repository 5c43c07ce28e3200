"""Tests of spider_training.fp8's experts path: the fused MoE experts through torchao's FP8 rowwise grouped GEMM.

torchao's FP8 grouped GEMM runs only on CUDA SM90 with triton (torchao 0.18 has no emulated mode). On CPU its
CUDA-only pieces are replaced by named test doubles, :class:`EmulatedFp8Kernels`: the four triton casting kernels
``fp8_grouped_mm.py`` calls (rowwise 2-D, column-wise 3-D, transposed 3-D, per-group column-wise) and
``torch._scaled_grouped_mm``, written from their contracts (shapes, layouts, scales ``448 / amax`` rounded down to a
power of two, e4m3 with saturation; ``torch._scaled_grouped_mm`` multiplies the dequantised operands in fp32, and
checks what the CUDA kernel needs: e4m3 operands, a row-major left and column-major right operand, int32 offsets,
groups a multiple of 16 rows long, rows past the last offset left unwritten, here NaN). Around them runs the real
chain: Spider's fused experts, the aligned experts function, torchao's ``Float8TrainingWeightWrapperTensor`` dispatch,
its ``_Float8GroupedMM`` autograd function with its own checks and backward (input and weight gradients).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.prototype.moe_training")

from torchao.prototype.moe_training import fp8_grouped_mm  # noqa: E402
from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor  # noqa: E402

from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training import fp8  # noqa: E402
from spider_training.fp8 import (  # noqa: E402
    ALIGNED_GROUPED_MM,
    convert_experts_to_fp8,
    convert_for_fp8_training,
    convert_fp8_to_plain,
    fp8_grouped_mm_unsupported_reason,
    fp8_to_plain_state_dict,
    has_fp8_weight_wrappers,
)
from tests.helpers import float_tol, tiny_model  # noqa: E402

FP8_GROUP_ALIGNMENT = fp8.FP8_DIM_MULTIPLE  # rows per expert group that torchao's FP8 grouped GEMM needs
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
#: e4m3 keeps 3 mantissa bits: round-to-nearest moves a value by at most 2^-4 of itself (normal range)
E4M3_UNIT_ROUNDOFF = 2.0**-4
EPS = 1e-12  # torchao.float8.float8_utils.EPS: the amax floor of a scale


def _scale(amax: torch.Tensor, power_of_2: bool) -> torch.Tensor:
    scale = E4M3_MAX / amax.float().clamp(min=EPS)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored column-major (strides ..., 1, rows)."""
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


def _is_column_major(x: torch.Tensor) -> bool:
    return x.stride(-2) == 1 and x.stride(-1) > 1


class EmulatedFp8Kernels:
    """The test doubles (module docstring); ``calls`` counts ``torch._scaled_grouped_mm`` calls by kind
    (``"2d_3d"``: forward and input gradient, ``"2d_2d"``: weight gradient)."""

    def __init__(self, transpose_square_weights: bool = False):
        self.calls = {"2d_3d": 0, "2d_2d": 0}
        self.transpose_square_weights = transpose_square_weights  # a wrong layout, for the bound's own test

    def install(self, monkeypatch) -> EmulatedFp8Kernels:
        for name in (
            "triton_fp8_rowwise_2d_scale_and_cast",
            "triton_fp8_colwise_3d_scale_and_cast",
            "triton_fp8_rowwise_3d_transpose_rhs",
            "triton_fp8_per_group_colwise_scales_dual",
        ):
            monkeypatch.setattr(fp8_grouped_mm, name, getattr(self, name))
        monkeypatch.setattr(torch, "_scaled_grouped_mm", self.scaled_grouped_mm)
        return self

    @staticmethod
    def triton_fp8_rowwise_2d_scale_and_cast(x, output_dtype=E4M3, round_scales_to_power_of_2=False):
        """(M, K) -> e4m3 (M, K) row-major, scales (M, 1) over each row."""
        scale = _scale(x.abs().amax(-1, keepdim=True), round_scales_to_power_of_2)
        return _cast(x, scale).to(output_dtype), scale

    @staticmethod
    def triton_fp8_colwise_3d_scale_and_cast(b_t, output_dtype=E4M3, round_scales_to_power_of_2=False):
        """(E, K, N) column-major -> e4m3 (E, K, N) column-major, scales (E, 1, N) over K."""
        assert _is_column_major(b_t), "B_t must be column-major"
        scale = _scale(b_t.abs().amax(-2, keepdim=True), round_scales_to_power_of_2)
        return _column_major(_cast(b_t, scale).to(output_dtype)), scale

    @staticmethod
    def triton_fp8_rowwise_3d_transpose_rhs(b_t, output_dtype=E4M3, round_scales_to_power_of_2=False):
        """(E, K, N) -> its transpose (E, N, K) in e4m3, column-major, scales (E, K) over N."""
        b = b_t.transpose(-2, -1)
        scale = _scale(b.abs().amax(-2), round_scales_to_power_of_2)
        return _column_major(_cast(b, scale[:, None, :]).to(output_dtype)), scale

    @staticmethod
    def triton_fp8_per_group_colwise_scales_dual(x1, x2, offsets, output_dtype=E4M3, round_scales_to_power_of_2=False):
        """Two (M, N_i) tensors -> e4m3 column-major, flat scales (E * N_i,) over each group's rows (group-major)."""
        out = []
        for x in (x1, x2):
            q, scales, start = torch.zeros(x.shape, dtype=output_dtype), [], 0
            for end in offsets.tolist():
                scale = _scale(
                    x[start:end].abs().amax(0) if end > start else torch.zeros(x.shape[1]), round_scales_to_power_of_2
                )
                q[start:end] = _cast(x[start:end], scale).to(output_dtype)
                scales.append(scale)
                start = end
            out += [_column_major(q), torch.cat(scales)]
        return tuple(out)

    def scaled_grouped_mm(
        self, a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
    ):
        assert a.dtype == b.dtype == E4M3, (a.dtype, b.dtype)
        for name, t in (("a", a), ("b", b)):  # cuBLAS's rule, which torch checks ("strides should be multiple of
            # 16 bytes"): every stride but the unit one
            assert all(st * t.element_size() % 16 == 0 for st in t.stride() if st != 1), (
                f"{name} strides {t.stride()} should be multiple of 16 bytes"
            )
        assert not _is_column_major(a) and _is_column_major(b), "a row-major, b column-major"
        assert offs is not None and offs.dtype == torch.int32 and bias is None
        ends = offs.tolist()
        sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
        assert all(size % FP8_GROUP_ALIGNMENT == 0 for size in sizes), f"group sizes {sizes} not multiples of 16"
        out_dtype = out_dtype or torch.bfloat16
        if b.dim() == 3:  # (M, K) x (E, K, N) -> (M, N); scale_a (M,), scale_b (E, N): dequantising multipliers
            self.calls["2d_3d"] += 1
            out = torch.full((a.shape[0], b.shape[-1]), float("nan"))  # rows past the last offset: unwritten
            for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
                weight = b[e].float() * scale_b[e][None, :]
                if self.transpose_square_weights and weight.shape[0] == weight.shape[1]:
                    weight = weight.t()
                out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ weight
            return out.to(out_dtype)
        # (N, M) x (M, K) -> (E, N, K), groups along M; scale_a (E * N,), scale_b (E * K,) group-major
        self.calls["2d_2d"] += 1
        n, k = a.shape[0], b.shape[1]
        out = torch.empty(len(ends), n, k)
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            out[e] = (a[:, start:end].float() * scale_a[e * n : (e + 1) * n, None]) @ (
                b[start:end].float() * scale_b[e * k : (e + 1) * k][None, :]
            )
        return out.to(out_dtype)


@pytest.fixture
def fp8_double(monkeypatch):
    """The emulated FP8 kernels, and the hardware check answering as on an SM90 GPU with triton (a test double)."""
    monkeypatch.setattr(fp8, "fp8_grouped_mm_unsupported_reason", lambda device=None: None)
    return EmulatedFp8Kernels().install(monkeypatch)


def test_the_doubles_keep_within_the_fp8_error_bound_and_enforce_the_kernel_contract(fp8_double):
    """torchao's FP8 grouped GEMM over the doubles: each product term `a_k b_k` moves by at most (1 + u)^2 - 1 of
    |a_k b_k| (u = e4m3 unit roundoff; amax scaling puts the large terms at the top of the range, and a power-of-two
    scale leaves the smallest within twice e4m3's subnormal step of the amax), plus fp32 roundoff over K terms. Groups
    that are not multiples of 16 rows are refused, and so is torchao's own padding (0.18), which is why the experts
    align their groups themselves."""
    gen = torch.Generator().manual_seed(0)
    A, B = torch.randn(48, 64, generator=gen), torch.randn(4, 48, 64, generator=gen)  # B: (E, N, K), as stored
    B_t = B.transpose(-2, -1)  # (E, K, N) column-major, as the experts pass it
    offs = torch.tensor([16, 16, 32, 48], dtype=torch.int32)
    got = fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm(
        A, B_t, offs, torch.float32, pad_token_groups_for_grouped_mm=False
    )
    exact = torch._grouped_mm(A, B_t, offs=offs)
    magnitude = torch._grouped_mm(A.abs(), B_t.abs(), offs=offs)
    subnormal = 2 * 2.0**-9 / E4M3_MAX
    bound = (
        ((1 + E4M3_UNIT_ROUNDOFF) ** 2 - 1) * magnitude
        + 2 * subnormal * A.abs().amax() * B_t.abs().amax() * A.shape[1]
        + float_tol(exact, terms=A.shape[1])["atol"]
    )
    assert ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, exact)  # it does round
    with pytest.raises(AssertionError, match="not multiples of 16"):
        fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm(
            A,
            B_t,
            torch.tensor([10, 10, 25, 48], dtype=torch.int32),
            torch.float32,
            pad_token_groups_for_grouped_mm=False,
        )
    with pytest.raises(AssertionError, match="not yet supported"):
        fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm(
            A, B_t, offs, torch.float32, pad_token_groups_for_grouped_mm=True
        )


def test_aligned_experts_equal_grouped_mm_and_align_every_group():
    """The converted experts' layout (:func:`aligned_grouped_mm_experts_forward`) without FP8: the same outputs and
    gradients as transformers' ``grouped_mm`` up to fp32 roundoff, every group of rows starting at a multiple of 16, in
    a buffer whose size does not depend on the routing."""
    from modeling_spider import SpiderMoE
    from tests.helpers import tiny

    torch.manual_seed(0)
    moe = SpiderMoE(tiny(n_routed_experts=8))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(37, moe.config.hidden_size, requires_grad=True)
    results = {}
    offsets, buffers = [], []

    def spy(a, b, offs=None, **kwargs):
        offsets.append(offs.tolist())
        buffers.append(a.shape[0])
        return original(a, b, offs=offs, **kwargs)

    original = torch._grouped_mm
    for implementation in ("grouped_mm", ALIGNED_GROUPED_MM):
        moe.config._experts_implementation = implementation
        moe.zero_grad(set_to_none=True)
        x.grad = None
        if implementation == ALIGNED_GROUPED_MM:
            torch._grouped_mm = spy
        try:
            out = moe(x)[0]
            out.square().sum().backward()
        finally:
            torch._grouped_mm = original
        results[implementation] = (out.detach(), x.grad.clone(), moe.experts.gate_up_proj.grad.clone())
    for got, expected in zip(results[ALIGNED_GROUPED_MM], results["grouped_mm"]):
        torch.testing.assert_close(got, expected, **float_tol(expected, terms=moe.config.hidden_size))
    slots = x.shape[0] * moe.top_k
    bound = slots + moe.config.n_routed_experts * (FP8_GROUP_ALIGNMENT - 1)
    assert buffers and set(buffers) == {-(-bound // FP8_GROUP_ALIGNMENT) * FP8_GROUP_ALIGNMENT}
    for ends in offsets:
        assert all(end % FP8_GROUP_ALIGNMENT == 0 for end in ends) and ends[-1] >= slots


def test_fused_experts_run_the_fp8_grouped_gemm(fp8_double):
    """After conversion a training step sends every grouped GEMM of every MoE layer and loop through torchao's FP8 op
    (forward: gate_up and down per layer per loop), the loss moves by FP8 rounding only, and the wrapped parameters get
    gradients."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 40))
    reference = tiny_model(seed=0).to(torch.bfloat16)
    model = tiny_model(seed=0).to(torch.bfloat16)
    report = convert_for_fp8_training(model, experts="on")  # --fp8_layers auto: no linear layer of tiny pays
    layers = model.model.recurrent_block.layers
    assert list(report.converted) == [f"model.recurrent_block.layers.{i}.mlp.experts" for i in range(len(layers))]
    assert "routed experts: converted 2 of 2" in report.message
    for layer in layers:
        assert isinstance(layer.mlp.experts.gate_up_proj.data, TrainingWeightWrapperBaseTensor)
    reference.eval(), model.eval()
    with torch.no_grad():
        expected = reference(ids, labels=ids).lm_loss
        got = model(ids, labels=ids).lm_loss
    assert fp8_double.calls == {"2d_3d": 2 * len(layers) * model.config.n_loops, "2d_2d": 0}
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

    from modeling_spider import SpiderMoE
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
    config = Float8TrainingOpConfig(out_dtype=torch.float32)
    convert_experts_to_fp8(moe, ["experts"], config=config)
    assert isinstance(moe.experts.gate_up_proj.data, TrainingWeightWrapperBaseTensor)
    with torch.no_grad():
        got = moe(x)[0]
    assert fp8_double.calls == {"2d_3d": 2, "2d_2d": 0}
    bound = fp8_error_bound(x, gate_up, down, scores, moe.top_k) + float_tol(expected, terms=gate_up.shape[-1])["atol"]
    assert ((got - expected).abs() <= bound).all()
    assert not torch.equal(got, expected)


def fp8_error_bound(x, gate_up, down, scores, top_k, sigmas: float = 6.0) -> torch.Tensor:
    """`sigmas` standard deviations of the FP8 experts' output error, `(T, D)` (see the test's docstring)."""
    from modeling_spider import SpiderMoEKernels

    F = torch.nn.functional
    rel_sd = E4M3_UNIT_ROUNDOFF * (2.0 / 3.0) ** 0.5
    half_subnormal = 2.0**-9 / E4M3_MAX  # relative to the amax of the row / column scaled (a power-of-two scale: 2x)
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
            dh = rel_sd * ((w_gu**2) @ (xt**2)).sqrt()
            g, u, dg, du = h[:I], h[I:], dh[:I], dh[I:]
            z = F.silu(g) * u
            dz = ((silu_lipschitz * dg * u) ** 2 + (F.silu(g) * du) ** 2).sqrt()
            dy = ((w_d**2) @ (dz**2) + rel_sd**2 * (w_d**2) @ (z**2)).sqrt()
            sub_y = half_subnormal * (z.abs().max() * w_d.abs().sum(1) + w_d.abs().amax(1) * z.abs().sum())
            sub_z = w_d.abs() @ (silu_lipschitz * sub_h[:I] * u.abs() + F.silu(g).abs() * sub_h[I:])
            out[t] += weights[t, j] * (sigmas * dy + sub_y + sub_z)
    return out


def test_the_layer_bound_catches_a_wrong_layout(monkeypatch):
    """The bound above is tight enough to see an FP8 op that multiplied a transposed expert matrix."""
    from modeling_spider import SpiderMoE
    from tests.helpers import tiny

    # gate_up_proj: (E, 2I, D) with 2I == D in the tiny preset, so its transpose multiplies without a shape error
    EmulatedFp8Kernels(transpose_square_weights=True).install(monkeypatch)
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
        convert_experts_to_fp8(moe, ["experts"])
        got = moe(x)[0].float()
    assert ((got - expected).abs() > fp8_error_bound(x, gate_up, down, scores, moe.top_k)).any()


def test_other_implementations_and_odd_sizes_are_skipped_with_the_reason(fp8_double):
    report = convert_for_fp8_training(tiny_model(experts_implementation="eager"), experts="auto")
    assert not report.converted and all("only grouped_mm" in r for r in report.kept.values() if "experts" in r)
    report = convert_for_fp8_training(tiny_model(moe_intermediate_size=24), experts="auto")
    experts = [r for fqn, r in report.kept.items() if fqn.endswith("mlp.experts")]
    assert not report.converted and experts and all("not divisible by 16" in r for r in experts)


def test_unwrapped_model_saves_and_loads_plain(tmp_path, fp8_double):
    model = tiny_model(seed=0)
    first = convert_for_fp8_training(model, experts="on")
    assert convert_for_fp8_training(model, experts="on").converted == first.converted  # idempotent
    assert model.config._experts_implementation == ALIGNED_GROUPED_MM
    assert convert_fp8_to_plain(model) == model.config.num_recurrent_layers
    assert model.config._experts_implementation == "grouped_mm"
    experts = model.model.recurrent_block.layers[0].mlp.experts
    assert type(experts.gate_up_proj.data) is torch.Tensor and experts.gate_up_proj.requires_grad
    model.save_pretrained(tmp_path)
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert fp8_double.calls == {"2d_3d": 0, "2d_2d": 0}


def test_unsupported_reason_on_this_machine():
    reason = fp8_grouped_mm_unsupported_reason("cpu")
    assert reason is not None and "needs CUDA" in reason


def test_fp8_experts_modes_on_a_machine_without_the_kernels():
    """``--fp8_experts`` on this CPU: ``auto`` leaves every experts module in high precision with the reason, ``on``
    refuses with it, ``off`` says it was asked; a wrong value names the flag."""
    model = tiny_model(seed=0)
    experts = [f"model.recurrent_block.layers.{i}.mlp.experts" for i in range(model.config.num_recurrent_layers)]
    auto = convert_for_fp8_training(model, experts="auto", device="cpu")
    assert not auto.converted and all(fqn in auto.kept for fqn in experts)
    assert (
        all("needs CUDA" in auto.kept[fqn] for fqn in experts) and "routed experts: converted 0 of 2" in auto.message
    )
    assert not has_fp8_weight_wrappers(model)
    with pytest.raises(RuntimeError, match="--fp8_experts on: .*needs CUDA"):
        convert_for_fp8_training(model, experts="on", device="cpu")
    off = convert_for_fp8_training(model, experts="off", device="cpu")
    assert {off.kept[fqn] for fqn in experts} == {"--fp8_experts off"}
    with pytest.raises(ValueError, match="--fp8_experts must be one of"):
        convert_for_fp8_training(model, experts="yes", device="cpu")


def test_trainer_trains_fp8_experts_and_writes_a_plain_checkpoint(tmp_path, fp8_double, monkeypatch):
    """``SpiderTrainer`` with ``precision="fp8"`` on a machine that has the kernels. Test doubles for what this CPU
    lacks: the hardware check answers as on an SM90 GPU with triton, and the FP8 op is the emulated double. The experts
    train through the FP8 grouped GEMM, and the checkpoint Trainer writes holds the plain trained tensors and loads
    into a plain model."""
    from tests.helpers import cpu_trainer

    model = tiny_model(seed=0)
    initial = model.model.recurrent_block.layers[0].mlp.experts.gate_up_proj.detach().clone()
    trainer = cpu_trainer(tmp_path, model=model, max_steps=2, save_strategy="steps", save_steps=2, precision="fp8")
    assert (
        sum(fqn.endswith("mlp.experts") for fqn in trainer.fp8_report.converted) == model.config.num_recurrent_layers
    )
    assert has_fp8_weight_wrappers(trainer.model)
    trainer.train()
    assert fp8_double.calls["2d_3d"] > 0 and fp8_double.calls["2d_2d"] > 0  # forward, input and weight gradients
    saved = SpiderForConditionalGeneration.from_pretrained(tmp_path / "checkpoint-2")
    trained = fp8_to_plain_state_dict(trainer.model)
    assert not has_fp8_weight_wrappers(saved)
    for key, value in saved.state_dict().items():
        assert torch.equal(value, trained[key]), key
    gate_up = saved.model.recurrent_block.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(gate_up, initial)  # the FP8 experts trained
