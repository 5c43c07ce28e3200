"""transformers' ``DeepseekV3ForCausalLM`` at a Spider config's shape: the peer Spider's training step is measured
against (aten ops per layer application in ``tests/test_op_count.py``; step time, FLOPs and host syncs in
``python -m bench.gpu_check``'s step table), the architecture Spider's MLA attention and routed experts come from.
Beside it the dense peers of about a Spider model's parameter count (:func:`dense_llama_config`,
:func:`dense_peer_models`): the step table's ``llama_dense`` row and ``bench.generation``'s decoding rows.
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
        **_shared_fields(c),
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
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
    )


def _shared_fields(c) -> dict:
    """What every peer takes from the Spider config `c`: vocab, width, dense-MLP width, heads (full multi-head
    attention), norm epsilon, initialisation and special ids; no cache, SDPA attention."""
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
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


def dense_llama_config(spider_cfg, max_position_embeddings: int = 4096):
    """transformers' ``LlamaConfig`` of a dense byte model with about the parameter count of a Spider model built from
    `spider_cfg`: Spider's vocab, width, heads and dense-MLP width; the layer count is the one that brings the
    parameter count nearest to Spider's (untied embeddings, full multi-head attention, SDPA)."""
    from transformers import LlamaConfig

    from modeling_spider import SpiderForConditionalGeneration

    with torch.device("meta"):
        target = sum(p.numel() for p in SpiderForConditionalGeneration(spider_cfg).parameters())
    c = spider_cfg
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    layers = max(1, round((target - 2 * v * h - h) / per_layer))
    return LlamaConfig(
        **_shared_fields(c),
        num_hidden_layers=layers,
        max_position_embeddings=max(max_position_embeddings, c.max_position_embeddings),
        tie_word_embeddings=False,
    )


def dense_peer_models(spider_cfg, kinds: tuple[str, ...] = ("llama", "mistral")) -> dict:
    """The dense peers of a Spider config, about its parameter count (:func:`dense_llama_config`): a
    ``LlamaForCausalLM`` with full attention and a ``MistralForCausalLM`` of the same shape with local attention over
    Spider's byte window (``sliding_window``, at least 16 bytes), both eval mode, fp32; only those named in `kinds`
    are built (the Llama's weights are the same either way: it is drawn first after the seed)."""
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    llama = dense_llama_config(spider_cfg)
    mistral = MistralConfig(**{k: v for k, v in llama.to_dict().items() if k in MistralConfig().to_dict()})
    mistral.sliding_window = max(16, spider_cfg.sliding_window or 16)
    torch.manual_seed(0)
    builders = {"llama": lambda: LlamaForCausalLM(llama), "mistral": lambda: MistralForCausalLM(mistral)}
    return {kind: build().eval() for kind, build in builders.items() if kind in kinds}
