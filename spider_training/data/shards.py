"""Byte shards (``.bin``): tk-train.py's headerless format (``uint16``, no header), the modded-nanogpt /
parameter-golf format (256 ``int32`` header: magic ``20240520``, version 1, token count) and ``uint8`` shards (raw
bytes, documents marked apart by an offsets file; what the byte cache of text sources writes), their
``metadata.json``, and :class:`ByteShardDataset`, the shards memory-mapped as one stream of windows."""

from __future__ import annotations

import bisect
import glob as _glob
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spider_training.data.windows import MAX_TOKEN_ID, ByteWindowDataset
from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_training.data")  # one logger for the whole package


HEADER_MAGIC = 20240520  # parameter-golf / modded-nanogpt .bin header
HEADER_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
SHARD_SUFFIX = ".bin"
METADATA_NAME = "metadata.json"

#: ``uint16`` shard formats (what ``write_shards`` writes): ``headerless`` (tk-train.py's: ``uint16`` tokens, no
#: header) and ``header`` (parameter-golf's).
SHARD_FORMATS = ("headerless", "header")
#: Raw bytes, one per byte of text: document ``i`` is ``[BOS] + bytes[offsets[i]:offsets[i + 1]] + [EOS]``, the
#: offsets read from ``NAME.docs.npy`` beside ``NAME.bin`` (without it the file is one document). Declared by that
#: file or by ``"format": "uint8"`` in ``metadata.json`` (for the whole folder, or in a shard's entry).
UINT8_FORMAT = "uint8"
DOCUMENTS_SUFFIX = ".docs.npy"
#: Deprecated format names -> their current name (``metadata.json`` files written before the rename say ``seed``).
SHARD_FORMAT_ALIASES = {"seed": "headerless"}

_ID_CHECK_CHUNK = 1 << 24  # tokens per vectorised max() when validating a shard
_UINT8_HINT = (
    f"Raw bytes (uint8) are read as such when declared: a NAME{DOCUMENTS_SUFFIX} of document offsets "
    f'beside NAME.bin, or "format": "uint8" in the folder\'s {METADATA_NAME}'
)


class ShardFormatError(ValueError):
    """A byte shard (``.bin``) or its ``metadata.json`` is malformed. ``path`` is the offending file."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        super().__init__(f"shard {self.path}: {problem}")


_EVAL_MARK = re.compile(r"(?:^|[^a-z])(val|valid|validation|eval|test|dev)(?:[^a-z]|$)", re.I)
_GLOB_CHARS = re.compile(r"[*?\[]")


def split_of_path(relative_path: str) -> str:
    """``"eval"`` if a shard/text file path (relative to its source directory) names a held-out split --
    a path component or ``_``/``-``/``.``-separated word ``val``, ``valid``, ``validation``, ``eval``, ``test`` or
    ``dev`` (``fineweb_val_000000.bin``, ``val/x.bin``) -- else ``"train"``."""
    return "eval" if _EVAL_MARK.search(relative_path) else "train"


def _glob_files(pattern: str, what: str) -> list[Path]:
    """Files matched by a (recursive, ``~``-expanded) glob, sorted. Raises FileNotFoundError naming the pattern."""
    files = sorted(Path(p) for p in _glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"{what} {pattern!r} matched no files")
    return files


# ---------------------------------------------------------------------------------------------------------------------
# Byte shards
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """One validated shard: ``format`` is ``"headerless"``, ``"header"`` or ``"uint8"``; ``uint16`` tokens start at
    ``offset`` bytes; ``num_tokens`` counts ``BOS``/``EOS`` of ``uint8`` shards too; ``documents`` is a ``uint8``
    shard's offsets file (``None``: one document)."""

    path: str
    format: str
    offset: int
    num_tokens: int
    documents: str | None = None


