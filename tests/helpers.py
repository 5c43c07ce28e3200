"""Small builders shared by the test modules."""

import torch

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration


def tiny(**overrides) -> SpiderConfig:
    """The `tiny` preset with overrides."""
    return SpiderConfig.from_preset("tiny", **overrides)


def tiny_model(seed: int = 0, **overrides) -> SpiderForConditionalGeneration:
    """A freshly initialised tiny model, reproducible for a given `seed`."""
    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(tiny(**overrides))
