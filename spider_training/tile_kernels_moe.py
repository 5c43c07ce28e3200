"""TileKernels' (deepseek-ai/TileKernels) MoE routing kernels, swapped into Spider before training as tk-train.py did.

``modeling_spider.SpiderMoE`` routes through its ``kernels`` attribute (class default: the torch reference
``SpiderMoEKernels``); :func:`swap_in_tile_kernels` sets it per layer to :class:`TileKernelsMoEKernels`: TileKernels'
``topk_gate(scores fp32 [T, E], k) -> int64 [T, k]`` (ties to the smaller index) and ``normalize_weight(w fp32 [T, k])
-> (denominator [T], normalized [T, k])`` (sum from 1e-20) on CUDA tensors, the reference elsewhere (its fused
``moe_topk_gate`` scores with ``sqrt(softplus)``, Spider's router is a softmax; the 1.x layout ops no longer import).
The kernels (SM90/SM100, ``k <= 32``) have no backward: ``normalize_weight`` gets the reference's gradient.
"""

from __future__ import annotations

import importlib
import logging

import torch

from modeling_spider import SpiderMoEKernels

logger = logging.getLogger(__name__)

#: The ``tile_kernels.moe`` functions the adapter calls.
TILE_KERNELS_FUNCTIONS = ("topk_gate", "normalize_weight")
BACKEND_TILE_KERNELS = "tile_kernels"
BACKEND_TORCH = "torch"
TILE_KERNELS_MAX_TOPK = 32


class _NormalizeWeight(torch.autograd.Function):
    """TileKernels' ``normalize_weight`` forward; the backward of ``n = w / d``, ``d = 1e-20 + sum(w)``."""

    @staticmethod
    def forward(ctx, topk_weights, kernel):
        denominator, normalized = kernel(topk_weights.to(torch.float32).contiguous())
        ctx.save_for_backward(topk_weights, denominator)
        return denominator, normalized

    @staticmethod
    def backward(ctx, grad_denominator, grad_normalized):
        topk_weights, denominator = ctx.saved_tensors
        w, d = topk_weights.to(torch.float32), denominator[:, None]
        # d n_i / d w_j = delta_ij / d - w_i / d^2 ; d d / d w_j = 1
        grad = grad_normalized / d - (grad_normalized * w).sum(-1, keepdim=True) / (d * d) + grad_denominator[:, None]
        return grad.to(topk_weights.dtype), None


class TileKernelsMoEKernels:
    """``SpiderMoEKernels``' interface with TileKernels' ``topk_gate`` and ``normalize_weight``: shapes, dtypes and
    gradients the reference's, which serves every other op and every non-CUDA tensor (unless `allow_non_cuda`, for CPU
    test doubles). Raises ValueError when `tile_kernels_module` lacks one of :data:`TILE_KERNELS_FUNCTIONS`."""

    name = BACKEND_TILE_KERNELS
    alignment = 1

    def __init__(self, tile_kernels_module, reference=SpiderMoEKernels, allow_non_cuda: bool = False):
        moe = getattr(tile_kernels_module, "moe", tile_kernels_module)  # the package, or tile_kernels.moe itself
        missing = [n for n in TILE_KERNELS_FUNCTIONS if not callable(getattr(moe, n, None))]
        if missing:
            raise ValueError(f"{tile_kernels_module!r} lacks the TileKernels MoE functions {missing}")
        self._topk_gate, self._normalize_weight = moe.topk_gate, moe.normalize_weight
        self.reference, self.allow_non_cuda = reference, allow_non_cuda

    def __deepcopy__(self, memo):  # function references only: share it (modules cannot be deep-copied)
        return self

    def _runs(self, tensor: torch.Tensor, k: int) -> bool:
        return (tensor.is_cuda or self.allow_non_cuda) and k <= TILE_KERNELS_MAX_TOPK and tensor.shape[0] > 0

    def topk_gate(self, scores: torch.Tensor, num_topk: int) -> torch.Tensor:
        """`scores` fp32 `(T, E)` -> int64 `(T, k)`, best first, ties to the smaller index (no gradient)."""
        if not self._runs(scores, num_topk):
            return self.reference.topk_gate(scores, num_topk)
        with torch.no_grad():
            return self._topk_gate(scores.detach().to(torch.float32).contiguous(), num_topk)

    def normalize_weight(self, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(T, k)` -> `(denominator fp32 (T,), normalized fp32 (T, k))`, differentiable in `topk_weights`."""
        if not self._runs(topk_weights, topk_weights.shape[-1]):
            return self.reference.normalize_weight(topk_weights)
        return _NormalizeWeight.apply(topk_weights, self._normalize_weight)

    def aux_fi(self, topk_idx: torch.Tensor, num_experts: int, num_topk: int) -> torch.Tensor:
        """DeepSeek's f_i, fp32 `(E,)`: the reference's (TileKernels 2.x has no such kernel)."""
        return self.reference.aux_fi(topk_idx, num_experts, num_topk)


class MoEBackend(str):
    """What :func:`swap_in_tile_kernels` chose (``"tile_kernels"`` or ``"torch"``), with ``reason`` and
    ``num_layers``."""

    def __new__(cls, name: str, reason: str, num_layers: int):
        backend = super().__new__(cls, name)
        backend.reason, backend.num_layers = reason, num_layers
        return backend


def spider_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every SpiderMoE module of `model` (duck-typed: a class ``kernels`` attribute, ``router`` and ``experts``)."""
    return [
        m for m in model.modules() if hasattr(type(m), "kernels") and hasattr(m, "router") and hasattr(m, "experts")
    ]


def swap_in_tile_kernels(model: torch.nn.Module, tile_kernels_module=None) -> MoEBackend:
    """Set every SpiderMoE layer's ``kernels`` to :class:`TileKernelsMoEKernels` where TileKernels can run, and
    return the :class:`MoEBackend` (logged). Without `tile_kernels_module`: ``tile_kernels.moe`` when CUDA is there and
    it imports; a given module (a test double) is used on any tensors. The torch path removes per-layer overrides."""
    layers = spider_moe_layers(model)

    def torch_path(reason: str) -> MoEBackend:
        for layer in layers:
            layer.__dict__.pop("kernels", None)
        logger.info("MoE kernels: torch (%s)", reason)
        return MoEBackend(BACKEND_TORCH, reason, len(layers))

    if not layers:
        return torch_path("the model has no SpiderMoE layers")
    injected = tile_kernels_module is not None
    if not injected:
        if not torch.cuda.is_available():
            return torch_path("CUDA is not available (TileKernels kernels are CUDA-only)")
        try:
            tile_kernels_module = importlib.import_module("tile_kernels.moe")
        except Exception as exc:  # ImportError, or tilelang failing at import time
            return torch_path(f"tile_kernels does not import: {type(exc).__name__}: {exc}")
    try:
        for layer in layers:
            layer.kernels = TileKernelsMoEKernels(tile_kernels_module, type(layer).kernels, allow_non_cuda=injected)
    except ValueError as exc:
        return torch_path(str(exc))
    reason = (
        f"{'injected module' if injected else 'installed tile_kernels.moe'}: "
        f"{', '.join(TILE_KERNELS_FUNCTIONS)} (the rest in torch)"
    )
    logger.info("MoE kernels: %s on %d MoE layers (%s)", BACKEND_TILE_KERNELS, len(layers), reason)
    return MoEBackend(BACKEND_TILE_KERNELS, reason, len(layers))
