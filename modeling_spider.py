# Copyright 2026 The Spider authors. Licensed under the Apache License, Version 2.0.
"""PyTorch Spider: a byte-level recurrent-depth transformer with learned token boundaries.

The file reads top-down like the forward pass (docs/design.md, "The forward pass")::

    x = embed_tokens(input_ids)                   # (B, L, D) bytes
    x = prelude(x)                                # SpiderDecoderLayer: dense MLA + SwiGLU
    b, e = flexitokens(x)                         # SpiderFlexiTokens: 0/1 boundary per byte,
                                                  #   e = pool_norm(pool_segments(b, x)) (B, 1+S, D)
    h_out = recurrent_block(e, engram_memory)     # SpiderRecurrentBlock, per loop t:
        z = loop_norm(h + e + loop_embedding[t])
        z = layers(z, engram_memory)              #   SpiderRecurrentLayer: MLA + MoE (+ Engram)
        z = z + loop_lora(z, t);  h = A*h + B*e + z   # per-loop adapter, LTI injection
        ACT halting: h_out += w_t * h             #   Graves 2016
    y = flexitokens.expand(b, h_out, x)           # segments expanded to bytes, mixed in
    logits = lm_head(norm(coda(y)))

The cached decode step (``SpiderDecodingMixin.decode_byte``) runs the same modules one byte at a
time; it and its state, :class:`SpiderCache`, live in `generation_spider.py` beside this file.

Sources: DeepSeek-V2/V3 (MLA, MoE, aux_fi load balancing; transformers ``models/deepseek_v3``), Engram (DeepSeek,
arXiv 2601.07372), FLEXITOKENS (Owodunni et al. 2025, arXiv 2507.12720) with the pooling of Nawrot et al. 2023,
OpenMythos / Parcae (LTI injection, ACT, per-loop LoRA), Huginn (arXiv 2502.05171), Relaxed Recursive Transformers
(arXiv 2410.20672), ACT (Graves 2016, arXiv 1603.08983). The MoE routing ops mirror TileKernels 1.x (deepseek-ai).

Imports only torch, transformers, numpy, the standard library and its sibling files (the Hub serves them). On import
it registers the conversion of older checkpoints (``conversion_spider.py``) for model type ``"spider"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.integrations.moe import use_experts_implementation
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    or_masks,
    padding_mask_function,
    sdpa_mask,
    sliding_window_overlay,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.utils import ModelOutput, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

try:  # loaded as part of a package (trust_remote_code, or `spider` installed as a package)
    from .configuration_spider import SpiderConfig
    from .conversion_spider import older_checkpoint_conversions
    from .generation_spider import SpiderCache, SpiderDecodingMixin, SpiderGenerationMixin, SpiderLayerCache
except ImportError:  # loaded as a top-level module from the repository root
    from configuration_spider import SpiderConfig
    from conversion_spider import older_checkpoint_conversions
    from generation_spider import SpiderCache, SpiderDecodingMixin, SpiderGenerationMixin, SpiderLayerCache


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class SpiderModelOutput(ModelOutput):
    """Output of :class:`SpiderModel` (a cached decode step fills `last_hidden_state`, `cache`,
    `boundaries` and `hidden_states` only).

    Attributes:
        last_hidden_state (`torch.FloatTensor` `(B, L, D)`): byte states after the coda and norm.
        cache (:class:`SpiderCache`, *optional*): the decoding state, with `use_cache=True`.
        hidden_states (`tuple[torch.FloatTensor]`, *optional*): `(B, L, D)` each: the embeddings, each prelude layer's
            output, the expanded recurrent output mixed into the bytes, each coda layer's output.
        router_logits (`tuple[torch.FloatTensor]`, *optional*): fp32 `(N, E)` per (loop, layer).
        boundaries, boundary_probs (`torch.FloatTensor` `(B, L)`): the 0/1 boundary decisions
            (straight-through in training) and the predictor's probabilities.
        segment_mask (`torch.FloatTensor` `(B, 1+S)`): 1.0 for real segments (segment 0 is the
            null segment), 0.0 for the padding of the segment axis.
        halting_step, halting_remainder (`torch.FloatTensor` `(B, 1+S)`): ACT's loops run per
            segment and the remainder paid at its halting loop.
        expert_loads, mean_scores (`tuple[torch.FloatTensor]`): DeepSeek's `f_i` and `P_i` `(E,)` per (loop, layer).
        loop_weights (`torch.FloatTensor` `(B, 1+S, T)`, *optional*): with
            `output_router_logits=True`, each loop's ACT weight in a segment's output.
        attentions (`tuple[torch.FloatTensor]`, *optional*): with `output_attentions=True` and ``"eager"``, per
            attention call: `(B, H, L, L)` for byte layers, `(B, H, 1+S, 1+S)` per (loop, recurrent layer).
    """

    last_hidden_state: torch.FloatTensor | None = None
    cache: object | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    boundaries: torch.FloatTensor | None = None
    boundary_probs: torch.FloatTensor | None = None
    segment_mask: torch.FloatTensor | None = None
    halting_step: torch.FloatTensor | None = None
    halting_remainder: torch.FloatTensor | None = None
    expert_loads: tuple[torch.FloatTensor, ...] | None = None
    mean_scores: tuple[torch.FloatTensor, ...] | None = None
    loop_weights: torch.FloatTensor | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class SpiderCausalLMOutput(ModelOutput):
    """Output of :class:`SpiderForConditionalGeneration`; fields it shares with
    :class:`SpiderModelOutput` as there, the loss terms None for a cached decode step.

    Attributes:
        loss (`torch.FloatTensor` scalar, with `labels`): ``lm_loss + router_aux_loss_coef *
            aux_loss + boundary_loss_coef * boundary_loss + ponder_loss_coef * ponder_loss``
            (a term whose coefficient is 0 is left out).
        logits (`torch.FloatTensor` `(B, L, vocab_size)`).
        lm_loss (`torch.FloatTensor` scalar): next-byte cross-entropy in nats (-100 ignored).
        aux_loss, boundary_loss, ponder_loss (`torch.FloatTensor` scalars): unweighted; the mean
            over (loop, layer) of `sum_i f_i * P_i`; the rate hinge plus `boundary_teacher_coef`
            times the teacher's cross-entropy; the mean of ACT's loops and remainders.
        compression_rate, mean_halting_step (`torch.FloatTensor` scalars): bytes per closed segment; mean ACT loops.
        expert_load (`torch.FloatTensor` `(E,)`): `f_i` per expert (1.0 at perfect balance).
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    lm_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    boundary_loss: torch.FloatTensor | None = None
    ponder_loss: torch.FloatTensor | None = None
    compression_rate: torch.FloatTensor | None = None
    mean_halting_step: torch.FloatTensor | None = None
    expert_load: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    cache: object | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    boundaries: torch.FloatTensor | None = None
    boundary_probs: torch.FloatTensor | None = None
    segment_mask: torch.FloatTensor | None = None
    halting_step: torch.FloatTensor | None = None
    loop_weights: torch.FloatTensor | None = None


# --------------------------------------------------------------------------------------------------
# Building blocks: RMSNorm, RoPE, MLA attention, SwiGLU
# --------------------------------------------------------------------------------------------------


def as_weight_dtype(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` in `module.weight`'s floating dtype where that differs (fp32 modules in a bf16 model);
    a quantised weight takes `x` as it is."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dtype != x.dtype:
        return x.to(weight.dtype)
    return x


def autocast_enabled(device_type: str) -> bool:
    try:  # False for a device type autocast does not know
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def autocast_off(device_type: str) -> AbstractContextManager:
    """Autocast turned off for `device_type` where it is on, for an op that must see its operands' own dtypes."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """Floating `x` in the autocast dtype where autocast is on, for a tensor several layers read:
    cast once, not once per layer (their gradients then add up before the one cast back)."""
    device_type = x.device.type
    if not x.is_floating_point() or not autocast_enabled(device_type):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def value_checks_sync(tensor: torch.Tensor, training: bool) -> bool:
    return tensor.device.type == "cpu" or not training


def check_values(bad: torch.Tensor, training: bool, message: Callable[[bool], str]) -> None:
    """Raise ``ValueError(message(True))`` where bool `bad` has a True element; where reading it
    would sync in training, assert on the device instead (``message(False)`` reads no value)."""
    if value_checks_sync(bad, training):
        if bool(bad.any()):
            raise ValueError(message(True))
    else:
        torch._assert_async(~bad.any(), message(False))


class SpiderRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32, returned in the input dtype promoted with
    the weight's. `(..., D) -> (..., D)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes in fp32 for any input and scales before its cast back: only an fp32
        # input takes the weight inside (else rounded, then scaled, as in transformers)
        shape = (hidden_states.shape[-1],)
        if hidden_states.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)
        with autocast_off(hidden_states.device.type):  # no fp32 copy of a bf16 input
            normed = F.rms_norm(hidden_states, shape, eps=self.variance_epsilon)
        return self.weight * normed


