"""The main job's console: library noise silenced where it starts, and a start-up summary of the run.

What the main job prints (process 0): the summary from :func:`describe_run` (model, parameters, data, precision, MoE
kernels, devices, output folder, evaluation schedule), Trainer's progress bar with the training metrics, held-out
bits per byte at each evaluation, the sample, and where the release was written. Warnings and errors -- from the
libraries or about the user's own input -- still print.

Silenced, each at its source:

* torchao logs a WARNING for every CUDA-only extension (``_C_mxfp8``, ``_C_cutlass_90a``) it cannot load on a machine
  without them, and registers two enums with torch's pytree, which torch 2.13 answers with a deprecation WARNING
  (``torch.utils._pytree``). Both happen once, at the first import of the modules concerned:
  :func:`import_libraries_quietly` imports them with those two loggers raised to ERROR, for those imports only.
* bitsandbytes (imported by peft, hence by transformers and accelerate when peft is installed) logs a WARNING at
  import on a CPU with AVX512-BF16 when the optional ``kernels`` package is missing ("Failed to load CPU
  gemm_4bit_forward from kernels-community"): imported the same way.
* transformers' INFO messages (the ``GenerationConfig`` dump, "Configuration saved in ...") and its shard-writing
  progress bars: :func:`configure_logging` sets transformers to WARNING.
* accelerate's "The following values were not passed to ``accelerate launch``" block: the repository ships the
  values (``configs/accelerate/single_process.yaml``, used by the README's command).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys

#: torchao modules that transformers and our FP8 conversion import later and that register an enum at import
#: (``ScaleCalculationMode``): imported once here, quietly
TORCHAO_MODULES_IMPORTED_LATER = ("torchao.float8", "torchao.prototype.mx_formats.config")
#: loggers that report on a library's own installation at its import, not on the run
IMPORT_TIME_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


@contextlib.contextmanager
def quiet_loggers(names=IMPORT_TIME_LOGGERS, level: int = logging.ERROR):
    """Raise the loggers `names` to `level` inside the block; their previous levels come back after it."""
    loggers = [logging.getLogger(name) for name in names]
    previous = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, previous):
            lg.setLevel(old)


def import_libraries_quietly() -> None:
    """Import torchao and bitsandbytes (those installed) with their import-time warnings silenced (see the module
    docstring). Call before anything imports them (transformers does, through its quantizers and peft, when
    ``modeling_spider`` is imported)."""
    if "bitsandbytes" not in sys.modules and importlib.util.find_spec("bitsandbytes") is not None:
        with quiet_loggers():
            try:
                import bitsandbytes  # noqa: F401  (reports its optional CPU kernels at import)
            except Exception:  # a broken install says so later, where it is used
                pass
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    with quiet_loggers():
        import torchao  # noqa: F401  (CUDA extensions; registers KernelPreference)

        for module in TORCHAO_MODULES_IMPORTED_LATER:
            try:
                importlib.import_module(module)
            except ImportError:  # another torchao version: nothing of its own to silence there
                pass


def configure_logging(process_index: int = 0) -> None:
    """Our loggers at INFO on process 0 (WARNING elsewhere), one line each; transformers at WARNING, its progress bars
    for shard writing and Hub transfers off (Trainer's own progress bar is separate and stays)."""
    import transformers

    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        stream=sys.stdout,
        level=logging.INFO if process_index == 0 else logging.WARNING,
    )
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()


def describe_run(
    *,
    preset: str,
    parameters: int,
    data: str,
    train_windows: int | None,
    window_bytes: int,
    eval_data: str | None,
    precision: str,
    moe_backend: str,
    devices: str,
    output_dir: str,
    max_steps: int,
    batch_windows: int,
    eval_steps: int | None,
    optimizer: str | None = None,
) -> str:
    """The start-up summary: one ``key: value`` line per fact, under a title line. `parameters` is a count,
    `window_bytes` the bytes per window, `batch_windows` windows per optimizer step (all processes)."""
    seen = max_steps * batch_windows
    data_line = f"{data}"
    if train_windows:
        data_line += (
            f", {train_windows:,} windows of {window_bytes} bytes; {max_steps} steps x {batch_windows} "
            f"windows see {seen:,} windows ({min(1.0, seen / train_windows):.1%} of them)"
        )
    lines = [
        f"Spider {preset}: {parameters / 1e6:.2f}M parameters",
        f"  data:       {data_line}",
        f"  held-out:   {eval_data or 'none'}"
        + (f", scored every {eval_steps} steps and after training" if eval_data and eval_steps else ""),
        f"  precision:  {precision}",
        f"  MoE:        {moe_backend}",
        *([f"  optimizer:  {optimizer}"] if optimizer else []),
        f"  devices:    {devices}",
        f"  output:     {output_dir}",
    ]
    return "\n".join(lines)
