"""FP8 training for Spider with torchao's ``Float8Linear`` (as in ``tk-train.py``, the original training script: ``configure_fp8_training``,
``detect_precision_mode``).

What gets converted (:func:`fp8_skip_reason`, ``--fp8_layers``):

- ``"auto"`` (default): the layers where torchao's own filter (``torchao.float8.float8_linear_utils.
  _auto_filter_for_recipe``, thresholds from its H100 benchmarks) expects FP8 to beat bf16, among the plain
  ``nn.Linear`` layers tk-train.py's filter allows. On the small and tiny presets no layer is large enough, so nothing is
  converted and the run says so.
- ``"tk_train"``: every layer tk-train.py's filter allows: a plain ``nn.Linear`` whose qualified name contains none of
  its skip words (:data:`TK_TRAIN_FP8_SKIP`) and whose ``in_features`` and ``out_features`` both divide by 16 (torchao /
  ``torch._scaled_mm`` needs it). In Spider that is the MLA projections, the dense prelude/coda SwiGLUs and the shared
  experts; the router, ``lm_head``, boundary predictor, Engram projections and halt predictor stay in high precision
  (the module names are fixed so that tk-train.py's filter keeps selecting the same layers). ``"seed"`` is the
  deprecated name of ``"tk_train"`` (:data:`FP8_LAYER_ALIASES`) and still works, with a warning.

The routed experts are fused 3-D parameters (``modeling_spider.SpiderExperts``), not ``nn.Linear`` layers:
``Float8Linear`` does not reach them under either filter, and they run through the model's ``experts_implementation``
in high precision. (tk-train.py converted every expert's ``nn.Linear``; on an H200 that made a 1b step 5.8 s against
0.85 s in bf16: each expert multiplies only the few rows routed to it.) Their FP8 path is torchao's grouped GEMM,
:mod:`spider_training.fp8_moe`.

:attr:`Fp8Report.message` is the one log line that says how many layers were converted and, by reason, how many were
left in high precision.

Precision (:func:`resolve_precision`, ``--precision auto|fp8|bf16|fp32``): ``auto`` picks what was *measured* faster
for the preset on that GPU class (:data:`FP8_MEASURED`): ``fp8`` only where an FP8 training step measured faster than
bf16, ``bf16`` on every other CUDA device (today: every one; FP8 measured slower for both presets on an H200), and
``fp32`` on CPU. On CPU, FP8 only runs emulated (``Float8LinearConfig(emulate=True)``: the same numbers as the
hardware path, about 8x slower than bf16; a real ``torch._scaled_mm`` on CPU is ~500x slower), and bf16 is *slower*
than fp32 for small models on a 2-core CPU, so ``auto`` keeps fp32 there. ``--precision fp8`` still works everywhere
(emulated on CPU), for testing the FP8 code path and for measuring it.

Checkpoints: ``Float8Linear`` keeps its high-precision weight as an ordinary ``nn.Parameter`` under the same name, so
a converted model's ``state_dict()`` has exactly the plain model's keys, dtypes and tensor types, and
``save_pretrained`` -> ``SpiderForConditionalGeneration.from_pretrained`` gives a plain model with equal weights
(tested). The one exception is torchao's FSDP2 float8 all-gather (``enable_fsdp_float8_all_gather=True``, which
accelerate's *default* ``AORecipeKwargs`` config turns on): its weights are ``WeightWithDynamicFloat8CastTensor``
wrapper subclasses and ``save_pretrained`` fails on them ("Attempted to access the data pointer on an invalid python
storage"). :func:`fp8_to_plain_state_dict` unwraps them (``model.save_pretrained(d,
state_dict=fp8_to_plain_state_dict(model))``), :func:`convert_fp8_to_plain` swaps the layers back to ``nn.Linear``.
:func:`ao_recipe_kwargs` builds an accelerate ``AORecipeKwargs`` with this module's config and filter instead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: tk-train.py's FP8 skip list (its ``configure_fp8_training``): a module whose qualified name contains any
#: of these substrings is never converted.
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

#: torchao recipes (``Float8LinearRecipeName`` values) accepted by :func:`convert_model_to_fp8`.
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: Values of ``--precision``; :func:`resolve_precision` maps ``auto`` to one of the others.
PRECISIONS = ("auto", "fp8", "bf16", "fp32")

#: Values of ``--fp8_layers``: which linear layers :func:`convert_model_to_fp8` converts (module docstring).
FP8_LAYER_FILTERS = ("auto", "tk_train")

#: Deprecated values of ``--fp8_layers`` -> their current name; accepted with a warning (logged once per value).
FP8_LAYER_ALIASES = {"seed": "tk_train"}

#: Minimum CUDA compute capability with FP8 tensor-core matmuls (Ada Lovelace sm_89).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)

#: One training step (forward, backward, optimizer) measured in bf16 autocast and in FP8 on a GPU class, by
#: ``python -m bench.gpu_check``: ``{(compute capability, preset): {...}}``. ``--precision auto`` picks FP8 for a
#: (GPU class, preset) only when its entry has ``fp8_seconds < bf16_seconds``; a pair without an entry gets bf16.
#: The entries are what ``--precision fp8`` converts (``Float8Linear`` where torchao's filter expects a gain, the
#: experts through torchao's FP8 grouped GEMM; ``small``: the ``fp8`` part's tk_train layers), measured on an H200 on
#: 2026-11-26 (``bench/gpu_check_h200.json``, docs/results.md "Performance on a GPU"); at 1 x 2048 bytes the 1b step
#: was 0.288 s bf16 against 0.690 s FP8 tensorwise (0.256 / 0.377 s rowwise).
FP8_MEASURED: dict[tuple[tuple[int, int], str], dict] = {
    ((9, 0), "1b"): {
        "gpu": "NVIDIA H200", "batch": "32 x 256 bytes", "bf16_seconds": 0.355, "fp8_seconds": 5.05,
        "fp8": "tensorwise Float8Linear on 48 of 94 linear layers (torchao's filter), 6 experts modules on FP8 "
               "grouped GEMM",
        "versions": "torch 2.11.0+cu130, transformers 5.24.0, torchao 0.18.0",
    },
    ((9, 0), "small"): {
        "gpu": "NVIDIA H200", "batch": "8 x 256 bytes", "bf16_seconds": 0.082, "fp8_seconds": 0.209,
        "fp8": "tensorwise Float8Linear on tk-train.py's 32 layers, 2 experts modules FP8 grouped GEMM",
        "versions": "torch 2.11.0+cu130, transformers 5.24.0, torchao 0.18.0",
    },
}

FP8_DIM_MULTIPLE = 16


def _float8_linear_class():
    """torchao's ``Float8Linear`` class, or None when torchao's float8 module does not import."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except Exception:  # torchao missing or broken (it needs a matching torch build)
        return None
    return Float8Linear


