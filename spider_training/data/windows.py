"""Encoding and packing: a document becomes ``[BOS] + utf8(text) + [EOS]`` (``uint16`` ids), documents are
concatenated into one stream and cut into windows of ``seq_len + 1`` tokens; :class:`ByteWindowDataset` is the
map-style dataset of those windows that the text and shard datasets share."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_training.data")  # one logger for the whole package


# ---------------------------------------------------------------------------------------------------------------------
# Vocabulary and file-format constants
# ---------------------------------------------------------------------------------------------------------------------

MAX_TOKEN_ID = VOCAB_SIZE - 1  # 271: highest legal id in a shard
IGNORE_INDEX = -100  # label value ignored by the loss (torch cross_entropy default)
_PIECE_CHARS = 1 << 20  # text documents longer than this are encoded piece by piece (characters or bytes per piece)


# ---------------------------------------------------------------------------------------------------------------------
# Encoding and packing
# ---------------------------------------------------------------------------------------------------------------------


def encode_document(text: str | bytes) -> np.ndarray:
    """Encode one document as ``[BOS] + utf8 bytes + [EOS]`` (docs/design.md, "Vocabulary").

    Args:
        text: a ``str`` (encoded with ``errors="replace"``, so lone surrogates become ``?``) or raw ``bytes``
            (used as they are, e.g. a parquet binary column).

    Returns:
        ``np.ndarray`` of dtype ``uint16`` and shape ``[len(utf8) + 2]``.
    """
    data = bytes(text) if isinstance(text, (bytes, bytearray, memoryview)) else text.encode("utf-8", "replace")
    out = np.empty(len(data) + 2, dtype=np.uint16)
    out[0] = BOS_ID
    out[1:-1] = np.frombuffer(data, dtype=np.uint8)
    out[-1] = EOS_ID
    return out


def _pack_views(
    documents: Iterable[np.ndarray], width: int, stats: DocumentStats | None = None
) -> Iterator[np.ndarray]:
    """Linear-time packer behind :func:`pack_windows`; yields *views* valid only until the next ``next()``."""
    buf = np.empty(width, dtype=np.uint16)
    fill = 0
    for ids in documents:
        n = len(ids)
        pos = 0
        if fill:
            take = min(width - fill, n)
            buf[fill : fill + take] = ids[:take]
            fill += take
            pos = take
            if fill < width:
                continue
            yield buf
            fill = 0
        full = (n - pos) // width
        for i in range(full):  # whole windows straight out of a long document, no copy
            yield ids[pos + i * width : pos + (i + 1) * width]
        pos += full * width
        rest = n - pos
        if rest:
            buf[:rest] = ids[pos:]
            fill = rest
    if fill >= 2:
        buf[fill:] = PAD_ID
        if stats is not None:
            stats.padded_tokens += width - fill
        yield buf
    elif fill == 1 and stats is not None:
        stats.unused_tail_tokens += 1


def pack_windows(documents: Iterable[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Concatenate encoded documents and cut them into windows of ``seq_len + 1`` tokens.

    Args:
        documents: iterable of 1-D integer arrays (e.g. :func:`encode_document` outputs).
        seq_len: model sequence length; windows have ``seq_len + 1`` tokens.

    Yields:
        ``np.ndarray`` ``uint16`` ``[seq_len + 1]`` (fresh copies). The last window is padded with ``PAD``; a final
        remainder of exactly one token (it has no target) is not yielded. Time is linear in the total length.
    """
    _check_seq_len(seq_len)
    for w in _pack_views(documents, seq_len + 1):
        yield w.copy()


def window_to_example(window: np.ndarray) -> dict[str, torch.Tensor]:
    """Turn one ``seq_len + 1`` window into a training example in transformers' causal-LM convention.

    Returns:
        ``{"input_ids": LongTensor[seq_len + 1], "labels": LongTensor[seq_len + 1]}``: ``input_ids = window`` and
        ``labels = window`` with ``PAD`` replaced by ``-100``. The model shifts the labels inside (as every
        transformers causal LM does), so a window gives exactly tk-train.py's ``seq_len`` (input, target) pairs
        ``window[:-1] -> window[1:]``.
    """
    t = torch.from_numpy(np.asarray(window, dtype=np.int64))  # always a copy (uint16 -> int64)
    labels = t.clone()
    labels[labels == PAD_ID] = IGNORE_INDEX
    return {"input_ids": t, "labels": labels}


