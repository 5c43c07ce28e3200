"""The models an ``experiments.quality`` row trains: Spider's ``small`` preset, its byte layers alone
(:class:`BytePathOnly`), the dense ``LlamaForCausalLM`` at equal parameters (:data:`LLAMA_BASELINE`) and the same with
Spider's local window (``MistralForCausalLM``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import set_seed

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration, attention_mask_function, create_attention_mask
from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

#: the dense baseline: 7 layers, hidden 256, 4 heads, SwiGLU 768 (6.1M parameters, like Spider small)
LLAMA_BASELINE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)


class BytePathOnly(torch.nn.Module):
    """The "global path removed" ablation: Spider's own byte layers alone -- `embed_tokens -> prelude -> coda ->
    norm -> lm_head` -- with no boundaries, segments, recurrent block or upsampling. Same byte layers, same init.
    ``config`` is the Spider config it came from (what the trainer reads)."""

    def __init__(self, spider: SpiderForConditionalGeneration):
        super().__init__()
        trunk = spider.model
        self.layers = torch.nn.ModuleList([*trunk.prelude_layers, *trunk.coda_layers])
        self.config, self.sliding_window = spider.config, spider.config.sliding_window
        self.embed_tokens, self.rotary_emb, self.norm, self.lm_head = (
            trunk.embed_tokens,
            trunk.rotary_emb,
            trunk.norm,
            spider.lm_head,
        )

    def forward(self, input_ids, labels=None, **_):
        from transformers.modeling_outputs import CausalLMOutput

        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        rope = self.rotary_emb(x, positions)
        mask_function = attention_mask_function(None, self.sliding_window)
        mask = create_attention_mask(self.config, x, input_ids.shape[1], mask_function)
        for layer in self.layers:
            x = layer(x, rope, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def build(kind: str, overrides: dict) -> torch.nn.Module:
    """A fresh model of `kind`: ``"spider"`` (the small preset with `overrides`), ``"bytes_only"`` (its byte layers,
    :class:`BytePathOnly`), ``"llama"`` (:data:`LLAMA_BASELINE`) or ``"llama_local"`` (the same dense model with
    Spider's byte-layer window: transformers' ``MistralForCausalLM``, Llama with sliding-window attention).
    `overrides` may name another Spider preset, ``{"preset": "tiny", ...}`` (a quick check of the wiring)."""
    overrides = dict(overrides)
    preset = overrides.pop("preset", "small")
    if kind == "llama_local":
        from transformers import MistralConfig, MistralForCausalLM

        window = SpiderConfig.from_preset("small").sliding_window
        return MistralForCausalLM(MistralConfig(**{**LLAMA_BASELINE, "sliding_window": window, **overrides}))
    if kind == "bytes_only":
        return BytePathOnly(SpiderForConditionalGeneration(SpiderConfig.from_preset(preset, **overrides)))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**{**LLAMA_BASELINE, **overrides}))
    return SpiderForConditionalGeneration(SpiderConfig.from_preset(preset, **overrides))


def initial_model(kind: str, overrides: dict, seed: int, same_init: bool = False) -> torch.nn.Module:
    """:func:`build` under ``set_seed(seed)`` (as ``train_hf.py`` builds its model); with `same_init`, a variant's
    parameters that the model without `overrides` also has (same name and shape) take that model's initial values."""
    set_seed(seed)
    model = build(kind, overrides)
    if same_init and overrides:
        set_seed(seed)
        reference = build(kind, {k: v for k, v in overrides.items() if k == "preset"}).state_dict()
        own = model.state_dict()
        model.load_state_dict(
            {k: v for k, v in reference.items() if k in own and own[k].shape == v.shape}, strict=False
        )
    return model