def torchao_fp8_available() -> bool:
    """True when ``torchao.float8`` imports (``convert_to_float8_training`` and ``Float8LinearConfig`` usable)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception:
        return False
    return True


def _is_float8_linear(module: nn.Module) -> bool:
    cls = _float8_linear_class()
    return cls is not None and isinstance(module, cls)


@functools.cache
def _torchao_auto_filter(recipe: str):
    """torchao's ``_auto_filter_for_recipe`` for `recipe` (its ``rowwise`` one for ``rowwise_with_gw_hp``, which has
    the same forward GEMM shapes and no filter of its own), without fqn filtering (tk-train.py's words are checked
    here)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    return _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])


#: The reason of :func:`fp8_skip_reason` that ``--fp8_layers auto`` adds to tk-train.py's (prefix of the text).
AUTO_SKIP_SIZE = "torchao's auto filter"


def fp8_skip_reason(module: nn.Module, fqn: str, layers: str = "tk_train", recipe: str = "tensorwise") -> str | None:
    """Why `module` (qualified name `fqn`) stays in high precision under ``--fp8_layers`` `layers` (None: it is
    converted). See the module docstring for the two filters.

    Reasons (tk-train.py's): ``"not nn.Linear"``, ``"already Float8Linear"``, ``"name contains '<word>'"`` (first
    matching word of :data:`TK_TRAIN_FP8_SKIP`), ``"in_features=<n> / out_features=<m> not divisible by 16"``; and with
    ``layers="auto"``: ``"torchao's auto filter (<recipe>) expects no gain at in_features=<K>, out_features=<N>"``.

    Raises:
        ValueError: `layers` not in :data:`FP8_LAYER_FILTERS`.
    """
    layers = canonical_fp8_layers(layers)
    if not isinstance(module, nn.Linear):
        return "not nn.Linear"
    if _is_float8_linear(module):
        return "already Float8Linear"
    for word in TK_TRAIN_FP8_SKIP:
        if word in fqn:
            return f"name contains {word!r}"
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        return (
            f"in_features={module.in_features} / out_features={module.out_features} not divisible by "
            f"{FP8_DIM_MULTIPLE}"
        )
    if layers == "auto":
        if not _torchao_auto_filter(_check_recipe(recipe))(module, fqn):
            return (f"{AUTO_SKIP_SIZE} ({recipe}) expects no gain at in_features={module.in_features}, "
                    f"out_features={module.out_features}")
    return None


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """tk-train.py's ``module_filter_fn`` for ``torchao.float8.convert_to_float8_training`` (``--fp8_layers tk_train``).

    True exactly for a plain ``nn.Linear`` (not already a ``Float8Linear``: a second conversion pass, e.g. accelerate's
    after ours, leaves converted layers alone) whose qualified name `fqn` contains none of :data:`TK_TRAIN_FP8_SKIP` (its
    filter) and whose ``in_features`` and ``out_features`` are both multiples of 16.
    :func:`fp8_layer_filter` gives the filter of either ``--fp8_layers`` value.
    """
    return fp8_skip_reason(module, fqn) is None


