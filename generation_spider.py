# Copyright 2026 The Spider authors. Licensed under the Apache License, Version 2.0.
"""Incremental decoding for Spider: :class:`SpiderCache` and the hooks ``generate()`` calls.

:class:`SpiderCache` is a transformers ``Cache`` with one layer per model layer, in the model's
order: a :class:`SpiderDynamicLayer` per prelude and coda layer (byte keys and values), a
:class:`SpiderRecurrentLayerCache` per recurrent layer holding one :class:`SpiderLayerCache` per
loop (segment keys and values written at per-row slots, which no transformers cache layer can
express). Beside the layers it keeps the segment-level state: a per-byte record of the prelude
outputs, Engram memory and boundaries, from which :meth:`SpiderCache.restore` rebuilds segment
counts, positions and the open segment's sums (docs/design.md, "Generation cache").

:class:`SpiderDecodingMixin` gives ``SpiderModel`` the cache a full forward fills and its cached
decode step, which runs the model's own modules one byte at a time and writes the cache (with the
decode step's own mask function, :func:`segment_slot_mask_function`); :class:`SpiderGenerationMixin`
builds a cache per ``generate()`` call and hands the model only the bytes it has not seen.

Ships beside ``modeling_spider.py`` (``trust_remote_code`` copies it); imports only torch and
transformers.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import GenerationMixin
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils import logging

try:  # loaded as part of a package (trust_remote_code, or `spider` installed as a package)
    from .configuration_spider import SpiderConfig
except ImportError:  # loaded as a top-level module from the repository root
    from configuration_spider import SpiderConfig

logger = logging.get_logger(__name__)


def write_segment_slots(cache: SpiderCache, buffer: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """`new` (one segment per row, length 1 along `dim`) written in place into `buffer` at each row's slot
    `cache.segment_write_index` `(B,)`; returns the buffer. A growing cache's buffer is first grown (zeros) to hold
    `cache.segment_slots` slots, at least doubling, so a decode step copies its own segment, not the whole cache
    (the slots past `segment_slots` are never read: :meth:`SpiderLayerCache.update` returns the first
    `segment_slots`); a fixed-size cache's buffer keeps its address (CUDA graphs)."""
    if not cache.is_compileable and buffer.shape[dim] < cache.segment_slots:
        buffer = fixed_size(buffer, dim, max(cache.segment_slots, 2 * buffer.shape[dim]))
    # an index_put_ (not scatter_): inductor writes it into the buffer instead of copying the whole buffer
    rows = torch.arange(new.shape[0], device=new.device)
    index = (rows, *([slice(None)] * (dim - 1)), cache.segment_write_index)
    buffer[index] = new.select(dim, 0)
    return buffer


def segment_slot_mask_function(
    query_slots: torch.Tensor, key_slots: torch.Tensor, sliding_window: int | None
) -> Callable:
    """A recurrent decode step's mask function (``transformers.masking_utils``): the query of row
    `b` at segment slot `query_slots` `(B, T_q)` int64 sees the keys at slots `key_slots`
    `(B, T_k)` at or before its own and, with a `sliding_window`, less than `sliding_window`
    before it (rows close segments at different bytes, so the slots are per row)."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        distance = query_slots[batch_idx, q_idx] - key_slots[batch_idx, kv_idx]
        if sliding_window is None:
            return distance >= 0
        return (distance >= 0) & (distance < sliding_window)

    return inner_mask


def _select_rows(holder, names: tuple[str, ...], rows: torch.LongTensor) -> None:
    """Replace each tensor attribute `names` of `holder` (None skipped) by its batch rows `rows`."""
    for name in names:
        if getattr(holder, name) is not None:
            setattr(holder, name, getattr(holder, name).index_select(0, rows))


def _filled_slots(buffer_name: str, dim: int) -> property:
    """A :class:`SpiderLayerCache` tensor: its buffer `buffer_name` cut to the cache's `segment_slots` along `dim` (a
    growing cache's buffers have room to grow into); setting it sets the buffer."""

    def get(self):
        # is_compileable first: a compiled decode step must not read `seen_bytes` (a Python int; dynamo would guard
        # on it and recompile at every byte), and a fixed-size buffer is all slots anyway
        buffer, cache = getattr(self, buffer_name), self.cache
        if buffer is None or cache.is_compileable or not cache.seen_bytes or buffer.shape[dim] == cache.segment_slots:
            return buffer
        return buffer.narrow(dim, 0, cache.segment_slots)

    setter = lambda self, value: setattr(self, buffer_name, value)  # noqa: E731
    return property(get, setter, doc=f"The first `segment_slots` slots of `{buffer_name}` (along dim {dim}).")


