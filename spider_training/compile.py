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
"""

from __future__ import annotations

import torch

#: ``torch.compile`` options every Spider region is compiled with (see the module docstring).
COMPILE_OPTIONS = {"dynamic": True}


def configure_dynamo() -> None:
    """Turn dynamo's duck sizing off for this process (``torch.fx.experimental._config.use_duck_shape``, torch's
    switch for it), so a dynamic segment axis keeps its own symbol whatever its size (see the module docstring)."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False


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
