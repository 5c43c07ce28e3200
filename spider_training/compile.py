"""``--compile``: each decoder layer compiled whole, as torchtitan compiles transformer blocks.

What is compiled: every prelude, coda and recurrent layer (``SpiderDecoderLayer``, ``SpiderRecurrentLayer``), in
place, each traced whole (``fullgraph=True``). Layers of one kind share one graph: dynamo inlines ``nn.Module``\\s, so
a layer's parameters are graph inputs and the layers differ only in them; a kind is a layer class, the recurrent
layers holding Engram being a second recurrent kind, and each kind is a compiled function of its own. So a model
compiles three graphs (forward and backward each), whatever its depth, with no recompilation, and the loops re-run
the recurrent graphs. The glue between the layers (embedding, boundary predictor, pooling and expansion, loop
adapter, LTI injection, ACT step, head and loss) stays eager: a few dozen small ops, whose Python branches (a segment
closed or not, the first loop) would each be a guard to recompile on.

Shapes: the byte layers see the same `(B, L)` at every training step and compile static. The recurrent layers see a
new segment count at almost every step (FlexiTokens' boundaries, padded to ``pad_segments_to_multiple_of``); that
one axis is marked dynamic on the layer's inputs (:func:`mark_segment_axis`), and every other dim stays
static. Nothing in a layer guards on a Python identity, a ``requires_grad`` flag or a data-dependent count, so after
the first step nothing recompiles (tests/test_compile.py; ``python -m bench.compile`` measures it).

Which calls run compiled: training forwards (gradients on, no generation cache). Evaluation and generation run the
same layers eagerly: a no-grad graph would be a second compile per kind for a few scoring passes, and the cached
decode step (``generation_spider``) passes a cache object per layer.

Compile time and inductor's caches across runs (``TORCHINDUCTOR_CACHE_DIR``, by default under the system's temporary
folder): :func:`configure_dynamo` sets what lets a warm cache serve every bf16 graph (floats specialised from the first
trace; autocast regions cacheable by AOTAutograd; FP8 graphs come from inductor's FX graph cache only), and
:func:`save_compile_artifacts` / :func:`load_compile_artifacts` carry the compiled artifacts beside a checkpoint
(``torch.compiler.save_cache_artifacts``), so a resumed run, or each rank of a multi-GPU run, loads them instead of
compiling (``SpiderTrainer`` does both).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

#: ``torch.compile`` options every Spider layer is compiled with (see the module docstring): traced whole, static
#: shapes but for the segment axis :func:`mark_segment_axis` marks
COMPILE_OPTIONS = {"fullgraph": True, "dynamic": False}

#: graph functions AOTAutograd's cache may hold (torch's ``unsafe_marked_cacheable_functions``): autocast's enter and
#: exit, keyed by the torch version. Sound because their arguments (device type, dtype, enabled) are part of the graph
#: the cache key hashes.
CACHEABLE_FUNCTIONS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")

#: file that :func:`save_compile_artifacts` writes into a checkpoint folder
COMPILE_ARTIFACTS_NAME = "compile_artifacts.bin"


def configure_dynamo() -> None:
    """Set, for this process: dynamo's duck sizing off (``torch.fx.experimental._config.use_duck_shape``), so a
    dynamic dim keeps its own symbol when it happens to equal another's size; float arguments specialised from the
    first trace (``torch._dynamo.config.specialize_float``; Spider's are config constants, and a float traced as a
    symbol then specialised made dynamo trace the frame twice); and AOTAutograd's cache allowed to hold autocast
    regions (:data:`CACHEABLE_FUNCTIONS`; RMSNorm and the router turn autocast off), so a warm cache serves every bf16
    layer graph. FP8 layer graphs bypass AOTAutograd's cache (torchao's ``allow_in_graph`` autograd functions enter
    the graph as a local closure that the cache cannot pickle); inductor's FX graph cache serves them."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    dynamo_config.specialize_float = True
    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # not in older torch releases
        inductor_config.unsafe_marked_cacheable_functions = {
            **inductor_config.unsafe_marked_cacheable_functions,
            **dict.fromkeys(CACHEABLE_FUNCTIONS, torch.__version__),
        }


