"""Held-out metrics: bits-per-byte of a Spider model over a loader of byte windows."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def bits_per_byte(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
    n_loops: int | None = None,
    max_batches: int | None = None,
    reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Next-byte cross-entropy in bits per predicted byte, in eval mode (deterministic boundaries).

    Args:
        model: a :class:`SpiderForConditionalGeneration` (or a wrapper returning its output).
        batches: dicts with ``input_ids`` int64 ``(B, L)`` and ``labels`` int64 ``(B, L)`` aligned with the inputs
            (shifted inside, -100 ignored); ``attention_mask`` optional.
        max_batches: stop after this many batches.
        reduce: cross-process sum (``accelerator.reduce``) so every rank returns the global figure.
    Returns:
        ``{"bits_per_byte", "lm_loss" (nats), "compression_rate" (bytes per segment), "mean_halting_step" (ACT loops
        per segment, batch mean), "bytes" (predicted bytes)}``.
        Every predicted id counts as one byte, BOS/EOS included.
    Raises:
        ValueError: no batch held a single label.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # nll, predicted bytes, compression rate, halting step
    n_batches = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            labels = batch.pop("labels")
            out = model(**batch, n_loops=n_loops)
            logits = out["logits"][:, :-1].float()
            target = labels[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum")
            totals += torch.stack([nll.double(), (target != -100).sum().double(), out["compression_rate"].double(),
                                   out["mean_halting_step"].double()])
            n_batches += 1
    finally:
        model.train(was_training)
    counts = torch.tensor([n_batches], dtype=torch.float64, device=device)
    if reduce is not None:
        totals, counts = reduce(totals, "sum"), reduce(counts, "sum")
    nll_sum, n_bytes, rate_sum, halting_sum = totals.tolist()
    if n_bytes == 0:
        raise ValueError("bits_per_byte: the held-out data held no predicted byte (empty source or all labels -100)")
    lm_loss = nll_sum / n_bytes
    return {
        "bits_per_byte": lm_loss / math.log(2),
        "lm_loss": lm_loss,
        "compression_rate": rate_sum / max(counts.item(), 1),
        "mean_halting_step": halting_sum / max(counts.item(), 1),
        "bytes": int(n_bytes),
    }
