"""`--compile`: one graph per layer kind, traced whole, that does not recompile as the segment count changes.

The recurrent block's shapes follow the number of segments the batch closes. `spider_training.compile.compile_model`
compiles each prelude, coda and recurrent layer in place with `fullgraph=True`; layers of one kind share a graph,
and the recurrent layers' segment axis is marked dynamic, so the first step compiles every graph and later steps
reuse them. Dynamo's own `recompiles` log and counters are read; the `eager` backend runs dynamo's tracing and guards
(what decides a recompile) without generating code, so most tests take seconds.
"""

import logging

import pytest
import torch
from transformers import TrainerCallback

import train_hf

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
            spider.flexitokens.register_forward_hook(
                torch.compiler.disable(lambda module, a, out: self.segment_counts.append(int(out[4].sum(1).max())))
            )
            spider.recurrent_block.register_forward_pre_hook(
                torch.compiler.disable(lambda module, a: self.segment_axes.append(a[0].shape[1]))
            )
            self.hooked = True


def _common_run_flags(output_dir) -> list[str]:
    """`train_hf.py --compile` on the tiny preset with dynamo's `eager` backend, mock data, no evaluation or sample."""
    return [
        "--preset",
        "tiny",
        "--data",
        "mock",
        "--compile",
        "--torch_compile_backend",
        "eager",
        "--ckpt_dir",
        str(output_dir),
        "--eval_strategy",
        "no",
        "--sample_bytes",
        "0",
        "--dataloader_num_workers",
        "0",
    ]


def _compile_norm(norm, x) -> dict:
    """An inductor compile of one RMSNorm (forward and backward) after a dynamo reset: inductor's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(norm, backend="inductor", fullgraph=True)(x).sum().backward()
    return dict(counters["inductor"])


class _Messages(logging.Handler):
    """Records every message of the loggers it is added to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """Two `--compile` runs, shared by the recompile test and the warm-start test. The first, 12 steps, starts in an
    empty inductor cache right after an inductor compile of one RMSNorm (`configure_dynamo`'s settings, which change
    the graphs and so the cache keys, set first, as in the run), with dynamo's recompile log recorded per step, and
    writes a checkpoint at its last step (which carries the compiled artifacts). The second resumes that checkpoint
    in another empty cache (a new machine's: only the checkpoint's artifacts can serve a compile), for one step more,
    and the RMSNorm is compiled again after it."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import fresh_cache

    from spider_training.compile import configure_dynamo
    from tests.helpers import tiny_model

    # Inductor probes the CPU's vector instruction sets once per process, building a small library per set into its
    # cache folder: here in its default folder, where those builds stay from run to run, not in the empty folder
    # below (where they took 10-17 s of compiler runs every time).
    pick_vec_isa()
    configure_dynamo()
    norm = tiny_model(seed=0).model.norm
    x = torch.randn(2, 8, norm.weight.shape[0], requires_grad=True)
    folder = tmp_path_factory.mktemp("compiled_run")
    log = _RecompileLog()
    callback = _StepAndShapes(log)
    dynamo_logger = logging.getLogger("torch._dynamo")
    trainer_messages = _Messages()
    trainer_logger = logging.getLogger("spider_training.trainer")
    try:
        with fresh_cache():  # an empty cache folder of its own
            torch.compiler.reset()  # nothing recorded from earlier tests
            cold = _compile_norm(norm, x)
            torch._dynamo.reset()
            counters.clear()
            torch._logging.set_logs(recompiles=True)
            dynamo_logger.addHandler(log)
            try:
                summary = train_hf.main(
                    [*_common_run_flags(folder / "run"), "--max_steps", str(STEPS), "--save_steps", str(STEPS)],
                    callbacks=[callback],
                )
                graphs = counters["stats"]["unique_graphs"]
            finally:
                dynamo_logger.removeHandler(log)
                torch._logging.set_logs()
        checkpoint = folder / "run" / f"checkpoint-{STEPS}"
        level = trainer_logger.level
        with fresh_cache():
            trainer_logger.addHandler(trainer_messages)
            trainer_logger.setLevel(logging.INFO)
            try:
                resumed = train_hf.main(
                    [
                        *_common_run_flags(folder / "resumed"),
                        "--max_steps",
                        str(STEPS + 1),
                        "--resume",
                        str(checkpoint),
                    ]
                )
            finally:
                trainer_logger.removeHandler(trainer_messages)
                trainer_logger.setLevel(level)
            warm = _compile_norm(norm, x)
    finally:
        torch._dynamo.reset()
    return SimpleNamespace(
        checkpoint=checkpoint,
        cold=cold,
        summary=summary,
        graphs=graphs,
        log=log,
        callback=callback,
        resumed=resumed,
        resumed_messages=trainer_messages.messages,
        warm=warm,
    )


@pytest.mark.slow
def test_compiled_training_compiles_only_in_its_first_step(compiled_run):
    """`train_hf.py --compile` on the tiny preset: 12 steps whose segment counts differ; the first step compiles the
    3 graphs (the byte layers, the recurrent layers, the recurrent layer with Engram, each kind a compiled function of
    its own) and nothing recompiles, then or later."""
    summary, log, callback, graphs = compiled_run.summary, compiled_run.log, compiled_run.callback, compiled_run.graphs
    assert summary["steps"] == STEPS
    axes, counts = callback.segment_axes, callback.segment_counts
    assert len(axes) == len(counts) == STEPS and all(axis % 16 == 0 for axis in axes)  # padded to multiples of 16
    assert len(set(axes)) > 1, axes  # the recurrent layers' input shape does change from step to step
    assert not log.events, f"recompiles (segments {counts}, axes {axes}): {log.events}"
    assert graphs == 3, graphs  # every recompile would be a graph more


class _RecompileReasons(logging.Handler):
    """Records every "Recompiling function ..." message whole (the guard failures that caused it follow the name)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.messages.append(message)


