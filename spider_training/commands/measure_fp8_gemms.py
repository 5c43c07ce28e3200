"""Measure the FP8 GEMM table that ``--fp8_layers auto`` reads, on the GPU at hand: ``spider-measure-fp8-gemms``
(or ``python -m spider_training.commands.measure_fp8_gemms``) ``[--presets 1b] [--batches 8x2048 32x256]
[--out fp8_gemm_table.json]``, then train with ``--fp8_gemm_table fp8_gemm_table.json``.

For every ``(kind, M, K, N)`` that :func:`spider_training.fp8.gemm_shapes` gives for the presets at the micro-batches
(default: the 1b preset at the step table's shapes and tk-train.py's recipe), skipping the layers that never convert
(tk-train.py's skip words), one layer is timed as training runs it: fp32 master weights under bf16 autocast on CUDA,
``torch.compile``d, forward plus backward (input and weight gradients), median of ``--repeats`` after a warm-up.
``linear``: ``nn.Linear`` against torchao ``Float8Linear`` per recipe (tensorwise, rowwise); ``grouped``:
``torch._grouped_mm`` over the preset's routed experts (rows split evenly, each group a multiple of 16) against
torchao's FP8 rowwise grouped GEMM, where the GPU has it. ``--fp8_layers auto`` converts a layer when its row measured
FP8 faster (:func:`spider_training.fp8.measured_speedup`). The table is written to ``--out`` under this GPU's device
name; the other GPUs an existing ``--out`` holds are kept (``spider_training/fp8_gemm_table.json``, the default table,
is one such file). On CPU the FP8 matmuls are emulated: the times test the command, they are not FP8's.
``python -m bench.gpu_check --only fp8_gemm`` runs the same measurement as one of its parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from spider_training import fp8
from spider_training.checkpointing import write_json
from spider_training.shapes import DEFAULT_BATCHES, parse_batch
from spider_training.throughput import synchronize

__all__ = [
    "DEFAULT_BATCHES",
    "LINEAR_RECIPES",
    "gemm_table_shapes",
    "time_gemm",
    "measure_gemm_table",
    "parse_batch",
    "main",
]

LINEAR_RECIPES = ("tensorwise", "rowwise")


def gemm_table_shapes(presets, batches) -> list[tuple[str, int, int, int, int]]:
    """The distinct ``(kind, M, K, N, groups)`` of the `presets` (names of ``SpiderConfig.from_preset``) at `batches`
    (``(batch, bytes)`` pairs), largest M*K*N first; the layers that never convert (their names hold one of
    :data:`spider_training.fp8.TK_TRAIN_FP8_SKIP`) left out. Models are built on the meta device (no memory)."""
    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration

    shapes = set()
    for preset in presets:
        with torch.device("meta"):
            model = SpiderForConditionalGeneration(SpiderConfig.from_preset(preset))
        for batch, length in batches:
            for fqn, (kind, m, k, n) in fp8.gemm_shapes(model, batch, length).items():
                if not any(word in fqn for word in fp8.TK_TRAIN_FP8_SKIP):
                    shapes.add((kind, m, k, n, model.config.n_routed_experts if kind == "grouped" else 1))
    return sorted(shapes, key=lambda s: (-s[1] * s[2] * s[3], s))


class _GroupedGemm(nn.Module):
    """One routed-experts projection: ``weight`` `(groups, N, K)` applied with ``torch._grouped_mm`` to `(M, K)`."""

    def __init__(self, groups: int, k: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, n, k) * k**-0.5)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x.to(torch.bfloat16), self.weight.to(torch.bfloat16).transpose(-2, -1), offs=offsets)


def time_gemm(
    kind: str,
    m: int,
    k: int,
    n: int,
    groups: int,
    variant: str,
    device: torch.device,
    repeats: int,
    backend: str | None = "inductor",
) -> float:
    """Median seconds of one forward+backward of the GEMM `(M, K) @ (K, N)` (``kind`` ``"linear"``, or
    ``"grouped"`` over `groups` experts) in `variant` (``"bf16"`` or an FP8 recipe of :data:`LINEAR_RECIPES`),
    compiled with ``torch.compile``'s `backend` (None: eager), over `repeats` calls after one warm-up call.

    Raises:
        RuntimeError: torch or torchao cannot run the variant here (the caller records it as not measured).
    """
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if kind == "linear":
        layer = nn.Linear(k, n, bias=False, device=device)
        if variant != "bf16":
            config = fp8.build_float8_config(variant, emulate=device.type != "cuda")
            from torchao.float8 import convert_to_float8_training

            layer = convert_to_float8_training(nn.Sequential(layer), config=config)[0]
        x = torch.randn(m, k, device=device, requires_grad=True)
        args = (x,)
    else:
        layer = _GroupedGemm(groups, k, n).to(device)
        if variant != "bf16":
            reason = fp8.fp8_grouped_mm_unsupported_reason(device)
            if reason is not None:
                raise RuntimeError(reason)
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig
            from torchao.quantization import quantize_

            quantize_(layer, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: module is layer)
        rows = -(-m // groups // 16) * 16
        x = torch.randn(rows * groups, k, device=device, requires_grad=True)
        args = (x, torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows)
    run = layer if backend is None else torch.compile(layer, backend=backend)
    grad = None
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            out = run(*args)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call compiles and warms up


def measure_gemm_table(
    presets=("1b",),
    batches=DEFAULT_BATCHES,
    device: torch.device | None = None,
    repeats: int = 10,
    backend: str | None = "inductor",
    out_of_time: Callable[[], bool] | None = None,
) -> dict:
    """Time every shape of :func:`gemm_table_shapes` in bf16 and each FP8 recipe on `device` (default: CUDA when
    there is one, else CPU with FP8 emulated). `out_of_time()`, checked before each shape, skips the rest when true.

    Returns ``{"rows": [{"kind", "m", "k", "n", "groups", "seconds": {variant: s}, "speedup": {recipe: x}}],
    "not_run": {"<kind> <variant>": reason}, "shapes": int, "skipped": int, "table": {"gpus": {device name:
    {"capability", "measured", "versions", "gemms"}}}}``; ``table`` is what :func:`spider_training.fp8.load_gemm_table`
    reads. A variant that cannot run here is left out of its row's ``seconds`` and named in ``not_run``."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = gemm_table_shapes(presets, batches)
    rows, failures, skipped = [], {}, 0
    for kind, m, k, n, groups in shapes:
        if out_of_time is not None and out_of_time():
            skipped += 1
            continue
        seconds = {}
        for variant in ("bf16", *(LINEAR_RECIPES if kind == "linear" else ("rowwise",))):
            try:
                seconds[variant] = time_gemm(kind, m, k, n, groups, variant, device, repeats, backend)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is recorded, not fatal
                failures[f"{kind} {variant}"] = f"{type(exc).__name__}: {exc}"[:300]
            torch._dynamo.reset()  # one small graph per shape: do not let the recompile limit stop the table
        speedup = {v: seconds["bf16"] / s for v, s in seconds.items() if v != "bf16" and "bf16" in seconds}
        rows.append({"kind": kind, "m": m, "k": k, "n": n, "groups": groups, "seconds": seconds, "speedup": speedup})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (emulated)"
    gpu = {
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "measured": time.strftime("%Y-%m-%d"),
        "versions": f"torch {torch.__version__}",
        "gemms": [{key: value for key, value in row.items() if key != "speedup"} for row in rows],
    }
    return {
        "rows": rows,
        "not_run": failures,
        "shapes": len(shapes),
        "skipped": skipped,
        "table": {"gpus": {name: gpu}},
    }