def fp8_layer_filter(layers: str = "auto", recipe: str = "tensorwise"):
    """The ``module_filter_fn(module, fqn) -> bool`` of ``--fp8_layers`` `layers` for `recipe` (True: convert).

    Raises:
        ValueError: unknown `layers` or `recipe`.
    """
    recipe, layers = _check_recipe(recipe), canonical_fp8_layers(layers)
    return lambda module, fqn: fp8_skip_reason(module, fqn, layers, recipe) is None


@dataclass
class Fp8Report:
    """Result of :func:`convert_model_to_fp8`.

    Attributes:
        converted: number of ``Float8Linear`` layers in the model after the call (for an already-converted model: the
            ones found).
        linear_total: number of ``nn.Linear`` layers (``Float8Linear`` included) in the model.
        recipe: torchao recipe name; for an already-converted model the recipe its layers' config matches, or
            ``"custom"``.
        emulate: whether the float8 matmuls are emulated (``Float8LinearConfig.emulate``).
        converted_fqns: qualified names of the ``Float8Linear`` layers, in module order.
        already_converted: True when the model already held ``Float8Linear`` layers and nothing was converted.
        skipped: qualified name -> reason (see :func:`fp8_skip_reason`) for every ``nn.Linear`` left in high precision.
        layers: the ``--fp8_layers`` filter used (``"auto"`` or ``"tk_train"``).
    """

    converted: int
    linear_total: int
    recipe: str
    emulate: bool
    converted_fqns: list[str] = field(default_factory=list)
    already_converted: bool = False
    skipped: dict[str, str] = field(default_factory=dict)
    layers: str = "tk_train"

    def skipped_by_reason(self) -> dict[str, int]:
        """Linear layers left in high precision, counted by the kind of reason: the reason's text up to its first
        ``:`` or ``(``, with the numbers of the size reasons dropped (``"name contains 'router'"``,
        ``"routed expert"``, ``"torchao's auto filter"``, ...)."""
        kinds = collections.Counter()
        for reason in self.skipped.values():
            kind = re.split(r"[:(]", reason, maxsplit=1)[0].strip()
            kinds["dims not divisible by 16" if "not divisible by" in kind else kind] += 1
        return dict(kinds)

    @property
    def message(self) -> str:
        """The log line: ``FP8: converted N of M linear layers (recipe=..., emulate=..., layers=...); left in high
        precision: <count> <reason>, ...``."""
        if self.already_converted:
            text = (
                f"FP8: model already converted ({self.converted} of {self.linear_total} linear layers are "
                f"Float8Linear, recipe={self.recipe}, emulate={self.emulate}); not converting again"
            )
        else:
            text = (
                f"FP8: converted {self.converted} of {self.linear_total} linear layers "
                f"(recipe={self.recipe}, emulate={self.emulate}, layers={self.layers})"
            )
            if self.skipped:
                text += "; left in high precision: " + ", ".join(
                    f"{count} {kind}" for kind, count in sorted(self.skipped_by_reason().items()))
        return text


