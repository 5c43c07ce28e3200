"""FP8 training for Spider, each layer converted where FP8 measured faster for its GEMM shape: torchao's
``Float8Linear`` for linear layers, its FP8 rowwise grouped GEMM for the routed experts (torchtitan's float8 converter
is the model, tk-train.py's ``configure_fp8_training`` the original).

``--fp8_layers`` (:func:`convert_for_fp8_training`): never a module named with one of tk-train.py's skip words
(:data:`TK_TRAIN_FP8_SKIP`: router, ``lm_head``, boundary predictor, Engram, halt predictor, norms) or with a dim not
divisible by 16. ``auto`` (default) converts a layer when the GEMM table (:data:`FP8_GEMM_TABLE`, or
``--fp8_gemm_table`` from ``spider-measure-fp8-gemms``) measured its ``(M, K, N)`` faster in FP8 on this GPU; M is the
rows one call multiplies at the run's micro-batch (:func:`gemm_shapes`). A GPU the table lacks gets torchao's size
filter (from its H100 benchmarks) and a warning. ``tk_train`` converts every layer tk-train.py converted.

The routed experts (3-D ``gate_up_proj`` / ``down_proj``) run torchao's FP8 grouped GEMM (``moe_training``: CUDA SM90,
triton, no emulated mode) with each expert's rows at a multiple of 16 (:func:`aligned_grouped_mm_experts_forward`):
``--fp8_experts auto`` where the kernels exist and it measured faster, ``on`` (raises without them), ``off``.

:class:`Fp8Report` says per layer group what was converted and why the rest was kept. Checkpoints keep the plain
model's keys and dtypes (:func:`fp8_to_plain_state_dict` unwraps torchao's weight wrappers). ``--precision auto``
picks FP8 only where a whole step measured faster (:func:`resolve_precision`, :data:`FP8_MEASURED`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

logger = logging.getLogger(__name__)

#: tk-train.py's skip words: a module whose qualified name contains one of them stays in high precision.
TK_TRAIN_FP8_SKIP = (
    "boundary_predictor",
    "loop_embedding",
    "engram",
    "layernorm",
    "norm",
    "embed_tokens",
    "lm_head",
    "halt_predictor",
    "router",
)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
PRECISIONS = ("auto", "fp8", "bf16", "fp32")
FP8_LAYER_FILTERS = ("auto", "tk_train")
FP8_EXPERTS_MODES = ("auto", "on", "off")
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores from Ada (sm_89)
FP8_GROUPED_MM_CAPABILITY = (9, 0)  # torchao's FP8 rowwise grouped GEMM (torch._scaled_grouped_mm, Hopper)
FP8_DIM_MULTIPLE = 16  # both GEMM dims (torch._scaled_mm); also the rows of each expert's group (grouped GEMM)
ALIGNED_GROUPED_MM = "grouped_mm_aligned16"  # experts implementation of converted experts
#: Per GPU name, compiled forward+backward seconds per GEMM: ``{"gpus": {name: {"gemms": [{"kind": "linear" |
#: "grouped", "m", "k", "n", "groups", "seconds": {"bf16": s, "tensorwise": s, "rowwise": s}}, ...]}}}``
FP8_GEMM_TABLE = Path(__file__).with_name("fp8_gemm_table.json")
#: One training step, bf16 autocast against FP8 (``bench.gpu_check``), per (compute capability, preset); ``--precision
#: auto`` picks FP8 only where ``fp8_seconds < bf16_seconds``. H200, 2026-11-26 (eager FP8, bench/gpu_check_h200.json).
FP8_MEASURED: dict[tuple[tuple[int, int], str], dict] = {
    ((9, 0), "1b"): {"gpu": "NVIDIA H200", "batch": "32 x 256 bytes", "bf16_seconds": 0.355, "fp8_seconds": 5.05},
    ((9, 0), "small"): {"gpu": "NVIDIA H200", "batch": "8 x 256 bytes", "bf16_seconds": 0.082, "fp8_seconds": 0.209},
}


def _check(value, allowed: tuple, flag: str) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {allowed}, got {value!r}")


def torchao_fp8_available() -> bool:
    """True when torchao's float8 training (``torchao.float8``) imports."""
    try:
        from torchao.float8.float8_linear import Float8Linear  # noqa: F401
    except Exception:  # torchao missing, or built for another torch
        return False
    return True


