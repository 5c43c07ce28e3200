# Copyright 2026 The Spider authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Byte-level tokenizer for Spider (``SpiderTokenizer``) and tk-train.py's ``SENTINEL_TOKENS`` table.

Spider reads raw UTF-8 bytes. The vocabulary has 272 ids (docs/design.md, "Vocabulary"; the original release's
``hub-README.md``):

========  ==================  =====================================================
ids       token strings       meaning
========  ==================  =====================================================
0-255     ``chr(b)``          the byte ``b`` (id == byte value, **no offset**,
                              unlike ByT5 which shifts bytes by 3)
256       ``<pad>``           PAD (padding; labels at PAD become -100)
257       ``<s>``             BOS, prepended to every encoded text
258       ``</s>``            EOS, appended to every encoded text
259-262   ``<img_start>`` ... image sentinels IMG_START, IMG_END, IMG_PATCH,
                              IMG_NEWLINE
263       ``<boundary>``      FlexiTokens segment-boundary sentinel
264       ``<loop>``          recurrent-loop sentinel
265-271   ``<spare_0>`` ...   reserved spares (SPARE_0 ... SPARE_6)
========  ==================  =====================================================

**Moved sentinels.** The original release's README lists ``IMG_START=0, IMG_END=1, IMG_PATCH=2, IMG_NEWLINE=3``,
which collide with the bytes 0x00-0x03 (a text containing a NUL byte would read as an image marker).
They live at 259-262 here, with the boundary and loop sentinels (which tk-train.py names without ids)
after them; PAD/BOS/EOS keep tk-train.py's ids 256/257/258, so tk-train.py's ``.bin`` shards
(uint16, values 0-258) are read unchanged. Only code that used the image ids 0-3 must change.

