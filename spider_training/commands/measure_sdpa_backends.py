"""Which of torch's SDPA kernels ``--sdpa_backend`` should pick on the GPU at hand: ``spider-measure-sdpa-backends``
(or ``python -m spider_training.commands.measure_sdpa_backends``) ``[--preset 1b] [--batch 32] [--segment_counts 80 96
112] [--visits 5] [--out sdpa_backends.json]``.

Times SDPA forward+backward per kernel at a preset's recurrent-layer attention (the ``1b`` preset's heads and head
dims: query/key 96, value 64; causal without a mask, ``is_causal``, as the training forward's recurrent layers call
it) over the padded segment counts a batch meets (``1 + S``), each visited ``--visits`` times in a seeded shuffled
order after one warm-up call at another count, for ``default`` (torch's own choice, run first as training runs it)
and each of ``cudnn``, ``flash`` (the value zero-padded to the query/key head dim), ``efficient`` and ``math`` alone
(``torch.nn.attention.sdpa_kernel``): per kernel the first call at each new count (where cuDNN builds its execution
plan) and the steady-state median. It prints the JSON of :func:`sdpa_backend_timings` and the ``--sdpa_backend``
value of the fastest kernel over the whole sequence (:mod:`spider_training.sdpa` is the knob). On CPU the times test
the command (math and flash on CPU run, the rest are skipped). ``python -m bench.gpu_check``'s ``attention_backends``
part runs the same measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from spider_training.checkpointing import write_json
from spider_training.throughput import synchronize

__all__ = ["SDPA_BACKENDS", "SDPA_SEGMENT_COUNTS", "sdpa_backend_timings", "main"]


#: what is timed: torch's choice first (as training runs today, its planning not yet cached by another row), then each
#: kernel alone
SDPA_BACKENDS = ("default", "cudnn", "flash", "efficient", "math")
#: ``--sdpa_backend`` value of each timed kernel (``default``: torch's own choice, ``auto``)
KNOB_NAMES = {"default": "auto"}
#: padded segment counts (``1 + S``, multiples of ``pad_segments_to_multiple_of`` = 16) that a 32 x 256-byte batch
#: meets at about one segment per 3 bytes: the largest row's count rounded up
SDPA_SEGMENT_COUNTS = (80, 96, 112)
#: a shape outside the sequence that each kernel runs first, so that loading a kernel is not counted as planning
SDPA_WARMUP_SEGMENTS = 32


def _unsupported(exc: BaseException) -> bool:
    """Whether `exc` is SDPA saying that no enabled kernel takes the call (not a failure of the kernel)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("No available kernel" in text or "No viable backend" in text)