def is_float8_linear(module: nn.Module) -> bool:
    """True for torchao's ``Float8Linear`` (False when torchao does not import)."""
    if not torchao_fp8_available():
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def is_fused_experts(module: nn.Module) -> bool:
    """Duck-typed ``modeling_spider.SpiderExperts`` (remote code has its own class): 3-D expert parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3


def build_float8_config(recipe: str = "tensorwise", emulate: bool | None = None, fsdp_float8_all_gather: bool = False):
    """torchao ``Float8LinearConfig`` of `recipe`, with tk-train.py's ``pad_inner_dim=True``.

    Args:
        emulate: float8 matmuls emulated in high precision (None: exactly when CUDA is unavailable).
        fsdp_float8_all_gather: FSDP2 gathers the weights in float8 (tensorwise only, as torchao supports it).
    Raises:
        ValueError: unknown `recipe`, or all-gather with a rowwise recipe. ImportError: torchao missing.
    """
    _check(recipe, FP8_RECIPES, "--fp8_recipe")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"FSDP float8 all-gather needs --fp8_recipe tensorwise (torchao), got {recipe!r}")
    try:
        from torchao.float8 import Float8LinearConfig
    except Exception as exc:
        raise ImportError(f"FP8 training needs torchao (`pip install torchao`): {exc}") from exc
    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        pad_inner_dim=True,
        emulate=not torch.cuda.is_available() if emulate is None else bool(emulate),
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )


# --- GEMM shapes and the measured table ------------------------------------------------------------------------------


def layer_group(fqn: str) -> str:
    """The group a module's qualified name belongs to: ``"byte layers"`` (prelude and coda), ``"recurrent
    attention"``, ``"shared experts"``, ``"routed experts"`` or ``"other"``."""
    if "prelude_layers" in fqn or "coda_layers" in fqn:
        return "byte layers"
    if "experts" in fqn:
        return "shared experts" if "shared_experts" in fqn else "routed experts"
    return "recurrent attention" if "self_attn" in fqn else "other"


def gemm_shapes(model: nn.Module, batch_size: int, seq_len: int) -> dict[str, tuple[str, int, int, int]]:
    """``fqn -> (kind, M, K, N)`` for every linear layer and routed-experts projection of `model` at a micro-batch of
    `batch_size` windows of `seq_len` bytes: M rows per call (``"grouped"``: all routed rows, ``T * k``), K input and N
    output features. Byte layers see ``B * L`` rows; the recurrent block ``B * S`` segments, S the expected closed
    segments ``L * boundary_prior`` plus the null one, padded to 16 as the model pads them. Experts projections are
    named ``<experts fqn>.gate_up_proj`` / ``.down_proj``."""
    config = model.config
    segments = math.ceil((1 + seq_len * float(config.boundary_prior)) / 16) * 16
    shapes = {}
    for fqn, module in model.named_modules():
        rows = batch_size * (segments if "recurrent_block" in fqn else seq_len)
        if isinstance(module, nn.Linear):
            shapes[fqn] = ("linear", rows, module.in_features, module.out_features)
        elif is_fused_experts(module):
            _, two_inner, hidden = module.gate_up_proj.shape
            routed = rows * config.num_experts_per_tok
            shapes[f"{fqn}.gate_up_proj"] = ("grouped", routed, hidden, two_inner)
            shapes[f"{fqn}.down_proj"] = ("grouped", routed, two_inner // 2, hidden)
    return shapes


def load_gemm_table(path: str | Path | None = None) -> dict:
    """The GEMM table at `path` (default :data:`FP8_GEMM_TABLE`), ``{"gpus": {...}}``. Raises ValueError naming the
    file when it is not JSON or has no ``"gpus"`` mapping."""
    path = Path(FP8_GEMM_TABLE if path is None else path)
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"FP8 GEMM table {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(table, dict) or not isinstance(table.get("gpus"), dict):
        raise ValueError(f'FP8 GEMM table {path}: expected {{"gpus": {{device name: ...}}}}')
    return table


def measured_speedup(gpu: dict, kind: str, m: int, k: int, n: int, recipe: str) -> tuple[float, int] | None:
    """``(bf16 seconds / FP8 seconds, the row's M)`` from the row of `gpu` (one entry of the table's ``"gpus"``) with
    this `kind`, `k` and `n` whose M is nearest `m` (within a factor of 2), or None when the table has no such row or
    the row lacks `recipe` (``rowwise_with_gw_hp`` reads ``rowwise``)."""
    recipe = "rowwise" if recipe == "rowwise_with_gw_hp" else recipe
    rows = [
        r
        for r in gpu.get("gemms", ())
        if (r["kind"], r["k"], r["n"]) == (kind, k, n) and recipe in r["seconds"] and "bf16" in r["seconds"]
    ]
    if not rows or m <= 0:
        return None
    row = min(rows, key=lambda r: abs(math.log2(r["m"] / m)))
    return (row["seconds"]["bf16"] / row["seconds"][recipe], row["m"]) if abs(math.log2(row["m"] / m)) <= 1 else None


# --- The decision per layer ------------------------------------------------------------------------------------------


@functools.cache
def _torchao_size_filter(recipe: str):
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    return _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])