def mark_segment_axis(
    hidden_states, position_embeddings, attention_mask, segment_index, engram_memory=None, row_weights=None, cache=None
) -> None:
    """Mark the segment axis of a ``SpiderRecurrentLayer`` call's inputs dynamic, every other dim staying static:
    `hidden_states` `(B, S, D)`, the RoPE `(cos, sin)` `(B, S, r)` and `engram_memory` `(B, S, M)` dim 1, a tensor
    `attention_mask` `(B, 1, S, S)` dims 2 and 3, `segment_index` `(N,)` and the MoE's `row_weights` `(B*S,)` /
    `(B*S*k,)` dim 0. Takes the layer's own arguments.

    ``torch._dynamo.maybe_mark_dynamic``, not ``mark_dynamic`` with bounds: a backend may add a size guard of its own
    (CPU inductor's reduction helper guards ``B*S*k <= 4096``), which a hard mark turns into a
    ``ConstraintViolationError``; with this one, a segment axis past such a limit compiles a second graph instead."""
    marks = [(t, 1) for t in (hidden_states, *position_embeddings, engram_memory)]
    marks += [(t, 0) for t in (segment_index, *(row_weights or ()))]
    if isinstance(attention_mask, torch.Tensor):
        marks.append((attention_mask, [2, 3]))
    for tensor, dims in marks:
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, dims)


def _byte_layer(layer, *args, **kwargs):
    """A ``SpiderDecoderLayer``'s forward (its class's, activation checkpointing included): the compiled frame of
    the byte layers' kind. Each kind has a function of its own, so each kind's graphs are one code object's cache
    entries (dynamo's recompile limit counts per code object) and no kind's guards fail on another's layers."""
    return type(layer).forward(layer, *args, **kwargs)


def _recurrent_layer(layer, *args, **kwargs):
    """A ``SpiderRecurrentLayer``'s forward without Engram: the compiled frame of that kind."""
    return type(layer).forward(layer, *args, **kwargs)


def _engram_layer(layer, *args, **kwargs):
    """A ``SpiderRecurrentLayer``'s forward with Engram: the compiled frame of that kind."""
    return type(layer).forward(layer, *args, **kwargs)


#: the compiled function of each layer kind, by name (what a pickled model names)
_KINDS = {"byte": _byte_layer, "recurrent": _recurrent_layer, "engram": _engram_layer}


class _CompiledKind:
    """One layer kind's ``torch.compile``\\d function, made at its first call; a compiled model pickles it as its
    kind and options, so a copy (``torch.save(model)``, ``copy.deepcopy``) is compiled the same way. Dynamo keeps
    its graphs per function, so copies share them."""

    def __init__(self, kind: str, backend: str, mode: str | None, options: dict):
        self.kind, self.backend, self.mode, self.options = kind, backend, mode, options
        self._compiled = None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = torch.compile(_KINDS[self.kind], backend=self.backend, mode=self.mode, **self.options)
        return self._compiled(*args, **kwargs)

    def __reduce__(self):
        return type(self), (self.kind, self.backend, self.mode, self.options)


def _training_call(compiled, mark, layer, *args, **kwargs):
    """`layer`'s forward: `compiled` for a training call (gradients on, no cache), after `mark` marks its dynamic
    dims (None: none); the eager forward otherwise (evaluation, generation)."""
    if not torch.is_grad_enabled() or kwargs.get("cache") is not None:
        return type(layer).forward(layer, *args, **kwargs)
    if mark is not None:
        mark(*args, **kwargs)
    return compiled(layer, *args, **kwargs)


def compile_model(
    model: torch.nn.Module, backend: str = "inductor", mode: str | None = None, **options
) -> torch.nn.Module:
    """Compile `model`'s layers in place, as ``--compile`` does (module docstring): :func:`configure_dynamo`, then
    each prelude, coda and recurrent layer's ``forward`` replaced by a call of its kind's ``torch.compile``\\d
    function (:data:`COMPILE_OPTIONS` updated by `options`, `backend`, `mode`), the recurrent layers' segment axis
    marked dynamic. Module names, parameters and ``state_dict`` keys are unchanged (``del layer.forward`` undoes it),
    and the model still pickles and deep-copies, compiled.

    Args:
        model: a ``SpiderForConditionalGeneration`` or ``SpiderModel`` (anything with ``prelude_layers``,
            ``coda_layers`` and ``recurrent_block.layers``, or a ``.model`` that has them).
    Returns:
        `model` itself.
    Raises:
        TypeError: `model` has no Spider layers to compile.
    """
    base = getattr(model, "model", model)
    if not all(hasattr(base, name) for name in ("prelude_layers", "coda_layers", "recurrent_block")):
        raise TypeError(
            f"compile_model compiles a Spider model's layers; {type(model).__name__} has no "
            "prelude_layers, coda_layers and recurrent_block"
        )
    configure_dynamo()
    options = {**COMPILE_OPTIONS, **options}
    byte_kind, recurrent_kind, engram_kind = (_CompiledKind(kind, backend, mode, options) for kind in _KINDS)
    # dynamic=True: every dim symbolic; None: torch's automatic dynamic shapes (the benchmarks' alternatives)
    mark = mark_segment_axis if options.get("dynamic") is False else None
    for layer in (*base.prelude_layers, *base.coda_layers):
        layer.forward = functools.partial(_training_call, byte_kind, None, layer)
    for layer in base.recurrent_block.layers:
        kind = recurrent_kind if getattr(layer, "engram", None) is None else engram_kind
        layer.forward = functools.partial(_training_call, kind, mark, layer)
    return model