class SpiderRotaryEmbedding(DeepseekV3RotaryEmbedding):
    """Rotary position embedding for the `qk_rope_head_dim` part of MLA heads: transformers'
    ``DeepseekV3RotaryEmbedding`` (``config.rope_parameters``, any ``rope_type`` of ``ROPE_INIT_FUNCTIONS``;
    `config.head_dim` is `qk_rope_head_dim`). `inv_freq` is a non-persistent buffer that ``_init_weights`` fills."""

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor):
        """`position_ids` int64 `(B, T)` -> `(cos, sin)` `(B, T, qk_rope_head_dim)` in `x.dtype`."""
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float32)
        freqs = position_ids[..., None].to(torch.float32) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(B, H, T, d)` by `cos`/`sin` `(B, T, d)`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _self_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    """A padding query sees itself, so no row is empty (SDPA and softmax give NaN for one)."""
    return q_idx == kv_idx


def attention_mask_function(token_mask: torch.Tensor | None, sliding_window: int | None = None) -> Callable | None:
    """Spider's attention pattern as a ``transformers.masking_utils`` mask function (None: plain causal): causal, real
    keys only (`token_mask` `(B, T_k)` bool or None), keys at `q - sliding_window < k <= q`, a padding query seeing
    itself (padding is contiguous, so a window over indices counts real bytes). A recurrent decode step's mask is
    `generation_spider.segment_slot_mask_function`."""
    if token_mask is None and sliding_window is None:
        return None
    mask_function = causal_mask_function
    if sliding_window is not None:
        mask_function = and_masks(mask_function, sliding_window_overlay(sliding_window))
    if token_mask is not None:
        mask_function = or_masks(and_masks(mask_function, padding_mask_function(token_mask)), _self_mask_function)
    return mask_function


def create_attention_mask(
    config: SpiderConfig, inputs: torch.Tensor, kv_length: int, mask_function: Callable | None, q_offset: int = 0
) -> torch.Tensor | BlockMask | None:
    """The mask of `mask_function` (None: causal) for the queries of `inputs` `(B, T_q, D)`, the first at key index
    `q_offset`, over `kv_length` keys, in the format of ``config._attn_implementation``
    (``ALL_MASK_ATTENTION_FUNCTIONS``, else SDPA's). None where SDPA's ``is_causal`` is exact."""
    mask_interface = ALL_MASK_ATTENTION_FUNCTIONS.get(config._attn_implementation, sdpa_mask)
    batch_size, q_length = inputs.shape[:2]
    if mask_function is None:
        if mask_interface is sdpa_mask and q_offset + q_length in (q_length, kv_length):
            return None
        mask_function = causal_mask_function
    return mask_interface(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        mask_function=mask_function,
        allow_is_causal_skip=False,
        dtype=inputs.dtype,
        device=inputs.device,
        config=config,
    )


class SpiderAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1, ``DeepseekV3Attention``'s names),
    `(B, T, D) -> (B, T, D)`, through the function ``config._attn_implementation`` names."""

    is_causal = True  # read by sdpa_attention_forward when the mask is None
    num_key_value_groups = 1  # read by eager_attention_forward: one key-value head per query head

    def __init__(self, config: SpiderConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = self.qk_head_dim**-0.5
        D, H = config.hidden_size, self.num_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = SpiderRMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = SpiderRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, D, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: SpiderLayerCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states` `(B, T, D)`; `attention_mask` `(B, 1, T, T_keys)` or None; `cache` this layer's, updated in
        place. Returns `(output (B, T, D), weights (B, H, T, T_keys) or None)`."""
        B, T, _ = hidden_states.shape
        H, rope_dim = self.num_heads, self.qk_rope_head_dim
        hidden_states = to_autocast_dtype(hidden_states)  # read by the q and kv projections
        if self.config.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(B, T, H, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, rope_dim], dim=-1)

        compressed_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(B, T, H, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value_states = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        # the query heads and the shared key head rotated together, rounded once to the
        # projections' dtype (where attention would round them anyway)
        q_and_k_pe = torch.cat((q_pe, k_pe.view(B, 1, T, rope_dim)), dim=1)
        q_pe, k_pe = apply_rotary_pos_emb(q_and_k_pe, *position_embeddings).to(q_nope.dtype).split([H, 1], dim=1)
        query_states = torch.cat((q_nope, q_pe), dim=-1)
        key_states = torch.cat((k_nope, k_pe.expand(B, H, T, rope_dim)), dim=-1)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
        )
        return self.o_proj(attn_output.reshape(B, T, H * self.v_head_dim)), attn_weights


class SpiderMLP(nn.Module):
    """SwiGLU (Shazeer 2020): `down_proj(act(gate_proj(x)) * up_proj(x))`, `(..., D)`."""

    def __init__(self, config: SpiderConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_autocast_dtype(x)  # read by the gate and the up projection
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------------
# Mixture of experts (DeepSeek-V3 MoE; routing ops mirror TileKernels 1.x)
# --------------------------------------------------------------------------------------------------


class SpiderMoEKernels:
    """Torch reference of the TileKernels 1.x MoE routing ops (same names, shapes and rules); the
    trainer may swap in a ``tile_kernels`` adapter."""

    name = "torch"
    alignment = 1

    @staticmethod
    def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
        """fp32 `(T, E)` -> int64 `(T, k)` expert ids, best first; ties go to the smaller index."""
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :num_topk]

    @staticmethod
    def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(T, k)` -> `(denominator (T,), normalized (T, k))`; the sum starts at 1e-20."""
        denominator = topk_weights.sum(dim=-1) + 1e-20
        return denominator, topk_weights / denominator[:, None]

    @staticmethod
    def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_topk: int) -> torch.Tensor:
        """DeepSeek's f_i, `count_i * E / (T * k)`, fp32 `(E,)` (1.0 at perfect balance)."""
        counts = SpiderMoEKernels.expert_counts(topk_idx, num_experts).to(torch.float32)
        return counts * num_experts / max(topk_idx.shape[0] * num_topk, 1)

    @staticmethod
    def expert_counts(
        topk_idx: torch.Tensor, num_experts: int, slot_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token-slots per expert, int64 `(E,)`, by scatter-add (no host sync, unlike
        `torch.bincount`); with `slot_weight` fp32 `(T*k,)` each slot counts its weight (fp32)."""
        flat = topk_idx.reshape(-1)
        slot_weight = torch.ones_like(flat) if slot_weight is None else slot_weight
        counts = torch.zeros(num_experts, dtype=slot_weight.dtype, device=flat.device)
        return counts.scatter_add_(0, flat, slot_weight)


@use_experts_implementation
class SpiderExperts(nn.Module):
    """The routed SwiGLU experts of one MoE layer in transformers' MoE layout: `gate_up_proj` `(E, 2I, D)` (expert e's
    gate rows, then its up rows), `down_proj` `(E, D, I)`, run by ``config._experts_implementation`` (``"grouped_mm"``,
    ``"batched_mm"`` or ``"eager"``): `(T, D)`, int64 `top_k_index` `(T, k)`, `top_k_weights` `(T, k)` -> `(T, D)`.
    Grouped GEMM is no autocast op: training with fp32 weights under autocast runs it in the autocast dtype through
    ``spider_training.mixed_precision``."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        E, D, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, D, inner
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, inner))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """``"eager"``: a loop over experts (a host sync per expert), accumulated in fp32."""
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            weighted = expert_out * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, weighted.to(torch.float32))
        return out.to(hidden_states.dtype)


class RowWeights(NamedTuple):
    """Weights of the rows :class:`SpiderMoE` routes from a padded segment axis, made once per
    forward: fp32 `weight` `(T,)` (1 real, 0 padding), `mean_weight` (`weight / real rows`) and
    `load_weight` `(T*k,)` (per token-slot: summed per expert, DeepSeek's `f_i`)."""

    weight: torch.Tensor
    mean_weight: torch.Tensor
    load_weight: torch.Tensor

    @classmethod
    def of(cls, row_mask: torch.Tensor, top_k: int, num_experts: int) -> RowWeights:
        """From `row_mask` bool (flattened to `(T,)`), for `top_k` of `num_experts` per row."""
        weight = row_mask.reshape(-1).to(torch.float32)
        real = weight.sum()
        slot_weight = weight[:, None].expand(-1, top_k).reshape(-1)
        load_weight = slot_weight * (num_experts / (real * top_k).clamp_min(1))
        return cls(weight, weight / real.clamp_min(1), load_weight)


