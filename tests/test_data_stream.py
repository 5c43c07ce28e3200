"""Streamed text sources (spider_training.data.StreamingTextDataset): exact resume from a saved position without
replaying, the shuffle, the split across processes, and SpiderTrainer's checkpointing of the position."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spider_training import checkpointing
from spider_training import data as D
from spider_training.data.loader import STREAM_READ_DOCUMENTS, STREAM_STATE_VERSION
from tests.helpers import cpu_trainer

SEQ_LEN = 31


def write_jsonl(folder, files: int = 2, per_file: int = 300) -> list[str]:
    """`files` JSON Lines files of `per_file` documents of varied length (5-60 bytes); returns the documents in
    file order."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w", encoding="utf-8") as handle:
            for i in range(per_file):
                text = f"f{f}d{i} " * (1 + (i * 7 + f) % 11)
                handle.write(json.dumps({"text": text}) + "\n")
                docs.append(text)
    return docs


def streamed(folder, **kwargs) -> D.StreamingTextDataset:
    return D.build_dataset(str(folder), SEQ_LEN, stream=True, **kwargs)


def batches_and_positions(dataset, batch_size: int = 4):
    """Every batch of a pass (``input_ids`` as numpy) and the loader's position after each (a JSON round trip, as a
    checkpoint stores it)."""
    loader = D.make_dataloader(dataset, batch_size)
    out, positions = [], []
    for batch in loader:
        out.append(batch["input_ids"].numpy().copy())
        positions.append(json.loads(json.dumps(loader.state_dict())))
    return out, positions


def test_streamed_local_source_yields_the_cached_sources_windows(tmp_path):
    """--streaming reads local text through datasets streaming and packs it on the fly: the same windows, in the same
    order, as the byte cache's map-style dataset."""
    write_jsonl(tmp_path / "data")
    stream = streamed(tmp_path / "data")
    cached = D.build_dataset(str(tmp_path / "data"), SEQ_LEN, cache_dir=tmp_path / "cache")
    assert isinstance(stream, D.StreamingTextDataset) and isinstance(cached, D.TextByteDataset)
    got = [w.tolist() for w in stream.iter_windows()]
    assert got == [w.tolist() for w in cached.iter_windows()]
    assert stream.stats.documents == cached.stats.documents


