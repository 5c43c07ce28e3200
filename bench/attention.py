"""Benchmark 9 -- attention backends: the training step with each ``attn_implementation``.

What its entries and fields mean: bench/README.md, "Module notes", `attention.py`.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import (
    TrainStep,
    check,
    finish,
    info,
    main_for,
    random_bytes,
    spider_config,
    spider_model,
    synchronize,
    time_interleaved,
)

TARGET = 1.0

IMPLEMENTATIONS = ("sdpa", "eager")
FULL = dict(preset="small", batch=8, seq_len=256, warmup=2, repeats=5)
QUICK = dict(preset="tiny", batch=2, seq_len=32, warmup=1, repeats=2)


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. ``profile`` is accepted for the runner and
    unused. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    ids = random_bytes(s["batch"], s["seq_len"])
    steps, losses = {}, {}
    for implementation in IMPLEMENTATIONS:
        model = spider_model(s["preset"])  # same seed: the same weights for every backend
        model.set_attn_implementation(implementation)
        steps[implementation] = TrainStep(model, ids)
        with torch.no_grad():
            losses[implementation] = float(model(input_ids=ids, labels=ids).loss)
    timed = time_interleaved(steps, s["warmup"], s["repeats"])
    ms = {name: 1000 * t["median_s"] for name, t in timed.items()}
    result = {
        "benchmark": "attention",
        "description": "training step time per attention backend (attn_implementation)",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len")},
        "dtype": "fp32",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "losses": losses,
        "measurements": {
            "median_ms": {k: round(v, 2) for k, v in ms.items()},
            "times_s": {n: t["times_s"] for n, t in timed.items()},
        },
        "checks": [
            check(
                "attention: the default sdpa against eager",
                "step time ratio (eager / sdpa)",
                TARGET,
                ms["eager"] / ms["sdpa"],
            )
        ],
        "info": [info(f"attention {name}: training step", ms[name], "ms") for name in IMPLEMENTATIONS],
        "notes": [],
    }
    return finish(result, start)


# ---------------------------------------------------------------------------------------------------------------------
# SDPA kernels at the recurrent layers' shapes
# ---------------------------------------------------------------------------------------------------------------------

#: what is timed: torch's choice first (as training runs today, its planning not yet cached by another row), then each
#: kernel alone
SDPA_BACKENDS = ("default", "cudnn", "flash", "efficient", "math")
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
    """Time SDPA forward+backward per kernel at `preset`'s recurrent-layer attention (bench/README.md).

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
    config = spider_config(preset, **config_overrides)
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


if __name__ == "__main__":
    main_for(run)