_warned_layer_aliases: set[str] = set()


def canonical_fp8_layers(layers: str) -> str:
    """`layers` as a value of :data:`FP8_LAYER_FILTERS`: a deprecated alias is mapped (and warned about once)."""
    if layers in FP8_LAYER_ALIASES:
        new = FP8_LAYER_ALIASES[layers]
        if layers not in _warned_layer_aliases:
            _warned_layer_aliases.add(layers)
            logger.warning("--fp8_layers %s is deprecated; use --fp8_layers %s (the same layers)", layers, new)
        layers = new
    if layers not in FP8_LAYER_FILTERS:
        raise ValueError(f"--fp8_layers must be one of {FP8_LAYER_FILTERS}, got {layers!r}")
    return layers


def _check_recipe(recipe: str) -> str:
    if not isinstance(recipe, str) or recipe.strip().lower() not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {FP8_RECIPES}")
    return recipe.strip().lower()


def default_emulate() -> bool:
    """``emulate=None`` resolves to this: True exactly when CUDA is unavailable (CPU runs emulate the FP8 matmuls)."""
    return not torch.cuda.is_available()


def build_float8_config(recipe: str = "tensorwise", emulate: bool | None = None):
    """torchao ``Float8LinearConfig`` for `recipe` with ``emulate`` and tk-train.py's ``pad_inner_dim=True``.

    Built as ``dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=..., pad_inner_dim=True)``
    (torchao 0.18 has both fields). FSDP float8 all-gather stays off (the recipes' default), so weights stay plain
    parameters.

    Raises:
        ValueError: `recipe` not in :data:`FP8_RECIPES`.
        ImportError: torchao is not installed / does not import.
    """
    recipe = _check_recipe(recipe)
    try:
        from torchao.float8 import Float8LinearConfig
    except Exception as exc:
        raise ImportError(
            f"FP8 training needs torchao (`pip install torchao`); importing torchao.float8 failed: {exc}"
        ) from exc
    emulate = default_emulate() if emulate is None else bool(emulate)
    base = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate}
    if any(f.name == "pad_inner_dim" for f in dataclasses.fields(base)):
        changes["pad_inner_dim"] = True
    return dataclasses.replace(base, **changes)


def _config_recipe_name(config) -> str:
    """Name of the recipe whose casting/gemm settings `config` matches (emulate/padding/FSDP ignored), or "custom"."""
    from torchao.float8 import Float8LinearConfig

    ignore = {"emulate", "pad_inner_dim", "enable_fsdp_float8_all_gather", "force_recompute_fp8_weight_in_bwd"}
    names = [f.name for f in dataclasses.fields(config) if f.name not in ignore]
    for recipe in FP8_RECIPES:
        reference = Float8LinearConfig.from_recipe_name(recipe)
        if all(getattr(config, n) == getattr(reference, n) for n in names):
            return recipe
    return "custom"


