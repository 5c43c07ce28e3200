"""Tests of spider_training.data and spider_training.commands.write_shards (byte-level datasets, shards, sharding)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from spider_training import data as D
from spider_training.commands.write_shards import write_shards
from tests.helpers import write_header_shard, write_headerless_shard

TEXTS = [
    "Hello world.",
    "Ünïcödé – ∑ 日本語 🕷",
    "   ",  # whitespace only: skipped
    "",  # empty: skipped
    "The quick brown fox jumps over the lazy dog. " * 5,
    "x",
    "\n\t\n",  # whitespace only: skipped
    "Last document.",
]


# ---------------------------------------------------------------------------------------------------------------------
# independent reference (plain Python lists)
# ---------------------------------------------------------------------------------------------------------------------


def reference_stream(texts) -> list[int]:
    stream: list[int] = []
    for t in texts:
        b = t if isinstance(t, bytes) else t.encode("utf-8")
        if (t.strip() if isinstance(t, str) else b.strip()) in ("", b""):
            continue
        stream += [257] + list(b) + [258]
    return stream


def reference_windows(texts, seq_len: int) -> list[list[int]]:
    stream = reference_stream(texts)
    width = seq_len + 1
    out = []
    for i in range(0, len(stream), width):
        w = stream[i : i + width]
        if len(w) < 2:  # a lone final token has no target
            break
        out.append(w + [256] * (width - len(w)))
    return out


def reference_examples(texts, seq_len):
    return [(w, [-100 if x == 256 else x for x in w]) for w in reference_windows(texts, seq_len)]


def as_pairs(examples):
    return [(e["input_ids"].tolist(), e["labels"].tolist()) for e in examples]


def rows(batches):
    """Batches from a DataLoader -> list of (input_ids tuple, labels tuple)."""
    out = []
    for b in batches:
        for x, y in zip(b["input_ids"].tolist(), b["labels"].tolist()):
            out.append((tuple(x), tuple(y)))
    return out


def _chunks(stream, width):
    return [
        c + [256] * (width - len(c))
        for c in (stream[i : i + width] for i in range(0, len(stream), width))
        if len(c) >= 2
    ]


@pytest.fixture
def random_shards(tmp_path):
    """Two headerless shards of random ids (windows are unique with overwhelming probability)."""
    rng = np.random.default_rng(123)
    d = tmp_path / "shards"
    d.mkdir()
    a = rng.integers(0, 259, size=1000)
    b = rng.integers(0, 259, size=540)
    write_headerless_shard(d / "part_000.bin", a)
    write_headerless_shard(d / "part_001.bin", b)
    return d, np.concatenate([a, b])


# ---------------------------------------------------------------------------------------------------------------------
# packing and labels
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 7, 16, 63, 4096])
def test_text_packing_matches_reference(seq_len):
    ds = D.TextByteDataset(D.TextSource.from_texts(TEXTS, "unit texts"), seq_len)
    got = as_pairs(ds)
    want = reference_examples(TEXTS, seq_len)
    assert got == want
    assert ds.stats.skipped_empty == 3 and ds.stats.documents == 5
    for e in ds:
        assert e["input_ids"].dtype == torch.long and e["labels"].dtype == torch.long
        assert e["input_ids"].shape == e["labels"].shape == (seq_len + 1,)


def test_bos_eos_and_pad_positions():
    seq_len = 10
    ds = D.TextByteDataset(D.TextSource.from_texts(["ab", "c"], "two docs"), seq_len)
    (ex,) = list(ds)
    # stream: BOS a b EOS BOS c EOS, padded to 11 with PAD
    assert ex["input_ids"].tolist() == [257, 97, 98, 258, 257, 99, 258, 256, 256, 256, 256]
    assert ex["labels"].tolist() == [257, 97, 98, 258, 257, 99, 258, -100, -100, -100, -100]


def test_single_tail_token_is_not_emitted():
    # "abc" -> 5 tokens; width 4 -> one full window + 1 lone token (no target)
    ds = D.TextByteDataset(D.TextSource.from_texts(["abc"], "t"), 3)
    assert as_pairs(ds) == [([257, 97, 98, 99], [257, 97, 98, 99])]
    assert ds.stats.unused_tail_tokens == 1


def test_window_to_example_pad_inside_window():
    ex = D.window_to_example(np.array([257, 65, 256, 66, 258], dtype=np.uint16))
    assert ex["input_ids"].tolist() == [257, 65, 256, 66, 258]
    assert ex["labels"].tolist() == [257, 65, -100, 66, 258]


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40), max_size=12),
    seq_len=st.integers(1, 50),
)
def test_pack_windows_property(texts, seq_len):
    docs = [D.encode_document(t) for t in texts if t.strip()]
    got = [w.tolist() for w in D.pack_windows(docs, seq_len)]
    assert got == reference_windows(texts, seq_len)


def test_large_document_packs(tmp_path):
    """A 20 MB single document streams through the datasets text path and the packer (linear, no list slicing)."""
    n = 20 * 1024 * 1024
    rng = np.random.default_rng(0)
    body = rng.integers(97, 123, size=n, dtype=np.uint8).tobytes()
    f = tmp_path / "big.txt"
    f.write_bytes(body)
    seq_len = 2047
    ds = D.build_dataset(str(f), seq_len)
    total = 0
    first = last = None
    for k, w in enumerate(ds.iter_windows()):
        if k == 0:
            first = w.copy()
        last = w
        total += 1
    assert total == math.ceil((n + 2) / (seq_len + 1))
    assert first[0] == D.BOS_ID and bytes(first[1:].astype(np.uint8)) == body[:seq_len]
    tail = (n + 2) % (seq_len + 1)
    assert last[tail - 1] == D.EOS_ID and (last[tail:] == D.PAD_ID).all()
    # the public packer on the same document with a small window
    windows = D.pack_windows([D.encode_document(body)], 255)
    assert sum(1 for _ in windows) == math.ceil((n + 2) / 256)


def test_max_doc_bytes_truncates_and_counts():
    ds = D.TextByteDataset(D.TextSource.from_texts(["abcdef", "gh"], "t"), 100, max_doc_bytes=3)
    (ex,) = list(ds)
    assert ex["input_ids"].tolist()[:9] == [257, 97, 98, 99, 258, 257, 103, 104, 258]
    assert ds.stats.truncated == 1


# ---------------------------------------------------------------------------------------------------------------------
# empty documents, invalid UTF-8
# ---------------------------------------------------------------------------------------------------------------------


def test_whitespace_only_documents_are_skipped_and_counted(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in ["  ", "real text", "\n\n", "", "more"]) + "\n")
    ds = D.build_dataset(str(f), 8)
    got = as_pairs(ds)
    assert got == reference_examples(["real text", "more"], 8)
    assert ds.stats.skipped_empty == 3 and ds.stats.documents == 2


def test_all_empty_source_raises_naming_source(tmp_path):
    f = tmp_path / "blank_docs.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in [" ", "\t", ""]) + "\n")
    with pytest.raises(ValueError, match=r"blank_docs\.jsonl.*no non-empty documents.*3 empty"):
        D.build_dataset(str(f), 8)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_invalid_utf8_is_replaced_not_fatal(tmp_path, suffix):
    f = tmp_path / f"bad{suffix}"
    if suffix == ".txt":
        f.write_bytes(b"good \xff\xfe bytes\n")
    else:
        f.write_bytes(b'{"text": "good \xff\xfe bytes"}\n')
    (ex,) = list(D.build_dataset(str(f), 64))
    ids = ex["input_ids"].tolist()
    replacement = list("\ufffd".encode("utf-8"))
    assert ids[1:6] == list(b"good ")
    assert ids[6:9] == replacement and ids[9:12] == replacement
    assert 0xFF not in ids


# ---------------------------------------------------------------------------------------------------------------------
# local files and the hub code path, through datasets streaming
# ---------------------------------------------------------------------------------------------------------------------


DOCS = ["First document, plain ASCII.", "Second: ß, é, 中文.", "Third one is a bit longer " * 3]


def _write_local(tmp_path: Path, kind: str) -> Path:
    if kind == "text":
        d = tmp_path / "txt"
        d.mkdir()
        for i, t in enumerate(DOCS):
            (d / f"doc{i}.txt").write_text(t, encoding="utf-8")
        return d
    if kind == "json":
        f = tmp_path / "docs.jsonl"
        f.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)), encoding="utf-8")
        return f
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), f)
    return f


@pytest.mark.parametrize("kind", ["text", "json", "parquet"])
def test_local_files_through_streaming_datasets(tmp_path, kind):
    import datasets

    src = _write_local(tmp_path, kind)
    column = "content" if kind == "parquet" else "text"
    ds = D.build_dataset(str(src), 12, text_column=column)
    assert isinstance(ds.source.dataset, datasets.IterableDataset)  # the streaming path
    assert as_pairs(ds) == reference_examples(DOCS, 12)


def test_missing_text_column_is_named(tmp_path):
    src = _write_local(tmp_path, "parquet")
    with pytest.raises(ValueError, match=r"no column 'body'.*content"):
        list(D.build_dataset(str(src), 12, text_column="body"))


def test_parquet_binary_column_keeps_raw_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok\xff"], type=pa.binary())}), f)
    (ex,) = list(D.build_dataset(str(f), 8))
    assert ex["input_ids"].tolist()[:5] == [257, 111, 107, 255, 258]


def test_hub_code_path_offline_with_local_dataset_dir(tmp_path):
    """TextSource.from_hub is load_dataset(id, name=config, split, streaming=True); a local dataset directory takes
    the same call offline (the real FineWeb-Edu id cannot be reached here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "fake_hub_repo" / "data"
    repo.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:2]}), repo / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": DOCS[2:]}), repo / "train-00001-of-00002.parquet")
    source = D.TextSource.from_hub(str(tmp_path / "fake_hub_repo"), None, split="train")
    assert source.is_hub and source.num_shards == 2
    assert as_pairs(D.StreamingTextDataset(source, 12)) == reference_examples(DOCS, 12)


