"""Tests of spider_training.tile_kernels_moe: TileKernels' MoE routing kernels swapped into SpiderMoE layers.

TileKernels cannot run here (every kernel is CUDA-only; tile-kernels 2.x needs Python >= 3.12), so its functions are
replaced by a test double, ``FakeTileKernels2x``: CPU implementations of exactly the contracts read from
deepseek-ai/TileKernels (``tile_kernels/moe/*_kernel.py``): argument orders, asserts (fp32 contiguous inputs,
``num_topk <= 32``), output dtypes, no autograd (fresh tensors computed under ``no_grad``). They are written from those
contracts, not from ``SpiderMoEKernels``. Around them runs the real adapter and the real SpiderMoE / model code.
"""

from __future__ import annotations

import collections
import copy
import sys
import types

import pytest
import torch

from configuration_spider import SpiderConfig
from modeling_spider import SpiderMoEKernels
from spider_training.tile_kernels_moe import (
    BACKEND_TILE_KERNELS,
    BACKEND_TORCH,
    TileKernelsMoEKernels,
    spider_moe_layers,
    swap_in_tile_kernels,
)
from tests.helpers import float_tol, model_terms, tiny_model, train_step

# ---------------------------------------------------------------------------------------------------------------------
# Test double
# ---------------------------------------------------------------------------------------------------------------------


class FakeTileKernels2x:
    """Test double of ``tile_kernels.moe`` 2.x (deepseek-ai/TileKernels) on CPU: ``topk_gate`` and ``normalize_weight``
    from their contracts (both assert num_topk <= 32), and the sqrt-softplus ``moe_topk_gate*`` family, which Spider's
    softmax router must not use (calling them fails). Counts calls in ``calls``."""

    max_topk = 32

    def __init__(self):
        self.calls = collections.Counter()

    def topk_gate(self, scores: torch.Tensor, num_topk: int) -> torch.Tensor:
        """Repeated arg-max per row (the kernel's loop), ties to the smaller index; int64 [T, k]."""
        self.calls["topk_gate"] += 1
        assert scores.dim() == 2 and scores.is_contiguous() and scores.dtype == torch.float32
        num_tokens, num_experts = scores.shape
        assert num_topk <= num_experts
        if self.max_topk is not None:
            assert num_topk <= self.max_topk
        topk_idx = torch.empty((num_tokens, num_topk), dtype=torch.int64)
        if num_tokens == 0:
            return topk_idx
        with torch.no_grad():
            work = scores.clone()
            expert_ids = torch.arange(num_experts).expand(num_tokens, num_experts)
            for k in range(num_topk):
                amax = work.max(dim=1, keepdim=True).values
                chosen = torch.where(work == amax, expert_ids, num_experts).min(dim=1).values
                topk_idx[:, k] = chosen
                work[torch.arange(num_tokens), chosen] = float("-inf")
        return topk_idx

    def normalize_weight(self, topk_weights: torch.Tensor):
        """``(denominator [T], normalized [T, k])``; the running sum starts at 1e-20 (kernel's ``init=1e-20``)."""
        self.calls["normalize_weight"] += 1
        assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
        if self.max_topk is not None:
            assert topk_weights.shape[1] <= self.max_topk
        with torch.no_grad():
            total = torch.full((topk_weights.shape[0],), 1e-20, dtype=torch.float32)
            for i in range(topk_weights.shape[1]):
                total = total + topk_weights[:, i]
            normalized = torch.empty_like(topk_weights)
            for i in range(topk_weights.shape[1]):
                normalized[:, i] = topk_weights[:, i] / total
        return total, normalized

    def moe_topk_gate_forward(self, logits, num_topk, *args, **kwargs):
        self.calls["moe_topk_gate_forward"] += 1
        raise AssertionError("moe_topk_gate_forward scores with sqrt(softplus); Spider's adapter must not call it")

    def moe_topk_gate(self, *args, **kwargs):
        self.calls["moe_topk_gate"] += 1
        raise AssertionError("moe_topk_gate must not be called by Spider's adapter")

    def moe_topk_gate_backward(self, *args, **kwargs):
        self.calls["moe_topk_gate_backward"] += 1
        raise AssertionError("moe_topk_gate_backward must not be called by Spider's adapter")


# ---------------------------------------------------------------------------------------------------------------------
# Op level: the adapter over the double == torch reference, values and gradients
# ---------------------------------------------------------------------------------------------------------------------


def test_fake_topk_gate_breaks_ties_to_smaller_index():
    fake = FakeTileKernels2x()
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.5, 0.2, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    expected = [sorted(range(4), key=lambda e: (-scores[t, e].item(), e))[:3] for t in range(scores.shape[0])]
    assert fake.topk_gate(scores, 3).tolist() == expected == [[1, 2, 3], [0, 2, 1], [0, 1, 2]]