class DocumentBytes:
    """The token stream of documents stored as bytes (a ``uint8`` shard), sliced like the ``uint16`` array it stands
    for: document ``i`` is ``[BOS] + data[offsets[i]:offsets[i + 1]] + [EOS]`` and starts at token
    ``offsets[i] + 2 * i``. Only the tokens asked for are computed; nothing is held but the two (memory-mapped)
    arrays.

    Args:
        data: ``uint8`` ``[num_bytes]``.
        offsets: integer ``[num_documents + 1]``, non-decreasing from ``0`` to ``num_bytes`` (not checked here; see
            :func:`inspect_shard`).
    """

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return len(self.data) + 2 * (len(self.offsets) - 1)

    def _document_of(self, token: int) -> int:
        offsets = self.offsets  # token starts offsets[d] + 2 d are increasing: bisect reads log2(n) of them
        return bisect.bisect_right(range(len(offsets)), token, key=lambda d: int(offsets[d]) + 2 * d) - 1

    def __getitem__(self, key: slice) -> np.ndarray:
        """Tokens ``[key.start, key.stop)``: ``uint16`` ``[stop - start]``. Raises TypeError for anything but a slice
        of step 1."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"DocumentBytes takes a slice of step 1, got {key!r}")
        lo, hi, _ = key.indices(len(self))
        out = np.empty(max(hi - lo, 0), dtype=np.uint16)
        if hi <= lo:
            return out
        first, last = self._document_of(lo), self._document_of(hi - 1)
        docs = np.arange(first, last + 2, dtype=np.int64)
        starts = np.asarray(self.offsets[first : last + 2], dtype=np.int64) + 2 * docs  # token starts, one past last
        t = np.arange(lo, hi, dtype=np.int64)
        rel = np.searchsorted(starts, t, side="right") - 1
        bos, eos = t == starts[rel], t == starts[rel + 1] - 1
        body = ~(bos | eos)
        out[bos], out[eos] = BOS_ID, EOS_ID
        n = int(body.sum())
        if n:  # the body tokens of a slice are consecutive bytes of data
            k = int(np.argmax(body))
            start = int(t[k] - 2 * docs[rel[k]] - 1)
            out[body] = self.data[start : start + n]
        return out


def open_shard(info: ShardInfo) -> np.ndarray | DocumentBytes:
    """The tokens of a validated shard, memory-mapped: a ``uint16`` ``np.memmap`` ``[num_tokens]``, or a
    :class:`DocumentBytes` over a ``uint8`` shard."""
    if info.format != UINT8_FORMAT:
        return np.memmap(info.path, dtype=TOKEN_DTYPE, mode="r", offset=info.offset, shape=(info.num_tokens,))
    data = np.memmap(info.path, dtype=np.uint8, mode="r")
    offsets = np.load(info.documents, mmap_mode="r") if info.documents else np.array([0, len(data)], dtype=np.int64)
    return DocumentBytes(data, offsets)


def _check_ids(path: Path, offset: int, num_tokens: int) -> None:
    arr = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=offset, shape=(num_tokens,))
    for start in range(0, num_tokens, _ID_CHECK_CHUNK):
        chunk = arr[start : start + _ID_CHECK_CHUNK]
        if int(chunk.max()) > MAX_TOKEN_ID:
            i = int(np.flatnonzero(chunk > MAX_TOKEN_ID)[0])
            raise ShardFormatError(
                path,
                f"token id {int(chunk[i])} at token {start + i} is > {MAX_TOKEN_ID} "
                f"(vocab size {VOCAB_SIZE}); not a Spider uint16 byte shard (GPT-2 tokens?). "
                f"{_UINT8_HINT}",
            )
    del arr


def inspect_shard(
    path: str | os.PathLike,
    *,
    check_ids: bool = True,
    fmt: str | None = None,
    documents: str | os.PathLike | None = None,
) -> ShardInfo:
    """Validate one ``.bin`` shard and detect its format.

    A ``uint8`` shard is one declared so (``fmt="uint8"``) or one with a ``NAME.docs.npy`` beside it. Otherwise the
    header format is recognised by the magic ``20240520`` in the first 4 bytes; it must then have version 1 and a
    file size of exactly ``1024 + 2 * header[2]``. (A headerless shard cannot start with the magic: as ``uint16`` its
    first two tokens would be 54600 and 308, both > 271.) Anything else is read as headerless.

    Args:
        check_ids: scan all tokens (vectorised ``max`` over the memmap, 16M tokens per step) for ids > 271; for a
            ``uint8`` shard, check that its document offsets never decrease (every byte is a legal id).
        fmt: ``"uint8"``, or ``None`` to detect the format as above.
        documents: a ``uint8`` shard's offsets file (``.npy``, integer ``[num_documents + 1]``, ``0`` to the file
            size); default ``NAME.docs.npy`` beside the shard if it exists, else the file is one document.

    Raises:
        FileNotFoundError: no such file. ShardFormatError (a ``ValueError``; message and ``.path`` name the file):
            empty file, odd byte length, truncated header, wrong version, a header-like file with a wrong magic,
            token count inconsistent with the file size, zero tokens, token id > 271; for a ``uint8`` shard, an
            offsets file that cannot be read, is not 1-D integers, or does not run from 0 to the file size.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"shard {p}: no such file")
    size = p.stat().st_size
    if size == 0:
        raise ShardFormatError(p, "file is empty (0 bytes)")
    sidecar = p.with_suffix(DOCUMENTS_SUFFIX)
    if fmt == UINT8_FORMAT or (fmt is None and documents is None and sidecar.is_file()):
        if documents is None and sidecar.is_file():
            documents = sidecar
        return _inspect_uint8(p, size, documents, check_ids)
    if fmt not in (None, *SHARD_FORMATS):
        raise ShardFormatError(p, f"unknown format {fmt!r} (expected {', '.join(SHARD_FORMATS)} or {UINT8_FORMAT})")
    with open(p, "rb") as f:
        head = f.read(HEADER_BYTES)
    magic = int.from_bytes(head[:4], "little", signed=True) if size >= 4 else None
    if magic == HEADER_MAGIC:
        if size < HEADER_BYTES:
            raise ShardFormatError(
                p, f"starts with header magic {HEADER_MAGIC} but has only {size} bytes (< {HEADER_BYTES}-byte header)"
            )
        header = np.frombuffer(head, dtype="<i4")
        if int(header[1]) != HEADER_VERSION:
            raise ShardFormatError(p, f"header version {int(header[1])} is not supported (expected {HEADER_VERSION})")
        count = int(header[2])
        expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * count
        if count < 0 or size != expected:
            raise ShardFormatError(
                p, f"header token count {count} needs {expected} bytes but the file has {size} (truncated or corrupt)"
            )
        if count == 0:
            raise ShardFormatError(p, "header shard holds 0 tokens")
        info = ShardInfo(str(p), "header", HEADER_BYTES, count)
    else:
        if size >= HEADER_BYTES:
            header = np.frombuffer(head, dtype="<i4")
            count = int(header[2])
            if int(header[1]) == HEADER_VERSION and count > 0 and size == HEADER_BYTES + 2 * count:
                raise ShardFormatError(
                    p,
                    f"looks like a header shard (version 1, token count {count} matches the "
                    f"size) but its magic is {int(header[0])}, expected {HEADER_MAGIC}",
                )
        if size % TOKEN_DTYPE.itemsize:
            raise ShardFormatError(
                p,
                f"odd byte length {size}: a headerless uint16 shard needs an even size "
                f"(and a header shard starts with magic {HEADER_MAGIC}). {_UINT8_HINT}",
            )
        info = ShardInfo(str(p), "headerless", 0, size // TOKEN_DTYPE.itemsize)
    if check_ids:
        _check_ids(p, info.offset, info.num_tokens)
    return info


def _inspect_uint8(p: Path, size: int, documents: str | os.PathLike | None, check: bool) -> ShardInfo:
    """A ``uint8`` shard (see :func:`inspect_shard`)."""
    if documents is None:
        return ShardInfo(str(p), UINT8_FORMAT, 0, size + 2)
    try:
        offsets = np.load(documents, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ShardFormatError(documents, f"document offsets of {p} cannot be read: {type(e).__name__}: {e}") from e
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2:
        raise ShardFormatError(
            documents,
            f"document offsets of {p} must be 1-D integers [num_documents + 1], got {offsets.dtype} {offsets.shape}",
        )
    if int(offsets[0]) != 0 or int(offsets[-1]) != size:
        raise ShardFormatError(
            documents,
            f"document offsets of {p} run from {int(offsets[0])} to "
            f"{int(offsets[-1])}; expected 0 to the file size {size}",
        )
    n = len(offsets) - 1
    for start in range(0, n if check else 0, _ID_CHECK_CHUNK):
        step = np.diff(np.asarray(offsets[start : start + _ID_CHECK_CHUNK + 1], dtype=np.int64))
        if (step < 0).any():
            i = start + int(np.flatnonzero(step < 0)[0])
            raise ShardFormatError(documents, f"document offsets of {p} decrease at document {i}")
    del offsets
    return ShardInfo(str(p), UINT8_FORMAT, 0, size + 2 * n, str(documents))


def _read_metadata(folder: Path) -> dict | None:
    """``folder/metadata.json`` as a dict, or None without one. Raises ShardFormatError when it cannot be read."""
    meta_path = folder / METADATA_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardFormatError(meta_path, f"cannot read metadata: {e}") from e
    if not isinstance(meta, dict):
        raise ShardFormatError(meta_path, "metadata is not a JSON object")
    return meta


def _declared(path: Path, folder: Path, meta: dict | None) -> dict:
    """What ``folder``'s metadata says of the shard ``path``: ``{"fmt": "uint8", "documents": ...}`` for a ``uint8``
    shard (its entry's ``format`` or the folder's), else ``{}`` (format detected by :func:`inspect_shard`)."""
    if meta is None:
        return {}
    name = path.relative_to(folder).as_posix()
    entry = next((e for e in meta.get("shards", []) if isinstance(e, dict) and e.get("name") == name), {})
    if entry.get("format", meta.get("format")) != UINT8_FORMAT:
        return {}
    return {"fmt": UINT8_FORMAT, "documents": folder / entry["documents"] if entry.get("documents") else None}


def _check_metadata(root: Path, meta: dict | None, infos: list[ShardInfo], split: str) -> None:
    """Cross-check shards against ``root/metadata.json`` (``meta``) when it exists (written by ``write_shards``)."""
    meta_path = root / METADATA_NAME
    if meta is None:
        if any(i.format == "headerless" for i in infos):
            logger.warning(
                "no %s beside the shards in %s; reading them as headerless byte shards", METADATA_NAME, root
            )
        return
    vocab = meta.get("vocab") or {}
    for key, expected in (("pad", PAD_ID), ("bos", BOS_ID), ("eos", EOS_ID)):
        if key in vocab and vocab[key] != expected:
            raise ShardFormatError(meta_path, f"vocab {key} id is {vocab[key]}, Spider uses {expected}")
    if "vocab_size" in vocab and vocab["vocab_size"] > VOCAB_SIZE:
        raise ShardFormatError(meta_path, f"vocab_size {vocab['vocab_size']} > {VOCAB_SIZE}")
    entries = {e.get("name"): e for e in meta.get("shards", []) if isinstance(e, dict)}
    by_name = {Path(i.path).relative_to(root).as_posix(): i for i in infos}
    for name, info in by_name.items():
        entry = entries.get(name)
        if entry is None:
            logger.warning("shard %s is not listed in %s", info.path, meta_path)
            continue
        if "tokens" in entry and int(entry["tokens"]) != info.num_tokens:
            raise ShardFormatError(info.path, f"holds {info.num_tokens} tokens but {meta_path} says {entry['tokens']}")
        if SHARD_FORMAT_ALIASES.get(entry.get("format"), entry.get("format")) not in (None, info.format):
            raise ShardFormatError(info.path, f"is in {info.format} format but {meta_path} says {entry['format']}")
    for name, entry in entries.items():
        if name not in by_name and entry.get("split", split) == split:
            raise ShardFormatError(root / str(name), f"listed in {meta_path} (split {split}) but missing")


def discover_shards(source: str | os.PathLike, split: str = "train", *, check_ids: bool = True) -> list[ShardInfo]:
    """Find and validate the ``.bin`` shards of ``source``.

    ``source``: a directory (searched recursively; files chosen for ``split`` by name, :func:`split_of_path`;
    checked against its ``metadata.json`` if present), a single ``.bin`` file, or a glob (taken as is).

    Raises:
        FileNotFoundError: missing directory/file, or no shards (for this split). ShardFormatError: see
            :func:`inspect_shard`, or a ``metadata.json`` mismatch.
    """
    source = str(source)
    path = Path(source).expanduser()
    root = None
    metas: dict[Path, dict | None] = {}  # metadata.json of each shard's folder: declares uint8 shards
    if path.is_dir():
        root = path
        files = sorted(p for p in path.rglob("*" + SHARD_SUFFIX) if p.is_file())
        if not files:
            raise FileNotFoundError(f"shard directory {path} holds no {SHARD_SUFFIX} files")
        if split not in ("train", "eval"):
            raise ValueError(f"split for shard directory {path} must be 'train' or 'eval', got {split!r}")
        files = [p for p in files if split_of_path(p.relative_to(root).as_posix()) == split]
        if not files:
            raise FileNotFoundError(
                f"shard directory {path} has no {split} shards (eval shards carry val/eval/test in their name)"
            )
    elif path.is_file():
        files = [path]
    elif _GLOB_CHARS.search(source):
        files = _glob_files(source, "shard glob")
    else:
        raise FileNotFoundError(f"shard source {source}: no such file or directory")
    infos = []
    for p in files:
        folder = root or p.parent
        if folder not in metas:
            metas[folder] = _read_metadata(folder)
        infos.append(inspect_shard(p, check_ids=check_ids, **_declared(p, folder, metas[folder])))
    if root is not None:
        _check_metadata(root, metas[root], infos, split)
    return infos


class ByteShardDataset(ByteWindowDataset):
    """Pre-encoded byte shards read through ``np.memmap`` (tk-train.py's ``LocalByteLevelDataset``; every format
    above, mixed as they come), as one concatenated stream (windows may span two files).

    Args:
        shards: a source for :func:`discover_shards` (directory / file / glob) or a list of :class:`ShardInfo`.
        seq_len: tokens per example.
        split: ``"train"`` / ``"eval"`` file selection in a directory.
        check_ids: validate ids on open (full vectorised scan); if ``False`` each window is checked when read.

    Raises:
        FileNotFoundError, ShardFormatError: see :func:`discover_shards`. ValueError: fewer than 2 tokens in total.
    """

    def __init__(
        self,
        shards: str | os.PathLike | Sequence[ShardInfo],
        seq_len: int,
        *,
        split: str = "train",
        check_ids: bool = True,
    ):
        super().__init__(seq_len)
        if isinstance(shards, (str, os.PathLike)):
            self.description = str(shards)
            shards = discover_shards(shards, split, check_ids=check_ids)
        else:
            self.description = f"{len(shards)} shards"
        self.shards = list(shards)
        if not self.shards:
            raise FileNotFoundError("no shards given")
        self.check_ids = check_ids
        self._maps: list[np.memmap] | None = None
        self._set_lengths([s.num_tokens for s in self.shards])
        if self.num_windows == 0:
            raise ValueError(f"shards {self.description} hold {self.total_tokens} token(s): nothing to train on")

    def __repr__(self) -> str:
        return (
            f"ByteShardDataset({self.description!r}, {len(self.shards)} shards, {self.total_tokens} tokens, "
            f"{self.num_windows} windows, seq_len={self.seq_len})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None  # pickling a memmap would copy its data; reopen in the worker
        return state

    def _arrays(self) -> Sequence[np.ndarray | DocumentBytes]:
        if self._maps is None:
            self._maps = [open_shard(s) for s in self.shards]
        return self._maps

    def _check_piece(self, index: int, lo: int, hi: int, piece: np.ndarray) -> None:
        if not self.check_ids and len(piece) and int(piece.max()) > MAX_TOKEN_ID:  # never for uint8 shards
            shard = self.shards[index]
            _check_ids(Path(shard.path), shard.offset + TOKEN_DTYPE.itemsize * lo, hi - lo)

    def window(self, k: int) -> np.ndarray:
        """Window ``k`` (see :meth:`ByteWindowDataset.window`).

        Raises: IndexError out of range; ShardFormatError for an id > 271 when ``check_ids=False``."""
        return super().window(k)
