"""Benchmark 2 -- training step: Spider vs the HF-native peer (transformers' ``DeepseekV3ForCausalLM``).

What its entries and fields mean: bench/README.md, "Module notes", `train_step.py`.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from bench.common import (
    TrainStep,
    check,
    finish,
    info,
    main_for,
    num_params,
    profile_top,
    random_bytes,
    spider_config,
    spider_model,
    time_interleaved,
)
from spider_training.peers import peer_model

TARGET = 1.5
FULL = dict(preset="small", batch=8, seq_len=256, warmup=2, repeats=7)
QUICK = dict(preset="tiny", batch=1, seq_len=32, warmup=1, repeats=2)


def build_steps(preset: str, batch: int, seq_len: int) -> tuple[dict, dict]:
    """``({"spider_n_loops_1", "spider_default", "peer"}: TrainStep, details)`` on one shared random byte batch.

    The two Spider variants share one model (only the ``n_loops`` forward argument differs) but have their own
    AdamW state."""
    cfg = spider_config(preset)
    spider = spider_model(preset)
    peer = peer_model(cfg)
    ids = random_bytes(batch, seq_len)
    # The same model with the boundary predictor at the FlexiTokens prior: training samples a boundary with
    # probability sigmoid(logit), so logit(prior) gives the rate the boundary loss trains towards.
    at_prior = copy.deepcopy(spider)
    with torch.no_grad():
        at_prior.model.flexitokens.boundary_predictor.out_proj.weight.zero_()
        at_prior.model.flexitokens.boundary_predictor.out_proj.bias.fill_(
            math.log(cfg.boundary_prior / (1 - cfg.boundary_prior))
        )
    steps = {
        "spider_n_loops_1": TrainStep(spider, ids, n_loops=1),
        "spider_n_loops_1_at_prior_rate": TrainStep(at_prior, ids, n_loops=1),
        "spider_default": TrainStep(spider, ids, n_loops=cfg.n_loops),
        "peer": TrainStep(peer, ids),
    }
    details = {
        "default_n_loops": cfg.n_loops,
        "boundary_prior": cfg.boundary_prior,
        "spider_params": num_params(spider),
        "peer_params": num_params(peer),
        "spider_experts_implementation": cfg._experts_implementation,
        "peer_experts_implementation": getattr(peer.config, "_experts_implementation", None),
        "peer_attn_implementation": peer.config._attn_implementation,
        "peer_layers": [type(layer.mlp).__name__ for layer in peer.model.layers],
    }
    return steps, details


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    steps, info_ = build_steps(s["preset"], s["batch"], s["seq_len"])
    timed = time_interleaved(steps, s["warmup"], s["repeats"])
    tokens = s["batch"] * s["seq_len"]
    tps = {name: tokens / t["median_s"] for name, t in timed.items()}
    result = {
        "benchmark": "train_step",
        "description": "training step tokens/s: Spider (n_loops=1) / DeepseekV3ForCausalLM peer",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len")},
        "dtype": "fp32",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "models": info_,
        "measurements": {
            "median_s": {n: round(t["median_s"], 5) for n, t in timed.items()},
            "times_s": {n: t["times_s"] for n, t in timed.items()},
            "tokens_per_s": {n: round(v, 1) for n, v in tps.items()},
            "default_over_n_loops_1_time": round(
                timed["spider_default"]["median_s"] / timed["spider_n_loops_1"]["median_s"], 4
            ),
            "spider_default_over_peer_tokens_per_s": round(tps["spider_default"] / tps["peer"], 4),
        },
        "checks": [
            check(
                "train step Spider(n_loops=1) / peer, boundary rate at init (~0.5)",
                "tokens/s ratio",
                TARGET,
                tps["spider_n_loops_1"] / tps["peer"],
            ),
            check(
                f"train step Spider(n_loops=1) / peer, boundary rate at the prior ({info_['boundary_prior']})",
                "tokens/s ratio",
                TARGET,
                tps["spider_n_loops_1_at_prior_rate"] / tps["peer"],
            ),
        ],
        "info": [
            info("Spider tokens/s n_loops=1", tps["spider_n_loops_1"], "tokens/s"),
            info(f"Spider tokens/s n_loops={info_['default_n_loops']} (default)", tps["spider_default"], "tokens/s"),
            info("peer tokens/s", tps["peer"], "tokens/s"),
            info(
                "default n_loops step time / n_loops=1",
                timed["spider_default"]["median_s"] / timed["spider_n_loops_1"]["median_s"],
                "x",
            ),
        ],
        "notes": [
            "peer: DeepseekV3 cannot make its last layer dense, so the peer's coda layer(s) are MoE "
            f"(peer layers: {info_['peer_layers']})",
            "peer uses sigmoid routing with one group (n_group=topk_group=1), Spider softmax routing; "
            "both top-k of the same number of experts",
            f"default loop count ({info_['default_n_loops']}) costs "
            f"{timed['spider_default']['median_s'] / timed['spider_n_loops_1']['median_s']:.2f}x the n_loops=1 step",
        ],
    }
    if profile and not result["checks"][0]["met"]:
        result["profile"] = {
            "spider_n_loops_1": profile_top(steps["spider_n_loops_1"], steps=2),
            "peer": profile_top(steps["peer"], steps=2, top=8),
        }
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
