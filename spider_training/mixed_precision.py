"""What bf16 autocast training adds around Spider: the routed experts' weights cast once per forward.

Under autocast the routed experts run in the autocast dtype (``modeling_spider._experts_in_autocast_dtype``: torch's
grouped GEMM is no autocast op), their fp32 master weights cast by each ``SpiderExperts.cast_weight`` call. The
recurrent block calls every layer's experts once per loop, so a plain cast copies each expert weight once per loop:
on the ``1b`` preset 100M parameters per layer, 7.3 GB of bf16 copies per step without checkpointing. Inside
:func:`shared_weight_casts`, :func:`cast_weight` hands every later call the first call's cast of the same parameter,
as autocast's own weight cache does for the layers it casts: one copy per forward (1.2 GB), and the loops' gradients
add up in bf16 before the one cast back. :func:`share_expert_weight_casts` points a model's experts at it;
``SpiderTrainer`` applies both (the step ``bench.common.TrainStep`` times too). With activation checkpointing the
recompute in the backward casts afresh (outside the context); under ``torch.compile`` a traced region casts its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_SHARED_WEIGHT_CASTS: ContextVar[dict | None] = ContextVar("spider_shared_weight_casts", default=None)


@contextmanager
def shared_weight_casts() -> Iterator[None]:
    """Inside, :func:`cast_weight` casts each parameter once per dtype and hands every later call the same cast
    (the cache lives for the context: open it around one forward)."""
    token = _SHARED_WEIGHT_CASTS.set({})
    try:
        yield
    finally:
        _SHARED_WEIGHT_CASTS.reset(token)


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)``; inside :func:`shared_weight_casts` the same result for the same parameter (an
    ``nn.Parameter`` not written in place since), so a weight used by every loop is cast once. A tensor computed from
    the parameters (PEFT's LoRA on experts) is cast anew each call, and nothing is shared while compiling."""
    casts = None if torch.compiler.is_compiling() else _SHARED_WEIGHT_CASTS.get()
    if casts is None or not isinstance(weight, nn.Parameter) or weight.dtype == dtype:
        return weight.to(dtype)
    key = (id(weight), dtype)
    cached = casts.get(key)
    # the parameter itself is kept with its cast: its id is not reused while the cache lives
    if cached is not None and cached[0] is weight and cached[1] == weight._version:
        return cached[2]
    cast = weight.to(dtype)
    casts[key] = (weight, weight._version, cast)
    return cast


def share_expert_weight_casts(model: nn.Module) -> int:
    """Set :func:`cast_weight` as the ``cast_weight`` of every routed-experts module of `model` (a Spider model,
    also one loaded with ``trust_remote_code``: found by its ``cast_weight`` and fused ``gate_up_proj``). Returns how
    many modules were set."""
    count = 0
    for module in model.modules():
        if callable(getattr(type(module), "cast_weight", None)) and hasattr(module, "gate_up_proj"):
            module.cast_weight = cast_weight
            count += 1
    return count
