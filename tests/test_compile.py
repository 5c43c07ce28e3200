"""`--compile`: regional compilation that does not recompile as the segment count changes from step to step.

The recurrent block's shapes follow the number of segments the batch closes. With the segment axis padded to a
multiple of `pad_segments_to_multiple_of` and every layer compiled as its own region (accelerate's
`compile_regions`, which `SpiderTrainer` asks for), a few distinct shapes and call kinds compile during the first
steps and later steps reuse them. Dynamo's own `recompiles` log is counted; the `eager` backend runs dynamo's
tracing and guards (what decides a recompile) without generating code, so the test takes seconds.
"""

import collections
import logging

import pytest
import torch
from transformers import TrainerCallback

import train_hf

WARMUP_STEPS = 4
STEPS = 12


class _RecompileLog(logging.Handler):
    """Records dynamo's "Recompiling function ..." messages with the training step they happened in."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.step = 0
        self.events = []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.events.append((self.step, message.splitlines()[0]))


class _StepAndShapes(TrainerCallback):
    """Tells the log the current step and records, for every training forward, the most segments a row closed and
    the recurrent block's (padded) segment axis."""

    def __init__(self, log: _RecompileLog):
        self.log = log
        self.segment_counts = []
        self.segment_axes = []
        self.hooked = False

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.log.step = state.global_step + 1
        if not self.hooked:
            # the hooks run inside the compiled regions: kept out of the graphs, they add no recompile of their own
            spider = model.model
            spider.flexitokens.register_forward_hook(torch.compiler.disable(
                lambda module, a, out: self.segment_counts.append(int(out[4].sum(1).max()))))
            spider.recurrent_block.register_forward_pre_hook(torch.compiler.disable(
                lambda module, a: self.segment_axes.append(a[0].shape[1])))
            self.hooked = True


@pytest.mark.slow
def test_compiled_training_stops_recompiling_after_warmup(tmp_path):
    log = _RecompileLog()
    callback = _StepAndShapes(log)
    dynamo_logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    dynamo_logger.addHandler(log)
    try:
        torch._dynamo.reset()
        summary = train_hf.main(
            ["--preset", "tiny", "--data", "mock", "--max_steps", str(STEPS), "--compile",
             "--torch_compile_backend", "eager", "--ckpt_dir", str(tmp_path / "run"), "--save_strategy", "no",
             "--eval_strategy", "no", "--sample_bytes", "0", "--dataloader_num_workers", "0"],
            callbacks=[callback],
        )
    finally:
        dynamo_logger.removeHandler(log)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert summary["steps"] == STEPS
    axes, counts = callback.segment_axes, callback.segment_counts
    assert len(axes) == len(counts) == STEPS and all(axis % 16 == 0 for axis in axes)  # padded to multiples of 16
    assert len(set(counts)) > 1, counts  # the segment count does change from step to step
    by_step = collections.Counter(step for step, _ in log.events)
    late = [event for event in log.events if event[0] > WARMUP_STEPS]
    assert not late, f"recompiles after step {WARMUP_STEPS} (segments {counts}, axes {axes}): {late}"
    assert sum(by_step.values()) > 0  # the log is seen: the first steps do compile the shapes they meet