class SpiderMoE(nn.Module):
    """DeepSeek-V3-style MoE: fp32 `router`, top-k routed `experts`, `shared_experts`; routing ops from
    ``self.kernels``. Balancing is DeepSeek's aux_fi loss `sum_i f_i * P_i` (1 at perfect balance)."""

    kernels = SpiderMoEKernels

    def __init__(self, config: SpiderConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, self.num_experts, bias=False, dtype=torch.float32)
        self.experts = SpiderExperts(config)
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = SpiderMLP(config, shared_size) if config.n_shared_experts > 0 else None

    def forward(self, x: torch.Tensor, row_weights: RowWeights | None = None):
        """Route `x` `(T, D)` (padding rows, per `row_weights`, weigh zero). Returns `(out (T, D)
        in x.dtype, router_logits (T, E), expert_load (E,), mean_scores (E,))`, the last three fp32:
        DeepSeek's `f_i` and `P_i`."""
        router_logits = self.route(x)
        scores = router_logits.softmax(dim=-1)
        topk_idx = self.kernels.topk_gate(scores, self.top_k)
        topk_weights = scores.gather(1, topk_idx)
        if self.config.norm_topk_prob:
            topk_weights = self.kernels.normalize_weight(topk_weights)[1]
        if row_weights is not None:
            topk_weights = topk_weights * row_weights.weight[:, None]

        x_experts = to_autocast_dtype(x)  # read by the routed and the shared experts
        out = self.experts(x_experts, topk_idx, topk_weights).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_experts)

        if row_weights is None:
            expert_load = self.kernels.aux_fi(topk_idx, self.num_experts, self.top_k)
            mean_scores = scores.mean(dim=0)
        else:  # over the real rows only (a tensor count: no host sync)
            expert_load = SpiderMoEKernels.expert_counts(topk_idx, self.num_experts, row_weights.load_weight)
            mean_scores = (scores * row_weights.mean_weight[:, None]).sum(dim=0)
        return out, router_logits, expert_load, mean_scores

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 `(T, E)` logits of `x` `(T, D)` by the router's own forward (a PEFT or quantised
        router applies), autocast off: DeepSeek-V3 gates in fp32."""
        with autocast_off(x.device.type):
            return self.router(as_weight_dtype(self.router, x)).to(torch.float32)


# --------------------------------------------------------------------------------------------------
# Engram conditional memory (DeepSeek, arXiv 2601.07372)
# --------------------------------------------------------------------------------------------------


def _primes_from(start: int, count: int) -> list[int]:
    """The `count` smallest primes >= `start`."""
    primes, n = [], max(start, 2)
    while len(primes) < count:
        if all(n % d for d in range(2, math.isqrt(n) + 1)):
            primes.append(n)
        n += 1
    return primes


class SpiderEngramEmbeddings(nn.Module):
    """Hashed byte n-gram memory tables (one per n-gram order and head, in one `nn.Embedding`), looked up per byte:
    `XOR_i(id[l-i] * m_{n,h,i}) mod p_{n,h}`, constants from `numpy.random.default_rng(engram_hash_seed)`; positions
    before the start and padding read as id `vocab_size`. `(B, L)` -> `(B, L, M)`, `M = n_tables * engram_head_dim`."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        self.ngram_sizes = list(config.engram_ngram_sizes)
        self.num_heads = config.engram_num_heads
        self.head_dim = config.engram_head_dim
        self.fill_id = config.vocab_size
        n_tables = len(self.ngram_sizes) * self.num_heads
        rng = np.random.default_rng(config.engram_hash_seed)
        # multipliers[n_idx][h]: n odd 31-bit ints
        self.multipliers = [
            [[int(m) | 1 for m in rng.integers(1 << 20, 1 << 31, size=n)] for _ in range(self.num_heads)]
            for n in self.ngram_sizes
        ]
        self.moduli = _primes_from(config.engram_table_size, n_tables)
        self.offsets = [int(o) for o in np.cumsum([0] + self.moduli[:-1])]
        # multiplier_table[table][i] multiplies id[l - i]; 0 past the table's n (x ^ 0 == x)
        max_n = max(self.ngram_sizes)
        self.multiplier_table = [mult + [0] * (max_n - len(mult)) for per_n in self.multipliers for mult in per_n]
        self.embedding = nn.Embedding(sum(self.moduli), self.head_dim)
        self.output_size = n_tables * self.head_dim
        self._hash_constants = {}

    def hash_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """int64 `multiplier_table` `(n_tables, max_n)`, `moduli`, `offsets` `(n_tables,)`, copied
        once per device (a copy syncs); not buffers, so checkpoints do not carry them."""
        constants = self._hash_constants.get(device)
        if constants is None:
            constants = self._hash_constants[device] = tuple(
                torch.tensor(values, dtype=torch.long, device=device)
                for values in (self.multiplier_table, self.moduli, self.offsets)
            )
        return constants

    def hash_ids(self, input_ids: torch.LongTensor, token_mask: torch.Tensor | None = None):
        """Row of `self.embedding` of every (byte, table): int64 `(B, L, n_tables)`."""
        ids = input_ids if token_mask is None else input_ids.masked_fill(~token_mask, self.fill_id)
        max_n = max(self.ngram_sizes)
        # context[b, l, i] = id[l - i], (B, L, max_n): all tables hashed at once
        context = F.pad(ids, (max_n - 1, 0), value=self.fill_id).unfold(1, max_n, 1).flip(-1)
        multipliers, moduli, offsets = self.hash_constants(ids.device)
        products = context[:, :, None, :] * multipliers  # (B, L, n_tables, max_n)
        hashed = products[..., 0]
        for i in range(1, max_n):
            hashed = torch.bitwise_xor(hashed, products[..., i])
        return hashed % moduli + offsets

    def forward(self, input_ids: torch.LongTensor, token_mask: torch.Tensor | None = None):
        rows = self.hash_ids(input_ids, token_mask)
        B, L, n_tables = rows.shape
        return self.embedding(rows).view(B, L, n_tables * self.head_dim)


def depthwise_conv1d(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.conv1d(input, weight, groups=D)``, `(B, D, L)` and `(D, 1, K)` -> `(B, D, L - K + 1)`,
    as a sum over ``unfold`` windows: inductor's convolution backward specialises the length."""
    kernel_size = weight.shape[-1]
    channels_last = input.transpose(1, 2)  # (B, L, D)
    out = (channels_last.unfold(1, kernel_size, 1) * weight.squeeze(1).to(input.dtype)).sum(-1)
    return out.transpose(1, 2)


class SpiderShortConv(nn.Conv1d):
    """Engram's depthwise ShortConv: an ``nn.Conv1d`` (weight, init, checkpoint key) computed by
    :func:`depthwise_conv1d`."""

    def __init__(self, hidden_size: int, kernel_size: int):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return depthwise_conv1d(input, self.weight)


class SpiderEngram(nn.Module):
    """Engram gating into one recurrent layer (Engram §3):
    `alpha = sigmoid(signed_sqrt(<RMSNorm(h), RMSNorm(W_k e)> / sqrt(D)))`, `v = alpha * W_v e`,
    `out = v + SiLU(ShortConv(RMSNorm(v)))`; `h` `(B, S, D)`, memory `(B, S, M)`."""

    def __init__(self, config: SpiderConfig, memory_size: int):
        super().__init__()
        D = config.hidden_size
        self.key_proj = nn.Linear(memory_size, D, bias=False)
        self.value_proj = nn.Linear(memory_size, D, bias=False)
        self.hidden_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        self.key_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        self.conv_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        self.kernel_size = config.engram_conv_kernel_size
        self.short_conv = SpiderShortConv(D, self.kernel_size)

    def forward(self, hidden_states, memory, cache: SpiderLayerCache | None = None):
        # read by the key and the value projection: cast once
        memory = to_autocast_dtype(memory) if autocast_enabled(memory.device.type) else memory.to(hidden_states.dtype)
        key = self.key_norm(self.key_proj(memory))
        score = (self.hidden_norm(hidden_states) * key).sum(-1, keepdim=True)
        score = (score / math.sqrt(hidden_states.shape[-1])).to(torch.float32)
        gate = torch.sigmoid(torch.sign(score) * score.abs().clamp_min(1e-6).sqrt())
        value = gate.to(hidden_states.dtype) * self.value_proj(memory)
        conv_in = self.conv_norm(value)
        if cache is None:
            window = F.pad(conv_in, (0, 0, self.kernel_size - 1, 0))
        else:
            window = cache.conv_window(conv_in, self.kernel_size)
        return value + F.silu(self.short_conv(window.transpose(1, 2)).transpose(1, 2))


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class SpiderDecoderLayer(GradientCheckpointingLayer):
    """Dense pre-norm layer over bytes (prelude and coda): MLA attention + SwiGLU, `(B, L, D) -> (B, L, D)`."""

    def __init__(self, config: SpiderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = SpiderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SpiderAttention(config, layer_idx)
        self.post_attention_layernorm = SpiderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SpiderMLP(config, config.intermediate_size)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None):
        normed = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(normed, position_embeddings, attention_mask, cache)[0]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SpiderRecurrentLayer(GradientCheckpointingLayer):
    """One layer of the looped block over segments `(B, S, D)`, pre-norm: (Engram) + MLA + MoE. Positional arguments
    (for activation checkpointing); `segment_index` int64 `(N,)`: the rows to route (None: all), or bool `(B*S,)`:
    every row routed and the others' MoE output zeroed (fixed shapes, for a compiled decode step). Returns
    `(hidden_states, router_logits (N, E), expert_load (E,), mean_scores (E,))`."""

    def __init__(self, config: SpiderConfig, layer_idx: int, memory_size: int):
        super().__init__()
        self.layer_idx = layer_idx
        has_engram = layer_idx in config.engram_layer_ids
        self.engram = SpiderEngram(config, memory_size) if has_engram else None
        self.input_layernorm = SpiderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SpiderAttention(config, layer_idx)
        self.post_attention_layernorm = SpiderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SpiderMoE(config)

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        segment_index,
        engram_memory=None,
        row_weights=None,
        cache=None,
    ):
        if self.engram is not None:
            hidden_states = hidden_states + self.engram(hidden_states, engram_memory, cache)
        normed = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(normed, position_embeddings, attention_mask, cache)[0]
        normed = self.post_attention_layernorm(hidden_states)
        flat = normed.reshape(-1, normed.shape[-1])
        if segment_index is not None and segment_index.dtype == torch.bool:  # fixed shapes: every row, masked
            moe_out, router_logits, expert_load, mean_scores = self.mlp(flat, None)
            moe_out = torch.where(segment_index[:, None], moe_out, 0.0)
            return hidden_states + moe_out.view_as(hidden_states), router_logits, expert_load, mean_scores
        # routed rows packed by index (gather / scatter-add): no boolean mask, no host sync
        rows = flat if segment_index is None else flat.index_select(0, segment_index)
        if rows.shape[0] == 0:  # every segment has exited (act_early_exit)
            E = self.mlp.num_experts
            zeros = rows.new_zeros(E, dtype=torch.float32)
            return hidden_states, rows.new_zeros(0, E, dtype=torch.float32), zeros, zeros
        row_weights = row_weights if segment_index is None else None
        moe_out, router_logits, expert_load, mean_scores = self.mlp(rows, row_weights)
        if segment_index is not None:
            moe_out = torch.zeros_like(flat).index_add(0, segment_index, moe_out)
        hidden_states = hidden_states + moe_out.view_as(hidden_states)
        return hidden_states, router_logits, expert_load, mean_scores


