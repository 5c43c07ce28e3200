"""FP8 for Spider's fused MoE experts: torchao's FP8 rowwise grouped GEMM (torchtitan's recipe).

torchao's ``Float8Linear`` (:mod:`spider_training.fp8`) converts ``nn.Linear`` layers; the routed experts are fused
3-D parameters (``modeling_spider.SpiderExperts``: ``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I)) that
transformers' ``grouped_mm`` experts implementation multiplies with ``torch._grouped_mm``. torchao's MoE training
prototype (``torchao.prototype.moe_training``, as torchtitan uses it) makes those grouped GEMMs FP8: ``quantize_``
with ``Float8TrainingOpConfig`` wraps each expert parameter's data in ``Float8TrainingWeightWrapperTensor``, whose
``__torch_function__`` turns ``torch._grouped_mm(activations, weight, offs=...)`` into a dynamic rowwise FP8
quantisation of both operands and ``torch._scaled_grouped_mm`` (forward and backward). Nothing else in the model
changes: the wrapped parameters keep their names, shapes and high-precision values.

Where it runs (torchao 0.18, ``fp8_grouped_mm.py`` / ``kernels/float8_rowwise.py``): CUDA with compute capability
9.0 (SM90; SM100 has torchao's MXFP8 recipe instead, not wired here), triton installed, bf16 experts. There is no
emulated mode ("TODO: support emulated mode" in torchao), so on CPU the semantics are tested with named test doubles
of its CUDA-only pieces (``tests/test_fp8_moe.py``: the four triton casting kernels and ``torch._scaled_grouped_mm``),
around which torchao's own autograd function, its checks and its backward run.

Every group of rows (one expert's tokens) must be a multiple of 16 rows long ("Group sizes must be divisible by 16")
and torchao 0.18 does not pad them itself (``pad_token_groups_for_grouped_mm=True`` fails with "not yet supported";
its padding kernel is a CUDA extension built for one Python version, its fallback reads the sizes on the host). So the
converted experts run :func:`aligned_grouped_mm_experts_forward` (experts implementation
:data:`ALIGNED_GROUPED_MM`): transformers' ``grouped_mm`` with each expert's rows placed at a multiple of 16 in a
zero-filled buffer of fixed size, on the device.

:func:`fp8_grouped_mm_unsupported_reason` says whether this machine can run it, :func:`convert_experts_to_fp8_grouped_mm`
converts a model, :func:`experts_fp8_to_plain` unwraps the parameters again (for evaluation or export; a checkpoint
is written from ``spider_training.fp8.fp8_to_plain_state_dict``, which unwraps without touching the model).
:func:`convert_experts_for_training` is what ``--precision fp8`` calls, by ``--fp8_experts``
(:data:`FP8_EXPERTS_MODES`): ``auto`` converts where this machine has the kernels, ``on`` insists, ``off`` leaves the
experts in bf16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from spider_training import moe_layout

logger = logging.getLogger(__name__)

#: CUDA compute capability of torchao's FP8 rowwise grouped GEMM (``torch._scaled_grouped_mm``, Hopper).
FP8_GROUPED_MM_CAPABILITY = (9, 0)
#: FP8 GEMMs need both dimensions of every expert matrix divisible by 16 (as ``torch._scaled_mm``).
FP8_GROUPED_MM_DIM_MULTIPLE = 16
#: Values of ``--fp8_experts`` (:func:`convert_experts_for_training`).
FP8_EXPERTS_MODES = ("auto", "on", "off")
#: Rows per group that torchao's FP8 rowwise grouped GEMM needs (``fp8_grouped_mm.py``: "Group sizes must be divisible
#: by 16").
FP8_GROUP_ALIGNMENT = 16
#: The experts implementation (transformers' ``ALL_EXPERTS_FUNCTIONS``) of converted experts.
ALIGNED_GROUPED_MM = "grouped_mm_aligned16"


def aligned_grouped_mm_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts (``integrations/moe.py``: token slots sorted by expert, one grouped GEMM per
    projection, the weighted sum over each token's k slots) with every expert's group of rows starting at a multiple of
    :data:`FP8_GROUP_ALIGNMENT`, as torchao's FP8 grouped GEMM needs.

    The rows are laid out by TileKernels' fused-layout ops (``moe_layout.get_fused_mapping`` with that alignment,
    ``expand_to_fused``, ``reduce_fused``: TileKernels' layout): a zero-filled buffer of ``S + E *
    (FP8_GROUP_ALIGNMENT - 1)`` rows (S = T * k slots, E experts: the most padding E groups can need) rounded up to a
    multiple of 16 (``moe_layout.fused_num_rows``: ``torch._scaled_grouped_mm`` needs 16-byte strides, and the
    weight gradient reads the FP8 buffer transposed, a row stride of N bytes), so no size depends on the routing and
    nothing is read on the host. Padding rows are zero and never read back (rows past the last offset, which the
    grouped GEMM leaves unwritten, neither).

    Args:
        experts: a fused-experts module (``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I), ``num_experts``,
            ``_apply_gate``), as transformers' experts functions take it.
        hidden_states: `(T, D)`; top_k_index: int64 `(T, k)`; top_k_weights: `(T, k)`.
    Returns:
        `(T, D)` in ``hidden_states.dtype`` (accumulated in fp32).
    """
    mapping = moe_layout.get_fused_mapping(top_k_index, experts.num_experts, FP8_GROUP_ALIGNMENT)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    x = moe_layout.expand_to_fused(hidden_states.to(gate_up.dtype), mapping.token_topk_to_pos,
                                   mapping.pos_to_expert)
    offsets = mapping.expert_end.to(torch.int32)
    h = experts._apply_gate(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets))
    y = torch._grouped_mm(h.to(down.dtype), down.transpose(-2, -1), offs=offsets)
    return moe_layout.reduce_fused(y, top_k_weights, mapping.token_topk_to_pos).to(hidden_states.dtype)


