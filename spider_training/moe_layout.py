"""The expert-sorted ("fused") token layout of TileKernels 1.x (deepseek-ai/TileKernels), in torch, and the fusion of
older releases' per-expert weights.

The model never uses this layout: its experts go through transformers' experts implementations
(``modeling_spider.SpiderExperts``). What uses it sits on the training side: torchao's FP8 grouped GEMM needs each
expert's rows at a multiple of 16 (:mod:`spider_training.fp8_moe`), and the TileKernels adapter
(:mod:`spider_training.tile_kernels_moe`) falls back to these ops where a kernel cannot run. Same names, shapes and
rules as ``tile_kernels.moe`` 1.x (``get_fused_mapping``, ``expand_to_fused``, ``reduce_fused``; -1 marks a padding
row).

:func:`fuse_per_expert_state_dict` turns the per-expert layout (``...experts.{e}.gate_proj.weight`` etc.: older
releases, ``tk-train.py``'s checkpoints) into the fused parameters, for code that loads a state dict without
``from_pretrained`` (the converter of ``tk-train.py`` checkpoints, a Trainer resuming an old checkpoint);
``from_pretrained`` converts through the mapping the model file registers.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from modeling_spider import SpiderMoEKernels


class FusedMapping(NamedTuple):
    """The expert-sorted layout of TileKernels' `get_fused_mapping` (N rows, -1 marks padding).

    Attributes: `pos_to_expert`, `pos_to_token`, `pos_to_token_topk` int64 `(N,)`; `token_topk_to_pos` int64 `(T, k)`;
    `expert_start`, `expert_end`, `num_tokens_per_expert` int64 `(E,)` (slice bounds and rows per expert)."""

    pos_to_expert: torch.Tensor
    pos_to_token: torch.Tensor
    pos_to_token_topk: torch.Tensor
    token_topk_to_pos: torch.Tensor
    expert_start: torch.Tensor
    expert_end: torch.Tensor
    num_tokens_per_expert: torch.Tensor


def fused_num_rows(num_slots: int, num_experts: int, alignment: int = 1) -> int:
    """Rows N of the fused layout for `num_slots` = T*k token-slots: ``num_slots + E*(alignment-1)`` rounded up to a
    multiple of `alignment` (a static bound: no size depends on the routing)."""
    return -(-(num_slots + num_experts * (alignment - 1)) // alignment) * alignment


def get_fused_mapping(topk_idx: torch.Tensor, num_experts: int, alignment: int = 1) -> FusedMapping:
    """Expert-sorted layout of the `(T, k)` token-slots (:class:`FusedMapping`): `T*k + E*(alignment-1)` rows (the
    most padding E groups can need) rounded up to a multiple of `alignment`, as TileKernels sizes it (so every row
    stride of the buffer and of its transpose is aligned too: FP8 GEMMs need 16-byte strides)."""
    T, k = topk_idx.shape
    device = topk_idx.device
    flat = topk_idx.reshape(-1)
    counts = SpiderMoEKernels.expert_counts(flat, num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    expert_end = padded.cumsum(0)
    expert_start = expert_end - padded
    order = torch.sort(flat, stable=True).indices  # slots sorted by expert, token order kept within an expert
    sorted_expert = flat[order]
    rank_in_expert = torch.arange(T * k, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    pos = expert_start[sorted_expert] + rank_in_expert
    N = fused_num_rows(T * k, num_experts, alignment)
    token_topk_to_pos = torch.empty_like(flat).scatter_(0, order, pos)
    pos_to_expert = torch.full((N,), -1, dtype=torch.long, device=device).scatter_(0, pos, sorted_expert)
    pos_to_token = torch.full((N,), -1, dtype=torch.long, device=device).scatter_(0, pos, order // k)
    pos_to_token_topk = torch.full((N,), -1, dtype=torch.long, device=device).scatter_(0, pos, order)
    return FusedMapping(
        pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos.view(T, k), expert_start, expert_end, padded
    )


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """`x` `(T, H)` -> `(N, H)` rows in the fused layout; padding rows are 0."""
    T, k = token_topk_to_pos.shape
    out = x.new_zeros(pos_to_expert.shape[0], x.shape[-1])
    return out.index_copy(0, token_topk_to_pos.reshape(-1), x.repeat_interleave(k, dim=0))


def reduce_fused(x: torch.Tensor, topk_weights: torch.Tensor, token_topk_to_pos: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's k rows: `(N, H)`, `(T, k)`, `(T, k)` -> fp32 `(T, H)` (fp32 accumulation)."""
    T, k = token_topk_to_pos.shape
    rows = x[token_topk_to_pos.reshape(-1)].view(T, k, -1).to(torch.float32)
    return (rows * topk_weights.to(torch.float32)[..., None]).sum(dim=1)


#: a per-expert weight of older releases: prefix (ending in "experts."), expert index, projection
PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_per_expert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` with every per-expert group (``P.experts.{e}.gate_proj.weight`` etc.) fused into
    ``modeling_spider.SpiderExperts``' ``P.experts.gate_up_proj`` `(E, 2I, D)` and ``down_proj`` `(E, D, I)`, other
    keys in order (the ``load_state_dict`` counterpart of ``modeling_spider.per_expert_checkpoint_conversions``).

    Raises:
        ValueError: an incomplete group (an expert index or a projection missing), naming the prefix.
    """
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, value in state_dict.items():
        match = PER_EXPERT_KEY.match(key)
        if match:
            groups.setdefault(match["prefix"], {})[int(match["e"]), match["proj"]] = value
    if not groups:
        return dict(state_dict)
    fused: dict[str, torch.Tensor] = {}
    for prefix, weights in groups.items():
        num_experts = 1 + max(e for e, _ in weights)
        missing = [(e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                   if (e, p) not in weights]
        if missing:
            raise ValueError(f"per-expert weights under {prefix!r} are incomplete: missing "
                             + ", ".join(f"{prefix}{e}.{p}.weight" for e, p in missing[:5]))
        fused[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]], dim=0) for e in range(num_experts)]
        )
        fused[prefix + "down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(num_experts)])
    out, placed = {}, set()
    for key, value in state_dict.items():
        match = PER_EXPERT_KEY.match(key)
        if not match:
            out[key] = value
        elif match["prefix"] not in placed:  # the fused pair takes the place of the group's first key
            placed.add(match["prefix"])
            out[match["prefix"] + "gate_up_proj"] = fused[match["prefix"] + "gate_up_proj"]
            out[match["prefix"] + "down_proj"] = fused[match["prefix"] + "down_proj"]
    return out


__all__ = ["FusedMapping", "PER_EXPERT_KEY", "expand_to_fused", "fuse_per_expert_state_dict", "fused_num_rows",
           "get_fused_mapping", "reduce_fused"]