def test_hub_source_parsing_and_errors():
    assert D.parse_hub_source("HuggingFaceFW/fineweb-edu:sample-10BT") == ("HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert D.parse_hub_source("owner/name") == ("owner/name", None)
    assert D.classify_source("HuggingFaceFW/fineweb-edu:sample-10BT") == ("hub", [])
    with pytest.raises(ValueError, match="not a Hub dataset id"):
        D.parse_hub_source("no-slash")
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        D.classify_source("./no_such_dir/x")
    # huggingface_hub's own validation decides (double dots, a leading dash, too long), on top of owner/name
    for bad in ("owner/na..me", "-owner/name", "owner/" + "n" * 100, "a/b/c", "./owner/name"):
        assert not D.is_hub_repo_id(bad), bad
    with pytest.raises(ValueError, match="not a Hub dataset id"):
        D.parse_hub_source("owner/name:bad config")


# ---------------------------------------------------------------------------------------------------------------------
# the embedded corpus
# ---------------------------------------------------------------------------------------------------------------------


def test_sotu_split_by_year_is_disjoint_and_complete():
    train = D.sotu_documents("train", eval_from_year=2000)
    ev = D.sotu_documents("eval", eval_from_year=2000)
    speech_files = [p for p in D.sotu_speeches_dir().iterdir() if p.suffix == ".txt"]
    assert train and ev
    assert max(d["year"] for d in train) < 2000 <= min(d["year"] for d in ev)
    assert not {d["fileid"] for d in train} & {d["fileid"] for d in ev}
    assert len(train) + len(ev) == len(speech_files)
    # the file name carries year and president
    washington = train[0]
    assert washington["fileid"].startswith(f"{washington['year']}-{washington['president']}-")
    assert all(d["text"].strip() for d in train + ev)
    with pytest.raises(ValueError, match="eval_from_year=3000"):
        D.sotu_documents("eval", eval_from_year=3000)


def test_sotu_dataset_and_windows():
    hf = D.sotu_dataset("eval", eval_from_year=2020)
    assert set(hf.column_names) >= {"text", "year", "president", "fileid"}
    assert min(hf["year"]) >= 2020
    ds = D.build_dataset("sotu", 512, split="eval", eval_from_year=2020)
    windows = list(ds.iter_windows())
    assert windows and ds.stats.documents == len(hf)
    stream = np.concatenate(windows)
    assert int((stream == D.BOS_ID).sum()) == len(hf) == int((stream == D.EOS_ID).sum())


def test_mock_source_matches_seed_samples():
    ds = D.build_dataset("mock", 32, num_samples=10)
    texts = [D.MOCK_SAMPLES[i % len(D.MOCK_SAMPLES)] for i in range(10)]
    assert as_pairs(ds) == reference_examples(texts, 32)


# ---------------------------------------------------------------------------------------------------------------------
# map-style datasets: whole corpus, split across ranks and shuffled by the sampler
# ---------------------------------------------------------------------------------------------------------------------


def _local_dataset(kind, random_shards, seq_len=15):
    d, _ = random_shards
    if kind == "shards":
        return D.build_dataset(str(d), seq_len)
    return D.TextByteDataset(D.TextSource.from_texts([f"doc {i} " * (i % 9 + 1) for i in range(60)], "t"), seq_len)


@pytest.mark.parametrize("kind", ["shards", "text"])
def test_local_sources_are_map_style_over_the_whole_corpus(random_shards, kind):
    from torch.utils.data import Dataset, IterableDataset

    ds = _local_dataset(kind, random_shards)
    assert isinstance(ds, Dataset) and not isinstance(ds, IterableDataset)
    assert len(ds) == ds.num_windows == math.ceil(ds.total_tokens / 16)
    assert [ds[k]["input_ids"].tolist() for k in range(len(ds))] == [w.tolist() for w in ds.iter_windows()]
    assert ds[-1]["input_ids"].tolist() == ds[len(ds) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    if kind == "shards":
        _, stream = random_shards
        assert [w.tolist() for w in ds.iter_windows()] == _chunks(stream.tolist(), 16)


def test_mock_and_sotu_sources_are_map_style():
    assert isinstance(D.build_dataset("mock", 32), D.TextByteDataset)
    ds = D.build_dataset("sotu", 256)
    assert isinstance(ds, D.TextByteDataset) and len(ds) > 40_000
    docs = D.sotu_documents("train")  # every address before 2000, 1790 to 1999
    assert ds.stats.documents == len(docs)
    assert ds.total_tokens == sum(len(d["text"].encode("utf-8", "replace")) + 2 for d in docs)


@pytest.mark.parametrize("kind", ["shards", "text"])
def test_accelerate_two_ranks_get_disjoint_windows_covering_the_corpus(random_shards, kind):
    """What Trainer does in a 2-process run: accelerate's prepare splits the (seeded random) batches of one
    permutation between the ranks."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import RandomSampler

    ds = _local_dataset(kind, random_shards)
    every = Counter(rows(DataLoader(ds, batch_size=len(ds))))
    per_rank = []
    for rank in range(2):
        loader = prepare_data_loader(
            DataLoader(ds, batch_size=3, sampler=RandomSampler(ds)),
            num_processes=2,
            process_index=rank,
            put_on_device=False,
            use_seedable_sampler=True,
            data_seed=7,
        )
        per_rank.append(rows(loader))
    got = Counter(per_rank[0] + per_rank[1])
    assert set(got) == set(every)  # the whole corpus is covered
    assert len(per_rank[0]) == len(per_rank[1])
    # disjoint except for accelerate's even_batches padding (< one batch per rank, taken from the start)
    assert sum(got.values()) - len(every) < 2 * 3
    assert len(set(per_rank[0]) & set(per_rank[1])) < 2 * 3


def test_distributed_sampler_two_ranks_disjoint(random_shards):
    from torch.utils.data.distributed import DistributedSampler

    ds = _local_dataset("shards", random_shards)
    parts = [list(DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=3)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == math.ceil(len(ds) / 2)
    assert set(parts[0]) | set(parts[1]) == set(range(len(ds)))
    assert len(parts[0]) + len(parts[1]) - len(ds) == len(set(parts[0]) & set(parts[1])) <= 1


def _trainer_loader(ds, seed, batch_size=4):
    """Trainer's own train DataLoader for ``ds`` (what SpiderTrainer uses for a local source)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir="/tmp/unused-spider-data-test",
        use_cpu=True,
        report_to="none",
        seed=seed,
        per_device_train_batch_size=batch_size,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=ds, data_collator=default_data_collator)
    return trainer.get_train_dataloader()


@pytest.mark.parametrize("kind", ["shards", "text"])
def test_trainer_order_is_shuffled_and_reproducible_per_seed(random_shards, kind):
    ds = _local_dataset(kind, random_shards)
    stream = rows(DataLoader(ds, batch_size=4))
    a, b, c = (rows(_trainer_loader(ds, seed)) for seed in (0, 0, 1))
    assert a == b  # same seed, same order
    assert a != stream and a != c  # shuffled; another seed, another order
    assert Counter(a) == Counter(stream) == Counter(c)  # one epoch = every window once
    loader = _trainer_loader(ds, 0)
    loader.set_epoch(1)  # what Trainer calls at each epoch
    e1 = rows(loader)
    assert e1 != a and Counter(e1) == Counter(a)


@pytest.mark.parametrize("kind", ["shards", "text"])
def test_resume_with_skip_first_batches_gives_the_same_batches(random_shards, kind):
    """Trainer resumes a map-style dataset by skipping the consumed batches of the same seeded permutation."""
    from accelerate import skip_first_batches

    ds = _local_dataset(kind, random_shards)
    full = [rows([b]) for b in _trainer_loader(ds, 5)]
    for consumed in (1, 4, 7):
        resumed = [rows([b]) for b in skip_first_batches(_trainer_loader(ds, 5), consumed)]
        assert resumed == full[consumed:]


def test_spider_trainer_keeps_trainers_loader_for_local_data(tmp_path):
    from transformers import default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.trainer import SpiderTrainer
    from tests.helpers import tiny_model

    ds = D.build_dataset("mock", 32, num_samples=50)
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        remove_unused_columns=False,
        precision="fp32",
    )
    trainer = SpiderTrainer(
        model=tiny_model(seed=0),
        args=args,
        train_dataset=ds,
        eval_dataset=ds,
        data_collator=default_data_collator,
        stop_signals=(),
    )
    loader = trainer.get_train_dataloader()
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    assert isinstance(get_sampler(loader), SeedableRandomSampler)  # Trainer's RandomSampler, seeded by accelerate
    assert Counter(rows(loader)) == Counter(rows(DataLoader(ds, batch_size=4)))
    eval_rows = rows(trainer.get_eval_dataloader(ds))
    # eval stays in stream order and stops after the trainer's eval_windows (64, whole batches of 8)
    assert len(ds) > trainer.args.eval_windows == 64
    assert eval_rows == rows(DataLoader(ds, batch_size=8))[:64]


