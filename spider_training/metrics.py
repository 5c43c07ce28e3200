"""Held-out metrics: bits per byte, counted in bytes (summed next-byte cross-entropy over the predicted bytes).

:func:`byte_nll` (summing :func:`per_byte_nll`) is the one computation; :func:`bits_per_byte` scores a model over a
loader of byte windows (:mod:`spider_training.evaluation` over a text, by byte kind too), and
:func:`compute_bits_per_byte` is the ``compute_metrics`` of :class:`~spider_training.trainer.SpiderTrainer`, whose
``prediction_step`` hands Trainer's evaluation loop each row's :func:`byte_nll`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F


def per_byte_nll(logits: torch.Tensor, labels: torch.LongTensor) -> torch.Tensor:
    """Next-byte cross-entropy of every predicted byte: fp32 ``(B, L - 1)`` in nats, 0 where the label is -100.

    Args:
        logits: ``(B, L, V)`` any float dtype (computed in fp32).
        labels: int64 ``(B, L)`` aligned with the inputs (shifted here), -100 ignored.
    """
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")


def byte_nll(
    logits: torch.Tensor, labels: torch.LongTensor, per_byte: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-byte cross-entropy summed per row (:func:`per_byte_nll`, summed in fp64).

    Args:
        logits: ``(B, L, V)`` any float dtype (computed in fp32).
        labels: int64 ``(B, L)`` aligned with the inputs (shifted here), -100 ignored.
        per_byte: :func:`per_byte_nll` of the same `logits` and `labels` where the caller has it already.
    Returns:
        ``(nll, n_bytes)``: float64 ``(B,)`` summed negative log-likelihood in nats, and int64 ``(B,)`` the number
        of predicted bytes per row.
    """
    nll = per_byte_nll(logits, labels) if per_byte is None else per_byte
    return nll.double().sum(1), (labels[:, 1:] != -100).sum(1)


def _summary(nll_sum: float, n_bytes: float, rate_mean: float, halting_mean: float) -> dict[str, float]:
    if n_bytes == 0:
        raise ValueError("bits_per_byte: the held-out data held no predicted byte (empty source or all labels -100)")
    lm_loss = nll_sum / n_bytes
    return {
        "bits_per_byte": lm_loss / math.log(2),
        "lm_loss": lm_loss,
        "compression_rate": rate_mean,
        "mean_halting_step": halting_mean,
        "bytes": int(n_bytes),
    }


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
    """Next-byte cross-entropy in bits per predicted byte, in eval mode (deterministic boundaries), outside a Trainer.

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
            nll, n_bytes = byte_nll(out["logits"], labels)
            totals += torch.stack(
                [
                    nll.sum(),
                    n_bytes.sum().double(),
                    out["compression_rate"].double(),
                    out["mean_halting_step"].double(),
                ]
            )
            n_batches += 1
    finally:
        model.train(was_training)
    counts = torch.tensor([n_batches], dtype=torch.float64, device=device)
    if reduce is not None:
        totals, counts = reduce(totals, "sum"), reduce(counts, "sum")
    nll_sum, n_bytes, rate_sum, halting_sum = totals.tolist()
    return _summary(nll_sum, n_bytes, rate_sum / max(counts.item(), 1), halting_sum / max(counts.item(), 1))


def compute_bits_per_byte(eval_pred) -> dict[str, float]:
    """``compute_metrics`` for Trainer's evaluation loop over :meth:`SpiderTrainer.prediction_step`'s rows.

    Args:
        eval_pred: a ``transformers.EvalPrediction`` whose ``predictions`` are float64 ``(N, 3)``, one row per
            held-out window (summed next-byte NLL in nats, its batch's compression rate in bytes per segment, its
            batch's mean ACT halting step) and whose ``label_ids`` are ``(N,)`` predicted bytes per window.
    Returns:
        ``{"bits_per_byte", "loss" (nats per byte, Trainer's ``eval_loss``), "lm_loss", "compression_rate",
        "mean_halting_step" (means over windows; absent for a model without segments or ACT), "bytes"}``.
    Raises:
        ValueError: no window held a single predicted byte.
    """
    rows, n_bytes = np.asarray(eval_pred.predictions, dtype=np.float64), np.asarray(eval_pred.label_ids)
    summary = _summary(
        float(rows[:, 0].sum()), float(n_bytes.sum()), float(rows[:, 1].mean()), float(rows[:, 2].mean())
    )
    # a model without segments or ACT (NaN rows) reports neither
    summary = {name: value for name, value in summary.items() if not (isinstance(value, float) and math.isnan(value))}
    return {**summary, "loss": summary["lm_loss"]}