Behaviour (same ids as tk-train.py's ``encode``/``decode``):

* ``tok("text").input_ids == [257] + list("text".encode("utf-8")) + [258]``.
  A pair ``tok(a, b)`` gives ``[BOS] a [EOS] b [EOS]``; ``add_special_tokens=False`` gives the bare bytes.
* Text is always read as bytes: the 16 reserved token strings (``"<s>"``, ``"<pad>"``, ...) inside a
  text are encoded as their bytes, exactly as tk-train.py does. Reserved ids enter a sequence only as ids
  (``add_special_tokens=True``, padding, or ids you insert). Tokens added later with ``add_tokens`` /
  ``add_special_tokens`` get ids from 272 on and *are* matched in text (the usual transformers rule),
  unless ``split_special_tokens=True``, which turns off all matching.
* ``decode`` joins the bytes and decodes them with ``errors="replace"`` (the ``errors`` init argument), so
  any id sequence decodes without raising; ``skip_special_tokens=True`` drops ids 256-271 (and any added
  special token). Without it, reserved ids are rendered as their token strings.
* Ids that are not in the vocabulary (negative, or >= ``len(tokenizer)``; 272 unless tokens were added)
  raise ``ValueError`` naming the id, in ``decode`` and ``convert_ids_to_tokens``. Token strings that are
  neither a single byte character nor an added token raise ``ValueError`` in ``convert_tokens_to_ids``.

The special ids are fixed: passing ``pad_token=``/``bos_token=``/``eos_token=`` renames the token string
at id 256/257/258, it never moves the id. There is no vocabulary file (``save_vocabulary`` writes nothing);
``save_pretrained`` writes ``tokenizer_config.json`` with an ``auto_map`` and a copy of this module, so
``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` works from the Hub.

This file is served from the Hub next to the weights: it imports only the standard library and
transformers. Modelled on transformers' ``models/byt5/tokenization_byt5.py`` (Apache-2.0).
"""

from __future__ import annotations

import numbers
import operator

from transformers.tokenization_python import AddedToken, PreTrainedTokenizer

#: Number of byte ids (0-255); byte ``b`` has id ``b``.
NUM_BYTES = 256

#: Reserved ids 256-271 by name, as in tk-train.py (``SENTINEL_TOKENS['BOS']``). The image sentinels moved
#: from tk-train.py's 0-3 (colliding with bytes) to 259-262; see the module docstring.
SENTINEL_TOKENS: dict[str, int] = {
    "PAD": 256,
    "BOS": 257,
    "EOS": 258,
    "IMG_START": 259,
    "IMG_END": 260,
    "IMG_PATCH": 261,
    "IMG_NEWLINE": 262,
    "BOUNDARY": 263,
    "LOOP": 264,
    "SPARE_0": 265,
    "SPARE_1": 266,
    "SPARE_2": 267,
    "SPARE_3": 268,
    "SPARE_4": 269,
    "SPARE_5": 270,
    "SPARE_6": 271,
}

#: Default token string of each reserved id (PAD/BOS/EOS strings can be renamed at init).
SENTINEL_TOKEN_STRINGS: dict[str, str] = {
    "PAD": "<pad>",
    "BOS": "<s>",
    "EOS": "</s>",
    "IMG_START": "<img_start>",
    "IMG_END": "<img_end>",
    "IMG_PATCH": "<img_patch>",
    "IMG_NEWLINE": "<img_newline>",
    "BOUNDARY": "<boundary>",
    "LOOP": "<loop>",
    **{f"SPARE_{i}": f"<spare_{i}>" for i in range(7)},
}

PAD_ID = SENTINEL_TOKENS["PAD"]
BOS_ID = SENTINEL_TOKENS["BOS"]
EOS_ID = SENTINEL_TOKENS["EOS"]
#: Size of the fixed vocabulary: 256 bytes + 16 reserved ids (docs/design.md, "Vocabulary").
VOCAB_SIZE = NUM_BYTES + len(SENTINEL_TOKENS)

# Reserved ids after PAD/BOS/EOS, in id order: their strings are fixed and they are registered as
# extra special tokens (so ``skip_special_tokens`` drops them and ``extra_special_tokens`` lists them).
_FIXED_SENTINEL_NAMES = [name for name, idx in sorted(SENTINEL_TOKENS.items(), key=lambda kv: kv[1]) if idx > EOS_ID]

assert sorted(SENTINEL_TOKENS.values()) == list(range(NUM_BYTES, VOCAB_SIZE)), "reserved ids must be 256..271"
assert VOCAB_SIZE == 272


def _special(token: str | AddedToken, field: str) -> AddedToken:
    """Return ``token`` as a special ``AddedToken`` that is matched verbatim (no strip, no normalisation).

    Raises:
        ValueError: ``token`` is None or empty (``field`` names the init argument).
        TypeError: ``token`` is neither a ``str`` nor an ``AddedToken``.
    """
    if token is None or str(token) == "":
        raise ValueError(
            f"SpiderTokenizer: {field} must be a non-empty string; the id it names is fixed "
            f"(PAD={PAD_ID}, BOS={BOS_ID}, EOS={EOS_ID}) and cannot be removed."
        )
    if isinstance(token, AddedToken):
        return token
    if isinstance(token, str):
        return AddedToken(token, lstrip=False, rstrip=False, single_word=False, normalized=False, special=True)
    raise TypeError(f"SpiderTokenizer: {field} must be a str or AddedToken, got {type(token).__name__}")


class SpiderTokenizer(PreTrainedTokenizer):
    """Byte-level tokenizer of Spider: id ``b`` is the UTF-8 byte ``b``; PAD=256, BOS=257, EOS=258; 272 ids.

    Source: tk-train.py's ``encode``/``decode`` (``hub-README.md``: ``[257] + list(text.encode()) + [258]``,
    ``bytes(...).decode("utf-8", errors="replace")``) on transformers' python tokenizer base, modelled on
    ``ByT5Tokenizer`` without its id offset. See the module docstring for the id table and the move of the
    tk-train.py's image sentinels away from bytes 0-3.

    Outputs: ``input_ids`` and ``attention_mask`` as lists of Python ints (or int64 tensors / arrays with
    ``return_tensors="pt"``/``"np"``), shape ``(batch, seq)`` when batched; padding uses PAD=256 on the
    ``padding_side`` ("right" by default, "left" for generation) and the mask is 1 on real tokens, 0 on PAD.

    Args:
        pad_token (`str` or `AddedToken`, defaults to `"<pad>"`): string of id 256.
        bos_token (`str` or `AddedToken`, defaults to `"<s>"`): string of id 257, prepended by
            `build_inputs_with_special_tokens`.
        eos_token (`str` or `AddedToken`, defaults to `"</s>"`): string of id 258, appended after each
            sequence.
        extra_special_tokens (`list[str]`, *optional*): further special tokens. The 13 reserved sentinels
            (ids 259-271) are always included first; any other token here is added at id 272 onwards.
        errors (`str`, defaults to `"replace"`): how `decode` treats invalid UTF-8 (any `bytes.decode`
            error handler: "replace", "ignore", "strict", "backslashreplace", ...).
        clean_up_tokenization_spaces (`bool`, defaults to `False`): must stay False for exact round trips
            (the cleanup removes spaces before punctuation).
        split_special_tokens (`bool`, defaults to `False`): if True, tokens added with `add_tokens` are not
            matched in text either (the reserved ids never are).

    Raises:
        ValueError: a PAD/BOS/EOS string is None/empty or two of them are equal; `errors` is not a string.
    """

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"
    vocab_files_names = {}

    def __init__(
        self,
        pad_token: str | AddedToken = SENTINEL_TOKEN_STRINGS["PAD"],
        bos_token: str | AddedToken = SENTINEL_TOKEN_STRINGS["BOS"],
        eos_token: str | AddedToken = SENTINEL_TOKEN_STRINGS["EOS"],
        extra_special_tokens: list[str | AddedToken] | None = None,
        errors: str = "replace",
        clean_up_tokenization_spaces: bool = False,
        split_special_tokens: bool = False,
        **kwargs,
    ) -> None:
        if not isinstance(errors, str):
            raise ValueError(f"SpiderTokenizer: errors must be a bytes.decode error handler name, got {errors!r}")
        if extra_special_tokens is None and "additional_special_tokens" in kwargs:
            extra_special_tokens = kwargs.pop("additional_special_tokens")

        pad_token = _special(pad_token, "pad_token")
        bos_token = _special(bos_token, "bos_token")
        eos_token = _special(eos_token, "eos_token")
        named = {"pad_token": str(pad_token), "bos_token": str(bos_token), "eos_token": str(eos_token)}
        if len(set(named.values())) != 3:
            raise ValueError(f"SpiderTokenizer: pad/bos/eos tokens must be distinct strings, got {named}")
        fixed = {SENTINEL_TOKENS[name]: _special(SENTINEL_TOKEN_STRINGS[name], name) for name in _FIXED_SENTINEL_NAMES}
        clash = [s for s in named.values() if s in {str(t) for t in fixed.values()}]
        if clash:
            raise ValueError(f"SpiderTokenizer: {clash} is the string of a reserved sentinel (ids 259-271)")

        # The byte vocabulary needs no file; reserved ids are "added tokens" at fixed positions, set before
        # super().__init__ (as ByT5 does). A saved `added_tokens_decoder` (from_pretrained) brings back the
        # tokens added later (ids >= 272); the reserved positions are always rewritten from the arguments so
        # that e.g. `pad_token="[PAD]"` renames id 256 instead of adding a new id.
        decoder: dict[int, AddedToken] = {}
        for index, token in (kwargs.pop("added_tokens_decoder", None) or {}).items():
            decoder[int(index)] = token if isinstance(token, AddedToken) else AddedToken(str(token))
        decoder.update({PAD_ID: pad_token, BOS_ID: bos_token, EOS_ID: eos_token, **fixed})
        self._added_tokens_decoder = decoder
        self.errors = errors

        if isinstance(extra_special_tokens, dict):
            # Named model-specific tokens (v5 dict form): passed through; the reserved sentinels are still
            # skipped by `decode(skip_special_tokens=True)` (see `_reserved_ids_to_skip`).
            extras = extra_special_tokens
        else:
            extras = [str(t) for t in fixed.values()]
            for token in extra_special_tokens or []:
                if str(token) not in extras:
                    extras.append(token)

        super().__init__(
            pad_token=pad_token,
            bos_token=bos_token,
            eos_token=eos_token,
            extra_special_tokens=extras,
            errors=errors,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            split_special_tokens=split_special_tokens,
            **kwargs,
        )

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Size of the fixed vocabulary: 272 (256 bytes + 16 reserved ids); `len(tok)` adds added tokens."""
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id for all 256 byte tokens (``chr(b) -> b``), the 16 reserved and any added tokens."""
        vocab = {chr(i): i for i in range(NUM_BYTES)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Nothing to save: the byte vocabulary is implicit. Returns ``()``."""
        return ()

    # ------------------------------------------------------------------ text -> tokens

    def _reserved_strings(self) -> set[str]:
        """Current token strings of the reserved ids 256-271 (never matched inside a text)."""
        return {
            self._added_tokens_decoder[i].content
            for i in range(NUM_BYTES, VOCAB_SIZE)
            if i in self._added_tokens_decoder
        }

    def _update_trie(self, unique_no_split_tokens: list[str] | None = None):
        # Same as the base class, but the reserved token strings stay out of the trie: inside a text they
        # are plain bytes (tk-train.py parity). Tokens added by the user (ids >= 272) are matched as usual.
        reserved = self._reserved_strings()
        for token in self._added_tokens_decoder.values():
            if token.content not in reserved and token.content not in self.tokens_trie._tokens:
                self.tokens_trie.add(token.content)
        for token in unique_no_split_tokens or []:
            if token not in reserved and token not in self.tokens_trie._tokens:
                self.tokens_trie.add(token)

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """Split ``text`` into byte tokens (``chr(b)`` per UTF-8 byte) and added tokens (ids >= 272).

        The reserved token strings are bytes here even when a whole piece of text equals one of them
        (the base class would otherwise keep such a piece as the special token).
        """
        tokens = super().tokenize(text, **kwargs)
        reserved = self._reserved_strings()
        if any(token in reserved for token in tokens):
            tokens = [piece for token in tokens for piece in (self._tokenize(token) if token in reserved else [token])]
        return tokens

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        """UTF-8 bytes of ``text`` as one-character token strings ``chr(b)``."""
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        """Id of a byte token ``chr(b)`` (``b < 256``). Added tokens are resolved by the caller.

        Raises:
            ValueError: ``token`` is not a single character below U+0100 (names the token).
        """
        if isinstance(token, str) and len(token) == 1 and ord(token) < NUM_BYTES:
            return ord(token)
        raise ValueError(
            f"SpiderTokenizer: token {token!r} is not in the vocabulary: byte tokens are single characters "
            f"chr(0)..chr(255); other tokens must be added first with add_tokens()"
        )

    # ------------------------------------------------------------------ ids -> tokens -> text

    def _reserved_ids_to_skip(self) -> set[int]:
        """Ids dropped by ``skip_special_tokens=True``: all reserved ids 256-271 plus added special tokens."""
        return set(range(NUM_BYTES, VOCAB_SIZE)) | {i for i in self.all_special_ids if i is not None}

    def _check_id(self, raw) -> int:
        """Validate one token id; return it as ``int``.

        Raises:
            TypeError: ``raw`` is not an integer (e.g. a float).
            ValueError: the id is negative or not in the vocabulary (names the id and the valid range).
        """
        try:
            index = operator.index(raw)
        except TypeError:
            if hasattr(raw, "item"):  # 0-d torch / numpy values
                return self._check_id(raw.item())
            raise TypeError(
                f"SpiderTokenizer: token ids must be integers, got {raw!r} ({type(raw).__name__})"
            ) from None
        if 0 <= index < NUM_BYTES or index in self._added_tokens_decoder:
            return index
        raise ValueError(
            f"SpiderTokenizer: token id {index} is not in the vocabulary (valid ids: 0-255 bytes, "
            f"256-271 reserved, up to {len(self) - 1} with added tokens)"
        )

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """Token strings of ``ids`` (an int or a sequence of ints); byte ``b`` -> ``chr(b)``.

        With ``skip_special_tokens=True`` the reserved ids 256-271 and added special tokens are dropped from
        a sequence (a single int is always converted).

        Raises:
            ValueError: an id is not in the vocabulary (the message names the id).
        """
        if isinstance(ids, numbers.Integral) or (hasattr(ids, "ndim") and getattr(ids, "ndim", 1) == 0):
            index = self._check_id(ids)
            return self._id_to_token(index)
        skip = self._reserved_ids_to_skip() if skip_special_tokens else ()
        tokens = []
        for raw in ids:
            index = self._check_id(raw)
            if index in skip:
                continue
            tokens.append(self._id_to_token(index))
        return tokens

    def _id_to_token(self, index: int) -> str:
        if index in self._added_tokens_decoder and not index < NUM_BYTES:
            return self._added_tokens_decoder[index].content
        return self._convert_id_to_token(index)

    def _convert_id_to_token(self, index: int) -> str:
        """Byte token ``chr(index)`` for ``0 <= index < 256``.

        Raises:
            ValueError: ``index`` is not a byte id (names the id).
        """
        if 0 <= index < NUM_BYTES:
            return chr(index)
        raise ValueError(f"SpiderTokenizer: token id {index} is not a byte id (0-255) nor an added token")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join byte tokens into bytes (added tokens contribute their UTF-8 text) and decode with ``self.errors``.

        Raises:
            ValueError: a token is neither a byte token nor an added token (names the token).
        """
        buffer = bytearray()
        for token in tokens:
            if len(token) == 1 and ord(token) < NUM_BYTES:
                buffer.append(ord(token))
            elif token in self._added_tokens_encoder:
                buffer += token.encode("utf-8")
            else:
                raise ValueError(f"SpiderTokenizer: cannot turn token {token!r} into bytes: not in the vocabulary")
        return buffer.decode("utf-8", errors=self.errors)

    # ------------------------------------------------------------------ special tokens

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        """Add tk-train.py's special tokens: ``[BOS] a [EOS]``, or ``[BOS] a [EOS] b [EOS]`` for a pair."""
        out = [self.bos_token_id] + list(token_ids_0) + [self.eos_token_id]
        if token_ids_1 is not None:
            out += list(token_ids_1) + [self.eos_token_id]
        return out

    def get_special_tokens_mask(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        """1 where `build_inputs_with_special_tokens` puts BOS/EOS, 0 on the sequence ids."""
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        mask = [1] + [0] * len(token_ids_0) + [1]
        if token_ids_1 is not None:
            mask += [0] * len(token_ids_1) + [1]
        return mask

    def create_token_type_ids_from_sequences(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        """Spider has no token types: zeros, as long as `build_inputs_with_special_tokens`' output."""
        return [0] * len(self.build_inputs_with_special_tokens(token_ids_0, token_ids_1))


SpiderTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["SpiderTokenizer", "SENTINEL_TOKENS", "SENTINEL_TOKEN_STRINGS", "VOCAB_SIZE", "PAD_ID", "BOS_ID", "EOS_ID"]
