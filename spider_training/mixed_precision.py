"""What bf16 autocast training adds around Spider: the routed experts run in the autocast dtype, their weights cast
once per forward.

torch's grouped GEMM is no autocast op: under autocast with fp32 master weights transformers' experts functions
(``"grouped_mm"``, ``"batched_mm"``) would run it in fp32, which on CUDA is torch's fallback, a loop over the experts
that reads the offsets on the host (tests/test_host_syncs.py). :func:`autocast_experts` gives every routed-experts
module of a model a forward that runs its experts function in the autocast dtype, the weights cast by
:func:`cast_weight` (``"eager"``, a loop of ``F.linear`` calls that autocast casts itself, and torchao's FP8 weight
wrappers, which quantise from the master weights, run as they are).

The recurrent block calls every layer's experts once per loop, so a plain cast copies each expert weight once per
loop: on the ``1b`` preset 100M parameters per layer, 7.3 GB of bf16 copies per step without checkpointing. Inside
:func:`shared_weight_casts`, :func:`cast_weight` hands every later call the first call's cast of the same parameter,
as autocast's own weight cache does for the layers it casts: one copy per forward (1.2 GB), and the loops' gradients
add up in bf16 before the one cast back. ``SpiderTrainer`` applies both (the step ``bench.common.TrainStep`` times
too). With activation checkpointing the recompute in the backward casts afresh (outside the context); under
``torch.compile`` a traced region casts its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from modeling_spider import autocast_enabled

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


class _ExpertsWeightsIn:
    """`experts` seen with its fused weights cast to `dtype` (:func:`cast_weight`), for an experts function to read."""

    def __init__(self, experts: nn.Module, dtype: torch.dtype):
        self._experts = experts
        self.gate_up_proj = cast_weight(experts.gate_up_proj, dtype)
        self.down_proj = cast_weight(experts.down_proj, dtype)

    def __getattr__(self, name: str):
        return getattr(self._experts, name)


def _autocast_experts_forward(self, hidden_states: torch.Tensor, *args) -> torch.Tensor:
    """The experts module's own forward (``_plain_forward``), but under autocast its experts function
    (``config._experts_implementation``) runs on `hidden_states` and weights in the autocast dtype. `self`: a
    ``SpiderExperts`` whose class :func:`autocast_experts` derived."""
    device_type = hidden_states.device.type
    function = None
    if autocast_enabled(device_type):
        function = ALL_EXPERTS_FUNCTIONS.get_interface(self.config._experts_implementation, None)
    if function is None:  # no autocast, or "eager" (F.linear, which autocast casts)
        return self._plain_forward(hidden_states, *args)
    dtype = torch.get_autocast_dtype(device_type)
    weights = (self.gate_up_proj, self.down_proj)
    if all(w.dtype == dtype for w in weights) or any(type(w) not in (torch.Tensor, nn.Parameter) for w in weights):
        return function(self, hidden_states, *args)  # already in dtype, or torchao's FP8 wrappers
    return function(_ExpertsWeightsIn(self, dtype), hidden_states.to(dtype), *args)


#: experts class -> its autocast subclass (one per class, so every module of a class shares one forward)
_AUTOCAST_CLASSES: dict[type, type] = {}


def _autocast_class(cls: type) -> type:
    """The subclass of experts class `cls` whose forward is :func:`_autocast_experts_forward`, made once per class
    and named in this module (``AutocastSpiderExperts``, numbered for a second class of that name, e.g. a release's),
    so its modules pickle and deep-copy. Its name still ends with ``SpiderExperts``."""
    if cls not in _AUTOCAST_CLASSES:
        name, n = f"Autocast{cls.__name__}", 1
        while name in globals():
            n += 1
            name = f"Autocast{cls.__name__}{n}"
        subclass = type(
            name,
            (cls,),
            {
                "forward": _autocast_experts_forward,
                "_plain_forward": cls.forward,
                "__module__": __name__,
                "__qualname__": name,
            },
        )
        globals()[name] = _AUTOCAST_CLASSES[cls] = subclass
    return _AUTOCAST_CLASSES[cls]


def autocast_experts(model: nn.Module) -> int:
    """Give every routed-experts module of `model` (``SpiderExperts``, also from a release loaded with
    ``trust_remote_code``, or under PEFT's parametrisation) the forward that runs under autocast in the autocast
    dtype, its weights cast by :func:`cast_weight` (see the module docstring): the module's class becomes a subclass
    made once per class (:func:`_autocast_class`), so modules, names and ``state_dict`` stay as they were, the model
    still pickles and deep-copies, and ``torch.compile`` sees one forward for every layer (a per-module forward would
    be a guard on its identity: a graph per layer). Idempotent. Returns how many modules were set."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("SpiderExperts") and hasattr(module, "gate_up_proj"):
            if not isinstance(module, tuple(_AUTOCAST_CLASSES.values())):  # also once PEFT subclassed it again
                module.__class__ = _autocast_class(type(module))
            count += 1
    return count
