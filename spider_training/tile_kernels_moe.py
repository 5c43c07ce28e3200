"""TileKernels (deepseek-ai/TileKernels) MoE routing kernels for Spider, with torch fallbacks (as in tk-train.py, the original training script).

``modeling_spider.SpiderMoE`` calls its ``kernels`` attribute for the routing ops (class default: the torch reference
``SpiderMoEKernels``; an instance attribute overrides it per layer). :class:`TileKernelsMoEKernels` is the same
interface over the installed ``tile_kernels.moe``; :func:`swap_in_tile_kernels` installs it on every MoE layer.

What the model calls: ``topk_gate``, ``normalize_weight``, and ``aux_fi`` where every routed row is real (a forward with
a generation cache; the training forward's padded segment axis counts the real rows' load in torch, as ``aux_fi``
takes no row mask). The routed experts are fused
3-D parameters (``modeling_spider.SpiderExperts``) computed by transformers' experts implementations, which sort the
token-slots by expert themselves (the fused layout at alignment 1, offsets on the device), so the model no longer calls
the fused-layout ops; the adapter still wraps them (``get_fused_mapping``, ``expand_to_fused``, ``reduce_fused``) for
code that runs that layout itself, with the contracts below.

TileKernels API generations, told apart by the functions ``tile_kernels.moe`` exposes (never by version string):

* **1.x** -- ``topk_gate, normalize_weight, get_fused_mapping, expand_to_fused, reduce_fused, aux_fi``: the whole
  routing pipeline ("tile_kernels 1.x fused").
* **2.x** -- ``topk_gate, normalize_weight`` plus ``moe_topk_gate[_forward|_backward]``; the fused-layout ops are
  gone. ``moe_topk_gate`` scores with ``sqrt(softplus(logits))`` only (it asserts ``scoring_func == 'sqrtsoftplus'``),
  while Spider's router is a softmax (DeepSeek-V3's routing), so only ``topk_gate`` and ``normalize_weight`` are used
  ("tile_kernels 2.x gate-only"); the mapping / expand / reduce / aux_fi ops run in torch.

Facts about the kernels (read from the TileKernels sources) that the adapter handles:

* No op has an autograd backward (tilelang kernels writing into ``torch.empty`` outputs). ``topk_gate``,
  ``get_fused_mapping`` and ``aux_fi`` produce integer / count outputs that need none. ``normalize_weight``,
  ``expand_to_fused`` and ``reduce_fused`` are wrapped in ``torch.autograd.Function``\\ s whose backward is the torch
  reference math (the gradients ``SpiderMoEKernels`` gets from autograd).
* ``topk_gate(scores fp32 contiguous [T, E], num_topk) -> int64 [T, k]``: repeated arg-max, ties to the smaller index.
* ``normalize_weight(w fp32 contiguous [T, k]) -> (denominator [T], normalized [T, k])``, sum starting at 1e-20.
* ``get_fused_mapping(topk_idx int64 contiguous [T, k], num_experts, num_expanded_tokens, alignment)`` returns eight
  values, the tensors **int32**: ``pos_to_expert, pos_to_token, pos_to_token_topk [N], token_topk_to_pos [T, k],
  expert_start, expert_end, num_tokens_per_expert [E]`` (counts rounded up to `alignment`) and a Python list of the
  counts (filled only when it synchronised). ``num_expanded_tokens`` N is the size of the expert-major buffer: 0 asks
  the op to size it itself (host sync), a positive N is used as given (rows past the last expert are padding, -1).
  The adapter passes the torch reference's static bound (``moe_layout.fused_num_rows``: ``T*k +
  E*(alignment-1)`` rounded up to `alignment`; no sync, same N as the torch path) and returns int64 tensors (the
  ``FusedMapping`` contract). Within one expert's slice the kernel does *not* keep token order (warp-parallel
  placement fills each chunk backwards); nothing downstream depends on that order.
* ``expand_to_fused(x contiguous [T, H], token_topk_to_pos int32, pos_to_expert int32) -> [N, H]`` in ``x.dtype``,
  padding rows zero.
* ``reduce_fused(x [N, H], topk_weights fp32 [T, k] or None, token_topk_to_pos int32) -> [T, H]`` accumulates in fp32
  but returns ``x.dtype`` and asserts ``H % 256 == 0``; for other widths the adapter uses the torch reference. The
  reference returns fp32; SpiderMoE casts the result to the activations' dtype right away, so both give the same
  values (one rounding of the fp32 sum).
* ``aux_fi(topk_idx int64 [T, k], num_experts, num_aux_topk) -> fp32 [E]`` = ``count * E / (T * num_aux_topk)``.
* Every kernel is CUDA-only (SM90/SM100); outputs are allocated on CUDA. The adapter falls back to the torch reference
  for non-CUDA inputs unless it was built with ``allow_non_cuda=True`` (test doubles).
"""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import torch