def save_compile_artifacts(folder: str | os.PathLike) -> str | None:
    """Write what this process compiled (``torch.compiler.save_cache_artifacts``: inductor's and AOTAutograd's
    cache entries, portable across machines with the same torch and GPU) to ``folder/compile_artifacts.bin``.
    Returns the file's path, or None when nothing was compiled or torch could not serialise it (logged: the
    checkpoint is written without it, and a resume compiles). Raises ``OSError`` when the file cannot be written."""
    try:
        artifacts = torch.compiler.save_cache_artifacts()
    except Exception as error:  # noqa: BLE001 - an optional warm start must never fail a checkpoint
        logger.warning("compiled artifacts not saved (%s: %s); a resume compiles afresh", type(error).__name__, error)
        return None
    if artifacts is None or not artifacts[0]:
        return None
    path = os.path.join(folder, COMPILE_ARTIFACTS_NAME)
    with open(path, "wb") as f:
        f.write(artifacts[0])
    return path


def load_compile_artifacts(folder: str | os.PathLike) -> bool:
    """Load ``folder/compile_artifacts.bin`` (written by :func:`save_compile_artifacts`) into this process's
    compile caches, so the layers' first compile reads them instead of generating code. Returns whether a file was
    loaded; a file that does not load (another torch version) is logged and skipped: compiling starts cold."""
    path = os.path.join(folder, COMPILE_ARTIFACTS_NAME)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        data = f.read()
    try:
        loaded = torch.compiler.load_cache_artifacts(data)  # None: torch could not read the file
        why = "not a torch compile cache, or another torch version's"
    except Exception as error:  # noqa: BLE001 - a stale cache must never stop a resume
        loaded, why = None, f"{type(error).__name__}: {error}"
    if loaded is None:
        logger.warning("%s was not loaded (%s); compiling from scratch", path, why)
        return False
    return True


#: Optimizer steps after which ``--compile`` pays for its compilation on a GPU, per preset: compile time over the
#: time a compiled step saves, the largest of the measurements rounded up. Measured on two H200s
#: (bench/gpu_check_h200.json, 2026-11-27, bf16, fused AdamW, accelerate's per-module regions with dynamic shapes,
#: before the per-kind compile above) at 8 x 2048 bytes: 782eb15's first two steps took 119 s, then 0.398 s a step
#: against 0.602 s eager (119 / 0.204 = 583 steps); 6d5a9ca's took 145 s, then 0.270 s against 0.499 s eager
#: (145 / 0.229 = 633 steps). At 32 x 256 at repeated segment axes (782eb15) it pays after about 1,100. The small
#: preset's whole 500-step main job trains in 38 s eager, less than compiling takes: no entry, so it never compiles
#: by default. The per-kind compile's GPU compile time is not measured yet (issue 63): the rule stays until it is.
COMPILE_PAYS_AFTER_STEPS: dict[str, int] = {"1b": 640}


def compile_by_default(preset: str | None, max_steps: int, cuda: bool, fp8: bool = False) -> tuple[bool, str]:
    """Whether ``--compile`` is on when neither ``--compile`` nor ``--no_compile`` is given, and why: on a CUDA
    device, always for an FP8 run (`fp8`: torchao's float8 gains are stated under ``torch.compile``, and eager FP8
    measured up to 14x slower than bf16 on an H200), else for a preset whose run of `max_steps` optimizer steps is
    longer than :data:`COMPILE_PAYS_AFTER_STEPS` says compiling takes to pay; eager otherwise (on CPU compiling costs
    a minute and FP8 is only emulated, a correctness path)."""
    pays_after = COMPILE_PAYS_AFTER_STEPS.get(preset or "")
    if not cuda:
        return False, "eager: no CUDA device (compiling does not pay on CPU)"
    if fp8:
        return True, "compiled: FP8 runs compiled (eager FP8 measured up to 14x slower than bf16 on an H200)"
    if pays_after is None:
        return False, f"eager: compiling the {preset!r} preset was not measured to pay on a GPU"
    if max_steps < pays_after:
        return False, f"eager: {max_steps} steps is shorter than the {pays_after} the {preset!r} compile pays after"
    return True, f"compiled: {max_steps} steps, the {preset!r} compile pays after {pays_after}"