def keep_reason(
    module: nn.Module,
    fqn: str,
    layers: str = "tk_train",
    recipe: str = "tensorwise",
    shape: tuple | None = None,
    measured: tuple[str, dict] | None = None,
) -> str | None:
    """Why the linear layer `module` (name `fqn`) stays in high precision under `layers`, or None to convert it.
    ``"auto"`` decides by `measured` (``(GPU name, its table entry)``) at `shape` (``(kind, M, K, N)``,
    :func:`gemm_shapes`) when both are given, else by torchao's size filter. Raises ValueError: unknown option."""
    _check(layers, FP8_LAYER_FILTERS, "--fp8_layers")
    _check(recipe, FP8_RECIPES, "--fp8_recipe")
    if not isinstance(module, nn.Linear) or is_float8_linear(module):
        return "not a plain nn.Linear"
    word = next((w for w in TK_TRAIN_FP8_SKIP if w in fqn), None)
    if word is not None:
        return f"name contains {word!r}"
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        return f"{module.in_features} x {module.out_features} not divisible by {FP8_DIM_MULTIPLE}"
    if layers == "tk_train":
        return None
    if measured is not None and shape is not None:
        return _measured_keep_reason(measured, shape, recipe)
    if not _torchao_size_filter(recipe)(module, fqn):
        return f"torchao's size filter ({recipe}): no gain at K={module.in_features}, N={module.out_features}"
    return None


def _measured_keep_reason(measured: tuple[str, dict], shape: tuple, recipe: str) -> str | None:
    (gpu, entry), (kind, m, k, n) = measured, shape
    speedup = measured_speedup(entry, kind, m, k, n, recipe)
    if speedup is None:
        return f"(M={m}, K={k}, N={n}) not measured on {gpu}"
    return None if speedup[0] > 1.0 else f"measured {speedup[0]:.2f}x at (M={speedup[1]}, K={k}, N={n}) on {gpu}"


