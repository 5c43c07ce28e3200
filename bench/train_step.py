"""Benchmark 2 -- training step: Spider vs the HF-native peer (transformers' ``DeepseekV3ForCausalLM``).

What its entries and fields mean: bench/README.md, "Module notes", `train_step.py`.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from bench.common import (
    check,
    finish,
    info,
    main_for,
    num_params,
    profile_top,
    random_bytes,
    spider_config,
    spider_model,
    trainer_steps,
)
from spider_training.peers import peer_model

TARGET = 1.5
FULL = dict(preset="small", batch=8, seq_len=256, warmup=2, repeats=7)
QUICK = dict(preset="tiny", batch=1, seq_len=32, warmup=1, repeats=2)


def build_models(preset: str) -> tuple[dict, dict]:
    """``({"spider_n_loops_1", "spider_n_loops_1_at_prior_rate", "spider_default", "peer"}: (model, n_loops),
    details)``. The two plain Spider rows share one model's initial weights (only the trainer's ``n_loops`` differs;
    each trains its own copy); ``n_loops`` None for the peer."""
    cfg = spider_config(preset)
    spider = spider_model(preset)
    peer = peer_model(cfg)
    # The same model with the boundary predictor at the FlexiTokens prior: training samples a boundary with
    # probability sigmoid(logit), so logit(prior) gives the rate the boundary loss trains towards.
    at_prior = copy.deepcopy(spider)
    with torch.no_grad():
        at_prior.model.flexitokens.boundary_predictor.out_proj.weight.zero_()
        at_prior.model.flexitokens.boundary_predictor.out_proj.bias.fill_(
            math.log(cfg.boundary_prior / (1 - cfg.boundary_prior))
        )
    models = {
        "spider_n_loops_1": (spider, 1),
        "spider_n_loops_1_at_prior_rate": (at_prior, 1),
        "spider_default": (copy.deepcopy(spider), cfg.n_loops),
        "peer": (peer, None),
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
    return models, details


def train_rows(models: dict, s: dict, peak: float | None = None) -> dict:
    """Each ``(model, n_loops)`` of `models` (:func:`build_models`) through :func:`bench.common.trainer_steps`:
    ``s["warmup"] + s["repeats"]`` steps on one batch of ``s["batch"] x s["seq_len"]`` random bytes, MFU against `peak`
    (None: the trainer's own). Returns ``{name: its trainer_steps result}``."""
    ids = random_bytes(s["batch"], s["seq_len"])
    return {name: trainer_steps(m, ids, n, s["warmup"], s["repeats"], peak=peak) for name, (m, n) in models.items()}


def profile_trainer(trainer) -> dict:
    """:func:`bench.common.profile_top` of two more one-step ``trainer.train()`` calls (the step and the trainer's
    per-run setup)."""
    trainer.args.max_steps = 1
    return profile_top(trainer.train, steps=2)


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    models, info_ = build_models(s["preset"])
    runs = train_rows(models, s)
    tokens = s["batch"] * s["seq_len"]
    tps = {name: tokens / t["median_s"] for name, t in runs.items()}
    loop_cost = runs["spider_default"]["median_s"] / runs["spider_n_loops_1"]["median_s"]  # default n_loops / 1
    result = {
        "benchmark": "train_step",
        "description": "training step tokens/s: Spider (n_loops=1) / DeepseekV3ForCausalLM peer",
        "sizes": {k: s[k] for k in ("preset", "batch", "seq_len")},
        "dtype": "fp32",
        "timing": {"warmup": s["warmup"], "repeats": s["repeats"], "statistic": "median"},
        "models": info_,
        "measurements": {
            "median_s": {n: round(t["median_s"], 5) for n, t in runs.items()},
            "times_s": {n: t["times_s"] for n, t in runs.items()},
            "tokens_per_s": {n: round(v, 1) for n, v in tps.items()},
            "default_over_n_loops_1_time": round(loop_cost, 4),
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
            info("default n_loops step time / n_loops=1", loop_cost, "x"),
        ],
        "notes": [
            "peer: DeepseekV3 cannot make its last layer dense, so the peer's coda layer(s) are MoE "
            f"(peer layers: {info_['peer_layers']})",
            "peer uses sigmoid routing with one group (n_group=topk_group=1), Spider softmax routing; "
            "both top-k of the same number of experts",
            f"default loop count ({info_['default_n_loops']}) costs {loop_cost:.2f}x the n_loops=1 step",
        ],
    }
    if profile and not result["checks"][0]["met"]:
        result["profile"] = {name: profile_trainer(runs[name]["trainer"]) for name in ("spider_n_loops_1", "peer")}
    return finish(result, start)


if __name__ == "__main__":
    main_for(run)
