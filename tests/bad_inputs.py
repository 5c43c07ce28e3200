"""One registry of bad inputs (README, "Reliability"): every entry must give a clear error that names the problem.

Each :class:`BadInput` builds its input in a fresh temporary folder (``make(tmp) -> thunk``) and calling the thunk
must either

* raise ``expected`` with a message matching ``match`` -- the regex names the offending thing (the path, field, flag,
  environment variable, token id); ``{tmp}`` in it stands for the escaped temporary folder -- or,
* for the inputs that are handled by design (``expected=None``: invalid UTF-8 is replaced, a 50 MB document is
  streamed), return without error, with ``match`` found in the WARNING+ log records and ``check(result)`` true.

In both cases nothing that existed in the folder before the call may be deleted or changed ("nothing already written
is lost"); ``after(tmp)`` adds case-specific checks (e.g. no half-written shards left behind).

For ``SystemExit`` (argparse) the text matched is the exception plus what was written to stderr -- what the user
reads. Entries with ``xfail`` need a change in a file this registry's owner may not edit; the reason names the
proposed change (it is spelled out in the reliability report) and pytest runs them as ``xfail(strict=True)``.

:func:`run_case` runs one entry and returns an :class:`Outcome` (``clear`` / ``handled`` / ``crash``);
``python -m tests.reliability`` runs them all and prints the table; ``tests/test_bad_inputs.py`` parametrizes over
:data:`REGISTRY`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from huggingface_hub.errors import StrictDataclassFieldValidationError

from tests.helpers import write_header_shard, write_headerless_shard

REPO = Path(__file__).resolve().parents[1]

CATEGORIES = ("byte shards", "text sources", "configs", "cli flags", "env vars", "checkpoints", "model forward")


@dataclass(frozen=True)
class BadInput:
    """One bad input. ``make(tmp)`` prepares files under ``tmp`` and returns the thunk that triggers the problem."""

    name: str
    category: str
    make: Callable[[Path], Callable[[], Any]]
    expected: type[BaseException] | None
    match: str
    xfail: str | None = None
    check: Callable[[Any], bool] | None = None
    after: Callable[[Path], None] | None = None

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"BadInput {self.name!r}: unknown category {self.category!r}")


@dataclass
class Outcome:
    """Result of one :class:`BadInput`: ``status`` is ``clear`` (the expected error, named), ``handled`` (no error by
    design, warning logged) or ``crash`` (anything else: other exception type, unclear message, silent acceptance,
    something already written lost)."""

    case: BadInput
    status: str
    detail: str = ""
    text: str = ""


# ---------------------------------------------------------------------------------------------------------------------
# running one case
# ---------------------------------------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """``{relative path: sha1}`` of every file under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha1()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            out[p.relative_to(root).as_posix()] = h.hexdigest()
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_case(case: BadInput, tmp: Path) -> Outcome:
    """Run ``case`` in the (empty, existing) folder ``tmp`` and classify what happened."""
    thunk = case.make(tmp)
    before = snapshot(tmp)
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    stderr = io.StringIO()
    error: BaseException | None = None
    result = None
    try:
        with contextlib.redirect_stderr(stderr):
            result = thunk()
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- classifying every failure is the point
        error = e
    finally:
        root.removeHandler(records)
    after = snapshot(tmp)
    lost = sorted(p for p, h in before.items() if after.get(p) != h)
    pattern = case.match.replace("{tmp}", re.escape(str(tmp)))
    if case.expected is None:
        text = "\n".join(records.messages)
        if error is not None:
            return Outcome(case, "crash", f"raised {type(error).__name__}: {error}", text)
        if not re.search(pattern, text, re.S):
            return Outcome(case, "crash", f"no warning matching {pattern!r}; warnings: {records.messages[:3]}", text)
        if case.check is not None and not case.check(result):
            return Outcome(case, "crash", f"check failed on result {result!r}"[:500], text)
        status = "handled"
    else:
        if error is None:
            return Outcome(case, "crash", f"no error (returned {type(result).__name__})")
        text = str(error)
        if isinstance(error, SystemExit):
            text += "\n" + stderr.getvalue()
        if not isinstance(error, case.expected):
            return Outcome(
                case, "crash", f"{type(error).__name__} instead of {case.expected.__name__}: {text[:300]}", text
            )
        if not re.search(pattern, text, re.S):
            return Outcome(case, "crash", f"message does not match {pattern!r}: {text[-400:]}", text)
        status = "clear"
    if lost:
        return Outcome(case, "crash", f"changed or deleted existing files: {lost[:5]}", text)
    if case.after is not None:
        try:
            case.after(tmp)
        except AssertionError as e:
            return Outcome(case, "crash", f"after-check failed: {e}", text)
    return Outcome(case, status, "", text)


# ---------------------------------------------------------------------------------------------------------------------
# small builders
# ---------------------------------------------------------------------------------------------------------------------


_MODEL = None


def tiny_eval_model():
    """The tiny preset in eval mode, built once per process (the forward cases only read it)."""
    global _MODEL
    if _MODEL is None:
        from tests.helpers import tiny_model

        _MODEL = tiny_model(seed=0).eval()
    return _MODEL


def _saved_tiny(folder: Path) -> Path:
    """A saved tiny model folder (``save_pretrained``)."""
    tiny_eval_model().save_pretrained(folder)
    return folder


def _build(source: Path | str, seq_len: int = 8, **kw):
    from spider_training import data as D

    return D.build_dataset(str(source), seq_len, **kw)