def main(argv=None) -> int:
    """The command: measure, merge this GPU's entry into ``--out`` (atomically; its other GPUs kept), print a summary
    (JSON: ``rows``, ``not_run``, ``shapes``, ``out``) on stdout; returns the exit code 0. Raises SystemExit
    (argparse's error, exit code 2) naming ``--out`` when that file exists but is not a GEMM table."""
    from configuration_spider import SPIDER_PRESETS

    parser = argparse.ArgumentParser(
        prog="spider-measure-fp8-gemms",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--presets", nargs="+", default=["1b"], choices=sorted(SPIDER_PRESETS))
    parser.add_argument(
        "--batches",
        nargs="+",
        type=parse_batch,
        default=list(DEFAULT_BATCHES),
        help="micro-batches BATCHxBYTES whose GEMM shapes are timed (default: 8x2048 32x256 112x256)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per variant (median)")
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument(
        "--out", default="fp8_gemm_table.json", help="the table to write (pass it to --fp8_gemm_table)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    out = Path(args.out)
    table = {"gpus": {}}
    if out.exists():
        try:
            table = fp8.load_gemm_table(out)
        except ValueError as exc:
            parser.error(f"--out: {exc}")
    result = measure_gemm_table(args.presets, args.batches, repeats=args.repeats, backend=args.compile_backend)
    table["gpus"].update(result["table"]["gpus"])
    write_json(out, table)
    summary = {key: result[key] for key in ("rows", "not_run", "shapes")} | {"out": str(out)}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}: train with --fp8_layers auto --fp8_gemm_table {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