# --------------------------------------------------------------------------------------------------
# FlexiTokens: boundary predictor, pooling bytes into segments, expanding segments to bytes
# --------------------------------------------------------------------------------------------------


class SpiderBoundaryPredictor(nn.Module):
    """FlexiTokens boundary predictor (arXiv 2507.12720 §3), `Linear -> GELU -> Linear(D, 1)` per
    byte in fp32. `boundary_mode` ``"hard"`` (H-Net): `sigmoid(logit) > boundary_threshold`,
    straight-through; ``"relaxed"``: relaxed-Bernoulli samples in training; ``"fixed"``: every
    `round(1 / boundary_prior)`-th byte. With a `boundary_teacher` only the teacher's loss trains
    it. `(B, L, D)` -> `(boundaries 0/1 in value, probs)`, fp32 `(B, L)`."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=torch.float32)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(config.hidden_size, 1, dtype=torch.float32)
        self.temperature = config.boundary_temperature
        self.threshold = config.boundary_threshold
        self.mode = config.boundary_mode
        self.stride = max(1, round(1.0 / config.boundary_prior))
        self.config = config  # boundary_teacher is read at each forward

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Boundary logits, fp32 `(B, L)`, from byte states `(B, L, D)`."""
        hidden = self.act(self.dense(as_weight_dtype(self.dense, hidden_states)))
        return self.out_proj(as_weight_dtype(self.out_proj, hidden)).squeeze(-1).to(torch.float32)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
    ):
        supervised = self.config.boundary_teacher is not None
        logits = self.logits(hidden_states.detach() if supervised else hidden_states)
        probs = torch.sigmoid(logits)
        if self.mode == "fixed":
            if position_ids is None:
                position_ids = torch.arange(probs.shape[1], device=probs.device).expand_as(probs)
            boundaries = ((position_ids + 1) % self.stride == 0).to(torch.float32)
        elif self.training and self.mode == "relaxed":
            # RelaxedBernoulli's sample from its parts: no argument validation (a host sync)
            logit_sample = torch.distributions.relaxed_bernoulli.LogitRelaxedBernoulli(
                self.temperature, logits=logits, validate_args=False
            ).rsample()
            soft = torch.distributions.transforms.SigmoidTransform()(logit_sample)
            boundaries = (soft > 0.5).to(soft.dtype)
            boundaries = boundaries if supervised else boundaries + (soft - soft.detach())
        elif self.training and not supervised:
            boundaries = (probs > self.threshold).to(torch.float32) + (probs - probs.detach())
        else:
            boundaries = (probs > self.threshold).to(torch.float32)
        if token_mask is not None:
            boundaries = boundaries * token_mask
        return boundaries, probs


