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


def compile_model(model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> torch.nn.Module:
    """`model` compiled as ``--compile`` compiles it: :func:`configure_dynamo`, then accelerate's ``compile_regions``
    with :data:`COMPILE_OPTIONS`. Returns the new module (the regions wrapped; parameters shared with `model`)."""
    from accelerate.utils import compile_regions

    configure_dynamo()
    return compile_regions(model, backend=backend, mode=mode, **COMPILE_OPTIONS)