def fp8_grouped_mm_unsupported_reason(device: torch.device | str | None = None) -> str | None:
    """Why torchao's FP8 grouped GEMM cannot run on `device` (default: the current CUDA device), or None."""
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
    except Exception as exc:
        return f"torchao.prototype.moe_training does not import: {type(exc).__name__}: {exc}"
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA (torch._scaled_grouped_mm, torchao's triton kernels; no emulated mode)"
    if torch.cuda.get_device_capability(device) != FP8_GROUPED_MM_CAPABILITY:
        return f"compute capability {torch.cuda.get_device_capability(device)}: torchao's FP8 grouped GEMM is SM90's"
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton does not import ({exc})"
    return None


def _experts_keep_reason(
    module: nn.Module, fqn: str, mode: str, device, shapes: dict | None, measured: tuple | None
) -> str | None:
    if mode == "off":
        return "--fp8_experts off"
    reason = fp8_grouped_mm_unsupported_reason(device)
    if reason is not None and mode == "on":
        raise RuntimeError(f"--fp8_experts on: torchao's FP8 grouped GEMM cannot run here: {reason}")
    if reason is None and mode == "auto" and shapes is not None and measured is not None:
        reason = _measured_keep_reason(measured, shapes[f"{fqn}.gate_up_proj"], "rowwise")
    if reason is None and getattr(module.config, "_experts_implementation", None) not in (
        "grouped_mm",
        ALIGNED_GROUPED_MM,
    ):
        reason = f"experts_implementation={module.config._experts_implementation!r}: only grouped_mm runs it"
    dims = (*module.gate_up_proj.shape[1:], module.down_proj.shape[-1])  # 2I, D, I
    if reason is None and any(d % FP8_DIM_MULTIPLE for d in dims):
        reason = f"expert matrices {tuple(module.gate_up_proj.shape[1:])} not divisible by {FP8_DIM_MULTIPLE}"
    return reason


# --- Converting ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fp8Report:
    """What :func:`convert_for_fp8_training` did. ``converted``/``kept``: qualified name -> layer group / reason
    (linear layers and routed-experts modules); ``source``: what decided (the table's GPU, or torchao's filter)."""

    converted: dict[str, str] = dataclasses.field(default_factory=dict)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    recipe: str = "tensorwise"
    layers: str = "auto"
    source: str = ""

    @property
    def message(self) -> str:
        """A header, then per layer group: ``<group>: converted n of m; kept: <count> <reason>, ...``."""
        groups = defaultdict(lambda: ([], []))
        for fqn, group in self.converted.items():
            groups[group][0].append(fqn)
        for fqn, reason in self.kept.items():
            kind = "measured slower" if reason.startswith("measured") else reason.split(" at ")[0].split(" (")[0]
            groups[layer_group(fqn)][1].append("not measured" if " not measured " in reason else kind)
        lines = [f"FP8 ({self.recipe}, --fp8_layers {self.layers}, {self.source}):"]
        for group, (done, kept) in sorted(groups.items()):
            reasons = ", ".join(f"{kept.count(r)} {r}" for r in sorted(set(kept)))
            lines.append(
                f"  {group}: converted {len(done)} of {len(done) + len(kept)}"
                + (f"; kept: {reasons}" if reasons else "")
            )
        return "\n".join(lines)


def convert_for_fp8_training(
    model: nn.Module,
    recipe: str = "tensorwise",
    layers: str = "auto",
    experts: str = "auto",
    emulate: bool | None = None,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    gemm_table: dict | str | Path | None = None,
    gpu: str | None = None,
    fsdp_float8_all_gather: bool = False,
) -> Fp8Report:
    """What ``--precision fp8`` does to `model`, in place: ``Float8Linear`` for the linear layers and torchao's FP8
    grouped GEMM for the routed experts, each where the module docstring's rules say it pays.

    Args:
        recipe / layers / experts: ``--fp8_recipe``, ``--fp8_layers``, ``--fp8_experts``.
        emulate: see :func:`build_float8_config`. device: the training device (experts' kernels check).
        batch_size, seq_len: the micro-batch (windows, bytes) that sets each GEMM's M; None: torchao's size filter.
        gemm_table: the table (dict or path; default :data:`FP8_GEMM_TABLE`). gpu: its device name to read (default
            the current CUDA device's; None on CPU).
        fsdp_float8_all_gather: FSDP2 all-gathers the ``Float8Linear`` weights in float8 (tensorwise); call
            :func:`precompute_fp8_scales` after each optimizer step.
    Returns:
        :class:`Fp8Report` (its message is logged). Layers already ``Float8Linear`` are left as they are.
    Raises:
        ValueError: an unknown option; ImportError: torchao missing; RuntimeError: ``experts="on"`` without kernels.
    """
    _check(experts, FP8_EXPERTS_MODES, "--fp8_experts")
    config = build_float8_config(recipe, emulate, fsdp_float8_all_gather)
    _check(layers, FP8_LAYER_FILTERS, "--fp8_layers")
    table = gemm_table if isinstance(gemm_table, dict) else load_gemm_table(gemm_table)
    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    measured = (gpu, table["gpus"][gpu]) if layers == "auto" and gpu in table["gpus"] else None
    shapes = gemm_shapes(model, batch_size, seq_len) if batch_size and seq_len else None
    if layers == "tk_train":
        source = "tk-train.py's layers"
    elif measured is not None and shapes is not None:
        source = f"GEMM table of {gpu} at {batch_size} x {seq_len} bytes"
    else:
        why = "no batch size given" if measured else f"no measured GEMM table for {gpu or 'this device'}"
        source = f"torchao's size filter ({why})"
        if measured is None and gpu is not None:
            logger.warning("FP8: no GEMM table for %s: run `spider-measure-fp8-gemms` to measure one", gpu)
    report = Fp8Report(recipe=recipe, layers=layers, source=source)
    chosen, chosen_experts = set(), set()
    for fqn, module in model.named_modules():
        if is_fused_experts(module):
            reason = _experts_keep_reason(module, fqn, experts, device, shapes, measured)
            target = chosen_experts
        elif isinstance(module, nn.Linear):
            if is_float8_linear(module):
                report.converted[fqn] = layer_group(fqn)
                continue
            reason = keep_reason(module, fqn, layers, recipe, shapes and shapes[fqn], measured)
            target = chosen
        else:
            continue
        if reason is None:
            report.converted[fqn] = layer_group(fqn)
            target.add(fqn)
        else:
            report.kept[fqn] = reason
    if chosen:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    if chosen_experts:
        convert_experts_to_fp8(model, chosen_experts)
    logger.info(report.message)
    return report


def convert_experts_to_fp8(model: nn.Module, fqns, config=None) -> None:
    """Route the fused experts named `fqns` through torchao's FP8 rowwise grouped GEMM (``quantize_`` with `config`,
    default ``Float8TrainingOpConfig()``; parameters keep names and values) and :data:`ALIGNED_GROUPED_MM`."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    fqns = set(fqns)
    quantize_(model, config or Float8TrainingOpConfig(), filter_fn=lambda module, fqn: fqn in fqns)
    for fqn in fqns:
        model.get_submodule(fqn).config._experts_implementation = ALIGNED_GROUPED_MM


def aligned_grouped_mm_experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts (``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I)) on `hidden_states`
    `(T, D)`, int64 `top_k_index` `(T, k)`, `top_k_weights` `(T, k)` -> `(T, D)` (k slots summed in fp32), with each
    expert's rows starting at a multiple of 16 as torchao's FP8 grouped GEMM needs (0.18 does not pad): a zero buffer
    of ``T*k + E*15`` rows rounded up to 16, a static bound (nothing read on the host)."""
    (T, k), E, align = top_k_index.shape, experts.num_experts, FP8_DIM_MULTIPLE
    slots = top_k_index.reshape(-1)
    counts = torch.zeros(E, dtype=torch.long, device=slots.device).scatter_add_(0, slots, torch.ones_like(slots))
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    order = torch.sort(slots, stable=True).indices  # slots by expert, token order kept within an expert
    sorted_experts = slots[order]
    rank = torch.arange(T * k, device=slots.device) - (counts.cumsum(0) - counts)[sorted_experts]
    row = torch.empty_like(slots).scatter_(0, order, (ends - padded)[sorted_experts] + rank)  # each slot's row
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_rows = -(-(T * k + E * (align - 1)) // align) * align
    x = hidden_states.new_zeros(num_rows, hidden_states.shape[-1], dtype=gate_up.dtype)
    x = x.index_copy(0, row, hidden_states.to(gate_up.dtype).repeat_interleave(k, dim=0))
    offsets = ends.to(torch.int32)
    h = experts._apply_gate(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets))
    y = torch._grouped_mm(h.to(down.dtype), down.transpose(-2, -1), offs=offsets)
    out = (y[row].view(T, k, -1).to(torch.float32) * top_k_weights.to(torch.float32)[..., None]).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(ALIGNED_GROUPED_MM, aligned_grouped_mm_experts_forward)


def precompute_fp8_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP2 float8 all-gather: every weight's scale in one all-reduce (torchao)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


# --- Back to plain weights -------------------------------------------------------------------------------------------


def _plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap torchao's weight wrappers (``_tensor``: FSDP float8 all-gather; ``_data``: FP8 experts)."""
    while type(tensor) not in (torch.Tensor, nn.Parameter):
        inner = next(
            (
                t
                for t in (getattr(tensor, "_tensor", None), getattr(tensor, "_data", None))
                if isinstance(t, torch.Tensor)
            ),
            None,
        )
        if inner is None:
            return tensor
        tensor = inner
    return tensor


def has_fp8_weight_wrappers(model: nn.Module) -> bool:
    """True when a parameter is a torchao weight wrapper, which ``save_pretrained`` cannot write."""
    return any(_plain_tensor(p) is not p for p in model.parameters())


def fp8_to_plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()``, torchao's weight wrappers unwrapped (tensors shared): the plain model's keys and dtypes,
    for ``save_pretrained(d, state_dict=...)``. Not for DTensors."""
    return {name: _plain_tensor(t) for name, t in model.state_dict().items()}


def convert_fp8_to_plain(model: nn.Module) -> int:
    """Swap every ``Float8Linear`` back to ``nn.Linear`` and unwrap the FP8 experts, in place (for evaluation or
    export); returns the number of modules changed. Raises ValueError when `model` itself is a ``Float8Linear``."""
    if is_float8_linear(model):
        raise ValueError("convert_fp8_to_plain swaps submodules in place; the model itself is a Float8Linear")
    changed = 0
    for fqn, module in list(model.named_modules()):
        if is_float8_linear(module):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            plain.weight = nn.Parameter(_plain_tensor(module.weight), module.weight.requires_grad)
            plain.bias = module.bias
            plain.train(module.training)
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, plain)
            changed += 1
        elif is_fused_experts(module) and any(type(p.data) is not torch.Tensor for p in module.parameters()):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(module, name)
                setattr(module, name, nn.Parameter(_plain_tensor(param.data), requires_grad=param.requires_grad))
            module.config._experts_implementation = "grouped_mm"
            changed += 1
    return changed


# --- --precision -----------------------------------------------------------------------------------------------------


def fp8_measured_faster(preset: str | None, capability: tuple[int, int] | None = None) -> bool:
    """Whether :data:`FP8_MEASURED` holds a faster FP8 step of `preset` on this GPU class (default: the current)."""
    capability = tuple(torch.cuda.get_device_capability()) if capability is None else tuple(capability)
    entry = FP8_MEASURED.get((capability, preset))
    return entry is not None and entry["fp8_seconds"] < entry["bf16_seconds"]


def resolve_precision(precision: str, preset: str | None = None) -> str:
    """``--precision`` (tk-train.py's ``detect_precision_mode``) as ``"fp8"``, ``"bf16"`` or ``"fp32"``. ``auto``: fp8
    on a GPU with FP8 matmuls (>= sm_89) where an FP8 step of `preset` measured faster (:func:`fp8_measured_faster`),
    bf16 on other GPUs, fp32 on CPU (FP8 only emulates there; bf16 is slower than fp32 for small models on 2 cores).
    Raises ValueError (unknown value), ImportError (``fp8`` without torchao)."""
    precision = precision.strip().lower() if isinstance(precision, str) else precision
    _check(precision, PRECISIONS, "--precision")
    if precision == "fp8" and not torchao_fp8_available():
        raise ImportError("--precision fp8 needs torchao (`pip install torchao`); torchao.float8 does not import")
    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    capability = tuple(torch.cuda.get_device_capability())
    fast = capability >= FP8_MIN_COMPUTE_CAPABILITY and torchao_fp8_available() and fp8_measured_faster(preset)
    return "fp8" if fast else "bf16"