def pool_segments(
    boundaries: torch.Tensor,
    hidden_states: torch.Tensor,
    null_segment: torch.Tensor | None,
    token_mask: torch.Tensor | None = None,
    pad_to_multiple_of: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pool bytes `(B, L, D)` into the segments their `boundaries` `(B, L)` (0/1) close
    (Nawrot et al. 2023): the open segment is dropped, padding (`token_mask` `(B, L)` bool) never
    enters a mean, no gradient reaches `boundaries`. Returns `(segments (B, 1+S, D), segment_mask
    (B, 1+S) bool)`: `null_segment` `(D,)` (None: zeros) first, then each row's closed segments,
    right-padded with zeros to the most any row closed, `1+S` rounded up to `pad_to_multiple_of`."""
    B, L, D = hidden_states.shape
    hard = boundaries.detach()
    cum_inclusive = hard.cumsum(dim=1)
    segment_idx = (cum_inclusive - hard).long()  # the segment holding byte l
    n_closed = cum_inclusive[:, -1].long() if L > 0 else boundaries.new_zeros(B).long()
    closed = int(n_closed.max()) if B > 0 and L > 0 else 0  # the forward's one host sync
    S = -(-(closed + 1) // pad_to_multiple_of) * pad_to_multiple_of - 1
    inside = segment_idx < n_closed[:, None]
    if token_mask is not None:
        inside = inside & token_mask
    weight = inside.to(torch.float32)
    # an empty slice of the bytes keeps a (zero) gradient upstream, which FSDP2 needs on every rank
    pooled = hidden_states[:, :0]
    if closed > 0:
        index = segment_idx.clamp(max=S - 1)
        sums = torch.zeros(B, S, D, dtype=torch.float32, device=hidden_states.device).scatter_add(
            1, index[..., None].expand(B, L, D), hidden_states.to(torch.float32) * weight[..., None]
        )
        counts = torch.zeros(B, S, dtype=torch.float32, device=hidden_states.device).scatter_add(1, index, weight)
        pooled = (sums / counts.clamp_min(1e-6)[..., None]).to(hidden_states.dtype)
    elif S > 0:  # no segment closed but the axis is padded: zeros tied to the bytes
        pooled = torch.cat([pooled, hidden_states.new_zeros(B, S, D)], dim=1)
    null = hidden_states.new_zeros(D) if null_segment is None else null_segment.to(pooled.dtype)
    segments = torch.cat([null.expand(B, 1, D), pooled], dim=1)
    segment_mask = torch.arange(S + 1, device=hidden_states.device)[None] <= n_closed[:, None]
    return segments, segment_mask


def expand_segments(boundaries: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Byte l reads the last segment closed at or before l (segment 0 before the first), times the
    confidence of its own decision (1 in value, a boundary gradient; H-Net §2.2). `boundaries`
    `(B, L)` 0/1 float, `segments` `(B, 1+S, D)` -> `(B, L, D)`."""
    hard = boundaries.detach()
    index = hard.cumsum(dim=1).long()
    confidence = torch.where(hard > 0, boundaries, 1.0 - boundaries).to(segments.dtype)
    gathered = segments.gather(1, index[..., None].expand(-1, -1, segments.shape[-1]))
    return gathered * confidence[..., None]


def boundary_rate_loss(boundaries: torch.Tensor, token_mask: torch.Tensor | None, config):
    """FlexiTokens' hinge on the boundary rate r per real byte, `relu(r - prior) +
    relu(prior - k*std - r)`. Returns `(loss, rate)`, fp32 scalars."""
    if token_mask is None:
        rate = boundaries.sum() / max(boundaries.numel(), 1)
    else:
        rate = (boundaries * token_mask).sum() / token_mask.sum().clamp_min(1)
    lower = config.boundary_prior - config.boundary_prior_k * config.boundary_prior_std
    return F.relu(rate - config.boundary_prior) + F.relu(lower - rate), rate


def word_bytes(input_ids: torch.LongTensor) -> torch.Tensor:
    """SpaceByte's word bytes (Slagle 2024, §2): ASCII letters and digits and UTF-8 continuation
    bytes; the rest is spacelike. int64 `(B, L)` -> bool `(B, L)`."""
    ids = input_ids
    return (
        ((ids >= 48) & (ids <= 57))
        | ((ids >= 65) & (ids <= 90))
        | ((ids >= 97) & (ids <= 122))
        | ((ids >= 0x80) & (ids <= 0xBF))
    )


def spacelike_boundaries(input_ids: torch.LongTensor) -> torch.Tensor:
    """SpaceByte's word boundaries: a spacelike byte right after a word byte closes a segment.
    int64 `(B, L)` -> fp32 `(B, L)`, 0/1."""
    word_byte = word_bytes(input_ids)
    previous = F.pad(word_byte[:, :-1], (1, 0), value=False)
    return (~word_byte & previous).to(torch.float32)


#: `boundary_teacher` -> rule, `input_ids (B, L) -> fp32 0/1 boundaries (B, L)`
BOUNDARY_TEACHER_RULES = {"spacelike": spacelike_boundaries}


def boundary_teacher_loss(
    boundary_probs: torch.Tensor, input_ids: torch.LongTensor, token_mask: torch.Tensor, teacher: str
) -> torch.Tensor:
    """Class-balanced BCE of `boundary_probs` fp32 `(B, L)` against the `teacher`'s segmentation of
    `input_ids` over `token_mask` (Nawrot et al. 2023 §3.2). fp32 scalar.

    Raises:
        ValueError: an unknown teacher.
    """
    if teacher not in BOUNDARY_TEACHER_RULES:
        raise ValueError(f"unknown boundary_teacher {teacher!r}; known: {sorted(BOUNDARY_TEACHER_RULES)}")
    target = BOUNDARY_TEACHER_RULES[teacher](input_ids)
    weight = token_mask.to(torch.float32)
    # written out: CUDA autocast refuses F.binary_cross_entropy
    p = boundary_probs.to(torch.float32).clamp(1e-6, 1 - 1e-6)
    positive, negative = target * weight, (1.0 - target) * weight
    return 0.5 * (
        -(positive * p.log()).sum() / positive.sum().clamp_min(1.0)
        - (negative * (1.0 - p).log()).sum() / negative.sum().clamp_min(1.0)
    )


class SpiderFlexiTokens(nn.Module):
    """FlexiTokens (arXiv 2507.12720): bytes -> segments (:meth:`forward`) and segments -> bytes
    (:meth:`expand`); one byte at a time, `generation_spider.pool_step` and `expand_step`."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        D = config.hidden_size
        self.mixing = config.expand_mixing
        self.rms_ratio = config.expand_rms_ratio
        self.eps = config.rms_norm_eps
        self.boundary_predictor = SpiderBoundaryPredictor(config)
        self.null_segment = nn.Parameter(torch.empty(D))
        self.pool_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        if self.mixing in ("residual_proj", "scaled_norm"):
            self.expand_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        if self.mixing == "residual_proj":
            self.residual_proj = nn.Linear(D, D, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        byte_mask: torch.Tensor,
        position_ids: torch.LongTensor,
        pad_to_multiple_of: int = 1,
    ):
        """Pool `x` `(B, L, D)` and its Engram `memory` `(B, L, M)`. Returns `(boundaries, boundary_probs` fp32
        `(B, L)`, `segments (B, 1+S, D)` normed, `segment_memory (B, 1+S, M)`, `segment_mask (B, 1+S)` bool`)`."""
        boundaries, boundary_probs = self.boundary_predictor(x, byte_mask, position_ids)
        D, M = x.shape[-1], memory.shape[-1]
        null = torch.cat([self.null_segment.to(x.dtype), x.new_zeros(M)])
        bytes_and_memory = torch.cat([x, memory.to(x.dtype)], -1)
        pooled, segment_mask = pool_segments(boundaries, bytes_and_memory, null, byte_mask, pad_to_multiple_of)
        segments, segment_memory = pooled.split([D, M], dim=-1)
        return boundaries, boundary_probs, self.pool_norm(segments), segment_memory, segment_mask

    def global_stream(self, h_out: torch.Tensor) -> torch.Tensor:
        """What each segment `(B, S, D)` hands back to the bytes, per `expand_mixing`."""
        if self.mixing == "rms_matched":
            return F.rms_norm(h_out, (h_out.shape[-1],), eps=self.eps)
        if self.mixing in ("residual_proj", "scaled_norm"):
            return self.expand_norm(h_out)
        return h_out

    def mix(self, expanded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The coda's input from `expanded` and the byte states `x`, both `(B, L, D)`
        (docs/design.md, "Mixing the global path into the bytes")."""
        if self.mixing == "rms_matched":
            rms = x.detach().to(torch.float32).pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
            return x + (self.rms_ratio * rms).to(x.dtype) * expanded
        if self.mixing == "residual_proj":
            return expanded + self.residual_proj(x)
        return expanded + x

    def expand(self, boundaries: torch.Tensor, h_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Segments -> bytes: `boundaries` `(B, L)`, `h_out` `(B, 1+S, D)` fp32, `x` `(B, L, D)`
        -> `(B, L, D)` in `x.dtype`."""
        return self.mix(expand_segments(boundaries, self.global_stream(h_out).to(x.dtype)), x)


# --------------------------------------------------------------------------------------------------
# Recurrence: loop adapter, LTI injection, ACT halting
# --------------------------------------------------------------------------------------------------


class SpiderLoopAdapter(nn.Module):
    """Per-loop low-rank adapter (Relaxed Recursive Transformers' depth-wise LoRA, OpenMythos' form)
    `z -> lora_B(loop_scale[t] * lora_A(z))`, `(B, S, D) -> (B, S, D)`: `lora_A` `(r, D)` and
    `lora_B` `(D, r)` shared by the loops, one scale per loop (loops past `max_loop_iters` reuse the
    last). Part of the model, not a PEFT adapter (``config.loop_adapter_rank``)."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        self.max_loop_iters = config.max_loop_iters
        rank = config.loop_adapter_rank
        self.lora_A = nn.Parameter(torch.empty(rank, config.hidden_size))
        self.lora_B = nn.Parameter(torch.empty(config.hidden_size, rank))
        self.loop_scale = nn.Parameter(torch.empty(config.max_loop_iters, rank))

    def forward(self, hidden_states: torch.Tensor, loop_idx: int) -> torch.Tensor:
        scale = self.loop_scale[min(loop_idx, self.max_loop_iters - 1)].to(hidden_states.dtype)
        down = F.linear(hidden_states, self.lora_A.to(hidden_states.dtype)) * scale
        return F.linear(down, self.lora_B.to(hidden_states.dtype))


class SpiderLTIInjection(nn.Module):
    """Stable linear time-invariant update (Parcae / OpenMythos): `h = A*h + B*e + z` per channel,
    `A = exp(-exp(log_dt + log_A))` in (0, 1), computed in fp32 (a decay near 1 rounds to 1 in
    bf16). Shapes `(B, S, D)`, returned in `h.dtype`."""

    def __init__(self, config: SpiderConfig):
        super().__init__()
        self.log_A = nn.Parameter(torch.empty(config.hidden_size))
        self.log_dt = nn.Parameter(torch.empty(1))
        self.B = nn.Parameter(torch.empty(config.hidden_size))

    def decay(self) -> torch.Tensor:
        """A, fp32 `(D,)`."""
        return torch.exp(-torch.exp((self.log_dt + self.log_A).to(torch.float32).clamp(-10.0, 4.0)))

    def forward(self, h: torch.Tensor, e: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        f32 = torch.float32
        return (self.decay() * h.to(f32) + self.B.to(f32) * e.to(f32) + z.to(f32)).to(h.dtype)


class ACTState(NamedTuple):
    """Adaptive computation time state per segment (Graves 2016), fp32 `(B, S)`: the accumulated
    halting probability, the remainder paid at the halting loop and the loops run."""

    halting_prob: torch.Tensor
    remainders: torch.Tensor
    n_updates: torch.Tensor


class SpiderHaltingStep(nn.Module):
    """One loop of ACT (Graves 2016, OpenMythos' loop form): `p = sigmoid(halt_logits)` `(B, S)`;
    a segment accumulates `p` until `threshold`, then halts with the remainder (all halt at the
    last loop, so a segment's weights sum to 1). Returns `(h_out + weight * h` fp32 `(B, S, D)`,
    the new state, `weight` fp32 `(B, S))`."""

    def forward(
        self,
        halt_logits: torch.Tensor,
        h: torch.Tensor,
        h_out: torch.Tensor,
        state: ACTState,
        threshold: float,
        is_last: bool,
    ) -> tuple[torch.Tensor, ACTState, torch.Tensor]:
        p = torch.sigmoid(halt_logits.to(torch.float32))
        halting_prob, remainders, n_updates = state
        running = (halting_prob < threshold).to(torch.float32)
        if is_last:
            new_halted, running = running, torch.zeros_like(running)
        else:
            reached = (halting_prob + p * running >= threshold).to(torch.float32)
            new_halted, running = reached * running, (1.0 - reached) * running
        halting_prob = halting_prob + p * running
        remainders = remainders + new_halted * (1.0 - halting_prob)
        halting_prob = halting_prob + new_halted * remainders
        n_updates = n_updates + running + new_halted
        weight = p * running + new_halted * remainders
        return h_out + weight[..., None] * h.to(torch.float32), ACTState(halting_prob, remainders, n_updates), weight


class SpiderRecurrentBlockOutput(NamedTuple):
    """`h_out` fp32 `(B, S, D)` (the ACT-weighted sum of the loops' states), `act` after the last
    loop, per (loop, layer) the MoE's `expert_loads` and `mean_scores` `(E,)` and, when asked for,
    `router_logits` `(N, E)` and per loop the ACT weights `loop_weights` `(B, S)` (detached)."""

    h_out: torch.Tensor
    act: ACTState
    expert_loads: list
    mean_scores: list
    router_logits: list
    loop_weights: list


class SpiderRecurrentBlock(nn.Module):
    """The looped block over segments (Huginn / OpenMythos), weights shared across loops: the loop
    of the module docstring's map. Loops past `max_loop_iters` reuse the last loop embedding."""

    def __init__(self, config: SpiderConfig, memory_size: int):
        super().__init__()
        D = config.hidden_size
        self.max_loop_iters = config.max_loop_iters
        self.config = config  # act_early_exit is read at each forward
        self.act_threshold = config.act_threshold
        self.loop_embedding = nn.Embedding(config.max_loop_iters, D)
        self.loop_norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            SpiderRecurrentLayer(config, i, memory_size) for i in range(config.num_recurrent_layers)
        )
        self.loop_lora = SpiderLoopAdapter(config)
        self.injection = SpiderLTIInjection(config)
        self.halt_predictor = nn.Linear(D, 1, dtype=torch.float32)
        self.halting_step = SpiderHaltingStep()
        self.halt_predictor.bias_init = config.halt_bias_init  # read by _init_weights

    def forward(
        self,
        segments: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        segment_index: torch.Tensor | None,
        engram_memory: torch.Tensor,
        n_loops: int,
        cache: SpiderCache | None = None,
        output_router_logits: bool = False,
        segment_mask: torch.Tensor | None = None,
    ) -> SpiderRecurrentBlockOutput:
        """`segments` `(B, S, D)` and their RoPE, `attention_mask` bool `(B, 1, S, S_keys)` or
        None, `segment_index` int64 `(N,)` (the rows to route; None: all), `engram_memory`
        `(B, S, M)`, `segment_mask` `(B, S)` bool (rows routed with weight 1) or None."""
        e = segments
        B, S, D = e.shape
        engram_memory = to_autocast_dtype(engram_memory)  # read by every loop: cast once
        h = e
        act = ACTState(*(torch.zeros(B, S, dtype=torch.float32, device=e.device) for _ in range(3)))
        h_out = torch.zeros(B, S, D, dtype=torch.float32, device=e.device)
        expert_loads, mean_scores, router_logits, loop_weights = [], [], [], []
        # once, through the embedding's forward (where offloading hooks load its weight)
        loop_ids = torch.arange(n_loops, device=e.device).clamp(max=self.max_loop_iters - 1)
        loop_embeddings = self.loop_embedding(loop_ids)
        early_exit = self.config.act_early_exit and not self.training
        routed_rows, running = segment_index, None
        row_weights = (
            None
            if segment_mask is None
            else RowWeights.of(segment_mask, self.config.num_experts_per_tok, self.config.n_routed_experts)
        )
        if early_exit and segment_index is not None:  # the non-padding segments, as a flat mask
            real_rows = torch.zeros(B * S, dtype=torch.bool, device=e.device).index_fill(0, segment_index, True)
        # a fixed-size cache (a compiled decode step) keeps fixed shapes: halted segments' MoE output is masked out
        mask_halted = early_exit and cache is not None and cache.is_compileable
        for t in range(n_loops):
            if early_exit and t > 0:
                # halted segments keep their state and serve keys and values but leave the MoE;
                # without a cache the loop stops once every segment has halted
                running = act.halting_prob < self.act_threshold
                if cache is None and not bool(running.any()):
                    break
                keep = running.reshape(-1)
                keep = keep if segment_index is None else keep & real_rows
                routed_rows = keep if mask_halted else keep.nonzero().squeeze(1)
            z = self.loop_norm(h + e + loop_embeddings[t])
            for i, layer in enumerate(self.layers):
                z, logits, load, scores = layer(
                    z,
                    position_embeddings,
                    attention_mask,
                    routed_rows,
                    engram_memory,
                    row_weights,
                    cache=cache.recurrent[t][i] if cache is not None else None,
                )
                expert_loads.append(load)
                mean_scores.append(scores)
                if output_router_logits:
                    router_logits.append(logits)
            z = z + self.loop_lora(z, t)
            h_next = self.injection(h, e, z)
            h = h_next if running is None else torch.where(running[..., None], h_next, h)
            halt_logits = self.halt_predictor(as_weight_dtype(self.halt_predictor, h)).squeeze(-1)
            h_out, act, weight = self.halting_step(halt_logits, h, h_out, act, self.act_threshold, t == n_loops - 1)
            if output_router_logits:
                loop_weights.append(weight.detach())
        return SpiderRecurrentBlockOutput(h_out, act, expert_loads, mean_scores, router_logits, loop_weights)


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


class SpiderPreTrainedModel(PreTrainedModel):
    config: SpiderConfig
    config_class = SpiderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SpiderDecoderLayer", "SpiderRecurrentLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False
    _can_record_outputs = {"attentions": OutputRecorder(SpiderAttention, index=1)}
    # SpiderCache crops back to accepted candidates: assisted decoding and prompt lookup work
    _is_stateful = False

    def save_pretrained(self, save_directory, *args, save_original_format: bool = False, **kwargs):
        """transformers' ``save_pretrained``, in the fused expert layout by default (Trainer's
        resume reads checkpoints with ``load_state_dict``, which knows only the fused names)."""
        return super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, SpiderRotaryEmbedding):
            super()._init_weights(module)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:  # the halt predictor's halt_bias_init
                init.constant_(module.bias, getattr(module, "bias_init", 0.0))
        elif isinstance(module, (nn.Embedding, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, SpiderExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, SpiderRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, SpiderLoopAdapter):
            init.normal_(module.lora_A, mean=0.0, std=std)
            init.zeros_(module.lora_B)
            init.ones_(module.loop_scale)
        elif isinstance(module, SpiderLTIInjection):
            init.zeros_(module.log_A)
            init.constant_(module.log_dt, math.log(math.log(2.0)))  # A = 0.5 at start
            init.constant_(module.B, 0.5)
        elif isinstance(module, SpiderFlexiTokens):
            init.normal_(module.null_segment, mean=0.0, std=std)
            if self.config.expand_mixing == "residual_proj":
                init.zeros_(module.residual_proj.weight)  # H-Net: the byte skip starts closed
            if self.config.expand_mixing == "scaled_norm":
                init.constant_(module.expand_norm.weight, self.config.expand_scale_init)


class SpiderBytes(NamedTuple):
    """The bytes of a full forward: `token_mask` `(B, L)` bool or None (no padding), `byte_mask`
    `(B, L)` bool, RoPE `position_ids` `(B, L)` int64 counting real bytes only, and the byte
    layers' `attention_mask` and `position_embeddings`."""

    token_mask: torch.Tensor | None
    byte_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor]


class SpiderSegments(NamedTuple):
    """What segmentation hands the recurrent block: fp32 `boundaries`, `boundary_probs` `(B, L)`,
    normed `segments` `(B, 1+S, D)`, their Engram `memory` `(B, 1+S, M)`, `segment_mask` bool
    `(B, 1+S)`, RoPE and mask, and the rows the MoE routes: `segment_index` int64 `(N,)` or
    `routed_mask` `(B, 1+S)` bool (the rest routed with weight 0), None for all."""

    boundaries: torch.Tensor
    boundary_probs: torch.Tensor
    segments: torch.Tensor
    memory: torch.Tensor
    segment_mask: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor | None
    segment_index: torch.Tensor | None
    routed_mask: torch.Tensor | None


class SpiderModel(SpiderPreTrainedModel, SpiderDecodingMixin):
    """The Spider trunk: bytes -> prelude -> boundaries -> looped recurrent block over segments ->
    coda (module names: docs/design.md, "Names that FP8 and PEFT rely on")."""

    # Routing, boundary and halting decisions stay fp32; the two lists must not share an entry.
    _keep_in_fp32_modules = [
        "recurrent_block.halt_predictor",
        "flexitokens.boundary_predictor",
        "recurrent_block.layers.*.router",
    ]
    _keep_in_fp32_modules_strict = [
        "halt_predictor.weight",
        "halt_predictor.bias",
        "boundary_predictor.dense",
        "boundary_predictor.out_proj",
        "mlp.router",
    ]

    def __init__(self, config: SpiderConfig):
        super().__init__(config)
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.rotary_emb = SpiderRotaryEmbedding(config)
        self.prelude_layers = nn.ModuleList(SpiderDecoderLayer(config, i) for i in range(config.num_prelude_layers))
        self.engram_embeddings = SpiderEngramEmbeddings(config)
        self.flexitokens = SpiderFlexiTokens(config)
        self.recurrent_block = SpiderRecurrentBlock(config, self.engram_embeddings.output_size)
        first = config.num_prelude_layers + config.num_recurrent_layers
        self.coda_layers = nn.ModuleList(SpiderDecoderLayer(config, first + i) for i in range(config.num_coda_layers))
        self.norm = SpiderRMSNorm(D, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def check_inputs(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        n_loops: int,
        cache: SpiderCache | None = None,
    ) -> None:
        """Raises:
        TypeError: non-integer `input_ids`.
        ValueError: a shape other than `(B >= 1, L >= 1)`, ids on another device or outside `[0, vocab_size)`, more
            than `max_position_embeddings` bytes (the cache's included), `n_loops` not an int >= 1 or not the cache's,
            an `attention_mask` of another shape.
        """
        max_length = self.config.max_position_embeddings
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.LongTensor of shape (batch, length), got {type(input_ids).__name__}"
            )
        dtype = input_ids.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {dtype}")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(
                f"input_ids must have shape (batch, length) with batch, length >= 1, got {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] > max_length:
            raise ValueError(f"input length {input_ids.shape[1]} exceeds max_position_embeddings={max_length}")
        weight_device = self.embed_tokens.weight.device
        if weight_device.type != "meta" and input_ids.device != weight_device:
            raise ValueError(
                f"input_ids is on {input_ids.device} but the model's embeddings are on {weight_device}: "
                "build the inputs on model.device (or move them with .to(model.device))"
            )
        bad = (input_ids < 0) | (input_ids >= self.config.vocab_size)
        check_values(
            bad,
            self.training,
            lambda on_host: (
                f"input_ids contains token id {int(input_ids[bad][0]) if on_host else '(on device)'}, "
                f"outside the vocabulary [0, {self.config.vocab_size})"
            ),
        )
        if not isinstance(n_loops, int) or isinstance(n_loops, bool) or n_loops < 1:
            raise ValueError(f"n_loops must be an integer >= 1, got {n_loops!r}")
        if cache is not None and n_loops != cache.n_loops:
            raise ValueError(f"n_loops={n_loops} differs from the n_loops={cache.n_loops} this cache was built with")
        decoding = cache is not None and cache.seen_bytes > 0
        if decoding and cache.seen_bytes + input_ids.shape[1] > max_length:
            raise ValueError(
                f"decoding past max_position_embeddings={max_length}: the cache holds {cache.seen_bytes} "
                f"bytes and {input_ids.shape[1]} more were given; generate at most {max_length} bytes in "
                "total (prompt included)"
            )
        if not decoding and attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal "
                f"input_ids shape {tuple(input_ids.shape)}"
            )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # transformers 5.24's rename
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        n_loops: int | None = None,
        cache: SpiderCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> SpiderModelOutput:
        """The forward pass of the module docstring's map, one call per step.

        Args:
            input_ids: int64 `(B, L)`, ids in `[0, vocab_size)`. With a non-empty `cache`, only the
                bytes the cache has not seen (all real bytes, no padding).
            attention_mask: `(B, L)`, 1 for real bytes, 0 for padding (left or right), or None.
            n_loops: recurrent iterations (default `config.n_loops`).
            cache: a :class:`SpiderCache` from an earlier call, or None.
            use_cache: build and return a :class:`SpiderCache` (default: `config.use_cache` in eval mode).
        Raises:
            ValueError: see :meth:`check_inputs`.
        """
        n_loops = self.config.n_loops if n_loops is None else n_loops
        self.check_inputs(input_ids, attention_mask, n_loops, cache)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if cache is not None and cache.seen_bytes > 0:
            return SpiderModelOutput(**self.decode(input_ids, cache, bool(output_hidden_states)))
        cache = self.prefill_cache(cache, use_cache, n_loops)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        # collected here, not by capture_outputs: the layout holds the mixed expanded stream
        hidden_states = [] if output_hidden_states else None

        x = self.embed_tokens(input_ids)
        byte_inputs = self.byte_inputs(x, attention_mask)
        x = self.prelude(x, byte_inputs.position_embeddings, byte_inputs.attention_mask, cache, hidden_states)
        # the segment axis is exact (real rows routed by index) for a cache, returned router
        # logits or ACT early exit; else padded to a repeating length (docs/design.md)
        exact = cache is not None or output_router_logits or (self.config.act_early_exit and not self.training)
        engram_bytes = self.engram_embeddings(input_ids, byte_inputs.byte_mask)
        segments = self.segment(x, engram_bytes, byte_inputs, exact)
        block = self.recurrent_block(
            segments.segments,
            segments.position_embeddings,
            segments.attention_mask,
            segments.segment_index,
            segments.memory,
            n_loops,
            cache,
            output_router_logits,
            segments.routed_mask,
        )
        y = self.flexitokens.expand(segments.boundaries, block.h_out, x)
        y = self.coda(y, byte_inputs.position_embeddings, byte_inputs.attention_mask, cache, hidden_states)
        if cache is not None:
            cache.start(
                input_ids, x.detach(), engram_bytes.detach(), segments.boundaries, byte_inputs.token_mask, block.h_out
            )
        return SpiderModelOutput(
            last_hidden_state=y,
            cache=cache,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            router_logits=tuple(block.router_logits) if output_router_logits else None,
            boundaries=segments.boundaries,
            boundary_probs=segments.boundary_probs,
            segment_mask=segments.segment_mask.to(torch.float32),
            halting_step=block.act.n_updates,
            halting_remainder=block.act.remainders,
            expert_loads=tuple(block.expert_loads),
            mean_scores=tuple(block.mean_scores),
            loop_weights=torch.stack(block.loop_weights, -1) if output_router_logits else None,
        )

    def byte_inputs(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> SpiderBytes:
        """Masks and positions of the embedded bytes `x` `(B, L, D)`; one host read of
        `attention_mask` tells whether any byte is padding."""
        B, L, _ = x.shape
        token_mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            token_mask = attention_mask.bool()
            position_ids = (token_mask.long().cumsum(-1) - 1).clamp(min=0)
            byte_mask = token_mask
        else:
            position_ids = torch.arange(L, device=x.device).expand(B, L)
            byte_mask = torch.ones(B, L, dtype=torch.bool, device=x.device)
        mask = self.attention_mask(x, L, token_mask, self.config.sliding_window)
        rope = self.rotary_emb(x, position_ids)
        return SpiderBytes(token_mask, byte_mask, position_ids, mask, rope)

    def attention_mask(
        self,
        inputs: torch.Tensor,
        kv_length: int,
        token_mask: torch.Tensor | None = None,
        sliding_window: int | None = None,
        q_offset: int = 0,
        mask_function: Callable | None = None,
    ) -> torch.Tensor | BlockMask | None:
        """The mask of :func:`attention_mask_function` (`token_mask`, `sliding_window`), or of a
        decode step's `mask_function`, for the queries of `inputs` `(B, T_q, D)` over `kv_length`
        keys, in the attention implementation's format (:func:`create_attention_mask`)."""
        if mask_function is None:
            mask_function = attention_mask_function(token_mask, sliding_window)
        return create_attention_mask(self.config, inputs, kv_length, mask_function, q_offset)

    def prelude(self, x, position_embeddings, attention_mask, cache, hidden_states):
        """The prelude layers over the embedded bytes `x` `(B, L, D)` (:meth:`byte_layers`)."""
        caches = None if cache is None else cache.prelude
        return self.byte_layers(self.prelude_layers, caches, x, position_embeddings, attention_mask, hidden_states)

    def coda(self, y, position_embeddings, attention_mask, cache, hidden_states):
        """The coda layers and the final norm over `y` `(B, L, D)`, the segments mixed into the
        byte stream (:meth:`byte_layers`)."""
        caches = None if cache is None else cache.coda
        y = self.byte_layers(self.coda_layers, caches, y, position_embeddings, attention_mask, hidden_states)
        return self.norm(y)

    @staticmethod
    def byte_layers(layers, caches, x, position_embeddings, attention_mask, hidden_states):
        """Dense byte `layers` over `x` `(B, L, D)` with their `caches` (or None), appending `x`
        and each output to `hidden_states` (or None). Returns `(B, L, D)`."""
        if hidden_states is not None:
            hidden_states.append(x)
        for i, layer in enumerate(layers):
            x = layer(x, position_embeddings, attention_mask, cache=caches[i] if caches is not None else None)
            if hidden_states is not None:
                hidden_states.append(x)
        return x

    def segment(
        self, x: torch.Tensor, engram_bytes: torch.Tensor, byte_inputs: SpiderBytes, exact: bool
    ) -> SpiderSegments:
        """Segmentation (FlexiTokens): boundaries, the segments and their Engram memory pooled with the same
        boundaries, their positions and mask. `exact`: the segment axis as long as the longest row (routing picks the
        real rows by index), else padded to `pad_segments_to_multiple_of` (padding routed with weight 0)."""
        boundaries, boundary_probs, e, memory, segment_mask = self.flexitokens(
            x,
            engram_bytes,
            byte_inputs.byte_mask,
            byte_inputs.position_ids,
            1 if exact else self.config.pad_segments_to_multiple_of,
        )
        B, S1 = segment_mask.shape
        rope = self.rotary_emb(e, torch.arange(S1, device=e.device).expand(B, S1))
        window = self.config.recurrent_sliding_window
        segments = (boundaries, boundary_probs, e, memory, segment_mask, rope)
        if not exact:  # padding sits at each row's end: the causal mask hides it
            mask = self.attention_mask(e, S1, None, window)
            return SpiderSegments(*segments, mask, None, segment_mask)
        padded = not bool(segment_mask.all())
        mask = self.attention_mask(e, S1, segment_mask if padded else None, window)
        # the rows the MoE routes, once here rather than per loop and layer
        index = segment_mask.reshape(-1).nonzero().squeeze(1) if padded else None
        return SpiderSegments(*segments, mask, index, None)


class SpiderForConditionalGeneration(SpiderPreTrainedModel, SpiderGenerationMixin):
    """Spider with a byte LM head; `generate()` decodes incrementally (:class:`SpiderCache`; the
    hooks ``generate()`` calls are :class:`SpiderGenerationMixin`'s, in `generation_spider.py`)."""

    # SpiderModel's fp32 modules under this class's names, and the output logits
    _keep_in_fp32_modules = ["lm_head", *(f"model.{name}" for name in SpiderModel._keep_in_fp32_modules)]
    _keep_in_fp32_modules_strict = ["lm_head.weight"]
    _tied_weights_keys = {}
    get_compiled_call = SpiderGenerationMixin.get_compiled_call  # not PreTrainedModel's: the decode step's regions

    def __init__(self, config: SpiderConfig):
        super().__init__(config)
        self.model = SpiderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=torch.float32)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        n_loops: int | None = None,
        cache: SpiderCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> SpiderCausalLMOutput:
        """Args as :meth:`SpiderModel.forward`, plus `labels` int64 `(B, L)` (-100: ignored),
        `num_items_in_batch`, `shift_labels` and `logits_to_keep` (k > 0: the last k positions; a
        1-D tensor: those; 0: all). Returns logits `(B, L, vocab_size)` and every loss term.

        Raises:
            ValueError: as :meth:`SpiderModel.check_inputs`; mis-shaped labels, labels with a
                non-empty cache or with `logits_to_keep`.
        """
        if labels is not None and cache is not None and cache.seen_bytes > 0:
            raise ValueError("labels cannot be scored against a non-empty cache; pass the whole sequence")
        shift_labels = kwargs.get("shift_labels")  # pre-shifted targets (sequence parallelism)
        if self.is_decode_step(input_ids, cache, output_hidden_states, logits_to_keep, kwargs):
            return self.decode_step(input_ids, cache, n_loops)
        keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
        if (labels is not None or shift_labels is not None) and not keep_all:
            raise ValueError(f"logits_to_keep={logits_to_keep!r} with labels: the loss needs every position's logits")
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            n_loops=n_loops,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            return_dict=True,
            **{k: v for k, v in kwargs.items() if k == "output_attentions"},
        )
        hidden_states = outputs.last_hidden_state
        if not keep_all:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            hidden_states = hidden_states[:, keep, :]
        logits = self.lm_head(as_weight_dtype(self.lm_head, hidden_states))
        loss = lm_loss = None
        if labels is not None or shift_labels is not None:
            loss = lm_loss = self.lm_loss(logits, input_ids, labels, shift_labels, num_items_in_batch)
        # a decode step (no segment mask) has no loss terms
        terms = {} if outputs.segment_mask is None else self.loss_terms(outputs, input_ids, attention_mask)
        if loss is not None:
            for coef, name in (
                (self.config.router_aux_loss_coef, "aux_loss"),
                (self.config.boundary_loss_coef, "boundary_loss"),
                (self.config.ponder_loss_coef, "ponder_loss"),
            ):
                if coef != 0:  # a term weighted 0 would add only its backward through the loops
                    loss = loss + coef * terms[name]
        return SpiderCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            lm_loss=lm_loss,
            **terms,
            attentions=outputs.attentions,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            **{
                name: getattr(outputs, name)
                for name in ("boundaries", "boundary_probs", "segment_mask", "halting_step", "loop_weights")
            },
        )

    def is_decode_step(self, input_ids, cache, output_hidden_states, logits_to_keep, kwargs) -> bool:
        """Whether :meth:`forward` is a ``generate()`` decode step that :meth:`decode_step` serves: one new byte per
        row after a non-empty `cache`, no labels, no hidden states or attentions asked for, the one position's
        logits."""
        return (
            cache is not None
            and cache.seen_bytes > 0
            and isinstance(input_ids, torch.Tensor)
            and input_ids.dim() == 2
            and input_ids.shape[1] == 1
            and not (self.config.output_hidden_states if output_hidden_states is None else output_hidden_states)
            and not kwargs.get("output_attentions", self.config.output_attentions)
            and kwargs.get("shift_labels") is None
            and isinstance(logits_to_keep, int)
            and logits_to_keep in (0, 1)
        )

    def decode_step(
        self, input_ids: torch.LongTensor, cache: SpiderCache, n_loops: int | None
    ) -> SpiderCausalLMOutput:
        """One decode step of ``generate()``: one new byte per row, int64 `input_ids` `(B, 1)`, after `cache`,
        through :meth:`SpiderModel.decode_byte` and the LM head, without the full forward's output capturing and the
        base model's output (which cost about a tenth of a compiled byte's step on CPU). Returns the outputs the full
        forward returns for it: `logits` `(B, 1, vocab_size)`, the cache and the byte's `boundaries` fp32 `(B, 1)`.

        Raises:
            ValueError: as :meth:`SpiderModel.check_inputs`; a full static cache.
        """
        n_loops = self.config.n_loops if n_loops is None else n_loops
        self.model.check_inputs(input_ids, None, n_loops, cache)
        hidden_states, boundaries, _ = self.model.decode_byte(input_ids, cache)
        logits = self.lm_head(as_weight_dtype(self.lm_head, hidden_states))
        return SpiderCausalLMOutput(logits=logits, cache=cache, boundaries=boundaries)

    def lm_loss(
        self,
        logits: torch.Tensor,
        input_ids: torch.LongTensor,
        labels: torch.LongTensor | None,
        shift_labels: torch.LongTensor | None,
        num_items_in_batch,
    ) -> torch.Tensor:
        """Next-byte cross-entropy in nats, fp32 scalar, of `logits` `(B, L, V)` against `labels` `(B, L)` (shifted
        inside) or `shift_labels`, summed over `num_items_in_batch` targets (default: the targets here).

        Raises:
            ValueError: `labels` of another shape than `input_ids`, an id outside the vocabulary.
        """
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        targets = shift_labels if shift_labels is not None else labels[:, 1:]
        bad = (targets != -100) & ((targets < 0) | (targets >= self.vocab_size))
        check_values(
            bad,
            self.training,
            lambda on_host: (
                f"labels contains token id {int(targets[bad][0]) if on_host else '(on device)'}, "
                f"outside the vocabulary [0, {self.vocab_size}) (-100 = ignored)"
            ),
        )
        if num_items_in_batch is None:  # a tensor count: no host sync
            num_items_in_batch = (targets != -100).sum().clamp_min(1)
        return self.loss_function(
            logits, labels, self.vocab_size, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels
        )

    def loss_terms(
        self, outputs: SpiderModelOutput, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The loss terms and diagnostics of :class:`SpiderCausalLMOutput` from the base model's
        `outputs` for `input_ids` `(B, L)`; fp32, the diagnostics detached."""
        byte_mask = None if attention_mask is None else attention_mask.bool()
        segment_weight = outputs.segment_mask
        ponder_loss = ((outputs.halting_step + outputs.halting_remainder) * segment_weight).sum()
        ponder_loss = ponder_loss / segment_weight.sum()
        mean_halting_step = ((outputs.halting_step * segment_weight).sum() / segment_weight.sum()).detach()
        boundary_loss, rate = boundary_rate_loss(outputs.boundaries, byte_mask, self.config)
        if self.config.boundary_teacher is not None:
            teacher_mask = torch.ones_like(input_ids, dtype=torch.bool) if byte_mask is None else byte_mask
            boundary_loss = boundary_loss + self.config.boundary_teacher_coef * boundary_teacher_loss(
                outputs.boundary_probs, input_ids, teacher_mask, self.config.boundary_teacher
            )
        aux_losses = [(load * scores).sum() for load, scores in zip(outputs.expert_loads, outputs.mean_scores)]
        return dict(
            aux_loss=torch.stack(aux_losses).mean(),
            boundary_loss=boundary_loss,
            ponder_loss=ponder_loss,
            compression_rate=(1.0 / rate.clamp_min(1.0 / max(input_ids.shape[1], 1))).detach(),
            mean_halting_step=mean_halting_step,
            expert_load=torch.stack(outputs.expert_loads).mean(0).detach(),
        )


# --------------------------------------------------------------------------------------------------
# Loading: older releases' checkpoints (conversion_spider.py), the Auto classes
# --------------------------------------------------------------------------------------------------


# overwrite: this file is imported once per location (repository root, remote-code copies)
register_checkpoint_conversion_mapping(SpiderConfig.model_type, older_checkpoint_conversions(), overwrite=True)


SpiderConfig.register_for_auto_class()
SpiderModel.register_for_auto_class("AutoModel")
SpiderForConditionalGeneration.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "SpiderPreTrainedModel",
    "SpiderModel",
    "SpiderForConditionalGeneration",
    "SpiderExperts",
    "SpiderMoE",
    "SpiderMoEKernels",
    "expand_segments",
    "pool_segments",
]