from modeling_spider import SpiderMoEKernels
from spider_training import moe_layout
from spider_training.moe_layout import FusedMapping

logger = logging.getLogger(__name__)

#: Functions of ``tile_kernels.moe`` 1.x used by the adapter (tk-train.py's fused MoE routing).
TILE_KERNELS_1X_FUNCTIONS = (
    "topk_gate", "normalize_weight", "get_fused_mapping", "expand_to_fused", "reduce_fused", "aux_fi"
)
#: Functions every 2.x ``tile_kernels.moe`` has; the adapter uses only ``topk_gate`` and ``normalize_weight``.
TILE_KERNELS_2X_FUNCTIONS = (
    "topk_gate", "normalize_weight", "moe_topk_gate", "moe_topk_gate_forward", "moe_topk_gate_backward"
)
TILE_KERNELS_2X_USED = ("topk_gate", "normalize_weight")

BACKEND_1X = "tile_kernels 1.x fused"
BACKEND_2X = "tile_kernels 2.x gate-only"
BACKEND_TORCH = "torch"

#: ``reduce_fused`` asserts ``hidden % 256 == 0``.
REDUCE_FUSED_HIDDEN_MULTIPLE = 256
#: 2.x ``topk_gate`` / ``normalize_weight`` assert ``num_topk <= 32``.
TILE_KERNELS_MAX_TOPK = 32


def _moe_namespace(module):
    """The object holding the MoE functions: ``module.moe`` when given the ``tile_kernels`` package, else `module`."""
    moe = getattr(module, "moe", None)
    if moe is not None and callable(getattr(moe, "topk_gate", None)):
        return moe
    return module


def detect_tile_kernels_api(module) -> str | None:
    """Which TileKernels MoE API `module` (``tile_kernels``, ``tile_kernels.moe`` or a stand-in) exposes.

    Returns ``"1.x"`` when all of :data:`TILE_KERNELS_1X_FUNCTIONS` are callable, ``"2.x"`` when ``topk_gate`` and
    ``normalize_weight`` are but the fused-layout ops (``get_fused_mapping``/``expand_to_fused``/``reduce_fused``) are
    not, else None. Decided by the functions present, never by a version string.
    """
    moe = _moe_namespace(module)

    def has(name):
        return callable(getattr(moe, name, None))

    if all(has(name) for name in TILE_KERNELS_1X_FUNCTIONS):
        return "1.x"
    if all(has(name) for name in TILE_KERNELS_2X_USED) and not any(
        has(name) for name in ("get_fused_mapping", "expand_to_fused", "reduce_fused")
    ):
        return "2.x"
    return None


# ----------------------------------------------------------------------------------------------------------------------
# autograd wrappers: TileKernels forward, torch reference backward
# ----------------------------------------------------------------------------------------------------------------------


class _NormalizeWeight(torch.autograd.Function):
    """``tile_kernels.moe.normalize_weight`` forward; backward of ``n = w / d``, ``d = 1e-20 + sum(w)``."""

    @staticmethod
    def forward(ctx, topk_weights, kernel):
        denominator, normalized = kernel(topk_weights.to(torch.float32).contiguous())
        ctx.save_for_backward(topk_weights, denominator)
        ctx.in_dtype = topk_weights.dtype
        return denominator, normalized

    @staticmethod
    def backward(ctx, grad_denominator, grad_normalized):
        topk_weights, denominator = ctx.saved_tensors
        w = topk_weights.to(torch.float32)
        d = denominator[:, None]
        # d n_i / d w_j = delta_ij / d - w_i / d^2 ; d d / d w_j = 1
        grad = grad_normalized / d - (grad_normalized * w).sum(-1, keepdim=True) / (d * d) + grad_denominator[:, None]
        return grad.to(ctx.in_dtype), None