@pytest.mark.parametrize("streamed", [False, True])
def test_spider_trainer_loaders_copy_batches_as_the_accelerator_config_says(tmp_path, streamed):
    """``non_blocking`` (train_hf.py sets it on CUDA, with pinned memory) reaches the loader that moves the batches,
    Trainer's for local data and SpiderTrainer's own for a stream, and the batches it yields are unchanged."""
    from transformers import default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.trainer import SpiderTrainer
    from tests.helpers import tiny_model

    ds = (
        D.StreamingTextDataset(_streamed_source(tmp_path)[0], 12)
        if streamed
        else D.build_dataset("mock", 32, num_samples=20)
    )
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        remove_unused_columns=False,
        accelerator_config={"non_blocking": True},
        precision="fp32",
    )
    trainer = SpiderTrainer(
        model=tiny_model(seed=0),
        args=args,
        train_dataset=ds,
        data_collator=default_data_collator,
        stop_signals=(),
    )
    loader = trainer.get_train_dataloader()
    assert loader._non_blocking is True
    assert Counter(rows(loader)) == Counter(rows(DataLoader(ds, batch_size=4)))


# ---------------------------------------------------------------------------------------------------------------------
# Hub sources: streamed, split across ranks with split_dataset_by_node
# ---------------------------------------------------------------------------------------------------------------------


