"""spider_training.profiling: the host syncs, aten ops and compiled graphs of a step, counted on CPU (the CUDA
warnings' parsing half with a stand-in for the debug mode), and the trainer's ``host_syncs_per_step`` on request."""

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from spider_training.profiling import (
    CudaSyncWarnings,
    HostSyncCounter,
    HostSyncsPerStep,
    eager_aten_ops,
    graphs_compiled,
)
from tests.helpers import cpu_trainer


def test_host_sync_counter_counts_deliberate_syncs():
    x = torch.arange(6.0)
    original_tolist = torch.Tensor.tolist
    with HostSyncCounter() as counter:
        y = (x * 2 + 1).sum()  # no sync
        y.item()  # line A
        x.tolist()  # line B
        x[x > 2]  # boolean index: a nonzero on the device
        torch.nonzero(x)
    assert torch.Tensor.tolist is original_tolist  # the wrapper is gone after the context
    assert counter.counts == {"_local_scalar_dense": 1, "tolist": 1, "index (boolean)": 1, "nonzero": 1}
    assert counter.total == 4 and counter.ops > 4
    assert sum(counter.sources.values()) == 4
    assert all(source.startswith("tests/test_profiling.py:") for source in counter.sources), counter.sources
    x.tolist()  # outside: not counted
    assert counter.counts["tolist"] == 1


def test_graphs_compiled_counts_compilations_and_recompilations():
    torch._dynamo.reset()
    try:
        double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        counts = [graphs_compiled(lambda n=n: double(torch.ones(n)))[1] for n in (3, 3, 4)]
        result, eager = graphs_compiled(lambda: torch.ones(2) * 2)
    finally:
        torch._dynamo.reset()
    assert counts == [1, 0, 1] and eager == 0 and result.tolist() == [2.0, 2.0]


def test_eager_aten_ops_leaves_out_what_compiled_regions_ran():
    """The ops of a compiled function's forward and backward (``aot_eager``: both are compiled regions) are not
    counted; the ops around it are, once each (not their sub-ops), and views are not."""
    from torch.profiler import ProfilerActivity, profile

    def region(x):
        return x.sin().cos() * 3

    compiled = torch.compile(region, backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    torch._dynamo.reset()
    try:
        compiled(x)  # compiles outside the profile
        counts = {}
        for name, fn in (("compiled", compiled), ("eager", region)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                (fn(x) * 2 + 1).t().sum().backward()
            counts[name] = eager_aten_ops(prof.events())
    finally:
        torch._dynamo.reset()
    glue, everything = counts["compiled"]["by_op"], counts["eager"]["by_op"]
    assert "aten::sin" not in glue and "aten::cos" not in glue  # the region's forward and backward
    assert everything["aten::sin"] >= 1 and everything["aten::cos"] >= 1  # cos backward is a sin, and so on
    assert glue["aten::add"] == 1 and glue["aten::sum"] == 1 and "aten::t" not in glue  # around it, no views
    assert counts["compiled"]["count"] < counts["eager"]["count"]


def test_cuda_sync_warnings_counts_the_sync_debug_warnings(monkeypatch):
    """The parsing half of CudaSyncWarnings (the warnings themselves need a GPU): the debug mode is set to "warn"
    inside the context and restored after it; only the synchronisation warnings count, by source line."""
    import warnings

    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with CudaSyncWarnings() as syncs:
        assert modes[-1] == "warn"
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # as TORCH_WARN reaches Python
        warnings.warn("something else")
    assert modes[-1] == "default"
    assert syncs.count == 2 and len(syncs.sources) == 1
    assert next(iter(syncs.sources)).startswith("tests/test_profiling.py:")


def test_host_syncs_per_step_is_the_mean_over_the_steps_since_the_last_read():
    """Counted between ``on_step_begin`` and ``on_step_end`` only; a step left open is closed without being counted,
    and nothing stays patched or on the dispatch-mode stack."""
    callback, x, original_tolist = HostSyncsPerStep(), torch.arange(4.0), torch.Tensor.tolist
    for syncs in (2, 1):
        callback.on_step_begin(None, None, None)
        for _ in range(syncs):
            x.sum().item()
        callback.on_step_end(None, None, None)
        x.sum().item()  # between steps: not counted
    assert callback.read() == {"host_syncs_per_step": 1.5}
    assert callback.read() == {}  # nothing since the previous read
    callback.on_step_begin(None, None, None)
    x.tolist()
    callback.close()  # training stopped mid-step
    assert callback.read() == {}
    assert _get_current_dispatch_mode() is None and torch.Tensor.tolist is original_tolist


def test_a_training_run_logs_host_syncs_per_step_on_request(tmp_path):
    """``log_host_syncs``: every logging step of a tiny run carries ``host_syncs_per_step``; a step of two
    micro-batches syncs more than a step of one (each forward needs its segment count on the host); off by default."""
    per_step = {}
    for accumulation in (1, 2):
        trainer = cpu_trainer(
            tmp_path / str(accumulation),
            max_steps=6,
            logging_steps=2,
            gradient_accumulation_steps=accumulation,
            log_host_syncs=True,
        )
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["step"] for entry in logs] == [2, 4, 6]
        assert all(entry["host_syncs_per_step"] >= accumulation for entry in logs), logs
        per_step[accumulation] = logs[-1]["host_syncs_per_step"]
        assert _get_current_dispatch_mode() is None  # the counter closed with the run
    assert per_step[2] > per_step[1], per_step
    trainer = cpu_trainer(tmp_path / "off", max_steps=2, logging_steps=1)
    trainer.train()
    assert not any("host_syncs_per_step" in entry for entry in trainer.state.log_history)