def _register_aligned_grouped_mm() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ALIGNED_GROUPED_MM, aligned_grouped_mm_experts_forward)


_register_aligned_grouped_mm()


def is_fused_experts(module: nn.Module) -> bool:
    """Duck-typed ``modeling_spider.SpiderExperts`` (a model loaded with ``trust_remote_code`` has its own copy of the
    class): 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3


def fp8_grouped_mm_unsupported_reason(device: torch.device | str | None = None) -> str | None:
    """Why torchao's FP8 grouped GEMM cannot run on `device` (default: CUDA's current device), or None when it can.

    Checks: ``torchao.prototype.moe_training`` imports, CUDA is there, the device's compute capability is
    :data:`FP8_GROUPED_MM_CAPABILITY`, triton imports (torchao's FP8 casting kernels are triton kernels).
    """
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
    except Exception as exc:  # torchao missing, or a build that does not match torch
        return f"torchao.prototype.moe_training does not import: {type(exc).__name__}: {exc}"
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA (torch._scaled_grouped_mm and torchao's triton FP8 kernels; torchao has no emulated mode)"
    capability = torch.cuda.get_device_capability(device)
    if capability != FP8_GROUPED_MM_CAPABILITY:
        return (f"compute capability {capability}: torchao's FP8 rowwise grouped GEMM runs on "
                f"{FP8_GROUPED_MM_CAPABILITY} (SM90); SM100 has its MXFP8 recipe, not wired here")
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton does not import ({type(exc).__name__}: {exc}); torchao's FP8 casting kernels need it"
    return None


@dataclass
class Fp8ExpertsReport:
    """Result of :func:`convert_experts_to_fp8_grouped_mm`.

    Attributes:
        converted_fqns: qualified names of the fused-experts modules whose parameters now run FP8 grouped GEMMs.
        skipped: qualified name -> reason for fused-experts modules left in high precision.
    """

    converted_fqns: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def message(self) -> str:
        """The log line: ``FP8 experts: N of M fused MoE experts modules through torchao's FP8 grouped GEMM``."""
        total = len(self.converted_fqns) + len(self.skipped)
        text = f"FP8 experts: {len(self.converted_fqns)} of {total} fused MoE experts modules through torchao's FP8 " \
               "grouped GEMM"
        if self.skipped:
            text += f" (skipped: {sorted(set(self.skipped.values()))})"
        return text


def _skip_reason(module: nn.Module) -> str | None:
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in ("grouped_mm", ALIGNED_GROUPED_MM):
        # batched_mm (bmm) and eager (F.linear on slices) never call torch._grouped_mm: the wrapper would not apply
        return f"experts_implementation={implementation!r}: only 'grouped_mm' calls torch._grouped_mm"
    shapes = (tuple(module.gate_up_proj.shape[1:]), tuple(module.down_proj.shape[1:]))
    if any(d % FP8_GROUPED_MM_DIM_MULTIPLE for shape in shapes for d in shape):
        return f"expert matrices {shapes} not divisible by {FP8_GROUPED_MM_DIM_MULTIPLE}"
    return None


def convert_experts_to_fp8_grouped_mm(model: nn.Module, config=None) -> Fp8ExpertsReport:
    """Route every fused-experts module's grouped GEMMs in `model` through torchao's FP8 rowwise grouped GEMM, in place.

    Args:
        model: a Spider model (any module holding ``SpiderExperts``).
        config: a ``torchao.prototype.moe_training.config.Float8TrainingOpConfig``; default
            ``Float8TrainingOpConfig()`` (bf16 output; no padding by torchao: the experts align their groups).
    Returns:
        :class:`Fp8ExpertsReport`; modules on another ``experts_implementation`` than ``"grouped_mm"``, or with an expert
        dimension not divisible by 16, are skipped with the reason. The converted modules' experts implementation
        becomes :data:`ALIGNED_GROUPED_MM` (not saved with the config). Idempotent (wrapped parameters stay as they are).
    Raises:
        ImportError: ``torchao.prototype.moe_training`` does not import.
        ValueError: `config` asks torchao to pad the groups (``pad_token_groups_for_grouped_mm=True``), which its FP8
            grouped GEMM does not support (0.18).

    It does not check the hardware (:func:`fp8_grouped_mm_unsupported_reason` does): on a machine without the kernels
    the converted model fails at its first forward with torchao's error.
    """
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    config = Float8TrainingOpConfig() if config is None else config
    if getattr(config, "pad_token_groups_for_grouped_mm", False):
        raise ValueError("pad_token_groups_for_grouped_mm=True: torchao's FP8 grouped GEMM does not pad groups (0.18: "
                         "'not yet supported'); the converted experts align their groups to 16 rows themselves")
    report = Fp8ExpertsReport()
    chosen = set()
    for fqn, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        reason = _skip_reason(module)
        if reason is None:
            report.converted_fqns.append(fqn)
            chosen.add(id(module))
        else:
            report.skipped[fqn] = reason
    if chosen:
        quantize_(model, config, filter_fn=lambda module, fqn: id(module) in chosen)
        for module in model.modules():
            if id(module) in chosen:
                module.config._experts_implementation = ALIGNED_GROUPED_MM
    logger.info(report.message)
    return report


def convert_experts_for_training(model: nn.Module, mode: str = "auto",
                                 device: torch.device | str | None = None) -> Fp8ExpertsReport:
    """``--fp8_experts``: route the fused experts of `model` through torchao's FP8 grouped GEMM where `mode` and the
    machine allow (what ``--precision fp8`` does to the experts, after ``Float8Linear`` took the linear layers).

    Args:
        model: a Spider model; converted in place.
        mode: ``"auto"``: convert when :func:`fp8_grouped_mm_unsupported_reason` (`device`) is None, otherwise leave
            every experts module in high precision with that reason; ``"on"``: convert or raise; ``"off"``: leave them.
        device: the training device (default: CUDA's current device).
    Returns:
        :class:`Fp8ExpertsReport` (its :attr:`~Fp8ExpertsReport.message` is logged).
    Raises:
        ValueError: `mode` not in :data:`FP8_EXPERTS_MODES`.
        RuntimeError: ``mode="on"`` on a machine without the kernels (the message says what is missing).
    """
    if mode not in FP8_EXPERTS_MODES:
        raise ValueError(f"--fp8_experts must be one of {FP8_EXPERTS_MODES}, got {mode!r}")
    reason = "--fp8_experts off" if mode == "off" else fp8_grouped_mm_unsupported_reason(device)
    if reason is None:
        return convert_experts_to_fp8_grouped_mm(model)
    if mode == "on":
        raise RuntimeError(f"--fp8_experts on: torchao's FP8 grouped GEMM cannot run here: {reason}")
    report = Fp8ExpertsReport(skipped={fqn: reason for fqn, m in model.named_modules() if is_fused_experts(m)})
    logger.info(report.message)
    return report


def experts_fp8_to_plain(model: nn.Module) -> int:
    """Unwrap every fused-experts parameter that :func:`convert_experts_to_fp8_grouped_mm` wrapped back to a plain
    ``nn.Parameter`` holding the same high-precision tensor, and put those experts back on ``grouped_mm`` (in place;
    for ``save_pretrained``, evaluation or generation). Returns the number of parameters unwrapped (0 when torchao's
    prototype does not import)."""
    try:
        from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor
    except Exception:
        return 0
    count = 0
    for module in model.modules():
        if not is_fused_experts(module):
            continue
        if getattr(getattr(module, "config", None), "_experts_implementation", None) == ALIGNED_GROUPED_MM:
            module.config._experts_implementation = "grouped_mm"
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module, name)
            if isinstance(param.data, TrainingWeightWrapperBaseTensor):
                setattr(module, name, nn.Parameter(param.data._data, requires_grad=param.requires_grad))
                count += 1
    return count


__all__ = [
    "FP8_GROUPED_MM_CAPABILITY",
    "FP8_GROUPED_MM_DIM_MULTIPLE",
    "FP8_EXPERTS_MODES",
    "FP8_GROUP_ALIGNMENT",
    "ALIGNED_GROUPED_MM",
    "aligned_grouped_mm_experts_forward",
    "convert_experts_for_training",
    "Fp8ExpertsReport",
    "is_fused_experts",
    "fp8_grouped_mm_unsupported_reason",
    "convert_experts_to_fp8_grouped_mm",
    "experts_fp8_to_plain",
]
