"""FP8 training for Spider with torchao's ``Float8Linear`` (seed ``tk-train.py``: ``configure_fp8_training``,
``detect_precision_mode``).

What gets converted (:func:`fp8_module_filter`): every plain ``nn.Linear`` whose qualified name contains none of the
seed's skip words (:data:`SEED_FP8_SKIP`) and whose ``in_features`` and ``out_features`` both divide by 16 (torchao /
``torch._scaled_mm`` needs it). In Spider that is the MLA projections, the dense prelude/coda SwiGLUs and the shared
experts; the router, ``lm_head``, boundary predictor, Engram projections and halt predictor stay in high precision
(SPEC §1 fixes the module names so that the seed's filter keeps selecting the same layers). The routed experts are
fused 3-D parameters (``modeling_spider.SpiderExperts``, issue #39), not ``nn.Linear`` layers: ``Float8Linear`` does
not reach them, and they keep running through the model's ``experts_implementation`` in high precision.

Precision (:func:`resolve_precision`, ``--precision auto|fp8|bf16|fp32``): ``auto`` picks ``fp8`` on CUDA devices
with compute capability >= 8.9 (Ada sm_89, Hopper sm_90, Blackwell sm_100 / sm_120) when torchao imports, ``bf16``
on other CUDA devices, and ``fp32`` on CPU. On CPU, FP8 only runs emulated (``Float8LinearConfig(emulate=True)``:
the same numbers as the hardware path, about 8x slower than bf16; a real ``torch._scaled_mm`` on CPU is ~500x slower),
and bf16 is *slower* than fp32 for small models on the 2-core development machine (NOTES.md), so ``auto`` keeps fp32
there. ``--precision fp8`` on CPU still works (emulated), for testing the FP8 code path.

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

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: The seed's FP8 skip list (``tk-train.py`` ``configure_fp8_training``): a module whose qualified name contains any
#: of these substrings is never converted.
SEED_FP8_SKIP = (
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

#: Minimum CUDA compute capability with FP8 tensor-core matmuls (Ada Lovelace sm_89).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)

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


def fp8_skip_reason(module: nn.Module, fqn: str) -> str | None:
    """Why :func:`fp8_module_filter` would not convert `module` (None: it would).

    Reasons: ``"not nn.Linear"``, ``"already Float8Linear"``, ``"name contains '<word>'"`` (first matching word of
    :data:`SEED_FP8_SKIP`), ``"in_features=<n> / out_features=<m> not divisible by 16"``.
    """
    if not isinstance(module, nn.Linear):
        return "not nn.Linear"
    if _is_float8_linear(module):
        return "already Float8Linear"
    for word in SEED_FP8_SKIP:
        if word in fqn:
            return f"name contains {word!r}"
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        return (
            f"in_features={module.in_features} / out_features={module.out_features} not divisible by "
            f"{FP8_DIM_MULTIPLE}"
        )
    return None


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``torchao.float8.convert_to_float8_training`` (and accelerate's ``AORecipeKwargs``).

    True exactly for a plain ``nn.Linear`` (not already a ``Float8Linear``: a second conversion pass, e.g. accelerate's
    after ours, leaves converted layers alone) whose qualified name `fqn` contains none of :data:`SEED_FP8_SKIP` (the
    seed's filter, ``tk-train.py``) and whose ``in_features`` and ``out_features`` are both multiples of 16.
    """
    return fp8_skip_reason(module, fqn) is None


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
    """

    converted: int
    linear_total: int
    recipe: str
    emulate: bool
    converted_fqns: list[str] = field(default_factory=list)
    already_converted: bool = False
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def message(self) -> str:
        """The log line: ``FP8: converted N of M linear layers (recipe=..., emulate=...)``."""
        if self.already_converted:
            text = (
                f"FP8: model already converted ({self.converted} of {self.linear_total} linear layers are "
                f"Float8Linear, recipe={self.recipe}, emulate={self.emulate}); not converting again"
            )
        else:
            text = (
                f"FP8: converted {self.converted} of {self.linear_total} linear layers "
                f"(recipe={self.recipe}, emulate={self.emulate})"
            )
        return text


def _check_recipe(recipe: str) -> str:
    if not isinstance(recipe, str) or recipe.strip().lower() not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {FP8_RECIPES}")
    return recipe.strip().lower()


def default_emulate() -> bool:
    """``emulate=None`` resolves to this: True exactly when CUDA is unavailable (CPU runs emulate the FP8 matmuls)."""
    return not torch.cuda.is_available()


def build_float8_config(recipe: str = "tensorwise", emulate: bool | None = None):
    """torchao ``Float8LinearConfig`` for `recipe` with ``emulate`` and the seed's ``pad_inner_dim=True``.

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


