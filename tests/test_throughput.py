"""Tests of spider_training.throughput: the FLOPs, TFLOP/s and MFU a training run logs about itself."""

from __future__ import annotations

import math
import types

import pytest
import torch

from spider_training import throughput
from spider_training.throughput import ThroughputMeter, count_flops, peak_flops
from tests.helpers import cpu_trainer, tiny_model


def test_count_flops_counts_matmuls_forward_and_backward_and_grouped_mm():
    M, K, N = 32, 64, 48
    layer = torch.nn.Linear(K, N)
    x = torch.randn(M, K, requires_grad=True)
    counted = count_flops(lambda: layer(x).relu().sum().backward())
    assert counted["total"] == 3 * 2 * M * K * N  # forward, input gradient, weight gradient
    E, rows = 4, 16
    weight = torch.randn(E, K, N)
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * rows
    grouped = count_flops(lambda: torch._grouped_mm(torch.randn(E * rows, K), weight, offs=offsets))
    assert grouped["total"] == 2 * E * rows * K * N  # torch's own counter has no formula for it
    compiled = torch.compile(lambda t: layer(t).relu(), backend="aot_eager")
    compiled(x).sum().backward()
    assert count_flops(lambda: compiled(x).sum().backward())["total"] == 3 * 2 * M * K * N


def test_a_counted_forward_leaves_the_step_exact():
    """What the trainer counts (the first micro-batch's forward under the counter, its backward outside it) computes
    exactly the loss and gradients of the same step uncounted; the counter's dispatch mode around the backward would
    not (it changes backward kernels), which is why the trainer leaves the backward out and triples the forward."""
    model = tiny_model()
    model.train()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))

    def step(counted: bool):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the boundary predictor samples
        forward = lambda: model(input_ids=ids, labels=ids)  # noqa: E731
        out = count_flops(forward)["result"] if counted else forward()
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (loss, grads), (counted_loss, counted_grads) = step(False), step(True)
    assert torch.equal(loss, counted_loss) and grads.keys() == counted_grads.keys()
    assert all(torch.equal(grads[name], counted_grads[name]) for name in grads)


def test_peak_flops_reads_the_data_sheet_on_a_known_gpu_and_measures_elsewhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", torch.bfloat16) == (989e12, "NVIDIA H100 80GB HBM3 data sheet, dense bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert peak_flops("cuda", torch.bfloat16)[0] == 756e12  # the first matching name wins: the PCIe card's own
    monkeypatch.setattr(throughput, "measured_matmul_flops", lambda device, dtype: {"n": 8, "flops_per_s": 5.0})
    assert peak_flops("cpu", torch.float32) == (5.0, "measured 8^3 matmul, float32")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert peak_flops("cuda", torch.bfloat16)[1] == "measured 8^3 matmul, bfloat16"


def test_meter_scales_the_counted_micro_batch_by_the_micro_batches_since_the_last_read(monkeypatch):
    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))  # a test clock
    monkeypatch.setattr(throughput, "peak_flops", lambda device, dtype: (1e12, "test"))
    meter = ThroughputMeter("cpu", torch.float32, micro_batches_per_step=2)  # t = 100
    layer, x = torch.nn.Linear(16, 16), torch.randn(4, 16, requires_grad=True)
    assert meter.count(lambda: layer(x).sum().backward()) is None
    flops = 3 * 2 * 4 * 16 * 16
    for _ in range(4):
        meter.step()
    first = meter.read()  # t = 110: 4 micro-batches in 10 s
    assert first == {
        "flops_per_step": 2.0 * flops,
        "tflops_per_second": float(f"{4 * flops / 10 / 1e12:.4g}"),
        "mfu": float(f"{4 * flops / 10 / 1e12:.4g}"),
    }
    meter.step()
    assert meter.read()["mfu"] == float(f"{flops / 20 / 1e12:.4g}")  # t = 130: 1 micro-batch in 20 s


def test_a_training_run_logs_flops_and_mfu_at_every_logging_step(tmp_path):
    """The issue's target: a 20-step tiny run's logs carry ``mfu`` and ``flops_per_step`` at every logging step,
    and the counted FLOPs are those of one of its micro-batches (forward and backward) times the accumulation."""
    from spider_training.data import build_dataset

    dataset = build_dataset("mock", 32)
    trainer = cpu_trainer(
        tmp_path, train_dataset=dataset, max_steps=20, logging_steps=5, gradient_accumulation_steps=2
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [5, 10, 15, 20]
    per_micro_batch = trainer.throughput.flops_per_micro_batch
    assert per_micro_batch > 0
    assert sum(trainer.throughput.flops_by_op.values()) == per_micro_batch  # bench.mfu's FLOPs by op
    assert any("mm" in op for op in trainer.throughput.flops_by_op)
    for entry in logs:
        assert entry["flops_per_step"] == 2 * per_micro_batch
        assert 0 < entry["mfu"] < 1 and entry["tflops_per_second"] > 0
        assert math.isclose(
            entry["mfu"], entry["tflops_per_second"] * 1e12 / trainer.throughput.peak, rel_tol=2e-3
        )  # both to 4 significant digits
    # an independent count of one micro-batch of the same shape, fresh model: the same matmuls up to the segment
    # count (the recurrent block runs on the segments its boundary predictor closes)
    batch = torch.stack([torch.as_tensor(dataset[i]["input_ids"]) for i in range(2)]).long()
    model = tiny_model()
    model.train()
    fresh = count_flops(lambda: model(input_ids=batch, labels=batch).loss.backward())["total"]
    assert fresh == pytest.approx(per_micro_batch, rel=0.25)
