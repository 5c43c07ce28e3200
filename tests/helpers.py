"""Small builders shared by the test modules."""

from pathlib import Path

import numpy as np
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


def write_seed_shard(path: Path, tokens) -> Path:
    """A headerless little-endian ``uint16`` byte shard (the seed's format) holding `tokens`; returns `path`."""
    np.asarray(tokens, dtype="<u2").tofile(path)
    return path


def write_header_shard(path: Path, tokens, *, magic=20240520, version=1, count=None) -> Path:
    """A modded-nanogpt / parameter-golf shard: 256 int32 header (`magic`, `version`, token `count`, default
    `len(tokens)`), then `tokens` as ``uint16``; returns `path`."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())
    return path
