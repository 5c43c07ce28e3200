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


def train_step(model, input_ids: torch.Tensor, seed: int = 1):
    """One training forward+backward with a fixed seed (the boundary predictor samples).

    Returns `(outputs, grads)`: the model output and `{name: gradient copy}` of every parameter that got one."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