def test_layers_compile_one_graph_per_kind_for_every_segment_count():
    """`compile_model` marks the recurrent layers' segment axis dynamic, so over 8 padded segment counts (a padded
    row among them: the MoE's row weights are inputs too) the recurrent layers compile two graphs, with and without
    Engram, and nothing recompiles. The model's own Python branches (the first loop's aliasing of state and input,
    the halting step's first loop) run eagerly between the layers and add none."""
    from torch._dynamo.utils import counters

    from spider_training.compile import compile_model
    from tests.helpers import tiny_model

    log = _RecompileReasons()
    dynamo_logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    dynamo_logger.addHandler(log)
    try:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model(seed=0).train()
        block = compile_model(model, backend="eager").model.recurrent_block
        config, B = model.config, 2
        memory_size = next(m for m in model.modules() if type(m).__name__ == "SpiderEngram").key_proj.in_features
        for S in (16, 32, 48, 64, 80, 96, 112, 128):
            segments = torch.randn(B, S, config.hidden_size, requires_grad=True)
            rope = model.model.rotary_emb(segments, torch.arange(S)[None].expand(B, S))
            mask = torch.ones(B, S, dtype=torch.bool)
            mask[1, S // 2 :] = False  # a padded row
            out = block(segments, rope, None, None, torch.randn(B, S, memory_size), config.n_loops, segment_mask=mask)
            out[0].sum().backward()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        dynamo_logger.removeHandler(log)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert not log.messages, log.messages
    assert graphs == 2, graphs


def test_layers_of_a_kind_share_one_graph_as_the_trainer_runs_them():
    """Four recurrent layers (Engram in one), bf16 autocast and the trainer's autocast experts
    (`spider_training.mixed_precision.autocast_experts`): still one graph per kind, 3 in all. The experts' forward is
    one class's, not one per module: a per-module forward (as a `functools.partial` it was) made dynamo guard on its
    identity and compile every recurrent layer apart (the 1b structure: 7 graphs, 5 recompilations)."""
    from torch._dynamo.utils import counters

    from spider_training.compile import compile_model
    from spider_training.mixed_precision import autocast_experts, shared_weight_casts
    from tests.helpers import tiny_model

    model = tiny_model(seed=0, num_recurrent_layers=4, engram_layer_ids=[1]).train()
    assert autocast_experts(model) == 4
    ids = torch.randint(0, 256, (2, 32))
    try:
        torch._dynamo.reset()
        counters.clear()
        compile_model(model, backend="eager")
        with torch.autocast("cpu", dtype=torch.bfloat16), shared_weight_casts():
            loss = model(ids, labels=ids).loss
        loss.backward()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 3, graphs
    assert all(p.grad is not None for p in model.model.recurrent_block.layers[3].mlp.experts.parameters())


def test_compiled_layers_keep_their_names_and_run_eagerly_without_gradients():
    """The layers are compiled in place: the same modules, `state_dict` keys and outputs; a forward without gradients
    (evaluation, generation) runs them eagerly and compiles nothing; `del layer.forward` undoes it."""
    from torch._dynamo.utils import counters

    from spider_training.compile import compile_model
    from tests.helpers import tiny_model

    model, reference = tiny_model(seed=0).eval(), tiny_model(seed=0).eval()
    keys = list(model.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    try:
        torch._dynamo.reset()
        counters.clear()
        assert compile_model(model, backend="eager") is model
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
        graphs = counters["stats"]["unique_graphs"]
        loss = model(ids, labels=ids, use_cache=False).loss  # with gradients and no cache: compiled
        compiled_graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(logits, reference(ids).logits)
        assert torch.equal(generated, reference.generate(ids[:1, :8], max_new_tokens=4, do_sample=False))
    assert graphs == 0 and compiled_graphs == 3
    reference_loss = reference(ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss, reference_loss, rtol=float_eps_tolerance(loss), atol=0)
    for layer in model.model.prelude_layers:
        del layer.forward
        assert layer.forward.__func__ is type(layer).forward


GRAPH_CALLS = []


def counting_backend(graph_module, example_inputs):
    """A dynamo backend that runs the captured graph as it is and counts its calls (module-level: a compiled model
    names its backend when pickled)."""

    def run(*args):
        GRAPH_CALLS.append(1)
        return graph_module(*args)

    return run


def test_a_compiled_model_pickles_and_its_copy_trains_compiled(tmp_path):
    """`torch.save(model)` of a compiled model (and `copy.deepcopy`) keeps it compiled: the copy's layers name their
    kind, backend and options, not the process's compiled functions; its training forward runs the captured graphs
    (one call per layer call), with the original's loss, and compiles no new graph."""
    import copy

    from torch._dynamo.utils import counters

    from spider_training.compile import compile_model
    from tests.helpers import tiny_model

    ids = torch.randint(0, 256, (2, 24))
    try:
        torch._dynamo.reset()
        model = compile_model(tiny_model(seed=0).train(), backend=counting_backend)
        loss = model(ids, labels=ids).loss
        counters.clear()
        torch.save(model, tmp_path / "model.pt")
        copies = [torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)]
        GRAPH_CALLS.clear()
        losses = [c(ids, labels=ids).loss for c in copies]
        graph_calls, new_graphs = len(GRAPH_CALLS), counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    for c, copied_loss in zip(copies, losses):
        layer = c.model.recurrent_block.layers[0]
        assert layer.forward.args[-1] is layer  # the copy's own layer
        torch.testing.assert_close(copied_loss, loss, rtol=float_eps_tolerance(loss), atol=0)
    layer_calls = (
        len(model.model.prelude_layers)
        + len(model.model.coda_layers)
        + (model.config.num_recurrent_layers * model.config.n_loops)
    )
    assert graph_calls == 2 * layer_calls, (graph_calls, layer_calls)
    assert new_graphs == 0, new_graphs


def float_eps_tolerance(value: torch.Tensor) -> float:
    """A relative tolerance for a loss the eager backend computes with the same ops in the same order, allowing
    dynamo's decompositions a few roundings: 64 ulps of the dtype."""
    return 64 * torch.finfo(value.dtype).eps


@pytest.mark.slow
def test_engram_layer_compiles_once_for_every_segment_count_with_inductor():
    """The `eager` backend above runs dynamo's guards only; inductor's lowerings can add guards of their own, and one
    did: its convolution-backward lowering fixed the segment axis of Engram's ShortConv input, so the recurrent layer
    holding Engram recompiled at every new segment count. With the ShortConv as a sum over unfolded windows
    (`modeling_spider.SpiderShortConv`) and the segment axis marked dynamic (`compile_model`), one inductor graph
    (forward and backward) serves three segment counts."""
    from torch._dynamo.utils import counters

    from modeling_spider import RowWeights
    from spider_training.compile import compile_model
    from tests.helpers import tiny_model

    model = tiny_model(seed=0).train()
    config = model.config
    torch._dynamo.reset()
    counters.clear()
    try:
        layer = compile_model(model).model.recurrent_block.layers[config.engram_layer_ids[0]]
        memory_size = layer.engram.key_proj.in_features
        B = 2
        for S in (16, 32, 48):
            # the inputs as SpiderRecurrentBlock hands them over, with a padded row
            hidden = torch.randn(B, S, config.hidden_size, requires_grad=True)
            positions = torch.arange(S)[None].expand(B, S)
            rope = model.model.rotary_emb(hidden, positions)
            mask = torch.ones(B, S, dtype=torch.bool)
            mask[1, S // 2 :] = False
            row_weights = RowWeights.of(mask, config.num_experts_per_tok, config.n_routed_experts)
            memory = torch.randn(B, S, memory_size)
            out = layer(hidden, rope, None, None, memory, row_weights)
            out[0].sum().backward()
            assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
        stats = dict(counters["stats"])
    finally:
        torch._dynamo.reset()
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
                    torch.randn(B, S),
                    torch.randn(B, S, D, requires_grad=True),
                    torch.zeros(B, S, D),
                    state,
                    model.config.act_threshold,
                    False,
                )[0]
                out.sum().backward()
                runs.append(dict(counters["aot_autograd"]))
    finally:  # as the Engram test above: no compiled state left for the next test, also when a compile fails
        torch._dynamo.reset()
    first, second = runs
    assert first.get("autograd_cache_bypass", 0) == 0, first
    assert first.get("autograd_cache_miss") == first.get("autograd_cache_saved") == 2, first
    assert second.get("autograd_cache_hit") == 2 and second.get("autograd_cache_miss", 0) == 0, second


@pytest.mark.slow
def test_compiled_artifacts_travel_with_a_checkpoint_and_warm_a_resumed_run(compiled_run, tmp_path, caplog):
    """The warm start (`spider_training.compile`): a `--compile` run writes what this process compiled
    (`torch.compiler.save_cache_artifacts`) into each checkpoint as `compile_artifacts.bin`, and a run resumed from it
    loads them, so an empty inductor cache then serves the compile from them (a hit, no code generated). The inductor
    compile here is one RMSNorm, standing in for a model's layers (the tiny preset's take a minute on 2 cores); the
    training runs (`compiled_run`) use the `eager` backend, so the artifacts in the checkpoint are that RMSNorm's. A
    file that does not load is skipped with a warning, never an error."""
    from spider_training.compile import COMPILE_ARTIFACTS_NAME, load_compile_artifacts

    assert compiled_run.cold.get("fxgraph_cache_miss", 0) >= 1
    assert (compiled_run.checkpoint / COMPILE_ARTIFACTS_NAME).stat().st_size > 0
    assert compiled_run.resumed["steps"] == STEPS + 1
    assert any("compiled artifacts loaded" in message for message in compiled_run.resumed_messages)
    warm = compiled_run.warm
    assert warm.get("fxgraph_cache_hit", 0) >= 1 and warm.get("fxgraph_cache_miss", 0) == 0, warm
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / COMPILE_ARTIFACTS_NAME).write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING, logger="spider_training.compile"):
        assert load_compile_artifacts(tmp_path / "broken") is False
    assert any("compiling from scratch" in record.getMessage() for record in caplog.records)


def test_a_compile_cache_that_cannot_be_serialised_leaves_the_checkpoint_without_it(tmp_path, monkeypatch, caplog):
    """`save_compile_artifacts` inside a checkpoint save: when torch cannot serialise its caches (a test double for
    `torch.compiler.save_cache_artifacts` raising), the checkpoint goes on without the file and says so; the run
    compiles afresh on resume rather than losing the checkpoint."""
    from spider_training.compile import COMPILE_ARTIFACTS_NAME, save_compile_artifacts

    def failing_save():  # stands in for a torch-internal serialisation failure
        raise RuntimeError("cannot serialise this cache entry")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", failing_save)
    with caplog.at_level(logging.WARNING, logger="spider_training.compile"):
        assert save_compile_artifacts(tmp_path) is None
    assert not (tmp_path / COMPILE_ARTIFACTS_NAME).exists()
    assert any("cannot serialise this cache entry" in record.getMessage() for record in caplog.records)
