"""Tests of SpiderTokenizer (tokenization_spider.py).

1. ``SpiderTokenizationTest`` runs transformers' own ``TokenizerTesterMixin`` suite (from the transformers sdist,
   see tests/hf_suites.py) against SpiderTokenizer, with the suite's integration check fed by tk-train.py's
   ``encode`` rule.
2. Our own tests: ids equal tk-train.py's ``encode``/``decode`` (hub-README.md), padding, reserved ids, errors,
   save/load, AutoTokenizer from a saved folder in a fresh process, and hypothesis properties.
3. A few tests of the tests/hf_suites.py infrastructure (failure paths).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenization_spider
from tests import hf_suites
from tokenization_spider import SENTINEL_TOKENS, SpiderTokenizer

REPO_ROOT = Path(tokenization_spider.__file__).resolve().parent


# tk-train.py's tokenizer, verbatim from seeds/hub-README.md ("## Tokenizer"): the oracle for ids.
def seed_encode(text: str) -> list[int]:
    return [257] + list(text.encode("utf-8")) + [258]  # BOS + bytes + EOS


def seed_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i <= 255).decode("utf-8", errors="replace")


SAMPLES = [
    "",
    "text",
    "Hello, world!",
    "Héllo wörld — ça va? 生活的真谛是 😊 🕷️",
    "nul\x00byte and \x01\x02\x03 control bytes",  # bytes 0-3: tk-train.py's old image-sentinel ids
    "literal <s>, </s>, <pad> and <img_start> are text",
    "<s>",
    "  leading and trailing spaces  \n\t",
]


@pytest.fixture(scope="module")
def tok() -> SpiderTokenizer:
    return SpiderTokenizer()


# --------------------------------------------------------------------------- 1. transformers' suite

TokenizerTesterMixin = hf_suites.suite_class("test_tokenization_common", "TokenizerTesterMixin")


class SpiderTokenizationTest(TokenizerTesterMixin, unittest.TestCase):
    """transformers' common tokenizer tests on SpiderTokenizer.

    ``from_pretrained_id`` is a local folder saved by ``SpiderTokenizer().save_pretrained`` (loaded by the suite
    through ``AutoTokenizer`` with ``trust_remote_code``), which turns on the suite's Hub-style checks
    (integration, added-token serialisation, local_files_only) without the Hub.
    """

    tokenizer_class = SpiderTokenizer
    from_pretrained_kwargs = {"trust_remote_code": True}
    test_tokenizer_from_extractor = False  # no tokenizer.json: nothing for TokenizersExtractor to read

    @classmethod
    def setUpClass(cls):
        cls._source_dir = tempfile.mkdtemp(prefix="spider-tok-")
        SpiderTokenizer().save_pretrained(cls._source_dir)
        cls.from_pretrained_id = [cls._source_dir]
        text = getattr(cls, "integration_test_input_string", None)
        if text is not None:
            # Expected values from tk-train.py's rule (bytes, no specials), not from the tokenizer under test.
            cls.integration_expected_token_ids = list(text.encode("utf-8"))
            cls.integration_expected_tokens = [chr(b) for b in text.encode("utf-8")]
            cls.integration_expected_decoded_text = text
        super().setUpClass()
        if not hasattr(cls, "tmpdirname"):  # placeholder mixin (suite unavailable)
            cls.tmpdirname = tempfile.mkdtemp(prefix="spider-tok-")
        SpiderTokenizer().save_pretrained(cls.tmpdirname)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls._source_dir, ignore_errors=True)
        super().tearDownClass()

    @unittest.skip(
        reason="pre-tokenized input (is_split_into_words) drops the spaces between words: a byte tokenizer has no "
        "word-boundary marker to put them back (ByT5Tokenizer skips this test for the same reason)"
    )
    def test_pretokenized_inputs(self):
        pass

    def test_vocab_round_trip(self):
        # our cheap replacement of the suite's @slow test_conversion_reversible
        tokenizer = SpiderTokenizer.from_pretrained(self.tmpdirname)
        for token, index in tokenizer.get_vocab().items():
            self.assertEqual(tokenizer.convert_tokens_to_ids(token), index)
            self.assertEqual(tokenizer.convert_ids_to_tokens(index), token)


# --------------------------------------------------------------------------- 2. our own tests


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_seed(tok, text):
    assert tok(text).input_ids == seed_encode(text)
    assert tok.encode(text) == seed_encode(text)
    assert tok(text, add_special_tokens=False).input_ids == seed_encode(text)[1:-1]
    assert tok(text).attention_mask == [1] * len(seed_encode(text))


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_matches_seed(tok, text):
    ids = seed_encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == seed_decode(ids) == text


def test_pair_layout_and_masks(tok):
    out = tok("ab", "c", return_special_tokens_mask=True, return_token_type_ids=True)
    bos, eos = SENTINEL_TOKENS["BOS"], SENTINEL_TOKENS["EOS"]
    assert out.input_ids == [bos, ord("a"), ord("b"), eos, ord("c"), eos]
    assert out.special_tokens_mask == [1, 0, 0, 1, 0, 1]
    assert out.token_type_ids == [0] * 6
    assert "token_type_ids" not in tok("ab", "c")  # model_input_names: input_ids, attention_mask
    assert tok.model_input_names == ["input_ids", "attention_mask"]


def test_truncation_keeps_bos_and_eos(tok):
    assert tok("abcdef", max_length=4, truncation=True).input_ids == seed_encode("ab")


def test_decode_keeps_or_drops_reserved_ids(tok):
    ids = [SENTINEL_TOKENS["BOS"], ord("h"), 0xFF, ord("i"), SENTINEL_TOKENS["IMG_START"], SENTINEL_TOKENS["EOS"]]
    ids += [SENTINEL_TOKENS["PAD"]] * 2
    assert tok.decode(ids, skip_special_tokens=True) == "h\ufffdi"  # 0xFF alone is invalid UTF-8
    assert tok.decode(ids) == "<s>h\ufffdi<img_start></s><pad><pad>"
    assert tok.batch_decode([ids, ids[:2]], skip_special_tokens=True) == ["h\ufffdi", "h"]
    # every reserved id is dropped, whatever its name
    assert tok.decode(list(range(256, 272)), skip_special_tokens=True) == ""


def test_decode_accepts_tensors_and_numpy(tok):
    ids = seed_encode("tensor é")
    assert tok.decode(torch.tensor(ids), skip_special_tokens=True) == "tensor é"
    assert tok.decode(np.array(ids, dtype=np.int64), skip_special_tokens=True) == "tensor é"
    assert tok.convert_ids_to_tokens(torch.tensor(97)) == "a"
    assert tok.convert_ids_to_tokens(np.int64(98)) == "b"


def test_decode_errors_argument():
    strict = SpiderTokenizer(errors="strict")
    with pytest.raises(UnicodeDecodeError):
        strict.decode([0xC3])  # truncated 2-byte sequence
    assert SpiderTokenizer(errors="ignore").decode([0xC3, ord("a")]) == "a"
    assert SpiderTokenizer().decode([0xC3, ord("a")]) == "\ufffda"


@pytest.mark.parametrize("side", ["right", "left"])
def test_batch_padding(tok, side):
    texts = ["a", "abcd", ""]
    out = tok(texts, padding=True, padding_side=side)
    longest = max(len(seed_encode(t)) for t in texts)
    pad = SENTINEL_TOKENS["PAD"]
    for text, ids, mask in zip(texts, out.input_ids, out.attention_mask):
        real = seed_encode(text)
        n_pad = longest - len(real)
        expected = real + [pad] * n_pad if side == "right" else [pad] * n_pad + real
        expected_mask = [1] * len(real) + [0] * n_pad if side == "right" else [0] * n_pad + [1] * len(real)
        assert ids == expected
        assert mask == expected_mask


def test_batch_padding_tensors_and_tokenizer_side(tok):
    left = SpiderTokenizer(padding_side="left")
    out = left(["xyz", "x"], padding="max_length", max_length=8, return_tensors="pt")
    assert out.input_ids.shape == (2, 8) and out.input_ids.dtype == torch.int64
    assert out.attention_mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]
    assert out.input_ids[1].tolist() == [256] * 5 + seed_encode("x")
    # pad() of already-encoded rows (what a data collator does)
    rows = [{"input_ids": seed_encode("ab")}, {"input_ids": seed_encode("")}]
    padded = tok.pad(rows, return_tensors="pt")
    assert padded.input_ids.tolist() == [seed_encode("ab"), seed_encode("") + [256, 256]]
    assert padded.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_sentinel_tokens_table(tok):
    seed_names = {"PAD", "BOS", "EOS", "IMG_START", "IMG_END", "IMG_PATCH", "IMG_NEWLINE"}
    assert seed_names <= set(SENTINEL_TOKENS)
    assert all(isinstance(k, str) for k in SENTINEL_TOKENS)
    ids = list(SENTINEL_TOKENS.values())
    assert len(set(ids)) == len(ids) == 16
    assert min(ids) >= 256, "a sentinel collides with a byte id"
    assert set(ids) == set(range(256, tok.vocab_size))
    # tk-train.py's ids (hub-README: PAD=256, BOS=257, EOS=258) and the tokenizer's attributes agree
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert (SENTINEL_TOKENS["PAD"], SENTINEL_TOKENS["BOS"], SENTINEL_TOKENS["EOS"]) == (256, 257, 258)
    assert tok.vocab_size == len(tok) == len(tok.get_vocab()) == 272 == tokenization_spider.VOCAB_SIZE
    assert set(tok.all_special_ids) == set(ids)
    for name, index in SENTINEL_TOKENS.items():
        token = tok.convert_ids_to_tokens(index)
        assert tok.convert_tokens_to_ids(token) == index, name
        assert tokenization_spider.SENTINEL_TOKEN_STRINGS[name] == token


def test_reserved_strings_in_text_are_bytes_but_added_tokens_match(tok):
    text = "<s><img_start></s>"
    assert tok(text, add_special_tokens=False).input_ids == list(text.encode())
    custom = SpiderTokenizer()
    assert custom.add_tokens(["<new>"]) == 1
    assert custom.add_special_tokens({"extra_special_tokens": ["<ctl>"]}, replace_extra_special_tokens=False) == 1
    ids = custom("a<new>b<ctl><s>", add_special_tokens=False).input_ids
    assert ids == [ord("a"), 272, ord("b"), 273] + list(b"<s>")
    assert custom.decode(ids) == "a<new>b<ctl><s>"
    assert custom.decode(ids, skip_special_tokens=True) == "a<new>b<s>"
    # split_special_tokens=True: nothing is matched, everything is bytes
    assert custom("a<new>", add_special_tokens=False, split_special_tokens=True).input_ids == list(b"a<new>")
    # replacing the extra special tokens does not make the reserved ids decodable as text
    custom.add_special_tokens({"extra_special_tokens": ["<only>"]})
    assert custom.decode([SENTINEL_TOKENS["IMG_END"], ord("z")], skip_special_tokens=True) == "z"


def test_renaming_special_tokens_keeps_ids():
    renamed = SpiderTokenizer(pad_token="[PAD]", eos_token="<eos>")
    assert (renamed.pad_token_id, renamed.eos_token_id) == (256, 258)
    assert renamed.convert_ids_to_tokens(256) == "[PAD]" and len(renamed) == 272
    with pytest.raises(ValueError, match="distinct"):
        SpiderTokenizer(pad_token="</s>")
    with pytest.raises(ValueError, match="bos_token"):
        SpiderTokenizer(bos_token="")
    with pytest.raises(ValueError, match="reserved sentinel"):
        SpiderTokenizer(pad_token="<img_start>")


@pytest.mark.parametrize("bad", [272, 300, -1, -100, 10**9])
def test_bad_ids_raise_value_error_naming_the_id(tok, bad):
    with pytest.raises(ValueError, match=rf"token id {bad}\b"):
        tok.decode([ord("a"), bad])
    with pytest.raises(ValueError, match=rf"token id {bad}\b"):
        tok.decode([ord("a"), bad], skip_special_tokens=True)
    with pytest.raises(ValueError, match=rf"token id {bad}\b"):
        tok.convert_ids_to_tokens(bad)
    with pytest.raises(ValueError, match=rf"token id {bad}\b"):
        tok.convert_ids_to_tokens([bad])


def test_bad_tokens_and_types_raise(tok):
    with pytest.raises(ValueError, match="'生'"):
        tok.convert_tokens_to_ids("生")
    with pytest.raises(ValueError, match="'<nope>'"):
        tok.convert_tokens_to_ids(["a", "<nope>"])
    with pytest.raises(TypeError, match="integers"):
        tok.convert_ids_to_tokens([1.5])
    with_added = SpiderTokenizer()
    with_added.add_tokens(["bim"])
    assert with_added.decode([272]) == "bim"  # valid once added
    with pytest.raises(ValueError, match="token id 273"):
        with_added.decode([273])


def test_save_and_load_round_trip(tmp_path):
    original = SpiderTokenizer(pad_token="[PAD]", model_max_length=4096)
    original.add_tokens(["bim"])
    assert original.save_vocabulary(str(tmp_path)) == ()
    original.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_spider.SpiderTokenizer"
    assert config["tokenizer_class"] == "SpiderTokenizer"
    assert (tmp_path / "tokenization_spider.py").read_bytes() == (REPO_ROOT / "tokenization_spider.py").read_bytes()

    loaded = SpiderTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == original.get_vocab()
    assert loaded.pad_token == "[PAD]" and loaded.pad_token_id == 256
    assert loaded.model_max_length == 4096
    assert loaded.extra_special_tokens == original.extra_special_tokens
    for text in SAMPLES + ["bim bam"]:
        assert loaded(text).input_ids == original(text).input_ids
    assert loaded("bim", add_special_tokens=False).input_ids == [272]


def test_auto_tokenizer_from_saved_folder_in_fresh_process(tmp_path):
    saved = tmp_path / "saved"
    tokenizer = SpiderTokenizer()
    tokenizer.add_tokens(["bim"])
    tokenizer.save_pretrained(saved)
    script = textwrap.dedent(
        """
        import json, sys
        repo = sys.argv[2]
        assert not any(p and __import__("os").path.realpath(p) == repo for p in sys.path), sys.path
        # (an editable install may still make the repo's tokenization_spider importable: the module check below
        # proves the class came from the saved folder's code, through transformers' dynamic modules)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
        out = tok(["hi bim", "é"], padding=True, padding_side="left")
        print(json.dumps({
            "cls": type(tok).__name__, "module": type(tok).__module__, "len": len(tok),
            "ids": out["input_ids"], "mask": out["attention_mask"],
            "text": tok.decode(out["input_ids"][1], skip_special_tokens=True),
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(saved), str(REPO_ROOT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "SpiderTokenizer"
    assert result["module"].startswith("transformers_modules."), result["module"]
    assert result["len"] == 273
    hi_bim = [257] + list(b"hi ") + [272, 258]
    e_acute = seed_encode("é")
    assert result["ids"] == [hi_bim, [256] * (len(hi_bim) - len(e_acute)) + e_acute]
    assert result["mask"][1] == [0] * (len(hi_bim) - len(e_acute)) + [1] * len(e_acute)
    assert result["text"] == "é"


# hypothesis properties ---------------------------------------------------------------------------

_TOK = SpiderTokenizer()


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips_and_matches_seed(text):
    ids = _TOK(text).input_ids
    assert ids == seed_encode(text)
    assert _TOK.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=300, deadline=None)
@given(st.binary())
def test_any_byte_sequence_decodes(data):
    assert _TOK.decode(list(data)) == data.decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=271)))