def _streamed_source(tmp_path, files=2):
    """A local dataset directory loaded like a Hub id (load_dataset(path, streaming=True)): the Hub stand-in."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "fake_hub_repo" / "data"
    repo.mkdir(parents=True)
    texts = [f"streamed document {i} " * (i % 5 + 1) for i in range(24)]
    per = len(texts) // files
    parts = [texts[i * per : (i + 1) * per] for i in range(files)]
    for i, part in enumerate(parts):
        pq.write_table(pa.table({"text": part}), repo / f"train-{i:05d}-of-{files:05d}.parquet")
    return D.TextSource.from_hub(str(tmp_path / "fake_hub_repo"), None, split="train"), parts


def test_hub_source_builds_a_streaming_dataset(tmp_path, monkeypatch):
    import datasets

    source, parts = _streamed_source(tmp_path)
    monkeypatch.setattr(D.TextSource, "from_hub", classmethod(lambda cls, *a, **k: source))
    ds = D.build_dataset("owner/name:config", 12)
    assert isinstance(ds, D.StreamingTextDataset) and isinstance(ds.source.dataset, datasets.IterableDataset)
    assert as_pairs(ds) == reference_examples(parts[0] + parts[1], 12)


def test_spider_trainer_trains_on_a_stream_with_gradient_accumulation(tmp_path):
    """A streamed (Hub) source through SpiderTrainer's own loader: with gradient accumulation every optimizer step
    consumes `gradient_accumulation_steps` batches in stream order, and the accelerator's GradientState tracks the
    loader (it syncs gradients on the last micro-batch of each step only)."""
    from transformers import TrainerCallback, default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.trainer import SpiderTrainer
    from tests.helpers import tiny_model

    source, _ = _streamed_source(tmp_path)
    ds = D.StreamingTextDataset(source, 12)
    seen, syncs = [], []

    def collate(examples):
        seen.append(len(examples))
        return default_data_collator(examples)

    class RecordSync(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            syncs.append(
                (
                    len(seen),
                    trainer.accelerator.gradient_state.sync_gradients,
                    trainer.accelerator.gradient_state.active_dataloader is not None,
                )
            )

    args = SpiderTrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        remove_unused_columns=False,
        save_strategy="no",
        logging_steps=100,
        precision="fp32",
    )
    trainer = SpiderTrainer(
        model=tiny_model(seed=0),
        args=args,
        train_dataset=ds,
        data_collator=collate,
        stop_signals=(),
        callbacks=[RecordSync()],
    )
    trainer.train()
    assert trainer.state.global_step == 3 and set(seen) == {2}
    # batches collated by each optimizer step: 2 more per step (accelerate reads one batch ahead to spot the end)
    consumed = [n for n, _, _ in syncs]
    assert [b - a for a, b in zip(consumed, consumed[1:])] == [2, 2] and consumed[0] in (2, 3)
    assert all(synced and tracked for _, synced, tracked in syncs)


@pytest.mark.parametrize("files", [2, 3])
def test_hub_stream_split_by_node_two_ranks(tmp_path, files):
    """2 files: one file per rank; 3 files (not divisible): every other document per rank. Either way the ranks
    share nothing and together hold every document."""
    source, parts = _streamed_source(tmp_path, files)
    docs = [t for p in parts for t in p]
    got_docs = []
    for rank in range(2):
        ds = D.StreamingTextDataset(source, 4096, rank=rank, world_size=2)
        stream = np.concatenate(list(ds.iter_windows()))
        text = bytes(int(x) for x in stream if x < 256).decode()
        mine = [t for t in docs if t in text]
        assert mine and ds.stats.documents == len(mine)
        got_docs += mine
    assert sorted(got_docs) == sorted(docs)


def test_hub_stream_two_workers_cover_every_window_once(tmp_path):
    source, parts = _streamed_source(tmp_path, 2)
    want = Counter((tuple(x), tuple(y)) for p in parts for x, y in reference_examples(p, 9))
    ds = D.StreamingTextDataset(source, 9)
    assert Counter(rows(DataLoader(ds, batch_size=4, num_workers=2))) == want  # one file per worker
    one_file, _ = _streamed_source(tmp_path / "one", 1)
    ds = D.StreamingTextDataset(one_file, 9)  # fewer files than workers: windows alternate between workers
    assert Counter(rows(DataLoader(ds, batch_size=4, num_workers=2))) == Counter(rows(DataLoader(ds, batch_size=4)))


def test_hub_stream_shuffle_deterministic_per_seed_and_epoch():
    import datasets

    texts = [f"streamed document {i} " * (i % 5 + 1) for i in range(24)]
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=2)
    source = D.TextSource(stream, "in-memory stream", is_hub=True)  # (a parquet stream's shuffle takes ~5 s)

    def order(seed, epoch=0):
        ds = D.StreamingTextDataset(source, 10, seed=seed, shuffle=True, shuffle_buffer=50)
        loader = D.make_dataloader(ds, 4)
        loader.set_epoch(epoch)  # Trainer calls this each epoch: must reach the dataset
        return rows(loader)

    assert order(0) == order(0)
    assert order(0) != order(1) and order(0) != order(0, epoch=1)
    tokens = [Counter(t for x, _ in order(seed) for t in x if t != D.PAD_ID) for seed in (0, 1)]
    assert tokens[0] == tokens[1]  # the same documents, packed in another order


def test_accelerate_default_prepare_would_reshard_a_stream(tmp_path):
    """Why SpiderTrainer keeps make_dataloader for streams: accelerate's prepare (dispatch_batches=False) wraps an
    IterableDataset in IterableDatasetShard and keeps 1/num_processes of what each rank iterates, so a stream already
    split by node would lose windows; make_dataloader (num_processes=1) keeps them all."""
    from accelerate.data_loader import prepare_data_loader

    source, parts = _streamed_source(tmp_path, 2)
    want = Counter((tuple(x), tuple(y)) for p in parts for x, y in reference_examples(p, 15))
    resharded, ours = [], []
    for rank in range(2):
        ds = D.StreamingTextDataset(source, 15, rank=rank, world_size=2)
        loader = prepare_data_loader(
            DataLoader(ds, batch_size=2),
            num_processes=2,
            process_index=rank,
            dispatch_batches=False,
            put_on_device=False,
        )
        resharded += rows(loader)
        ours += rows(D.make_dataloader(ds, 2))
    assert Counter(ours) == want
    assert len(resharded) < sum(want.values())


def test_stream_rank_validation(tmp_path):
    src = D.TextSource.from_texts(["a"], "t")
    with pytest.raises(ValueError, match="rank"):
        D.StreamingTextDataset(src, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        D.StreamingTextDataset(src, 0)
    with pytest.raises(ValueError, match="seq_len"):
        D.TextByteDataset(src, 0)


# ---------------------------------------------------------------------------------------------------------------------
# shard formats and errors
# ---------------------------------------------------------------------------------------------------------------------


def test_headerless_and_header_formats_read_the_same_stream(tmp_path):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 272, size=333)
    bare_dir, head_dir = tmp_path / "headerless", tmp_path / "head"
    bare_dir.mkdir()
    head_dir.mkdir()
    write_headerless_shard(bare_dir / "a.bin", tokens)
    write_header_shard(head_dir / "a.bin", tokens)
    a = D.ByteShardDataset(str(bare_dir), 31)
    b = D.ByteShardDataset(str(head_dir), 31)
    assert [s.format for s in a.shards] == ["headerless"] and [s.format for s in b.shards] == ["header"]
    wa = np.concatenate(list(a.iter_windows()))
    assert (wa == np.concatenate(list(b.iter_windows()))).all()
    assert (wa[:333] == tokens).all() and (wa[333:] == D.PAD_ID).all()


def _expect_shard_error(path: Path, match: str, exc=D.ShardFormatError, source=None):
    with pytest.raises(exc, match=re.escape(str(path)) + ".*" + match) as info:
        D.ByteShardDataset(str(source or path), 8)
    if exc is D.ShardFormatError:
        assert info.value.path == str(path)


def test_shard_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing_dir"
    _expect_shard_error(missing, "no such file", FileNotFoundError)

    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    (empty_dir / "notes.md").write_text("not a shard")
    with pytest.raises(FileNotFoundError, match=re.escape(str(empty_dir))):
        D.discover_shards(empty_dir)

    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    _expect_shard_error(empty, "empty")

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    _expect_shard_error(odd, "odd byte length 3")

    bad_magic = write_header_shard(tmp_path / "bad_magic.bin", [1, 2, 3], magic=20240521)
    _expect_shard_error(bad_magic, "magic is 20240521")

    bad_version = write_header_shard(tmp_path / "bad_version.bin", [1, 2, 3], version=2)
    _expect_shard_error(bad_version, "version 2")

    bad_count = write_header_shard(tmp_path / "bad_count.bin", [1, 2, 3], count=10)
    _expect_shard_error(bad_count, "token count 10")

    short = tmp_path / "short_header.bin"
    short.write_bytes(np.array([D.HEADER_MAGIC, 1, 5], dtype="<i4").tobytes())
    _expect_shard_error(short, "only 12 bytes")

    big_id = write_headerless_shard(tmp_path / "big_id.bin", [257, 65, 272, 258])
    _expect_shard_error(big_id, "token id 272 at token 2")

    gpt2 = write_header_shard(tmp_path / "gpt2.bin", [50256, 464, 2068])
    _expect_shard_error(gpt2, "token id 50256")


def test_unchecked_shard_ids_fail_when_the_window_is_read(tmp_path):
    bad = write_headerless_shard(tmp_path / "late_bad.bin", [65] * 20 + [999] + [66] * 9)
    ds = D.ByteShardDataset(str(bad), 9, check_ids=False)
    assert ds.window(0).max() == 65
    with pytest.raises(D.ShardFormatError, match=re.escape(str(bad)) + ".*token id 999"):
        ds.window(2)


# ---------------------------------------------------------------------------------------------------------------------
# write_shards round trips
# ---------------------------------------------------------------------------------------------------------------------


def test_format_seed_is_a_deprecated_name_of_headerless(tmp_path):
    """``fmt="seed"`` (the old name) writes headerless shards, and a metadata.json written under the old name (its
    shards say ``"format": "seed"``) still reads."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)), encoding="utf-8")
    new = write_shards(str(src), tmp_path / "new", tokens_per_shard=100, fmt="headerless")
    old = write_shards(str(src), tmp_path / "old", tokens_per_shard=100, fmt="seed")
    assert old["shards"] == new["shards"]
    for name in new["shards"]:
        assert (tmp_path / "old" / name).read_bytes() == (tmp_path / "new" / name).read_bytes()
    meta_path = tmp_path / "old" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert {s["format"] for s in meta["shards"]} == {"headerless"}
    for shard in meta["shards"]:
        shard["format"] = "seed"  # as written before the rename
    meta_path.write_text(json.dumps(meta))
    assert as_pairs(D.build_dataset(str(tmp_path / "old"), 37)) == as_pairs(D.build_dataset(str(tmp_path / "new"), 37))


