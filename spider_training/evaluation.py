"""Held-out evaluation of a Spider model: how a user judges a release or a run (``spider-evaluate``).

The project's quality measure is held-out bits per byte: the summed next-byte cross-entropy over the predicted bytes
(:func:`spider_training.metrics.byte_nll`, the trainer's own computation) divided by their number and by ln 2. This
module scores a model on the held-out slice every published figure uses, or on any text, also by the kind of byte
predicted and at other loop counts; ``spider-evaluate`` (:mod:`spider_training.commands.evaluate`) runs it on a saved
release. ``experiments.quality`` builds its results tables from the same functions.

The held-out slice: the SOTU addresses from 2000 on (:func:`corpus_bytes` ``"eval"``), a 32 KB slice starting a third
of the way in, as non-overlapping windows of 257 ids (:func:`heldout_windows`). Beyond bits per byte: the kind of byte
predicted (SpaceByte's word bytes, Slagle 2024: :func:`byte_kinds`), evaluation-time probes of what a trained model's
prediction rests on (its global stream replaced, :data:`GLOBAL_STREAM_PROBES`; its boundary rule replaced,
:func:`score_with_boundary_rule`; all of them: :func:`probe_spider`), the real-word rate of samples
(:func:`sample_words`) and ``xz -9e`` on the same bytes (:func:`xz_bits_per_byte`), the compressor a byte model has to
beat.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from modeling_spider import word_bytes
from tokenization_spider import BOS_ID, PAD_ID

from .data import encode_document, sotu_documents
from .metrics import byte_nll, per_byte_nll


def corpus_bytes(split: str) -> np.ndarray:
    """The SOTU addresses of `split` ("train": before 2000, "eval": 2000 on) as one uint16 id stream
    (BOS + UTF-8 bytes + EOS per address, in year order)."""
    return np.concatenate([encode_document(d["text"]) for d in sotu_documents(split)]).astype(np.int64)


def heldout_windows(
    ids: np.ndarray, seq_len: int = 256, slice_bytes: int = 32 * 1024, start_fraction: float = 1 / 3
) -> torch.Tensor:
    """Non-overlapping windows of `seq_len + 1` ids from a `slice_bytes` slice starting at `start_fraction` of `ids`:
    int64 `(N, seq_len + 1)`; each window predicts its last `seq_len` ids from the ones before (context <= seq_len)."""
    start = int(len(ids) * start_fraction) if len(ids) > slice_bytes else 0
    piece = ids[start : start + slice_bytes]
    n = (len(piece) - 1) // seq_len
    if n < 1:
        raise ValueError(f"held-out text of {len(piece)} ids is shorter than one window of {seq_len + 1} ids")
    windows = [piece[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(windows))


def text_file_ids(path: str) -> np.ndarray:
    """The UTF-8 text file `path` as one int64 id stream (BOS + bytes + EOS; undecodable bytes become U+FFFD).

    Raises ``FileNotFoundError`` naming `path` when it is missing, ``ValueError`` when it holds no text."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"text file {path!r}: no such file")
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {path!r} holds no text")
    return encode_document(text).astype(np.int64)


#: What a predicted byte is, by its place in the text (SpaceByte's word bytes, :func:`modeling_spider.word_bytes`):
#: the keys of :func:`score`'s ``bits_per_byte_by_byte_kind``, in the order of :func:`byte_kinds`' indices.
BYTE_KINDS = (
    "space or punctuation",
    "1st byte of a word",
    "2nd byte of a word",
    "3rd byte of a word",
    "4th byte of a word",
    "5th byte of a word or later",
)


def byte_kinds(windows: torch.Tensor) -> torch.LongTensor:
    """The kind (:data:`BYTE_KINDS` index) of every predicted byte of `windows` `(N, T)` int64: `(N, T - 1)` int64
    for `windows[:, 1:]`. 0: not a word byte; k >= 1: the k-th byte of its word (5 and later share index 5). The first
    word of a window counts from the window's start (its earlier bytes are not in the window)."""
    word = word_bytes(windows)
    position = torch.arange(windows.shape[1], device=windows.device).expand_as(windows)
    last_spacelike = torch.where(word, -1, position).cummax(dim=1).values
    return torch.where(word, position - last_spacelike, 0).clamp(max=len(BYTE_KINDS) - 1)[:, 1:]


