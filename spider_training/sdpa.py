"""``--sdpa_backend``: which of torch's scaled-dot-product-attention kernels a training step prefers.

Spider's attention goes through transformers' ``"sdpa"`` function (docs/design.md, "Attention backends"), and torch
picks the kernel per call: on Hopper/Blackwell with a recent cuDNN it prefers cuDNN, which builds an execution plan per
new shape. ``spider-measure-sdpa-backends`` (also ``bench.gpu_check``'s ``attention_backends`` part) times each kernel
at the ``1b`` preset's recurrent-layer shapes; this module is the knob that makes the measured winner the training
default:

- ``auto`` (default): torch's own choice, unchanged.
- ``cudnn`` | ``flash`` | ``efficient`` | ``math``: SDPA may run that kernel and, for the calls it cannot run,
  the memory-efficient and then the math kernel (:data:`FALLBACKS`), in that priority order
  (``torch.nn.attention.sdpa_kernel(backends, set_priority=True)``); every other kernel is off. The fallbacks are
  there because Spider's byte layers pass a bool sliding-window mask, which torch's CUDA flash kernel does not take;
  the recurrent layers (no mask, ``is_causal``) are where the segment count varies and the choice matters. (torch's
  CPU dispatch ignores the priority order and tries flash, then math: there the switched-off kernels are what
  changes.)
- ``flash`` where the value head dim differs from the query/key head dim (MLA: ``v_head_dim`` against
  ``qk_nope_head_dim + qk_rope_head_dim``; torch's flash kernels need all three equal): the model's attention is
  switched to :data:`VALUE_PADDED_SDPA`, transformers' sdpa with the value zero-padded to the query's head dim and
  the output sliced back (what transformers' DeepseekV3 does for flash_attention_2); the padded columns of the output
  are exactly zero, the rest equal sdpa's up to the kernel's rounding.

The trainer applies :func:`sdpa_backend_context` around each training step, forward and backward together: the
backward's kernel follows from the forward's op, and activation checkpointing recomputes forwards inside the backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: ``--sdpa_backend`` values and torch's backends (``auto``: no preference)
SDPA_BACKENDS = {
    "auto": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
#: the aten op each kernel runs as (profiler event names), by backend name
KERNEL_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
#: where the chosen kernel cannot run a call, these run it, in this order: on CUDA they take every mask and head dim
#: Spider passes (torch's flash kernel takes no mask, so the byte layers' sliding-window masks need one of them)
FALLBACKS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
#: the attention-interface name of :func:`value_padded_sdpa_attention_forward`
VALUE_PADDED_SDPA = "sdpa_value_padded"


def value_padded_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward`` with `value` zero-padded to `query`'s head dim (torch's flash kernels
    need equal q/k/v head dims) and the output sliced back to the value's width: `query` `(B, H, T_q, d_qk)`, `value`
    `(B, H, T_k, d_v)`, `d_v <= d_qk`. Returns ``(attn_output (B, T_q, H, d_v), None)``."""
    width = value.shape[-1]
    if width < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - width))
    attn_output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return attn_output[..., :width], weights


AttentionInterface.register(VALUE_PADDED_SDPA, value_padded_sdpa_attention_forward)


def check_sdpa_backend(name: str) -> SDPBackend | None:
    """The torch backend of ``--sdpa_backend name`` (None for ``auto``). Raises ValueError naming the choices."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"--sdpa_backend must be one of {', '.join(SDPA_BACKENDS)}; got {name!r}")
    return SDPA_BACKENDS[name]


def attention_for_backend(config, name: str) -> str:
    """The attention implementation a model with `config` trains with under ``--sdpa_backend name``: its own, or
    :data:`VALUE_PADDED_SDPA` for ``flash`` where the value head dim is below the query/key head dim.

    Raises ValueError: a backend other than ``auto`` on a model whose attention is not ``"sdpa"`` (the knob picks
    SDPA's kernel; another function would ignore it), or ``flash`` with a value head dim above the query/key one."""
    check_sdpa_backend(name)
    current = config._attn_implementation or "sdpa"
    if name == "auto" or current == VALUE_PADDED_SDPA:
        return current
    if current != "sdpa":
        raise ValueError(
            f"--sdpa_backend {name} picks torch SDPA's kernel, but the model's attention is "
            f"{current!r}; use attn_implementation='sdpa' or --sdpa_backend auto"
        )
    if name != "flash":
        return current
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.v_head_dim == qk:
        return current
    if config.v_head_dim > qk:
        raise ValueError(
            f"--sdpa_backend flash needs v_head_dim <= qk_nope_head_dim + qk_rope_head_dim to pad the "
            f"value; got v_head_dim={config.v_head_dim}, qk_nope_head_dim={config.qk_nope_head_dim}, "
            f"qk_rope_head_dim={config.qk_rope_head_dim}"
        )
    return VALUE_PADDED_SDPA


_INITIALISED: set[str] = set()


def _initialise_priority_order(device: torch.device | None) -> None:
    """torch sets its device-dependent default order (cuDNN first on Hopper/Blackwell with a recent cuDNN) at the
    first CUDA SDPA call, over whatever order is set then: make that call once before a preference is layered on
    top."""
    if device is not None and device.type == "cuda" and str(device) not in _INITIALISED:
        x = torch.zeros(1, 1, 1, 8, device=device, dtype=torch.bfloat16)
        F.scaled_dot_product_attention(x, x, x)
        _INITIALISED.add(str(device))


def preference_order(name: str) -> list[SDPBackend]:
    """The backends SDPA may run under ``--sdpa_backend name``, in priority order: that one, then the
    :data:`FALLBACKS` after it (``efficient``: math; ``math``: none); ``auto``: every backend in torch's current
    order."""
    chosen = check_sdpa_backend(name)
    if chosen is None:
        return [SDPBackend(int(b)) for b in torch._C._get_sdp_priority_order()]  # what sdpa_kernel itself reads
    rest = FALLBACKS[FALLBACKS.index(chosen) + 1 :] if chosen in FALLBACKS else FALLBACKS  # math takes every call
    return [chosen, *rest]


def sdpa_backend_context(name: str, device: torch.device | None = None):
    """A context manager in which SDPA runs the kernel of ``--sdpa_backend name``, or where it cannot, the
    :data:`FALLBACKS` (see the module docstring); ``auto``: no change."""
    if check_sdpa_backend(name) is None:
        return contextlib.nullcontext()
    _initialise_priority_order(device)
    return sdpa_kernel(preference_order(name), set_priority=True)