def convert_model_to_fp8(model: nn.Module, recipe: str = "tensorwise", emulate: bool | None = None,
                         layers: str = "auto") -> Fp8Report:
    """Convert `model`'s eligible ``nn.Linear`` layers to torchao ``Float8Linear`` in place (tk-train.py's
    ``configure_fp8_training``).

    Args:
        model: any ``nn.Module`` (a Spider model in practice); converted in place.
        recipe: ``"tensorwise"`` (tk-train.py's default; dynamic per-tensor scales), ``"rowwise"`` or ``"rowwise_with_gw_hp"``
            (torchao ``Float8LinearRecipeName``). All three run forward+backward on CPU in emulate mode (tested).
        emulate: emulate the float8 matmuls in high precision; ``None`` = True exactly when CUDA is unavailable.
        layers: ``"auto"`` (default: where torchao's filter expects a gain, routed experts excluded) or ``"tk_train"``
            (every layer tk-train.py converted); see the module docstring.

    Layers are chosen by :func:`fp8_layer_filter`. Idempotent: a model that already holds ``Float8Linear`` layers
    (from an earlier call, or from accelerate's ``mixed_precision="fp8"`` / ``AORecipeKwargs`` path) is not converted
    again; the report says so (``already_converted=True``). Logs :attr:`Fp8Report.message`.

    Returns:
        :class:`Fp8Report`.
    Raises:
        ValueError: unknown `recipe` or `layers`, or `model` is itself a bare ``nn.Linear`` (it cannot be swapped in
            place).
        TypeError: `model` is not an ``nn.Module``.
        ImportError: torchao missing.
    """
    recipe, layers = _check_recipe(recipe), canonical_fp8_layers(layers)
    module_filter = fp8_layer_filter(layers, recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_model_to_fp8 expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise ValueError("convert_model_to_fp8 converts submodules in place; pass the model, not a bare nn.Linear")
    config = build_float8_config(recipe, emulate)  # raises ImportError without torchao
    from torchao.float8 import convert_to_float8_training

    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    existing = [(fqn, m) for fqn, m in linears if _is_float8_linear(m)]
    if existing:
        first_config = existing[0][1].config
        report = Fp8Report(
            converted=len(existing),
            linear_total=len(linears),
            recipe=_config_recipe_name(first_config),
            emulate=bool(first_config.emulate),
            converted_fqns=[fqn for fqn, _ in existing],
            already_converted=True,
            skipped={
                fqn: fp8_skip_reason(m, fqn, layers, recipe) or "left out by the earlier conversion"
                for fqn, m in linears
                if not _is_float8_linear(m)
            },
            layers=layers,
        )
        logger.info(report.message)
        return report

    skipped = {fqn: reason for fqn, m in linears if (reason := fp8_skip_reason(m, fqn, layers, recipe)) is not None}
    if len(skipped) < len(linears):  # torchao's conversion with nothing to convert still walks the model: skip it
        convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    converted_fqns = [fqn for fqn, m in model.named_modules() if _is_float8_linear(m)]
    report = Fp8Report(
        converted=len(converted_fqns),
        linear_total=len(linears),
        recipe=recipe,
        emulate=bool(config.emulate),
        converted_fqns=converted_fqns,
        skipped=skipped,
        layers=layers,
    )
    logger.info(report.message)
    return report


def convert_for_fp8_training(model: nn.Module, recipe: str = "tensorwise", layers: str = "auto",
                             experts: str = "auto", emulate: bool | None = None, device: torch.device | str | None = None):
    """What ``--precision fp8`` does to `model`, in place: :func:`convert_model_to_fp8` (`recipe`, `layers`, `emulate`)
    on the linear layers, then :func:`spider_training.fp8_moe.convert_experts_for_training` (`experts`: ``--fp8_experts``,
    on `device`) on the routed experts.

    Returns:
        ``(Fp8Report, Fp8ExpertsReport)``.
    Raises:
        What the two conversions raise (a bad `recipe`, `layers` or `experts`; torchao missing; ``experts="on"`` where
        the FP8 grouped GEMM cannot run).
    """
    from .fp8_moe import convert_experts_for_training

    linear = convert_model_to_fp8(model, recipe=recipe, emulate=emulate, layers=layers)
    return linear, convert_experts_for_training(model, experts, device)


def _plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap torchao's weight wrapper subclasses (``WeightWithDynamicFloat8CastTensor`` keeps the high-precision
    tensor in ``_tensor``, the MoE experts' ``Float8TrainingWeightWrapperTensor`` in ``_data``); plain tensors come
    back unchanged."""
    while type(tensor) not in (torch.Tensor, nn.Parameter):
        inner = next((getattr(tensor, name) for name in ("_tensor", "_data")
                      if isinstance(getattr(tensor, name, None), torch.Tensor)), None)
        if inner is None:
            break
        tensor = inner
    return tensor


def has_fp8_weight_wrappers(model: nn.Module) -> bool:
    """True when a parameter of `model` is one of torchao's weight wrapper subclasses (FSDP float8 all-gather, the FP8
    grouped-GEMM experts), whose ``state_dict()`` ``save_pretrained`` cannot write: save
    :func:`fp8_to_plain_state_dict` instead."""
    return any(_plain_tensor(p) is not p for p in model.parameters())


def fp8_to_plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every torchao float8 weight wrapper unwrapped to its plain high-precision tensor.

    Keys and dtypes are those of the unconverted model. Needed when the model was converted with FSDP float8
    all-gather (accelerate's default ``AORecipeKwargs``) or its experts run torchao's FP8 grouped GEMM
    (:mod:`spider_training.fp8_moe`; :func:`has_fp8_weight_wrappers`): ``save_pretrained(d,
    state_dict=fp8_to_plain_state_dict(m))``.
    Tensors are shared with the model, not copied (a new dict each call: ``save_pretrained`` pops the entries of the
    dict it is given). Not for FSDP2-sharded (``DTensor``) models: gather them first.
    """
    return {name: _plain_tensor(t) for name, t in model.state_dict().items()}