@dataclass
class DocumentStats:
    """Counters of one pass over a source (for a streamed source: in the process that iterated it)."""

    documents: int = 0  # non-empty documents encoded
    skipped_empty: int = 0  # empty / whitespace-only / null documents skipped
    truncated: int = 0  # documents cut to ``max_doc_bytes``
    bytes: int = 0  # UTF-8 bytes encoded (without BOS/EOS)
    windows: int = 0  # windows in the stream
    padded_tokens: int = 0  # PAD tokens appended to the final window
    unused_tail_tokens: int = 0  # final single token without a target (0 or 1)
    replaced_documents: int = 0  # documents holding U+FFFD (invalid UTF-8 replaced while decoding the source)
    missing_text: int = 0  # rows without a value in the text column (key absent from a JSON line, or null)

    def no_documents_error(self, description: str, column: str) -> ValueError:
        """The error for a pass that found no non-empty document, with what was skipped and why."""
        missing = (
            f", {self.missing_text} without a value in column {column!r} (missing or null)"
            if self.missing_text
            else ""
        )
        return ValueError(
            f"text source {description} has no non-empty documents ({self.skipped_empty} empty or "
            f"whitespace-only skipped{missing})"
        )


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def _accepted(texts: Iterable[Any], stats: DocumentStats, description: str, column: str) -> Iterator[str | bytes]:
    """The documents of ``texts`` worth encoding, each counted in ``stats.documents``: rows without a value
    (``None``) are counted in ``stats.missing_text`` (one WARNING per call), empty and whitespace-only ones in
    ``stats.skipped_empty``; ``str`` documents holding U+FFFD are counted in ``stats.replaced_documents`` (one WARNING
    per call). Raises TypeError for a value that is neither ``str`` nor ``bytes``."""
    for index, text in enumerate(texts):
        if text is None:
            stats.missing_text += 1
            if stats.missing_text == 1:
                logger.warning(
                    "text source %s: row %d has no value in column %r (a JSON line without the key, or a "
                    "null); such rows are skipped and counted in stats.missing_text",
                    description,
                    index,
                    column,
                )
            continue
        if not isinstance(text, (str, bytes, bytearray, memoryview)):
            raise TypeError(
                f"text source {description}: column {column!r} holds {type(text).__name__} "
                f"(document {index}), expected str or bytes"
            )
        if isinstance(text, memoryview):
            text = bytes(text)
        if not text or text.isspace():
            stats.skipped_empty += 1
            continue
        if isinstance(text, str) and "\ufffd" in text:
            stats.replaced_documents += 1
            if stats.replaced_documents == 1:
                logger.warning(
                    "text source %s: document %d holds U+FFFD at character %d: invalid UTF-8 in the source "
                    "is replaced by U+FFFD (errors='replace'), not an error; further such documents are "
                    "counted in stats.replaced_documents",
                    description,
                    index,
                    text.index("\ufffd"),
                )
        stats.documents += 1
        yield text


def _utf8_pieces(
    text: str | bytes, piece_chars: int, max_doc_bytes: int | None, stats: DocumentStats
) -> Iterator[bytes | memoryview]:
    """The UTF-8 bytes of one document in non-empty pieces of at most ``piece_chars`` characters (bytes for
    ``bytes``), cut at ``max_doc_bytes`` bytes (counted in ``stats.truncated``); ``stats.bytes`` counts what is
    yielded. The pieces concatenate to ``text.encode("utf-8", "replace")[:max_doc_bytes]``."""
    remaining = max_doc_bytes
    view = memoryview(text) if not isinstance(text, str) else None
    for start in range(0, len(text), piece_chars):
        data = (
            text[start : start + piece_chars].encode("utf-8", "replace")
            if view is None
            else view[start : start + piece_chars]
        )
        cut = remaining is not None and len(data) > remaining  # every piece is non-empty
        if cut:
            data = data[:remaining]
            stats.truncated += 1
        if remaining is not None:
            remaining -= len(data)
        if len(data):
            stats.bytes += len(data)
            yield data
        if cut:
            break


