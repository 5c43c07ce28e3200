"""transformers' ``DeepseekV3ForCausalLM`` at a Spider config's shape: the peer Spider's training step is measured
against (aten ops per layer application in ``tests/test_op_count.py``; step time, FLOPs and host syncs in
``python -m bench.gpu_check``'s step table), the architecture Spider's MLA attention and routed experts come from.
"""

from __future__ import annotations

import torch


def peer_config(spider_cfg):
    """transformers' ``DeepseekV3Config`` with Spider's width, heads, MLA ranks, experts, layer count and vocab.

    Layers: ``num_hidden_layers = prelude + recurrent + coda``; ``first_k_dense_replace = num_prelude_layers`` makes
    the prelude dense. DeepseekV3 cannot make a *last* layer dense (``layer_idx >= first_k_dense_replace`` is MoE),
    so the peer's coda layers are MoE layers -- a documented mismatch. Routing: one group (``n_group=topk_group=1``),
    no multi-token prediction, non-interleaved RoPE as in Spider, SDPA attention, transformers' default experts
    implementation.
    """
    from transformers import DeepseekV3Config

    c = spider_cfg
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts,
        n_routed_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim,
        v_head_dim=c.v_head_dim,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=c.num_prelude_layers,
        norm_topk_prob=c.norm_topk_prob,
        max_position_embeddings=c.max_position_embeddings,
        num_mtp_layers=0,
        rope_interleave=False,
        rms_norm_eps=c.rms_norm_eps,
        initializer_range=c.initializer_range,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        use_cache=False,
        attn_implementation="sdpa",
    )


def peer_model(spider_cfg, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A freshly initialised ``DeepseekV3ForCausalLM`` built from :func:`peer_config`."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(peer_config(spider_cfg)).to(dtype)