def convert_fp8_to_plain(model: nn.Module) -> int:
    """Swap every ``Float8Linear`` in `model` back to a plain ``nn.Linear`` sharing its weight/bias (in place).

    For evaluation, generation or export after FP8 training. Returns the number of layers swapped (0 when torchao is
    missing or nothing was converted). Weight wrapper subclasses are unwrapped to plain parameters.
    """
    cls = _float8_linear_class()
    if cls is None:
        return 0
    targets = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, cls)]
    for fqn, module in targets:
        with torch.device("meta"):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        weight = _plain_tensor(module.weight)
        plain.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, module.weight.requires_grad)
        plain.bias = module.bias
        plain.train(module.training)
        if fqn == "":
            raise ValueError("convert_fp8_to_plain swaps submodules in place; the model itself is a Float8Linear")
        parent_name, _, child_name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, plain)
    if targets:
        logger.info("FP8: swapped %d Float8Linear layers back to nn.Linear", len(targets))
    return len(targets)


def ao_recipe_kwargs(recipe: str = "tensorwise", emulate: bool | None = None, layers: str = "auto"):
    """accelerate ``AORecipeKwargs`` with :func:`build_float8_config` and :func:`fp8_layer_filter` (`layers`).

    Use it (e.g. from ``Trainer._build_accelerator_args``) instead of ``ACCELERATE_MIXED_PRECISION=fp8`` alone, whose
    default converts every 16-divisible ``nn.Linear`` but the first and last (boundary predictor and Engram included),
    does not emulate on CPU, and turns on FSDP float8 all-gather (weights that ``save_pretrained`` cannot write).
    With this filter, accelerate's conversion pass is a no-op on a model :func:`convert_model_to_fp8` already converted.

    Raises:
        ValueError: unknown `recipe`. ImportError: accelerate or torchao missing.
    """
    from accelerate.utils import AORecipeKwargs

    return AORecipeKwargs(config=build_float8_config(recipe, emulate),
                          module_filter_func=fp8_layer_filter(layers, recipe))