def encode_texts(
    texts: Iterable[Any],
    stats: DocumentStats,
    description: str,
    column: str,
    max_doc_bytes: int | None,
    *,
    piece_chars: int | None = None,
) -> Iterator[np.ndarray]:
    """Encode raw documents with :func:`encode_document`, skipping (and counting in ``stats``) ``None``, empty and
    whitespace-only ones; cut documents longer than ``max_doc_bytes`` bytes (counted as ``truncated``).

    Args:
        texts: raw column values (``str``, ``bytes`` or ``None``).
        stats: counters updated in place (``documents``, ``skipped_empty``, ``missing_text``, ``truncated``,
            ``bytes``, ``replaced_documents``).
        description, column: name of the source and its column, for messages.
        max_doc_bytes: cut longer documents to this many UTF-8 bytes (``None``: keep whole).
        piece_chars: ``None`` yields one ``uint16`` array per document (``[BOS] + bytes + [EOS]``). An int yields a
            document longer than ``piece_chars`` characters (bytes for ``bytes`` input) as several arrays -- ``[BOS]``,
            the encoded pieces, ``[EOS]`` -- whose concatenation is the same; peak memory per document is then the
            decoded text plus one piece, not plus a 3-bytes-per-byte ``uint16`` copy (a single 50 MB document).

    Yields:
        ``np.ndarray`` ``uint16`` (whole documents or pieces, see ``piece_chars``).

    Logs one WARNING per call for the first ``str`` document holding U+FFFD (what ``errors="replace"`` puts in place of
    invalid UTF-8), naming the source, the document number and the character offset, and one for the first row
    without a value (``None``: a JSON line without the column, a null), which is skipped and counted in
    ``stats.missing_text``.

    Raises:
        TypeError: a value that is neither ``str`` nor ``bytes`` (names ``description`` and ``column``).
    """
    for text in _accepted(texts, stats, description, column):
        if piece_chars is None or len(text) <= piece_chars:
            ids = encode_document(text)
            if max_doc_bytes is not None and len(ids) - 2 > max_doc_bytes:
                ids = np.concatenate([ids[: max_doc_bytes + 1], ids[-1:]])
                stats.truncated += 1
            stats.bytes += len(ids) - 2
            yield ids
            continue
        yield np.array([BOS_ID], dtype=np.uint16)
        for data in _utf8_pieces(text, piece_chars, max_doc_bytes, stats):
            yield np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        yield np.array([EOS_ID], dtype=np.uint16)


def document_bytes(
    texts: Iterable[Any],
    stats: DocumentStats,
    description: str,
    column: str,
    max_doc_bytes: int | None,
    *,
    piece_chars: int = _PIECE_CHARS,
) -> Iterator[tuple[bytes | memoryview, bool]]:
    """The UTF-8 bytes of each document of ``texts``, without ``BOS``/``EOS``: what :func:`encode_texts` encodes,
    for writers that store bytes (``uint8``) and mark documents apart (the byte cache, ``uint8`` shards).

    Skips, counts, warns and truncates exactly as :func:`encode_texts` (same ``stats``).

    Yields:
        ``(piece, last)``: a document's bytes in non-empty pieces of at most ``piece_chars`` characters (bytes for
        ``bytes`` input), in order; ``last`` is True on the final piece of a document (every document has >= 1 byte).

    Raises:
        TypeError: a value that is neither ``str`` nor ``bytes`` (names ``description`` and ``column``).
    """
    for text in _accepted(texts, stats, description, column):
        pending = None
        for data in _utf8_pieces(text, piece_chars, max_doc_bytes, stats):
            if pending is not None:
                yield pending, False
            pending = data
        yield pending, True


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------