@pytest.mark.parametrize(("files", "shuffle"), [(2, False), (2, True), (1, True)])
def test_resume_from_any_batch_gives_the_uninterrupted_stream_without_rereading(tmp_path, files, shuffle):
    """From the position saved after any batch, a fresh dataset yields exactly the batches the uninterrupted pass
    yielded next, and reads from datasets only the block holding that position onwards (earlier documents are never
    pulled again, none but one is encoded again). Shuffled, 2 files are read in a seeded order through datasets'
    shuffle, one file without it."""
    docs = write_jsonl(tmp_path / "data", files=files, per_file=800 // files)
    options = dict(shuffle=shuffle, shuffle_buffer=64, seed=3)
    full, positions = batches_and_positions(streamed(tmp_path / "data", **options))
    read = 64 if shuffle else STREAM_READ_DOCUMENTS
    for k in (0, len(full) // 3, len(full) // 2, len(full) - 2):
        resumed = streamed(tmp_path / "data", **options)
        loader = D.make_dataloader(resumed, 4)
        loader.load_state_dict(positions[k])
        rest = [b["input_ids"].numpy() for b in loader]
        assert len(rest) == len(full) - k - 1
        assert all(np.array_equal(a, b) for a, b in zip(rest, full[k + 1 :]))
        block = positions[k]["block"]
        assert resumed.documents_read == len(docs) - block * read  # the blocks before are not read again
        # encoded again: only documents from the one holding the next window's first byte
        assert resumed.stats.documents == len(docs) - block * read - positions[k]["document"]
    assert positions[len(full) // 2]["block"] > 0  # the check above did skip whole blocks


def test_a_resumed_stream_resumes_again_and_crosses_the_epoch(tmp_path):
    """A resumed stream's own positions resume exactly too; the position after an epoch's last batch starts the next
    epoch (which, shuffled, has another order)."""
    write_jsonl(tmp_path / "data", files=2, per_file=120)
    options = dict(shuffle=True, shuffle_buffer=32, seed=1)
    dataset = streamed(tmp_path / "data", **options)
    loader = D.make_dataloader(dataset, 4)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([b["input_ids"].numpy().copy() for b in loader])
    assert not all(np.array_equal(a, b) for a, b in zip(*epochs))  # reshuffled
    first, positions = batches_and_positions(streamed(tmp_path / "data", **options))
    again = streamed(tmp_path / "data", **options)
    again.load_state_dict(positions[10])
    _, later = batches_and_positions(again)
    third = streamed(tmp_path / "data", **options)
    third.load_state_dict(later[5])
    rest = [b["input_ids"].numpy() for b in D.make_dataloader(third, 4)]
    assert all(np.array_equal(a, b) for a, b in zip(rest, first[17:], strict=True))
    next_epoch = streamed(tmp_path / "data", **options)
    loader = D.make_dataloader(next_epoch, 4)
    loader.load_state_dict(positions[-1])
    loader.set_epoch(0)  # a resumed Trainer counts epochs from 0 again
    assert all(np.array_equal(b["input_ids"].numpy(), a) for a, b in zip(epochs[1], loader, strict=True))


def test_a_position_of_another_stream_is_refused(tmp_path):
    write_jsonl(tmp_path / "data", files=1, per_file=50)
    _, positions = batches_and_positions(streamed(tmp_path / "data"))
    other = D.build_dataset(str(tmp_path / "data"), SEQ_LEN + 1, stream=True)
    with pytest.raises(ValueError, match=r"seq_len was 31, now 32"):
        other.load_state_dict(positions[3])
    with pytest.raises(ValueError, match=r"shuffle_buffer was 0, now 8"):
        streamed(tmp_path / "data", shuffle=True, shuffle_buffer=8).load_state_dict(positions[3])
    with pytest.raises(ValueError, match="not a stream position"):
        streamed(tmp_path / "data").load_state_dict({"windows": 3})
    older = {**positions[3], "version": STREAM_STATE_VERSION - 1}  # another way of reading the stream
    with pytest.raises(ValueError, match=r"of version \d+, this code reads version \d+.*--ignore_data_skip"):
        streamed(tmp_path / "data").load_state_dict(older)


class RecordingTrainer:
    """Builds a SpiderTrainer that records each micro-batch it trains on, keyed by the global step."""

    @staticmethod
    def build(output_dir, dataset, max_steps: int, **training_args):
        trainer = cpu_trainer(
            output_dir,
            train_dataset=dataset,
            max_steps=max_steps,
            gradient_accumulation_steps=2,
            save_strategy="steps",
            save_steps=3,
            logging_steps=1,
            **training_args,
        )
        trainer.seen = []
        step = trainer.training_step

        def training_step(model, inputs, num_items_in_batch=None):
            trainer.seen.append((trainer.state.global_step, inputs["input_ids"].clone()))
            return step(model, inputs, num_items_in_batch)

        trainer.training_step = training_step
        return trainer


def test_trainer_resumes_a_stream_from_its_saved_position(tmp_path):
    """SpiderTrainer saves each rank's stream position in the checkpoint and a resume continues from it: the
    micro-batches and losses of every later step equal the uninterrupted run's, the documents before the
    position's block are never read again, and Trainer's replay (skip_first_batches) is not used."""
    write_jsonl(tmp_path / "data", files=2, per_file=100)
    options = dict(shuffle=True, shuffle_buffer=8, seed=3)
    full_data = streamed(tmp_path / "data", **options)
    full = RecordingTrainer.build(tmp_path / "full", full_data, 12)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-6"
    assert (checkpoint / checkpointing.STREAM_POSITION_NAME.format(rank=0)).is_file()
    resumed_data = streamed(tmp_path / "data", **options)
    resumed = RecordingTrainer.build(tmp_path / "resumed", resumed_data, 12)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    want = [x for step, x in full.seen if step >= 6]
    got = [x for step, x in resumed.seen]
    assert len(got) == len(want) == 12 and all(torch.equal(a, b) for a, b in zip(got, want))

    def losses(trainer):
        return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}

    assert losses(resumed) == losses(full)
    assert resumed.args.ignore_data_skip is False  # restored after train()
    position = checkpointing.read_stream_position(checkpoint, 0)
    assert resumed_data.documents_read == full_data.documents_read - position["block"] * 8 > 0
    assert position["block"] > 0


def test_trainer_refuses_a_stream_checkpoint_without_a_position(tmp_path):
    write_jsonl(tmp_path / "data", files=1, per_file=100)
    trainer = RecordingTrainer.build(tmp_path / "run", streamed(tmp_path / "data"), 3)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    (checkpoint / checkpointing.STREAM_POSITION_NAME.format(rank=0)).unlink()
    again = RecordingTrainer.build(tmp_path / "again", streamed(tmp_path / "data"), 6)
    with pytest.raises(ValueError, match="holds no position in the streamed source.*--ignore_data_skip"):
        again.train(resume_from_checkpoint=str(checkpoint))
    # --ignore_data_skip: the user's choice, the stream from its beginning
    fresh = RecordingTrainer.build(tmp_path / "fresh", streamed(tmp_path / "data"), 6, ignore_data_skip=True)
    fresh.train(resume_from_checkpoint=str(checkpoint))
    assert torch.equal(fresh.seen[0][1], trainer.seen[0][1]) and fresh.seen[0][0] == 3


# ---------------------------------------------------------------------------------------------------------------------
# the shuffle and the split across processes
# ---------------------------------------------------------------------------------------------------------------------


def test_shuffle_is_a_permutation_fixed_by_the_seed(tmp_path):
    """The shuffled stream holds the same documents as the stream's own order, in an order fixed by the seed."""
    docs = write_jsonl(tmp_path / "data", files=2, per_file=60)

    def documents(**options):
        dataset = D.StreamingTextDataset(D.open_text_source(str(tmp_path / "data")), 4096, **options)
        stream = np.concatenate(list(dataset.iter_windows()))
        bos = np.flatnonzero(stream == D.BOS_ID)
        eos = np.flatnonzero(stream == D.EOS_ID)
        return [bytes(stream[a + 1 : b].astype(np.uint8)).decode() for a, b in zip(bos, eos)]

    assert documents() == docs
    one, again, other = (documents(shuffle=True, shuffle_buffer=16, seed=s) for s in (0, 0, 1))
    assert one == again and one != other and one != docs
    assert sorted(one) == sorted(other) == sorted(docs)


@pytest.mark.parametrize("files", [2, 3])
def test_two_processes_read_disjoint_parts_of_a_local_stream(tmp_path, files):
    """split_dataset_by_node: 2 files give each process one file to read (it never opens the other), 3 files (not
    divisible) every other document; either way the processes' documents are disjoint and cover the source."""
    docs = write_jsonl(tmp_path / "data", files=files, per_file=30)
    seen = []
    for rank in range(2):
        dataset = streamed(tmp_path / "data", rank=rank, world_size=2)
        stream = np.concatenate(list(dataset.iter_windows()))
        text = bytes(stream[stream < 256].astype(np.uint8)).decode()
        mine = [d for d in docs if d in text]
        assert dataset.stats.documents == len(mine) == dataset.documents_read
        if files == 2:
            assert dataset.source.num_shards == 1 and mine == docs[rank * 30 : (rank + 1) * 30]
        seen += mine
    assert sorted(seen) == sorted(docs)


def test_training_run_shuffles_a_stream_with_its_flags(tmp_path):
    """--shuffle_buffer reaches the streamed train dataset (seeded by --data_seed, else --seed); 0 keeps the
    stream's order; a negative value is refused."""
    from spider_training.arguments import parse_args
    from spider_training.train import build_trainer
    from tests.helpers import tiny_model

    write_jsonl(tmp_path / "data", files=1, per_file=20)
    base = ["--preset", "tiny", "--data", str(tmp_path / "data"), "--streaming", "--seq_len", "32"]
    base += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "--precision", "fp32", "--max_steps", "2"]
    args = parse_args([*base, "--shuffle_buffer", "16", "--seed", "5"])
    dataset = build_trainer(args, tiny_model()).train_dataset
    assert isinstance(dataset, D.StreamingTextDataset)
    assert (dataset.shuffle, dataset.shuffle_buffer, dataset.seed) == (True, 16, 5)
    args = parse_args([*base, "--data_seed", "7"])
    dataset = build_trainer(args, tiny_model()).train_dataset
    assert (dataset.shuffle, dataset.shuffle_buffer, dataset.seed) == (True, 10_000, 7)
    args = parse_args([*base, "--shuffle_buffer", "0"])
    assert build_trainer(args, tiny_model()).train_dataset.shuffle is False
    with pytest.raises(ValueError, match="--shuffle_buffer must be >= 0"):
        parse_args([*base, "--shuffle_buffer", "-1"])


def test_a_stream_resumed_by_another_number_of_processes_is_refused(tmp_path):
    """Issue 67 D3 for streamed sources: each process's saved position is in its own part of the stream
    (split_dataset_by_node), so one process cannot continue a two-process run's stream: refused by the checkpoint's
    data layout, and by the position itself when the checkpoint has no layout record (never silent)."""
    write_jsonl(tmp_path / "data", files=2, per_file=50)
    RecordingTrainer.build(tmp_path / "run", streamed(tmp_path / "data"), 3).train()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    layout_file = checkpoint / checkpointing.DATA_LAYOUT_NAME
    layout = json.loads(layout_file.read_text())
    layout_file.write_text(json.dumps({**layout, "world_size": 2}))

    def resume():
        trainer = RecordingTrainer.build(tmp_path / "again", streamed(tmp_path / "data"), 6)
        trainer.train(resume_from_checkpoint=str(checkpoint))
        return trainer

    with pytest.raises(ValueError, match=r"written by a run of 2 process\(es\).*this run has 1 process\(es\)"):
        resume()
    layout_file.unlink()  # a checkpoint without the record: the position still knows its process count
    position_file = checkpoint / checkpointing.STREAM_POSITION_NAME.format(rank=0)
    position = json.loads(position_file.read_text())
    two = streamed(tmp_path / "data", rank=0, world_size=2)
    position_file.write_text(json.dumps({**position, "layout": two.state_dict()["layout"]}))
    with pytest.raises(ValueError, match=r"world_size was 2, now 1"):
        resume()
    position_file.write_text(json.dumps(position))
    assert resume().state.global_step == 6


# ---------------------------------------------------------------------------------------------------------------------
# dataloader workers
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("files", "shuffle"), [(1, True), (3, False)])
def test_a_stream_read_by_dataloader_workers_resumes_from_any_batch(tmp_path, files, shuffle):
    """With 2 dataloader workers the loader's position is each worker's position and the worker of the last batch;
    from the position after any batch a fresh loader yields exactly the batches the uninterrupted loader yielded
    next. One file: the workers take every other window of one stream; 3 files: 2 and 1 files each, so one worker's
    part ends first and the other's batches follow alone (positions there included)."""
    write_jsonl(tmp_path / "data", files=files, per_file=240 // files)
    options = dict(shuffle=shuffle, shuffle_buffer=32, seed=2)
    loader = D.make_dataloader(streamed(tmp_path / "data", **options), 4, num_workers=2)
    full, positions = [], []
    for batch in loader:
        full.append(batch["input_ids"].numpy().copy())
        positions.append(json.loads(json.dumps(loader.state_dict())))
    assert {p["last_worker"] for p in positions} == {0, 1}
    ends = [k for k, p in enumerate(positions) if sum(w["finished"] for w in p["worker_positions"]) == 1]
    if files == 3:  # one worker's part ended while the other's went on
        assert ends and ends[0] < len(full) - 2
    for k in sorted({0, 1, len(full) // 2, *ends[:1], len(full) - 2}):
        resumed = D.make_dataloader(streamed(tmp_path / "data", **options), 4, num_workers=2)
        resumed.load_state_dict(positions[k])
        rest = [b["input_ids"].numpy() for b in resumed]
        assert len(rest) == len(full) - k - 1
        assert all(np.array_equal(a, b) for a, b in zip(rest, full[k + 1 :]))
    # after the epoch's last batch every part is done: the next iteration is the next epoch's first batch
    assert all(w["finished"] for w in positions[-1]["worker_positions"])
    nxt = D.make_dataloader(streamed(tmp_path / "data", **options), 4, num_workers=2)
    nxt.load_state_dict(positions[-1])
    assert streamed(tmp_path / "data", **options).epoch == 0 and nxt.dataset.epoch == 1


def test_a_worker_position_needs_the_same_number_of_workers(tmp_path):
    """Each worker reads its own part of the stream, so a position saved with 2 workers continues only with 2: a
    loader with 0 or 1 worker refuses it, and a single position is refused by a loader with workers."""
    write_jsonl(tmp_path / "data", files=1, per_file=80)
    _, two = batches_and_positions_with_workers(streamed(tmp_path / "data"), 2)
    _, none = batches_and_positions(streamed(tmp_path / "data"))
    for workers, position, message in [
        (0, two[3], "of 2 dataloader workers.*this loader has 0: resume with --dataloader_num_workers 2"),
        (1, two[3], "of 2 dataloader workers.*this loader has 1: resume with --dataloader_num_workers 2"),
        (2, none[3], "read in the main process.*--dataloader_num_workers 0"),
    ]:
        loader = D.make_dataloader(streamed(tmp_path / "data"), 4, num_workers=workers)
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(position)
    dataset = streamed(tmp_path / "data")  # positioned without a loader (as SpiderTrainer does): refused when read
    dataset.load_state_dict(two[3])
    with pytest.raises(ValueError, match="this loader has 0: resume with --dataloader_num_workers 2"):
        next(iter(D.make_dataloader(dataset, 4)))


def batches_and_positions_with_workers(dataset, workers: int, batch_size: int = 4):
    """:func:`batches_and_positions` of a loader with `workers` dataloader workers."""
    loader = D.make_dataloader(dataset, batch_size, num_workers=workers)
    out, positions = [], []
    for batch in loader:
        out.append(batch["input_ids"].numpy().copy())
        positions.append(json.loads(json.dumps(loader.state_dict())))
    return out, positions


def test_trainer_resumes_a_stream_read_by_dataloader_workers(tmp_path):
    """--dataloader_num_workers 2: every checkpoint holds the workers' positions and a resume continues from them
    (nothing replayed): the micro-batches and losses of every later step equal the uninterrupted run's. A resume
    with another worker count is refused, naming the count to use."""
    write_jsonl(tmp_path / "data", files=1, per_file=100)
    options = dict(shuffle=True, shuffle_buffer=8, seed=3)
    full = RecordingTrainer.build(
        tmp_path / "full", streamed(tmp_path / "data", **options), 6, dataloader_num_workers=2
    )
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    position = checkpointing.read_stream_position(checkpoint, 0)
    assert position["num_workers"] == 2 and len(position["worker_positions"]) == 2
    resumed = RecordingTrainer.build(
        tmp_path / "resumed", streamed(tmp_path / "data", **options), 6, dataloader_num_workers=2
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    want = [x for step, x in full.seen if step >= 3]
    got = [x for step, x in resumed.seen]
    assert len(got) == len(want) == 6 and all(torch.equal(a, b) for a, b in zip(got, want))
    losses = [
        {e["step"]: e["loss"] for e in t.state.log_history if "loss" in e and e["step"] > 3} for t in (full, resumed)
    ]
    assert losses[0] == losses[1]
    other = RecordingTrainer.build(tmp_path / "other", streamed(tmp_path / "data", **options), 6)
    with pytest.raises(ValueError, match="--dataloader_num_workers 2, this run has 0"):
        other.train(resume_from_checkpoint=str(checkpoint))