def convert_model_to_fp8(model: nn.Module, recipe: str = "tensorwise", emulate: bool | None = None) -> Fp8Report:
    """Convert `model`'s eligible ``nn.Linear`` layers to torchao ``Float8Linear`` in place (seed
    ``configure_fp8_training``).

    Args:
        model: any ``nn.Module`` (a Spider model in practice); converted in place.
        recipe: ``"tensorwise"`` (seed default; dynamic per-tensor scales), ``"rowwise"`` or ``"rowwise_with_gw_hp"``
            (torchao ``Float8LinearRecipeName``). All three run forward+backward on CPU in emulate mode (tested).
        emulate: emulate the float8 matmuls in high precision; ``None`` = True exactly when CUDA is unavailable.

    Layers are chosen by :func:`fp8_module_filter`. Idempotent: a model that already holds ``Float8Linear`` layers
    (from an earlier call, or from accelerate's ``mixed_precision="fp8"`` / ``AORecipeKwargs`` path) is not converted
    again; the report says so (``already_converted=True``). Logs ``"FP8: converted N of M linear layers
    (recipe=..., emulate=...)"``.

    Returns:
        :class:`Fp8Report`.
    Raises:
        ValueError: unknown `recipe`, or `model` is itself a bare ``nn.Linear`` (it cannot be swapped in place).
        TypeError: `model` is not an ``nn.Module``.
        ImportError: torchao missing.
    """
    recipe = _check_recipe(recipe)
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
                fqn: fp8_skip_reason(m, fqn) or "left out by the earlier conversion"
                for fqn, m in linears
                if not _is_float8_linear(m)
            },
        )
        logger.info(report.message)
        return report

    skipped = {fqn: reason for fqn, m in linears if (reason := fp8_skip_reason(m, fqn)) is not None}
    convert_to_float8_training(model, module_filter_fn=fp8_module_filter, config=config)
    converted_fqns = [fqn for fqn, m in model.named_modules() if _is_float8_linear(m)]
    report = Fp8Report(
        converted=len(converted_fqns),
        linear_total=len(linears),
        recipe=recipe,
        emulate=bool(config.emulate),
        converted_fqns=converted_fqns,
        skipped=skipped,
    )
    logger.info(report.message)
    return report


def _plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap torchao's weight wrapper subclasses (``WeightWithDynamicFloat8CastTensor`` keeps the high-precision
    tensor in ``_tensor``); plain tensors come back unchanged."""
    while type(tensor) not in (torch.Tensor, nn.Parameter) and isinstance(
        getattr(tensor, "_tensor", None), torch.Tensor
    ):
        tensor = tensor._tensor
    return tensor


def fp8_to_plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every torchao float8 weight wrapper unwrapped to its plain high-precision tensor.

    Keys and dtypes are those of the unconverted model. Needed only when the model was converted with FSDP float8
    all-gather (accelerate's default ``AORecipeKwargs``): ``save_pretrained(d, state_dict=fp8_to_plain_state_dict(m))``.
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


def ao_recipe_kwargs(recipe: str = "tensorwise", emulate: bool | None = None):
    """accelerate ``AORecipeKwargs`` with :func:`build_float8_config` and :func:`fp8_module_filter`.

    Use it (e.g. from ``Trainer._build_accelerator_args``) instead of ``ACCELERATE_MIXED_PRECISION=fp8`` alone, whose
    default converts every 16-divisible ``nn.Linear`` but the first and last (boundary predictor and Engram included),
    does not emulate on CPU, and turns on FSDP float8 all-gather (weights that ``save_pretrained`` cannot write).
    With this filter, accelerate's conversion pass is a no-op on a model :func:`convert_model_to_fp8` already converted.

    Raises:
        ValueError: unknown `recipe`. ImportError: accelerate or torchao missing.
    """
    from accelerate.utils import AORecipeKwargs

    return AORecipeKwargs(config=build_float8_config(recipe, emulate), module_filter_func=fp8_module_filter)


def resolve_precision(precision: str) -> str:
    """Resolve ``--precision`` (seed ``detect_precision_mode``) to ``"fp8"``, ``"bf16"`` or ``"fp32"``.

    ``auto``: ``fp8`` on a CUDA device with compute capability >= 8.9 (sm_89 Ada, sm_90 H100, sm_100 B200, sm_120
    RTX Blackwell) when torchao's float8 module imports; ``bf16`` on any other CUDA device; ``fp32`` on CPU (FP8 is only
    emulated there, ~8x slower than bf16, and bf16 is slower than fp32 for small models on the development CPU; see
    NOTES.md). The seed returned FP8 from compute capability 8.0, but sm_80/sm_86 (A100, RTX 30xx) have no FP8 matmuls.
    Explicit ``fp8`` / ``bf16`` / ``fp32`` are returned as given (case-insensitive); ``fp8`` on CPU runs emulated.

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
    if torch.cuda.get_device_capability() >= FP8_MIN_COMPUTE_CAPABILITY and torchao_fp8_available():
        return "fp8"
    return "bf16"


__all__ = [
    "SEED_FP8_SKIP",
    "FP8_RECIPES",
    "PRECISIONS",
    "FP8_MIN_COMPUTE_CAPABILITY",
    "Fp8Report",
    "fp8_skip_reason",
    "fp8_module_filter",
    "torchao_fp8_available",
    "default_emulate",
    "build_float8_config",
    "convert_model_to_fp8",
    "fp8_to_plain_state_dict",
    "convert_fp8_to_plain",
    "ao_recipe_kwargs",
    "resolve_precision",
]