def test_any_valid_id_sequence_decodes_like_seed(ids):
    assert _TOK.decode(ids, skip_special_tokens=True) == seed_decode(ids)


# --------------------------------------------------------------------------- 3. hf_suites infrastructure


def test_hf_suites_exposes_the_suites():
    assert hf_suites.tokenization_common.TokenizerTesterMixin is TokenizerTesterMixin
    modeling_common = hf_suites.modeling_common
    assert issubclass(modeling_common.ModelTesterMixin, modeling_common.ExportTesterMixin)
    assert hf_suites.configuration_common.ConfigTester.__name__ == "ConfigTester"
    # get_tests_dir() of the suite resolves to the extracted package, where the fixture lives
    assert (hf_suites.suites_dir() / "fixtures" / "sample_text.txt").is_file()
    assert hf_suites.cache_root() not in REPO_ROOT.parents and REPO_ROOT not in hf_suites.suites_dir().parents


def test_suite_class_placeholder_fails_loudly(monkeypatch):
    def fake_load_suite(name):  # test double for a failed download
        raise hf_suites.HFSuitesUnavailable("pip download failed: simulated")

    monkeypatch.setattr(hf_suites, "load_suite", fake_load_suite)
    Mixin = hf_suites.suite_class("test_tokenization_common", "TokenizerTesterMixin")

    class UsesPlaceholder(Mixin, unittest.TestCase):
        pass

    result = unittest.TestResult()
    UsesPlaceholder("test_transformers_common_suite_available").run(result)
    assert len(result.failures) == 1 and not result.skipped
    assert "simulated" in result.failures[0][1]
    helper = hf_suites.suite_class("test_configuration_common", "ConfigTester")(object(), config_class=dict)
    with pytest.raises(AssertionError, match="simulated"):
        helper.run_common_tests()


def test_missing_sdist_raises_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIDER_HF_TESTS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(hf_suites.HFSuitesUnavailable, match=r"transformers==0\.0\.0"):
        hf_suites.suites_dir(version="0.0.0")
    assert not list((tmp_path / "cache").glob("transformers-0.0.0-tests*/"))