@torch.no_grad()
def score(
    model, windows: torch.Tensor, n_loops: int | None = None, batch_size: int = 16, by_byte_kind: bool = False
) -> dict:
    """Bits per predicted byte of `model` over `windows` `(N, T)`, in eval mode (summed next-byte cross-entropy,
    :func:`spider_training.metrics.byte_nll`, as the trainer scores its held-out windows); Spider's bytes per segment
    too.
    `by_byte_kind`: also ``bits_per_byte_by_byte_kind`` (bits per byte of the bytes of each :data:`BYTE_KINDS` kind)
    and ``byte_kind_shares`` (each kind's share of the predicted bytes)."""
    model.eval()
    device = next(model.parameters()).device  # the windows are built on the CPU; the model may sit on a GPU
    nll, count, seg_bytes, segs = 0.0, 0, 0.0, 0.0
    kinds = byte_kinds(windows) if by_byte_kind else None
    kind_nll = torch.zeros(len(BYTE_KINDS), dtype=torch.float64)
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(device)
        kwargs = {"n_loops": n_loops} if n_loops is not None else {}
        out = model(input_ids=batch, **kwargs)
        per_byte = per_byte_nll(out.logits, batch)
        row_nll, row_bytes = byte_nll(out.logits, batch, per_byte)  # the trainer's held-out computation
        nll += float(row_nll.sum())
        count += int(row_bytes.sum())
        if kinds is not None:
            kind_nll.index_add_(0, kinds[i : i + batch_size].reshape(-1), per_byte.double().cpu().reshape(-1))
        if getattr(out, "compression_rate", None) is not None:
            segs += batch.numel() / float(out.compression_rate)
            seg_bytes += batch.numel()
    result = {"bits_per_byte": nll / count / math.log(2)}
    if segs:
        result["bytes_per_segment"] = seg_bytes / segs
    if kinds is not None:
        counts = torch.bincount(kinds.reshape(-1), minlength=len(BYTE_KINDS)).double()
        bits = kind_nll / counts.clamp_min(1) / math.log(2)
        result["bits_per_byte_by_byte_kind"] = dict(zip(BYTE_KINDS, bits.tolist()))
        result["byte_kind_shares"] = dict(zip(BYTE_KINDS, (counts / counts.sum()).tolist()))
    return result


#: What :class:`_GlobalStreamProbe` hands the bytes instead of the trained global stream, `(B, 1+S, D) -> (B, 1+S, D)`:
#: nothing; the same content-free vector everywhere (the null segment's, segment 0, which the bytes before the first
#: boundary read); or every segment's stream one segment late (each byte reads the segment before its own).
GLOBAL_STREAM_PROBES = {
    "removed": torch.zeros_like,
    "the null segment's for every byte": lambda stream: stream[:, :1].expand_as(stream),
    "one segment late": lambda stream: torch.cat([stream[:, :1], stream[:, :-1]], dim=1),
}


class _GlobalStreamProbe:
    """Context manager: a trained Spider's global stream (``SpiderFlexiTokens.global_stream``, what each segment
    hands back to the bytes) replaced at evaluation by one of :data:`GLOBAL_STREAM_PROBES`, the same weights
    otherwise: how much of the trained model's prediction rests on what the path carries."""

    def __init__(self, model, probe: str):
        self.flexitokens, self.probe = model.model.flexitokens, GLOBAL_STREAM_PROBES[probe]

    def __enter__(self):
        flexitokens, probe, trained = self.flexitokens, self.probe, type(self.flexitokens).global_stream
        flexitokens.global_stream = lambda h_out: probe(trained(flexitokens, h_out))
        return self

    def __exit__(self, *exc):
        del self.flexitokens.global_stream  # back to the class's method


class _BoundaryRule:
    """Context manager: the trained boundary predictor of `model` decides at evaluation by another rule.

    ``"sampled"``: a byte closes a segment with probability ``p`` (a Bernoulli draw, seeded); ``"rate-matched"``: the
    threshold is the quantile of this batch's ``p`` that gives one boundary per `bytes_per_segment` bytes (the training
    run's rate). The default rule (``p > boundary_threshold``) needs no context manager."""

    def __init__(self, model, rule: str, bytes_per_segment: float | None):
        self.predictor = model.model.flexitokens.boundary_predictor
        self.rule, self.bytes_per_segment = rule, bytes_per_segment

    def __enter__(self):
        predictor, rule, rate = self.predictor, self.rule, 1.0 / (self.bytes_per_segment or 1.0)
        generator = torch.Generator().manual_seed(0)

        def decide(hidden_states, token_mask=None, position_ids=None):
            probs = torch.sigmoid(predictor.logits(hidden_states))
            if rule == "sampled":
                boundaries = (torch.rand(probs.shape, generator=generator).to(probs.device) < probs).float()
            else:
                real = probs if token_mask is None else probs[token_mask.bool()]
                boundaries = (probs > torch.quantile(real.float(), 1.0 - rate)).float()
            return (boundaries * token_mask if token_mask is not None else boundaries), probs

        predictor.forward = decide
        return self

    def __exit__(self, *exc):
        del self.predictor.forward  # back to the class's forward


def score_with_boundary_rule(model, windows: torch.Tensor, rule: str, train_bytes_per_segment: float | None) -> dict:
    """:func:`score` with the boundary decision at evaluation replaced by `rule` ("sampled" or "rate-matched")."""
    with _BoundaryRule(model, rule, train_bytes_per_segment):
        return score(model, windows)