def _iterate(source: Path | str, seq_len: int = 8, **kw):
    return lambda: list(_build(source, seq_len, **kw))


# ---------------------------------------------------------------------------------------------------------------------
# byte shards (the logic of tests/test_data.py::test_shard_errors_name_the_file, as registry entries)
# ---------------------------------------------------------------------------------------------------------------------


def _shards() -> list[BadInput]:
    cases = []

    def shard_case(name, write, match, expected=None, source=None):
        from spider_training.data import ShardFormatError

        def make(tmp: Path):
            path = write(tmp)
            return lambda: _build(source(tmp) if source else path)

        cases.append(BadInput(name, "byte shards", make, expected or ShardFormatError, match))

    shard_case(
        "missing shard directory", lambda t: t / "missing_dir", r"{tmp}/missing_dir.*no such file", FileNotFoundError
    )
    shard_case("shard file empty (0 bytes)", lambda t: _touch(t / "empty.bin"), r"{tmp}/empty\.bin.*empty")
    shard_case(
        "shard of odd byte length",
        lambda t: _bytes(t / "odd.bin", b"\x01\x00\x02"),
        r"{tmp}/odd\.bin.*odd byte length 3",
    )
    shard_case(
        "header shard with wrong magic",
        lambda t: write_header_shard(t / "bad_magic.bin", [1, 2, 3], magic=20240521),
        r"{tmp}/bad_magic\.bin.*magic is 20240521",
    )
    shard_case(
        "header shard with wrong version",
        lambda t: write_header_shard(t / "v2.bin", [1, 2, 3], version=2),
        r"{tmp}/v2\.bin.*version 2",
    )
    shard_case(
        "header token count larger than the file",
        lambda t: write_header_shard(t / "count.bin", [1, 2, 3], count=10),
        r"{tmp}/count\.bin.*token count 10",
    )
    shard_case(
        "header token count negative",
        lambda t: write_header_shard(t / "negcount.bin", [1, 2, 3], count=-4),
        r"{tmp}/negcount\.bin.*token count -4",
    )
    shard_case(
        "header cut short (12 bytes)",
        lambda t: _bytes(t / "short.bin", np.array([20240520, 1, 5], dtype="<i4").tobytes()),
        r"{tmp}/short\.bin.*only 12 bytes",
    )
    shard_case(
        "token id 272 in a headerless shard",
        lambda t: write_headerless_shard(t / "big_id.bin", [257, 65, 272, 258]),
        r"{tmp}/big_id\.bin.*token id 272 at token 2",
    )
    shard_case(
        "GPT-2 token ids in a header shard",
        lambda t: write_header_shard(t / "gpt2.bin", [50256, 464]),
        r"{tmp}/gpt2\.bin.*token id 50256",
    )

    def late_bad_id(tmp: Path):
        from spider_training import data as D

        bad = write_headerless_shard(tmp / "late_bad.bin", [65] * 20 + [999] + [66] * 9)
        ds = D.ByteShardDataset(str(bad), 9, check_ids=False)
        return lambda: ds.window(2)

    cases.append(
        BadInput(
            "token id 999 found late (check_ids=False)",
            "byte shards",
            late_bad_id,
            _shard_error(),
            r"{tmp}/late_bad\.bin.*token id 999",
        )
    )

    def dir_without_shards(tmp: Path):
        from spider_training import data as D

        d = tmp / "no_bins"
        d.mkdir()
        (d / "notes.md").write_text("not a shard")
        return lambda: D.discover_shards(d)

    cases.append(
        BadInput(
            "shard directory without .bin files",
            "byte shards",
            dir_without_shards,
            FileNotFoundError,
            r"{tmp}/no_bins.*no \.bin",
        )
    )

    def metadata(tmp: Path, edit):
        d = tmp / "ds"
        d.mkdir()
        write_headerless_shard(d / "data_train_000000.bin", np.arange(40) % 259)
        meta = {
            "vocab": {"pad": 256, "bos": 257, "eos": 258, "vocab_size": 272},
            "shards": [{"name": "data_train_000000.bin", "split": "train", "format": "headerless", "tokens": 40}],
        }
        edit(d, meta)
        return lambda: _build(d)

    def bad_json(d, meta):
        (d / "metadata.json").write_text("{not json")

    def wrong_count(d, meta):
        meta["shards"][0]["tokens"] = 41
        (d / "metadata.json").write_text(json.dumps(meta))

    def listed_missing(d, meta):
        meta["shards"].append({"name": "data_train_000001.bin", "split": "train", "tokens": 5})
        (d / "metadata.json").write_text(json.dumps(meta))

    def wrong_bos(d, meta):
        meta["vocab"]["bos"] = 1
        (d / "metadata.json").write_text(json.dumps(meta))

    for name, edit, match in [
        ("metadata.json is not JSON", bad_json, r"{tmp}/ds/metadata\.json.*cannot read metadata"),
        (
            "metadata.json token count disagrees",
            wrong_count,
            r"{tmp}/ds/data_train_000000\.bin.*metadata\.json says 41",
        ),
        ("metadata.json lists a missing shard", listed_missing, r"{tmp}/ds/data_train_000001\.bin.*missing"),
        ("metadata.json with another BOS id", wrong_bos, r"{tmp}/ds/metadata\.json.*bos id is 1"),
    ]:
        cases.append(BadInput(name, "byte shards", lambda tmp, edit=edit: metadata(tmp, edit), _shard_error(), match))
    return cases


