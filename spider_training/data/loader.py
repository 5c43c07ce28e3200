"""The entry points: :func:`build_dataset` (a ``--data`` string to a dataset), :class:`StreamingTextDataset` (a Hub
source split by rank and packed on the fly) and :func:`make_dataloader` (a loader that reads a dataset as it is)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

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
    encode_texts,
    window_to_example,
)
from tokenization_spider import BOS_ID, PAD_ID

logger = logging.getLogger("spider_training.data")  # one logger for the whole package


#: documents read from ``datasets`` at a time by an unshuffled stream (its position is saved per read, plus the
#: document and byte within it)
STREAM_READ_DOCUMENTS = 256
#: version of :meth:`StreamingTextDataset.state_dict` (2: a one-file stream is read without ``datasets``' shuffle
#: layer, so its ``datasets`` state has another shape than version 1's)
STREAM_STATE_VERSION = 2


def _one_document_buffer_filter(record: logging.LogRecord) -> bool:
    """Drops ``datasets``' warning that a loaded shuffle state lacks its buffer's content: the streams here shuffle
    with a buffer of one document (the file order), which a state dict restores exactly."""
    return not record.getMessage().startswith("Loading a state dict of a shuffle buffer")


class StreamingTextDataset(IterableDataset):
    """A text source streamed with ``datasets`` (never downloaded or encoded whole), encoded and packed on the fly:
    Hub datasets, and local text with ``stream=True`` in :func:`build_dataset` (``--streaming``).

    Each rank reads its own part of the stream: ``datasets.distributed.split_dataset_by_node(rank, world_size)``
    (whole files per rank when the number of files is divisible by ``world_size``, else every ``world_size``-th
    document, which every rank then parses). Within a rank, dataloader workers take files ``worker_id, worker_id +
    num_workers, ...`` when the stream has at least ``num_workers`` files, else windows ``k % num_workers ==
    worker_id``. Yields the same examples as :class:`TextByteDataset` (:func:`window_to_example`).

    Shuffling (``shuffle=True``): the files in a seeded order (one process: ``datasets.concatenate_datasets`` of its
    files in the order ``numpy.random.default_rng([seed, epoch]).permutation``; a process of several reading several
    files: ``datasets``' ``IterableDataset.shuffle(seed)``, its shard order, with a buffer of one document, which reads
    example by example, 30x slower) and the documents permuted in blocks of ``shuffle_buffer``
    (``numpy.random.default_rng([seed, epoch, block])``). Unlike ``datasets``' rolling shuffle buffer, whose content
    its state dict does not hold (a resume refills it and so changes the order), a block is read again from its
    ``datasets`` position and permuted the same way, so the shuffled stream resumes exactly from a state of a few
    numbers. The order is a function of ``seed`` and the epoch (:meth:`set_epoch`).

    Resuming (:meth:`state_dict` / :meth:`load_state_dict`): the position of the next window is the ``datasets``
    position of the block holding its first byte (``IterableDataset.state_dict()``), the document within the block
    and the token within the document (a window is a contiguous cut of the token stream, so this is all the packer's
    partial-window state). Loading it, the next iteration re-reads that one block (at most ``shuffle_buffer``, or
    :data:`STREAM_READ_DOCUMENTS`, documents, none of them encoded but the one the window starts in) and continues
    with exactly the windows the uninterrupted stream would have yielded; nothing before is replayed. In a training
    run the state travels through :func:`make_dataloader`'s loader (accelerate's snapshot of it at each batch it
    hands out) into every checkpoint (``SpiderTrainer``). With dataloader workers each worker reads its own part of
    the stream and sends its position with every batch (as torchdata's ``StatefulDataLoader`` does); the loader's
    position is every worker's plus the worker of the last batch (:func:`workers_position`), and a loader with as
    many workers continues it exactly: torch's loader takes batches from its workers in turn, starting at worker 0,
    so a resumed worker ``i`` reads the part ``i`` places after the last batch's (:meth:`__iter__`).

    Use it with :func:`make_dataloader` (``SpiderTrainer`` does): accelerate's default ``prepare`` would dispatch
    (rank 0 reads for everyone) or re-shard this already rank-split stream.

    Args:
        source: a :class:`TextSource` (``TextSource.from_hub``, or :func:`open_text_source` for local files).
        seq_len, max_doc_bytes: see :class:`TextByteDataset`.
        rank, world_size: ``TrainingArguments.process_index`` and ``.world_size``.
        seed, shuffle, shuffle_buffer: see Shuffling above (``shuffle_buffer`` documents per block).

    Attributes: ``stats`` (:class:`DocumentStats` of the current pass in this process), ``documents_read`` (documents
    pulled from ``datasets`` by this object, every pass: what a resume saves).

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
        self._epoch_offset = 0  # after a resume: the saved epoch minus the epoch the trainer counts from
        self._resume_epoch: int | None = None
        self._resume: dict | None = None  # the position the next iteration starts from (load_state_dict)
        self._position: tuple | None = None  # (epoch, finished, block, source state, document, token, windows)
        self._worker_resume: dict | None = None  # a dataloader-workers position to continue (load_state_dict)
        self.worker_id: int | None = None  # in a dataloader worker: the part of the stream it reads (__iter__)
        self.stats = DocumentStats()
        self.documents_read = 0

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
        """Select the epoch (reseeds the shuffle); called by Trainer/accelerate each epoch. After
        :meth:`load_state_dict` the first call maps the caller's count onto the saved epoch (Trainer counts a
        resumed stream's epochs from 0 again)."""
        if self._resume_epoch is not None:
            self._epoch_offset = self._resume_epoch - int(epoch)
            self._resume_epoch = None
        self._epoch.fill_(int(epoch) + self._epoch_offset)

    # -- the saved position ------------------------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        """What a saved position is only valid for: the stream read, split and shuffled the same way."""
        return {
            "source": self.source.description,
            "text_column": self.source.text_column,
            "seq_len": self.seq_len,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0,
            "seed": self.seed if self.shuffle else None,
            "max_doc_bytes": self.max_doc_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position of the next window of this process's stream, JSON-serialisable: ``{"version", "layout",
        "epoch", "finished", "block", "source", "document", "token", "windows"}`` (``source``: ``datasets``'
        ``IterableDataset.state_dict()`` at the start of the block, ``None`` at the start of the stream;
        ``finished``: the epoch's last window was yielded). Cheap (no copy of the ``datasets`` state): taken at every
        batch by :func:`make_dataloader`'s loader."""
        if self._position is None:
            epoch, finished, block, source, document, token, windows = self.epoch, False, 0, None, 0, 0, 0
        else:
            epoch, finished, block, source, document, token, windows = self._position
        return {
            "version": STREAM_STATE_VERSION,
            "layout": self._layout(),
            "epoch": epoch,
            "finished": finished,
            "block": block,
            "source": source,
            "document": document,
            "token": token,
            "windows": windows,
        }

    def epoch_start_state(self) -> dict[str, Any]:
        """:meth:`state_dict` of the start of the current epoch (no window read yet)."""
        start = {"epoch": self.epoch, "finished": False, "block": 0, "source": None, "document": 0, "token": 0}
        return {**self.state_dict(), **start, "windows": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of a stream read the same way, or the position of a loader's
        dataloader workers, :func:`workers_position`): the next iteration yields exactly the windows the saved stream
        would have yielded next (the next epoch's first when ``finished``, for every worker).

        Raises:
            ValueError: ``state`` is not a stream state of this version, or it was saved by a stream read otherwise
                (another source, split, ``seq_len``, shuffle or ``max_doc_bytes``): the message names what differs.
        """
        self._worker_resume = None
        if isinstance(state, dict) and "worker_positions" in state:
            self._load_workers_position(state)
            return
        self._check_position(state)
        epoch = int(state["epoch"]) + (1 if state["finished"] else 0)
        self._resume = None if state["finished"] else dict(state)
        self._resume_epoch = epoch
        self._epoch.fill_(epoch)
        self._position = (
            (epoch, False, 0, None, 0, 0, 0)
            if state["finished"]
            else (epoch, False, state["block"], state["source"], state["document"], state["token"], state["windows"])
        )

    def _load_workers_position(self, state: dict[str, Any]) -> None:
        """:meth:`load_state_dict` of a dataloader workers' position: each worker continues from its own (in
        :meth:`__iter__`), the first batch coming from the worker after the one that gave the last batch."""
        positions, workers = state["worker_positions"], state.get("num_workers")
        if not isinstance(positions, list) or workers != len(positions) or workers < 1:
            raise ValueError(f"{self.source.description}: not a workers' stream position: {str(state)[:200]}")
        for position in positions:
            self._check_position(position)
        if len({int(p["epoch"]) for p in positions}) != 1:
            raise ValueError(f"{self.source.description}: the workers' positions are in different epochs")
        if all(p["finished"] for p in positions):  # the epoch is over: the next one starts from the beginning
            self.load_state_dict(positions[0])
            return
        epoch = int(positions[0]["epoch"])
        last = state.get("last_worker")
        self._worker_resume = {
            "num_workers": workers,
            "last_worker": last,
            "offset": 0 if last is None else (int(last) + 1) % workers,
            "positions": positions,
        }
        self._resume = None
        self._resume_epoch = epoch
        self._epoch.fill_(epoch)
        self._position = None

    def check_workers(self, num_workers: int) -> None:
        """Raise ValueError unless a loader with ``num_workers`` dataloader workers (0: none) can continue the loaded
        position: a workers' position needs as many workers (each continues its own part of the stream), a single
        position none."""
        saved = self._worker_resume["num_workers"] if self._worker_resume is not None else None
        if saved is not None and saved != num_workers:
            raise ValueError(
                f"{self.source.description}: the saved position is of {saved} dataloader workers, each with its own "
                f"part of the stream; this loader has {num_workers}: resume with --dataloader_num_workers {saved}"
            )
        if self._resume is not None and num_workers > 0:
            raise ValueError(
                f"{self.source.description}: the saved position is of a stream read in the main process; this "
                f"loader has {num_workers} dataloader workers: resume with --dataloader_num_workers 0"
            )

    def _check_position(self, state: Any) -> None:
        """Raise ValueError unless ``state`` is a :meth:`state_dict` of this stream (version and layout)."""
        if isinstance(state, dict) and isinstance(state.get("version"), int) and "layout" in state:
            if state["version"] != STREAM_STATE_VERSION:
                raise ValueError(
                    f"{self.source.description}: the saved stream position is of version {state['version']}, this "
                    f"code reads version {STREAM_STATE_VERSION} (the stream is read another way), so it cannot "
                    "continue exactly: pass --ignore_data_skip to start the stream from its beginning"
                )
        elif not isinstance(state, dict) or state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(
                f"{self.source.description}: not a stream position of version {STREAM_STATE_VERSION}: "
                f"{str(state)[:200]}"
            )
        saved, now = state["layout"], self._layout()
        if saved != now:
            differ = {
                k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
            }
            raise ValueError(
                f"the saved stream position is for another stream than {self.source.description}: "
                + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in differ.items())
                + ". Resuming it would skip or repeat documents; read the stream as the saved run did"
            )

    # -- iteration ---------------------------------------------------------------------------------------------------
    def _documents(self, epoch: int, shard: tuple[int, int] | None, resume: dict | None, where: list):
        """This rank's documents in stream order (``shuffle``: files in a seeded order, documents permuted in blocks),
        from ``resume``'s block and document on; ``where[0]`` is set to ``(block, source state, document)`` of each
        document just before it is yielded."""
        ds = self.source.dataset
        if shard is not None:
            ds = ds.shard(num_shards=shard[0], index=shard[1], contiguous=False)
        # the files this process reads: split_dataset_by_node takes effect when iterating, whole files per rank when
        # their count divides by the process count, else every world_size-th document of all of them
        files = ds.num_shards // self.world_size if ds.num_shards % self.world_size == 0 else ds.num_shards
        if self.shuffle and files > 1 and self.world_size == 1:
            # the files in a seeded order (blocks are permuted below), one after the other in Arrow batches
            import datasets

            order = np.random.default_rng([self.seed, epoch]).permutation(files)
            ds = datasets.concatenate_datasets(
                [ds.shard(num_shards=files, index=int(i), contiguous=False) for i in order]
            )
        elif self.shuffle and files > 1:
            # the file order through datasets (a split stream's files are chosen when it is iterated): its shuffle
            # layer, with a buffer of one document, reads example by example (30x slower than Arrow batches) and a
            # resume skips to the saved example one by one
            ds = ds.shuffle(seed=self.seed, buffer_size=1)
        ds.set_epoch(epoch)
        block, source_state, first = 0, None, 0
        if resume is not None:
            block, source_state, first = resume["block"], resume["source"], resume["document"]
            if source_state is not None:
                # datasets warns that the shuffle buffer's content is not in the state: it holds one document here
                logging.getLogger("datasets.iterable_dataset").addFilter(_one_document_buffer_filter)
                ds.load_state_dict(source_state)
        read = self.shuffle_buffer if self.shuffle else STREAM_READ_DOCUMENTS
        for texts in self.source.iter_batches(ds, read):
            self.documents_read += len(texts)
            order = (
                np.random.default_rng([self.seed, epoch, block]).permutation(len(texts))
                if self.shuffle
                else range(len(texts))
            )
            for document in range(first, len(texts)):
                where[0] = (block, source_state, document)
                yield texts[order[document]]
            first = 0
            block += 1
            source_state = ds.state_dict()

    def iter_windows(self, worker_id: int = 0, num_workers: int = 1) -> Iterator[np.ndarray]:
        """This rank's windows for worker ``worker_id`` of ``num_workers`` (``uint16`` ``[seq_len + 1]``), from the
        loaded position (:meth:`load_state_dict`) if any, else from the start of the epoch."""
        by_files = num_workers > 1 and self.source.num_shards >= num_workers
        resume, self._resume = self._resume, None
        epoch = int(resume["epoch"]) if resume is not None else self.epoch
        windows = int(resume["windows"]) if resume is not None else 0
        stats = self.stats = DocumentStats()
        where: list = [(0, None, 0)]
        texts = self._documents(epoch, (num_workers, worker_id) if by_files else None, resume, where)
        docs = encode_texts(
            texts,
            stats,
            self.source.description,
            self.source.text_column,
            self.max_doc_bytes,
            piece_chars=_PIECE_CHARS,
        )
        width = self.width
        buf = np.empty(width, dtype=np.uint16)
        fill = 0
        skip = int(resume["token"]) if resume is not None else 0
        document, token = where[0], 0
        for ids in docs:
            if ids[0] == BOS_ID:  # a document's first piece (bytes are < 256; a middle piece never starts so)
                document, token = where[0], 0
            if skip:  # the resumed window starts `skip` tokens into its document
                cut = min(skip, len(ids))
                ids, skip, token = ids[cut:], skip - cut, token + cut
            pos, n = 0, len(ids)
            while pos < n:
                take = min(width - fill, n - pos)
                buf[fill : fill + take] = ids[pos : pos + take]
                fill, pos, token = fill + take, pos + take, token + take
                if fill == width:
                    k, windows = windows, windows + 1
                    stats.windows += 1
                    self._position = (epoch, False, *document, token, windows)
                    if by_files or k % num_workers == worker_id:
                        yield buf.copy()
                    fill = 0
        if fill >= 2:
            buf[fill:] = PAD_ID
            stats.padded_tokens += width - fill
            k, windows = windows, windows + 1
            stats.windows += 1
            self._position = (epoch, True, 0, None, 0, 0, windows)
            if by_files or k % num_workers == worker_id:
                yield buf
        else:
            stats.unused_tail_tokens += fill
        self._position = (epoch, True, 0, None, 0, 0, windows)
        if stats.documents == 0 and resume is None:
            msg = str(stats.no_documents_error(self.source.description, self.source.text_column))
            if by_files:  # one worker's files may all be empty; the others may not
                logger.warning("%s (worker %d of %d)", msg, worker_id, num_workers)
                return
            raise ValueError(msg)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The examples of this rank's stream (:func:`window_to_example` of :meth:`iter_windows`); in a dataloader
        worker, of the worker's part. After :meth:`load_state_dict` of a workers' position, worker ``i`` of this
        iteration continues part ``(i + offset) % num_workers`` from its saved position, where part ``offset`` is the
        one after the part of the last batch handed out: torch's loader asks its workers in turn from worker 0, so
        the batches come in the uninterrupted order (a part whose epoch was over yields nothing)."""
        info = get_worker_info()
        if info is None:
            self.check_workers(0)
            self.worker_id = None
            yield from map(window_to_example, self.iter_windows())
            return
        self.check_workers(info.num_workers)
        resume, self._worker_resume = self._worker_resume, None  # this worker's copy: the first iteration only
        self.worker_id = info.id
        if resume is not None:
            self.worker_id = (info.id + resume["offset"]) % info.num_workers
            position = resume["positions"][self.worker_id]
            if position["finished"]:  # this part's epoch is over; the other parts go on
                self._position = (position["epoch"], True, 0, None, 0, 0, position["windows"])
                return
            self._resume = dict(position)
        yield from map(window_to_example, self.iter_windows(self.worker_id, info.num_workers))


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
    stream: bool = False,
) -> ByteWindowDataset | StreamingTextDataset:
    """The single entry point of the trainer: the dataset of
    ``{"input_ids": LongTensor[seq_len + 1], "labels": LongTensor[seq_len + 1]}`` for ``source``.

    A local source (``"mock"``, ``"sotu"``, byte shards, local text files) gives a map-style
    :class:`ByteWindowDataset` over the whole corpus (:class:`ByteShardDataset` or :class:`TextByteDataset`); the
    sampler shuffles and shards it. Local text and ``sotu`` are encoded once into the byte cache on disk, shared by
    every process and found again by later starts (``mock`` stays in memory). A Hub id, or any text source with
    ``stream=True``, gives a rank-split :class:`StreamingTextDataset` (read and packed on the fly, resumable from its
    saved position).

    Args:
        source: ``"mock"``, ``"sotu"``, a directory / file / glob of ``.bin`` byte shards (``uint16`` or ``uint8``),
            a local text file / glob / directory (``.txt``, ``.md``, ``.jsonl``, ``.json``, ``.csv``, ``.parquet``,
            ``.arrow``; ``.txt``/``.jsonl``/``.json``/``.csv`` also as ``.gz``/``.bz2``/``.xz``/``.zst``), a
            ``datasets.save_to_disk`` folder, a local snapshot of a Hub dataset ``folder[:config]``, or a Hub id
            ``"owner/name[:config]"`` (``"HuggingFaceFW/fineweb-edu:sample-10BT"``).
        seq_len: tokens per example.
        rank, world_size, seed, shuffle, shuffle_buffer: streamed sources only (:class:`StreamingTextDataset`);
            map-style datasets are split and shuffled by the sampler.
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
        stream: a local text source (files, ``save_to_disk`` folders, snapshots, ``sotu``, ``mock``) is streamed as
            a Hub one is (:class:`StreamingTextDataset`: no byte cache, nothing encoded up front) instead of being
            encoded into the byte cache. Byte shards are always map-style.

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
    if kind == "hub" or stream:
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
    dataset) may be smaller (``drop_last=False``). For a dataset with a position (``state_dict``: a
    :class:`StreamingTextDataset`) the loader is a ``StreamPositionLoader`` (a ``DataLoaderShard`` subclass) whose
    ``state_dict()`` is the dataset's position after the last batch it handed out (with ``num_workers > 0``, every
    worker's: :func:`workers_position`) and whose ``load_state_dict`` continues from a saved one (what
    ``SpiderTrainer`` checkpoints and resumes; ValueError for a position of another stream or another number of
    workers).
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
    if callable(getattr(dataset, "state_dict", None)):
        return _stream_position_loader()(
            dataset,
            device=torch.device(device) if device is not None else None,
            _non_blocking=non_blocking,
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


#: key of the worker's position in a batch on its way from a dataloader worker to the main process
WORKER_POSITION_KEY = "_spider_stream_worker_position"


def workers_position(positions: list[dict[str, Any]], last_worker: int | None) -> dict[str, Any]:
    """The position of a loader's dataloader workers (what its ``state_dict()`` returns, JSON-serialisable):
    ``{"version", "num_workers", "last_worker", "worker_positions"}``, ``worker_positions[i]`` being part ``i``'s
    :meth:`StreamingTextDataset.state_dict` after the last batch it gave and ``last_worker`` the part that gave the
    last batch handed out (``None``: none yet)."""
    return {
        "version": STREAM_STATE_VERSION,
        "num_workers": len(positions),
        "last_worker": last_worker,
        "worker_positions": list(positions),
    }


class _CollateWithWorkerPosition:
    """A collate function that adds, to the batch a dataloader worker built, the worker's part of the stream and its
    position after the batch's last window (``batch[WORKER_POSITION_KEY] = (part, state_dict)``): torchdata's
    ``StatefulDataLoader`` sends each worker's dataset state with its batches the same way."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, examples):
        batch = self.collate_fn(examples)
        info = get_worker_info()
        if info is not None:
            if not isinstance(batch, dict):
                raise TypeError(f"a streamed dataset's collate_fn must return a dict, got {type(batch).__name__}")
            batch[WORKER_POSITION_KEY] = (info.dataset.worker_id, info.dataset.state_dict())
        return batch


@functools.cache
def _stream_position_loader() -> type:
    """:class:`StreamPositionLoader`'s class, built on first use (accelerate is imported then)."""
    from accelerate.data_loader import DataLoaderShard
    from torch.utils.data import DataLoader

    class WorkersPositionDataLoader(DataLoader):
        """torch's ``DataLoader`` over a :class:`StreamingTextDataset` with dataloader workers that follows their
        positions: each batch arrives with its worker's (:class:`_CollateWithWorkerPosition`, removed from the batch
        here), and ``workers_position`` is the position (:func:`workers_position`) after the last batch yielded.
        Batches come from the workers in turn (``in_order``), a worker whose part ended being skipped; so a resumed
        loader whose worker 0 continues the part after the last batch's (:meth:`StreamingTextDataset.__iter__`)
        yields the uninterrupted sequence."""

        def __init__(self, dataset, *, collate_fn: Callable, **kwargs):
            super().__init__(dataset, collate_fn=_CollateWithWorkerPosition(collate_fn), **kwargs)
            self.workers_position: dict | None = None

        def start_position(self) -> dict[str, Any]:
            """The position the next iteration starts from: a loaded one, else every part at the epoch's start."""
            dataset = self.dataset
            dataset.check_workers(self.num_workers)
            resume = dataset._worker_resume
            if resume is not None:
                return workers_position(resume["positions"], resume["last_worker"])
            return workers_position([dataset.epoch_start_state()] * self.num_workers, None)

        def __iter__(self):
            state = self.workers_position = self.start_position()
            positions, last = list(state["worker_positions"]), state["last_worker"]
            iterator = super().__iter__()  # starts the workers, which copy the dataset with its loaded position
            self.dataset._worker_resume = None  # the next epoch starts afresh
            for batch in iterator:
                last, positions[last] = batch.pop(WORKER_POSITION_KEY)
                self.workers_position = workers_position(positions, last)
                yield batch
            # every part is done: the epoch is over (a part ending on a full batch had not seen its end)
            self.workers_position = workers_position([{**p, "finished": True} for p in positions], last)

    class StreamPositionLoader(DataLoaderShard):
        """accelerate's ``DataLoaderShard`` (device placement, ``GradientState``, ``set_epoch``) whose
        ``state_dict()`` is its dataset's position (:meth:`StreamingTextDataset.state_dict`) at the last batch it
        handed out: accelerate's stateful-dataloader snapshot (``_update_state_dict``, taken before its one-batch
        look-ahead), with the dataset's own state in place of torchdata's ``StatefulDataLoader``'s (not installed
        here; and transformers 5.24's Trainer neither saves nor restores a loader's state: ``SpiderTrainer`` does).
        With dataloader workers (``num_workers > 0``) it is every worker's position and the worker of the last batch
        (:func:`workers_position`, followed by ``WorkersPositionDataLoader``). ``load_state_dict`` positions the
        dataset; the next iteration continues from there."""

        def __init__(self, dataset, *, device=None, _non_blocking: bool = False, **loader_kwargs):
            super().__init__(dataset, device=device, _non_blocking=_non_blocking, **loader_kwargs)
            if loader_kwargs.get("num_workers", 0) > 0:
                self.base_dataloader = WorkersPositionDataLoader(dataset, **loader_kwargs)

        def _update_state_dict(self):
            base = self.base_dataloader
            if isinstance(base, WorkersPositionDataLoader):
                self.dl_state_dict = base.workers_position or base.start_position()
            else:
                self.dl_state_dict = self.dataset.state_dict()

        def state_dict(self):
            if self.__dict__.get("dl_state_dict") is None:
                self._update_state_dict()
            return self.dl_state_dict

        def load_state_dict(self, state_dict):
            """Position the dataset at `state_dict` (see :meth:`StreamingTextDataset.load_state_dict`).

            Raises: ValueError: not a position of this stream, or of another number of dataloader workers
                (:meth:`StreamingTextDataset.check_workers`)."""
            self.dataset.load_state_dict(state_dict)
            self.dataset.check_workers(self.base_dataloader.num_workers)
            self.dl_state_dict = None
            self._update_state_dict()

    return StreamPositionLoader