def probe_spider(
    model, windows: torch.Tensor, train_bytes_per_segment: float | None, loop_counts: bool = True
) -> dict:
    """What a trained Spider's held-out figure on `windows` rests on (the results tables' Spider rows,
    ``spider-evaluate --probes``): ``bpb_by_loops`` (bits per byte at 1, half, the configured and twice the configured
    loop count; with `loop_counts`), ``mean_halting_step`` (ACT's, over the first 16 windows), ``act_early_exit`` (with
    ACT early exit at inference, ``config.act_early_exit``: bits per byte, mean halting step over the first 16 windows,
    loops saved per segment), ``bpb_by_global_stream_probe`` (each of :data:`GLOBAL_STREAM_PROBES`: bits per byte, and
    by the kind of byte predicted) and, unless the boundaries are fixed, ``bpb_by_eval_boundary_rule`` (the
    ``"sampled"`` and ``"rate-matched"`` rules of :func:`score_with_boundary_rule`, rate-matched to
    `train_bytes_per_segment`)."""
    cfg, out = model.config, {}
    first = windows[:16].to(next(model.parameters()).device)  # the windows are built on the CPU
    if loop_counts:
        counts = sorted({1, max(1, cfg.n_loops // 2), cfg.n_loops, 2 * cfg.n_loops})
        out["bpb_by_loops"] = {str(n): score(model, windows, n_loops=n)["bits_per_byte"] for n in counts}
    with torch.no_grad():
        out["mean_halting_step"] = float(model(input_ids=first).mean_halting_step)
    early_exit = cfg.act_early_exit
    cfg.act_early_exit = True  # halted segments skip the remaining loops
    try:
        with torch.no_grad():
            exit_steps = float(model(input_ids=first).mean_halting_step)
        exit_bpb = score(model, windows)["bits_per_byte"]
    finally:
        cfg.act_early_exit = early_exit
    out["act_early_exit"] = {
        "bits_per_byte": exit_bpb,
        "mean_halting_step": exit_steps,
        "loops_saved_per_segment": cfg.n_loops - exit_steps,
    }
    out["bpb_by_global_stream_probe"] = {}
    for probe in GLOBAL_STREAM_PROBES:
        with _GlobalStreamProbe(model, probe):
            probed = score(model, windows, by_byte_kind=True)
        out["bpb_by_global_stream_probe"][probe] = {
            "bits_per_byte": probed["bits_per_byte"],
            "by_byte_kind": probed["bits_per_byte_by_byte_kind"],
        }
    if cfg.boundary_mode != "fixed":
        out["bpb_by_eval_boundary_rule"] = {
            rule: score_with_boundary_rule(model, windows, rule, train_bytes_per_segment)
            for rule in ("sampled", "rate-matched")
        }
    return out


SAMPLE_PROMPT = "The state of the Union is"


def sample_words(
    model, train_ids: np.ndarray, n_samples: int = 16, new_bytes: int = 200, temperature: float = 0.8, seed: int = 0
) -> dict:
    """Sample `n_samples` continuations of :data:`SAMPLE_PROMPT` (`new_bytes` bytes each, temperature sampling,
    seeded) and measure how many of their words are real: the share of alphabetic words (lower-cased, punctuation
    stripped) that occur in the training addresses. Returns ``{"sample": first continuation (str),
    "real_word_rate": float in [0, 1], "real_word_samples": n_samples}`` (rows before 2026-11-25 used 4 samples, whose
    rate moved by about 0.02 from one sampling seed to the next)."""
    import re

    text = train_ids[train_ids < 256].astype(np.uint8).tobytes().decode("utf-8", "replace")
    vocabulary = set(re.findall(r"[a-z]+", text.lower()))
    prompt = torch.tensor([[BOS_ID, *SAMPLE_PROMPT.encode()]], device=next(model.parameters()).device)
    torch.manual_seed(seed)
    model.eval()
    texts = []
    with torch.no_grad():
        for _ in range(n_samples):
            out = model.generate(
                prompt,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                max_new_tokens=new_bytes,
                min_new_tokens=new_bytes,
                pad_token_id=PAD_ID,
                eos_token_id=None,
            )
            texts.append(bytes(int(i) for i in out[0, prompt.shape[1] :] if i < 256).decode("utf-8", "replace"))
    words = [w for t in texts for w in re.findall(r"[A-Za-z]+", t)]
    real = sum(w.lower() in vocabulary for w in words)
    return {
        "sample": SAMPLE_PROMPT + texts[0],
        "real_word_rate": real / max(1, len(words)),
        "real_word_samples": n_samples,
    }


def xz_bits_per_byte(windows: torch.Tensor) -> float:
    """`xz -9e` (LZMA preset 9 | extreme) on the bytes of `windows` (ids >= 256 dropped): compressed bits per byte."""
    import lzma

    ids = torch.cat([windows[0], windows[1:, 1:].reshape(-1)])  # consecutive windows share one id
    raw = bytes(int(i) for i in ids if int(i) < 256)
    return 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / len(raw)


def technical_text_ids() -> np.ndarray:
    """An unrelated technical English text every CPython ships: the Python reference topics of ``pydoc_data``
    (about 465 KB), as one BOS + bytes + EOS id stream."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return encode_document("\n\n".join(topics[k] for k in sorted(topics))).astype(np.int64)