def fp8_measured_faster(preset: str | None, capability: tuple[int, int] | None = None) -> bool:
    """Whether :data:`FP8_MEASURED` holds a step of `preset` on a GPU of compute capability `capability` (default:
    the current CUDA device's) where FP8 measured faster than bf16. False without an entry."""
    if capability is None:
        capability = tuple(torch.cuda.get_device_capability())
    entry = FP8_MEASURED.get((tuple(capability), preset))
    return entry is not None and entry["fp8_seconds"] < entry["bf16_seconds"]


def resolve_precision(precision: str, preset: str | None = None) -> str:
    """Resolve ``--precision`` (tk-train.py's ``detect_precision_mode``) to ``"fp8"``, ``"bf16"`` or ``"fp32"``.

    ``auto`` chooses by measurement, not by capability alone: ``fp8`` on a CUDA device with FP8 matmuls (compute
    capability >= 8.9) when torchao's float8 module imports *and* an FP8 step of `preset` measured faster than bf16 on
    that GPU class (:func:`fp8_measured_faster`); ``bf16`` on every other CUDA device; ``fp32`` on CPU (FP8 is only
    emulated there, ~8x slower than bf16, and bf16 is slower than fp32 for small models on a 2-core CPU). tk-train.py
    returned FP8 from compute capability 8.0 on; on an H200 its FP8 step of the 1b preset took 5.8 s against 0.85 s
    in bf16. Explicit ``fp8`` / ``bf16`` / ``fp32`` are returned as given (case-insensitive); ``fp8`` on CPU runs
    emulated.

    Args:
        precision: one of :data:`PRECISIONS`.
        preset: the model preset being trained (``"tiny"``, ``"small"``, ``"1b"``; None for a custom config, which
            has no measurement and so never gets FP8 from ``auto``).
    Raises:
        ValueError: unknown value (the message lists the valid ones).
        ImportError: ``fp8`` requested and torchao's float8 module does not import.
    """
    if not isinstance(precision, str) or precision.strip().lower() not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    precision = precision.strip().lower()
    if precision == "fp8":
        if not torchao_fp8_available():
            raise ImportError("--precision fp8 needs torchao (`pip install torchao`); torchao.float8 does not import")
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_MIN_COMPUTE_CAPABILITY:
            logger.warning(
                "--precision fp8 on a CUDA device with compute capability %s < 8.9: no FP8 matmuls in hardware; "
                "pass emulate=True to convert_model_to_fp8 or use bf16",
                torch.cuda.get_device_capability(),
            )
        return "fp8"
    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    capability = tuple(torch.cuda.get_device_capability())
    if capability >= FP8_MIN_COMPUTE_CAPABILITY and torchao_fp8_available() and fp8_measured_faster(preset, capability):
        return "fp8"
    return "bf16"


__all__ = [
    "TK_TRAIN_FP8_SKIP",
    "FP8_RECIPES",
    "PRECISIONS",
    "FP8_LAYER_ALIASES",
    "canonical_fp8_layers",
    "FP8_LAYER_FILTERS",
    "FP8_MIN_COMPUTE_CAPABILITY",
    "FP8_MEASURED",
    "Fp8Report",
    "fp8_skip_reason",
    "fp8_module_filter",
    "fp8_layer_filter",
    "fp8_measured_faster",
    "torchao_fp8_available",
    "default_emulate",
    "build_float8_config",
    "convert_model_to_fp8",
    "convert_for_fp8_training",
    "fp8_to_plain_state_dict",
    "has_fp8_weight_wrappers",
    "convert_fp8_to_plain",
    "ao_recipe_kwargs",
    "resolve_precision",
]