@pytest.mark.parametrize("fmt", ["headerless", "header"])
def test_write_shards_round_trip(tmp_path, fmt):
    src = tmp_path / "docs.jsonl"
    texts = [f"round trip document {i}: {'é' * (i % 5)}" for i in range(50)] + ["  "]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = tmp_path / "out"
    summary = write_shards(str(src), out, tokens_per_shard=500, fmt=fmt)
    stream = reference_stream(texts)
    assert summary["tokens"] == len(stream) and summary["skipped_empty"] == 1
    assert summary["num_shards"] == math.ceil(len(stream) / 500) > 1
    first = out / summary["shards"][0]
    if fmt == "header":
        header = np.fromfile(first, dtype="<i4", count=256)
        assert header[:3].tolist() == [D.HEADER_MAGIC, 1, 500]
        assert first.stat().st_size == 1024 + 2 * 500
    else:
        assert first.stat().st_size == 2 * 500
    meta = json.loads((out / "metadata.json").read_text())
    assert [s["name"] for s in meta["shards"]] == summary["shards"]
    assert {s["format"] for s in meta["shards"]} == {fmt}
    assert meta["vocab"]["bos"] == 257 and meta["splits"]["train"]["documents"] == 50
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    # shards read back == text source packed on the fly, windows spanning shard boundaries included
    from_shards = as_pairs(D.build_dataset(str(out), 37))
    assert from_shards == as_pairs(D.build_dataset(str(src), 37)) == reference_examples(texts, 37)