class _AttentionInputs:
    """Query, key and value leaves of one recurrent-layer attention call at `segments` segments, laid out as
    ``SpiderAttention`` hands them over: query and key contiguous ``(B, H, S, d_qk)`` (concatenations), the value a
    strided slice of ``kv_b_proj``'s output ``(B, S, H, d_nope + d_v)`` transposed, and a fixed output gradient."""

    def __init__(self, batch, heads, segments, qk_nope, qk_rope, v_dim, device, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        qk = qk_nope + qk_rope

        def leaf(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(True)

        self.query, self.key = leaf(batch, heads, segments, qk), leaf(batch, heads, segments, qk)
        self.kv = leaf(batch, segments, heads, qk_nope + v_dim)
        self.qk_nope, self.qk, self.v_dim = qk_nope, qk, v_dim
        self.grad = torch.randn(batch, heads, segments, v_dim, generator=g).to(device=device, dtype=dtype)

    def call(self, pad_value: bool) -> None:
        """Forward and backward (gradients of the three leaves), launched, not synchronised."""
        value = self.kv.transpose(1, 2)[..., self.qk_nope :]
        if pad_value and self.v_dim < self.qk:
            value = F.pad(value, (0, self.qk - self.v_dim))
        out = F.scaled_dot_product_attention(self.query, self.key, value, is_causal=True, scale=self.qk**-0.5)
        torch.autograd.grad(out[..., : self.v_dim], (self.query, self.key, self.kv), self.grad)


def _kernels_of(fn) -> list[str]:
    """The SDPA kernels (``spider_training.sdpa.KERNEL_OPS`` names) `fn()` ran, by the profiler's op names."""
    from torch.profiler import profile

    from spider_training.sdpa import KERNEL_OPS

    with profile() as prof:
        fn()
    return sorted({KERNEL_OPS[e.name] for e in prof.events() if e.name in KERNEL_OPS})


def sdpa_backend_timings(
    preset: str = "1b",
    batch: int = 32,
    segment_counts=SDPA_SEGMENT_COUNTS,
    visits: int = 5,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    backends=SDPA_BACKENDS,
    stop_at: float | None = None,
    **config_overrides,
) -> dict:
    """Time SDPA forward+backward per kernel at `preset`'s recurrent-layer attention (this module's docstring).

    Every backend runs the same shuffled sequence: each count in `segment_counts` `visits` times (seeded), after one
    call at :data:`SDPA_WARMUP_SEGMENTS` (or another count outside the sequence). Per call, ``torch.cuda.synchronize``
    before and after: the call's time, and the host's (``time.perf_counter`` until the forward and backward have been
    launched). ``cudnn``, ``efficient``, ``math``: that kernel alone (``sdpa_kernel``); ``flash`` also, with the value
    zero-padded to the query/key head
    dim (torch's flash needs equal head dims); ``default``: no restriction, the kernel torch picked read from the
    profiler at each count afterwards. A kernel that does not take the call is ``skipped`` with torch's reason.
    `stop_at` (``time.monotonic``): backends not started by then are skipped (``"time budget"``). `config_overrides`
    change `preset`'s config (head counts and dims). Defaults: CUDA if available, bf16 there, fp32 on CPU.

    Returns a dict with ``backends`` (per kernel: first-call and steady-state seconds, the sequence's total, and
    ``first_calls_after`` where an earlier row ran the same kernel, whose cached plans it reused), ``fastest_steady``
    and ``fastest_sequence_total`` (among the rows without ``first_calls_after``: a warm row's total omits the
    per-shape planning that training pays at each new segment count)."""
    from torch.nn.attention import sdpa_kernel

    from spider_training.sdpa import SDPA_BACKENDS as KNOB_BACKENDS

    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    from configuration_spider import SpiderConfig

    config = SpiderConfig.from_preset(preset, **config_overrides)
    shape = dict(
        batch=batch,
        heads=config.num_attention_heads,
        qk_nope=config.qk_nope_head_dim,
        qk_rope=config.qk_rope_head_dim,
        v_dim=config.v_head_dim,
    )
    qk = shape["qk_nope"] + shape["qk_rope"]
    warmup = SDPA_WARMUP_SEGMENTS if SDPA_WARMUP_SEGMENTS not in segment_counts else max(segment_counts) + 16
    sequence = [count for count in segment_counts for _ in range(visits)]
    random.Random(seed).shuffle(sequence)
    inputs = {
        count: _AttentionInputs(segments=count, device=device, dtype=dtype, seed=seed + count, **shape)
        for count in {*segment_counts, warmup}
    }
    results = {}
    for name in backends:
        if stop_at is not None and time.monotonic() >= stop_at:
            results[name] = {"status": "skipped", "reason": "time budget"}
            continue
        pad = name == "flash"
        restrict = contextlib.nullcontext() if name == "default" else sdpa_kernel(KNOB_BACKENDS[name])
        entry = {"status": "ran", "value_padded_to": qk if pad and shape["v_dim"] < qk else None}
        try:
            with restrict:
                inputs[warmup].call(pad)
                synchronize(device)
                calls = []
                for count in sequence:
                    synchronize(device)
                    start = time.perf_counter()
                    inputs[count].call(pad)
                    launched = time.perf_counter()
                    synchronize(device)
                    calls.append((count, time.perf_counter() - start, launched - start))
                kernels = {
                    str(count): _kernels_of(lambda c=count: (inputs[c].call(pad), synchronize(device)))
                    for count in segment_counts
                }
        except Exception as exc:  # noqa: BLE001 - one kernel's failure leaves the others measured
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            results[name] = {"status": "skipped" if _unsupported(exc) else "failed", "reason": reason}
            continue
        seen, first, steady = set(), {}, {}
        for count, seconds, host in calls:
            if count not in seen:
                seen.add(count)
                first[str(count)] = (seconds, host)
            else:
                steady.setdefault(str(count), []).append((seconds, host))
        steady_all = [t for ts in steady.values() for t in ts]
        entry.update(
            kernels_by_segments=kernels,
            kernel=sorted({k for ks in kernels.values() for k in ks}),
            first_call_s={k: round(v[0], 6) for k, v in first.items()},
            first_call_s_mean=round(statistics.mean(v[0] for v in first.values()), 6),
            first_call_host_s_mean=round(statistics.mean(v[1] for v in first.values()), 6),
            steady_median_s=round(statistics.median(t[0] for t in steady_all), 6) if steady_all else None,
            steady_median_host_s=round(statistics.median(t[1] for t in steady_all), 6) if steady_all else None,
            steady_median_s_by_segments={k: round(statistics.median(t[0] for t in v), 6) for k, v in steady.items()},
            sequence_total_s=round(sum(seconds for _, seconds, _ in calls), 6),
            calls=len(calls),
        )
        results[name] = entry
    names = list(results)
    for i, (name, entry) in enumerate(results.items()):  # plans are cached per process: a later row's first calls
        earlier = [
            other
            for other in names[:i]  # reuse those of an earlier row with the same kernel
            if set(results[other].get("kernel", ())) & set(entry.get("kernel", ()))
        ]
        if entry["status"] == "ran" and earlier:
            entry["first_calls_after"] = f"{', '.join(earlier)} ran the same kernel at these shapes first"
    ran = {name: r for name, r in results.items() if r["status"] == "ran" and r["steady_median_s"] is not None}
    cold = {name: r for name, r in ran.items() if "first_calls_after" not in r}  # their totals include the planning
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "preset": preset,
        "shape": {"batch": batch, "heads": shape["heads"], "qk_head_dim": qk, "v_head_dim": shape["v_dim"]},
        "mask": "none, is_causal=True (the training forward's recurrent layers: padding sits at each row's end)",
        "segment_counts": list(segment_counts),
        "visits": visits,
        "sequence": sequence,
        "warmup_segments": warmup,
        "timing": "forward+backward per call (on CUDA torch.cuda.synchronize before and after); host: until launched",
        "backends": results,
        "fastest_steady": min(ran, key=lambda n: ran[n]["steady_median_s"]) if ran else None,
        "fastest_sequence_total": min(cold, key=lambda n: cold[n]["sequence_total_s"]) if cold else None,
    }


def main(argv=None) -> int:
    """The command: time the kernels, print the JSON (stdout; also ``--out``) and the ``--sdpa_backend`` to train
    with (stderr); returns the exit code 0. Bad flags: argparse's error (exit code 2)."""
    parser = argparse.ArgumentParser(
        prog="spider-measure-sdpa-backends",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="1b", help="preset whose recurrent-layer heads and head dims are timed")
    parser.add_argument("--batch", type=int, default=None, help="batch (default 32 on CUDA, 4 on CPU)")
    parser.add_argument(
        "--segment_counts",
        nargs="+",
        type=int,
        default=list(SDPA_SEGMENT_COUNTS),
        help="padded segment counts of the sequence (default 80 96 112: 32 x 256 bytes at a segment per 3 bytes)",
    )
    parser.add_argument("--visits", type=int, default=5, help="visits of each segment count")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.visits < 1 or (args.batch is not None and args.batch < 1) or min(args.segment_counts) < 1:
        parser.error("--batch, --visits and --segment_counts must be >= 1")
    batch = args.batch or (32 if torch.cuda.is_available() else 4)
    timings = sdpa_backend_timings(args.preset, batch, tuple(args.segment_counts), args.visits)
    text = json.dumps(timings, indent=1)
    if args.out:
        write_json(args.out, timings)
    print(text)
    fastest = timings["fastest_sequence_total"]
    if fastest is not None:
        print(
            f"fastest over the sequence: {fastest}: train with --sdpa_backend {KNOB_NAMES.get(fastest, fastest)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