class _RecompileReasons(logging.Handler):
    """Records every "Recompiling function ..." message whole (the guard failures that caused it follow the name)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.messages.append(message)


def test_regions_compile_once_for_every_segment_count():
    """`--compile` compiles the regions with dynamic shapes (`spider_training.compile.compile_model`), so over 8
    padded segment counts no region recompiles for a size: the only recompiles left are structural (layers with and
    without Engram, the first loop's aliasing of the state and its input, the first loop index, the halting step's
    first loop, whose output sum starts without a gradient). With static first compiles, each new count recompiled
    the layers until dynamo's automatic dynamic shapes caught up, and a layer took 3 versions of the 8 dynamo allows
    a function before it falls back to eager."""
    from spider_training.compile import compile_model
    from tests.helpers import tiny_model

    log = _RecompileReasons()
    dynamo_logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    dynamo_logger.addHandler(log)
    try:
        torch._dynamo.reset()
        model = tiny_model(seed=0).train()
        block = compile_model(model, backend="eager").model.recurrent_block
        config, B = model.config, 2
        memory_size = next(m for m in model.modules() if type(m).__name__ == "SpiderEngram").key_proj.in_features
        for S in (16, 32, 48, 64, 80, 96, 112, 128):
            segments = torch.randn(B, S, config.hidden_size, requires_grad=True)
            rope = model.model.rotary_emb(segments, torch.arange(S)[None].expand(B, S))
            mask = torch.ones(B, S, dtype=torch.bool)
            mask[1, S // 2:] = False  # a padded row: the MoE's row weights are inputs too
            out = block(segments, rope, None, None, torch.randn(B, S, memory_size), config.n_loops, segment_mask=mask)
            out[0].sum().backward()
    finally:
        dynamo_logger.removeHandler(log)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert log.messages  # the log is seen
    sized = [m.splitlines()[0] for m in log.messages if "size mismatch" in m]
    assert not sized, sized
    assert len(log.messages) <= 5, [m.splitlines()[0] for m in log.messages]


@pytest.mark.slow
def test_engram_layer_compiles_once_for_every_segment_count_with_inductor():
    """The `eager` backend above runs dynamo's guards only; inductor's lowerings can add guards of their own, and one
    did: its convolution-backward lowering fixed the segment axis of Engram's ShortConv input, so the recurrent layer
    holding Engram recompiled at every new segment count and, past dynamo's recompile limit of 8, ran eagerly. With the
    ShortConv as a sum over unfolded windows (`modeling_spider.SpiderShortConv`), one inductor graph (forward
    and backward) serves three segment counts."""
    from torch._dynamo.utils import counters

    from modeling_spider import RowWeights
    from spider_training.compile import COMPILE_OPTIONS
    from tests.helpers import tiny_model

    model = tiny_model(seed=0).train()
    config = model.config
    layer = model.model.recurrent_block.layers[config.engram_layer_ids[0]]
    memory_size = layer.engram.key_proj.in_features
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(layer, backend="inductor", **COMPILE_OPTIONS)
        B = 2
        for S in (16, 32, 48):
            # the inputs as SpiderRecurrentBlock hands them over, with a padded row
            hidden = torch.randn(B, S, config.hidden_size, requires_grad=True)
            positions = torch.arange(S)[None].expand(B, S)
            rope = model.model.rotary_emb(hidden, positions)
            mask = torch.ones(B, S, dtype=torch.bool)
            mask[1, S // 2:] = False
            row_weights = RowWeights.of(mask, config.num_experts_per_tok, config.n_routed_experts)
            memory = torch.randn(B, S, memory_size)
            out = compiled(hidden, rope, None, None, memory, row_weights)
            out[0].sum().backward()
            assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
        frames, stats = dict(counters["frames"]), dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    assert frames.get("total") == frames.get("ok") == 1, (frames, stats)
    assert stats.get("unique_graphs") == 1, stats


@pytest.mark.slow
def test_a_second_compile_reuses_aotautograd_cache_without_retracing():
    """`configure_dynamo` makes inductor's on-disk caches serve a later run (tests the settings, not a timing): a
    region that turns autocast off (a bf16 input to SpiderRMSNorm) is saved to AOTAutograd's cache instead of
    bypassing it, and a region with a float argument (ACT's threshold in SpiderHaltingStep) is traced once, not traced
    again after its float is specialised (a discarded first trace shows as a cache miss that saves nothing). After a
    dynamo reset, the same regions load from the cache. Without the settings the first case counts
    `autograd_cache_bypass` and the second an unsaved miss on every run."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from modeling_spider import ACTState
    from spider_training.compile import COMPILE_OPTIONS, configure_dynamo
    from tests.helpers import tiny_model

    configure_dynamo()
    model = tiny_model(seed=0).train()
    norm, halting = model.model.prelude_layers[0].input_layernorm, model.model.recurrent_block.halting_step
    B, S, D = 2, 8, model.config.hidden_size
    runs = []
    try:
        with fresh_cache():  # a private cache folder, removed afterwards
            for _ in range(2):
                torch._dynamo.reset()
                counters.clear()
                x = torch.randn(B, S, D, dtype=torch.bfloat16, requires_grad=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    torch.compile(norm, backend="inductor", **COMPILE_OPTIONS)(x).float().sum().backward()
                state = ACTState(torch.zeros(B, S), torch.zeros(B, S), torch.zeros(B, S))
                out = torch.compile(halting, backend="inductor", **COMPILE_OPTIONS)(
                    torch.randn(B, S), torch.randn(B, S, D, requires_grad=True), torch.zeros(B, S, D), state,
                    model.config.act_threshold, False)[0]
                out.sum().backward()
                runs.append(dict(counters["aot_autograd"]))
    finally:  # as the Engram test above: no compiled state left for the next test, also when a compile fails
        torch._dynamo.reset()
    first, second = runs
    assert first.get("autograd_cache_bypass", 0) == 0, first
    assert first.get("autograd_cache_miss") == first.get("autograd_cache_saved") == 2, first
    assert second.get("autograd_cache_hit") == 2 and second.get("autograd_cache_miss", 0) == 0, second