def test_adapter_ops_match_reference():
    torch.manual_seed(0)
    T, E, k = 19, 8, 2
    fake = FakeTileKernels2x()
    adapter = TileKernelsMoEKernels(fake, allow_non_cuda=True)
    ref = SpiderMoEKernels
    scores = torch.randn(T, E).softmax(-1)
    scores[3, 5] = scores[3, 2]  # a tie
    idx = adapter.topk_gate(scores, k)
    assert torch.equal(idx, ref.topk_gate(scores, k))
    assert torch.equal(adapter.aux_fi(idx, E, k), ref.aux_fi(idx, E, k))
    w_a = scores.gather(1, idx).requires_grad_(True)
    w_r = w_a.detach().clone().requires_grad_(True)
    den_a, norm_a = adapter.normalize_weight(w_a)
    den_r, norm_r = ref.normalize_weight(w_r)
    torch.testing.assert_close(norm_a, norm_r, **float_tol(norm_r, terms=k))
    torch.testing.assert_close(den_a, den_r, **float_tol(den_r, terms=k))
    g = torch.randn(T, k)
    (norm_a * g).sum().add(den_a.sum() * 0.5).backward()
    (norm_r * g).sum().add(den_r.sum() * 0.5).backward()
    torch.testing.assert_close(w_a.grad, w_r.grad, **float_tol(w_r.grad, terms=2 * k))
    assert dict(fake.calls) == {"topk_gate": 1, "normalize_weight": 1}
    # more than 32 slots per token: the kernels' limit, the reference takes over
    wide = torch.randn(4, 40).softmax(-1)
    assert torch.equal(adapter.topk_gate(wide, 33), ref.topk_gate(wide, 33)) and fake.calls["topk_gate"] == 1


def test_adapter_keeps_cpu_tensors_off_cuda_only_kernels_and_needs_both_functions():
    fake = FakeTileKernels2x()
    adapter = TileKernelsMoEKernels(fake)  # allow_non_cuda=False: the real-kernel setting
    scores = torch.randn(5, 8).softmax(-1)
    adapter.normalize_weight(scores.gather(1, adapter.topk_gate(scores, 2)))
    assert sum(fake.calls.values()) == 0
    with pytest.raises(ValueError, match="lacks the TileKernels MoE functions \\['normalize_weight'\\]"):
        TileKernelsMoEKernels(types.SimpleNamespace(topk_gate=fake.topk_gate))


# ---------------------------------------------------------------------------------------------------------------------
# Model level: swap_in_tile_kernels with the double == torch path (outputs and gradients)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_model_with_fake_tile_kernels_matches_torch_path(implementation):
    model = tiny_model(experts_implementation=implementation)
    torch.manual_seed(123)
    input_ids = torch.randint(0, 256, (2, 48))
    ref_out, ref_grads = train_step(model, input_ids)

    fake = FakeTileKernels2x()
    backend = swap_in_tile_kernels(model, fake)
    assert (
        backend == BACKEND_TILE_KERNELS and backend.num_layers == SpiderConfig.from_preset("tiny").num_recurrent_layers
    )
    assert all(isinstance(layer.kernels, TileKernelsMoEKernels) for layer in spider_moe_layers(model))
    out, grads = train_step(model, input_ids)

    terms = model_terms(model)
    for name in ("loss", "logits", "aux_loss", "expert_load", "boundary_loss", "ponder_loss"):
        torch.testing.assert_close(out[name], ref_out[name], **float_tol(ref_out[name], terms), msg=name)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():  # backward runs the chain twice
        torch.testing.assert_close(grad, ref_grads[name], **float_tol(ref_grads[name], 2 * terms), msg=name)
    router = "model.recurrent_block.layers.0.mlp.router.weight"
    assert ref_grads[router].abs().sum() > 0  # gradients do flow through normalize_weight
    assert {name for name, n in fake.calls.items() if n > 0} == {"topk_gate", "normalize_weight"}


def test_swap_keeps_torch_without_cuda_and_without_injected_module(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_model()
    swap_in_tile_kernels(model, FakeTileKernels2x())
    backend = swap_in_tile_kernels(model)  # back to torch: no CUDA, nothing injected
    assert backend == BACKEND_TORCH and "CUDA is not available" in backend.reason
    for layer in spider_moe_layers(model):
        assert "kernels" not in vars(layer) and layer.kernels is SpiderMoEKernels


def test_swap_keeps_torch_when_tile_kernels_does_not_import(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "tile_kernels", None)  # `import tile_kernels` raises ImportError
    monkeypatch.delitem(sys.modules, "tile_kernels.moe", raising=False)
    backend = swap_in_tile_kernels(tiny_model())
    assert backend == BACKEND_TORCH and "does not import" in backend.reason


def test_swap_imports_installed_tile_kernels_and_guards_cpu_tensors(monkeypatch):
    # CUDA "available" and an importable `tile_kernels.moe` (the double, as a module): the swap picks it up by
    # import; the model stays on CPU, so the adapter must not send CPU tensors to the CUDA-only functions.
    fake = FakeTileKernels2x()
    package, moe = types.ModuleType("tile_kernels"), types.ModuleType("tile_kernels.moe")
    for name in ("topk_gate", "normalize_weight", "moe_topk_gate"):
        setattr(moe, name, getattr(fake, name))
    package.moe = moe
    monkeypatch.setitem(sys.modules, "tile_kernels", package)
    monkeypatch.setitem(sys.modules, "tile_kernels.moe", moe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tiny_model()
    backend = swap_in_tile_kernels(model)
    assert backend == BACKEND_TILE_KERNELS and "installed tile_kernels.moe" in backend.reason
    train_step(model, torch.randint(0, 256, (1, 24)))
    assert sum(fake.calls.values()) == 0


def test_swap_with_missing_functions_and_model_without_moe():
    odd = types.SimpleNamespace(topk_gate=lambda scores, k: None)
    backend = swap_in_tile_kernels(tiny_model(), odd)
    assert backend == BACKEND_TORCH and "lacks the TileKernels MoE functions" in backend.reason
    backend = swap_in_tile_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4)), FakeTileKernels2x())
    assert backend == BACKEND_TORCH and "no SpiderMoE" in backend.reason


def test_swapped_model_deepcopies():
    model = tiny_model()
    swap_in_tile_kernels(model, FakeTileKernels2x())
    clone = copy.deepcopy(model)
    assert all(isinstance(layer.kernels, TileKernelsMoEKernels) for layer in spider_moe_layers(clone))