_CHUNK_TOKENS = 1 << 20  # in-memory encoded text is kept in chunks of this many tokens (2 MiB each)


class ByteWindowDataset(Dataset):
    """Map-style dataset of the windows of one concatenated token stream (a local source).

    The stream is a list of 1-D ``uint16`` arrays (in-memory chunks or memory-mapped shards) read as one sequence.
    Window ``k`` is tokens ``[k * (seq_len + 1), (k + 1) * (seq_len + 1))``; windows span array boundaries; the
    last one is padded with ``PAD``; a final single token (no target) is not used. ``len(ds)`` is the number of
    windows, ``ds[k]`` is :func:`window_to_example` of window ``k``. Shuffling, distributed sampling and resuming are
    the sampler's job (Trainer / accelerate).

    Raises:
        ValueError: invalid ``seq_len``.
    """

    def __init__(self, seq_len: int):
        super().__init__()
        _check_seq_len(seq_len)
        self.seq_len = int(seq_len)
        self.description = type(self).__name__
        self.stats = DocumentStats()
        self.total_tokens = 0
        self.num_windows = 0
        self._starts = np.zeros(1, dtype=np.int64)

    @property
    def width(self) -> int:
        """Tokens per window: ``seq_len + 1``."""
        return self.seq_len + 1

    def _set_lengths(self, lengths: Sequence[int]) -> None:
        """Lay out the stream from the lengths of its arrays; count windows, padding and the unused tail."""
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)
        self.total_tokens = int(self._starts[-1])
        full, rest = divmod(self.total_tokens, self.width)
        #: windows in the stream (``len(self)``)
        self.num_windows = full + (1 if rest >= 2 else 0)
        self.stats.windows = self.num_windows
        self.stats.padded_tokens = self.width - rest if rest >= 2 else 0
        self.stats.unused_tail_tokens = int(rest == 1)
        if rest == 1:
            logger.info("%s: final single token has no target and is not used", self.description)

    def _arrays(self) -> Sequence[np.ndarray]:
        """The stream's arrays, in order."""
        raise NotImplementedError

    def _check_piece(self, index: int, lo: int, hi: int, piece: np.ndarray) -> None:
        """Hook: validate tokens ``[lo, hi)`` of array ``index`` as they are read (shards with ``check_ids=False``)."""

    def __len__(self) -> int:
        return self.num_windows

    def window(self, k: int) -> np.ndarray:
        """Window ``k`` of the stream: ``uint16`` ``[seq_len + 1]`` (a fresh array, ``PAD``-padded at the very end).

        Raises: IndexError for ``k`` outside ``[0, num_windows)``."""
        k = int(k)
        if not 0 <= k < self.num_windows:
            raise IndexError(f"window {k} out of range [0, {self.num_windows})")
        start = k * self.width
        end = min(start + self.width, self.total_tokens)
        out = np.empty(self.width, dtype=np.uint16)
        if end - start < self.width:
            out[end - start :] = PAD_ID
        arrays = self._arrays()
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:
            lo = pos - int(self._starts[i])
            hi = min(end, int(self._starts[i + 1])) - int(self._starts[i])
            piece = arrays[i][lo:hi]
            self._check_piece(i, lo, hi, piece)
            out[pos - start : pos - start + hi - lo] = piece
            pos += hi - lo
            i += 1
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"input_ids": LongTensor[seq_len + 1], "labels": LongTensor[seq_len + 1]}`` of window ``index``
        (negative indices count from the end). Raises IndexError out of range (so ``list(ds)`` works)."""
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{type(self).__name__} indices must be integers, got {type(index).__name__}")
        index = int(index)
        if index < 0:
            index += self.num_windows
        return window_to_example(self.window(index))

    def iter_windows(self) -> Iterator[np.ndarray]:
        """All windows in stream order (``uint16`` ``[seq_len + 1]``)."""
        for k in range(self.num_windows):
            yield self.window(k)