class SpiderLayerCache:
    """One recurrent layer's cache for one loop: keys `(B, H, S, qk_head_dim)`, values
    `(B, H, S, v_head_dim)` (post-RoPE) and Engram conv inputs `(B, S, D)` per segment slot. A
    decode step writes row b at ``segment_write_index[b]``: rows close segments at different bytes,
    which no transformers cache layer can express. The tensors are the first `S = segment_slots` slots of buffers
    that a growing cache doubles when full (:func:`write_segment_slots`)."""

    keys, values, conv_inputs = (
        _filled_slots("key_buffer", 2),
        _filled_slots("value_buffer", 2),
        _filled_slots("conv_buffer", 1),
    )

    def __init__(self, cache: SpiderCache):
        self.cache = cache
        self.key_buffer = self.value_buffer = self.conv_buffer = None

    def _write(self, buffer: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
        return new if buffer is None else write_segment_slots(self.cache, buffer, new, dim)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `keys`/`values` `(B, H, T, d)`; return every key/value the queries may see."""
        self.key_buffer = self._write(self.key_buffer, keys, dim=2)
        self.value_buffer = self._write(self.value_buffer, values, dim=2)
        return self.keys, self.values

    def conv_window(self, conv_inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """The Engram convolution's causal window: `(B, S, D)` -> `(B, kernel_size - 1 + S, D)`."""
        first = self.conv_buffer is None
        self.conv_buffer = self._write(self.conv_buffer, conv_inputs, dim=1)
        if first:
            return F.pad(conv_inputs, (0, 0, kernel_size - 1, 0))
        offsets = torch.arange(-(kernel_size - 1), 1, device=conv_inputs.device)
        positions = self.cache.segment_write_index[:, None] + offsets  # (B, kernel_size)
        window = self.conv_buffer.gather(1, positions.clamp(min=0)[..., None].expand(-1, -1, conv_inputs.shape[-1]))
        return window * (positions >= 0)[..., None].to(window.dtype)

    def select_rows(self, rows: torch.LongTensor) -> None:
        _select_rows(self, ("key_buffer", "value_buffer", "conv_buffer"), rows)


class SpiderRecurrentLayerCache(CacheLayerMixin):
    """The transformers cache layer of one recurrent layer: its :class:`SpiderLayerCache` per loop
    (`loops`). The model writes the loops' caches directly."""

    is_croppable = True  # stale slots stay: the mask hides them and the next write replaces them

    def __init__(self, loops: list[SpiderLayerCache]):
        super().__init__()
        self.loops = loops

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a recurrent layer caches one SpiderLayerCache per loop: use .loops[t].update")

    def get_seq_length(self) -> int:
        """Segment slots held (the null segment included)."""
        keys = self.loops[0].keys if self.loops else None
        return 0 if keys is None else keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.LongTensor) -> None:
        for loop in self.loops:
            loop.select_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


def fixed_size(tensor: torch.Tensor, dim: int, length: int, fill=0) -> torch.Tensor:
    """`tensor` copied into a new buffer `length` long along `dim`, the rest `fill`."""
    shape = list(tensor.shape)
    shape[dim] = length
    buffer = tensor.new_full(shape, fill)
    buffer.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return buffer


class SpiderDynamicLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` for a prelude or coda layer (keys `(B, H, T, qk_head_dim)`, values `(B, H, T,
    v_head_dim)`, exactly the bytes seen) whose tensors are views of buffers that at least double when full: a decode
    step writes its byte's column in place, where ``DynamicLayer`` concatenates (a copy of the whole cache every
    byte). A layer whose tensors were replaced (rows selected, caches joined) is copied into a new buffer at its
    next write; the attention reads the same values, in the same layout but for the row stride."""

    key_buffer = value_buffer = None

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if not (_views_start_of(self.keys, self.key_buffer) and _views_start_of(self.values, self.value_buffer)) or (
            length + new > self.key_buffer.shape[-2]
        ):
            self.key_buffer = fixed_size(self.keys, 2, 2 * (length + new))
            self.value_buffer = fixed_size(self.values, 2, 2 * (length + new))
        self.key_buffer[:, :, length : length + new] = key_states
        self.value_buffer[:, :, length : length + new] = value_states
        self.keys = self.key_buffer[:, :, : length + new]
        self.values = self.value_buffer[:, :, : length + new]
        return self.keys, self.values


def _views_start_of(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `tensor` is the first columns (dim 2) of `buffer`, all its other dims whole."""
    return (
        buffer is not None
        and tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:2] == buffer.shape[:2]
        and tensor.shape[3:] == buffer.shape[3:]
    )


class SpiderStaticByteLayer(CacheLayerMixin):
    """A prelude or coda layer's keys `(B, H, K, qk_head_dim)` and values `(B, H, K, v_head_dim)` in fixed-size
    buffers of ``K = cache.byte_key_slots`` columns (transformers' ``StaticLayer`` with Spider's write position, or,
    under a ``sliding_window`` shorter than ``max_cache_len``, its ``StaticSlidingWindowLayer``: a ring of the last
    ``sliding_window`` bytes): a decode step writes its byte at slot ``cache.position % K`` in place and attends over
    the whole buffer, the mask (:func:`static_byte_mask_function`) hiding the slots not yet written."""

    is_compileable = True
    is_croppable = False

    def __init__(self, cache: SpiderStaticCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.cache = cache
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one byte's `key_states`/`value_states` `(B, H, 1, d)` at slot ``cache.position % K``; return the
        whole buffers."""
        slot = self.cache.position.remainder(self.keys.shape[2])
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cache.seen_bytes

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def batch_select_indices(self, indices: torch.LongTensor) -> None:
        _select_rows(self, ("keys", "values"), indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


class SpiderCache(Cache):
    """Incremental-decoding state of :class:`SpiderModel`, a transformers ``Cache`` with one layer
    per model layer (crop, beam reordering; not compileable). The recurrent block runs when a byte
    closes a segment; a per-byte record rebuilds the rest (:meth:`restore`). Valid for the
    ``n_loops`` it was built with (docs/design.md, "Generation cache")."""

    RECORD = ("input_ids", "byte_states", "byte_memory", "boundaries")
    ROW_STATE = (
        "byte_mask",
        "segment_outputs",
        "byte_positions",
        "open_sum",
        "open_memory_sum",
        "open_count",
        "num_segments",
        "last_segment_output",
    )

    def __init__(self, config: SpiderConfig, n_loops: int):
        self.config = config
        self.n_loops = n_loops
        self.prelude = [SpiderDynamicLayer() for _ in range(config.num_prelude_layers)]
        self.coda = [SpiderDynamicLayer() for _ in range(config.num_coda_layers)]
        # recurrent[t][i]: loop t's cache of recurrent layer i
        self.recurrent = [[SpiderLayerCache(self) for _ in range(config.num_recurrent_layers)] for _ in range(n_loops)]
        recurrent_layers = [
            SpiderRecurrentLayerCache([loop[i] for loop in self.recurrent]) for i in range(config.num_recurrent_layers)
        ]
        super().__init__(layers=[*self.prelude, *recurrent_layers, *self.coda])
        self.seen_bytes = 0  # columns of input_ids consumed, padding included
        self.byte_mask = None  # (B, n) bool, or None while no column is padding
        # RECORD's (B, n) int64, (B, n, D), (B, n, M), (B, n) fp32, in buffers that double
        self.record = dict.fromkeys(self.RECORD)
        self.record_length = 0
        self.segment_outputs = None  # (B, >= segment_slots, D) fp32 per closed segment (slot 0: null segment)
        # derived from the record by restore(): (B,) int64 RoPE position of the next byte
        self.byte_positions = None
        self.open_sum = self.open_memory_sum = self.open_count = None  # (B, D), (B, M), (B,) fp32
        self.num_segments = None  # (B,) int64: closed segments (the null segment excluded)
        self.last_segment_output = None  # (B, D) fp32
        self.segment_write_index = None  # (B,) int64, set for one recurrent decode step
        self.segment_slots = 0

    def _recorded(name: str):  # noqa: N805 (a property factory used in the class body)
        return property(
            lambda self: None if self.record[name] is None else self.record[name][:, : self.record_length],
            doc=f"The record's {name}: the first `record_length` columns of its buffer.",
        )

    input_ids, byte_states = _recorded("input_ids"), _recorded("byte_states")
    byte_memory, boundaries = _recorded("byte_memory"), _recorded("boundaries")
    del _recorded

    # --- what generate() reads --------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Bytes (input columns) already consumed."""
        return self.seen_bytes

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` bytes (0 or negative, transformers' convention).

        Raises:
            ValueError: a positive value, or more bytes than the cache holds.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of bytes to remove (0 or negative)")
        keep = self.seen_bytes + tokens_to_remove
        if tokens_to_remove == 0 or self.seen_bytes == 0:
            return
        if keep < 0:
            raise ValueError(f"crop({tokens_to_remove}) removes more bytes than the cache holds ({self.seen_bytes})")
        if keep == 0:
            return self.reset()
        for layer in self.prelude + self.coda:
            layer.crop(keep - self.seen_bytes)
        self.record_length = keep
        self.byte_mask = None if self.byte_mask is None else self.byte_mask[:, :keep]
        self.seen_bytes = keep
        self.restore()  # recurrent caches keep their slots (see SpiderRecurrentLayerCache)

    def reset(self) -> None:
        """Empty the cache (the next forward is a prefill)."""
        self.__init__(self.config, self.n_loops)

    def batch_select_indices(self, indices: torch.LongTensor) -> None:
        """Keep batch rows `indices` `(B',)` int64 of every cached tensor."""
        super().batch_select_indices(indices)
        _select_rows(self, self.ROW_STATE, indices)
        self.record = {name: None if t is None else t.index_select(0, indices) for name, t in self.record.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place."""
        rows = self.num_segments.shape[0] if self.num_segments is not None else 0
        self.batch_select_indices(
            torch.arange(rows, device=self.num_segments.device).repeat_interleave(repeats)
            if rows
            else torch.zeros(0, dtype=torch.long)
        )

    def add_rows(self, other: SpiderCache) -> None:
        """Append the rows of `other` below this cache's, in place: continuous batching (Orca, Yu et al. 2022),
        where a request prefilled on its own joins a batch that is already decoding. Both caches are between decode
        steps, of one config and `n_loops`. Byte columns are aligned at the right: the rows of the cache that has
        seen fewer columns get left padding, masked out as a left-padded prompt's is (so a row goes on generating
        what it generates alone); segment slots are aligned at the left, the unused ones zeros that the masks hide.

        Raises:
            ValueError: a fixed-size cache (its rows are fixed), another `n_loops`, or a cache without a prefill.
        """
        if self.is_compileable or other.is_compileable:
            raise ValueError("add_rows: a SpiderStaticCache has a fixed number of rows; use SpiderCache")
        if other.n_loops != self.n_loops:
            raise ValueError(f"add_rows: a cache of n_loops={other.n_loops} cannot join one of n_loops={self.n_loops}")
        if not (self.seen_bytes and other.seen_bytes):
            raise ValueError("add_rows: both caches must hold a prefill (seen_bytes > 0)")
        width = max(self.seen_bytes, other.seen_bytes)

        def joined(mine: torch.Tensor, theirs: torch.Tensor, dim: int, left: bool, fill=0) -> torch.Tensor:
            size = width if left else max(mine.shape[dim], theirs.shape[dim])  # segment buffers may have room
            parts = []
            for tensor in (mine, theirs):
                pad = list(tensor.shape)
                pad[dim] = size - tensor.shape[dim]
                padding = tensor.new_full(pad, fill)
                parts.append(torch.cat([padding, tensor] if left else [tensor, padding], dim=dim))
            return torch.cat(parts, dim=0)

        for mine, theirs in zip(self.prelude + self.coda, other.prelude + other.coda):
            mine.keys, mine.values = (
                joined(getattr(mine, n), getattr(theirs, n), 2, True) for n in ("keys", "values")
            )
        for mine_loop, their_loop in zip(self.recurrent, other.recurrent):
            for mine, theirs in zip(mine_loop, their_loop):
                mine.keys = joined(mine.keys, theirs.keys, 2, False)
                mine.values = joined(mine.values, theirs.values, 2, False)
                if mine.conv_inputs is not None:
                    mine.conv_inputs = joined(mine.conv_inputs, theirs.conv_inputs, 1, False)
        masks = [c.byte_mask if c.byte_mask is not None else c.input_ids.new_ones(c.input_ids.shape, dtype=torch.bool)
                 for c in (self, other)]  # fmt: skip
        self.byte_mask = joined(*masks, 1, True, fill=False)
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        self.record = {
            name: joined(getattr(self, name), getattr(other, name), 1, True, fill=pad_id if name == "input_ids" else 0)
            for name in self.RECORD
        }
        self.record_length = self.seen_bytes = width
        self.segment_outputs = joined(self.segment_outputs, other.segment_outputs, 1, False)
        self.segment_slots = max(self.segment_slots, other.segment_slots)
        for name in self.ROW_STATE[2:]:  # per-row state: rows stacked
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], dim=0))

    # --- what the model writes --------------------------------------------------------------------

    def start(self, input_ids, byte_states, byte_memory, boundaries, byte_mask, segment_outputs) -> None:
        """After a full forward over `input_ids` `(B, n)`: the record (prelude output `(B, n, D)`,
        Engram memory `(B, n, M)`, boundaries `(B, n)`), `byte_mask` `(B, n)` bool or None, and the
        segment outputs `(B, 1+S, D)` fp32."""
        self.seen_bytes = input_ids.shape[1]
        self.byte_mask = byte_mask
        self.record = dict(zip(self.RECORD, (input_ids, byte_states, byte_memory, boundaries.detach().float())))
        self.record_length = input_ids.shape[1]
        self.segment_outputs = segment_outputs.detach()
        self.segment_slots = segment_outputs.shape[1]
        self.restore()
        if not self.is_compileable:  # room to grow into: decode steps write the segment buffers in place
            self.reserve_segment_slots(2 * self.segment_slots)

    def reserve_segment_slots(self, slots: int) -> None:
        """Move the recurrent layers' keys, values and Engram conv inputs and the segment outputs into new buffers of
        `slots` segment slots (zeros past the filled ones): the cache's own, which decode steps write in place."""
        for loop in self.recurrent:
            for layer in loop:
                layer.key_buffer = fixed_size(layer.key_buffer, 2, slots)
                layer.value_buffer = fixed_size(layer.value_buffer, 2, slots)
                if layer.conv_buffer is not None:
                    layer.conv_buffer = fixed_size(layer.conv_buffer, 1, slots)
        self.segment_outputs = fixed_size(self.segment_outputs, 1, slots)

    def append(self, input_ids, byte_state, memory, boundary) -> None:
        """Record one decoded byte per row: ids `(B, 1)`, prelude output `(B, 1, D)`, memory
        `(B, M)`, boundary `(B, 1)`."""
        n = self.record_length
        for name, column in zip(self.RECORD, (input_ids, byte_state, memory[:, None], boundary.detach())):
            buffer = self.record[name]
            if buffer.shape[1] == n:  # full: double the capacity
                buffer = self.record[name] = torch.cat([buffer, buffer.new_empty(buffer[:, : max(n, 16)].shape)], 1)
            buffer[:, n : n + 1] = column
        self.record_length = n + 1

    def restore(self) -> None:
        """Recompute segment counts and outputs, open-segment sums and positions from the record."""
        byte_mask = self.byte_mask
        if byte_mask is None:
            byte_mask = torch.ones_like(self.input_ids, dtype=torch.bool)
        self.byte_positions = byte_mask.long().sum(-1)
        self.num_segments = self.boundaries.sum(-1).long()
        index = self.num_segments[:, None, None].expand(-1, 1, self.segment_outputs.shape[-1])
        self.last_segment_output = self.segment_outputs.gather(1, index)[:, 0]
        open_bytes = ((self.boundaries.cumsum(1) - self.boundaries).long() == self.num_segments[:, None]) & byte_mask
        weight = open_bytes[..., None].to(torch.float32)
        self.open_sum = (self.byte_states.to(torch.float32) * weight).cumsum(1)[:, -1]
        self.open_memory_sum = (self.byte_memory.to(torch.float32) * weight).cumsum(1)[:, -1]
        self.open_count = open_bytes.to(torch.float32).sum(-1)

    def begin_segment_step(self) -> torch.LongTensor:
        """Point every row at its next segment's slot (slot 0 is the null segment); `(B,)` int64."""
        self.segment_write_index = self.num_segments + 1
        self.segment_slots = max(self.segment_slots, int(self.segment_write_index.max()) + 1)
        return self.segment_write_index

    def end_segment_step(self, closing: torch.Tensor, h_out: torch.Tensor) -> None:
        """Rows `closing` `(B,)` bool closed a segment whose recurrent output is `h_out`
        `(B, 1, D)` fp32."""
        self.segment_outputs = write_segment_slots(self, self.segment_outputs, h_out, dim=1)
        self.last_segment_output.copy_(torch.where(closing[:, None], h_out[:, 0], self.last_segment_output))
        self.num_segments.add_(closing.long())

    def advance(self) -> None:
        """After a decode step: the next byte's RoPE positions and the bytes seen."""
        self.byte_positions.add_(1)
        self.seen_bytes += 1


class SpiderStaticCache(SpiderCache):
    """:class:`SpiderCache` in buffers of fixed size (``generate(cache_implementation="static")``): after the prefill
    (which fills it as :class:`SpiderCache` does) every tensor is moved into a buffer sized for `max_cache_len` bytes
    (the per-byte record, the byte mask; the byte layers' keys and values hold the last ``config.sliding_window``
    bytes where the window is shorter, :attr:`byte_key_slots`) and `max_cache_len + 1` segment slots (a byte can
    close a segment at every step; slot 0 is the null segment), and each decode step writes in place at the tensor
    ``position``. A decode step then has the same shapes at every byte, so its regions compile once
    (:meth:`SpiderDecodingMixin.compile_decode`) and, on CUDA, replay as CUDA graphs; its greedy ids equal
    :class:`SpiderCache`'s (the attention reads the same keys, beside masked ones that add exact zeros; a byte layer's
    softmax over its window's slots rounds in another order, so logits may differ in the last bits). Not croppable.

    Raises:
        ValueError: (at the prefill) a prompt longer than `max_cache_len`.
    """

    def __init__(self, config: SpiderConfig, n_loops: int, max_cache_len: int):
        super().__init__(config, n_loops)
        self.max_cache_len = max_cache_len
        self.position = None  # (1,) int64: the column the next byte is written at
        self.compiled_calls = {}  # compiled decode region -> how it runs on these buffers (call_compiled)

    @property
    def is_compileable(self) -> bool:
        return True

    def reset(self) -> None:
        self.__init__(self.config, self.n_loops, self.max_cache_len)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("SpiderStaticCache cannot be cropped (assisted decoding): use the dynamic SpiderCache")

    def start(self, input_ids, byte_states, byte_memory, boundaries, byte_mask, segment_outputs) -> None:
        """As :meth:`SpiderCache.start`, then every tensor moved into its fixed-size buffer."""
        super().start(input_ids, byte_states, byte_memory, boundaries, byte_mask, segment_outputs)
        N, T = self.max_cache_len, self.seen_bytes
        if T > N:
            raise ValueError(f"the prompt has {T} bytes, more than the static cache's max_cache_len={N}")
        for layers in (self.prelude, self.coda):
            layers[:] = [
                SpiderStaticByteLayer(self, self._byte_slots(layer.keys, T), self._byte_slots(layer.values, T))
                for layer in layers
            ]
        self.layers[: len(self.prelude)] = self.prelude
        self.layers[len(self.layers) - len(self.coda) :] = self.coda
        self.segment_slots = N + 1
        self.reserve_segment_slots(N + 1)
        self.record = {name: fixed_size(t, 1, N) for name, t in self.record.items()}
        mask = self.byte_mask if self.byte_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        self.byte_mask = fixed_size(mask, 1, N, fill=True)  # the columns to come are real bytes
        self.position = torch.tensor([T], device=input_ids.device)
        self.segment_write_index = torch.zeros_like(self.num_segments)
        for buffer in self.buffers().values():  # as transformers' StaticCache: CUDA graphs may keep the addresses
            torch._dynamo.mark_static_address(buffer)

    @property
    def byte_key_slots(self) -> int:
        """Key slots of a byte layer: ``config.sliding_window`` where it is shorter than `max_cache_len` (older
        bytes are never attended to again), else `max_cache_len`."""
        window = self.config.sliding_window
        return self.max_cache_len if window is None else min(window, self.max_cache_len)

    def _byte_slots(self, states: torch.Tensor, length: int) -> torch.Tensor:
        """A byte layer's prefilled `states` `(B, H, length, d)` in a buffer of :attr:`byte_key_slots` columns, the
        byte at column `c` in slot ``c % byte_key_slots`` (the last ones kept); the other slots zero."""
        slots = self.byte_key_slots
        buffer = states.new_zeros(*states.shape[:2], slots, states.shape[3])
        columns = torch.arange(max(0, length - slots), length, device=states.device)
        buffer[:, :, columns % slots] = states[:, :, columns]
        return buffer

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode step reads or writes in place, by name (after the prefill)."""
        byte_layers = enumerate(self.prelude + self.coda)
        tensors = {f"byte{i}.{kv}": getattr(layer, kv) for i, layer in byte_layers for kv in ("keys", "values")}
        for t, loop in enumerate(self.recurrent):
            for i, layer in enumerate(loop):
                for name in ("keys", "values", "conv_inputs"):
                    tensors[f"loop{t}.layer{i}.{name}"] = getattr(layer, name)
        tensors.update({f"record.{name}": t for name, t in self.record.items()})
        for name in (*self.ROW_STATE, "position", "segment_write_index"):
            tensors[name] = getattr(self, name)
        return {name: t for name, t in tensors.items() if t is not None}

    def write_row(self, row: int, source: SpiderStaticCache) -> None:
        """Put the one row of `source` (a cache of the same config, `n_loops` and `max_cache_len` after a prefill of
        its own, ``position`` P) into row `row`, in place, its bytes at the P columns before ``position``; the columns
        before them are masked. What the row held before is gone (a finished request's row taking a new one: the
        compiled decode step keeps its buffers and shapes). Between two decode steps; reads ``position`` on the host.

        Raises:
            ValueError: `source` of another shape, batch size or `n_loops`; its prompt longer than the columns
                decoded so far (``position``); `row` outside the batch.
        """
        shift = int(self.position) - int(source.position)
        batch = self.num_segments.shape[0]
        if (source.n_loops, source.max_cache_len, source.num_segments.shape[0]) != (
            self.n_loops,
            self.max_cache_len,
            1,
        ):
            raise ValueError(
                f"write_row needs a one-row cache with n_loops={self.n_loops}, max_cache_len={self.max_cache_len}; "
                f"got {source.num_segments.shape[0]} rows, n_loops={source.n_loops}, "
                f"max_cache_len={source.max_cache_len}"
            )
        if shift < 0 or not 0 <= row < batch:
            raise ValueError(
                f"write_row: a {int(source.position)}-byte prompt into row {row} of {batch} needs at most "
                f"{int(self.position)} bytes (the columns decoded so far) and a row in [0, {batch})"
            )
        theirs = source.buffers()
        for name, mine in self.buffers().items():
            if name == "position":
                continue
            if name.startswith("record.") or name == "byte_mask":  # columns: shifted (wrapped ones are masked)
                mine[row].copy_(theirs[name][0].roll(shift, 0))
            elif name.startswith("byte") and name.endswith((".keys", ".values")):  # slot c % slots holds column c
                mine[row].copy_(theirs[name][0].roll(shift, 1))
            else:
                mine[row].copy_(theirs[name][0])
        self.byte_mask[row, :shift] = False

    def append(self, input_ids, byte_state, memory, boundary) -> None:
        """Write one decoded byte per row at column ``position`` (`record_length` moves in :meth:`advance`)."""
        for name, column in zip(self.RECORD, (input_ids, byte_state, memory[:, None], boundary.detach())):
            self.record[name].index_copy_(1, self.position, column.to(self.record[name].dtype))

    def advance(self) -> None:
        """After a decode step: the next byte's column and positions."""
        super().advance()
        self.record_length += 1
        self.position.add_(1)

    def begin_segment_step(self) -> torch.LongTensor:
        """Point every row at its next segment's slot, in place (no host read); `(B,)` int64."""
        return self.segment_write_index.copy_(self.num_segments + 1)

    def batch_select_indices(self, indices: torch.LongTensor) -> None:
        super().batch_select_indices(indices)
        self.segment_write_index = self.segment_write_index.index_select(0, indices)
        self.compiled_calls.clear()


class SpiderDecodingMixin:
    """``SpiderModel``'s cache (:meth:`prefill_cache`: the one a full forward fills) and its cached
    decode step, the full forward's modules one byte at a time. A byte runs the prelude, joins its
    row's open segment and the coda; where it closes the segment, the recurrent block runs over
    that one segment at the row's next slot (every row runs it, the others keep their last
    output)."""

    def prefill_cache(self, cache: SpiderCache | None, use_cache: bool | None, n_loops: int) -> SpiderCache | None:
        """`cache` (empty), a new one when `use_cache` (default `config.use_cache` in eval mode),
        or None; none under activation checkpointing in training."""
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and self.gradient_checkpointing and self.training:
            logger.warning_once(
                "use_cache=True is incompatible with activation checkpointing in training; no cache built"
            )
            use_cache = False
        if cache is None and use_cache:
            cache = SpiderCache(self.config, n_loops)
        return cache

    @torch.no_grad()
    def decode(self, input_ids: torch.LongTensor, cache: SpiderCache, output_hidden_states: bool = False) -> dict:
        """Continue from `cache` with new bytes `input_ids` `(B, T)` (all real), one at a time.
        Returns the fields of a ``SpiderModelOutput``: `last_hidden_state` `(B, T, D)`,
        `boundaries` fp32 `(B, T)`, the cache and, with `output_hidden_states`, the new bytes'
        `hidden_states` in the full forward's layout; no loss terms."""
        states, boundaries, per_byte = zip(
            *(
                self.decode_byte(input_ids[:, j : j + 1], cache, output_hidden_states)
                for j in range(input_ids.shape[1])
            )
        )
        hidden_states = tuple(torch.cat(layer, 1) for layer in zip(*per_byte)) if output_hidden_states else None
        return dict(
            last_hidden_state=torch.cat(states, 1),
            cache=cache,
            boundaries=torch.cat(boundaries, 1),
            hidden_states=hidden_states,
        )

    def decode_byte(
        self, input_ids: torch.LongTensor, cache: SpiderCache, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One new byte per row, `input_ids` `(B, 1)` -> `(byte state (B, 1, D), boundary (B, 1)
        fp32, hidden states in the full forward's layout or None)`. Three regions with a host read
        between them (does any row close a segment?); with a :class:`SpiderStaticCache` each has
        fixed shapes, and runs compiled after :meth:`compile_decode`."""
        if cache.is_compileable and cache.seen_bytes >= cache.max_cache_len:
            raise ValueError(
                f"the static cache is full: max_cache_len={cache.max_cache_len} bytes (prompt included); "
                "build it with a larger max_cache_len (generate: max_length)"
            )
        hidden = [] if output_hidden_states else None
        compiled = getattr(self, "compiled_decode", None) if cache.is_compileable and hidden is None else None
        if compiled:
            compiled = tuple(functools.partial(call_compiled, region, cache) for region in compiled)
        byte_in, segment, byte_out = compiled or (self.decode_byte_in, self.decode_segment, self.decode_byte_out)
        input_ids = input_ids.clone(memory_format=torch.contiguous_format)  # a column of the ids: strides vary
        x, boundary, closing, e, segment_memory, byte_rope, byte_attention_mask = byte_in(input_ids, cache, hidden)
        if bool(closing.any()):  # every row runs the block; the others keep their last output
            segment(e, segment_memory, closing, cache)
        y = byte_out(x, byte_rope, byte_attention_mask, cache, hidden)
        cache.advance()
        return y, boundary, tuple(hidden) if output_hidden_states else None

    def decode_byte_in(self, input_ids: torch.LongTensor, cache: SpiderCache, hidden: list | None):
        """The new bytes `input_ids` `(B, 1)` through the prelude, Engram lookup and pooling, recorded in `cache`.
        Returns `(prelude output (B, 1, D), boundary (B, 1) fp32, closing (B,) bool, segment (B, 1, D), segment
        memory (B, 1, M), byte RoPE, byte attention mask)`."""
        x = self.embed_tokens(input_ids)
        if cache.is_compileable:
            byte_attention_mask = self.attention_mask(
                x, cache.byte_key_slots, mask_function=static_byte_mask_function(cache, self.config.sliding_window)
            )
        else:
            if cache.byte_mask is not None:
                cache.byte_mask = torch.cat([cache.byte_mask, cache.byte_mask.new_ones(x.shape[0], 1)], dim=1)
            byte_attention_mask = self.attention_mask(
                x, cache.seen_bytes + 1, cache.byte_mask, self.config.sliding_window, q_offset=cache.seen_bytes
            )
        byte_rope = self.rotary_emb(x, cache.byte_positions[:, None])
        x = self.prelude(x, byte_rope, byte_attention_mask, cache, hidden)
        memory = engram_step(self.engram_embeddings, cache, input_ids)
        boundary, closing, e, segment_memory = pool_step(self.flexitokens, x, memory, cache)
        cache.append(input_ids, x, memory, boundary)
        return x, boundary, closing, e, segment_memory, byte_rope, byte_attention_mask

    def decode_byte_out(self, x, byte_rope, byte_attention_mask, cache: SpiderCache, hidden: list | None):
        """The coda over the prelude output `x` `(B, 1, D)` mixed with its row's last closed segment; `(B, 1, D)`."""
        return self.coda(expand_step(self.flexitokens, cache, x), byte_rope, byte_attention_mask, cache, hidden)

    def compile_decode(self, **compile_kwargs) -> None:
        """Compile the three regions of a :class:`SpiderStaticCache` decode step (:meth:`decode_byte`), each traced
        whole with fixed shapes (``fullgraph=True, dynamic=False``); `compile_kwargs` (``backend``, ``mode``,
        ``options``: a ``CompileConfig``'s) go to ``torch.compile``. From then on every decode step over a
        :class:`SpiderStaticCache` runs them (one without ``output_hidden_states``; ``del model.compiled_decode``
        returns to eager); under ACT early exit halted segments' MoE output is masked there, not skipped by index
        (``SpiderRecurrentBlock``), so the shapes stay fixed. Experts run by ``"grouped_mm"`` (the
        default) switch to :data:`DECODE_EXPERTS_IMPLEMENTATION`, which differs from it only inside a compiled decode
        step."""
        compile_kwargs = {**compile_kwargs, "fullgraph": True, "dynamic": False}
        if self.config._experts_implementation == "grouped_mm":  # the same outside the compiled regions
            self.config._experts_implementation = DECODE_EXPERTS_IMPLEMENTATION
        self.compiled_decode = tuple(
            torch.compile(region, **compile_kwargs)
            for region in (self.decode_byte_in, self.decode_segment, self.decode_byte_out)
        )

    def decode_segment(
        self, e: torch.Tensor, segment_memory: torch.Tensor, closing: torch.Tensor, cache: SpiderCache
    ) -> None:
        """The recurrent block over one new segment per row, `e` `(B, 1, D)` and its memory
        `(B, 1, M)`, at each row's next slot; rows `closing` `(B,)` bool keep its output."""
        slot = cache.begin_segment_step()
        segment_rope = self.rotary_emb(e, slot[:, None])
        slots = torch.arange(cache.segment_slots, device=e.device).expand(e.shape[0], -1)
        mask_function = segment_slot_mask_function(slot[:, None], slots, self.config.recurrent_sliding_window)
        mask = self.attention_mask(e, cache.segment_slots, mask_function=mask_function)
        h_out = self.recurrent_block(e, segment_rope, mask, None, segment_memory, cache.n_loops, cache).h_out
        cache.end_segment_step(closing, h_out)


#: The experts implementation :meth:`SpiderDecodingMixin.compile_decode` selects: transformers' ``"grouped_mm"``
#: except in a compiled no-grad call of a few tokens with weights other than bf16 (:func:`decode_experts_forward`).
DECODE_EXPERTS_IMPLEMENTATION = "grouped_mm_gathered_decode"
#: Most tokens for which :func:`decode_experts_forward` reads each token's experts in place: on the 2-core CPU, one
#: compiled fp32 `small` experts call took 119 against 386 us at 1 token, 830 against 928 at 16, 1,280 against 1,060
#: at 32 (docs/research_log.md).
DECODE_EXPERTS_MAX_TOKENS = 16


def decode_experts_forward(
    experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``SpiderExperts`` on `hidden_states` `(T, D)`, int64 `top_k_index` `(T, k)`, `top_k_weights` `(T, k)` ->
    `(T, D)`, as transformers' ``grouped_mm`` computes it. Inside a compiled decode step (``torch.compile``, no grad,
    at most :data:`DECODE_EXPERTS_MAX_TOKENS` tokens, weights other than bf16) each token's `k` experts are read in
    place instead: ``gate_up_proj[top_k_index]`` multiplied and summed, which inductor fuses into one reduction
    without copying a weight, where ``grouped_mm`` would call transformers' per-expert fallback (a custom op, a host
    read of the offsets and a GEMM per expert: ``torch._grouped_mm`` takes only bf16 when traced). The two agree to
    the rounding of their sums."""
    if not (
        torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and hidden_states.shape[0] <= DECODE_EXPERTS_MAX_TOKENS
        and experts.gate_up_proj.dtype != torch.bfloat16
    ):
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden_states, top_k_index, top_k_weights)
    x = hidden_states.to(experts.gate_up_proj.dtype)[:, None, None, :]  # (T, 1, 1, D)
    gated = experts._apply_gate((x * experts.gate_up_proj[top_k_index]).sum(-1))  # (T, k, I)
    out = (gated[:, :, None, :] * experts.down_proj[top_k_index]).sum(-1)  # (T, k, D)
    return (out.float() * top_k_weights[..., None].float()).sum(1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(DECODE_EXPERTS_IMPLEMENTATION, decode_experts_forward)


def call_compiled(region: Callable, cache: SpiderStaticCache, *args):
    """`region` (one of :meth:`SpiderDecodingMixin.compile_decode`'s) on `args`, through dynamo only at its first call
    for `cache` (which compiles it or evaluates its guards): later steps over the same buffers have the same shapes,
    strides and Python state (the write position is a tensor), so they run the entry the first call chose without
    evaluating guards again. On CPU that entry's code is called directly (:func:`compiled_entry`), which skips
    dynamo's frame evaluation as well (a fifth of a compiled `small` byte's time on the 2-core CPU); elsewhere, and
    where torch does not expose its entries, the call goes through dynamo under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``. ``SpiderStaticCache.batch_select_indices`` (new
    buffers) makes the next call go through dynamo again."""
    call = cache.compiled_calls.get(region)
    if call is not None:
        return call(*args)
    outputs = region(*args)
    direct = compiled_entry(region, args) if cache.position.device.type == "cpu" else None
    cache.compiled_calls[region] = direct or functools.partial(call_unguarded, region)
    return outputs


def call_unguarded(region: Callable, *args):
    """`region` on `args` through dynamo, its guards not evaluated (the entry it chose at its last evaluation)."""
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        return region(*args)


def compiled_entry(region: Callable, args: tuple) -> Callable | None:
    """The code dynamo compiled `region` (``torch.compile`` of a bound method, called on `args` once already) into
    for `args`, as a method of the same object: the entry of its code's cache whose guards `args` pass (the entry
    dynamo itself runs for them). None where torch does not expose the cache's entries or none passes."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    method = getattr(region, "__wrapped__", None)
    if not isinstance(method, types.MethodType):
        return None
    function, owner = method.__func__, method.__self__
    code = function.__code__
    f_locals = dict(zip(code.co_varnames[: code.co_argcount], (owner, *args)))
    try:
        entry_code = next(e.code for e in _debug_get_cache_entry_list(code) if e.guard_manager.check(f_locals))
    except (AttributeError, StopIteration):  # another torch's entries, or none for `args`
        return None
    compiled = types.FunctionType(
        entry_code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    return types.MethodType(compiled, owner)


def static_byte_mask_function(cache: SpiderStaticCache, sliding_window: int | None) -> Callable:
    """A byte decode step's mask function over a :class:`SpiderStaticCache`'s ``byte_key_slots`` key slots (slot `s`
    holds the latest column `c <= position` with ``c % byte_key_slots == s``): the query at column ``cache.position``
    sees the real bytes (``cache.byte_mask``) at or before it and, with a `sliding_window`, less than
    `sliding_window` before it (the same keys as :func:`attention_mask_function`)."""
    position, byte_mask, slots = cache.position, cache.byte_mask, cache.byte_key_slots

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        distance = (position - kv_idx).remainder(slots)  # the slot's column is position - distance
        visible = (distance <= position) & byte_mask[batch_idx, (position - distance).clamp(min=0)]
        return visible if sliding_window is None else visible & (distance < sliding_window)

    return inner_mask


def engram_step(engram_embeddings, cache: SpiderCache, input_ids: torch.LongTensor):
    """``SpiderEngramEmbeddings`` for one new byte per row, `input_ids` `(B, 1)`, after the bytes `cache` recorded
    -> `(B, M)`: the full lookup over the last n-gram's context (padding and columns before the first read as
    ``fill_id``)."""
    context = max(engram_embeddings.ngram_sizes) - 1
    if cache.is_compileable:  # fixed shapes: the `context` columns before `position`, gathered
        columns = cache.position + torch.arange(-context, 0, device=input_ids.device)
        past_ids = cache.record["input_ids"].index_select(1, columns.clamp(min=0))
        past_mask = cache.byte_mask.index_select(1, columns.clamp(min=0)) & (columns >= 0)
        past_ids = past_ids.masked_fill(~past_mask, engram_embeddings.fill_id)
    else:
        past_ids = cache.input_ids[:, -context:]
        if cache.byte_mask is not None:  # already one column longer: the new byte's
            past_mask = cache.byte_mask[:, -1 - past_ids.shape[1] : -1]
            past_ids = past_ids.masked_fill(~past_mask, engram_embeddings.fill_id)
    return engram_embeddings(torch.cat([past_ids, input_ids], dim=1))[:, -1]


def pool_step(flexitokens, x: torch.Tensor, memory: torch.Tensor, cache: SpiderCache):
    """``SpiderFlexiTokens`` pooling for one new byte per row, `x` `(B, 1, D)`, `memory` `(B, M)`:
    the byte joins its row's open segment (running fp32 sums in `cache`), which it closes on a
    boundary. Returns `(boundary (B, 1) fp32, closing (B,) bool, segment (B, 1, D) normed,
    segment_memory (B, 1, M))`."""
    boundary, _ = flexitokens.boundary_predictor(x, position_ids=cache.byte_positions[:, None])
    open_sum = cache.open_sum + x[:, 0].to(torch.float32)
    open_memory_sum = cache.open_memory_sum + memory.to(torch.float32)
    open_count = cache.open_count + 1.0
    closing = boundary[:, 0] > 0
    segment = flexitokens.pool_norm((open_sum / open_count[:, None]).to(x.dtype)[:, None])
    segment_memory = (open_memory_sum / open_count[:, None]).to(memory.dtype)[:, None]
    keep = (~closing).to(torch.float32)
    cache.open_sum.copy_(open_sum * keep[:, None])
    cache.open_memory_sum.copy_(open_memory_sum * keep[:, None])
    cache.open_count.copy_(open_count * keep)
    return boundary, closing, segment, segment_memory


def expand_step(flexitokens, cache: SpiderCache, x: torch.Tensor) -> torch.Tensor:
    """The coda's input for a new byte `x` `(B, 1, D)`: its row's last closed segment, mixed in
    as ``SpiderFlexiTokens.expand`` does."""
    return flexitokens.mix(flexitokens.global_stream(cache.last_segment_output[:, None]).to(x.dtype), x)


class SpiderGenerationMixin(GenerationMixin):
    """``generate()`` for ``SpiderForConditionalGeneration``: a :class:`SpiderCache` per call
    and, per step, only the bytes the cache has not seen."""

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """An empty :class:`SpiderCache` for the call's `n_loops`; a caller's cache is used as is.

        Raises:
            ValueError: a `cache_implementation` (Spider has its own cache).
        """
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        implementation = generation_config.cache_implementation
        if implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported: Spider decodes with its own "
                "SpiderCache (per-byte layers plus per-segment recurrent state); use None/'dynamic' or 'static' "
                "(SpiderStaticCache, fixed-size buffers for compiled decoding)"
            )
        n_loops = model_kwargs.get("n_loops") or self.config.n_loops
        if implementation == "static":
            model_kwargs["cache"] = SpiderStaticCache(self.config, n_loops, max_cache_length)
        else:
            model_kwargs["cache"] = SpiderCache(self.config, n_loops)

    def get_compiled_call(self, compile_config) -> Callable:
        """What ``generate()`` calls per step when it compiles (a compileable cache on CUDA, or
        ``CompileConfig._compile_all_devices``): the model uncompiled, its decode step's regions compiled once
        (:meth:`SpiderDecodingMixin.compile_decode`) with `compile_config`'s backend, mode and options. The whole
        forward does not compile as one graph: a host read decides whether the recurrent block runs."""
        compile_config = compile_config or self._default_compile_config()
        options = {"backend": compile_config.backend, "mode": compile_config.mode, "options": compile_config.options}
        if getattr(self, "decode_compile_options", None) != options:
            self.model.compile_decode(**options)
            self.decode_compile_options = options
        return self.__call__

    def prepare_inputs_for_generation(
        self,
        input_ids,
        cache=None,
        attention_mask=None,
        n_loops=None,
        use_cache=None,
        inputs_embeds=None,
        **kwargs,
    ):
        """The bytes `cache` has not seen; other model kwargs pass through to :meth:`forward`.

        Raises:
            ValueError: `inputs_embeds` (the Engram memory hashes the n-grams of `input_ids`).
        """
        if inputs_embeds is not None:
            raise ValueError(
                "generate(inputs_embeds=...) is not supported: Spider reads byte ids (its Engram "
                "memory hashes the n-grams of input_ids); pass input_ids"
            )
        if cache is not None:
            input_ids = input_ids[:, cache.seen_bytes :]
        return {
            **{k: v for k, v in kwargs.items() if v is not None},
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "n_loops": n_loops,
            "cache": cache,
            "use_cache": use_cache,
        }
