"""The FP8 GEMM table: each GEMM shape Spider's presets produce, timed compiled forward+backward in bf16 and in FP8.

    python -m bench.gpu_check --only fp8_gemm --out gpu_check.json   # then copy its "fp8_gemm_table" into
                                                                    # spider_training/fp8_gemm_table.json

For every ``(kind, M, K, N)`` that ``spider_training.fp8.gemm_shapes`` gives for `presets` at `batches` (the step
table's shapes and tk-train.py's recipe by default), skipping the layers that never convert (tk-train.py's skip
words), one layer is timed as training runs it: fp32 master weights under bf16 autocast on CUDA, ``torch.compile``d,
forward plus backward (input and weight gradients), median of `repeats` after a warm-up. ``linear``: ``nn.Linear``
against torchao ``Float8Linear`` per recipe (tensorwise, rowwise); ``grouped``: ``torch._grouped_mm`` over the
preset's routed experts (rows split evenly, each group a multiple of 16) against torchao's FP8 rowwise grouped GEMM,
where the GPU has it. ``--fp8_layers auto`` converts a layer when its row measured FP8 faster
(``spider_training.fp8.measured_speedup``). On CPU the FP8 matmuls are emulated: the times test the runner, they are
not FP8's (the entry says so).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from bench.common import spider_model, synchronize
from bench.parts import TIME_BUDGET, Deadline, default_device, entry
from spider_training import fp8

#: (batch, bytes) per micro-batch: the step table's shapes and tk-train.py's recipe
DEFAULT_BATCHES = ((8, 2048), (32, 256), (112, 256))
LINEAR_RECIPES = ("tensorwise", "rowwise")


def table_shapes(presets, batches) -> list[tuple]:
    """The distinct ``(kind, M, K, N, groups)`` of `presets` at `batches`, largest M*K*N first (the layers that never
    convert left out: their names hold one of tk-train.py's skip words)."""
    shapes = set()
    for preset in presets:
        with torch.device("meta"):
            model = spider_model(preset)
        for batch, length in batches:
            for fqn, (kind, m, k, n) in fp8.gemm_shapes(model, batch, length).items():
                if not any(word in fqn for word in fp8.TK_TRAIN_FP8_SKIP):
                    shapes.add((kind, m, k, n, model.config.n_routed_experts if kind == "grouped" else 1))
    return sorted(shapes, key=lambda s: (-s[1] * s[2] * s[3], s))


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call compiles and warms up


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
    """Median seconds of one forward+backward of the GEMM in `variant` (``"bf16"`` or an FP8 recipe), compiled with
    ``torch.compile``'s `backend` (None: eager).

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

    def step():
        nonlocal grad
        with autocast:
            out = run(*args)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)

    return _median_seconds(step, device, repeats)


def fp8_gemm_check(
    presets=("1b",),
    batches=DEFAULT_BATCHES,
    device: torch.device | None = None,
    repeats: int = 10,
    backend: str | None = "inductor",
    deadline: Deadline | None = None,
) -> dict:
    """The ``fp8_gemm`` entry: ``rows`` (one per shape: seconds per variant, FP8's speedup) and ``fp8_gemm_table``,
    the rows in the shape ``spider_training.fp8.load_gemm_table`` reads, keyed by this device's name."""
    device = device or default_device()
    shapes = table_shapes(presets, batches)
    rows, failures, skipped = [], {}, 0
    for kind, m, k, n, groups in shapes:
        if deadline is not None and deadline.expired(10):
            skipped += 1
            continue
        seconds = {}
        for variant in ("bf16", *(LINEAR_RECIPES if kind == "linear" else ("rowwise",))):
            try:
                seconds[variant] = time_gemm(kind, m, k, n, groups, variant, device, repeats, backend)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is recorded, not fatal
                failures[f"{kind} {variant}"] = f"{type(exc).__name__}: {exc}"[:300]
            torch._dynamo.reset()  # one small graph per shape: do not let the recompile limit stop the table
        rows.append(
            {
                "kind": kind,
                "m": m,
                "k": k,
                "n": n,
                "groups": groups,
                "seconds": seconds,
                "speedup": {v: seconds["bf16"] / s for v, s in seconds.items() if v != "bf16" and "bf16" in seconds},
            }
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (emulated)"
    capability = list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    table = {
        "gpus": {
            name: {
                "capability": capability,
                "measured": time.strftime("%Y-%m-%d"),
                "versions": f"torch {torch.__version__}",
                "gemms": [{key: value for key, value in row.items() if key != "speedup"} for row in rows],
            }
        }
    }
    reason = f"{TIME_BUDGET}: {skipped} of {len(shapes)} shapes not measured" if skipped else ""
    return entry(
        "fp8_gemm",
        "skipped" if skipped and not rows else "passed",
        reason,
        device=str(device),
        presets=list(presets),
        batches=[f"{b}x{length}" for b, length in batches],
        compile_backend=backend,
        rows=rows,
        not_run=failures,
        fp8_gemm_table=table,
        note="" if device.type == "cuda" else "CPU emulation: the FP8 times are not FP8's",
    )