def _shard_error():
    from spider_training.data import ShardFormatError

    return ShardFormatError


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# text sources
# ---------------------------------------------------------------------------------------------------------------------

BIG_DOCUMENT_BYTES = 50 * 1024 * 1024
#: allowed growth of peak RSS while encoding one document, in multiples of its size. The datasets text builder holds
#: the
#: file as a Python str and as an Arrow buffer (~2x); the dataset keeps the encoded stream (uint16, 2x), filled piece
#: by
#: piece into 1M-token chunks -- a uint16 copy of the whole document made at once would add 3x more (5.3x measured).
BIG_DOCUMENT_MAX_RSS_FACTOR = 4.0

_MEMORY_PROBE = r"""
import json, resource, sys
import datasets, pyarrow  # imported before the baseline: their code is not the document's memory
from spider_training import data as D
D.build_dataset("mock", 16)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ds = D.build_dataset(sys.argv[1], 2047)
first = last = None
n = 0
for w in ds.iter_windows():
    if first is None:
        first = w.copy()
    last, n = w, n + 1
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"windows": n, "delta_bytes": (peak - base) * 1024, "first": first[:4].tolist(),
                  "documents": ds.stats.documents, "bytes": ds.stats.bytes}))
"""


def big_document_run(path: Path) -> dict:
    """Pack the single document in ``path`` (``seq_len=2047``) in a fresh process; returns windows, the peak-RSS growth
    (``delta_bytes``) after imports, and the stats. A fresh process, because ``ru_maxrss`` only ever grows."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    if r.returncode:
        raise RuntimeError(f"memory probe failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def big_document_ok(result: dict) -> bool:
    n = BIG_DOCUMENT_BYTES
    return (
        result["windows"] == math.ceil((n + 2) / 2048)
        and result["documents"] == 1
        and result["bytes"] == n
        and result["first"][0] == 257
        and result["delta_bytes"] < BIG_DOCUMENT_MAX_RSS_FACTOR * n
    )


def _text() -> list[BadInput]:
    cases = []

    def text_case(name, write, match, expected=ValueError, iterate=True, xfail=None, **kw):
        def make(tmp: Path):
            src = write(tmp)
            return _iterate(src, **kw) if iterate else (lambda: _build(src, **kw))

        cases.append(BadInput(name, "text sources", make, expected, match, xfail=xfail))

    text_case("empty .txt file", lambda t: _touch(t / "empty.txt"), r"{tmp}/empty\.txt.*no non-empty documents")
    text_case(
        "empty .jsonl file (0 bytes)",
        lambda t: _touch(t / "empty.jsonl"),
        r"{tmp}/empty\.jsonl.*no non-empty documents",
    )
    text_case(".jsonl of blank lines only", lambda t: _bytes(t / "blank.jsonl", b"\n \n\n"), r"{tmp}/blank\.jsonl")
    text_case(
        "documents of only whitespace (.jsonl)",
        lambda t: _bytes(t / "ws.jsonl", b'{"text": "  "}\n{"text": "\\t\\n"}\n{"text": ""}\n'),
        r"{tmp}/ws\.jsonl.*no non-empty documents.*3 empty",
    )
    text_case(
        "whitespace-only .txt", lambda t: _bytes(t / "ws.txt", b"  \n\t \n"), r"{tmp}/ws\.txt.*no non-empty documents"
    )
    text_case(
        "malformed JSON line",
        lambda t: _bytes(t / "bad.jsonl", b'{"text": "ok"}\n{not json}\n'),
        r"{tmp}/bad\.jsonl.*reading failed.*JSON",
    )
    text_case(
        "missing text column",
        lambda t: _bytes(t / "body.jsonl", b'{"body": "x"}\n'),
        r"{tmp}/body\.jsonl.*no column 'text'",
    )
    text_case(
        "text column of numbers",
        lambda t: _bytes(t / "nums.jsonl", b'{"text": 5}\n'),
        r"{tmp}/nums\.jsonl.*column 'text' holds int",
        expected=TypeError,
    )
    text_case("parquet with 0 rows", _zero_row_parquet, r"{tmp}/zero\.parquet.*no non-empty documents")
    text_case(
        "file named .parquet that is not parquet",
        lambda t: _bytes(t / "fake.parquet", b"not parquet"),
        r"{tmp}/fake\.parquet.*cannot be read",
    )
    text_case(
        "unsupported file type (.xlsx)",
        lambda t: _bytes(t / "x.xlsx", b"PK\x03\x04"),
        r"{tmp}/x\.xlsx.*unsupported file type",
        iterate=False,
    )
    text_case(
        "glob matching nothing",
        lambda t: str(t / "*.nothing"),
        r"{tmp}/\*\.nothing.*matched no files",
        expected=FileNotFoundError,
        iterate=False,
    )
    text_case(
        "missing local path",
        lambda t: str(t / "nope" / "data.txt"),
        r"{tmp}/nope/data\.txt.*no such file",
        expected=FileNotFoundError,
        iterate=False,
    )
    text_case(
        "directory without text or shards",
        lambda t: _mkdir(t / "empty_dir"),
        r"{tmp}/empty_dir.*holds no \.bin shards",
        expected=FileNotFoundError,
        iterate=False,
    )
    text_case(
        "directory without eval files",
        lambda t: _dir_with(t / "only_train", "a.txt", "text"),
        r"{tmp}/only_train.*no eval files",
        expected=FileNotFoundError,
        iterate=False,
        split="eval",
    )
    text_case("seq_len 0", lambda t: "mock", r"seq_len.*got 0", iterate=False, seq_len=0)
    text_case("empty source string", lambda t: "", r"data source.*''", iterate=False)
    text_case(
        "sotu split past the last year",
        lambda t: "sotu",
        r"sotu split 'eval'.*eval_from_year=3000",
        iterate=False,
        split="eval",
        eval_from_year=3000,
    )
    text_case(
        "sotu unknown split name", lambda t: "sotu", r"sotu split.*'validation'", iterate=False, split="validation"
    )
    text_case(
        "text_sample_by unknown",
        lambda t: _bytes(t / "a.txt", b"x"),
        r"text_sample_by.*'sentence'",
        iterate=False,
        text_sample_by="sentence",
    )

    def invalid_utf8(tmp: Path):
        f = _bytes(tmp / "latin1.txt", b"caf\xe9 cr\xe8me \xff\xfe end\n")
        return lambda: list(_build(f, 64))

    def utf8_replaced(examples) -> bool:
        ids = examples[0]["input_ids"].tolist()
        return ids[1:4] == list(b"caf") and ids[4:7] == list("\ufffd".encode()) and 0xFF not in ids

    cases.append(
        BadInput(
            "invalid UTF-8 in a .txt file",
            "text sources",
            invalid_utf8,
            None,
            r"{tmp}/latin1\.txt: document 0 holds U\+FFFD at character 3",
            check=utf8_replaced,
        )
    )

    def invalid_utf8_jsonl(tmp: Path):
        f = _bytes(tmp / "bad_utf8.jsonl", b'{"text": "fine"}\n{"text": "bad \xff byte"}\n')
        return lambda: list(_build(f, 64))

    cases.append(
        BadInput(
            "invalid UTF-8 in a .jsonl record",
            "text sources",
            invalid_utf8_jsonl,
            None,
            r"{tmp}/bad_utf8\.jsonl: document 1 holds U\+FFFD at character 4",
            check=lambda ex: len(ex) == 1,
        )
    )

    def big_document(tmp: Path):
        f = tmp / "big.txt"
        rng = np.random.default_rng(0)
        f.write_bytes(rng.integers(97, 123, size=BIG_DOCUMENT_BYTES, dtype=np.uint8).tobytes())

        def run():
            result = big_document_run(f)
            logging.getLogger(__name__).warning(
                "%s: %.1f MB document packed into %d windows, peak RSS +%.1f MB",
                f,
                BIG_DOCUMENT_BYTES / 2**20,
                result["windows"],
                result["delta_bytes"] / 2**20,
            )
            return result

        return run

    cases.append(
        BadInput(
            "50 MB single document (memory bounded)",
            "text sources",
            big_document,
            None,
            r"{tmp}/big\.txt: 50\.0 MB document packed",
            check=big_document_ok,
        )
    )
    return cases


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _dir_with(path: Path, name: str, text: str) -> Path:
    path.mkdir()
    (path / name).write_text(text)
    return path


def _zero_row_parquet(tmp: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp / "zero.parquet"
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), f)
    return f


# ---------------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------------

POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "num_recurrent_layers",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "engram_num_heads",
    "engram_head_dim",
    "engram_table_size",
    "engram_conv_kernel_size",
    "n_loops",
    "max_loop_iters",
    "loop_adapter_rank",
    "max_position_embeddings",
)
NON_NEGATIVE_INT_FIELDS = ("num_prelude_layers", "num_coda_layers", "n_shared_experts")
#: float field -> an out-of-range value
FLOAT_FIELDS = {
    "boundary_temperature": 0.0,
    "boundary_threshold": 1.0,
    "boundary_prior": 0.0,
    "boundary_prior_std": -0.1,
    "act_threshold": 1.5,
    "router_aux_loss_coef": -1.0,
    "boundary_loss_coef": -1.0,
    "ponder_loss_coef": -1.0,
    "boundary_prior_k": -1.0,
    "rms_norm_eps": 0.0,
    "attention_dropout": 1.0,
}


def _config(**overrides):
    from configuration_spider import SpiderConfig

    return lambda tmp: lambda: SpiderConfig.from_preset("tiny", **overrides)


def _field(name: str) -> str:
    return rf"SpiderConfig\.{name}="


#: a value of the wrong type: huggingface_hub's @strict names the field and the value
TypeMismatch = StrictDataclassFieldValidationError


def _type_error(name: str, value) -> str:
    return rf"Field '{name}' .*{re.escape(repr(value))}"


def _configs() -> list[BadInput]:
    cases = []
    add = cases.append
    for f in POSITIVE_INT_FIELDS:
        add(BadInput(f"{f} = 0", "configs", _config(**{f: 0}), ValueError, _field(f) + r"0 .*> 0"))
        add(BadInput(f"{f} = -3", "configs", _config(**{f: -3}), ValueError, _field(f) + r"-3 "))
        add(BadInput(f"{f} = '8' (str)", "configs", _config(**{f: "8"}), TypeMismatch, _type_error(f, "8")))
    for f in NON_NEGATIVE_INT_FIELDS:
        add(BadInput(f"{f} = -1", "configs", _config(**{f: -1}), ValueError, _field(f) + r"-1 .*>= 0"))
        add(BadInput(f"{f} = '1' (str)", "configs", _config(**{f: "1"}), TypeMismatch, _type_error(f, "1")))
    add(
        BadInput(
            "n_shared_experts = True (bool)",
            "configs",
            _config(n_shared_experts=True),
            TypeMismatch,
            _type_error("n_shared_experts", True),
        )
    )
    for f, bad in FLOAT_FIELDS.items():
        add(BadInput(f"{f} = {bad}", "configs", _config(**{f: bad}), ValueError, _field(f) + re.escape(repr(bad))))
        add(BadInput(f"{f} = 'abc' (str)", "configs", _config(**{f: "abc"}), TypeMismatch, _type_error(f, "abc")))
    for bad in (-1.0, 0, "abc"):  # rope_theta (older configs' field) lands in rope_parameters, checked there
        add(
            BadInput(
                f"rope_theta = {bad!r}",
                "configs",
                _config(rope_theta=bad),
                ValueError,
                _field("rope_parameters") + r".*rope_theta=" + re.escape(repr(bad)) + " must be a number > 0",
            )
        )
    add(BadInput("n_loops = 1.5", "configs", _config(n_loops=1.5), TypeMismatch, _type_error("n_loops", 1.5)))
    add(BadInput("n_loops = True", "configs", _config(n_loops=True), TypeMismatch, _type_error("n_loops", True)))
    add(
        BadInput(
            "top-k > experts",
            "configs",
            _config(num_experts_per_tok=9),
            ValueError,
            _field("num_experts_per_tok") + r"9 .*n_routed_experts=8",
        )
    )
    add(
        BadInput(
            "engram layer id out of range",
            "configs",
            _config(engram_layer_ids=[2]),
            ValueError,
            _field("engram_layer_ids") + r"\[2\] .*\[0, 2\)",
        )
    )
    add(
        BadInput(
            "engram layer id negative",
            "configs",
            _config(engram_layer_ids=[-1]),
            ValueError,
            _field("engram_layer_ids") + r"\[-1\]",
        )
    )
    add(
        BadInput(
            "engram layer ids repeated",
            "configs",
            _config(engram_layer_ids=[1, 1]),
            ValueError,
            _field("engram_layer_ids") + r"\[1, 1\] .*distinct",
        )
    )
    add(
        BadInput(
            "engram layer ids not numbers",
            "configs",
            _config(engram_layer_ids=["a"]),
            TypeMismatch,
            _type_error("engram_layer_ids", ["a"]),
        )
    )
    add(
        BadInput(
            "engram layer ids not a list",
            "configs",
            _config(engram_layer_ids=5),
            TypeMismatch,
            _type_error("engram_layer_ids", 5),
        )
    )
    add(
        BadInput(
            "engram n-gram size 0",
            "configs",
            _config(engram_ngram_sizes=[0]),
            ValueError,
            _field("engram_ngram_sizes") + r"\[0\]",
        )
    )
    add(
        BadInput(
            "engram n-gram sizes empty",
            "configs",
            _config(engram_ngram_sizes=[]),
            ValueError,
            _field("engram_ngram_sizes") + r"\[\]",
        )
    )
    add(
        BadInput(
            "engram n-gram sizes a string",
            "configs",
            _config(engram_ngram_sizes="ab"),
            TypeMismatch,
            _type_error("engram_ngram_sizes", "ab"),
        )
    )
    add(
        BadInput(
            "qk_rope_head_dim odd",
            "configs",
            _config(qk_rope_head_dim=15),
            ValueError,
            _field("qk_rope_head_dim") + r"15 .*even",
        )
    )
    add(BadInput("q_lora_rank = 0", "configs", _config(q_lora_rank=0), ValueError, _field("q_lora_rank") + r"0 "))
    add(
        BadInput(
            "q_lora_rank = 'x' (str)",
            "configs",
            _config(q_lora_rank="x"),
            TypeMismatch,
            _type_error("q_lora_rank", "x"),
        )
    )
    add(
        BadInput(
            "vocab_size below 259", "configs", _config(vocab_size=100), ValueError, _field("vocab_size") + r"100 .*259"
        )
    )
    add(
        BadInput(
            "pad_token_id out of vocab",
            "configs",
            _config(pad_token_id=999),
            ValueError,
            _field("pad_token_id") + r"999",
        )
    )
    add(
        BadInput(
            "eos_token_id out of vocab",
            "configs",
            _config(eos_token_id=999),
            ValueError,
            _field("eos_token_id") + r"999",
        )
    )
    add(
        BadInput(
            "moe_implementation unknown",
            "configs",
            _config(moe_implementation="nope"),
            ValueError,
            _field("moe_implementation") + r"'nope'",
        )
    )
    add(
        BadInput(
            "experts_implementation unknown",
            "configs",
            _config(experts_implementation="nope"),
            ValueError,
            _field("experts_implementation") + r"'nope'",
        )
    )
    add(
        BadInput(
            "hidden_act unknown", "configs", _config(hidden_act="nope"), ValueError, _field("hidden_act") + r"'nope'"
        )
    )
    add(
        BadInput(
            "initializer_range negative",
            "configs",
            _config(initializer_range=-1.0),
            ValueError,
            _field("initializer_range") + r"-1\.0",
        )
    )
    add(
        BadInput(
            "num_hidden_layers not the sum",
            "configs",
            _config(num_hidden_layers=3),
            ValueError,
            r"num_hidden_layers=3 must equal",
        )
    )
    add(
        BadInput(
            "unknown preset",
            "configs",
            lambda tmp: lambda: _preset("nope"),
            ValueError,
            r"unknown Spider preset 'nope'",
        )
    )
    add(BadInput("misspelt override (n_loop=3)", "configs", _config(n_loop=3), ValueError, r"'n_loop'.*n_loops"))
    return cases


def _preset(name):
    from configuration_spider import SpiderConfig

    return SpiderConfig.from_preset(name)


# ---------------------------------------------------------------------------------------------------------------------
# command line and environment variables (spider_training.arguments.parse_args, what train_hf.py calls first)
# ---------------------------------------------------------------------------------------------------------------------


def _cli(*argv: str, env: dict[str, str] | None = None, files: Callable[[Path], list[str]] | None = None):
    """``parse_args(argv)`` with ``--ckpt_dir tmp/run`` (a folder holding a previous run's checkpoint, which must
    survive) and the environment variables ``env`` set during the call (``files(tmp)`` appends more argv)."""

    def make(tmp: Path):
        from spider_training.arguments import parse_args

        ckpt = tmp / "run" / "checkpoint-2"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
        (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
        args = [*argv, "--ckpt_dir", str(tmp / "run"), *(files(tmp) if files else [])]

        def run():
            with mock.patch.dict(os.environ, env or {}):
                return parse_args(args)

        return run

    return make


def _pt_file(tmp: Path) -> list[str]:
    import torch

    path = tmp / "spider-step50.pt"
    torch.save({"step": 50, "model_state_dict": {"w": torch.zeros(2)}}, path)
    return ["--init_from", str(path)]


def _flags() -> list[BadInput]:
    c = "cli flags"
    return [
        BadInput(
            "--max_steps abc",
            c,
            _cli("--max_steps", "abc"),
            SystemExit,
            r"argument --max_steps.*invalid int value: 'abc'",
        ),
        BadInput("--seq_len abc", c, _cli("--seq_len", "abc"), SystemExit, r"argument --seq_len.*'abc'"),
        BadInput("--eval_from_year x", c, _cli("--eval_from_year", "x"), SystemExit, r"argument --eval_from_year"),
        BadInput("--compile maybe", c, _cli("--compile", "maybe"), SystemExit, r"argument --compile.*maybe"),
        BadInput(
            "unknown flag --no_such_flag",
            c,
            _cli("--no_such_flag", "1"),
            SystemExit,
            r"unrecognized arguments: --no_such_flag",
        ),
        BadInput("--preset nope", c, _cli("--preset", "nope"), ValueError, r"--preset .*'nope'"),
        BadInput("--precision fp16", c, _cli("--precision", "fp16"), ValueError, r"--precision .*'fp16'"),
        BadInput("--fp8_recipe x", c, _cli("--fp8_recipe", "x"), ValueError, r"--fp8_recipe .*'x'"),
        BadInput("--seq_len -1", c, _cli("--seq_len", "-1"), ValueError, r"--seq_len must be >= 1, got -1"),
        BadInput("--micro_batch 0", c, _cli("--micro_batch", "0"), ValueError, r"--micro_batch must be >= 1, got 0"),
        BadInput("--n_loops 0", c, _cli("--n_loops", "0"), ValueError, r"--n_loops must be >= 1, got 0"),
        BadInput("--lr 0", c, _cli("--lr", "0"), ValueError, r"--lr must be .*> 0, got 0"),
        BadInput("--lr nan", c, _cli("--lr", "nan"), ValueError, r"--lr must be .*got nan"),
        BadInput("--learning_rate -1", c, _cli("--learning_rate", "-1"), ValueError, r"--learning_rate .*got -1"),
        BadInput("--max_steps -5", c, _cli("--max_steps", "-5"), ValueError, r"--max_steps .*got -5"),
        BadInput(
            "--config_overrides naming no field",
            c,
            _cli("--config_overrides", "n_loops=3,nloops=2"),
            ValueError,
            r"--config_overrides .*unknown SpiderConfig field 'nloops'.*did you mean 'n_loops'",
        ),
        BadInput(
            "--config_overrides n_loops=abc",
            c,
            _cli("--config_overrides", "n_loops=abc"),
            ValueError,
            r"--config_overrides .*n_loops='abc' does not parse as SpiderConfig\.n_loops's type \(int\)",
        ),
        BadInput(
            "--config_overrides item without =",
            c,
            _cli("--config_overrides", "n_loops"),
            ValueError,
            r"--config_overrides .*'n_loops' is not key=value",
        ),
        BadInput(
            "--config_overrides engram_layer_ids=[9]",
            c,
            _cli("--config_overrides", "engram_layer_ids=[9]"),
            ValueError,
            r"--config_overrides .*SpiderConfig\.engram_layer_ids=\[9\] is invalid",
        ),
        BadInput(
            "--config_overrides n_loops=[2]",
            c,
            _cli("--config_overrides", "n_loops=[2]"),
            ValueError,
            r"--config_overrides .*n_loops.*expected int",
        ),
        BadInput(
            "--reset_steps without --resume", c, _cli("--reset_steps"), ValueError, r"--reset_steps needs --resume"
        ),
        BadInput(
            "--resume of a missing folder",
            c,
            _cli(files=lambda t: ["--resume", str(t / "gone")]),
            FileNotFoundError,
            r"--resume {tmp}/gone: no such folder",
        ),
        BadInput(
            "--init_from a tk-train.py .pt file",
            c,
            _cli(files=_pt_file),
            ValueError,
            r"--init_from {tmp}/spider-step50\.pt: is a file.*convert_tk_train",
        ),
        BadInput(
            "--init_from a missing local folder",
            c,
            _cli(files=lambda t: ["--init_from", str(t / "nope")]),
            FileNotFoundError,
            r"--init_from {tmp}/nope: no such folder",
        ),
    ]


def _env() -> list[BadInput]:
    e = "env vars"
    return [
        BadInput("SEQ_LEN=abc", e, _cli(env={"SEQ_LEN": "abc"}), ValueError, r"SEQ_LEN='abc' is not a valid int"),
        BadInput("MICRO_BATCH=1.5", e, _cli(env={"MICRO_BATCH": "1.5"}), ValueError, r"MICRO_BATCH='1\.5'"),
        BadInput("GRAD_ACCUM=' '", e, _cli(env={"GRAD_ACCUM": " "}), ValueError, r"GRAD_ACCUM=' '"),
        BadInput("N_LOOPS=many", e, _cli(env={"N_LOOPS": "many"}), ValueError, r"N_LOOPS='many'"),
        BadInput(
            "N_LOOPS=0", e, _cli(env={"N_LOOPS": "0"}), ValueError, r"--n_loops .*0.*environment variable N_LOOPS"
        ),
        BadInput(
            "MICRO_BATCH=-2", e, _cli(env={"MICRO_BATCH": "-2"}), ValueError, r"-2.*environment variable MICRO_BATCH"
        ),
        BadInput("LR=fast", e, _cli(env={"LR": "fast"}), ValueError, r"LR='fast' is not a valid float"),
        BadInput("LR=nan", e, _cli(env={"LR": "nan"}), ValueError, r"nan.*environment variable LR"),
        BadInput("LR=-1e-3", e, _cli(env={"LR": "-1e-3"}), ValueError, r"-0\.001.*environment variable LR"),
        BadInput(
            "TARGET_TOKENS=1.5e9", e, _cli(env={"TARGET_TOKENS": "1.5e9"}), ValueError, r"TARGET_TOKENS='1\.5e9'"
        ),
        BadInput("CKPT_EVERY=ten", e, _cli(env={"CKPT_EVERY": "ten"}), ValueError, r"CKPT_EVERY='ten'"),
        BadInput(
            "WORLD_SIZE=two (with TARGET_TOKENS)",
            e,
            _cli(env={"WORLD_SIZE": "two", "TARGET_TOKENS": "100000"}),
            ValueError,
            r"WORLD_SIZE='two'",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------------------


def _load(path: Path):
    """How the training code loads a release or checkpoint (``--init_from``, ``spider_training.commands.generate``)."""
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.release import checked_from_pretrained

    return checked_from_pretrained(SpiderForConditionalGeneration.from_pretrained, path)


def _folder(edit: Callable[[Path], None]):
    def make(tmp: Path):
        folder = _saved_tiny(tmp / "release")
        edit(folder)
        return lambda: _load(folder)

    return make


def _truncate(fraction: float):
    def edit(folder: Path):
        f = folder / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: int(len(data) * fraction)])

    return edit


def _edit_config(**changes):
    def edit(folder: Path):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _llama_folder(tmp: Path) -> Path:
    d = tmp / "llama"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 100,
            }
        )
    )
    return d


def _checkpoints() -> list[BadInput]:
    c = "checkpoints"

    def seed_pt(tmp: Path):
        _pt_file(tmp)
        return lambda: _load(tmp / "spider-step50.pt")

    def llama_config(tmp: Path):
        from configuration_spider import SpiderConfig
        from spider_training.release import checked_from_pretrained

        d = _llama_folder(tmp)
        return lambda: checked_from_pretrained(SpiderConfig.from_pretrained, d)

    def llama_model(tmp: Path):
        d = _llama_folder(tmp)
        return lambda: _load(d)

    return [
        BadInput(
            "model.safetensors cut in half", c, _folder(_truncate(0.5)), OSError, r"{tmp}/release/model\.safetensors"
        ),
        BadInput(
            "model.safetensors cut to 5 bytes",
            c,
            _folder(_truncate(5 / 10**9)),
            OSError,
            r"{tmp}/release/model\.safetensors",
        ),
        BadInput(
            "model.safetensors missing",
            c,
            _folder(lambda f: (f / "model.safetensors").unlink()),
            OSError,
            r"model\.safetensors.*{tmp}/release",
        ),
        BadInput(
            "config.json not JSON",
            c,
            _folder(lambda f: (f / "config.json").write_text("{oops")),
            OSError,
            r"{tmp}/release/config\.json.*not a valid JSON",
        ),
        BadInput(
            "config.json with n_loops 0", c, _folder(_edit_config(n_loops=0)), ValueError, r"SpiderConfig\.n_loops=0"
        ),
        BadInput(
            "config.json of model_type llama (SpiderConfig)",
            c,
            llama_config,
            ValueError,
            r"{tmp}/llama.*model_type 'llama'",
        ),
        BadInput(
            "config.json of model_type llama (Spider model)",
            c,
            llama_model,
            ValueError,
            r"{tmp}/llama.*model_type 'llama'",
        ),
        BadInput("seed .pt file given to from_pretrained", c, seed_pt, OSError, r"{tmp}/spider-step50\.pt"),
        BadInput(
            "missing release folder", c, lambda tmp: lambda: _load(tmp / "no_release"), OSError, r"{tmp}/no_release"
        ),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# model forward
# ---------------------------------------------------------------------------------------------------------------------


def _forward(make_inputs: Callable[[], dict]):
    def make(tmp: Path):
        model = tiny_eval_model()
        kwargs = make_inputs()

        def run():
            import torch

            with torch.no_grad():
                return model(**kwargs)

        return run

    return make


def _ids(*rows):
    import torch

    return torch.tensor(rows, dtype=torch.long)


def _model_forward() -> list[BadInput]:
    import torch

    c = "model forward"
    ok = lambda: _ids([257, 65, 66, 258])  # noqa: E731
    return [
        BadInput(
            "negative token id",
            c,
            _forward(lambda: {"input_ids": _ids([257, -1, 66])}),
            ValueError,
            r"input_ids contains token id -1",
        ),
        BadInput(
            "token id 272",
            c,
            _forward(lambda: {"input_ids": _ids([257, 272, 66])}),
            ValueError,
            r"input_ids contains token id 272",
        ),
        BadInput("token id 50256", c, _forward(lambda: {"input_ids": _ids([50256])}), ValueError, r"token id 50256"),
        BadInput(
            "1-D input_ids",
            c,
            _forward(lambda: {"input_ids": torch.tensor([257, 65])}),
            ValueError,
            r"input_ids must have shape \(batch, length\).*got \(2,\)",
        ),
        BadInput(
            "3-D input_ids",
            c,
            _forward(lambda: {"input_ids": torch.zeros(1, 2, 3, dtype=torch.long)}),
            ValueError,
            r"input_ids must have shape .*\(1, 2, 3\)",
        ),
        BadInput(
            "longer than max_position_embeddings",
            c,
            _forward(lambda: {"input_ids": torch.full((1, 513), 65)}),
            ValueError,
            r"input length 513 exceeds max_position_embeddings=512",
        ),
        BadInput("n_loops 0", c, _forward(lambda: {"input_ids": ok(), "n_loops": 0}), ValueError, r"n_loops.*got 0"),
        BadInput(
            "n_loops 1.5", c, _forward(lambda: {"input_ids": ok(), "n_loops": 1.5}), ValueError, r"n_loops.*got 1\.5"
        ),
        BadInput(
            "n_loops '2' (str)",
            c,
            _forward(lambda: {"input_ids": ok(), "n_loops": "2"}),
            ValueError,
            r"n_loops.*got '2'",
        ),
        BadInput(
            "n_loops True (bool)",
            c,
            _forward(lambda: {"input_ids": ok(), "n_loops": True}),
            ValueError,
            r"n_loops.*got True",
        ),
        BadInput(
            "labels of the wrong shape",
            c,
            _forward(lambda: {"input_ids": ok(), "labels": _ids([257, 65])}),
            ValueError,
            r"labels shape \(1, 2\) must equal input_ids shape \(1, 4\)",
        ),
        BadInput(
            "label id 999",
            c,
            _forward(lambda: {"input_ids": ok(), "labels": _ids([257, 999, 66, 258])}),
            ValueError,
            r"labels contains .*999",
        ),
        BadInput(
            "float input_ids",
            c,
            _forward(lambda: {"input_ids": ok().float()}),
            TypeError,
            r"input_ids .*torch\.float32",
        ),
        BadInput(
            "input_ids as a Python list",
            c,
            _forward(lambda: {"input_ids": [[257, 65]]}),
            TypeError,
            r"input_ids .*list",
        ),
        BadInput(
            "empty sequence (length 0)",
            c,
            _forward(lambda: {"input_ids": torch.zeros(1, 0, dtype=torch.long)}),
            ValueError,
            r"input_ids .*\(1, 0\)",
        ),
        BadInput(
            "attention_mask of another shape",
            c,
            _forward(lambda: {"input_ids": ok(), "attention_mask": torch.tensor([[0, 1, 1]])}),
            ValueError,
            r"attention_mask shape \(1, 3\) .*\(1, 4\)",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# writing shards must not lose what is already there
# ---------------------------------------------------------------------------------------------------------------------


def _write_shards_failing_midway(tmp: Path):
    """A dataset folder from an earlier ``write_shards`` run, then ``--overwrite`` from a source whose second file is
    malformed: the error must name the source and leave the earlier dataset untouched."""
    from spider_training.commands.write_shards import write_shards

    good = tmp / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"first run {i} " * 20}) + "\n" for i in range(300)))
    write_shards(str(good), tmp / "out", tokens_per_shard=2000, prefix="data")
    src = tmp / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"second run {i} " * 20}) + "\n" for i in range(300)))
    (src / "b.jsonl").write_text('{"text": "x"}\n{broken\n')
    return lambda: write_shards(str(src), tmp / "out", tokens_per_shard=2000, prefix="data", overwrite=True)


def _no_partial_shards(tmp: Path) -> None:
    meta = json.loads((tmp / "out" / "metadata.json").read_text())
    listed = {s["name"] for s in meta["shards"]}
    on_disk = {p.name for p in (tmp / "out").glob("*.bin")}
    assert on_disk == listed, f"shards on disk but not in metadata.json: {sorted(on_disk - listed)[:3]}"


def _writes() -> list[BadInput]:
    return [
        BadInput(
            "write_shards --overwrite from a source failing midway",
            "text sources",
            _write_shards_failing_midway,
            ValueError,
            r"{tmp}/src.*reading failed.*JSON",
            after=_no_partial_shards,
        )
    ]


# ---------------------------------------------------------------------------------------------------------------------


def build_registry() -> list[BadInput]:
    """All registry entries (imports are deferred to the ``make`` functions where they are heavy)."""
    cases = _shards() + _text() + _writes() + _configs() + _flags() + _env() + _checkpoints() + _model_forward()
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate BadInput names: {sorted(dupes)}")
    return cases


REGISTRY: list[BadInput] = build_registry()
