"""Tests of spider_training.tile_kernels_moe: the TileKernels MoE adapter and its installation on SpiderMoE layers.

TileKernels cannot run here (every kernel is CUDA-only, and tile-kernels 1.0.0 does not even import with the current
tilelang), so the kernels are replaced by test doubles, ``FakeTileKernels1x`` / ``FakeTileKernels2x``: CPU
implementations of exactly the TileKernels functions' contracts as read from deepseek-ai/TileKernels
(``tile_kernels/moe/*_kernel.py``): the same argument orders, asserts (fp32 contiguous scores, int32 mapping tensors,
``hidden % 256 == 0`` in ``reduce_fused``, ``num_topk <= 32`` in 2.x), output dtypes (int32 mappings, ``reduce_fused``
in the input dtype), no autograd (outputs are fresh tensors computed under ``no_grad``), and the kernel's
non-token-order placement inside an expert's slice. They are written from those contracts, not from
``SpiderMoEKernels``. Around them runs the real adapter and the real SpiderMoE / model code.
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
from spider_training import moe_layout
from spider_training.tile_kernels_moe import (
    BACKEND_1X,
    BACKEND_2X,
    BACKEND_TORCH,
    TileKernelsMoEKernels,
    detect_tile_kernels_api,
    spider_moe_layers,
    swap_in_tile_kernels,
)
from tests.helpers import float_tol, model_terms, tiny_model, train_step

# ----------------------------------------------------------------------------------------------------------------------
# Test doubles
# ----------------------------------------------------------------------------------------------------------------------


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _FakeTileKernelsGate:
    """CPU stand-in for the gate functions both TileKernels generations have. Counts calls in ``calls``."""

    max_topk = None  # 2.x asserts num_topk <= 32

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


class FakeTileKernels1x(_FakeTileKernelsGate):
    """Test double of ``tile_kernels.moe`` 1.x (deepseek-ai/TileKernels): topk_gate, normalize_weight,
    get_fused_mapping, expand_to_fused, reduce_fused, aux_fi, on CPU."""

    def get_fused_mapping(self, topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync=False):
        """Expert-major layout. Eight outputs, tensors int32. Inside an expert's slice the slots are placed in
        *descending* slot order, as the warp-parallel kernel does within a chunk (``pos = prefix - count``)."""
        self.calls["get_fused_mapping"] += 1
        assert topk_idx.is_contiguous() and topk_idx.dtype == torch.int64
        num_tokens, num_topk = topk_idx.shape
        should_sync = num_expanded_tokens == 0 and not force_no_sync
        if should_sync:
            num_expanded_tokens = _align(num_tokens * num_topk + (alignment - 1) * num_experts, alignment)
        flat = topk_idx.reshape(-1).tolist()
        counts = [sum(1 for e in flat if e == expert) for expert in range(num_experts)]
        aligned = [_align(c, alignment) for c in counts]
        starts = [sum(aligned[:e]) for e in range(num_experts)]
        pos_to_expert = [-1] * num_expanded_tokens
        pos_to_token = [-1] * num_expanded_tokens
        pos_to_token_topk = [-1] * num_expanded_tokens
        token_topk_to_pos = [-1] * len(flat)
        for expert in range(num_experts):
            slots = [i for i, e in enumerate(flat) if e == expert][::-1]
            for rank, slot in enumerate(slots):
                pos = starts[expert] + rank
                assert pos < num_expanded_tokens
                pos_to_expert[pos], pos_to_token[pos], pos_to_token_topk[pos] = expert, slot // num_topk, slot
                token_topk_to_pos[slot] = pos

        def i32(values):
            return torch.tensor(values, dtype=torch.int32)

        counts_list = []
        if should_sync:
            counts_list = list(aligned)
            num_expanded_tokens = sum(aligned)
        return (
            i32(pos_to_expert[:num_expanded_tokens]),
            i32(pos_to_token[:num_expanded_tokens]),
            i32(pos_to_token_topk[:num_expanded_tokens]),
            i32(token_topk_to_pos).view(num_tokens, num_topk),
            i32(starts),
            i32([s + a for s, a in zip(starts, aligned)]),
            i32(aligned),
            counts_list,
        )

    def expand_to_fused(self, x, token_topk_to_pos, pos_to_expert):
        """``x [T, H]`` -> ``[N, H]``: row ``token_topk_to_pos[t, j]`` = ``x[t]``, rows with ``pos_to_expert < 0`` = 0."""
        self.calls["expand_to_fused"] += 1
        assert x.is_contiguous() and token_topk_to_pos.is_contiguous()
        assert x.dim() == 2 and token_topk_to_pos.dim() == 2
        assert token_topk_to_pos.dtype == torch.int32 and pos_to_expert.dtype == torch.int32
        assert x.shape[0] == token_topk_to_pos.shape[0]
        with torch.no_grad():
            out = torch.empty((pos_to_expert.shape[0], x.shape[1]), dtype=x.dtype)
            out[pos_to_expert < 0] = 0
            for t in range(x.shape[0]):
                for pos in token_topk_to_pos[t].tolist():
                    if pos >= 0:
                        out[pos] = x[t]
        return out

    def reduce_fused(self, x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, out=None):
        """``out[t] = sum_j w[t, j] * x[pos[t, j]]``, accumulated in fp32 in j order, returned in ``x.dtype``."""
        self.calls["reduce_fused"] += 1
        assert x.shape[1] % 256 == 0, "reduce_fused needs hidden % 256 == 0"
        assert fp8_format == "" and sf is None
        assert token_topk_to_pos.dtype == torch.int32
        assert topk_weights is None or topk_weights.dtype == torch.float32
        num_tokens, num_topk = token_topk_to_pos.shape
        with torch.no_grad():
            acc = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32)
            for j in range(num_topk):
                pos = token_topk_to_pos[:, j].long()
                valid = pos >= 0
                scale = topk_weights[:, j] if topk_weights is not None else torch.ones(num_tokens)
                acc[valid] += x[pos[valid]].to(torch.float32) * scale[valid, None]
            return acc.to(x.dtype)

    def aux_fi(self, topk_idx, num_experts, num_aux_topk):
        """``count_e * E / (T * num_aux_topk)`` as fp32 ``[E]``; -1 entries ignored."""
        self.calls["aux_fi"] += 1
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous()
        num_tokens = topk_idx.shape[0]
        out = torch.zeros(num_experts, dtype=torch.float32)
        for e in topk_idx.reshape(-1).tolist():
            assert -1 <= e < num_experts
        for e in range(num_experts):
            count = int((topk_idx == e).sum())
            if count > 0:
                out[e] = float(count * num_experts) / float(num_tokens * num_aux_topk)
        return out


class FakeTileKernels2x(_FakeTileKernelsGate):
    """Test double of ``tile_kernels.moe`` 2.x: only topk_gate, normalize_weight (num_topk <= 32) and the
    sqrt-softplus ``moe_topk_gate*`` family, which Spider's softmax router must not use (calling them fails)."""

    max_topk = 32

    def moe_topk_gate_forward(self, logits, num_topk, *args, **kwargs):
        self.calls["moe_topk_gate_forward"] += 1
        raise AssertionError("moe_topk_gate_forward scores with sqrt(softplus); Spider's adapter must not call it")

    def moe_topk_gate(self, *args, **kwargs):
        self.calls["moe_topk_gate"] += 1
        raise AssertionError("moe_topk_gate must not be called by Spider's adapter")

    def moe_topk_gate_backward(self, *args, **kwargs):
        self.calls["moe_topk_gate_backward"] += 1
        raise AssertionError("moe_topk_gate_backward must not be called by Spider's adapter")


