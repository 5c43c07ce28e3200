"""``--compile``: Spider's regional compilation and the dynamo settings it needs.

accelerate's ``compile_regions`` compiles every prelude, recurrent and coda layer and every other submodule as a
region of its own; the loops and the data-dependent segment count stay in eager Python between them. The recurrent
block's regions see a new segment count at almost every step (the segment axis is padded to a multiple of
``pad_segments_to_multiple_of``: a few dozen counts over a run), and dynamo compiles a function at most 8 times before
it runs it eagerly. So the regions compile with dynamic shapes from their first call (``dynamic=True``), and without
dynamo's duck sizing, which gives dims of equal size one symbol: a segment count equal to a head dim (16, 32, 64)
would be specialised with it and recompile at the next count. One graph per region then serves every count, with no
hint in the model file (tests/test_compile.py). :func:`configure_dynamo` sets the process-wide part (it stays set);
``SpiderTrainer`` applies both to accelerate's dynamo plugin; the benchmarks call :func:`compile_model`.

Compile time, and inductor's caches across runs (``TORCHINDUCTOR_CACHE_DIR``, by default under the system's temporary
folder): two dynamo defaults made every run trace most regions twice and pay AOTAutograd's tracing again however warm
the cache. A Python float argument (nn.Embedding's ``norm_type``, ACT's threshold) is first traced as a symbol and,
when inductor specialises it, the whole frame is traced again ("Restarting analysis due to _tensorify_python_scalars");
floats are specialised from the start instead (``specialize_float``; Spider's are constants of the config). And a
graph holding an autocast region (RMSNorm and the router turn autocast off) bypassed AOTAutograd's cache ("Unsupported
call_function target _enter_autocast"): autocast's enter and exit are marked cacheable, which is sound because their
arguments (device type, dtype, enabled) are part of the graph the cache key hashes. On this 2-core CPU (tiny preset,
bf16 autocast, inductor) the first training step took 90 s with a warm cache before and 20 s after, with the same
losses and weights (docs/research_log.md).
"""

from __future__ import annotations

import torch

#: ``torch.compile`` options every Spider region is compiled with (see the module docstring).
COMPILE_OPTIONS = {"dynamic": True}


#: graph functions AOTAutograd's cache may hold (torch's ``unsafe_marked_cacheable_functions``; see the module
#: docstring): autocast's enter and exit, keyed by the torch version
CACHEABLE_FUNCTIONS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def configure_dynamo() -> None:
    """Set, for this process: dynamo's duck sizing off (``torch.fx.experimental._config.use_duck_shape``), so a
    dynamic segment axis keeps its own symbol whatever its size; float arguments specialised from the first trace
    (``torch._dynamo.config.specialize_float``), so no frame is traced twice; and autocast's enter/exit cacheable by
    AOTAutograd (:data:`CACHEABLE_FUNCTIONS`), so a warm cache serves the layers. See the module docstring."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    dynamo_config.specialize_float = True
    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # not in older torch releases
        inductor_config.unsafe_marked_cacheable_functions = {
            **inductor_config.unsafe_marked_cacheable_functions, **dict.fromkeys(CACHEABLE_FUNCTIONS, torch.__version__)}


def compile_model(model: torch.nn.Module, backend: str = "inductor", mode: str | None = None,
                  **options) -> torch.nn.Module:
    """`model` compiled as ``--compile`` compiles it: :func:`configure_dynamo`, then accelerate's ``compile_regions``
    with :data:`COMPILE_OPTIONS`, updated by `options` (``dynamic=None``: torch's automatic dynamic shapes, static
    first and dynamic only in the dims seen to change, the benchmarks' alternative). Returns the new module (the
    regions wrapped; parameters shared with `model`)."""
    from accelerate.utils import compile_regions

    configure_dynamo()
    return compile_regions(model, backend=backend, mode=mode, **{**COMPILE_OPTIONS, **options})


#: Optimizer steps after which ``--compile`` pays for its compilation on a GPU, per preset: compile time over the
#: time a compiled step saves, the largest of the measurements rounded up. Measured on two H200s
#: (bench/gpu_check_h200.json, 2026-11-27, bf16, fused AdamW, dynamic-shape regions) at 8 x 2048 bytes: 782eb15's
#: first two steps took 119 s, then 0.398 s a step against 0.602 s eager (119 / 0.204 = 583 steps); 6d5a9ca's took
#: 145 s, then 0.270 s against 0.499 s eager (145 / 0.229 = 633 steps). At 32 x 256 at repeated segment axes (782eb15)
#: it pays after about 1,100. The small preset's whole 500-step main job trains in 38 s eager, less than compiling
#: takes: no entry, so it never compiles by default.
COMPILE_PAYS_AFTER_STEPS: dict[str, int] = {"1b": 640}


def compile_by_default(preset: str | None, max_steps: int, cuda: bool) -> tuple[bool, str]:
    """Whether ``--compile`` is on when neither ``--compile`` nor ``--no_compile`` is given, and why: on a CUDA
    device, for a preset whose run of `max_steps` optimizer steps is longer than :data:`COMPILE_PAYS_AFTER_STEPS`
    says compiling takes to pay; eager otherwise (on CPU compiling a region costs minutes and saved no step time)."""
    pays_after = COMPILE_PAYS_AFTER_STEPS.get(preset or "")
    if not cuda:
        return False, "eager: no CUDA device (compiling does not pay on CPU)"
    if pays_after is None:
        return False, f"eager: compiling the {preset!r} preset was not measured to pay on a GPU"
    if max_steps < pays_after:
        return False, f"eager: {max_steps} steps is shorter than the {pays_after} the {preset!r} compile pays after"
    return True, f"compiled: {max_steps} steps, the {preset!r} compile pays after {pays_after}"
