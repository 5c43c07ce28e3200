# Copyright 2026 The Spider authors. Licensed under the Apache License, Version 2.0.
"""Older Spider checkpoints loaded in today's layout: the conversion ``modeling_spider.py`` registers for model type
``"spider"`` with transformers' ``register_checkpoint_conversion_mapping`` (what transformers keeps for its own
models in ``transformers/conversion_mapping.py``), so that ``from_pretrained`` converts while loading and
``save_pretrained(..., save_original_format=True)`` writes the older layout back.

Ships beside ``modeling_spider.py`` (``trust_remote_code`` copies it); imports only transformers.
"""

from __future__ import annotations

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

#: older releases' names of the segmentation's parameters -> today's (docs/design.md, "Glossary"); regex -> replacement
OLDER_SEGMENTATION_KEYS = {
    r"flexitokens\.null_group": "flexitokens.null_segment",
    r"flexitokens\.down_norm\.": "flexitokens.pool_norm.",
    r"flexitokens\.upsample_norm\.": "flexitokens.expand_norm.",
}


def older_checkpoint_conversions() -> list[WeightRenaming | WeightConverter]:
    """transformers weight conversions from older releases' layouts: the per-expert routed experts
    (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``, each `(I, D)` or `(D, I)`) to
    ``SpiderExperts``' fused ``gate_up_proj`` `(E, 2I, D)` and ``down_proj`` `(E, D, I)` (``MergeModulelist`` /
    ``Concatenate``, as transformers does for Qwen2-MoE), and the segmentation's older names
    (:data:`OLDER_SEGMENTATION_KEYS`)."""
    return [
        *(WeightRenaming(old, new) for old, new in OLDER_SEGMENTATION_KEYS.items()),
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]