# ----------------------------------------------------------------------------------------------------------------------
# The test doubles follow TileKernels' own contracts
# ----------------------------------------------------------------------------------------------------------------------


def test_fake_topk_gate_breaks_ties_to_smaller_index():
    fake = FakeTileKernels1x()
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.5, 0.2, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    expected = [sorted(range(4), key=lambda e: (-scores[t, e].item(), e))[:3] for t in range(scores.shape[0])]
    assert fake.topk_gate(scores, 3).tolist() == expected == [[1, 2, 3], [0, 2, 1], [0, 1, 2]]


@pytest.mark.parametrize("alignment", [1, 4])
def test_fake_get_fused_mapping_satisfies_tilekernels_invariants(alignment):
    # The checks of deepseek-ai/TileKernels tests/moe/test_get_fused_mapping.py, on the double.
    torch.manual_seed(0)
    num_tokens, num_topk, num_experts = 23, 2, 6
    topk_idx = torch.stack([torch.randperm(num_experts)[:num_topk] for _ in range(num_tokens)])
    fake = FakeTileKernels1x()
    outputs = fake.get_fused_mapping(topk_idx, num_experts, 0, alignment)
    p2e, p2t, p2tk, tk2p, start, end, per_expert, per_expert_list = outputs
    assert per_expert.tolist() == per_expert_list
    offset = 0
    for e in range(num_experts):
        assert start[e].item() == offset
        s = p2e[offset:offset + per_expert_list[e]]
        assert int((s == e).sum()) == int((topk_idx == e).sum())
        assert bool(((s == e) | (s == -1)).all())
        assert per_expert_list[e] % alignment == 0
        offset += per_expert_list[e]
        assert end[e].item() == offset
    valid = p2e >= 0
    slots = p2tk[valid].long()
    assert torch.equal(tk2p[slots // num_topk, slots % num_topk].long(), torch.arange(p2e.numel())[valid])
    assert torch.equal(topk_idx[slots // num_topk, slots % num_topk], p2e[valid].long())
    assert torch.equal(slots // num_topk, p2t[valid].long())
    assert torch.equal(~valid, p2t < 0) and torch.equal(~valid, p2tk < 0)
    # Within an expert, slots are not in token order (unlike the torch reference's stable sort).
    reference = moe_layout.get_fused_mapping(topk_idx, num_experts, alignment)
    assert not torch.equal(reference.token_topk_to_pos, tk2p.long())


# ----------------------------------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------------------------------


def test_detection_by_function_set():
    assert detect_tile_kernels_api(FakeTileKernels1x()) == "1.x"
    assert detect_tile_kernels_api(FakeTileKernels2x()) == "2.x"
    # the `tile_kernels` package itself (functions under `.moe`) is accepted too
    assert detect_tile_kernels_api(types.SimpleNamespace(moe=FakeTileKernels2x())) == "2.x"
    # a version string means nothing; an incomplete set is neither
    gate_only = FakeTileKernels1x()
    partial = types.SimpleNamespace(
        __version__="1.0.0", topk_gate=gate_only.topk_gate, get_fused_mapping=gate_only.get_fused_mapping
    )
    assert detect_tile_kernels_api(partial) is None
    mixed = types.SimpleNamespace(
        topk_gate=gate_only.topk_gate,
        normalize_weight=gate_only.normalize_weight,
        expand_to_fused=gate_only.expand_to_fused,
    )
    assert detect_tile_kernels_api(mixed) is None
    with pytest.raises(ValueError, match="neither"):
        TileKernelsMoEKernels(partial)
    with pytest.raises(ValueError, match="alignment"):
        TileKernelsMoEKernels(FakeTileKernels1x(), alignment=0)


def test_adapter_uses_only_the_detected_functions():
    adapter1 = TileKernelsMoEKernels(FakeTileKernels1x(), allow_non_cuda=True)
    adapter2 = TileKernelsMoEKernels(FakeTileKernels2x(), allow_non_cuda=True)
    assert adapter1.name == BACKEND_1X and set(adapter1.used_functions) == {
        "topk_gate", "normalize_weight", "get_fused_mapping", "expand_to_fused", "reduce_fused", "aux_fi"
    }
    assert adapter2.name == BACKEND_2X and set(adapter2.used_functions) == {"topk_gate", "normalize_weight"}


# ----------------------------------------------------------------------------------------------------------------------
# Op level: adapter over the doubles == torch reference, values and gradients
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [256, 64])
@pytest.mark.parametrize("alignment", [1, 4])
def test_adapter_ops_match_reference(hidden, alignment):
    torch.manual_seed(0)
    T, E, k = 19, 8, 2
    fake = FakeTileKernels1x()
    adapter = TileKernelsMoEKernels(fake, allow_non_cuda=True, alignment=alignment)
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
    torch.testing.assert_close(norm_a, norm_r, rtol=0, atol=0)
    torch.testing.assert_close(den_a, den_r, **float_tol(den_r, terms=k))
    g = torch.randn(T, k)
    (norm_a * g).sum().add(den_a.sum() * 0.5).backward()
    (norm_r * g).sum().add(den_r.sum() * 0.5).backward()
    torch.testing.assert_close(w_a.grad, w_r.grad, **float_tol(w_r.grad, terms=2 * k))

    mapping = adapter.get_fused_mapping(idx, E, alignment)
    ref_mapping = moe_layout.get_fused_mapping(idx, E, alignment)
    assert mapping.token_topk_to_pos.dtype == torch.int64
    assert mapping.pos_to_expert.shape == ref_mapping.pos_to_expert.shape
    assert torch.equal(mapping.num_tokens_per_expert, ref_mapping.num_tokens_per_expert)
    assert torch.equal(mapping.expert_end, ref_mapping.expert_end)

    x_a = torch.randn(T, hidden, requires_grad=True)
    x_r = x_a.detach().clone().requires_grad_(True)
    weights_a = norm_r.detach().clone().requires_grad_(True)
    weights_r = norm_r.detach().clone().requires_grad_(True)
    fused_a = adapter.expand_to_fused(x_a, mapping.token_topk_to_pos, mapping.pos_to_expert)
    fused_r = moe_layout.expand_to_fused(x_r, ref_mapping.token_topk_to_pos, ref_mapping.pos_to_expert)
    # same rows per expert slice (order inside a slice may differ), zero padding rows
    assert bool((fused_a[mapping.pos_to_expert < 0] == 0).all())
    for e in range(E):
        s, t = mapping.expert_start[e], mapping.expert_end[e]
        rows_a = sorted(map(tuple, fused_a[s:t].tolist()))
        rows_r = sorted(map(tuple, fused_r[s:t].tolist()))
        assert rows_a == rows_r
    # a row-wise "expert" (same on every row) keeps the comparison exact despite the different row order
    scale = torch.linspace(0.5, 1.5, hidden)
    out_a = adapter.reduce_fused(torch.tanh(fused_a) * scale, weights_a, mapping.token_topk_to_pos)
    out_r = moe_layout.reduce_fused(torch.tanh(fused_r) * scale, weights_r, ref_mapping.token_topk_to_pos)
    assert out_a.dtype == torch.float32 and out_a.shape == (T, hidden)
    torch.testing.assert_close(out_a, out_r, **float_tol(out_r, terms=k))
    g_out = torch.randn(T, hidden)
    (out_a * g_out).sum().backward()
    (out_r * g_out).sum().backward()
    torch.testing.assert_close(x_a.grad, x_r.grad, **float_tol(x_r.grad, terms=k))
    torch.testing.assert_close(weights_a.grad, weights_r.grad, **float_tol(weights_r.grad, terms=hidden))
    # the kernel's hidden % 256 constraint: reduce_fused falls back to torch below it
    assert fake.calls["reduce_fused"] == (1 if hidden % 256 == 0 else 0)
    for name in ("topk_gate", "normalize_weight", "get_fused_mapping", "expand_to_fused", "aux_fi"):
        assert fake.calls[name] == 1, name


def test_adapter_keeps_cpu_tensors_off_cuda_only_kernels():
    fake = FakeTileKernels1x()
    adapter = TileKernelsMoEKernels(fake)  # allow_non_cuda=False: the real-kernel setting
    scores = torch.randn(5, 8).softmax(-1)
    idx = adapter.topk_gate(scores, 2)
    adapter.normalize_weight(scores.gather(1, idx))
    adapter.get_fused_mapping(idx, 8, 1)
    assert sum(fake.calls.values()) == 0


# ----------------------------------------------------------------------------------------------------------------------
# Model level: swap_in_tile_kernels with a double == torch path (outputs and gradients)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fake_cls, implementation, hidden",
    [
        (FakeTileKernels1x, "grouped_mm", 256),
        (FakeTileKernels1x, "eager", 64),
        (FakeTileKernels2x, "grouped_mm", 64),
        (FakeTileKernels2x, "eager", 64),
    ],
)
def test_model_with_fake_tile_kernels_matches_torch_path(fake_cls, implementation, hidden):
    model = tiny_model(hidden_size=hidden, experts_implementation=implementation)
    torch.manual_seed(123)
    input_ids = torch.randint(0, 256, (2, 48))
    ref_out, ref_grads = train_step(model, input_ids)

    fake = fake_cls()
    backend = swap_in_tile_kernels(model, fake)
    expected = BACKEND_1X if fake_cls is FakeTileKernels1x else BACKEND_2X
    assert backend == expected and backend.num_layers == SpiderConfig.from_preset("tiny").num_recurrent_layers
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

    # the routing ops; the fused experts sort the token-slots themselves (no fused-layout op on the model's path), and
    # the training forward's padded segment axis counts the real rows' load in torch (aux_fi takes no row mask)
    assert {name for name, n in fake.calls.items() if n > 0} == {"topk_gate", "normalize_weight"}
    if fake_cls is FakeTileKernels1x:  # aux_fi where every routed row is real: the exact rows of a cached forward
        model.eval()
        with torch.no_grad():
            model(input_ids, use_cache=True)
        assert fake.calls["aux_fi"] > 0


def test_swap_keeps_torch_without_cuda_and_without_injected_module(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_model()
    swap_in_tile_kernels(model, FakeTileKernels1x())
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
    fake = FakeTileKernels1x()
    package, moe = types.ModuleType("tile_kernels"), types.ModuleType("tile_kernels.moe")
    for name in ("topk_gate", "normalize_weight", "get_fused_mapping", "expand_to_fused", "reduce_fused", "aux_fi"):
        setattr(moe, name, getattr(fake, name))
    package.moe = moe
    monkeypatch.setitem(sys.modules, "tile_kernels", package)
    monkeypatch.setitem(sys.modules, "tile_kernels.moe", moe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tiny_model()
    backend = swap_in_tile_kernels(model)
    assert backend == BACKEND_1X and "installed tile_kernels.moe" in backend.reason
    assert "topk_gate, normalize_weight and aux_fi" in backend.reason
    train_step(model, torch.randint(0, 256, (1, 24)))
    assert sum(fake.calls.values()) == 0


def test_swap_with_unknown_function_set_and_model_without_moe():
    odd = types.SimpleNamespace(topk_gate=lambda scores, k: None)
    backend = swap_in_tile_kernels(tiny_model(), odd)
    assert backend == BACKEND_TORCH and "neither" in backend.reason and "topk_gate" in backend.reason
    backend = swap_in_tile_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4)), FakeTileKernels1x())
    assert backend == BACKEND_TORCH and "no SpiderMoE" in backend.reason


def test_swapped_model_deepcopies():
    model = tiny_model()
    swap_in_tile_kernels(model, FakeTileKernels2x())
    clone = copy.deepcopy(model)
    assert all(layer.kernels.name == BACKEND_2X for layer in spider_moe_layers(clone))
