"""Benchmark 1 -- MoE layer: ``SpiderMoE`` fast path vs the per-expert loop, forward + backward.

What its entries and fields mean: bench/README.md, "Module notes", `moe.py`.
"""

from __future__ import annotations

import time

import torch

from bench.common import (
    check,
    finish,
    info,
    main_for,
    profile_top,
    spider_config,
    time_interleaved,
)
from spider_training.throughput import count_flops, measured_matmul_flops

TARGET = 1.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAST = ("grouped_mm",)
FULL = dict(
    tokens=4096,
    hidden_size=512,
    n_routed_experts=32,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    warmup=2,
    repeats=5,
    matmul_n=2048,
)
# matmul_n: side of the square matmul that measures the peak FLOP/s (a 2048^3 bf16 matmul takes seconds on a CPU
# without native bf16, minutes over the repeats: the quick mode measures a smaller one)
QUICK = dict(
    tokens=256,
    hidden_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    warmup=1,
    repeats=2,
    matmul_n=512,
)
#: the keys of :data:`FULL` / :data:`QUICK` that size the layer (its config's)
SHAPE = ("hidden_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def build_layers(dtype: torch.dtype, seed: int = 0, **shape) -> dict:
    """``{implementation: SpiderMoE}`` for eager and :data:`FAST` with identical weights, in ``dtype``; `shape`: the
    :data:`SHAPE` sizes."""
    from modeling_spider import SpiderMoE

    layers = {}
    state = None
    for impl in ("eager",) + FAST:
        cfg = spider_config("tiny", **shape, n_shared_experts=0, experts_implementation=impl)
        torch.manual_seed(seed)
        layer = SpiderMoE(cfg)
        if state is None:
            for p in layer.parameters():  # std 0.02 as _init_weights; the router gets a spread of scores
                torch.nn.init.normal_(p, std=0.02)
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        layers[impl] = layer.to(dtype).train()
    return layers


def fwd_bwd(layer, x: torch.Tensor, grad: torch.Tensor):
    """One forward + backward of ``layer`` on ``x`` (leaf, requires grad) with incoming gradient ``grad``."""
    x.grad = None
    out = layer(x)[0]
    out.backward(grad)
    layer.zero_grad(set_to_none=True)
    return out


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK` keys. Returns the result dict
    (see :mod:`bench.common`); per dtype the median seconds of each implementation and the max abs output difference
    between the fast paths and eager."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    result = {
        "benchmark": "moe",
        "description": "SpiderMoE forward+backward: eager (per-expert loop) time / fast path time",
        "sizes": {k: s[k] for k in ("tokens", *SHAPE)} | {"n_shared_experts": 0},
        "dtype": "fp32 and bf16",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "checks": [],
        "measurements": {},
        "notes": [
            "same state_dict in every implementation; routing (fp32 router) is identical, so every "
            "implementation computes the same experts for the same tokens"
        ],
    }
    missed = []
    for dname, dtype in DTYPES.items():
        layers = build_layers(dtype, **{k: s[k] for k in SHAPE})
        g = torch.Generator().manual_seed(1)
        x = torch.randn(s["tokens"], s["hidden_size"], generator=g).to(dtype).requires_grad_(True)
        grad = torch.randn(s["tokens"], s["hidden_size"], generator=g).to(dtype)
        with torch.no_grad():
            ref = layers["eager"](x)[0].float()
            diffs = {impl: float((layers[impl](x)[0].float() - ref).abs().max()) for impl in FAST}
        timed = time_interleaved(
            {impl: (lambda l=layer: fwd_bwd(l, x, grad)) for impl, layer in layers.items()}, s["warmup"], s["repeats"]
        )
        eager = timed["eager"]["median_s"]
        # The ceiling: eager's matmul FLOPs at this machine's peak matmul rate. No implementation can do the same
        # matmuls faster, so eager_time / ceiling_time bounds any fast path's speedup on this CPU.
        flops = count_flops(lambda: fwd_bwd(layers["eager"], x, grad))["total"]
        peak = measured_matmul_flops("cpu", dtype, n=s["matmul_n"])["flops_per_s"]
        result.setdefault("info", []).extend(
            [
                info(f"moe eager {dname}: share of peak matmul FLOP/s", flops / eager / peak, "fraction"),
                info(f"moe {dname}: highest possible speedup over eager (matmul-bound)", eager / (flops / peak), "x"),
            ]
        )
        result["measurements"][dname] = {
            "median_s": {impl: round(t["median_s"], 5) for impl, t in timed.items()},
            "times_s": {impl: t["times_s"] for impl, t in timed.items()},
            "tokens_per_s": {impl: round(s["tokens"] / t["median_s"], 1) for impl, t in timed.items()},
            "max_abs_diff_vs_eager": diffs,
        }
        for impl in FAST:
            c = check(
                f"moe {impl} {dname}", "speedup (eager / fast), fwd+bwd", TARGET, eager / timed[impl]["median_s"]
            )
            result["checks"].append(c)
            if not c["met"]:
                missed.append((c["measured"], impl, dname, layers[impl], x, grad))
    by_impl = {impl: all(c["met"] for c in result["checks"] if c["name"].startswith(f"moe {impl} ")) for impl in FAST}
    result["met"] = any(by_impl.values())
    result["met_by_implementation"] = by_impl
    if profile and missed:
        result["profile"] = {}
        for _, impl, dname, layer, x, grad in sorted(missed, key=lambda m: m[0])[:2]:  # the two worst
            result["profile"][f"{impl} {dname}"] = profile_top(lambda: fwd_bwd(layer, x, grad), steps=2)
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