class _ExpandToFused(torch.autograd.Function):
    """``tile_kernels.moe.expand_to_fused`` forward; backward sums each token's k rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, token_topk_to_pos, pos_to_expert, kernel):
        out = kernel(
            x.contiguous(), token_topk_to_pos.to(torch.int32).contiguous(), pos_to_expert.to(torch.int32).contiguous()
        )
        ctx.save_for_backward(token_topk_to_pos)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (token_topk_to_pos,) = ctx.saved_tensors
        T, k = token_topk_to_pos.shape
        grad_x = grad_out[token_topk_to_pos.reshape(-1).long()].view(T, k, -1).sum(dim=1)
        return grad_x, None, None, None


class _ReduceFused(torch.autograd.Function):
    """``tile_kernels.moe.reduce_fused`` forward (fp32 accumulation, output cast to fp32 like the reference);
    backward: ``grad_x[pos[t, j]] = w[t, j] * g[t]``, ``grad_w[t, j] = <g[t], x[pos[t, j]]>`` in fp32."""

    @staticmethod
    def forward(ctx, x, topk_weights, token_topk_to_pos, kernel):
        out = kernel(
            x.contiguous(), topk_weights.to(torch.float32).contiguous(), token_topk_to_pos.to(torch.int32).contiguous()
        )
        ctx.save_for_backward(x, topk_weights, token_topk_to_pos)
        return out.to(torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_weights, token_topk_to_pos = ctx.saved_tensors
        T, k = token_topk_to_pos.shape
        flat_pos = token_topk_to_pos.reshape(-1).long()
        grad_out = grad_out.to(torch.float32)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            rows_grad = (grad_out[:, None, :] * topk_weights.to(torch.float32)[..., None]).reshape(T * k, -1)
            grad_x = x.new_zeros(x.shape).index_copy(0, flat_pos, rows_grad.to(x.dtype))
        if ctx.needs_input_grad[1]:
            rows = x[flat_pos].view(T, k, -1).to(torch.float32)
            grad_w = (grad_out[:, None, :] * rows).sum(-1).to(topk_weights.dtype)
        return grad_x, grad_w, None, None


# ----------------------------------------------------------------------------------------------------------------------
# The adapter
# ----------------------------------------------------------------------------------------------------------------------


class TileKernelsMoEKernels:
    """``SpiderMoEKernels`` interface over an installed ``tile_kernels.moe``; torch reference for the rest.

    Args:
        tile_kernels_module: ``tile_kernels``, ``tile_kernels.moe`` or a module-like stand-in with the same functions.
        reference: the torch routing ops to fall back to (default ``modeling_spider.SpiderMoEKernels``;
            :func:`swap_in_tile_kernels` passes each MoE layer's own class default); the fused-layout ops fall back
            to :mod:`spider_training.moe_layout`.
        alignment: per-expert row alignment of the fused layout (``get_fused_mapping``'s `alignment`; 1 = no
            padding rows, what the per-expert ``nn.Linear`` path needs; grouped-GEMM kernels may want 64/128).
        allow_non_cuda: call the TileKernels functions on non-CUDA tensors too (for CPU test doubles); by default a
            CPU tensor goes to the torch reference (the real kernels allocate their outputs on CUDA).

    Attributes:
        name: ``"tile_kernels 1.x fused"`` or ``"tile_kernels 2.x gate-only"``.
        api: ``"1.x"`` / ``"2.x"``.
        used_functions: the ``tile_kernels.moe`` functions this adapter calls.

    Raises:
        ValueError: `tile_kernels_module` exposes neither function set (see :func:`detect_tile_kernels_api`), or
            `alignment` < 1.

    Shapes/dtypes of every method are those of ``SpiderMoEKernels``; differentiable where the reference is.
    """

    def __init__(
        self, tile_kernels_module, reference=SpiderMoEKernels, alignment: int = 1, allow_non_cuda: bool = False
    ):
        api = detect_tile_kernels_api(tile_kernels_module)
        if api is None:
            raise ValueError(
                f"{tile_kernels_module!r} exposes neither the TileKernels 1.x MoE functions "
                f"{TILE_KERNELS_1X_FUNCTIONS} nor the 2.x ones {TILE_KERNELS_2X_USED}"
            )
        if not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be an integer >= 1, got {alignment!r}")
        self.api = api
        self.name = BACKEND_1X if api == "1.x" else BACKEND_2X
        self.alignment = alignment
        self.reference = reference
        self.allow_non_cuda = allow_non_cuda
        moe = _moe_namespace(tile_kernels_module)
        self.used_functions = TILE_KERNELS_1X_FUNCTIONS if api == "1.x" else TILE_KERNELS_2X_USED
        self._tk = SimpleNamespace(**{name: getattr(moe, name) for name in self.used_functions})

    def __repr__(self):
        return f"TileKernelsMoEKernels(name={self.name!r}, alignment={self.alignment})"

    def __deepcopy__(self, memo):  # stateless apart from function references: share it (modules cannot be copied)
        return self

    def _tk_fn(self, name: str, *tensors: torch.Tensor):
        """The TileKernels function `name` if this adapter uses it and every tensor may go to it, else None."""
        fn = getattr(self._tk, name, None)
        if fn is None:
            return None
        if not self.allow_non_cuda and not all(t.is_cuda for t in tensors):
            return None
        return fn

    # -- routing --------------------------------------------------------------------------------------------------

    def topk_gate(self, scores: torch.Tensor, num_topk: int) -> torch.Tensor:
        """`scores` fp32 `(T, E)` -> int64 `(T, k)`, best first, ties to the smaller index (not differentiable)."""
        fn = self._tk_fn("topk_gate", scores)
        if fn is None or num_topk > TILE_KERNELS_MAX_TOPK:
            return self.reference.topk_gate(scores, num_topk)
        with torch.no_grad():
            return fn(scores.detach().to(torch.float32).contiguous(), num_topk)

    def normalize_weight(self, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(T, k)` -> `(denominator fp32 (T,), normalized fp32 (T, k))`; differentiable w.r.t. `topk_weights`."""
        fn = self._tk_fn("normalize_weight", topk_weights)
        if fn is None or topk_weights.shape[-1] > TILE_KERNELS_MAX_TOPK:
            return self.reference.normalize_weight(topk_weights)
        return _NormalizeWeight.apply(topk_weights, fn)

    def aux_fi(self, topk_idx: torch.Tensor, num_experts: int, num_topk: int) -> torch.Tensor:
        """DeepSeek's f_i, fp32 `(E,)`: `count_i * E / (T * k)` (not differentiable)."""
        fn = self._tk_fn("aux_fi", topk_idx)
        if fn is None or topk_idx.shape[0] == 0:
            return self.reference.aux_fi(topk_idx, num_experts, num_topk)
        with torch.no_grad():
            return fn(topk_idx.to(torch.int64).contiguous(), num_experts, num_topk)

    # -- fused expert-major layout ----------------------------------------------------------------------------------

    def get_fused_mapping(self, topk_idx: torch.Tensor, num_experts: int, alignment: int = 1) -> FusedMapping:
        """Expert-sorted layout of the `(T, k)` token-slots as a ``FusedMapping`` of int64 tensors.

        N = ``moe_layout.fused_num_rows(T*k, E, alignment)`` rows (the reference's static bound; passed to the
        kernel as ``num_expanded_tokens`` so it does not synchronise). Within an expert the row order is the kernel's.
        """
        fn = self._tk_fn("get_fused_mapping", topk_idx)
        T, k = topk_idx.shape
        num_rows = moe_layout.fused_num_rows(T * k, num_experts, alignment)
        if fn is None or num_rows == 0:
            return moe_layout.get_fused_mapping(topk_idx, num_experts, alignment)
        with torch.no_grad():
            outputs = fn(topk_idx.to(torch.int64).contiguous(), num_experts, num_rows, alignment)
        return FusedMapping(*(t.to(torch.int64) for t in outputs[:7]))

    def expand_to_fused(
        self, x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor
    ) -> torch.Tensor:
        """`x` `(T, H)` -> `(N, H)` in the fused layout, padding rows 0; differentiable w.r.t. `x`."""
        fn = self._tk_fn("expand_to_fused", x)
        if fn is None or x.shape[0] == 0:
            return moe_layout.expand_to_fused(x, token_topk_to_pos.long(), pos_to_expert.long())
        return _ExpandToFused.apply(x, token_topk_to_pos, pos_to_expert, fn)

    def reduce_fused(
        self, x: torch.Tensor, topk_weights: torch.Tensor, token_topk_to_pos: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's k rows: `(N, H)`, `(T, k)`, `(T, k)` -> fp32 `(T, H)`; differentiable w.r.t.
        `x` and `topk_weights`. Uses the torch reference when ``H % 256 != 0`` (the kernel's constraint)."""
        fn = self._tk_fn("reduce_fused", x)
        if fn is None or x.shape[-1] % REDUCE_FUSED_HIDDEN_MULTIPLE or token_topk_to_pos.shape[0] == 0:
            return moe_layout.reduce_fused(x, topk_weights, token_topk_to_pos.long())
        return _ReduceFused.apply(x, topk_weights, token_topk_to_pos, fn)


# ----------------------------------------------------------------------------------------------------------------------
# Installing it on a model
# ----------------------------------------------------------------------------------------------------------------------


class MoEBackend(str):
    """The backend name :func:`swap_in_tile_kernels` returns (a ``str``: ``"tile_kernels 1.x fused"``,
    ``"tile_kernels 2.x gate-only"`` or ``"torch"``) with ``reason`` (why) and ``num_layers`` (MoE layers set)."""

    reason: str
    num_layers: int

    def __new__(cls, name: str, reason: str, num_layers: int):
        obj = super().__new__(cls, name)
        obj.reason = reason
        obj.num_layers = num_layers
        return obj


def _is_spider_moe(module) -> bool:
    """Duck-typed SpiderMoE check (a model loaded with ``trust_remote_code`` has its own copy of the class): a class
    ``kernels`` attribute, a ``router`` and ``experts``."""
    return hasattr(type(module), "kernels") and hasattr(module, "router") and hasattr(module, "experts")


def spider_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every SpiderMoE module in `model`, in module order."""
    return [m for m in model.modules() if _is_spider_moe(m)]


def swap_in_tile_kernels(model: torch.nn.Module, tile_kernels_module=None, alignment: int = 1) -> MoEBackend:
    """Set ``.kernels`` of every SpiderMoE in `model` to a :class:`TileKernelsMoEKernels` when possible (tk-train.py
    ``tk-train.py``: "Falls back to Python MoE loop if TileKernels is unavailable").

    Without `tile_kernels_module`: uses ``tile_kernels.moe`` if CUDA is available and it imports (any exception while
    importing counts as unavailable; tile-kernels 1.0.0 fails to import with current tilelang). With
    `tile_kernels_module` given explicitly (e.g. a test double), uses it whether or not CUDA is there, and lets it see
    CPU tensors. When the torch path is chosen, per-instance overrides are removed, so every layer uses its class
    default (``SpiderMoEKernels``).

    Returns:
        :class:`MoEBackend` -- ``"tile_kernels 1.x fused"``, ``"tile_kernels 2.x gate-only"`` or ``"torch"``, with
        ``.reason``. The choice and the reason are logged.
    Raises:
        ValueError: `alignment` < 1.
    """
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an integer >= 1, got {alignment!r}")
    layers = spider_moe_layers(model)

    def use_torch(reason: str) -> MoEBackend:
        for layer in layers:
            layer.__dict__.pop("kernels", None)
        logger.info("MoE kernels: torch (%s)", reason)
        return MoEBackend(BACKEND_TORCH, reason, len(layers))

    if not layers:
        return use_torch("the model has no SpiderMoE layers")
    injected = tile_kernels_module is not None
    if not injected:
        if not torch.cuda.is_available():
            return use_torch("CUDA is not available (TileKernels kernels are CUDA-only)")
        try:
            tile_kernels_module = importlib.import_module("tile_kernels.moe")
        except Exception as exc:  # ImportError, or tilelang failing at import time
            return use_torch(f"tile_kernels does not import: {type(exc).__name__}: {exc}")
    api = detect_tile_kernels_api(tile_kernels_module)
    if api is None:
        moe = _moe_namespace(tile_kernels_module)
        known = set(TILE_KERNELS_1X_FUNCTIONS + TILE_KERNELS_2X_FUNCTIONS)
        found = sorted(n for n in known if callable(getattr(moe, n, None)))
        return use_torch(f"tile_kernels.moe exposes neither the 1.x nor the 2.x function set (found {found})")

    for layer in layers:
        layer.kernels = TileKernelsMoEKernels(
            tile_kernels_module, reference=type(layer).kernels, alignment=alignment, allow_non_cuda=injected
        )
    adapter = layers[0].kernels
    source = "injected module" if injected else "installed tile_kernels.moe"
    reason = f"{source} has the {api} function set; using {', '.join(adapter.used_functions)}"
    if api == "2.x":
        reason += " (moe_topk_gate scores with sqrt(softplus), Spider's router is a softmax); fused layout in torch"
    if api == "1.x":
        reason += ("; the model runs topk_gate, normalize_weight and aux_fi (its fused experts sort the token-slots "
                   "in transformers' experts implementation, not with the fused-layout ops)")
    logger.info("MoE kernels: %s on %d MoE layers (%s)", adapter.name, len(layers), reason)
    return MoEBackend(adapter.name, reason, len(layers))


__all__ = [
    "TILE_KERNELS_1X_FUNCTIONS",
    "TILE_KERNELS_2X_FUNCTIONS",
    "BACKEND_1X",
    "BACKEND_2X",
    "BACKEND_TORCH",
    "detect_tile_kernels_api",
    "TileKernelsMoEKernels",
    "MoEBackend",
    "spider_moe_layers",
    "swap_in_tile_kernels",
]