def test_write_shards_splits_metadata_and_overwrite(tmp_path):
    out = tmp_path / "sotu_shards"
    train = write_shards("sotu", out, split="train", eval_from_year=2016, tokens_per_shard=4_000_000)
    ev = write_shards("sotu", out, split="eval", eval_from_year=2016, fmt="header")
    assert train["shards"][0] == "sotu_train_000000.bin" and ev["shards"] == ["sotu_eval_000000.bin"]
    tr_ds = D.build_dataset(str(out), 1024, split="train")
    ev_ds = D.build_dataset(str(out), 1024, split="eval")
    assert tr_ds.total_tokens == train["tokens"] and ev_ds.total_tokens == ev["tokens"]
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shards("sotu", out, split="train", eval_from_year=2016)
    # overwrite with bigger shards: stale shard files of the split disappear, eval untouched
    again = write_shards("sotu", out, split="train", eval_from_year=2016, tokens_per_shard=50_000_000, overwrite=True)
    assert again["num_shards"] == 1 and train["num_shards"] > 1
    assert sorted(p.name for p in out.glob("*.bin")) == ["sotu_eval_000000.bin", "sotu_train_000000.bin"]
    meta = json.loads((out / "metadata.json").read_text())
    assert sorted(meta["splits"]) == ["eval", "train"] and len(meta["shards"]) == 2
    # metadata mismatch names the shard
    meta["shards"][0]["tokens"] += 1
    (out / "metadata.json").write_text(json.dumps(meta))
    bad = out / meta["shards"][0]["name"]
    with pytest.raises(D.ShardFormatError, match=re.escape(str(bad)) + ".*metadata.json says"):
        D.discover_shards(out, meta["shards"][0]["split"])


def test_write_shards_cli(tmp_path, capsys):
    """``spider-write-shards`` (its entry point in-process): the JSON summary on stdout, exit code
    2 with the fix named when the shards already exist."""
    from spider_training.commands.write_shards import main

    argv = ["--source", "mock", "--num_samples", "20", "--out", str(tmp_path / "cli"), "--format", "header"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 20 and summary["shards"] == ["mock_train_000000.bin"]
    assert {"tokens", "mb_per_s", "seconds"} <= set(summary)
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err


def test_write_shards_empty_source_errors(tmp_path):
    f = tmp_path / "nothing.jsonl"
    f.write_text(json.dumps({"text": "   "}) + "\n")
    with pytest.raises(ValueError, match=r"nothing\.jsonl.*no non-empty documents"):
        write_shards(str(f), tmp_path / "out")
